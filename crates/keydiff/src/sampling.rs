//! Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeded.
//!
//! The order follows llama.cpp's default chain: logit bias → penalties → top-k → top-p → min-p
//! → temperature. With [`Sampling::temperature_first`], vLLM's and Hugging Face's: the
//! temperature before top-p and min-p (top-k does not depend on it).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One row's draw on the device ([`Sampler::device_draw`]).
pub use keydiff_model::model::DrawParams;

/// Sampling settings. `temperature <= 0` is greedy.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sampling {
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set with cumulative probability ≥ p (1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p ×` the top probability (0 = off).
    pub min_p: f32,
    /// Penalty on tokens seen in the last `repeat_last_n` tokens (1 = off).
    pub repetition_penalty: f32,
    /// Tokens the penalties look back on (llama.cpp's `penalty_last_n`).
    pub repeat_last_n: usize,
    /// Subtracted from a token's logit per occurrence in the last `repeat_last_n` tokens
    /// (OpenAI's `frequency_penalty`; 0 = off).
    #[serde(default)]
    pub frequency_penalty: f32,
    /// Subtracted once from the logit of every token in the last `repeat_last_n` tokens
    /// (OpenAI's `presence_penalty`; 0 = off).
    #[serde(default)]
    pub presence_penalty: f32,
    /// Added to a token's logit before anything else (OpenAI's `logit_bias`, llama.cpp's
    /// `--logit-bias`): `(token id, bias)`, a token given twice gets both. −∞ bans the token.
    /// Applies to greedy decoding too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
    /// What the output must be: any text, one JSON object ([`crate::json_mode`]) or a text of
    /// a grammar ([`crate::grammar`]), applied before the logit bias.
    #[serde(default, skip_serializing_if = "Format::is_text")]
    pub format: Format,
    pub seed: u64,
    /// Top-p and min-p cut the distribution at the temperature, as vLLM and Hugging Face
    /// do (the server's OpenAI endpoints), rather than at temperature 1 before it, as
    /// llama.cpp does (the command line, llama.cpp's endpoints).
    #[serde(default)]
    pub temperature_first: bool,
    /// OpenAI's and vLLM's penalties (the server's OpenAI endpoints): the frequency and
    /// presence penalties count the reply's tokens, all of them, and the repetition penalty
    /// looks at the prompt's and the reply's, all of them; `repeat_last_n` is not read. Off:
    /// llama.cpp's, all three over the last `repeat_last_n` tokens, prompt included.
    #[serde(default)]
    pub output_penalties: bool,
}

/// The form of a request's output.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// Any text.
    #[default]
    Text,
    /// One JSON object, then the end of generation ([`crate::json_mode`]).
    JsonObject,
    /// A text of this GBNF grammar ([`crate::grammar`]); the end of generation can come only
    /// once the text is whole. A JSON schema is written as one by
    /// [`crate::json_schema::to_grammar`].
    Grammar(String),
    /// Any text until a trigger comes; from there on, a text of `grammar` that starts with
    /// the trigger, then the end of generation (llama.cpp's lazy grammars; tool calls with
    /// `tool_choice: auto`, [`crate::tools`]). `triggers` count anywhere in the text,
    /// `at_start` only where the text begins with them, after whitespace. With `reasoning`
    /// (`Some(open)`: the prompt opened the block), a `<think>…</think>` block at the start
    /// of the reply is free text where no trigger counts, and the answer after it is the
    /// text's start ([`crate::reasoning`]).
    Lazy {
        grammar: String,
        triggers: Vec<String>,
        at_start: Vec<String>,
        reasoning: Option<bool>,
    },
    /// `format` (JSON mode or a grammar) over the answer of a reasoning model's reply: a
    /// `<think>…</think>` block at its start (`open`: the prompt opened it) is free text, and
    /// the answer after it, its leading whitespace aside, must be of `format`; generation
    /// cannot end inside the block. A reply without a block is all answer. This is how vLLM
    /// applies structured outputs under a reasoning parser, and how llama.cpp lets a reasoning
    /// model think before a required tool call.
    AfterReasoning { format: Box<Format>, open: bool },
}

impl Format {
    fn is_text(&self) -> bool {
        *self == Format::Text
    }

    /// This format for a reply that `reasoning` says opens with a reasoning block
    /// ([`crate::Engine::reasoning_start`]: `Some(open)`), or not (`None`): JSON mode and
    /// grammars then constrain the answer after the block ([`Format::AfterReasoning`]), and a
    /// lazy grammar's triggers count only there. Text, and a format without a reasoning
    /// block, stay as they are.
    pub fn after_reasoning(self, reasoning: Option<bool>) -> Format {
        let Some(open) = reasoning else {
            return self;
        };
        match self {
            Format::JsonObject | Format::Grammar(_) => Format::AfterReasoning {
                format: Box::new(self),
                open,
            },
            Format::Lazy {
                grammar,
                triggers,
                at_start,
                ..
            } => Format::Lazy {
                grammar,
                triggers,
                at_start,
                reasoning: Some(open),
            },
            other => other,
        }
    }
}

impl Default for Sampling {
    /// Greedy decoding, the reproducible default.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            // llama.cpp's default penalty window
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            format: Format::Text,
            seed: 299_792_458,
            temperature_first: false,
            output_penalties: false,
        }
    }
}

impl Sampling {
    /// The device draw's [`DrawParams`] of these settings and a uniform `r` (a top-k past
    /// `u32::MAX` saturates: no vocabulary is that large).
    pub fn draw_params(&self, r: f32) -> DrawParams {
        DrawParams {
            temperature: self.temperature,
            top_k: u32::try_from(self.top_k).unwrap_or(u32::MAX),
            top_p: self.top_p,
            min_p: self.min_p,
            r,
            truncation_temperature: match self.temperature_first && self.temperature > 0.0 {
                true => self.temperature,
                false => 1.0,
            },
        }
    }

    /// Refuses settings with no meaning, as vLLM does, rather than sampling from NaNs:
    /// a negative or non-finite temperature, top-p outside (0, 1], min-p outside [0, 1], a
    /// repetition penalty that is not a positive number, or a logit bias that is NaN or +∞.
    /// (Token ids are checked against the model's vocabulary by the engine.)
    pub fn validate(&self) -> Result<(), String> {
        self.check().map_err(|(_, why)| why)
    }

    /// [`Sampling::validate`], with the field at fault (`top_p`, `logit_bias`, ...), for an
    /// API error that names it.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err((
                "temperature",
                format!(
                    "temperature {} must be a finite number >= 0 (0 is greedy)",
                    self.temperature
                ),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err((
                "top_p",
                format!("top-p {} must be in (0, 1] (1 is off)", self.top_p),
            ));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err((
                "min_p",
                format!("min-p {} must be in [0, 1] (0 is off)", self.min_p),
            ));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err((
                "repetition_penalty",
                format!(
                    "repetition penalty {} must be a finite number > 0 (1 is off)",
                    self.repetition_penalty
                ),
            ));
        }
        for (field, name, v) in [
            (
                "frequency_penalty",
                "frequency penalty",
                self.frequency_penalty,
            ),
            (
                "presence_penalty",
                "presence penalty",
                self.presence_penalty,
            ),
        ] {
            // OpenAI's and vLLM's range; llama.cpp takes any number.
            if self.output_penalties && !(-2.0..=2.0).contains(&v) {
                return Err((field, format!("{name} {v} must be in [-2, 2] (0 is off)")));
            }
            if !v.is_finite() {
                return Err((
                    field,
                    format!("{name} {v} must be a finite number (0 is off)"),
                ));
            }
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| b.is_nan() || *b == f32::INFINITY)
        {
            return Err((
                "logit_bias",
                format!(
                    "logit bias {b} for token {t} must be a number or -inf (which bans the token)"
                ),
            ));
        }
        Ok(())
    }
}

impl Sampling {
    /// Whether a token is the logits' argmax and nothing else: greedy, with no logit bias and
    /// no penalty (what [`Sampler::sample`] then does is [`argmax`]). The engine then picks it
    /// where the logits are ([`keydiff_model::model::argmax_rows`]: on the GPU, 4 bytes come
    /// back instead of the vocabulary's row).
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.is_plain()
    }

    /// Whether the token is drawn from the logits as they come, with no logit bias and no
    /// active penalty (a penalty with an empty window is none): what the device's sampler
    /// (`keydiff_model::model::sample_rows`) can stand in for.
    pub fn is_plain(&self) -> bool {
        let penalised = self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0;
        self.logit_bias.is_empty()
            && !(penalised && (self.output_penalties || self.repeat_last_n > 0))
    }
}

/// A seeded sampler over host logits.
#[derive(Clone)]
pub struct Sampler {
    cfg: Sampling,
    rng: StdRng,
    /// How many tokens of the history are the prompt's ([`Sampling::output_penalties`]).
    prompt_len: usize,
    /// The prompt's distinct tokens, sorted: made on the first penalised draw, so that each
    /// later one reads the reply only (the prompt does not change under a request).
    prompt_ids: Option<Vec<u32>>,
}

impl Sampler {
    /// A sampler with its own seeded random generator.
    pub fn new(cfg: Sampling) -> Self {
        let rng = StdRng::seed_from_u64(cfg.seed);
        Self {
            cfg,
            rng,
            prompt_len: 0,
            prompt_ids: None,
        }
    }

    /// The first `n` tokens of the history [`Sampler::sample`] is given are the prompt's,
    /// the rest the reply's (read by [`Sampling::output_penalties`]; 0 by default: all reply).
    pub fn with_prompt_len(mut self, n: usize) -> Self {
        self.prompt_len = n;
        self.prompt_ids = None;
        self
    }

    /// Picks the next token as [`Sampler::sample`] would from `logits` with the tokens a
    /// constraint refuses set to −∞: `push` reads a token into the constraint's `state` (false
    /// when it cannot come, leaving the state meaningless), `mask` sets the refused tokens'
    /// logits to −∞ and counts those left. `Err` says why no token can come.
    ///
    /// Sampling first and masking only when the token cannot come (llama.cpp's trick) draws
    /// from the same distribution when nothing truncates it: greedy picks the same token, and
    /// a draw from p kept if allowed, else redrawn from p over the allowed set A, gives
    /// x ∈ A with p(x) + (1 − p(A)) p(x) / p(A) = p(x) / p(A). Top-k, top-p and min-p
    /// truncate before the draw, so with them the mask comes first.
    pub fn sample_constrained<C: Clone>(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        state: &mut C,
        push: impl Fn(&mut C, u32) -> bool,
        mask: impl FnOnce(&C, &mut [f32]) -> usize,
    ) -> Result<u32, &'static str> {
        if logits.is_empty() {
            return Err("no logits to sample from");
        }
        let c = &self.cfg;
        if c.temperature <= 0.0 || (c.top_k == 0 && c.top_p >= 1.0 && c.min_p == 0.0) {
            let mut first = logits.to_vec();
            let tok = self.sample(&mut first, history);
            let mut next = state.clone();
            // (A token drawn from nothing but −∞, the bias having banned everything, is no
            // draw.)
            if first[tok as usize].is_finite() && push(&mut next, tok) {
                *state = next;
                return Ok(tok);
            }
        }
        if mask(state, logits) == 0 {
            return Err("no token of this vocabulary can continue the text");
        }
        let tok = self.sample(logits, history);
        // The mask comes before the logit bias, which can ban what it left: the sampler then
        // has only −∞ to pick from.
        match logits[tok as usize].is_finite() && push(state, tok) {
            true => Ok(tok),
            false => Err("the logit bias left no token that can continue the text"),
        }
    }

    /// Picks the next token from `logits` (one per vocab entry), given the tokens so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let c = &self.cfg;
        for &(t, b) in &c.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        let penalised =
            c.repetition_penalty != 1.0 || c.frequency_penalty != 0.0 || c.presence_penalty != 0.0;
        if penalised && c.output_penalties {
            // vLLM's: repetition over every token of prompt and reply, the frequency and
            // presence penalties over the reply's.
            let p = self.prompt_len.min(history.len());
            let prompt = self.prompt_ids.get_or_insert_with(|| {
                let mut ids = history[..p].to_vec();
                ids.sort_unstable();
                ids.dedup();
                ids
            });
            let reply = &history[p..];
            // The reply's tokens the prompt does not have, then the prompt's: each once.
            let mut extra: Vec<u32> = reply
                .iter()
                .copied()
                .filter(|t| prompt.binary_search(t).is_err())
                .collect();
            extra.sort_unstable();
            extra.dedup();
            penalize(logits, extra.iter().chain(prompt.iter()), reply, c);
        } else if penalised && c.repeat_last_n > 0 {
            // llama.cpp's penalties sampler: each token seen in the window once, with its
            // count there.
            let window = &history[history.len().saturating_sub(c.repeat_last_n)..];
            let mut seen = window.to_vec();
            seen.sort_unstable();
            seen.dedup();
            penalize(logits, seen.iter(), window, c);
        }
        if c.temperature <= 0.0 {
            return argmax(logits);
        }
        if !logits.iter().any(|l| l.is_finite()) {
            return argmax(logits);
        }
        let r: f32 = self.rng.random();
        draw(logits, c, r).unwrap_or_else(|| argmax(logits))
    }

    /// What the device needs to draw this sampler's next token from a row of logits as
    /// [`Sampler::sample`] would ([`keydiff_model::model::sample_rows`]): its settings and the
    /// next uniform draw, taken from its generator now. `None` for a sampler the device cannot
    /// stand in for (a logit bias or an active penalty; greedy is `temperature` 0). Keep the
    /// returned generator state and [`Sampler::give_back`] it when the row had no finite logit
    /// (the host draws nothing then).
    pub fn device_draw(&mut self) -> Option<(DrawParams, StdRng)> {
        let c = &self.cfg;
        if !c.is_plain() {
            return None;
        }
        let before = self.rng.clone();
        let r = match c.temperature > 0.0 {
            true => self.rng.random(),
            false => 0.0,
        };
        Some((c.draw_params(r), before))
    }

    /// Puts the generator back as [`Sampler::device_draw`] found it.
    pub fn give_back(&mut self, rng: StdRng) {
        self.rng = rng;
    }
}

/// The penalties of `c`: the repetition penalty scales the logit of each token of `seen`
/// (distinct tokens) once (divided when positive, multiplied when not), then the frequency
/// penalty subtracts per occurrence in `counted` and the presence penalty once for a token
/// there.
fn penalize<'a>(
    logits: &mut [f32],
    seen: impl Iterator<Item = &'a u32>,
    counted: &[u32],
    c: &Sampling,
) {
    if c.repetition_penalty != 1.0 {
        for &t in seen {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 {
                    *l / c.repetition_penalty
                } else {
                    *l * c.repetition_penalty
                };
            }
        }
    }
    if c.frequency_penalty != 0.0 || c.presence_penalty != 0.0 {
        let mut ids = counted.to_vec();
        ids.sort_unstable();
        for run in ids.chunk_by(|a, b| a == b) {
            if let Some(l) = logits.get_mut(run[0] as usize) {
                *l -= run.len() as f32 * c.frequency_penalty + c.presence_penalty;
            }
        }
    }
}

/// The host's draw from a row of logits with `c`'s top-k, top-p, min-p and temperature, `r`
/// uniform in [0, 1) (`temperature` > 0; no bias or penalty here): `None` when no logit is
/// finite. See [`keydiff_model::model::draw`], the reference of the device's sampler.
pub fn draw(logits: &[f32], c: &Sampling, r: f32) -> Option<u32> {
    keydiff_model::model::draw(logits, &c.draw_params(r))
}

/// [`keydiff_model::model::pick`] with `c`'s settings and `r`.
#[cfg(test)]
fn pick(cand: Vec<(u32, f32)>, c: &Sampling, r: f32) -> u32 {
    keydiff_model::model::pick(cand, &c.draw_params(r))
}

#[cfg(test)]
use keydiff_model::model::order;

/// Index of the largest value; the first one on ties (NaNs skipped, 0 when the first is NaN).
/// The same function as the device's greedy choice takes for its reference.
pub(crate) use keydiff_model::model::argmax;

#[cfg(test)]
mod tests {
    use super::*;

    fn s(cfg: Sampling) -> Sampler {
        Sampler::new(cfg)
    }

    /// The allowed set {1, 3, 4} of six tokens, as a constraint.
    fn allowed(_: &mut (), t: u32) -> bool {
        [1, 3, 4].contains(&t)
    }

    fn mask(_: &(), l: &mut [f32]) -> usize {
        for (t, l) in l.iter_mut().enumerate() {
            if !allowed(&mut (), t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        3
    }

    #[test]
    fn constrained_sampling_draws_from_the_allowed_distribution() {
        let logits = [2.0f32, 0.5, 1.5, -0.5, 0.0, 1.0];
        let e: Vec<f64> = logits.iter().map(|&l| (l as f64).exp()).collect();
        let pa: f64 = [1, 3, 4].iter().map(|&t| e[t]).sum();
        let draws = 40_000;
        // Temperature 1, nothing truncating: sampled first, masked on a miss. Top-k 6 keeps
        // all six but makes the mask come first: the reference.
        for top_k in [0, 6] {
            let mut smp = s(Sampling {
                temperature: 1.0,
                top_k,
                seed: 7,
                ..Sampling::default()
            });
            let mut counts = [0usize; 6];
            for _ in 0..draws {
                let t = smp
                    .sample_constrained(&mut logits.to_vec(), &[], &mut (), allowed, mask)
                    .unwrap();
                counts[t as usize] += 1;
            }
            for t in 0..6 {
                let p = if [1, 3, 4].contains(&t) {
                    e[t] / pa
                } else {
                    0.0
                };
                let sd = (p * (1.0 - p) / draws as f64).sqrt();
                let got = counts[t] as f64 / draws as f64;
                assert!(
                    (got - p).abs() <= 5.0 * sd + 1e-12,
                    "top-k {top_k} token {t}: {got} vs {p}"
                );
            }
        }
        // Greedy: the best allowed token, whether the best of all is allowed or not.
        let mut g = s(Sampling::default());
        let mut l = logits.to_vec();
        assert_eq!(
            g.sample_constrained(&mut l, &[], &mut (), allowed, mask),
            Ok(1)
        );
        l = vec![0.0, 3.0, 1.0, 2.0, 0.0, 0.0];
        assert_eq!(
            g.sample_constrained(&mut l, &[], &mut (), allowed, mask),
            Ok(1)
        );
        // A bias that bans what the mask leaves: an error, even though token 0 (what an
        // all −∞ argmax gives) would be allowed by another constraint.
        let all = |_: &mut (), _: u32| true;
        let mut b = s(Sampling {
            logit_bias: (0..6).map(|t| (t, f32::NEG_INFINITY)).collect(),
            ..Sampling::default()
        });
        assert!(b
            .sample_constrained(&mut logits.to_vec(), &[], &mut (), all, |_, _| 6)
            .unwrap_err()
            .contains("logit bias"));
        let mut b = s(Sampling {
            logit_bias: vec![
                (1, f32::NEG_INFINITY),
                (3, f32::NEG_INFINITY),
                (4, f32::NEG_INFINITY),
            ],
            ..Sampling::default()
        });
        assert!(b
            .sample_constrained(&mut logits.to_vec(), &[], &mut (), allowed, mask)
            .unwrap_err()
            .contains("logit bias"));
    }

    /// The draw with every candidate sorted first, in f64 and normalised probabilities, the
    /// old way round. Also returns how near a decision came to going the other way (`r` to a
    /// boundary between two tokens, a running sum to top-p, a probability to min-p), where
    /// rounding may decide.
    fn pick_whole_sort(mut cand: Vec<(u32, f32)>, c: &Sampling, r: f32) -> (u32, f64) {
        cand.sort_by(order);
        if c.top_k > 0 {
            cand.truncate(c.top_k);
        }
        let probs = |cand: &[(u32, f32)], temp: f64| -> Vec<f64> {
            let m = cand[0].1;
            let e: Vec<f64> = (cand.iter())
                .map(|(_, l)| ((l - m) as f64 / temp).exp())
                .collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect()
        };
        let mut margin = f64::INFINITY;
        if c.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, p) in probs(&cand, 1.0).iter().enumerate() {
                acc += p;
                margin = margin.min((acc - c.top_p as f64).abs());
                if acc >= c.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
        if c.min_p > 0.0 {
            let p = probs(&cand, 1.0);
            for x in &p {
                margin = margin.min((x / p[0] - c.min_p as f64).abs());
            }
            let keep = p
                .iter()
                .take_while(|&&x| x / p[0] >= c.min_p as f64)
                .count();
            cand.truncate(keep.max(1));
        }
        let mut acc = 0.0;
        for (i, p) in probs(&cand, c.temperature as f64).iter().enumerate() {
            acc += p;
            margin = margin.min((r as f64 - acc).abs());
            if (r as f64) < acc {
                return (cand[i].0, margin);
            }
        }
        (cand[cand.len() - 1].0, margin)
    }

    /// A 150K vocabulary, one token far ahead and a long tail, `r` up to its largest: the
    /// draw ends in the tail where the whole sort's does, never past the end (in f32 the
    /// running sum stopped short of the total and handed the rest to the least likely token).
    #[test]
    fn a_long_tail_is_drawn_from_where_a_whole_sort_draws() {
        let mut rng = StdRng::seed_from_u64(3);
        let cand: Vec<(u32, f32)> = (0..150_000u32)
            .map(|i| {
                (
                    i,
                    if i == 77 {
                        12.0
                    } else {
                        rng.random_range(-10.0f32..0.0)
                    },
                )
            })
            .collect();
        let least = cand.iter().map(|x| x.1).fold(f32::INFINITY, f32::min);
        for temperature in [0.7, 1.0, 1.5] {
            for top_p in [1.0, 0.999_999] {
                let c = Sampling {
                    temperature,
                    top_p,
                    ..Sampling::default()
                };
                for r in [0.0, 0.5, 0.9999, 0.999_999, 1.0 - f32::EPSILON / 2.0] {
                    let got = pick(cand.clone(), &c, r);
                    let (want, margin) = pick_whole_sort(cand.clone(), &c, r);
                    assert!(cand[got as usize].1 > least, "t {temperature} r {r}");
                    if margin > 1e-9 {
                        assert_eq!(got, want, "t {temperature} top-p {top_p} r {r}");
                    }
                }
            }
        }
    }

    proptest::proptest! {
        /// The draw over a partly sorted vocabulary is the draw over a sorted one, unless `r`
        /// falls within rounding of a boundary.
        #[test]
        fn pick_is_the_whole_sort_draw(
            logits in proptest::collection::vec(-8.0f32..8.0, 1..400),
            ties in proptest::collection::vec(-2i8..2, 0..200),
            top_k in proptest::prop_oneof![proptest::strategy::Just(0usize), 1usize..100],
            top_p in proptest::prop_oneof![proptest::strategy::Just(1.0f32), 0.05f32..1.0],
            min_p in proptest::prop_oneof![proptest::strategy::Just(0.0f32), 0.001f32..0.5],
            temperature in 0.1f32..2.0,
            r in 0.0f32..1.0,
        ) {
            // Random logits, and small integers: many ties.
            let cand: Vec<(u32, f32)> = logits
                .into_iter()
                .chain(ties.into_iter().map(|t| t as f32))
                .enumerate()
                .map(|(i, l)| (i as u32, l))
                .collect();
            let c = Sampling { temperature, top_k, top_p, min_p, ..Sampling::default() };
            let (want, margin) = pick_whole_sort(cand.clone(), &c, r);
            if margin > 1e-9 {
                proptest::prop_assert_eq!(pick(cand, &c, r), want);
            }
        }

        /// Top-k keeps the k first by logit, ties to the lower id (selected, then sorted), as
        /// a whole sort would: the draw equals one with the others set to −∞ and no top-k.
        #[test]
        fn top_k_selects_what_a_whole_sort_keeps(
            logits in proptest::collection::vec(-3i8..3, 1..60),
            k in 1usize..70,
            seed in 0u64..1000,
            top_p in 0.5f32..=1.0,
        ) {
            // Small integers: many ties.
            let logits: Vec<f32> = logits.into_iter().map(|l| l as f32 * 0.5).collect();
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let mut kept = vec![f32::NEG_INFINITY; logits.len()];
            for &i in order.iter().take(k) {
                kept[i] = logits[i];
            }
            let cfg = Sampling { temperature: 0.9, top_p, seed, ..Sampling::default() };
            let got = s(Sampling { top_k: k, ..cfg.clone() }).sample(&mut logits.clone(), &[]);
            let want = s(cfg).sample(&mut kept, &[]);
            proptest::prop_assert_eq!(got, want);
        }
    }

    /// A sampler drawing for the device ([`Sampler::device_draw`], then
    /// `keydiff_model::model::sample_rows`, here on the CPU) gives the tokens
    /// [`Sampler::sample`] gives, step after step: the generator is given back for a row with
    /// no finite logit (the host draws nothing for it), and greedy takes no draw. A biased or
    /// penalised sampler does not draw for the device.
    #[test]
    fn device_draws_follow_the_host_sampler() {
        use candle_core::{Device, Tensor};
        use keydiff_model::model::{sample_rows, NO_DRAW};
        for temperature in [0.8, 0.0] {
            let c = Sampling {
                temperature,
                top_k: 20,
                top_p: 0.9,
                min_p: 0.01,
                seed: 5,
                ..Sampling::default()
            };
            let (mut host, mut dev) = (s(c.clone()), s(c.clone()));
            let mut rng = StdRng::seed_from_u64(9);
            let mut flagged = 0;
            for step in 0..40 {
                let mut row: Vec<f32> = (0..500).map(|_| rng.random_range(-5.0..5.0)).collect();
                if step % 7 == 3 {
                    row.fill(f32::NEG_INFINITY);
                    row[step] = f32::NAN;
                }
                let want = host.sample(&mut row.clone(), &[]);
                let (p, before) = dev.device_draw().unwrap();
                let t = Tensor::from_vec(row, (1, 500), &Device::Cpu).unwrap();
                let got = sample_rows(&t, &[p]).unwrap().unwrap()[0];
                let got = match got & NO_DRAW {
                    0 => got,
                    _ => {
                        flagged += 1;
                        dev.give_back(before);
                        got & !NO_DRAW
                    }
                };
                assert_eq!(got, want, "temperature {temperature} step {step}");
            }
            assert_eq!(flagged, if temperature > 0.0 { 6 } else { 0 });
        }
        for c in [
            Sampling {
                temperature: 0.8,
                logit_bias: vec![(2, 1.0)],
                ..Sampling::default()
            },
            Sampling {
                temperature: 0.8,
                repetition_penalty: 1.2,
                ..Sampling::default()
            },
        ] {
            assert!(s(c).device_draw().is_none());
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let mut l = vec![0.1, 3.0, -1.0, 2.9];
        assert_eq!(s(Sampling::default()).sample(&mut l, &[]), 1);
    }

    /// What the device's greedy pick must equal (`keydiff_argmax_rows_*`): the first of equal
    /// largest values, NaNs skipped, 0 for a row that starts with NaN or is all −∞.
    #[test]
    fn argmax_keeps_the_first_of_ties_and_skips_nans() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        assert_eq!(argmax(&[1.0, 5.0, 2.0, 5.0]), 1);
        assert_eq!(argmax(&[1.0, nan, 4.0, nan, 4.0]), 2);
        assert_eq!(argmax(&[nan, 9.0, 1.0]), 0);
        assert_eq!(argmax(&[-inf, -inf, -inf]), 0);
        assert_eq!(argmax(&[-inf, -inf, -7.0]), 2);
        assert_eq!(argmax(&[1.0, inf, inf]), 1);
        assert_eq!(argmax(&[2.0]), 0);
        assert_eq!(argmax(&[]), 0);
    }

    /// Plain greedy (the token is the argmax and nothing else) only without a bias or an active
    /// penalty; a penalty with an empty window is no penalty.
    #[test]
    fn plain_greedy_is_greedy_without_bias_or_penalty() {
        assert!(Sampling::default().is_plain_greedy());
        let not = [
            Sampling {
                temperature: 0.7,
                ..Default::default()
            },
            Sampling {
                logit_bias: vec![(3, 0.0)],
                ..Default::default()
            },
            Sampling {
                repetition_penalty: 1.1,
                ..Default::default()
            },
            Sampling {
                frequency_penalty: 0.1,
                ..Default::default()
            },
            Sampling {
                presence_penalty: -0.1,
                ..Default::default()
            },
        ];
        for c in not {
            assert!(!c.is_plain_greedy(), "{c:?}");
        }
        assert!(Sampling {
            repetition_penalty: 1.3,
            repeat_last_n: 0,
            top_k: 5,
            ..Default::default()
        }
        .is_plain_greedy());
        // OpenAI's penalties read no window: never off.
        assert!(!Sampling {
            repetition_penalty: 1.3,
            repeat_last_n: 0,
            output_penalties: true,
            ..Default::default()
        }
        .is_plain_greedy());
    }

    /// llama.cpp's penalties count the last `repeat_last_n` tokens, prompt included; OpenAI's
    /// (vLLM's) count the reply's for frequency and presence, every token for repetition.
    #[test]
    fn penalties_count_the_window_or_the_reply() {
        // Prompt [1, 1, 2], reply [2, 3]; logits 1.0 each, token 0 never seen.
        let history = [1u32, 1, 2, 2, 3];
        let run = |cfg: Sampling| {
            let mut l = vec![1.0f32; 5];
            let mut s = Sampler::new(cfg).with_prompt_len(3);
            s.sample(&mut l, &history);
            l
        };
        let freq = Sampling {
            frequency_penalty: 0.25,
            presence_penalty: 0.5,
            ..Default::default()
        };
        // llama.cpp's, window 64: counts 1×2, 2×2, 3×1.
        assert_eq!(run(freq.clone()), [1.0, 0.0, 0.0, 0.25, 1.0]);
        // Window 2: the last two tokens, [2, 3].
        let window = Sampling {
            repeat_last_n: 2,
            ..freq.clone()
        };
        assert_eq!(run(window), [1.0, 1.0, 0.25, 0.25, 1.0]);
        // OpenAI's: the reply [2, 3] only, whatever the window.
        let openai = Sampling {
            repeat_last_n: 1,
            output_penalties: true,
            ..freq
        };
        assert_eq!(run(openai), [1.0, 1.0, 0.25, 0.25, 1.0]);
        // The repetition penalty: every token of prompt and reply, once.
        let rep = Sampling {
            repetition_penalty: 2.0,
            repeat_last_n: 1,
            output_penalties: true,
            ..Default::default()
        };
        assert_eq!(run(rep), [1.0, 0.5, 0.5, 0.5, 1.0]);
    }

    #[test]
    fn meaningless_settings_are_refused() {
        assert!(Sampling::default().validate().is_ok());
        let bad = [
            Sampling {
                temperature: -0.5,
                ..Default::default()
            },
            Sampling {
                temperature: f32::NAN,
                ..Default::default()
            },
            Sampling {
                top_p: 0.0,
                ..Default::default()
            },
            Sampling {
                top_p: 1.5,
                ..Default::default()
            },
            Sampling {
                min_p: -0.1,
                ..Default::default()
            },
            Sampling {
                min_p: f32::NAN,
                ..Default::default()
            },
            Sampling {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            Sampling {
                repetition_penalty: f32::INFINITY,
                ..Default::default()
            },
            // OpenAI's range where the penalties count OpenAI's way (llama.cpp's: any).
            Sampling {
                frequency_penalty: 2.5,
                output_penalties: true,
                ..Default::default()
            },
            Sampling {
                frequency_penalty: f32::INFINITY,
                ..Default::default()
            },
            Sampling {
                presence_penalty: f32::NAN,
                ..Default::default()
            },
            Sampling {
                logit_bias: vec![(0, f32::NAN)],
                ..Default::default()
            },
            Sampling {
                logit_bias: vec![(0, 1.0), (3, f32::INFINITY)],
                ..Default::default()
            },
        ];
        for s in bad {
            assert!(s.validate().is_err(), "{s:?} accepted");
        }
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let cfg = Sampling {
            temperature: 5.0,
            top_k: 1,
            ..Default::default()
        };
        let mut smp = s(cfg);
        for _ in 0..50 {
            assert_eq!(smp.sample(&mut [0.0, 1.0, 0.5, 0.99], &[]), 1);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // probs ≈ [0.665, 0.245, 0.09, ~0]
        let logits = [2.0f32, 1.0, 0.0, -20.0];
        let mut smp = s(Sampling {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(smp.sample(&mut logits.clone(), &[]), 0);
        }
        let mut smp = s(Sampling {
            temperature: 1.0,
            min_p: 0.3,
            ..Default::default()
        });
        for _ in 0..200 {
            assert!(smp.sample(&mut logits.clone(), &[]) <= 1);
        }
    }

    /// vLLM's order cuts the tempered distribution: logits [2, 1, 0] at T 0.5 have
    /// probabilities .867 / .117 / .016 (token 1 is .135 of the best), at T 1 .665 / .245 /
    /// .090 (.368). Top-p 0.8 and min-p 0.2 then keep token 0 alone in vLLM's order, and
    /// token 1 too in llama.cpp's, which the largest draw picks.
    #[test]
    fn temperature_first_cuts_the_tempered_distribution() {
        let last = 1.0 - f32::EPSILON / 2.0;
        for (top_p, min_p) in [(0.8, 0.0), (1.0, 0.2)] {
            let c = |temperature_first| Sampling {
                temperature: 0.5,
                top_p,
                min_p,
                temperature_first,
                ..Sampling::default()
            };
            assert_eq!(draw(&[2.0, 1.0, 0.0], &c(false), last), Some(1));
            assert_eq!(draw(&[2.0, 1.0, 0.0], &c(true), last), Some(0));
            assert_eq!(c(true).draw_params(0.5).truncation_temperature, 0.5);
            assert_eq!(c(false).draw_params(0.5).truncation_temperature, 1.0);
        }
        // Greedy has no truncation to temper.
        let greedy = Sampling {
            temperature_first: true,
            ..Sampling::default()
        };
        assert_eq!(greedy.draw_params(0.5).truncation_temperature, 1.0);
    }

    #[test]
    fn logit_bias_comes_first_and_bans() {
        // Greedy: +1 on token 2 makes it the largest; a token given twice gets both biases.
        let cfg = Sampling {
            logit_bias: vec![(2, 0.75), (2, 0.5), (1, -0.25), (9, 5.0)],
            ..Default::default()
        };
        let mut l = vec![0.0f32, 1.0, 0.0];
        assert_eq!(s(cfg).sample(&mut l, &[]), 2);
        // An id past the logits (a vocabulary padded in the model) is left alone.
        assert_eq!(l, [0.0, 0.75, 1.25]);
        // Before the repetition penalty: 2 + 2 = 4, halved to 2 > 1.5.
        let mut l = vec![2.0f32, 1.5];
        let cfg = Sampling {
            logit_bias: vec![(0, 2.0)],
            repetition_penalty: 2.0,
            ..Default::default()
        };
        assert_eq!(s(cfg).sample(&mut l, &[0]), 0);
        assert_eq!(l, [2.0, 1.5]);
        // -inf bans the most likely token at any temperature.
        let mut smp = s(Sampling {
            temperature: 2.0,
            logit_bias: vec![(0, f32::NEG_INFINITY)],
            seed: 3,
            ..Default::default()
        });
        for _ in 0..200 {
            assert_ne!(smp.sample(&mut [5.0, 0.0, 0.0], &[]), 0);
        }
        let banned = Sampling {
            logit_bias: vec![(0, f32::NEG_INFINITY)],
            ..Default::default()
        };
        assert!(banned.validate().is_ok());
    }

    #[test]
    fn repetition_penalty_changes_the_choice() {
        let cfg = Sampling {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut l = vec![1.0, 0.8, -1.0];
        assert_eq!(s(cfg).sample(&mut l, &[0]), 1);
    }

    #[test]
    fn frequency_and_presence_penalties_count_the_window() {
        let cfg = Sampling {
            frequency_penalty: 0.25,
            presence_penalty: 0.125,
            ..Default::default()
        };
        // Token 0 twice and token 1 once in the window: 1 - 2·0.25 - 0.125, 0.75 - 0.25 - 0.125.
        let mut l = vec![1.0f32, 0.75, 0.5];
        assert_eq!(s(cfg.clone()).sample(&mut l, &[0, 1, 0]), 2);
        assert_eq!(l, [0.375, 0.375, 0.5]);
        // A window of 2 sees token 0 once.
        let mut l = vec![1.0f32, 0.75, 0.5];
        s(Sampling {
            repeat_last_n: 2,
            ..cfg.clone()
        })
        .sample(&mut l, &[0, 1, 0]);
        assert_eq!(l, [0.625, 0.375, 0.5]);
        // A negative presence penalty favours what was said.
        let mut l = vec![1.0f32, 0.75, 0.25];
        let favour = Sampling {
            presence_penalty: -0.5,
            ..Default::default()
        };
        assert_eq!(s(favour).sample(&mut l, &[1]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_distribution_is_sane() {
        let cfg = Sampling {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let logits = [0.0f32, (3.0f32).ln()]; // p = [0.25, 0.75]
        let run = |cfg: &Sampling| -> Vec<u32> {
            let mut smp = s(cfg.clone());
            (0..2000)
                .map(|_| smp.sample(&mut logits.clone(), &[]))
                .collect()
        };
        let a = run(&cfg);
        assert_eq!(a, run(&cfg));
        let ones = a.iter().filter(|&&t| t == 1).count() as f32 / a.len() as f32;
        assert!((ones - 0.75).abs() < 0.05, "frequency {ones}");
    }

    /// The penalties' range is OpenAI's where they count OpenAI's way, any number where they
    /// count llama.cpp's (llama.cpp takes any); a refusal names the field.
    #[test]
    fn a_refusal_names_its_field() {
        let llama = Sampling {
            frequency_penalty: 3.0,
            presence_penalty: -2.5,
            ..Default::default()
        };
        assert_eq!(llama.check(), Ok(()));
        let openai = Sampling {
            output_penalties: true,
            ..llama.clone()
        };
        assert_eq!(openai.check().unwrap_err().0, "frequency_penalty");
        let nan = Sampling {
            presence_penalty: f32::NAN,
            ..Default::default()
        };
        assert_eq!(nan.check().unwrap_err().0, "presence_penalty");
        let top_p = Sampling {
            top_p: 0.0,
            ..Default::default()
        };
        assert_eq!(
            top_p.check(),
            Err(("top_p", "top-p 0 must be in (0, 1] (1 is off)".to_string()))
        );
        assert_eq!(top_p.validate().unwrap_err(), top_p.check().unwrap_err().1);
    }
}
