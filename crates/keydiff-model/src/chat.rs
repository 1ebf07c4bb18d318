//! Chat templates, rendered with minijinja the way transformers renders them with Jinja2.
//!
//! transformers (`utils/chat_template_utils.py`) uses a sandboxed Jinja2 environment with
//! `trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` filter built on Python's
//! `json.dumps`, and the globals `raise_exception` and `strftime_now`. We provide the same, plus
//! Python's string and dict methods through minijinja-contrib's pycompat.

use crate::error::{ModelError, Result};
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};
use std::collections::BTreeMap;
use std::fmt::Write;

/// One chat message, in the form transformers gives chat templates: `tool_calls` and
/// `tool_call_id` are there only when set (templates test `'tool_calls' in message`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message text.
    pub content: String,
    /// The functions an assistant message called.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant's reasoning, apart from its `content` (the field of DeepSeek's API,
    /// llama.cpp's and vLLM's servers); templates of reasoning models (Qwen 3) read it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    /// A message from `role` with `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }
}

/// A function call an assistant made, as chat templates read it: `tool_call.function.name`
/// and `tool_call.function.arguments`, the arguments an object (transformers' form, which
/// templates write with `tojson`; OpenAI's wire form is a JSON string of it).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: serde_json::Value,
}

impl serde::Serialize for ToolCall {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        serde_json::json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
        .serialize(s)
    }
}

/// Chat templates by name, as llama.cpp's `--chat-template NAME` takes them, for the formats of
/// the model families keydiff runs: `chatml` (Qwen's `<|im_start|>` turns, without Qwen 2.5's
/// default system message) and `llama3` (Llama 3's header turns). They give the tokens
/// llama.cpp's templates of those names give: neither writes a BOS, which the tokenizer adds
/// where the model asks for one.
pub const BUILTIN_TEMPLATES: [(&str, &str); 2] = [
    (
        "chatml",
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + \
         message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}\
         {{ '<|im_start|>assistant\\n' }}{% endif %}",
    ),
    (
        "llama3",
        "{% for message in messages %}{{ '<|start_header_id|>' + \
         message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + \
         '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}\
         {{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    ),
];

/// The template `given` stands for: a built-in's text for its name ([`BUILTIN_TEMPLATES`]),
/// else `given` itself, which must then be Jinja (have a `{{` or `{%`): a word that names no
/// template (llama.cpp's `mistral-v7`, a misspelling) is refused rather than used as a
/// template that writes it and drops every message.
pub fn resolve_template(given: &str) -> Result<&str> {
    if let Some((_, src)) = BUILTIN_TEMPLATES.iter().find(|(n, _)| *n == given.trim()) {
        return Ok(src);
    }
    if given.contains("{{") || given.contains("{%") {
        return Ok(given);
    }
    let names: Vec<&str> = BUILTIN_TEMPLATES.iter().map(|(n, _)| *n).collect();
    let shown: String = given.chars().take(60).collect();
    Err(ModelError::ChatTemplate(format!(
        "`{shown}` is neither a Jinja template (it has no `{{{{` or `{{%`) nor the name of a \
         built-in one ({}); give the template's text, or a file of it",
        names.join(", ")
    )))
}

/// A model's chat template, compiled once.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

const TEMPLATE_NAME: &str = "chat";

/// Instructions one render may run: real templates take thousands per message, so this
/// allows conversations of tens of thousands of messages, and stops a template that loops
/// for ever (a model file's template is untrusted input) within a second or so.
pub const TEMPLATE_FUEL: u64 = 50_000_000;

/// Bytes a render may write beyond [`TEMPLATE_OUTPUT_PER_INPUT`] times its input's.
pub const TEMPLATE_OUTPUT_BASE: usize = 1 << 20;
/// How many times its input's size (messages, tools, kwargs as JSON) a render may write,
/// beyond [`TEMPLATE_OUTPUT_BASE`]: a template repeats some of what it is given (a tool's
/// schema, a system prompt), never without bound.
pub const TEMPLATE_OUTPUT_PER_INPUT: usize = 8;

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the texts the template sees under those
    /// names (undefined when `None`, as in transformers).
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(template_err)?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token,
            eos_token,
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's reply
    /// starts. A `raise_exception` in the template comes back as [`ModelError::ChatTemplate`].
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// Renders `messages` with the functions the model may call, `tools` (OpenAI's objects,
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`, which is
    /// what transformers hands templates); none is the same as [`ChatTemplate::render`].
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_with(
            messages,
            tools,
            add_generation_prompt,
            &TemplateKwargs::new(),
        )
    }

    /// [`ChatTemplate::render_with_tools`] with extra variables for the template (`kwargs`,
    /// transformers' `apply_chat_template(**kwargs)`, vLLM's and llama.cpp's
    /// `chat_template_kwargs`), such as Qwen 3's `enable_thinking`. A name the renderer sets
    /// itself (see [`RESERVED_TEMPLATE_VARIABLES`]) is refused, as transformers refuses it.
    pub fn render_with(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
        kwargs: &TemplateKwargs,
    ) -> Result<String> {
        check_template_kwargs(kwargs)?;
        // transformers passes `tools` and `documents` as None when there are none.
        let mut ctx = BTreeMap::new();
        for (k, v) in kwargs {
            ctx.insert(k.as_str(), Value::from_serialize(v));
        }
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        let input = serde_json::to_vec(messages).map_or(0, |v| v.len())
            + serde_json::to_vec(tools).map_or(0, |v| v.len())
            + serde_json::to_vec(kwargs).map_or(0, |v| v.len());
        let tools = match tools.is_empty() {
            true => Value::from(()),
            false => Value::from_serialize(tools),
        };
        ctx.insert("tools", tools);
        ctx.insert("documents", Value::from(()));
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token", Value::from(eos.as_str()));
        }
        let limit = TEMPLATE_OUTPUT_BASE.saturating_add(input * TEMPLATE_OUTPUT_PER_INPUT);
        let mut out = Capped {
            text: Vec::new(),
            limit,
            over: false,
        };
        let rendered = self
            .env
            .get_template(TEMPLATE_NAME)
            .and_then(|t| t.render_captured_to(ctx, &mut out));
        match rendered {
            Ok(_) => String::from_utf8(out.text)
                .map_err(|e| ModelError::ChatTemplate(format!("rendered no UTF-8 text: {e}"))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(ModelError::ChatTemplate(format!(
                "the chat template ran more than {TEMPLATE_FUEL} steps for {} message(s) \
                 without ending: a loop without bound?",
                messages.len()
            ))),
            Err(_) if out.over => Err(ModelError::ChatTemplate(format!(
                "the chat template wrote more than {} bytes for {} bytes of messages, tools \
                 and kwargs: a loop without bound?",
                out.limit, input
            ))),
            Err(e) => Err(template_err(e)),
        }
    }
}

/// A render's output, refusing to grow past `limit` bytes (`over` once it has refused).
struct Capped {
    text: Vec<u8>,
    limit: usize,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len().saturating_add(buf.len()) > self.limit {
            self.over = true;
            return Err(std::io::Error::other("output beyond the limit"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Extra variables for a chat template, by name (JSON values).
pub type TemplateKwargs = serde_json::Map<String, serde_json::Value>;

/// Variables the renderer sets itself, which `chat_template_kwargs` may not replace.
pub const RESERVED_TEMPLATE_VARIABLES: [&str; 6] = [
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// Refuses kwargs that name a variable the renderer sets ([`RESERVED_TEMPLATE_VARIABLES`]).
pub fn check_template_kwargs(kwargs: &TemplateKwargs) -> Result<()> {
    match kwargs
        .keys()
        .find(|k| RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str()))
    {
        Some(k) => Err(ModelError::ChatTemplate(format!(
            "chat template kwargs may not set `{k}`: the renderer sets it (reserved: {})",
            RESERVED_TEMPLATE_VARIABLES.join(", ")
        ))),
        None => Ok(()),
    }
}

fn template_err(e: Error) -> ModelError {
    ModelError::ChatTemplate(e.to_string())
}

/// `raise_exception(message)`: the template refuses its input.
fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current time, formatted like Python's `strftime`. transformers
/// uses local time; we use UTC, which is the local time of our machines and containers.
fn strftime_now(format: String) -> std::result::Result<String, Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    strftime(&format, now.as_secs() as i64)
}

const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Formats a UTC unix time with the strftime directives chat templates use (`%d %b %Y` in
/// Llama 3.x). A `-` after `%` drops the zero padding, as glibc does. Others are refused.
fn strftime(format: &str, unix_secs: i64) -> std::result::Result<String, Error> {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let pad = spec != Some('-');
        if !pad {
            spec = chars.next();
        }
        let num = |out: &mut String, n: i64, width: usize| {
            if pad {
                let _ = write!(out, "{n:0width$}");
            } else {
                let _ = write!(out, "{n}");
            }
        };
        match spec {
            Some('Y') => {
                let _ = write!(out, "{year}");
            }
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month, 2),
            Some('d') => num(&mut out, day, 2),
            Some('j') => num(&mut out, day_of_year, 3),
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// (year, month, day) of a day count since 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Day count since 1970-01-01 of a civil date (H. Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `tojson`, as transformers defines it: Python's `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, unescaped for HTML. Its keyword arguments
/// are accepted too.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(seps) => {
            let seps: Vec<Value> = seps.try_iter()?.collect();
            match seps.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                    (item.to_string(), key.to_string())
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be (item_separator, key_separator)",
                    ))
                }
            }
        }
        // Python's defaults: no trailing space after commas when indenting.
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = Json {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    json.value(&mut out, value, 0)?;
    Ok(Value::from_safe_string(out))
}

/// A writer of Python `json.dumps` output.
struct Json {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
    item_sep: String,
    key_sep: String,
}

impl Json {
    fn value(&self, out: &mut String, v: &Value, depth: usize) -> std::result::Result<(), Error> {
        match v.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => {
                let _ = write!(out, "{v}");
            }
            ValueKind::Number => python_float(out, f64::try_from(v.clone())?),
            ValueKind::String => self.string(out, v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container(out, ('[', ']'), depth, &items, |out, item| {
                    self.value(out, item, depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = v
                    .try_iter()?
                    .map(|k| Ok((key_string(&k)?, v.get_item(&k)?)))
                    .collect::<std::result::Result<_, Error>>()?;
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container(out, ('{', '}'), depth, &entries, |out, (k, item)| {
                    self.string(out, k);
                    out.push_str(&self.key_sep);
                    self.value(out, item, depth + 1)
                })?;
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a value of kind {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    fn container<T>(
        &self,
        out: &mut String,
        (open, close): (char, char),
        depth: usize,
        items: &[T],
        mut item: impl FnMut(&mut String, &T) -> std::result::Result<(), Error>,
    ) -> std::result::Result<(), Error> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        let newline = |out: &mut String, depth: usize| {
            if let Some(n) = self.indent {
                out.push('\n');
                out.push_str(&" ".repeat(n * depth));
            }
        };
        for (i, x) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            newline(out, depth + 1);
            item(out, x)?;
        }
        newline(out, depth);
        out.push(close);
        Ok(())
    }

    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A map key as Python's json writes it: strings as they are, scalars by their JSON text.
fn key_string(k: &Value) -> std::result::Result<String, Error> {
    match k.kind() {
        ValueKind::String => Ok(k.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".to_string()),
        ValueKind::Bool => Ok(if k.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::Number if k.is_integer() => Ok(k.to_string()),
        ValueKind::Number => {
            let mut s = String::new();
            python_float(&mut s, f64::try_from(k.clone())?);
            Ok(s)
        }
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents in [-4, 16).
fn python_float(out: &mut String, x: f64) {
    if x.is_nan() {
        out.push_str("NaN");
        return;
    }
    if x.is_infinite() {
        out.push_str(if x > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e3".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    out.push_str(sign);
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            out.push_str("0.");
            out.push_str(&"0".repeat((-point) as usize));
            out.push_str(&digits);
        } else if point as usize >= digits.len() {
            out.push_str(&digits);
            out.push_str(&"0".repeat(point as usize - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..point as usize]);
            out.push('.');
            out.push_str(&digits[point as usize..]);
        }
    } else {
        out.push_str(mantissa);
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-Instruct's template, tool branches included.
    const QWEN25: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

    /// Meta-Llama-3-8B-Instruct's template, with a role check added to exercise
    /// `raise_exception`, laid out on lines to exercise `trim_blocks` and `lstrip_blocks`.
    const LLAMA3: &str = r#"{% set loop_messages = messages %}
{% for message in loop_messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}
    {% if loop.index0 == 0 %}
        {% set content = bos_token + content %}
    {% endif %}
    {{- content -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{% endif %}
"#;

    /// Llama-3.1-8B-Instruct's template (transformers' `tokenizer_config.json`), which puts
    /// tools in the first user message and writes calls as JSON with `parameters`.
    const LLAMA31: &str = r##"{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"##;

    /// What Jinja2 renders (see `tools_and_calls`).
    const QWEN_EXPECTED: &str = "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"The weather in a city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"c\", \"f\"]}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n";

    /// What Jinja2 renders (see `tools_and_calls`).
    const LLAMA_EXPECTED: &str = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\",\n        \"description\": \"The weather in a city\",\n        \"parameters\": {\n            \"type\": \"object\",\n            \"properties\": {\n                \"city\": {\n                    \"type\": \"string\"\n                },\n                \"unit\": {\n                    \"type\": \"string\",\n                    \"enum\": [\n                        \"c\",\n                        \"f\"\n                    ]\n                }\n            },\n            \"required\": [\n                \"city\"\n            ]\n        }\n    }\n}\n\nWeather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"c\"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"{\\\"temp\\\": 21}\"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";

    fn chat() -> Vec<Message> {
        vec![
            Message::new("system", "Be brief."),
            Message::new("user", "  Hi!  "),
            Message::new("assistant", "Hello."),
            Message::new("user", "2+2?"),
        ]
    }

    #[test]
    fn qwen_template() {
        let t = ChatTemplate::new(QWEN25, None, Some("<|im_end|>".into())).unwrap();
        assert_eq!(
            t.render(&chat(), true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n\
             <|im_start|>user\n  Hi!  <|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n\
             <|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let no_system = t.render(&chat()[1..2], false).unwrap();
        assert_eq!(
            no_system,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
             assistant.<|im_end|>\n<|im_start|>user\n  Hi!  <|im_end|>\n"
        );
    }

    #[test]
    fn llama3_template() {
        let t = ChatTemplate::new(LLAMA3, Some("<|begin_of_text|>".into()), None).unwrap();
        assert_eq!(
            t.render(&chat()[..2], true).unwrap(),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    /// Tools, a call and its result, rendered as transformers renders them (the expected
    /// texts are Jinja2's, with transformers' environment and `tojson`).
    #[test]
    fn tools_and_calls() {
        let tools = [serde_json::json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"]}}})];
        let call = ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: serde_json::json!({"city": "Paris", "unit": "c"}),
        };
        let messages = [
            Message::new("system", "Be brief."),
            Message::new("user", "Weather in Paris?"),
            Message {
                tool_calls: vec![call],
                ..Message::new("assistant", "")
            },
            Message {
                tool_call_id: Some("call_1".into()),
                ..Message::new("tool", "{\"temp\": 21}")
            },
        ];
        let qwen = ChatTemplate::new(QWEN25, None, Some("<|im_end|>".into())).unwrap();
        assert_eq!(
            qwen.render_with_tools(&messages, &tools, true).unwrap(),
            QWEN_EXPECTED
        );
        let llama = ChatTemplate::new(LLAMA31, Some("<|begin_of_text|>".into()), None).unwrap();
        assert_eq!(
            llama.render_with_tools(&messages, &tools, true).unwrap(),
            LLAMA_EXPECTED
        );
        // No tools: the templates' other branch, and no `tool_calls` key on plain messages
        // (Llama's template tests `'tool_calls' in message`).
        let plain = &[Message::new("user", "Hi")];
        assert_eq!(
            llama.render_with_tools(plain, &[], true).unwrap(),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge \
             Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user\
             <|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new(LLAMA3, Some("<|begin_of_text|>".into()), None).unwrap();
        let err = t
            .render(&[Message::new("robot", "beep")], true)
            .unwrap_err();
        assert!(
            matches!(err, ModelError::ChatTemplate(ref m) if m.contains("Unknown role: robot")),
            "{err}"
        );
    }

    /// A model file's template is untrusted: one that loops for ever or writes without bound
    /// is stopped with an error naming that, and a long real conversation still renders.
    #[test]
    fn endless_or_huge_renders_are_stopped() {
        let user = [Message::new("user", "hi")];
        let endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}\
                       {% endfor %}";
        let t = std::time::Instant::now();
        let err = ChatTemplate::new(endless, None, None)
            .unwrap()
            .render(&user, true)
            .unwrap_err();
        assert!(err.to_string().contains("steps"), "{err}");
        eprintln!("endless template stopped after {:?}", t.elapsed());
        let huge = "{% set s = 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' %}\
                    {% for i in range(100000) %}{{ s }}{% endfor %}";
        let err = ChatTemplate::new(huge, None, None)
            .unwrap()
            .render(&user, true)
            .unwrap_err();
        assert!(err.to_string().contains("wrote more than"), "{err}");
        // 20,000 turns of Qwen 2.5's template (tool branches included), one big message.
        let mut long: Vec<Message> = (0..20_000)
            .map(|i| Message::new(["user", "assistant"][i % 2], format!("turn {i}")))
            .collect();
        long.push(Message::new("user", "x".repeat(4 << 20)));
        let t = ChatTemplate::new(QWEN25, None, None).unwrap();
        let text = t.render(&long, true).unwrap();
        assert!(text.ends_with("<|im_start|>assistant\n"));
        assert_eq!(text.matches("<|im_start|>").count(), 20_003);
    }

    #[test]
    fn bad_syntax_is_an_error() {
        let err = ChatTemplate::new("{% for %}", None, None).err().unwrap();
        assert!(matches!(err, ModelError::ChatTemplate(_)), "{err}");
    }

    #[test]
    fn python_methods_and_undefined_tokens() {
        let src = "{{ messages[0].content.strip().upper() }}|{{ bos_token }}|\
                   {{ messages[0].content.startswith(' ') }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        assert_eq!(
            t.render(&[Message::new("user", " hi ")], false).unwrap(),
            "HI||True"
        );
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let render = |src: &str| {
            ChatTemplate::new(src, None, None)
                .unwrap()
                .render(&[], false)
                .unwrap()
        };
        assert_eq!(
            render(r#"{{ {"a": [1, 2.5, 1e16, 0.0001, none, true, "é<&"]} | tojson }}"#),
            r#"{"a": [1, 2.5, 1e+16, 0.0001, null, true, "é<&"]}"#
        );
        let t = ChatTemplate::new("{{ messages[0].content | tojson }}", None, None).unwrap();
        let msg = Message::new("user", "a\"b\\c\nd\u{1}\u{7f}");
        assert_eq!(
            t.render(&[msg], false).unwrap(),
            "\"a\\\"b\\\\c\\nd\\u0001\u{7f}\""
        );
        assert_eq!(
            render(r#"{{ {"k": [1, {"x": none}], "e": {}} | tojson(indent=2, sort_keys=true) }}"#),
            "{\n  \"e\": {},\n  \"k\": [\n    1,\n    {\n      \"x\": null\n    }\n  ]\n}"
        );
        assert_eq!(
            render(r#"{{ "😀é" | tojson(ensure_ascii=true) }}"#),
            r#""\ud83d\ude00\u00e9""#
        );
    }

    #[test]
    fn python_float_repr() {
        let repr = |x: f64| {
            let mut s = String::new();
            python_float(&mut s, x);
            s
        };
        assert_eq!(repr(1.0), "1.0");
        assert_eq!(repr(1e16), "1e+16");
        assert_eq!(repr(1e15), "1000000000000000.0");
        assert_eq!(repr(1e-5), "1e-05");
        assert_eq!(repr(0.1), "0.1");
        assert_eq!(repr(123.456), "123.456");
        assert_eq!(repr(-2.5e-7), "-2.5e-07");
    }

    #[test]
    fn strftime_matches_python() {
        // Python: datetime(2024, 7, 23, 14, 5, 9).strftime(...)
        assert_eq!(
            strftime(
                "%d %b %Y|%A %a %B %m %y %H %I %M %S %p %j|%-d %-m %%",
                1_721_743_509
            )
            .unwrap(),
            "23 Jul 2024|Tuesday Tue July 07 24 14 02 05 09 PM 205|23 7 %"
        );
        assert_eq!(
            strftime("%d %b %Y %A %I %p %j", 951_782_401).unwrap(),
            "29 Feb 2000 Tuesday 12 AM 060"
        );
        assert!(strftime("%Q", 0).is_err());
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap().len(), 4);
    }

    /// A reasoning model's template in the constructs Qwen 3's uses (reversed messages, a
    /// namespace, `split`/`lstrip`/`rstrip`/`strip('\n')`, `startswith`, `reasoning_content`,
    /// `enable_thinking` from the kwargs). The expected texts are Jinja2's, in transformers'
    /// environment. (Qwen 3's own template was checked the same way, on seven conversations
    /// with tools, tool replies and reasoning: identical.)
    const REASONING: &str = r#"{#- A reasoning model's template, in the constructs Qwen 3's uses: reversed messages, a namespace, Python string methods, `reasoning_content`, `enable_thinking`. -#}
{%- set ns = namespace(last_user=messages|length - 1, searching=true) %}
{%- for m in messages[::-1] %}
    {%- if ns.searching and m.role == "user" and not (m.content.startswith('<result>') and m.content.endswith('</result>')) %}
        {%- set ns.searching = false %}
        {%- set ns.last_user = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role == "assistant" %}
        {%- set answer = m.content %}
        {%- set thought = '' %}
        {%- if m.reasoning_content is defined and m.reasoning_content is not none %}
            {%- set thought = m.reasoning_content %}
        {%- elif '</think>' in m.content %}
            {%- set answer = m.content.split('</think>')[-1].lstrip('\n') %}
            {%- set thought = m.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user and thought %}
            {{- '[A]<think>\n' + thought.strip('\n') + '\n</think>\n\n' + answer + '[/A]\n' }}
        {%- else %}
            {{- '[A]' + answer + '[/A]\n' }}
        {%- endif %}
    {%- else %}
        {{- '[' + m.role|upper + ']' + m.content + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '[A]' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"#;

    #[test]
    fn reasoning_template_and_kwargs_render_as_jinja2() {
        let t = ChatTemplate::new(REASONING, None, None).unwrap();
        let user = Message::new("user", "Hi");
        let mut off = TemplateKwargs::new();
        off.insert("enable_thinking".into(), false.into());
        let none = TemplateKwargs::new();
        let render = |m: &[Message], kw: &TemplateKwargs| t.render_with(m, &[], true, kw).unwrap();
        assert_eq!(render(std::slice::from_ref(&user), &none), "[USER]Hi\n[A]");
        assert_eq!(
            render(std::slice::from_ref(&user), &off),
            "[USER]Hi\n[A]<think>\n\n</think>\n\n"
        );
        let conversation = [
            user,
            Message::new("assistant", "<think>\nold\n</think>\n\nHello!"),
            Message::new("user", "2+2?"),
            Message::new("assistant", "<think>\nadd\n</think>\n\n4"),
            Message::new("user", "<result>x</result>"),
            Message {
                reasoning_content: Some("\nkept\n".into()),
                ..Message::new("assistant", "4 still")
            },
        ];
        assert_eq!(
            render(&conversation, &none),
            "[USER]Hi\n[A]Hello![/A]\n[USER]2+2?\n[A]<think>\nadd\n</think>\n\n4[/A]\n\
             [USER]<result>x</result>\n[A]<think>\nkept\n</think>\n\n4 still[/A]\n[A]"
        );
        // Variables the renderer sets are refused by name.
        let mut bad = TemplateKwargs::new();
        bad.insert("add_generation_prompt".into(), false.into());
        let err = t.render_with(&conversation, &[], true, &bad).unwrap_err();
        assert!(err.to_string().contains("`add_generation_prompt`"), "{err}");
    }

    /// The built-ins write llama.cpp's formats of those names (llm_chat_apply_template's
    /// `LLM_CHAT_TEMPLATE_CHATML` and `LLM_CHAT_TEMPLATE_LLAMA_3`: Llama 3 trims each
    /// message); other text must be Jinja.
    #[test]
    fn built_in_templates_by_name() {
        let msgs = [
            Message::new("system", "Be brief."),
            Message::new("user", " Hi there \n"),
        ];
        let render = |name: &str, bos: Option<&str>| {
            ChatTemplate::new(resolve_template(name).unwrap(), bos.map(Into::into), None)
                .unwrap()
                .render(&msgs, true)
                .unwrap()
        };
        assert_eq!(
            render("chatml", None),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi there \n\
             <|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            render("llama3", Some("<|begin_of_text|>")),
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.\
             <|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        let src = "{{ messages[0].content }}";
        assert_eq!(resolve_template(src).unwrap(), src);
        for word in ["chat-ml", "mistral-v7", "abc def"] {
            let e = resolve_template(word).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{word}` is neither a Jinja template"))
                    && e.contains("(chatml, llama3)"),
                "{e}"
            );
        }
    }
}
