//! The OpenAI-compatible server (`keydiff-server`, `keydiff serve`) over HTTP on the real
//! SmolLM2: answers equal the engine's, streams add up to the whole answer, bad requests get
//! 400 naming the field, a client that leaves is cancelled, a full queue answers 503.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use keydiff::{
    CacheConfig, Engine, EngineConfig, GenerateParams, Message, ModelSource, PolicyKind, Prompt,
    StopReason,
};
use keydiff_server::{Server, ServerConfig, ServerError, ServerHandle};
use keydiff_tests::{keydiff_bin, model, SMOLLM2};
use serde_json::{json, Value};

fn engine(cache: CacheConfig) -> Engine {
    let cfg = EngineConfig {
        cache,
        ..Default::default()
    };
    Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap()
}

/// KeyDiff under the budget `n` with chunks of `b`.
fn keydiff_cache(n: usize, b: usize) -> CacheConfig {
    CacheConfig {
        policy: PolicyKind::parse("keydiff", 32, 0).unwrap(),
        budget: Some(n),
        ..CacheConfig::full(b)
    }
}

fn start(cache: CacheConfig, max_queue: usize) -> ServerHandle {
    let cfg = ServerConfig {
        max_queue,
        ..ServerConfig::new("smol")
    };
    Server::bind("127.0.0.1:0", engine(cache), cfg)
        .unwrap()
        .spawn()
}

/// A server that decodes up to `max_batch` requests together, without a prompt cache.
fn start_batched(
    cache: CacheConfig,
    max_batch: usize,
    prefill_tokens: Option<usize>,
) -> ServerHandle {
    let cfg = ServerConfig {
        max_batch,
        prefill_tokens,
        prompt_cache: None,
        ..ServerConfig::new("smol")
    };
    Server::bind("127.0.0.1:0", engine(cache), cfg)
        .unwrap()
        .spawn()
}

/// POSTs `body`; the status and the JSON answer (4xx/5xx included).
fn post(url: &str, body: &Value) -> (u16, Value) {
    match ureq::post(url).send_json(body) {
        Ok(r) => (r.status(), r.into_json().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap()),
        Err(e) => panic!("{url}: {e}"),
    }
}

fn get(url: &str) -> Value {
    ureq::get(url).call().unwrap().into_json().unwrap()
}

/// The `data:` payloads of a server-sent event stream, up to and without `[DONE]`.
fn events(resp: ureq::Response) -> Vec<Value> {
    assert_eq!(resp.header("content-type"), Some("text/event-stream"));
    let mut out = Vec::new();
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return out;
        }
        out.push(serde_json::from_str(data).unwrap());
    }
    panic!("the stream ended without [DONE]")
}

/// Polls `/health` until `ready` holds (at most a minute: the server acts on a closed
/// connection at its next token).
fn wait_health(base: &str, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let h = get(&format!("{base}/health"));
        if ready(&h) {
            return h;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{what}: {h}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn greedy(prompt: Prompt, n: usize) -> GenerateParams {
    GenerateParams {
        prompt,
        max_tokens: n,
        ..Default::default()
    }
}

/// Both endpoints, whole and streamed, under a budget that evicts: the same tokens, text and
/// cache figures as the engine gives in process.
#[test]
fn answers_equal_the_engine_whole_and_streamed() {
    let cache = keydiff_cache(64, 32);
    let server = start(cache.clone(), 4);
    let base = server.url();
    let local = engine(cache);

    let long = format!(
        "{}\nQuestion: what does the text repeat? Answer:",
        "The quick brown fox jumps over the lazy dog. ".repeat(20)
    );
    let want = local
        .generate(&greedy(Prompt::Text(long.clone()), 12), |_| {})
        .unwrap();
    assert!(want.stats.eviction.evictions > 0, "the budget must evict");
    let body = json!({"model": "anything", "prompt": long, "max_tokens": 12, "temperature": 0});
    let (code, got) = post(&format!("{base}/v1/completions"), &body);
    assert_eq!(code, 200, "{got}");
    assert_eq!(got["object"], "text_completion");
    assert_eq!(got["model"], "smol");
    assert_eq!(got["choices"][0]["text"], want.text);
    let reason = match want.stats.stop_reason {
        StopReason::MaxTokens => "length",
        _ => "stop",
    };
    assert_eq!(got["choices"][0]["finish_reason"], reason);
    let usage = &got["usage"];
    assert_eq!(usage["prompt_tokens"], want.stats.prompt_tokens);
    assert_eq!(usage["completion_tokens"], want.tokens.len());
    assert_eq!(
        usage["total_tokens"],
        want.stats.prompt_tokens + want.tokens.len()
    );
    let k = &got["keydiff"];
    assert_eq!(k["policy"], "keydiff");
    assert_eq!(k["budget"], 64);
    assert_eq!(k["eviction"]["evictions"], want.stats.eviction.evictions);
    assert_eq!(k["final_cache_len"], want.stats.final_cache_len);
    assert_eq!(k["peak_kv_bytes"], want.stats.peak_kv_bytes);

    // Token ids as the prompt, and `echo`.
    let (code, by_ids) = post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": want.prompt_tokens, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(code, 200, "{by_ids}");
    assert_eq!(by_ids["choices"][0]["text"], want.text);
    let (_, echoed) = post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": long, "max_tokens": 12, "temperature": 0, "echo": true}),
    );
    assert_eq!(echoed["choices"][0]["text"], format!("{long}{}", want.text));

    // Chat, whole and streamed with usage.
    // Text parts are joined by a line break (vLLM's and llama.cpp's way).
    let messages = vec![
        Message::new("system", "You are a helpful assistant."),
        Message::new("user", "What is the capital of\nFrance?"),
    ];
    let want = local
        .generate(&greedy(Prompt::Chat(messages), 24), |_| {})
        .unwrap();
    let body = json!({
        "messages": [
            {"role": "developer", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of"},
                                         {"type": "text", "text": "France?"}]},
        ],
        "max_completion_tokens": 24,
        "temperature": 0,
    });
    let (code, got) = post(&format!("{base}/v1/chat/completions"), &body);
    assert_eq!(code, 200, "{got}");
    assert_eq!(got["object"], "chat.completion");
    assert_eq!(got["choices"][0]["message"]["role"], "assistant");
    assert_eq!(got["choices"][0]["message"]["content"], want.text);
    assert!(want.text.contains("Paris"), "{}", want.text);
    assert_eq!(got["usage"]["prompt_tokens"], want.stats.prompt_tokens);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let resp = ureq::post(&format!("{base}/v1/chat/completions"))
        .send_json(&streamed)
        .unwrap();
    let ev = events(resp);
    assert!(ev.len() >= 4, "{ev:?}");
    assert!(ev.iter().all(|e| e["object"] == "chat.completion.chunk"));
    assert!(ev.iter().all(|e| e["id"] == ev[0]["id"]));
    assert_eq!(ev[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = ev
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want.text);
    let last = &ev[ev.len() - 2];
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(last["keydiff"]["generated_tokens"], want.tokens.len());
    let usage = &ev[ev.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    // The same prompt again: all of it from the prompt cache (with the logits it left).
    let mut again = got["usage"].clone();
    again["prompt_tokens_details"]["cached_tokens"] = got["usage"]["prompt_tokens"].clone();
    assert_eq!(usage["usage"], again);

    let h = get(&format!("{base}/health"));
    assert_eq!(h["completed"], 5, "{h}");
    assert_eq!(h["failed"], 0, "{h}");
    let m = get(&format!("{base}/v1/models"));
    assert_eq!(m["data"][0]["id"], "smol");
    assert_eq!(m["data"][0]["max_model_len"], 8192);
    server.stop().unwrap();
}

/// The next turn of a conversation reuses the prompt cache (OpenAI's
/// `usage.prompt_tokens_details.cached_tokens`) and answers as the engine does fresh, one
/// request at a time and batched (`--max-batch`, whose batch keeps the last requests'
/// caches); with the prompt cache off nothing is reused.
#[test]
fn a_follow_up_reuses_the_prompt_cache() {
    let cache = CacheConfig::full(16);
    let local = engine(cache.clone());
    let q1 = json!({"role": "user", "content": "What is the capital of France?"});
    let exact = Some(keydiff::Reuse::Exact);
    for (prompt_cache, max_batch) in [(exact, 1), (exact, 2), (None, 1)] {
        let cfg = ServerConfig {
            prompt_cache,
            max_batch,
            ..ServerConfig::new("smol")
        };
        let server = Server::bind("127.0.0.1:0", engine(cache.clone()), cfg)
            .unwrap()
            .spawn();
        let url = format!("{}/v1/chat/completions", server.url());
        let (_, first) = post(
            &url,
            &json!({"messages": [q1], "max_tokens": 24, "temperature": 0}),
        );
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let reply = first["choices"][0]["message"]["content"].as_str().unwrap();
        let turn2 = vec![
            Message::new("user", "What is the capital of France?"),
            Message::new("assistant", reply),
            Message::new("user", "And the capital of Italy?"),
        ];
        let body = json!({"messages": [q1, {"role": "assistant", "content": reply},
                                       {"role": "user", "content": "And the capital of Italy?"}],
                          "max_tokens": 24, "temperature": 0});
        let (code, second) = post(&url, &body);
        assert_eq!(code, 200, "{second}");
        let want = local
            .generate(&greedy(Prompt::Chat(turn2), 24), |_| {})
            .unwrap();
        assert_eq!(second["choices"][0]["message"]["content"], want.text);
        let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(cached, second["keydiff"]["prefix_tokens"].as_u64().unwrap());
        if prompt_cache.is_some() {
            assert!(cached >= first["usage"]["prompt_tokens"].as_u64().unwrap() - 16);
        } else {
            assert_eq!(cached, 0);
        }
        let h = get(&format!("{}/health", server.url()));
        assert_eq!(h["cached_prompt_tokens"], cached, "{h}");
        // What the prompt cache keeps: the follow-up took the first request's cache over,
        // and its own is kept (batched too).
        let kept = h["prompt_cache_entries"].as_u64().unwrap();
        let bytes = h["prompt_cache_bytes"].as_u64().unwrap();
        match prompt_cache {
            Some(_) => {
                assert_eq!(kept, 1, "{h}");
                assert!(bytes > 0, "{h}");
            }
            None => assert_eq!((kept, bytes), (0, 0), "{h}"),
        }
        let m = ureq::get(&format!("{}/metrics", server.url()))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        assert!(
            m.contains(&format!("keydiff_prompt_cache_bytes {bytes}\n")),
            "{m}"
        );
    }
}

/// Sampled requests with a seed repeat; the penalties and the stop strings reach the engine.
#[test]
fn seeds_penalties_and_stops_are_honoured() {
    let server = start(CacheConfig::full(128), 4);
    let url = format!("{}/v1/completions", server.url());
    let body = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9,
                      "top_p": 0.95, "top_k": 40, "seed": 7});
    let a = post(&url, &body).1["choices"][0]["text"].clone();
    let b = post(&url, &body).1["choices"][0]["text"].clone();
    assert_eq!(a, b);

    let local = engine(CacheConfig::full(128));
    let mut params = greedy(Prompt::Text("Once upon a time".into()), 24);
    params.sampling.frequency_penalty = 1.5;
    params.sampling.presence_penalty = 0.5;
    // llama.cpp's penalties: the last 64 tokens, prompt included.
    let llama = local.generate(&params, |_| {}).unwrap();
    // OpenAI's (vLLM's): the reply's tokens.
    params.sampling.output_penalties = true;
    let want = local.generate(&params, |_| {}).unwrap();
    let plain = local
        .generate(&greedy(Prompt::Text("Once upon a time".into()), 24), |_| {})
        .unwrap();
    assert_ne!(
        want.tokens, plain.tokens,
        "the penalties change greedy text"
    );
    assert_ne!(want.tokens, llama.tokens, "the two counts give other text");
    let (_, got) = post(
        &url,
        &json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                "frequency_penalty": 1.5, "presence_penalty": 0.5}),
    );
    assert_eq!(got["choices"][0]["text"], want.text);
    // With llama.cpp's `repeat_last_n`, llama.cpp's count; on llama.cpp's own endpoint,
    // llama.cpp's count whether it is given or not.
    let (_, got) = post(
        &url,
        &json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                "frequency_penalty": 1.5, "presence_penalty": 0.5, "repeat_last_n": 64}),
    );
    assert_eq!(got["choices"][0]["text"], llama.text);
    let own = format!("{}/completion", server.url());
    let (_, got) = post(
        &own,
        &json!({"prompt": "Once upon a time", "n_predict": 24, "temperature": 0,
                "frequency_penalty": 1.5, "presence_penalty": 0.5}),
    );
    assert_eq!(got["content"], llama.text, "{got}");

    // logit_bias: -100 on the greedy first token makes the reply start with the runner-up,
    // as the engine's own logit bias does; logprobs stay the model's.
    let banned = plain.tokens[0];
    let mut params = greedy(Prompt::Text("Once upon a time".into()), 8);
    params.sampling.logit_bias = vec![(banned, -100.0)];
    let want = local.generate(&params, |_| {}).unwrap();
    assert_ne!(want.tokens[0], banned);
    let body = json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                      "logprobs": 2});
    let (_, unbiased) = post(&url, &body);
    let mut body = body;
    body["logit_bias"] = json!({banned.to_string(): -100});
    let (code, got) = post(&url, &body);
    assert_eq!(code, 200, "{got}");
    assert_eq!(got["choices"][0]["text"], want.text);
    let top = &got["choices"][0]["logprobs"]["top_logprobs"][0];
    assert_eq!(
        top, &unbiased["choices"][0]["logprobs"]["top_logprobs"][0],
        "{got}"
    );
    let texts = |ids: &[u32]| local.detokenize(ids).unwrap();
    let top = top.as_object().unwrap();
    assert!(
        top.contains_key(&texts(&[banned])) && top.contains_key(&texts(&want.tokens[..1])),
        "the banned token and the runner-up are the two most likely: {top:?}"
    );

    // A stop string inside the greedy text ends it there, unemitted.
    // Three characters after the first space (char boundaries, whatever the text).
    let from = plain.text.find(' ').map_or(1, |i| i + 1);
    let stop: String = plain.text[from..].chars().take(3).collect();
    let stop = stop.as_str();
    let (_, got) = post(
        &url,
        &json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                "stop": [stop]}),
    );
    let text = got["choices"][0]["text"].as_str().unwrap();
    assert!(
        !text.contains(stop) && plain.text.starts_with(text),
        "{text:?}"
    );
    assert_eq!(got["choices"][0]["finish_reason"], "stop");
}

/// Every request this server cannot honour gets a 400 (or 404) with OpenAI's error body
/// naming the problem; none reaches the engine as something else.
#[test]
fn bad_requests_are_refused_naming_the_problem() {
    let server = start(CacheConfig::full(128), 4);
    let base = server.url();
    let c = format!("{base}/v1/completions");
    let chat = format!("{base}/v1/chat/completions");
    let user = json!([{"role": "user", "content": "hi"}]);
    let too_long = "word ".repeat(9000);
    let cases: Vec<(&str, Value, Option<&str>, &str)> = vec![
        (&c, json!({"max_tokens": 4}), None, "missing field `prompt`"),
        (
            &c,
            json!({"prompt": ""}),
            Some("prompt"),
            "the prompt is empty",
        ),
        (
            &c,
            json!({"prompt": []}),
            Some("prompt"),
            "the prompt is empty",
        ),
        (&c, json!({"prompt": 5}), Some("prompt"), "prompt must be"),
        (
            &c,
            json!({"prompt": [1, "a"]}),
            Some("prompt"),
            "prompt must be",
        ),
        (
            &c,
            json!({"prompt": ["a", "b"], "stream": true}),
            Some("prompt"),
            "a stream answers one prompt",
        ),
        (
            &c,
            json!({"prompt": vec!["a"; 129]}),
            Some("prompt"),
            "at most 128",
        ),
        (
            &c,
            json!({"prompt": ["a", "", "b"]}),
            Some("prompt"),
            "prompt 1: the prompt is empty",
        ),
        (
            &c,
            json!({"prompt": ["a", 5]}),
            Some("prompt"),
            "a string or an array of token ids",
        ),
        (
            &c,
            json!({"prompt": [99999999]}),
            None,
            "outside the vocabulary",
        ),
        (
            &c,
            json!({"prompt": too_long}),
            Some("prompt"),
            "beyond the model's context of 8192",
        ),
        (
            &c,
            json!({"prompt": "hi", "n": 0}),
            Some("n"),
            "from 1 to 128",
        ),
        (
            &c,
            json!({"prompt": "hi", "n": 129}),
            Some("n"),
            "from 1 to 128",
        ),
        (
            &c,
            json!({"prompt": "hi", "logprobs": 21}),
            Some("logprobs"),
            "from 0 to 20",
        ),
        (
            &c,
            json!({"prompt": "hi", "logprobs": true}),
            Some("logprobs"),
            "must be an integer",
        ),
        (
            &c,
            json!({"prompt": "hi", "top_logprobs": 2}),
            Some("top_logprobs"),
            "chat field",
        ),
        (
            &c,
            json!({"prompt": "hi", "best_of": 1, "n": 2}),
            Some("best_of"),
            "from n (2) to 128",
        ),
        (
            &c,
            json!({"prompt": "hi", "best_of": 3, "stream": true}),
            Some("best_of"),
            "cannot be streamed",
        ),
        (
            &c,
            json!({"prompt": "hi", "suffix": "x"}),
            Some("suffix"),
            "no fill-in-the-middle tokens",
        ),
        (
            &c,
            json!({"prompt": [1, 2], "suffix": "x"}),
            Some("suffix"),
            "a suffix needs text prompts",
        ),
        (
            &c,
            json!({"prompt": "hi", "suffix": "x", "echo": true}),
            Some("echo"),
            "echo with a suffix",
        ),
        (
            &c,
            json!({"prompt": [1, 99999999], "echo": true}),
            None,
            "outside the vocabulary",
        ),
        (
            &c,
            json!({"prompt": "hi", "max_tokens": 0}),
            Some("max_tokens"),
            "at least 1",
        ),
        (
            &c,
            json!({"prompt": "hi", "max_tokens": -1}),
            None,
            "invalid value",
        ),
        (
            &c,
            json!({"prompt": "hi", "stop": ""}),
            Some("stop"),
            "must not be empty",
        ),
        (
            &c,
            json!({"prompt": "hi", "temperature": -1}),
            Some("temperature"),
            "temperature -1",
        ),
        (
            &c,
            json!({"prompt": "hi", "top_p": 0}),
            Some("top_p"),
            "top-p 0",
        ),
        (
            &c,
            json!({"prompt": "hi", "presence_penalty": 3}),
            Some("presence_penalty"),
            "presence penalty 3",
        ),
        (
            &c,
            json!({"prompt": "hi", "logit_bias": {"x": 5}}),
            Some("logit_bias"),
            "key `x` is not a token id",
        ),
        (
            &c,
            json!({"prompt": "hi", "logit_bias": {"1": 101}}),
            Some("logit_bias"),
            "from -100 to 100",
        ),
        (
            &c,
            json!({"prompt": "hi", "logit_bias": {"1": "up"}}),
            Some("logit_bias"),
            "from -100 to 100",
        ),
        // Refused before the stream opens, by the engine, which knows the vocabulary.
        (
            &c,
            json!({"prompt": "hi", "logit_bias": {"99999999": 1}, "stream": true}),
            Some("logit_bias"),
            "logit bias on token id 99999999, outside the vocabulary",
        ),
        (
            &chat,
            json!({"messages": []}),
            Some("messages"),
            "must not be empty",
        ),
        (
            &chat,
            json!({"prompt": "hi"}),
            None,
            "missing field `messages`",
        ),
        (
            &chat,
            json!({"messages": user, "tools": [{"type": "function"}]}),
            Some("tools"),
            "needs its `function` object",
        ),
        (
            &chat,
            json!({"messages": user, "logprobs": 3}),
            Some("logprobs"),
            "true or false",
        ),
        (
            &chat,
            json!({"messages": user, "top_logprobs": 3}),
            Some("top_logprobs"),
            "needs logprobs set to true",
        ),
        (
            &chat,
            json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
            Some("top_logprobs"),
            "from 0 to 20",
        ),
        (
            &chat,
            json!({"messages": user, "response_format": {"type": "json_schema",
                   "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a)\\1"}}}}),
            Some("response_format"),
            "backreferences are not supported",
        ),
        (
            &chat,
            json!({"messages": user, "response_format": {"type": "json_schema",
                   "json_schema": {"name": "x"}}}),
            Some("response_format"),
            "needs its schema in json_schema.schema",
        ),
        (
            &c,
            json!({"prompt": "hi", "grammar": "root ::= x"}),
            Some("grammar"),
            "rule `x` is used (line 1) but not defined",
        ),
        (
            &c,
            json!({"prompt": "hi", "json_schema": {"type": "thing"}}),
            Some("json_schema"),
            "unknown type",
        ),
        (
            &c,
            json!({"prompt": "hi", "grammar": "root ::= \"a\"",
                   "grammar_triggers": [{"type": 1, "value": "a"}]}),
            Some("grammar_triggers"),
            "set grammar_lazy to true",
        ),
        (
            &c,
            json!({"prompt": "hi", "grammar_lazy": true,
                   "grammar_triggers": [{"type": 1, "value": "a"}]}),
            Some("grammar_lazy"),
            "needs a grammar or json_schema",
        ),
        (
            &c,
            json!({"prompt": "hi", "grammar": "root ::= \"a\"", "grammar_lazy": true}),
            Some("grammar_triggers"),
            "never applies",
        ),
        (
            &c,
            json!({"prompt": "hi", "grammar": "root ::= \"a\"", "grammar_lazy": true,
                   "grammar_triggers": [{"type": 2, "value": "a+"}]}),
            Some("grammar_triggers"),
            "pattern triggers are not supported",
        ),
        (
            &chat,
            json!({"messages": user, "grammar": "root ::= \"a\"",
                   "response_format": {"type": "json_object"}}),
            Some("response_format"),
            "give one",
        ),
        (
            &chat,
            json!({"messages": user, "response_format": {"type": "json_object"},
                   "ignore_eos": true}),
            Some("ignore_eos"),
            "cannot ignore the end of generation",
        ),
        (
            &chat,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            Some("messages"),
            "`image_url` is not supported",
        ),
        // Refused before the stream opens: a status, not an event.
        (
            &chat,
            json!({"messages": [{"role": "user", "content": too_long}], "stream": true}),
            Some("prompt"),
            "beyond the model's context",
        ),
    ];
    for (url, body, param, msg) in cases {
        let (code, got) = post(url, &body);
        assert_eq!(code, 400, "{body}: {got}");
        let e = &got["error"];
        assert_eq!(e["type"], "invalid_request_error", "{body}: {got}");
        assert_eq!(e["param"], json!(param), "{body}: {got}");
        let m = e["message"].as_str().unwrap();
        assert!(m.contains(msg), "{body}: {m:?} lacks {msg:?}");
    }
    // Not JSON at all.
    match ureq::post(&c).send_string("{not json") {
        Err(ureq::Error::Status(400, r)) => {
            let v: Value = r.into_json().unwrap();
            let m = v["error"]["message"].as_str().unwrap().to_string();
            assert!(m.starts_with("invalid request body"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    match ureq::get(&format!("{base}/v1/embeddings")).call() {
        Err(ureq::Error::Status(404, _)) => {}
        other => panic!("{other:?}"),
    }
    let h = get(&format!("{base}/health"));
    assert_eq!(h["completed"], 0, "{h}");
}

/// A streaming client that disconnects is cancelled at once (its request would run to the
/// context otherwise); one waiting in a full queue is answered 503; the engine is free again.
#[test]
fn leaving_clients_are_cancelled_and_a_full_queue_refuses() {
    let server = start(keydiff_cache(256, 128), 1);
    let base = server.url();
    let chat = format!("{base}/v1/chat/completions");
    let endless = json!({"messages": [{"role": "user", "content": "Count to a million."}],
                         "ignore_eos": true, "temperature": 0, "stream": true});

    // A: streams without end; read a few pieces, keep the connection.
    let a = ureq::post(&chat).send_json(&endless).unwrap();
    let mut a = BufReader::new(a.into_reader()).lines();
    for _ in 0..6 {
        a.next().unwrap().unwrap();
    }
    // B waits behind A; C finds the queue (of 1) full.
    let b_url = format!("{base}/v1/completions");
    let b = std::thread::spawn(move || {
        post(
            &b_url,
            &json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
        )
    });
    wait_health(&base, "B queued", |h| h["queued"] == 1 && h["running"] == 1);
    let (code, c) = post(&format!("{base}/v1/completions"), &json!({"prompt": "x"}));
    assert_eq!(code, 503, "{c}");
    assert!(
        c["error"]["message"].as_str().unwrap().contains("busy"),
        "{c}"
    );

    // A leaves: it is cancelled, and B runs.
    drop(a);
    let (code, got) = b.join().unwrap();
    assert_eq!(code, 200, "{got}");
    assert_eq!(got["usage"]["completion_tokens"], 4);
    let h = wait_health(&base, "A cancelled", |h| h["cancelled"] == 1);
    assert_eq!(h["completed"], 1, "{h}");
    assert_eq!(h["rejected"], 1, "{h}");
    assert_eq!(h["running"], 0, "{h}");
    assert_eq!(h["queued"], 0, "{h}");

    // A client of a whole (not streamed) answer that gives up is cancelled too.
    let mut whole = endless.clone();
    whole["stream"] = json!(false);
    let impatient = ureq::AgentBuilder::new()
        .timeout_read(Duration::from_secs(1))
        .build();
    assert!(impatient.post(&chat).send_json(&whole).is_err());
    let h = wait_health(&base, "the impatient client cancelled", |h| {
        h["cancelled"] == 2
    });
    assert_eq!(h["running"], 0, "{h}");

    // A client that leaves while queued frees its place at once, before the worker gets to
    // it: the next request queues instead of getting 503.
    let e = ureq::post(&chat).send_json(&endless).unwrap();
    let mut e = BufReader::new(e.into_reader()).lines();
    e.next().unwrap().unwrap();
    assert!(impatient.post(&chat).send_json(&whole).is_err());
    wait_health(&base, "the queue emptied", |h| {
        h["queued"] == 0 && h["running"] == 1
    });
    let g_url = format!("{base}/v1/completions");
    let g = std::thread::spawn(move || {
        post(
            &g_url,
            &json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0}),
        )
    });
    wait_health(&base, "G queued", |h| h["queued"] == 1);
    drop(e);
    let (code, got) = g.join().unwrap();
    assert_eq!(code, 200, "{got}");
    let h = get(&format!("{base}/health"));
    assert_eq!(h["rejected"], 1, "{h}");
}

/// `keydiff serve` end to end: it prints where it listens (port 0 takes a free one), answers,
/// and stops cleanly on SIGTERM.
#[test]
fn the_cli_serves_and_stops_on_sigterm() {
    use std::process::{Command, Stdio};
    let mut child = Command::new(keydiff_bin())
        .args(["serve", "-m", SMOLLM2, "--port", "0", "--budget", "128"])
        .current_dir(keydiff_tests::root())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let url = loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "serve exited early");
        if let Some(i) = line.find("http://") {
            let rest = &line[i..];
            break rest[..rest.find(' ').unwrap()].to_string();
        }
    };
    assert!(line.contains("policy keydiff, budget 128"), "{line}");
    let (code, got) = post(
        &format!("{url}/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0, "max_tokens": 16}),
    );
    assert_eq!(code, 200, "{got}");
    assert!(
        got["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("Paris"),
        "{got}"
    );
    assert_eq!(got["model"], "SmolLM2-135M-Instruct.Q4_1");

    // A stream that would run to the context is stopped by SIGTERM with an error event.
    let endless = json!({"messages": [{"role": "user", "content": "Count to a million."}],
                         "ignore_eos": true, "temperature": 0, "stream": true});
    let resp = ureq::post(&format!("{url}/v1/chat/completions"))
        .send_json(&endless)
        .unwrap();
    let mut lines = BufReader::new(resp.into_reader()).lines();
    for _ in 0..6 {
        lines.next().unwrap().unwrap();
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let error = rest
        .iter()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v.get("error").is_some())
        .unwrap_or_else(|| panic!("no error event in {rest:?}"));
    let m = error["error"]["message"].as_str().unwrap();
    assert!(m.contains("shutting down: generation stopped after"), "{m}");
    assert_eq!(
        rest.iter().rev().find(|l| !l.is_empty()).unwrap(),
        "data: [DONE]"
    );
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

/// `/tokenize` and `/detokenize` give the engine's tokens and text (the prompt tokens a
/// completion would count); `/metrics` reports the counters in Prometheus' text format.
#[test]
fn tokenize_detokenize_and_metrics() {
    let server = start(CacheConfig::full(128), 4);
    let base = server.url();
    let local = engine(CacheConfig::full(128));
    let text = "The capital of France is";
    let (code, t) = post(&format!("{base}/tokenize"), &json!({"prompt": text}));
    assert_eq!(code, 200, "{t}");
    let want = local.prompt_tokens(&Prompt::Text(text.into())).unwrap();
    assert_eq!(t["tokens"], json!(want));
    assert_eq!(t["count"], want.len());
    assert_eq!(t["max_model_len"], 8192);
    let msgs = vec![Message::new("user", "Hi")];
    let (_, t) = post(
        &format!("{base}/tokenize"),
        &json!({"messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(
        t["tokens"],
        json!(local.prompt_tokens(&Prompt::Chat(msgs)).unwrap())
    );
    let (code, e) = post(&format!("{base}/tokenize"), &json!({}));
    assert_eq!(code, 400, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("either"));

    let (_, d) = post(&format!("{base}/detokenize"), &json!({"tokens": want}));
    assert_eq!(d["prompt"], local.detokenize(&want).unwrap());
    let (code, e) = post(
        &format!("{base}/detokenize"),
        &json!({"tokens": [1, 99999999]}),
    );
    assert_eq!(code, 400, "{e}");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("outside the vocabulary"));

    let (_, done) = post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": text, "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(done["usage"]["completion_tokens"], 5);
    let m = ureq::get(&format!("{base}/metrics")).call().unwrap();
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    let m = m.into_string().unwrap();
    for line in [
        "keydiff_requests_total{outcome=\"completed\"} 1",
        "keydiff_requests_total{outcome=\"failed\"} 0",
        "keydiff_generated_tokens_total 5",
        &format!("keydiff_prompt_tokens_total {}", want.len()),
        "keydiff_time_to_first_token_seconds_count 1",
        "keydiff_requests_running 0",
        "# TYPE keydiff_prefill_seconds summary",
    ] {
        assert!(m.lines().any(|l| l == line), "{line:?} not in\n{m}");
    }
    let ttft: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("keydiff_time_to_first_token_seconds_sum "))
        .unwrap()
        .parse()
        .unwrap();
    let reported = done["keydiff"]["ttft_s"].as_f64().unwrap();
    assert!((ttft - reported).abs() < 1e-5, "{ttft} vs {reported}");
}

/// With an API key, every endpoint but `/health` needs `Authorization: Bearer <key>`.
#[test]
fn an_api_key_is_required_when_set() {
    let cfg = ServerConfig {
        api_key: Some("s3cret".into()),
        ..ServerConfig::new("smol")
    };
    let server = Server::bind("127.0.0.1:0", engine(CacheConfig::full(128)), cfg)
        .unwrap()
        .spawn();
    let base = server.url();
    let status = |path: &str, auth: Option<&str>| {
        let mut r = ureq::get(&format!("{base}{path}"));
        if let Some(a) = auth {
            r = r.set("Authorization", a);
        }
        match r.call() {
            Ok(r) => r.status(),
            Err(ureq::Error::Status(c, r)) => {
                if c == 401 {
                    let v: Value = r.into_json().unwrap();
                    assert!(v["error"]["message"].as_str().unwrap().contains("API key"));
                }
                c
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(status("/v1/models", None), 401);
    assert_eq!(status("/v1/models", Some("Bearer s3cre")), 401);
    assert_eq!(status("/v1/models", Some("Bearer s3cret!")), 401);
    assert_eq!(status("/v1/models", Some("s3cret")), 401);
    assert_eq!(status("/metrics", None), 401);
    assert_eq!(status("/v1/models", Some("Bearer s3cret")), 200);
    assert_eq!(status("/health", None), 200);
    match ureq::post(&format!("{base}/v1/completions")).send_json(json!({"prompt": "hi"})) {
        Err(ureq::Error::Status(401, _)) => {}
        other => panic!("{other:?}"),
    }
    let ok = ureq::post(&format!("{base}/v1/completions"))
        .set("Authorization", "Bearer s3cret")
        .send_json(json!({"prompt": "hi", "max_tokens": 2}))
        .unwrap();
    assert_eq!(ok.status(), 200);
}

/// `--prompt-cache continue` under a budget: the next turn goes on from the evicted cache
/// and answers as `Engine::chat_turn` does.
#[test]
fn continue_mode_goes_on_from_an_evicted_cache() {
    let cache = keydiff_cache(48, 16);
    let cfg = ServerConfig {
        prompt_cache: Some(keydiff::Reuse::Continue),
        ..ServerConfig::new("smol")
    };
    let server = Server::bind("127.0.0.1:0", engine(cache.clone()), cfg)
        .unwrap()
        .spawn();
    let url = format!("{}/v1/chat/completions", server.url());
    let local = engine(cache);
    let mut conv = keydiff::Conversation::new(None);
    let params = GenerateParams {
        max_tokens: 24,
        ..Default::default()
    };
    let mut messages: Vec<Value> = Vec::new();
    let mut held = 0;
    let mut evictions = 0;
    for user in [
        "What is the capital of France? Tell me about the city in detail.",
        "And the capital of Italy?",
    ] {
        let want = local.chat_turn(&mut conv, user, &params, |_| {}).unwrap();
        messages.push(json!({"role": "user", "content": user}));
        let (code, got) = post(
            &url,
            &json!({"messages": messages, "max_tokens": 24, "temperature": 0}),
        );
        assert_eq!(code, 200, "{got}");
        assert_eq!(got["choices"][0]["message"]["content"], want.text);
        assert_eq!(got["usage"]["prompt_tokens_details"]["cached_tokens"], held);
        let fed_reply = want.tokens.len() - 1; // the last sampled token is not fed
        held = got["usage"]["prompt_tokens"].as_u64().unwrap() as usize + fed_reply;
        messages.push(json!({"role": "assistant", "content": want.text}));
        evictions += got["keydiff"]["eviction"]["evictions"].as_u64().unwrap();
        assert!(got["keydiff"]["final_cache_len"].as_u64().unwrap() <= 48 + 16);
    }
    assert!(evictions > 0, "the server's cache must evict");
    let h = get(&format!("{}/health", server.url()));
    assert_eq!(h["prompt_cache"], "continue");
}

/// The `logprobs` arrays of completion chunks, joined in order.
fn joined_completion_logprobs(chunks: &[Value]) -> Value {
    let mut all =
        json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for c in chunks {
        let lp = &c["choices"][0]["logprobs"];
        if lp.is_null() {
            continue;
        }
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let more = lp[key].as_array().unwrap().clone();
            all[key].as_array_mut().unwrap().extend(more);
        }
    }
    all
}

/// Checks a completion's `logprobs` against the engine's tokens and log-probabilities:
/// `entries[i]` for `tokens[i]` (`None`: `null`), token texts, and text offsets into `text`.
fn check_completion_logprobs(
    local: &Engine,
    lp: &Value,
    text: &str,
    tokens: &[u32],
    entries: &[Option<&keydiff::TokenLogprob>],
) {
    let n = tokens.len();
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().unwrap().len(), n, "{key}: {lp}");
    }
    let pieces = local.token_pieces(tokens).unwrap();
    let chars: Vec<char> = text.chars().collect();
    for (i, (piece, entry)) in pieces.iter().zip(entries).enumerate() {
        assert_eq!(lp["tokens"][i], piece.text(), "token {i}");
        match entry {
            None => {
                assert!(lp["token_logprobs"][i].is_null());
                assert!(lp["top_logprobs"][i].is_null());
            }
            Some(e) => {
                let got = lp["token_logprobs"][i].as_f64().unwrap();
                assert!((got - e.logprob as f64).abs() < 1e-6, "token {i}");
                // The alternatives, and the chosen token (OpenAI: up to logprobs + 1).
                let top = lp["top_logprobs"][i].as_object().unwrap();
                for (id, l) in e.top.iter().chain([&(e.token, e.logprob)]) {
                    let key = local.token_pieces(&[*id]).unwrap()[0].text();
                    let got = top[&key].as_f64().unwrap();
                    assert!((got - *l as f64).abs() < 1e-6, "token {i}: {key:?}");
                }
                assert!(top.len() <= e.top.len() + 1);
            }
        }
        // Where a token is whole characters, the text has it at its offset.
        let at = lp["text_offset"][i].as_u64().unwrap() as usize;
        if let (false, Ok(s)) = (piece.special, std::str::from_utf8(&piece.bytes)) {
            if at < chars.len() {
                let here: String = chars[at..].iter().take(s.chars().count()).collect();
                assert_eq!(here, s, "token {i} at {at}");
            }
        }
    }
}

/// Logprobs as lm-evaluation-harness asks for them (`local-completions`: token ids, echo,
/// `logprobs: 1`, `max_tokens: 1`, scored as its `parse_logprobs` does) under a budget that
/// evicts: the continuation's log-likelihood and greediness are the engine's. Completions'
/// logprobs whole and streamed, echo streamed, chat's `logprobs`/`top_logprobs` whole and
/// streamed; `/tokenizer_info` and `/tokenize` without special tokens, which lm-eval's
/// remote tokenizer uses.
#[test]
fn logprobs_score_prompts_and_replies() {
    let cache = keydiff_cache(64, 32);
    let server = start(cache.clone(), 4);
    let base = server.url();
    let c = format!("{base}/v1/completions");
    let local = engine(cache);

    // lm-eval's loglikelihood request for (context, continuation).
    let context = format!(
        "{}\nQuestion: which animal jumps? Answer:",
        "The quick brown fox jumps over the lazy dog. ".repeat(12)
    );
    let ctx = local.prompt_tokens(&Prompt::Text(context.clone())).unwrap();
    let cont = local.tokenize_continuation(" The fox").unwrap();
    let ids: Vec<u32> = ctx.iter().chain(&cont).copied().collect();
    let body = json!({"model": "smol", "prompt": [ids], "temperature": 0, "max_tokens": 1,
                      "logprobs": 1, "seed": 1234, "echo": true});
    let (code, got) = post(&c, &body);
    assert_eq!(code, 200, "{got}");
    let want = local
        .generate(
            &GenerateParams {
                prompt: Prompt::Tokens(ids.clone()),
                max_tokens: 1,
                logprobs: Some(1),
                prompt_logprobs: Some(1),
                ..Default::default()
            },
            |_| {},
        )
        .unwrap();
    assert!(want.stats.eviction.evictions > 0, "the budget must evict");
    let choice = &got["choices"][0];
    let lp = &choice["logprobs"];
    // parse_logprobs: token_logprobs[ctxlen:-1], greedy where each is its top's maximum.
    let ctxlen = ctx.len();
    let scored = &lp["token_logprobs"].as_array().unwrap()[ctxlen..ids.len()];
    let tops = &lp["top_logprobs"].as_array().unwrap()[ctxlen..ids.len()];
    let loglik: f64 = scored.iter().map(|v| v.as_f64().unwrap()).sum();
    let greedy = scored.iter().zip(tops).all(|(t, top)| {
        let max = top
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        t.as_f64().unwrap() == max
    });
    let plp = want.prompt_logprobs.as_ref().unwrap();
    let want_loglik: f64 = plp[ctxlen - 1..].iter().map(|l| l.logprob as f64).sum();
    let want_greedy = plp[ctxlen - 1..].iter().all(|l| l.top[0].0 == l.token);
    assert!(
        (loglik - want_loglik).abs() < 1e-5,
        "{loglik} vs {want_loglik}"
    );
    assert_eq!(greedy, want_greedy);
    let echoed = local.detokenize(&ids).unwrap();
    let text = choice["text"].as_str().unwrap();
    assert_eq!(text, format!("{echoed}{}", want.text));
    let all_tokens: Vec<u32> = ids.iter().chain(&want.tokens).copied().collect();
    let entries: Vec<_> = std::iter::once(None)
        .chain(plp.iter().map(Some))
        .chain(want.logprobs.as_ref().unwrap().iter().map(Some))
        .collect();
    check_completion_logprobs(&local, lp, text, &all_tokens, &entries);

    // The same with `max_tokens: 0` (vLLM's form, older harnesses'): the prompt and its
    // logprobs only, whole and streamed; no completion tokens.
    let mut body0 = body.clone();
    body0["max_tokens"] = json!(0);
    let (code, got0) = post(&c, &body0);
    assert_eq!(code, 200, "{got0}");
    let choice0 = &got0["choices"][0];
    assert_eq!(choice0["text"], echoed.as_str(), "{got0}");
    assert_eq!(choice0["finish_reason"], "length", "{got0}");
    assert_eq!(got0["usage"]["completion_tokens"], 0, "{got0}");
    assert_eq!(got0["usage"]["prompt_tokens"], ids.len(), "{got0}");
    let entries0: Vec<_> = std::iter::once(None).chain(plp.iter().map(Some)).collect();
    check_completion_logprobs(&local, &choice0["logprobs"], &echoed, &ids, &entries0);
    body0["stream"] = json!(true);
    body0["stream_options"] = json!({"include_usage": true});
    let chunks = events(ureq::post(&c).send_json(&body0).unwrap());
    let joined: String = (chunks.iter())
        .filter_map(|ch| ch["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(joined, echoed);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 0, "{usage}");
    // Without echo, 0 is still refused.
    let (code, v) = post(&c, &json!({"prompt": "a", "max_tokens": 0}));
    assert_eq!(code, 400, "{v}");

    // Logprobs of a reply, whole and streamed; echo streamed. (With prompt logprobs every
    // prompt row goes through the LM head, without them only the last: the first reply
    // token's logits may differ in the last bits, so each is compared with its own kind.)
    let prompt = "Write a list of three fruits:";
    let reply = |prompt_logprobs| {
        let p = GenerateParams {
            prompt: Prompt::Text(prompt.into()),
            max_tokens: 10,
            logprobs: Some(3),
            prompt_logprobs,
            ..Default::default()
        };
        local.generate(&p, |_| {}).unwrap()
    };
    let want = reply(None);
    let body = json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 3});
    let (_, whole) = post(&c, &body);
    let lp = &whole["choices"][0]["logprobs"];
    let entries: Vec<_> = want.logprobs.as_ref().unwrap().iter().map(Some).collect();
    check_completion_logprobs(&local, lp, &want.text, &want.tokens, &entries);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let ev = events(ureq::post(&c).send_json(&streamed).unwrap());
    assert_eq!(&joined_completion_logprobs(&ev), lp);
    streamed["echo"] = json!(true);
    let ev = events(ureq::post(&c).send_json(&streamed).unwrap());
    let text: String = ev
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, format!("{prompt}{}", want.text));
    assert_eq!(
        ev[0]["choices"][0]["text"], prompt,
        "the echo opens the stream"
    );
    let want = reply(Some(3));
    assert_eq!(text, format!("{prompt}{}", want.text));
    let prompt_tokens = want.prompt_tokens.clone();
    let all_tokens: Vec<u32> = prompt_tokens.iter().chain(&want.tokens).copied().collect();
    let entries: Vec<_> = std::iter::once(None)
        .chain(want.prompt_logprobs.as_ref().unwrap().iter().map(Some))
        .chain(want.logprobs.as_ref().unwrap().iter().map(Some))
        .collect();
    check_completion_logprobs(
        &local,
        &joined_completion_logprobs(&ev),
        &text,
        &all_tokens,
        &entries,
    );

    // Chat: logprobs true with two alternatives, whole and streamed.
    let messages = vec![Message::new("user", "Name a colour.")];
    let want = local
        .generate(
            &GenerateParams {
                prompt: Prompt::Chat(messages),
                max_tokens: 6,
                logprobs: Some(2),
                ..Default::default()
            },
            |_| {},
        )
        .unwrap();
    let body = json!({"messages": [{"role": "user", "content": "Name a colour."}],
                      "max_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (code, whole) = post(&format!("{base}/v1/chat/completions"), &body);
    assert_eq!(code, 200, "{whole}");
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    let lps = want.logprobs.as_ref().unwrap();
    assert_eq!(content.len(), lps.len());
    let mut bytes = Vec::new();
    for (item, e) in content.iter().zip(lps) {
        let piece = &local.token_pieces(&[e.token]).unwrap()[0];
        assert_eq!(item["token"], piece.text());
        assert_eq!(item["bytes"], json!(piece.bytes));
        assert!((item["logprob"].as_f64().unwrap() - e.logprob as f64).abs() < 1e-6);
        let top = item["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        for (t, (id, l)) in top.iter().zip(&e.top) {
            assert_eq!(t["token"], local.token_pieces(&[*id]).unwrap()[0].text());
            assert!((t["logprob"].as_f64().unwrap() - *l as f64).abs() < 1e-6);
        }
        if !piece.special {
            bytes.extend(&piece.bytes);
        }
    }
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let ev = events(
        ureq::post(&format!("{base}/v1/chat/completions"))
            .send_json(&streamed)
            .unwrap(),
    );
    let joined: Vec<Value> = ev
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(&joined, content);
    // Without logprobs, none; `logprobs: false` and `top_logprobs: 0` ask for none either.
    let (_, plain) = post(
        &c,
        &json!({"prompt": prompt, "max_tokens": 2, "temperature": 0}),
    );
    assert!(plain["choices"][0]["logprobs"].is_null());
    let (code, off) = post(
        &c,
        &json!({"prompt": prompt, "max_tokens": 2, "logprobs": false, "top_logprobs": 0}),
    );
    assert_eq!(code, 200, "{off}");
    assert!(off["choices"][0]["logprobs"].is_null());

    // What lm-eval's remote tokenizer asks.
    let info = get(&format!("{base}/tokenizer_info"));
    let eos = local.eos_token().unwrap();
    assert_eq!(info["eos_token"], eos);
    assert_eq!(info["model_max_length"], 8192);
    assert!(info["chat_template"].as_str().unwrap().contains("im_start"));
    let (_, t) = post(
        &format!("{base}/tokenize"),
        &json!({"prompt": eos, "add_special_tokens": false}),
    );
    let eos_id = local.tokenize_special(&eos).unwrap();
    assert_eq!(eos_id.len(), 1);
    assert_eq!(t["tokens"], json!(eos_id));
    // By default, as a completion's text prompt: in the model's format, the special token's
    // text parsed (vLLM's and llama-server's way).
    let (_, t) = post(&format!("{base}/tokenize"), &json!({ "prompt": eos }));
    assert_eq!(t["tokens"], json!(local.tokenize(&eos, true).unwrap()));
    assert_ne!(
        local.prompt_tokens(&Prompt::Text(eos.clone())).unwrap(),
        local.tokenize(&eos, true).unwrap()
    );
    let (_, t) = post(
        &format!("{base}/tokenize"),
        &json!({"prompt": "Hello world", "add_special_tokens": false}),
    );
    assert_eq!(
        t["tokens"],
        json!(local.tokenize_continuation("Hello world").unwrap())
    );
    server.stop().unwrap();
}

/// Continuous batching (`max_batch` 4, two chunks of prompt a step): requests that come while
/// one runs join it instead of waiting for its end, each answer (whole or streamed) is the
/// engine's for that request alone, a client that leaves cancels only its own request, and
/// /health counts the batch.
#[test]
fn requests_run_together_with_max_batch() {
    let cache = keydiff_cache(64, 32);
    let server = start_batched(cache.clone(), 4, Some(64));
    let base = server.url();
    let chat = format!("{base}/v1/chat/completions");
    let completions = format!("{base}/v1/completions");
    let local = engine(cache);

    // A streams without end; B and C come while it runs and finish before it does.
    let endless = json!({"messages": [{"role": "user", "content": "Count to a million."}],
                         "ignore_eos": true, "temperature": 0, "stream": true});
    let a = ureq::post(&chat).send_json(&endless).unwrap();
    let mut a = BufReader::new(a.into_reader()).lines();
    for _ in 0..4 {
        a.next().unwrap().unwrap();
    }
    let prompts = [
        format!(
            "{}\nQuestion: what does the text repeat? Answer:",
            "The quick brown fox jumps over the lazy dog. ".repeat(12)
        ),
        "The capital of France is".to_string(),
    ];
    let clients: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let url = completions.clone();
            let body = json!({"prompt": p, "max_tokens": 10 + 4 * i, "temperature": 0,
                              "stream": i == 1});
            std::thread::spawn(move || {
                if i == 1 {
                    let chunks = events(ureq::post(&url).send_json(&body).unwrap());
                    let text: String = chunks
                        .iter()
                        .filter_map(|c| c["choices"][0]["text"].as_str())
                        .collect();
                    (200, json!({"choices": [{"text": text}]}))
                } else {
                    post(&url, &body)
                }
            })
        })
        .collect();
    for (i, (c, p)) in clients.into_iter().zip(&prompts).enumerate() {
        let (code, got) = c.join().unwrap();
        assert_eq!(code, 200, "{got}");
        let want = local
            .generate(&greedy(Prompt::Text(p.clone()), 10 + 4 * i), |_| {})
            .unwrap();
        assert_eq!(got["choices"][0]["text"], want.text, "request {i}");
    }
    // A still runs: B and C did not wait for it.
    let h = get(&format!("{base}/health"));
    assert_eq!(h["running"], 1, "{h}");
    assert_eq!(h["completed"], 2, "{h}");
    for _ in 0..4 {
        a.next().unwrap().unwrap();
    }
    drop(a);
    let h = wait_health(&base, "A cancelled", |h| h["cancelled"] == 1);
    assert_eq!(h["running"], 0, "{h}");
    assert_eq!(h["failed"], 0, "{h}");
}

/// The engine's completion `i` of `n` for `prompt`, sampled at temperature 0.9 from `seed`:
/// what a request with `n` > 1 must answer as its choice `i` (seed + i).
fn sampled(local: &Engine, prompt: Prompt, seed: u64, i: usize, max: usize) -> keydiff::Output {
    let mut p = greedy(prompt, max);
    p.sampling.temperature = 0.9;
    p.sampling.seed = seed + i as u64;
    local.generate(&p, |_| {}).unwrap()
}

/// `n` > 1: one prompt, prefilled once under a budget that evicts, answered with a choice per
/// completion, each the request alone with seed + i: whole (completions, with logprobs) and
/// streamed (chat, each choice's role, text and one last chunk), one at a time and under
/// `--max-batch` (beside another request, and with more completions than the batch holds).
#[test]
fn several_completions_per_request() {
    let cache = keydiff_cache(64, 32);
    let local = engine(cache.clone());
    let doc = format!(
        "{}\nA new story. Once upon a time",
        "The quick brown fox jumps over the lazy dog. ".repeat(12)
    );
    let whole = json!({"prompt": doc, "max_tokens": 8, "temperature": 0.9, "seed": 5,
                       "n": 3, "logprobs": 1});
    let check_whole = |got: &Value, what: &str| {
        let choices = got["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3, "{what}: {got}");
        let mut tokens = 0;
        for (i, c) in choices.iter().enumerate() {
            let want = sampled(&local, Prompt::Text(doc.clone()), 5, i, 8);
            assert!(
                want.stats.eviction.evictions > 0,
                "the budget never evicted"
            );
            assert_eq!(c["index"], i, "{what}");
            assert_eq!(c["text"], want.text, "{what}: choice {i}");
            assert_eq!(
                c["logprobs"]["tokens"].as_array().unwrap().len(),
                want.tokens.len()
            );
            assert_eq!(
                c["keydiff"]["eviction"]["evictions"],
                want.stats.eviction.evictions
            );
            tokens += want.tokens.len();
        }
        let texts: Vec<&Value> = choices.iter().map(|c| &c["text"]).collect();
        assert!(
            texts[0] != texts[1] || texts[1] != texts[2],
            "{what}: one text"
        );
        let u = &got["usage"];
        assert_eq!(u["completion_tokens"], tokens, "{what}: {u}");
        let prompt_tokens = local
            .prompt_tokens(&Prompt::Text(doc.clone()))
            .unwrap()
            .len();
        assert_eq!(u["prompt_tokens"], prompt_tokens, "{what}: {u}");
    };
    let question = vec![Message::new("user", "Name a colour and a fruit.")];
    let streamed = json!({"messages": [{"role": "user", "content": question[0].content}],
                          "max_tokens": 12, "temperature": 0.9, "seed": 9, "n": 2,
                          "stream": true, "stream_options": {"include_usage": true}});
    let check_stream = |chunks: &[Value]| {
        let mut texts = [String::new(), String::new()];
        let (mut roles, mut lasts) = ([0; 2], [0; 2]);
        for c in &chunks[..chunks.len() - 1] {
            let choice = &c["choices"][0];
            let i = choice["index"].as_u64().unwrap() as usize;
            if choice["delta"]["role"] == "assistant" {
                roles[i] += 1;
            }
            if let Some(t) = choice["delta"]["content"].as_str() {
                texts[i].push_str(t);
            }
            if !choice["finish_reason"].is_null() {
                lasts[i] += 1;
            }
        }
        assert_eq!((roles, lasts), ([1, 1], [1, 1]), "{chunks:?}");
        let mut tokens = 0;
        for (i, text) in texts.iter().enumerate() {
            let want = sampled(&local, Prompt::Chat(question.clone()), 9, i, 12);
            assert_eq!(text, &want.text, "streamed choice {i}");
            tokens += want.tokens.len();
        }
        let usage = &chunks[chunks.len() - 1]["usage"];
        assert_eq!(usage["completion_tokens"], tokens, "{usage}");
    };

    // One at a time.
    let server = start(cache.clone(), 4);
    let base = server.url();
    let (code, got) = post(&format!("{base}/v1/completions"), &whole);
    assert_eq!(code, 200, "{got}");
    check_whole(&got, "one at a time");
    let resp = ureq::post(&format!("{base}/v1/chat/completions"))
        .send_json(&streamed)
        .unwrap();
    check_stream(&events(resp));
    let h = get(&format!("{base}/health"));
    assert_eq!(
        (&h["completed"], &h["failed"]),
        (&json!(2), &json!(0)),
        "{h}"
    );
    drop(server);

    // Batched: three completions beside another request in a batch of 4, then three in a
    // batch of 2 (they run alone, together).
    for max_batch in [4, 2] {
        let server = start_batched(cache.clone(), max_batch, None);
        let base = server.url();
        let url = format!("{base}/v1/chat/completions");
        let body = streamed.clone();
        let other = std::thread::spawn(move || events(ureq::post(&url).send_json(&body).unwrap()));
        let (code, got) = post(&format!("{base}/v1/completions"), &whole);
        assert_eq!(code, 200, "{got}");
        check_whole(&got, &format!("max batch {max_batch}"));
        check_stream(&other.join().unwrap());
    }
}

/// Integer fields take whole floats (`2.0`), as vLLM's pydantic models and llama-server's JSON
/// reader do; a fraction is refused.
#[test]
fn integer_fields_take_whole_floats() {
    let server = start(CacheConfig::full(64), 4);
    let whole = json!({"prompt": "Once upon a time", "max_tokens": 3.0, "n": 2.0,
                       "top_k": 40.0, "seed": 7.0, "temperature": 0.5});
    let ints = json!({"prompt": "Once upon a time", "max_tokens": 3, "n": 2, "top_k": 40,
                      "seed": 7, "temperature": 0.5});
    let url = format!("{}/v1/completions", server.url());
    let (code, a) = post(&url, &whole);
    assert_eq!(code, 200, "{a}");
    let (_, b) = post(&url, &ints);
    let texts = |v: &Value| -> Vec<Value> {
        let choices = v["choices"].as_array().unwrap();
        choices.iter().map(|c| c["text"].clone()).collect()
    };
    assert_eq!(texts(&a), texts(&b));
    assert_eq!(a["usage"]["completion_tokens"], 6, "{a}");
    let llama = format!("{}/completion", server.url());
    let (code, v) = post(&llama, &json!({"prompt": "Hi", "n_predict": 2.0}));
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tokens_predicted"], 2, "{v}");
    for bad in [json!(2.5), json!(-1.0)] {
        let (code, v) = post(&url, &json!({"prompt": "Hi", "max_tokens": bad}));
        assert_eq!(code, 400, "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("invalid value"), "{m}");
    }
}

/// `response_format: {"type": "json_object"}`: the reply, whole and streamed, is one JSON
/// object, the one the engine gives in JSON mode.
#[test]
fn json_object_replies() {
    let server = start(CacheConfig::full(64), 4);
    let url = format!("{}/v1/chat/completions", server.url());
    let local = engine(CacheConfig::full(64));
    let content = "Describe a grey cat called Tom, aged 3, as JSON with keys name, age, colour.";
    let mut params = greedy(Prompt::Chat(vec![Message::new("user", content)]), 96);
    params.sampling.format = keydiff::Format::JsonObject;
    let want = local.generate(&params, |_| {}).unwrap();
    assert_eq!(want.stats.stop_reason, StopReason::Eos, "{:?}", want.text);
    let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 96,
                      "temperature": 0, "response_format": {"type": "json_object"}});
    let (code, got) = post(&url, &body);
    assert_eq!(code, 200, "{got}");
    let text = got["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text, want.text);
    let v: Value = serde_json::from_str(text).unwrap();
    assert!(v.is_object(), "{v}");
    assert_eq!(got["choices"][0]["finish_reason"], "stop");
    let mut body = body;
    body["stream"] = json!(true);
    let chunks = events(ureq::post(&url).send_json(&body).unwrap());
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, want.text);
}

/// The engine's reply to `content` in JSON mode, greedy, up to 96 tokens.
fn local_json_mode_text(e: &Engine, content: &str) -> String {
    let mut params = greedy(Prompt::Chat(vec![Message::new("user", content)]), 96);
    params.sampling.format = keydiff::Format::JsonObject;
    e.generate(&params, |_| {}).unwrap().text
}

/// `response_format: {"type": "json_schema"}` on chat and llama.cpp's `grammar` on
/// completions: the reply, whole and streamed, is the one the engine gives under the same
/// grammar, and a value of the schema.
#[test]
fn json_schema_and_grammar_replies() {
    let server = start(CacheConfig::full(64), 4);
    let local = engine(CacheConfig::full(64));
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "colour": {"enum": ["grey", "black"]}}, "required": ["name", "age", "colour"]});
    let content = "Describe a grey cat called Tom, aged 3, as JSON.";
    let mut params = greedy(Prompt::Chat(vec![Message::new("user", content)]), 96);
    params.sampling.format =
        keydiff::Format::Grammar(keydiff::json_schema::to_grammar(&schema).unwrap());
    let want = local.generate(&params, |_| {}).unwrap();
    assert_eq!(want.stats.stop_reason, StopReason::Eos, "{:?}", want.text);
    let url = format!("{}/v1/chat/completions", server.url());
    let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 96,
                      "temperature": 0, "response_format": {"type": "json_schema",
                      "json_schema": {"name": "cat", "strict": true, "schema": schema}}});
    let (code, got) = post(&url, &body);
    assert_eq!(code, 200, "{got}");
    let text = got["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text, want.text);
    let v: Value = serde_json::from_str(text).unwrap();
    let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["name", "age", "colour"], "{v}");
    // llama-server's form: the schema beside `json_object` (it used to be dropped, and the
    // reply was any object).
    let mut beside = body.clone();
    beside["response_format"] = json!({"type": "json_object", "schema": schema});
    let (code, got) = post(&url, &beside);
    assert_eq!(code, 200, "{got}");
    assert_eq!(got["choices"][0]["message"]["content"], want.text, "{got}");
    // A schema of any value (`{}`, `true`) leaves JSON mode's object: asked for a number,
    // the reply is still an object (under the any-value grammar it was a number).
    let seven = "Reply with just the number 7.";
    let json_mode = local_json_mode_text(&local, seven);
    assert!(json_mode.trim_start().starts_with('{'), "{json_mode:?}");
    for any in [json!({}), json!(true)] {
        let body = json!({"messages": [{"role": "user", "content": seven}], "max_tokens": 96,
            "temperature": 0, "response_format": {"type": "json_object", "schema": any}});
        let (code, got) = post(&url, &body);
        assert_eq!(code, 200, "{got}");
        assert_eq!(got["choices"][0]["message"]["content"], json_mode, "{got}");
    }
    let mut body = body;
    body["stream"] = json!(true);
    let chunks = events(ureq::post(&url).send_json(&body).unwrap());
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, want.text);

    let grammar = "root ::= \" a \" (\"cat\" | \"dog\") \" named \" [A-Z] [a-z]{1,8} \".\"";
    let mut params = greedy(Prompt::Text("My pet is".into()), 32);
    params.sampling.format = keydiff::Format::Grammar(grammar.into());
    let want = local.generate(&params, |_| {}).unwrap();
    let (code, got) = post(
        &format!("{}/v1/completions", server.url()),
        &json!({"prompt": "My pet is", "max_tokens": 32, "temperature": 0, "grammar": grammar}),
    );
    assert_eq!(code, 200, "{got}");
    let text = got["choices"][0]["text"].as_str().unwrap();
    assert_eq!(text, want.text);
    assert!(
        text.starts_with(" a cat named ") || text.starts_with(" a dog named "),
        "{text:?}"
    );
    assert_eq!(got["choices"][0]["finish_reason"], "stop");
    // llama.cpp's lazy grammar: free text until a trigger (here the plain reply's second
    // word), then the grammar from the trigger on; a trigger that never comes leaves the
    // reply as it is.
    let plain = local
        .generate(&greedy(Prompt::Text("My pet is".into()), 32), |_| {})
        .unwrap()
        .text;
    let word = plain.split_whitespace().nth(1).unwrap().to_string();
    let cut = plain.find(&word).unwrap() + word.len();
    let lazy = format!("root ::= {word:?} \"!!!\"");
    let mut params = greedy(Prompt::Text("My pet is".into()), 32);
    params.sampling.format = keydiff::Format::Lazy {
        grammar: lazy.clone(),
        triggers: vec![word.clone()],
        at_start: Vec::new(),
        reasoning: None,
    };
    let want = local.generate(&params, |_| {}).unwrap();
    assert_eq!(want.text, format!("{}!!!", &plain[..cut]));
    let never = "root ::= \"zebra-unicorn\" \"!!!\"".to_string();
    for (grammar, trigger, expect) in [
        (&lazy, json!({"type": 1, "value": word}), &want.text),
        (&lazy, json!({"type": "word", "value": word}), &want.text),
        (&never, json!({"type": 1, "value": "zebra-unicorn"}), &plain),
    ] {
        let (code, got) = post(
            &format!("{}/completion", server.url()),
            &json!({"prompt": "My pet is", "n_predict": 32, "temperature": 0,
                    "grammar": grammar, "grammar_lazy": true, "grammar_triggers": [trigger]}),
        );
        assert_eq!(code, 200, "{got}");
        assert_eq!(got["content"].as_str().unwrap(), expect, "{trigger}");
    }
}

/// `best_of`: of 4 completions (seeds seed + i, prefilled once), the 2 whose tokens have the
/// highest mean logprob, best first, as the engine ranks them; `usage` counts all 4; the
/// logprobs used to rank them are not sent when not asked for.
#[test]
fn best_of_returns_the_most_likely() {
    let server = start(CacheConfig::full(64), 4);
    let url = format!("{}/v1/completions", server.url());
    let local = engine(CacheConfig::full(64));
    let mut runs: Vec<(f64, keydiff::Output, u64)> = (0..4)
        .map(|i| {
            let mut p = greedy(Prompt::Text("Once upon a time".into()), 8);
            p.sampling.temperature = 1.0;
            p.sampling.seed = 21 + i;
            p.logprobs = Some(0);
            let out = local.generate(&p, |_| {}).unwrap();
            let lps = out.logprobs.as_deref().unwrap();
            let mean = lps.iter().map(|l| l.logprob as f64).sum::<f64>() / lps.len() as f64;
            (mean, out, i)
        })
        .collect();
    let tokens: usize = runs.iter().map(|(_, o, _)| o.tokens.len()).sum();
    runs.sort_by(|a, b| b.0.total_cmp(&a.0));
    assert!(runs[1].0 > runs[2].0, "the test needs a clear second best");
    let order: Vec<u64> = runs.iter().map(|r| r.2).collect();
    assert_ne!(
        order[..2],
        [0, 1],
        "the test needs a ranking other than the seeds' order"
    );
    let body = json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0,
                      "seed": 21, "n": 2, "best_of": 4});
    let (code, got) = post(&url, &body);
    assert_eq!(code, 200, "{got}");
    let choices = got["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{got}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], runs[i].1.text, "choice {i}");
        assert!(c["logprobs"].is_null(), "{c}");
    }
    assert_eq!(got["usage"]["completion_tokens"], tokens, "{got}");
}

/// A batch of prompts in one completions request (a string and token ids), `n` choices each,
/// echoed with logprobs: choice k·n + j is completion j of prompt k, equal to the engine's;
/// `usage` counts each prompt once. One at a time, and under `--max-batch 2`, where three
/// prompts join as room frees.
#[test]
fn a_batch_of_prompts() {
    let local = engine(CacheConfig::full(64));
    let texts = [
        "Once upon a time",
        "The capital of France is",
        "Water boils at",
    ];
    let ids = local.prompt_tokens(&Prompt::Text(texts[1].into())).unwrap();
    let want: Vec<keydiff::Output> = texts
        .iter()
        .map(|t| {
            local
                .generate(&greedy(Prompt::Text(t.to_string()), 6), |_| {})
                .unwrap()
        })
        .collect();
    let prompt_tokens = |k: usize| want[k].stats.prompt_tokens;
    let check = |got: &Value, prompts: usize, n: usize, echo: bool| {
        let choices = got["choices"].as_array().unwrap();
        assert_eq!(choices.len(), prompts * n, "{got}");
        for (i, c) in choices.iter().enumerate() {
            let k = i / n;
            assert_eq!(c["index"], i);
            let text = match echo {
                true => format!("{}{}", texts[k], want[k].text),
                false => want[k].text.clone(),
            };
            assert_eq!(c["text"], text, "choice {i}");
            if echo {
                let tokens = c["logprobs"]["tokens"].as_array().unwrap();
                assert_eq!(tokens.len(), prompt_tokens(k) + want[k].tokens.len(), "{c}");
            }
        }
        let u = &got["usage"];
        let prompt: usize = (0..prompts).map(prompt_tokens).sum();
        let completion: usize = (0..prompts).map(|k| n * want[k].tokens.len()).sum();
        assert_eq!(u["prompt_tokens"], prompt, "{u}");
        assert_eq!(u["completion_tokens"], completion, "{u}");
    };
    let server = start(CacheConfig::full(64), 4);
    let url = format!("{}/v1/completions", server.url());
    let body = json!({"prompt": [texts[0], ids], "max_tokens": 6, "temperature": 0, "n": 2,
                      "echo": true, "logprobs": 1});
    let (code, got) = post(&url, &body);
    assert_eq!(code, 200, "{got}");
    check(&got, 2, 2, true);
    drop(server);
    let server = start_batched(CacheConfig::full(64), 2, None);
    let url = format!("{}/v1/completions", server.url());
    let (code, got) = post(
        &url,
        &json!({"prompt": texts, "max_tokens": 6, "temperature": 0}),
    );
    assert_eq!(code, 200, "{got}");
    check(&got, 3, 1, false);
    let h = get(&format!("{}/health", server.url()));
    assert_eq!(
        (&h["completed"], &h["failed"]),
        (&json!(1), &json!(0)),
        "{h}"
    );
}

/// llama.cpp's own `/completion`: special-token text in the prompt is parsed (as llama.cpp
/// does), the answer is the engine's greedy text in llama.cpp's form, whole and streamed.
#[test]
fn llama_cpp_completion_endpoint() {
    let local = engine(keydiff_cache(64, 32));
    let server = start(keydiff_cache(64, 32), 4);
    let text = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n";
    let ids = local.tokenize(text, true).unwrap();
    assert!(ids.len() + 10 < local.tokenize(text, false).unwrap().len());
    let want = local
        .generate(
            &GenerateParams {
                prompt: Prompt::Tokens(ids.clone()),
                max_tokens: 8,
                sampling: keydiff::Sampling {
                    top_k: 40,
                    top_p: 0.95,
                    min_p: 0.05,
                    ..Default::default()
                },
                ..Default::default()
            },
            |_| {},
        )
        .unwrap();
    for path in ["/completion", "/completions"] {
        let url = format!("{}{path}", server.url());
        let body = json!({"prompt": text, "n_predict": 8, "temperature": 0});
        let (code, v) = post(&url, &body);
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["content"], want.text.as_str(), "{v}");
        assert_eq!(v["tokens_evaluated"], ids.len());
        assert_eq!(v["tokens_predicted"], 8);
        assert_eq!(v["stop"], true);
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let r = ureq::post(&url).send_json(&streamed).unwrap();
        let chunks: Vec<Value> = BufReader::new(r.into_reader())
            .lines()
            .map(|l| l.unwrap())
            .filter_map(|l| {
                l.strip_prefix("data: ")
                    .map(|d| serde_json::from_str(d).unwrap())
            })
            .collect();
        let joined: String = chunks
            .iter()
            .filter_map(|c| c["content"].as_str())
            .collect();
        assert_eq!(joined, want.text);
        assert_eq!(chunks.last().unwrap()["stop"], true);
    }
    // The OpenAI endpoint reads a text prompt the same way (as vLLM and llama-server do), in
    // a batch too, and echoes the text as given.
    let url = format!("{}/v1/completions", server.url());
    let (code, v) = post(
        &url,
        &json!({"prompt": [text, text], "max_tokens": 8, "temperature": 0, "echo": true}),
    );
    assert_eq!(code, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["text"], format!("{text}{}", want.text), "{v}");
    }
    assert_eq!(v["usage"]["prompt_tokens"], 2 * ids.len(), "{v}");
    let (code, v) = post(&url, &json!({"prompt": ["a", ""], "max_tokens": 1}));
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("prompt 1: "),
        "{v}"
    );
    let url = format!("{}/completion", server.url());
    // llama.cpp's samplers as letters: temperature (0: greedy) and top-k listed.
    let (code, v) = post(
        &url,
        &json!({"prompt": text, "n_predict": 8, "temperature": 0, "samplers": "kt"}),
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["content"], want.text.as_str(), "{v}");
    for (body, param) in [
        (json!({"prompt": "a", "samplers": 3}), "samplers"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": ""}), "prompt"),
        (json!({"prompt": "a", "repeat_last_n": -2}), "repeat_last_n"),
    ] {
        let (code, v) = post(&url, &body);
        assert_eq!(code, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    server.stop().unwrap();
}

/// llama.cpp's `logit_bias` (pairs of an id or a text and a number or `false`, or an object)
/// and `n_probs` on `/completion`; its samplers keydiff does not have, refused unless off; vLLM's
/// `stop_token_ids`, and its fields keydiff does not have, refused unless they ask for
/// nothing; seeds and `repeat_last_n` as integers of any sign.
#[test]
fn logit_bias_stop_tokens_and_unsupported_samplers() {
    let local = engine(CacheConfig::full(32));
    let server = start(CacheConfig::full(32), 4);
    let text = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n";
    let ids = local.tokenize(text, true).unwrap();
    let greedy_with = |bias: Vec<(u32, f32)>, stop_tokens: Vec<u32>| {
        let mut p = greedy(Prompt::Tokens(ids.clone()), 8);
        p.sampling.logit_bias = bias;
        p.stop_tokens = stop_tokens;
        local.generate(&p, |_| {}).unwrap()
    };
    let plain = greedy_with(vec![], vec![]);
    let first = plain.tokens[0];
    let banned = greedy_with(vec![(first, f32::NEG_INFINITY)], vec![]);
    assert_ne!(banned.tokens[0], first);
    let first_text = local.detokenize(&[first]).unwrap();
    let text_ids = local.tokenize_continuation(&first_text).unwrap();
    let text_banned = greedy_with(
        text_ids.iter().map(|&t| (t, f32::NEG_INFINITY)).collect(),
        vec![],
    );
    let lowered = greedy_with(vec![(first, -1.5)], vec![]);
    let url = format!("{}/completion", server.url());
    for (bias, want) in [
        (json!([[first, false]]), &banned),
        (json!({ first.to_string(): false }), &banned),
        (json!([[first_text, false]]), &text_banned),
        (json!([[first, -1.5]]), &lowered),
        (json!([]), &plain),
    ] {
        let body = json!({"prompt": text, "n_predict": 8, "temperature": 0, "logit_bias": bias});
        let (code, v) = post(&url, &body);
        assert_eq!(code, 200, "{body}: {v}");
        assert_eq!(v["content"], want.text.as_str(), "{body}: {v}");
    }
    for bias in [
        json!([[first, true]]),
        json!([[first]]),
        json!([[-1, 1.0]]),
        json!([["", 1.0]]),
        json!("x"),
        json!([[1_000_000, 1.0]]),
    ] {
        let (code, v) = post(&url, &json!({"prompt": text, "logit_bias": bias}));
        assert_eq!(code, 400, "{bias}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("logit bias") || msg.contains("logit_bias"),
            "{bias}: {v}"
        );
    }
    // llama.cpp's stopping_word: the stop string that ended the reply.
    let words: Vec<&str> = plain.text.split_inclusive(' ').collect();
    let stop = words.get(1).copied().unwrap_or(&plain.text[1..]).trim();
    assert!(!stop.is_empty(), "{:?}", plain.text);
    let body = json!({"prompt": text, "n_predict": 8, "temperature": 0,
        "stop": ["never-said", stop]});
    let (code, v) = post(&url, &body);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["stop_type"], "word", "{v}");
    assert_eq!(v["stopping_word"], stop, "{v}");
    let (_, v) = post(
        &url,
        &json!({"prompt": text, "n_predict": 2, "temperature": 0}),
    );
    assert_eq!(v["stopping_word"], "", "{v}");

    // n_probs: each token's log-probability and its alternatives', before sampling, whole
    // and streamed.
    let mut p = greedy(Prompt::Tokens(ids.clone()), 4);
    p.logprobs = Some(3);
    let scored = local.generate(&p, |_| {}).unwrap();
    let lps = scored.logprobs.as_ref().unwrap();
    let body = json!({"prompt": text, "n_predict": 4, "temperature": 0, "n_probs": 3});
    let (code, v) = post(&url, &body);
    assert_eq!(code, 200, "{v}");
    let probs = v["completion_probabilities"].as_array().unwrap();
    assert_eq!(probs.len(), 4, "{v}");
    for (p, want) in probs.iter().zip(lps) {
        assert_eq!(p["id"], want.token, "{p}");
        assert!((p["logprob"].as_f64().unwrap() - want.logprob as f64).abs() < 1e-5);
        let piece = &local.token_pieces(&[want.token]).unwrap()[0];
        assert_eq!(p["bytes"], json!(piece.bytes), "{p}");
        let top: Vec<u64> = (p["top_logprobs"].as_array().unwrap().iter())
            .map(|t| t["id"].as_u64().unwrap())
            .collect();
        let want_top: Vec<u64> = want.top.iter().map(|t| t.0 as u64).collect();
        assert_eq!(top, want_top, "{p}");
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = ureq::post(&url).send_json(&streamed).unwrap();
    let joined: Vec<Value> = BufReader::new(r.into_reader())
        .lines()
        .filter_map(|l| l.unwrap().strip_prefix("data: ").map(str::to_string))
        .flat_map(|d| {
            let c: Value = serde_json::from_str(&d).unwrap();
            c["completion_probabilities"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(&joined, probs);
    for (field, on) in [("n_probs", json!(21)), ("post_sampling_probs", json!(true))] {
        let (code, v) = post(&url, &json!({"prompt": text, "n_probs": 2, field: on}));
        assert_eq!(code, 400, "{field}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
    }

    // llama.cpp's other samplers: off is answered, on is refused by name.
    let off = json!({"prompt": text, "n_predict": 2, "n_probs": 0, "post_sampling_probs": false,
        "typical_p": 1.0,
        "mirostat": 0, "dynatemp_range": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
        "top_n_sigma": -1.0});
    let (code, v) = post(&url, &off);
    assert_eq!(code, 200, "{v}");
    for (field, on) in [
        ("post_sampling_probs", json!(true)),
        ("typical_p", json!(0.5)),
        ("mirostat", json!(2)),
        ("dynatemp_range", json!(0.5)),
        ("dry_multiplier", json!(0.8)),
        ("xtc_probability", json!(0.5)),
        ("top_n_sigma", json!(1.0)),
    ] {
        let mut body = off.clone();
        body[field] = on.clone();
        let (code, v) = post(&url, &body);
        assert_eq!(code, 400, "{field}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        // llama-server reads them on its OpenAI endpoints too: refused there as well (they
        // used to be dropped as unknown fields).
        for (path, mut body) in [
            ("/v1/completions", json!({"prompt": text, "max_tokens": 2})),
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
            ),
        ] {
            let v1 = format!("{}{path}", server.url());
            assert_eq!(post(&v1, &body).0, 200, "{path}");
            body[field] = on.clone();
            let (code, v) = post(&v1, &body);
            assert_eq!(code, 400, "{path} {field}: {v}");
            assert_eq!(v["error"]["param"], field, "{v}");
        }
    }

    // The samplers' order: llama.cpp's on its endpoint (top-p and min-p at temperature 1,
    // then the temperature), vLLM's on the OpenAI one (the temperature first).
    let sampled = |temperature_first| {
        let mut p = greedy(Prompt::Tokens(ids.clone()), 12);
        p.sampling = keydiff::Sampling {
            temperature: 1.5,
            top_p: 0.6,
            min_p: 0.02,
            seed: 11,
            temperature_first,
            ..Default::default()
        };
        local.generate(&p, |_| {}).unwrap().text
    };
    let (llama_order, vllm_order) = (sampled(false), sampled(true));
    assert_ne!(
        llama_order, vllm_order,
        "the test must tell the orders apart"
    );
    let knobs = json!({"temperature": 1.5, "top_p": 0.6, "min_p": 0.02, "seed": 11,
        "top_k": 0, "repeat_penalty": 1.0});
    let mut body = json!({"prompt": text, "n_predict": 12});
    body.as_object_mut()
        .unwrap()
        .extend(knobs.as_object().unwrap().clone());
    let (code, v) = post(&url, &body);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["content"], llama_order.as_str(), "{v}");
    let mut body = json!({"prompt": ids, "max_tokens": 12});
    body.as_object_mut()
        .unwrap()
        .extend(knobs.as_object().unwrap().clone());
    let (code, v) = post(&format!("{}/v1/completions", server.url()), &body);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], vllm_order.as_str(), "{v}");

    // vLLM's stop_token_ids: the reply ends before the first of them, as at an EOS.
    let stop = plain.tokens[3];
    let k = plain.tokens.iter().position(|&t| t == stop).unwrap();
    let stopped = greedy_with(vec![], vec![stop]);
    assert_eq!(stopped.tokens, plain.tokens[..=k]);
    assert_eq!(stopped.stats.stop_reason, StopReason::Eos);
    let url = format!("{}/v1/completions", server.url());
    let body = json!({"prompt": ids, "max_tokens": 8, "temperature": 0,
        "stop_token_ids": [stop]});
    let (code, v) = post(&url, &body);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], stopped.text.as_str(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], k + 1, "{v}");
    let (code, v) = post(&url, &json!({"prompt": ids, "stop_token_ids": [1_000_000]}));
    assert_eq!(code, 400, "{v}");
    // vLLM's min_tokens: the stop token cannot come before it (masked), so the reply goes on
    // past where it stopped; the library's reply with the same setting.
    let mut p = greedy(Prompt::Tokens(ids.clone()), 8);
    (p.stop_tokens, p.min_tokens) = (vec![stop], k + 2);
    let held = local.generate(&p, |_| {}).unwrap();
    assert!(held.tokens.len() >= k + 2, "{held:?}");
    assert!(!held.tokens[..k + 1].contains(&stop), "{held:?}");
    assert_eq!(held.tokens[..k], plain.tokens[..k]);
    let body = json!({"prompt": ids, "max_tokens": 8, "temperature": 0,
        "stop_token_ids": [stop], "min_tokens": k + 2});
    let (code, v) = post(&url, &body);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], held.text.as_str(), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], held.tokens.len(), "{v}");
    let body = json!({"prompt": ids, "max_tokens": 2, "min_tokens": 3});
    let (code, v) = post(&url, &body);
    assert_eq!(code, 400, "{v}");
    // vLLM's fields keydiff does not have.
    let (code, v) = post(
        &url,
        &json!({"prompt": "a", "max_tokens": 2, "min_tokens": 0, "bad_words": [],
            "allowed_token_ids": [], "include_stop_str_in_output": false}),
    );
    assert_eq!(code, 200, "{v}");
    for (field, on) in [
        ("bad_words", json!(["red"])),
        ("allowed_token_ids", json!([1, 2])),
        ("include_stop_str_in_output", json!(true)),
    ] {
        let mut body = json!({"prompt": "a", "max_tokens": 2});
        body[field] = on;
        let (code, v) = post(&url, &body);
        assert_eq!(code, 400, "{field}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
    }
    // A negative seed is a seed; repeat_last_n -1 is the whole context.
    let seeded = json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.5,
        "seed": -5, "repeat_last_n": -1, "repetition_penalty": 1.1});
    let (code, a) = post(&url, &seeded);
    assert_eq!(code, 200, "{a}");
    let (_, b) = post(&url, &seeded);
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let (code, v) = post(&url, &json!({"prompt": "a", "repeat_last_n": -2}));
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["param"], "repeat_last_n", "{v}");
    server.stop().unwrap();
}

/// A ChatML template of a reasoning model: `enable_thinking: false` writes an empty
/// `<think>` block into the generation prompt, as Qwen 3's does.
const THINKING_TEMPLATE: &str = "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + \
    m.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- \
    '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false \
    %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}";

/// A server whose model has `THINKING_TEMPLATE` in place of its own, splitting reasoning as
/// `format` says.
fn start_thinking(format: keydiff::reasoning::ReasoningFormat) -> (ServerHandle, Engine) {
    start_with_template(format, THINKING_TEMPLATE)
}

/// A server whose model has `template` in place of its own, splitting reasoning as `format`
/// says, and the same engine for reference.
fn start_with_template(
    format: keydiff::reasoning::ReasoningFormat,
    template: &str,
) -> (ServerHandle, Engine) {
    let cfg = EngineConfig {
        cache: keydiff_cache(32, 16),
        chat_template: Some(template.into()),
        ..Default::default()
    };
    let load = || Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap();
    let scfg = ServerConfig {
        reasoning_format: format,
        ..ServerConfig::new("smol")
    };
    let server = Server::bind("127.0.0.1:0", load(), scfg).unwrap().spawn();
    (server, load())
}

/// Reasoning comes back apart from the answer (`reasoning_content`, whole and streamed) for a
/// template that writes `</think>`, under an evicting budget, and stays in the content with
/// `none`; a request's `chat_template_kwargs` reach the template, and reserved names are
/// refused. The grammar makes the small model write a reasoning block, then an answer.
#[test]
fn reasoning_comes_apart_and_template_kwargs_reach_the_template() {
    use keydiff::reasoning::{split, ReasoningFormat};
    let (server, local) = start_thinking(ReasoningFormat::Auto);
    let url = format!("{}/v1/chat/completions", server.url());
    let grammar = "root ::= \"<think>\" [a-z ]{8,60} \"</think>\\n\\n\" [A-Z] [a-z ]{4,40} \".\"";
    let question = "Is the sky blue? Think first, then answer.";
    let mut params = greedy(Prompt::Chat(vec![Message::new("user", question)]), 80);
    params.sampling.format = keydiff::Format::Grammar(grammar.into());
    let want = local.generate(&params, |_| {}).unwrap();
    eprintln!("reply: {:?}", want.text);
    let parts = split(&want.text, false);
    let reasoning = parts.reasoning.clone().expect("a reasoning block");
    assert!(
        !parts.content.is_empty() && !parts.content.contains("think"),
        "{want:?}"
    );
    assert!(
        want.stats.eviction.evictions > 0,
        "the budget evicts: {want:?}"
    );

    let body = json!({"messages": [{"role": "user", "content": question}], "max_tokens": 80,
                      "temperature": 0, "grammar": grammar});
    let (code, got) = post(&url, &body);
    assert_eq!(code, 200, "{got}");
    let message = &got["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], reasoning.as_str(), "{got}");
    // vLLM's name for it too.
    assert_eq!(message["reasoning"], reasoning.as_str(), "{got}");
    assert_eq!(message["content"], parts.content.as_str(), "{got}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = events(ureq::post(&url).send_json(&streamed).unwrap());
    let joined = |field: &str| -> String {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"][field].as_str())
            .collect()
    };
    assert_eq!(joined("reasoning_content"), reasoning);
    assert_eq!(joined("reasoning"), reasoning);
    assert_eq!(joined("content"), parts.content);
    // Reasoning was sent as it came, in several chunks, before any content.
    let kinds: Vec<bool> = chunks
        .iter()
        .filter_map(|c| {
            let d = &c["choices"][0]["delta"];
            match (d["reasoning_content"].is_string(), d["content"].as_str()) {
                (true, _) => Some(true),
                (false, Some(t)) if !t.is_empty() => Some(false),
                _ => None,
            }
        })
        .collect();
    assert!(kinds.iter().filter(|&&r| r).count() > 1, "{kinds:?}");
    assert!(kinds.windows(2).all(|w| w[0] || !w[1]), "{kinds:?}");

    // `chat_template_kwargs` reach the template: the empty block is in the prompt.
    let mut off = body.clone();
    off["chat_template_kwargs"] = json!({"enable_thinking": false});
    off["grammar"] = json!("root ::= [A-Z] [a-z ]{4,40} \".\"");
    let (code, got) = post(&url, &off);
    assert_eq!(code, 200, "{got}");
    let mut kwargs = keydiff::TemplateKwargs::new();
    kwargs.insert("enable_thinking".into(), false.into());
    let messages = vec![Message::new("user", question)];
    let text = local.render_chat_with(&messages, &[], &kwargs).unwrap();
    assert!(
        text.ends_with("assistant\n<think>\n\n</think>\n\n"),
        "{text:?}"
    );
    let prompt = Prompt::ChatTools {
        messages,
        tools: vec![],
        template_kwargs: kwargs,
    };
    let n = local.prompt_tokens(&prompt).unwrap().len();
    assert_eq!(got["usage"]["prompt_tokens"], n);
    assert!(n > local.prompt_tokens(&params.prompt).unwrap().len());
    assert!(got["choices"][0]["message"]["reasoning_content"].is_null());
    // `/tokenize` renders them the same way.
    let (code, tok) = post(
        &format!("{}/tokenize", server.url()),
        &json!({"messages": [{"role": "user", "content": question}],
                "chat_template_kwargs": {"enable_thinking": false}}),
    );
    assert_eq!(code, 200, "{tok}");
    assert_eq!(tok["count"], n, "{tok}");
    let mut reserved = off.clone();
    reserved["chat_template_kwargs"] = json!({"messages": []});
    let (code, err) = post(&url, &reserved);
    assert_eq!(code, 400, "{err}");
    assert_eq!(err["error"]["param"], "chat_template_kwargs", "{err}");

    // `none`: the reasoning stays in the content, as written.
    let (plain, _) = start_thinking(ReasoningFormat::None);
    let (code, got) = post(&format!("{}/v1/chat/completions", plain.url()), &body);
    assert_eq!(code, 200, "{got}");
    assert_eq!(got["choices"][0]["message"]["content"], want.text.as_str());
    assert!(got["choices"][0]["message"]
        .get("reasoning_content")
        .is_none());
    assert!(got["choices"][0]["message"].get("reasoning").is_none());
}

/// A reasoning model's reply under OpenAI's `response_format`: JSON mode shapes the answer
/// after the reasoning block, as vLLM applies structured outputs under a reasoning parser.
/// Here the prompt opens the block (as DeepSeek-R1's template does), so the reply starts in
/// it: free text, which the small model does not close in 12 tokens, where generation may
/// not end. With `--reasoning-format none`, JSON mode applies from the reply's first token.
/// (llama.cpp's `grammar` field constrains the whole reply, reasoning included: the test
/// above writes the block with it.)
#[test]
fn response_formats_shape_the_answer_after_the_reasoning() {
    use keydiff::reasoning::ReasoningFormat;
    // Earlier replies' reasoning is dropped, as DeepSeek-R1's template does: it writes
    // `</think>`, which is how `auto` knows a reasoning model.
    const OPENED: &str = "{%- for m in messages %}{%- set c = m.content %}{%- if '</think>' in \
        c %}{%- set c = c.split('</think>')[-1] %}{%- endif %}{{- '<|im_start|>' + m.role + \
        '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- \
        '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}";
    let question = "Give me a JSON object with your name.";
    let body = json!({"messages": [{"role": "user", "content": question}], "max_tokens": 12,
                      "temperature": 0, "response_format": {"type": "json_object"}});
    let (server, local) = start_with_template(ReasoningFormat::Auto, OPENED);
    let prompt = Prompt::Chat(vec![Message::new("user", question)]);
    assert_eq!(
        local
            .reasoning_start(&prompt, ReasoningFormat::Auto)
            .unwrap(),
        Some(true)
    );
    let plain = local.generate(&greedy(prompt.clone(), 12), |_| {}).unwrap();
    assert_eq!(
        plain.stats.stop_reason,
        keydiff::StopReason::MaxTokens,
        "{plain:?}"
    );
    assert!(!plain.text.contains("</think>"), "{plain:?}");
    assert!(
        !plain.text.trim_start().starts_with('{'),
        "the test needs free text to tell the two apart: {plain:?}"
    );
    let url = format!("{}/v1/chat/completions", server.url());
    let (code, got) = post(&url, &body);
    assert_eq!(code, 200, "{got}");
    let choice = &got["choices"][0];
    // The block is free: the reply is what the model writes without a format.
    let want = keydiff::reasoning::split(&plain.text, true);
    let reasoning = want.reasoning.expect("all reasoning");
    assert!(
        !reasoning.is_empty() && want.content.is_empty(),
        "{plain:?}"
    );
    assert_eq!(choice["message"]["reasoning_content"], reasoning, "{got}");
    assert_eq!(choice["message"]["content"], "", "{got}");
    assert_eq!(choice["finish_reason"], "length", "{got}");
    // The same request without reasoning apart: JSON from the first token.
    let (none, _) = start_with_template(ReasoningFormat::None, OPENED);
    let (code, got) = post(&format!("{}/v1/chat/completions", none.url()), &body);
    assert_eq!(code, 200, "{got}");
    let content = got["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.trim_start().starts_with('{'), "{got}");
    // In the library: the format that the server used, from the engine.
    let mut params = greedy(prompt, 12);
    params.sampling.format = keydiff::Format::JsonObject.after_reasoning(Some(true));
    let out = local.generate(&params, |_| {}).unwrap();
    assert_eq!(out.text, plain.text);
    server.stop().unwrap();
    none.stop().unwrap();
}

/// llama.cpp's slot actions (`POST /slots/{id}?action=save|restore|erase`, with
/// `--slot-save-path`): a document's evicted cache (`--prompt-cache continue`, budget 48)
/// saved from one server is restored into another, one at a time or batched, and a follow-up
/// there reuses all of it and answers as the engine does from the same file; erase frees the
/// slot; what cannot be done is refused, naming why.
#[test]
fn slots_save_restore_and_erase_prompt_caches() {
    let cache = keydiff_cache(48, 16);
    let dir = keydiff_tests::temp_dir("server-slots");
    let serve = |max_batch: usize, slot_save_path: Option<std::path::PathBuf>| {
        let cfg = ServerConfig {
            prompt_cache: Some(keydiff::Reuse::Continue),
            max_batch,
            slot_save_path,
            ..ServerConfig::new("smol")
        };
        Server::bind("127.0.0.1:0", engine(cache.clone()), cfg)
            .unwrap()
            .spawn()
    };
    let a = serve(1, Some(dir.clone()));
    let doc =
        "The lighthouse keeper wrote in his log every evening, and the log grew long. ".repeat(4);
    let (code, first) = post(
        &format!("{}/v1/completions", a.url()),
        &json!({"prompt": doc, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(code, 200, "{first}");
    assert!(first["keydiff"]["eviction"]["evictions"].as_u64().unwrap() > 0);
    let slot = |s: &ServerHandle, id: &str, action: &str, body: Value| {
        post(&format!("{}/slots/{id}?action={action}", s.url()), &body)
    };
    let (code, saved) = slot(&a, "0", "save", json!({"filename": "doc.kv"}));
    assert_eq!(code, 200, "{saved}");
    let file = dir.join("doc.kv");
    assert_eq!(saved["id_slot"], 0);
    assert_eq!(saved["filename"], "doc.kv");
    assert_eq!(
        saved["n_written"].as_u64().unwrap(),
        std::fs::metadata(&file).unwrap().len()
    );
    // The prompt and the reply but its last token, which was never fed.
    let n_saved = saved["n_saved"].as_u64().unwrap();
    assert_eq!(
        n_saved,
        first["usage"]["prompt_tokens"].as_u64().unwrap() + 3,
        "{saved}"
    );
    let (code, erased) = slot(&a, "0", "erase", json!({}));
    assert_eq!((code, erased["n_erased"].as_u64()), (200, Some(n_saved)));
    assert_eq!(
        get(&format!("{}/health", a.url()))["prompt_cache_entries"],
        0
    );
    let (code, empty) = slot(&a, "0", "save", json!({"filename": "empty.kv"}));
    assert_eq!(code, 400);
    assert!(
        empty["error"]["message"]
            .as_str()
            .unwrap()
            .contains("holds no prompt cache"),
        "{empty}"
    );

    // What the engine gives from the same file.
    let local = engine(cache.clone());
    let follow = format!(
        "{doc}{} Then what?",
        first["choices"][0]["text"].as_str().unwrap()
    );
    let p = greedy(Prompt::Text(follow.clone()), 8);
    let mut pc = local
        .load_prompt_cache(&file, keydiff::Reuse::Continue)
        .unwrap();
    let want = local.generate_cached(&p, &mut pc, |_| {}).unwrap();
    assert_eq!(want.stats.prefix_tokens as u64, n_saved);
    for server in [serve(1, Some(dir.clone())), serve(2, Some(dir.clone()))] {
        let (code, restored) = slot(&server, "0", "restore", json!({"filename": "doc.kv"}));
        assert_eq!(code, 200, "{restored}");
        assert_eq!(restored["n_restored"].as_u64(), Some(n_saved));
        assert_eq!(
            restored["n_read"].as_u64().unwrap(),
            saved["n_written"].as_u64().unwrap()
        );
        assert_eq!(
            get(&format!("{}/health", server.url()))["prompt_cache_entries"],
            1
        );
        let (code, got) = post(
            &format!("{}/v1/completions", server.url()),
            &json!({"prompt": follow, "max_tokens": 8, "temperature": 0}),
        );
        assert_eq!(code, 200, "{got}");
        assert_eq!(
            got["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
            Some(n_saved)
        );
        assert_eq!(got["choices"][0]["text"], want.text);
        // The follow-up's cache is kept in turn: the document, the follow-up and its reply.
        let (code, erased) = slot(&server, "0", "erase", json!({}));
        assert_eq!(code, 200, "{erased}");
        assert!(erased["n_erased"].as_u64().unwrap() > n_saved, "{erased}");
        assert_eq!(
            get(&format!("{}/health", server.url()))["prompt_cache_entries"],
            0
        );
    }

    // Refusals.
    let refused =
        |s: &ServerHandle, id: &str, action: &str, body: Value, status: u16, want: &str| {
            let (code, v) = slot(s, id, action, body);
            assert_eq!(code, status, "{id} {action}: {v}");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains(want), "{id} {action}: {msg}");
        };
    let f = |name: &str| json!({ "filename": name });
    refused(&a, "0", "restore", f("missing.kv"), 400, "no such file");
    // Named as the client named it, not by the server's directory.
    let (_, v) = slot(&a, "0", "restore", f("missing.kv"));
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("KV cache file missing.kv:") && !msg.contains(dir.to_str().unwrap()),
        "{msg}"
    );
    refused(&a, "0", "save", f("C:doc.kv"), 400, "invalid filename");
    refused(&a, "0", "save", f("../doc.kv"), 400, "invalid filename");
    refused(&a, "0", "save", f(""), 400, "invalid filename");
    refused(
        &a,
        "1",
        "erase",
        json!({}),
        400,
        "invalid slot 1: this server has 1",
    );
    refused(&a, "x", "erase", json!({}), 400, "invalid slot id `x`");
    refused(
        &a,
        "0",
        "dance",
        json!({}),
        400,
        "invalid slot action `dance`",
    );
    refused(&a, "0", "save", json!({}), 400, "filename");
    let none = serve(1, None);
    refused(&none, "0", "save", f("doc.kv"), 501, "--slot-save-path");
    // Under exact reuse an evicted cache could stand for nothing.
    let exact = Server::bind(
        "127.0.0.1:0",
        engine(cache),
        ServerConfig {
            slot_save_path: Some(dir),
            ..ServerConfig::new("smol")
        },
    )
    .unwrap()
    .spawn();
    refused(&exact, "0", "restore", f("doc.kv"), 400, "exact reuse");
}

/// A server run with a shorter context (`serve -c N`, `EngineConfig::context`) reports it as
/// `max_model_len` and refuses a prompt beyond it, naming the setting.
#[test]
fn a_shorter_context_is_served_as_max_model_len() {
    let cfg = EngineConfig {
        context: Some(32),
        ..Default::default()
    };
    let e = Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap();
    let server = Server::bind("127.0.0.1:0", e, ServerConfig::new("smol"))
        .unwrap()
        .spawn();
    let m = get(&format!("{}/v1/models", server.url()));
    assert_eq!(m["data"][0]["max_model_len"], 32, "{m}");
    let (code, err) = post(
        &format!("{}/v1/completions", server.url()),
        &json!({"prompt": "word ".repeat(40), "max_tokens": 4}),
    );
    assert_eq!(code, 400, "{err}");
    assert_eq!(err["error"]["param"], "prompt");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.contains("(-c/--ctx-size) of 32"), "{msg}");
}

/// A GGUF's recommended sampling (`general.sampling.*`, llama.cpp's keys) fills what a
/// request leaves out (vLLM's `--generation-config auto`, llama.cpp's server): the answer is
/// the engine's under those settings; with `generation_config: false`, OpenAI's defaults;
/// a request's own fields win. A value out of range is not used.
#[test]
fn a_checkpoints_sampling_fills_what_a_request_leaves_out() {
    use candle_core::quantized::gguf_file::{self, Value};
    let dir = keydiff_tests::temp_dir("sampling-defaults");
    let base = dir.join("base.gguf");
    keydiff_tests::write_tiny_qwen3(&base, false).unwrap();
    let with = |name: &str, extra: Vec<(&str, Value)>| {
        let (mut md, ts) = keydiff_tests::read_gguf(&base).unwrap();
        md.extend(extra.into_iter().map(|(k, v)| (k.to_string(), v)));
        let p = dir.join(name);
        let mut out = std::fs::File::create(&p).unwrap();
        let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let ts: Vec<(&str, &candle_core::quantized::QTensor)> =
            ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut out, &md, &ts).unwrap();
        p
    };
    let path = with(
        "sampling.gguf",
        vec![
            ("general.sampling.temp", Value::F32(0.25)),
            ("general.sampling.top_k", Value::I32(7)),
            ("general.sampling.top_p", Value::F32(0.5)),
            ("general.sampling.min_p", Value::F32(0.125)),
            ("general.sampling.penalty_repeat", Value::F32(1.125)),
            ("general.sampling.penalty_last_n", Value::I32(32)),
        ],
    );
    let load = |p: &std::path::Path| {
        Engine::load(
            &ModelSource::Gguf(p.to_path_buf()),
            &EngineConfig::default(),
        )
        .unwrap()
    };
    let local = load(&path);
    let want = keydiff::SamplingDefaults {
        temperature: Some(0.25),
        top_k: Some(7),
        top_p: Some(0.5),
        min_p: Some(0.125),
        repetition_penalty: Some(1.125),
        repeat_last_n: Some(32),
    };
    assert_eq!(local.sampling_defaults(), want);
    let bad = with(
        "bad.gguf",
        vec![("general.sampling.top_p", Value::F32(2.0))],
    );
    assert_eq!(
        load(&bad).sampling_defaults(),
        keydiff::SamplingDefaults::default()
    );
    // llama.cpp's -1: the whole context; below it, out of range.
    for (n, want) in [(-1, Some(usize::MAX)), (-2, None)] {
        let p = with(
            &format!("last{n}.gguf"),
            vec![("general.sampling.penalty_last_n", Value::I32(n))],
        );
        assert_eq!(load(&p).sampling_defaults().repeat_last_n, want, "{n}");
    }

    let engine_text = |s: keydiff::Sampling| {
        let p = GenerateParams {
            prompt: Prompt::Text("The weather today".into()),
            max_tokens: 16,
            sampling: s,
            ignore_eos: true,
            ..Default::default()
        };
        local.generate(&p, |_| {}).unwrap().text
    };
    let recommended = engine_text(keydiff::Sampling {
        temperature: 0.25,
        top_k: 7,
        top_p: 0.5,
        min_p: 0.125,
        repetition_penalty: 1.125,
        repeat_last_n: 32,
        seed: 5,
        // The OpenAI endpoints' order (vLLM's): top-p and min-p cut the tempered weights.
        temperature_first: true,
        ..Default::default()
    });
    let openai = engine_text(keydiff::Sampling {
        temperature: 1.0,
        top_p: 1.0,
        seed: 5,
        ..Default::default()
    });
    assert_ne!(recommended, openai, "the test must tell the two apart");
    for (generation_config, want) in [(true, &recommended), (false, &openai)] {
        let cfg = ServerConfig {
            generation_config,
            ..ServerConfig::new("tiny")
        };
        let server = Server::bind("127.0.0.1:0", load(&path), cfg)
            .unwrap()
            .spawn();
        let url = format!("{}/v1/completions", server.url());
        let body = json!({"prompt": "The weather today", "max_tokens": 16, "seed": 5,
                          "ignore_eos": true});
        let (code, got) = post(&url, &body);
        assert_eq!(code, 200, "{got}");
        assert_eq!(
            &got["choices"][0]["text"], want,
            "generation_config {generation_config}"
        );
        // The request's own fields win: greedy.
        let mut greedy_body = body.clone();
        greedy_body["temperature"] = json!(0);
        greedy_body["repetition_penalty"] = json!(1.0);
        let (_, got) = post(&url, &greedy_body);
        let greedy = engine_text(keydiff::Sampling {
            temperature: 0.0,
            seed: 5,
            ..Default::default()
        });
        assert_eq!(got["choices"][0]["text"], greedy.as_str());
    }
}

/// `serve --spec-type ngram` (`ServerConfig::speculative`): a request decodes speculatively
/// and answers what a server without it answers (greedy, the same text and logprobs);
/// llama.cpp's endpoint reports `timings.draft_n` and `draft_n_accepted`, the `keydiff`
/// stats the counters, and `/metrics` their sums.
#[test]
fn a_speculative_server_answers_as_one_without() {
    let prompt = "The committee met on Tuesday to review the budget. The treasurer reported that \
        spending on the library had risen by twelve percent.\n\nThe same sentences again:\n\n\
        The committee met on Tuesday";
    let body = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 2});
    let serve = |spec: Option<keydiff::NgramSpec>| {
        let e = Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &EngineConfig::default()).unwrap();
        let cfg = ServerConfig {
            speculative: spec,
            ..ServerConfig::new("smol")
        };
        Server::bind("127.0.0.1:0", e, cfg).unwrap().spawn()
    };
    let plain = serve(None);
    let spec = serve(Some(keydiff::NgramSpec::default()));
    let url = |s: &ServerHandle, path: &str| format!("{}{path}", s.url());
    let (c1, a) = post(&url(&plain, "/v1/completions"), &body);
    let (c2, b) = post(&url(&spec, "/v1/completions"), &body);
    assert_eq!((c1, c2), (200, 200), "{a} {b}");
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]);
    let counters = &b["keydiff"]["speculative"];
    assert!(counters["accepted"].as_u64().unwrap() > 0, "{b}");
    assert!(a["keydiff"].get("speculative").is_none(), "{a}");
    let (code, l) = post(
        &url(&spec, "/completion"),
        &json!({"prompt": prompt, "n_predict": 24}),
    );
    assert_eq!(code, 200, "{l}");
    assert!(l["timings"]["draft_n"].as_u64().unwrap() > 0, "{l}");
    let l_accepted = l["timings"]["draft_n_accepted"].as_u64().unwrap();
    assert!(l_accepted > 0, "{l}");
    let (_, l) = post(
        &url(&plain, "/completion"),
        &json!({"prompt": prompt, "n_predict": 24}),
    );
    assert!(l["timings"].get("draft_n").is_none(), "{l}");
    // Prometheus counters over both requests, as vLLM's spec_decode_num_*_tokens.
    let text = ureq::get(&url(&spec, "/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    let value = |name: &str| -> u64 {
        let line = (text.lines().find(|l| l.starts_with(name))).unwrap_or_else(|| panic!("{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let accepted = counters["accepted"].as_u64().unwrap() + l_accepted;
    assert_eq!(value("keydiff_spec_decode_accepted_tokens_total"), accepted);
    assert!(value("keydiff_spec_decode_draft_tokens_total") >= accepted);
}

/// Embedded in an async program: `Server::serve` on the caller's runtime answers and ends
/// with its shutdown future (its worker too); `Server::run` there is refused, not a panic.
#[test]
fn a_server_serves_on_the_callers_runtime() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = Server::bind(
        "127.0.0.1:0",
        engine(CacheConfig::full(128)),
        ServerConfig::new("smol"),
    )
    .unwrap();
    let url = format!("http://{}/v1/completions", server.local_addr());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let served = rt.spawn(server.serve(async {
        let _ = rx.await;
    }));
    let body = json!({"prompt": "Once upon a time", "max_tokens": 2});
    let (code, v) = std::thread::spawn(move || post(&url, &body))
        .join()
        .unwrap();
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
    tx.send(()).unwrap();
    rt.block_on(served).unwrap().unwrap();
    let other = Server::bind(
        "127.0.0.1:0",
        engine(CacheConfig::full(128)),
        ServerConfig::new("smol"),
    )
    .unwrap();
    let err = rt.block_on(async { other.run(async {}) }).unwrap_err();
    assert!(matches!(err, ServerError::InRuntime), "{err}");
}

/// What vLLM's and llama-server's clients send beyond OpenAI's fields: vLLM's structured
/// output (`guided_choice`, `guided_json`, `structured_outputs`) shapes the reply, its fields
/// keydiff does not do are refused by name; llama-server's `n_predict`; text parts joined by
/// line breaks; `top_logprobs: 0` alone; `stream_options: {}` (usage, and `"usage": null` in
/// the chunks before it); CORS preflights; the router's own errors in OpenAI's form.
#[test]
fn fields_of_vllm_and_llama_server_clients() {
    let server = start(CacheConfig::full(64), 4);
    let base = server.url();
    let chat = format!("{base}/v1/chat/completions");
    let cmpl = format!("{base}/v1/completions");
    let ask = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Pick a colour."}],
            "max_tokens": 8, "temperature": 0});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        post(&chat, &body)
    };
    for extra in [
        json!({"guided_choice": ["red", "blue \"x\"\n"]}),
        json!({"structured_outputs": {"choice": ["red", "blue \"x\"\n"]}}),
    ] {
        let (code, v) = ask(extra.clone());
        assert_eq!(code, 200, "{extra}: {v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(["red", "blue \"x\"\n"].contains(&text), "{extra}: {text:?}");
    }
    let (code, v) = ask(json!({"guided_json": {"type": "object",
        "properties": {"colour": {"type": "string"}}, "required": ["colour"]}, "max_tokens": 24}));
    assert_eq!(code, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        let obj: Value = serde_json::from_str(text).unwrap();
        assert!(obj["colour"].is_string(), "{text}");
    } else {
        assert!(text.starts_with("{\"colour\""), "{text}");
    }
    for (extra, param) in [
        (json!({"guided_regex": "[0-9]+"}), "guided_regex"),
        (json!({"guided_grammar": "root ::= x"}), "guided_grammar"),
        (
            json!({"structured_outputs": {"regex": "a"}}),
            "structured_outputs",
        ),
        (
            json!({"continue_final_message": true}),
            "continue_final_message",
        ),
        (
            json!({"add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (json!({"echo": true}), "echo"),
        (json!({"use_beam_search": true}), "use_beam_search"),
        (json!({"prompt_logprobs": 1}), "prompt_logprobs"),
        (
            json!({"guided_choice": ["a"], "response_format": {"type": "json_object"}}),
            "response_format",
        ),
    ] {
        let (code, v) = ask(extra.clone());
        assert_eq!(code, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
    }
    // Their defaults ask for nothing.
    let (code, v) = ask(
        json!({"add_generation_prompt": true, "use_beam_search": false,
        "top_logprobs": 0}),
    );
    assert_eq!(code, 200, "{v}");

    // An echoed prompt as sent writes its special tokens out: they take their text's room
    // in text_offset, so every token (the reply's too) is found at its offset.
    let (code, v) = post(
        &cmpl,
        &json!({"prompt": "<|im_start|>user\nhi there<|im_end|>\n", "echo": true,
            "logprobs": 0, "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(code, 200, "{v}");
    let c = &v["choices"][0];
    let text: Vec<char> = c["text"].as_str().unwrap().chars().collect();
    let tokens = c["logprobs"]["tokens"].as_array().unwrap();
    let offsets = c["logprobs"]["text_offset"].as_array().unwrap();
    assert_eq!(tokens[0], "<|im_start|>", "{v}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    for (i, (t, o)) in tokens.iter().zip(offsets).enumerate() {
        let (t, o) = (t.as_str().unwrap(), o.as_u64().unwrap() as usize);
        // The reply's special tokens are left out of its text (and take no room).
        let special = t.starts_with("<|") && t.ends_with("|>");
        if t.starts_with("bytes:") || (i >= prompt_tokens && special) {
            continue;
        }
        let at: String = text[o..].iter().collect();
        assert!(at.starts_with(t), "{t:?} at {o}: {at:?}");
    }

    // llama-server's n_predict.
    let (code, v) = post(&cmpl, &json!({"prompt": "Count: 1, 2, 3,", "n_predict": 3}));
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");

    // Text parts: one text, joined by a line break.
    let tok = format!("{base}/tokenize");
    let parts = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]}]});
    let joined = json!({"messages": [{"role": "user", "content": "Line one.\nLine two."}]});
    assert_eq!(
        post(&tok, &parts).1["tokens"],
        post(&tok, &joined).1["tokens"]
    );

    // stream_options without include_usage: usage at the end, null before.
    let r = ureq::post(&cmpl)
        .send_json(json!({"prompt": "Hello", "max_tokens": 3, "stream": true,
            "stream_options": {}}))
        .unwrap();
    let chunks: Vec<Value> = BufReader::new(r.into_reader())
        .lines()
        .map(|l| l.unwrap())
        .filter_map(|l| {
            l.strip_prefix("data: ")
                .filter(|d| *d != "[DONE]")
                .map(|d| serde_json::from_str(d).unwrap())
        })
        .collect();
    let (last, before) = chunks.split_last().unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 3, "{last}");
    assert!(!before.is_empty());
    for c in before {
        assert!(c.get("usage").is_some_and(Value::is_null), "{c}");
    }

    server.stop().unwrap();

    // CORS: a preflight is answered without the key (browsers send none with it), and
    // answers allow any origin; `cors: false` (`serve --no-cors`) answers none of it.
    let keyed = |cors: bool| {
        let cfg = ServerConfig {
            api_key: Some("s3cret".into()),
            cors,
            ..ServerConfig::new("smol")
        };
        Server::bind("127.0.0.1:0", engine(CacheConfig::full(64)), cfg)
            .unwrap()
            .spawn()
    };
    let server = keyed(true);
    let base = server.url();
    let chat = format!("{base}/v1/chat/completions");
    let pre = ureq::request("OPTIONS", &chat)
        .set("Origin", "http://example.org")
        .set("Access-Control-Request-Method", "POST")
        .set(
            "Access-Control-Request-Headers",
            "content-type, authorization",
        )
        .call()
        .unwrap();
    assert_eq!(pre.status(), 204);
    assert_eq!(pre.header("access-control-allow-origin"), Some("*"));
    assert_eq!(
        pre.header("access-control-allow-headers"),
        Some("content-type, authorization")
    );
    let models = ureq::get(&format!("{base}/v1/models"))
        .set("Origin", "http://example.org")
        .set("Authorization", "Bearer s3cret")
        .call()
        .unwrap();
    assert_eq!(models.header("access-control-allow-origin"), Some("*"));
    // Without the key, still refused (with the header, so the page can read why).
    match ureq::get(&format!("{base}/v1/models"))
        .set("Origin", "http://example.org")
        .call()
    {
        Err(ureq::Error::Status(401, r)) => {
            assert_eq!(r.header("access-control-allow-origin"), Some("*"))
        }
        other => panic!("{other:?}"),
    }
    server.stop().unwrap();
    let server = keyed(false);
    match ureq::request("OPTIONS", &format!("{}/v1/chat/completions", server.url()))
        .set("Origin", "http://example.org")
        .set("Access-Control-Request-Method", "POST")
        .call()
    {
        Err(ureq::Error::Status(c, r)) => {
            // Not answered as a preflight: refused for the key (as any request without it).
            assert_eq!(c, 401);
            assert_eq!(r.header("access-control-allow-origin"), None);
        }
        other => panic!("{other:?}"),
    }
    server.stop().unwrap();
    let server = start(CacheConfig::full(64), 4);
    let base = server.url();

    // The router's own errors are OpenAI's JSON.
    for (method, path, code) in [
        ("GET", "/v1/nonexistent", 404),
        ("GET", "/v1/completions", 405),
    ] {
        match ureq::request(method, &format!("{base}{path}")).call() {
            Err(ureq::Error::Status(c, r)) => {
                assert_eq!(c, code);
                let v: Value = r.into_json().unwrap();
                assert!(
                    v["error"]["message"].as_str().unwrap().contains(path),
                    "{v}"
                );
            }
            other => panic!("{method} {path}: {other:?}"),
        }
    }
    server.stop().unwrap();
}
