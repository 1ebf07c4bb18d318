//! Writes the tiny random Qwen 3 GGUF of the parity tests (`keydiff_tests::write_tiny_qwen3`),
//! for `scripts/gen-fixtures.py qwen3`:
//!
//!     cargo run --release -p keydiff-tests --example tiny-qwen3 -- OUT.gguf [--unit-qk-norms]

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let out = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: tiny-qwen3 OUT.gguf [--unit-qk-norms]"))?;
    let unit = match args.next().as_deref() {
        None => false,
        Some("--unit-qk-norms") => true,
        Some(other) => anyhow::bail!("unknown argument `{other}`"),
    };
    keydiff_tests::write_tiny_qwen3(std::path::Path::new(&out), unit)?;
    println!("{out}");
    Ok(())
}
