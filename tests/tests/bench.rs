//! Benchmarks: the prefill time breakdown, the TTFT, decode and join sweeps, and `keydiff bench`'s
//! files. Tiny random models: these check what is measured and written, not how fast it is.

use std::process::Command;

use keydiff::bench::{self, JoinMode, Phase, Plan};
use keydiff::{
    CacheConfig, Engine, EngineConfig, GenerateParams, ModelSource, PolicyKind, Prompt, Sampling,
};
use keydiff_tests::{keydiff_bin, root, temp_dir};

fn tiny(preset: &str, cache: CacheConfig) -> Engine {
    let source = ModelSource::Random {
        config: root().join(format!("configs/{preset}.json")),
        seed: 3,
        on_host: false,
        weights: None,
    };
    let cfg = EngineConfig {
        cache,
        ..Default::default()
    };
    Engine::load(&source, &cfg).unwrap()
}

fn budgeted(policy: &str, n: usize, b: usize) -> CacheConfig {
    CacheConfig {
        policy: PolicyKind::parse(policy, keydiff::SNAPKV_WINDOW, 0).unwrap(),
        budget: Some(n),
        chunk: b,
        window: 0.0,
        sinks: 0,
        evict_every: None,
    }
}

/// The profiled regions add up to no more than the prefill, land where each policy spends its
/// time, and profiling changes nothing about the output.
#[test]
fn breakdown_accounts_for_prefill_and_changes_nothing() {
    let tokens = keydiff::parity::random_tokens(700, 256, 11);
    for cache in [
        CacheConfig::full(64),
        budgeted("keydiff", 256, 64),
        budgeted("h2o", 256, 64),
        budgeted("snapkv", 256, 64),
    ] {
        let name = cache.policy.name();
        let e = tiny("tiny-llama", cache);
        let params = |profile| GenerateParams {
            prompt: Prompt::Tokens(tokens.clone()),
            max_tokens: 6,
            ignore_eos: true,
            profile,
            ..Default::default()
        };
        let plain = e.generate(&params(false), |_| {}).unwrap();
        let prof = e.generate(&params(true), |_| {}).unwrap();
        assert_eq!(
            plain.tokens, prof.tokens,
            "{name}: profiling changed the output"
        );
        assert!(plain.stats.breakdown.is_none());
        let s = &prof.stats;
        let b = s.breakdown.expect("profiled run has a breakdown");
        let known =
            b.attention_s + b.attention_stats_s + b.eviction_score_s + b.select_move_s + b.mlp_s;
        assert!(
            known <= s.prefill_s * 1.0001,
            "{name}: regions {known} s exceed prefill {} s",
            s.prefill_s
        );
        assert!(
            (b.total() - s.prefill_s).abs() < 1e-9,
            "{name}: {b:?} vs {}",
            s.prefill_s
        );
        assert!(b.attention_s > 0.0 && b.mlp_s > 0.0, "{name}: {b:?}");
        match name.as_str() {
            "full" => {
                assert_eq!(b.eviction_score_s + b.select_move_s, 0.0, "{b:?}");
                assert_eq!(b.attention_stats_s, 0.0, "{b:?}");
            }
            "keydiff" => {
                assert!(b.eviction_score_s > 0.0 && b.select_move_s > 0.0, "{b:?}");
                assert_eq!(
                    b.attention_stats_s, 0.0,
                    "keydiff needs no statistics: {b:?}"
                );
            }
            _ => {
                assert!(b.attention_stats_s > 0.0, "{name} needs statistics: {b:?}");
                assert!(b.eviction_score_s > 0.0, "{name}: {b:?}");
            }
        }
        // The breakdown's eviction parts are the prefill's eviction counters.
        assert_eq!(b.eviction_score_s, s.eviction.score_s, "{name}");
    }
}

#[test]
fn ttft_sweep_measures_every_case_in_interleaved_rounds() {
    let mut e = tiny("tiny-qwen", CacheConfig::full(64));
    let policies = [
        PolicyKind::Full,
        PolicyKind::parse("keydiff", 32, 0).unwrap(),
        PolicyKind::Sink,
    ];
    let plan = Plan {
        cases: bench::cases(
            &[300, 520],
            &[192],
            &[32, 64],
            &policies,
            &CacheConfig::full(64),
        )
        .unwrap(),
        warmup: 1,
        reps: 3,
        seed: 7,
        breakdown: true,
    };
    assert_eq!(plan.cases.len(), 12);
    let mut seen = Vec::new();
    let results = bench::ttft(&mut e, &plan, |phase, case, s| {
        seen.push((phase, case.label(), s.prompt_tokens));
    })
    .unwrap();
    assert_eq!(seen.len(), bench::ttft_runs(&plan, false));
    // Warm-ups first, then round after round over all cases.
    let phases: Vec<Phase> = seen.iter().map(|s| s.0).collect();
    assert!(phases[..12].iter().all(|&p| p == Phase::Warmup));
    assert!(phases[12..].iter().all(|&p| p == Phase::Measure));
    let labels: Vec<&String> = seen[12..24].iter().map(|s| &s.1).collect();
    let next: Vec<&String> = seen[24..36].iter().map(|s| &s.1).collect();
    assert_eq!(labels, next, "every round runs the cases in the same order");

    assert_eq!(results.len(), 12);
    let c = e.model_config().clone();
    for r in &results {
        assert_eq!(r.ttft_s.len(), 3);
        assert!(
            r.ttft.min <= r.ttft.median && r.ttft.median <= r.ttft.max,
            "{r:?}"
        );
        assert!(r.ttft.min > 0.0 && r.prefill_tok_s > 0.0);
        match r.budget {
            None => {
                assert_eq!(r.policy, "full");
                assert_eq!(r.eviction_share, 0.0);
                assert_eq!(r.evictions, 0);
            }
            Some(n) => {
                let kv = (n + r.chunk) * c.num_layers * c.num_kv_heads * c.head_dim * 2 * 4;
                assert_eq!(r.peak_kv_bytes, kv, "{r:?}");
                assert!(r.evictions > 0 && r.eviction_share > 0.0, "{r:?}");
                assert!(r.eviction_share < 1.0);
            }
        }
    }
}

#[test]
fn rounds_draw_new_prompts_and_cases_of_a_round_share_one() {
    let e = tiny("tiny-qwen", CacheConfig::full(64));
    let a = bench::prompt(&e, 100, 7, 0);
    assert_eq!(a, bench::prompt(&e, 100, 7, 0));
    assert_ne!(a, bench::prompt(&e, 100, 7, 1));
    assert_eq!(a.len(), 100);
}

#[test]
fn decode_sweep_reports_throughput_and_bounded_cache() {
    let mut e = tiny("tiny-llama", CacheConfig::full(64));
    let policies = [
        PolicyKind::Full,
        PolicyKind::parse("keydiff", 32, 0).unwrap(),
    ];
    let plan = Plan {
        cases: bench::cases(&[300], &[128], &[64], &policies, &CacheConfig::full(64)).unwrap(),
        warmup: 0,
        reps: 2,
        seed: 1,
        breakdown: false,
    };
    let greedy = Sampling::default();
    let r = bench::decode(&mut e, &plan, 150, 1, &greedy, |_, _, _| {}).unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].final_cache_len, 300 + 150, "full keeps everything");
    assert!(r[1].final_cache_len <= 128 + 64, "{:?}", r[1]);
    for x in &r {
        assert_eq!(x.decode_steps, 150);
        assert!(x.decode.median > 0.0);
        assert_eq!(x.decode_tok_s.len(), 2);
        assert_eq!(x.batch, 1);
    }
    assert!(r[1].peak_kv_bytes < r[0].peak_kv_bytes);

    // Three requests decoded together: each runs the same steps and keeps the same cache as
    // one alone; the rate is theirs together.
    let b = bench::decode(&mut e, &plan, 150, 3, &greedy, |_, _, _| {}).unwrap();
    for (x, one) in b.iter().zip(&r) {
        assert_eq!(x.batch, 3);
        assert_eq!(x.decode_steps, 150);
        assert_eq!(x.final_cache_len, one.final_cache_len);
        assert_eq!(x.peak_kv_bytes, one.peak_kv_bytes);
        assert!(x.decode.median > 0.0);
    }
    assert!(bench::decode(&mut e, &plan, 150, 0, &greedy, |_, _, _| {}).is_err());

    // Sampled tokens: the same steps and caches, the settings recorded; bad ones refused.
    let sampled = Sampling {
        temperature: 0.8,
        top_p: 0.9,
        seed: 3,
        ..Default::default()
    };
    for batch in [1, 2] {
        let s = bench::decode(&mut e, &plan, 150, batch, &sampled, |_, _, _| {}).unwrap();
        for (x, one) in s.iter().zip(&r) {
            assert_eq!(x.sampling, sampled);
            assert_eq!(x.decode_steps, 150);
            assert_eq!(x.final_cache_len, one.final_cache_len);
        }
    }
    let bad = Sampling {
        top_p: 0.0,
        ..sampled
    };
    let err = bench::decode(&mut e, &plan, 150, 1, &bad, |_, _, _| {}).unwrap_err();
    assert!(err.to_string().contains("top-p"), "{err}");
}

/// A prompt joining running requests, prefilled alone and in the batch's steps: every run is
/// recorded per case and mode, with its settings. Bad settings are refused before anything
/// runs. The CLI writes its table, CSV and JSON.
#[test]
fn join_bench_measures_a_prompt_alone_and_in_steps() {
    let mut e = tiny("tiny-llama", CacheConfig::full(64));
    let policies = [PolicyKind::parse("keydiff", 32, 0).unwrap()];
    let plan = Plan {
        cases: bench::cases(&[300], &[128], &[64], &policies, &CacheConfig::full(64)).unwrap(),
        warmup: 1,
        reps: 2,
        seed: 1,
        breakdown: false,
    };
    let modes = [JoinMode::Alone, JoinMode::Steps(64)];
    let mut runs = Vec::new();
    let r = bench::join(&mut e, &plan, 3, 40, &modes, |phase, _, mode, _| {
        runs.push((phase, mode))
    })
    .unwrap();
    assert_eq!(
        runs.len(),
        6,
        "one warm-up and two measured rounds of two modes"
    );
    assert_eq!(runs.iter().filter(|r| r.0 == Phase::Measure).count(), 4);
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].mode.as_str(), r[0].prefill_tokens), ("alone", 0));
    assert_eq!((r[1].mode.as_str(), r[1].prefill_tokens), ("steps", 64));
    for x in &r {
        assert_eq!(
            (x.running, x.running_prompt_len, x.prompt_len),
            (3, 40, 300)
        );
        assert_eq!(x.ttft_s.len(), 2);
        assert!(x.ttft.min > 0.0 && x.max_gap.min > 0.0, "{x:?}");
    }
    assert!(bench::join(&mut e, &plan, 0, 40, &modes, |_, _, _, _| {}).is_err());
    let zero = [JoinMode::Steps(0)];
    assert!(bench::join(&mut e, &plan, 3, 40, &zero, |_, _, _, _| {}).is_err());

    let dir = temp_dir("bench-join");
    let out = run_cli(&[
        "bench",
        "join",
        "--preset",
        "tiny-qwen",
        "--random-weights",
        "--prompt-len",
        "200",
        "--budget",
        "64",
        "--policies",
        "keydiff",
        "--chunks",
        "32",
        "--running",
        "2",
        "--running-prompt-len",
        "16",
        "--warmup",
        "0",
        "--reps",
        "1",
        "--out",
        dir.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("max gap s"), "{stdout}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    let modes: Vec<&str> = rows.iter().map(|r| r["mode"].as_str().unwrap()).collect();
    assert_eq!(modes, ["alone", "steps"]);
    assert_eq!(rows[1]["prefill_tokens"], 32);
    assert!(rows[0]["commit"].is_string());
    let csv = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
}

fn run_cli(args: &[&str]) -> std::process::Output {
    Command::new(keydiff_bin())
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

#[test]
fn bench_ttft_writes_table_csv_json_and_svg() {
    let dir = temp_dir("bench-ttft");
    let out = run_cli(&[
        "bench",
        "ttft",
        "--preset",
        "tiny-qwen",
        "--random-weights",
        "--prompt-len",
        "400",
        "--budget",
        "128",
        "--chunks",
        "32,64",
        "--policies",
        "full,keydiff,tova",
        "--reps",
        "2",
        "--warmup",
        "0",
        "--out",
        dir.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("meaningless"),
        "random weights must be announced: {stderr}"
    );
    // Header lines and one table row per case.
    let rows: Vec<&str> = stdout.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), 1 + 6, "{stdout}");
    assert!(rows[0].contains("TTFT med") && rows[0].contains("evict%"));

    let csv = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 7, "{csv}");
    for col in [
        "ttft_median_s",
        "eviction_share",
        "peak_kv_bytes",
        "commit",
        "binary_commit",
        "env",
        "machine",
        "command",
    ] {
        assert!(
            lines[0].split(',').any(|c| c == col),
            "missing {col}: {}",
            lines[0]
        );
    }

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    let rows = json.as_array().unwrap();
    assert_eq!(rows.len(), 6);
    for r in rows {
        for key in [
            "commit",
            "binary_commit",
            "env",
            "machine",
            "device",
            "command",
            "date",
        ] {
            assert!(
                r[key].as_str().is_some_and(|s| !s.is_empty()),
                "{key} in {r}"
            );
        }
        assert!(r["command"].as_str().unwrap().contains("bench ttft"));
        assert_eq!(r["ttft_s"].as_array().unwrap().len(), 2);
    }

    // `bench plot` redraws the figure from results.json alone.
    std::fs::remove_file(dir.join("ttft.svg")).unwrap();
    let out = run_cli(&["bench", "plot", dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let svg = std::fs::read_to_string(dir.join("ttft.svg")).unwrap();
    assert!(svg.starts_with("<svg"));
    for p in ["full", "keydiff", "tova", "chunk size B", "TTFT (s)"] {
        assert!(svg.contains(p), "figure lacks {p}");
    }
}

#[test]
fn bench_refuses_bad_cases_before_running() {
    let out = run_cli(&[
        "bench",
        "ttft",
        "--preset",
        "tiny-qwen",
        "--random-weights",
        "--budget",
        "32",
        "--chunks",
        "64",
        "--policies",
        "keydiff",
        "--out",
        temp_dir("bench-bad").to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("N=32 B=64"), "{stderr}");
    let out = run_cli(&[
        "bench",
        "ttft",
        "--preset",
        "tiny-qwen",
        "--random-weights",
        "--prompt-len",
        "40000",
        "--budget",
        "128",
        "--chunks",
        "64",
        "--policies",
        "keydiff",
        "--out",
        temp_dir("bench-long").to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("context"), "{stderr}");
    // A prompt that fills the context leaves no room for the first token, so no TTFT.
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("configs/tiny-qwen.json")).unwrap(),
    )
    .unwrap();
    let context = config["max_position_embeddings"]
        .as_u64()
        .unwrap()
        .to_string();
    let out = run_cli(&[
        "bench",
        "ttft",
        "--preset",
        "tiny-qwen",
        "--random-weights",
        "--prompt-len",
        &context,
        "--chunks",
        "64",
        "--policies",
        "full",
        "--out",
        temp_dir("bench-full-context").to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("context"), "{stderr}");
}

/// `bench ttft --eviction together,per-layer`: every policy that evicts gets a `/per-layer`
/// case beside its default one, measured with each layer evicting after its own attention
/// (same evictions, same first token); `full` never evicts and gets one case, not two of the
/// same thing.
#[test]
fn eviction_timings_are_cases_of_their_own() {
    let policies = [
        PolicyKind::Full,
        PolicyKind::parse("keydiff", 32, 0).unwrap(),
        PolicyKind::parse("tova", 32, 0).unwrap(),
    ];
    let cases = bench::cases(&[300], &[96], &[32], &policies, &CacheConfig::full(32)).unwrap();
    let both = bench::with_eviction_timings(cases.clone(), &[false, true]).unwrap();
    let names: Vec<String> = both.iter().map(|c| c.policy_name()).collect();
    assert_eq!(
        names,
        [
            "full",
            "keydiff",
            "keydiff/per-layer",
            "tova",
            "tova/per-layer"
        ]
    );
    let alone = bench::with_eviction_timings(cases.clone(), &[true]).unwrap();
    let names: Vec<String> = alone.iter().map(|c| c.policy_name()).collect();
    assert_eq!(names, ["full", "keydiff/per-layer", "tova/per-layer"]);
    assert!(bench::with_eviction_timings(cases, &[]).is_err());
    // Measured: the per-layer case runs per layer and keeps what the default keeps.
    let mut e = tiny("tiny-qwen", CacheConfig::full(32));
    let per_layer = e.config().evict_per_layer;
    let plan = Plan {
        cases: both[1..3].to_vec(),
        warmup: 0,
        reps: 1,
        seed: 3,
        breakdown: false,
    };
    let mut first = Vec::new();
    let r = bench::ttft(&mut e, &plan, |_, _, s| first.push(s.eviction.evictions)).unwrap();
    assert_eq!(
        (r[0].policy.as_str(), r[0].evict_per_layer),
        ("keydiff", false)
    );
    assert_eq!(
        (r[1].policy.as_str(), r[1].evict_per_layer),
        ("keydiff/per-layer", true)
    );
    assert!(first[0] > 0 && first[0] == first[1], "{first:?}");
    // The cases ran with their own timing; the engine keeps its own.
    assert!(!per_layer, "the default evicts every layer at once");
    assert_eq!(e.config().evict_per_layer, per_layer);
    assert_eq!(e.config().cache, CacheConfig::full(32));
}

/// `bench ttft --compare-attention eager,flash`: every case once per backend, run with the
/// backend it names, its ratio to `full` under the same backend.
#[test]
fn attention_backends_are_cases_of_their_own() {
    use keydiff::AttentionBackend::{Auto, Eager, Flash};
    let policies = [
        PolicyKind::Full,
        PolicyKind::parse("keydiff", 32, 0).unwrap(),
    ];
    let cases = bench::cases(&[300], &[96], &[32], &policies, &CacheConfig::full(32)).unwrap();
    let mut e = tiny("tiny-llama", CacheConfig::full(32));
    let loaded = e.config().attention;
    let both = bench::with_attentions(&mut e, cases.clone(), &[Eager, Flash]).unwrap();
    let names: Vec<String> = both.iter().map(|c| c.policy_name()).collect();
    assert_eq!(
        names,
        ["full/eager", "full/flash", "keydiff/eager", "keydiff/flash"]
    );
    assert!(bench::with_attentions(&mut e, cases.clone(), &[]).is_err());
    let err = bench::with_attentions(&mut e, cases.clone(), &[Eager, Auto]).unwrap_err();
    assert!(err.to_string().contains("not auto"), "{err}");
    let err = bench::with_attentions(&mut e, cases, &[Flash, Eager, Flash]).unwrap_err();
    assert!(err.to_string().contains("flash given twice"), "{err}");
    // Checking the backends leaves the engine as it was loaded.
    assert_eq!(e.config().attention, loaded);
    let plan = Plan {
        cases: both,
        warmup: 0,
        reps: 1,
        seed: 3,
        breakdown: false,
    };
    let mut evictions = Vec::new();
    let r = bench::ttft(&mut e, &plan, |_, _, s| {
        evictions.push(s.eviction.evictions)
    })
    .unwrap();
    let got: Vec<(&str, Option<&str>)> = r
        .iter()
        .map(|x| (x.policy.as_str(), x.attention.as_deref()))
        .collect();
    assert_eq!(
        got,
        [
            ("full/eager", Some("eager")),
            ("full/flash", Some("flash")),
            ("keydiff/eager", Some("eager")),
            ("keydiff/flash", Some("flash")),
        ]
    );
    assert_eq!(evictions[0], 0);
    assert!(
        evictions[2] > 0 && evictions[2] == evictions[3],
        "{evictions:?}"
    );
    // The sweep leaves the engine's settings as they were (each case set its own).
    assert_eq!(e.config().attention, loaded);
    assert_eq!(e.config().cache, CacheConfig::full(32));
    // A prefix is used only under the backend it was prefilled with (they round differently).
    e.set_attention(Flash).unwrap();
    let tokens: Vec<u32> = (0..80).map(|i| (i * 7 % 250) as u32 + 1).collect();
    let prefix = e
        .prefill_prefix(&tokens[..64], None, CacheConfig::full(32))
        .unwrap();
    e.set_attention(Eager).unwrap();
    let err = e.prefill_logits_from(&tokens, Some(&prefix)).unwrap_err();
    assert!(
        err.to_string()
            .contains("prefilled with flash attention and the engine now runs eager"),
        "{err}"
    );
    e.set_attention(Flash).unwrap();
    assert!(e.prefill_logits_from(&tokens, Some(&prefix)).is_ok());

    let dir = temp_dir("bench-attention");
    let out = run_cli(&[
        "bench",
        "ttft",
        "--preset",
        "tiny-llama",
        "--random-weights",
        "--prompt-len",
        "200",
        "--budget",
        "64",
        "--policies",
        "full,keydiff",
        "--chunks",
        "32",
        "--compare-attention",
        "eager,flash",
        "--warmup",
        "0",
        "--reps",
        "1",
        "--no-breakdown",
        "--out",
        dir.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("eager/flash (per case) attention"),
        "{stdout}"
    );
    // keydiff/flash's ratio is to full/flash: every row has one.
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && (l.contains("/eager") || l.contains("/flash")))
        .collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    for row in &rows {
        let ratio = row.split_whitespace().nth(7).unwrap();
        assert!(ratio.parse::<f64>().is_ok(), "{row}");
    }
    let results: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    let attention: Vec<&str> = results
        .iter()
        .map(|r| r["attention"].as_str().unwrap())
        .collect();
    assert_eq!(attention, ["eager", "flash", "eager", "flash"]);
    let out = run_cli(&[
        "bench",
        "ttft",
        "--preset",
        "tiny-llama",
        "--random-weights",
        "--compare-attention",
        "eager,sdpa",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("`sdpa`"));
}
