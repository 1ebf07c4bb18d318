//! Memory: how much there is to plan with, on the host or a GPU, and sizes as people write them.
//!
//! The engine plans its large allocations (the weights, their CPU copies, the KV cache) against
//! this, so that a model or a cache that cannot fit is refused with the numbers, or made to fit
//! by dropping optional copies, instead of the process being killed by the kernel's OOM killer,
//! aborting in the allocator, or failing a device allocation minutes into a prefill. On the CPU
//! the budget is host memory; on a CUDA device it is the device's free memory.

use std::fmt;
use std::path::Path;

use candle_core::Device;

/// Memory the engine may plan its allocations with: the host's on the CPU, a GPU's on CUDA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryBudget {
    /// Bytes that can be allocated without swapping: `MemAvailable`, or less under a cgroup
    /// limit, or the user's limit.
    pub ram: u64,
    /// Bytes that can be allocated at all: `ram` plus free swap (equal to `ram` under a user
    /// limit). Beyond this the process would be killed.
    pub total: u64,
    /// Where the numbers come from (for messages).
    pub source: String,
}

impl MemoryBudget {
    /// A budget the user set (`--memory-limit`): no detection, no swap.
    pub fn fixed(bytes: u64) -> Self {
        Self {
            ram: bytes,
            total: bytes,
            source: format!("--memory-limit {}", human(bytes)),
        }
    }

    /// What this machine (and the cgroup the process runs in) has available now; `None` where
    /// the system does not say (no `/proc/meminfo`). The heap's free pages are given back
    /// first ([`release_freed_heap`]), so that memory this process freed counts as available.
    pub fn detect() -> Option<Self> {
        release_freed_heap();
        let root = Path::new("/");
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let caps: Vec<(u64, &str)> = [
            (cgroup_headroom(root), "cgroup memory limit"),
            (
                address_space_headroom(root),
                "address-space limit (ulimit -v)",
            ),
        ]
        .into_iter()
        .filter_map(|(room, name)| Some((room?, name)))
        .collect();
        budget_from(&meminfo, &caps)
    }

    /// What `device` has free now: host memory on the CPU (see [`MemoryBudget::detect`]), the
    /// device's free memory on CUDA (after synchronising it, so that buffers freed on its
    /// stream are freed), plus what candle's memory pool holds idle ([`cuda_pool_idle`]).
    /// `None` where it cannot be known (other devices, a failed query, which is logged).
    pub fn detect_on(device: &Device) -> Option<Self> {
        match device {
            Device::Cpu => Self::detect(),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let query = || -> Result<(usize, usize), String> {
                    device.synchronize().map_err(|e| e.to_string())?;
                    let (free, total) = d
                        .cuda_stream()
                        .context()
                        .mem_get_info()
                        .map_err(|e| e.to_string())?;
                    // Memory a pool that keeps what is freed (`prepare_cuda`) holds idle is
                    // this process's to allocate from, though the driver counts it as used.
                    Ok((free + cuda_pool_idle(d)? as usize, total))
                };
                match query() {
                    Ok((free, total)) => {
                        let name = match device.location() {
                            candle_core::DeviceLocation::Cuda { gpu_id } => {
                                format!("cuda:{gpu_id}")
                            }
                            other => format!("{other:?}"),
                        };
                        Some(Self::device_free(&name, free as u64, total as u64))
                    }
                    Err(e) => {
                        tracing::warn!("cannot read the free memory of the GPU ({e}): not planned");
                        None
                    }
                }
            }
            _ => None,
        }
    }

    /// A device's budget from its driver's figures: `free` of `total` bytes (no swap on a
    /// device). `device` names it in messages.
    pub fn device_free(device: &str, free: u64, total: u64) -> Self {
        Self {
            ram: free,
            total: free,
            source: format!("free memory of {device}, {} in all", human(total)),
        }
    }

    /// This budget less `bytes` already taken (saturating).
    pub fn less(&self, bytes: u64) -> Self {
        Self {
            ram: self.ram.saturating_sub(bytes),
            total: self.total.saturating_sub(bytes),
            source: self.source.clone(),
        }
    }
}

impl fmt::Display for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.total > self.ram {
            write!(
                f,
                "{} available ({} with swap; {})",
                human(self.ram),
                human(self.total),
                self.source
            )
        } else {
            write!(f, "{} available ({})", human(self.ram), self.source)
        }
    }
}

/// How [`prepare_cuda`] left a CUDA device's allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaAllocator {
    /// The device's memory pool keeps freed memory across synchronisations.
    pub pool_retains: bool,
    /// cudarc still creates two CUDA events for every allocation.
    pub event_tracking: bool,
}

/// Sets up a CUDA device's allocator for inference, where every step allocates and frees the
/// same temporaries (as PyTorch's caching allocator, or other candle engines, do):
///
/// - The memory pool candle allocates from (`cuMemAllocAsync`, the device's current pool)
///   keeps what is freed across synchronisations: release threshold `u64::MAX`. The driver's
///   default, 0, gives every freed byte back at each synchronisation (a token read back, a
///   timed region), so the next step maps its temporaries afresh.
///   `KEYDIFF_CUDA_POOL_RETAIN=0` keeps the driver's default. [`MemoryBudget::detect_on`]
///   counts what the pool holds idle as free, so plans still count memory freed here. Other
///   allocators (cuBLAS's workspace, module loads) cannot take it; they allocate early, before
///   the first prompt's temporaries fill the pool.
/// - cudarc's event tracking is turned off: with it, every allocation creates two CUDA events
///   (and destroys them when freed) for synchronisation across streams, but candle runs a
///   device's work on CUDA's per-thread stream, where cudarc never waits on them.
///   `KEYDIFF_CUDA_EVENTS=1` keeps them.
///
/// Call it on a freshly opened device, before tensors are made on it (the engine's
/// `parse_device` does). Other devices are left alone (`None`).
pub fn prepare_cuda(device: &Device) -> Result<Option<CudaAllocator>, String> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let retain = env_flag("KEYDIFF_CUDA_POOL_RETAIN", true);
            let events = env_flag("KEYDIFF_CUDA_EVENTS", false);
            if retain {
                if let Some(pool) = cuda_pool(d)? {
                    let mut threshold = u64::MAX;
                    // SAFETY: the pool is the device's; the attribute's value is a u64.
                    unsafe {
                        cuda_result::mem_pool::set_attribute(
                            pool,
                            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                            (&mut threshold as *mut u64).cast(),
                        )
                    }
                    .map_err(|e| format!("cannot set its memory pool's release threshold: {e}"))?;
                }
            }
            if !events {
                // SAFETY: candle runs a device's work on CUDA's per-thread stream, which
                // cudarc does not count as a stream of its own, so it never waits on or records
                // an allocation's events (it does so only once streams are made through it, as
                // nothing here does); allocations made before this call keep theirs, unused.
                unsafe { d.disable_event_tracking() };
            }
            let out = cuda_allocator(device)?;
            tracing::debug!(?out, "CUDA allocator");
            Ok(out)
        }
        _ => Ok(None),
    }
}

/// How a CUDA device's allocator is set ([`prepare_cuda`]); `None` for other devices.
pub fn cuda_allocator(device: &Device) -> Result<Option<CudaAllocator>, String> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let pool_retains = match cuda_pool(d)? {
                Some(pool) => {
                    let mut threshold = 0u64;
                    // SAFETY: the pool is the device's; the attribute's value is a u64.
                    unsafe {
                        cuda_result::mem_pool::get_attribute(
                            pool,
                            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                            (&mut threshold as *mut u64).cast(),
                        )
                    }
                    .map_err(|e| format!("cannot read its memory pool's release threshold: {e}"))?;
                    threshold == u64::MAX
                }
                None => false,
            };
            Ok(Some(CudaAllocator {
                pool_retains,
                event_tracking: d.is_event_tracking(),
            }))
        }
        _ => Ok(None),
    }
}

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{result as cuda_result, sys::CUmemPool_attribute};

/// The memory pool candle's allocations come from (the device's current pool, which
/// `cuMemAllocAsync` takes), or `None` where the device has no pools (cudarc then allocates
/// without one).
#[cfg(feature = "cuda")]
fn cuda_pool(
    d: &candle_core::CudaDevice,
) -> Result<Option<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool>, String> {
    let ctx = d.cuda_stream().context().clone();
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    // SAFETY: the device handle is the context's own.
    unsafe { cuda_result::device::get_mem_pool(ctx.cu_device()) }
        .map(Some)
        .map_err(|e| format!("cannot get its memory pool: {e}"))
}

/// Bytes the memory pool candle allocates from holds but does not use (reserved − used): freed
/// memory a pool with a release threshold keeps ([`prepare_cuda`]), which the driver counts as
/// used but candle's next allocations take first. 0 for a device without pools.
#[cfg(feature = "cuda")]
pub fn cuda_pool_idle(d: &candle_core::CudaDevice) -> Result<u64, String> {
    let Some(pool) = cuda_pool(d)? else {
        return Ok(0);
    };
    let get = |attr, what: &str| -> Result<u64, String> {
        let mut v = 0u64;
        // SAFETY: the pool is the device's; both attributes' values are u64.
        unsafe { cuda_result::mem_pool::get_attribute(pool, attr, (&mut v as *mut u64).cast()) }
            .map_err(|e| format!("cannot read its memory pool's {what}: {e}"))?;
        Ok(v)
    };
    let reserved = get(
        CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        "reserved memory",
    )?;
    let used = get(
        CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        "used memory",
    )?;
    Ok(reserved.saturating_sub(used))
}

/// A boolean environment switch: `0` is off, any other value on, unset `default`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn env_flag(name: &str, default: bool) -> bool {
    std::env::var(name).map_or(default, |v| v != "0")
}

/// Gives the free pages of the C heap back to the system (glibc's `malloc_trim`), so that
/// `MemAvailable` counts memory this process has freed. glibc serves buffers below its mmap
/// threshold from its heap, and that threshold rises (up to 32 MiB) each time a larger buffer
/// is freed, so after the first request a KV cache's per-layer buffers live there. Freeing
/// them (a request's cache, a kept prompt cache) would otherwise leave their pages with the
/// process: the memory checks would see less memory than there is, and a prompt cache freed to
/// make room would free none. Costs microseconds when nothing is free, milliseconds per
/// hundreds of MiB given back. Nothing to do with other allocators.
pub fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer; it only returns unused pages of glibc's own heap
    // to the kernel, and is thread-safe (it locks each arena).
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The budget from `/proc/meminfo`'s text, capped by the room left under each limit the
/// process runs under (`caps`: room in bytes and the limit's name; a cgroup's memory limit,
/// `ulimit -v`).
pub fn budget_from(meminfo: &str, caps: &[(u64, &str)]) -> Option<MemoryBudget> {
    let field = |name: &str| -> Option<u64> {
        meminfo.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let mut it = rest.split_whitespace();
            let v: u64 = it.next()?.parse().ok()?;
            match it.next() {
                Some("kB") => Some(v.saturating_mul(1024)),
                None => Some(v),
                Some(_) => None,
            }
        })
    };
    // Kernels before 3.14 have no MemAvailable; free + page cache is its rough predecessor.
    let avail = field("MemAvailable").or_else(|| Some(field("MemFree")? + field("Cached")?))?;
    let swap = field("SwapFree").unwrap_or(0);
    let mut b = MemoryBudget {
        ram: avail,
        total: avail.saturating_add(swap),
        source: "MemAvailable".to_string(),
    };
    for &(room, name) in caps {
        if room < b.total {
            b = MemoryBudget {
                ram: b.ram.min(room),
                total: room,
                source: name.to_string(),
            };
        }
    }
    Some(b)
}

/// Room left under the process's address-space limit (`ulimit -v`, `RLIMIT_AS`): the soft
/// limit in `/proc/self/limits` less `VmSize` in `/proc/self/status`, read under `root`;
/// `None` when unlimited or unreadable. Allocations beyond it fail even with free RAM.
pub fn address_space_headroom(root: &Path) -> Option<u64> {
    let limits = std::fs::read_to_string(root.join("proc/self/limits")).ok()?;
    let status = std::fs::read_to_string(root.join("proc/self/status")).ok()?;
    let soft = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max address space"))?
        .split_whitespace()
        .next()?;
    let limit: u64 = soft.parse().ok()?; // "unlimited" does not parse
    let size_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(limit.saturating_sub(size_kb.saturating_mul(1024)))
}

/// Room left under the memory limit of the cgroup this process is in (v2 `memory.max` −
/// `memory.current`, or v1 `memory.limit_in_bytes` − `memory.usage_in_bytes`), read under
/// `root`; `None` when there is no limit or no cgroup file says.
pub fn cgroup_headroom(root: &Path) -> Option<u64> {
    let read = |p: &Path| std::fs::read_to_string(root.join(p)).ok();
    let own = read(Path::new("proc/self/cgroup")).unwrap_or_default();
    // v2: the line `0::/path`; its limit, or the root's when the path is not mounted here
    // (inside a container the namespace root is the container's cgroup).
    let v2 = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim().trim_start_matches('/').to_string());
    let mut dirs = Vec::new();
    if let Some(p) = v2.filter(|p| !p.is_empty()) {
        dirs.push(Path::new("sys/fs/cgroup").join(p));
    }
    dirs.push(Path::new("sys/fs/cgroup").to_path_buf());
    for d in &dirs {
        if let (Some(max), Some(cur)) =
            (read(&d.join("memory.max")), read(&d.join("memory.current")))
        {
            return headroom(&max, &cur);
        }
    }
    let v1 = Path::new("sys/fs/cgroup/memory");
    match (
        read(&v1.join("memory.limit_in_bytes")),
        read(&v1.join("memory.usage_in_bytes")),
    ) {
        (Some(max), Some(cur)) => headroom(&max, &cur),
        _ => None,
    }
}

/// `limit − usage` from the two files' text; `None` for no limit (`max`, or v1's huge
/// "unlimited" value) or unreadable numbers.
fn headroom(limit: &str, usage: &str) -> Option<u64> {
    let limit: u64 = limit.trim().parse().ok()?;
    let usage: u64 = usage.trim().parse().ok()?;
    // cgroup v1 writes "unlimited" as the largest page-aligned i64.
    if limit >= 1 << 60 {
        return None;
    }
    Some(limit.saturating_sub(usage))
}

/// Parses a size: bytes, or a number with a unit `K`, `M`, `G`, `T` (powers of 1024; `KiB`,
/// `KB`, `k` and the like are read the same way, as llama.cpp and most tools do for memory).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 16G, 512MiB, 1073741824)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        u => {
            return Err(format!(
                "unknown size unit `{u}` in `{s}` (use K, M, G or T)"
            ))
        }
    };
    let bytes = x * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
        return Err(format!("size `{s}` is out of range"));
    }
    Ok(bytes as u64)
}

/// `1.5 GiB`, `820.0 MiB`, `512 B`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = bytes as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{x:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24576000 kB\nMemFree:        20000000 kB\n\
        MemAvailable:   22000000 kB\nCached:          1000000 kB\nSwapTotal:       4000000 kB\n\
        SwapFree:        3000000 kB\n";

    #[test]
    fn device_budgets_are_their_free_memory() {
        let b = MemoryBudget::device_free("cuda:0", 3 << 30, 141 << 30);
        assert_eq!((b.ram, b.total), (3 << 30, 3 << 30), "no swap on a device");
        assert_eq!(
            b.to_string(),
            "3.0 GiB available (free memory of cuda:0, 141.0 GiB in all)"
        );
        assert_eq!(b.less(1 << 30).ram, 2 << 30);
    }

    #[test]
    fn meminfo_gives_available_and_swap() {
        let b = budget_from(MEMINFO, &[]).unwrap();
        assert_eq!(b.ram, 22_000_000 * 1024);
        assert_eq!(b.total, 25_000_000 * 1024);
        assert_eq!(b.source, "MemAvailable");
    }

    #[test]
    fn old_kernels_without_memavailable_use_free_plus_cached() {
        let m = MEMINFO.replace("MemAvailable:   22000000 kB\n", "");
        let b = budget_from(&m, &[]).unwrap();
        assert_eq!(b.ram, 21_000_000 * 1024);
        assert!(budget_from("MemTotal: 1 kB\n", &[]).is_none());
        // A field name that merely starts like another is not taken for it.
        assert!(budget_from("MemAvailableX: 5 kB\n", &[]).is_none());
    }

    #[test]
    fn limits_cap_both() {
        let room = 8u64 << 30;
        let b = budget_from(MEMINFO, &[(room, "cgroup")]).unwrap();
        assert_eq!((b.ram, b.total), (room, room));
        assert_eq!(b.source, "cgroup");
        // Room beyond RAM + swap changes nothing.
        let b = budget_from(MEMINFO, &[(1 << 50, "cgroup")]).unwrap();
        assert_eq!(b.ram, 22_000_000 * 1024);
        assert_eq!(b.source, "MemAvailable");
        // Room between RAM and RAM + swap caps only the total.
        let room = 23_000_000 * 1024;
        let b = budget_from(MEMINFO, &[(room, "cgroup")]).unwrap();
        assert_eq!((b.ram, b.total), (22_000_000 * 1024, room));
        // The tightest of several limits wins, and is named.
        let b = budget_from(MEMINFO, &[(5 << 30, "cgroup"), (3 << 30, "ulimit")]).unwrap();
        assert_eq!(
            (b.ram, b.total, b.source.as_str()),
            (3 << 30, 3 << 30, "ulimit")
        );
        let b = budget_from(MEMINFO, &[(3 << 30, "cgroup"), (5 << 30, "ulimit")]).unwrap();
        assert_eq!((b.ram, b.source.as_str()), (3 << 30, "cgroup"));
    }

    #[test]
    fn address_space_limit() {
        let dir = std::env::temp_dir().join(format!("keydiff-rlimit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("proc/self")).unwrap();
        let write = |p: &str, s: &str| std::fs::write(dir.join(p), s).unwrap();
        write(
            "proc/self/status",
            "Name:\tkeydiff\nVmPeak:\t  900 kB\nVmSize:\t  1000 kB\n",
        );
        write(
            "proc/self/limits",
            "Limit                     Soft Limit           Hard Limit           Units\n\
             Max address space         unlimited            unlimited            bytes\n",
        );
        assert_eq!(address_space_headroom(&dir), None);
        write(
            "proc/self/limits",
            "Max address space         4096000000           unlimited            bytes\n",
        );
        assert_eq!(
            address_space_headroom(&dir),
            Some(4_096_000_000 - 1_024_000)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cgroup_files_v2_v1_and_none() {
        let dir = std::env::temp_dir().join(format!("keydiff-cgroup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let write = |p: &str, s: &str| {
            let p = dir.join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, s).unwrap();
        };
        assert_eq!(cgroup_headroom(&dir), None);
        // v1
        write("sys/fs/cgroup/memory/memory.limit_in_bytes", "1000\n");
        write("sys/fs/cgroup/memory/memory.usage_in_bytes", "400\n");
        assert_eq!(cgroup_headroom(&dir), Some(600));
        write(
            "sys/fs/cgroup/memory/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        assert_eq!(cgroup_headroom(&dir), None);
        // v2 at the root, then in the process's own cgroup, which wins.
        write("sys/fs/cgroup/memory.max", "5000\n");
        write("sys/fs/cgroup/memory.current", "1000\n");
        assert_eq!(cgroup_headroom(&dir), Some(4000));
        write("proc/self/cgroup", "0::/user.slice/job\n");
        write("sys/fs/cgroup/user.slice/job/memory.max", "max\n");
        write("sys/fs/cgroup/user.slice/job/memory.current", "123\n");
        assert_eq!(cgroup_headroom(&dir), None);
        write("sys/fs/cgroup/user.slice/job/memory.max", "300\n");
        assert_eq!(cgroup_headroom(&dir), Some(177));
        // Usage beyond the limit leaves no room rather than wrapping.
        write("sys/fs/cgroup/user.slice/job/memory.current", "900\n");
        assert_eq!(cgroup_headroom(&dir), Some(0));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1073741824"), Ok(1 << 30));
        assert_eq!(parse_size("16G"), Ok(16 << 30));
        assert_eq!(parse_size("16GiB"), Ok(16 << 30));
        assert_eq!(parse_size(" 512 MB "), Ok(512 << 20));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("2t"), Ok(2 << 40));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        for bad in ["", "G", "12X", "-1G", "0", "1e3", "1.2.3G", "99999999999T"] {
            assert!(parse_size(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 29), "1.5 GiB");
        assert_eq!(human(820 << 20), "820.0 MiB");
    }

    #[test]
    fn detect_reads_this_machine() {
        // Linux CI and dev machines have /proc/meminfo; elsewhere there is nothing to check.
        if !Path::new("/proc/meminfo").exists() {
            eprintln!("skipped: no /proc/meminfo on this system");
            return;
        }
        let b = MemoryBudget::detect().expect("a budget from /proc/meminfo");
        assert!(b.ram > 0 && b.total >= b.ram, "{b:?}");
    }
}
