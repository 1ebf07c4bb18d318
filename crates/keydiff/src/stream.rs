//! Incremental detokenization with stop strings.
//!
//! Byte-level BPE tokens can end inside a UTF-8 character, and a stop string can span tokens, so
//! text is released only when it is complete and cannot be the start of a stop string.
//!
//! Each token costs the same however long the output is: only a window of the last tokens is
//! decoded (as vLLM's and TGI's incremental detokenizers do: the window starts one step back,
//! so that a decoder's rules for a first token, such as SentencePiece's leading space, apply
//! to tokens already decoded and the new text is what the window's decoding adds), and the
//! stops are looked for only in the new text and the stop length before it.

use tokenizers::Tokenizer;

use crate::error::{EngineError, Result};

/// Turns generated token ids into text pieces as they arrive.
#[derive(Clone)]
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    /// The window: `tokens[prefix..]` is decoded on each token; `tokens[prefix..read]`, whose
    /// text (`prefix_text`) is in `text` already, gives the decoder its context.
    prefix: usize,
    read: usize,
    prefix_text: String,
    /// `text`'s length before the text of `tokens[read..]`: what a token's decoding rewrites.
    base: usize,
    /// All text decoded so far (complete characters only).
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    stops: Vec<String>,
    /// Bytes of `text` already looked through for a stop: a stop can start at most its length
    /// less one byte before it.
    searched: usize,
    /// End at a line less indented than this ([`TextStream::stop_below_indent`]).
    indent: Option<usize>,
    /// Where [`below_indent_from`] starts next: a line after the first not yet decided.
    indent_from: Option<usize>,
    stopped: Option<Stopped>,
    /// Which of `stops` ended the text.
    stop_index: Option<usize>,
    /// Tokens pushed, and how many must be before the stops apply ([`TextStream::min_tokens`]).
    pushed: usize,
    min_tokens: usize,
    /// Bytes of `text` made before the stops applied: never looked through again, not even
    /// when a decoder's rewrite makes the stream decode everything anew.
    floor: usize,
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
            prefix: 0,
            read: 0,
            prefix_text: String::new(),
            base: 0,
            text: String::new(),
            emitted: 0,
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            searched: 0,
            indent: None,
            indent_from: None,
            stopped: None,
            stop_index: None,
            pushed: 0,
            min_tokens: 0,
            floor: 0,
        }
    }

    /// The stops (strings and the indentation) apply only once `n` tokens were pushed: the
    /// text of the first `n − 1` is never looked through for them (vLLM's `min_tokens`, whose
    /// stop checks begin at the `n`-th token).
    pub fn min_tokens(mut self, n: usize) -> Self {
        self.min_tokens = n;
        self
    }

    /// Also ends the text where a line after its first starts with fewer than `n` spaces or
    /// tabs, cut before that line's first other character, a line break included (llama.cpp's
    /// `n_indent`: a code completion ends with its block). 0 never ends it.
    pub fn stop_below_indent(mut self, n: usize) -> Self {
        self.indent = (n > 0).then_some(n);
        self
    }

    fn decode(&self, tokens: &[u32]) -> Result<String> {
        (self.tokenizer)
            .decode(tokens, true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// True for a token that decoding leaves out (a special token, or an id the vocabulary
    /// lacks: `Tokenizer::decode`'s filter). It is not kept: a run of them (an end-of-text
    /// token generated again and again under `ignore_eos`) would otherwise grow the window,
    /// which must begin with a token that has text, and every token would decode the run.
    fn skipped(&self, token: u32) -> bool {
        (self.tokenizer.id_to_token(token))
            .is_none_or(|t| self.tokenizer.get_added_vocabulary().is_special_token(&t))
    }

    /// Adds a token; returns the text that is now safe to show (possibly empty).
    pub fn push(&mut self, token: u32) -> Result<String> {
        if self.stopped.is_some() {
            return Ok(String::new());
        }
        self.pushed += 1;
        if self.skipped(token) {
            return Ok(String::new());
        }
        self.tokens.push(token);
        let Some(window) = self.window(false)? else {
            return Ok(String::new());
        };
        // An incomplete UTF-8 sequence decodes to U+FFFD: the complete text before it is
        // taken (and looked through for stops) now, the rest on a later token.
        let complete = window.trim_end_matches('\u{FFFD}');
        let whole = complete.len() == window.len();
        // A token that adds no text leaves the window where it is: the window's first token
        // must be one with text, for a decoder's first-token rules.
        if !self.extend(complete) {
            return Ok(String::new());
        }
        if whole {
            // The window moves on: the new tokens become the next one's context.
            self.prefix = self.read;
            self.read = self.tokens.len();
            self.prefix_text = self.decode(&self.tokens[self.prefix..self.read])?;
            self.base = self.text.len();
        }
        if self.pushed < self.min_tokens {
            // Before the stops apply, the text is out of their reach (but a tail that could
            // begin one is held back, as always: the stops apply at the next token). The
            // indentation rule goes on from the last line, which may go on after them.
            let from = floor_char_boundary(&self.text, self.searched);
            if let Some(nl) = self.text[from..].rfind('\n') {
                self.indent_from = Some(from + nl + 1);
            }
            self.searched = self.text.len();
            self.floor = self.searched;
        } else if self.cut() {
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

    /// The window's tokens decoded, beginning with `prefix_text`. A decoder can rewrite its
    /// context's text given more tokens: byte fallback (SentencePiece's) decodes a group of
    /// byte tokens that is not valid UTF-8 as one U+FFFD a byte, those of the context too,
    /// until the character is whole. `None` (wait for more tokens) while the window ends in
    /// such a character, unless `last`; else, when the window still does not begin with its
    /// context's text, all the tokens are decoded and the window starts over from the first.
    fn window(&mut self, last: bool) -> Result<Option<String>> {
        let window = self.decode(&self.tokens[self.prefix..])?;
        if window.starts_with(self.prefix_text.as_str()) {
            return Ok(Some(window));
        }
        if !last && window.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        tracing::debug!("the decoder rewrote text before the new token: decoding all tokens");
        (self.prefix, self.read, self.base) = (0, 0, 0);
        self.prefix_text.clear();
        (self.searched, self.indent_from) = (self.floor, None);
        self.decode(&self.tokens).map(Some)
    }

    /// Makes `text` end with what `window` (from [`TextStream::window`]) adds to its context's
    /// text; false (`text` unchanged) when it adds nothing beyond what `text` has.
    fn extend(&mut self, window: &str) -> bool {
        let Some(new) = window.strip_prefix(self.prefix_text.as_str()) else {
            return false;
        };
        if self.base + new.len() <= self.text.len() {
            return false;
        }
        self.text.truncate(self.base);
        self.text.push_str(new);
        true
    }

    /// Ends the text at the first stop string or line below the indentation in the text not
    /// yet looked through; true when one was there.
    fn cut(&mut self) -> bool {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(1);
        let mut from = self
            .searched
            .saturating_sub(longest - 1)
            .min(self.text.len());
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        // The earliest; of two at the same place, the first given.
        let string = (self.stops.iter().enumerate())
            .filter_map(|(i, s)| Some((from + self.text[from..].find(s.as_str())?, i)))
            .min();
        self.stop_index = string.map(|s| s.1);
        let string = string.map(|(at, _)| (at, Stopped::String));
        let indent = (self.indent)
            .and_then(|n| match self.indent_from {
                Some(at) => below_indent_from(&self.text, n, at),
                // No line break before `searched`: the second line starts after the first one.
                None => (self.text[self.searched..].find('\n'))
                    .and_then(|nl| below_indent_from(&self.text, n, self.searched + nl + 1)),
            })
            .map(|at| (at, Stopped::Indent));
        let Some((at, why)) = string.into_iter().chain(indent).min_by_key(|c| c.0) else {
            // The next search of the indentation starts at the last line, which may go on.
            if let Some(nl) = self.text[self.searched..].rfind('\n') {
                self.indent_from = Some(self.searched + nl + 1);
            }
            self.searched = self.text.len();
            return false;
        };
        self.text.truncate(at);
        self.stopped = Some(why);
        if why != Stopped::String {
            self.stop_index = None;
        }
        true
    }

    /// Flushes what was held back at the end of generation (a character cut short decoded as
    /// it is), cut as [`TextStream::push`] cuts.
    pub fn finish(&mut self) -> String {
        if self.stopped.is_none() {
            if let Ok(Some(window)) = self.window(true) {
                if self.extend(&window) && self.pushed >= self.min_tokens {
                    self.cut();
                }
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

    /// The stop string that ended the text, if one did.
    pub fn stop_string(&self) -> Option<&str> {
        self.stop_index.map(|i| self.stops[i].as_str())
    }

    /// Everything produced so far, stop string excluded.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn take(&mut self, upto: usize) -> String {
        // Text already out that a decoder rewrote ([`TextStream::window`]) may now end inside
        // a character: what comes next starts after it.
        while self.emitted < self.text.len() && !self.text.is_char_boundary(self.emitted) {
            self.emitted += 1;
        }
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
#[cfg(test)]
fn below_indent(text: &str, n: usize) -> Option<usize> {
    below_indent_from(text, n, text.find('\n')? + 1)
}

/// [`below_indent`] from `at`, the start of a line after the first.
fn below_indent_from(text: &str, n: usize, mut at: usize) -> Option<usize> {
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

/// The largest char boundary of `text` at or below `at`.
fn floor_char_boundary(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
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

    /// Special tokens are not kept: a run of them costs nothing later tokens decode again.
    #[test]
    fn special_tokens_leave_the_window_alone() {
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [{"id": 2, "content": "<eos>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "<eos>": 2},
                "unk_token": "a"},
        });
        let tok = Tokenizer::from_bytes(json.to_string()).unwrap();
        let mut s = TextStream::new(&tok, vec!["a b".into()]);
        let mut out = s.push(0).unwrap();
        for _ in 0..1000 {
            out += &s.push(2).unwrap();
            out += &s.push(7).unwrap(); // not in the vocabulary: decoding drops it too
        }
        assert_eq!(s.tokens, [0], "the run is not kept");
        out += &s.push(1).unwrap();
        out += &s.finish();
        assert_eq!(out, "", "the stop spans the run");
        assert_eq!(s.stop_string(), Some("a b"));
        let mut s = TextStream::new(&tok, vec![]);
        let out: String = [0, 2, 2, 1, 2, 0].map(|t| s.push(t).unwrap()).concat() + &s.finish();
        assert_eq!(out, tok.decode(&[0, 2, 2, 1, 2, 0], true).unwrap());
        assert_eq!(out, "a b a");
    }

    /// With `min_tokens`, a stop in the text of the first tokens is not looked for; from
    /// the `n`-th token on, the stops apply to the new text.
    #[test]
    fn stops_wait_for_min_tokens() {
        let json = serde_json::json!({
            "version": "1.0",
            "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}, "unk_token": "a"},
        });
        let tok = Tokenizer::from_bytes(json.to_string()).unwrap();
        let run = |min: usize| {
            let mut s = TextStream::new(&tok, vec!["a b".into()]).min_tokens(min);
            let mut out = String::new();
            for t in [0, 1, 0, 1, 0] {
                out += &s.push(t).unwrap();
            }
            (out + &s.finish(), s.stop_string().is_some())
        };
        assert_eq!(run(0), (String::new(), true));
        assert_eq!(
            run(2),
            (String::new(), true),
            "the 2nd token's stop applies"
        );
        // The first two tokens' "a b" is never a stop; the second one (tokens 3, 4) is.
        assert_eq!(run(3), ("a b ".to_string(), true));
        assert_eq!(run(5), ("a b a b a".to_string(), false));
    }

    #[test]
    fn prefix_suffix() {
        assert_eq!(longest_prefix_suffix("hello wo", "world"), 2);
        assert_eq!(longest_prefix_suffix("hello", "world"), 0);
        assert_eq!(longest_prefix_suffix("abc", "c"), 0);
    }
}
