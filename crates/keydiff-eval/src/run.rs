//! Running samples under policies and budgets, and aggregating the scores.

use std::time::Instant;

use keydiff::{
    CacheConfig, Engine, GenerateParams, Message, PolicyKind, Prefix, Prompt, StatsNeed,
};

use crate::{longbench, EvalError, Result, Sample};

/// A budget: a number of slots, or a share of each sample's input length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BudgetSpec {
    Tokens(usize),
    /// In (0, 1]: `round(share × input tokens)`.
    Share(f64),
}

impl BudgetSpec {
    /// `1024` or `25%`.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || EvalError::Params(format!("bad budget `{s}` (a token count or a percentage)"));
        if let Some(p) = s.strip_suffix('%') {
            let v: f64 = p.trim().parse().map_err(|_| bad())?;
            if !(v > 0.0 && v <= 100.0) {
                return Err(bad());
            }
            Ok(Self::Share(v / 100.0))
        } else {
            let n: usize = s.trim().parse().map_err(|_| bad())?;
            if n == 0 {
                return Err(bad());
            }
            Ok(Self::Tokens(n))
        }
    }

    /// Slots for an input of `tokens` tokens.
    pub fn resolve(&self, tokens: usize) -> usize {
        match *self {
            Self::Tokens(n) => n,
            Self::Share(f) => ((f * tokens as f64).round() as usize).max(1),
        }
    }

    pub fn label(&self) -> String {
        match *self {
            Self::Tokens(n) => n.to_string(),
            Self::Share(f) => format!("{}%", (f * 100.0 * 1000.0).round() / 1000.0),
        }
    }
}

/// One policy at one budget (`full`: no budget).
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    pub policy: PolicyKind,
    pub budget: Option<BudgetSpec>,
}

impl Setting {
    /// `full` once, and every other policy at every budget.
    pub fn grid(policies: &[PolicyKind], budgets: &[BudgetSpec]) -> Result<Vec<Self>> {
        let mut out = Vec::new();
        for p in policies {
            if *p == PolicyKind::Full {
                out.push(Self {
                    policy: p.clone(),
                    budget: None,
                });
            } else {
                if budgets.is_empty() {
                    return Err(EvalError::Params(format!(
                        "policy {} needs --budgets",
                        p.name()
                    )));
                }
                out.extend(budgets.iter().map(|b| Self {
                    policy: p.clone(),
                    budget: Some(*b),
                }));
            }
        }
        Ok(out)
    }

    pub fn budget_label(&self) -> String {
        self.budget.map_or_else(|| "-".into(), |b| b.label())
    }
}

/// How samples are fed to the model.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Wrap the prompt in the model's chat template (unless the sample says otherwise).
    pub chat: bool,
    /// Chunk size, window, sinks and decode eviction interval for every setting.
    pub template: CacheConfig,
    /// Prefill the chunks that every setting of a sample shares (those before its first
    /// eviction) once, and start each run from them ([`Engine::generate_from`]). The answers are
    /// the same as without; only the time changes.
    pub reuse_prefix: bool,
}

/// The model input of a user turn followed by an answer prefix: with `chat`, the chat
/// template's user turn and generation prompt, then the prefix; without, the text, a newline
/// and the prefix.
pub fn input_ids(engine: &Engine, user: &str, prefix: &str, chat: bool) -> Result<Vec<u32>> {
    if chat {
        let mut ids =
            engine.prompt_tokens(&Prompt::Chat(vec![Message::new("user", user.to_string())]))?;
        if !prefix.is_empty() {
            ids.extend(engine.tokenize_continuation(prefix)?);
        }
        Ok(ids)
    } else if prefix.is_empty() {
        Ok(engine.prompt_tokens(&Prompt::Text(user.to_string()))?)
    } else {
        Ok(engine.prompt_tokens(&Prompt::Text(format!("{user}\n{prefix}")))?)
    }
}

/// One generated answer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Record {
    pub task: String,
    pub id: String,
    /// The sample's length bucket.
    pub length: usize,
    pub depth: Option<f64>,
    /// Model input tokens (after truncation).
    pub input_tokens: usize,
    /// Whether the input was cut in the middle to fit the context (LongBench).
    pub truncated: bool,
    pub policy: String,
    /// The budget as given (`25%`, `1024`, or `-` for full).
    pub budget: String,
    /// Slots it came to for this sample.
    pub budget_tokens: Option<usize>,
    pub prediction: String,
    pub answers: Vec<String>,
    /// In [0, 1].
    pub score: f64,
    pub evictions: usize,
    /// Seconds of this run, not counting the shared prefix it started from.
    pub seconds: f64,
    /// Prompt tokens taken from a prefix shared with other settings of the sample (0: none).
    pub prefix_tokens: usize,
    /// Seconds it took to prefill that prefix (shared: other records count it too), so that
    /// `seconds + prefix_seconds` is about what the run takes alone.
    pub prefix_seconds: f64,
    /// The keydiff build that made it (a commit), for records gathered over several runs
    /// (`--resume`); set by the caller, empty when unknown (and then not written).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub code: String,
}

/// A sample's model input, prepared once for every setting.
struct Prepared<'a> {
    sample: &'a Sample,
    ids: Vec<u32>,
    truncated: bool,
}

/// Prepares every sample and checks every (sample, setting) before anything runs.
fn prepare<'a>(
    engine: &Engine,
    samples: &'a [Sample],
    settings: &[Setting],
    opts: &RunOptions,
) -> Result<Vec<Prepared<'a>>> {
    let context = engine.model_config().context();
    let mut out = Vec::with_capacity(samples.len());
    for s in samples {
        let chat = s.chat.unwrap_or(opts.chat);
        let mut ids = input_ids(engine, &s.prompt, &s.answer_prefix, chat)?;
        let room = context.saturating_sub(s.max_new_tokens);
        let mut truncated = false;
        if ids.len() > room {
            if s.task.starts_with("longbench/") {
                ids = longbench::truncate_middle(&ids, room);
                truncated = true;
            } else {
                return Err(EvalError::Params(format!(
                    "sample {}: {} input tokens + {} to generate exceed the context of {context}",
                    s.id,
                    ids.len(),
                    s.max_new_tokens
                )));
            }
        }
        for st in settings {
            let cache = cache_config(st, ids.len(), opts);
            cache.validate().map_err(|e| {
                EvalError::Params(format!(
                    "sample {} under {} at budget {}: {e}",
                    s.id,
                    st.policy.name(),
                    st.budget_label()
                ))
            })?;
        }
        out.push(Prepared {
            sample: s,
            ids,
            truncated,
        });
    }
    Ok(out)
}

fn cache_config(st: &Setting, input_tokens: usize, opts: &RunOptions) -> CacheConfig {
    CacheConfig {
        policy: st.policy.clone(),
        budget: st.budget.map(|b| b.resolve(input_tokens)),
        ..opts.template.clone()
    }
}

/// Runs every sample under every setting, greedy, and scores the answers, except the pairs
/// `skip` names (already done in an earlier, resumed run). Everything is checked before the
/// first run. `on_record` sees each record as it is made (for progress and partial saves).
pub fn run(
    engine: &mut Engine,
    samples: &[Sample],
    settings: &[Setting],
    opts: &RunOptions,
    skip: impl Fn(&Sample, &Setting) -> bool,
    mut on_record: impl FnMut(&Record),
) -> Result<Vec<Record>> {
    let prepared = prepare(engine, samples, settings, opts)?;
    let chunk = opts.template.chunk;
    let mut out = Vec::with_capacity(prepared.len() * settings.len());
    for p in &prepared {
        let s = p.sample;
        let n = p.ids.len();
        let todo: Vec<&Setting> = settings.iter().filter(|st| !skip(s, st)).collect();
        // Shared prefixes are prefilled under H2O when an H2O setting is to run (H2O needs the
        // attention it accumulates in them; the others ignore it), else under `full`.
        let chain = todo
            .iter()
            .map(|st| &st.policy)
            .find(|k| k.stats_need() == StatsNeed::AllRows)
            .cloned()
            .unwrap_or(PolicyKind::Full);
        // The longest whole-chunk prefix each setting can start from: no eviction in it (at
        // most N tokens) and at least one prompt token left to prefill. Runs go in the order of
        // their prefix, so that one prefix grows into the next.
        let mut plan: Vec<(usize, &Setting)> = todo
            .iter()
            .map(|st| {
                let shares = st.policy.stats_need() != StatsNeed::AllRows || st.policy == chain;
                let point = if opts.reuse_prefix && shares {
                    let free = cache_config(st, n, opts).budget.unwrap_or(n);
                    free.min(n.saturating_sub(1)) / chunk * chunk
                } else {
                    0
                };
                (point, *st)
            })
            .collect();
        plan.sort_by_key(|(point, _)| *point);
        let mut prefix: Option<Prefix> = None;
        // Seconds spent prefilling the current prefix, its bases included.
        let mut prefix_s = 0.0;
        for (point, st) in plan {
            if point > 0 && prefix.as_ref().map(Prefix::len) != Some(point) {
                // Nothing is evicted in a prefix, so sinks and window play no part (and a
                // budget of `point` with them could fail validation where N would not).
                let cfg = CacheConfig {
                    policy: chain.clone(),
                    budget: (chain != PolicyKind::Full).then_some(point),
                    sinks: 0,
                    window: 0.0,
                    ..opts.template.clone()
                };
                let t = Instant::now();
                prefix = Some(engine.prefill_prefix(&p.ids[..point], prefix.as_ref(), cfg)?);
                prefix_s += t.elapsed().as_secs_f64();
            }
            let cache = cache_config(st, n, opts);
            let budget_tokens = cache.budget;
            engine.set_cache_config(cache)?;
            let t = Instant::now();
            let mut params = GenerateParams {
                prompt: Prompt::Tokens(p.ids.clone()),
                max_tokens: s.max_new_tokens,
                ..Default::default()
            };
            let task = s.task.strip_prefix("longbench/");
            if task.is_some_and(longbench::stops_at_newline) {
                // pred.py's extra EOS: the last token of "\n" alone; not as the first token.
                let newline = engine.tokenize_continuation("\n")?;
                params.stop_tokens = newline.last().copied().into_iter().collect();
                params.min_tokens = 1;
            }
            let from = if point > 0 { prefix.as_ref() } else { None };
            let o = engine.generate_from(&params, from, |_| {})?;
            let prediction = if let Some(task) = s.task.strip_prefix("longbench/") {
                longbench::postprocess(task, &o.text)
            } else {
                o.text.clone()
            };
            let score = s.metric.best(&prediction, &s.answers, &s.all_classes);
            let r = Record {
                task: s.task.clone(),
                id: s.id.clone(),
                length: s.length,
                depth: s.depth,
                input_tokens: n,
                truncated: p.truncated,
                policy: st.policy.name(),
                budget: st.budget_label(),
                budget_tokens,
                prediction,
                answers: s.answers.clone(),
                score,
                evictions: o.stats.eviction.evictions,
                seconds: t.elapsed().as_secs_f64(),
                prefix_tokens: o.stats.prefix_tokens,
                prefix_seconds: if point > 0 { prefix_s } else { 0.0 },
                code: String::new(),
            };
            on_record(&r);
            out.push(r);
        }
    }
    Ok(out)
}

/// Mean score of the records sharing task, policy, budget, length (and depth, if asked).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Cell {
    pub task: String,
    pub policy: String,
    pub budget: String,
    pub length: usize,
    pub depth: Option<f64>,
    pub n: usize,
    /// Mean score in [0, 1].
    pub mean: f64,
    /// Standard error of the mean (sample standard deviation / √n; 0 for n = 1).
    pub stderr: f64,
}

/// Aggregates records into cells, in the order cells first appear.
pub fn cells(records: &[Record], by_depth: bool) -> Vec<Cell> {
    let mut keys: Vec<(String, String, String, usize, Option<u64>)> = Vec::new();
    let mut scores: Vec<Vec<f64>> = Vec::new();
    for r in records {
        let depth = if by_depth {
            r.depth.map(f64::to_bits)
        } else {
            None
        };
        let k = (
            r.task.clone(),
            r.policy.clone(),
            r.budget.clone(),
            r.length,
            depth,
        );
        match keys.iter().position(|x| *x == k) {
            Some(i) => scores[i].push(r.score),
            None => {
                keys.push(k);
                scores.push(vec![r.score]);
            }
        }
    }
    keys.into_iter()
        .zip(scores)
        .map(|((task, policy, budget, length, depth), xs)| {
            let n = xs.len();
            let mean = xs.iter().sum::<f64>() / n as f64;
            let stderr = if n > 1 {
                let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
                (var / n as f64).sqrt()
            } else {
                0.0
            };
            Cell {
                task,
                policy,
                budget,
                length,
                depth: depth.map(f64::from_bits),
                n,
                mean,
                stderr,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_and_resolve() {
        assert_eq!(BudgetSpec::parse("25%").unwrap().resolve(2048), 512);
        assert_eq!(BudgetSpec::parse("1024").unwrap().resolve(9999), 1024);
        assert_eq!(BudgetSpec::parse("75%").unwrap().label(), "75%");
        for bad in ["0", "0%", "120%", "abc", "-5", ""] {
            assert!(BudgetSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn full_runs_once_and_others_at_every_budget() {
        let b = [BudgetSpec::Share(0.25), BudgetSpec::Share(0.5)];
        let g = Setting::grid(&[PolicyKind::Full, PolicyKind::Sink], &b).unwrap();
        assert_eq!(g.len(), 3);
        assert!(Setting::grid(&[PolicyKind::Sink], &[]).is_err());
    }

    fn rec(policy: &str, depth: f64, score: f64) -> Record {
        Record {
            task: "niah".into(),
            id: String::new(),
            length: 2048,
            depth: Some(depth),
            input_tokens: 2000,
            truncated: false,
            policy: policy.into(),
            budget: "25%".into(),
            budget_tokens: Some(500),
            prediction: String::new(),
            answers: vec![],
            score,
            evictions: 0,
            seconds: 0.0,
            prefix_tokens: 0,
            prefix_seconds: 0.0,
            code: String::new(),
        }
    }

    #[test]
    fn cells_average_with_standard_error() {
        let r = [
            rec("keydiff", 0.0, 1.0),
            rec("keydiff", 0.5, 0.0),
            rec("keydiff", 0.0, 1.0),
            rec("keydiff", 0.5, 1.0),
            rec("tova", 0.0, 0.0),
        ];
        let c = cells(&r, false);
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].n, c[0].mean), (4, 0.75));
        // sd of {1,0,1,1} = 0.5, / √4
        assert!((c[0].stderr - 0.25).abs() < 1e-12);
        let d = cells(&r, true);
        assert_eq!(d.len(), 3);
        assert_eq!((d[0].depth, d[0].mean), (Some(0.0), 1.0));
        assert_eq!((d[1].depth, d[1].mean), (Some(0.5), 0.5));
    }
}
