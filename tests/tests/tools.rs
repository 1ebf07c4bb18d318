//! Tools (function calling) on the real Qwen2.5-Coder over HTTP: the template renders the
//! tools, the model's calls come back as OpenAI's `tool_calls` (whole and streamed), a
//! required call follows the function's schema under KeyDiff eviction, and bad tools are
//! refused naming the field.

use std::io::{BufRead, BufReader};

use keydiff::tools::{ToolChoice, ToolSyntax};
use keydiff::{Engine, EngineConfig, GenerateParams, Message, ModelSource, Prompt, Sampling};
use keydiff_server::{Server, ServerConfig, ServerHandle};
use keydiff_tests::{evicting_engine, model, QWEN, SMOLLM2};
use serde_json::{json, Value};

fn serve(engine: Engine) -> ServerHandle {
    Server::bind("127.0.0.1:0", engine, ServerConfig::new("m"))
        .unwrap()
        .spawn()
}

fn full_engine(rel: &str) -> Engine {
    Engine::load(&ModelSource::Gguf(model(rel)), &EngineConfig::default()).unwrap()
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    match ureq::post(url).send_json(body) {
        Ok(r) => (r.status(), r.into_json().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap()),
        Err(e) => panic!("{url}: {e}"),
    }
}

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}})
}

fn ask(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
        "tools": [weather()],
        "temperature": 0,
        "max_tokens": 60,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The one call of a reply, checked against `get_weather`'s schema: its arguments.
fn weather_call(message: &Value) -> Value {
    let calls = message["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{message}");
    let c = &calls[0];
    assert_eq!(c["type"], "function");
    assert!(c["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(c["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
    let city = args["city"].as_str().expect("a city");
    assert!(city.chars().count() <= 40, "{city}");
    let o = args.as_object().unwrap();
    assert!(o.keys().all(|k| k == "city" || k == "unit"), "{args}");
    if let Some(u) = o.get("unit") {
        assert!(u == "celsius" || u == "fahrenheit", "{u}");
    }
    args
}

/// The `data:` payloads of a stream, without `[DONE]`.
fn stream(url: &str, body: &Value) -> Vec<Value> {
    let r = ureq::post(url).send_json(body).unwrap();
    BufReader::new(r.into_reader())
        .lines()
        .map(|l| l.unwrap())
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .take_while(|d| d != "[DONE]")
        .map(|d| serde_json::from_str(&d).unwrap())
        .collect()
}

#[test]
fn calls_come_back_whole_and_streamed() {
    let server = serve(full_engine(QWEN));
    let url = format!("{}/v1/chat/completions", server.url());
    // Auto: this model calls the function (as a bare call object, which is read too).
    for choice in [
        json!("auto"),
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        let (code, v) = post(&url, &ask(json!({"tool_choice": choice})));
        assert_eq!(code, 200, "{v}");
        let c = &v["choices"][0];
        // A named function's call ends with `stop`, as OpenAI's and vLLM's.
        let reason = if choice.is_object() {
            "stop"
        } else {
            "tool_calls"
        };
        assert_eq!(c["finish_reason"], reason, "{choice}: {v}");
        assert_eq!(c["message"]["content"], Value::Null);
        assert_eq!(weather_call(&c["message"])["city"], "Paris", "{choice}");
    }
    // /tokenize renders the tools as chat does.
    let body = ask(json!({}));
    let (_, v) = post(&url, &body);
    let used = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let tok = |b: Value| post(&format!("{}/tokenize", server.url()), &b).1["count"].as_u64();
    let with = tok(json!({"messages": body["messages"], "tools": body["tools"]}));
    assert_eq!(with, Some(used));
    assert!(tok(json!({"messages": body["messages"]})).unwrap() + 100 < used);
    // None: the same text, as text.
    let (_, v) = post(&url, &ask(json!({"tool_choice": "none"})));
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "stop");
    assert!(c["message"].get("tool_calls").is_none());
    assert!(c["message"]["content"]
        .as_str()
        .unwrap()
        .contains("get_weather"));

    // A stream: the role, then the call in one delta, then `tool_calls`; no content.
    let events = stream(
        &url,
        &ask(json!({"tool_choice": "required", "stream": true})),
    );
    let deltas: Vec<&Value> = events.iter().map(|e| &e["choices"][0]["delta"]).collect();
    let text: String = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    assert_eq!(text, "");
    let calls: Vec<&Value> = deltas
        .iter()
        .copied()
        .filter(|d| d.get("tool_calls").is_some())
        .collect();
    assert_eq!(calls.len(), 1, "{events:?}");
    assert_eq!(calls[0]["tool_calls"][0]["index"], 0);
    let whole = json!({"tool_calls": [calls[0]["tool_calls"][0].clone()]});
    assert_eq!(weather_call(&whole)["city"], "Paris");
    let last = &events.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], "tool_calls");

    // The call and its result go back in; the model answers in text (with the tools still
    // there to call) that streams as it comes, and equals the whole answer.
    let turn = json!({
        "messages": [
            {"role": "user", "content": "What is the weather like in Paris today?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21, \"sky\": \"sunny\"}"},
            {"role": "user", "content": "Thanks. Now answer me in one sentence: how warm is it?"},
        ],
        "tools": [weather()],
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 40,
    });
    let (code, v) = post(&url, &turn);
    assert_eq!(code, 200, "{v}");
    // `auto`, answered in text: the lazy grammar never starts, and the text streams.
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(
        v["choices"][0]["message"].get("tool_calls").is_none(),
        "{v}"
    );
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(answer.contains("21"), "{answer}");
    let mut streamed = turn.clone();
    streamed["stream"] = json!(true);
    let events = stream(&url, &streamed);
    let pieces: Vec<&str> = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .filter(|t| !t.is_empty())
        .collect();
    assert!(pieces.len() > 1, "{pieces:?}");
    assert_eq!(pieces.concat(), answer);
    server.stop().unwrap();
}

#[test]
fn bad_tools_are_refused_naming_the_field() {
    let server = serve(full_engine(QWEN));
    let url = format!("{}/v1/chat/completions", server.url());
    let refused = |body: Value, param: &str, what: &str| {
        let (code, v) = post(&url, &body);
        assert_eq!(code, 400, "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(what), "{m}");
    };
    let named = |n: &str| json!({"type": "function", "function": {"name": n}});
    refused(ask(json!({"tools": [named("a b")]})), "tools", "1 to 64");
    refused(
        ask(json!({"tools": [named("f"), named("f")]})),
        "tools",
        "declared twice",
    );
    // A keyword the grammar cannot enforce: refused with `strict`, else left out of it.
    let even = |strict: bool| {
        ask(
            json!({"max_tokens": 24, "tools": [{"type": "function", "function": {"name": "f",
            "strict": strict, "parameters": {"type": "object",
                "properties": {"n": {"type": "integer", "multipleOf": 2}}}}}]}),
        )
    };
    refused(even(true), "tools", "`multipleOf`");
    let (code, v) = post(&url, &even(false));
    assert_eq!(code, 200, "{v}");
    // A schema the grammar cannot follow at all (`anyOf` beside other keywords, a common
    // "one of these members" form): refused with `strict`; without it, OpenAI takes it, and
    // the arguments may be any object (it used to be refused).
    let one_of_two = |strict: bool| {
        ask(
            json!({"max_tokens": 24, "tools": [{"type": "function", "function": {"name": "f",
            "strict": strict, "parameters": {"type": "object",
                "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}}}]}),
        )
    };
    refused(one_of_two(true), "tools", "`anyOf`");
    let (code, v) = post(&url, &one_of_two(false));
    assert_eq!(code, 200, "{v}");
    refused(
        ask(json!({"tool_choice": {"type": "function", "function": {"name": "g"}}})),
        "tool_choice",
        "`g`, which is not among",
    );
    refused(
        ask(json!({"tool_choice": "sometimes"})),
        "tool_choice",
        "`sometimes`",
    );
    refused(
        ask(json!({"response_format": {"type": "json_object"}})),
        "tool_choice",
        "response_format",
    );
    // What some SDKs always send.
    let (code, v) = post(
        &url,
        &ask(json!({"response_format": {"type": "text"}, "max_tokens": 2})),
    );
    assert_eq!(code, 200, "{v}");
    let bad_args = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]}],
        "tools": [weather()]});
    refused(bad_args, "messages", "messages[1].tool_calls[0]");
    server.stop().unwrap();

    // SmolLM2's template writes no calls: tools to call are refused, `none` renders them.
    let smol = serve(full_engine(SMOLLM2));
    let url = format!("{}/v1/chat/completions", smol.url());
    let (code, v) = post(&url, &ask(json!({})));
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["param"], "tools");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("writes no function calls"));
    let (code, v) = post(&url, &ask(json!({"tool_choice": "none", "max_tokens": 4})));
    assert_eq!(code, 200, "{v}");
    smol.stop().unwrap();
}

/// The library: a required call under KeyDiff eviction (a 64-slot budget, far below the
/// prompt) still follows the schema, and reads back as one call.
#[test]
fn a_required_call_under_eviction() {
    let engine = evicting_engine(QWEN);
    let syntax = engine
        .tool_syntax()
        .expect("Qwen's template writes <tool_call>");
    assert_eq!(syntax, ToolSyntax::Hermes);
    let tools = keydiff::tools::tools_from_openai(&[weather()]).unwrap();
    let format = syntax
        .format(&tools, &ToolChoice::Required, true)
        .unwrap()
        .unwrap();
    let messages = vec![Message::new(
        "user",
        "What is the weather like in Paris today?",
    )];
    let params = GenerateParams {
        prompt: Prompt::ChatTools {
            messages,
            tools: tools.clone(),
            template_kwargs: Default::default(),
        },
        max_tokens: 80,
        sampling: Sampling {
            format,
            ..Sampling::default()
        },
        ..Default::default()
    };
    let out = engine.generate(&params, |_| {}).unwrap();
    assert!(out.stats.prompt_tokens > 150, "{}", out.stats.prompt_tokens);
    assert!(out.stats.eviction.evictions > 0, "{:?}", out.stats.eviction);
    assert!(out.text.starts_with("<tool_call>\n"), "{}", out.text);
    let parsed = syntax.parse(&out.text, &tools);
    assert_eq!(parsed.calls.len(), 1, "{}", out.text);
    assert_eq!(parsed.content.trim(), "");
    let call = json!({"tool_calls": keydiff_server::api::tool_calls(&parsed.calls, false)});
    weather_call(&call);
}
