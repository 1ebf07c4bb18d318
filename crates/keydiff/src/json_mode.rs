//! JSON mode: generation constrained to one JSON object (OpenAI's `response_format: {"type":
//! "json_object"}`, llama.cpp's `json.gbnf`, Ollama's `format: "json"`).
//!
//! [`JsonObject`] is an incremental checker over bytes: it accepts exactly the prefixes of a
//! JSON object (RFC 8259) and says when one is complete. Before each token is sampled,
//! [`JsonObject::mask`] sets the logits of every token that cannot come next to −∞: tokens
//! whose bytes would leave no JSON object, tokens with no text (special tokens), and the
//! end-of-generation tokens until the object is complete; after it, only those. The sampler
//! then draws from what is left, as from any other distribution (so the chosen token's
//! distribution is the model's, renormalised over the allowed tokens).
//!
//! Whitespace between tokens is limited to [`MAX_WHITESPACE`] bytes in a row (a small model
//! can otherwise fill its output with newlines, which JSON allows), and nesting to
//! [`MAX_DEPTH`] levels. Strings are checked for JSON's escapes and control characters, and
//! their other bytes for UTF-8 (RFC 3629): no overlong forms, surrogates or code points past
//! U+10FFFF. A token may end inside a character; the next bytes must finish it.

/// Whitespace bytes allowed in a row between the tokens of the object.
pub const MAX_WHITESPACE: u8 = 32;

/// Objects and arrays nested at most.
pub const MAX_DEPTH: u8 = 128;

/// Where the checker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the object.
    Start,
    /// A value must come (after `:`, or `,` in an array).
    Value,
    /// After `[`: a value or `]`.
    ArrayFirst,
    /// After `{`: a key or `}`.
    ObjectFirst,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value: `,` or the end of its container.
    After,
    /// In a string (an object's key when `key`).
    Str {
        key: bool,
        esc: Esc,
    },
    /// In `true`, `false` or `null` (`WORDS[word]`), `at` bytes read.
    Word {
        word: u8,
        at: u8,
    },
    Num(Num),
    /// The object is complete: nothing may follow.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Esc {
    No,
    /// After a backslash.
    Slash,
    /// Hex digits of a `\u` escape still to come.
    Hex(u8),
    /// Inside a UTF-8 character: the next byte lies in `lo..=hi`, and `more` continuation
    /// bytes (`80..=BF`) follow it.
    Utf8 {
        lo: u8,
        hi: u8,
        more: u8,
    },
}

/// Where a number is: after `-`, a leading `0`, integer digits, `.`, fraction digits, `e`,
/// the exponent's sign, exponent digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

const WORDS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// An incremental JSON object checker (see the module docs). It is `Copy`, so that trying a
/// token's bytes on a copy costs no allocation: the containers it is in are bits of a `u128`
/// (1 for an array).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsonObject {
    state: State,
    arrays: u128,
    depth: u8,
    whitespace: u8,
}

impl Default for JsonObject {
    fn default() -> Self {
        Self::new()
    }
}

impl JsonObject {
    /// Nothing read yet.
    pub fn new() -> Self {
        Self {
            state: State::Start,
            arrays: 0,
            depth: 0,
            whitespace: 0,
        }
    }

    /// True once the bytes read are a whole JSON object.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Reads `bytes`; false when no JSON object starts with what has been read (the checker is
    /// then in no meaningful state).
    pub fn push_all(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.push(b))
    }

    /// Reads one byte; false when no JSON object starts with what has been read.
    pub fn push(&mut self, b: u8) -> bool {
        match self.state {
            State::Str { key, esc } => return self.string(b, key, esc),
            State::Word { word, at } => {
                let w = WORDS[word as usize];
                if w[at as usize] != b {
                    return false;
                }
                self.state = if at as usize + 1 == w.len() {
                    State::After
                } else {
                    State::Word { word, at: at + 1 }
                };
                return true;
            }
            State::Num(n) => match number(n, b) {
                Some(next) => {
                    self.state = State::Num(next);
                    return true;
                }
                // The number ends here; `b` is read after it.
                None if matches!(n, Num::Zero | Num::Int | Num::Frac | Num::Exp) => {
                    self.state = State::After;
                }
                None => return false,
            },
            _ => {}
        }
        if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            self.whitespace += 1;
            return self.state != State::Done && self.whitespace <= MAX_WHITESPACE;
        }
        self.whitespace = 0;
        match (self.state, b) {
            (State::Start, b'{') => self.open(false),
            (State::ArrayFirst, b']') => self.close(true),
            (State::Value | State::ArrayFirst, _) => self.value(b),
            (State::ObjectFirst, b'}') => self.close(false),
            (State::ObjectFirst | State::Key, b'"') => {
                self.state = State::Str {
                    key: true,
                    esc: Esc::No,
                };
                true
            }
            (State::Colon, b':') => {
                self.state = State::Value;
                true
            }
            (State::After, b',') if self.depth > 0 => {
                self.state = if self.in_array() {
                    State::Value
                } else {
                    State::Key
                };
                true
            }
            (State::After, b'}') if self.depth > 0 && !self.in_array() => self.close(false),
            (State::After, b']') if self.depth > 0 && self.in_array() => self.close(true),
            _ => false,
        }
    }

    /// The first byte of a value.
    fn value(&mut self, b: u8) -> bool {
        self.state = match b {
            b'{' => return self.open(false),
            b'[' => return self.open(true),
            b'"' => State::Str {
                key: false,
                esc: Esc::No,
            },
            b't' => State::Word { word: 0, at: 1 },
            b'f' => State::Word { word: 1, at: 1 },
            b'n' => State::Word { word: 2, at: 1 },
            b'-' => State::Num(Num::Minus),
            b'0' => State::Num(Num::Zero),
            b'1'..=b'9' => State::Num(Num::Int),
            _ => return false,
        };
        true
    }

    fn in_array(&self) -> bool {
        self.arrays >> (self.depth - 1) & 1 == 1
    }

    fn open(&mut self, array: bool) -> bool {
        if self.depth >= MAX_DEPTH {
            return false;
        }
        let bit = 1u128 << self.depth;
        self.arrays = if array {
            self.arrays | bit
        } else {
            self.arrays & !bit
        };
        self.depth += 1;
        self.state = if array {
            State::ArrayFirst
        } else {
            State::ObjectFirst
        };
        true
    }

    fn close(&mut self, array: bool) -> bool {
        debug_assert!(self.depth > 0 && self.in_array() == array);
        self.depth -= 1;
        self.state = if self.depth == 0 {
            State::Done
        } else {
            State::After
        };
        true
    }

    fn string(&mut self, b: u8, key: bool, esc: Esc) -> bool {
        let esc = match (esc, b) {
            (Esc::No, b'"') => {
                self.state = if key { State::Colon } else { State::After };
                return true;
            }
            (Esc::No, b'\\') => Esc::Slash,
            (Esc::No, 0..=0x1f) => return false,
            (Esc::No, 0..=0x7f) => Esc::No,
            // The first byte of a character of 2 to 4 bytes: what its second byte may be.
            (Esc::No, 0xc2..=0xdf) => utf8(0x80, 0xbf, 0),
            (Esc::No, 0xe0) => utf8(0xa0, 0xbf, 1),
            (Esc::No, 0xed) => utf8(0x80, 0x9f, 1),
            (Esc::No, 0xe1..=0xef) => utf8(0x80, 0xbf, 1),
            (Esc::No, 0xf0) => utf8(0x90, 0xbf, 2),
            (Esc::No, 0xf1..=0xf3) => utf8(0x80, 0xbf, 2),
            (Esc::No, 0xf4) => utf8(0x80, 0x8f, 2),
            (Esc::Utf8 { lo, hi, more }, _) if (lo..=hi).contains(&b) => match more {
                0 => Esc::No,
                more => utf8(0x80, 0xbf, more - 1),
            },
            (Esc::Slash, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Esc::No,
            (Esc::Slash, b'u') => Esc::Hex(4),
            (Esc::Hex(n), _) if b.is_ascii_hexdigit() => match n {
                1 => Esc::No,
                n => Esc::Hex(n - 1),
            },
            _ => return false,
        };
        self.state = State::Str { key, esc };
        true
    }

    /// Sets to −∞ the logits of the tokens that cannot come next (see the module docs):
    /// `tokens[id]` is token `id`'s bytes (empty for a token with no text), `eos` the
    /// end-of-generation tokens. Returns how many tokens are left.
    pub fn mask(&self, logits: &mut [f32], tokens: &[Box<[u8]>], eos: &[u32]) -> usize {
        // The bytes that can come next: most tokens fail on their first.
        let first: [bool; 256] = std::array::from_fn(|b| self.clone().push(b as u8));
        let done = self.is_done();
        let mut left = 0;
        for (id, l) in logits.iter_mut().enumerate() {
            let ok = if eos.contains(&(id as u32)) {
                done
            } else {
                match tokens.get(id) {
                    Some(t) if !done && !t.is_empty() && first[t[0] as usize] => {
                        self.clone().push_all(t)
                    }
                    _ => false,
                }
            };
            if ok {
                left += 1;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        left
    }
}

fn utf8(lo: u8, hi: u8, more: u8) -> Esc {
    Esc::Utf8 { lo, hi, more }
}

/// The number state after `b`, or `None` when `b` cannot continue the number.
fn number(n: Num, b: u8) -> Option<Num> {
    let digit = b.is_ascii_digit();
    Some(match (n, b) {
        (Num::Minus, b'0') => Num::Zero,
        (Num::Minus, _) if digit => Num::Int,
        (Num::Int, _) if digit => Num::Int,
        (Num::Zero | Num::Int, b'.') => Num::Dot,
        (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::E,
        (Num::Dot | Num::Frac, _) if digit => Num::Frac,
        (Num::E, b'+' | b'-') => Num::ESign,
        (Num::E | Num::ESign | Num::Exp, _) if digit => Num::Exp,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn accepts(s: &str) -> Option<bool> {
        let mut j = JsonObject::new();
        j.push_all(s.as_bytes()).then(|| j.is_done())
    }

    #[test]
    fn whole_objects_are_accepted_and_done() {
        for s in [
            "{}",
            " {\"a\": 1}",
            "{\"a\":[1,-2.5e+3,0,0.25,1E5,true,false,null,\"x\\n\\u00e9\\\"\",{},[]]}",
            "{\n  \"k\": {\"nested\": [[], [{}]]},\n  \"\u{e9}t\u{e9}\": \"caf\u{e9} \u{1f600}\"\n}",
        ] {
            assert_eq!(accepts(s), Some(true), "{s}");
        }
    }

    #[test]
    fn prefixes_are_accepted_but_not_done() {
        let s = "{\"a\": [1, 2.5, \"x\"], \"b\": {\"c\": null}}";
        for i in 0..s.len() {
            assert_eq!(accepts(&s[..i]), Some(false), "{:?}", &s[..i]);
        }
    }

    #[test]
    fn what_no_object_starts_with_is_refused() {
        for s in [
            "[1]",
            "1",
            "\"x\"",
            "{a:1}",
            "{\"a\" 1}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":-}",
            "{\"a\":.5}",
            "{\"a\":1,}",
            "{\"a\":[1,]}",
            "{\"a\":[1}",
            "{\"a\":tru}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12g4\"}",
            "{\"a\":\"tab\there\"}",
            "{} ",
            "{}{}",
            "{,}",
            "{\"a\":1 2}",
        ] {
            assert_eq!(accepts(s), None, "{s:?}");
        }
    }

    #[test]
    fn strings_are_utf8() {
        let read = |bytes: &[u8]| {
            let mut j = JsonObject::new();
            j.push_all(b"{\"a\":\"") && j.push_all(bytes)
        };
        // One character of each length, and the edges of the ranges.
        for ok in [
            "é", "€", "😀", "\u{7f}", "\u{80}", "\u{7ff}", "\u{800}", "\u{d7ff}",
        ] {
            assert!(read(ok.as_bytes()), "{ok:?}");
        }
        for ok in ["\u{e000}", "\u{ffff}", "\u{10000}", "\u{10ffff}"] {
            assert!(read(ok.as_bytes()), "{ok:?}");
        }
        // A character split over tokens is read byte by byte.
        assert!(read(&"😀".as_bytes()[..2]));
        for bad in [
            &[0x80][..],               // a continuation byte alone
            &[0xc3, 0x41],             // a character cut short
            &[0xc3, 0x22],             // ... by the closing quote
            &[0xc0, 0xaf],             // overlong `/`
            &[0xc1, 0xbf],             // overlong
            &[0xe0, 0x80, 0xaf],       // overlong
            &[0xf0, 0x8f, 0xbf],       // overlong
            &[0xed, 0xa0, 0x80],       // the surrogate U+D800
            &[0xf4, 0x90, 0x80],       // past U+10FFFF
            &[0xf5],                   // no such first byte
            &[0xff],                   // ...
            &[0xe2, 0x82, 0xac, 0x82], // a continuation byte after a whole character
        ] {
            assert!(!read(bad), "{bad:x?}");
        }
        // Keys too.
        let mut j = JsonObject::new();
        assert!(!j.push_all(b"{\"\xff"));
        assert_eq!(accepts("{\"\u{e9}\": \"\u{1f600}\"}"), Some(true));
    }

    #[test]
    fn whitespace_and_depth_are_limited() {
        let ws = " ".repeat(MAX_WHITESPACE as usize);
        assert_eq!(accepts(&format!("{{{ws}}}")), Some(true));
        assert_eq!(accepts(&format!("{{{ws} }}")), None);
        // Whitespace inside strings is text, not limited.
        let long = format!("{{\"a\": \"{}\"}}", " ".repeat(100));
        assert_eq!(accepts(&long), Some(true));
        let deep = MAX_DEPTH as usize - 1;
        let ok = format!("{{\"a\":{}{}}}", "[".repeat(deep), "]".repeat(deep));
        assert_eq!(accepts(&ok), Some(true));
        let too = format!("{{\"a\":{}", "[".repeat(deep + 1));
        assert_eq!(accepts(&too), None);
    }

    #[test]
    fn mask_keeps_what_can_come_next() {
        let tokens: Vec<Box<[u8]>> = ["{", "}", "\"a", "\":", " 1", "1}", "x", "", "} "]
            .iter()
            .map(|t| t.as_bytes().into())
            .collect();
        let eos = [9u32];
        let allowed = |j: &JsonObject| {
            let mut l = vec![0.0f32; 10];
            let left = j.mask(&mut l, &tokens, &eos);
            let ids: Vec<usize> = (0..10).filter(|&i| l[i] == 0.0).collect();
            assert_eq!(ids.len(), left);
            ids
        };
        let mut j = JsonObject::new();
        assert_eq!(allowed(&j), [0]);
        assert!(j.push_all(b"{"));
        // `":` starts a key; `} ` would put whitespace after the whole object.
        assert_eq!(allowed(&j), [1, 2, 3]);
        assert!(j.push_all(b"\"a\":"));
        assert_eq!(allowed(&j), [0, 2, 3, 4, 5]);
        assert!(j.push_all(b"1"));
        assert_eq!(allowed(&j), [1, 5]);
        assert!(j.push_all(b"}"));
        assert_eq!(allowed(&j), [9], "only the end once the object is whole");
    }

    /// JSON values as text, nested, with every kind of scalar.
    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            (-1e12f64..1e12).prop_map(Value::from),
            "\\PC{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map("\\PC{0,8}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Every object serde_json writes (compact and pretty) is accepted byte by byte, and
        /// done only at its end.
        #[test]
        fn serde_objects_are_accepted(v in json_value(), key in "\\PC{0,6}") {
            let obj = serde_json::json!({ key: v });
            for s in [obj.to_string(), serde_json::to_string_pretty(&obj).unwrap()] {
                let mut j = JsonObject::new();
                for (i, &b) in s.as_bytes().iter().enumerate() {
                    prop_assert!(!j.is_done(), "done before byte {} of {}", i, s);
                    prop_assert!(j.push(b), "byte {} of {} refused", i, s);
                }
                prop_assert!(j.is_done(), "{}", s);
            }
        }

        /// The checker and serde_json agree on which strings of JSON's characters are whole
        /// objects.
        #[test]
        fn what_is_accepted_parses(s in "\\{[{}\\[\\],:\" 0-9.eE+\\-tfnrulsa\\\\]{0,30}\\}") {
            if accepts(&s) == Some(true) {
                let v: serde_json::Value = serde_json::from_str(&s)
                    .map_err(|e| TestCaseError::fail(format!("{s:?}: {e}")))?;
                prop_assert!(v.is_object(), "{}", s);
            }
            if let Ok(serde_json::Value::Object(_)) = serde_json::from_str(&s) {
                prop_assert_eq!(accepts(&s), Some(true), "{}", s);
            }
        }
    }
}
