//! Speculative decoding by n-gram lookup (prompt lookup decoding; vLLM's `ngram` method,
//! llama.cpp's `ngram-simple`): no draft model. The last tokens of the text so far are looked
//! up in the text itself (prompt and output); where they occurred before, the tokens that
//! followed are proposed as the next ones, and one decode pass over the proposal verifies it
//! ([`keydiff_model::Model::forward_decode_rows`]). A request on a long document often copies
//! from it (a quote, a name, code being edited), and the document's tokens are all there to
//! look up, evicted from the KV cache or not.
//!
//! The output is the one decoding token by token gives: every generated token is still sampled
//! from the model's distribution after the tokens before it (drafted tokens only save the
//! passes), in order, with the same sampler, so greedy and seeded sampling give the same tokens
//! (bit for bit with [`NgramSpec::exact`], or where the weights' kernels compute several rows
//! as they compute one, as on the CPU for Q8_0; otherwise up to the rounding of a pass over
//! several rows, as a batch's).
//! The draft stops before the cache would evict ([`KvCache::draft_room`]), so rejected
//! tokens can be taken back ([`KvCache::rewind`]).

use keydiff_cache::KvCache;

use crate::{EngineError, Result};

/// Settings of n-gram speculation ([`crate::GenerateParams::speculative`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NgramSpec {
    /// The shortest run of last tokens looked up (vLLM's `prompt_lookup_min`).
    pub ngram_min: usize,
    /// The longest run looked up first (vLLM's `prompt_lookup_max`); the longest that
    /// occurred before wins.
    pub ngram_max: usize,
    /// Tokens proposed at most per pass (llama.cpp's `--draft-max`, vLLM's
    /// `num_speculative_tokens`).
    pub draft_max: usize,
    /// Verify bit for bit: a weight whose kernel computes several rows otherwise than one
    /// (CPU x86 Q6K; CUDA's quantized and dense matmuls) runs row by row in the verification
    /// pass, so every logit is the one token-by-token decoding computes (slower where such
    /// weights are). Off, the pass runs each weight once over all rows, as a batch does: the
    /// same distribution up to the last bits of rounding, which can flip a near tie, as in
    /// vLLM's and llama.cpp's speculative decoding. Rows are exact either way on the CPU for
    /// Q8_0 (and the Q4_1/Q5_0/Q5_1 weights run as Q8_0).
    #[serde(default)]
    pub exact: bool,
}

/// The most tokens a draft may propose, and the longest n-gram looked up.
pub const MAX_DRAFT: usize = 64;

impl Default for NgramSpec {
    fn default() -> Self {
        Self {
            ngram_min: 2,
            ngram_max: 4,
            draft_max: 8,
            exact: false,
        }
    }
}

impl NgramSpec {
    /// Refuses sizes that propose nothing or look up nothing.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| {
            Err(EngineError::BadParams(format!(
                "speculative decoding: {what}"
            )))
        };
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max {
            return bad(format!(
                "the n-gram sizes must satisfy 1 <= min <= max (min {}, max {})",
                self.ngram_min, self.ngram_max
            ));
        }
        if self.ngram_max > MAX_DRAFT {
            return bad(format!(
                "n-grams of {} tokens looked up, at most {MAX_DRAFT}",
                self.ngram_max
            ));
        }
        if self.draft_max == 0 || self.draft_max > MAX_DRAFT {
            return bad(format!(
                "a draft of {} tokens, expected 1 to {MAX_DRAFT}",
                self.draft_max
            ));
        }
        Ok(())
    }

    /// The tokens proposed after `text` (the prompt and what was generated, the token about
    /// to be fed last), at most `room` of them: for `n` from `ngram_max` down to `ngram_min`,
    /// the last `n` tokens are looked up at their latest earlier occurrence, and the tokens
    /// after it are proposed. Empty when no n-gram occurred before.
    pub fn draft(&self, text: &[u32], room: usize) -> Vec<u32> {
        let want = self.draft_max.min(room);
        if want == 0 {
            return Vec::new();
        }
        let len = text.len();
        for n in (self.ngram_min..=self.ngram_max.min(len.saturating_sub(1))).rev() {
            let pattern = &text[len - n..];
            // The latest occurrence that ends before the text does.
            let found = (0..len - n)
                .rev()
                .find(|&at| text[at + n - 1] == pattern[n - 1] && &text[at..at + n] == pattern);
            if let Some(at) = found {
                let from = at + n;
                return text[from..len.min(from + want)].to_vec();
            }
        }
        Vec::new()
    }

    /// [`NgramSpec::draft`] for a request whose cache is `cache` (one that can rewind): no
    /// longer than the cache can take back ([`KvCache::draft_room`]), nor than `left` more
    /// tokens may be generated after the next one.
    pub(crate) fn draft_for(&self, text: &[u32], cache: &KvCache, left: usize) -> Vec<u32> {
        debug_assert!(cache.can_rewind());
        self.draft(text, cache.draft_room().min(left))
    }
}

/// How long a request's next draft may be, from how its last ones went: transformers'
/// heuristic schedule (two more after a draft taken whole, one fewer after one that was not),
/// and after a draft of one token that missed, a pause of 2, 4, ... up to 64 tokens without
/// drafting, so that text that does not repeat costs few verification rows. It depends on the
/// tokens only, never on timings, so a request's passes are the same on every run.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    len: usize,
    pause: usize,
    backoff: usize,
}

/// The longest pause of [`Schedule`], in tokens.
const MAX_PAUSE: usize = 64;

impl Schedule {
    pub(crate) fn new(spec: &NgramSpec) -> Self {
        Self {
            len: spec.draft_max,
            pause: 0,
            backoff: 0,
        }
    }

    /// The longest draft after the next token (0 while paused; each call is a token).
    pub(crate) fn next_len(&mut self) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        self.len
    }

    /// After a draft of `drafted` tokens of which the first `kept` were taken.
    pub(crate) fn update(&mut self, spec: &NgramSpec, drafted: usize, kept: usize) {
        if kept == drafted {
            self.len = (self.len + 2).min(spec.draft_max);
        } else {
            if kept == 0 && self.len == 1 {
                self.backoff = (self.backoff * 2).clamp(2, MAX_PAUSE);
                self.pause = self.backoff;
            }
            self.len = self.len.saturating_sub(1).max(1);
        }
        if kept > 0 {
            self.backoff = 0;
        }
    }
}

/// Drafted and accepted tokens of a request ([`crate::Stats::speculative`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpecCounters {
    /// Verification passes that carried a draft.
    pub passes: usize,
    /// Tokens proposed.
    pub drafted: usize,
    /// Tokens proposed that were the ones sampled (each saved a decode pass).
    pub accepted: usize,
}

impl SpecCounters {
    /// Accepted over drafted tokens (0 without drafts).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(min: usize, max: usize, draft: usize) -> NgramSpec {
        NgramSpec {
            ngram_min: min,
            ngram_max: max,
            draft_max: draft,
            exact: false,
        }
    }

    #[test]
    fn the_longest_earlier_ngram_gives_what_followed_it() {
        // "1 2 3 9 ... 2 3 7 8 ... 1 2 3": the 3-gram [1 2 3] occurred at 0 (then 9), the
        // 2-gram [2 3] last at 5 (then 7): the longest wins.
        let text = [1, 2, 3, 9, 4, 2, 3, 7, 8, 1, 2, 3];
        assert_eq!(spec(2, 3, 4).draft(&text, 8), vec![9, 4, 2, 3]);
        // Only 2-grams: the latest occurrence of [2 3] before the end.
        assert_eq!(spec(2, 2, 3).draft(&text, 8), vec![7, 8, 1]);
        // The room bounds the draft, and so does the text's end.
        assert_eq!(spec(2, 3, 4).draft(&text, 2), vec![9, 4]);
        assert_eq!(spec(1, 1, 8).draft(&[5, 6, 5], 8), vec![6, 5]);
    }

    #[test]
    fn nothing_is_proposed_without_an_earlier_occurrence() {
        assert!(spec(2, 4, 8).draft(&[1, 2, 3, 4, 5], 8).is_empty());
        assert!(spec(2, 4, 8).draft(&[7], 8).is_empty());
        assert!(spec(1, 4, 8).draft(&[], 8).is_empty());
        assert!(spec(1, 4, 8).draft(&[1, 2, 1], 0).is_empty());
    }

    #[test]
    fn a_repeating_text_is_continued_from_its_last_period() {
        // The latest earlier [a b] ends one period back: its continuation runs into the end.
        let text = [1, 2, 1, 2, 1, 2];
        assert_eq!(spec(2, 2, 8).draft(&text, 8), vec![1, 2]);
    }

    #[test]
    fn drafts_shrink_on_misses_and_pause_after_misses_of_one() {
        let spec = spec(2, 4, 4);
        let mut s = Schedule::new(&spec);
        assert_eq!(s.next_len(), 4);
        // Taken whole: stays at the most; a miss: one fewer, down to one.
        s.update(&spec, 4, 4);
        assert_eq!(s.next_len(), 4);
        for want in [3, 2, 1, 1] {
            s.update(&spec, 4, 1);
            assert_eq!(s.next_len(), want);
        }
        // A draft of one that missed: 2 tokens without drafts, then 4, 8, ... up to 64.
        let mut paused = Vec::new();
        for _ in 0..7 {
            s.update(&spec, 1, 0);
            let mut n = 0;
            while s.next_len() == 0 {
                n += 1;
            }
            paused.push(n);
        }
        assert_eq!(paused, [2, 4, 8, 16, 32, 64, 64]);
        // A draft taken ends the pauses; the length grows back by two.
        s.update(&spec, 1, 1);
        assert_eq!(s.next_len(), 3);
        s.update(&spec, 1, 0);
        s.update(&spec, 2, 0);
        assert_eq!(s.next_len(), 1);
        s.update(&spec, 1, 0);
        assert_eq!((s.next_len(), s.next_len(), s.next_len()), (0, 0, 1));
    }

    #[test]
    fn sizes_are_checked() {
        assert!(spec(0, 2, 4).validate().is_err());
        assert!(spec(3, 2, 4).validate().is_err());
        assert!(spec(1, 2, 0).validate().is_err());
        assert!(spec(1, MAX_DRAFT + 1, 4).validate().is_err());
        assert!(spec(1, 2, MAX_DRAFT + 1).validate().is_err());
        assert!(NgramSpec::default().validate().is_ok());
    }
}
