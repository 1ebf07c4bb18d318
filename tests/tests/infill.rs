//! Fill in the middle (`Prompt::Infill`, the CLI's `--suffix`, the server's `suffix` and
//! `/infill`): the prompt is the model's FIM tokens around the two texts, with the project's
//! other files before them for `/infill`, as llama.cpp's infill builds it, and a code model
//! writes the hole; a model without FIM tokens refuses.

use std::io::{BufRead, BufReader};

use keydiff::{EngineError, GenerateParams, InfillFile, Prompt, Sampling};
use keydiff_server::{Server, ServerConfig};
use keydiff_tests::{evicting_engine as engine, QWEN, SMOLLM2};
use serde_json::{json, Value};

fn infill(prefix: &str, suffix: &str) -> Prompt {
    Prompt::Infill {
        prefix: prefix.into(),
        suffix: suffix.into(),
        repo: None,
    }
}

#[test]
fn a_code_model_fills_the_hole() {
    let e = engine(QWEN);
    let (prefix, suffix) = ("def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n");
    // The same ids as the FIM tokens' texts parsed as special tokens around the texts.
    let ids = e.prompt_tokens(&infill(prefix, suffix)).unwrap();
    let want = e
        .tokenize_special(&format!(
            "<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
        ))
        .unwrap();
    assert_eq!(ids, want);
    // Special-token text inside the texts stays text.
    let odd = e.prompt_tokens(&infill("<|fim_middle|>", "x")).unwrap();
    assert_eq!(
        odd.iter().filter(|&&t| t == want[want.len() - 1]).count(),
        1
    );

    // A prompt longer than the budget: filled under eviction.
    let long_prefix = format!("{}{prefix}", "# a helper module\n".repeat(12));
    let out = e
        .generate(
            &GenerateParams {
                prompt: infill(&long_prefix, suffix),
                max_tokens: 24,
                ..Default::default()
            },
            |_| {},
        )
        .unwrap();
    assert!(out.stats.eviction.evictions > 0, "nothing evicted");
    assert!(out.text.starts_with("a + b"), "{:?}", out.text);
}

#[test]
fn models_without_fim_tokens_and_empty_infills_are_refused() {
    let e = engine(SMOLLM2);
    let err = e.prompt_tokens(&infill("def f():", "")).unwrap_err();
    assert!(
        matches!(&err, EngineError::BadField { field: "suffix", reason }
            if reason.contains("no fill-in-the-middle tokens")),
        "{err}"
    );
    let e = engine(QWEN);
    assert!(matches!(
        e.prompt_tokens(&infill("", "")),
        Err(EngineError::EmptyPrompt)
    ));
    // One side empty is a prompt.
    assert!(e.prompt_tokens(&infill("", "return x\n")).is_ok());
}

/// `/infill`'s prompt: llama.cpp's layout, files before the FIM tokens, each text tokenized
/// on its own as llama.cpp tokenizes it.
#[test]
fn project_files_go_before_the_hole() {
    let e = engine(QWEN);
    let files = vec![
        InfillFile {
            name: "utils.py".into(),
            text: "import math\n\ndef area(r):\n    return math.pi * r * r\n".into(),
        },
        InfillFile {
            name: "b.py".into(),
            text: "X = 1\n".into(),
        },
    ];
    let (prefix, suffix) = ("from utils import area\nprint(", ")\n");
    let ids = e
        .prompt_tokens(&Prompt::Infill {
            prefix: prefix.into(),
            suffix: suffix.into(),
            repo: Some(files.clone()),
        })
        .unwrap();
    let special = |t: &str| {
        let ids = e.tokenize_special(t).unwrap();
        assert_eq!(ids.len(), 1, "{t} is one token");
        ids[0]
    };
    let plain = |t: &str| e.tokenize_continuation(t).unwrap();
    let mut want = vec![special("<|repo_name|>")];
    want.extend(plain("myproject\n"));
    for f in &files {
        want.push(special("<|file_sep|>"));
        want.extend(plain(&format!("{}\n", f.name)));
        want.extend(plain(&f.text));
    }
    want.push(special("<|file_sep|>"));
    want.extend(plain("filename\n"));
    want.push(special("<|fim_prefix|>"));
    want.extend(plain(prefix));
    want.push(special("<|fim_suffix|>"));
    want.extend(plain(suffix));
    want.push(special("<|fim_middle|>"));
    assert_eq!(ids, want);
    // The texts of the layout, special tokens left out.
    assert_eq!(
        e.detokenize(&ids).unwrap(),
        format!(
            "myproject\nutils.py\n{}b.py\nX = 1\nfilename\n{prefix}{suffix}",
            files[0].text
        )
    );
}

/// llama.cpp's `/infill` over HTTP: the engine's answer, whole and streamed (llama.cpp's
/// chunks, no `[DONE]`), with llama.cpp's fields; bad `input_extra` is refused naming it.
#[test]
fn the_infill_endpoint_answers_as_llama_cpp() {
    let local = engine(QWEN);
    let server = Server::bind("127.0.0.1:0", engine(QWEN), ServerConfig::new("q"))
        .unwrap()
        .spawn();
    let url = format!("{}/infill", server.url());
    let extra =
        json!([{"filename": "utils.py", "text": "def area(r):\n    return 3.14 * r * r\n"}]);
    let body = json!({
        "input_prefix": "from utils import area\n\ndef describe(r):\n    return f\"area {",
        "input_suffix": "}\"\n",
        "input_extra": extra,
        "n_predict": 12,
        "temperature": 0,
        "cache_prompt": true,
        "t_max_prompt_ms": 500,
    });
    let whole: Value = ureq::post(&url)
        .send_json(&body)
        .unwrap()
        .into_json()
        .unwrap();
    let want = local
        .generate(
            &GenerateParams {
                prompt: Prompt::Infill {
                    prefix: body["input_prefix"].as_str().unwrap().into(),
                    suffix: body["input_suffix"].as_str().unwrap().into(),
                    repo: Some(vec![InfillFile {
                        name: "utils.py".into(),
                        text: "def area(r):\n    return 3.14 * r * r\n".into(),
                    }]),
                },
                max_tokens: 12,
                sampling: Sampling {
                    top_k: 40,
                    top_p: 0.95,
                    min_p: 0.05,
                    ..Sampling::default()
                },
                ..Default::default()
            },
            |_| {},
        )
        .unwrap();
    assert_eq!(whole["content"], want.text.as_str(), "{whole}");
    assert_eq!(whole["stop"], true);
    assert_eq!(whole["tokens_predicted"], 12);
    assert_eq!(whole["tokens_evaluated"], want.stats.prompt_tokens);
    assert_eq!(whole["stop_type"], "limit");
    assert_eq!(whole["timings"]["predicted_n"], 12);
    assert!(whole["timings"]["prompt_per_second"].as_f64().unwrap() > 0.0);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = ureq::post(&url).send_json(&streamed).unwrap();
    let lines: Vec<String> = BufReader::new(r.into_reader())
        .lines()
        .map(|l| l.unwrap())
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect();
    let chunks: Vec<Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (last, pieces) = chunks.split_last().unwrap();
    assert!(pieces.iter().all(|c| c["stop"] == false));
    let text: String = pieces
        .iter()
        .map(|c| c["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, want.text);
    assert_eq!(last["stop"], true);
    assert_eq!(last["content"], "");
    assert_eq!(last["tokens_predicted"], 12);

    let bad = json!({"input_prefix": "x", "input_extra": [{"filename": 3, "text": "y"}]});
    let Err(ureq::Error::Status(400, r)) = ureq::post(&url).send_json(&bad) else {
        panic!("not refused")
    };
    let v: Value = r.into_json().unwrap();
    assert_eq!(v["error"]["param"], "input_extra", "{v}");
    server.stop().unwrap();

    // The same files again (an editor's next request), on a server without a budget: the
    // prompt cache gives whole chunks back (under a budget, `--prompt-cache continue` does).
    let full = keydiff::Engine::load(
        &keydiff::ModelSource::Gguf(keydiff_tests::model(QWEN)),
        &keydiff::EngineConfig::default(),
    )
    .unwrap();
    let plain = Server::bind("127.0.0.1:0", full, ServerConfig::new("q"))
        .unwrap()
        .spawn();
    let url = format!("{}/infill", plain.url());
    let mut again = body.clone();
    let long: String = (0..30)
        .map(|i| format!("def f{i}(x):\n    return x + {i}\n\n"))
        .collect();
    again["input_extra"] = json!([{"filename": "big.py", "text": long}]);
    let post = |b: &Value| -> Value { ureq::post(&url).send_json(b).unwrap().into_json().unwrap() };
    // An editor warms the cache with the files (`n_predict: 0`): no text, the prompt held.
    let mut warm = again.clone();
    warm["n_predict"] = json!(0);
    let warmed = post(&warm);
    assert_eq!(warmed["content"], "", "{warmed}");
    assert_eq!(warmed["tokens_predicted"], 0);
    assert_eq!(warmed["timings"]["cache_n"], 0);
    assert_eq!(warmed["tokens_cached"], warmed["tokens_evaluated"]);
    // The same prompt: all of it from the cache, with the logits the warming left.
    let second = post(&again);
    let cached = second["timings"]["cache_n"].as_u64().unwrap();
    assert_eq!(
        cached,
        second["tokens_evaluated"].as_u64().unwrap(),
        "{second}"
    );
    assert_eq!(
        second["timings"]["prompt_n"].as_u64().unwrap() + cached,
        second["tokens_evaluated"].as_u64().unwrap()
    );
    assert_eq!(
        second["tokens_cached"].as_u64().unwrap(),
        second["tokens_evaluated"].as_u64().unwrap() + 11
    );
    // llama.cpp's `response_fields`: those paths only, as flat keys.
    let mut fields = again.clone();
    fields["response_fields"] = json!(["content", "timings/prompt_n", "no/such"]);
    let picked = post(&fields);
    let keys: Vec<&String> = picked.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["content", "timings/prompt_n"], "{picked}");
    assert_eq!(picked["content"], second["content"]);
    // `n_indent`: the reply ends where a line starts less indented, cut before its text.
    let mut block = again.clone();
    block["n_indent"] = json!(100);
    block["n_predict"] = json!(48);
    let ended = post(&block);
    let text = ended["content"].as_str().unwrap();
    assert!(text.contains('\n'), "{ended}");
    assert!(
        text.lines().skip(1).all(|l| l.trim().is_empty()),
        "{text:?}"
    );
    assert_eq!(ended["stop_type"], "limit");
    assert!(
        second["content"].as_str().unwrap().starts_with(text),
        "{second}"
    );
    // `t_max_predict_ms`: past the time, the reply ends at its first line break.
    let mut long = again.clone();
    long["n_predict"] = json!(48);
    let whole = post(&long);
    long["t_max_predict_ms"] = json!(1);
    let timed = post(&long);
    let (whole, text) = (
        whole["content"].as_str().unwrap(),
        timed["content"].as_str().unwrap(),
    );
    assert!(
        whole.starts_with(text) && text.contains('\n'),
        "{text:?} of {whole:?}"
    );
    assert!(timed["tokens_predicted"].as_u64().unwrap() < 48, "{timed}");
    assert_eq!(timed["stop_type"], "limit");

    plain.stop().unwrap();
}

/// Project files that do not fit lose tokens from their start, leaving the reply its room;
/// the rest of the prompt is never cut.
#[test]
fn project_files_are_cut_to_fit_the_context() {
    let e = engine(QWEN);
    let context = e.model_config().context();
    let files = vec![
        InfillFile {
            name: "old.py".into(),
            text: "OLD = 1\n".repeat(40),
        },
        InfillFile {
            name: "new.py".into(),
            text: "NEW = 2\n".into(),
        },
    ];
    let (whole, cut) = e
        .infill_within("a = ", "\n", &files, 0, usize::MAX)
        .unwrap();
    assert_eq!(cut, 0);
    let room = context - whole.len() + 50;
    let (ids, cut) = e
        .infill_within("a = ", "\n", &files, room, usize::MAX)
        .unwrap();
    assert_eq!(cut, 50);
    assert_eq!(ids.len() + room, context);
    // The latest file and the FIM part are whole: the end of the prompt is unchanged.
    assert_eq!(ids[ids.len() - 30..], whole[whole.len() - 30..]);
    // No room left for any file: the block is gone, the FIM part stays.
    // A fixed cap on the files cuts them the same whatever the prefix (the prompt cache
    // then finds them again).
    let block = whole.len() - 7;
    for prefix in ["a = ", "a = b + c + d + e + f + g + h"] {
        let (ids, cut) = e
            .infill_within(prefix, "\n", &files, 0, block - 20)
            .unwrap();
        assert_eq!(cut, 20);
        assert_eq!(ids[..block - 20], whole[20..block]);
    }
    let (ids, _) = e
        .infill_within("a = ", "\n", &files, context, usize::MAX)
        .unwrap();
    let pre = e.tokenize_special("<|fim_prefix|>").unwrap()[0];
    assert_eq!(ids[0], pre, "{ids:?}");
    assert!(whole.ends_with(&ids));
    // A FIM part beyond the context is refused, not cut.
    let huge = "x = 1\n".repeat(context);
    assert!(matches!(
        e.infill_within(&huge, "", &files, 0, usize::MAX),
        Err(EngineError::PromptTooLong { .. })
    ));
}
