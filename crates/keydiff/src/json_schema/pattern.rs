//! `pattern`: a regular expression (the ECMAScript subset JSON schemas use) as GBNF for the
//! inside of a JSON string.
//!
//! A pattern matches anywhere in the string, as JSON Schema says, unless it is anchored: an
//! alternative at the top level that starts with `^` starts the string, one that ends with
//! `$` ends it; an unanchored side may have any characters there.
//!
//! Compiled: literals, `.`, classes (`[a-z]`, `[^"]`, with `\d \w \s` and their negations
//! inside or out), groups (`(...)`, `(?:...)`, `(?<name>...)`), `|`, and the quantifiers
//! `* + ? {m} {m,} {m,n}` (lazy ones too: the language is the same), and the escapes
//! `\t \n \r \f \v \0 \xHH \uHHHH \u{H...}` and of punctuation. Refused, with the place:
//! backreferences, lookarounds, word boundaries, `\p{...}`, and `^`/`$` anywhere else; groups
//! nested over 256 deep, and patterns that compile to over 4 MiB of grammar (repetitions of
//! what can be empty, nested, double the text per level).
//!
//! The characters are written as JSON writes them: `"` as `\"`, `\` as `\\` and control
//! characters by their escapes, so every text the grammar allows is a JSON string whose value
//! the pattern matches.

use crate::grammar::{MAX_NESTING, MAX_REPEAT};

/// Bytes of GBNF a pattern may compile to: rewriting repetitions of what can be empty
/// (`(a?(b?)*)*`) can double the text per level.
const MAX_SIZE: usize = 1 << 22;

/// A regular expression.
#[derive(Debug, Clone, PartialEq)]
enum Node {
    /// One character of these ranges (inclusive, sorted, disjoint).
    Set(Vec<(u32, u32)>),
    Seq(Vec<Node>),
    Alt(Vec<Node>),
    Repeat(Box<Node>, u32, Option<u32>),
}

/// Every character a JSON string can hold (surrogates are not characters).
const ALL: &[(u32, u32)] = &[(0, 0xd7ff), (0xe000, 0x10ffff)];

/// `\d`, `\w` and `\s` as ECMAScript defines them.
const DIGIT: &[(u32, u32)] = &[(0x30, 0x39)];
const WORD: &[(u32, u32)] = &[(0x30, 0x39), (0x41, 0x5a), (0x5f, 0x5f), (0x61, 0x7a)];
const SPACE: &[(u32, u32)] = &[
    (0x09, 0x0d),
    (0x20, 0x20),
    (0xa0, 0xa0),
    (0x1680, 0x1680),
    (0x2000, 0x200a),
    (0x2028, 0x2029),
    (0x202f, 0x202f),
    (0x205f, 0x205f),
    (0x3000, 0x3000),
    (0xfeff, 0xfeff),
];
/// What `.` does not match: the line terminators.
const LINE_ENDS: &[(u32, u32)] = &[(0x0a, 0x0a), (0x0d, 0x0d), (0x2028, 0x2029)];

/// Sorted, merged ranges.
fn normalize(mut r: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    r.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(r.len());
    for (lo, hi) in r {
        match out.last_mut() {
            Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

/// The characters of [`ALL`] not in `set`.
fn complement(set: &[(u32, u32)]) -> Vec<(u32, u32)> {
    let set = normalize(set.to_vec());
    let mut out = Vec::new();
    for &(lo, hi) in ALL {
        let mut from = lo;
        for &(a, b) in &set {
            if b < from || a > hi {
                continue;
            }
            if a > from {
                out.push((from, a - 1));
            }
            from = b.saturating_add(1);
        }
        if from <= hi {
            out.push((from, hi));
        }
    }
    out
}

/// The pattern `pat` as a GBNF expression for the characters between a JSON string's
/// quotes; `anything` is GBNF for any characters of a JSON string, what an unanchored side
/// allows. Errors name the problem and the character offset.
pub(super) fn to_gbnf(pat: &str, anything: &str) -> Result<String, String> {
    let chars: Vec<char> = pat.chars().collect();
    let mut p = Parser {
        chars,
        pos: 0,
        depth: 0,
    };
    let mut budget = MAX_SIZE;
    let mut alts = Vec::new();
    loop {
        let start = p.eat('^');
        let seq = p.sequence(true)?;
        let end = p.eat('$');
        let open = |anchored: bool| if anchored { "" } else { anything };
        let body = render(&seq, &mut budget)?;
        let parts: Vec<String> = [open(start).to_string(), body, open(end).to_string()]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect();
        alts.push(match parts.is_empty() {
            true => r#""""#.to_string(),
            false => parts.join(" "),
        });
        if !p.eat('|') {
            break;
        }
    }
    if let Some(c) = p.peek() {
        return p.err(format!("unexpected `{c}`"));
    }
    Ok(format!("({})", alts.join(" | ")))
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
    /// Groups open around `pos`.
    depth: usize,
}

impl Parser {
    fn err<T>(&self, what: impl std::fmt::Display) -> Result<T, String> {
        Err(format!("{what} at character {} of the pattern", self.pos))
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        let found = self.peek() == Some(c);
        self.pos += found as usize;
        found
    }

    /// Alternatives, up to `)` or the end.
    fn alternatives(&mut self) -> Result<Node, String> {
        let mut alts = vec![self.sequence(false)?];
        while self.eat('|') {
            alts.push(self.sequence(false)?);
        }
        Ok(match alts.len() {
            1 => alts.pop().expect("one"),
            _ => Node::Alt(alts),
        })
    }

    /// Atoms and their quantifiers up to `|`, `)` or the end; at the top level, also up to
    /// a `$` that ends the alternative.
    fn sequence(&mut self, top: bool) -> Result<Node, String> {
        let mut seq = Vec::new();
        while let Some(c) = self.peek() {
            if c == '|' || c == ')' {
                break;
            }
            if c == '$' && top && matches!(self.chars.get(self.pos + 1), None | Some('|')) {
                break;
            }
            let atom = self.atom()?;
            seq.push(self.quantified(atom)?);
        }
        Ok(Node::Seq(seq))
    }

    fn atom(&mut self) -> Result<Node, String> {
        let c = self.peek().expect("an atom");
        self.pos += 1;
        Ok(match c {
            '(' => {
                if self.eat('?') {
                    if self.eat(':') {
                    } else if self.peek() == Some('<')
                        && !matches!(self.chars.get(self.pos + 1), Some('=' | '!'))
                    {
                        // A named group.
                        while self.peek().is_some_and(|c| c != '>') {
                            self.pos += 1;
                        }
                        if !self.eat('>') {
                            return self.err("a group name without `>`");
                        }
                    } else {
                        return self.err("lookarounds and group flags are not supported");
                    }
                }
                if self.depth >= MAX_NESTING {
                    return self.err(format!("groups nested more than {MAX_NESTING} deep"));
                }
                self.depth += 1;
                let inner = self.alternatives()?;
                self.depth -= 1;
                if !self.eat(')') {
                    return self.err("`(` without `)`");
                }
                inner
            }
            '[' => self.class()?,
            '.' => Node::Set(complement(LINE_ENDS)),
            '\\' => Node::Set(self.escape(false)?),
            '^' | '$' => {
                self.pos -= 1;
                return self.err(format!(
                    "`{c}` is supported only at the start (`^`) or end (`$`) of the pattern \
                     or of one of its top-level alternatives"
                ));
            }
            '*' | '+' | '?' => {
                self.pos -= 1;
                return self.err(format!("`{c}` repeats nothing"));
            }
            '{' => {
                // A literal `{` unless it starts a quantifier.
                self.pos -= 1;
                if self.braces()?.is_some() {
                    return self.err("`{` repeats nothing");
                }
                self.pos += 1;
                Node::Set(vec![(c as u32, c as u32)])
            }
            c => Node::Set(vec![(c as u32, c as u32)]),
        })
    }

    fn quantified(&mut self, atom: Node) -> Result<Node, String> {
        let (min, max) = match self.peek() {
            Some('*') => (0, None),
            Some('+') => (1, None),
            Some('?') => (0, Some(1)),
            Some('{') => match self.braces()? {
                Some(r) => r,
                None => return Ok(atom),
            },
            _ => return Ok(atom),
        };
        self.pos += 1; // the quantifier, or the `}` that ends it
        self.eat('?'); // lazy: the same language
        if matches!(self.peek(), Some('*' | '+' | '?')) {
            return self.err("a quantifier after a quantifier");
        }
        Ok(Node::Repeat(Box::new(atom), min, max))
    }

    /// `{m}`, `{m,}` or `{m,n}` at `pos`, leaving `pos` on the `}`; `None` (nothing read)
    /// when the brace starts no quantifier, which ECMAScript then reads as a literal `{`.
    fn braces(&mut self) -> Result<Option<(u32, Option<u32>)>, String> {
        // Reads digits from `at`: their value (saturated) and where they end.
        let digits = |mut at: usize| -> (Option<u64>, usize) {
            let mut value: Option<u64> = None;
            while let Some(d) = self.chars.get(at).and_then(|c| c.to_digit(10)) {
                value = Some(
                    value
                        .unwrap_or(0)
                        .saturating_mul(10)
                        .saturating_add(d as u64),
                );
                at += 1;
            }
            (value, at)
        };
        let (Some(min), at) = digits(self.pos + 1) else {
            return Ok(None);
        };
        let (max, end) = match self.chars.get(at) {
            Some('}') => (Some(min), at),
            Some(',') => match digits(at + 1) {
                (max, end) if self.chars.get(end) == Some(&'}') => (max, end),
                _ => return Ok(None),
            },
            _ => return Ok(None),
        };
        let limit = MAX_REPEAT as u64;
        if min > limit || max.is_some_and(|m| m > limit) {
            return self.err(format!("a repetition over {MAX_REPEAT}"));
        }
        if max.is_some_and(|m| m < min) {
            return self.err("a repetition whose maximum is below its minimum");
        }
        self.pos = end;
        Ok(Some((min as u32, max.map(|m| m as u32))))
    }

    /// A class, after its `[`.
    fn class(&mut self) -> Result<Node, String> {
        let negated = self.eat('^');
        let mut set = Vec::new();
        loop {
            let Some(c) = self.peek() else {
                return self.err("`[` without `]`");
            };
            self.pos += 1;
            if c == ']' {
                break;
            }
            let lo = match c {
                '\\' => {
                    let e = self.escape(true)?;
                    if e.len() != 1 || e[0].0 != e[0].1 {
                        // A class escape (`\d`...): no range from it.
                        set.extend(e);
                        continue;
                    }
                    e[0].0
                }
                c => c as u32,
            };
            if self.peek() == Some('-') && self.chars.get(self.pos + 1).is_some_and(|&c| c != ']') {
                self.pos += 1;
                let hi = match self.peek() {
                    Some('\\') => {
                        self.pos += 1;
                        let e = self.escape(true)?;
                        if e.len() != 1 || e[0].0 != e[0].1 {
                            return self.err("a range ending in a class escape");
                        }
                        e[0].0
                    }
                    Some(c) => {
                        self.pos += 1;
                        c as u32
                    }
                    None => return self.err("`[` without `]`"),
                };
                if hi < lo {
                    return self.err("a range out of order");
                }
                set.push((lo, hi));
            } else {
                set.push((lo, lo));
            }
        }
        let set = normalize(set);
        let set = if negated { complement(&set) } else { set };
        if set.is_empty() {
            return self.err("a class that matches no character");
        }
        Ok(Node::Set(set))
    }

    /// An escape, after its `\`: the characters it stands for.
    fn escape(&mut self, in_class: bool) -> Result<Vec<(u32, u32)>, String> {
        let Some(c) = self.peek() else {
            return self.err("a pattern ending in `\\`");
        };
        self.pos += 1;
        let one = |c: u32| Ok(vec![(c, c)]);
        match c {
            'd' => Ok(DIGIT.to_vec()),
            'D' => Ok(complement(DIGIT)),
            'w' => Ok(WORD.to_vec()),
            'W' => Ok(complement(WORD)),
            's' => Ok(SPACE.to_vec()),
            'S' => Ok(complement(SPACE)),
            't' => one(0x09),
            'n' => one(0x0a),
            'v' => one(0x0b),
            'f' => one(0x0c),
            'r' => one(0x0d),
            '0' if !self.peek().is_some_and(|c| c.is_ascii_digit()) => one(0),
            'b' if in_class => one(0x08),
            'x' => self.hex(2).and_then(one),
            'u' if self.eat('{') => {
                let start = self.pos;
                while self.peek().is_some_and(|c| c.is_ascii_hexdigit()) {
                    self.pos += 1;
                }
                let digits: String = self.chars[start..self.pos].iter().collect();
                match (self.eat('}'), u32::from_str_radix(&digits, 16)) {
                    (true, Ok(c)) if char::from_u32(c).is_some() => one(c),
                    _ => self.err("`\\u{...}` must be a character's code point"),
                }
            }
            'u' => {
                let c = self.hex(4)?;
                if (0xd800..=0xdfff).contains(&c) {
                    return self.err("a surrogate escape (`\\uD800`...) is not supported");
                }
                one(c)
            }
            '0'..='9' if in_class => self.err(format!("`\\{c}` in a class is not supported")),
            '0' => self.err("octal escapes are not supported"),
            'B' | 'k' if in_class => self.err(format!("unknown escape `\\{c}` in a class")),
            'b' | 'B' => self.err("word boundaries (`\\b`, `\\B`) are not supported"),
            '1'..='9' | 'k' => self.err("backreferences are not supported"),
            'p' | 'P' => self.err("Unicode property escapes (`\\p{...}`) are not supported"),
            'c' => self.err("control escapes (`\\cX`) are not supported"),
            c if c.is_ascii_alphanumeric() => self.err(format!("unknown escape `\\{c}`")),
            c => one(c as u32),
        }
    }

    fn hex(&mut self, n: usize) -> Result<u32, String> {
        let digits: String = self.chars.iter().skip(self.pos).take(n).collect();
        if digits.len() != n || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
            return self.err(format!("an escape needs {n} hex digits"));
        }
        self.pos += n;
        Ok(u32::from_str_radix(&digits, 16).expect("hex digits"))
    }
}

/// GBNF for `node`, as the characters of a JSON string; `budget` is the bytes it may still
/// write (and nodes it may still copy).
fn render(node: &Node, budget: &mut usize) -> Result<String, String> {
    let out = match node {
        Node::Set(set) => render_set(set),
        Node::Seq(items) => {
            let mut parts = Vec::new();
            // Single characters in a row, as JSON writes them: one literal.
            let mut run = String::new();
            for n in items {
                if let Node::Set(set) = n {
                    if let [(lo, hi)] = set[..] {
                        if lo == hi {
                            run += &json_text(lo);
                            continue;
                        }
                    }
                }
                if !run.is_empty() {
                    parts.push(super::literal(&std::mem::take(&mut run)));
                }
                let s = render(n, budget)?;
                if !s.is_empty() {
                    parts.push(match n {
                        Node::Alt(_) => format!("({s})"),
                        _ => s,
                    });
                }
            }
            if !run.is_empty() {
                parts.push(super::literal(&run));
            }
            parts.join(" ")
        }
        Node::Alt(alts) => {
            let mut parts = Vec::new();
            for n in alts {
                parts.push(match render(n, budget)? {
                    s if s.is_empty() => r#""""#.to_string(),
                    s => s,
                });
            }
            parts.join(" | ")
        }
        Node::Repeat(_, _, Some(0)) => String::new(),
        Node::Repeat(inner, min, max) => {
            // GBNF (as llama.cpp's) refuses to repeat what can be empty: with `X` empty,
            // `X{m,n}` is `X'{0,n}` for `X'` the non-empty texts of `X`.
            let (inner, min) = match nullable(inner) {
                false => (inner.as_ref().clone(), *min),
                true => match non_empty(inner, budget)? {
                    Some(x) => (x, 0),
                    None => return Ok(String::new()),
                },
            };
            let body = match render(&inner, budget)? {
                s if s.is_empty() => return Ok(String::new()),
                s => s,
            };
            let q = match (min, *max) {
                (0, None) => "*".to_string(),
                (1, None) => "+".to_string(),
                (0, Some(1)) => "?".to_string(),
                (m, None) => format!("{{{m},}}"),
                (m, Some(n)) if m == n => format!("{{{m}}}"),
                (m, Some(n)) => format!("{{{m},{n}}}"),
            };
            format!("({body}){q}")
        }
    };
    spend(budget, out.len())?;
    Ok(out)
}

fn spend(budget: &mut usize, n: usize) -> Result<(), String> {
    *budget = budget.checked_sub(n).ok_or_else(|| {
        format!(
            "the pattern compiles to over {} MiB of grammar (repetitions of what can be empty, \
             nested)",
            MAX_SIZE >> 20
        )
    })?;
    Ok(())
}

/// Whether `n` matches the empty text.
fn nullable(n: &Node) -> bool {
    match n {
        Node::Set(_) => false,
        Node::Seq(items) => items.iter().all(nullable),
        Node::Alt(alts) => alts.iter().any(nullable),
        Node::Repeat(x, min, _) => *min == 0 || nullable(x),
    }
}

/// The non-empty texts of `n`, or `None` when it has none; each node copied spends one of
/// `budget`.
fn non_empty(n: &Node, budget: &mut usize) -> Result<Option<Node>, String> {
    let one_of = |mut alts: Vec<Node>| match alts.len() {
        0 => None,
        1 => alts.pop(),
        _ => Some(Node::Alt(alts)),
    };
    spend(budget, 1)?;
    Ok(match n {
        Node::Set(_) => Some(n.clone()),
        Node::Alt(alts) => {
            let mut out = Vec::new();
            for a in alts {
                out.extend(non_empty(a, budget)?);
            }
            one_of(out)
        }
        // The first item with a non-empty text, those before it empty, the rest anything.
        Node::Seq(items) => {
            let mut alts = Vec::new();
            for (i, item) in items.iter().enumerate() {
                if let Some(first) = non_empty(item, budget)? {
                    spend(budget, items.len() - i)?;
                    alts.push(Node::Seq(
                        [first]
                            .into_iter()
                            .chain(items[i + 1..].iter().cloned())
                            .collect(),
                    ));
                }
                if !nullable(item) {
                    break;
                }
            }
            one_of(alts)
        }
        Node::Repeat(_, _, Some(0)) => None,
        Node::Repeat(x, min, max) => match nullable(x) {
            true => non_empty(x, budget)?.map(|x| Node::Repeat(Box::new(x), 1, *max)),
            false => Some(Node::Repeat(x.clone(), (*min).max(1), *max)),
        },
    })
}

/// GBNF for one character of `set`, written as JSON writes it in a string.
fn render_set(set: &[(u32, u32)]) -> String {
    // Characters a JSON string holds only escaped.
    const ESCAPED: &[(u32, u32)] = &[(0, 0x1f), (0x22, 0x22), (0x5c, 0x5c)];
    let raw = normalize(
        set.iter()
            .flat_map(|&r| subtract(r, ESCAPED))
            .collect::<Vec<_>>(),
    );
    let mut alts = Vec::new();
    if let [(lo, hi)] = raw[..] {
        if lo == hi {
            alts.push(super::literal(
                &char::from_u32(lo).expect("a char").to_string(),
            ));
        }
    }
    if alts.is_empty() && !raw.is_empty() {
        let body: String = raw
            .iter()
            .map(|&(lo, hi)| match lo == hi {
                true => class_char(lo),
                false => format!("{}-{}", class_char(lo), class_char(hi)),
            })
            .collect();
        alts.push(format!("[{body}]"));
    }
    for &(lo, hi) in set {
        for &(a, b) in ESCAPED {
            for c in lo.max(a)..=hi.min(b) {
                alts.push(super::literal(&json_text(c)));
            }
        }
    }
    match alts.len() {
        0 => unreachable!("empty classes are refused when parsed"),
        1 => alts.pop().expect("one"),
        _ => format!("({})", alts.join(" | ")),
    }
}

/// Character `c` as JSON writes it inside a string.
fn json_text(c: u32) -> String {
    let json = serde_json::to_string(&char::from_u32(c).expect("a char")).expect("a string");
    json[1..json.len() - 1].to_string()
}

/// The parts of `r` outside `cut`.
fn subtract(r: (u32, u32), cut: &[(u32, u32)]) -> Vec<(u32, u32)> {
    let mut out = vec![r];
    for &(a, b) in cut {
        out = out
            .into_iter()
            .flat_map(|(lo, hi)| {
                let mut v = Vec::new();
                if lo < a {
                    v.push((lo, hi.min(a - 1)));
                }
                if hi > b {
                    v.push((lo.max(b + 1), hi));
                }
                if b < lo || a > hi {
                    v = vec![(lo, hi)];
                }
                v
            })
            .collect();
    }
    out
}

/// `c` in a GBNF class.
pub(super) fn class_char(c: u32) -> String {
    match c {
        c if c < 0x80 && (c as u8).is_ascii_alphanumeric() => (c as u8 as char).to_string(),
        c if c <= 0xff => format!("\\x{c:02X}"),
        c if c <= 0xffff => format!("\\u{c:04X}"),
        c => format!("\\U{c:08X}"),
    }
}
