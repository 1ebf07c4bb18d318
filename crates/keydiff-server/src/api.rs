//! The OpenAI wire format: requests, their checks and their mapping onto [`GenerateParams`],
//! and the response bodies.
//!
//! Unknown fields are ignored, as OpenAI clients send many; fields this server cannot honour
//! (`best_of` above `n` with a stream, `suffix` with `echo`, image content, JSON schema
//! keywords the grammar cannot enforce, tools for a model whose calls keydiff cannot read,
//! vLLM's and llama.cpp's samplers keydiff does not have, when on) are refused with a 400
//! naming the field rather than ignored, so that no client gets an answer it did not ask for.
//!
//! The output's form is OpenAI's `response_format` (`text`, `json_object`, `json_schema`) or
//! llama.cpp's `grammar` (GBNF) or `json_schema`, on both endpoints.
//!
//! Chat takes OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, and messages with
//! `tool_calls` and `tool` replies ([`keydiff::tools`]).
//!
//! `logprobs` follow each endpoint's form: an integer (0 to [`MAX_TOP_LOGPROBS`] alternatives)
//! for completions, where `echo` adds the prompt's; `logprobs: true` with `top_logprobs` for
//! chat.

use keydiff::tools::{Tool, ToolCall, ToolChoice, ToolSyntax};
use keydiff::{
    Format, GenerateParams, Message, Output, Prompt, Sampling, StopReason, MAX_TOP_LOGPROBS,
};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`: `include_usage` true when left out (vLLM's default), false when null.
#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default = "some_true")]
    pub include_usage: Option<bool>,
}

fn some_true() -> Option<bool> {
    Some(true)
}

/// Sampling and length fields shared by both endpoints. `top_k`, `min_p`,
/// `repetition_penalty`, `repeat_last_n` and `ignore_eos` are extensions (vLLM's and
/// llama.cpp's names).
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub max_tokens: Option<usize>,
    #[serde(default, deserialize_with = "whole")]
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    #[serde(default, deserialize_with = "whole")]
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// The last this many tokens are penalised; -1: the whole context (llama.cpp's).
    #[serde(default, deserialize_with = "whole")]
    pub repeat_last_n: Option<i64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    /// Any integer (OpenAI's and vLLM's); a negative one is taken as its 64 bits.
    #[serde(default, deserialize_with = "whole")]
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "whole")]
    pub n: Option<usize>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    pub ignore_eos: Option<bool>,
    pub response_format: Option<Value>,
    /// llama.cpp's: a GBNF grammar the output must be a text of.
    pub grammar: Option<String>,
    /// llama.cpp's: a JSON schema the output must be a value of.
    pub json_schema: Option<Value>,
    /// llama.cpp's lazy grammar: the text is free until one of `grammar_triggers` comes, and
    /// from that trigger on it is a text of `grammar` (or `json_schema`).
    pub grammar_lazy: Option<bool>,
    /// llama.cpp's triggers, `{"type": 1, "value": "<tool_call>"}`: words (type 1 or
    /// `"word"`) and tokens (type 0 or `"token"`, by their text); patterns are refused.
    pub grammar_triggers: Option<Vec<Value>>,
    /// vLLM's: generation also ends at these tokens ([`GenerateParams::stop_tokens`]).
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM's: no end of generation before this many tokens
    /// ([`GenerateParams::min_tokens`]).
    #[serde(default, deserialize_with = "whole")]
    pub min_tokens: Option<u64>,
    /// vLLM's sampling fields keydiff does not have: refused unless they ask for nothing
    /// ([`Common::refuse_unsupported`]).
    pub include_stop_str_in_output: Option<bool>,
    pub allowed_token_ids: Option<Vec<u32>>,
    pub bad_words: Option<Vec<String>>,
    pub use_beam_search: Option<bool>,
    pub prompt_logprobs: Option<Value>,
    /// vLLM's structured output: `guided_json` (a schema) and `guided_choice` (one of these
    /// strings), or the same as `structured_outputs.json` / `.choice`, are the output's form;
    /// `guided_regex`, `guided_grammar` (vLLM's grammar dialects) and the others are refused.
    pub guided_json: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub structured_outputs: Option<Value>,
    /// llama-server's names on its OpenAI endpoints: `n_predict` for `max_tokens` (-1: no
    /// limit), `repeat_penalty` for `repetition_penalty`.
    #[serde(default, deserialize_with = "whole")]
    pub n_predict: Option<i64>,
    pub repeat_penalty: Option<f32>,
    /// llama.cpp's samplers keydiff does not have: refused unless off.
    #[serde(flatten)]
    pub unsupported: LlamaSamplers,
}

/// An integer field that also takes a whole float (`2.0`), as vLLM's pydantic models and
/// llama-server's JSON reader do; `2.5` and values out of the field's range are refused.
fn whole<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i128>,
{
    use serde::de::Error;
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    let i = match (n.as_i64(), n.as_u64(), n.as_f64()) {
        (Some(i), _, _) => i128::from(i),
        (_, Some(u), _) => i128::from(u),
        (_, _, Some(f)) if f.fract() == 0.0 && f.abs() < 1e30 => f as i128,
        _ => {
            return Err(D::Error::custom(format!(
                "invalid value: {n}, expected a whole number"
            )))
        }
    };
    T::try_from(i)
        .map(Some)
        .map_err(|_| D::Error::custom(format!("invalid value: {n} is out of range")))
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// A string, token ids, or a one-element array of either (checked in [`Self::map`]).
    pub prompt: Value,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub best_of: Option<usize>,
    #[serde(flatten)]
    pub common: Common,
}

/// A chat message's content: a string, or parts of which only text is understood.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant's calls: `{"id", "type": "function", "function": {"name", "arguments"}}`,
    /// the arguments a JSON text.
    pub tool_calls: Option<Vec<Value>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
    /// An assistant's reasoning (as this server answers it), for templates that read it.
    pub reasoning_content: Option<String>,
    /// The same under vLLM's name (since late 2025; OpenAI's guidance for gpt-oss), which
    /// clients of vLLM send back.
    pub reasoning: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Variables for the chat template (vLLM's and llama.cpp's field), over the server's
    /// `--chat-template-kwargs`: e.g. `{"enable_thinking": false}` for Qwen 3.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// vLLM's rendering fields: refused where they ask for what keydiff does not do (a reply
    /// that goes on from the last assistant message, no generation prompt, the last message
    /// echoed).
    pub continue_final_message: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub common: Common,
}

/// Parses a JSON body, naming what is wrong with it.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("invalid request body: {e}"), None))
}

/// A request mapped onto the engine, with how to answer it.
#[derive(Debug)]
pub struct Mapped {
    pub params: GenerateParams,
    /// Completions' prompts after the first (`params.prompt`): a batch of prompts in one
    /// request, each answered with its own choices.
    pub more: Vec<Prompt>,
    /// Completions returned (`n`).
    pub n: usize,
    /// Completions generated, of which the `n` with the highest mean token logprob are
    /// returned (completions' `best_of`; `n` when absent). All of them are prefilled once.
    pub best_of: usize,
    /// Logprobs were turned on to rank `best_of` completions only: leave them out.
    pub hide_logprobs: bool,
    /// Send the prompt before the generated text (completions' `echo`).
    pub echo: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// Read the replies for calls to these tools, written in this syntax, as `tool_choice`
    /// asked (chat with tools and a `tool_choice` other than `none`).
    pub tools: Option<(ToolSyntax, Vec<Tool>, ToolChoice)>,
    /// The output's form was set by OpenAI's `response_format` or by the tools' calls, which
    /// shape the answer: a reasoning model's reasoning block before it is left free
    /// ([`keydiff::Format::after_reasoning`], as vLLM does). llama.cpp's `grammar` and
    /// `json_schema` fields constrain the whole reply, as in llama.cpp.
    pub answer_format: bool,
    /// How llama.cpp's own endpoints shape the answer.
    pub llama: LlamaReply,
    /// llama.cpp's `logit_bias` on texts: each of the text's tokens gets the bias, once the
    /// server has tokenized it (into `params.sampling.logit_bias`).
    pub bias_texts: TextBiases,
    /// Completions' `echo` with `max_tokens: 0` (vLLM's; the form of evaluation harnesses
    /// that score a text): the prompt and its logprobs only. One token is generated and left
    /// out of the answer and of `usage`.
    pub prompt_only: bool,
}

/// What llama.cpp's endpoints (`/completion`, `/infill`) answer beyond the engine's output.
#[derive(Debug, Clone, Default)]
pub struct LlamaReply {
    /// `n_predict: 0`: the prompt only, into the prompt cache (editor plugins warm it so):
    /// one token is sampled and left out of the answer.
    pub prefill_only: bool,
    /// `response_fields`: only these (paths such as `timings/prompt_n`, as flat keys).
    pub fields: Vec<String>,
    /// Tokens of the project's files cut to fit the context (`/infill`).
    pub cut: usize,
}

/// The most completions one request may ask for (`n`; OpenAI's limit). Each has its own KV
/// cache, planned against the memory there is when the request starts.
pub const MAX_N: usize = 128;

/// The most prompts one completions request may carry.
pub const MAX_PROMPTS: usize = 128;

/// Limits and defaults the server applies to every request.
#[derive(Debug, Clone, Copy)]
pub struct Defaults {
    /// Tokens generated when a request sets no `max_tokens` (`None`: up to the context).
    pub max_tokens: Option<usize>,
    /// How the model writes function calls (`None`: it cannot be given tools to call).
    pub tool_syntax: Option<ToolSyntax>,
    /// The checkpoint's recommended sampling, for the fields a request leaves out (empty
    /// with `--generation-config none`).
    pub sampling: keydiff::SamplingDefaults,
    /// Speculative decoding for every request (`keydiff serve --spec-type`).
    pub speculative: Option<keydiff::NgramSpec>,
}

impl Common {
    /// Checks the shared fields and builds the engine's parameters for `prompt`, with
    /// `logprobs` alternatives per generated token when asked.
    pub fn map(
        &self,
        prompt: Prompt,
        defaults: Defaults,
        logprobs: Option<usize>,
    ) -> Result<Mapped, ApiError> {
        let bad = |m: String, p: &'static str| Err(ApiError::invalid(m, Some(p)));
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_N).contains(&n) {
            return bad(format!("n = {n}: it must be from 1 to {MAX_N}"), "n");
        }
        self.refuse_unsupported()?;
        let logit_bias = match &self.logit_bias {
            None => Vec::new(),
            Some(m) => logit_bias(m)?,
        };
        let repeat_last_n = match self.repeat_last_n {
            Some(-1) => Some(usize::MAX),
            Some(n) if n < 0 => {
                return bad(
                    format!("repeat_last_n = {n}: it must be -1 (the context) or more"),
                    "repeat_last_n",
                )
            }
            n => n.map(|n| n as usize),
        };
        let n_predict = match self.n_predict {
            None | Some(-1) => None,
            Some(n) if n >= 1 => Some(n as usize),
            Some(n) => {
                return bad(
                    format!("n_predict = {n}: it must be -1 (no limit) or at least 1"),
                    "n_predict",
                )
            }
        };
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens).or(n_predict) {
            Some(0) => return bad("max_tokens must be at least 1".into(), "max_tokens"),
            Some(n) => n,
            // Until end of generation or the context; the engine sizes the cache to what the
            // context leaves.
            None => defaults.max_tokens.unwrap_or(usize::MAX),
        };
        let stop: Vec<String> = match &self.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        };
        if stop.iter().any(String::is_empty) {
            return bad("stop strings must not be empty".into(), "stop");
        }
        let d = Sampling::default();
        // What the request leaves out: the checkpoint's recommendation (vLLM's and llama.cpp's
        // servers), else OpenAI's defaults (temperature 1, top-p 1), with a fresh seed.
        let m = &defaults.sampling;
        let sampling = Sampling {
            temperature: self.temperature.or(m.temperature).unwrap_or(1.0),
            top_p: self.top_p.or(m.top_p).unwrap_or(1.0),
            top_k: (self.top_k.map(|k| k.max(0) as usize))
                .or(m.top_k)
                .unwrap_or(0),
            min_p: self.min_p.or(m.min_p).unwrap_or(0.0),
            repetition_penalty: (self.repetition_penalty)
                .or(self.repeat_penalty)
                .or(m.repetition_penalty)
                .unwrap_or(1.0),
            repeat_last_n: repeat_last_n.or(m.repeat_last_n).unwrap_or(d.repeat_last_n),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            logit_bias,
            format: self.format()?,
            seed: self.seed.map_or_else(rand::random, |s| s as u64),
            // vLLM's order on the OpenAI endpoints (llama.cpp's own take llama.cpp's).
            temperature_first: true,
            // OpenAI's penalties (the reply's tokens), unless the request (llama-server's
            // `repeat_last_n`, `repeat_penalty`) or the checkpoint (a GGUF's recommended
            // `penalty_last_n`) speaks llama.cpp's.
            output_penalties: self.repeat_last_n.is_none()
                && self.repeat_penalty.is_none()
                && m.repeat_last_n.is_none(),
        };
        sampling.check().map_err(|(field, e)| {
            ApiError::invalid(format!("invalid sampling parameter: {e}"), Some(field))
        })?;
        Ok(Mapped {
            params: GenerateParams {
                prompt,
                max_tokens,
                sampling,
                stop,
                ignore_eos: self.ignore_eos.unwrap_or(false),
                stop_tokens: self.stop_token_ids.clone().unwrap_or_default(),
                min_tokens: (self.min_tokens)
                    .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX)),
                profile: false,
                cancel: None,
                logprobs,
                prompt_logprobs: None,
                stop_indent: 0,
                time_limit: None,
                speculative: defaults.speculative,
            },
            more: Vec::new(),
            n,
            best_of: n,
            hide_logprobs: false,
            echo: false,
            stream: self.stream.unwrap_or(false),
            tools: None,
            answer_format: self.response_format.as_ref().is_some_and(|v| !v.is_null()),
            llama: LlamaReply::default(),
            bias_texts: Vec::new(),
            prompt_only: false,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage == Some(true)),
        })
    }
}

impl Common {
    /// Refuses vLLM's sampling fields that keydiff does not have, where they ask for
    /// something (a client that sends their defaults is answered).
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let asked = [
            (
                "include_stop_str_in_output",
                self.include_stop_str_in_output == Some(true),
            ),
            (
                "allowed_token_ids",
                self.allowed_token_ids
                    .as_ref()
                    .is_some_and(|v| !v.is_empty()),
            ),
            (
                "bad_words",
                self.bad_words.as_ref().is_some_and(|v| !v.is_empty()),
            ),
            ("use_beam_search", self.use_beam_search == Some(true)),
            (
                "prompt_logprobs",
                // vLLM's 0 asks for each prompt token's own logprob: something too.
                !null(&self.prompt_logprobs),
            ),
            ("guided_regex", !null(&self.guided_regex)),
            ("guided_grammar", !null(&self.guided_grammar)),
        ];
        match asked.iter().find(|a| a.1) {
            Some(&(field, _)) => Err(ApiError::invalid(
                format!("{field} is not supported"),
                Some(field),
            )),
            None => self.unsupported.refuse(),
        }
    }

    /// The output's form: OpenAI's `response_format` (`text`, `json_object`, or `json_schema`
    /// with its `json_schema.schema`), or llama.cpp's `grammar` or `json_schema`; one of them.
    /// A schema is compiled to a grammar here, so that what it cannot enforce is refused
    /// before the request queues.
    fn format(&self) -> Result<Format, ApiError> {
        let eager = self.eager_format()?;
        let triggers = self.grammar_triggers.as_deref().unwrap_or_default();
        if self.grammar_lazy != Some(true) {
            if !triggers.is_empty() {
                return Err(ApiError::invalid(
                    "grammar_triggers apply to a lazy grammar: set grammar_lazy to true",
                    Some("grammar_triggers"),
                ));
            }
            return Ok(eager);
        }
        let Format::Grammar(grammar) = eager else {
            return Err(ApiError::invalid(
                "grammar_lazy needs a grammar or json_schema to apply from its triggers on",
                Some("grammar_lazy"),
            ));
        };
        if triggers.is_empty() {
            return Err(ApiError::invalid(
                "grammar_lazy needs grammar_triggers (without one the grammar never applies)",
                Some("grammar_triggers"),
            ));
        }
        let words = triggers
            .iter()
            .map(lazy_trigger)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Format::Lazy {
            grammar,
            triggers: words,
            at_start: Vec::new(),
            reasoning: None,
        })
    }

    /// The output's form apart from `grammar_lazy` ([`Common::format`]).
    fn eager_format(&self) -> Result<Format, ApiError> {
        let bad = |m: String, p: &'static str| Err(ApiError::invalid(m, Some(p)));
        let response_format = self.response_format.as_ref().filter(|v| !v.is_null());
        let vllm = self.vllm_form()?;
        // A `text` format asks for nothing beside vLLM's forms (vLLM ignores it there).
        let response_format = response_format
            .filter(|f| vllm.is_none() || f.get("type").and_then(Value::as_str) != Some("text"));
        let given = [
            response_format.is_some(),
            self.grammar.is_some(),
            self.json_schema.is_some(),
            vllm.is_some(),
        ];
        if given.iter().filter(|g| **g).count() > 1 {
            return bad(
                "response_format, grammar, json_schema and vLLM's guided_json, guided_choice \
                 and structured_outputs each set the output's form; give one"
                    .into(),
                "response_format",
            );
        }
        let schema = |s: &Value, p: &'static str| -> Result<Format, ApiError> {
            let g = keydiff::json_schema::to_grammar(s)
                .map_err(|e| ApiError::invalid(e.to_string(), Some(p)))?;
            keydiff::grammar::Grammar::parse(&g).map_err(|e| {
                ApiError::invalid(format!("{e} (compiled from the schema)"), Some(p))
            })?;
            Ok(Format::Grammar(g))
        };
        if let Some(g) = &self.grammar {
            keydiff::grammar::Grammar::parse(g)
                .map_err(|e| ApiError::invalid(e.to_string(), Some("grammar")))?;
            return Ok(Format::Grammar(g.clone()));
        }
        if let Some(s) = &self.json_schema {
            return schema(s, "json_schema");
        }
        match vllm {
            Some((param, VllmForm::Json(s))) => return schema(&s, param),
            Some((param, VllmForm::Choice(choices))) => {
                let g = choice_grammar(&choices);
                keydiff::grammar::Grammar::parse(&g).map_err(|e| {
                    ApiError::invalid(format!("{e} (from the choices)"), Some(param))
                })?;
                return Ok(Format::Grammar(g));
            }
            None => {}
        }
        let Some(f) = response_format else {
            return Ok(Format::Text);
        };
        match f.get("type").and_then(Value::as_str) {
            Some("text") => Ok(Format::Text),
            // llama-server's: a schema beside `json_object` constrains it.
            // A schema of any value (`{}`, `true`) leaves JSON mode's object.
            Some("json_object") => match (f.get("schema")).filter(|s| {
                !s.is_null()
                    && *s != &Value::Bool(true)
                    && s.as_object().is_none_or(|o| !o.is_empty())
            }) {
                Some(s) => schema(s, "response_format"),
                None => Ok(Format::JsonObject),
            },
            Some("json_schema") => match f.get("json_schema").and_then(|j| j.get("schema")) {
                Some(s) => schema(s, "response_format"),
                None => bad(
                    "response_format json_schema needs its schema in json_schema.schema".into(),
                    "response_format",
                ),
            },
            _ => bad(
                format!(
                    "response_format {f} is not supported (text, json_object and json_schema are)"
                ),
                "response_format",
            ),
        }
    }
}

/// The text of one of llama.cpp's `grammar_triggers`: a word, or a token by its text (type
/// 1 or 0, or their names); a pattern (2, 3) is refused.
fn lazy_trigger(t: &Value) -> Result<String, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("grammar_triggers"));
    let kind = match t.get("type") {
        Some(Value::Number(n)) => match n.as_u64() {
            Some(0) => "token",
            Some(1) => "word",
            Some(2 | 3) => "pattern",
            _ => "",
        },
        Some(Value::String(k)) => match k.as_str() {
            "token" | "word" => k.as_str(),
            "pattern" | "pattern_full" => "pattern",
            _ => "",
        },
        _ => "",
    };
    match (kind, t.get("value").and_then(Value::as_str)) {
        ("pattern", _) => Err(bad(format!(
            "trigger {t}: pattern triggers are not supported (words and tokens are)"
        ))),
        ("word" | "token", Some(v)) if !v.is_empty() => Ok(v.to_string()),
        ("word" | "token", _) => Err(bad(format!("trigger {t} needs its text in `value`"))),
        _ => Err(bad(format!(
            "trigger {t}: expected {{\"type\": 1 (a word) or 0 (a token), \"value\": text}}"
        ))),
    }
}

/// vLLM's structured output as keydiff takes it: a JSON schema, or one of several strings.
enum VllmForm {
    Json(Value),
    Choice(Vec<String>),
}

impl Common {
    /// vLLM's `guided_json` / `guided_choice`, or `structured_outputs` with `json` or
    /// `choice`, with the field that gave it; its other forms are refused by name.
    fn vllm_form(&self) -> Result<Option<(&'static str, VllmForm)>, ApiError> {
        let choices = |v: &Value, p: &'static str| -> Result<VllmForm, ApiError> {
            let list: Option<Vec<String>> = v
                .as_array()
                .and_then(|a| a.iter().map(|c| c.as_str().map(String::from)).collect());
            match list {
                Some(l) if !l.is_empty() && l.iter().all(|c| !c.is_empty()) => {
                    Ok(VllmForm::Choice(l))
                }
                _ => Err(ApiError::invalid(
                    format!("{p} must be a list of non-empty strings"),
                    Some(p),
                )),
            }
        };
        let mut found = Vec::new();
        if let Some(s) = self.guided_json.as_ref().filter(|v| !v.is_null()) {
            // vLLM takes the schema as an object or as its JSON text.
            let s = match s {
                Value::String(t) => serde_json::from_str(t).map_err(|e| {
                    ApiError::invalid(format!("guided_json is not JSON: {e}"), Some("guided_json"))
                })?,
                other => other.clone(),
            };
            found.push(("guided_json", VllmForm::Json(s)));
        }
        if let Some(c) = self.guided_choice.as_ref().filter(|v| !v.is_null()) {
            found.push(("guided_choice", choices(c, "guided_choice")?));
        }
        if let Some(so) = self.structured_outputs.as_ref().filter(|v| !v.is_null()) {
            let Some(o) = so.as_object() else {
                return Err(ApiError::invalid(
                    "structured_outputs must be an object",
                    Some("structured_outputs"),
                ));
            };
            for (k, v) in o.iter().filter(|(_, v)| !v.is_null()) {
                match k.as_str() {
                    "json" => {
                        // A schema, or its JSON text (as vLLM takes both).
                        let schema = match v {
                            Value::String(t) => serde_json::from_str(t).map_err(|e| {
                                ApiError::invalid(
                                    format!("structured_outputs.json is not JSON: {e}"),
                                    Some("structured_outputs"),
                                )
                            })?,
                            other => other.clone(),
                        };
                        found.push(("structured_outputs", VllmForm::Json(schema)));
                    }
                    "choice" => {
                        found.push(("structured_outputs", choices(v, "structured_outputs")?))
                    }
                    // Settings of the backend, not a form.
                    "disable_fallback"
                    | "disable_any_whitespace"
                    | "disable_additional_properties"
                    | "whitespace_pattern" => {}
                    other => {
                        return Err(ApiError::invalid(
                            format!(
                                "structured_outputs.{other} is not supported (json and choice are)"
                            ),
                            Some("structured_outputs"),
                        ))
                    }
                }
            }
        }
        if found.len() > 1 {
            return Err(ApiError::invalid(
                "give one of guided_json, guided_choice and structured_outputs' forms",
                Some(found[1].0),
            ));
        }
        Ok(found.pop())
    }
}

/// A GBNF grammar whose texts are exactly `choices`.
fn choice_grammar(choices: &[String]) -> String {
    let lit = |c: &str| -> String {
        let mut s = String::from("\"");
        for ch in c.chars() {
            match ch {
                '\\' => s.push_str("\\\\"),
                '"' => s.push_str("\\\""),
                '\n' => s.push_str("\\n"),
                '\r' => s.push_str("\\r"),
                '\t' => s.push_str("\\t"),
                c => s.push(c),
            }
        }
        s.push('"');
        s
    };
    format!(
        "root ::= {}",
        choices
            .iter()
            .map(|c| lit(c))
            .collect::<Vec<_>>()
            .join(" | ")
    )
}

/// OpenAI's `logit_bias`: token ids (as strings, JSON's keys) to biases from −100 to 100,
/// which OpenAI documents as banning (−100) or forcing (100) a token. Ids outside the
/// vocabulary are refused by the engine.
fn logit_bias(m: &serde_json::Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("logit_bias"));
    m.iter()
        .map(|(k, v)| {
            let id: u32 = k
                .parse()
                .map_err(|_| bad(format!("logit_bias key `{k}` is not a token id")))?;
            match v.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => Err(bad(format!(
                    "logit_bias for token {id} is {v}; it must be a number from -100 to 100"
                ))),
            }
        })
        .collect()
}

impl CompletionRequest {
    pub fn map(self, defaults: Defaults) -> Result<Mapped, ApiError> {
        let bad = |m: &str, p: &'static str| Err(ApiError::invalid(m, Some(p)));
        let suffix = self.suffix.filter(|s| !s.is_empty());
        if suffix.is_some() && self.echo == Some(true) {
            return bad("echo with a suffix is not supported", "echo");
        }
        // One prompt (a string or token ids), or a batch of them.
        let mut prompts = match self.prompt {
            Value::Array(v) if !v.is_empty() && v.iter().all(|x| !x.is_number()) => {
                v.into_iter().map(prompt).collect::<Result<Vec<_>, _>>()?
            }
            p => vec![prompt(p)?],
        };
        if prompts.len() > MAX_PROMPTS {
            return Err(ApiError::invalid(
                format!(
                    "{} prompts: at most {MAX_PROMPTS} per request",
                    prompts.len()
                ),
                Some("prompt"),
            ));
        }
        // A suffix: each prompt is the text before the hole (fill in the middle).
        if let Some(suffix) = &suffix {
            for p in &mut prompts {
                let Prompt::Text(prefix) = p else {
                    return bad("a suffix needs text prompts, not token ids", "suffix");
                };
                *p = Prompt::Infill {
                    prefix: std::mem::take(prefix),
                    suffix: suffix.clone(),
                    repo: None,
                };
            }
        }
        let more = prompts.split_off(1);
        let prompt = prompts.pop().expect("one prompt at least");
        // `top_logprobs` is chat's; 0 (or null) asks for nothing and is let through.
        let top = &self.common.top_logprobs;
        if !null(top) && top.as_ref().and_then(Value::as_u64) != Some(0) {
            return bad(
                "top_logprobs is a chat field: completions take `logprobs: <alternatives>`",
                "top_logprobs",
            );
        }
        // `false`, as vLLM reads it: no logprobs.
        let logprobs = match &self.common.logprobs {
            Some(Value::Bool(false)) => None,
            v => alternatives(v, "logprobs")?,
        };
        // `echo` with `max_tokens: 0`: the prompt only (one token generated and left out).
        let echo = self.echo.unwrap_or(false);
        let mut common = self.common;
        let prompt_only = echo && common.max_completion_tokens.or(common.max_tokens) == Some(0);
        if prompt_only {
            (common.max_tokens, common.max_completion_tokens) = (Some(1), None);
        }
        let mut m = common.map(prompt, defaults, logprobs)?;
        m.prompt_only = prompt_only;
        if !more.is_empty() && m.stream {
            return bad(
                "a stream answers one prompt: stream each prompt of a batch in its own request",
                "prompt",
            );
        }
        m.more = more;
        if let Some(b) = self.best_of {
            if !(m.n..=MAX_N).contains(&b) {
                return Err(ApiError::invalid(
                    format!("best_of = {b}: it must be from n ({}) to {MAX_N}", m.n),
                    Some("best_of"),
                ));
            }
            if b > m.n && m.stream {
                return bad(
                    "best_of greater than n cannot be streamed (the best are known at the end)",
                    "best_of",
                );
            }
            m.best_of = b;
            if b > m.n && m.params.logprobs.is_none() {
                m.params.logprobs = Some(0);
                m.hide_logprobs = true;
            }
        }
        m.echo = echo;
        if m.echo {
            m.params.prompt_logprobs = logprobs;
        }
        Ok(m)
    }
}

/// An absent or `null` field.
fn null(v: &Option<Value>) -> bool {
    matches!(v, None | Some(Value::Null))
}

/// The field `param`: a count of logprob alternatives, an integer from 0 to
/// [`MAX_TOP_LOGPROBS`] (`None` when absent or `null`).
fn alternatives(v: &Option<Value>, param: &'static str) -> Result<Option<usize>, ApiError> {
    let Some(v) = v.as_ref().filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    v.as_u64()
        .and_then(|k| usize::try_from(k).ok())
        .filter(|&k| k <= MAX_TOP_LOGPROBS)
        .map(Some)
        .ok_or_else(|| {
            ApiError::invalid(
                format!(
                    "{param} must be an integer from 0 to {MAX_TOP_LOGPROBS} (alternatives per \
                     token), not {v}"
                ),
                Some(param),
            )
        })
}

/// A single prompt: a string or an array of token ids.
fn prompt(v: Value) -> Result<Prompt, ApiError> {
    match v {
        Value::String(t) => Ok(Prompt::Text(t)),
        Value::Array(ids) => ids
            .iter()
            .map(|x| x.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .map(Prompt::Tokens)
            .ok_or_else(|| {
                ApiError::invalid(
                    "prompt must be a string or an array of token ids (integers >= 0)",
                    Some("prompt"),
                )
            }),
        other => Err(ApiError::invalid(
            format!("prompt must be a string or an array of token ids, not {other}"),
            Some("prompt"),
        )),
    }
}

impl ChatRequest {
    pub fn map(self, defaults: Defaults) -> Result<Mapped, ApiError> {
        let bad = |m: String, p: &'static str| Err(ApiError::invalid(m, Some(p)));
        for (field, asked) in [
            (
                "continue_final_message",
                self.continue_final_message == Some(true),
            ),
            (
                "add_generation_prompt",
                self.add_generation_prompt == Some(false),
            ),
            ("echo", self.echo == Some(true)),
        ] {
            if asked {
                return bad(
                    format!(
                        "{field} is not supported: chat replies start a new assistant turn \
                         (/v1/completions continues any text)"
                    ),
                    field,
                );
            }
        }
        let tools = keydiff::tools::tools_from_openai(self.tools.as_deref().unwrap_or_default())
            .map_err(|e| ApiError::invalid(e.to_string(), Some("tools")))?;
        let choice = match self.tool_choice.as_ref().filter(|v| !v.is_null()) {
            Some(v) => ToolChoice::from_openai(v, &tools)
                .map_err(|e| ApiError::invalid(e.to_string(), Some("tool_choice")))?,
            None if tools.is_empty() => ToolChoice::None,
            None => ToolChoice::Auto,
        };
        // The calls' grammar sets the output's form, unless the model is not to call.
        let tool_format = match (choice != ToolChoice::None, defaults.tool_syntax) {
            (false, _) => None,
            (true, None) => {
                return bad(
                    "this model's chat template writes no function calls keydiff can read \
                     (Hermes <tool_call> blocks, as Qwen 2.5, or Llama 3.x JSON calls), so it \
                     cannot be given tools to call; tool_choice none renders them only"
                        .into(),
                    "tools",
                )
            }
            (true, Some(syntax)) => {
                let c = &self.common;
                let text = |v: &Value| v.is_null() || v.get("type").is_some_and(|t| t == "text");
                if c.response_format.as_ref().is_some_and(|v| !text(v))
                    || c.grammar.is_some()
                    || c.json_schema.is_some()
                {
                    return bad(
                        "tools to call set the output's form (calls, or text then calls); \
                         response_format, grammar and json_schema cannot be added to it \
                         (tool_choice none allows them)"
                            .into(),
                        "tool_choice",
                    );
                }
                let parallel = self.parallel_tool_calls.unwrap_or(true);
                let format = syntax
                    .format(&tools, &choice, parallel)
                    .map_err(|e| ApiError::invalid(e.to_string(), Some("tools")))?;
                format.map(|f| (syntax, f, choice.clone()))
            }
        };
        let on = match &self.common.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(v) => {
                return bad(
                    format!("logprobs must be true or false for chat, not {v}"),
                    "logprobs",
                )
            }
        };
        let top = alternatives(&self.common.top_logprobs, "top_logprobs")?;
        // 0 asks for nothing (vLLM lets it through without `logprobs`).
        if top.is_some_and(|k| k > 0) && !on {
            return bad(
                "top_logprobs needs logprobs set to true".into(),
                "top_logprobs",
            );
        }
        let messages = messages(self.messages)?;
        let logprobs = on.then(|| top.unwrap_or(0));
        let template_kwargs = template_kwargs(self.chat_template_kwargs)?;
        let prompt = match tools.is_empty() && template_kwargs.is_empty() {
            true => Prompt::Chat(messages),
            false => Prompt::ChatTools {
                messages,
                tools: tools.clone(),
                template_kwargs,
            },
        };
        let mut m = self.common.map(prompt, defaults, logprobs)?;
        if let Some((syntax, format, choice)) = tool_format {
            m.params.sampling.format = format;
            m.answer_format = true;
            m.tools = Some((syntax, tools, choice));
        }
        Ok(m)
    }
}

/// An assistant message's `tool_calls[j]`, with its arguments read from their JSON text (an
/// object is taken too).
fn tool_call(v: &Value, at: &str) -> Result<ToolCall, ApiError> {
    let bad = |m: String| ApiError::invalid(format!("{at}: {m}"), Some("messages"));
    let f = v
        .get("function")
        .ok_or_else(|| bad("a tool call needs its `function`".into()))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("a tool call's function needs a string `name`".into()))?;
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(t)) => serde_json::from_str(t)
            .map_err(|e| bad(format!("the arguments of `{name}` are not JSON: {e}")))?,
        Some(o @ Value::Object(_)) => o.clone(),
        Some(o) => {
            return Err(bad(format!(
                "the arguments of `{name}` must be a JSON text, not {o}"
            )))
        }
    };
    Ok(ToolCall {
        id: v
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        name: name.to_string(),
        arguments,
    })
}

/// Calls in OpenAI's form, the arguments a JSON text; with their `index` for a stream's
/// delta.
pub fn tool_calls(calls: &[ToolCall], indexed: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let mut v = json!({
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments.to_string()},
            });
            if indexed {
                v["index"] = k.into();
            }
            v
        })
        .collect()
}

/// A request's `chat_template_kwargs`, refused when it names a variable the renderer sets.
fn template_kwargs(
    kwargs: Option<serde_json::Map<String, Value>>,
) -> Result<keydiff::TemplateKwargs, ApiError> {
    let kwargs = kwargs.unwrap_or_default();
    keydiff::check_template_kwargs(&kwargs)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("chat_template_kwargs")))?;
    Ok(kwargs)
}

/// Chat messages in the engine's form: text content only, `developer` as `system`.
pub fn messages(list: Vec<ChatMessage>) -> Result<Vec<Message>, ApiError> {
    let bad = |m: String| Err(ApiError::invalid(m, Some("messages")));
    if list.is_empty() {
        return bad("messages must not be empty".into());
    }
    let mut messages = Vec::with_capacity(list.len());
    for (i, m) in list.into_iter().enumerate() {
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                // Joined by line breaks, as vLLM and llama.cpp join text parts.
                let mut text = String::new();
                for (k, p) in parts.into_iter().enumerate() {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => {
                            if k > 0 {
                                text.push('\n');
                            }
                            text.push_str(&t);
                        }
                        (kind, _) => {
                            return bad(format!(
                                "content part `{kind}` is not supported (text only)"
                            ))
                        }
                    }
                }
                text
            }
        };
        // OpenAI's `developer` role is the system prompt of chat templates.
        let role = match m.role.as_str() {
            "developer" => "system".to_string(),
            _ => m.role,
        };
        let tool_calls = (m.tool_calls.iter().flatten().enumerate())
            .map(|(j, c)| tool_call(c, &format!("messages[{i}].tool_calls[{j}]")))
            .collect::<Result<Vec<_>, _>>()?;
        messages.push(Message {
            role,
            content,
            tool_calls,
            tool_call_id: m.tool_call_id,
            reasoning_content: m.reasoning_content.or(m.reasoning),
        });
    }
    Ok(messages)
}

/// llama.cpp's own sampling and length fields (its `/completion` and `/infill`), with
/// llama.cpp's defaults. Fields that steer llama.cpp's own slots (`cache_prompt`, `id_slot`)
/// and `t_max_prompt_ms` (which llama.cpp does not implement either) are ignored, as unknown
/// fields are.
#[derive(Debug, Default, Deserialize)]
pub struct LlamaParams {
    #[serde(default, deserialize_with = "whole")]
    pub n_predict: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
    pub max_tokens: Option<i64>,
    /// End where a line starts less indented ([`GenerateParams::stop_indent`]).
    #[serde(default, deserialize_with = "whole")]
    pub n_indent: Option<i64>,
    /// End at a line break after this many milliseconds of generation
    /// ([`GenerateParams::time_limit`]); 0 or less: no limit.
    #[serde(default, deserialize_with = "whole")]
    pub t_max_predict_ms: Option<i64>,
    /// The samplers of llama.cpp's chain, by name (or alternative name) or as a string of
    /// their letters (`kpmt`): of those keydiff has, the ones not listed are off
    /// (`temperature` 1, `top_k` 0, `top_p` 1, `min_p` 0, `penalties` none). Their order is
    /// keydiff's.
    pub samplers: Option<Value>,
    pub response_fields: Option<Vec<String>>,
    pub temperature: Option<f32>,
    #[serde(default, deserialize_with = "whole")]
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    #[serde(default, deserialize_with = "whole")]
    pub repeat_last_n: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    #[serde(default, deserialize_with = "whole")]
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    pub stream: Option<bool>,
    pub ignore_eos: Option<bool>,
    pub grammar: Option<String>,
    pub json_schema: Option<Value>,
    pub grammar_lazy: Option<bool>,
    pub grammar_triggers: Option<Vec<Value>>,
    /// `[[token, bias], …]` (a token id or a text, whose every token is biased; a number, or
    /// `false`: never), or OpenAI's object form.
    pub logit_bias: Option<Value>,
    /// The probabilities of each generated token and of its `n_probs` most likely
    /// alternatives, before sampling (`completion_probabilities`; at most
    /// [`MAX_TOP_LOGPROBS`]).
    #[serde(default, deserialize_with = "whole")]
    pub n_probs: Option<i64>,
    /// llama.cpp's samplers keydiff does not have, and probabilities after its samplers:
    /// refused unless off ([`LlamaParams::refuse_unsupported`]).
    #[serde(flatten)]
    pub unsupported: LlamaSamplers,
}

/// llama.cpp's samplers keydiff does not have. llama-server reads them on every endpoint, its
/// OpenAI ones too: each endpoint here refuses them unless they are off
/// ([`LlamaSamplers::refuse`]), rather than answering without them.
#[derive(Debug, Default, Deserialize)]
pub struct LlamaSamplers {
    /// Probabilities after the samplers (keydiff's are taken before them).
    pub post_sampling_probs: Option<bool>,
    pub typical_p: Option<f32>,
    #[serde(default, deserialize_with = "whole")]
    pub mirostat: Option<i64>,
    pub dynatemp_range: Option<f32>,
    pub dry_multiplier: Option<f32>,
    pub xtc_probability: Option<f32>,
    pub top_n_sigma: Option<f32>,
}

impl LlamaSamplers {
    /// Refuses the first sampler that is on (llama.cpp's web UI and editor plugins send them
    /// all, at their defaults, which are off).
    fn refuse(&self) -> Result<(), ApiError> {
        if self.post_sampling_probs == Some(true) {
            return Err(ApiError::invalid(
                "post_sampling_probs is not supported (keydiff's probabilities are taken \
                 before its samplers)",
                Some("post_sampling_probs"),
            ));
        }
        let on = [
            ("typical_p", self.typical_p.is_some_and(|p| p < 1.0)),
            ("mirostat", self.mirostat.is_some_and(|m| m != 0)),
            (
                "dynatemp_range",
                self.dynatemp_range.is_some_and(|r| r > 0.0),
            ),
            (
                "dry_multiplier",
                self.dry_multiplier.is_some_and(|m| m > 0.0),
            ),
            (
                "xtc_probability",
                self.xtc_probability.is_some_and(|p| p > 0.0),
            ),
            ("top_n_sigma", self.top_n_sigma.is_some_and(|s| s > 0.0)),
        ];
        match on.iter().find(|o| o.1) {
            Some(&(field, _)) => Err(ApiError::invalid(
                format!("{field} is not supported (keydiff's samplers: {KEYDIFF_SAMPLERS})"),
                Some(field),
            )),
            None => Ok(()),
        }
    }
}

/// llama.cpp's seed for "a fresh one" (`LLAMA_DEFAULT_SEED`), as negative ones are.
const LLAMA_RANDOM_SEED: i64 = 0xFFFF_FFFF;

impl LlamaParams {
    /// Refuses llama.cpp's samplers that keydiff does not have, unless they are off (its web
    /// UI and editor plugins send them all, at their defaults).
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        self.unsupported.refuse()
    }

    /// The request on `prompt`, as the OpenAI endpoints would run it with these settings.
    fn map(self, prompt: Prompt, defaults: Defaults) -> Result<Mapped, ApiError> {
        // llama.cpp's n_predict: −1 (the default) generates to the end or the context; 0
        // only prefills.
        let n_predict = self.n_predict.or(self.max_tokens);
        let n_indent = self.n_indent.map_or(0, |n| n.max(0) as usize);
        let time_limit = (self.t_max_predict_ms)
            .filter(|&ms| ms > 0)
            .map(|ms| std::time::Duration::from_millis(ms as u64));
        let response_fields = self.response_fields.clone().unwrap_or_default();
        let max_tokens = match n_predict {
            None => None,
            Some(n) if n < 0 => Some(usize::MAX),
            Some(0) => Some(1),
            Some(n) => Some(n as usize),
        };
        let samplers = match &self.samplers {
            None => None,
            Some(v) => Some(sampler_names(v)?),
        };
        let listed = |name: &str| samplers.as_ref().is_none_or(|s| s.contains(&name));
        // llama.cpp's defaults, under the checkpoint's recommendation where it gives one.
        let m = defaults.sampling;
        let penalties = listed("penalties");
        self.refuse_unsupported()?;
        let (bias_ids, bias_texts) = match &self.logit_bias {
            None => (Vec::new(), Vec::new()),
            Some(v) => llama_logit_bias(v)?,
        };
        let common = Common {
            max_tokens,
            temperature: Some(match listed("temperature") {
                true => self.temperature.or(m.temperature).unwrap_or(0.8),
                false => 1.0,
            }),
            top_k: Some(match listed("top_k") {
                true => (self.top_k).or(m.top_k.map(|k| k as i64)).unwrap_or(40),
                false => 0,
            }),
            top_p: Some(match listed("top_p") {
                true => self.top_p.or(m.top_p).unwrap_or(0.95),
                false => 1.0,
            }),
            min_p: Some(match listed("min_p") {
                true => self.min_p.or(m.min_p).unwrap_or(0.05),
                false => 0.0,
            }),
            repetition_penalty: (self.repeat_penalty)
                .or(m.repetition_penalty)
                .filter(|_| penalties),
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty.filter(|_| penalties),
            frequency_penalty: self.frequency_penalty.filter(|_| penalties),
            seed: (self.seed).filter(|&s| s >= 0 && s != LLAMA_RANDOM_SEED),
            // llama.cpp drops empty stop strings.
            stop: self.stop.map(|s| {
                let v = match s {
                    StopInput::One(s) => vec![s],
                    StopInput::Many(v) => v,
                };
                StopInput::Many(v.into_iter().filter(|s| !s.is_empty()).collect())
            }),
            stream: self.stream,
            ignore_eos: self.ignore_eos,
            grammar: self.grammar,
            json_schema: self.json_schema,
            grammar_lazy: self.grammar_lazy,
            grammar_triggers: self.grammar_triggers,
            ..Common::default()
        };
        let logprobs = match self.n_probs {
            None | Some(..=0) => None,
            Some(n) if n as u64 > MAX_TOP_LOGPROBS as u64 => {
                return Err(ApiError::invalid(
                    format!("n_probs = {n}: at most {MAX_TOP_LOGPROBS} are reported"),
                    Some("n_probs"),
                ))
            }
            Some(n) => Some(n as usize),
        };
        let mut m = common.map(prompt, defaults, logprobs)?;
        // llama.cpp's endpoints: llama.cpp's order and penalties.
        m.params.sampling.temperature_first = false;
        m.params.sampling.output_penalties = false;
        m.params.sampling.logit_bias.extend(bias_ids);
        m.bias_texts = bias_texts;
        m.params.stop_indent = n_indent;
        m.params.time_limit = time_limit;
        m.llama = LlamaReply {
            prefill_only: n_predict == Some(0),
            fields: response_fields,
            cut: 0,
        };
        Ok(m)
    }
}

/// The samplers `samplers` lists, by llama.cpp's names: an array of names (its alternative
/// names too) or a string of letters (`k` top-k, `p` top-p, `m` min-p, `t` temperature,
/// `e` penalties, as llama.cpp's `--sampling-seq`). Names keydiff does not have are left out.
fn sampler_names(v: &Value) -> Result<Vec<&'static str>, ApiError> {
    let by_name = |n: &str| match n {
        "top_k" | "top-k" => Some("top_k"),
        "top_p" | "top-p" | "nucleus" => Some("top_p"),
        "min_p" | "min-p" => Some("min_p"),
        "temperature" | "temp" => Some("temperature"),
        "penalties" => Some("penalties"),
        _ => None,
    };
    let by_letter = |c: char| match c {
        'k' => Some("top_k"),
        'p' => Some("top_p"),
        'm' => Some("min_p"),
        't' => Some("temperature"),
        'e' => Some("penalties"),
        _ => None,
    };
    match v {
        Value::String(s) => Ok(s.chars().filter_map(by_letter).collect()),
        Value::Array(a) if a.iter().all(Value::is_string) => {
            Ok(a.iter().filter_map(|x| by_name(x.as_str()?)).collect())
        }
        _ => Err(ApiError::invalid(
            format!("samplers must be an array of names or a string of letters, not {v}"),
            Some("samplers"),
        )),
    }
}

/// The samplers keydiff has, for messages.
const KEYDIFF_SAMPLERS: &str =
    "penalties, top_k, top_p, min_p, temperature, logit_bias, grammar, json_schema";

/// Texts and the bias of each of their tokens (llama.cpp's `logit_bias`).
pub type TextBiases = Vec<(String, f32)>;

/// llama.cpp's `logit_bias`: `[[token, bias], …]`, or an object of token (id or text) to bias,
/// where a token is an id or a text (each of the text's tokens is biased) and a bias a number
/// or `false` (the token never comes). Ids outside the vocabulary are refused by the engine.
/// The ids, and the texts to tokenize ([`Mapped::bias_texts`]).
fn llama_logit_bias(v: &Value) -> Result<(Vec<(u32, f32)>, TextBiases), ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("logit_bias"));
    let pairs: Vec<(Value, &Value)> = match v {
        Value::Array(a) => (a.iter())
            .map(|el| match el.as_array().map(Vec::as_slice) {
                Some([t, b]) => Ok((t.clone(), b)),
                _ => Err(bad(format!(
                    "logit_bias entry {el}: it must be a [token, bias] pair"
                ))),
            })
            .collect::<Result<_, _>>()?,
        Value::Object(m) => (m.iter())
            .map(|(k, b)| {
                let t = k.parse::<u64>().map_or_else(|_| json!(k), |id| json!(id));
                (t, b)
            })
            .collect(),
        _ => {
            return Err(bad(format!(
                "logit_bias must be an array of [token, bias] pairs or an object, not {v}"
            )))
        }
    };
    let (mut ids, mut texts) = (Vec::new(), Vec::new());
    for (t, b) in pairs {
        let bias = match b {
            Value::Bool(false) => f32::NEG_INFINITY,
            Value::Number(n) if n.as_f64().is_some_and(f64::is_finite) => {
                n.as_f64().unwrap_or_default() as f32
            }
            _ => {
                return Err(bad(format!(
                    "logit_bias for {t} is {b}; it must be a number or false"
                )))
            }
        };
        match t {
            Value::Number(n) => match n.as_u64().and_then(|id| u32::try_from(id).ok()) {
                Some(id) => ids.push((id, bias)),
                None => return Err(bad(format!("logit_bias token {n} is not a token id"))),
            },
            Value::String(s) if !s.is_empty() => texts.push((s, bias)),
            _ => {
                return Err(bad(format!(
                    "logit_bias token {t}: it must be a token id or a non-empty text"
                )))
            }
        }
    }
    Ok((ids, texts))
}

/// `POST /completion` (and `/completions`), llama.cpp's own completion endpoint: one prompt,
/// a string or token ids, answered in llama.cpp's form.
#[derive(Debug, Deserialize)]
pub struct LlamaCompletionRequest {
    pub prompt: Value,
    #[serde(flatten)]
    pub params: LlamaParams,
}

impl LlamaCompletionRequest {
    pub fn map(self, defaults: Defaults) -> Result<Mapped, ApiError> {
        let p = match self.prompt {
            Value::Array(v) if v.iter().any(|x| !x.is_number()) => {
                return Err(ApiError::invalid(
                    "prompt must be one string or one array of token ids here (several prompts \
                     go to /v1/completions)",
                    Some("prompt"),
                ))
            }
            p => prompt(p)?,
        };
        self.params.map(p, defaults)
    }
}

/// `POST /infill`, llama.cpp's fill in the middle with the project's other files, which editor
/// plugins (llama.vim, llama.vscode) call. Its fields are llama.cpp's ([`LlamaParams`]).
#[derive(Debug, Deserialize)]
pub struct InfillRequest {
    #[serde(default)]
    pub input_prefix: String,
    #[serde(default)]
    pub input_suffix: String,
    /// Other files: `{"filename", "text"}` each.
    #[serde(default)]
    pub input_extra: Vec<Value>,
    /// Text after `input_prefix` (llama.cpp appends it there).
    #[serde(default)]
    pub prompt: String,
    #[serde(flatten)]
    pub params: LlamaParams,
}

impl InfillRequest {
    pub fn map(self, defaults: Defaults) -> Result<Mapped, ApiError> {
        let mut repo = Vec::with_capacity(self.input_extra.len());
        for (i, chunk) in self.input_extra.iter().enumerate() {
            let text = chunk.get("text").and_then(Value::as_str);
            let name = match chunk.get("filename") {
                None => Some("tmp"),
                Some(n) => n.as_str(),
            };
            let (Some(text), Some(name)) = (text, name) else {
                return Err(ApiError::invalid(
                    format!(
                        "input_extra[{i}] must be {{\"filename\": string, \"text\": string}}, \
                         not {chunk}"
                    ),
                    Some("input_extra"),
                ));
            };
            repo.push(keydiff::InfillFile {
                name: name.to_string(),
                text: text.to_string(),
            });
        }
        let prompt = Prompt::Infill {
            prefix: self.input_prefix + &self.prompt,
            suffix: self.input_suffix,
            repo: Some(repo),
        };
        self.params.map(prompt, defaults)
    }
}

/// `POST /tokenize` (vLLM's): a prompt or chat messages, tokenized as the completion
/// endpoints would (BOS, chat template).
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    /// Tools rendered with `messages`, as chat renders them.
    pub tools: Option<Vec<Value>>,
    /// Variables for the chat template, as chat takes them.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// `false` tokenizes a `prompt` as Hugging Face's `tokenizer(text,
    /// add_special_tokens=False)` does: no BOS, special tokens written in the text parsed (what
    /// a client that sends the ids back as a prompt, such as lm-evaluation-harness, expects).
    /// The default, `true`, tokenizes it as `/v1/completions` does.
    pub add_special_tokens: Option<bool>,
}

impl TokenizeRequest {
    /// The text to tokenize without special-token handling (`add_special_tokens: false`),
    /// else `None`.
    pub fn raw_text(&self) -> Option<&str> {
        match (&self.prompt, &self.messages, self.add_special_tokens) {
            (Some(p), None, Some(false)) => Some(p),
            _ => None,
        }
    }

    pub fn prompt(self) -> Result<Prompt, ApiError> {
        let tools = keydiff::tools::tools_from_openai(self.tools.as_deref().unwrap_or_default())
            .map_err(|e| ApiError::invalid(e.to_string(), Some("tools")))?;
        match (self.prompt, self.messages) {
            (Some(_), None) if !tools.is_empty() => Err(ApiError::invalid(
                "tools go with `messages`, not a `prompt`",
                Some("tools"),
            )),
            (Some(p), None) => Ok(Prompt::Text(p)),
            (None, Some(m)) => Ok(Prompt::ChatTools {
                messages: messages(m)?,
                tools,
                template_kwargs: template_kwargs(self.chat_template_kwargs)?,
            }),
            _ => Err(ApiError::invalid(
                "give either `prompt` or `messages`",
                Some("prompt"),
            )),
        }
    }
}

/// `POST /detokenize` (vLLM's).
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

/// `POST /slots/{id}?action=save|restore`'s body (llama.cpp's).
#[derive(Debug, Deserialize)]
pub struct SlotFileRequest {
    /// A file name in the server's `--slot-save-path`.
    pub filename: String,
}

/// A slot file's name, which must stay in `--slot-save-path` (llama.cpp's rule: a plain file
/// name, no directories): not empty, at most 240 bytes (room for the temporary name it is
/// written under), no `/`, `\`, `:` (a Windows drive), NUL or other control characters, not
/// `.` or `..`.
pub fn check_slot_filename(name: &str) -> Result<(), ApiError> {
    let bad = name.is_empty()
        || name.len() > 240
        || name == "."
        || name == ".."
        || name
            .chars()
            .any(|c| c == '/' || c == '\\' || c == ':' || c.is_control());
    if bad {
        return Err(ApiError::invalid(
            format!(
                "invalid filename `{}`: a plain file name in the server's --slot-save-path \
                 (no directories or drives, no control characters, at most 240 bytes)",
                name.escape_debug()
            ),
            Some("filename"),
        ));
    }
    Ok(())
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::Eos | StopReason::StopString | StopReason::Indent => "stop",
        StopReason::MaxTokens | StopReason::Context => "length",
        // vLLM's word for a request stopped before its end (the server shutting down).
        StopReason::Cancelled => "abort",
    }
}

/// Of each prompt's `best_of` completions in `outs` (prompt after prompt), the `n` whose
/// tokens have the highest mean logprob, best first (completions' `best_of`, as OpenAI ranks
/// them; equal means keep their order); all of them, in order, when `best_of` is `n`. A
/// completion without logprobs ranks last.
pub fn best(outs: Vec<Output>, best_of: usize, n: usize) -> Vec<Output> {
    if best_of <= n {
        return outs;
    }
    let mean = |o: &Output| match o.logprobs.as_deref() {
        Some(l) if !l.is_empty() => {
            l.iter().map(|t| t.logprob as f64).sum::<f64>() / l.len() as f64
        }
        _ => f64::NEG_INFINITY,
    };
    let mut groups: Vec<Vec<Output>> = Vec::new();
    for (i, o) in outs.into_iter().enumerate() {
        if i % best_of == 0 {
            groups.push(Vec::with_capacity(best_of));
        }
        groups.last_mut().expect("pushed").push(o);
    }
    groups
        .into_iter()
        .flat_map(|mut g| {
            g.sort_by(|a, b| mean(b).total_cmp(&mean(a)));
            g.truncate(n);
            g
        })
        .collect()
}

/// `usage`, from what the engine counted for `outs`, `per_prompt` completions of each prompt
/// in turn: each prompt once (its completions share its prefill), the tokens of every
/// completion.
pub fn usage(outs: &[Output], per_prompt: usize) -> Value {
    let firsts = outs.iter().step_by(per_prompt.max(1));
    let (prompt, cached) = firsts.fold((0, 0), |(p, c), o| {
        (p + o.stats.prompt_tokens, c + o.stats.prefix_tokens)
    });
    let completion: usize = outs.iter().map(|o| o.tokens.len()).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// The engine's timings and cache figures for the request (TTFT, prefill and decode speed,
/// peak KV bytes, evictions, policy, budget): the `keydiff` field of a response.
pub fn stats(out: &Output) -> Value {
    serde_json::to_value(&out.stats).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An assistant's reasoning sent back reaches the template, under DeepSeek's and
    /// llama.cpp's name or vLLM's (`reasoning_content` first when a client sends both).
    #[test]
    fn reasoning_sent_back_under_either_name() {
        let list: Vec<ChatMessage> = serde_json::from_value(json!([
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
            {"role": "assistant", "content": "Hello", "reasoning": "wave"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "a", "reasoning": "b"},
            {"role": "assistant", "content": "Hello"},
        ]))
        .unwrap();
        let got: Vec<Option<String>> = messages(list)
            .unwrap()
            .into_iter()
            .map(|m| m.reasoning_content)
            .collect();
        let want = [None, Some("greet"), Some("wave"), Some("a"), None];
        assert_eq!(got, want.map(|w| w.map(String::from)));
    }
}
