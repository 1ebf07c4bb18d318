//! Writes the tiny random Qwen 3 GGUFs of the parity tests (`keydiff_tests::write_tiny_qwen3`,
//! `keydiff_tests::write_tiny_qwen3_moe`), for `scripts/gen-fixtures.py qwen3` and `qwen3moe`:
//!
//!     cargo run --release -p keydiff-tests --example tiny-qwen3 -- OUT.gguf [--unit-qk-norms]
//!     cargo run --release -p keydiff-tests --example tiny-qwen3 -- OUT.gguf --moe [q8_0|q4_0]

use candle_core::quantized::GgmlDType;

fn main() -> anyhow::Result<()> {
    const USAGE: &str = "usage: tiny-qwen3 OUT.gguf [--unit-qk-norms | --moe [q8_0|q4_0]]";
    let mut args = std::env::args().skip(1);
    let out = args.next().ok_or_else(|| anyhow::anyhow!(USAGE))?;
    let path = std::path::Path::new(&out);
    match args.next().as_deref() {
        None => keydiff_tests::write_tiny_qwen3(path, false)?,
        Some("--unit-qk-norms") => keydiff_tests::write_tiny_qwen3(path, true)?,
        Some("--moe") => {
            let experts = match args.next().as_deref() {
                None => GgmlDType::F32,
                Some("q8_0") => GgmlDType::Q8_0,
                Some("q4_0") => GgmlDType::Q4_0,
                Some(other) => anyhow::bail!("unknown expert type `{other}`; {USAGE}"),
            };
            keydiff_tests::write_tiny_qwen3_moe(path, experts)?
        }
        Some(other) => anyhow::bail!("unknown argument `{other}`; {USAGE}"),
    }
    if let Some(extra) = args.next() {
        anyhow::bail!("unexpected argument `{extra}`; {USAGE}");
    }
    println!("{out}");
    Ok(())
}
