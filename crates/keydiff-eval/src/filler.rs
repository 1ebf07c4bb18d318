//! Procedural haystack text: seeded, the same on every machine, never downloaded.
//!
//! A port of `scripts/filler.py`: sentences of 6..14 words drawn from a fixed word list by
//! SplitMix64, capitalised, ending in '.'. The Python and Rust versions give identical text for
//! the same seed (checked by a test against a string produced by the script).

/// The word list of `scripts/filler.py`.
pub const WORDS: &[&str] = &[
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "that",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "this",
    "be",
    "are",
    "were",
    "river",
    "mountain",
    "city",
    "garden",
    "library",
    "window",
    "morning",
    "evening",
    "market",
    "harbor",
    "village",
    "teacher",
    "farmer",
    "doctor",
    "sailor",
    "painter",
    "student",
    "engineer",
    "baker",
    "merchant",
    "traveler",
    "walked",
    "carried",
    "opened",
    "noticed",
    "remembered",
    "built",
    "found",
    "watched",
    "followed",
    "explained",
    "quiet",
    "bright",
    "ancient",
    "narrow",
    "heavy",
    "gentle",
    "distant",
    "careful",
    "simple",
    "golden",
    "slowly",
    "quickly",
    "often",
    "never",
    "always",
    "together",
    "again",
    "almost",
    "still",
    "early",
    "bridge",
    "letter",
    "story",
    "road",
    "music",
    "stone",
    "light",
    "water",
    "bread",
    "clock",
    "paper",
    "lamp",
    "because",
    "while",
    "after",
    "before",
    "although",
    "until",
    "since",
    "during",
    "under",
    "over",
    "near",
    "beyond",
];

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny seeded generator whose output is fixed by its
/// definition, so that tasks are reproducible across versions of any crate.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// An integer in `[0, n)` (modulo bias is irrelevant here, and fixed).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// An integer in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// A float in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Endless filler sentences from `seed`, each ending in '.', a paragraph break before every 8th.
pub struct Sentences {
    rng: SplitMix64,
    n: usize,
}

impl Sentences {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: SplitMix64::new(seed),
            n: 0,
        }
    }

    /// The next sentence with its leading separator (none for the first, a newline before
    /// every 8th, else a space).
    pub fn next_sentence(&mut self, max_words: usize) -> String {
        let len = (6 + self.rng.below(9) as usize).min(max_words);
        let mut words: Vec<String> = (0..len)
            .map(|_| WORDS[self.rng.below(WORDS.len() as u64) as usize].to_string())
            .collect();
        if let Some(first) = words.first_mut() {
            let mut c = first.chars();
            if let Some(f) = c.next() {
                *first = f.to_uppercase().collect::<String>() + c.as_str();
            }
        }
        let sep = if self.n == 0 {
            ""
        } else if self.n.is_multiple_of(8) {
            "\n"
        } else {
            " "
        };
        self.n += 1;
        format!("{sep}{}.", words.join(" "))
    }

    /// Word count of a sentence made by [`Sentences::next_sentence`].
    fn words(s: &str) -> usize {
        s.split_whitespace().count()
    }
}

/// Exactly `n_words` words of filler (the last sentence may be cut short), as
/// `scripts/filler.py` `filler_text(n_words, seed)` makes them.
pub fn filler_text(n_words: usize, seed: u64) -> String {
    let mut s = Sentences::new(seed);
    let mut out = String::new();
    let mut left = n_words;
    while left > 0 {
        let sent = s.next_sentence(left);
        left -= Sentences::words(&sent);
        out.push_str(&sent);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_python_script() {
        // python3 scripts/filler.py 30 7
        assert_eq!(filler_text(30, 7), "Simple always road distant clock mountain harbor never traveler. Music light it is garden water early. Although water stone market village bread for since. Baker market although opened bridge be.");
        // python3 scripts/filler.py 100 1 (spans a paragraph break)
        assert_eq!(filler_text(100, 1), "Was harbor with gentle teacher almost river bridge mountain farmer near. On merchant careful and this at bridge still. Noticed opened quickly narrow while with was story to. By under before opened bright farmer. Evening engineer baker together followed a although harbor. Lamp window because in although found built water. Opened paper followed because beyond under. Always music explained with letter careful never baker while explained at together lamp near.\nMarket gentle farmer before followed traveler this library remembered simple. That harbor always road remembered heavy a bread be this farmer are. Paper student road from mountain as during window.");
    }
}
