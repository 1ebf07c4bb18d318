//! Benchmarks: time-to-first-token sweeps, decode throughput, and prompts joining a batch.
//!
//! How the timing is kept honest:
//! - The device is synchronised before each measured request; the request ends by copying the
//!   logits to the host, which waits for the device, so the host timer spans finished work.
//! - Warm-up runs are made before any measured run and are not recorded.
//! - Repetitions are interleaved: round r runs every case once, on a prompt drawn from
//!   `seed + r`, so slow drift of the machine (heat, other load) spreads over all cases rather than
//!   landing on one. Every case of a round sees the same prompt.
//! - The time breakdown needs a device synchronisation at every region boundary. On the CPU that
//!   is free, so measured runs carry it. On GPUs it would stall the queue, so it comes from one
//!   extra, separate profiled run per case that is not part of the TTFT figures.

use std::time::Instant;

use crate::engine::{Breakdown, Engine, GenerateParams, Prompt, Stats};
use crate::error::{EngineError, Result};
use crate::parity::random_tokens;
use crate::sampling::Sampling;
use keydiff_cache::{CacheConfig, PolicyKind};
use keydiff_model::AttentionBackend;

/// One measured configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub prompt_len: usize,
    /// Policy, budget N and chunk size B.
    pub cache: CacheConfig,
    /// Each layer evicts after its own attention, not every layer after the last one's
    /// ([`crate::EngineConfig::evict_per_layer`]).
    pub evict_per_layer: bool,
    /// The chunk attention the case runs with; `None`: the engine's, as loaded.
    pub attention: Option<AttentionBackend>,
}

impl Case {
    /// `policy N=… B=… L=…`, for messages.
    pub fn label(&self) -> String {
        let n = self
            .cache
            .budget
            .map_or_else(|| "-".to_string(), |n| n.to_string());
        format!(
            "{} N={n} B={} L={}",
            self.policy_name(),
            self.cache.chunk,
            self.prompt_len
        )
    }

    /// The policy's name, with `/per-layer` when each layer evicts after its own attention
    /// and `/eager` or `/flash` when the case sets the attention: the series the results,
    /// tables and plots show.
    pub fn policy_name(&self) -> String {
        let mut name = self.cache.policy.name();
        if self.evict_per_layer {
            name.push_str("/per-layer");
        }
        if let Some(a) = self.attention {
            name.push('/');
            name.push_str(a.name());
        }
        name
    }
}

/// `cases`, each once per attention backend of `backends` (`eager`, `flash`), in one sweep
/// so that their ratios come from one run. Every backend must run on the engine's device,
/// dtype and model ([`Engine::set_attention`] checks, before anything runs); `auto` is
/// refused: name what it would resolve to.
pub fn with_attentions(
    engine: &mut Engine,
    cases: Vec<Case>,
    backends: &[AttentionBackend],
) -> Result<Vec<Case>> {
    if backends.is_empty() {
        return Err(EngineError::BadParams("no attention backend given".into()));
    }
    if let Some(b) = backends
        .iter()
        .enumerate()
        .find_map(|(i, b)| backends[..i].contains(b).then_some(b))
    {
        return Err(EngineError::BadParams(format!(
            "attention backend {b} given twice"
        )));
    }
    let loaded = engine.config().attention;
    for &b in backends {
        if b == AttentionBackend::Auto {
            return Err(EngineError::BadParams(
                "attention backends to compare: name eager or flash, not auto".into(),
            ));
        }
        let ok = engine.set_attention(b);
        engine.set_attention(loaded)?;
        ok?;
    }
    Ok(cases
        .into_iter()
        .flat_map(|c| {
            backends.iter().map(move |&b| Case {
                attention: Some(b),
                ..c.clone()
            })
        })
        .collect())
}

/// `cases`, each once per eviction timing of `per_layer` (`false`: every layer at once after
/// the last one's attention, the engine's default; `true`: each layer after its own). `full`
/// never evicts, so it gets one case, not two of the same thing.
pub fn with_eviction_timings(cases: Vec<Case>, per_layer: &[bool]) -> Result<Vec<Case>> {
    if per_layer.is_empty() {
        return Err(EngineError::BadParams("no eviction timing given".into()));
    }
    let mut out = Vec::new();
    for c in cases {
        if c.cache.policy == PolicyKind::Full {
            out.push(c);
            continue;
        }
        for &p in per_layer {
            out.push(Case {
                evict_per_layer: p,
                ..c.clone()
            });
        }
    }
    Ok(out)
}

/// The cross product of prompt lengths, chunk sizes, policies and budgets. `full` takes no
/// budget, so it gets one case per length and chunk. `template` gives window, sinks and decode
/// eviction interval. Every case is validated before anything runs.
pub fn cases(
    prompt_lens: &[usize],
    budgets: &[usize],
    chunks: &[usize],
    policies: &[PolicyKind],
    template: &CacheConfig,
) -> Result<Vec<Case>> {
    let mut out = Vec::new();
    for &prompt_len in prompt_lens {
        if prompt_len == 0 {
            return Err(EngineError::BadParams("prompt length 0".into()));
        }
        for &chunk in chunks {
            for policy in policies {
                let budgets: Vec<Option<usize>> = if *policy == PolicyKind::Full {
                    vec![None]
                } else if budgets.is_empty() {
                    return Err(EngineError::BadParams(format!(
                        "policy {} needs a budget (--budget)",
                        policy.name()
                    )));
                } else {
                    budgets.iter().copied().map(Some).collect()
                };
                for budget in budgets {
                    let cache = CacheConfig {
                        policy: policy.clone(),
                        budget,
                        chunk,
                        ..template.clone()
                    };
                    let case = Case {
                        prompt_len,
                        cache,
                        evict_per_layer: false,
                        attention: None,
                    };
                    case.cache.validate().map_err(|e| {
                        EngineError::BadParams(format!("case {}: {e}", case.label()))
                    })?;
                    out.push(case);
                }
            }
        }
    }
    if out.is_empty() {
        return Err(EngineError::BadParams("no benchmark cases".into()));
    }
    Ok(out)
}

/// Median, minimum and maximum.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// Of a non-empty sample (the median of an even count is the mean of the middle two).
    pub fn of(xs: &[f64]) -> Self {
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n == 0 {
            return Self::default();
        }
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Self {
            median,
            min: v[0],
            max: v[n - 1],
        }
    }
}

/// Measured TTFT of one case.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TtftResult {
    pub prompt_len: usize,
    pub chunk: usize,
    /// The policy's name, `/per-layer` appended when each layer evicted after its own
    /// attention ([`Case::policy_name`]).
    pub policy: String,
    /// Each layer evicted after its own attention, not every layer after the last one's.
    #[serde(default)]
    pub evict_per_layer: bool,
    /// The chunk attention the case ran with (`eager`, `flash`). Results written before it
    /// was recorded lack it; read back from a results.json row, they get the provenance's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<String>,
    pub budget: Option<usize>,
    /// Every measured TTFT, in round order.
    pub ttft_s: Vec<f64>,
    pub ttft: Spread,
    /// Prompt tokens per second of prefill, median over runs.
    pub prefill_tok_s: f64,
    /// Eviction (scoring + selection/moves) as a share of prefill time, from the breakdown
    /// ([`TtftResult::share`]).
    pub eviction_share: f64,
    /// Evictions per request (layers × eviction points).
    pub evictions: usize,
    pub peak_kv_bytes: usize,
    /// Prefill time by region: the mean over measured runs on the CPU, or the separate
    /// profiled run on GPUs.
    pub breakdown: Breakdown,
    /// Whether `breakdown` came from a separate profiled run (GPUs) or the measured runs (CPU).
    pub breakdown_from_separate_run: bool,
}

/// What a sweep runs.
#[derive(Debug, Clone)]
pub struct Plan {
    pub cases: Vec<Case>,
    /// Unrecorded runs of every case before measuring.
    pub warmup: usize,
    /// Measured runs of every case.
    pub reps: usize,
    /// Round r's prompt is drawn from `seed + r`.
    pub seed: u64,
    /// Collect the time breakdown.
    pub breakdown: bool,
}

/// Progress of a sweep, for a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Warmup,
    Measure,
    Profile,
}

/// The prompt of round `round`: random token ids, the same for every case of the round.
pub fn prompt(engine: &Engine, len: usize, seed: u64, round: u64) -> Vec<u32> {
    random_tokens(
        len,
        engine.model_config().vocab_size,
        seed.wrapping_add(round),
    )
}

/// Runs are counted as `(warmup + reps + profiled) × cases`.
pub fn ttft_runs(plan: &Plan, profile_separately: bool) -> usize {
    let extra = usize::from(plan.breakdown && profile_separately);
    (plan.warmup + plan.reps + extra) * plan.cases.len()
}

/// Runs a TTFT sweep. `on_run(phase, case, stats)` is called after every run. The engine's
/// cache settings, eviction timing and attention are as they were when it returns.
pub fn ttft(
    engine: &mut Engine,
    plan: &Plan,
    on_run: impl FnMut(Phase, &Case, &Stats),
) -> Result<Vec<TtftResult>> {
    restoring(engine, |engine| ttft_sweep(engine, plan, on_run))
}

/// [`ttft`]'s runs; [`ttft`] restores the engine's settings after them.
fn ttft_sweep(
    engine: &mut Engine,
    plan: &Plan,
    mut on_run: impl FnMut(Phase, &Case, &Stats),
) -> Result<Vec<TtftResult>> {
    if plan.reps == 0 {
        return Err(EngineError::BadParams("--reps must be at least 1".into()));
    }
    let context = engine.model_config().context();
    for c in &plan.cases {
        // The first token needs a place in the context too: a prompt that fills it gets none
        // (and so no time to it).
        if c.prompt_len + 1 > context {
            return Err(EngineError::BadParams(format!(
                "a prompt of {} tokens leaves no room in the context of {context} for the \
                 first token (--prompt-len at most {})",
                c.prompt_len,
                context.saturating_sub(1)
            )));
        }
    }
    let on_cpu = engine.config().device.is_cpu();
    let profile_measured = plan.breakdown && on_cpu;
    let runs = rounds(engine, plan, &mut on_run, |engine, c, p, phase| {
        request(
            engine,
            c,
            p,
            1,
            phase == Phase::Measure && profile_measured,
            &Sampling::default(),
        )
    })?;
    let mut out = Vec::with_capacity(plan.cases.len());
    for (c, stats) in plan.cases.iter().zip(runs) {
        // `None`: the engine's own, which no case changed (only `with_attentions` sets it,
        // and then for every case).
        let attention = c.attention.unwrap_or(engine.config().attention);
        let (breakdown, separate) = if !plan.breakdown {
            (Breakdown::default(), false)
        } else if profile_measured {
            (mean_breakdown(&stats), false)
        } else {
            let p = prompt(engine, c.prompt_len, plan.seed, 0);
            let s = request(engine, c, p, 1, true, &Sampling::default())?;
            on_run(Phase::Profile, c, &s);
            (s.breakdown.unwrap_or_default(), true)
        };
        let ttft_s: Vec<f64> = stats.iter().map(|s| s.ttft_s).collect();
        let prefill: Vec<f64> = stats.iter().map(|s| s.prefill_tok_s).collect();
        let ttft = Spread::of(&ttft_s);
        let eviction_share = if plan.breakdown && breakdown.total() > 0.0 {
            share(
                breakdown.eviction_score_s + breakdown.select_move_s,
                &breakdown,
                separate,
                ttft.median,
            )
        } else {
            // No breakdown: host timers around eviction (exact on the CPU).
            let s = &stats[0];
            (s.eviction.score_s + s.eviction.select_move_s) / s.prefill_s.max(1e-12)
        };
        out.push(TtftResult {
            prompt_len: c.prompt_len,
            chunk: c.cache.chunk,
            policy: c.policy_name(),
            evict_per_layer: c.evict_per_layer,
            attention: Some(attention.name().to_string()),
            budget: c.cache.budget,
            ttft,
            ttft_s,
            prefill_tok_s: Spread::of(&prefill).median,
            eviction_share,
            evictions: stats[0].eviction.evictions,
            peak_kv_bytes: stats[0].peak_kv_bytes,
            breakdown,
            breakdown_from_separate_run: separate,
        });
    }
    Ok(out)
}

/// `seconds` of a region of `breakdown` as a share of the prefill. From the measured runs
/// (the CPU), of their time. From a separate profiled run (GPUs), of the measured TTFT's
/// median: that run waits for the device at every region, which makes it 1.5–1.9× as long as
/// a measured one, so a share of its own total would understate a region's cost.
fn share(seconds: f64, breakdown: &Breakdown, separate: bool, ttft_median: f64) -> f64 {
    let whole = if separate {
        ttft_median
    } else {
        breakdown.total()
    };
    seconds / whole.max(1e-12)
}

impl TtftResult {
    /// `seconds` of a region of this case's breakdown as a share of its prefill (see
    /// `eviction_share`).
    pub fn share(&self, seconds: f64) -> f64 {
        share(
            seconds,
            &self.breakdown,
            self.breakdown_from_separate_run,
            self.ttft.median,
        )
    }
}

fn mean_breakdown(stats: &[Stats]) -> Breakdown {
    let n = stats.len().max(1) as f64;
    let mut m = Breakdown::default();
    for b in stats.iter().filter_map(|s| s.breakdown) {
        m.attention_s += b.attention_s / n;
        m.attention_stats_s += b.attention_stats_s / n;
        m.eviction_score_s += b.eviction_score_s / n;
        m.select_move_s += b.select_move_s / n;
        m.mlp_s += b.mlp_s / n;
        m.other_s += b.other_s / n;
    }
    m
}

/// Warm-up runs (prompts from seeds no measured round uses), then `plan.reps` interleaved
/// rounds over every case; returns each case's measured stats in round order.
fn rounds<F>(
    engine: &mut Engine,
    plan: &Plan,
    on_run: &mut impl FnMut(Phase, &Case, &Stats),
    mut run: F,
) -> Result<Vec<Vec<Stats>>>
where
    F: FnMut(&mut Engine, &Case, Vec<u32>, Phase) -> Result<Stats>,
{
    for w in 0..plan.warmup {
        for c in &plan.cases {
            let p = prompt(engine, c.prompt_len, plan.seed ^ 0x5741_524d, w as u64);
            let s = run(engine, c, p, Phase::Warmup)?;
            on_run(Phase::Warmup, c, &s);
        }
    }
    let mut runs: Vec<Vec<Stats>> = vec![Vec::new(); plan.cases.len()];
    for r in 0..plan.reps {
        for (i, c) in plan.cases.iter().enumerate() {
            let p = prompt(engine, c.prompt_len, plan.seed, r as u64);
            let s = run(engine, c, p, Phase::Measure)?;
            on_run(Phase::Measure, c, &s);
            runs[i].push(s);
        }
    }
    Ok(runs)
}

/// Runs `f`, then gives the engine back the cache settings, eviction timing and attention it
/// had (each case sets its own), whether `f` succeeded or not: a library caller's engine is
/// as it was after a sweep.
fn restoring<T>(engine: &mut Engine, f: impl FnOnce(&mut Engine) -> Result<T>) -> Result<T> {
    let cfg = engine.config();
    let (cache, per_layer, attention) = (cfg.cache.clone(), cfg.evict_per_layer, cfg.attention);
    let out = f(engine);
    engine.set_evict_per_layer(per_layer);
    let back = engine
        .set_cache_config(cache)
        .and_then(|()| engine.set_attention(attention));
    let v = out?;
    back?;
    Ok(v)
}

/// Sets the engine's cache settings, eviction timing and (where the case names one) attention
/// to the case's.
fn configure(engine: &mut Engine, case: &Case) -> Result<()> {
    engine.set_cache_config(case.cache.clone())?;
    engine.set_evict_per_layer(case.evict_per_layer);
    if let Some(a) = case.attention {
        engine.set_attention(a)?;
    }
    Ok(())
}

/// Prefills `tokens` under the case's cache settings and generates `max_tokens` with
/// `sampling`, ignoring end-of-generation, with the device idle at the start.
fn request(
    engine: &mut Engine,
    case: &Case,
    tokens: Vec<u32>,
    max_tokens: usize,
    profile: bool,
    sampling: &Sampling,
) -> Result<Stats> {
    configure(engine, case)?;
    engine.config().device.synchronize()?;
    let params = GenerateParams {
        prompt: Prompt::Tokens(tokens),
        max_tokens,
        sampling: sampling.clone(),
        ignore_eos: true,
        profile,
        ..Default::default()
    };
    Ok(engine.generate(&params, |_| {})?.stats)
}

/// Prefills `batch` prompts (`tokens` and rotations of it) under the case's cache settings,
/// one after the other, then decodes them together ([`crate::Batch`]) until each has
/// `max_tokens`, with `sampling` (request i seeded with its seed + i), ignoring
/// end-of-generation. The first request's stats, with
/// `decode_s` the wall time of the batch's decode steps and `decode_tok_s` the aggregate
/// rate over all requests' steps.
fn request_batch(
    engine: &mut Engine,
    case: &Case,
    tokens: Vec<u32>,
    max_tokens: usize,
    batch: usize,
    sampling: &Sampling,
) -> Result<Stats> {
    configure(engine, case)?;
    let device = engine.config().device.clone();
    device.synchronize()?;
    let params: Vec<GenerateParams> = (0..batch)
        .map(|i| {
            let mut t = tokens.clone();
            let len = t.len().max(1);
            t.rotate_left(i * 7 % len);
            GenerateParams {
                prompt: Prompt::Tokens(t),
                max_tokens,
                ignore_eos: true,
                sampling: Sampling {
                    seed: sampling.seed.wrapping_add(i as u64),
                    ..sampling.clone()
                },
                ..Default::default()
            }
        })
        .collect();
    let mut running = engine.batch();
    for (i, p) in params.iter().enumerate() {
        if running.add(i as u64, p, |_| {})?.is_some() {
            return Err(EngineError::BadParams(
                "a batched request ended at its first token: ask for more tokens".into(),
            ));
        }
    }
    device.synchronize()?;
    let t = Instant::now();
    let mut outs = Vec::with_capacity(batch);
    while !running.is_empty() {
        for (id, out) in running.step(|_, _| {})? {
            outs.push((id, out?));
        }
    }
    device.synchronize()?;
    let wall = t.elapsed().as_secs_f64();
    outs.sort_by_key(|(id, _)| *id);
    let steps: usize = outs.iter().map(|(_, o)| o.tokens.len() - 1).sum();
    let mut stats = outs.swap_remove(0).1.stats;
    stats.decode_s = wall;
    stats.decode_tok_s = steps as f64 / wall.max(1e-9);
    Ok(stats)
}

/// Measured decode throughput of one case.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DecodeResult {
    pub prompt_len: usize,
    pub chunk: usize,
    pub policy: String,
    pub budget: Option<usize>,
    /// Requests decoded together (1: one request alone).
    pub batch: usize,
    /// How the tokens were picked (request i of a batch seeded with the seed + i).
    pub sampling: Sampling,
    /// Decode steps per request (tokens after the first).
    pub decode_steps: usize,
    /// Decode tokens per second of every measured run, in round order: all requests of a
    /// batch together.
    pub decode_tok_s: Vec<f64>,
    pub decode: Spread,
    /// Evictions per request, prefill and decode.
    pub evictions: usize,
    /// Bytes of the KV cache (allocated once: also its peak).
    pub peak_kv_bytes: usize,
    /// Slots per head at the end of the request.
    pub final_cache_len: usize,
    /// Peak resident memory of this process so far (Linux VmHWM), when known. It includes the
    /// weights and only grows, so it bounds what every case so far needed.
    pub process_peak_rss_bytes: Option<u64>,
    /// GPU memory in use after the sweep (driver's total − free, all processes), on CUDA.
    pub device_used_bytes: Option<u64>,
}

/// Runs a decode sweep: prefill each case's prompt, then generate `steps` tokens past the first
/// with `sampling` (greedy by default), ignoring end-of-generation; with `batch` above 1, that
/// many requests (the prompt and rotations of it) decode together and the rate is theirs
/// together. The breakdown flag of `plan` is ignored. The engine's settings are as they were
/// when it returns.
pub fn decode(
    engine: &mut Engine,
    plan: &Plan,
    steps: usize,
    batch: usize,
    sampling: &Sampling,
    on_run: impl FnMut(Phase, &Case, &Stats),
) -> Result<Vec<DecodeResult>> {
    restoring(engine, |engine| {
        decode_sweep(engine, plan, steps, batch, sampling, on_run)
    })
}

/// [`decode`]'s runs; [`decode`] restores the engine's settings after them.
fn decode_sweep(
    engine: &mut Engine,
    plan: &Plan,
    steps: usize,
    batch: usize,
    sampling: &Sampling,
    mut on_run: impl FnMut(Phase, &Case, &Stats),
) -> Result<Vec<DecodeResult>> {
    sampling.validate().map_err(EngineError::BadParams)?;
    if plan.reps == 0 || steps == 0 || batch == 0 {
        return Err(EngineError::BadParams(
            "--reps, --gen-len and --batch must be at least 1".into(),
        ));
    }
    let context = engine.model_config().context();
    for c in &plan.cases {
        if c.prompt_len + steps + 1 > context {
            return Err(EngineError::BadParams(format!(
                "a prompt of {} tokens and {} generated ones do not fit in the context of \
                 {context}",
                c.prompt_len,
                steps + 1
            )));
        }
    }
    let runs = rounds(engine, plan, &mut on_run, |engine, c, p, _| match batch {
        1 => request(engine, c, p, steps + 1, false, sampling),
        n => request_batch(engine, c, p, steps + 1, n, sampling),
    })?;
    let rss = peak_rss_bytes();
    let device_used = device_used_bytes(&engine.config().device);
    Ok(plan
        .cases
        .iter()
        .zip(runs)
        .map(|(c, stats)| {
            let tok_s: Vec<f64> = stats.iter().map(|s| s.decode_tok_s).collect();
            DecodeResult {
                prompt_len: c.prompt_len,
                chunk: c.cache.chunk,
                policy: c.policy_name(),
                budget: c.cache.budget,
                batch,
                sampling: sampling.clone(),
                decode_steps: stats[0].generated_tokens.saturating_sub(1),
                decode: Spread::of(&tok_s),
                decode_tok_s: tok_s,
                evictions: stats[0].eviction.evictions,
                peak_kv_bytes: stats[0].peak_kv_bytes,
                final_cache_len: stats[0].final_cache_len,
                process_peak_rss_bytes: rss,
                device_used_bytes: device_used,
            }
        })
        .collect())
}

/// How a prompt joins running requests in [`join`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinMode {
    /// Prefilled at once, the running requests waiting ([`crate::Batch::add`]).
    Alone,
    /// Prefilled in the batch's steps, this many prompt tokens a step
    /// ([`crate::Batch::join`], [`crate::Batch::set_prefill_tokens`]).
    Steps(usize),
}

impl JoinMode {
    /// `alone`, or `steps`.
    pub fn name(&self) -> &'static str {
        match self {
            JoinMode::Alone => "alone",
            JoinMode::Steps(_) => "steps",
        }
    }
}

/// What running requests and a joining prompt see of each other, for one case and mode.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct JoinResult {
    /// The joining prompt's length.
    pub prompt_len: usize,
    pub chunk: usize,
    pub policy: String,
    pub budget: Option<usize>,
    /// Requests decoding when the prompt joins.
    pub running: usize,
    /// Their prompts' length.
    pub running_prompt_len: usize,
    /// `alone` or `steps` ([`JoinMode`]).
    pub mode: String,
    /// Prompt tokens a step takes (`steps`); 0 for `alone`.
    pub prefill_tokens: usize,
    /// The running requests' longest wait between two tokens while the prompt joined, in
    /// seconds, per measured run in round order.
    pub max_gap_s: Vec<f64>,
    pub max_gap: Spread,
    /// Their mean time per token over the same window (from the join to the step that gave
    /// the joiner its first token), per measured run.
    pub mean_gap_s: Vec<f64>,
    pub mean_gap: Spread,
    /// The joining request's time to first token, per measured run.
    pub ttft_s: Vec<f64>,
    pub ttft: Spread,
}

/// Measures a prompt joining `running` decoding requests under each of `modes`: the running
/// requests (`running_prompt_len` tokens each, greedy, two steps in) get one token per step;
/// then the case's prompt joins, and steps run until it has its first token. Records the
/// running requests' longest and mean time between tokens over that window, and the joiner's
/// time to first token. Runs are interleaved: each round runs every case under every mode.
/// `on_run(phase, case, mode, (max gap, TTFT))` is called after every run. The engine's
/// settings are as they were when it returns.
pub fn join(
    engine: &mut Engine,
    plan: &Plan,
    running: usize,
    running_prompt_len: usize,
    modes: &[JoinMode],
    on_run: impl FnMut(Phase, &Case, JoinMode, (f64, f64)),
) -> Result<Vec<JoinResult>> {
    restoring(engine, |engine| {
        join_sweep(engine, plan, running, running_prompt_len, modes, on_run)
    })
}

/// [`join`]'s runs; [`join`] restores the engine's settings after them.
fn join_sweep(
    engine: &mut Engine,
    plan: &Plan,
    running: usize,
    running_prompt_len: usize,
    modes: &[JoinMode],
    mut on_run: impl FnMut(Phase, &Case, JoinMode, (f64, f64)),
) -> Result<Vec<JoinResult>> {
    if plan.reps == 0 || running == 0 || running_prompt_len == 0 || modes.is_empty() {
        return Err(EngineError::BadParams(
            "--reps, --running and --running-prompt-len must be at least 1, and a mode given"
                .into(),
        ));
    }
    if modes.contains(&JoinMode::Steps(0)) {
        return Err(EngineError::BadParams(
            "prompt tokens per step must be at least 1".into(),
        ));
    }
    let context = engine.model_config().context();
    for c in &plan.cases {
        // The running requests decode up to a token per joined prompt token.
        let need = (running_prompt_len + c.prompt_len + 8).max(c.prompt_len + 2);
        if need > context {
            return Err(EngineError::PromptTooLong {
                tokens: need,
                context,
                limited: engine.model_config().context_limited(),
            });
        }
    }
    let mut runs: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); plan.cases.len() * modes.len()];
    let mut round = |engine: &mut Engine, phase: Phase, seed: u64, r: u64| -> Result<()> {
        for (ci, c) in plan.cases.iter().enumerate() {
            let joiner = prompt(engine, c.prompt_len, seed, r);
            let short = prompt(engine, running_prompt_len, seed ^ 0x5255_4e4e, r);
            for (mi, &mode) in modes.iter().enumerate() {
                let m = join_run(engine, c, &joiner, &short, running, mode)?;
                on_run(phase, c, mode, (m.0, m.2));
                if phase == Phase::Measure {
                    runs[ci * modes.len() + mi].push(m);
                }
            }
        }
        Ok(())
    };
    for w in 0..plan.warmup {
        round(engine, Phase::Warmup, plan.seed ^ 0x5741_524d, w as u64)?;
    }
    for r in 0..plan.reps {
        round(engine, Phase::Measure, plan.seed, r as u64)?;
    }
    let mut out = Vec::new();
    for (ci, c) in plan.cases.iter().enumerate() {
        for (mi, &mode) in modes.iter().enumerate() {
            let m = &runs[ci * modes.len() + mi];
            let col = |f: fn(&(f64, f64, f64)) -> f64| m.iter().map(f).collect::<Vec<f64>>();
            let (max_gap_s, mean_gap_s, ttft_s) = (col(|x| x.0), col(|x| x.1), col(|x| x.2));
            out.push(JoinResult {
                prompt_len: c.prompt_len,
                chunk: c.cache.chunk,
                policy: c.policy_name(),
                budget: c.cache.budget,
                running,
                running_prompt_len,
                mode: mode.name().into(),
                prefill_tokens: match mode {
                    JoinMode::Alone => 0,
                    JoinMode::Steps(t) => t,
                },
                max_gap: Spread::of(&max_gap_s),
                mean_gap: Spread::of(&mean_gap_s),
                ttft: Spread::of(&ttft_s),
                max_gap_s,
                mean_gap_s,
                ttft_s,
            });
        }
    }
    Ok(out)
}

/// One run of [`join`]: (longest gap, mean gap, the joiner's TTFT), in seconds.
fn join_run(
    engine: &mut Engine,
    case: &Case,
    joiner: &[u32],
    short: &[u32],
    running: usize,
    mode: JoinMode,
) -> Result<(f64, f64, f64)> {
    configure(engine, case)?;
    let device = engine.config().device.clone();
    let params = |tokens: Vec<u32>, max_tokens: usize| GenerateParams {
        prompt: Prompt::Tokens(tokens),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let mut batch = engine.batch();
    if let JoinMode::Steps(t) = mode {
        batch.set_prefill_tokens(t);
    }
    for i in 0..running {
        let mut t = short.to_vec();
        let k = i * 7 % t.len();
        t.rotate_left(k);
        // A step gives the joiner at least one prompt token: they outlast its prefill.
        if batch
            .add(i as u64, &params(t, joiner.len() + 4), |_| {})?
            .is_some()
        {
            return Err(EngineError::BadParams(
                "a running request ended at its first token".into(),
            ));
        }
    }
    // Nothing ends in the window but the joiner after its first token; a failure is an error.
    let ended = |e: crate::Ended| -> Result<()> {
        for (id, out) in e {
            out?;
            if id < running as u64 {
                return Err(EngineError::BadParams(
                    "a running request ended while the prompt joined".into(),
                ));
            }
        }
        Ok(())
    };
    for _ in 0..2 {
        ended(batch.step(|_, _| {})?)?;
    }
    device.synchronize()?;
    let t_join = Instant::now();
    let mut last = t_join;
    let mut max_gap = 0f64;
    let mut steps = 0usize;
    let id = running as u64;
    let mut ttft = match mode {
        JoinMode::Alone => {
            batch.add(id, &params(joiner.to_vec(), 2), |_| {})?;
            Some(t_join.elapsed().as_secs_f64())
        }
        JoinMode::Steps(_) => {
            batch.join(id, &params(joiner.to_vec(), 2))?;
            None
        }
    };
    // Until the step after which the joiner has its first token (for `alone`, the step that
    // follows its prefill: the running requests' next token).
    loop {
        ended(batch.step(|_, _| {})?)?;
        device.synchronize()?;
        let now = Instant::now();
        max_gap = max_gap.max((now - last).as_secs_f64());
        last = now;
        steps += 1;
        if ttft.is_none() && batch.prefilling() == 0 {
            ttft = Some(t_join.elapsed().as_secs_f64());
        }
        if ttft.is_some() {
            break;
        }
    }
    let mean_gap = (last - t_join).as_secs_f64() / steps as f64;
    Ok((max_gap, mean_gap, ttft.expect("set before the loop ends")))
}

/// Memory in use on a CUDA device (driver's total − free, every process, less what candle's
/// memory pool holds idle: `keydiff_model::memory::cuda_pool_idle`), `None` elsewhere.
pub fn device_used_bytes(device: &candle_core::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        device.synchronize().ok()?;
        let (free, total) = d.cuda_stream().context().mem_get_info().ok()?;
        let idle = keydiff_model::memory::cuda_pool_idle(d).ok()?;
        return Some((total.saturating_sub(free) as u64).saturating_sub(idle));
    }
    let _ = device;
    None
}

/// Peak resident set size of this process (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Where and from what a result was measured, stored with every result row.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Provenance {
    /// UTC time the sweep started, RFC 3339.
    pub date: String,
    /// `git describe --always --dirty` of the working directory, or `$KEYDIFF_COMMIT`.
    pub commit: String,
    /// The same of the tree the binary was built from, at build time (`unknown` outside a git
    /// checkout). It differs from `commit` when a copied binary runs in a newer tree.
    #[serde(default)]
    pub binary_commit: String,
    /// Host name, CPU model and logical CPUs; GPU name when one is used.
    pub machine: String,
    pub device: String,
    pub dtype: String,
    /// Dtype the KV cache held; empty in rows written before it was recorded, whose cache
    /// held `dtype`.
    #[serde(default)]
    pub kv_dtype: String,
    /// Whether that cache held keys or values Hadamard-rotated (rows written before the
    /// rotation existed held none).
    #[serde(default)]
    pub kv_rotated: bool,
    /// Attention backend (`eager` or `flash`); rows written before it was recorded were eager.
    #[serde(default = "eager")]
    pub attention: String,
    /// The model path or preset, and whether its weights are random.
    pub model: String,
    pub random_weights: bool,
    /// What CPU copies of GGUF weights ran (`CpuWeights::describe`; memory may have dropped
    /// some); empty for other sources, GPUs, and rows written before it was recorded.
    #[serde(default)]
    pub cpu_weights: String,
    /// RoPE in use, as JSON: `rope_theta`, `rope_scaling` (`null` when unscaled) and the
    /// context; empty in rows written before it was recorded, which ran the model's own.
    #[serde(default)]
    pub rope: String,
    /// The chat template in use, as JSON: the `sha256` of its source (`null` without one) and
    /// the `kwargs` every render gets; empty in rows written before it was recorded.
    #[serde(default)]
    pub chat_template: String,
    /// The full command line.
    pub command: String,
    /// The environment variables set for the run that change what keydiff computes or how
    /// fast (`KEYDIFF_*` kernel and allocator switches, `RAYON_NUM_THREADS`,
    /// `CUDA_VISIBLE_DEVICES`), as a JSON object; empty in rows written before it was
    /// recorded.
    #[serde(default)]
    pub env: String,
    pub keydiff_version: String,
}

/// Whether an environment variable is one that [`Provenance::env`] records: keydiff's kernel
/// and allocator switches (never a secret such as `KEYDIFF_API_KEY`: results are committed)
/// and the thread and device settings.
fn recorded_env(name: &str) -> bool {
    name.starts_with("KEYDIFF_CUDA_")
        || name.starts_with("KEYDIFF_FLASH_")
        || [
            "RAYON_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES",
            "CUDA_LAUNCH_BLOCKING",
        ]
        .contains(&name)
}

impl Provenance {
    /// The commit of the code that ran (the binary's), and the working tree's when it is
    /// another: what a results header or a plot names.
    pub fn code(&self) -> String {
        match (self.binary_commit.as_str(), self.commit.as_str()) {
            (b, c) if b == c || c == "unknown" || c.is_empty() => b.to_string(),
            ("unknown" | "", c) => c.to_string(),
            (b, c) => format!("{b} (run in a tree at {c})"),
        }
    }

    /// Collects the environment of this run.
    pub fn collect(engine: &Engine, random_weights: bool, command: String) -> Self {
        let device = match &engine.config().device {
            candle_core::Device::Cpu => "cpu".to_string(),
            d => format!("{:?}", d.location()),
        };
        let mut machine = format!(
            "{} ({}, {} logical CPUs)",
            read_trim("/proc/sys/kernel/hostname").unwrap_or_else(|| "unknown host".into()),
            cpu_model().unwrap_or_else(|| "unknown CPU".into()),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        if !engine.config().device.is_cpu() {
            if let Some(gpu) =
                command_output("nvidia-smi", &["--query-gpu=name", "--format=csv,noheader"])
            {
                machine.push_str(&format!(
                    ", GPU {}",
                    gpu.lines().next().unwrap_or("").trim()
                ));
            }
        }
        let commit = std::env::var("KEYDIFF_COMMIT")
            .ok()
            .or_else(|| command_output("git", &["describe", "--always", "--dirty", "--abbrev=12"]))
            .unwrap_or_else(|| "unknown".into());
        Self {
            date: utc_now(),
            commit: commit.trim().to_string(),
            binary_commit: option_env!("KEYDIFF_BUILD_COMMIT")
                .unwrap_or("unknown")
                .to_string(),
            machine,
            device,
            dtype: format!("{:?}", engine.config().dtype).to_lowercase(),
            kv_dtype: engine
                .config()
                .kv_dtype
                .unwrap_or(engine.config().dtype.into())
                .to_string(),
            kv_rotated: engine.kv_rotated(),
            attention: engine.config().attention.name().to_string(),
            model: engine.origin().to_string(),
            random_weights,
            cpu_weights: engine
                .cpu_weights()
                .map_or(String::new(), |c| c.describe().to_string()),
            rope: {
                let c = engine.model_config();
                serde_json::json!({"rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
                    "context": c.context()})
                .to_string()
            },
            chat_template: {
                use sha2::{Digest, Sha256};
                let sha = engine.chat_template().map(|t| {
                    Sha256::digest(t.as_bytes())
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>()
                });
                serde_json::json!({"sha256": sha,
                    "kwargs": engine.config().chat_template_kwargs})
                .to_string()
            },
            command,
            env: {
                let mut vars: Vec<(String, String)> =
                    std::env::vars().filter(|(k, _)| recorded_env(k)).collect();
                vars.sort();
                serde_json::Value::Object(
                    vars.into_iter()
                        .map(|(k, v)| (k, serde_json::Value::String(v)))
                        .collect(),
                )
                .to_string()
            },
            keydiff_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

fn eager() -> String {
    "eager".into()
}

fn read_trim(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
}

fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(cmd).args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ` (civil-from-days, no time crate needed).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_utc(secs)
}

/// Formats seconds since the Unix epoch as RFC 3339 UTC.
pub fn format_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The switches that change a run are recorded; the commit override and others are not.
    #[test]
    fn recorded_environment() {
        for v in [
            "KEYDIFF_CUDA_DECODE",
            "KEYDIFF_CUDA_POOL_RETAIN",
            "KEYDIFF_FLASH_KERNELS",
            "RAYON_NUM_THREADS",
        ] {
            assert!(recorded_env(v), "{v}");
        }
        for v in [
            "KEYDIFF_COMMIT",
            "KEYDIFF_API_KEY",
            "HOME",
            "PATH",
            "KEYDIFF",
        ] {
            assert!(!recorded_env(v), "{v}");
        }
    }

    /// A header names the code that ran: the binary's commit, and the tree's beside it.
    #[test]
    fn code_is_the_binarys_commit() {
        let p = |binary: &str, tree: &str| Provenance {
            binary_commit: binary.into(),
            commit: tree.into(),
            ..serde_json::from_value(serde_json::json!({
                "date": "", "commit": "", "machine": "", "device": "", "dtype": "",
                "model": "", "random_weights": false, "command": "", "keydiff_version": ""
            }))
            .unwrap()
        };
        assert_eq!(p("abc", "abc").code(), "abc");
        assert_eq!(p("abc", "unknown").code(), "abc");
        assert_eq!(p("unknown", "def").code(), "def");
        assert_eq!(p("abc", "def").code(), "abc (run in a tree at def)");
    }

    #[test]
    fn spread_of_odd_and_even_samples() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        let s = Spread::of(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 4.0));
    }

    #[test]
    fn utc_formatting_matches_known_dates() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(format_utc(1_796_004_245), "2026-11-30T02:04:05Z");
    }

    #[test]
    fn full_gets_one_case_per_length_and_chunk() {
        let t = CacheConfig::full(128);
        let c = cases(
            &[1000, 2000],
            &[256, 512],
            &[64, 128],
            &[PolicyKind::Full, PolicyKind::Sink],
            &t,
        )
        .unwrap();
        // 2 lengths × 2 chunks × (1 full + 2 sink budgets)
        assert_eq!(c.len(), 12);
        assert_eq!(c.iter().filter(|c| c.cache.budget.is_none()).count(), 4);
    }

    #[test]
    fn invalid_cases_are_refused_before_running() {
        let t = CacheConfig::full(128);
        let e = cases(&[1000], &[64], &[128], &[PolicyKind::Sink], &t).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("N=64 B=128"), "{msg}");
        assert!(cases(&[1000], &[], &[128], &[PolicyKind::Sink], &t).is_err());
        assert!(cases(&[0], &[256], &[128], &[PolicyKind::Full], &t).is_err());
    }
}
