//! Synthetic retrieval tasks: passkey, needle in a haystack (RULER style) and phonebook.
//!
//! Each sample is made from a seed, a target length L in tokens and a depth d in [0, 1]. As in
//! RULER, L bounds the whole sequence: the haystack is filled until the model's input (chat
//! template and answer prefix included, as the caller's `count` measures it) plus the tokens to
//! generate is as long as possible without exceeding L. The fact to retrieve is placed after a
//! share d of the haystack's units (0: first, 1: last). The answer is scored by
//! [`Metric::Contains`].

/// Counts the model input tokens of a user turn followed by an answer prefix.
pub type Counter<'a> = dyn FnMut(&str, &str) -> Result<usize> + 'a;

use crate::filler::{Sentences, SplitMix64};
use crate::{EvalError, Metric, Result, Sample};

/// The synthetic tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// A 5-digit key in repeated filler (Mohtashami & Jaggi 2023, as RULER words it).
    Passkey,
    /// A magic number for a key phrase in varied procedural prose (RULER `niah_single`).
    Niah,
    /// A phone number among many names with numbers.
    Phonebook,
}

impl Task {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "passkey" => Ok(Self::Passkey),
            "niah" => Ok(Self::Niah),
            "phonebook" => Ok(Self::Phonebook),
            other => Err(EvalError::Params(format!(
                "unknown synthetic task `{other}` (passkey, niah, phonebook)"
            ))),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Passkey => "passkey",
            Self::Niah => "niah",
            Self::Phonebook => "phonebook",
        }
    }
}

/// The passkey task's repeated filler (as in Mohtashami & Jaggi and RULER).
const PASSKEY_FILLER: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";

const ADJECTIVES: &[&str] = &[
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
    "kind", "lively", "misty", "noble", "odd", "proud", "quick", "rusty", "silent", "tidy",
    "upbeat", "vivid", "wild", "young", "zealous", "bitter", "crisp", "dizzy", "frozen", "grand",
];
const NOUNS: &[&str] = &[
    "anchor", "badge", "candle", "dolphin", "engine", "falcon", "glacier", "hammer", "island",
    "jacket", "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quartz", "rocket",
    "saddle", "teapot", "umbrella", "violin", "walnut", "yacht", "zipper", "basket", "cactus",
    "drum", "feather", "guitar",
];
const FIRST_NAMES: &[&str] = &[
    "Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira",
    "Luca", "Mona", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera",
    "Wendel", "Xenia", "Yusuf", "Zora", "Anton", "Bianca", "Cyril", "Dalia", "Emil", "Frida",
    "Goran", "Hanna", "Igor", "Jana", "Karl", "Lena", "Milan", "Nora",
];
const LAST_NAMES: &[&str] = &[
    "Abbott",
    "Becker",
    "Castillo",
    "Dalton",
    "Eriksen",
    "Fischer",
    "Garcia",
    "Hartmann",
    "Ivanova",
    "Jensen",
    "Kowalski",
    "Lindqvist",
    "Moreau",
    "Novak",
    "Okafor",
    "Petrov",
    "Quintero",
    "Rossi",
    "Schmidt",
    "Tanaka",
    "Ueda",
    "Varga",
    "Weber",
    "Xu",
    "Yilmaz",
    "Zimmer",
    "Almeida",
    "Brandt",
    "Costa",
    "Dubois",
    "Engel",
    "Ferrari",
    "Gruber",
    "Horvat",
    "Ibsen",
    "Jovanovic",
    "Keller",
    "Larsen",
    "Meyer",
    "Nieminen",
];

/// The parts of a prompt before fitting: a head, haystack units, the needle (inserted before
/// unit `floor(d · n)`), and a tail.
struct Parts {
    head: String,
    units: Vec<String>,
    needle: String,
    tail: String,
}

impl Parts {
    fn render(&self, n: usize, depth: f64) -> String {
        let at = ((depth * n as f64).floor() as usize).min(n);
        let mut s = self.head.clone();
        for u in &self.units[..at] {
            s.push_str(u);
        }
        s.push_str(&self.needle);
        for u in &self.units[at..n] {
            s.push_str(u);
        }
        s.push_str(&self.tail);
        s
    }
}

/// The most haystack units whose prompt stays within `max_tokens`, found by bisection.
fn fit(
    parts: &Parts,
    depth: f64,
    max_tokens: usize,
    count: &mut dyn FnMut(&str) -> Result<usize>,
) -> Result<(String, usize)> {
    let bare = count(&parts.render(0, depth))?;
    if bare > max_tokens {
        return Err(EvalError::Params(format!(
            "too short: its {max_tokens} tokens for the prompt are too few, the task's \
             question alone takes {bare} tokens"
        )));
    }
    let (mut lo, mut hi) = (0usize, parts.units.len());
    if count(&parts.render(hi, depth))? <= max_tokens {
        return Err(EvalError::Params(format!(
            "not enough haystack for {max_tokens} tokens ({} units)",
            parts.units.len()
        )));
    }
    // Invariant: lo fits, hi does not.
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if count(&parts.render(mid, depth))? <= max_tokens {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let text = parts.render(lo, depth);
    let n = count(&text)?;
    Ok((text, n))
}

/// Haystack units for more than `max_tokens` tokens: 12 characters per token, where English BPE
/// vocabularies average about 4 and even one token per word needs less than 8. Units are short,
/// so fitting is fine-grained.
fn units(task: Task, rng: &mut SplitMix64, max_tokens: usize) -> Vec<String> {
    let want_chars = max_tokens * 12 + 2000;
    let mut out = Vec::new();
    let mut chars = 0;
    match task {
        Task::Passkey => {
            while chars < want_chars {
                out.push(PASSKEY_FILLER.to_string());
                chars += PASSKEY_FILLER.len();
            }
        }
        Task::Niah => {
            let mut s = Sentences::new(rng.next_u64());
            while chars < want_chars {
                let u = s.next_sentence(usize::MAX);
                chars += u.len();
                out.push(u);
            }
        }
        Task::Phonebook => {
            // Distinct names: shuffle the first × last product, and cycle with a middle initial
            // once exhausted.
            let mut names: Vec<String> = FIRST_NAMES
                .iter()
                .flat_map(|f| LAST_NAMES.iter().map(move |l| format!("{f} {l}")))
                .collect();
            shuffle(&mut names, rng);
            let base = names.len();
            let mut i = 0;
            while chars < want_chars {
                let name = if i < base {
                    names[i].clone()
                } else {
                    let (f, l) = names[i % base].split_once(' ').unwrap_or(("A", "B"));
                    let initial = (b'A' + ((i / base - 1) % 26) as u8) as char;
                    format!("{f} {initial}. {l}")
                };
                let u = format!("{name}: {}\n", phone(rng));
                chars += u.len();
                out.push(u);
                i += 1;
            }
        }
    }
    out
}

fn shuffle<T>(v: &mut [T], rng: &mut SplitMix64) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

fn phone(rng: &mut SplitMix64) -> String {
    format!(
        "{}-{:03}-{:04}",
        rng.range(201, 989),
        rng.below(1000),
        rng.below(10_000)
    )
}

/// Makes one sample of `task` whose input plus answer fits in `length` tokens (as counted by
/// `count`), the fact at `depth` (random when `None`), from `seed`.
pub fn sample(
    task: Task,
    length: usize,
    depth: Option<f64>,
    seed: u64,
    count: &mut Counter<'_>,
) -> Result<Sample> {
    if let Some(d) = depth {
        if !(0.0..=1.0).contains(&d) {
            return Err(EvalError::Params(format!("depth {d} is outside [0, 1]")));
        }
    }
    // Different tasks draw different streams from the same seed.
    let mut rng = SplitMix64::new(seed ^ (task as u64).wrapping_mul(0x9E37_79B9));
    let depth = depth.unwrap_or_else(|| rng.unit());
    let (parts, answer, prefix, max_new) = match task {
        Task::Passkey => {
            let key = rng.range(10_000, 99_999);
            (
                Parts {
                    head: "There is an important piece of information hidden inside a lot of \
                           irrelevant text. Find it and memorize it. I will quiz you about the \
                           important information there.\n\n"
                        .into(),
                    units: units(task, &mut rng, length),
                    needle: format!("The pass key is {key}. Remember it. {key} is the pass key. "),
                    tail: "\n\nWhat is the pass key?".into(),
                },
                key.to_string(),
                "The pass key is".to_string(),
                12,
            )
        }
        Task::Niah => {
            let key = format!(
                "{}-{}",
                ADJECTIVES[rng.below(ADJECTIVES.len() as u64) as usize],
                NOUNS[rng.below(NOUNS.len() as u64) as usize]
            );
            let value = rng.range(1_000_000, 9_999_999);
            (
                Parts {
                    head: "Some special magic numbers are hidden within the following text. \
                           Make sure to memorize it. I will quiz you about the numbers \
                           afterwards.\n\n"
                        .into(),
                    units: units(task, &mut rng, length),
                    needle: format!(" One of the special magic numbers for {key} is: {value}. "),
                    tail: format!(
                        "\n\nWhat is the special magic number for {key} mentioned in the \
                         provided text?"
                    ),
                },
                value.to_string(),
                format!("The special magic number for {key} mentioned in the provided text is"),
                16,
            )
        }
        Task::Phonebook => {
            let mut hay = units(task, &mut rng, length);
            // The entry asked for is removed from the haystack and becomes the needle, so it
            // sits exactly at the depth and is unique.
            let pick = rng.below(hay.len().min(64) as u64) as usize;
            let entry = hay.remove(pick);
            let (name, number) = entry
                .trim_end()
                .split_once(": ")
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .unwrap_or_default();
            (
                Parts {
                    head: "Below is a phonebook. Each line gives a name and that person's phone \
                           number.\n\n"
                        .into(),
                    units: hay,
                    needle: entry,
                    tail: format!("\nWhat is the phone number of {name}?"),
                },
                number,
                format!("The phone number of {name} is"),
                16,
            )
        }
    };
    let budget = length.checked_sub(max_new).ok_or_else(|| {
        EvalError::Params(format!(
            "length {length} is shorter than the answer ({max_new})"
        ))
    })?;
    let (prompt, tokens) =
        fit(&parts, depth, budget, &mut |t: &str| count(t, &prefix)).map_err(|e| match e {
            EvalError::Params(m) => EvalError::Params(format!(
                "length {length} (the prompt and a {max_new}-token answer): {m}"
            )),
            e => e,
        })?;
    tracing::debug!(task = task.name(), length, tokens, depth, "sample fitted");
    Ok(Sample {
        task: task.name().into(),
        id: format!("{}-L{length}-d{depth:.3}-s{seed}", task.name()),
        prompt,
        answer_prefix: prefix,
        answers: vec![answer],
        all_classes: Vec::new(),
        metric: Metric::Contains,
        max_new_tokens: max_new,
        length,
        depth: Some(depth),
        chat: None,
    })
}

/// Samples of `task` for every length and depth, `per_cell` seeds each (seed, seed+1, …; the
/// same seeds in every cell). With no depths, each sample draws its own.
pub fn samples(
    task: Task,
    lengths: &[usize],
    depths: &[f64],
    per_cell: usize,
    seed: u64,
    count: &mut Counter<'_>,
) -> Result<Vec<Sample>> {
    let depths: Vec<Option<f64>> = if depths.is_empty() {
        vec![None]
    } else {
        depths.iter().copied().map(Some).collect()
    };
    let mut out = Vec::new();
    for &l in lengths {
        for &d in &depths {
            for i in 0..per_cell as u64 {
                out.push(sample(task, l, d, seed + i, count)?);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in tokenizer: one token per whitespace-separated word.
    fn words(s: &str, prefix: &str) -> Result<usize> {
        Ok(s.split_whitespace().count() + prefix.split_whitespace().count())
    }

    #[test]
    fn samples_fill_the_length_without_exceeding_it() {
        for task in [Task::Passkey, Task::Niah, Task::Phonebook] {
            for len in [300, 1000, 4000] {
                let s = sample(task, len, Some(0.5), 3, &mut words).unwrap();
                let n = words(&s.prompt, &s.answer_prefix).unwrap() + s.max_new_tokens;
                assert!(n <= len, "{task:?} {len}: {n}");
                assert!(n + 40 >= len, "{task:?} {len}: only {n}");
                assert!(
                    s.prompt.contains(&s.answers[0]),
                    "{task:?}: answer not in prompt"
                );
                assert_eq!(
                    s.prompt.matches(&s.answers[0]).count(),
                    match task {
                        Task::Passkey => 2, // "The pass key is K. Remember it. K is the pass key."
                        _ => 1,
                    }
                );
            }
        }
    }

    #[test]
    fn depth_places_the_needle() {
        for task in [Task::Passkey, Task::Niah, Task::Phonebook] {
            let mut last = 0.0;
            for d in [0.0, 0.25, 0.5, 0.75, 1.0] {
                let s = sample(task, 2000, Some(d), 9, &mut words).unwrap();
                let at = s.prompt.find(&s.answers[0]).unwrap() as f64 / s.prompt.len() as f64;
                assert!(
                    (at - d).abs() < 0.08,
                    "{task:?} depth {d}: needle at {at:.3}"
                );
                assert!(at >= last, "{task:?}: depth not monotone");
                last = at;
            }
        }
    }

    #[test]
    fn seeds_reproduce_and_differ() {
        let a = sample(Task::Niah, 800, None, 5, &mut words).unwrap();
        let b = sample(Task::Niah, 800, None, 5, &mut words).unwrap();
        let c = sample(Task::Niah, 800, None, 6, &mut words).unwrap();
        assert_eq!(a, b);
        assert_ne!(a.prompt, c.prompt);
        assert_ne!(a.answers, c.answers);
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert!(sample(Task::Passkey, 10, Some(0.5), 0, &mut words).is_err());
        assert!(sample(Task::Passkey, 1000, Some(1.5), 0, &mut words).is_err());
        assert!(Task::parse("needle").is_err());
    }

    #[test]
    fn phonebook_names_are_unique() {
        let s = sample(Task::Phonebook, 6000, Some(0.3), 1, &mut words).unwrap();
        let names: Vec<&str> = s
            .prompt
            .lines()
            .filter_map(|l| l.split_once(": ").map(|x| x.0))
            .collect();
        let mut set = names.clone();
        set.sort();
        set.dedup();
        assert_eq!(set.len(), names.len());
        assert!(names.len() > 500);
    }
}
