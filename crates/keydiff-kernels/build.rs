//! Compiles `kernels/*.cu` to PTX with nvcc when the `cuda` feature is on, and, with
//! `emulate`, the same source with the host C++ compiler under `kernels/emu` (no CUDA needed).
//!
//! Why build time and not NVRTC at run time: a kernel that does not compile fails the build
//! (and CI, which runs `cargo clippy --features cuda` with the pinned toolchain), not a user's
//! first eviction; the PTX ISA is fixed by the pinned nvcc (9.0, which the H200 host's CUDA 13.0
//! driver loads); and the binary needs no libnvrtc or CUDA headers at run time.
//!
//! nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the PATH. The PTX targets
//! `compute_$CUDA_COMPUTE_CAP` (default 80: A100; the driver JIT-compiles it for H100/H200).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("../../kernels");
    #[cfg(feature = "emulate")]
    emulation(&root);
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    // The architecture every CUDA crate of the build compiles for (`arch::BUILD_COMPUTE_CAP`),
    // when it is set; unset, candle asks the build machine's nvidia-smi.
    if let Ok(cap) = std::env::var("CUDA_COMPUTE_CAP") {
        println!("cargo:rustc-env=KEYDIFF_BUILD_COMPUTE_CAP={}", cap.trim());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| match std::env::var("CUDA_HOME") {
        Ok(home) => format!("{home}/bin/nvcc"),
        Err(_) => "nvcc".to_string(),
    });
    // The toolkit's release (`arch::BUILD_CUDA_VERSION`): the driver must be at least as new
    // to load the PTX it writes.
    if let Ok(out) = Command::new(&nvcc).arg("--version").output() {
        let text = String::from_utf8_lossy(&out.stdout);
        if let Some(v) = text
            .split("release ")
            .nth(1)
            .and_then(|r| r.split(',').next())
        {
            println!("cargo:rustc-env=KEYDIFF_BUILD_CUDA_VERSION={}", v.trim());
        }
    }
    let cap = std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .map(|c| c.trim().replace('.', ""))
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "80".to_string());
    // One module for now; a new kernels/*.cu file is added here and in src/cuda.rs.
    let sources = ["keydiff"];
    for name in sources.iter() {
        let src = root.join(format!("{name}.cu"));
        println!("cargo:rerun-if-changed={}", src.display());
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "-Werror", "all-warnings"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-o")
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {nvcc} (set NVCC or CUDA_HOME): {e}"));
        if !status.success() {
            panic!("{nvcc} failed on {}", src.display());
        }
        // The source's FNV-1a 64 as a trailing PTX comment (the driver ignores it), so that the
        // executing mock can refuse a host build of another kernels/keydiff.cu than the one this
        // binary's kernels come from (scripts/cuda/mock/mockcuda.c; exec/build.sh writes the
        // host build's in kx_sources.tsv).
        let bytes = std::fs::read(&src).expect("kernel source");
        let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        });
        let mut text = std::fs::read_to_string(&ptx).expect("nvcc's PTX");
        text.push_str(&format!("\n// {name}.cu fnv1a64 {hash:016x}\n"));
        std::fs::write(&ptx, text).expect("PTX written");
    }
}

/// `kernels/emu/launch.cpp`, which includes the kernel source, and the memory checker
/// `kernels/emu/race.cpp`, as one static library.
#[cfg(feature = "emulate")]
fn emulation(root: &std::path::Path) {
    for f in [
        "keydiff.cu",
        "emu/launch.cpp",
        "emu/cuda_emu.h",
        "emu/race.h",
        "emu/race.cpp",
        "emu/include/cuda_bf16.h",
        "emu/include/cuda_fp16.h",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
    let build = |instrumented: bool| {
        let mut b = cc::Build::new();
        b.cpp(true)
            .include(root.join("emu/include"))
            .std("c++17")
            .flag("-fno-strict-aliasing")
            // No fused multiply-adds: the same results on every host, whatever its -march.
            .flag("-ffp-contract=off")
            // Every page a frame takes is touched in order: a thread that outgrows its fiber
            // stack meets the guard page below it (kernels/emu/cuda_emu.h, Stacks).
            .flag("-fstack-clash-protection")
            .opt_level(2)
            .warnings(true)
            .extra_warnings(true)
            .warnings_into_errors(true);
        if instrumented {
            // Every load and store of the kernels calls the checker of kernels/emu/race.cpp
            // (its __tsan_* functions; no ThreadSanitizer runtime is linked).
            b.flag("-fsanitize=thread")
                // Indexing an array of known size (the kernels' __shared__ arrays) out of
                // bounds traps (SIGILL) instead of touching a neighbour; no runtime either.
                .flag("-fsanitize=bounds")
                .flag("-fsanitize-undefined-trap-on-error");
        }
        b
    };
    let objects = build(false)
        .file(root.join("emu/race.cpp"))
        .compile_intermediates();
    build(true)
        .file(root.join("emu/launch.cpp"))
        .objects(objects)
        .compile("keydiff_emu");
}
