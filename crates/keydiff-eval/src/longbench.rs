//! LongBench (v1, THUDM/LongBench) English tasks: prompt templates, generation lengths,
//! metrics, the JSONL loader, and the official truncation, post-processing and aggregation.
//!
//! How LongBench's `pred.py` / `eval.py` run a task, and where each step lives here:
//!
//! 1. `prompt = dataset2prompt[task].format(**record)` — [`load`] / [`format_prompt`], with
//!    the templates of `config/dataset2prompt.json` ([`TaskSpec::prompt`]);
//! 2. when the tokenized prompt is longer than the model's `max_length`, keep its first and
//!    last `max_length/2` tokens — [`truncate_middle`];
//! 3. wrap the prompt in the model's chat template, except for trec, triviaqa, samsum, lsht,
//!    lcc and repobench-p — [`TaskSpec::chat`], carried to [`crate::Sample::chat`];
//! 4. greedy decoding of at most `config/dataset2maxlen.json` tokens —
//!    [`TaskSpec::max_new_tokens`]. For samsum `pred.py` also stops at the newline token and
//!    sets `min_length = context_length + 1` (neither it nor the end of text as the first
//!    token) — [`stops_at_newline`], which the runner gives the engine as a stop token
//!    (`GenerateParams::stop_tokens`) with `min_tokens` 1;
//! 5. keep only the first line of the prediction for trec, triviaqa, samsum, lsht —
//!    [`postprocess`];
//! 6. score against every reference answer with the task's metric (`dataset2metric` in
//!    `eval.py`) and keep the best — [`crate::Metric::best`];
//! 7. report `round(100 * total / n, 2)` — [`task_score`].
//!
//! Templates and lengths are those of LongBench v1's final `config/dataset2prompt.json` and
//! `config/dataset2maxlen.json` (the copies that moved to `LongBench/config/` when v2 was
//! released), including the template typo "asconcisely" of narrativeqa and the trailing
//! space or newline some templates end with. The Chinese tasks (multifieldqa_zh, dureader,
//! vcsum, lsht, passage_retrieval_zh) are not supported: their metrics need `jieba`.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use crate::metrics::Metric;
use crate::{EvalError, Result, Sample};

/// One LongBench task: how to prompt, how long to generate, how to score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TaskSpec {
    /// LongBench dataset name (also the JSONL file stem).
    pub name: &'static str,
    /// `config/dataset2prompt.json`: a Python `str.format` template over the record's
    /// `{context}` and `{input}`.
    pub prompt: &'static str,
    /// `config/dataset2maxlen.json`.
    pub max_new_tokens: usize,
    /// `dataset2metric` of `eval.py`.
    pub metric: Metric,
    /// Whether `pred.py` wraps the prompt in the chat template (`false` for trec, triviaqa,
    /// samsum, lsht, lcc, repobench-p: "chat models are better off without build prompts on
    /// these tasks").
    pub chat: bool,
}

const MULTIDOC_QA: &str = "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:";

/// The English LongBench v1 tasks, in LongBench's order.
pub const TASKS: &[TaskSpec] = &[
    TaskSpec {
        name: "narrativeqa",
        prompt: "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
        max_new_tokens: 128,
        metric: Metric::QaF1,
        chat: true,
    },
    TaskSpec {
        name: "qasper",
        prompt: "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
        max_new_tokens: 128,
        metric: Metric::QaF1,
        chat: true,
    },
    TaskSpec {
        name: "multifieldqa_en",
        prompt: "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
        max_new_tokens: 64,
        metric: Metric::QaF1,
        chat: true,
    },
    TaskSpec {
        name: "hotpotqa",
        prompt: MULTIDOC_QA,
        max_new_tokens: 32,
        metric: Metric::QaF1,
        chat: true,
    },
    TaskSpec {
        name: "2wikimqa",
        prompt: MULTIDOC_QA,
        max_new_tokens: 32,
        metric: Metric::QaF1,
        chat: true,
    },
    TaskSpec {
        name: "musique",
        prompt: MULTIDOC_QA,
        max_new_tokens: 32,
        metric: Metric::QaF1,
        chat: true,
    },
    TaskSpec {
        name: "gov_report",
        prompt: "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
        max_new_tokens: 512,
        metric: Metric::RougeL,
        chat: true,
    },
    TaskSpec {
        name: "qmsum",
        prompt: "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
        max_new_tokens: 512,
        metric: Metric::RougeL,
        chat: true,
    },
    TaskSpec {
        name: "multi_news",
        prompt: "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
        max_new_tokens: 512,
        metric: Metric::RougeL,
        chat: true,
    },
    TaskSpec {
        name: "trec",
        prompt: "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
        max_new_tokens: 64,
        metric: Metric::Classification,
        chat: false,
    },
    TaskSpec {
        name: "triviaqa",
        prompt: "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
        max_new_tokens: 32,
        metric: Metric::QaF1,
        chat: false,
    },
    TaskSpec {
        name: "samsum",
        prompt: "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
        max_new_tokens: 128,
        metric: Metric::RougeL,
        chat: false,
    },
    TaskSpec {
        name: "passage_count",
        prompt: "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
        max_new_tokens: 32,
        metric: Metric::Count,
        chat: true,
    },
    TaskSpec {
        name: "passage_retrieval_en",
        prompt: "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
        max_new_tokens: 32,
        metric: Metric::Retrieval,
        chat: true,
    },
    TaskSpec {
        name: "lcc",
        prompt: "Please complete the code given below. \n{context}Next line of code:\n",
        max_new_tokens: 64,
        metric: Metric::CodeSim,
        chat: false,
    },
    TaskSpec {
        name: "repobench-p",
        prompt: "Please complete the code given below. \n{context}{input}Next line of code:\n",
        max_new_tokens: 64,
        metric: Metric::CodeSim,
        chat: false,
    },
];

/// The names of [`TASKS`], in the same order.
pub const ENGLISH_TASKS: &[&str] = &[
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
];

/// True for the task whose generation `pred.py` ends at the newline token
/// (`tokenizer.encode("\n", add_special_tokens=False)[-1]` as an extra EOS), with at least one
/// token first (`min_length = context_length + 1`): samsum.
pub fn stops_at_newline(task: &str) -> bool {
    task == "samsum"
}

/// The tasks whose prediction `eval.py` cuts to its first line (lsht is Chinese and not
/// loadable here, but its post-processing is the same).
const FIRST_LINE_TASKS: &[&str] = &["trec", "triviaqa", "samsum", "lsht"];

/// The task name without an optional `longbench/` prefix.
fn bare(task: &str) -> &str {
    task.strip_prefix("longbench/").unwrap_or(task)
}

/// The spec of a task, by LongBench name (`hotpotqa`) or sample task name
/// (`longbench/hotpotqa`).
pub fn spec(task: &str) -> Option<&'static TaskSpec> {
    let name = bare(task);
    TASKS.iter().find(|t| t.name == name)
}

fn unknown_task(task: &str) -> EvalError {
    EvalError::Params(format!(
        "unknown LongBench task `{task}`; known tasks: {}",
        ENGLISH_TASKS.join(", ")
    ))
}

/// The task's template formatted as Python's `template.format(context=..., input=...)` would:
/// one pass over the template, so braces inside the context or the input stay as they are.
pub fn format_prompt(spec: &TaskSpec, context: &str, input: &str) -> String {
    let template = spec.prompt;
    let mut out = String::with_capacity(template.len() + context.len() + input.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open..];
        if let Some(value) = after
            .strip_prefix("{context}")
            .map(|tail| (context, tail))
            .or_else(|| after.strip_prefix("{input}").map(|tail| (input, tail)))
        {
            out.push_str(value.0);
            rest = value.1;
        } else {
            // No other field occurs in the templates (checked by the tests); keep the brace.
            out.push('{');
            rest = &after[1..];
        }
    }
    out.push_str(rest);
    out
}

/// Loads `{dir}/{task}.jsonl` (LongBench's record format: `input`, `context`, `answers`,
/// `length`, `dataset`, `language`, `all_classes`, `_id`), at most `limit` records, in file
/// order.
///
/// Each record becomes a [`Sample`] whose prompt is the whole formatted template (LongBench
/// puts the answer cue inside it, so `answer_prefix` is empty), `length` is the record's
/// `length` and `chat` is `Some(false)` for the tasks LongBench runs without chat template.
/// `dataset` and `language` are not read; `all_classes` may be `null` or absent except for
/// trec; `answers` must be non-empty, and for passage_retrieval_en each must hold a
/// `Paragraph N` (where LongBench's metric would raise). Blank lines are skipped.
///
/// Errors: an unknown task ([`EvalError::Params`], listing the known ones); a file that cannot
/// be read, a line that is not JSON, a missing or mistyped field ([`EvalError::Data`] naming
/// the file and the 1-based line).
pub fn load(dir: &Path, task: &str, limit: Option<usize>) -> Result<Vec<Sample>> {
    let spec = spec(task).ok_or_else(|| unknown_task(task))?;
    let path = dir.join(format!("{}.jsonl", spec.name));
    let path_str = path.display().to_string();
    let data_err = |msg: String| EvalError::Data {
        path: path_str.clone(),
        msg,
    };
    let file = File::open(&path).map_err(|e| data_err(format!("cannot open: {e}")))?;
    let mut samples = Vec::new();
    for (idx, line) in BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|l| samples.len() >= l) {
            break;
        }
        let lineno = idx + 1;
        let line = line.map_err(|e| data_err(format!("line {lineno}: cannot read: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let record: serde_json::Value = serde_json::from_str(&line)
            .map_err(|e| data_err(format!("line {lineno}: malformed JSON: {e}")))?;
        let sample =
            to_sample(spec, &record).map_err(|msg| data_err(format!("line {lineno}: {msg}")))?;
        samples.push(sample);
    }
    Ok(samples)
}

fn str_field<'a>(
    obj: &'a serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> std::result::Result<&'a str, String> {
    match obj.get(key) {
        None => Err(format!("missing field `{key}`")),
        Some(v) => v
            .as_str()
            .ok_or_else(|| format!("field `{key}` is not a string")),
    }
}

fn str_list(v: &serde_json::Value, key: &str) -> std::result::Result<Vec<String>, String> {
    let items = v
        .as_array()
        .ok_or_else(|| format!("field `{key}` is not a list"))?;
    items
        .iter()
        .map(|item| {
            item.as_str()
                .map(str::to_owned)
                .ok_or_else(|| format!("field `{key}` holds a non-string"))
        })
        .collect()
}

fn to_sample(spec: &TaskSpec, record: &serde_json::Value) -> std::result::Result<Sample, String> {
    let obj = record
        .as_object()
        .ok_or_else(|| "record is not a JSON object".to_owned())?;
    let context = str_field(obj, "context")?;
    let input = str_field(obj, "input")?;
    let id = str_field(obj, "_id")?;
    let answers = str_list(
        obj.get("answers")
            .ok_or_else(|| "missing field `answers`".to_owned())?,
        "answers",
    )?;
    if answers.is_empty() {
        return Err("field `answers` is empty".to_owned());
    }
    let length = obj
        .get("length")
        .ok_or_else(|| "missing field `length`".to_owned())?
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| "field `length` is not a non-negative integer".to_owned())?;
    let all_classes = match obj.get("all_classes") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(v) => str_list(v, "all_classes")?,
    };
    if spec.metric == Metric::Classification && all_classes.is_empty() {
        return Err(format!(
            "field `all_classes` must list the classes for {}",
            spec.name
        ));
    }
    if spec.metric == Metric::Retrieval {
        if let Some(bad) = answers
            .iter()
            .find(|a| crate::metrics::paragraph_id(a).is_none())
        {
            return Err(format!("answer {bad:?} has no `Paragraph N`"));
        }
    }
    Ok(Sample {
        task: format!("longbench/{}", spec.name),
        id: id.to_owned(),
        prompt: format_prompt(spec, context, input),
        answer_prefix: String::new(),
        answers,
        all_classes,
        metric: spec.metric,
        max_new_tokens: spec.max_new_tokens,
        length,
        depth: None,
        chat: if spec.chat { None } else { Some(false) },
    })
}

/// LongBench's middle truncation: a prompt longer than `max` tokens keeps its first and its
/// last `max/2` tokens (`half = int(max_length/2)`), so an odd `max` keeps `max - 1`.
///
/// Differences from `pred.py`, which truncates text: it tokenizes the prompt (with the
/// tokenizer's special tokens, e.g. BOS), decodes both halves with `skip_special_tokens=True`,
/// concatenates the two strings and tokenizes the result again before generation, so its
/// final ids can differ slightly around the cut and at the start; this function cuts the ids
/// directly. Also, for `max < 2` Python's `tokenized_prompt[-0:]` keeps the whole prompt,
/// whereas this returns nothing.
pub fn truncate_middle(ids: &[u32], max: usize) -> Vec<u32> {
    if ids.len() <= max {
        return ids.to_vec();
    }
    let half = max / 2;
    let mut out = Vec::with_capacity(2 * half);
    out.extend_from_slice(&ids[..half]);
    out.extend_from_slice(&ids[ids.len() - half..]);
    out
}

/// `eval.py`'s per-task post-processing of a prediction before scoring: for trec, triviaqa,
/// samsum and lsht `prediction.lstrip('\n').split('\n')[0]`; other tasks unchanged. `task`
/// may carry the `longbench/` prefix.
pub fn postprocess(task: &str, prediction: &str) -> String {
    if FIRST_LINE_TASKS.contains(&bare(task)) {
        prediction
            .trim_start_matches('\n')
            .split('\n')
            .next()
            .unwrap_or_default()
            .to_owned()
    } else {
        prediction.to_owned()
    }
}

/// Python's `round(x, 2)`: the double nearest to the correctly rounded two-decimal value
/// (ties to even on the exact binary value, as Rust's `{:.2}` formatting also does).
fn py_round2(x: f64) -> f64 {
    format!("{x:.2}").parse().unwrap_or(x)
}

/// The task score LongBench reports: `round(100 * total_score / len(predictions), 2)` over
/// the samples' best scores ([`crate::Metric::best`] of the post-processed predictions).
///
/// Errors ([`EvalError::Params`]) for an unknown task or no scores (where Python divides by
/// zero).
pub fn task_score(task: &str, best_scores: &[f64]) -> Result<f64> {
    if spec(task).is_none() {
        return Err(unknown_task(task));
    }
    if best_scores.is_empty() {
        return Err(EvalError::Params(format!(
            "no scores to aggregate for LongBench task `{task}`"
        )));
    }
    let total: f64 = best_scores.iter().fold(0.0, |acc, s| acc + s);
    Ok(py_round2(100.0 * total / best_scores.len() as f64))
}
