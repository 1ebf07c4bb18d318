//! Scoring a prediction against a reference answer.
//!
//! Apart from [`Metric::Contains`], every metric mirrors one function of LongBench v1's
//! `LongBench/metrics.py` (THUDM/LongBench), including its quirks, so that scores computed
//! here are the numbers LongBench's `eval.py` would print for the same predictions. The
//! Python building blocks those functions lean on are reproduced too:
//!
//! * Python's `str.split()` whitespace and `re`'s Unicode `\w` / `\d` classes;
//! * the PyPI `rouge` package (1.0.1) for ROUGE-L: its sentence splitting on `.`, its
//!   set-based "summary level" union-LCS and its F formula with the `1e-8` term;
//! * `fuzzywuzzy.fuzz.ratio` (0.18.0) on top of `difflib.SequenceMatcher`, which is what
//!   fuzzywuzzy falls back to when `python-Levenshtein` is not installed. LongBench's
//!   `requirements.txt` lists `fuzzywuzzy` without `python-Levenshtein`, so its reference
//!   environment used difflib. (With `python-Levenshtein`, `fuzz.ratio` uses an edit-distance
//!   ratio that can differ by a few points.)
//!
//! Only the English metrics exist: `qa_f1_zh_score`, `rouge_zh_score` and
//! `retrieval_zh_score` need the `jieba` segmenter and are not implemented.
//!
//! Per-task post-processing of the prediction (first line only for trec, triviaqa, samsum and
//! lsht) is not a metric: see [`crate::longbench::postprocess`].

use std::collections::{HashMap, HashSet};

/// How a prediction is scored. Every score is in [0, 1].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// 1 when the reference appears in the prediction (synthetic retrieval tasks).
    Contains,
    /// LongBench `qa_f1_score`: token F1 after SQuAD normalisation. See [`qa_f1_score`].
    QaF1,
    /// LongBench `rouge_score`: ROUGE-L F of the `rouge` package. See [`rouge_score`].
    RougeL,
    /// LongBench `classification_score`. See [`classification_score`].
    Classification,
    /// LongBench `retrieval_score` (passage_retrieval_en). See [`retrieval_score`].
    Retrieval,
    /// LongBench `count_score` (passage_count). See [`count_score`].
    Count,
    /// LongBench `code_sim_score`: fuzz.ratio of the first code line. See [`code_sim_score`].
    CodeSim,
}

impl Metric {
    /// Score of `prediction` against one reference `answer`.
    pub fn score(&self, prediction: &str, answer: &str, all_classes: &[String]) -> f64 {
        match self {
            Metric::Contains => {
                f64::from(u8::from(!answer.is_empty() && prediction.contains(answer)))
            }
            Metric::QaF1 => qa_f1_score(prediction, answer),
            Metric::RougeL => rouge_score(prediction, answer),
            Metric::Classification => classification_score(prediction, answer, all_classes),
            Metric::Retrieval => retrieval_score(prediction, answer),
            Metric::Count => count_score(prediction, answer),
            Metric::CodeSim => code_sim_score(prediction, answer),
        }
    }

    /// The best score over all reference answers (0 when there are none), as LongBench's
    /// `scorer` does: `score = max(score, metric(prediction, ground_truth))` from 0.
    pub fn best(&self, prediction: &str, answers: &[String], all_classes: &[String]) -> f64 {
        answers
            .iter()
            .map(|a| self.score(prediction, a, all_classes))
            .fold(0.0, f64::max)
    }
}

// ---------------------------------------------------------------------------------------------
// Python character classes
// ---------------------------------------------------------------------------------------------

/// Python's `str.isspace()`, which `str.split()` splits on: Rust's Unicode `White_Space` plus
/// the four ASCII information separators U+001C..U+001F.
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.split()` without arguments: runs of whitespace separate, no empty pieces.
fn py_split(s: &str) -> impl Iterator<Item = &str> {
    s.split(py_isspace).filter(|t| !t.is_empty())
}

/// `re`'s Unicode `\w`: alphanumerics and the underscore. (Rust's `Alphabetic` also counts a
/// few combining marks that Python's `isalnum` does not; irrelevant for the articles removed.)
fn py_is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Unicode general category `Nd`, which `re`'s `\d` matches on `str` patterns (table from
/// Python 3.11's `unicodedata`, Unicode 14.0).
const ND_RANGES: &[(u32, u32)] = &[
    (0x30, 0x39),
    (0x660, 0x669),
    (0x6F0, 0x6F9),
    (0x7C0, 0x7C9),
    (0x966, 0x96F),
    (0x9E6, 0x9EF),
    (0xA66, 0xA6F),
    (0xAE6, 0xAEF),
    (0xB66, 0xB6F),
    (0xBE6, 0xBEF),
    (0xC66, 0xC6F),
    (0xCE6, 0xCEF),
    (0xD66, 0xD6F),
    (0xDE6, 0xDEF),
    (0xE50, 0xE59),
    (0xED0, 0xED9),
    (0xF20, 0xF29),
    (0x1040, 0x1049),
    (0x1090, 0x1099),
    (0x17E0, 0x17E9),
    (0x1810, 0x1819),
    (0x1946, 0x194F),
    (0x19D0, 0x19D9),
    (0x1A80, 0x1A89),
    (0x1A90, 0x1A99),
    (0x1B50, 0x1B59),
    (0x1BB0, 0x1BB9),
    (0x1C40, 0x1C49),
    (0x1C50, 0x1C59),
    (0xA620, 0xA629),
    (0xA8D0, 0xA8D9),
    (0xA900, 0xA909),
    (0xA9D0, 0xA9D9),
    (0xA9F0, 0xA9F9),
    (0xAA50, 0xAA59),
    (0xABF0, 0xABF9),
    (0xFF10, 0xFF19),
    (0x104A0, 0x104A9),
    (0x10D30, 0x10D39),
    (0x11066, 0x1106F),
    (0x110F0, 0x110F9),
    (0x11136, 0x1113F),
    (0x111D0, 0x111D9),
    (0x112F0, 0x112F9),
    (0x11450, 0x11459),
    (0x114D0, 0x114D9),
    (0x11650, 0x11659),
    (0x116C0, 0x116C9),
    (0x11730, 0x11739),
    (0x118E0, 0x118E9),
    (0x11950, 0x11959),
    (0x11C50, 0x11C59),
    (0x11D50, 0x11D59),
    (0x11DA0, 0x11DA9),
    (0x16A60, 0x16A69),
    (0x16AC0, 0x16AC9),
    (0x16B50, 0x16B59),
    (0x1D7CE, 0x1D7FF),
    (0x1E140, 0x1E149),
    (0x1E2F0, 0x1E2F9),
    (0x1E950, 0x1E959),
    (0x1FBF0, 0x1FBF9),
];

/// `re`'s `\d` on a `str` pattern.
fn py_is_digit(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    let u = u32::from(c);
    ND_RANGES.iter().any(|&(lo, hi)| (lo..=hi).contains(&u))
}

/// `re.findall(r"\d+", s)`: the maximal runs of decimal digits, left to right.
fn digit_runs(s: &str) -> Vec<&str> {
    let mut runs = Vec::new();
    let mut start = None;
    for (i, c) in s.char_indices() {
        match (py_is_digit(c), start) {
            (true, None) => start = Some(i),
            (false, Some(st)) => {
                runs.push(&s[st..i]);
                start = None;
            }
            _ => {}
        }
    }
    if let Some(st) = start {
        runs.push(&s[st..]);
    }
    runs
}

// ---------------------------------------------------------------------------------------------
// qa_f1_score
// ---------------------------------------------------------------------------------------------

/// LongBench `normalize_answer` (the SQuAD v1.1 evaluation script's): lower-case, drop ASCII
/// punctuation (`string.punctuation`), replace the words a/an/the by a space
/// (`re.sub(r"\b(a|an|the)\b", " ", text)`), and collapse whitespace
/// (`" ".join(text.split())`).
pub fn normalize_answer(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punc: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    // `\b(a|an|the)\b` matches exactly the maximal runs of word characters that equal one of
    // the three articles: both ends must sit on a word boundary and the articles are all word
    // characters.
    let mut no_articles = String::with_capacity(no_punc.len());
    let mut rest = no_punc.as_str();
    while let Some(c) = rest.chars().next() {
        let run_len = if py_is_word(c) {
            rest.find(|ch: char| !py_is_word(ch)).unwrap_or(rest.len())
        } else {
            rest.find(py_is_word).unwrap_or(rest.len())
        };
        let (piece, tail) = rest.split_at(run_len);
        if matches!(piece, "a" | "an" | "the") {
            no_articles.push(' ');
        } else {
            no_articles.push_str(piece);
        }
        rest = tail;
    }
    py_split(&no_articles).collect::<Vec<_>>().join(" ")
}

/// LongBench `f1_score` on token lists: `Counter(prediction) & Counter(ground_truth)`,
/// precision and recall over the list lengths, 0 when nothing is shared.
fn token_f1(prediction: &[&str], ground_truth: &[&str]) -> f64 {
    let mut gt_counts: HashMap<&str, usize> = HashMap::new();
    for t in ground_truth {
        *gt_counts.entry(t).or_default() += 1;
    }
    let mut pred_counts: HashMap<&str, usize> = HashMap::new();
    for t in prediction {
        *pred_counts.entry(t).or_default() += 1;
    }
    let num_same: usize = pred_counts
        .iter()
        .map(|(t, &n)| n.min(gt_counts.get(t).copied().unwrap_or(0)))
        .sum();
    if num_same == 0 {
        return 0.0;
    }
    let precision = num_same as f64 / prediction.len() as f64;
    let recall = num_same as f64 / ground_truth.len() as f64;
    (2.0 * precision * recall) / (precision + recall)
}

/// LongBench `qa_f1_score`: token-level F1 between the whitespace tokens of
/// [`normalize_answer`]`(prediction)` and `normalize_answer(ground_truth)`.
pub fn qa_f1_score(prediction: &str, ground_truth: &str) -> f64 {
    let p = normalize_answer(prediction);
    let g = normalize_answer(ground_truth);
    let pt: Vec<&str> = py_split(&p).collect();
    let gt: Vec<&str> = py_split(&g).collect();
    token_f1(&pt, &gt)
}

// ---------------------------------------------------------------------------------------------
// rouge_score
// ---------------------------------------------------------------------------------------------

/// How the `rouge` package's `Rouge.get_scores` prepares a text: split on `.`, keep the
/// non-empty pieces (before whitespace is normalised, so a whitespace-only piece stays, as an
/// empty sentence) and collapse each piece's whitespace.
fn rouge_sentences(text: &str) -> Vec<String> {
    text.split('.')
        .filter(|s| !s.is_empty())
        .map(|s| py_split(s).collect::<Vec<_>>().join(" "))
        .collect()
}

/// The words of a list of sentences as the `rouge` package sees them: each sentence split on
/// single spaces (`_split_into_words`), so an empty sentence is one empty word.
fn rouge_words(sentences: &[String]) -> impl Iterator<Item = &str> {
    sentences.iter().flat_map(|s| s.split(' '))
}

/// The words of the longest common subsequence of `x` (reference) and `y` (hypothesis),
/// reconstructed with the `rouge` package's `_recon_lcs` tie-breaking: on a match take it,
/// else move up when `table[i-1][j] > table[i][j-1]`, else left.
fn recon_lcs<'a>(x: &[&'a str], y: &[&str], out: &mut HashSet<&'a str>) {
    let (n, m) = (x.len(), y.len());
    let w = m + 1;
    let mut table = vec![0u32; (n + 1) * w];
    for i in 1..=n {
        for j in 1..=m {
            table[i * w + j] = if x[i - 1] == y[j - 1] {
                table[(i - 1) * w + j - 1] + 1
            } else {
                table[(i - 1) * w + j].max(table[i * w + j - 1])
            };
        }
    }
    let (mut i, mut j) = (n, m);
    while i > 0 && j > 0 {
        if x[i - 1] == y[j - 1] {
            out.insert(x[i - 1]);
            i -= 1;
            j -= 1;
        } else if table[(i - 1) * w + j] > table[i * w + j - 1] {
            i -= 1;
        } else {
            j -= 1;
        }
    }
}

/// ROUGE-L F exactly as `Rouge().get_scores([hyp], [ref], avg=True)["rouge-l"]["f"]` of the
/// PyPI `rouge` package 1.0.1 computes it (`rouge_l_summary_level` with `exclusive=True`):
///
/// * `m`, `n`: the number of *distinct* words of the reference and of the hypothesis;
/// * `llcs`: the number of distinct words in the union, over every (reference sentence,
///   hypothesis sentence) pair, of the words of their reconstructed LCS;
/// * `r = llcs/m`, `p = llcs/n`, `f = 2·(p·r)/(p + r + 1e-8)`.
///
/// `None` where the package raises (no sentence on either side, e.g. an empty or all-`.`
/// text); `get_scores` also computes ROUGE-1 and ROUGE-2, which raise in the same cases only.
pub fn rouge_l(hypothesis: &str, reference: &str) -> Option<f64> {
    let hyp = rouge_sentences(hypothesis);
    let refs = rouge_sentences(reference);
    if hyp.is_empty() || refs.is_empty() {
        return None;
    }
    let m = rouge_words(&refs).collect::<HashSet<_>>().len();
    let n = rouge_words(&hyp).collect::<HashSet<_>>().len();
    let hyp_words: Vec<Vec<&str>> = hyp.iter().map(|s| s.split(' ').collect()).collect();
    let mut union: HashSet<&str> = HashSet::new();
    for r in &refs {
        let ref_words: Vec<&str> = r.split(' ').collect();
        for h in &hyp_words {
            recon_lcs(&ref_words, h, &mut union);
        }
    }
    let llcs = union.len() as f64;
    let r_lcs = llcs / m as f64;
    let p_lcs = llcs / n as f64;
    Some(2.0 * ((p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8)))
}

/// LongBench `rouge_score`: [`rouge_l`] of the prediction against the ground truth, 0 when the
/// `rouge` package raises.
///
/// One difference remains: the package reconstructs the LCS recursively, so for a sentence
/// pair of roughly a thousand words together Python hits its recursion limit and LongBench's
/// bare `except` turns that into 0.0. This implementation has no such limit and scores those
/// (rare: one sentence is the text between two `.`) pairs normally.
pub fn rouge_score(prediction: &str, ground_truth: &str) -> f64 {
    rouge_l(prediction, ground_truth).unwrap_or(0.0)
}

// ---------------------------------------------------------------------------------------------
// classification_score
// ---------------------------------------------------------------------------------------------

/// LongBench `classification_score`, quirks included:
///
/// 1. `em_match_list` = the classes (in `all_classes` order, duplicates kept) that occur as a
///    substring of the prediction;
/// 2. every listed class that is a substring of the ground truth without being equal to it is
///    removed — with Python's `for x in list: list.remove(x)`, which removes the *first* equal
///    element and then skips the element that slid into the current slot;
/// 3. the score is `1/len(em_match_list)` when the ground truth is in the list, else 0.
pub fn classification_score(prediction: &str, ground_truth: &str, all_classes: &[String]) -> f64 {
    let mut em_match_list: Vec<&str> = all_classes
        .iter()
        .map(String::as_str)
        .filter(|c| prediction.contains(c))
        .collect();
    // Python's list iterator: an index that advances by one whatever happens to the list.
    let mut idx = 0;
    while idx < em_match_list.len() {
        let term = em_match_list[idx];
        if ground_truth.contains(term) && term != ground_truth {
            if let Some(pos) = em_match_list.iter().position(|&t| t == term) {
                em_match_list.remove(pos);
            }
        }
        idx += 1;
    }
    if em_match_list.contains(&ground_truth) {
        1.0 / em_match_list.len() as f64
    } else {
        0.0
    }
}

// ---------------------------------------------------------------------------------------------
// retrieval_score / count_score
// ---------------------------------------------------------------------------------------------

/// The first `re.findall(r"Paragraph (\d+)", s)` match's group.
pub(crate) fn paragraph_id(s: &str) -> Option<&str> {
    const KEY: &str = "Paragraph ";
    let mut from = 0;
    while let Some(off) = s[from..].find(KEY) {
        let digits_at = from + off + KEY.len();
        let rest = &s[digits_at..];
        let len = rest.find(|c: char| !py_is_digit(c)).unwrap_or(rest.len());
        if len > 0 {
            return Some(&rest[..len]);
        }
        from = from + off + 1;
    }
    None
}

/// The share of the numbers (`\d+` runs) in `prediction` that equal `target` (0 when the
/// prediction holds no number).
fn share_equal(prediction: &str, target: &str) -> f64 {
    let numbers = digit_runs(prediction);
    if numbers.is_empty() {
        return 0.0;
    }
    let right = numbers.iter().filter(|&&n| n == target).count();
    right as f64 / numbers.len() as f64
}

/// LongBench `retrieval_score` (passage_retrieval_en): the paragraph number is the first
/// `Paragraph (\d+)` of the ground truth; the score is the share of the numbers in the
/// prediction that are equal to it, as strings (so `07` does not match `7`).
///
/// Where the ground truth has no `Paragraph N`, LongBench raises `IndexError`; this returns 0.
pub fn retrieval_score(prediction: &str, ground_truth: &str) -> f64 {
    match paragraph_id(ground_truth) {
        Some(id) => share_equal(prediction, id),
        None => 0.0,
    }
}

/// LongBench `count_score` (passage_count): the share of the numbers (`\d+`) in the
/// prediction that equal the ground truth string.
pub fn count_score(prediction: &str, ground_truth: &str) -> f64 {
    share_equal(prediction, ground_truth)
}

// ---------------------------------------------------------------------------------------------
// code_sim_score
// ---------------------------------------------------------------------------------------------

/// The number of matched elements `difflib.SequenceMatcher(None, a, b)` finds (the sum of its
/// matching blocks' sizes), with difflib's defaults: no junk function, `autojunk=True` (when
/// `b` has 200 elements or more, elements occurring more than `len(b)//100 + 1` times are
/// "popular" and cannot start a match, though matches may extend over them).
fn sequence_matcher_matches(a: &[char], b: &[char]) -> usize {
    let mut b2j: HashMap<char, Vec<usize>> = HashMap::new();
    for (j, &c) in b.iter().enumerate() {
        b2j.entry(c).or_default().push(j);
    }
    if b.len() >= 200 {
        let ntest = b.len() / 100 + 1;
        b2j.retain(|_, idxs| idxs.len() <= ntest);
    }
    let mut total = 0;
    let mut queue = vec![(0, a.len(), 0, b.len())];
    while let Some((alo, ahi, blo, bhi)) = queue.pop() {
        let (i, j, k) = find_longest_match(a, b, &b2j, (alo, ahi), (blo, bhi));
        if k > 0 {
            total += k;
            if alo < i && blo < j {
                queue.push((alo, i, blo, j));
            }
            if i + k < ahi && j + k < bhi {
                queue.push((i + k, ahi, j + k, bhi));
            }
        }
    }
    total
}

/// `difflib.SequenceMatcher.find_longest_match` without junk: the longest matching block in
/// `a[alo..ahi]`, `b[blo..bhi]`, earliest in `a` then in `b` among the longest, then extended
/// over equal (popular) elements on both sides.
fn find_longest_match(
    a: &[char],
    b: &[char],
    b2j: &HashMap<char, Vec<usize>>,
    (alo, ahi): (usize, usize),
    (blo, bhi): (usize, usize),
) -> (usize, usize, usize) {
    let (mut besti, mut bestj, mut bestsize) = (alo, blo, 0);
    let mut j2len: HashMap<usize, usize> = HashMap::new();
    for (i, c) in a.iter().enumerate().take(ahi).skip(alo) {
        let mut newj2len = HashMap::new();
        if let Some(js) = b2j.get(c) {
            for &j in js {
                if j < blo {
                    continue;
                }
                if j >= bhi {
                    break;
                }
                let prev = if j == 0 {
                    0
                } else {
                    j2len.get(&(j - 1)).copied().unwrap_or(0)
                };
                let k = prev + 1;
                newj2len.insert(j, k);
                if k > bestsize {
                    besti = i + 1 - k;
                    bestj = j + 1 - k;
                    bestsize = k;
                }
            }
        }
        j2len = newj2len;
    }
    while besti > alo && bestj > blo && a[besti - 1] == b[bestj - 1] {
        besti -= 1;
        bestj -= 1;
        bestsize += 1;
    }
    while besti + bestsize < ahi
        && bestj + bestsize < bhi
        && a[besti + bestsize] == b[bestj + bestsize]
    {
        bestsize += 1;
    }
    (besti, bestj, bestsize)
}

/// `fuzzywuzzy.fuzz.ratio(s1, s2)` (0.18.0) without `python-Levenshtein`: 100 when the strings
/// are equal, 0 when either is empty, else `round(100 · SequenceMatcher(None, s1, s2).ratio())`
/// with Python's round-half-to-even; `ratio() = 2·M / (len(s1) + len(s2))` over code points.
pub fn fuzz_ratio(s1: &str, s2: &str) -> u32 {
    if s1 == s2 {
        return 100;
    }
    if s1.is_empty() || s2.is_empty() {
        return 0;
    }
    let a: Vec<char> = s1.chars().collect();
    let b: Vec<char> = s2.chars().collect();
    let matches = sequence_matcher_matches(&a, &b);
    let ratio = 2.0 * matches as f64 / (a.len() + b.len()) as f64;
    // In [0, 100]: the cast cannot truncate.
    (100.0 * ratio).round_ties_even() as u32
}

/// LongBench `code_sim_score`: after stripping leading `\n`s, the prediction's first line
/// (split on `\n`) that contains none of `` ` ``, `#` and `//` — an empty line qualifies — or
/// `""` when there is none; then `fuzz.ratio(line, ground_truth) / 100` ([`fuzz_ratio`]).
/// The prediction is not otherwise stripped, as in LongBench's `eval.py`.
pub fn code_sim_score(prediction: &str, ground_truth: &str) -> f64 {
    let line = prediction
        .trim_start_matches('\n')
        .split('\n')
        .find(|l| !l.contains('`') && !l.contains('#') && !l.contains("//"))
        .unwrap_or("");
    f64::from(fuzz_ratio(line, ground_truth)) / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digit_runs_are_maximal() {
        assert_eq!(digit_runs("a12b3 45"), vec!["12", "3", "45"]);
        assert_eq!(digit_runs("x"), Vec::<&str>::new());
        assert_eq!(digit_runs("７7"), vec!["７7"]);
    }

    #[test]
    fn paragraph_id_takes_first_match() {
        assert_eq!(paragraph_id("Paragraph 12"), Some("12"));
        assert_eq!(
            paragraph_id("Paragraph x, Paragraph 3 and Paragraph 4"),
            Some("3")
        );
        assert_eq!(paragraph_id("paragraph 3"), None);
    }

    #[test]
    fn articles_only_as_whole_words() {
        assert_eq!(normalize_answer("The Anthem of an Ant"), "anthem of ant");
        assert_eq!(normalize_answer("a-the;an"), "athean");
        assert_eq!(normalize_answer("a the\tan"), "");
    }
}
