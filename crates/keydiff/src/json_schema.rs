//! JSON schemas as grammars: OpenAI's `response_format: {"type": "json_schema"}`, llama.cpp's
//! `--json-schema`. [`to_grammar`] writes a GBNF grammar ([`crate::grammar`]) whose texts are
//! the JSON values the schema allows, written as llama.cpp's `json-schema-to-grammar` writes
//! them: no whitespace inside values but a space or a newline and up to 20 spaces or tabs
//! after each token, numbers with at most 16 digits before and after the point, object members
//! in the order the schema's `properties` gives.
//!
//! What is compiled: `type` (one or a list), `properties`, `required`, `additionalProperties`,
//! `items`, `prefixItems`, `minItems`, `maxItems`, `minLength`, `maxLength`, `enum`, `const`,
//! `anyOf`, `oneOf` (as `anyOf`), `$ref` to `#/...` (recursion allowed), and the string
//! formats `date`, `time`, `date-time` and `uuid`. Other formats are annotations, as JSON
//! Schema 2020-12 makes them by default: such a string is any string. Annotations (`title`,
//! `description`, `default`, `examples`, ...) are ignored. Any other keyword (`pattern`,
//! `minimum`, `allOf`, ...) is refused with its name and place, rather than ignored.
//!
//! As in vLLM's default (xgrammar's strict mode), an object without `additionalProperties`
//! has only the properties it names; `additionalProperties: true` or a schema allows others
//! after them. Required properties always come, optional ones may be left out.

use std::collections::HashMap;

use serde_json::{Map, Value};

/// A schema refused: what is wrong, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("JSON schema: {0}")]
pub struct SchemaError(pub String);

/// Keywords compiled into the grammar.
const COMPILED: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "$ref",
    "$defs",
    "definitions",
    "format",
];

/// Keywords that constrain nothing.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$anchor",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "contentMediaType",
    "contentEncoding",
];

/// The rules every schema can use (llama.cpp's primitives).
const PRIMITIVES: &[(&str, &str)] = &[
    ("space", r#"| " " | "\n" [ \t]{0,20}"#),
    ("boolean", r#"("true" | "false") space"#),
    ("null", r#""null" space"#),
    ("integral-part", r#"[0] | [1-9] [0-9]{0,15}"#),
    ("decimal-part", r#"[0-9]{1,16}"#),
    (
        "number",
        r#"("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)? space"#,
    ),
    ("integer", r#"("-"? integral-part) space"#),
    (
        "char",
        r#"[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})"#,
    ),
    ("string", r#""\"" char* "\"" space"#),
    (
        "value",
        r#"object | array | string | number | boolean | null"#,
    ),
    (
        "object",
        r#""{" space ( string ":" space value ("," space string ":" space value)* )? "}" space"#,
    ),
    (
        "array",
        r#""[" space ( value ("," space value)* )? "]" space"#,
    ),
    (
        "date",
        r#"[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )"#,
    ),
    (
        "time",
        r#"([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? ( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )"#,
    ),
    ("date-time", r#"date "T" time"#),
    (
        "uuid",
        r#"[0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12}"#,
    ),
];

/// Writes the GBNF grammar of the JSON values `schema` allows (see the module docs).
pub fn to_grammar(schema: &Value) -> Result<String, SchemaError> {
    let mut c = Converter {
        root: schema,
        rules: Vec::new(),
        refs: HashMap::new(),
        used: Vec::new(),
    };
    let root = c.visit(schema, "root", "#")?;
    if root != "root" {
        c.rules.push(("root".into(), root));
    }
    // The primitives used, and those they use.
    let mut out = String::new();
    for (name, body) in &c.rules {
        out += &format!("{name} ::= {body}\n");
    }
    let mut i = 0;
    while i < c.used.len() {
        let body = primitive(c.used[i]);
        for (dep, _) in PRIMITIVES {
            if mentions(body, dep) && !c.used.contains(dep) {
                c.used.push(dep);
            }
        }
        i += 1;
    }
    for (name, body) in PRIMITIVES {
        if c.used.contains(name) {
            out += &format!("{name} ::= {body}\n");
        }
    }
    Ok(out)
}

fn primitive(name: &str) -> &'static str {
    PRIMITIVES
        .iter()
        .find(|p| p.0 == name)
        .expect("a primitive")
        .1
}

/// Whether GBNF `body` refers to rule `name` (outside its literals).
fn mentions(body: &str, name: &str) -> bool {
    let mut in_lit = false;
    let mut escaped = false;
    let mut word = String::new();
    let mut found = false;
    for c in body.chars().chain([' ']) {
        if in_lit {
            match (escaped, c) {
                (false, '\\') => escaped = true,
                (false, '"') => in_lit = false,
                _ => escaped = false,
            }
            continue;
        }
        if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
            word.push(c);
            continue;
        }
        found |= word == name;
        word.clear();
        in_lit = c == '"';
    }
    found
}

/// A GBNF literal of `text`.
fn literal(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out += "\\\"",
            '\\' => out += "\\\\",
            '\n' => out += "\\n",
            '\r' => out += "\\r",
            '\t' => out += "\\t",
            c if (c as u32) < 0x20 => out += &format!("\\x{:02X}", c as u32),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

struct Converter<'a> {
    root: &'a Value,
    /// Rules written so far: (name, body).
    rules: Vec<(String, String)>,
    /// Rule names of the `$ref`s met, so that a recursive schema refers back.
    refs: HashMap<String, String>,
    /// Primitives used.
    used: Vec<&'static str>,
}

impl<'a> Converter<'a> {
    fn prim(&mut self, name: &'static str) -> String {
        if !self.used.contains(&name) {
            self.used.push(name);
        }
        name.to_string()
    }

    /// A rule name for `hint` not taken yet.
    fn name(&self, hint: &str) -> String {
        let clean: String = hint
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let taken = |n: &str| {
            self.rules.iter().any(|r| r.0 == n)
                || self.refs.values().any(|r| r == n)
                || PRIMITIVES.iter().any(|p| p.0 == n)
        };
        if !taken(&clean) {
            return clean;
        }
        (1..)
            .map(|i| format!("{clean}-{i}"))
            .find(|n| !taken(n))
            .expect("some name is free")
    }

    fn add(&mut self, hint: &str, body: String) -> String {
        let name = self.name(hint);
        self.rules.push((name.clone(), body));
        name
    }

    fn err<T>(&self, at: &str, what: impl std::fmt::Display) -> Result<T, SchemaError> {
        Err(SchemaError(format!("{what} (at {at})")))
    }

    /// The rule (or primitive) whose texts are the values `s` allows; `hint` names the rule,
    /// `at` is where `s` is, for errors.
    fn visit(&mut self, s: &'a Value, hint: &str, at: &str) -> Result<String, SchemaError> {
        let s = match s {
            Value::Bool(true) => return Ok(self.prim("value")),
            Value::Bool(false) => return self.err(at, "the schema `false` allows no value"),
            Value::Object(s) => s,
            _ => {
                return self.err(
                    at,
                    format!("a schema must be an object or a boolean, not {s}"),
                )
            }
        };
        for k in s.keys() {
            if !COMPILED.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str()) {
                return self.err(
                    at,
                    format!(
                        "`{k}` is not supported; keydiff compiles {}, and ignores annotations",
                        COMPILED.join(", ")
                    ),
                );
            }
        }
        let constraints = || {
            s.keys()
                .filter(|k| {
                    !ANNOTATIONS.contains(&k.as_str())
                        && !["$defs", "definitions"].contains(&k.as_str())
                })
                .count()
        };
        if let Some(r) = s.get("$ref") {
            if constraints() > 1 {
                return self.err(at, "`$ref` with other keywords beside it is not supported");
            }
            return self.reference(r, at);
        }
        if let Some(v) = s.get("const") {
            let body = format!("{} space", literal(&v.to_string()));
            self.prim("space");
            return Ok(self.add(hint, body));
        }
        if let Some(e) = s.get("enum") {
            let Some(e) = e.as_array().filter(|e| !e.is_empty()) else {
                return self.err(at, "`enum` must be a non-empty array");
            };
            let alts: Vec<String> = e.iter().map(|v| literal(&v.to_string())).collect();
            self.prim("space");
            return Ok(self.add(hint, format!("({}) space", alts.join(" | "))));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(subs) = s.get(key) {
                let Some(subs) = subs.as_array().filter(|e| !e.is_empty()) else {
                    return self.err(at, format!("`{key}` must be a non-empty array of schemas"));
                };
                if constraints() > 1 {
                    return self.err(
                        at,
                        format!("`{key}` with other keywords beside it is not supported"),
                    );
                }
                let mut alts = Vec::new();
                for (i, sub) in subs.iter().enumerate() {
                    alts.push(self.visit(
                        sub,
                        &format!("{hint}-{i}"),
                        &format!("{at}/{key}/{i}"),
                    )?);
                }
                return Ok(self.add(hint, alts.join(" | ")));
            }
        }
        let types: Vec<&str> = match s.get("type") {
            None if s.contains_key("properties") || s.contains_key("additionalProperties") => {
                vec!["object"]
            }
            None if s.contains_key("items") || s.contains_key("prefixItems") => vec!["array"],
            None => {
                if constraints() > 0 {
                    return self.err(at, "a schema with constraints but no `type`");
                }
                return Ok(self.prim("value"));
            }
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) if !ts.is_empty() => {
                let mut out = Vec::new();
                for t in ts {
                    match t.as_str() {
                        Some(t) => out.push(t),
                        None => return self.err(at, "`type` must name types"),
                    }
                }
                out
            }
            Some(t) => return self.err(at, format!("`type` {t} must be a type or a list of them")),
        };
        let mut alts = Vec::new();
        for t in &types {
            let sub_hint = match types.len() {
                1 => hint.to_string(),
                _ => format!("{hint}-{t}"),
            };
            alts.push(self.typed(s, t, &sub_hint, at)?);
        }
        Ok(match alts.len() {
            1 => alts.pop().expect("one"),
            _ => self.add(hint, alts.join(" | ")),
        })
    }

    fn reference(&mut self, r: &'a Value, at: &str) -> Result<String, SchemaError> {
        let Some(path) = r.as_str() else {
            return self.err(at, "`$ref` must be a string");
        };
        if let Some(name) = self.refs.get(path) {
            return Ok(name.clone());
        }
        let Some(pointer) = path.strip_prefix('#') else {
            return self.err(
                at,
                format!(
                    "`$ref` {path:?}: only references inside the schema (`#/...`) are supported"
                ),
            );
        };
        let Some(target) = self.root.pointer(pointer) else {
            return self.err(at, format!("`$ref` {path:?} points at nothing"));
        };
        let hint = pointer
            .rsplit('/')
            .next()
            .filter(|h| !h.is_empty())
            .unwrap_or("ref");
        // Named before it is visited, so that a recursive schema refers back to it.
        let name = self.name(&format!("ref-{hint}"));
        self.refs.insert(path.to_string(), name.clone());
        let inner = self.visit(target, &format!("{name}-def"), path)?;
        self.rules.push((name.clone(), inner));
        Ok(name)
    }

    fn typed(
        &mut self,
        s: &'a Map<String, Value>,
        t: &str,
        hint: &str,
        at: &str,
    ) -> Result<String, SchemaError> {
        let only = |keys: &[&str]| -> Result<(), SchemaError> {
            match s.keys().find(|k| {
                !ANNOTATIONS.contains(&k.as_str())
                    && !["type", "$defs", "definitions"].contains(&k.as_str())
                    && !keys.contains(&k.as_str())
            }) {
                Some(k) => Err(SchemaError(format!(
                    "`{k}` does not apply to type {t} (at {at})"
                ))),
                None => Ok(()),
            }
        };
        match t {
            "null" | "boolean" | "integer" | "number" => {
                only(&[])?;
                Ok(self.prim(match t {
                    "null" => "null",
                    "boolean" => "boolean",
                    "integer" => "integer",
                    _ => "number",
                }))
            }
            "string" => {
                only(&["minLength", "maxLength", "format"])?;
                let format = s.get("format").and_then(Value::as_str);
                if let Some(f @ ("date" | "time" | "date-time" | "uuid")) = format {
                    let f = self.prim(match f {
                        "date" => "date",
                        "time" => "time",
                        "date-time" => "date-time",
                        _ => "uuid",
                    });
                    self.prim("space");
                    return Ok(self.add(hint, format!(r#""\"" {f} "\"" space"#)));
                }
                let min = self.count(s, "minLength", at)?;
                let max = self.count(s, "maxLength", at)?;
                if min.is_none() && max.is_none() {
                    return Ok(self.prim("string"));
                }
                let (min, max) = (min.unwrap_or(0), max);
                if max.is_some_and(|m| m < min) {
                    return self.err(at, "`maxLength` is less than `minLength`");
                }
                let c = self.prim("char");
                self.prim("space");
                let rep = match max {
                    Some(max) => format!("{{{min},{max}}}"),
                    None => format!("{{{min},}}"),
                };
                Ok(self.add(hint, format!(r#""\"" {c}{rep} "\"" space"#)))
            }
            "array" => {
                only(&["items", "prefixItems", "minItems", "maxItems"])?;
                self.array(s, hint, at)
            }
            "object" => {
                only(&["properties", "required", "additionalProperties"])?;
                self.object(s, hint, at)
            }
            _ => self.err(at, format!("unknown type {t:?}")),
        }
    }

    fn count(
        &self,
        s: &Map<String, Value>,
        key: &str,
        at: &str,
    ) -> Result<Option<u32>, SchemaError> {
        match s.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= crate::grammar::MAX_REPEAT as u64 => Ok(Some(n as u32)),
                _ => self.err(
                    at,
                    format!(
                        "`{key}` {v} must be a whole number up to {}",
                        crate::grammar::MAX_REPEAT
                    ),
                ),
            },
        }
    }

    fn array(
        &mut self,
        s: &'a Map<String, Value>,
        hint: &str,
        at: &str,
    ) -> Result<String, SchemaError> {
        self.prim("space");
        let min = self.count(s, "minItems", at)?.unwrap_or(0);
        let max = self.count(s, "maxItems", at)?;
        if max.is_some_and(|m| m < min) {
            return self.err(at, "`maxItems` is less than `minItems`");
        }
        if let Some(prefix) = s.get("prefixItems") {
            let Some(prefix) = prefix.as_array() else {
                return self.err(at, "`prefixItems` must be an array of schemas");
            };
            if s.contains_key("minItems")
                || s.contains_key("maxItems")
                || !matches!(s.get("items"), None | Some(Value::Bool(false)))
            {
                return self.err(
                    at,
                    "`prefixItems` with `items`, `minItems` or `maxItems` is not supported",
                );
            }
            let mut parts = Vec::new();
            for (i, sub) in prefix.iter().enumerate() {
                parts.push(self.visit(
                    sub,
                    &format!("{hint}-{i}"),
                    &format!("{at}/prefixItems/{i}"),
                )?);
            }
            let body = parts.join(r#" "," space "#);
            return Ok(self.add(hint, format!(r#""[" space {body} "]" space"#)));
        }
        let item = match s.get("items") {
            None => self.prim("value"),
            Some(Value::Bool(false)) => {
                return Ok(self.add(hint, r#""[" space "]" space"#.into()));
            }
            Some(sub) => self.visit(sub, &format!("{hint}-item"), &format!("{at}/items"))?,
        };
        let more = |n: u32| match max {
            Some(max) => format!("{{{n},{}}}", max.saturating_sub(1).max(n)),
            None => format!("{{{n},}}"),
        };
        let items = if max == Some(0) {
            String::new()
        } else if min == 0 {
            format!(r#"( {item} ( "," space {item} ){} )?"#, more(0))
        } else {
            format!(r#"{item} ( "," space {item} ){}"#, more(min - 1))
        };
        Ok(self.add(hint, format!(r#""[" space {items} "]" space"#)))
    }

    fn object(
        &mut self,
        s: &'a Map<String, Value>,
        hint: &str,
        at: &str,
    ) -> Result<String, SchemaError> {
        self.prim("space");
        let props = match s.get("properties") {
            None => None,
            Some(Value::Object(p)) => Some(p),
            Some(_) => return self.err(at, "`properties` must be an object"),
        };
        let required: Vec<&str> = match s.get("required") {
            None => Vec::new(),
            Some(Value::Array(r)) => {
                let mut out = Vec::new();
                for n in r {
                    match n.as_str() {
                        Some(n) if props.is_some_and(|p| p.contains_key(n)) => out.push(n),
                        Some(n) => {
                            return self.err(
                                at,
                                format!("required property {n:?} is not in `properties`"),
                            )
                        }
                        None => return self.err(at, "`required` must list property names"),
                    }
                }
                out
            }
            Some(_) => return self.err(at, "`required` must be an array"),
        };
        let (mut req, mut opt) = (Vec::new(), Vec::new());
        for (name, sub) in props.into_iter().flatten() {
            let value = self.visit(
                sub,
                &format!("{hint}-{name}"),
                &format!("{at}/properties/{name}"),
            )?;
            let key = literal(&Value::String(name.clone()).to_string());
            let kv = self.add(
                &format!("{hint}-{name}-kv"),
                format!(r#"{key} space ":" space {value}"#),
            );
            match required.contains(&name.as_str()) {
                true => req.push(kv),
                false => opt.push(kv),
            }
        }
        let extra = match s.get("additionalProperties") {
            None | Some(Value::Bool(false)) => None,
            Some(sub) => {
                let value = self.visit(
                    sub,
                    &format!("{hint}-additional"),
                    &format!("{at}/additionalProperties"),
                )?;
                let key = self.prim("string");
                Some(self.add(
                    &format!("{hint}-additional-kv"),
                    format!(r#"{key} ":" space {value}"#),
                ))
            }
        };
        let extras = extra
            .as_ref()
            .map(|e| format!(r#" ( "," space {e} )*"#))
            .unwrap_or_default();
        let tail = |opt: &[String]| -> String {
            opt.iter()
                .map(|o| format!(r#" ( "," space {o} )?"#))
                .collect()
        };
        let body = if !req.is_empty() {
            format!("{}{}{extras}", req.join(r#" "," space "#), tail(&opt))
        } else {
            // One of the optional properties (or an extra) comes first, without a comma.
            let mut firsts: Vec<String> = (0..opt.len())
                .map(|i| format!("{}{}{extras}", opt[i], tail(&opt[i + 1..])))
                .collect();
            if let Some(e) = &extra {
                firsts.push(format!("{e}{extras}"));
            }
            match firsts.is_empty() {
                true => String::new(),
                false => format!("( {} )?", firsts.join(" | ")),
            }
        };
        Ok(self.add(hint, format!(r#""{{" space {body} "}}" space"#)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::{Grammar, GrammarState};
    use serde_json::json;
    use std::sync::Arc;

    fn state(schema: &Value) -> GrammarState {
        let g = to_grammar(schema).unwrap();
        GrammarState::new(Arc::new(
            Grammar::parse(&g).unwrap_or_else(|e| panic!("{e}\n{g}")),
        ))
    }

    fn whole(g: &GrammarState, text: &str) -> bool {
        let mut g = g.clone();
        g.push_all(text.as_bytes()) && g.is_done()
    }

    fn check(schema: Value, good: &[&str], bad: &[&str]) {
        let g = state(&schema);
        for t in good {
            assert!(
                whole(&g, t),
                "{schema} should allow {t}\n{}",
                to_grammar(&schema).unwrap()
            );
        }
        for t in bad {
            assert!(
                !whole(&g, t),
                "{schema} should refuse {t}\n{}",
                to_grammar(&schema).unwrap()
            );
        }
    }

    #[test]
    fn objects_in_schema_order_with_required_and_optional_properties() {
        check(
            json!({"type": "object", "properties": {
                "name": {"type": "string"}, "age": {"type": "integer"},
                "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "age"]}),
            &[
                r#"{"name": "Ada", "age": 36}"#,
                r#"{"name":"Ada","age":-1,"tags":["x", "y"]}"#,
                "{\n  \"name\": \"Ada\",\n  \"age\": 36,\n  \"email\": \"a@b.c\",\n  \"tags\": []\n}",
            ],
            &[
                r#"{"age": 36, "name": "Ada"}"#,
                r#"{"name": "Ada"}"#,
                r#"{"name": "Ada", "age": 3.5}"#,
                r#"{"name": "Ada", "age": 36, "other": 1}"#,
                r#"{"name": "Ada", "age": 36,}"#,
                r#"{"name": "Ada", "age": 36, "tags": [1]}"#,
            ],
        );
        // No required property: any ordered subset, the empty object too.
        check(
            json!({"properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}}),
            &[
                "{}",
                r#"{"a": true}"#,
                r#"{"b": null}"#,
                r#"{"a": false, "b": null}"#,
            ],
            &[
                r#"{"b": null, "a": true}"#,
                r#"{,"b": null}"#,
                r#"{"a": 1}"#,
            ],
        );
    }

    #[test]
    fn additional_properties() {
        check(
            json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                   "additionalProperties": {"type": "string"}}),
            &[r#"{"a": 1}"#, r#"{"a": 1, "x": "y", "z": ""}"#],
            &[r#"{"a": 1, "x": 2}"#, r#"{"x": "y"}"#],
        );
        check(
            json!({"type": "object", "additionalProperties": true}),
            &["{}", r#"{"x": [1, {"y": null}], "z": "w"}"#],
            &[r#"{"x"}"#],
        );
        check(json!({"type": "object"}), &["{}"], &[r#"{"x": 1}"#]);
    }

    #[test]
    fn scalars_enums_consts_and_unions() {
        check(
            json!({"type": "number"}),
            &["0", "-1.5", "2e10", "1.25E-3"],
            &["01", "1.", ".5", "\"1\"", "NaN"],
        );
        check(json!({"type": "integer"}), &["0", "-42"], &["1.0", "1e3"]);
        check(
            json!({"enum": ["red", "green", 3, null, {"a": [1]}]}),
            &["\"red\"", "\"green\"", "3", "null", r#"{"a":[1]}"#],
            &["\"blue\"", "\"Red\"", "4"],
        );
        check(
            json!({"const": "say \"hi\"\n"}),
            &[r#""say \"hi\"\n""#],
            &["\"say\""],
        );
        check(
            json!({"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Maybe"}),
            &["\"x\"", "null"],
            &["1"],
        );
        check(
            json!({"type": ["integer", "boolean"]}),
            &["1", "true"],
            &["\"1\""],
        );
        check(json!({}), &["1", "{\"a\": [true]}", "\"s\""], &["x"]);
    }

    #[test]
    fn strings_arrays_and_formats() {
        check(
            json!({"type": "string", "minLength": 2, "maxLength": 3}),
            &["\"ab\"", "\"abc\"", r#""a\n""#, "\"é😀\""],
            &["\"a\"", "\"abcd\""],
        );
        check(
            json!({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}),
            &["[1]", "[1, 2, 3]"],
            &["[]", "[1, 2, 3, 4]", "[1,]"],
        );
        check(json!({"type": "array", "maxItems": 0}), &["[]"], &["[1]"]);
        check(
            json!({"type": "array", "items": {"type": "boolean"}}),
            &["[]", "[true, false]"],
            &["[1]"],
        );
        check(
            json!({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}),
            &[r#"["a", 1]"#],
            &[r#"["a"]"#, r#"[1, "a"]"#, r#"["a", 1, 2]"#],
        );
        check(
            json!({"type": "string", "format": "date-time"}),
            &[
                "\"2026-12-02T23:59:01Z\"",
                "\"2026-01-31T00:00:00.123+05:30\"",
            ],
            &["\"2026-13-01T00:00:00Z\"", "\"yesterday\""],
        );
        check(
            json!({"type": "string", "format": "uuid"}),
            &["\"123e4567-e89b-12d3-a456-426614174000\""],
            &["\"123e4567\""],
        );
        check(
            json!({"type": "string", "format": "email"}),
            &["\"anything\""],
            &["1"],
        );
    }

    #[test]
    fn references_and_recursion() {
        let schema = json!({
            "$defs": {"node": {"type": "object", "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                "required": ["value", "children"]}},
            "$ref": "#/$defs/node"
        });
        check(
            schema,
            &[r#"{"value": 1, "children": [{"value": 2, "children": []}]}"#],
            &[r#"{"value": 1, "children": [{"value": 2}]}"#],
        );
    }

    #[test]
    fn what_cannot_be_compiled_is_refused_with_its_place() {
        for (schema, want) in [
            (
                json!({"type": "string", "pattern": "^a+$"}),
                "`pattern` is not supported",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}),
                "`minimum` is not supported",
            ),
            (json!({"allOf": [{}]}), "`allOf` is not supported"),
            (
                json!({"type": "integer", "items": {}}),
                "`items` does not apply to type integer",
            ),
            (json!({"$ref": "#/$defs/missing"}), "points at nothing"),
            (
                json!({"$ref": "https://example.com/s.json"}),
                "only references inside",
            ),
            (
                json!({"type": "object", "required": ["x"]}),
                "required property \"x\"",
            ),
            (json!({"type": "thing"}), "unknown type \"thing\""),
            (json!(false), "allows no value"),
            (json!(3), "must be an object or a boolean"),
            (json!({"enum": []}), "`enum` must be a non-empty array"),
            (
                json!({"type": "string", "minLength": 3, "maxLength": 1}),
                "less than",
            ),
        ] {
            let e = to_grammar(&schema).unwrap_err().to_string();
            assert!(e.contains(want), "{schema}: {e}");
        }
        let e = to_grammar(&json!({"properties": {"a": {"type": "string", "pattern": "x"}}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at #/properties/a"), "{e}");
    }

    #[test]
    fn mentions_skips_literals() {
        assert!(mentions(r#""x" space"#, "space"));
        assert!(!mentions(r#""space""#, "space"));
        assert!(!mentions(r#"spaces"#, "space"));
        assert!(mentions(r#""\"" char* "\"" space"#, "char"));
    }
}
