//! The `keydiff` binary end to end on SmolLM2: run (streamed, JSON, chat, stop strings),
//! tokenize, info; fill in the middle on Qwen2.5-Coder.

use std::process::Command;

use keydiff_tests::{fixture, keydiff_bin, model, root, temp_dir, QWEN, SMOLLM2};

fn ok(args: &[&str]) -> (String, String) {
    let out = Command::new(keydiff_bin()).args(args).output().unwrap();
    let so = String::from_utf8_lossy(&out.stdout).to_string();
    let se = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "keydiff {args:?} failed: {se}");
    (so, se)
}

#[test]
fn tokenize_matches_llamacpp_ids() {
    let m = model(SMOLLM2);
    let fx = fixture("smollm2");
    let p = fx.prompts.iter().find(|p| p.name == "digits").unwrap();
    let (so, _) = ok(&["tokenize", "-m", m.to_str().unwrap(), "-p", &p.text]);
    let ids: Vec<u32> = serde_json::from_str(so.trim()).unwrap();
    assert_eq!(ids, p.tokens);
}

#[test]
fn version_names_the_build() {
    let (so, _) = ok(&["--version"]);
    // `keydiff 0.1.0 (build <git describe>, features: ...)`; this test runs from a checkout, and
    // the binary is built from the same tree as this test.
    let commit = keydiff::BUILD_COMMIT.expect("tests are built in a git checkout");
    assert!(
        so.starts_with(&format!("keydiff {} (build ", env!("CARGO_PKG_VERSION"))),
        "{so}"
    );
    assert!(so.contains(&format!("build {commit}, features: ")), "{so}");
    // And it names this checkout's HEAD: a build script that read another checkout (one
    // compiled into the same target dir) once reported that checkout's commit here.
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(keydiff_tests::root())
        .output()
        .expect("git runs in the test checkout");
    let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
    assert!(
        commit.trim_end_matches("-dirty").ends_with(&head),
        "HEAD {head}: {so}"
    );
}

#[test]
fn info_describes_the_model() {
    let m = model(SMOLLM2);
    let (so, _) = ok(&["info", "-m", m.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert_eq!(v["config"]["arch"], "llama");
    assert_eq!(v["config"]["num_layers"], 30);
    assert_eq!(v["config"]["num_kv_heads"], 3);
    assert_eq!(v["weights"]["attn_q"], "Q4_1");
    // `--attention auto` (the default) resolved for the CPU: eager.
    assert_eq!(v["attention"], "eager");
    assert_eq!(
        v["memory"]["cpu_weights"],
        "weights with dense prefill copies and Q8_0 decode copies"
    );
    assert_eq!(v["runtime_weights"]["attn_q"], "decode Q8_0, prefill F32");
    let full = v["memory"]["weight_bytes"].as_u64().unwrap();

    // 300 MiB has no room for the dense copies (~680 MiB): they are dropped, with a warning
    // that says what that costs.
    let (so, se) = ok(&["info", "-m", m.to_str().unwrap(), "--memory-limit", "300M"]);
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert_eq!(
        v["memory"]["cpu_weights"],
        "weights with Q8_0 decode copies only"
    );
    assert_eq!(v["runtime_weights"]["attn_q"], "Q8_0");
    let held = v["memory"]["weight_bytes"].as_u64().unwrap();
    assert!(held < 300 << 20 && held * 3 < full, "{held} vs {full}");
    let avail = v["memory"]["available"].as_str().unwrap();
    assert!(
        avail.ends_with("available (--memory-limit 300.0 MiB)"),
        "{avail}"
    );
    assert!(se.contains("prefill runs quantized matmuls"), "{se}");
}

/// llama.cpp's RoPE flags: YaRN ×4 from 32K gives Qwen 2.5 a context of 128K (`context`,
/// which bounds prompts), while its trained `max_position_embeddings` stays 32K.
#[test]
fn rope_flags_extend_the_context() {
    let m = model(QWEN);
    let (so, _) = ok(&["info", "-m", m.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert_eq!(
        (v["context"].as_u64(), &v["config"]["rope_scaling"]),
        (Some(32768), &serde_json::Value::Null)
    );
    let yarn = [
        "--rope-scaling",
        "yarn",
        "--rope-scale",
        "4",
        "--yarn-orig-ctx",
        "32768",
    ];
    let args = [&["info", "-m", m.to_str().unwrap()][..], &yarn].concat();
    let (so, _) = ok(&args);
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert_eq!(v["context"], 131072);
    let r = &v["config"]["rope_scaling"];
    assert_eq!(
        (r["rope_type"].as_str(), r["factor"].as_f64()),
        (Some("yarn"), Some(4.0))
    );
    assert_eq!(r["original_max_position_embeddings"], 32768);
    assert!((r["attention_factor"].as_f64().unwrap() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    assert_eq!(v["config"]["max_position_embeddings"], 32768);
}

/// `--chat-template-file` replaces the model's template (also for a model without one) and
/// `--chat-template-kwargs` reaches it: Qwen 3's `enable_thinking: false` form adds its empty
/// `<think>` block to the prompt.
#[test]
fn chat_template_flags_shape_the_prompt() {
    let dir = temp_dir("cli-template");
    let file = dir.join("thinking.jinja");
    std::fs::write(
        &file,
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + \
         '<|im_end|>\\n' }}{%- endfor %}{{- '<|im_start|>assistant\\n' }}{%- if \
         enable_thinking is defined and enable_thinking is false %}{{- \
         '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    )
    .unwrap();
    let m = model(SMOLLM2);
    let prompt_tokens = |extra: &[&str]| -> u64 {
        let base = [
            "run",
            "-m",
            m.to_str().unwrap(),
            "--chat",
            "-p",
            "Hi",
            "-n",
            "1",
        ];
        let (so, _) = ok(&[&base[..], &["--json"], extra].concat());
        let v: serde_json::Value = serde_json::from_str(&so).unwrap();
        v["stats"]["prompt_tokens"].as_u64().unwrap()
    };
    let own = prompt_tokens(&[]);
    let given = prompt_tokens(&["--chat-template-file", file.to_str().unwrap()]);
    let off = prompt_tokens(&[
        "--chat-template-file",
        file.to_str().unwrap(),
        "--chat-template-kwargs",
        r#"{"enable_thinking": false}"#,
    ]);
    // SmolLM2's own template adds a default system message; the file's does not.
    assert!(given < own, "{given} vs {own}");
    // llama.cpp's built-in of that name writes the same turns as the file (without thinking).
    assert_eq!(prompt_tokens(&["--chat-template", "chatml"]), given);
    // A word that names no built-in is refused, not used as a template that drops the messages.
    let out = std::process::Command::new(keydiff_bin())
        .args(["run", "-m", m.to_str().unwrap(), "-p", "Hi", "-n", "1"])
        .args(["--chat-template", "mistral-v7"])
        .output()
        .unwrap();
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{se}");
    assert!(
        se.contains("`mistral-v7` is neither a Jinja template") && se.contains("chatml, llama3"),
        "{se}"
    );
    assert!(off > given, "{off} vs {given}");
    // llama.cpp's way to say the same.
    let budget = prompt_tokens(&[
        "--chat-template-file",
        file.to_str().unwrap(),
        "--reasoning-budget",
        "0",
    ]);
    assert_eq!(budget, off);
    // A template flag asks for the template: no --chat needed.
    let (so, _) = ok(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "Hi",
        "-n",
        "1",
        "--json",
        "--chat-template-file",
        file.to_str().unwrap(),
    ]);
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert_eq!(v["stats"]["prompt_tokens"].as_u64(), Some(given), "{v}");
    // The template writes `</think>`: with --json, the reasoning comes apart from the answer.
    let (so, _) = ok(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "--chat",
        "-p",
        "Is the sky blue?",
        "-n",
        "60",
        "--json",
        "--chat-template-file",
        file.to_str().unwrap(),
        "--grammar",
        r#"root ::= "<think>" [a-z ]{4,30} "</think>\n\n" [A-Z] [a-z ]{2,20} ".""#,
    ]);
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    let text = v["text"].as_str().unwrap();
    let (reasoning, content) = (v["reasoning_content"].as_str(), v["content"].as_str());
    let (reasoning, content) = (reasoning.unwrap(), content.unwrap());
    assert!(!reasoning.is_empty() && !content.is_empty(), "{v}");
    let split = keydiff::reasoning::split(text, false);
    assert_eq!(split.reasoning.as_deref(), Some(reasoning), "{v}");
    assert_eq!(split.content, content, "{v}");
    assert!(text.starts_with("<think>") && text.ends_with(content) && !content.contains("think"));
    // A model without a template chats with one given.
    let preset = root().join("configs/tiny-llama.json");
    ok(&[
        "run",
        "--random-weights",
        "-m",
        preset.to_str().unwrap(),
        "--chat",
        "-p",
        "hi",
        "-n",
        "2",
        "--chat-template-file",
        file.to_str().unwrap(),
    ]);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn chat_answers_and_json_stats() {
    let m = model(SMOLLM2);
    let (so, _) = ok(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "--system",
        "You are a helpful assistant.",
        "-p",
        "What is the capital of France? Answer in one word.",
        "-n",
        "16",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(so.trim()).unwrap();
    assert!(v["text"].as_str().unwrap().contains("Paris"), "{v}");
    let s = &v["stats"];
    for k in [
        "prompt_tokens",
        "ttft_s",
        "prefill_tok_s",
        "decode_tok_s",
        "peak_kv_bytes",
    ] {
        assert!(s[k].as_f64().unwrap() > 0.0, "{k} in {s}");
    }
}

/// `--kv-dtype f16` holds the cache in half the bytes, `q8_0` in 34/128, and `--cache-type-k`
/// gives the keys their own type (over `--kv-dtype`); the stats and `info` say so.
#[test]
fn kv_dtype_option() {
    let m = model(SMOLLM2);
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "run",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "The capital of France is",
            "-n",
            "8",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (so, _) = ok(&args);
        serde_json::from_str::<serde_json::Value>(so.trim()).unwrap()["stats"].clone()
    };
    let (f32s, f16s) = (run(&[]), run(&["--kv-dtype", "f16"]));
    assert_eq!(f32s["kv_dtype"], "f32");
    assert_eq!(f16s["kv_dtype"], "f16");
    let bytes = |s: &serde_json::Value| s["peak_kv_bytes"].as_u64().unwrap();
    assert_eq!(2 * bytes(&f16s), bytes(&f32s), "{f16s} vs {f32s}");
    let q8 = run(&["--kv-dtype", "q8_0"]);
    let split = run(&["--kv-dtype", "q8_0", "--cache-type-k", "f16"]);
    assert_eq!(q8["kv_dtype"], "q8_0");
    assert_eq!(split["kv_dtype"], "f16/q8_0");
    // SmolLM2's heads hold 64 values: 512 bytes a slot in f32, 136 in Q8_0, 128 + 68 split.
    assert_eq!(bytes(&q8) * 512, bytes(&f32s) * 136, "{q8}");
    assert_eq!(bytes(&split) * 512, bytes(&f32s) * 196, "{split}");
    // llama.cpp's smaller block types: 2 · 36 bytes a slot in Q4_0, 2 · 48 in Q5_1, 68 + 40
    // for Q8_0 keys beside Q4_1 values.
    for (flags, name, slot) in [
        (&["--kv-dtype", "q4_0"][..], "q4_0", 72),
        (&["--kv-dtype", "q5_1"][..], "q5_1", 96),
        (&["--ctk", "q8_0", "--ctv", "q4_1"][..], "q8_0/q4_1", 108),
    ] {
        let s = run(flags);
        assert_eq!(s["kv_dtype"], name);
        assert_eq!(bytes(&s) * 512, bytes(&f32s) * slot, "{s}");
    }
    let (so, _) = ok(&["info", "-m", m.to_str().unwrap(), "--kv-dtype", "bf16"]);
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert_eq!(v["kv_dtype"], "bf16");
    let (so, _) = ok(&["info", "-m", m.to_str().unwrap(), "--ctv", "q8_0"]);
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert_eq!(v["kv_dtype"], "f32/q8_0");
}

#[test]
fn streams_text_and_prints_timing_line() {
    let m = model(SMOLLM2);
    let (so, se) = ok(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "The capital of France is",
        "-n",
        "8",
    ]);
    assert!(!so.trim().is_empty());
    assert!(
        se.contains("TTFT") && se.contains("prefill") && se.contains("decode"),
        "{se}"
    );
}

#[test]
fn stop_string_ends_generation() {
    let m = model(SMOLLM2);
    let (so, _) = ok(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "--chat",
        "-p",
        "What is the capital of France? Answer in one word.",
        "-n",
        "16",
        "--json",
        "--stop",
        "Paris",
    ]);
    let v: serde_json::Value = serde_json::from_str(so.trim()).unwrap();
    assert!(!v["text"].as_str().unwrap().contains("Paris"), "{v}");
    assert_eq!(v["stats"]["stop_reason"], "stop_string", "{v}");

    // llama.cpp reads escapes in -p and --stop: `\n` is a line break (it used to be two
    // characters, and the reply ran on to -n); --no-escape takes them as written.
    let lines = |extra: &[&str]| {
        let base = ["run", "-m", m.to_str().unwrap(), "-n", "40", "--json"];
        let args = [
            &base[..],
            &["-p", "A list of fruits:\\n1. Apple\\n2."],
            extra,
        ]
        .concat();
        let (so, _) = ok(&args);
        let v: serde_json::Value = serde_json::from_str(so.trim()).unwrap();
        v
    };
    let v = lines(&["--stop", "\\n"]);
    assert_eq!(v["stats"]["stop_reason"], "stop_string", "{v}");
    assert!(!v["text"].as_str().unwrap().contains('\n'), "{v}");
    let escaped_prompt = v["stats"]["prompt_tokens"].clone();
    let v = lines(&["--no-escape", "--stop", "\\n"]);
    assert_ne!(v["stats"]["prompt_tokens"], escaped_prompt, "{v}");
    let out = std::process::Command::new(keydiff_bin())
        .args(["run", "-m", m.to_str().unwrap(), "-p", "x", "--stop", ""])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--stop must not be empty"));
}

#[test]
fn seeded_sampling_is_reproducible() {
    let m = model(SMOLLM2);
    let args = [
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "Once upon a time",
        "-n",
        "12",
        "--temp",
        "0.9",
        "--top-k",
        "40",
        "--top-p",
        "0.95",
        "--min-p",
        "0.05",
        "--seed",
        "42",
        "--json",
    ];
    let (a, _) = ok(&args);
    let (b, _) = ok(&args);
    let ta: serde_json::Value = serde_json::from_str(a.trim()).unwrap();
    let tb: serde_json::Value = serde_json::from_str(b.trim()).unwrap();
    assert_eq!(ta["text"], tb["text"]);
}

#[test]
fn perplexity_reports_json_and_truncation() {
    let m = model(SMOLLM2);
    let text = "The lighthouse keeper had lived on the island for almost thirty years, and in \
                that time he had learned to read the weather the way other people read the \
                morning paper.";
    let (so, _) = ok(&[
        "perplexity",
        "-m",
        m.to_str().unwrap(),
        "-p",
        text,
        "--chunk",
        "8",
        "--budget",
        "16",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(so.trim()).unwrap();
    let tokens = v["tokens"].as_u64().unwrap();
    assert!(tokens > 30, "{v}");
    assert_eq!(v["scored"].as_u64().unwrap(), tokens - 1);
    assert_eq!(v["policy"], "keydiff");
    assert!(v["evictions"].as_u64().unwrap() > 0, "{v}");
    let ppl = v["ppl"].as_f64().unwrap();
    let nll = v["mean_nll"].as_f64().unwrap();
    assert!((ppl - nll.exp()).abs() < 1e-9 * ppl && ppl > 1.0, "{v}");
    assert_eq!(v["ppl_by_quarter"].as_array().unwrap().len(), 4);
    assert_eq!(v["window"], 0.0);
    assert!(v["provenance"]["commit"].is_string(), "{v}");
    assert!(v["provenance"]["command"]
        .as_str()
        .unwrap()
        .contains("perplexity"));

    let (so, _) = ok(&[
        "perplexity",
        "-m",
        m.to_str().unwrap(),
        "-p",
        text,
        "--max-tokens",
        "10",
    ]);
    assert!(
        so.contains(&format!(
            "over 9 scored tokens (the first 10 of the text's {tokens} tokens)"
        )),
        "{so}"
    );
    // One scored token: no standard error, and three quarters with no token: `n/a`, not 1.
    let (so, _) = ok(&[
        "perplexity",
        "-m",
        m.to_str().unwrap(),
        "-p",
        text,
        "--max-tokens",
        "2",
    ]);
    assert!(so.contains("± n/a") && !so.contains("NaN"), "{so}");
    let quarters = so.split("by quarter: ").nth(1).unwrap();
    let quarters: Vec<&str> = quarters.split(" | ").next().unwrap().split(' ').collect();
    assert_eq!(quarters.len(), 4, "{so}");
    assert_eq!(quarters.iter().filter(|q| **q == "n/a").count(), 3, "{so}");
}

/// A closed pipe on stdout (`keydiff ... | head -c 3`) ends the process as it ends
/// llama.cpp's tools (SIGPIPE), neither with a panic nor after generating for no reader.
#[test]
fn a_closed_stdout_ends_the_process_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let m = model(SMOLLM2);
    let m = m.to_str().unwrap();
    for args in [
        &["tokenize", "-m", m, "-p", "hello"][..],
        &[
            "run",
            "-m",
            m,
            "-p",
            "Once upon a time",
            "-n",
            "400",
            "--ignore-eos",
        ],
    ] {
        let mut child = Command::new(keydiff_bin())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = child.stdout.take().unwrap();
        if args[0] == "run" {
            // The reader goes away after the first bytes of the reply.
            let mut first = [0u8; 3];
            stdout.read_exact(&mut first).unwrap();
        }
        drop(stdout);
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(
            out.status.signal(),
            Some(13),
            "{args:?}: {:?} {err}",
            out.status
        );
        // Ended by the signal, `run` never printed its closing stats line.
        assert!(!err.contains("TTFT"), "{args:?}: {err}");
    }
}

/// `-f FILE` reads the prompt without the line break that ends the file (llama.cpp's `-f`);
/// `--parse-special` reads special-token text as the special tokens (llama-cli's way).
#[test]
fn prompt_file_and_special_tokens() {
    let dir = temp_dir("cli-prompt-file");
    let m = model(SMOLLM2);
    let m = m.to_str().unwrap();
    let prompt_tokens = |extra: &[&str]| -> u64 {
        let (so, _) = ok(&[&["run", "-m", m, "-n", "1", "--json"][..], extra].concat());
        let v: serde_json::Value = serde_json::from_str(&so).unwrap();
        v["stats"]["prompt_tokens"].as_u64().unwrap()
    };
    let file = dir.join("prompt.txt");
    std::fs::write(&file, "Once upon a time\n").unwrap();
    let from_file = prompt_tokens(&["-f", file.to_str().unwrap()]);
    assert_eq!(from_file, prompt_tokens(&["-p", "Once upon a time"]));
    std::fs::write(&file, "Once upon a time\n\n").unwrap();
    assert_eq!(
        prompt_tokens(&["-f", file.to_str().unwrap()]),
        prompt_tokens(&["-p", "Once upon a time\n"]),
        "only one line break is left out"
    );
    let chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    let plain = prompt_tokens(&["-p", chat]);
    let parsed = prompt_tokens(&["-p", chat, "--parse-special"]);
    // Each of the 4 special tokens is one token, not its text's several.
    assert!(parsed + 4 < plain, "{parsed} vs {plain}");
    let (so, _) = ok(&["tokenize", "-m", m, "-p", chat, "--parse-special"]);
    let ids: Vec<u64> = serde_json::from_str(&so).unwrap();
    assert_eq!(ids.len() as u64, parsed);
    // tokenize reads -f as run does.
    std::fs::write(&file, "Once upon a time\n").unwrap();
    let (a, _) = ok(&["tokenize", "-m", m, "-f", file.to_str().unwrap()]);
    let (b, _) = ok(&["tokenize", "-m", m, "-p", "Once upon a time"]);
    assert_eq!(a, b);
    std::fs::remove_dir_all(dir).ok();
}

/// `perplexity -c W --stride S` scores in windows; a text beyond the model's context is
/// scored in windows of the context, not refused or cut.
#[test]
fn perplexity_in_windows() {
    let m = model(SMOLLM2);
    let text = "The lighthouse keeper had lived on the island for almost thirty years, and in \
                that time he had learned to read the weather the way other people read the \
                morning paper.";
    let json = |args: &[&str]| -> serde_json::Value {
        let (so, _) = ok(args);
        serde_json::from_str(so.trim()).unwrap()
    };
    let m = m.to_str().unwrap();
    let base = ["perplexity", "-m", m, "-p", text, "--chunk", "8", "--json"];
    let one = json(&base);
    let tokens = one["tokens"].as_u64().unwrap();
    assert_eq!(
        (one["windows"].as_u64(), one["stride"].as_u64()),
        (Some(1), None)
    );
    let v = json(&[&base[..], &["-c", "16", "--stride", "8"]].concat());
    assert_eq!(v["scored"].as_u64().unwrap(), tokens - 1, "{v}");
    assert_eq!(
        v["windows"].as_u64().unwrap(),
        (tokens - 16).div_ceil(8) + 1,
        "{v}"
    );
    assert_eq!(
        (v["ctx_size"].as_u64(), v["stride"].as_u64()),
        (Some(16), Some(8))
    );
    // Tokens beyond the first window see at most 15 tokens before them, not all.
    assert_ne!(v["ppl"], one["ppl"]);
    let (so, _) = ok(&[
        "perplexity",
        "-m",
        m,
        "-p",
        text,
        "-c",
        "16",
        "--stride",
        "4",
    ]);
    assert!(so.contains(" windows of 16 tokens, 4 apart"), "{so}");

    // A random model with a context of 48: the text is scored in windows of 48, 24 apart.
    let cfg = std::fs::read_to_string(keydiff_tests::root().join("configs/tiny-qwen.json"))
        .unwrap()
        .replace(
            "\"max_position_embeddings\": 32768",
            "\"max_position_embeddings\": 48",
        );
    let path = std::env::temp_dir().join(format!("keydiff-ctx48-{}.json", std::process::id()));
    std::fs::write(&path, cfg).unwrap();
    let p = path.to_str().unwrap();
    let v = json(&[
        "perplexity",
        "--random-weights",
        "-m",
        p,
        "-p",
        text,
        "--json",
    ]);
    let tokens = v["tokens"].as_u64().unwrap();
    assert!(tokens > 60, "{v}");
    assert_eq!(v["scored"].as_u64().unwrap(), tokens - 1, "{v}");
    assert_eq!(
        (v["ctx_size"].as_u64(), v["stride"].as_u64()),
        (Some(48), Some(24))
    );
    assert_eq!(
        v["windows"].as_u64().unwrap(),
        (tokens - 48).div_ceil(24) + 1,
        "{v}"
    );
    let out = Command::new(keydiff_bin())
        .args([
            "perplexity",
            "--random-weights",
            "-m",
            p,
            "-p",
            text,
            "-c",
            "49",
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("window of 49 tokens is beyond the model's context of 48"),
        "{err}"
    );
}

/// `run --json --logprobs K`: one entry per generated token with K alternatives, the greedy
/// token first among them; `--logprobs` without `--json`, or above 20, is refused.
#[test]
fn run_reports_logprobs_in_json() {
    let m = model(SMOLLM2);
    let m = m.to_str().unwrap();
    let args = [
        "run",
        "-m",
        m,
        "-p",
        "The capital of France is",
        "-n",
        "4",
        "--json",
    ];
    let (so, _) = ok(&[&args[..], &["--logprobs", "3"]].concat());
    let v: serde_json::Value = serde_json::from_str(so.trim()).unwrap();
    let lps = v["logprobs"].as_array().unwrap();
    assert_eq!(
        lps.len() as u64,
        v["stats"]["generated_tokens"].as_u64().unwrap()
    );
    let mut text = String::new();
    for lp in lps {
        let top = lp["top"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{lp}");
        assert_eq!(top[0]["id"], lp["id"], "greedy picks the most likely: {lp}");
        assert!(lp["logprob"].as_f64().unwrap() <= 0.0);
        text.push_str(lp["text"].as_str().unwrap());
    }
    assert!(
        text.starts_with(v["text"].as_str().unwrap()),
        "{text:?} vs {v}"
    );
    let (plain, _) = ok(&args);
    let plain: serde_json::Value = serde_json::from_str(plain.trim()).unwrap();
    assert!(plain.get("logprobs").is_none());
    for (extra, msg) in [
        (&["--logprobs", "21"][..], "at most 20"),
        (&["--logprobs"][..], "a value is required"),
    ] {
        let out = Command::new(keydiff_bin())
            .args([&args[..], extra].concat())
            .output()
            .unwrap();
        let se = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && se.contains(msg), "{extra:?}: {se}");
    }
    let out = Command::new(keydiff_bin())
        .args(["run", "-m", m, "-p", "Hi", "--logprobs", "2"])
        .output()
        .unwrap();
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && se.contains("--json"), "{se}");
}

/// `--logit-bias`: banning the greedy first token gives the runner-up, a +100 bias forces the
/// third, and the reported logprobs stay the model's; bad forms and ids are refused.
#[test]
fn logit_bias_bans_and_forces() {
    let m = model(SMOLLM2);
    let m = m.to_str().unwrap();
    let args = [
        "run",
        "-m",
        m,
        "-p",
        "The capital of France is",
        "-n",
        "1",
        "--json",
        "--logprobs",
        "3",
    ];
    let first = |extra: &[&str]| -> serde_json::Value {
        let (so, _) = ok(&[&args[..], extra].concat());
        let v: serde_json::Value = serde_json::from_str(so.trim()).unwrap();
        v["logprobs"][0].clone()
    };
    let plain = first(&[]);
    let top: Vec<u64> = plain["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    assert_eq!(plain["id"].as_u64(), Some(top[0]));
    let ban = format!("{}-inf", top[0]);
    let banned = first(&["--logit-bias", &ban]);
    assert_eq!(banned["id"].as_u64(), Some(top[1]), "{banned}");
    assert_eq!(banned["top"], plain["top"], "logprobs are the model's");
    let force = format!("{}+100", top[2]);
    let forced = first(&["-l", &ban, "-l", &force]);
    assert_eq!(forced["id"].as_u64(), Some(top[2]), "{forced}");
    for (bias, msg) in [
        ("12", "expected TOKEN_ID+BIAS"),
        ("x+1", "expected TOKEN_ID+BIAS"),
        ("-5+1", "expected TOKEN_ID+BIAS"),
        ("5+inf", "a number or -inf"),
        ("99999999+1", "outside the vocabulary of 49152"),
    ] {
        let out = Command::new(keydiff_bin())
            .args([&args[..], &[format!("--logit-bias={bias}").as_str()]].concat())
            .output()
            .unwrap();
        let se = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && se.contains(msg), "{bias}: {se}");
    }
}

/// `--format json`: the reply is one JSON object, ended by the model; with `--ignore-eos`
/// it is refused.
#[test]
fn format_json_gives_one_object() {
    let m = model(SMOLLM2);
    let args = [
        "run",
        "-m",
        m.to_str().unwrap(),
        "--chat",
        "-p",
        "Describe a cat named Tom (3 years old, grey) as JSON with keys name, age, colour.",
        "-n",
        "96",
        "--format",
        "json",
        "--json",
    ];
    let (so, _) = ok(&args);
    let v: serde_json::Value = serde_json::from_str(so.trim()).unwrap();
    let reply: serde_json::Value = serde_json::from_str(v["text"].as_str().unwrap()).unwrap();
    assert!(reply.is_object(), "{v}");
    assert_eq!(v["stats"]["stop_reason"], "eos", "{v}");
    let out = Command::new(keydiff_bin())
        .args([&args[..], &["--ignore-eos"]].concat())
        .output()
        .unwrap();
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && se.contains("JSON mode"), "{se}");
}

/// `check-device` on the CPU (the GPU host runs it on CUDA, scripts/gpu-check.sh): against
/// the CPU reference, the logits agree; with `--batch`, every batched and mixed segment
/// equals its sequence alone, for the full cache and evicting policies, one JSON line each.
#[test]
fn check_device_runs_on_the_cpu() {
    let root = keydiff_tests::root();
    let (llama, qwen) = (
        root.join("configs/tiny-llama.json"),
        root.join("configs/tiny-qwen.json"),
    );
    let run = |args: &[&str]| -> Vec<serde_json::Value> {
        let mut all = vec!["check-device", "--device", "cpu", "--dtype", "f32"];
        all.extend(["--preset", llama.to_str().unwrap()]);
        all.extend(["--preset", qwen.to_str().unwrap()]);
        all.extend(args);
        let (out, _) = ok(&all);
        out.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let lines = run(&["--prompt-len", "100", "--chunk", "32", "--budget", "48"]);
    assert_eq!(
        lines.len(),
        2 * 2,
        "two presets, full and keydiff: {lines:?}"
    );
    for l in &lines {
        assert!(l["diff"]["cosine"].as_f64().unwrap() > 0.9999, "{l}");
        assert_eq!(l["top1_equal"], true, "{l}");
    }
    // The last 40 tokens as decode steps (decode-time eviction every 32 past N = 48).
    let lines = run(&[
        "--prompt-len",
        "100",
        "--chunk",
        "32",
        "--budget",
        "48",
        "--decode-steps",
        "40",
        "--policies",
        "keydiff,h2o",
    ]);
    assert_eq!(
        lines.len(),
        2 * 3,
        "two presets, full, keydiff, h2o: {lines:?}"
    );
    for l in &lines {
        assert_eq!(l["decode_steps"], 40, "{l}");
        assert!(l["diff"]["cosine"].as_f64().unwrap() > 0.9999, "{l}");
        assert_eq!(l["top1_equal"], true, "{l}");
    }
    let out = Command::new(keydiff_bin())
        .args(["check-device", "--device", "cpu", "--preset"])
        .arg(&llama)
        .args(["--prompt-len", "10", "--decode-steps", "10"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("10 decode steps need a prompt of more tokens than that, not 10"),
        "{err}"
    );
    let lines = run(&["--batch", "--policies", "keydiff,h2o"]);
    assert_eq!(
        lines.len(),
        2 * 3,
        "two presets, full, keydiff, h2o: {lines:?}"
    );
    let policies: Vec<&str> = lines
        .iter()
        .map(|l| l["policy"].as_str().unwrap())
        .collect();
    assert_eq!(&policies[..3], ["full", "keydiff", "h2o"]);
    for l in &lines {
        assert_eq!(l["check"], "batch");
        assert_eq!(l["pass"], true, "{l}");
        assert_eq!(l["segments"].as_array().unwrap().len(), 3 + 5, "{l}");
        assert!(l["max_rel"].as_f64().unwrap() < 1e-5, "{l}");
    }
}

/// `--weight-type`: random weights quantized as a GGUF file of that type holds them. `run`
/// generates with them, `info` names the type (its provenance, each linear's stored type, the
/// planned bytes held); `check-device` reports it per line; a type the preset's widths cannot
/// hold, an unknown type, and the flag on a model file are refused by name.
#[test]
fn weight_type_quantizes_random_weights() {
    let root = keydiff_tests::root();
    let d64 = root.join("configs/tiny-qwen-d64.json");
    let (out, _) = ok(&[
        "check-device",
        "--device",
        "cpu",
        "--dtype",
        "bf16",
        "--weight-type",
        "q4_k",
        "--preset",
        d64.to_str().unwrap(),
        "--prompt-len",
        "100",
        "--chunk",
        "32",
        "--budget",
        "48",
        "--policies",
        "h2o",
    ]);
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "full and h2o: {lines:?}");
    for l in &lines {
        assert_eq!(l["weights"], "q4_k", "{l}");
        assert!(l["diff"]["cosine"].as_f64().unwrap() > 0.999, "{l}");
    }
    ok(&[
        "run",
        "--random-weights",
        "-m",
        d64.to_str().unwrap(),
        "--weight-type",
        "q5_k",
        "-p",
        "hello",
        "-n",
        "3",
    ]);
    let (so, _) = ok(&[
        "info",
        "--random-weights",
        "-m",
        d64.to_str().unwrap(),
        "--weight-type",
        "Q6_K",
    ]);
    let info: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert!(
        info["origin"]
            .as_str()
            .unwrap()
            .contains("random weights in q6_k"),
        "{info}"
    );
    assert_eq!(info["weights"]["ffn_down"], "Q6K", "{info}");
    assert_eq!(
        info["memory"]["weight_bytes"], info["memory"]["planned_weight_bytes"],
        "{info}"
    );
    let fails = |args: &[&str], want: &[&str]| {
        let out = Command::new(keydiff_bin()).args(args).output().unwrap();
        let se = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        for w in want {
            assert!(se.contains(w), "{args:?}: {se}");
        }
    };
    let llama = root.join("configs/tiny-llama.json");
    let base = ["run", "--random-weights", "-p", "hi", "-n", "1", "-m"];
    fails(
        &[
            &base[..],
            &[llama.to_str().unwrap(), "--weight-type", "q4_k"],
        ]
        .concat(),
        &["q_proj.weight", "not whole", "256"],
    );
    fails(
        &[&base[..], &[llama.to_str().unwrap(), "--weight-type", "q9"]].concat(),
        &["weight type `q9`", "q4_0"],
    );
    let m = model(SMOLLM2);
    fails(
        &[
            "run",
            "-m",
            m.to_str().unwrap(),
            "--weight-type",
            "q4_0",
            "-p",
            "hi",
        ],
        &["--weight-type q4_0 applies to --random-weights only"],
    );
}

/// `--grammar` and `-j/--json-schema`: the reply is a whole text of the grammar, a value of
/// the schema; a bad grammar, an unsupported schema keyword and a missing file are refused
/// before the model loads, by name.
#[test]
fn grammar_and_json_schema_constrain_the_reply() {
    let m = model(SMOLLM2);
    let run = |extra: &[&str]| {
        let base = [
            "run",
            "-m",
            m.to_str().unwrap(),
            "--chat",
            "-p",
            "Describe a cat named Tom (3 years old, grey) as JSON.",
            "-n",
            "96",
            "--json",
        ];
        Command::new(keydiff_bin())
            .args([&base[..], extra].concat())
            .output()
            .unwrap()
    };
    let out = run(&["--grammar", "root ::= \"Tom is \" [0-9] \" years old.\""]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = v["text"].as_str().unwrap();
    assert!(
        text.len() == 19 && text.starts_with("Tom is ") && text.ends_with(" years old."),
        "{text:?}"
    );
    assert_eq!(v["stats"]["stop_reason"], "eos", "{v}");
    let schema = r#"{"type": "object", "properties": {"name": {"type": "string"},
                     "age": {"type": "integer"}}, "required": ["name", "age"]}"#;
    let out = run(&["-j", schema]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let reply: serde_json::Value = serde_json::from_str(v["text"].as_str().unwrap()).unwrap();
    let keys: Vec<&String> = reply.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["name", "age"], "{reply}");
    assert!(reply["age"].is_i64(), "{reply}");
    for (extra, want) in [
        (
            &["--grammar", "root ::= answer"][..],
            "grammar: rule `answer` is used (line 1) but not defined",
        ),
        (
            &["-j", r#"{"type": "string", "pattern": "(?=a)"}"#],
            "lookarounds and group flags are not supported",
        ),
        (&["-j", "{nope"], "--json-schema is not JSON"),
        (
            &["--grammar-file", "/nonexistent/g.gbnf"],
            "cannot read the grammar file /nonexistent/g.gbnf",
        ),
        (
            &["--grammar", "root ::= \"a\"", "--format", "json"],
            "cannot be used with",
        ),
    ] {
        let out = run(extra);
        let se = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && se.contains(want),
            "{extra:?}: {se}"
        );
    }
}

#[test]
fn suffix_fills_in_the_middle() {
    let run = |m: &str| {
        Command::new(keydiff_bin())
            .args([
                "run",
                "-m",
                model(m).to_str().unwrap(),
                "--json",
                "-n",
                "16",
            ])
            .args([
                "-p",
                "def add(a, b):\n    return ",
                "--suffix",
                "\n\nprint(add(2, 3))\n",
            ])
            .output()
            .unwrap()
    };
    let out = run(QWEN);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = v["text"].as_str().unwrap();
    assert!(text.starts_with("a + b"), "{text:?}");
    let out = run(SMOLLM2);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no fill-in-the-middle tokens"), "{err}");
}

#[test]
fn tools_are_called_from_the_command_line() {
    let dir = keydiff_tests::temp_dir("cli-tools");
    let tools = dir.join("tools.json");
    std::fs::write(
        &tools,
        r#"[{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}}]"#,
    )
    .unwrap();
    // An empty list is named as such (it was blamed on the --tool-choice never given).
    let empty = dir.join("empty.json");
    std::fs::write(&empty, "[]").unwrap();
    let out = Command::new(keydiff_bin())
        .args(["run", "-m", model(QWEN).to_str().unwrap(), "-p", "hi"])
        .args(["--tools", empty.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(se.contains("the file declares no functions"), "{se}");
    let run = |m: &str, extra: &[&str]| {
        Command::new(keydiff_bin())
            .args(["run", "-m", model(m).to_str().unwrap(), "-n", "48"])
            .args(["--tools", tools.to_str().unwrap()])
            .args(["-p", "What is the weather like in Paris today?"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(QWEN, &["--tool-choice", "required", "--json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["text"].as_str().unwrap().starts_with("<tool_call>"),
        "{v}"
    );
    let call = &v["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{v}");
    let args: serde_json::Value =
        serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args["city"], "Paris", "{v}");
    // Text mode names the call on stderr.
    let out = run(QWEN, &["--tool-choice", "get_weather"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tool call: get_weather {\"city\":\"Paris\""),
        "{err}"
    );
    // What cannot be honoured is refused, naming it.
    for (m, extra, want) in [
        (SMOLLM2, &[][..], "writes no function calls"),
        (
            QWEN,
            &["--tool-choice", "later"][..],
            "`later`, which is not among",
        ),
        (
            QWEN,
            &["--format", "json"][..],
            "--format, --grammar and --json-schema",
        ),
    ] {
        let out = run(m, extra);
        assert!(!out.status.success(), "{extra:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{extra:?}: {err}");
    }
    std::fs::write(&tools, "{\"type\": \"function\"}").unwrap();
    let out = run(QWEN, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("expected a JSON array of tools"), "{err}");
}

/// `run --prompt-cache FILE` (llama.cpp's flags): the first run makes the file with the
/// prompt's evicted cache; a run whose prompt extends it prefills only what it adds, with the
/// text and stats that the library's continued cache gives (`cache_file.rs` checks those
/// against the cache kept in memory); `--prompt-cache-ro` leaves the file as it is; other
/// cache settings are refused, naming the file and both settings.
#[test]
fn prompt_cache_file_skips_the_saved_prefill() {
    let m = model(SMOLLM2);
    let dir = temp_dir("cli-prompt-cache");
    let file = dir.join("doc.kv");
    let doc = "The lighthouse keeper wrote in his log every evening. ".repeat(12);
    let run = |prompt: &str, extra: &[&str]| -> (serde_json::Value, String) {
        let mut args = vec![
            "run",
            "-m",
            m.to_str().unwrap(),
            "--budget",
            "64",
            "--chunk",
            "16",
            "-p",
            prompt,
            "-n",
            "6",
            "--json",
            "--prompt-cache",
            file.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let (so, se) = ok(&args);
        (serde_json::from_str(so.trim()).unwrap(), se)
    };
    let (first, se) = run(&doc, &[]);
    let n = first["stats"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(first["stats"]["prefix_tokens"], 0);
    assert!(first["stats"]["eviction"]["evictions"].as_u64().unwrap() > 0);
    assert!(
        se.contains(&format!("saved {n} tokens (64 slots per layer and KV head")),
        "{se}"
    );
    let saved = std::fs::read(&file).unwrap();

    let question = format!("{doc}What did the keeper write?");
    let (second, se) = run(&question, &["--prompt-cache-ro"]);
    assert_eq!(
        second["stats"]["prefix_tokens"].as_u64().unwrap(),
        n,
        "{se}"
    );
    assert!(second["stats"]["prompt_tokens"].as_u64().unwrap() > n);
    assert!(se.contains(&format!("{n} of ")), "{se}");
    assert!(!se.contains("saved"), "{se}");
    assert_eq!(
        std::fs::read(&file).unwrap(),
        saved,
        "--prompt-cache-ro wrote"
    );
    // The same again: the same answer from the same file.
    let (third, _) = run(&question, &["--prompt-cache-ro"]);
    assert_eq!(third["text"], second["text"]);

    let out = Command::new(keydiff_bin())
        .args([
            "run",
            "-m",
            m.to_str().unwrap(),
            "--budget",
            "128",
            "--chunk",
            "16",
            "-p",
            &question,
            "-n",
            "2",
            "--prompt-cache",
            file.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("KV cache file {}", file.display()))
            && err.contains("made under policy keydiff, budget 64, chunk 16")
            && err.contains("this run has policy keydiff, budget 128"),
        "{err}"
    );
}

/// `-c/--ctx-size N` (llama.cpp's): the context is N tokens, prompt and output together.
/// Generation stops there (a full cache holds N slots at most), a longer prompt is refused
/// naming the flag, and a context beyond the model's is refused at load.
#[test]
fn ctx_size_bounds_the_context() {
    let m = model(SMOLLM2);
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "-m", m.to_str().unwrap(), "--json"];
        args.extend_from_slice(extra);
        Command::new(keydiff_bin()).args(&args).output().unwrap()
    };
    // A run that must succeed: its `--json` stats.
    let stats = |extra: &[&str]| -> serde_json::Value {
        let out = run(extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{extra:?}: {err}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["stats"].clone()
    };
    let s = &stats(&["-c", "24", "-p", "Once upon a time", "-n", "64"]);
    assert_eq!(s["stop_reason"], "context", "{s}");
    let (prompt, generated) = (
        s["prompt_tokens"].as_u64().unwrap(),
        s["generated_tokens"].as_u64().unwrap(),
    );
    assert_eq!(prompt + generated, 24, "{s}");
    // 30 layers × 3 KV heads × 64 × K and V × 4 bytes a slot, 24 slots.
    assert_eq!(
        s["peak_kv_bytes"].as_u64(),
        Some(24 * 30 * 3 * 64 * 2 * 4),
        "{s}"
    );
    // A prompt that fills the context leaves no room: nothing is generated.
    let s = &stats(&["-c", "4", "-p", "Once upon a time", "-n", "8"]);
    assert_eq!(s["prompt_tokens"], 4, "{s}");
    assert_eq!(s["generated_tokens"], 0, "{s}");
    assert_eq!(s["stop_reason"], "context", "{s}");
    // 0 is the model's context.
    let out = run(&["-c", "0", "-p", "Once upon a time", "-n", "8"]);
    assert!(out.status.success());
    for (extra, want) in [
        (
            ["-c", "4", "-p", "Once upon a time, far away"],
            "beyond the context set to run with (-c/--ctx-size) of 4",
        ),
        (
            ["-c", "9000", "-p", "Once upon a time"],
            "a context of 9000 tokens is beyond this model's 8192",
        ),
    ] {
        let out = run(&extra);
        assert!(!out.status.success(), "{extra:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{extra:?}: {err}");
    }
}

/// `chat --prompt-cache FILE`: a conversation saved after each turn goes on in a later
/// process, whose reply to the next message is the one a single session gives; a different
/// `--system` is refused.
#[test]
fn chat_resumes_a_saved_conversation() {
    use std::io::Write;
    let m = model(SMOLLM2);
    let dir = temp_dir("cli-chat-resume");
    let file = dir.join("chat.kv");
    let chat_as = |system: &str, input: &str, extra: &[&str]| {
        let mut args = vec![
            "chat",
            "-m",
            m.to_str().unwrap(),
            "--budget",
            "64",
            "--chunk",
            "16",
            "-n",
            "12",
            "--system",
            system,
        ];
        args.extend_from_slice(extra);
        let mut child = Command::new(keydiff_bin())
            .args(&args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let chat = |input: &str, extra: &[&str]| chat_as("You are brief.", input, extra);
    let (q1, q2) = (
        "Name three colours of the rainbow, and say which one is between the other two.",
        "And the other colours?",
    );
    let both = chat(&format!("{q1}\n{q2}\n"), &[]);
    assert!(both.status.success());
    let replies: Vec<String> = String::from_utf8_lossy(&both.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let f = file.to_str().unwrap();
    let first = chat(&format!("{q1}\n"), &["--prompt-cache", f]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(String::from_utf8_lossy(&first.stderr).contains("saved to"));
    let second = chat(&format!("{q2}\n"), &["--prompt-cache", f]);
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{err}");
    assert!(
        err.contains("resumed the conversation") && err.contains("3 messages"),
        "{err}"
    );
    let reply = String::from_utf8_lossy(&second.stdout)
        .trim_end()
        .to_string();
    assert_eq!(Some(&reply), replies.last(), "{replies:?}");
    let other = chat_as("Be long.", &format!("{q2}\n"), &["--prompt-cache", f]);
    assert!(!other.status.success());
    assert!(String::from_utf8_lossy(&other.stderr).contains("--system differs"));
}

/// `run --spec-type ngram`: the same text as without, under a budget that evicts in decode;
/// the JSON stats and the timing line report the drafts. `--draft-max` without
/// `--spec-type`, and `serve --spec-exact` with `--max-batch` above 1, are refused.
#[test]
fn spec_type_ngram_gives_the_same_text_in_fewer_passes() {
    let m = model(SMOLLM2);
    let prompt = "The committee met on Tuesday to review the budget. The treasurer reported \
        that spending on the library had risen by twelve percent.\n\nThe same sentences \
        again:\n\nThe committee met on Tuesday";
    let base = [
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        prompt,
        "-n",
        "40",
        "--budget",
        "32",
        "--chunk",
        "16",
        "--json",
    ];
    let json = |extra: &[&str]| -> serde_json::Value {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&args).0).unwrap()
    };
    let plain = json(&[]);
    let spec = json(&["--spec-type", "ngram", "--draft-max", "6"]);
    assert_eq!(plain["text"], spec["text"]);
    let c = &spec["stats"]["speculative"];
    assert!(c["accepted"].as_u64().unwrap() > 0, "{c}");
    assert!(
        c["drafted"].as_u64().unwrap() <= 6 * c["passes"].as_u64().unwrap(),
        "{c}"
    );
    assert!(plain["stats"].get("speculative").is_none());
    let (_, err) = ok(&base[..base.len() - 1]
        .iter()
        .copied()
        .chain(["--spec-type", "ngram"])
        .collect::<Vec<_>>());
    assert!(err.contains("drafted tokens accepted"), "{err}");
    let m = m.to_str().unwrap();
    for (args, want) in [
        (
            vec!["run", "-m", m, "-p", "Hi", "--draft-max", "4"],
            "--spec-type <TYPE>",
        ),
        (
            vec![
                "run",
                "-m",
                m,
                "-p",
                "Hi",
                "--spec-type",
                "none",
                "--spec-exact",
            ],
            "need --spec-type ngram",
        ),
        (
            vec![
                "serve",
                "-m",
                m,
                "--spec-type",
                "ngram",
                "--spec-exact",
                "--max-batch",
                "2",
            ],
            "it needs --max-batch 1",
        ),
        (
            vec![
                "run",
                "-m",
                m,
                "-p",
                "Hi",
                "--spec-type",
                "ngram",
                "--draft-max",
                "0",
            ],
            "a draft of 0 tokens",
        ),
    ] {
        let out = Command::new(keydiff_bin()).args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// `scripts/gpu-results.py` turns a GPU check's summary into the results page: on the first
/// hardware run's summary (bench/results/2026-12-04-gpu-check), one row per check with its
/// result and detail (a failure counted, `FAILED` read as FAIL), the binary's commit, and the
/// summary verbatim; a path without a summary is refused.
#[test]
fn gpu_results_page_lists_every_check_of_a_summary() {
    let script = root().join("scripts/gpu-results.py");
    let run = |arg: &std::path::Path| {
        Command::new("python3")
            .arg(&script)
            .arg(arg)
            .output()
            .expect("python3 runs")
    };
    let out = run(&root().join("bench/results/2026-12-04-gpu-check"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = String::from_utf8(out.stdout).unwrap();
    for row in [
        "| kernels | PASS |  |",
        "| parity | FAIL |  |",
        "| flash parity | not run | this binary was built without the flash-attn feature |",
        "| prefix reuse | PASS | 26/26 records identical, 26 started from a prefix |",
        "| sanitizer racecheck (keydiff_* kernels) | PASS |",
        "12 checks, 1 failed.",
        "- **Machine**: NVIDIA H200, 580.159.04, 143771 MiB.",
        "commit `86a43846439b-dirty`",
        "- **Wall time**: 269s for the check.",
    ] {
        assert!(page.contains(row), "missing {row:?} in:\n{page}");
    }
    // Facts are not checks, and the summary follows verbatim.
    assert!(!page.contains("| elapsed |") && !page.contains("| memory plan |"));
    let summary =
        std::fs::read_to_string(root().join("bench/results/2026-12-04-gpu-check/summary.txt"))
            .unwrap();
    assert!(page.contains(summary.trim_end()), "{page}");
    // Failures in every form the check writes, a run that recorded its start and was stopped
    // by the time limit (no `elapsed:`; the device script's log has the exit), as the device
    // script packs it: gc/summary.txt and gc.log in a .tgz.
    let dir = temp_dir("gpu-results");
    std::fs::create_dir_all(dir.join("gc")).unwrap();
    std::fs::write(
        dir.join("gc/summary.txt"),
        "started: 2026-12-05T06:00:00Z\ngpu: NVIDIA H200\nparity (CPU f32 reference):\n\
         memory plan: keydiff info FAILED (exit 1)\nprefix reuse (bf16): could not compare\n\
         sanitizer racecheck (x): exit 3\nsanitizer memcheck (all): timed out after 60 s (not \
         a failure)\nbatch: FAILED (exit 124); see errors.log\nkernels: PASS (15 cases)\n",
    )
    .unwrap();
    std::fs::write(dir.join("gc.log"), "...\ngpu-check exit: 124\n").unwrap();
    let tgz = dir.join("gpu-check.tgz");
    let tar = Command::new("tar")
        .arg("czf")
        .arg(&tgz)
        .arg("-C")
        .arg(&dir)
        .args(["gc", "gc.log"])
        .status()
        .unwrap();
    assert!(tar.success());
    for arg in [tgz.clone(), dir.join("gc")] {
        let page = String::from_utf8(run(&arg).stdout).unwrap();
        assert!(page.starts_with("# GPU check, 2026-12-05\n"), "{page}");
        for row in [
            "| memory plan | FAIL | keydiff info FAILED (exit 1) |",
            "| prefix reuse (bf16) | FAIL | could not compare |",
            "| sanitizer racecheck (x) | FAIL | exit 3 |",
            "| sanitizer memcheck (all) | timed out | after 60 s (not a failure) |",
            "| batch | FAIL | (exit 124); see errors.log |",
            "| kernels | PASS | 15 cases |",
            "6 checks, 4 failed.",
            "**the check did not finish** (no `elapsed:` line; it exited with 124",
        ] {
            assert!(page.contains(row), "missing {row:?} in:\n{page}");
        }
        assert!(
            !page.contains("| parity (CPU"),
            "a heading is not a check: {page}"
        );
    }
    // summary.txt alone: no log, so no exit to report.
    let page = String::from_utf8(run(&dir.join("gc/summary.txt")).stdout).unwrap();
    assert!(page.contains("(no `elapsed:` line): the steps"), "{page}");
    let none = run(&root().join("configs"));
    assert!(!none.status.success());
    assert!(String::from_utf8_lossy(&none.stderr).contains("no summary.txt in it"));
}

/// `keydiff devices` lists the CPU and what CUDA has to say: in a build without CUDA, the
/// feature to build with (the table and the JSON agree).
#[test]
fn devices_lists_the_cpu_and_why_there_is_no_gpu() {
    let (version, _) = ok(&["--version"]);
    let (table, _) = ok(&["devices"]);
    assert!(
        table.contains(&format!(
            "keydiff {}",
            version.trim().trim_start_matches("keydiff ")
        )),
        "{table}"
    );
    let threads = std::thread::available_parallelism().unwrap().get();
    assert!(
        table.contains(&format!("cpu      {threads} threads")),
        "{table}"
    );
    let (json, _) = ok(&["devices", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["cpu"]["threads"], threads);
    if version.contains("features: cuda") {
        // A CUDA build: a line per device, or one saying why there is none.
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("cuda:0 ") || l.starts_with("cuda     none: ")),
            "{table}"
        );
        return;
    }
    let why = "this keydiff was built without CUDA; build it with `--features cuda`";
    assert!(table.contains(&format!("cuda     none: {why}")), "{table}");
    assert!(v["cuda_error"].as_str().unwrap().starts_with(why), "{v}");
    assert_eq!(v["cuda"], serde_json::json!([]));
    assert_eq!(v["build_target"], serde_json::Value::Null);
}

/// candle attaches a backtrace to its errors when `RUST_BACKTRACE` is set: it stays out of the
/// message (a user debugging a panic should not get a stack dump in every error line).
#[test]
fn errors_carry_no_backtrace_under_rust_backtrace() {
    let d = temp_dir("cli-backtrace");
    let p = d.join("bad.gguf");
    let mut bytes = std::fs::read(model(SMOLLM2)).unwrap();
    // The first metadata key's length (after magic, version, tensor and key counts).
    bytes[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    let out = Command::new(keydiff_bin())
        .args(["run", "-m", p.to_str().unwrap(), "-p", "hi", "-n", "1"])
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(se.contains("string length 1099511627776 exceeds"), "{se}");
    assert!(!se.contains("Error::bt"), "{se}");
    assert_eq!(se.trim_end().lines().count(), 1, "{se}");
}
