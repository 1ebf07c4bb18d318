//! A reply's reasoning apart from its answer: the `<think>…</think>` block that reasoning
//! models (Qwen 3, DeepSeek-R1 and its distills) write before they answer, returned as
//! `reasoning_content` beside `content`, as llama.cpp's server (`--reasoning-format
//! deepseek`), DeepSeek's API and vLLM's reasoning parsers return it.
//!
//! - A reply that starts (after whitespace) with `<think>` reasons until `</think>`; the
//!   answer is what follows, without the whitespace that opens it. A reply cut before
//!   `</think>` is all reasoning.
//! - A prompt that ends with `<think>` (DeepSeek-R1's template opens the block itself) leaves
//!   the reply inside the block from its first byte.
//! - Any other reply is all answer, as written (Qwen 3 with `enable_thinking: false`, whose
//!   template puts an empty block in the prompt).
//! - The reasoning is trimmed of whitespace at both ends, and is absent when nothing is left.
//!
//! [`ReasoningStream`] splits a reply as it streams, with the same result as [`split`] on the
//! whole whatever the pieces (a property test checks it).

/// Opens a reasoning block.
pub const THINK_START: &str = "<think>";
/// Closes it.
pub const THINK_END: &str = "</think>";

/// Whether replies are split into reasoning and answer (llama.cpp's `--reasoning-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningFormat {
    /// Split when the chat template writes `</think>` (a reasoning model's).
    #[default]
    Auto,
    /// Never: the reasoning stays in the content, as the model wrote it.
    None,
    /// Always (llama.cpp's name: DeepSeek's `reasoning_content`).
    Deepseek,
}

impl std::str::FromStr for ReasoningFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "none" => Ok(Self::None),
            "deepseek" => Ok(Self::Deepseek),
            other => Err(format!(
                "unknown reasoning format `{other}` (auto, none, deepseek)"
            )),
        }
    }
}

impl ReasoningFormat {
    /// Whether replies to prompts of a chat `template` (its source, `None` without one) are
    /// split.
    pub fn applies(self, template: Option<&str>) -> bool {
        match self {
            Self::Auto => template.is_some_and(|t| t.contains(THINK_END)),
            Self::None => false,
            Self::Deepseek => true,
        }
    }
}

/// Whether a rendered prompt leaves the reply inside a reasoning block: it ends with
/// `<think>` (and whitespace).
pub fn opens_reasoning(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_START)
}

/// A reply split into reasoning and answer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Split {
    /// The reasoning, trimmed; `None` without a block or when it is empty.
    pub reasoning: Option<String>,
    /// The answer.
    pub content: String,
}

/// Splits a whole reply; `open`: the prompt left it inside a block ([`opens_reasoning`]).
pub fn split(text: &str, open: bool) -> Split {
    let body = if open {
        text
    } else {
        match text.trim_start().strip_prefix(THINK_START) {
            Some(rest) => rest,
            None => {
                return Split {
                    reasoning: None,
                    content: text.to_string(),
                }
            }
        }
    };
    let (reasoning, content) = match body.find(THINK_END) {
        Some(i) => (&body[..i], body[i + THINK_END.len()..].trim_start()),
        None => (body, ""),
    };
    let reasoning = reasoning.trim();
    Split {
        reasoning: (!reasoning.is_empty()).then(|| reasoning.to_string()),
        content: content.to_string(),
    }
}

/// A piece of a streamed reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first byte that is not whitespace: a block may still open.
    Start,
    /// Inside the block; `started`: some reasoning was sent (leading whitespace is dropped).
    Reasoning { started: bool },
    /// After `</think>`, skipping the whitespace that opens the answer.
    AfterEnd,
    /// The answer, sent as it comes.
    Content,
}

/// Splits a reply as it streams: text goes in as the model writes it, and comes out as
/// reasoning and answer pieces, holding back only what may still turn out to be a tag or
/// whitespace that [`split`] trims.
#[derive(Debug, Clone)]
pub struct ReasoningStream {
    state: State,
    pending: String,
}

impl ReasoningStream {
    /// `open`: the prompt left the reply inside a block ([`opens_reasoning`]).
    pub fn new(open: bool) -> Self {
        Self {
            state: if open {
                State::Reasoning { started: false }
            } else {
                State::Start
            },
            pending: String::new(),
        }
    }

    /// Takes the next text of the reply; returns what can be sent now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let t = self.pending.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK_START) {
                        self.pending = rest.to_string();
                        self.state = State::Reasoning { started: false };
                    } else if THINK_START.starts_with(t) {
                        return out; // whitespace, or the start of the tag
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning { started } => {
                    if !started {
                        let t = self.pending.trim_start();
                        if t.len() < self.pending.len() {
                            self.pending = t.to_string();
                        }
                    }
                    if let Some(i) = self.pending.find(THINK_END) {
                        let r = self.pending[..i].trim_end();
                        if !r.is_empty() {
                            out.push(Piece::Reasoning(r.to_string()));
                        }
                        self.pending = self.pending[i + THINK_END.len()..].to_string();
                        self.state = State::AfterEnd;
                        continue;
                    }
                    // Hold back a suffix that may start `</think>`, and the whitespace before
                    // it: trailing whitespace of the reasoning is trimmed.
                    let tag = (1..THINK_END.len())
                        .rev()
                        .find(|&k| self.pending.ends_with(&THINK_END[..k]))
                        .map_or(self.pending.len(), |k| self.pending.len() - k);
                    let keep = self.pending[..tag].trim_end().len();
                    if keep > 0 {
                        out.push(Piece::Reasoning(self.pending[..keep].to_string()));
                        self.pending.drain(..keep);
                        self.state = State::Reasoning { started: true };
                    }
                    return out;
                }
                State::AfterEnd => {
                    let t = self.pending.trim_start();
                    if t.is_empty() {
                        self.pending.clear();
                        return out;
                    }
                    self.pending = t.to_string();
                    self.state = State::Content;
                }
                State::Content => {
                    if !self.pending.is_empty() {
                        out.push(Piece::Content(std::mem::take(&mut self.pending)));
                    }
                    return out;
                }
            }
        }
    }

    /// The reply has ended: what was held back.
    pub fn finish(mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            // Only whitespace or a partial `<think>`: the answer, as written.
            State::Start if !rest.is_empty() => vec![Piece::Content(rest)],
            // A block cut off: its rest without trailing whitespace (leading whitespace of
            // the block was dropped as it came; after that, it is inside the reasoning).
            State::Reasoning { .. } if !rest.trim_end().is_empty() => {
                vec![Piece::Reasoning(rest.trim_end().to_string())]
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(reasoning: Option<&str>, content: &str) -> Split {
        Split {
            reasoning: reasoning.map(str::to_string),
            content: content.to_string(),
        }
    }

    #[test]
    fn whole_replies() {
        let cases = [
            (
                "<think>\nhmm\n</think>\n\nHello",
                false,
                s(Some("hmm"), "Hello"),
            ),
            ("  <think>a b</think>c", false, s(Some("a b"), "c")),
            (
                "Hello <think>x</think>",
                false,
                s(None, "Hello <think>x</think>"),
            ),
            ("<think>\n\n</think>\n\nHi", false, s(None, "Hi")),
            ("<think>cut off", false, s(Some("cut off"), "")),
            ("plain", false, s(None, "plain")),
            ("\nplain ", false, s(None, "\nplain ")),
            ("", false, s(None, "")),
            (
                "reason</think>\n\nanswer",
                true,
                s(Some("reason"), "answer"),
            ),
            ("all reasoning", true, s(Some("all reasoning"), "")),
            ("</think>answer</think>", true, s(None, "answer</think>")),
        ];
        for (text, open, want) in cases {
            assert_eq!(split(text, open), want, "{text:?} open {open}");
        }
    }

    #[test]
    fn formats_and_open_prompts() {
        let qwen3 = "... {{- '<think>\\n\\n</think>\\n\\n' }} ...";
        assert!(ReasoningFormat::Auto.applies(Some(qwen3)));
        assert!(!ReasoningFormat::Auto.applies(Some("{{ messages }}")));
        assert!(!ReasoningFormat::Auto.applies(None));
        assert!(!ReasoningFormat::None.applies(Some(qwen3)));
        assert!(ReasoningFormat::Deepseek.applies(None));
        assert_eq!("deepseek".parse(), Ok(ReasoningFormat::Deepseek));
        assert!("qwen3".parse::<ReasoningFormat>().is_err());
        assert!(opens_reasoning("<|Assistant|><think>\n"));
        assert!(!opens_reasoning(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!opens_reasoning("<|im_start|>assistant\n"));
    }

    /// The pieces of a stream, joined by kind.
    fn streamed(parts: &[String], open: bool) -> (String, String, usize) {
        let mut st = ReasoningStream::new(open);
        let mut pieces = Vec::new();
        for p in parts {
            pieces.extend(st.push(p));
        }
        pieces.extend(st.finish());
        let (mut r, mut c) = (String::new(), String::new());
        for p in &pieces {
            match p {
                Piece::Reasoning(t) => {
                    assert!(!t.is_empty());
                    r.push_str(t)
                }
                Piece::Content(t) => {
                    assert!(!t.is_empty());
                    c.push_str(t)
                }
            }
        }
        (r, c, pieces.len())
    }

    #[test]
    fn streams_send_reasoning_as_it_comes() {
        let mut st = ReasoningStream::new(false);
        assert_eq!(st.push("<thi"), vec![]);
        assert_eq!(
            st.push("nk>\nLet me"),
            vec![Piece::Reasoning("Let me".into())]
        );
        assert_eq!(
            st.push(" think. </th"),
            vec![Piece::Reasoning(" think.".into())]
        );
        assert_eq!(st.push("ink>\n\n"), vec![]);
        assert_eq!(st.push("Yes."), vec![Piece::Content("Yes.".into())]);
        assert_eq!(st.finish(), vec![]);
    }

    proptest! {
        /// Streamed in any pieces, a reply splits as the whole does.
        #[test]
        fn streams_split_as_the_whole(
            words in prop::collection::vec(
                prop::sample::select(vec![
                    "<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "b c", "<th",
                    "k>", "é",
                ]),
                0..12,
            ),
            cuts in prop::collection::vec(0usize..40, 0..6),
            open in any::<bool>(),
        ) {
            let text: String = words.concat();
            let mut at: Vec<usize> = cuts
                .into_iter()
                .map(|c| c.min(text.len()))
                .filter(|&c| text.is_char_boundary(c))
                .collect();
            at.sort_unstable();
            at.dedup();
            let mut parts = Vec::new();
            let mut prev = 0;
            for c in at.into_iter().chain([text.len()]) {
                parts.push(text[prev..c].to_string());
                prev = c;
            }
            let whole = split(&text, open);
            let (r, c, _) = streamed(&parts, open);
            prop_assert_eq!(whole.reasoning.unwrap_or_default(), r, "{:?}", parts);
            prop_assert_eq!(whole.content, c, "{:?}", parts);
        }
    }
}
