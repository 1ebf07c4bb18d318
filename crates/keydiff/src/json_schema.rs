//! JSON schemas as grammars: OpenAI's `response_format: {"type": "json_schema"}`, llama.cpp's
//! `--json-schema`. [`to_grammar`] writes a GBNF grammar ([`crate::grammar`]) whose texts are
//! the JSON values the schema allows, written as llama.cpp's `json-schema-to-grammar` writes
//! them: no whitespace inside values but a space or a newline and up to 20 spaces or tabs
//! after each token, numbers with at most 16 digits before and after the point, object members
//! in the order the schema's `properties` gives.
//!
//! What is compiled: `type` (one or a list), `properties`, `required`, `additionalProperties`,
//! `items`, `prefixItems`, `minItems`, `maxItems`, `minLength`, `maxLength`, `enum`, `const`,
//! `anyOf`, `oneOf` (as `anyOf`), `$ref` to `#/...` (recursion allowed), the string
//! formats `date`, `time`, `date-time` and `uuid`, `pattern` (regular expressions, in the
//! module `pattern`; not with `minLength`/`maxLength` or a compiled format), and `minimum`,
//! `maximum`, `exclusiveMinimum`, `exclusiveMaximum` on integers (exact digit ranges, to
//! ±1e38) and numbers (decimal texts without an exponent, compared digit by digit; the module
//! `number`), and `allOf` (one schema as itself, several object schemas merged; see
//! `merge_all_of`). Other formats are annotations, as JSON Schema 2020-12 makes them by
//! default: such a string is any string. Annotations (`title`, `description`, `default`,
//! `examples`, ...) are ignored. Any other keyword (`multipleOf`, `not`, `uniqueItems`,
//! `minProperties`, ...) is refused with its name and place, rather than ignored. A keyword applies to the types it constrains and is
//! ignored by the others in a list (`{"type": ["string", "null"], "maxLength": 8}`); one that
//! applies to none of them is refused.
//!
//! As in vLLM's default (xgrammar's strict mode), an object without `additionalProperties`
//! has only the properties it names, and `prefixItems` without `items` is a tuple of exactly
//! those items. Members come in the order of `properties`: required ones always, optional
//! ones may be left out. `additionalProperties: true` or a schema allows other members after
//! them, named anything but a declared name, as llama.cpp has it (`\u` escapes can still
//! spell one; a declared name with a character JSON escapes lifts the exclusion). `const` and `enum` take only `type` beside them,
//! which keeps the values of its types. Schemas nest at most [`MAX_DEPTH`] deep, `$ref`s
//! included.

mod number;
mod pattern;

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
    "pattern",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "$defs",
    "definitions",
    "format",
];

/// The bounds of numbers.
const BOUNDS: [&str; 4] = ["minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"];

/// The types of JSON Schema.
const TYPES: [&str; 7] = [
    "null", "boolean", "integer", "number", "string", "array", "object",
];

/// The keywords that constrain values of type `t`.
fn keywords_of(t: &str) -> &'static [&'static str] {
    match t {
        "integer" | "number" => &BOUNDS,
        "string" => &["minLength", "maxLength", "format", "pattern"],
        "array" => &["items", "prefixItems", "minItems", "maxItems"],
        "object" => &["properties", "required", "additionalProperties"],
        _ => &[],
    }
}

/// The first (for a minimum) or last (for a maximum) integer that bound `key` of value `v`
/// allows; `exact` is `v` when it is an integer in the JSON text.
fn bound_edge(key: &str, v: f64, exact: Option<i128>) -> i128 {
    let (floor, ceil) = match exact {
        Some(i) => (i, i),
        None => (v.floor() as i128, v.ceil() as i128),
    };
    match key {
        "minimum" => ceil,
        "exclusiveMinimum" => floor + 1,
        "maximum" => floor,
        _ => ceil - 1,
    }
}

/// Digits an integer may have when no bound limits it, as in the `integer` primitive.
const MAX_DIGITS: usize = 16;

/// GBNF alternatives for the decimal numbers from `from` to `to` (to [`MAX_DIGITS`] digits,
/// or `from`'s, when `to` is `None`), written without leading zeros.
fn digits_range(from: u128, to: Option<u128>) -> String {
    let from_len = from.to_string().len();
    let to_len = match to {
        Some(t) => t.to_string().len(),
        None => from_len.max(MAX_DIGITS),
    };
    let mut alts = Vec::new();
    for len in from_len..=to_len {
        let first = if len == from_len {
            from
        } else {
            10u128.pow(len as u32 - 1)
        };
        let last = match to {
            Some(t) if len == to_len => t,
            _ => 10u128.pow(len as u32) - 1,
        };
        if first <= last {
            alts.push(same_length(
                first.to_string().as_bytes(),
                last.to_string().as_bytes(),
            ));
        }
    }
    alts.join(" | ")
}

/// GBNF for the digit strings from `a` to `b`, both `a.len()` digits long, `a <= b`.
fn same_length(a: &[u8], b: &[u8]) -> String {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let prefix = match common {
        0 => String::new(),
        _ => format!(
            "\"{}\" ",
            std::str::from_utf8(&a[..common]).expect("digits")
        ),
    };
    if common == a.len() {
        return prefix.trim_end().to_string();
    }
    let (a0, b0) = (a[common], b[common]);
    let (at, bt) = (&a[common + 1..], &b[common + 1..]);
    let any = match at.len() {
        0 => String::new(),
        n => format!(" [0-9]{{{n}}}"),
    };
    let mut alts = Vec::new();
    // From `a`'s first digit: the rest from `a`'s up; all of them if those are zeros.
    let mut mid_from = a0;
    if at.iter().any(|&d| d != b'0') {
        let nines = vec![b'9'; at.len()];
        alts.push(format!("\"{}\" ({})", a0 as char, same_length(at, &nines)));
        mid_from += 1;
    }
    // The first digits in between: any rest.
    let mut mid_to = b0;
    let b_alt = if bt.iter().any(|&d| d != b'9') {
        let zeros = vec![b'0'; bt.len()];
        mid_to -= 1;
        Some(format!("\"{}\" ({})", b0 as char, same_length(&zeros, bt)))
    } else {
        None
    };
    if mid_from <= mid_to {
        alts.push(format!("[{}-{}]{any}", mid_from as char, mid_to as char));
    }
    alts.extend(b_alt);
    format!("{prefix}({})", alts.join(" | "))
}

/// Keywords that constrain nothing (JSON Schema's annotations, and OpenAPI's `example`,
/// `discriminator`, which names the property that tells a `oneOf`'s members apart, and
/// `externalDocs`); vendor extensions `x-*` too.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "example",
    "discriminator",
    "externalDocs",
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

/// A keyword that constrains nothing ([`ANNOTATIONS`], or a vendor extension `x-*`).
fn is_annotation(k: &str) -> bool {
    ANNOTATIONS.contains(&k) || k.starts_with("x-")
}

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
    to_rules(schema, "root")
}

/// The rules of [`to_grammar`] with the schema's values as rule `name` instead of `root`,
/// and no rule named `root`: a part of a larger grammar that defines `root` (tool calls,
/// [`crate::tools`]). Its other rules are named as in [`to_grammar`].
pub fn to_rules(schema: &Value, name: &str) -> Result<String, SchemaError> {
    let merged = merge_all_of(schema)?;
    let schema = &merged;
    let mut c = Converter {
        root: schema,
        rules: Vec::new(),
        refs: HashMap::new(),
        used: Vec::new(),
        taken: (PRIMITIVES.iter().map(|p| (p.0.to_string(), 1)))
            .chain([("root".to_string(), 1), (name.to_string(), 1)])
            .collect(),
        depth: 0,
    };
    let root = c.visit(schema, name, "#")?;
    if root != name {
        c.rules.push((name.into(), root));
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

/// `schema` without what [`to_grammar`] cannot enforce, so that its grammar allows at least
/// the values the schema allows: keywords it does not compile are dropped (in every
/// subschema), as are `minLength`/`maxLength` beside a `pattern` and a `pattern` beside a
/// compiled format. For schemas a grammar only guides, such as a function's parameters
/// without OpenAI's `strict` ([`crate::tools`]); what stays refused (a `$ref` outside the
/// schema, bounds beyond ±1e38, ...) is still refused by [`to_grammar`].
pub fn loosen(schema: &Value) -> Value {
    let Value::Object(s) = schema else {
        return schema.clone();
    };
    let each_value = |v: &Value| match v {
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), loosen(v))).collect()),
        v => v.clone(),
    };
    let each_item = |v: &Value| match v {
        Value::Array(a) => Value::Array(a.iter().map(loosen).collect()),
        v => v.clone(),
    };
    let mut out = Map::new();
    for (k, v) in s {
        let v = match k.as_str() {
            "properties" | "$defs" | "definitions" => each_value(v),
            "additionalProperties" | "items" => loosen(v),
            "prefixItems" | "anyOf" | "oneOf" | "allOf" => each_item(v),
            k if COMPILED.contains(&k) || is_annotation(k) => v.clone(),
            _ => continue,
        };
        out.insert(k.clone(), v);
    }
    let compiled_format = matches!(
        out.get("format").and_then(Value::as_str),
        Some("date" | "time" | "date-time" | "uuid")
    );
    if compiled_format {
        out.remove("pattern");
    }
    if compiled_format || out.contains_key("pattern") {
        out.remove("minLength");
        out.remove("maxLength");
    }
    Value::Object(out)
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

/// Whether `v` is of JSON schema type `t`.
fn of_type(v: &Value, t: &str) -> bool {
    match t {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        "number" => v.is_number(),
        "string" => v.is_string(),
        "array" => v.is_array(),
        "object" => v.is_object(),
        _ => false,
    }
}

/// The schema with every `allOf` merged into one schema. One subschema stands for itself
/// (Pydantic's `{"allOf": [{"$ref": ...}], "description": ...}`); several must be object
/// schemas (a `$ref` to one counts), merged as llama.cpp merges them: the properties of each
/// in turn, the `required` of all. Beside `allOf`, only annotations and `$defs`.
fn merge_all_of(root: &Value) -> Result<Value, SchemaError> {
    schema_with_merges(root, root, "#", 0, &mut HashMap::new())
}

/// [`merge_all_of`] of the schema `v` at `at`, walking only where schemas are; `refs` keeps
/// the `$ref`s merged so far, so that each is merged once.
fn schema_with_merges(
    v: &Value,
    root: &Value,
    at: &str,
    depth: usize,
    refs: &mut HashMap<String, Value>,
) -> Result<Value, SchemaError> {
    if depth > MAX_DEPTH {
        return Err(SchemaError(format!(
            "schemas nested more than {MAX_DEPTH} deep (through subschemas or `$ref`s) (at {at})"
        )));
    }
    let Value::Object(o) = v else {
        return Ok(v.clone());
    };
    let mut sub =
        |x: &Value, key: &str| schema_with_merges(x, root, &format!("{at}/{key}"), depth + 1, refs);
    let mut out = o.clone();
    for (key, x) in o {
        match (key.as_str(), x) {
            ("items" | "additionalProperties", _) => {
                out[key] = sub(x, key)?;
            }
            ("prefixItems" | "anyOf" | "oneOf" | "allOf", Value::Array(a)) => {
                let mut each = Vec::new();
                for (i, x) in a.iter().enumerate() {
                    each.push(sub(x, &format!("{key}/{i}"))?);
                }
                out[key] = Value::Array(each);
            }
            ("properties" | "$defs" | "definitions", Value::Object(m)) => {
                let mut each = Map::new();
                for (name, x) in m {
                    each.insert(name.clone(), sub(x, &format!("{key}/{name}"))?);
                }
                out[key] = Value::Object(each);
            }
            _ => {}
        }
    }
    let Some(all) = out.remove("allOf") else {
        return Ok(Value::Object(out));
    };
    let err = |what: String, place: &str| Err(SchemaError(format!("{what} (at {place})")));
    let Some(subs) = all.as_array().filter(|a| !a.is_empty()) else {
        return err("`allOf` must be a non-empty array of schemas".into(), at);
    };
    if let Some(k) = out
        .keys()
        .find(|k| !is_annotation(k) && !["$defs", "definitions"].contains(&k.as_str()))
    {
        return err(format!("`allOf` with `{k}` beside it is not supported"), at);
    }
    // What stays beside the merged schema: annotations and definitions.
    let mut merged =
        match &subs[..] {
            [one] => match one {
                Value::Object(m) => m.clone(),
                _ => return Ok(one.clone()),
            },
            _ => {
                let mut props = Map::new();
                let mut required: Vec<Value> = Vec::new();
                let mut additional: Option<Value> = None;
                for (i, s) in subs.iter().enumerate() {
                    let place = format!("{at}/allOf/{i}");
                    // A `$ref` stands for what it points at (merged in turn).
                    let target;
                    let s = match s.get("$ref").and_then(Value::as_str) {
                        Some(path) => {
                            let found = path.strip_prefix('#').and_then(|p| root.pointer(p));
                            let Some(found) = found else {
                                return err(format!("`$ref` {path:?} points at nothing"), &place);
                            };
                            target = match refs.get(path) {
                                Some(t) => t.clone(),
                                None => {
                                    let t = schema_with_merges(found, root, path, depth + 1, refs)?;
                                    refs.insert(path.to_string(), t.clone());
                                    t
                                }
                            };
                            &target
                        }
                        None => s,
                    };
                    let Value::Object(m) = s else {
                        return err("several `allOf` schemas must be objects'".into(), &place);
                    };
                    for (k, x) in m {
                        match (k.as_str(), x) {
                            ("type", Value::String(t)) if t == "object" => {}
                            ("properties", Value::Object(p)) => {
                                for (name, x) in p {
                                    props.insert(name.clone(), x.clone());
                                }
                            }
                            ("required", Value::Array(r)) => {
                                for n in r {
                                    if !required.contains(n) {
                                        required.push(n.clone());
                                    }
                                }
                            }
                            ("additionalProperties", x) => match &additional {
                                Some(a) if a != x => return err(
                                    "`allOf` schemas with different `additionalProperties` are \
                                     not supported"
                                        .into(),
                                    &place,
                                ),
                                _ => additional = Some(x.clone()),
                            },
                            (k, _) if is_annotation(k) || k == "$defs" || k == "definitions" => {}
                            (k, _) => {
                                return err(
                                    format!(
                                        "several `allOf` schemas must be objects' (`type`, \
                                     `properties`, `required`, `additionalProperties`); `{k}` \
                                     is not supported there"
                                    ),
                                    &place,
                                )
                            }
                        }
                    }
                }
                let mut m = Map::new();
                m.insert("type".into(), "object".into());
                m.insert("properties".into(), Value::Object(props));
                if !required.is_empty() {
                    m.insert("required".into(), Value::Array(required));
                }
                if let Some(a) = additional {
                    m.insert("additionalProperties".into(), a);
                }
                m
            }
        };
    for (k, x) in out {
        merged.entry(k).or_insert(x);
    }
    Ok(Value::Object(merged))
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
    /// Rule names taken, and the next suffix to try for a name.
    taken: HashMap<String, usize>,
    /// Schemas being visited, one inside the other.
    depth: usize,
}

/// Schemas nested at most, through subschemas or `$ref`s (serde_json stops JSON itself at
/// 128 levels; a chain of `$ref`s is flat JSON).
pub const MAX_DEPTH: usize = 256;

impl<'a> Converter<'a> {
    fn prim(&mut self, name: &'static str) -> String {
        if !self.used.contains(&name) {
            self.used.push(name);
        }
        name.to_string()
    }

    /// A rule name for `hint` not taken yet.
    /// A rule name for `hint` not taken yet, now taken.
    fn name(&mut self, hint: &str) -> String {
        let clean: String = hint
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let Some(&from) = self.taken.get(&clean) else {
            self.taken.insert(clean.clone(), 1);
            return clean;
        };
        let (i, name) = (from..)
            .map(|i| (i, format!("{clean}-{i}")))
            .find(|(_, n)| !self.taken.contains_key(n))
            .expect("some name is free");
        self.taken.insert(clean, i + 1);
        self.taken.insert(name.clone(), 1);
        name
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
        if self.depth >= MAX_DEPTH {
            return self.err(
                at,
                format!(
                    "schemas nested more than {MAX_DEPTH} deep (through subschemas or `$ref`s)"
                ),
            );
        }
        self.depth += 1;
        let r = self.visit_in(s, hint, at);
        self.depth -= 1;
        r
    }

    fn visit_in(&mut self, s: &'a Value, hint: &str, at: &str) -> Result<String, SchemaError> {
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
            if !COMPILED.contains(&k.as_str()) && !is_annotation(k) {
                return self.err(
                    at,
                    format!(
                        "`{k}` is not supported (a keyword keydiff cannot enforce); it compiles \
                         {}, and ignores annotations ({}, x-*)",
                        COMPILED.join(", "),
                        ANNOTATIONS.join(", ")
                    ),
                );
            }
        }
        let constraints = || {
            s.keys()
                .filter(|k| !is_annotation(k) && !["$defs", "definitions"].contains(&k.as_str()))
                .count()
        };
        if let Some(r) = s.get("$ref") {
            if constraints() > 1 {
                return self.err(at, "`$ref` with other keywords beside it is not supported");
            }
            return self.reference(r, at);
        }
        for key in ["const", "enum"] {
            let Some(v) = s.get(key) else { continue };
            let values: &[Value] = match (key, v) {
                ("const", v) => std::slice::from_ref(v),
                (_, Value::Array(e)) if !e.is_empty() => e,
                _ => return self.err(at, "`enum` must be a non-empty array"),
            };
            // Beside them, only `type`, which keeps the values of its types.
            if let Some(k) = s.keys().find(|k| {
                !is_annotation(k) && !["$defs", "definitions", "type", key].contains(&k.as_str())
            }) {
                return self.err(at, format!("`{key}` with `{k}` beside it is not supported"));
            }
            let types: Vec<&str> = match s.get("type") {
                None => Vec::new(),
                Some(Value::String(t)) => vec![t.as_str()],
                Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
                Some(t) => {
                    return self.err(at, format!("`type` {t} must be a type or a list of them"))
                }
            };
            let alts: Vec<String> = (values.iter())
                .filter(|v| types.is_empty() || types.iter().any(|t| of_type(v, t)))
                .map(|v| literal(&v.to_string()))
                .collect();
            if alts.is_empty() {
                return self.err(at, format!("no value of `{key}` is of the `type` given"));
            }
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
                let alts = self.visit_each(subs, hint, at, key)?;
                return Ok(self.add(hint, alts.join(" | ")));
            }
        }
        let types: Vec<&str> = match s.get("type") {
            None if s.contains_key("properties") || s.contains_key("additionalProperties") => {
                vec!["object"]
            }
            None if s.contains_key("items") || s.contains_key("prefixItems") => vec!["array"],
            // Keywords of one type only: a value of that type is a value of the schema (as
            // llama.cpp reads `pattern` and `format` as a string's).
            None if ["pattern", "format", "minLength", "maxLength"]
                .iter()
                .any(|k| s.contains_key(*k)) =>
            {
                vec!["string"]
            }
            None if ["minItems", "maxItems"].iter().any(|k| s.contains_key(*k)) => vec!["array"],
            None if BOUNDS.iter().any(|k| s.contains_key(*k)) => vec!["number"],
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
        // Each keyword must apply to one of the types; the others ignore it, as JSON Schema
        // has it (`{"type": ["string", "null"], "maxLength": 8}`).
        for t in &types {
            if !TYPES.contains(t) {
                return self.err(at, format!("unknown type {t:?}"));
            }
        }
        if let Some(k) = s.keys().find(|k| {
            !is_annotation(k)
                && !["type", "$defs", "definitions"].contains(&k.as_str())
                && !types.iter().any(|t| keywords_of(t).contains(&k.as_str()))
        }) {
            return self.err(
                at,
                format!("`{k}` does not apply to type {}", types.join(" or ")),
            );
        }
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

    /// The rules of the schemas `subs` of keyword `key`: the `i`th named `{hint}-{i}`, at
    /// `{at}/{key}/{i}`.
    fn visit_each(
        &mut self,
        subs: &'a [Value],
        hint: &str,
        at: &str,
        key: &str,
    ) -> Result<Vec<String>, SchemaError> {
        (subs.iter().enumerate())
            .map(|(i, sub)| self.visit(sub, &format!("{hint}-{i}"), &format!("{at}/{key}/{i}")))
            .collect()
    }

    /// A rule for the characters of a JSON string that is none of `names` (each written
    /// raw), or `None` when a name has a character JSON escapes (`"`, `\`, a control
    /// character). One rule per node of the names' trie: a name's next character goes on
    /// down it, any other character ends the match, and the string may end wherever no name
    /// ends. `\u` escapes can still spell a declared name.
    fn not_names(&mut self, names: &[&str], hint: &str) -> Option<String> {
        if names.iter().any(|n| {
            n.chars()
                .any(|c| c == '"' || c == '\\' || (c as u32) < 0x20)
        }) {
            return None;
        }
        // The trie, built without recursion: (next characters and their nodes, a name ends).
        let mut nodes: Vec<(Vec<(char, usize)>, bool)> = vec![(Vec::new(), false)];
        for name in names {
            let mut at = 0;
            for c in name.chars() {
                at = match nodes[at].0.iter().find(|x| x.0 == c) {
                    Some(&(_, next)) => next,
                    None => {
                        nodes.push((Vec::new(), false));
                        let next = nodes.len() - 1;
                        nodes[at].0.push((c, next));
                        next
                    }
                };
            }
            nodes[at].1 = true;
        }
        let char = self.prim("char");
        let rules: Vec<String> = (0..nodes.len())
            .map(|i| self.name(&format!("{hint}-{i}")))
            .collect();
        for (i, (next, ends)) in nodes.iter().enumerate() {
            // (`/` may also be written `\/`.)
            let mut alts: Vec<String> = (next.iter())
                .map(|&(c, n)| match c {
                    '/' => format!(r#"("/" | "\\/") {}"#, rules[n]),
                    c => format!("{} {}", literal(&c.to_string()), rules[n]),
                })
                .collect();
            // Any other character (raw or escaped), then anything.
            let others: String = next
                .iter()
                .map(|&(c, _)| pattern::class_char(c as u32))
                .collect();
            let slash = if next.iter().any(|x| x.0 == '/') {
                ""
            } else {
                "/"
            };
            alts.push(format!(
                r#"([^"\\\x7F\x00-\x1F{others}] | [\\] (["\\{slash}bfnrt] | "u" [0-9a-fA-F]{{4}})) {char}*"#
            ));
            if !ends {
                alts.push(r#""""#.to_string());
            }
            self.rules.push((rules[i].clone(), alts.join(" | ")));
        }
        Some(rules[0].clone())
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
        match t {
            "null" => Ok(self.prim("null")),
            "boolean" => Ok(self.prim("boolean")),
            "integer" => self.integer(s, hint, at),
            "number" => {
                if !BOUNDS.iter().any(|k| s.contains_key(*k)) {
                    return Ok(self.prim("number"));
                }
                let body = number::bounded(s).map_err(|e| SchemaError(format!("{e} (at {at})")))?;
                self.prim("space");
                Ok(self.add(hint, format!("{body} space")))
            }
            "string" => {
                let format = s.get("format").and_then(Value::as_str);
                if let Some(f @ ("date" | "time" | "date-time" | "uuid")) = format {
                    if let Some(k) = ["minLength", "maxLength", "pattern"]
                        .iter()
                        .find(|k| s.contains_key(**k))
                    {
                        return self.err(at, format!("`{k}` with format {f} is not supported"));
                    }
                    let f = self.prim(match f {
                        "date" => "date",
                        "time" => "time",
                        "date-time" => "date-time",
                        _ => "uuid",
                    });
                    self.prim("space");
                    return Ok(self.add(hint, format!(r#""\"" {f} "\"" space"#)));
                }
                if let Some(p) = s.get("pattern") {
                    let Some(p) = p.as_str() else {
                        return self.err(at, "`pattern` must be a string");
                    };
                    if let Some(k) = ["minLength", "maxLength"]
                        .iter()
                        .find(|k| s.contains_key(**k))
                    {
                        return self.err(at, format!("`{k}` with `pattern` is not supported"));
                    }
                    let c = self.prim("char");
                    let body = pattern::to_gbnf(p, &format!("{c}*"))
                        .map_err(|e| SchemaError(format!("`pattern` {p:?}: {e} (at {at})")))?;
                    self.prim("space");
                    return Ok(self.add(hint, format!(r#""\"" {body} "\"" space"#)));
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
            "array" => self.array(s, hint, at),
            "object" => self.object(s, hint, at),
            _ => unreachable!("types are checked before"),
        }
    }

    /// An integer, within the bounds `s` gives.
    fn integer(
        &mut self,
        s: &'a Map<String, Value>,
        hint: &str,
        at: &str,
    ) -> Result<String, SchemaError> {
        let mut lo: Option<i128> = None;
        let mut hi: Option<i128> = None;
        for key in BOUNDS {
            let Some(v) = s.get(key) else { continue };
            // The integers the bound allows begin (or end) here.
            let lower = key.ends_with("inimum");
            let edge = match (v.as_i64(), v.as_u64(), v.as_f64()) {
                (Some(i), _, _) => bound_edge(key, i as f64, Some(i as i128)),
                (_, Some(u), _) => bound_edge(key, u as f64, Some(u as i128)),
                (_, _, Some(f)) if f.abs() < 1e38 => bound_edge(key, f, None),
                // Far beyond any integer written: no bound on the open side.
                (_, _, Some(f)) if (f < 0.0) == lower => continue,
                (_, _, Some(_)) => {
                    return self.err(
                        at,
                        format!("`{key}` {v}: integers past ±1e38 are not supported"),
                    )
                }
                _ => {
                    return self.err(
                        at,
                        format!("`{key}` {v} must be a number (as from draft 6)"),
                    )
                }
            };
            if lower {
                lo = Some(lo.map_or(edge, |l| l.max(edge)));
            } else {
                hi = Some(hi.map_or(edge, |h| h.min(edge)));
            }
        }
        if let (Some(l), Some(h)) = (lo, hi) {
            if l > h {
                return self.err(at, format!("the bounds leave no integer (from {l} to {h})"));
            }
        }
        if lo.is_none() && hi.is_none() {
            return Ok(self.prim("integer"));
        }
        let mut alts = Vec::new();
        // Negative values: `-` and their magnitudes.
        if lo.is_none_or(|l| l < 0) {
            let from = hi.map_or(1, |h| (-h).max(1)) as u128;
            let to = lo.map(|l| (-l) as u128);
            alts.push(format!(r#""-" ({})"#, digits_range(from, to)));
        }
        if hi.is_none_or(|h| h >= 0) {
            let from = lo.map_or(0, |l| l.max(0)) as u128;
            alts.push(format!("({})", digits_range(from, hi.map(|h| h as u128))));
        }
        self.prim("space");
        Ok(self.add(hint, format!("({}) space", alts.join(" | "))))
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
            let parts = self.visit_each(prefix, hint, at, "prefixItems")?;
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
        // Any value: a required property's when `properties` does not name it.
        static ANY: Value = Value::Bool(true);
        let mut listed: Vec<(&str, &'a Value)> = props
            .into_iter()
            .flatten()
            .map(|(n, v)| (n.as_str(), v))
            .collect();
        let required: Vec<&str> = match s.get("required") {
            None => Vec::new(),
            Some(Value::Array(r)) => {
                let mut out = Vec::new();
                for n in r {
                    match n.as_str() {
                        Some(n) if props.is_some_and(|p| p.contains_key(n)) => out.push(n),
                        // Named by `required` only: a member of the additional properties'
                        // schema (any value without one), after those `properties` names.
                        Some(n) => match s.get("additionalProperties") {
                            Some(Value::Bool(false)) => {
                                return self.err(
                                    at,
                                    format!(
                                        "required property {n:?} is not in `properties`, and \
                                         `additionalProperties` is false: no object has it"
                                    ),
                                )
                            }
                            extra => {
                                if !listed.iter().any(|(m, _)| *m == n) {
                                    listed.push((n, extra.unwrap_or(&ANY)));
                                }
                                out.push(n);
                            }
                        },
                        None => return self.err(at, "`required` must list property names"),
                    }
                }
                out
            }
            Some(_) => return self.err(at, "`required` must be an array"),
        };
        let mut members = Vec::new();
        for &(name, sub) in &listed {
            let value = self.visit(
                sub,
                &format!("{hint}-{name}"),
                &format!("{at}/properties/{name}"),
            )?;
            let key = literal(&Value::String(name.to_string()).to_string());
            let kv = self.add(
                &format!("{hint}-{name}-kv"),
                format!(r#"{key} space ":" space {value}"#),
            );
            members.push((kv, required.contains(&name)));
        }
        let extra = match s.get("additionalProperties") {
            None | Some(Value::Bool(false)) => None,
            Some(sub) => {
                let value = self.visit(
                    sub,
                    &format!("{hint}-additional"),
                    &format!("{at}/additionalProperties"),
                )?;
                let names: Vec<&str> = listed.iter().map(|(n, _)| *n).collect();
                let key = match self.not_names(&names, &format!("{hint}-additional-name")) {
                    Some(body) => format!(r#""\"" ({body}) "\"" space"#),
                    None => self.prim("string"),
                };
                Some(self.add(
                    &format!("{hint}-additional-kv"),
                    format!(r#"{key} ":" space {value}"#),
                ))
            }
        };
        // From the last member back, two rules: what may follow once a member was written
        // (each member then after a comma), and what may come first (the first member
        // written has none). Members keep the order of `properties`; required ones must come,
        // optional ones may; extra ones come last. One rule each: linear in the members.
        let (mut then, mut first) = match &extra {
            Some(e) => (
                format!(r#"( "," space {e} )*"#),
                format!(r#"( {e} ( "," space {e} )* )?"#),
            ),
            None => (String::new(), String::new()),
        };
        for (i, (kv, required)) in members.iter().enumerate().rev() {
            let then_next = self.add(&format!("{hint}-then-{i}"), then);
            let first_next = self.add(&format!("{hint}-first-{i}"), first);
            (then, first) = match required {
                true => (
                    format!(r#""," space {kv} {then_next}"#),
                    format!("{kv} {then_next}"),
                ),
                false => (
                    format!(r#"( "," space {kv} )? {then_next}"#),
                    format!("{kv} {then_next} | {first_next}"),
                ),
            };
        }
        let body = self.add(&format!("{hint}-members"), first);
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
        let short = |s: String| s.chars().take(400).collect::<String>();
        let grammar = || short(to_grammar(&schema).unwrap());
        for t in good {
            assert!(
                whole(&g, t),
                "{} should allow {t}\n{}",
                short(schema.to_string()),
                grammar()
            );
        }
        for t in bad {
            assert!(
                !whole(&g, t),
                "{} should refuse {t}\n{}",
                short(schema.to_string()),
                grammar()
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
    fn required_and_optional_members_keep_the_properties_order() {
        check(
            json!({"properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                   "c": {"type": "integer"}}, "required": ["b"]}),
            &[
                r#"{"a": 1, "b": 2}"#,
                r#"{"b": 2}"#,
                r#"{"b": 2, "c": 3}"#,
                r#"{"a":1,"b":2,"c":3}"#,
            ],
            &[
                r#"{"b": 2, "a": 1}"#,
                r#"{"a": 1}"#,
                r#"{"a": 1, "c": 3}"#,
                r#"{}"#,
                r#"{"b": 2,}"#,
            ],
        );
        // 3000 optional members: a grammar linear in them, and any one of them alone.
        let props: Map<String, Value> = (0..3000)
            .map(|i| (format!("p{i}"), json!({"type": "null"})))
            .collect();
        let schema = json!({"type": "object", "properties": props});
        let g = to_grammar(&schema).unwrap();
        assert!(g.len() < 3000 * 200, "{} bytes", g.len());
        check(
            schema,
            &["{}", r#"{"p2999": null}"#, r#"{"p7": null, "p8": null}"#],
            &[r#"{"p8": null, "p7": null}"#],
        );
    }

    #[test]
    fn enums_and_consts_with_a_type_or_other_keywords() {
        check(
            json!({"type": "string", "enum": ["a", 1, "b"]}),
            &["\"a\"", "\"b\""],
            &["1"],
        );
        check(
            json!({"type": ["integer", "null"], "const": 2}),
            &["2"],
            &["null"],
        );
        for (schema, want) in [
            (
                json!({"const": "abc", "maxLength": 2}),
                "`const` with `maxLength` beside it",
            ),
            (
                json!({"type": "string", "enum": [1, 2]}),
                "no value of `enum` is of the `type`",
            ),
            (
                json!({"type": "string", "format": "date", "maxLength": 4}),
                "`maxLength` with format date",
            ),
        ] {
            let e = to_grammar(&schema).unwrap_err().to_string();
            assert!(e.contains(want), "{schema}: {e}");
        }
    }

    #[test]
    fn a_long_ref_chain_is_refused_not_overflowed() {
        let chain = |n: usize| {
            let defs: Map<String, Value> = (0..n)
                .map(|i| {
                    (
                        format!("a{i}"),
                        json!({"$ref": format!("#/$defs/a{}", i + 1)}),
                    )
                })
                .chain([(format!("a{n}"), json!({"type": "null"}))])
                .collect();
            json!({"$defs": defs, "$ref": "#/$defs/a0"})
        };
        check(chain(100), &["null"], &["1"]);
        let e = to_grammar(&chain(20_000)).unwrap_err().to_string();
        assert!(e.contains("nested more than 256 deep"), "{e}");
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
        // An additional member's name is none of the declared ones: not again, but prefixes,
        // extensions and neighbours of them are other names.
        check(
            json!({"type": "object", "properties": {"ab": {}, "abd": {}, "b": {}, "é": {}},
                   "additionalProperties": true}),
            &[
                r#"{"ab": 1, "a": 2}"#,
                r#"{"x": 1, "": 2, "abc": 3, "abde": 4, "bb": 5, "e": 6, "\n": 7}"#,
            ],
            &[
                r#"{"ab": 1, "ab": 2}"#,
                r#"{"abd": 1, "ab": 2}"#,
                r#"{"x": 1, "b": 2}"#,
                r#"{"é": 1, "é": 2}"#,
            ],
        );
        // `\/` cannot spell a declared `/`; long names compile flat (one rule a character).
        check(
            json!({"properties": {"a/b": {}}, "additionalProperties": true}),
            &[r#"{"a/b": 1, "a\\b": 2, "a\/c": 3, "a/": 4}"#],
            &[r#"{"a/b": 1, "a\/b": 2}"#, r#"{"a/b": 1, "a/b": 2}"#],
        );
        let long = "x".repeat(100_000);
        let g = state(&json!({"properties": {&long: {}}, "additionalProperties": true}));
        assert!(whole(
            &g,
            &format!(r#"{{"{long}": 1, "{long}y": 2, "x": 3}}"#)
        ));
        assert!(!whole(&g, &format!(r#"{{"x": 3, "{long}": 1}}"#)));
    }

    proptest::proptest! {
        /// The names of additional members are exactly the strings that are not declared (the
        /// declared members are strings, the additional ones numbers).
        #[test]
        fn additional_names_are_exactly_the_undeclared(
            declared in proptest::collection::vec("[abé]{0,3}", 1..5),
            names in proptest::collection::vec("[abcé]{0,4}", 16),
        ) {
            let mut props = Map::new();
            for d in &declared {
                props.insert(d.clone(), json!({"type": "string"}));
            }
            let g = state(&json!({"properties": props, "additionalProperties": {"type": "integer"}}));
            for n in names {
                let text = format!("{{{}: 1}}", quoted(&n));
                proptest::prop_assert_eq!(whole(&g, &text), !declared.contains(&n), "{} with {:?}", text, declared);
            }
        }
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
    fn loosened_schemas_compile_what_they_can() {
        let schema = json!({"type": "object", "properties": {
            "tags": {"type": "array", "uniqueItems": true, "items": {"type": "string",
                "pattern": "^[a-z]+$", "maxLength": 8}},
            "n": {"type": "integer", "multipleOf": 2, "minimum": 0},
            "not": {"type": "string", "format": "date", "pattern": "^2"},
            "any": {"not": {"type": "null"}}},
            "minProperties": 1, "required": ["n"]});
        assert!(to_grammar(&schema).is_err());
        let loose = loosen(&schema);
        assert_eq!(
            loose,
            json!({"type": "object", "properties": {
                "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}},
                "n": {"type": "integer", "minimum": 0},
                "not": {"type": "string", "format": "date"},
                "any": {}},
                "required": ["n"]})
        );
        check(
            loose,
            &[r#"{"tags": ["ab", "ab"], "n": 3, "not": "2024-01-02", "any": null}"#],
            &[r#"{"tags": ["A"], "n": 3}"#, r#"{"n": -1}"#],
        );
        // What is compiled stays as it is.
        let strict = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
            "$defs": {"a": {"type": "string", "minLength": 2}}});
        assert_eq!(loosen(&strict), strict);
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

    /// Annotations (OpenAPI's `example` and `discriminator`, vendor `x-*` keys) constrain
    /// nothing, also beside a combinator; keywords of one type only imply that type.
    #[test]
    fn annotations_are_ignored_and_single_type_keywords_imply_their_type() {
        check(
            json!({"type": "object", "x-order": 0, "properties": {
                "a": {"type": "integer", "example": 5, "x-go-type": "int"}}, "required": ["a"]}),
            &[r#"{"a": 5}"#],
            &[r#"{"a": "5"}"#],
        );
        let cat = json!({"type": "object", "properties": {"kind": {"const": "cat"}},
            "required": ["kind"], "additionalProperties": false});
        let dog = json!({"type": "object", "properties": {"kind": {"const": "dog"}},
            "required": ["kind"], "additionalProperties": false});
        check(
            json!({"oneOf": [cat, dog], "discriminator": {"propertyName": "kind"}}),
            &[r#"{"kind": "cat"}"#, r#"{"kind": "dog"}"#],
            &[r#"{"kind": "cow"}"#],
        );
        check(
            json!({"pattern": "^[a-z]+$"}),
            &[r#""abc""#],
            &["12", r#""ABC""#],
        );
        check(json!({"format": "date"}), &[r#""2024-02-29""#], &["2024"]);
        check(json!({"maxLength": 2}), &[r#""ab""#], &[r#""abc""#]);
        check(json!({"minItems": 1}), &["[1]"], &["[]"]);
        check(json!({"minimum": 3}), &["3", "4.5"], &["2", "\"3\""]);
        // A required property `properties` does not name: any value, or the additional
        // properties' schema.
        check(
            json!({"type": "object", "required": ["x"]}),
            &[r#"{"x": 1}"#, r#"{"x": {"y": []}}"#],
            &["{}", r#"{"y": 1}"#],
        );
        check(
            json!({"type": "object", "properties": {"a": {"type": "integer"}},
                   "required": ["x"], "additionalProperties": {"type": "string"}}),
            &[r#"{"x": "s"}"#, r#"{"a": 1, "x": "s", "z": "t"}"#],
            &[r#"{"x": 1}"#, r#"{"a": 1}"#],
        );
    }

    #[test]
    fn what_cannot_be_compiled_is_refused_with_its_place() {
        for (schema, want) in [
            (
                json!({"type": "string", "uniqueItems": true}),
                "`uniqueItems` is not supported",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}),
                "`multipleOf` is not supported",
            ),
            (json!({"not": {}}), "`not` is not supported"),
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
                json!({"type": "object", "required": ["x"], "additionalProperties": false}),
                "required property \"x\" is not in `properties`, and",
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
        let e = to_grammar(&json!({"properties": {"a": {"type": "string", "pattern": "("}}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at #/properties/a"), "{e}");
    }

    #[test]
    fn integer_bounds() {
        check(
            json!({"type": "integer", "minimum": -12, "maximum": 305}),
            &[
                "-12", "-9", "-1", "0", "7", "10", "99", "100", "299", "300", "305",
            ],
            &[
                "-13", "-20", "-100", "306", "310", "400", "1000", "-0", "007", "1.0",
            ],
        );
        check(
            json!({"type": "integer", "exclusiveMinimum": 0.5, "exclusiveMaximum": 10}),
            &["1", "9"],
            &["0", "10", "-1"],
        );
        check(
            json!({"type": "integer", "minimum": 1.5, "maximum": 3.9}),
            &["2", "3"],
            &["1", "4"],
        );
        check(
            json!({"type": "integer", "minimum": 0}),
            &["0", "1", "1234567890123456"],
            &["-1", "12345678901234567", "01"],
        );
        check(
            json!({"type": "integer", "maximum": -5}),
            &["-5", "-6", "-1000000"],
            &["-4", "0", "5"],
        );
        // Far bounds: open on their side, or exact to ±1e38.
        check(
            json!({"type": "integer", "minimum": -1e300, "maximum": 1e20}),
            &["-5", "0", "100000000000000000000"],
            &["100000000000000000001"],
        );
        check(
            json!({"type": "integer", "minimum": 1e20}),
            &["100000000000000000000", "999999999999999999999"],
            &["99999999999999999999", "1000000000000000000000"],
        );
        check(
            json!({"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX}),
            &["-9223372036854775808", "9223372036854775807", "0"],
            &["-9223372036854775809", "9223372036854775808"],
        );
        // A keyword applies to the types it constrains and is ignored by the others.
        check(
            json!({"type": ["integer", "string", "null"], "minimum": 1, "maxLength": 2}),
            &["1", "\"ab\"", "null"],
            &["0", "\"abc\""],
        );
        for (schema, want) in [
            (
                json!({"type": "integer", "minimum": 3, "maximum": 2}),
                "leave no integer",
            ),
            (
                json!({"type": "integer", "exclusiveMinimum": true}),
                "must be a number",
            ),
            (json!({"type": "integer", "minimum": 1e300}), "past ±1e38"),
            (json!({"type": "integer", "maximum": -1e300}), "past ±1e38"),
            (
                json!({"type": ["string", "null"], "minimum": 0}),
                "`minimum` does not apply to type string or null",
            ),
        ] {
            let e = to_grammar(&schema).unwrap_err().to_string();
            assert!(e.contains(want), "{schema}: {e}");
        }
    }

    proptest::proptest! {
        /// A bounded integer's grammar allows exactly the integers within the bounds.
        #[test]
        fn integer_ranges_are_exact(
            lo in proptest::option::of(-3000i64..3000),
            hi in proptest::option::of(-3000i64..3000),
            big in proptest::option::of(proptest::num::i64::ANY),
            xs in proptest::collection::vec(-4000i64..4000, 32),
        ) {
            let (lo, hi) = match big {
                Some(b) if b < 0 => (Some(b), hi),
                Some(b) => (lo, Some(b)),
                None => (lo, hi),
            };
            if lo.is_some_and(|l| hi.is_some_and(|h| l > h)) {
                return Ok(());
            }
            let mut schema = json!({"type": "integer"});
            if let Some(l) = lo {
                schema["minimum"] = json!(l);
            }
            if let Some(h) = hi {
                schema["maximum"] = json!(h);
            }
            let g = state(&schema);
            let edges = [lo, hi].into_iter().flatten().flat_map(|e| [e.saturating_sub(1), e, e.saturating_add(1)]);
            for x in xs.into_iter().chain(edges) {
                let want = lo.is_none_or(|l| x >= l) && hi.is_none_or(|h| x <= h);
                proptest::prop_assert_eq!(whole(&g, &x.to_string()), want, "{} in {}", x, schema);
            }
        }
    }

    #[test]
    fn all_of() {
        // Pydantic's form: one `$ref` in `allOf`, with a description beside it.
        check(
            json!({"type": "object", "required": ["colour"],
                   "properties": {"colour": {"allOf": [{"$ref": "#/$defs/Colour"}],
                                             "description": "the colour"}},
                   "$defs": {"Colour": {"enum": ["red", "green"]}}}),
            &[r#"{"colour": "red"}"#],
            &[r#"{"colour": "blue"}"#, "{}"],
        );
        // Several object schemas, one through a `$ref`: properties in turn, `required` joined.
        check(
            json!({"allOf": [
                       {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                       {"$ref": "#/$defs/B"}],
                   "$defs": {"B": {"properties": {"b": {"type": "string"}, "c": {"type": "null"}},
                                   "required": ["b"]}}}),
            &[r#"{"a": 1, "b": "x"}"#, r#"{"a": 1, "b": "x", "c": null}"#],
            &[
                r#"{"a": 1}"#,
                r#"{"b": "x", "a": 1}"#,
                r#"{"a": 1, "b": "x", "d": 2}"#,
            ],
        );
        // Each `$ref` is merged once: 40 levels of two references each stay linear.
        let mut defs = Map::new();
        for i in 0..40 {
            let next = format!("#/$defs/d{}", i + 1);
            defs.insert(
                format!("d{i}"),
                json!({"allOf": [{"$ref": next}, {"$ref": next}]}),
            );
        }
        defs.insert(
            "d40".into(),
            json!({"properties": {"x": {"type": "integer"}}}),
        );
        check(
            json!({"$ref": "#/$defs/d0", "$defs": defs}),
            &[r#"{"x": 3}"#, "{}"],
            &[r#"{"y": 3}"#],
        );
        for (schema, want) in [
            (json!({"allOf": []}), "non-empty array"),
            (
                json!({"type": "object", "allOf": [{}]}),
                "`allOf` with `type` beside it is not supported (at #)",
            ),
            (
                json!({"allOf": [{"type": "object"}, {"type": "string"}]}),
                "`type` is not supported there (at #/allOf/1)",
            ),
            (
                json!({"allOf": [{}, true]}),
                "must be objects' (at #/allOf/1)",
            ),
            (
                json!({"allOf": [{"additionalProperties": true}, {"additionalProperties": false}]}),
                "different `additionalProperties`",
            ),
            (
                json!({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}, {}]}}, "$ref": "#/$defs/a"}),
                "nested more than 256",
            ),
        ] {
            let e = to_grammar(&schema).unwrap_err().to_string();
            assert!(e.contains(want), "{schema}: {e}");
        }
    }

    #[test]
    fn number_bounds() {
        check(
            json!({"type": "number", "minimum": 0, "maximum": 1}),
            &[
                "0",
                "1",
                "0.5",
                "1.0",
                "0.000",
                "0.9999",
                "1.0000000000000000",
            ],
            &[
                "-0.1",
                "1.01",
                "1.5",
                "2",
                "-0",
                "1e0",
                ".5",
                "01",
                "1.00000000000000001",
            ],
        );
        check(
            json!({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
            &["0.5", "0.0001", "0.99"],
            &["0", "1", "0.0", "1.00", "-0.5"],
        );
        check(
            json!({"type": "number", "minimum": -2.5, "maximum": -0.25}),
            &["-2.5", "-1", "-0.25", "-0.3", "-2.49", "-2.50"],
            &["-2.51", "-0.24", "0", "-3", "-0.2"],
        );
        check(
            json!({"type": "number", "minimum": 0.1}),
            &["0.1", "0.10", "5", "1234.5", "0.2"],
            &["0.09", "0.0999", "0", "-1"],
        );
        check(
            json!({"type": "number", "maximum": 1e-7}),
            &["0", "-5", "0.0000001", "0.00000009"],
            &["0.00000011", "1", "0.000001"],
        );
        check(
            json!({"type": "number", "minimum": -1e300, "maximum": 1e300}),
            &["-5.5", "0", "1234567890123456.5"],
            &["1e5"],
        );
        // More than 16 decimals: the bounds move inward onto the numbers written.
        check(
            json!({"type": "number", "minimum": 0.30000000000000004}),
            &["0.3000000000000001", "1"],
            &["0.3", "0.30000000000000004"],
        );
        check(
            json!({"type": "number", "minimum": -5e-324, "maximum": 5e-324}),
            &["0"],
            &["0.0000000000000001", "-0.0000000000000001"],
        );
        check(
            json!({"type": "number", "maximum": -0.99999999999999999999, "minimum": -1}),
            &["-1", "-1.0"],
            &["-0.9999999999999999"],
        );
        check(
            json!({"type": "number", "maximum": 3e23}),
            &["300000000000000000000000", "299999999999999999999999.5"],
            &["300000000000000000000000.1"],
        );
        // With integers in a list: each type its own bounds' grammar.
        check(
            json!({"type": ["integer", "number"], "minimum": 1, "maximum": 2}),
            &["1", "2", "1.5"],
            &["0", "2.5"],
        );
        for (schema, want) in [
            (
                json!({"type": "number", "minimum": 2, "maximum": 1}),
                "leave no number",
            ),
            (
                json!({"type": "number", "exclusiveMinimum": 1, "maximum": 1}),
                "leave no number",
            ),
            (json!({"type": "number", "minimum": 1e39}), "past ±1e38"),
            (
                json!({"type": "number", "exclusiveMinimum": 0.30000000000000004, "maximum": 0.3}),
                "leave no number",
            ),
            (
                json!({"type": "number", "minimum": "1"}),
                "must be a number",
            ),
        ] {
            let e = to_grammar(&schema).unwrap_err().to_string();
            assert!(e.contains(want), "{schema}: {e}");
        }
    }

    proptest::proptest! {
        /// A bounded number's grammar allows exactly the decimal texts within the bounds
        /// (bounds of 3 decimals, values of up to 4, compared as scaled integers).
        #[test]
        fn number_ranges_are_exact(
            lo in proptest::option::of((-30_000i64..30_000, proptest::bool::ANY)),
            hi in proptest::option::of((-30_000i64..30_000, proptest::bool::ANY)),
            xs in proptest::collection::vec((proptest::bool::ANY, 0i64..40, "[0-9]{0,4}"), 48),
        ) {
            let text = |milli: i64| {
                let sign = if milli < 0 { "-" } else { "" };
                format!("{sign}{}.{:03}", milli.abs() / 1000, milli.abs() % 1000)
            };
            let mut schema = json!({"type": "number"});
            for (key, b) in [("imum", lo), ("aximum", hi)] {
                let Some((milli, inclusive)) = b else { continue };
                let name = match (key, inclusive) {
                    ("imum", true) => "minimum",
                    ("imum", false) => "exclusiveMinimum",
                    (_, true) => "maximum",
                    _ => "exclusiveMaximum",
                };
                schema[name] = serde_json::from_str(&text(milli)).unwrap();
            }
            let Ok(g) = to_grammar(&schema) else {
                // Only bounds that leave nothing are refused.
                let (l, li) = lo.unwrap();
                let (h, hi_in) = hi.unwrap();
                proptest::prop_assert!(l > h || (l == h && !(li && hi_in)), "{}", schema);
                return Ok(());
            };
            let g = GrammarState::new(Arc::new(Grammar::parse(&g).unwrap()));
            for (neg, int, frac) in xs {
                let scaled = int * 10_000 + format!("{frac:0<4}").parse::<i64>().unwrap();
                if neg && scaled == 0 {
                    continue; // `-0` is not written
                }
                let v = if neg { -scaled } else { scaled };
                let t = match frac.is_empty() {
                    true => format!("{}{int}", if neg { "-" } else { "" }),
                    false => format!("{}{int}.{frac}", if neg { "-" } else { "" }),
                };
                let want = lo.is_none_or(|(l, i)| if i { v >= l * 10 } else { v > l * 10 })
                    && hi.is_none_or(|(h, i)| if i { v <= h * 10 } else { v < h * 10 });
                proptest::prop_assert_eq!(whole(&g, &t), want, "{} in {}", t, schema);
            }
        }
    }

    /// The JSON string of `s`.
    fn quoted(s: &str) -> String {
        serde_json::to_string(s).unwrap()
    }

    #[test]
    fn patterns() {
        let pat = |p: &str, good: &[&str], bad: &[&str]| {
            let good: Vec<String> = good.iter().map(|s| quoted(s)).collect();
            let bad: Vec<String> = bad.iter().map(|s| quoted(s)).collect();
            let good: Vec<&str> = good.iter().map(String::as_str).collect();
            let bad: Vec<&str> = bad.iter().map(String::as_str).collect();
            check(json!({"type": "string", "pattern": p}), &good, &bad);
        };
        pat(
            r"^\d{3}-\d{4}$",
            &["555-1234"],
            &["555-123", "5551234", "a555-1234", "555-12345"],
        );
        // Unanchored: a match anywhere.
        pat("ab+", &["ab", "xxabbby", "ab\"\\"], &["", "a", "ba", "a b"]);
        pat("^ab", &["ab", "abx"], &["xab"]);
        pat("ab$", &["ab", "xab"], &["abx"]);
        pat("^a|b$", &["a", "ax", "b", "xb"], &["xa", "bx"]);
        pat(
            r"^[A-Z][a-z]*(?: [A-Z][a-z]*)*$",
            &["Ada", "Ada Lovelace"],
            &["ada", "Ada lovelace", "Ada  Lovelace", ""],
        );
        pat(r"^[^a-z]+$", &["A1 ", "\"\\", "é\n"], &["aA", ""]);
        pat(r"^.$", &["a", "\"", "\u{1f600}"], &["\n", "ab", ""]);
        pat(
            r#"^["\\]\t\x41\u00e9\u{1F600}$"#,
            &["\"\tAé😀", "\\\tAé😀"],
            &["\"\t", "x\tAé😀"],
        );
        pat(
            r"^(?<y>\d{4})-(\d\d)?$",
            &["2026-12", "2026-"],
            &["26-12", "2026"],
        );
        pat(r"^(a*)*b$", &["b", "aaab"], &["a", "ba"]);
        pat(r"^(a?|b){2,3}$", &["", "ab", "bbb", "a"], &["bbbb", "c"]);
        pat(r"^x{,2}$", &["x{,2}"], &["xx"]);
        pat(r"^\s\S\w\W\D$", &[" a_!x"], &["aa_!x", " a_ax", " a_!1"]);
        pat(r"^[\d.-]+$", &["1.5-2"], &["1,5"]);
        pat(r"^[-a]+[a-]$", &["-a-"], &["b"]);
        pat(r"^a{2}{$", &["aa{"], &["aa"]);
        // Braces that start no quantifier are literals, read in linear time.
        let braces = "{".repeat(200_000);
        pat(&format!("^{braces}$"), &[&braces], &[&braces[1..]]);
        // Nested groups to the limit, and nullable repetitions a few levels deep.
        pat(
            &format!("^{}a{}$", "(".repeat(200), ")".repeat(200)),
            &["a"],
            &["", "aa"],
        );
        pat(
            r"^(?:a?(?:b?(?:c?)*)*)*$",
            &["", "abc", "cba", "ccbbaa"],
            &["d"],
        );
        // The pattern's characters are written as JSON escapes them.
        let g = state(&json!({"type": "string", "pattern": "^\"\n$"}));
        assert!(whole(&g, r#""\"\n""#));
        for (p, want) in [
            (r"(a", "`(` without `)`"),
            (r"[a", "`[` without `]`"),
            (r"a)", "unexpected `)`"),
            (r"*a", "repeats nothing"),
            (r"a**", "a quantifier after a quantifier"),
            (r"a^b", "only at the start"),
            (r"(a$)", "only at the start"),
            (r"(?=a)", "lookarounds"),
            (r"(a)\1", "backreferences"),
            (r"\bword", "word boundaries"),
            (r"\p{L}", "Unicode property"),
            (r"[^\s\S]", "matches no character"),
            (r"[z-a]", "out of order"),
            (r"a{3,2}", "maximum is below its minimum"),
            (r"a{70000}", "a repetition over"),
            (r"\q", "unknown escape"),
            (r"\ud800", "surrogate"),
            (r"a{4294967296}", "a repetition over"),
            (r"a{1,99999999999}", "a repetition over"),
            (r"\01", "octal escapes"),
            (r"[\1]", r"`\1` in a class"),
            (r"[\B]", r"unknown escape `\B` in a class"),
            (
                &format!("{}a{}", "(".repeat(300), ")".repeat(300)),
                "nested more than 256",
            ),
            (
                &"(?:a?"
                    .repeat(40)
                    .chars()
                    .chain(")*".repeat(40).chars())
                    .collect::<String>(),
                "MiB of grammar",
            ),
        ] {
            let e = to_grammar(&json!({"type": "string", "pattern": p}))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want) && e.contains("at #"), "{p}: {e}");
        }
        let e = to_grammar(&json!({"type": "string", "pattern": "a", "maxLength": 3}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`maxLength` with `pattern`"), "{e}");
    }

    /// Regular expressions over a few characters, as text.
    fn regex_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just("a".to_string()),
            Just("b".to_string()),
            Just("\"".to_string()),
            Just(r"\\".to_string()),
            Just("[ab]".to_string()),
            Just("[^a]".to_string()),
            Just(".".to_string()),
            Just(r"\d".to_string()),
            Just(r"\s".to_string()),
        ];
        let re = leaf.prop_recursive(4, 24, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 1..4).prop_map(|v| v.concat()),
                (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("(?:{a}|{b})")),
                inner.clone().prop_map(|a| format!("({a})*")),
                inner.clone().prop_map(|a| format!("(?:{a})+")),
                inner.clone().prop_map(|a| format!("(?:{a})?")),
                (inner, 0u32..3, 0u32..3).prop_map(|(a, m, n)| format!(
                    "(?:{a}){{{},{}}}",
                    m.min(n),
                    m.max(n)
                )),
            ]
        });
        (any::<bool>(), re, any::<bool>()).prop_map(|(start, re, end)| {
            format!(
                "{}{re}{}",
                if start { "^" } else { "" },
                if end { "$" } else { "" }
            )
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// A pattern's grammar allows exactly the JSON strings whose values the `regex` crate
        /// matches (the same syntax for these patterns, and the same meaning on ASCII).
        #[test]
        fn patterns_match_as_the_regex_crate_does(
            p in regex_text(),
            texts in proptest::collection::vec("[ab\"\\\\1 \n]{0,6}", 24),
        ) {
            let re = regex::Regex::new(&p).unwrap();
            let g = state(&json!({"type": "string", "pattern": p}));
            for t in texts {
                proptest::prop_assert_eq!(whole(&g, &quoted(&t)), re.is_match(&t), "{:?} on {:?}", p, t);
            }
        }
    }

    #[test]
    fn mentions_skips_literals() {
        assert!(mentions(r#""x" space"#, "space"));
        assert!(!mentions(r#""space""#, "space"));
        assert!(!mentions(r#"spaces"#, "space"));
        assert!(mentions(r#""\"" char* "\"" space"#, "char"));
    }
}
