//! `keydiff eval <task>`: accuracy per policy × budget × length, results.json, and for niah a
//! heatmap.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use keydiff::bench::Provenance;
use keydiff::{CacheConfig, PolicyKind};
use keydiff_eval::run::{self, BudgetSpec, Cell, Record, RunOptions, Setting};
use keydiff_eval::synthetic::{self, Task};
use keydiff_eval::{longbench, Sample};

use crate::{plot, LoadArgs, PolicyArgs};

#[derive(Args)]
pub struct EvalArgs {
    /// passkey, niah, phonebook or longbench.
    task: String,
    #[command(flatten)]
    load: LoadArgs,
    /// Policies to compare (`full` is the ceiling).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,keydiff,tova,snapkv,h2o,sink"
    )]
    policies: Vec<String>,
    /// Budgets: token counts or shares of each sample's input (25%).
    #[arg(long, value_delimiter = ',', default_value = "25%,50%,75%")]
    budgets: Vec<String>,
    /// Sequence lengths in tokens (input + answer), synthetic tasks.
    #[arg(long, value_delimiter = ',', default_value = "2048,4096,8192")]
    lengths: Vec<usize>,
    /// Needle depths in [0, 1], synthetic tasks. Default: 0,0.25,0.5,0.75,1 for niah; a random
    /// depth per sample for passkey and phonebook.
    #[arg(long, value_delimiter = ',')]
    depths: Option<Vec<f64>>,
    /// Samples per length and depth (synthetic) or per LongBench task (at most).
    #[arg(long, default_value_t = 10)]
    samples: usize,
    /// Sample i of a cell is made from seed + i.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Prefill chunk size B.
    #[arg(long, default_value_t = keydiff::DEFAULT_CHUNK)]
    chunk: usize,
    #[command(flatten)]
    policy_args: PolicyArgs,
    /// Wrap prompts in the model's chat template (LongBench's few-shot and code tasks never
    /// are, as in LongBench).
    #[arg(long)]
    chat: bool,
    /// LongBench: directory of <task>.jsonl files.
    #[arg(long)]
    data: Option<PathBuf>,
    /// LongBench: tasks to run (default: every English task with a file in --data).
    #[arg(long, value_delimiter = ',')]
    tasks: Option<Vec<String>>,
    /// Directory for results.json, records.jsonl and (niah) heatmap.svg (default:
    /// bench/out/eval-TASK under the current directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep the records already in OUT/records.jsonl and run only the missing ones.
    #[arg(long)]
    resume: bool,
    /// Prefill every setting of a sample from scratch, instead of prefilling the chunks they
    /// share (those before the first eviction) once. The answers are the same either way.
    #[arg(long)]
    no_prefix_reuse: bool,
    /// Run nothing: rebuild the table, results.json and heatmap.svg of the given grid from
    /// OUT/records.jsonl (cells show how many samples they have). Implies --resume.
    #[arg(long)]
    report: bool,
}

fn key(task: &str, id: &str, policy: &str, budget: &str) -> String {
    format!("{task}\u{1f}{id}\u{1f}{policy}\u{1f}{budget}")
}

pub fn eval(a: EvalArgs) -> Result<()> {
    let policies = a
        .policies
        .iter()
        .map(|p| a.policy_args.policy(p))
        .collect::<Result<Vec<PolicyKind>>>()?;
    let budgets = a
        .budgets
        .iter()
        .map(|b| BudgetSpec::parse(b))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let settings = Setting::grid(&policies, &budgets)?;
    anyhow::ensure!(a.samples > 0, "--samples must be at least 1");
    // Checked before the model loads, which can take minutes.
    if a.task != "longbench" {
        Task::parse(&a.task).map_err(|_| {
            anyhow::anyhow!(
                "unknown task `{}` (passkey, niah, phonebook, longbench)",
                a.task
            )
        })?;
        anyhow::ensure!(
            !a.lengths.is_empty() && a.lengths.iter().all(|&l| l > 0),
            "--lengths must be one or more positive token counts"
        );
    }
    if let Some(d) = a
        .depths
        .iter()
        .flatten()
        .find(|d| !(0.0..=1.0).contains(*d))
    {
        bail!("--depths must be fractions of the context in [0, 1], found {d}");
    }
    let template = a.policy_args.cache("full", None, a.chunk)?;
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("bench/out/eval-{}", a.task)));
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create output directory {}", out.display()))?;
    // One run per directory at a time: two runs appending to the same records.jsonl, or one
    // removing it under the other, would mix or lose records. The lock is released when this
    // process ends, however it ends. Taken before the model loads, so a refused run costs nothing.
    let lock_path = out.join(".eval.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("cannot create {}", lock_path.display()))?;
    if let Err(e) = lock.try_lock() {
        match e {
            std::fs::TryLockError::WouldBlock => bail!(
                "another `keydiff eval` is writing to {}; wait for it or use another --out",
                out.display()
            ),
            std::fs::TryLockError::Error(e) => {
                return Err(e).with_context(|| format!("cannot lock {}", lock_path.display()))
            }
        }
    }

    let mut engine = a.load.load(CacheConfig::full(a.chunk))?;

    let opts = RunOptions {
        chat: a.chat,
        template: CacheConfig {
            chunk: a.chunk,
            ..template
        },
        reuse_prefix: !a.no_prefix_reuse,
    };
    let samples: Vec<Sample> = if a.task == "longbench" {
        // Settings of the synthetic tasks: said, not silently dropped.
        let mut unread = vec![];
        (a.lengths != [2048, 4096, 8192]).then(|| unread.push("--lengths"));
        a.depths.is_some().then(|| unread.push("--depths"));
        (a.seed != 0).then(|| unread.push("--seed"));
        if !unread.is_empty() {
            eprintln!(
                "warning: {} set the synthetic tasks' samples and have no effect on longbench, \
                 whose records are taken as they are (the first --samples of each task)",
                unread.join(", ")
            );
        }
        let dir = a
            .data
            .as_ref()
            .context("longbench needs --data DIR with LongBench <task>.jsonl files")?;
        let tasks: Vec<String> = match &a.tasks {
            Some(t) => t.clone(),
            None => longbench::ENGLISH_TASKS
                .iter()
                .filter(|t| dir.join(format!("{t}.jsonl")).exists())
                .map(|t| t.to_string())
                .collect(),
        };
        if tasks.is_empty() {
            bail!(
                "no LongBench task files (<task>.jsonl) in {}",
                dir.display()
            );
        }
        let mut all = Vec::new();
        for t in &tasks {
            all.extend(longbench::load(dir, t, Some(a.samples))?);
        }
        all
    } else {
        let task = Task::parse(&a.task)?;
        if a.tasks.is_some() || a.data.is_some() {
            eprintln!(
                "warning: --tasks and --data apply to longbench only: not read by {}",
                a.task
            );
        }
        let depths = match (&a.depths, task) {
            (Some(d), _) => d.clone(),
            (None, Task::Niah) => vec![0.0, 0.25, 0.5, 0.75, 1.0],
            (None, _) => Vec::new(),
        };
        let chat = a.chat;
        let eng = &engine;
        let mut count = |user: &str, prefix: &str| -> keydiff_eval::Result<usize> {
            Ok(run::input_ids(eng, user, prefix, chat)?.len())
        };
        synthetic::samples(task, &a.lengths, &depths, a.samples, a.seed, &mut count)?
    };

    // Records already made (resume), then the rest.
    let records_path = out.join("records.jsonl");
    let mut done: Vec<Record> = Vec::new();
    if a.report && !records_path.exists() {
        bail!("--report: no records in {}", records_path.display());
    }
    if (a.resume || a.report) && records_path.exists() {
        check_resume(&out.join("results.json"), &a, &engine)?;
        let text = std::fs::read_to_string(&records_path)?;
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}:{}", records_path.display(), i + 1))?;
            done.push(
                record_from_json(&v).with_context(|| {
                    format!("{}:{}: not a record", records_path.display(), i + 1)
                })?,
            );
        }
    } else if records_path.exists() {
        std::fs::remove_file(&records_path)?;
    }
    let have: HashSet<String> = done
        .iter()
        .map(|r| key(&r.task, &r.id, &r.policy, &r.budget))
        .collect();
    let is_done = |s: &Sample, st: &Setting| {
        have.contains(&key(&s.task, &s.id, &st.policy.name(), &st.budget_label()))
    };
    let todo = samples
        .iter()
        .map(|s| settings.iter().filter(|st| !is_done(s, st)).count())
        .sum::<usize>();

    let prov = Provenance::collect(&engine, a.load.random_weights, crate::bench::command_line());
    if !a.report {
        // The settings the records are made under, before the first one: a run stopped before
        // it writes results.json can still be checked by --resume.
        let v = serde_json::json!({"provenance": prov, "task": a.task, "options": options(&a)});
        let path = out.join(RUN_FILE);
        std::fs::write(&path, serde_json::to_string_pretty(&v)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let total = todo;
    let bar = crate::bench::progress_bar(todo);
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&records_path)
        .with_context(|| format!("cannot write {}", records_path.display()))?;
    let plain = !std::io::IsTerminal::is_terminal(&std::io::stderr());
    let code = prov.code();
    let mut write_error: Option<std::io::Error> = None;
    let new = if a.report {
        Vec::new()
    } else {
        run::run(&mut engine, &samples, &settings, &opts, is_done, |r| {
            let r = Record {
                code: code.clone(),
                ..r.clone()
            };
            if let Err(e) = writeln!(file, "{}", serde_json::to_string(&r).unwrap_or_default()) {
                if write_error.is_none() {
                    tracing::warn!(
                        "cannot append to {}: {e} (the records from here on are kept only in \
                         results.json; --resume would make them again)",
                        records_path.display()
                    );
                }
                write_error.get_or_insert(e);
            }
            let msg = format!(
                "{} {} N={}: {} ({:.0}%)",
                r.id,
                r.policy,
                r.budget,
                if r.score >= 1.0 { "ok" } else { "miss" },
                100.0 * r.score
            );
            if plain {
                eprintln!("[{}/{}] {msg}", bar.position() + 1, total);
            }
            bar.set_message(msg);
            bar.inc(1);
        })?
    };
    bar.finish_and_clear();
    let earlier = builds(&done);
    if !a.report && earlier.iter().any(|(c, _)| *c != code) {
        tracing::warn!(
            "the records in {} were made by {}; this run is {code}: the table mixes them",
            records_path.display(),
            earlier
                .iter()
                .map(|(c, n)| format!("{c} ({n})"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    done.extend(new.into_iter().map(|r| Record {
        code: code.clone(),
        ..r
    }));
    // Keep the order of samples × settings.
    let order: Vec<String> = samples
        .iter()
        .flat_map(|s| {
            settings
                .iter()
                .map(move |st| key(&s.task, &s.id, &st.policy.name(), &st.budget_label()))
        })
        .collect();
    done.retain(|r| order.contains(&key(&r.task, &r.id, &r.policy, &r.budget)));
    done.sort_by_key(|r| {
        order
            .iter()
            .position(|k| *k == key(&r.task, &r.id, &r.policy, &r.budget))
    });

    let longbench = a.task == "longbench";
    let for_table: Vec<Record> = done
        .iter()
        .cloned()
        .map(|mut r| {
            if longbench {
                r.length = 0;
            }
            r
        })
        .collect();
    let cells = run::cells(&for_table, false);
    let by_depth = run::cells(&done, true);
    let v = serde_json::json!({
        "provenance": prov,
        "task": a.task,
        "options": options(&a),
        "cells": cells,
        "cells_by_depth": by_depth,
        "records": done,
    });
    let json_path = out.join("results.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&v)? + "\n")
        .with_context(|| format!("cannot write {}", json_path.display()))?;
    if let Some(e) = write_error {
        bail!(
            "cannot append to {}: {e}; {} holds every record, but --resume reads {} and would \
             make the missing ones again",
            records_path.display(),
            json_path.display(),
            records_path.display()
        );
    }
    let mut wrote = vec![json_path.display().to_string()];
    if a.task == "niah" {
        let heat: Vec<plot::HeatCell> = by_depth
            .iter()
            .filter_map(|c| {
                Some(plot::HeatCell {
                    policy: c.policy.clone(),
                    budget: c.budget.clone(),
                    length: c.length,
                    depth: c.depth?,
                    mean: c.mean,
                })
            })
            .collect();
        let path = out.join("heatmap.svg");
        let title = format!(
            "needle in a haystack: {}, B = {}, {} per cell ({})",
            prov.model,
            a.chunk,
            a.samples,
            commits(&done)
        );
        plot::heatmap_svg(&path, &heat, &title)?;
        wrote.push(path.display().to_string());
    }
    // The table last: a closed stdout (`| head`) ends the process there, the files written.
    print!("{}", table(&a, &prov, &cells, longbench, &commits(&done)));
    eprintln!("wrote {}", wrote.join(", "));
    Ok(())
}

fn record_from_json(v: &serde_json::Value) -> Option<Record> {
    let s = |k: &str| v.get(k)?.as_str().map(str::to_string);
    Some(Record {
        task: s("task")?,
        id: s("id")?,
        length: v.get("length")?.as_u64()? as usize,
        depth: v.get("depth").and_then(|d| d.as_f64()),
        input_tokens: v.get("input_tokens")?.as_u64()? as usize,
        truncated: v.get("truncated")?.as_bool()?,
        policy: s("policy")?,
        budget: s("budget")?,
        budget_tokens: v
            .get("budget_tokens")
            .and_then(|b| b.as_u64())
            .map(|b| b as usize),
        prediction: s("prediction")?,
        answers: v
            .get("answers")?
            .as_array()?
            .iter()
            .filter_map(|a| a.as_str().map(str::to_string))
            .collect(),
        score: v.get("score")?.as_f64()?,
        evictions: v.get("evictions")?.as_u64()? as usize,
        seconds: v.get("seconds")?.as_f64()?,
        // Records made before prefixes were shared have no such field.
        prefix_tokens: v.get("prefix_tokens").and_then(|p| p.as_u64()).unwrap_or(0) as usize,
        prefix_seconds: v
            .get("prefix_seconds")
            .and_then(|p| p.as_f64())
            .unwrap_or(0.0),
        // Records made before the build was recorded have none.
        code: s("code").unwrap_or_default(),
    })
}

/// The builds that made `records`, in order of first appearance, with how many records each
/// made (`unrecorded` for records older than the field).
fn builds(records: &[Record]) -> Vec<(String, usize)> {
    let mut out: Vec<(String, usize)> = Vec::new();
    for r in records {
        let c = if r.code.is_empty() {
            "unrecorded"
        } else {
            r.code.as_str()
        };
        match out.iter_mut().find(|(k, _)| k == c) {
            Some((_, n)) => *n += 1,
            None => out.push((c.to_string(), 1)),
        }
    }
    out
}

/// `commit X`, or `commits X (n records), Y (m)` when the records come from several builds.
fn commits(records: &[Record]) -> String {
    match builds(records).as_slice() {
        [] => "no records".into(),
        [(c, _)] => format!("commit {c}"),
        many => format!(
            "commits {}",
            many.iter()
                .map(|(c, n)| format!("{c} ({n} records)"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Rows: task, policy, budget; columns: lengths. Each cell: mean score in %, ± standard error,
/// and the number of samples.
fn table(
    a: &EvalArgs,
    prov: &Provenance,
    cells: &[Cell],
    longbench: bool,
    commits: &str,
) -> String {
    let mut s = format!(
        "# {} | {} | {} | chunk {} | {} | {commits}\n# score in % ± standard error (samples)\n",
        a.task,
        prov.model,
        if a.chat { "chat" } else { "plain" },
        a.chunk,
        prov.date,
    );
    let mut lengths: Vec<usize> = cells.iter().map(|c| c.length).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let _ = write!(s, "{:24} {:>15} {:>6}", "task", "policy", "N");
    for l in &lengths {
        if longbench {
            let _ = write!(s, " {:>18}", "score");
        } else {
            let _ = write!(s, " {:>18}", format!("L={l}"));
        }
    }
    s.push('\n');
    let mut rows: Vec<(String, String, String)> = Vec::new();
    for c in cells {
        let r = (c.task.clone(), c.policy.clone(), c.budget.clone());
        if !rows.contains(&r) {
            rows.push(r);
        }
    }
    for (task, policy, budget) in rows {
        let _ = write!(s, "{task:24} {policy:>15} {budget:>6}");
        for l in &lengths {
            let cell = cells.iter().find(|c| {
                c.task == task && c.policy == policy && c.budget == budget && c.length == *l
            });
            let txt = cell.map_or_else(
                || "-".to_string(),
                |c| format!("{:.1} ±{:.1} ({})", 100.0 * c.mean, 100.0 * c.stderr, c.n),
            );
            let _ = write!(s, " {txt:>18}");
        }
        s.push('\n');
    }
    s
}

/// Where a run writes its settings before its first record (see [`check_resume`]).
const RUN_FILE: &str = "run.json";

/// The options a results file records (and --resume checks).
fn options(a: &EvalArgs) -> serde_json::Value {
    let p = &a.policy_args;
    serde_json::json!({
        "policies": a.policies, "budgets": a.budgets, "lengths": a.lengths,
        "depths": a.depths, "samples": a.samples, "seed": a.seed, "chunk": a.chunk,
        "chat": a.chat, "window": p.window, "sinks": p.sinks,
        "evict_every": p.evict_every.unwrap_or(a.chunk), "snap_window": p.snap_window,
        "policy_seed": p.policy_seed,
    })
}

/// Refuses to resume into a directory whose earlier run used other options that change the
/// records (device kind, model, dtype, KV dtype, attention, CPU weight copies, RoPE, chat
/// template, chunk, protection, seed): their records would be mixed with incomparable ones. Lengths, depths,
/// budgets, policies and samples may grow. The settings are the last run's `run.json`
/// (written before its first record, so a run stopped early has it), else, for directories
/// made before it existed, `results.json`.
fn check_resume(results: &std::path::Path, a: &EvalArgs, engine: &keydiff::Engine) -> Result<()> {
    let settings = results.with_file_name(RUN_FILE);
    let (text, results) = match std::fs::read_to_string(&settings) {
        Ok(t) => (t, settings.as_path()),
        Err(_) => match std::fs::read_to_string(results) {
            Ok(t) => (t, results),
            Err(_) => bail!(
                "cannot go on from the records in {}: they carry no settings to check this \
                 run against (neither {RUN_FILE} nor results.json); start afresh there",
                results.parent().unwrap_or(results).display()
            ),
        },
    };
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a results file", results.display()))?;
    let o = &v["options"];
    let p = &v["provenance"];
    let now = Provenance::collect(engine, a.load.random_weights, String::new());
    // Results written before the backend was recorded were eager.
    let attention = match &p["attention"] {
        serde_json::Value::Null => "eager".into(),
        v => v.clone(),
    };
    // Results written before the cache dtype was recorded held `dtype`.
    let kv_dtype = match &p["kv_dtype"] {
        serde_json::Value::String(s) if !s.is_empty() => p["kv_dtype"].clone(),
        _ => p["dtype"].clone(),
    };
    // Results written before the rotation existed held none.
    let kv_rotated = p["kv_rotated"].as_bool().unwrap_or(false);
    // Results written before the CPU weight copies were recorded: unknown, not checked.
    let cpu_weights = match &p["cpu_weights"] {
        serde_json::Value::String(s) if !s.is_empty() => p["cpu_weights"].clone(),
        _ => serde_json::Value::Null,
    };
    // Results written before RoPE was recorded: the model's own, not checked.
    let rope = match &p["rope"] {
        serde_json::Value::String(s) if !s.is_empty() => p["rope"].clone(),
        _ => serde_json::Value::Null,
    };
    // Results written before the chat template was recorded, or made without `--chat`
    // (which renders nothing): not checked.
    let chat_template = match &p["chat_template"] {
        serde_json::Value::String(s) if !s.is_empty() && a.chat => p["chat_template"].clone(),
        _ => serde_json::Value::Null,
    };
    // The kind of device (`cpu`, `Cuda`, ...), not its ordinal: another GPU of the same kind
    // may resume, a CPU may not go on from a GPU's records (other kernels, other rounding).
    let kind = |d: &str| -> serde_json::Value {
        d.split([' ', '{', '('])
            .next()
            .unwrap_or(d)
            .to_lowercase()
            .into()
    };
    let device = match p["device"].as_str() {
        Some(d) => kind(d),
        None => serde_json::Value::Null,
    };
    let now_options = options(a);
    let checks: [(&str, serde_json::Value, serde_json::Value); 17] = [
        ("--device", device, kind(&now.device)),
        ("--chat", o["chat"].clone(), a.chat.into()),
        ("--chunk", o["chunk"].clone(), a.chunk.into()),
        ("--window", o["window"].clone(), a.policy_args.window.into()),
        ("--sinks", o["sinks"].clone(), a.policy_args.sinks.into()),
        // Files written before these were recorded: not checked.
        (
            "--evict-every",
            o["evict_every"].clone(),
            now_options["evict_every"].clone(),
        ),
        (
            "--snap-window",
            o["snap_window"].clone(),
            now_options["snap_window"].clone(),
        ),
        (
            "--policy-seed",
            o["policy_seed"].clone(),
            now_options["policy_seed"].clone(),
        ),
        ("--seed", o["seed"].clone(), a.seed.into()),
        ("-m", p["model"].clone(), now.model.into()),
        ("--dtype", p["dtype"].clone(), now.dtype.into()),
        ("--attention", attention, now.attention.into()),
        (
            "--kv-dtype/--cache-type-k/-v",
            kv_dtype,
            now.kv_dtype.into(),
        ),
        ("--no-kv-rotation", kv_rotated.into(), now.kv_rotated.into()),
        (
            "--as-stored/--memory-limit (CPU weight copies)",
            cpu_weights,
            now.cpu_weights.into(),
        ),
        ("--rope-* (RoPE)", rope, now.rope.into()),
        (
            "--chat-template*/--chat-template-kwargs",
            chat_template,
            now.chat_template.into(),
        ),
    ];
    for (name, was, is) in checks {
        if !was.is_null() && was != is {
            bail!(
                "cannot --resume into {}: it was made with {name} {was}, this run has {is}",
                results.parent().unwrap_or(results).display()
            );
        }
    }
    Ok(())
}
