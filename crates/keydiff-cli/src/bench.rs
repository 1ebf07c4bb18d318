//! `keydiff bench ttft|decode|join`: parse, run the library's sweeps, print and write results.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use keydiff::bench::{
    self, Case, DecodeResult, JoinMode, JoinResult, Phase, Plan, Provenance, TtftResult,
};
use keydiff::{CacheConfig, Engine, PolicyKind, Stats};

use crate::{plot, LoadArgs, PolicyArgs};

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Time to first token over prompt lengths, budgets, chunk sizes and policies. Prints a
    /// table and writes results.csv, results.json and ttft.svg to --out.
    Ttft(TtftArgs),
    /// Decode tokens per second and memory at a budget, after a prompt.
    Decode(DecodeArgs),
    /// A prompt joining requests that decode together (as `serve --max-batch`): the running
    /// requests' longest and mean time between tokens while it joins, and its time to first
    /// token, when it is prefilled alone (the others wait) and in the batch's steps.
    Join(JoinArgs),
    /// Redraw DIR/ttft.svg from DIR/results.json (e.g. after merging results).
    Plot {
        /// A directory written by `bench ttft`.
        dir: PathBuf,
    },
}

/// Options of every sweep.
#[derive(Args)]
pub struct SweepArgs {
    #[command(flatten)]
    load: LoadArgs,
    /// Prompt lengths in tokens (random token ids, drawn anew for every repetition).
    #[arg(long, value_delimiter = ',', default_value = "4096")]
    prompt_len: Vec<usize>,
    /// KV budgets N (not used by `full`).
    #[arg(long, value_delimiter = ',', default_value = "2048")]
    budget: Vec<usize>,
    /// Policies to compare.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,keydiff,tova,snapkv,h2o,sink"
    )]
    policies: Vec<String>,
    #[command(flatten)]
    policy_args: PolicyArgs,
    /// Unrecorded runs of every case before measuring.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Measured runs of every case (interleaved: one round runs every case once).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Round r's prompt is drawn from seed + r.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Directory for the results (default: bench/out/KIND under the current directory).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
pub struct TtftArgs {
    #[command(flatten)]
    sweep: SweepArgs,
    /// Prefill chunk sizes B.
    #[arg(long, value_delimiter = ',', default_value = "64,128,256")]
    chunks: Vec<usize>,
    /// Skip the time breakdown (on GPUs it costs one extra, profiled run per case).
    #[arg(long)]
    no_breakdown: bool,
    /// When the layers evict: `together` (every layer at once after the last layer's
    /// attention, the engine's default) and/or `per-layer` (each layer after its own, shown as
    /// `POLICY/per-layer`). Both keep the same tokens; `full` gets one case.
    #[arg(long, value_delimiter = ',', default_value = "together")]
    eviction: Vec<EvictionTiming>,
    /// Run every case under each of these attention backends (eager, flash), interleaved in
    /// one sweep, shown as `POLICY/eager` and `POLICY/flash` (`/full` compares with full under
    /// the same backend). Default: only --attention's.
    #[arg(long, value_delimiter = ',')]
    compare_attention: Vec<String>,
}

/// `bench ttft --eviction`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum EvictionTiming {
    Together,
    PerLayer,
}

#[derive(Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    sweep: SweepArgs,
    /// Prefill chunk sizes B (decode evicts every --evict-every tokens, default B).
    #[arg(long, value_delimiter = ',', default_value = "128")]
    chunks: Vec<usize>,
    /// Tokens generated after the first (decode steps timed).
    #[arg(long, default_value_t = 128)]
    gen_len: usize,
    /// Requests decoded together (continuous batching, as `serve --max-batch`): each size is
    /// a case of its own; the rate is the batch's, all requests together.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    /// Sampling temperature of the decoded tokens; 0 is greedy. Sampled tokens are drawn where
    /// the logits are (on CUDA keydiff's kernel; `KEYDIFF_CUDA_SAMPLE=0` reads each row to the
    /// host and draws there).
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Top-k (0 is off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Top-p (1 is off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Min-p (0 is off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Seed of the sampler (request i of a batch takes this + i).
    #[arg(long, default_value_t = 0)]
    sample_seed: u64,
}

#[derive(Args)]
pub struct JoinArgs {
    #[command(flatten)]
    sweep: SweepArgs,
    /// Prefill chunk sizes B.
    #[arg(long, value_delimiter = ',', default_value = "128")]
    chunks: Vec<usize>,
    /// Requests decoding when the prompt joins.
    #[arg(long, default_value_t = 4)]
    running: usize,
    /// Their prompts' length in tokens.
    #[arg(long, default_value_t = 128)]
    running_prompt_len: usize,
}

pub fn bench(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Ttft(a) => ttft(a),
        BenchCmd::Decode(a) => decode(a),
        BenchCmd::Join(a) => join(a),
        BenchCmd::Plot { dir } => replot(&dir),
    }
}

/// The full command line, shell-quoted where needed.
pub fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./,:=@+".contains(c))
            {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

impl SweepArgs {
    fn plan(&self, chunks: &[usize], breakdown: bool) -> Result<Plan> {
        let policies = self
            .policies
            .iter()
            .map(|p| self.policy_args.policy(p))
            .collect::<Result<Vec<PolicyKind>>>()?;
        let template = self.policy_args.cache("full", None, chunks[0])?;
        Ok(Plan {
            cases: bench::cases(&self.prompt_len, &self.budget, chunks, &policies, &template)?,
            warmup: self.warmup,
            reps: self.reps,
            seed: self.seed,
            breakdown,
        })
    }

    fn load(&self, chunks: &[usize]) -> Result<Engine> {
        anyhow::ensure!(!chunks.is_empty(), "--chunks is empty");
        self.load.load(CacheConfig::full(chunks[0]))
    }

    fn out_dir(&self, kind: &str) -> Result<PathBuf> {
        let dir = self
            .out
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("bench/out/{kind}")));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create output directory {}", dir.display()))?;
        Ok(dir)
    }
}

pub fn progress_bar(total: usize) -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::with_draw_target(
        Some(total as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} runs, elapsed {elapsed}, eta {eta} {msg}",
        )
        .expect("static template"),
    );
    b
}

/// Advances the progress bar; when stderr is not a terminal (logs, CI), prints a line per run
/// instead, since the bar is not drawn there.
fn on_run(bar: &indicatif::ProgressBar) -> impl FnMut(Phase, &Case, &Stats) + '_ {
    let plain = !std::io::IsTerminal::is_terminal(&std::io::stderr());
    move |phase, case, stats| {
        let what = match phase {
            Phase::Warmup => "warm-up",
            Phase::Measure => "measured",
            Phase::Profile => "profiled",
        };
        let decode = if stats.generated_tokens > 1 {
            format!(", decode {:.1} tok/s", stats.decode_tok_s)
        } else {
            String::new()
        };
        let msg = format!(
            "({what} {}: TTFT {:.3} s{decode})",
            case.label(),
            stats.ttft_s
        );
        if plain {
            eprintln!(
                "[{}/{}] {msg}",
                bar.position() + 1,
                bar.length().unwrap_or(0)
            );
        }
        bar.set_message(msg);
        bar.inc(1);
    }
}

fn ttft(a: TtftArgs) -> Result<()> {
    let mut plan = a.sweep.plan(&a.chunks, !a.no_breakdown)?;
    let out = a.sweep.out_dir("ttft")?;
    let mut engine = a.sweep.load(&a.chunks)?;
    let per_layer: Vec<bool> = a
        .eviction
        .iter()
        .map(|&e| e == EvictionTiming::PerLayer)
        .collect();
    plan.cases = bench::with_eviction_timings(plan.cases, &per_layer)?;
    if !a.compare_attention.is_empty() {
        let backends = a
            .compare_attention
            .iter()
            .map(|b| b.parse())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        plan.cases = bench::with_attentions(&mut engine, plan.cases, &backends)?;
    }
    let mut prov = Provenance::collect(&engine, a.sweep.load.random_weights, command_line());
    if !a.compare_attention.is_empty() {
        prov.attention = format!("{} (per case)", a.compare_attention.join("/"));
    }
    let separate = !engine.config().device.is_cpu();
    let bar = progress_bar(bench::ttft_runs(&plan, separate));
    let results = bench::ttft(&mut engine, &plan, on_run(&bar))?;
    bar.finish_and_clear();

    // The files first: a closed stdout (`| head`) ends the process at the table.
    write_json(&out.join("results.json"), &prov, &results)?;
    write_csv(&out.join("results.csv"), &prov, &ttft_csv(&results))?;
    plot::ttft_svg(&out.join("ttft.svg"), &results, &prov)?;
    print!("{}", ttft_table(&results, &prov, &plan));
    eprintln!(
        "wrote {0}/results.csv, {0}/results.json, {0}/ttft.svg",
        out.display()
    );
    Ok(())
}

fn replot(dir: &Path) -> Result<()> {
    let path = dir.join("results.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a JSON array", path.display()))?;
    let first = rows
        .first()
        .with_context(|| format!("{} has no rows", path.display()))?;
    let prov: Provenance = serde_json::from_value(first.clone())
        .with_context(|| format!("{}: row 1 lacks provenance", path.display()))?;
    let results = rows
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            serde_json::from_value::<TtftResult>(r)
                .with_context(|| format!("{}: row {} is not a TTFT result", path.display(), i + 1))
        })
        .collect::<Result<Vec<_>>>()?;
    plot::ttft_svg(&dir.join("ttft.svg"), &results, &prov)?;
    eprintln!("wrote {}", dir.join("ttft.svg").display());
    Ok(())
}

fn decode(a: DecodeArgs) -> Result<()> {
    let plan = a.sweep.plan(&a.chunks, false)?;
    let out = a.sweep.out_dir("decode")?;
    let mut engine = a.sweep.load(&a.chunks)?;
    let prov = Provenance::collect(&engine, a.sweep.load.random_weights, command_line());
    let bar = progress_bar(bench::ttft_runs(&plan, false) * a.batch.len());
    let sampling = keydiff::Sampling {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: a.sample_seed,
        ..Default::default()
    };
    let mut results = Vec::new();
    for &n in &a.batch {
        results.extend(bench::decode(
            &mut engine,
            &plan,
            a.gen_len,
            n,
            &sampling,
            on_run(&bar),
        )?);
    }
    bar.finish_and_clear();

    write_json(&out.join("results.json"), &prov, &results)?;
    write_csv(&out.join("results.csv"), &prov, &decode_csv(&results))?;
    print!("{}", decode_table(&results, &prov, &plan));
    eprintln!("wrote {0}/results.csv, {0}/results.json", out.display());
    Ok(())
}

fn join(a: JoinArgs) -> Result<()> {
    let plan = a.sweep.plan(&a.chunks, false)?;
    let out = a.sweep.out_dir("join")?;
    let mut engine = a.sweep.load(&a.chunks)?;
    let prov = Provenance::collect(&engine, a.sweep.load.random_weights, command_line());
    let mut results = Vec::new();
    let bar = progress_bar((plan.warmup + plan.reps) * plan.cases.len() * 2);
    let plain = !std::io::IsTerminal::is_terminal(&std::io::stderr());
    // One prompt joins: a step takes one chunk of it (its chunks run one after another, each
    // evicting), whatever the step's token budget; so a step's budget is its case's B.
    for &chunk in &a.chunks {
        let modes = [JoinMode::Alone, JoinMode::Steps(chunk)];
        let plan = Plan {
            cases: plan
                .cases
                .iter()
                .filter(|c| c.cache.chunk == chunk)
                .cloned()
                .collect(),
            ..plan.clone()
        };
        results.extend(bench::join(
            &mut engine,
            &plan,
            a.running,
            a.running_prompt_len,
            &modes,
            |phase, case, mode, (gap, ttft)| {
                let what = match phase {
                    Phase::Measure => "measured",
                    _ => "warm-up",
                };
                let msg = format!(
                    "({what} {} {}: max gap {:.3} s, TTFT {:.3} s)",
                    case.label(),
                    mode.name(),
                    gap,
                    ttft
                );
                bar.inc(1);
                if plain {
                    eprintln!("{msg}");
                } else {
                    bar.set_message(msg);
                }
            },
        )?);
    }
    bar.finish_and_clear();
    write_json(&out.join("results.json"), &prov, &results)?;
    write_csv(&out.join("results.csv"), &prov, &join_csv(&results))?;
    print!("{}", join_table(&results, &prov, &plan));
    eprintln!("wrote {0}/results.csv, {0}/results.json", out.display());
    Ok(())
}

fn header(prov: &Provenance, plan: &Plan) -> String {
    format!(
        "# {} | {}{} | {} {} (KV {}) {} attention | commit {} | {}\n# {} warm-up + {} measured runs per case, interleaved; prompts: random token ids, seed {} + round\n",
        prov.date,
        prov.model,
        if prov.cpu_weights.is_empty() {
            String::new()
        } else {
            format!(" ({})", prov.cpu_weights)
        },
        prov.device,
        prov.dtype,
        prov.kv_dtype,
        prov.attention,
        prov.code(),
        prov.machine,
        plan.warmup,
        plan.reps,
        plan.seed
    )
}

fn budget_str(b: Option<usize>) -> String {
    b.map_or_else(|| "-".into(), |n| n.to_string())
}

const MIB: f64 = 1024.0 * 1024.0;

/// TTFT of `full` at the same prompt length, chunk size and attention, if measured.
fn full_ttft(results: &[TtftResult], r: &TtftResult) -> Option<f64> {
    results
        .iter()
        .find(|f| {
            f.policy.split('/').next() == Some("full")
                && f.attention == r.attention
                && f.prompt_len == r.prompt_len
                && f.chunk == r.chunk
        })
        .map(|f| f.ttft.median)
}

fn ttft_table(results: &[TtftResult], prov: &Provenance, plan: &Plan) -> String {
    let mut s = header(prov, plan);
    if prov.random_weights {
        s.push_str("# random weights: timing only, any generated text is meaningless\n");
    }
    // Wide enough for `keydiff-mean/per-layer`.
    let w = results
        .iter()
        .map(|r| r.policy.len())
        .max()
        .unwrap_or(0)
        .max(15);
    let _ = writeln!(
        s,
        "{:>6} {:>4} {:>w$} {:>6} {:>9} {:>9} {:>9} {:>7} {:>10} {:>7} {:>9} {:>10}",
        "L",
        "B",
        "policy",
        "N",
        "TTFT med",
        "min",
        "max",
        "/full",
        "prefill/s",
        "evict%",
        "stats%",
        "KV MiB"
    );
    for r in results {
        let vs_full = full_ttft(results, r)
            .map_or_else(|| "-".into(), |f| format!("{:.3}", r.ttft.median / f));
        let b = &r.breakdown;
        let stats_share = if plan.breakdown && b.total() > 0.0 {
            format!("{:.2}", 100.0 * r.share(b.attention_stats_s))
        } else {
            "-".into()
        };
        let _ = writeln!(
            s,
            "{:>6} {:>4} {:>w$} {:>6} {:>9.3} {:>9.3} {:>9.3} {:>7} {:>10.1} {:>7.2} {:>9} {:>10.1}",
            r.prompt_len,
            r.chunk,
            r.policy,
            budget_str(r.budget),
            r.ttft.median,
            r.ttft.min,
            r.ttft.max,
            vs_full,
            r.prefill_tok_s,
            100.0 * r.eviction_share,
            stats_share,
            r.peak_kv_bytes as f64 / MIB
        );
    }
    s
}

fn decode_table(results: &[DecodeResult], prov: &Provenance, plan: &Plan) -> String {
    let mut s = header(prov, plan);
    if let Some(c) = results.first().map(|r| &r.sampling) {
        let _ = match c.temperature > 0.0 {
            false => writeln!(s, "# tokens: greedy"),
            true => writeln!(
                s,
                "# tokens: sampled, temperature {}, top-k {}, top-p {}, min-p {}, seed {} (a \
                 batch's request i: seed + i)",
                c.temperature, c.top_k, c.top_p, c.min_p, c.seed
            ),
        };
    }
    let _ = writeln!(
        s,
        "{:>6} {:>4} {:>15} {:>6} {:>5} {:>6} {:>9} {:>9} {:>9} {:>10} {:>7} {:>10}",
        "L",
        "B",
        "policy",
        "N",
        "batch",
        "steps",
        "tok/s med",
        "min",
        "max",
        "evictions",
        "KV MiB",
        "RSS MiB"
    );
    for r in results {
        let _ = writeln!(
            s,
            "{:>6} {:>4} {:>15} {:>6} {:>5} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>10} {:>7.1} {:>10}",
            r.prompt_len,
            r.chunk,
            r.policy,
            budget_str(r.budget),
            r.batch,
            r.decode_steps,
            r.decode.median,
            r.decode.min,
            r.decode.max,
            r.evictions,
            r.peak_kv_bytes as f64 / MIB,
            r.process_peak_rss_bytes
                .map_or_else(|| "-".into(), |b| format!("{:.0}", b as f64 / MIB))
        );
    }
    s.push_str(
        "# batch > 1: that many requests decode together; tok/s is theirs together, steps and \
         evictions are one request's, KV MiB one request's cache\n",
    );
    s.push_str("# RSS: the process's peak resident memory after all runs (weights included)\n");
    if let Some(b) = results.iter().find_map(|r| r.device_used_bytes) {
        let _ = writeln!(
            s,
            "# GPU memory in use after all runs (driver total - free): {:.0} MiB",
            b as f64 / MIB
        );
    }
    s
}

/// The `alone` row of the same case, if measured.
fn join_alone<'a>(results: &'a [JoinResult], r: &JoinResult) -> Option<&'a JoinResult> {
    results.iter().find(|a| {
        a.mode == "alone"
            && (a.prompt_len, a.chunk, &a.policy, a.budget)
                == (r.prompt_len, r.chunk, &r.policy, r.budget)
    })
}

fn join_table(results: &[JoinResult], prov: &Provenance, plan: &Plan) -> String {
    let mut s = header(prov, plan);
    let _ = writeln!(
        s,
        "{:>6} {:>4} {:>15} {:>6} {:>7} {:>6} {:>7} {:>10} {:>8} {:>8} {:>11} {:>9} {:>8}",
        "L",
        "B",
        "policy",
        "N",
        "running",
        "mode",
        "tok/step",
        "max gap s",
        "/alone",
        "mean s",
        "TTFT med s",
        "max",
        "/alone"
    );
    for r in results {
        let alone = join_alone(results, r);
        let ratio = |f: fn(&JoinResult) -> f64| {
            alone.map_or_else(|| "-".into(), |a| format!("{:.3}", f(r) / f(a)))
        };
        let _ = writeln!(
            s,
            "{:>6} {:>4} {:>15} {:>6} {:>7} {:>6} {:>7} {:>10.3} {:>8} {:>8.3} {:>11.3} {:>9.3} {:>8}",
            r.prompt_len,
            r.chunk,
            r.policy,
            budget_str(r.budget),
            r.running,
            r.mode,
            if r.mode == "alone" { "-".to_string() } else { r.prefill_tokens.to_string() },
            r.max_gap.median,
            ratio(|x| x.max_gap.median),
            r.mean_gap.median,
            r.ttft.median,
            r.ttft.max,
            ratio(|x| x.ttft.median)
        );
    }
    s.push_str(
        "# max gap: the running requests' longest time between two tokens while the prompt \
         joined (median over runs); mean: their time per token over that window; TTFT: the \
         joining prompt's; /alone: against the same case prefilled alone, measured in the same \
         rounds\n",
    );
    s
}

fn join_csv(results: &[JoinResult]) -> Csv {
    let columns = vec![
        "prompt_len",
        "chunk",
        "policy",
        "budget",
        "running",
        "running_prompt_len",
        "mode",
        "prefill_tokens",
        "reps",
        "max_gap_s_median",
        "max_gap_s_min",
        "max_gap_s_max",
        "mean_gap_s_median",
        "ttft_s_median",
        "ttft_s_min",
        "ttft_s_max",
    ];
    let rows = results
        .iter()
        .map(|r| {
            vec![
                r.prompt_len.to_string(),
                r.chunk.to_string(),
                r.policy.clone(),
                r.budget.map_or_else(String::new, |n| n.to_string()),
                r.running.to_string(),
                r.running_prompt_len.to_string(),
                r.mode.clone(),
                r.prefill_tokens.to_string(),
                r.ttft_s.len().to_string(),
                format!("{:.4}", r.max_gap.median),
                format!("{:.4}", r.max_gap.min),
                format!("{:.4}", r.max_gap.max),
                format!("{:.4}", r.mean_gap.median),
                format!("{:.4}", r.ttft.median),
                format!("{:.4}", r.ttft.min),
                format!("{:.4}", r.ttft.max),
            ]
        })
        .collect();
    Csv { columns, rows }
}

/// Every row carries the provenance (commit, machine, device, command line).
fn write_json<T: serde::Serialize>(path: &Path, prov: &Provenance, rows: &[T]) -> Result<()> {
    let rows = rows
        .iter()
        .map(|r| {
            let mut v = serde_json::to_value(r)?;
            let p = serde_json::to_value(prov)?;
            // A row's own value wins: a TTFT row's `attention` is what it ran with, which
            // `bench ttft --compare-attention` sets per case.
            if let (Some(v), Some(p)) = (v.as_object_mut(), p.as_object()) {
                for (k, x) in p {
                    v.entry(k.clone()).or_insert_with(|| x.clone());
                }
            }
            Ok(v)
        })
        .collect::<Result<Vec<_>>>()?;
    std::fs::write(path, serde_json::to_string_pretty(&rows)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))
}

/// A table of named columns, one row per result, provenance columns appended.
struct Csv {
    columns: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

fn ttft_csv(results: &[TtftResult]) -> Csv {
    let columns = vec![
        "prompt_len",
        "chunk",
        "policy",
        "budget",
        "reps",
        "ttft_median_s",
        "ttft_min_s",
        "ttft_max_s",
        "ttft_vs_full",
        "prefill_tok_s",
        "eviction_share",
        "evictions",
        "peak_kv_bytes",
        "attention_s",
        "attention_stats_s",
        "eviction_score_s",
        "select_move_s",
        "mlp_s",
        "other_s",
        "breakdown_from_separate_run",
    ];
    let rows = results
        .iter()
        .map(|r| {
            let b = &r.breakdown;
            vec![
                r.prompt_len.to_string(),
                r.chunk.to_string(),
                r.policy.clone(),
                r.budget.map_or_else(String::new, |n| n.to_string()),
                r.ttft_s.len().to_string(),
                format!("{:.6}", r.ttft.median),
                format!("{:.6}", r.ttft.min),
                format!("{:.6}", r.ttft.max),
                full_ttft(results, r)
                    .map_or_else(String::new, |f| format!("{:.4}", r.ttft.median / f)),
                format!("{:.2}", r.prefill_tok_s),
                format!("{:.6}", r.eviction_share),
                r.evictions.to_string(),
                r.peak_kv_bytes.to_string(),
                format!("{:.6}", b.attention_s),
                format!("{:.6}", b.attention_stats_s),
                format!("{:.6}", b.eviction_score_s),
                format!("{:.6}", b.select_move_s),
                format!("{:.6}", b.mlp_s),
                format!("{:.6}", b.other_s),
                r.breakdown_from_separate_run.to_string(),
            ]
        })
        .collect();
    Csv { columns, rows }
}

fn decode_csv(results: &[DecodeResult]) -> Csv {
    let columns = vec![
        "prompt_len",
        "chunk",
        "policy",
        "budget",
        "batch",
        "reps",
        "decode_steps",
        "decode_tok_s_median",
        "decode_tok_s_min",
        "decode_tok_s_max",
        "evictions",
        "peak_kv_bytes",
        "final_cache_len",
        "process_peak_rss_bytes",
        "device_used_bytes",
    ];
    let rows = results
        .iter()
        .map(|r| {
            vec![
                r.prompt_len.to_string(),
                r.chunk.to_string(),
                r.policy.clone(),
                r.budget.map_or_else(String::new, |n| n.to_string()),
                r.batch.to_string(),
                r.decode_tok_s.len().to_string(),
                r.decode_steps.to_string(),
                format!("{:.3}", r.decode.median),
                format!("{:.3}", r.decode.min),
                format!("{:.3}", r.decode.max),
                r.evictions.to_string(),
                r.peak_kv_bytes.to_string(),
                r.final_cache_len.to_string(),
                r.process_peak_rss_bytes
                    .map_or_else(String::new, |b| b.to_string()),
                r.device_used_bytes
                    .map_or_else(String::new, |b| b.to_string()),
            ]
        })
        .collect();
    Csv { columns, rows }
}

/// RFC 4180 quoting.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn write_csv(path: &Path, prov: &Provenance, t: &Csv) -> Result<()> {
    let extra = [
        ("date", prov.date.as_str()),
        ("commit", prov.commit.as_str()),
        ("binary_commit", prov.binary_commit.as_str()),
        ("env", prov.env.as_str()),
        ("machine", prov.machine.as_str()),
        ("device", prov.device.as_str()),
        ("dtype", prov.dtype.as_str()),
        ("kv_dtype", prov.kv_dtype.as_str()),
        ("attention", prov.attention.as_str()),
        ("model", prov.model.as_str()),
        ("cpu_weights", prov.cpu_weights.as_str()),
        (
            "random_weights",
            if prov.random_weights { "true" } else { "false" },
        ),
        ("command", prov.command.as_str()),
    ];
    let mut s = String::new();
    let head: Vec<String> = t
        .columns
        .iter()
        .map(|c| c.to_string())
        .chain(extra.iter().map(|(k, _)| k.to_string()))
        .collect();
    s.push_str(&head.join(","));
    s.push('\n');
    for row in &t.rows {
        let cells: Vec<String> = row
            .iter()
            .map(|c| csv_field(c))
            .chain(extra.iter().map(|(_, v)| csv_field(v)))
            .collect();
        s.push_str(&cells.join(","));
        s.push('\n');
    }
    std::fs::write(path, s).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes_commas_and_quotes() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }
}
