//! Memory a process frees counts as available to the memory budget: buffers the size of a KV
//! cache's per-layer buffers, freed after glibc's mmap threshold has risen above them, are
//! given back to the system when the budget is measured. One test in its own binary: its
//! resident-size measurements need no other threads allocating.

/// This process's resident set, bytes (Linux).
fn rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb << 10)
}

/// `n` buffers of 6 MiB, every page written (as a prefill writes a cache's slots).
fn buffers(n: usize) -> Vec<Vec<f32>> {
    (0..n)
        .map(|i| {
            let mut v = vec![0f32; 6 << 18];
            for x in v.iter_mut().step_by(1024) {
                *x = i as f32 + 1.0;
            }
            v
        })
        .collect()
}

#[test]
fn freed_heap_buffers_count_as_available() {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) || rss().is_none() {
        eprintln!("skipped: needs Linux with glibc (malloc_trim, /proc/self/status)");
        return;
    }
    // Freeing a mapped 6 MiB buffer raises glibc's mmap threshold above 6 MiB: the next
    // ones come from the heap, whose pages stay with the process when they are freed.
    drop(buffers(1));
    let held = buffers(40); // 240 MiB
    let pin = buffers(1); // above them, so the heap's top cannot shrink on its own
    let before = rss().unwrap();
    drop(held);
    let dropped = rss().unwrap();
    let budget = keydiff_model::memory::MemoryBudget::detect();
    let after = rss().unwrap();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "resident: {:.0} MiB with the buffers, {:.0} MiB after freeing them, {:.0} MiB after \
         measuring the budget ({budget:?})",
        mib(before),
        mib(dropped),
        mib(after)
    );
    assert!(budget.is_some(), "no memory budget on Linux");
    if before - dropped.min(before) >= 100 << 20 {
        // The allocator gave them back by itself (a fixed mmap threshold, another malloc):
        // there is nothing for the budget to release.
        eprintln!("skipped: freeing the buffers gave their memory back without malloc_trim");
        return;
    }
    assert!(
        before - after.min(before) >= 200 << 20,
        "measuring the budget gave back {:.0} MiB of 240 freed",
        mib(before.saturating_sub(after))
    );
    drop(pin);
}
