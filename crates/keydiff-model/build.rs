//! Sets `avx2_f16c` when the target has AVX2, FMA and F16C (`-C target-cpu=native` on such a
//! CPU, or x86-64-v3): the CPU decode kernel's SIMD row operations need all three.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(avx2_f16c)");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    let has = |f: &str| features.split(',').any(|x| x == f);
    if arch == "x86_64" && has("avx2") && has("fma") && has("f16c") {
        println!("cargo::rustc-cfg=avx2_f16c");
    }
}
