//! Guard-page buffers for the emulated kernels: an out-of-bounds access becomes a report naming
//! the buffer, not a silent read of a neighbour's memory.
//!
//! Every buffer an emulated kernel gets is a copy placed in its own mapping, flush against an
//! inaccessible guard page at one side ([`Side`]): a kernel that reads or writes one element past
//! that side faults at once. A SIGSEGV handler finds the buffer the fault hit, prints which one
//! and how far outside it the access was, and aborts the process (a kernel cannot be unwound
//! from). The bytes between the buffer and the other guard page are filled with a pattern
//! that [`Fenced::finish`] checks, so that a write there is reported too; the emulation's
//! memory checker reports reads and writes there as they happen.
//!
//! On a GPU, `compute-sanitizer --tool memcheck` (scripts/gpu-check.sh) is the same check.
//!
//! The handler also reports a fault in the guard page below an emulated thread's fiber stack
//! (`Stacks` in kernels/emu/cuda_emu.h): a thread that outgrew its stack, then aborts. It can
//! run there only on an alternate signal stack, which every thread Rust's std starts has; on a
//! thread without one the fault kills the process unexplained (still not a silent overwrite).
//!
//! Every buffer is also registered with the emulation's memory checker (`kernels/emu/race.h`) as
//! global memory, so that a race on it, or an access outside it or outside its
//! [view](Fenced::view), is reported with its name and the byte offset.
//!
//! The same handler also explains a SIGILL: the emulation is compiled with `-fsanitize=bounds`
//! in trap mode, so an array of known size (a kernel's `__shared__` arrays) indexed out of
//! bounds traps with an illegal instruction (`ud2` on x86-64; on aarch64 the trap is `brk`, a
//! SIGTRAP, which crashes the test without this explanation).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

use candle_core::{bail, Result};

/// Which end of a buffer touches its guard page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The last byte is followed by the guard: catches reads and writes past the end.
    End,
    /// The first byte follows the guard: catches accesses before the start.
    Start,
}

impl Side {
    /// Even seeds fence the ends of buffers, odd seeds their starts, so that a test that runs
    /// two schedules (one of each parity) checks both sides.
    pub fn for_seed(seed: u64) -> Self {
        if seed.is_multiple_of(2) {
            Self::End
        } else {
            Self::Start
        }
    }
}

extern "C" {
    // The emulation's race checker (kernels/emu/race.h): fenced buffers are the kernels'
    // global memory, named in its reports.
    fn kd_emu_track_global(
        p: *const u8,
        n: usize,
        map_lo: usize,
        map_hi: usize,
        name: *const u8,
        name_len: usize,
    );
    fn kd_emu_untrack_global(p: *const u8);
    fn kd_emu_set_view(
        p: *const u8,
        heads: u64,
        head_stride: u64,
        rows: u64,
        row_stride: u64,
        row_bytes: u64,
        head_axis: i32,
    ) -> i32;
}

/// Which block index of a launch names the head its block works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadAxis {
    /// `blockIdx.x` (one block per head).
    X,
    /// `blockIdx.y` (blocks of rows × heads).
    Y,
}

/// The pattern written around a buffer inside its mapping.
const SLACK: u8 = 0xA5;

/// A copy of a buffer in its own mapping with guard pages; see the module docs.
pub struct Fenced<T: Copy> {
    map: *mut u8,
    map_len: usize,
    data: *mut T,
    len: usize,
    slot: usize,
    name: &'static str,
}

impl<T: Copy> Fenced<T> {
    /// `len` elements, each `value`, fenced at `side`; the start is aligned to `align` bytes
    /// (at least `T`'s alignment; a larger one leaves up to `align - 1` bytes, checked for
    /// writes, between an `End` buffer and its guard).
    pub fn filled(
        name: &'static str,
        len: usize,
        value: T,
        side: Side,
        align: usize,
    ) -> Result<Self> {
        let mut f = Self::alloc(name, len, side, align)?;
        f.as_mut_slice().fill(value);
        Ok(f)
    }

    /// A fenced copy of `src`.
    pub fn copy_of(name: &'static str, src: &[T], side: Side, align: usize) -> Result<Self> {
        let mut f = Self::alloc(name, src.len(), side, align)?;
        f.as_mut_slice().copy_from_slice(src);
        Ok(f)
    }

    fn alloc(name: &'static str, len: usize, side: Side, align: usize) -> Result<Self> {
        install_handler();
        let align = align.max(std::mem::align_of::<T>()).next_power_of_two();
        let page = page_size();
        let Some(bytes) = len.checked_mul(std::mem::size_of::<T>()) else {
            bail!("fenced buffer `{name}`: {len} elements overflow");
        };
        if align > page {
            bail!("fenced buffer `{name}`: alignment {align} above the page size");
        }
        let data_pages = (bytes + align).div_ceil(page).max(1);
        let map_len = (data_pages + 2) * page;
        // SAFETY: an anonymous private mapping; the result is checked.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            bail!("fenced buffer `{name}`: mmap of {map_len} bytes failed");
        }
        let map = map.cast::<u8>();
        let body = map as usize + page;
        let body_end = body + data_pages * page;
        let data = match side {
            Side::Start => body,
            Side::End => (body_end - bytes) & !(align - 1),
        };
        // SAFETY: the two guard pages lie inside the mapping; the body is filled with the
        // slack pattern before any element is written.
        unsafe {
            let guarded = libc::mprotect(map.cast(), page, libc::PROT_NONE) == 0
                && libc::mprotect((body_end as *mut u8).cast(), page, libc::PROT_NONE) == 0;
            if !guarded {
                libc::munmap(map.cast(), map_len);
                bail!("fenced buffer `{name}`: mprotect failed");
            }
            std::ptr::write_bytes(body as *mut u8, SLACK, data_pages * page);
        }
        let slot = match register(map as usize, map_len, data, bytes, name) {
            Ok(slot) => slot,
            Err(e) => {
                // SAFETY: the mapping made above, not yet shared.
                unsafe { libc::munmap(map.cast(), map_len) };
                return Err(e);
            }
        };
        // SAFETY: the range and name stay valid until `drop` untracks them.
        unsafe {
            kd_emu_track_global(
                data as *const u8,
                bytes,
                map as usize,
                map as usize + map_len,
                name.as_ptr(),
                name.len(),
            )
        };
        Ok(Self {
            map,
            map_len,
            data: data as *mut T,
            len,
            slot,
            name,
        })
    }

    /// Tells the emulation's memory checker what a launch may touch of this buffer: `heads` ×
    /// `rows` × `row_len` elements at element strides `(head_stride, row_stride, 1)`, and each
    /// head's rows only from blocks whose `axis` index is that head. An access elsewhere in the
    /// buffer (row padding, rows past the view, another head's rows) fails the launch. Heads may
    /// hold rows or be interleaved in them. An error if the view does not fit the buffer; when
    /// rows or heads overlap (a zero stride, say) or do not nest, there is no single head and
    /// row per byte to check, and the buffer is left without a view. Empty buffers have
    /// nothing to check.
    pub fn view(
        &self,
        heads: usize,
        head_stride: usize,
        rows: usize,
        row_stride: usize,
        row_len: usize,
        axis: HeadAxis,
    ) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let elem = std::mem::size_of::<T>() as u64;
        let bytes = |x: usize| (x as u64).checked_mul(elem);
        let (Some(hs), Some(rs), Some(rb)) =
            (bytes(head_stride), bytes(row_stride), bytes(row_len))
        else {
            bail!("fenced buffer `{}`: view strides overflow", self.name);
        };
        let axis = match axis {
            HeadAxis::X => 0,
            HeadAxis::Y => 1,
        };
        // SAFETY: `data` is tracked (alloc) until drop; the call only records the view.
        let rc = unsafe {
            kd_emu_set_view(
                self.data as *const u8,
                heads as u64,
                hs,
                rows as u64,
                rs,
                rb,
                axis,
            )
        };
        // 2: overlapping rows or heads, not checked (see above).
        if rc == 1 {
            bail!(
                "fenced buffer `{}` ({} elements): view of {heads} heads × {rows} rows × \
                 {row_len} at strides ({head_stride}, {row_stride}) does not fit",
                self.name,
                self.len
            );
        }
        Ok(())
    }

    pub fn as_ptr(&self) -> *const T {
        self.data
    }

    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.data
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `len` initialised elements at an aligned address inside the mapping.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `self` is borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }

    /// The elements, after checking that nothing was written around them inside the mapping (an
    /// error names the lowest stray byte's offset from the start of the buffer).
    pub fn finish(self) -> Result<Vec<T>> {
        let page = page_size();
        let body = self.map as usize + page;
        let body_len = self.map_len - 2 * page;
        let start = self.data as usize;
        let end = start + std::mem::size_of_val(self.as_slice());
        // SAFETY: the body is readable and initialised (filled at allocation).
        let all = unsafe { std::slice::from_raw_parts(body as *const u8, body_len) };
        let (before, after) = (&all[..start - body], &all[end - body..]);
        let bytes = end - start;
        if let Some(i) = before.iter().position(|&b| b != SLACK) {
            bail!(
                "emulated kernel wrote `{}` ({bytes} bytes) at byte offset -{}: out of bounds",
                self.name,
                before.len() - i
            );
        }
        if let Some(i) = after.iter().position(|&b| b != SLACK) {
            bail!(
                "emulated kernel wrote `{}` ({bytes} bytes) at byte offset {}: out of bounds",
                self.name,
                bytes + i
            );
        }
        Ok(self.as_slice().to_vec())
    }
}

impl<T: Copy> Drop for Fenced<T> {
    fn drop(&mut self) {
        // SAFETY: tracked in `alloc` with this start.
        unsafe { kd_emu_untrack_global(self.data as *const u8) };
        unregister(self.slot);
        // SAFETY: the mapping made in `alloc`, unmapped once.
        unsafe {
            libc::munmap(self.map.cast(), self.map_len);
        }
    }
}

fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    *PAGE.get_or_init(|| unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize)
}

// The live buffers, for the signal handler: a fixed table read with atomics only (no locks, no
// allocation), as a handler must.
const SLOTS: usize = 512;

struct Slot {
    taken: AtomicBool,
    /// Odd while the fields below change: the handler skips a slot whose generation is odd or
    /// changed while it read (a seqlock), so that it never mixes two registrations.
    generation: AtomicUsize,
    /// The mapping's start (0: slot not published), length, the data's start and length, and
    /// the name's pointer and length.
    map: AtomicUsize,
    map_len: AtomicUsize,
    data: AtomicUsize,
    bytes: AtomicUsize,
    name: AtomicUsize,
    name_len: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    taken: AtomicBool::new(false),
    generation: AtomicUsize::new(0),
    map: AtomicUsize::new(0),
    map_len: AtomicUsize::new(0),
    data: AtomicUsize::new(0),
    bytes: AtomicUsize::new(0),
    name: AtomicUsize::new(0),
    name_len: AtomicUsize::new(0),
};
static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];

fn register(map: usize, map_len: usize, data: usize, bytes: usize, name: &str) -> Result<usize> {
    for (i, s) in TABLE.iter().enumerate() {
        if s.taken
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            s.generation.fetch_add(1, Ordering::AcqRel); // odd: changing
            s.map_len.store(map_len, Ordering::Release);
            s.data.store(data, Ordering::Release);
            s.bytes.store(bytes, Ordering::Release);
            s.name.store(name.as_ptr() as usize, Ordering::Release);
            s.name_len.store(name.len(), Ordering::Release);
            s.map.store(map, Ordering::Release);
            s.generation.fetch_add(1, Ordering::AcqRel); // even: published
            return Ok(i);
        }
    }
    bail!("fenced buffer `{name}`: more than {SLOTS} live at once")
}

fn unregister(i: usize) {
    let s = &TABLE[i];
    s.generation.fetch_add(1, Ordering::AcqRel);
    s.map.store(0, Ordering::Release);
    s.generation.fetch_add(1, Ordering::AcqRel);
    s.taken.store(false, Ordering::Release);
}

/// The SIGSEGV and SIGILL actions in place before ours: what is not ours goes back to them.
static PREVIOUS_SEGV: OnceLock<libc::sigaction> = OnceLock::new();
static PREVIOUS_ILL: OnceLock<libc::sigaction> = OnceLock::new();

fn install_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for (sig, previous) in [
            (libc::SIGSEGV, &PREVIOUS_SEGV),
            (libc::SIGILL, &PREVIOUS_ILL),
        ] {
            // SAFETY: sigaction with a zeroed struct filled as documented; the handler only
            // uses async-signal-safe calls (write, sigaction, abort) and atomics.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = on_fault as *const () as usize;
                act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut act.sa_mask);
                if libc::sigaction(sig, std::ptr::null(), &mut old) == 0 {
                    let _ = previous.set(old);
                    libc::sigaction(sig, &act, std::ptr::null_mut());
                }
            }
        }
    });
}

/// Puts back the action in place before ours for `sig`; returning from the handler then
/// re-runs the instruction, which faults again and is handled as it would have been.
fn restore(sig: libc::c_int) {
    let previous = if sig == libc::SIGILL {
        &PREVIOUS_ILL
    } else {
        &PREVIOUS_SEGV
    };
    // SAFETY: restores a sigaction read at installation, or the default.
    unsafe {
        match previous.get() {
            Some(old) => libc::sigaction(sig, old, std::ptr::null_mut()),
            None => libc::signal(sig, libc::SIG_DFL) as libc::c_int,
        };
    }
}

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut c_void) {
    if sig == libc::SIGILL {
        // The emulation is built with -fsanitize=bounds in trap mode: an emulated kernel that
        // indexes an array of known size out of bounds ends here. Say so, then crash as usual.
        let msg = b"keydiff emulation: SIGILL; in an emulated kernel this is the bounds check \
                    (-fsanitize=bounds) trapping: an array of known size (__shared__) indexed \
                    out of bounds\n";
        // SAFETY: write is async-signal-safe.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
        restore(sig);
        return;
    }
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for s in &TABLE {
        let generation = s.generation.load(Ordering::Acquire);
        let map = s.map.load(Ordering::Acquire);
        let map_len = s.map_len.load(Ordering::Acquire);
        let (data, bytes) = (
            s.data.load(Ordering::Acquire),
            s.bytes.load(Ordering::Acquire),
        );
        let (name, name_len) = (
            s.name.load(Ordering::Acquire),
            s.name_len.load(Ordering::Acquire),
        );
        if generation % 2 == 1 || s.generation.load(Ordering::Acquire) != generation {
            continue; // changing under us: not the buffer this thread's kernel is using
        }
        if map == 0 || addr < map || addr >= map + map_len {
            continue;
        }
        // SAFETY: one registration's `&'static str`, read whole (the generation held).
        let name = unsafe { std::slice::from_raw_parts(name as *const u8, name_len) };
        let mut m = Msg::default();
        m.push(b"keydiff emulation: an emulated kernel accessed `");
        m.push(name);
        m.push(b"` (");
        m.num(bytes);
        m.push(b" bytes) at byte offset ");
        if addr < data {
            m.push(b"-");
            m.num(data - addr);
        } else {
            m.num(addr - data);
        }
        m.push(b": out of bounds; aborting\n");
        // SAFETY: write and abort are async-signal-safe.
        unsafe {
            libc::write(2, m.buf.as_ptr().cast(), m.len);
            libc::abort();
        }
    }
    // SAFETY: reads two thread-local words, uninstrumented (kernels/emu/launch.cpp).
    if unsafe { kd_emu_in_fiber_stacks(addr) } != 0 {
        let msg = b"keydiff emulation: an emulated kernel's thread outgrew its fiber stack \
                    (64 KiB) into the guard page below it; aborting\n";
        // SAFETY: write and abort are async-signal-safe.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::abort();
        }
    }
    // Not a fenced buffer, nor a fiber's stack.
    restore(sig);
}

extern "C" {
    /// Whether `addr` lies in the fiber stacks (guard pages included) of the launch this OS
    /// thread is running (kernels/emu/launch.cpp).
    fn kd_emu_in_fiber_stacks(addr: usize) -> libc::c_int;
}

/// A message built without allocating (inside a signal handler).
struct Msg {
    buf: [u8; 512],
    len: usize,
}

impl Default for Msg {
    fn default() -> Self {
        Self {
            buf: [0; 512],
            len: 0,
        }
    }
}

impl Msg {
    fn push(&mut self, s: &[u8]) {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s[..n]);
        self.len += n;
    }

    fn num(&mut self, mut v: usize) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }
}
