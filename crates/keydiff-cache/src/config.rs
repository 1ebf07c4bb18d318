//! Which policy, what budget, and when to evict.

use crate::{CacheError, Result};

/// KeyDiff anchor: the normalised mean (paper, kvpress) or the plain mean (Qualcomm runtime).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Anchor {
    /// μ = mean of k/‖k‖.
    Normalized,
    /// μ = mean of k.
    Mean,
}

/// An eviction policy, exactly as POLICIES.md defines it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "policy", rename_all = "kebab-case")]
pub enum PolicyKind {
    /// Nothing is evicted; the budget is the model's context.
    Full,
    /// Keep the keys least similar (cosine) to the anchor of the head's keys.
    KeyDiff { anchor: Anchor },
    /// Attention of the newest token, averaged over all query heads (or per KV head).
    Tova { per_head: bool },
    /// Summed attention of the last `window` queries, pooled (kernel 5) along slots.
    SnapKv { window: usize },
    /// Accumulated attention over every query so far (optionally divided by how many queries
    /// could see the slot), plus a recent window.
    H2o { normalized: bool },
    /// StreamingLLM: first `sinks` positions plus the most recent.
    Sink,
    /// Keep the keys of smallest L2 norm.
    Knorm,
    /// Seeded random scores.
    Random { seed: u64 },
}

/// SnapKV observation window when none is given (SnapKV reference code default).
pub const SNAPKV_WINDOW: usize = 32;
/// H2O's recent share of the budget (reference code: heavy:recent = 1:1).
pub const H2O_RECENT_FRACTION: f64 = 0.5;
/// StreamingLLM's attention sinks (Xiao et al. 2024).
pub const STREAMING_SINKS: usize = 4;

impl PolicyKind {
    /// Parses a policy name: full, keydiff, keydiff-mean, tova, tova-per-head, snapkv, h2o,
    /// h2o-normalized, sink, knorm, random.
    pub fn parse(name: &str, snap_window: usize, seed: u64) -> Result<Self> {
        Ok(match name {
            "full" => Self::Full,
            "keydiff" => Self::KeyDiff {
                anchor: Anchor::Normalized,
            },
            "keydiff-mean" => Self::KeyDiff {
                anchor: Anchor::Mean,
            },
            "tova" => Self::Tova { per_head: false },
            "tova-per-head" => Self::Tova { per_head: true },
            "snapkv" => Self::SnapKv {
                window: snap_window,
            },
            "h2o" => Self::H2o { normalized: false },
            "h2o-normalized" => Self::H2o { normalized: true },
            "sink" | "streamingllm" => Self::Sink,
            "knorm" => Self::Knorm,
            "random" => Self::Random { seed },
            other => {
                return Err(CacheError::Config(format!(
                    "unknown policy `{other}` (full, keydiff, keydiff-mean, tova, tova-per-head, \
                     snapkv, h2o, h2o-normalized, sink, knorm, random)"
                )))
            }
        })
    }

    /// The short name used in tables and file names.
    pub fn name(&self) -> String {
        match self {
            Self::Full => "full".into(),
            Self::KeyDiff {
                anchor: Anchor::Normalized,
            } => "keydiff".into(),
            Self::KeyDiff {
                anchor: Anchor::Mean,
            } => "keydiff-mean".into(),
            Self::Tova { per_head: false } => "tova".into(),
            Self::Tova { per_head: true } => "tova-per-head".into(),
            Self::SnapKv { .. } => "snapkv".into(),
            Self::H2o { normalized: false } => "h2o".into(),
            Self::H2o { normalized: true } => "h2o-normalized".into(),
            Self::Sink => "sink".into(),
            Self::Knorm => "knorm".into(),
            Self::Random { .. } => "random".into(),
        }
    }
}

/// The cache settings of one request.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CacheConfig {
    pub policy: PolicyKind,
    /// N: slots per layer and KV head that survive each eviction (`None` with `full`).
    pub budget: Option<usize>,
    /// B: the prefill chunk size.
    pub chunk: usize,
    /// Share of the budget reserved for the most recent tokens (round(window · N) slots).
    pub window: f64,
    /// The first `sinks` absolute positions are never evicted.
    pub sinks: usize,
    /// Decode evicts once `budget + evict_every` slots are used (default B; 1 = per token).
    pub evict_every: Option<usize>,
}

impl CacheConfig {
    /// A full cache (no eviction) with chunk size B.
    pub fn full(chunk: usize) -> Self {
        Self {
            policy: PolicyKind::Full,
            budget: None,
            chunk,
            window: 0.0,
            sinks: 0,
            evict_every: None,
        }
    }

    /// Recent slots protected from eviction: the user window, or the policy's own minimum
    /// (SnapKV's observation window, TOVA's newest token), whichever is more; under H2O the
    /// user window, or half the budget when none is set (the reference's default).
    pub fn protected_recent(&self, budget: usize) -> usize {
        let user = (self.window * budget as f64).round() as usize;
        let policy = match &self.policy {
            PolicyKind::SnapKv { window } => (*window).min(self.chunk),
            // The reference's heavy:recent = 1:1, unless the user sets the window.
            PolicyKind::H2o { .. } if self.window == 0.0 => {
                (H2O_RECENT_FRACTION * budget as f64).round() as usize
            }
            // kvpress keeps the newest token under TOVA.
            PolicyKind::Tova { .. } => 1,
            _ => 0,
        };
        user.max(policy)
    }

    /// Protected first positions: the user's sinks, or StreamingLLM's 4.
    pub fn protected_sinks(&self) -> usize {
        match self.policy {
            PolicyKind::Sink => self.sinks.max(STREAMING_SINKS),
            _ => self.sinks,
        }
    }

    /// Decode eviction period (K).
    pub fn evict_every(&self) -> usize {
        self.evict_every.unwrap_or(self.chunk)
    }

    /// Checks the settings against each other; run at start-up, never mid-request.
    pub fn validate(&self) -> Result<()> {
        if self.chunk == 0 {
            return Err(CacheError::Config("chunk size must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&self.window) {
            return Err(CacheError::Config(format!(
                "window fraction {} is not in [0, 1]",
                self.window
            )));
        }
        if let PolicyKind::SnapKv { window } = self.policy {
            if window == 0 {
                return Err(CacheError::Config(
                    "SnapKV window must be at least 1".into(),
                ));
            }
        }
        let Some(n) = self.budget else {
            if self.policy != PolicyKind::Full {
                return Err(CacheError::Config(format!(
                    "policy `{}` needs a budget (--budget N)",
                    self.policy.name()
                )));
            }
            return Ok(());
        };
        if self.policy == PolicyKind::Full {
            return Err(CacheError::Config(
                "policy `full` evicts nothing; drop --budget or pick another policy".into(),
            ));
        }
        if n < self.chunk {
            return Err(CacheError::Config(format!(
                "budget {n} is smaller than the chunk {} (--budget, --chunk): every chunk must \
                 fit in the budget",
                self.chunk
            )));
        }
        let k = self.evict_every();
        if k == 0 || k > self.chunk {
            return Err(CacheError::Config(format!(
                "evict-every {k} must be in 1..={} (the chunk size)",
                self.chunk
            )));
        }
        let protected = self.protected_recent(n) + self.protected_sinks();
        if protected > n {
            return Err(CacheError::Config(format!(
                "protected slots ({} sinks + {} recent: --sinks, --window) exceed the budget {n}",
                self.protected_sinks(),
                self.protected_recent(n)
            )));
        }
        Ok(())
    }

    /// Slots to allocate per layer and head: N + B (the chunk, or K in decode, on top of N).
    pub fn capacity(&self) -> Option<usize> {
        self.budget.map(|n| n + self.chunk.max(self.evict_every()))
    }

    /// Slots a cache for a request of at most `max_tokens` tokens allocates per layer and
    /// head: the capacity, or `max_tokens` when that is less (or when there is no budget).
    pub fn slots_for(&self, max_tokens: usize) -> usize {
        self.capacity().map_or(max_tokens, |c| c.min(max_tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_slots_protected_per_policy() {
        let with = |policy: PolicyKind, window: f64| CacheConfig {
            policy,
            budget: Some(100),
            window,
            ..CacheConfig::full(64)
        };
        let h2o = PolicyKind::H2o { normalized: false };
        // H2O: the reference's half unless the user sets the window, which then rules.
        assert_eq!(with(h2o.clone(), 0.0).protected_recent(100), 50);
        assert_eq!(with(h2o.clone(), 0.2).protected_recent(100), 20);
        assert_eq!(with(h2o, 0.8).protected_recent(100), 80);
        // SnapKV: at least its observation window (at most a chunk); TOVA the newest token.
        let snap = PolicyKind::SnapKv { window: 32 };
        assert_eq!(with(snap.clone(), 0.0).protected_recent(100), 32);
        assert_eq!(with(snap, 0.5).protected_recent(100), 50);
        let tova = PolicyKind::Tova { per_head: false };
        assert_eq!(with(tova, 0.0).protected_recent(100), 1);
        let keydiff = PolicyKind::parse("keydiff", 32, 0).unwrap();
        assert_eq!(with(keydiff.clone(), 0.0).protected_recent(100), 0);
        assert_eq!(with(keydiff, 0.2).protected_recent(100), 20);
    }
}
