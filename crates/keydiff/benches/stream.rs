//! Incremental detokenization with stop strings ([`keydiff::TextStream`]): every generated
//! token of a request goes through `push`, so its cost per token must not grow with the
//! length of the output. Pushes the first L tokens of a long text (the repository's README,
//! every line indented by four spaces, repeated; tokenized by SmolLM2's GGUF tokenizer) with
//! two stop strings that never come and llama.cpp's indentation stop at 4 (never met);
//! reported per token, so a cost that grows with L shows. Beside it, for L up to 4096, what
//! a stream that decodes all tokens so far on each token costs (keydiff's before 2026-12-07).
//! Last, a reply that goes on with its end-of-text token after 64 tokens (`ignore_eos`).
//!
//!     scripts/fetch-models.sh && cargo bench -p keydiff --bench stream

use std::path::Path;

use candle_core::quantized::gguf_file;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use keydiff::TextStream;

fn stream(c: &mut Criterion) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let gguf = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut f = std::fs::File::open(&gguf)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-models.sh)", gguf.display()));
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let tok = keydiff_model::tokenizer::tokenizer_from_gguf(&ct)
        .unwrap()
        .tokenizer;
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let text: String = readme.lines().map(|l| format!("    {l}\n")).collect();
    let ids = tok
        .encode(text.repeat(4).as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec();
    let mut grp = c.benchmark_group("text-stream");
    grp.sample_size(10);
    for len in [1024usize, 4096, 16384] {
        assert!(ids.len() >= len, "{} tokens of text", ids.len());
        grp.throughput(Throughput::Elements(len as u64));
        grp.bench_function(BenchmarkId::new("push", len), |b| {
            b.iter(|| {
                let stops = vec!["<never-a-stop>".to_string(), "\n\n\n\n\n".to_string()];
                let mut s = TextStream::new(&tok, stops).stop_below_indent(4);
                let mut n = 0;
                for &t in &ids[..len] {
                    n += s.push(t).unwrap().len();
                }
                n += s.finish().len();
                assert!(!s.stopped(), "nothing stops this text");
                n
            })
        });
        if len <= 4096 {
            grp.bench_function(BenchmarkId::new("full-decode", len), |b| {
                b.iter(|| {
                    let mut n = 0;
                    for i in 1..=len {
                        n += tok.decode(&ids[..i], true).unwrap().len();
                    }
                    n
                })
            });
        }
    }
    // A reply that ends and goes on generating its end-of-text token (`ignore_eos`, as
    // serving benchmarks ask for): 64 tokens of text, then L − 64 special tokens.
    let eos = tok
        .token_to_id("<|im_end|>")
        .expect("SmolLM2's end of turn");
    for len in [4096usize, 16384] {
        let run: Vec<u32> = (ids[..64].iter().copied())
            .chain(std::iter::repeat_n(eos, len - 64))
            .collect();
        grp.throughput(Throughput::Elements(len as u64));
        grp.bench_function(BenchmarkId::new("push-special-run", len), |b| {
            b.iter(|| {
                let mut s = TextStream::new(&tok, vec!["<never-a-stop>".to_string()]);
                let mut n = 0;
                for &t in &run {
                    n += s.push(t).unwrap().len();
                }
                n + s.finish().len()
            })
        });
    }
    grp.finish();
}

criterion_group!(benches, stream);
criterion_main!(benches);
