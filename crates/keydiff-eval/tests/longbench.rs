//! LongBench loader, templates and metrics against hand-written fixtures and against values
//! computed with the real Python implementations.
//!
//! Reference values marked "Python:" were produced with Python 3.11 in a venv holding
//! `rouge==1.0.1` and `fuzzywuzzy==0.18.0` (without `python-Levenshtein`, so fuzzywuzzy uses
//! `difflib.SequenceMatcher`, as in LongBench's environment), by calling the English functions
//! of LongBench v1's `LongBench/metrics.py` (copied verbatim) and `eval.py`'s `scorer`, and
//! printing `repr(float(score))`. Prompts marked "Python:" are
//! `dataset2prompt[task].format(**record)` on the fixture's first record.

use std::path::{Path, PathBuf};

use keydiff_eval::longbench::{self, ENGLISH_TASKS, TASKS};
use keydiff_eval::metrics::{
    classification_score, code_sim_score, count_score, fuzz_ratio, normalize_answer, qa_f1_score,
    retrieval_score, rouge_l, rouge_score,
};
use keydiff_eval::{EvalError, Metric};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/longbench")
}

fn strings(xs: &[&str]) -> Vec<String> {
    xs.iter().map(|s| s.to_string()).collect()
}

/// Scores computed from different but equivalent float expressions may differ in the last
/// bits; everything here is compared to 1e-12.
fn close(got: f64, want: f64) -> bool {
    (got - want).abs() < 1e-12
}

macro_rules! assert_close {
    ($got:expr, $want:expr, $($ctx:tt)*) => {{
        let (g, w): (f64, f64) = ($got, $want);
        assert!(close(g, w), "got {g:?}, want {w:?}: {}", format!($($ctx)*));
    }};
}

// ---------------------------------------------------------------------------------------------
// Task table
// ---------------------------------------------------------------------------------------------

#[test]
fn task_table_matches_longbench_config() {
    let names: Vec<&str> = TASKS.iter().map(|t| t.name).collect();
    assert_eq!(names, ENGLISH_TASKS);
    // config/dataset2maxlen.json, eval.py dataset2metric, pred.py's no-chat list.
    let want: &[(&str, usize, Metric, bool)] = &[
        ("narrativeqa", 128, Metric::QaF1, true),
        ("qasper", 128, Metric::QaF1, true),
        ("multifieldqa_en", 64, Metric::QaF1, true),
        ("hotpotqa", 32, Metric::QaF1, true),
        ("2wikimqa", 32, Metric::QaF1, true),
        ("musique", 32, Metric::QaF1, true),
        ("gov_report", 512, Metric::RougeL, true),
        ("qmsum", 512, Metric::RougeL, true),
        ("multi_news", 512, Metric::RougeL, true),
        ("trec", 64, Metric::Classification, false),
        ("triviaqa", 32, Metric::QaF1, false),
        ("samsum", 128, Metric::RougeL, false),
        ("passage_count", 32, Metric::Count, true),
        ("passage_retrieval_en", 32, Metric::Retrieval, true),
        ("lcc", 64, Metric::CodeSim, false),
        ("repobench-p", 64, Metric::CodeSim, false),
    ];
    for (t, &(name, max, metric, chat)) in TASKS.iter().zip(want) {
        assert_eq!(t.name, name);
        assert_eq!(t.max_new_tokens, max, "{name}");
        assert_eq!(t.metric, metric, "{name}");
        assert_eq!(t.chat, chat, "{name}");
    }
    assert_eq!(TASKS.len(), want.len());
}

#[test]
fn templates_only_use_context_and_input() {
    for t in TASKS {
        assert!(t.prompt.contains("{context}"), "{}", t.name);
        let stripped = t.prompt.replace("{context}", "").replace("{input}", "");
        assert!(
            !stripped.contains('{') && !stripped.contains('}'),
            "{} has another field",
            t.name
        );
    }
    // Spot checks of template details that are easy to get wrong.
    let get = |n: &str| longbench::spec(n).unwrap().prompt;
    assert!(get("narrativeqa").contains("Answer the question asconcisely as you can"));
    assert!(get("passage_count").ends_with("The final answer is: "));
    assert!(get("passage_retrieval_en").ends_with("The answer is: "));
    assert!(get("lcc").ends_with("Next line of code:\n"));
    assert!(get("triviaqa").ends_with("{context}\n\n{input}"));
    assert!(get("trec").ends_with("{context}\n{input}"));
    assert_eq!(get("2wikimqa"), get("hotpotqa"));
    assert_eq!(get("musique"), get("hotpotqa"));
    assert!(longbench::spec("longbench/qasper").is_some());
    assert!(longbench::spec("lsht").is_none());
}

// ---------------------------------------------------------------------------------------------
// Loader
// ---------------------------------------------------------------------------------------------

#[test]
fn loads_hotpotqa_with_the_official_prompt() {
    let s = longbench::load(&fixtures(), "hotpotqa", None).unwrap();
    assert_eq!(s.len(), 3);
    let first = &s[0];
    assert_eq!(first.task, "longbench/hotpotqa");
    assert_eq!(first.id, "hq-001");
    // Python: dataset2prompt["hotpotqa"].format(**record).
    assert_eq!(
        first.prompt,
        "Answer the question based on the given passages. Only give me the answer and do not \
output any other words.\n\nThe following are given passages.\nPassage 1:\nOdile Varn\nOdile \
Varn was a glassblower born in Merrow Ford in 1841.\n\nPassage 2:\nMerrow Ford\nMerrow Ford \
is a market town on the banks of the River Tessel.\n\nAnswer the question based on the given \
passages. Only give me the answer and do not output any other words.\n\nQuestion: Which river \
runs past the town where the glassblower Odile Varn was born?\nAnswer:"
    );
    assert_eq!(first.answer_prefix, "");
    assert_eq!(first.answers, strings(&["River Tessel"]));
    assert!(first.all_classes.is_empty());
    assert_eq!(first.metric, Metric::QaF1);
    assert_eq!(first.max_new_tokens, 32);
    assert_eq!(first.length, 38);
    assert_eq!(first.depth, None);
    assert_eq!(first.chat, None);
    // Braces inside the context are text, not fields (Python's format does not re-parse).
    assert!(s[1].prompt.contains("built over a {braced} old road."));
    assert_eq!(s[2].answers, strings(&["Ines Calloway", "Calloway"]));
}

#[test]
fn limit_takes_the_first_records() {
    let s = longbench::load(&fixtures(), "hotpotqa", Some(2)).unwrap();
    assert_eq!(
        s.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        ["hq-001", "hq-002"]
    );
    assert!(longbench::load(&fixtures(), "hotpotqa", Some(0))
        .unwrap()
        .is_empty());
    assert_eq!(
        longbench::load(&fixtures(), "longbench/hotpotqa", Some(10))
            .unwrap()
            .len(),
        3
    );
}

#[test]
fn loads_gov_report() {
    let s = longbench::load(&fixtures(), "gov_report", None).unwrap();
    assert_eq!(s.len(), 2);
    // Python: dataset2prompt["gov_report"].format(**record).
    assert_eq!(
        s[0].prompt,
        "You are given a report by a government agency. Write a one-page summary of the \
report.\n\nReport:\nThe Office of Road Upkeep reviewed bridge inspections in four districts. \
Inspectors found that 12 percent of bridges had overdue checks. The office recommends a shared \
schedule and yearly audits.\n\nNow, write a one-page summary of the report.\n\nSummary:"
    );
    assert_eq!(s[0].metric, Metric::RougeL);
    assert_eq!(s[0].max_new_tokens, 512);
    assert_eq!(s[0].chat, None);
    assert_eq!(s[1].length, 26);
}

#[test]
fn loads_trec_without_chat_and_with_classes() {
    let s = longbench::load(&fixtures(), "trec", None).unwrap();
    assert_eq!(s.len(), 2);
    // Python: dataset2prompt["trec"].format(**record).
    assert_eq!(
        s[0].prompt,
        "Please determine the type of the question below. Here are some examples of \
questions.\n\nQuestion: When did the lighthouse at Carrow Point first shine?\nType: \
Date\nQuestion: What does the acronym ORU stand for?\nType: Abbreviation\nQuestion: What shade \
is a ripe plum?\nType:"
    );
    assert_eq!(s[0].chat, Some(false));
    assert_eq!(s[0].metric, Metric::Classification);
    assert_eq!(s[0].max_new_tokens, 64);
    assert_eq!(s[0].all_classes.len(), 10);
    assert_eq!(s[0].all_classes[4], "Description of a person");
    assert_eq!(s[1].answers, strings(&["Animal"]));
}

#[test]
fn loads_passage_count_and_retrieval() {
    let c = longbench::load(&fixtures(), "passage_count", None).unwrap();
    // Python: dataset2prompt["passage_count"].format(**record).
    assert_eq!(
        c[0].prompt,
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. \
Please carefully read these paragraphs and determine how many unique paragraphs there are after \
removing duplicates. In other words, how many non-repeating paragraphs are there in \
total?\n\nParagraph 1: The Tessel floods each spring.\n\nParagraph 2: Harwick has a clock \
tower.\n\nParagraph 3: The Tessel floods each spring.\n\nPlease enter the final count of unique \
paragraphs after removing duplicates. The output format should only contain the number, such \
as 1, 2, 3, and so on.\n\nThe final answer is: "
    );
    assert_eq!(
        (c[0].metric, c[0].max_new_tokens, c[0].chat),
        (Metric::Count, 32, None)
    );
    assert_eq!(c[1].answers, strings(&["3"]));

    let r = longbench::load(&fixtures(), "passage_retrieval_en", None).unwrap();
    // Python: dataset2prompt["passage_retrieval_en"].format(**record).
    assert_eq!(
        r[0].prompt,
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which \
paragraph the abstract is from.\n\nParagraph 1: Harwick's clock tower was rebuilt \
twice.\n\nParagraph 2: Merrow Ford began as a crossing on the Tessel, whose spring floods \
shaped the market town.\n\nParagraph 3: Glass from the region was traded by canal.\n\nThe \
following is an abstract.\n\nA town grew around a ford on a flooding river.\n\nPlease enter \
the number of the paragraph that the abstract is from. The answer format must be like \
\"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: "
    );
    assert_eq!(
        (r[0].metric, r[0].max_new_tokens, r[0].chat),
        (Metric::Retrieval, 32, None)
    );
    // Scoring the fixture answers end to end.
    assert_eq!(r[0].metric.best("Paragraph 2", &r[0].answers, &[]), 1.0);
    assert_eq!(r[1].metric.best("Paragraph 2", &r[1].answers, &[]), 0.0);
}

#[test]
fn loads_lcc() {
    let s = longbench::load(&fixtures(), "lcc", None).unwrap();
    // Python: dataset2prompt["lcc"].format(**record).
    assert_eq!(
        s[0].prompt,
        "Please complete the code given below. \ndef area(width, height):\n    \"\"\"Area of a \
rectangle.\"\"\"\n    return width * height\n\ndef perimeter(width, height):\nNext line of \
code:\n"
    );
    assert_eq!(
        (s[0].metric, s[0].max_new_tokens, s[0].chat),
        (Metric::CodeSim, 64, Some(false))
    );
    assert_eq!(s[1].answers, strings(&["    println!(\"{}\", total);"]));
    let pred = "    return 2 * (width + height)\n\ndef diagonal(w, h):";
    assert_eq!(s[0].metric.best(pred, &s[0].answers, &[]), 1.0);
}

#[test]
fn malformed_line_names_file_and_line() {
    let dir = fixtures().join("malformed");
    let err = longbench::load(&dir, "hotpotqa", None).unwrap_err();
    let EvalError::Data { path, msg } = &err else {
        panic!("expected a data error, got {err:?}");
    };
    assert!(path.ends_with("malformed/hotpotqa.jsonl"), "{path}");
    assert!(msg.starts_with("line 2: malformed JSON"), "{msg}");
    let shown = err.to_string();
    assert!(
        shown.contains("hotpotqa.jsonl") && shown.contains("line 2"),
        "{shown}"
    );
    // The records before the bad line are fine.
    assert_eq!(longbench::load(&dir, "hotpotqa", Some(1)).unwrap().len(), 1);
}

#[test]
fn missing_field_names_field_and_line() {
    let dir = fixtures().join("missing_field");
    let err = longbench::load(&dir, "gov_report", None).unwrap_err();
    let EvalError::Data { path, msg } = &err else {
        panic!("expected a data error, got {err:?}");
    };
    assert!(path.ends_with("missing_field/gov_report.jsonl"), "{path}");
    // Line 2 is blank and skipped; line 3 lacks `answers`.
    assert_eq!(msg, "line 3: missing field `answers`");
}

#[test]
fn missing_file_is_a_data_error() {
    let err = longbench::load(&fixtures(), "qasper", None).unwrap_err();
    let EvalError::Data { path, msg } = &err else {
        panic!("expected a data error, got {err:?}");
    };
    assert!(path.ends_with("qasper.jsonl"), "{path}");
    assert!(msg.starts_with("cannot open"), "{msg}");
}

#[test]
fn unknown_task_lists_known_tasks() {
    for task in ["hotpot", "lsht", "longbench/nope"] {
        let err = longbench::load(&fixtures(), task, None).unwrap_err();
        let EvalError::Params(msg) = &err else {
            panic!("expected a params error, got {err:?}");
        };
        assert!(msg.contains(&format!("`{task}`")), "{msg}");
        for known in ENGLISH_TASKS {
            assert!(msg.contains(known), "{known} missing from: {msg}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Truncation, post-processing, aggregation
// ---------------------------------------------------------------------------------------------

#[test]
fn truncate_middle_keeps_both_ends() {
    let ids: Vec<u32> = (0..10).collect();
    assert_eq!(longbench::truncate_middle(&ids, 10), ids);
    assert_eq!(longbench::truncate_middle(&ids, 20), ids);
    assert_eq!(longbench::truncate_middle(&ids, 6), [0, 1, 2, 7, 8, 9]);
    // half = int(7/2) = 3: an odd budget keeps max - 1 tokens.
    assert_eq!(longbench::truncate_middle(&ids, 7), [0, 1, 2, 7, 8, 9]);
    assert_eq!(longbench::truncate_middle(&ids, 2), [0, 9]);
    assert!(longbench::truncate_middle(&ids, 1).is_empty());
    assert!(longbench::truncate_middle(&[], 0).is_empty());
}

#[test]
fn postprocess_cuts_first_line_for_few_shot_tasks() {
    for task in ["trec", "triviaqa", "samsum", "lsht", "longbench/trec"] {
        assert_eq!(
            longbench::postprocess(task, "\n\nColor\nQuestion: x"),
            "Color"
        );
        assert_eq!(longbench::postprocess(task, " Color \nx"), " Color ");
        assert_eq!(longbench::postprocess(task, ""), "");
        // lstrip('\n') strips newlines only, so a leading blank line with a space is kept.
        assert_eq!(longbench::postprocess(task, " \nColor"), " ");
    }
    for task in ["hotpotqa", "gov_report", "lcc", "longbench/lcc"] {
        assert_eq!(longbench::postprocess(task, "\nA\nB"), "\nA\nB");
    }
}

#[test]
fn task_score_rounds_like_longbench() {
    // Hand-computed.
    assert_eq!(
        longbench::task_score("hotpotqa", &[1.0, 0.5, 0.0]).unwrap(),
        50.0
    );
    assert_eq!(
        longbench::task_score("trec", &[1.0, 0.0, 0.0]).unwrap(),
        33.33
    );
    assert_eq!(
        longbench::task_score("longbench/lcc", &[2.0 / 3.0]).unwrap(),
        66.67
    );
    // Python: round(100 * total / n, 2) is round-half-even on the exact binary value:
    // round(0.125, 2) == 0.12 and round(0.375, 2) == 0.38.
    assert_eq!(longbench::task_score("lcc", &[0.00125]).unwrap(), 0.12);
    assert_eq!(longbench::task_score("lcc", &[0.00375]).unwrap(), 0.38);
    assert!(matches!(
        longbench::task_score("lcc", &[]),
        Err(EvalError::Params(_))
    ));
    assert!(matches!(
        longbench::task_score("nope", &[1.0]),
        Err(EvalError::Params(_))
    ));
}

/// `eval.py`'s `scorer` end to end: post-process, best over answers, aggregate.
fn scorer(task: &str, predictions: &[&str], answers: &[&[&str]], classes: &[String]) -> f64 {
    let metric = longbench::spec(task).unwrap().metric;
    let best: Vec<f64> = predictions
        .iter()
        .zip(answers)
        .map(|(p, a)| metric.best(&longbench::postprocess(task, p), &strings(a), classes))
        .collect();
    longbench::task_score(task, &best).unwrap()
}

#[test]
fn scorer_matches_python() {
    let trec = trec_classes();
    // Python: scorer(dataset, predictions, answers, all_classes).
    assert_eq!(
        scorer(
            "hotpotqa",
            &["River Tessel", "the Tessel", "no idea"],
            &[&["River Tessel"], &["River Tessel"], &["River Tessel"]],
            &[]
        ),
        55.56
    );
    assert_eq!(
        scorer(
            "trec",
            &["\nColor\nAnimal", "Animal"],
            &[&["Color"], &["Color"]],
            &trec
        ),
        50.0
    );
    assert_eq!(
        scorer(
            "passage_count",
            &["2", "3", "3"],
            &[&["2"], &["2"], &["3"]],
            &[]
        ),
        66.67
    );
}

// ---------------------------------------------------------------------------------------------
// Metrics: hand-computed cases
// ---------------------------------------------------------------------------------------------

fn trec_classes() -> Vec<String> {
    strings(&[
        "Abbreviation",
        "Animal",
        "Color",
        "Date",
        "Description of a person",
        "Individual",
        "Manner of an action",
        "City",
        "Country",
        "Definition of something",
    ])
}

#[test]
fn qa_f1_hand_computed() {
    assert_eq!(normalize_answer("  The  River, Tessel!  "), "river tessel");
    assert_eq!(normalize_answer("A man, a plan"), "man plan");
    // pred {tessel, river}, truth {river, tessel}: P = R = 1.
    assert_eq!(qa_f1_score("the Tessel River", "River Tessel"), 1.0);
    // pred [river, tessel, flows, north], truth [river, tessel]: P = 1/2, R = 1, F = 2/3.
    assert_close!(
        qa_f1_score("River Tessel flows north", "River Tessel"),
        2.0 / 3.0,
        "partial"
    );
    assert_eq!(qa_f1_score("nothing shared", "River Tessel"), 0.0);
    assert_eq!(qa_f1_score("the", "a"), 0.0);
    // Best over answers.
    let answers = strings(&["Ines Calloway", "Calloway"]);
    assert_eq!(Metric::QaF1.best("Calloway", &answers, &[]), 1.0);
    assert_eq!(Metric::QaF1.best("x", &[], &[]), 0.0);
}

#[test]
fn rouge_hand_computed() {
    // One sentence each; words hyp {a, b, c, d}, ref {a, c, d, e}; LCS a c d = 3.
    // P = 3/4, R = 3/4, F = 2 * (9/16) / (3/2 + 1e-8).
    let want = 2.0 * ((0.75 * 0.75) / (0.75 + 0.75 + 1e-8));
    assert_close!(rouge_score("a b c d", "a c d e"), want, "simple");
    // Identical text: F = 2 / (2 + 1e-8), just under 1.
    assert_close!(rouge_score("x y. z", "x y. z"), 2.0 / (2.0 + 1e-8), "same");
    // Nothing to split into sentences: the package raises, LongBench returns 0.
    assert_eq!(rouge_l("", "a"), None);
    assert_eq!(rouge_l("..", "a"), None);
    assert_eq!(rouge_score("a", "."), 0.0);
    // A whitespace-only piece between dots is an empty sentence, i.e. the word "".
    assert!(rouge_l(" . a", "a").is_some());
}

#[test]
fn classification_hand_computed() {
    let trec = trec_classes();
    assert_eq!(classification_score("Color", "Color", &trec), 1.0);
    assert_eq!(classification_score("Type: Animal", "Color", &trec), 0.0);
    // Two classes named, one right: 1/2.
    assert_eq!(classification_score("Color or Date", "Color", &trec), 0.5);
    // "Description" is dropped as a strict substring of the truth.
    let classes = strings(&["Description", "Description of a person", "Date"]);
    assert_eq!(
        classification_score(
            "Description of a person",
            "Description of a person",
            &classes
        ),
        1.0
    );
}

#[test]
fn retrieval_and_count_hand_computed() {
    assert_eq!(retrieval_score("Paragraph 7", "Paragraph 7"), 1.0);
    assert_eq!(retrieval_score("Paragraph 7 or 8", "Paragraph 7"), 0.5);
    assert_eq!(retrieval_score("Paragraph 17", "Paragraph 7"), 0.0);
    assert_eq!(retrieval_score("no number", "Paragraph 7"), 0.0);
    // No `Paragraph N` in the truth (LongBench raises): 0.
    assert_eq!(retrieval_score("7", "7"), 0.0);
    assert_eq!(count_score("4", "4"), 1.0);
    assert_close!(count_score("4 of 1, 2, 4", "4"), 0.5, "count");
    assert_eq!(count_score("four", "4"), 0.0);
}

#[test]
fn code_sim_hand_computed() {
    assert_eq!(fuzz_ratio("same", "same"), 100);
    assert_eq!(fuzz_ratio("", "x"), 0);
    assert_eq!(fuzz_ratio("", ""), 100);
    // "abcd" vs "abce": M = 3, T = 8, 2*3/8 = 0.75.
    assert_eq!(fuzz_ratio("abcd", "abce"), 75);
    // The line after the fence/comment lines is the one compared.
    assert_eq!(code_sim_score("```\n# note\n// c\nx = 1\ny", "x = 1"), 1.0);
    // Nothing qualifies: "" against the truth.
    assert_eq!(code_sim_score("# a\n// b", "x = 1"), 0.0);
    assert_eq!(
        Metric::CodeSim.best("x = 1", &strings(&["y", "x = 1"]), &[]),
        1.0
    );
}

#[test]
fn contains_is_unchanged() {
    assert_eq!(Metric::Contains.score("the key is 123", "123", &[]), 1.0);
    assert_eq!(Metric::Contains.score("the key is 12", "123", &[]), 0.0);
    assert_eq!(Metric::Contains.score("anything", "", &[]), 0.0);
}

// ---------------------------------------------------------------------------------------------
// Metrics: reference values from the Python packages
// ---------------------------------------------------------------------------------------------

#[test]
fn qa_f1_matches_python() {
    // Python: qa_f1_score(prediction, ground_truth).
    let cases: &[(&str, &str, f64)] = &[
        ("The River Tessel.", "River Tessel", 1.0),
        ("It is the Tessel river, I think", "River Tessel", 0.5),
        ("an apple a day", "the apple", 0.6666666666666666),
        (
            "Ines Calloway and Ines Varn",
            "Ines Calloway",
            0.5714285714285715,
        ),
        ("", "River Tessel", 0.0),
        ("Ångström's law\u{2014}1841", "ångström's law 1841", 0.4),
        ("a_b the_c", "ab thec", 1.0),
        ("yes", "yes", 1.0),
        ("Yes, they are both in Harwick.", "yes", 0.2857142857142857),
    ];
    for &(p, g, want) in cases {
        assert_close!(qa_f1_score(p, g), want, "{p:?} vs {g:?}");
    }
}

const G1: &str = "The office found overdue bridge inspections in four districts. It recommends a \
shared schedule and yearly audits.";
const G2: &str = "Leaks mostly come from old joints. Replacing them first would halve losses.";

#[test]
fn rouge_matches_python() {
    // Python: rouge_score(prediction, ground_truth), i.e.
    // Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"] or 0.0.
    let cases: &[(&str, &str, f64)] = &[
        (
            "The office found that bridge checks were overdue in four districts. It suggests \
yearly audits and a shared schedule.",
            G1,
            0.6111111061265434,
        ),
        (
            "the cat the cat sat. on the mat",
            "the cat sat on the mat.",
            0.7999999950000002,
        ),
        (
            "Leaks come from joints. . Replace old joints first.   Losses would halve",
            G2,
            0.6956521689224953,
        ),
        ("", G2, 0.0),
        ("...", G2, 0.0),
        ("no dots here at all", G2, 0.0),
        (
            "Leaks\u{a0}mostly come\tfrom old joints.\nReplacing them first would halve losses.",
            G2,
            0.999999995,
        ),
        (
            "audits yearly and schedule shared a recommends it. districts four in inspections \
bridge overdue found office the.",
            G1,
            0.11764705382352963,
        ),
        (
            "The office. The office. The office.",
            G1,
            0.2105263139058172,
        ),
    ];
    for &(p, g, want) in cases {
        assert_close!(rouge_score(p, g), want, "{p:?} vs {g:?}");
    }
}

#[test]
fn classification_matches_python() {
    let trec = trec_classes();
    let quirk1 = strings(&[
        "Date",
        "Description",
        "Description of a person",
        "Individual",
    ]);
    // Python's remove-while-iterating skips "a": two classes stay, score 1/2.
    let quirk2 = strings(&["of", "a", "Description of a person", "person"]);
    // Duplicates: the second "person" slides into the slot already visited and stays.
    let quirk3 = strings(&["person", "person", "Description of a person"]);
    // Python: classification_score(prediction, ground_truth, all_classes=classes).
    let cases: &[(&str, &str, &[String], f64)] = &[
        ("Color", "Color", &trec, 1.0),
        ("Animal", "Color", &trec, 0.0),
        ("Color or Animal", "Color", &trec, 0.5),
        (
            "Description of a person",
            "Description of a person",
            &quirk1,
            1.0,
        ),
        (
            "Description of a person",
            "Description of a person",
            &quirk2,
            0.5,
        ),
        (
            "Description of a person",
            "Description of a person",
            &quirk3,
            0.5,
        ),
        ("Country", "City", &trec, 0.0),
        ("Type: Individual", "Individual", &trec, 1.0),
    ];
    for &(p, g, classes, want) in cases {
        assert_close!(classification_score(p, g, classes), want, "{p:?} vs {g:?}");
    }
}

#[test]
fn retrieval_and_count_match_python() {
    // Python: retrieval_score(prediction, ground_truth).
    let retrieval: &[(&str, &str, f64)] = &[
        ("Paragraph 2", "Paragraph 2", 1.0),
        ("Paragraph 2 or Paragraph 12", "Paragraph 2", 0.5),
        ("The answer is 02", "Paragraph 2", 0.0),
        ("none", "Paragraph 2", 0.0),
        // A fullwidth digit is a `\d` in Python: counted, and not equal to "2".
        ("Paragraph \u{ff12}", "Paragraph 2", 0.0),
        (
            "Paragraph 2, not paragraph 3 or 2",
            "Paragraph 2",
            0.6666666666666666,
        ),
    ];
    for &(p, g, want) in retrieval {
        assert_close!(retrieval_score(p, g), want, "{p:?} vs {g:?}");
    }
    // Python: count_score(prediction, ground_truth).
    let count: &[(&str, &str, f64)] = &[
        ("2", "2", 1.0),
        ("There are 2 unique paragraphs out of 3", "2", 0.5),
        ("22", "2", 0.0),
        ("", "2", 0.0),
        ("2, 2 and 2", "2", 1.0),
    ];
    for &(p, g, want) in count {
        assert_close!(count_score(p, g), want, "{p:?} vs {g:?}");
    }
}

/// 211 characters: difflib's autojunk applies (ground truth of 200+ characters).
const LONG: &str =
    "        result = compute_weighted_average(values=[x for x in samples if x is not \
None], weights=weight_table.get(key, default_weights), normalize=True, clip_min=0.0, \
clip_max=1.0, strict_mode=False, tag='alpha')";

#[test]
fn code_sim_matches_python() {
    assert_eq!(LONG.chars().count(), 211);
    let l1 = "    return 2 * (width + height)";
    let l2 = "    println!(\"{}\", total);";
    let long_pred =
        "        result = compute_weighted_mean(values=[v for v in samples if v is not \
None], weights=weights.get(key, default_weights), normalize=False, clip_min=0.0, clip_max=10.0)";
    let long_padded = format!("  {LONG} ");
    // Python: code_sim_score(prediction, ground_truth).
    let cases: &[(&str, &str, f64)] = &[
        ("    return 2 * (width + height)\n", l1, 1.0),
        ("```python\n    return 2*(width+height)\n```", l1, 0.93),
        ("# compute\nreturn width + height", l1, 0.81),
        ("\n\n  // c\n    println!(\"{}\", sum);", l2, 0.84),
        // The empty line qualifies as the "first code line".
        ("x = 1 # c\n\ny = 2", "y = 2", 0.0),
        ("`a`\n#b\n//c", l1, 0.0),
        (long_pred, LONG, 0.83),
        (&long_padded, LONG, 0.99),
        ("größe = maß * 2", "größe = mass * 2", 0.9),
    ];
    for &(p, g, want) in cases {
        assert_close!(code_sim_score(p, g), want, "{p:?} vs {g:?}");
    }
}

#[test]
fn fuzz_ratio_matches_python() {
    // Python: fuzz.ratio(a, b) with difflib.
    let cases: &[(&str, &str, u32)] = &[
        // 2*1/16 = 12.5, rounded half to even.
        ("abcdefgh", "hijklmno", 12),
        // 2*3/16 = 37.5.
        ("abcdefgh", "abcxyzuv", 38),
        ("abc", "abd", 67),
        ("", "", 100),
        ("", "a", 0),
        ("kitten", "sitting", 62),
        // autojunk changes this one: 69 with it, 73 without.
        (
            "result=compute_weighted_average(values=[x for x in samples],weights=weight_table.\
get(key,default_weights),normalize=True)",
            LONG,
            69,
        ),
    ];
    for &(a, b, want) in cases {
        assert_eq!(fuzz_ratio(a, b), want, "{a:?} vs {b:?}");
    }
}

/// pred.py ends samsum's generation at the newline token (with at least one token first);
/// no other task.
#[test]
fn only_samsum_stops_at_the_newline() {
    for t in longbench::ENGLISH_TASKS {
        assert_eq!(longbench::stops_at_newline(t), *t == "samsum", "{t}");
    }
}
