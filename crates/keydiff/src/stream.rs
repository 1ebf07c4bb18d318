//! Incremental detokenization with stop strings.
//!
//! Byte-level BPE tokens can end inside a UTF-8 character, and a stop string can span tokens, so
//! text is released only when it is complete and cannot be the start of a stop string.

use tokenizers::Tokenizer;

use crate::error::{EngineError, Result};

/// Turns generated token ids into text pieces as they arrive.
#[derive(Clone)]
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    /// All text decoded so far (complete characters only).
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    stops: Vec<String>,
    /// End at a line less indented than this ([`TextStream::stop_below_indent`]).
    indent: Option<usize>,
    stopped: Option<Stopped>,
}

/// What ended a [`TextStream`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// A stop string.
    String,
    /// A line below the indentation ([`TextStream::stop_below_indent`]).
    Indent,
}

impl<'a> TextStream<'a> {
    /// A stream that ends at the first occurrence of any of `stops`.
    pub fn new(tokenizer: &'a Tokenizer, stops: Vec<String>) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            text: String::new(),
            emitted: 0,
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            indent: None,
            stopped: None,
        }
    }

    /// Also ends the text where a line after its first starts with fewer than `n` spaces or
    /// tabs, cut before that line's first other character, a line break included (llama.cpp's
    /// `n_indent`: a code completion ends with its block). 0 never ends it.
    pub fn stop_below_indent(mut self, n: usize) -> Self {
        self.indent = (n > 0).then_some(n);
        self
    }

    /// Adds a token; returns the text that is now safe to show (possibly empty).
    pub fn push(&mut self, token: u32) -> Result<String> {
        if self.stopped.is_some() {
            return Ok(String::new());
        }
        self.tokens.push(token);
        let decoded = self
            .tokenizer
            .decode(&self.tokens, true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        // An incomplete UTF-8 sequence decodes to U+FFFD: wait for the next token.
        if decoded.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        self.text = decoded;
        if self.cut() {
            return Ok(self.take(self.text.len()));
        }
        // Hold back a tail that could begin a stop string.
        let hold = self
            .stops
            .iter()
            .map(|s| longest_prefix_suffix(&self.text, s))
            .max()
            .unwrap_or(0);
        Ok(self.take(self.text.len() - hold))
    }

    /// Ends the text at the first stop string or line below the indentation in it; true
    /// when one was there.
    fn cut(&mut self) -> bool {
        let string = (self.stops.iter())
            .filter_map(|s| self.text.find(s.as_str()))
            .min()
            .map(|at| (at, Stopped::String));
        let indent = (self.indent)
            .and_then(|n| below_indent(&self.text, n))
            .map(|at| (at, Stopped::Indent));
        let Some((at, why)) = string.into_iter().chain(indent).min_by_key(|c| c.0) else {
            return false;
        };
        self.text.truncate(at);
        self.stopped = Some(why);
        true
    }

    /// Flushes what was held back at the end of generation (a character cut short decoded as
    /// it is), cut as [`TextStream::push`] cuts.
    pub fn finish(&mut self) -> String {
        if let Ok(rest) = self.tokenizer.decode(&self.tokens, true) {
            if self.stopped.is_none() && rest.len() >= self.text.len() {
                self.text = rest;
                self.cut();
            }
        }
        self.take(self.text.len())
    }

    /// True once a stop string or a line below the indentation was seen.
    pub fn stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// What ended the text, if anything did.
    pub fn stopped_by(&self) -> Option<Stopped> {
        self.stopped
    }

    /// Everything produced so far, stop string excluded.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn take(&mut self, upto: usize) -> String {
        if upto <= self.emitted || !self.text.is_char_boundary(upto) {
            return String::new();
        }
        let s = self.text[self.emitted..upto].to_string();
        self.emitted = upto;
        s
    }
}

/// Where `text` ends by llama.cpp's `n_indent` rule: on a line after the first, the first
/// character other than a space or a tab (a line break too: an empty line ends it) where the
/// indentation before it is below `n`.
pub fn below_indent(text: &str, n: usize) -> Option<usize> {
    let mut at = text.find('\n')? + 1;
    loop {
        let line = &text[at..];
        let indent = line
            .bytes()
            .take_while(|b| *b == b' ' || *b == b'\t')
            .count();
        match line.as_bytes().get(indent) {
            None => return None,
            Some(_) if indent < n => return Some(at + indent),
            Some(_) => {}
        }
        at += line.find('\n')? + 1;
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn longest_prefix_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&n| n <= text.len() && stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indentation_ends_a_block() {
        let code = "x + 1\n    return y\n    z = 2\nprint(z)\n";
        assert_eq!(below_indent(code, 4), Some(code.find("print").unwrap()));
        assert_eq!(below_indent(code, 2), Some(code.find("print").unwrap()));
        assert_eq!(below_indent(code, 5), Some(code.find("return").unwrap()));
        // The first line is never cut; an empty line ends the block, as in llama.cpp.
        assert_eq!(below_indent("print(1)\n    a", 4), None);
        assert_eq!(below_indent("a\n\n    b\n", 4), Some(2));
        assert_eq!(below_indent("a\n  \n", 4), Some(4));
        assert_eq!(below_indent("a\r\n\r\n", 4), Some(3));
        assert_eq!(below_indent("a\n    b\n    \n", 4), None, "still indented");
        assert_eq!(below_indent("a\n\t\tb", 2), None);
        assert_eq!(below_indent("a\n  ", 4), None, "the line has not started");
        assert_eq!(below_indent("no newline", 4), None);
    }

    #[test]
    fn prefix_suffix() {
        assert_eq!(longest_prefix_suffix("hello wo", "world"), 2);
        assert_eq!(longest_prefix_suffix("hello", "world"), 0);
        assert_eq!(longest_prefix_suffix("abc", "c"), 0);
    }
}
