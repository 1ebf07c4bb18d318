//! The `logprobs` objects of responses, in the two shapes OpenAI uses.
//!
//! - `/v1/completions`: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one
//!   entry per token. With `echo`, the prompt's tokens come first, the first of them with
//!   `null`s (nothing comes before it). `top_logprobs` maps token text to log-probability and,
//!   as OpenAI documents, also holds the chosen token, so it has up to `logprobs + 1` entries.
//!   `text_offset` is the character offset of each token in the returned `text`; special
//!   tokens (BOS, end of turn) take no room there, as the text leaves them out.
//! - `/v1/chat/completions`: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.
//! - llama.cpp's `/completion` and `/infill` (`n_probs`): `completion_probabilities`, an array
//!   of `{"id", "token", "bytes", "logprob", "top_logprobs"}` ([`llama`]).
//!
//! A token that ends inside a UTF-8 character shows as `bytes:\xe6\x97` in `token` (OpenAI's
//! form); `bytes` (chat) has its exact bytes. A log-probability of −∞ (a token the model rules
//! out) is sent as −9999, as vLLM does: JSON has no infinity.

use std::collections::HashMap;

use keydiff::{Engine, TokenLogprob, TokenPiece};
use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// Token pieces of every id the entries mention (tokens and alternatives).
fn pieces<'a>(
    engine: &Engine,
    ids: impl Iterator<Item = &'a u32>,
) -> Result<HashMap<u32, TokenPiece>, ApiError> {
    let mut ids: Vec<u32> = ids.copied().collect();
    ids.sort_unstable();
    ids.dedup();
    // The ids come from the engine: a failure here is the server's, not the request's.
    let pieces = engine
        .token_pieces(&ids)
        .map_err(|e| ApiError::internal(format!("logprobs: {e}")))?;
    Ok(ids.into_iter().zip(pieces).collect())
}

/// A log-probability as sent: finite, at least −9999.
fn finite(lp: f32) -> f32 {
    lp.max(-9999.0)
}

/// Builds `/v1/completions` logprobs objects, keeping the text offset across the chunks of a
/// stream.
#[derive(Debug, Default)]
pub struct CompletionLogprobs {
    /// Characters of the response's text before the next token.
    offset: usize,
}

impl CompletionLogprobs {
    /// The object for `tokens`, `entries[i]` the log-probability of `tokens[i]` (`None` for a
    /// prompt's first token).
    pub fn object(
        &mut self,
        engine: &Engine,
        tokens: &[u32],
        entries: &[Option<&TokenLogprob>],
    ) -> Result<Value, ApiError> {
        self.object_with_written_specials(engine, tokens, entries, 0)
    }

    /// [`CompletionLogprobs::object`] where the first `written` tokens stand for text that
    /// writes its special tokens out (an echoed prompt as sent, `<|im_start|>` and all): their
    /// special tokens take their text's room in `text_offset`.
    pub fn object_with_written_specials(
        &mut self,
        engine: &Engine,
        tokens: &[u32],
        entries: &[Option<&TokenLogprob>],
        written: usize,
    ) -> Result<Value, ApiError> {
        let alternatives = entries
            .iter()
            .flatten()
            .flat_map(|e| e.top.iter().map(|t| &t.0));
        let map = pieces(engine, tokens.iter().chain(alternatives))?;
        let ordered: Vec<TokenPiece> = tokens.iter().map(|t| map[t].clone()).collect();
        let roomed: Vec<TokenPiece> = ordered
            .iter()
            .enumerate()
            .map(|(i, p)| TokenPiece {
                special: p.special && i >= written,
                ..p.clone()
            })
            .collect();
        let (offsets, end) = keydiff::logprobs::text_offsets(&roomed, self.offset);
        self.offset = end;
        let top = |e: &TokenLogprob| {
            let mut m = Map::new();
            for (id, lp) in e.top.iter().chain(std::iter::once(&(e.token, e.logprob))) {
                // Two tokens with the same text keep the larger value.
                let lp = finite(*lp);
                let slot = m.entry(map[id].text()).or_insert(json!(lp));
                if slot.as_f64().is_some_and(|v| (lp as f64) > v) {
                    *slot = json!(lp);
                }
            }
            Value::Object(m)
        };
        Ok(json!({
            "tokens": ordered.iter().map(TokenPiece::text).collect::<Vec<_>>(),
            "token_logprobs": entries
                .iter()
                .map(|e| e.map(|e| finite(e.logprob)))
                .collect::<Vec<_>>(),
            "top_logprobs": entries.iter().map(|e| e.map(top)).collect::<Vec<_>>(),
            "text_offset": offsets,
        }))
    }
}

/// Each of `entries` as `item(id, piece, logprob)` with its alternatives, as `item`s, under
/// `top_logprobs` (chat's and llama.cpp's shape).
fn with_alternatives(
    engine: &Engine,
    entries: &[TokenLogprob],
    item: impl Fn(u32, &TokenPiece, f32) -> Value,
) -> Result<Vec<Value>, ApiError> {
    let ids = entries
        .iter()
        .flat_map(|e| std::iter::once(&e.token).chain(e.top.iter().map(|t| &t.0)));
    let map = pieces(engine, ids)?;
    let item = |id: &u32, lp: f32| item(*id, &map[id], finite(lp));
    Ok(entries
        .iter()
        .map(|e| {
            let mut v = item(&e.token, e.logprob);
            v["top_logprobs"] = e.top.iter().map(|(id, lp)| item(id, *lp)).collect();
            v
        })
        .collect())
}

/// llama.cpp's `completion_probabilities` of `entries` (its `n_probs`, before sampling): per
/// token `{"id", "token", "bytes", "logprob", "top_logprobs"}`, each alternative `{"id",
/// "token", "bytes", "logprob"}`. `token` is the text of the token's bytes up to a character
/// they split (llama.cpp's `validate_utf8`); `bytes` has them all.
pub fn llama(engine: &Engine, entries: &[TokenLogprob]) -> Result<Value, ApiError> {
    let items = with_alternatives(engine, entries, |id, p, lp| {
        let whole = match std::str::from_utf8(&p.bytes) {
            Ok(s) => s,
            // The prefix up to the error is valid UTF-8.
            Err(e) => std::str::from_utf8(&p.bytes[..e.valid_up_to()]).unwrap_or_default(),
        };
        json!({"id": id, "token": whole, "bytes": p.bytes, "logprob": lp})
    })?;
    Ok(Value::Array(items))
}

/// The `/v1/chat/completions` logprobs object of `entries`.
pub fn chat(engine: &Engine, entries: &[TokenLogprob]) -> Result<Value, ApiError> {
    let content = with_alternatives(
        engine,
        entries,
        |_, p, lp| json!({"token": p.text(), "logprob": lp, "bytes": p.bytes}),
    )?;
    Ok(json!({ "content": content }))
}
