//! `keydiff eval` end to end: synthetic tasks on a tiny random model (plumbing, files, resume),
//! and retrieval on SmolLM2 (the task is answerable by a real model, and a budget run evicts).

use std::process::Command;

use keydiff_tests::{keydiff_bin, model, root, temp_dir, SMOLLM2};

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(keydiff_bin())
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn records(dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("records.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn niah_writes_results_heatmap_and_resumes() {
    let dir = temp_dir("eval-niah");
    let d = dir.to_str().unwrap();
    let base = [
        "eval",
        "niah",
        "-m",
        "tiny-qwen",
        "--random-weights",
        "--lengths",
        "1200,2000",
        "--depths",
        "0,1",
        "--budgets",
        "50%",
        "--samples",
        "2",
        "--chunk",
        "64",
        "--out",
        d,
    ];
    let (ok, stdout, stderr) = run(&[&base[..], &["--policies", "full,keydiff"]].concat());
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("L=1200") && stdout.contains("L=2000"),
        "{stdout}"
    );
    // 2 lengths × 2 depths × 2 samples × (full + keydiff)
    let recs = records(&dir);
    assert_eq!(recs.len(), 16);
    for r in &recs {
        let input = r["input_tokens"].as_u64().unwrap();
        let len = r["length"].as_u64().unwrap();
        assert!(
            input + 16 <= len,
            "input {input} + answer exceeds length {len}"
        );
        if r["policy"] == "keydiff" {
            assert_eq!(
                r["budget_tokens"].as_u64().unwrap(),
                (input as f64 * 0.5).round() as u64
            );
            assert!(r["evictions"].as_u64().unwrap() > 0);
        }
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["records"].as_array().unwrap().len(), 16);
    assert_eq!(json["cells"].as_array().unwrap().len(), 4);
    assert_eq!(json["cells_by_depth"].as_array().unwrap().len(), 8);
    assert!(json["provenance"]["commit"].as_str().is_some());
    // Built in this checkout, so the build recorded a commit.
    let built = json["provenance"]["binary_commit"].as_str().unwrap();
    assert!(!built.is_empty() && built != "unknown", "{built}");
    let svg = std::fs::read_to_string(dir.join("heatmap.svg")).unwrap();
    assert!(svg.contains("keydiff, N = 50%") && svg.contains("depth"));
    // Each record names the build that made it, as the table does.
    let code = recs[0]["code"].as_str().unwrap().to_string();
    assert!(code.starts_with(built), "{code} vs {built}");
    assert!(recs.iter().all(|r| r["code"] == code.as_str()));
    assert!(stdout.contains(&format!("| commit {code}\n")), "{stdout}");

    // Resume with one more policy: only its 8 runs are made, the 16 old records are kept.
    // Records from another build (as after a rebuild) are kept, and the table says so.
    let older = std::fs::read_to_string(dir.join("records.jsonl"))
        .unwrap()
        .replace(&format!("\"code\":\"{code}\""), "\"code\":\"feedbee\"");
    std::fs::write(dir.join("records.jsonl"), older).unwrap();
    let (ok, stdout, stderr) =
        run(&[&base[..], &["--policies", "full,keydiff,sink", "--resume"]].concat());
    assert!(ok, "{stderr}");
    assert_eq!(stderr.matches("] niah-").count(), 8, "{stderr}");
    assert!(
        stderr.contains("were made by feedbee (16)") && stderr.contains("the table mixes them"),
        "{stderr}"
    );
    assert!(
        stdout.contains(&format!(
            "| commits feedbee (16 records), {code} (8 records)\n"
        )),
        "{stdout}"
    );
    let recs = records(&dir);
    assert_eq!(recs.len(), 24);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["records"].as_array().unwrap().len(), 24);

    // --report runs nothing and rebuilds results.json from the records of the grid it is given.
    let (ok, stdout, stderr) =
        run(&[&base[..], &["--policies", "full,sink,tova", "--report"]].concat());
    assert!(ok, "{stderr}");
    assert_eq!(stderr.matches("] niah-").count(), 0, "{stderr}");
    assert!(
        stdout.contains("sink") && !stdout.contains("keydiff"),
        "{stdout}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["records"].as_array().unwrap().len(), 16);
    assert_eq!(records(&dir).len(), 24);

    // Resuming with an option that changes the samples is refused, and nothing is run.
    let (ok, _, stderr) = run(&[
        &base[..],
        &["--policies", "full", "--seed", "9", "--resume"],
    ]
    .concat());
    assert!(!ok && stderr.contains("--seed"), "{stderr}");
    assert_eq!(records(&dir).len(), 24);
    // So is another attention backend (the records above were eager).
    let (ok, _, stderr) = run(&[
        &base[..],
        &["--policies", "full", "--attention", "flash", "--resume"],
    ]
    .concat());
    assert!(!ok && stderr.contains("--attention"), "{stderr}");
    assert_eq!(records(&dir).len(), 24);
    // And another RoPE scaling.
    let (ok, _, stderr) = run(&[
        &base[..],
        &["--policies", "full", "--rope-scale", "2", "--resume"],
    ]
    .concat());
    assert!(!ok && stderr.contains("--rope-* (RoPE)"), "{stderr}");
    assert_eq!(records(&dir).len(), 24);
    // And another SnapKV window (a setting that changes the answers of one policy).
    let (ok, _, stderr) = run(&[
        &base[..],
        &["--policies", "full", "--snap-window", "8", "--resume"],
    ]
    .concat());
    assert!(!ok && stderr.contains("--snap-window"), "{stderr}");
    // And records made on another kind of device (here: as if on a GPU).
    let settings = std::fs::read_to_string(dir.join("run.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&settings).unwrap();
    assert_eq!(v["provenance"]["device"], "cpu");
    v["provenance"]["device"] = "Cuda { gpu_id: 0 }".into();
    std::fs::write(dir.join("run.json"), v.to_string()).unwrap();
    let (ok, _, stderr) = run(&[&base[..], &["--policies", "full", "--resume"]].concat());
    assert!(
        !ok && stderr.contains("--device \"cuda\", this run has \"cpu\""),
        "{stderr}"
    );
    std::fs::write(dir.join("run.json"), settings).unwrap();
    // A first run stopped before its results.json is checked against run.json, written
    // before its first record.
    std::fs::remove_file(dir.join("results.json")).unwrap();
    let (ok, _, stderr) = run(&[
        &base[..],
        &["--policies", "full", "--window", "0.1", "--resume"],
    ]
    .concat());
    assert!(!ok && stderr.contains("--window"), "{stderr}");
    // Records with neither file to check them against are refused, not mixed.
    std::fs::remove_file(dir.join("run.json")).unwrap();
    let (ok, _, stderr) = run(&[&base[..], &["--policies", "full", "--resume"]].concat());
    assert!(!ok && stderr.contains("no settings"), "{stderr}");
    assert_eq!(records(&dir).len(), 24);
}

/// A chat evaluation records the chat template it rendered with, and `--resume` refuses
/// another template or other template variables (they change every prompt).
#[test]
fn chat_evaluations_resume_under_their_template_only() {
    let dir = temp_dir("eval-template");
    let template = "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}{%- endfor %}\
                    <|assistant|>{{ greeting | default('') }}";
    let base = [
        "eval",
        "passkey",
        "-m",
        "tiny-qwen",
        "--random-weights",
        "--chat",
        "--chat-template",
        template,
        "--lengths",
        "600",
        "--samples",
        "1",
        "--policies",
        "full",
        "--chunk",
        "64",
        "--out",
        dir.to_str().unwrap(),
    ];
    let (ok, _, stderr) = run(&base);
    assert!(ok, "{stderr}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    let recorded: serde_json::Value =
        serde_json::from_str(json["provenance"]["chat_template"].as_str().unwrap()).unwrap();
    assert_eq!(
        recorded["sha256"].as_str().map(str::len),
        Some(64),
        "{recorded}"
    );
    let kwargs = ["--chat-template-kwargs", r#"{"greeting": "Sure."}"#];
    let (ok, _, stderr) = run(&[&base[..], &kwargs, &["--resume"]].concat());
    assert!(
        !ok && stderr.contains("--chat-template*/--chat-template-kwargs"),
        "{stderr}"
    );
    let (ok, _, stderr) = run(&[&base[..], &["--resume"]].concat());
    assert!(ok, "{stderr}");
    assert_eq!(records(&dir).len(), 1);
    std::fs::remove_dir_all(dir).ok();
}

/// A second run into a directory that a run is writing to is refused before it runs anything;
/// once the first is gone, the directory is free again.
#[test]
fn concurrent_runs_into_one_directory_are_refused() {
    let dir = temp_dir("eval-lock");
    let d = dir.to_str().unwrap();
    let args = [
        "eval",
        "passkey",
        "-m",
        "tiny-qwen",
        "--random-weights",
        "--lengths",
        "300",
        "--budgets",
        "200",
        "--policies",
        "keydiff",
        "--samples",
        "1",
        "--chunk",
        "64",
        "--out",
        d,
    ];
    // Stand in for a running eval: hold the directory's lock (a file lock, as the CLI takes).
    let held = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".eval.lock"))
        .unwrap();
    held.try_lock().unwrap();
    let (ok, _, stderr) = run(&args);
    assert!(!ok && stderr.contains("another `keydiff eval`"), "{stderr}");
    assert!(!dir.join("records.jsonl").exists());
    drop(held);
    let (ok, _, stderr) = run(&args);
    assert!(ok, "{stderr}");
    assert_eq!(records(&dir).len(), 1);
}

#[test]
fn bad_eval_parameters_fail_before_running() {
    let dir = temp_dir("eval-bad");
    let d = dir.to_str().unwrap();
    for (args, want) in [
        (vec!["eval", "haystack"], "unknown task `haystack`"),
        (vec!["eval", "passkey", "--budgets", "120%"], "bad budget"),
        (
            vec!["eval", "passkey", "--lengths", "20"],
            "length 20 (the prompt and a 12-token answer): too short",
        ),
        (
            vec!["eval", "passkey", "--lengths", "9000"],
            "exceed the context",
        ),
        (
            vec!["eval", "passkey", "--lengths", "1000", "--budgets", "64"],
            "budget",
        ),
        (vec!["eval", "longbench"], "--data"),
    ] {
        let mut a = args.clone();
        a.extend([
            "-m",
            model(SMOLLM2).to_str().unwrap().to_owned().leak(),
            "--out",
            d,
        ]);
        let (ok, _, stderr) = run(&a);
        assert!(!ok, "{args:?} should fail");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}

/// SmolLM2 finds a passkey in ~1K tokens with the full cache, and still does under KeyDiff at
/// half that budget (evicting), on the same prompt.
#[test]
fn smollm2_retrieves_a_passkey() {
    let dir = temp_dir("eval-passkey");
    let (ok, stdout, stderr) = run(&[
        "eval",
        "passkey",
        "-m",
        model(SMOLLM2).to_str().unwrap(),
        "--chat",
        "--lengths",
        "1024",
        "--depths",
        "0.5",
        "--samples",
        "1",
        "--policies",
        "full,keydiff",
        "--budgets",
        "512",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let recs = records(&dir);
    assert_eq!(recs.len(), 2, "{stdout}");
    for r in &recs {
        assert_eq!(r["score"], 1.0, "{r}");
    }
    // records.jsonl is in the order of the runs (by shared prefix), not of --policies.
    let kd = recs.iter().find(|r| r["policy"] == "keydiff").unwrap();
    assert!(kd["evictions"].as_u64().unwrap() > 0, "{kd}");
}

/// LongBench from a directory of JSONL files: official templates, the task's metric, one row
/// per task and setting.
#[test]
fn longbench_runs_from_jsonl_files() {
    let dir = temp_dir("eval-longbench");
    let data = root().join("crates/keydiff-eval/tests/fixtures/longbench");
    let (ok, stdout, stderr) = run(&[
        "eval",
        "longbench",
        "-m",
        model(SMOLLM2).to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--tasks",
        "trec,passage_count",
        "--policies",
        "full,keydiff",
        "--budgets",
        "128",
        "--samples",
        "2",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let recs = records(&dir);
    assert_eq!(recs.len(), 2 * 2 * 2, "{stdout}");
    for r in &recs {
        let task = r["task"].as_str().unwrap();
        assert!(task == "longbench/trec" || task == "longbench/passage_count");
        let s = r["score"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&s));
        if task == "longbench/trec" {
            // eval.py keeps the first line of trec predictions.
            assert!(!r["prediction"].as_str().unwrap().contains('\n'));
        }
    }
    for row in ["longbench/trec", "longbench/passage_count"] {
        assert!(stdout.contains(row), "{stdout}");
    }
}

/// Sharing the prefill of the chunks before the first eviction between a sample's settings
/// changes no answer and no eviction count, only the work done; `--no-prefix-reuse` turns it off.
#[test]
fn prefix_reuse_changes_no_answer() {
    let mut per_mode = Vec::new();
    for (name, extra) in [("reuse", None), ("fresh", Some("--no-prefix-reuse"))] {
        let dir = temp_dir(&format!("eval-prefix-{name}"));
        let mut args = vec![
            "eval",
            "passkey",
            "-m",
            "tiny-llama",
            "--random-weights",
            "--lengths",
            "1000",
            // N = 100 leaves a prefix of one chunk, where 40 sinks and H2O's protected half
            // would not fit a prefix budget of 64: prefixes must ignore protection.
            "--budgets",
            "100,50%,75%",
            "--sinks",
            "40",
            "--samples",
            "2",
            "--chunk",
            "64",
            "--out",
            dir.to_str().unwrap(),
        ];
        args.extend(extra);
        let (ok, _, stderr) = run(&args);
        assert!(ok, "{stderr}");
        per_mode.push(records(&dir));
    }
    let (reuse, fresh) = (&per_mode[0], &per_mode[1]);
    // 2 samples × (full + 5 policies × 3 budgets)
    assert_eq!(reuse.len(), 32);
    assert_eq!(fresh.len(), 32);
    let key = |r: &serde_json::Value| format!("{} {} {}", r["id"], r["policy"], r["budget"]);
    for r in reuse {
        let f = fresh.iter().find(|f| key(f) == key(r)).unwrap();
        for field in ["prediction", "evictions", "budget_tokens", "score"] {
            assert_eq!(r[field], f[field], "{} {field}", key(r));
        }
        assert_eq!(f["prefix_tokens"], 0, "{}", key(r));
        // Every run starts from the longest whole-chunk prefix its budget leaves eviction-free.
        let input = r["input_tokens"].as_u64().unwrap();
        let free = r["budget_tokens"].as_u64().unwrap_or(input).min(input - 1);
        assert_eq!(r["prefix_tokens"], free / 64 * 64, "{}", key(r));
    }
}

/// Records made with the CPU's dense prefill copies are not mixed with records made on the
/// weights as stored (`--as-stored`, or copies that memory dropped): the numerics differ.
#[test]
fn resume_refuses_other_cpu_weight_copies() {
    let dir = temp_dir("eval-cpu-weights");
    let m = model(SMOLLM2);
    let base = [
        "eval",
        "passkey",
        "-m",
        m.to_str().unwrap(),
        "--lengths",
        "200",
        "--samples",
        "1",
        "--policies",
        "full",
        "--out",
        dir.to_str().unwrap(),
    ];
    let (ok, _, stderr) = run(&base);
    assert!(ok, "{stderr}");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(
        results["provenance"]["cpu_weights"],
        "weights with dense prefill copies and Q8_0 decode copies"
    );
    let (ok, _, stderr) = run(&[&base[..], &["--resume", "--as-stored"]].concat());
    assert!(!ok && stderr.contains("(CPU weight copies)"), "{stderr}");
    assert!(stderr.contains("weights as stored"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
