//! Tools (function calling), as OpenAI's chat API, vLLM and llama.cpp's server have them.
//!
//! The functions a model may call ([`Tool`]) are rendered into the prompt by the model's own
//! chat template (`tools`, as transformers hands them over). The model answers with calls in
//! its own syntax ([`ToolSyntax`], told by the template): Hermes' `<tool_call>` blocks (Qwen
//! 2.5, Hermes, and the many templates that copied them) or Llama 3.x's JSON object with
//! `parameters`. [`ToolSyntax::parse`] reads them back out of the text; [`ToolStream`] holds
//! back what may be a call while a reply streams.
//!
//! [`ToolChoice`] says what the model must do:
//! - `auto`: answer in text or call; once a call starts (its trigger, `<tool_call>` or
//!   `{"name"`), the rest of the reply follows the grammar of calls to the declared functions
//!   with arguments their schemas allow ([`Format::Lazy`], llama.cpp's lazy grammars);
//! - `required` or one named function: the whole reply is such calls ([`Format::Grammar`]);
//! - `none`: the tools are in the prompt, and the reply is text, not read for calls.

use serde_json::{json, Map, Value};

use crate::json_schema;
use crate::sampling::Format;
pub use keydiff_model::ToolCall;

/// A request's tools refused: what is wrong, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ToolError(pub String);

type Result<T> = std::result::Result<T, ToolError>;

/// The most tools one request may declare (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// `a-z`, `A-Z`, `0-9`, `_` and `-`, at most 64 (OpenAI's rule).
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments object, as given; `None`: no arguments (`{}`).
    pub parameters: Option<Value>,
    /// OpenAI's `strict`: the arguments must follow the whole schema, so keywords the grammar
    /// cannot enforce are refused. Otherwise they are left out of the grammar
    /// ([`json_schema::loosen`]), which then allows at least what the schema allows.
    pub strict: Option<bool>,
    /// The schema the calls' grammar follows.
    grammar_schema: Value,
}

impl Tool {
    /// A tool from OpenAI's object, `{"type": "function", "function": {"name", "description",
    /// "parameters"}}`. Its arguments' schema is compiled here, so that one the grammar cannot
    /// enforce is refused when the request comes, not when the model calls it.
    pub fn from_openai(v: &Value) -> Result<Tool> {
        let bad = |m: String| Err(ToolError(m));
        let Some(o) = v.as_object() else {
            return bad(format!("a tool must be an object, not {v}"));
        };
        match o.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(t) => {
                return bad(format!(
                    "tool type `{t}` is not supported (only `function`)"
                ))
            }
            None => return bad("a tool needs `\"type\": \"function\"`".into()),
        }
        let Some(f) = o.get("function").and_then(Value::as_object) else {
            return bad("a function tool needs its `function` object".into());
        };
        let name = match f.get("name").and_then(Value::as_str) {
            Some(n) if valid_name(n) => n.to_string(),
            Some(n) => {
                return bad(format!(
                    "function name `{n}`: it must be 1 to 64 of a-z, A-Z, 0-9, `_` and `-`"
                ))
            }
            None => return bad("a function needs a string `name`".into()),
        };
        let description = match f.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(d) => {
                return bad(format!(
                    "function `{name}`: description must be a string, not {d}"
                ))
            }
        };
        let strict = match f.get("strict") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => {
                return bad(format!(
                    "function `{name}`: strict must be true or false, not {v}"
                ))
            }
        };
        let (parameters, grammar_schema) = match f.get("parameters") {
            None | Some(Value::Null) => (None, json!({"type": "object", "properties": {}})),
            Some(p @ Value::Object(_)) => {
                if p.get("type").is_some_and(|t| t != "object") {
                    return bad(format!(
                        "function `{name}`: parameters must be a schema of an object, not of {}",
                        p["type"]
                    ));
                }
                let mut g = match strict {
                    Some(true) => p.clone(),
                    _ => json_schema::loosen(p),
                };
                // The arguments are an object, whatever else the schema says; one that names
                // no members may have any (JSON Schema's meaning, where keydiff's objects
                // otherwise have only the members they name).
                if let Value::Object(m) = &mut g {
                    m.entry("type").or_insert_with(|| "object".into());
                    let shaped = ["properties", "additionalProperties", "$ref", "anyOf"]
                        .iter()
                        .chain(&["oneOf", "allOf", "enum", "const"])
                        .any(|k| m.contains_key(*k));
                    if !shaped {
                        m.insert("additionalProperties".into(), true.into());
                    }
                }
                match (json_schema::to_grammar(&g), strict) {
                    (Ok(_), _) => {}
                    (Err(e), Some(true)) => {
                        return bad(format!("function `{name}` parameters: {e}"));
                    }
                    // Without `strict`, OpenAI takes any schema: one the grammar cannot
                    // follow (`anyOf` beside other keywords, a `pattern` of another regex
                    // dialect) lets the arguments be any object, which allows at least
                    // what the schema allows. A broken one (a `$ref` to nothing) is refused.
                    (Err(e), _) if !e.to_string().contains("not supported") => {
                        return bad(format!("function `{name}` parameters: {e}"));
                    }
                    (Err(e), _) => {
                        tracing::warn!(
                            "function `{name}`: its parameters cannot be enforced ({e}); any \
                             object is allowed as its arguments"
                        );
                        g = json!({"type": "object", "additionalProperties": true});
                    }
                }
                (Some(p.clone()), g)
            }
            Some(p) => {
                return bad(format!(
                    "function `{name}`: parameters must be a JSON schema object, not {p}"
                ))
            }
        };
        Ok(Tool {
            name,
            description,
            parameters,
            strict,
            grammar_schema,
        })
    }

    /// The object chat templates get (transformers passes OpenAI's form as given).
    pub fn to_openai(&self) -> Value {
        let mut f = Map::new();
        f.insert("name".into(), self.name.clone().into());
        if let Some(d) = &self.description {
            f.insert("description".into(), d.clone().into());
        }
        if let Some(p) = &self.parameters {
            f.insert("parameters".into(), p.clone());
        }
        if let Some(s) = self.strict {
            f.insert("strict".into(), s.into());
        }
        json!({"type": "function", "function": f})
    }

    /// The schema of its arguments object for the grammar, placed at `at` (a JSON pointer)
    /// in the schema of the calls: its references (`#/$defs/...`, `#`) are moved there.
    fn arguments_schema(&self, at: &str) -> Value {
        fn moved(v: &Value, at: &str) -> Value {
            match v {
                Value::Object(m) => Value::Object(
                    m.iter()
                        .map(|(k, v)| match (k.as_str(), v.as_str()) {
                            ("$ref", Some(r)) if r.starts_with('#') => {
                                (k.clone(), Value::String(format!("#{at}{}", &r[1..])))
                            }
                            _ => (k.clone(), moved(v, at)),
                        })
                        .collect(),
                ),
                Value::Array(a) => Value::Array(a.iter().map(|v| moved(v, at)).collect()),
                v => v.clone(),
            }
        }
        moved(&self.grammar_schema, at)
    }
}

/// Tools from OpenAI's `tools` array: at most [`MAX_TOOLS`], names unique.
pub fn tools_from_openai(list: &[Value]) -> Result<Vec<Tool>> {
    if list.len() > MAX_TOOLS {
        return Err(ToolError(format!(
            "{} tools: at most {MAX_TOOLS} per request",
            list.len()
        )));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, v) in list.iter().enumerate() {
        let t = Tool::from_openai(v).map_err(|e| ToolError(format!("tools[{i}]: {}", e.0)))?;
        if tools.iter().any(|u| u.name == t.name) {
            return Err(ToolError(format!(
                "tools[{i}]: function `{}` is declared twice",
                t.name
            )));
        }
        tools.push(t);
    }
    Ok(tools)
}

fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// What the model must do with its tools.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// Answer in text; the reply is not read for calls.
    None,
    /// Answer in text or call functions (OpenAI's default when there are tools).
    #[default]
    Auto,
    /// Call one function or more.
    Required,
    /// Call this function.
    Function(String),
}

impl ToolChoice {
    /// OpenAI's `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function",
    /// "function": {"name": ...}}` naming one of `tools`.
    pub fn from_openai(v: &Value, tools: &[Tool]) -> Result<ToolChoice> {
        let choice = match v {
            Value::String(s) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                _ => {
                    return Err(ToolError(format!(
                        "tool_choice `{s}`: it must be none, auto, required or a function"
                    )))
                }
            },
            Value::Object(o) => match o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
            {
                Some(n) if o.get("type").and_then(Value::as_str) == Some("function") => {
                    ToolChoice::Function(n.to_string())
                }
                _ => {
                    return Err(ToolError(format!(
                        "tool_choice {v}: a function is {{\"type\": \"function\", \"function\": \
                         {{\"name\": ...}}}}"
                    )))
                }
            },
            _ => {
                return Err(ToolError(format!(
                    "tool_choice must be a string or an object, not {v}"
                )))
            }
        };
        if choice != ToolChoice::None && tools.is_empty() {
            return Err(ToolError(
                "tool_choice other than none needs tools to choose from".into(),
            ));
        }
        if let ToolChoice::Function(n) = &choice {
            if !tools.iter().any(|t| &t.name == n) {
                return Err(ToolError(format!(
                    "tool_choice names function `{n}`, which is not among the tools"
                )));
            }
        }
        Ok(choice)
    }
}

/// How a model writes its calls, told by its chat template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call
    /// (Hermes; Qwen 2.5 and the templates that copied it).
    Hermes,
    /// `{"name": ..., "parameters": {...}}`, the whole reply, one call (Llama 3.1 to 3.3;
    /// Meta's templates refuse several calls in one message).
    Llama3,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
/// How a call object starts, as the grammar writes it: a reply that starts so is a call.
const CALL_START: &str = "{\"name\"";

impl ToolSyntax {
    /// The syntax a chat template writes calls in; `None` when it writes none keydiff knows
    /// (the model then cannot be given tools).
    pub fn of_template(source: &str) -> Option<ToolSyntax> {
        // Hermes' JSON in the tags, not the XML-like calls of Qwen3-Coder (`<function=`).
        if source.contains(HERMES_OPEN)
            && source.contains("arguments")
            && !source.contains("<function=")
        {
            Some(ToolSyntax::Hermes)
        } else if source.contains(PYTHON_TAG) || source.contains("\"parameters\": ") {
            Some(ToolSyntax::Llama3)
        } else {
            None
        }
    }

    /// The name of the arguments member of a call.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolSyntax::Hermes => "arguments",
            ToolSyntax::Llama3 => "parameters",
        }
    }

    /// The output form `choice` asks for: `None` for [`ToolChoice::None`]; calls only for
    /// `Required` and `Function` (several when `parallel` and the syntax has them); text or
    /// calls from their trigger on for `Auto`.
    pub fn format(
        self,
        tools: &[Tool],
        choice: &ToolChoice,
        parallel: bool,
    ) -> Result<Option<Format>> {
        let called: Vec<&Tool> = match choice {
            ToolChoice::None => return Ok(None),
            ToolChoice::Function(n) => tools.iter().filter(|t| &t.name == n).collect(),
            ToolChoice::Auto | ToolChoice::Required => tools.iter().collect(),
        };
        if called.is_empty() {
            return Err(ToolError("no tools to call".into()));
        }
        let key = self.arguments_key();
        let one = called.len() == 1;
        let calls: Vec<Value> = (called.iter().enumerate())
            .map(|(i, t)| {
                let at = match one {
                    true => format!("/properties/{key}"),
                    false => format!("/anyOf/{i}/properties/{key}"),
                };
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, key: t.arguments_schema(&at)},
                    "required": ["name", key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = match calls.len() {
            1 => calls.into_iter().next().expect("one"),
            _ => json!({ "anyOf": calls }),
        };
        let rules = json_schema::to_rules(&schema, "tool-call")
            .map_err(|e| ToolError(format!("the tools' schemas: {e}")))?;
        // A named function is called once, as OpenAI does.
        let parallel =
            parallel && self == ToolSyntax::Hermes && !matches!(choice, ToolChoice::Function(_));
        let auto = *choice == ToolChoice::Auto;
        let root = match self {
            ToolSyntax::Hermes => {
                let blocks = match parallel {
                    true => "block (\"\\n\" block)*",
                    false => "block",
                };
                // With `auto`, a reply that starts with a bare call object is read as calls
                // too (small Qwen models often leave the tags out).
                let bare = if auto { " | tool-call" } else { "" };
                format!(
                    "root ::= {blocks}{bare}\nblock ::= \"<tool_call>\\n\" tool-call \"\\n</tool_call>\"\n"
                )
            }
            ToolSyntax::Llama3 => "root ::= tool-call\n".to_string(),
        };
        let grammar = root + &rules;
        crate::grammar::Grammar::parse(&grammar)
            .map_err(|e| ToolError(format!("the tools' grammar: {e}")))?;
        Ok(Some(match auto {
            true => Format::Lazy {
                grammar,
                triggers: match self {
                    ToolSyntax::Hermes => vec![HERMES_OPEN.to_string()],
                    ToolSyntax::Llama3 => Vec::new(),
                },
                at_start: vec![CALL_START.to_string()],
                reasoning: None,
            },
            false => Format::Grammar(grammar),
        }))
    }

    /// The calls to `tools` in `text`, and the text around them. When a call cannot be read
    /// (not JSON, no such function, arguments that are not an object), there are no calls and
    /// the whole text is the content, as in vLLM: what the model wrote is not lost.
    pub fn parse(self, text: &str, tools: &[Tool]) -> Parsed {
        let calls = match self {
            ToolSyntax::Hermes => hermes_calls(text, tools),
            ToolSyntax::Llama3 => json_calls(text, tools, true),
        };
        match calls {
            Some((content, calls)) if !calls.is_empty() => Parsed { content, calls },
            _ => Parsed {
                content: text.to_string(),
                calls: Vec::new(),
            },
        }
    }

    /// How much of `text` (a reply so far) is surely content, not a call: the bytes that may
    /// stream. It only grows as `text` grows.
    pub fn content_len(self, text: &str) -> usize {
        // A reply that starts with an object may be a call object (or calls after Llama's
        // `<|python_tag|>`, which has no text).
        let t = trim_start(text);
        if t.is_empty() || t.starts_with('{') {
            return 0;
        }
        match self {
            ToolSyntax::Hermes => {
                let end = match text.find(HERMES_OPEN) {
                    Some(p) => p,
                    // Hold back an end that may begin `<tool_call>`.
                    None => {
                        let held = (1..HERMES_OPEN.len().min(text.len() + 1))
                            .rev()
                            .find(|&k| text.ends_with(&HERMES_OPEN[..k]))
                            .unwrap_or(0);
                        text.len() - held
                    }
                };
                // And whitespace that may come before a call, which the content leaves out.
                text[..end].trim_end().len()
            }
            ToolSyntax::Llama3 => match t.starts_with(PYTHON_TAG) || PYTHON_TAG.starts_with(t) {
                true => 0,
                false => text.len(),
            },
        }
    }
}

/// A reply read for calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// With calls, the text outside them, without whitespace at its end or between calls
    /// (empty when there is no other text); without, the whole reply as written.
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// A fresh call id, as OpenAI writes them (`call_` and 24 letters and digits).
pub fn call_id() -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..24)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect();
    format!("call_{tail}")
}

/// A call object (`{"name", <key>: {...}}`) of a declared function.
fn call(v: &Value, key: &str, tools: &[Tool]) -> Option<ToolCall> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?;
    if !tools.iter().any(|t| t.name == name) {
        return None;
    }
    // Models trained on either name write either; no member is no arguments.
    let args = o
        .get(key)
        .or_else(|| o.get("arguments"))
        .or_else(|| o.get("parameters"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    if !args.is_object() {
        return None;
    }
    Some(ToolCall {
        id: call_id(),
        name: name.to_string(),
        arguments: args,
    })
}

/// `<tool_call>` blocks: the text outside them and their calls. A last block without its
/// `</tool_call>` (the reply ended there) is read to the end.
fn hermes_calls(text: &str, tools: &[Tool]) -> Option<(String, Vec<ToolCall>)> {
    if !text.contains(HERMES_OPEN) {
        // A reply that is bare call objects.
        return json_calls(text, tools, false);
    }
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    let mut first = true;
    while let Some(p) = rest.find(HERMES_OPEN) {
        // The text before the first call; then only text that is not whitespace.
        if first || !rest[..p].trim().is_empty() {
            content.push_str(&rest[..p]);
        }
        first = false;
        let body = &rest[p + HERMES_OPEN.len()..];
        let (json, after) = match body.find(HERMES_CLOSE) {
            Some(e) => (&body[..e], &body[e + HERMES_CLOSE.len()..]),
            None => (body, ""),
        };
        let v: Value = serde_json::from_str(json.trim()).ok()?;
        calls.push(call(&v, "arguments", tools)?);
        rest = after;
    }
    content.push_str(rest);
    content.truncate(content.trim_end().len());
    Some((content, calls))
}

/// `text` without ASCII whitespace at its start (JSON's whitespace, and what the lazy
/// grammar's start triggers skip).
fn trim_start(text: &str) -> &str {
    text.trim_start_matches(|c: char| c.is_ascii_whitespace())
}

/// A reply that is a call object, or several separated by `;` (vLLM reads those in Llama
/// 3's replies), after an optional `<|python_tag|>` where `tag` (Llama's).
fn json_calls(text: &str, tools: &[Tool], tag: bool) -> Option<(String, Vec<ToolCall>)> {
    let t = trim_start(text);
    let mut t = match tag {
        true => trim_start(t.strip_prefix(PYTHON_TAG).unwrap_or(t)),
        false => t,
    };
    if !t.starts_with('{') {
        return None;
    }
    let mut calls = Vec::new();
    loop {
        let mut values = serde_json::Deserializer::from_str(t).into_iter::<Value>();
        let v = values.next()?.ok()?;
        calls.push(call(&v, "parameters", tools)?);
        let rest = trim_start(&t[values.byte_offset()..]);
        match rest.strip_prefix(';').map(trim_start) {
            None if rest.is_empty() => return Some((String::new(), calls)),
            Some("") => return Some((String::new(), calls)),
            Some(next) => t = next,
            None => return None,
        }
    }
}

/// A streamed reply's text, holding back what may be a call ([`ToolSyntax::content_len`])
/// until the reply ends and is read ([`ToolStream::finish`]).
#[derive(Debug, Clone)]
pub struct ToolStream {
    syntax: ToolSyntax,
    text: String,
    sent: usize,
}

impl ToolStream {
    pub fn new(syntax: ToolSyntax) -> Self {
        Self {
            syntax,
            text: String::new(),
            sent: 0,
        }
    }

    /// Takes the next piece of the reply; returns the content that may be sent now.
    pub fn push(&mut self, piece: &str) -> String {
        self.text.push_str(piece);
        let safe = self.syntax.content_len(&self.text);
        if safe <= self.sent {
            return String::new();
        }
        let out = self.text[self.sent..safe].to_string();
        self.sent = safe;
        out
    }

    /// The reply ended: the content not sent yet, and the calls.
    pub fn finish(self, tools: &[Tool]) -> Parsed {
        let mut p = self.syntax.parse(&self.text, tools);
        // What was sent is the start of the content: content only grows at its end while a
        // call may be coming, and the content of a parse begins with the text before the
        // first call.
        p.content = match p.content.get(self.sent..) {
            Some(rest) if p.content.starts_with(&self.text[..self.sent]) => rest.to_string(),
            _ => self.text[self.sent..].to_string(),
        };
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::{Grammar, GrammarState};
    use proptest::prelude::*;
    use std::sync::Arc;

    fn weather() -> Value {
        json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"]}}})
    }

    fn tools() -> Vec<Tool> {
        tools_from_openai(&[
            weather(),
            json!({"type": "function", "function": {"name": "now"}}),
        ])
        .unwrap()
    }

    fn err(v: Value) -> String {
        tools_from_openai(&[v]).unwrap_err().0
    }

    #[test]
    fn tools_are_checked_naming_the_problem() {
        let t = tools();
        assert_eq!(t[0].name, "get_weather");
        assert_eq!(t[1].parameters, None);
        assert_eq!(t[0].to_openai(), weather());
        assert!(err(json!({"type": "retrieval"})).contains("`retrieval` is not supported"));
        assert!(err(json!({"function": {"name": "f"}})).contains("\"type\": \"function\""));
        let named = |n: &str| json!({"type": "function", "function": {"name": n}});
        assert!(err(named("get weather")).contains("1 to 64 of a-z"));
        assert!(err(named(&"x".repeat(65))).contains("1 to 64"));
        assert!(err(named("")).contains("1 to 64"));
        let params =
            |p: Value| json!({"type": "function", "function": {"name": "f", "parameters": p}});
        assert!(err(params(json!({"type": "string"}))).contains("schema of an object"));
        assert!(err(params(json!([1]))).contains("JSON schema object"));
        // Keywords the grammar cannot enforce: left out of it, refused with `strict`.
        let unique = json!({"type": "object", "properties": {
            "t": {"type": "array", "uniqueItems": true}}, "not": {"required": ["t"]}});
        let loose = tools_from_openai(&[params(unique.clone())]).unwrap();
        assert_eq!(
            loose[0].parameters.as_ref(),
            Some(&unique),
            "as given, for the template"
        );
        let strict = json!({"type": "function", "function": {"name": "f", "strict": true,
            "parameters": unique}});
        let e = err(strict);
        assert!(
            e.contains("tools[0]") && e.contains("`f` parameters") && e.contains("`not` is not"),
            "{e}"
        );
        let strict_params = |p: Value| {
            json!({"type": "function", "function": {"name": "f", "strict": true,
                "parameters": p}})
        };
        assert!(
            err(strict_params(json!({"type": "object", "$ref": "http://x"}))).contains("`$ref`")
        );
        // Beyond the grammar without `strict`: any object.
        let any = tools_from_openai(&[params(json!({"type": "object", "$ref": "http://x"}))]);
        assert_eq!(
            any.unwrap()[0].grammar_schema,
            json!({"type": "object", "additionalProperties": true})
        );
        // Broken, not merely beyond the grammar: refused without `strict` too.
        assert!(err(params(json!({"type": "object", "properties": {
            "a": {"$ref": "#/$defs/nope"}}})))
        .contains("points at nothing"));
        let twice = tools_from_openai(&[named("f"), named("f")]).unwrap_err().0;
        assert!(
            twice.contains("tools[1]") && twice.contains("declared twice"),
            "{twice}"
        );
        let many: Vec<Value> = (0..=MAX_TOOLS).map(|i| named(&format!("f{i}"))).collect();
        assert!(tools_from_openai(&many)
            .unwrap_err()
            .0
            .contains("at most 128"));
    }

    #[test]
    fn tool_choice_is_read_and_checked() {
        let t = tools();
        let read = |v: Value| ToolChoice::from_openai(&v, &t);
        assert_eq!(read(json!("auto")), Ok(ToolChoice::Auto));
        assert_eq!(read(json!("none")), Ok(ToolChoice::None));
        assert_eq!(read(json!("required")), Ok(ToolChoice::Required));
        let f = json!({"type": "function", "function": {"name": "now"}});
        assert_eq!(read(f), Ok(ToolChoice::Function("now".into())));
        let unknown = json!({"type": "function", "function": {"name": "later"}});
        assert!(read(unknown)
            .unwrap_err()
            .0
            .contains("`later`, which is not among"));
        assert!(read(json!("always")).unwrap_err().0.contains("`always`"));
        assert!(read(json!({"name": "now"})).is_err());
        assert!(read(json!(1)).is_err());
        let none = ToolChoice::from_openai(&json!("required"), &[]);
        assert!(none.unwrap_err().0.contains("needs tools"));
    }

    #[test]
    fn the_template_tells_the_syntax() {
        assert_eq!(
            ToolSyntax::of_template("{{- '<tool_call>\\n{\"name\": ...\"arguments\": ' }}"),
            Some(ToolSyntax::Hermes)
        );
        // Qwen3-Coder's XML-like calls are not Hermes' JSON.
        assert_eq!(
            ToolSyntax::of_template("<tool_call>\n<function={{ name }}> arguments"),
            None
        );
        assert_eq!(
            ToolSyntax::of_template(r#"{{- '"parameters": ' }}"#),
            Some(ToolSyntax::Llama3)
        );
        assert_eq!(ToolSyntax::of_template("{{ messages }}"), None);
    }

    fn names(p: &Parsed) -> Vec<(&str, &Value)> {
        p.calls
            .iter()
            .map(|c| (c.name.as_str(), &c.arguments))
            .collect()
    }

    #[test]
    fn hermes_calls_are_read() {
        let t = tools();
        let h = ToolSyntax::Hermes;
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                    {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \
                    \"arguments\": {}}\n</tool_call>";
        let p = h.parse(text, &t);
        assert_eq!(
            names(&p),
            [
                ("get_weather", &json!({"city": "Paris"})),
                ("now", &json!({}))
            ]
        );
        assert_eq!(p.content, "Let me look.");
        // Whitespace between and after calls is not content; other text is.
        let later = h.parse(&format!("{text}\nDone.\n"), &t);
        assert_eq!(later.content, "Let me look.\n\nDone.");
        let only = h.parse("<tool_call>{\"name\": \"now\"}</tool_call>\n \n", &t);
        assert_eq!(only.content, "");
        assert!(p.calls[0].id.starts_with("call_") && p.calls[0].id.len() == 29);
        assert_ne!(p.calls[0].id, p.calls[1].id);
        // A last block the reply ended in.
        let cut = h.parse("<tool_call>\n{\"name\": \"now\"}", &t);
        assert_eq!(names(&cut), [("now", &json!({}))]);
        // A bare call object.
        let bare = h.parse(" {\"name\": \"now\", \"arguments\": {\"tz\": 1}}\n", &t);
        assert_eq!(names(&bare), [("now", &json!({"tz": 1}))]);
        assert_eq!(bare.content, "");
        // What cannot be read is content, all of it.
        for bad in [
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",
            "<tool_call>\n{\"name\": \"delete_all\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>\n{\"name\": \"now\", \"arguments\": [1]}\n</tool_call>",
            "{\"name\": \"now\"} and more",
            "The weather is fine.",
        ] {
            let p = h.parse(bad, &t);
            assert!(p.calls.is_empty(), "{bad}");
            assert_eq!(p.content, bad);
        }
    }

    #[test]
    fn llama3_calls_are_read() {
        let t = tools();
        let l = ToolSyntax::Llama3;
        let one = l.parse(
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
            &t,
        );
        assert_eq!(names(&one), [("get_weather", &json!({"city": "Oslo"}))]);
        let two = l.parse(
            "<|python_tag|>{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"now\", \
             \"arguments\": {\"tz\": 2}};",
            &t,
        );
        assert_eq!(
            names(&two),
            [("now", &json!({})), ("now", &json!({"tz": 2}))]
        );
        for bad in [
            "It is sunny.",
            "{\"name\": \"now\"} {\"name\": \"now\"}",
            "{\"name\": 3}",
        ] {
            assert!(l.parse(bad, &t).calls.is_empty(), "{bad}");
        }
    }

    /// Whether `g` takes all of `text` as a whole text.
    fn whole(g: &str, text: &str) -> bool {
        let mut s = GrammarState::new(Arc::new(Grammar::parse(g).unwrap()));
        s.push_all(text.as_bytes()) && s.is_done()
    }

    fn grammar(syntax: ToolSyntax, choice: ToolChoice, parallel: bool) -> String {
        match syntax.format(&tools(), &choice, parallel).unwrap() {
            Some(Format::Grammar(g)) => g,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn required_calls_follow_the_schemas() {
        let h = |p| grammar(ToolSyntax::Hermes, ToolChoice::Required, p);
        let block = |c: &str| format!("<tool_call>\n{c}\n</tool_call>");
        let paris = r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}"#;
        let now = r#"{"name": "now", "arguments": {}}"#;
        assert!(whole(&h(false), &block(paris)));
        assert!(whole(&h(false), &block(now)));
        assert!(!whole(
            &h(false),
            &format!("{}\n{}", block(paris), block(now))
        ));
        assert!(whole(
            &h(true),
            &format!("{}\n{}", block(paris), block(now))
        ));
        for bad in [
            r#"{"name": "get_weather", "arguments": {"unit": "c"}}"#,
            r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}}"#,
            r#"{"name": "later", "arguments": {}}"#,
            r#"{"arguments": {}, "name": "now"}"#,
        ] {
            assert!(!whole(&h(true), &block(bad)), "{bad}");
        }
        // Text before the calls, or a bare call, is not a reply that must call.
        assert!(!whole(&h(true), &format!("Sure.{}", block(now))));
        assert!(!whole(&h(true), now));
        // One named function, once.
        let named = grammar(ToolSyntax::Hermes, ToolChoice::Function("now".into()), true);
        assert!(whole(&named, &block(now)));
        assert!(!whole(&named, &block(paris)));
        assert!(!whole(&named, &format!("{}\n{}", block(now), block(now))));
        // Llama 3: the call object, `parameters`.
        let l = grammar(ToolSyntax::Llama3, ToolChoice::Required, true);
        assert!(whole(
            &l,
            r#"{"name": "get_weather", "parameters": {"city": "Oslo"}}"#
        ));
        assert!(!whole(&l, paris));
        assert_eq!(
            ToolSyntax::Hermes.format(&tools(), &ToolChoice::None, true),
            Ok(None)
        );
    }

    /// Tools whose schemas refer to their own `$defs` (as Pydantic writes them), or to
    /// themselves, in one grammar with other tools.
    #[test]
    fn references_in_parameters_are_their_own() {
        let nested = json!({"type": "function", "function": {"name": "move", "parameters": {
            "type": "object",
            "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}},
            "properties": {"to": {"$ref": "#/$defs/Loc"}}, "required": ["to"]}}});
        let tree = json!({"type": "function", "function": {"name": "tree", "parameters": {
            "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["kids"]}}});
        for list in [vec![nested.clone()], vec![weather(), nested, tree]] {
            let t = tools_from_openai(&list).unwrap();
            let g = grammar_of(&t, ToolChoice::Required);
            let go = r#"{"name": "move", "parameters": {"to": {"city": "Oslo"}}}"#;
            assert!(whole(&g, go));
            assert!(!whole(
                &g,
                r#"{"name": "move", "parameters": {"to": {"town": "Oslo"}}}"#
            ));
            if t.len() == 3 {
                let kids = r#"{"name": "tree", "parameters": {"kids": [{"kids": []}]}}"#;
                assert!(whole(&g, kids));
                assert!(!whole(
                    &g,
                    r#"{"name": "tree", "parameters": {"kids": [{}]}}"#
                ));
            }
        }
        // A schema without a type still makes the arguments an object.
        let untyped = json!({"type": "function", "function": {"name": "f", "parameters": {}}});
        let t = tools_from_openai(&[untyped]).unwrap();
        let g = grammar_of(&t, ToolChoice::Required);
        assert!(whole(&g, r#"{"name": "f", "parameters": {"x": 1}}"#));
        assert!(!whole(&g, r#"{"name": "f", "parameters": "x"}"#));
    }

    fn grammar_of(t: &[Tool], choice: ToolChoice) -> String {
        match ToolSyntax::Llama3.format(t, &choice, true).unwrap() {
            Some(Format::Grammar(g)) => g,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn auto_is_lazy_from_the_trigger() {
        let Some(Format::Lazy {
            grammar,
            triggers,
            at_start,
            ..
        }) = ToolSyntax::Hermes
            .format(&tools(), &ToolChoice::Auto, true)
            .unwrap()
        else {
            panic!("lazy")
        };
        assert_eq!(triggers, ["<tool_call>"]);
        assert_eq!(at_start, ["{\"name\""]);
        // From either trigger on: blocks, or a bare call.
        let now = r#"{"name": "now", "arguments": {}}"#;
        assert!(whole(
            &grammar,
            &format!("<tool_call>\n{now}\n</tool_call>")
        ));
        assert!(whole(&grammar, now));
        let Some(Format::Lazy { triggers, .. }) = ToolSyntax::Llama3
            .format(&tools(), &ToolChoice::Auto, true)
            .unwrap()
        else {
            panic!("lazy")
        };
        assert!(triggers.is_empty());
    }

    /// A reply in pieces: prose, call blocks (whole, cut, broken), bare calls, tags cut short.
    fn reply() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            Just("Sure, ".to_string()),
            Just("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>".to_string()),
            Just(
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"é\"}}"
                    .to_string()
            ),
            Just("<tool_call>{oops</tool_call>".to_string()),
            Just("{\"name\": \"now\"}".to_string()),
            Just("<tool_".to_string()),
            Just("<".to_string()),
            Just(" ".to_string()),
            Just("\n".to_string()),
            Just("<|python_tag|>".to_string()),
            "[a-z{}<>_ ]{0,6}",
        ];
        prop::collection::vec(piece, 0..6).prop_map(|v| v.concat())
    }

    proptest! {
        /// A stream sends, in pieces, the content a whole reply has, and the same calls:
        /// what it sends early is never taken back.
        #[test]
        fn a_stream_adds_up_to_the_whole_reply(
            text in reply(),
            cuts in prop::collection::vec(0usize..64, 0..8),
            llama in any::<bool>(),
        ) {
            let syntax = if llama { ToolSyntax::Llama3 } else { ToolSyntax::Hermes };
            let t = tools();
            let whole = syntax.parse(&text, &t);
            let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).collect();
            bounds.retain(|&b| text.is_char_boundary(b));
            bounds.push(text.len());
            bounds.sort_unstable();
            let mut stream = ToolStream::new(syntax);
            let mut sent = String::new();
            let mut at = 0;
            for b in bounds {
                let before = syntax.content_len(&text[..at]);
                sent += &stream.push(&text[at..b]);
                prop_assert!(syntax.content_len(&text[..b]) >= before);
                at = b;
            }
            let rest = stream.finish(&t);
            prop_assert_eq!(sent + &rest.content, whole.content.clone());
            prop_assert_eq!(names(&rest), names(&whole));
        }
    }
}
