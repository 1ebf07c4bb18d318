//! Bad input gets a clear error naming the problem, a non-zero exit, and no panic.

use std::path::Path;
use std::process::Command;

use candle_core::quantized::gguf_file::{self, Value};
use keydiff_tests::{keydiff_bin, model, temp_dir, SMOLLM2};

/// Runs `keydiff args…`, expects failure, returns stderr.
fn fails(args: &[&str]) -> String {
    let out = Command::new(keydiff_bin()).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success(),
        "keydiff {args:?} succeeded; stderr: {err}"
    );
    assert_eq!(out.status.code(), Some(1), "keydiff {args:?}: {err}");
    assert!(
        !err.contains("panicked"),
        "keydiff {args:?} panicked: {err}"
    );
    // The error's chain is printed `a: b: c`; no cause twice in a row (an error whose
    // message has its cause's and that also gives it as its `source()`).
    let line = err.lines().find(|l| l.starts_with("error: ")).unwrap_or("");
    let parts: Vec<&str> = line.split(": ").collect();
    assert!(
        parts.windows(2).all(|w| w[0] != w[1]),
        "keydiff {args:?}: a cause printed twice: {line}"
    );
    err
}

fn expect(err: &str, needle: &str) {
    assert!(err.contains(needle), "expected `{needle}` in: {err}");
}

/// Writes a GGUF with `metadata` and no tensors.
fn write_gguf(path: &Path, metadata: &[(String, Value)]) {
    let mut f = std::fs::File::create(path).unwrap();
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md, &[]).unwrap();
}

fn smollm2_metadata() -> Vec<(String, Value)> {
    let mut f = std::fs::File::open(model(SMOLLM2)).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut md: Vec<(String, Value)> = ct.metadata.into_iter().collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    md
}

#[test]
fn missing_model() {
    let err = fails(&["run", "-m", "/no/such/model.gguf", "-p", "hi"]);
    expect(&err, "not found: /no/such/model.gguf");
}

#[test]
fn bad_magic() {
    let d = temp_dir("badmagic");
    let p = d.join("bad.gguf");
    std::fs::write(&p, b"NOTAGGUF-at-all-just-some-bytes").unwrap();
    let err = fails(&["run", "-m", p.to_str().unwrap(), "-p", "hi"]);
    expect(&err, "invalid GGUF file");
    expect(&err, "bad.gguf");
}

#[test]
fn truncated_gguf() {
    let d = temp_dir("truncated");
    let p = d.join("trunc.gguf");
    let bytes = std::fs::read(model(SMOLLM2)).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let err = fails(&["run", "-m", p.to_str().unwrap(), "-p", "hi"]);
    expect(&err, "truncated");
}

/// One file of an HF checkpoint given as the model: the error says to give its directory.
#[test]
fn a_checkpoint_file_instead_of_its_directory() {
    let d = temp_dir("hf-file");
    let p = d.join("model.safetensors");
    std::fs::write(&p, b"not read").unwrap();
    let err = fails(&["run", "-m", p.to_str().unwrap(), "-p", "hi"]);
    expect(
        &err,
        "is a file of a Hugging Face checkpoint: give its directory",
    );
    expect(&err, d.to_str().unwrap());
}

#[test]
fn unsupported_architecture() {
    let d = temp_dir("arch");
    let p = d.join("mamba.gguf");
    let mut md = smollm2_metadata();
    for (k, v) in md.iter_mut() {
        if k == "general.architecture" {
            *v = Value::String("mamba".into());
        }
    }
    write_gguf(&p, &md);
    let err = fails(&["run", "-m", p.to_str().unwrap(), "-p", "hi"]);
    expect(&err, "unsupported architecture `mamba`");
}

/// candle's GGUF reader divides by the alignment unchecked (huggingface/candle#3876).
#[test]
fn zero_alignment() {
    let d = temp_dir("align");
    let p = d.join("align0.gguf");
    let mut md = smollm2_metadata();
    md.retain(|(k, _)| k != "general.alignment");
    md.push(("general.alignment".into(), Value::U32(0)));
    write_gguf(&p, &md);
    let err = fails(&["run", "-m", p.to_str().unwrap(), "-p", "hi"]);
    expect(&err, "`general.alignment` is 0; it must be a power of two");
    expect(&err, "align0.gguf");
}

#[test]
fn unknown_pre_tokenizer() {
    let d = temp_dir("pre");
    let p = d.join("weird-pre.gguf");
    let mut md = smollm2_metadata();
    for (k, v) in md.iter_mut() {
        if k == "tokenizer.ggml.pre" {
            *v = Value::String("weird".into());
        }
    }
    write_gguf(&p, &md);
    let err = fails(&["run", "-m", p.to_str().unwrap(), "-p", "hi"]);
    expect(&err, "unknown pre-tokenizer");
    expect(&err, "weird");
}

#[test]
fn empty_prompt() {
    let m = model(SMOLLM2);
    let err = fails(&["run", "-m", m.to_str().unwrap(), "-p", ""]);
    expect(&err, "the prompt is empty");
}

#[test]
fn prompt_beyond_context() {
    let m = model(SMOLLM2);
    let d = temp_dir("long");
    let p = d.join("long.txt");
    // ~12K tokens for SmolLM2 (8K context): digits are one token each.
    std::fs::write(&p, "1 ".repeat(6_000)).unwrap();
    let err = fails(&["run", "-m", m.to_str().unwrap(), "-f", p.to_str().unwrap()]);
    expect(&err, "beyond the model's context of 8192");

    // Megabytes beyond what the context could hold are refused before they are tokenized (a
    // 46 MB text took 5 GB and 18 s to be counted, then refused).
    std::fs::write(
        &p,
        "The quick brown fox jumps over the lazy dog. ".repeat(240_000),
    )
    .unwrap();
    let err = fails(&["run", "-m", m.to_str().unwrap(), "-f", p.to_str().unwrap()]);
    expect(
        &err,
        "the prompt's text of 10800000 bytes has at least 16666 tokens, beyond the model's \
         context of 8192",
    );
}

#[test]
fn contradicting_rope_flags() {
    let m = model(SMOLLM2);
    let m = m.to_str().unwrap();
    let err = fails(&["info", "-m", m, "--rope-scaling", "dynamic"]);
    expect(
        &err,
        "--rope-scaling: unknown RoPE scaling `dynamic` (expected none, linear or yarn)",
    );
    let err = fails(&[
        "info",
        "-m",
        m,
        "--yarn-orig-ctx",
        "4096",
        "--rope-scale",
        "2",
    ]);
    expect(
        &err,
        "the YaRN settings (original context, betas, attention factor) need YaRN",
    );
    let err = fails(&["info", "-m", m, "--rope-scaling", "yarn"]);
    expect(
        &err,
        "linear or YaRN RoPE scaling needs a factor (llama.cpp's --rope-scale)",
    );
    let err = fails(&[
        "info",
        "-m",
        m,
        "--rope-scaling",
        "yarn",
        "--rope-scale",
        "0.5",
    ]);
    expect(&err, "YaRN RoPE scaling factor 0.5 must be at least 1");
    let err = fails(&["info", "-m", m, "--rope-freq-base", "0"]);
    expect(&err, "rope_theta 0 must be above 1 and at most 1e12");
}

#[test]
fn unknown_device_and_dtype() {
    let m = model(SMOLLM2);
    let err = fails(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--dtype",
        "f8",
    ]);
    expect(&err, "unknown dtype `f8`");
    let err = fails(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--kv-dtype",
        "q4_k",
    ]);
    expect(&err, "unknown KV cache type `q4_k`");
    let err = fails(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--device",
        "tpu",
    ]);
    expect(&err, "unknown device `tpu`");
    let err = fails(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--device",
        "cuda:x",
    ]);
    expect(&err, "bad device `cuda:x` (expected cuda:N)");
}

#[test]
fn meaningless_sampling() {
    // A model path that does not exist: the settings are refused before loading.
    for (flag, needle) in [
        ("--top-p=2", "top-p 2 must be in (0, 1]"),
        ("--temp=-1", "temperature -1 must be"),
        ("--min-p=1.5", "min-p 1.5 must be in [0, 1]"),
        ("--repeat-penalty=0", "repetition penalty 0 must be"),
    ] {
        let err = fails(&["run", "-m", "/no/such/model.gguf", "-p", "hi", flag]);
        expect(&err, needle);
    }
}

#[test]
fn eval_parameters_checked_before_loading() {
    // A model path that does not exist: each is refused before the model would load.
    for (args, needle) in [
        (
            &["--lengths", "0"][..],
            "--lengths must be one or more positive",
        ),
        (&["--depths", "0.5,2"][..], "--depths must be fractions"),
        (&["--budgets", "150%"][..], "bad budget `150%`"),
        (&["--samples", "0"][..], "--samples must be at least 1"),
    ] {
        let cmd = [&["eval", "niah", "-m", "/no/such/model.gguf"][..], args].concat();
        expect(&fails(&cmd), needle);
    }
    let err = fails(&["eval", "nosuchtask", "-m", "/no/such/model.gguf"]);
    expect(
        &err,
        "unknown task `nosuchtask` (passkey, niah, phonebook, longbench)",
    );
}

#[test]
fn chunk_zero() {
    let m = model(SMOLLM2);
    let err = fails(&["run", "-m", m.to_str().unwrap(), "-p", "hi", "--chunk", "0"]);
    expect(&err, "chunk size must be at least 1");
}

#[test]
fn budget_smaller_than_chunk() {
    let m = model(SMOLLM2);
    let err = fails(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--budget",
        "64",
        "--chunk",
        "128",
    ]);
    expect(
        &err,
        "budget 64 is smaller than the chunk 128 (--budget, --chunk)",
    );
    // A setting, not the model, is at fault.
    assert!(!err.contains("cannot load model"), "{err}");
}

#[test]
fn protected_slots_exceed_budget() {
    let m = model(SMOLLM2);
    let err = fails(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--budget",
        "256",
        "--chunk",
        "128",
        "--window",
        "0.9",
        "--sinks",
        "64",
    ]);
    expect(&err, "protected slots");
    expect(&err, "exceed the budget 256");
}

#[test]
fn policy_without_budget_and_unknown_policy() {
    let m = model(SMOLLM2);
    let err = fails(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--policy",
        "tova",
    ]);
    expect(&err, "needs a budget");
    let err = fails(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--budget",
        "512",
        "--policy",
        "lru",
    ]);
    expect(&err, "unknown policy `lru`");
}

#[test]
fn malformed_hf_directory() {
    let d = temp_dir("hf-bad");
    let cfg = keydiff_tests::root().join("configs/tiny-llama.json");
    std::fs::copy(&cfg, d.join("config.json")).unwrap();
    std::fs::write(
        d.join("model.safetensors"),
        [255u8, 255, 0, 0, 0, 0, 0, 0, b'{'],
    )
    .unwrap();
    let err = fails(&["run", "-m", d.to_str().unwrap(), "-p", "hi"]);
    expect(&err, "invalid safetensors");
    expect(&err, "model.safetensors");
    // A well-formed file cut short.
    let t =
        candle_core::Tensor::zeros((64, 64), candle_core::DType::F32, &candle_core::Device::Cpu)
            .unwrap();
    let st = d.join("model.safetensors");
    candle_core::safetensors::save(
        &std::collections::HashMap::from([("w".to_string(), t)]),
        &st,
    )
    .unwrap();
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() - 100]).unwrap();
    let err = fails(&["run", "-m", d.to_str().unwrap(), "-p", "hi"]);
    expect(&err, "invalid safetensors");
    std::fs::write(d.join("config.json"), "{ not json").unwrap();
    let err = fails(&["run", "-m", d.to_str().unwrap(), "-p", "hi"]);
    expect(&err, "invalid config");
    expect(&err, "config.json");
}

/// Offline (or for a repository that does not exist) a hub id is a clear error, not a hang.
#[test]
fn unreachable_hub_model() {
    let err = fails(&[
        "run",
        "-m",
        "keydiff-test-no-such-org/no-such-model",
        "-p",
        "hi",
    ]);
    expect(
        &err,
        "Hugging Face hub: `keydiff-test-no-such-org/no-such-model` is no local file or \
         directory, and as a hub id: cannot fetch `config.json`",
    );
}

/// Memory: a malformed `--memory-limit` is a usage error naming the value; a model that
/// cannot fit is refused with the numbers before its tensors are read, whether the limit is
/// the user's or the process's address-space limit (`ulimit -v`, where the allocator would
/// otherwise abort the process).
#[test]
fn memory_limits() {
    let out = Command::new(keydiff_bin())
        .args(["run", "-p", "hi", "--memory-limit", "12X"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    expect(&err, "unknown size unit `x` in `12X`");

    let m = model(SMOLLM2);
    let err = fails(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--memory-limit",
        "64M",
    ]);
    expect(&err, "not enough memory: the weights of");
    expect(&err, "SmolLM2-135M-Instruct.Q4_1.gguf");
    expect(&err, "64.0 MiB available (--memory-limit 64.0 MiB)");

    if !Path::new("/proc/self/limits").exists() {
        eprintln!("skipped the ulimit -v case: no /proc/self/limits on this system");
        return;
    }
    // Llama 3.2 3B in f32 needs ~13 GiB; 3 GB of address space cannot hold it.
    let preset = keydiff_tests::root().join("configs/llama-3.2-3b.json");
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 3000000 && exec '{}' run --random-weights -m '{}' -p hi -n 1",
            keydiff_bin().display(),
            preset.display()
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    expect(&err, "not enough memory: the random weights of");
    expect(&err, "available (address-space limit (ulimit -v))");
}

#[test]
fn perplexity_needs_a_text_of_two_tokens() {
    let m = model(SMOLLM2);
    let m = m.to_str().unwrap();
    let err = fails(&["perplexity", "-m", m]);
    expect(&err, "give the text with -p TEXT or -f FILE");
    let err = fails(&["perplexity", "-m", m, "-p", "hi", "--max-tokens", "1"]);
    expect(&err, "perplexity needs at least 2 tokens, got 1");
    let err = fails(&["perplexity", "-m", m, "-p", "hi", "--max-tokens", "0"]);
    expect(&err, "--max-tokens must be at least 2");
    let err = fails(&["perplexity", "-m", m, "-f", "/no/such/text.txt"]);
    expect(&err, "cannot read text file /no/such/text.txt");
}

/// `chat` needs a chat template; a model without one is refused by name, not run as text.
#[test]
fn chat_without_a_template() {
    let preset = keydiff_tests::root().join("configs/tiny-llama.json");
    let mut child = Command::new(keydiff_bin())
        .args(["chat", "--random-weights", "-m", preset.to_str().unwrap()])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"hi\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    expect(&err, "this model has no chat template");
}

/// Chat template flags: kwargs that are not a JSON object, or that set a variable the
/// renderer sets; a template file that is missing; a template that does not compile.
#[test]
fn chat_template_flags() {
    let m = model(SMOLLM2);
    let m = m.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec!["run", "-m", m, "--chat", "-p", "hi", "-n", "1"];
        a.extend(extra);
        fails(&a)
    };
    expect(
        &run(&["--chat-template-kwargs", "[1]"]),
        "--chat-template-kwargs must be a JSON object, not [1]",
    );
    expect(
        &run(&["--chat-template-kwargs", "{bad"]),
        "--chat-template-kwargs is not JSON",
    );
    expect(
        &run(&[
            "--chat-template-kwargs",
            r#"{"add_generation_prompt": false}"#,
        ]),
        "chat template kwargs may not set `add_generation_prompt`",
    );
    expect(
        &run(&["--chat-template-file", "/no/such/template.jinja"]),
        "--chat-template-file /no/such/template.jinja",
    );
    expect(&run(&["--chat-template", "{% for %}"]), "chat template:");
    expect(
        &run(&["--reasoning-budget", "512"]),
        "--reasoning-budget 512: only -1 (unrestricted) and 0 (no thinking) are supported",
    );
    expect(
        &run(&[
            "--reasoning-budget",
            "0",
            "--chat-template-kwargs",
            r#"{"enable_thinking": true}"#,
        ]),
        "--reasoning-budget 0 contradicts `enable_thinking: true`",
    );
}

/// `serve` refuses settings with no meaning before it loads anything, and an address it
/// cannot listen on by name.
#[test]
fn serve_settings() {
    expect(
        &fails(&["serve", "--api-key", ""]),
        "--api-key (or KEYDIFF_API_KEY) is empty",
    );
    expect(
        &fails(&["serve", "--max-queue", "0"]),
        "--max-queue must be at least 1",
    );
    expect(
        &fails(&["serve", "-n", "0"]),
        "--max-tokens must be at least 1",
    );
    expect(
        &fails(&["serve", "--prompt-cache", "always"]),
        "--prompt-cache `always`: expected exact, continue or off",
    );
    expect(
        &fails(&["serve", "--max-batch", "4", "--prefill-tokens", "0"]),
        "--prefill-tokens must be at least 1",
    );
    expect(
        &fails(&["serve", "--reasoning-format", "qwen3"]),
        "--reasoning-format: unknown reasoning format `qwen3` (auto, none, deepseek)",
    );
    expect(
        &fails(&["serve", "--prefill-tokens", "256"]),
        "--prefill-tokens sets a batch's steps: it needs --max-batch above 1",
    );
    let err = fails(&["serve", "--host", "203.0.113.7", "--port", "1"]);
    expect(&err, "cannot listen on 203.0.113.7:1");
    // A port in use fails before the model loads (none is given here), with the reason.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let err = fails(&["serve", "-m", "no/such/model.gguf", "--port", &port]);
    expect(
        &err,
        &format!("cannot listen on 127.0.0.1:{port}: Address already in use"),
    );
}

/// A config that cannot be read is named, with the reason once.
#[test]
fn check_device_unreadable_preset() {
    let err = fails(&[
        "check-device",
        "--device",
        "cpu",
        "--preset",
        "/no/such/preset.json",
    ]);
    expect(
        &err,
        "io error on /no/such/preset.json: No such file or directory",
    );
    let d = temp_dir("dirpreset");
    let err = fails(&[
        "check-device",
        "--device",
        "cpu",
        "--batch",
        "--preset",
        d.to_str().unwrap(),
    ]);
    expect(&err, "Is a directory");
}
