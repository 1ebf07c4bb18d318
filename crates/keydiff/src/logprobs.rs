//! Log-probabilities of tokens (OpenAI's `logprobs`), and the bytes each token stands for.
//!
//! A log-probability is taken from the model's own distribution: the log-softmax of the raw
//! logits, before penalties, temperature or any truncation (vLLM's default, and what an
//! evaluation harness scores a continuation with). Under a KV budget it is the distribution of
//! the evicting engine, which is the point of asking for it here.

use candle_core::{DType, Tensor};
use tokenizers::{DecoderWrapper, Tokenizer};

use crate::error::{EngineError, Result};

/// The most alternatives a request may ask for per token (vLLM's default `max_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One token's log-probability and the most likely tokens in its place.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The `top` most likely tokens with their log-probabilities, most likely first (ties: the
    /// lower id first).
    pub top: Vec<(u32, f32)>,
}

/// The log-softmax of `logits` at `token`, and its `top` most likely entries. The
/// exponentials are summed in f32 over blocks of 1024 and the blocks in f64, so that a large
/// vocabulary loses no precision; the top entries are kept in one pass, in a list of at most
/// `top`.
pub fn token_logprob(logits: &[f32], token: u32, top: usize) -> Result<TokenLogprob> {
    let Some(&picked) = logits.get(token as usize) else {
        return Err(EngineError::BadParams(format!(
            "token {token} is outside the vocabulary of {}",
            logits.len()
        )));
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return Err(EngineError::BadParams(format!(
            "the logits' largest value is {max}: no distribution to take logprobs from"
        )));
    }
    // f32 exponentials (they vectorise), summed in f64 by blocks.
    let sum: f64 = logits
        .chunks(1024)
        .map(|b| f64::from(b.iter().map(|&l| (l - max).exp()).sum::<f32>()))
        .sum();
    let lse = f64::from(max) + sum.ln();
    let lp = |l: f32| (f64::from(l) - lse) as f32;
    // The best `top` so far, most likely first (ties: the lower id, which comes first).
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top.min(logits.len()) + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() == top && l <= best[top - 1].1 {
                continue;
            }
            let at = best.partition_point(|b| b.1 >= l);
            best.insert(at, (i as u32, l));
            best.truncate(top);
        }
    }
    Ok(TokenLogprob {
        token,
        logprob: lp(picked),
        top: best.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    })
}

/// [`token_logprob`] for every row of `logits` (`[rows, vocab]`), row `i` taken at
/// `targets[i]`. On the CPU the rows are read as they are; on a GPU the log-softmax and the
/// top alternatives are computed there ([`rows_logprobs_on_device`]), so that a chunk's
/// `rows × vocab` logits never cross to the host.
pub fn rows_logprobs(logits: &Tensor, targets: &[u32], top: usize) -> Result<Vec<TokenLogprob>> {
    if !logits.device().is_cpu() {
        return rows_logprobs_on_device(logits, targets, top);
    }
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    check_rows(rows.len(), targets)?;
    // Rows are independent: split them over the cores (the prefill waits for them).
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = rows.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let parts: Vec<_> = rows
            .chunks(per)
            .zip(targets.chunks(per))
            .map(|(rows, targets)| {
                s.spawn(move || {
                    rows.iter()
                        .zip(targets)
                        .map(|(row, &t)| token_logprob(row, t, top))
                        .collect::<Result<Vec<_>>>()
                })
            })
            .collect();
        let mut out = Vec::with_capacity(targets.len());
        for p in parts {
            out.extend(p.join().expect("a logprob thread panicked")?);
        }
        Ok(out)
    })
}

fn check_rows(rows: usize, targets: &[u32]) -> Result<()> {
    if rows != targets.len() {
        return Err(EngineError::BadParams(format!(
            "{rows} logit rows for {} target tokens",
            targets.len()
        )));
    }
    Ok(())
}

/// [`rows_logprobs`] in candle ops on the logits' device: the log-sum-exp and the targets'
/// logits by row, and the top alternatives by `top` rounds of argmax, each masking out what it
/// found. Only `rows × (1 + 2 top)` numbers come back. Equal alternatives may come in another
/// order than [`token_logprob`]'s (lower id first).
pub fn rows_logprobs_on_device(
    logits: &Tensor,
    targets: &[u32],
    top: usize,
) -> Result<Vec<TokenLogprob>> {
    let logits = logits.to_dtype(DType::F32)?;
    let (rows, vocab) = logits.dims2()?;
    check_rows(rows, targets)?;
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::BadParams(format!(
            "token {t} is outside the vocabulary of {vocab}"
        )));
    }
    let dev = logits.device();
    let max = logits.max_keepdim(1)?;
    if let Some(m) = max
        .squeeze(1)?
        .to_vec1::<f32>()?
        .into_iter()
        .find(|m| !m.is_finite())
    {
        return Err(EngineError::BadParams(format!(
            "the logits' largest value is {m}: no distribution to take logprobs from"
        )));
    }
    let lse = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()? + &max)?;
    let index = Tensor::new(targets, dev)?.unsqueeze(1)?;
    let picked = (logits.gather(&index, 1)? - &lse)?
        .squeeze(1)?
        .to_vec1::<f32>()?;
    let top = top.min(vocab);
    let mut alternatives = vec![Vec::with_capacity(top); rows];
    let mut work = logits.clone();
    let columns = Tensor::arange(0u32, vocab as u32, dev)?.unsqueeze(0)?;
    // One value seen at every position (a stride-0 view, nothing allocated).
    let masked = Tensor::new(f32::NEG_INFINITY, dev)?.broadcast_as((rows, vocab))?;
    for k in 0..top {
        let best = work.argmax_keepdim(1)?;
        let value = (work.gather(&best, 1)? - &lse)?
            .squeeze(1)?
            .to_vec1::<f32>()?;
        let ids = best.squeeze(1)?.to_vec1::<u32>()?;
        for (row, (id, v)) in alternatives.iter_mut().zip(ids.into_iter().zip(value)) {
            row.push((id, v));
        }
        if k + 1 < top {
            work = columns.broadcast_eq(&best)?.where_cond(&masked, &work)?;
        }
    }
    // A row with fewer than `top` finite logits: once they are taken, argmax meets only
    // masked entries and repeats one. Such rows (rare: a model's logits are finite) are
    // taken on the host, which lists the −∞ entries by id, as for any row.
    for (r, row) in alternatives.iter_mut().enumerate() {
        if row.iter().any(|a| a.1 == f32::NEG_INFINITY) {
            let host = logits.get(r)?.to_vec1::<f32>()?;
            *row = token_logprob(&host, targets[r], top)?.top;
        }
    }
    Ok(targets
        .iter()
        .zip(picked)
        .zip(alternatives)
        .map(|((&token, logprob), top)| TokenLogprob {
            token,
            logprob,
            top,
        })
        .collect())
}

/// What a token stands for in text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenPiece {
    /// Its bytes: part of a UTF-8 character when a byte-level token splits one.
    pub bytes: Vec<u8>,
    /// A special token (BOS, `<|im_end|>`, ...): decoded text leaves it out.
    pub special: bool,
}

impl TokenPiece {
    /// The token as text: its bytes when they are whole UTF-8 characters, else OpenAI's form
    /// for a token that splits a character, `bytes:\xe6\x97` (so that two such tokens never
    /// show as the same text).
    pub fn text(&self) -> String {
        match std::str::from_utf8(&self.bytes) {
            Ok(s) => s.to_string(),
            Err(_) => {
                let hex: String = self.bytes.iter().map(|b| format!("\\x{b:02x}")).collect();
                format!("bytes:{hex}")
            }
        }
    }
}

/// The pieces of `ids`. With a byte-level decoder (Llama 3, Qwen 2.5, SmolLM2, every GGUF we
/// load) a token's vocabulary string maps back to its exact bytes through GPT-2's byte
/// alphabet; added tokens are their content. Otherwise the SentencePiece conventions apply:
/// `<0xHH>` is the byte HH and `▁` a space. An id the tokenizer does not know (a padded
/// vocabulary's rows past the last token) stands for no text.
pub fn token_pieces(tokenizer: &Tokenizer, ids: &[u32]) -> Result<Vec<TokenPiece>> {
    let byte_level = matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
    let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
    let table = byte_level.then(char_bytes);
    ids.iter()
        .map(|&id| {
            if let Some(t) = added.get(&id) {
                return Ok(TokenPiece {
                    bytes: t.content.as_bytes().to_vec(),
                    special: t.special,
                });
            }
            let Some(s) = tokenizer.id_to_token(id) else {
                return Ok(TokenPiece {
                    bytes: Vec::new(),
                    special: true,
                });
            };
            let bytes = match &table {
                Some(table) => s
                    .chars()
                    .map(|c| {
                        table(c).ok_or_else(|| {
                            EngineError::Tokenizer(format!(
                                "token {id} ({s:?}) is not byte-level BPE text"
                            ))
                        })
                    })
                    .collect::<Result<Vec<u8>>>()?,
                None => sentencepiece_bytes(&s),
            };
            Ok(TokenPiece {
                bytes,
                special: false,
            })
        })
        .collect()
}

/// A SentencePiece token's bytes: `<0xHH>` is the byte HH (byte fallback), `▁` a space.
fn sentencepiece_bytes(s: &str) -> Vec<u8> {
    let hex = s
        .strip_prefix("<0x")
        .and_then(|h| h.strip_suffix('>'))
        .filter(|h| h.len() == 2)
        .and_then(|h| u8::from_str_radix(h, 16).ok());
    match hex {
        Some(b) => vec![b],
        None => s.replace('\u{2581}', " ").into_bytes(),
    }
}

/// GPT-2's byte-level alphabet backwards: the byte a vocabulary character stands for. Printable
/// bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves; the other 68 bytes were given
/// the characters from U+0100 on, in byte order.
fn char_bytes() -> impl Fn(char) -> Option<u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = [0u8; 68];
    let mut n = 0;
    for b in 0..=255u8 {
        if !printable(b) {
            table[n] = b;
            n += 1;
        }
    }
    move |c: char| {
        let c = c as u32;
        match c {
            0..=255 if printable(c as u8) => Some(c as u8),
            256..=323 => Some(table[(c - 256) as usize]),
            _ => None,
        }
    }
}

/// The character offset (Python's `str` index, as OpenAI's `text_offset`) at which each
/// piece starts in the text they decode to, counting from `start`, and the offset after the
/// last; special pieces take no room.
pub fn text_offsets(pieces: &[TokenPiece], start: usize) -> (Vec<usize>, usize) {
    let mut at = start;
    let offsets = pieces
        .iter()
        .map(|p| {
            let here = at;
            if !p.special {
                // Characters begin at every byte that is not a UTF-8 continuation byte.
                at += p.bytes.iter().filter(|&&b| b & 0xC0 != 0x80).count();
            }
            here
        })
        .collect();
    (offsets, at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_entries_in_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        let want = |i: usize| (f64::from(logits[i]) - z.ln()) as f32;
        let t = token_logprob(&logits, 2, 3).unwrap();
        assert_eq!(t.token, 2);
        assert!((t.logprob - want(2)).abs() < 1e-6);
        // Ties broken by id: 1 before 3.
        let ids: Vec<u32> = t.top.iter().map(|p| p.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        for (i, lp) in &t.top {
            assert!((lp - want(*i as usize)).abs() < 1e-6);
        }
        let all = token_logprob(&logits, 0, 99).unwrap();
        assert_eq!(all.top.len(), 5);
        let p: f64 = all.top.iter().map(|p| f64::from(p.1).exp()).sum();
        assert!((p - 1.0).abs() < 1e-6);
        assert!(token_logprob(&logits, 0, 0).unwrap().top.is_empty());
        assert!(token_logprob(&logits, 5, 1).is_err());
        assert!(token_logprob(&[f32::NEG_INFINITY; 3], 0, 1).is_err());
    }

    /// The device path (run here on the CPU, as on a GPU) against the host's, on random
    /// rows with a large vocabulary.
    #[test]
    fn the_device_path_equals_the_host_path() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (rows, vocab) = (7, 50_000);
        let data: Vec<f32> = (0..rows * vocab)
            .map(|_| rng.random_range(-20.0f32..20.0))
            .collect();
        let logits =
            Tensor::from_vec(data.clone(), (rows, vocab), &candle_core::Device::Cpu).unwrap();
        let targets: Vec<u32> = (0..rows)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        for top in [0, 1, 5, 20] {
            let device = rows_logprobs_on_device(&logits, &targets, top).unwrap();
            let host = rows_logprobs(&logits, &targets, top).unwrap();
            assert_eq!(device.len(), rows);
            for (d, h) in device.iter().zip(&host) {
                assert_eq!(d.token, h.token);
                assert!(
                    (d.logprob - h.logprob).abs() < 1e-4,
                    "{} vs {}",
                    d.logprob,
                    h.logprob
                );
                let ids = |t: &TokenLogprob| t.top.iter().map(|p| p.0).collect::<Vec<_>>();
                assert_eq!(ids(d), ids(h), "top {top}");
                for (a, b) in d.top.iter().zip(&h.top) {
                    assert!((a.1 - b.1).abs() < 1e-4);
                }
            }
        }
        assert!(rows_logprobs_on_device(&logits, &[0, 1], 1).is_err());
        assert!(rows_logprobs_on_device(&logits, &[vocab as u32; 7], 1).is_err());
    }

    /// Rows with −∞ logits (fewer finite entries than alternatives asked): the device path
    /// lists the same distinct ids as the host's, and both refuse a row without a finite one.
    #[test]
    fn rows_with_few_finite_logits_list_distinct_alternatives() {
        let inf = f32::NEG_INFINITY;
        let data = vec![
            inf, 2.0, inf, inf, 1.0, inf, //
            0.5, 0.1, 0.3, 0.2, 0.4, 0.0, //
            inf, inf, inf, 3.0, inf, inf,
        ];
        let dev = candle_core::Device::Cpu;
        let logits = Tensor::from_vec(data, (3, 6), &dev).unwrap();
        let targets = [1, 2, 0];
        for top in [1, 3, 6] {
            let device = rows_logprobs_on_device(&logits, &targets, top).unwrap();
            let host = rows_logprobs(&logits, &targets, top).unwrap();
            for (d, h) in device.iter().zip(&host) {
                let ids = |t: &TokenLogprob| t.top.iter().map(|p| p.0).collect::<Vec<_>>();
                assert_eq!(ids(d), ids(h), "top {top}");
                for (a, b) in d.top.iter().zip(&h.top) {
                    assert!(a.1 == b.1 || (a.1 - b.1).abs() < 1e-6, "{d:?} vs {h:?}");
                }
            }
            for t in &device {
                let mut ids: Vec<u32> = t.top.iter().map(|p| p.0).collect();
                assert_eq!(ids.len(), top);
                ids.sort();
                ids.dedup();
                assert_eq!(ids.len(), top, "{t:?}");
            }
        }
        assert_eq!(
            rows_logprobs_on_device(&logits, &targets, 3).unwrap()[0]
                .top
                .iter()
                .map(|p| p.0)
                .collect::<Vec<_>>(),
            [1, 4, 0]
        );
        let none = Tensor::from_vec(vec![inf; 4], (1, 4), &dev).unwrap();
        assert!(rows_logprobs_on_device(&none, &[0], 1).is_err());
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let logits = [1000.0f32, 1000.0];
        let t = token_logprob(&logits, 0, 1).unwrap();
        assert!((t.logprob - (-std::f32::consts::LN_2)).abs() < 1e-6);
    }

    #[test]
    fn the_byte_alphabet_is_a_bijection_onto_the_byte_level_chars() {
        let table = char_bytes();
        let alphabet = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
        assert_eq!(alphabet.len(), 256);
        let mut seen: Vec<u8> = alphabet.iter().map(|&c| table(c).unwrap()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..=255).collect::<Vec<u8>>());
        // GPT-2's own examples: 'Ġ' is a space, 'Ċ' a newline.
        assert_eq!(table('Ġ'), Some(b' '));
        assert_eq!(table('Ċ'), Some(b'\n'));
        assert_eq!(table('€'), None);
    }

    /// A SentencePiece-style tokenizer (Metaspace decoder, byte fallback): `▁` is a space,
    /// `<0xHH>` a byte, added tokens their content, unknown ids no text.
    #[test]
    fn sentencepiece_pieces() {
        use tokenizers::decoders::metaspace::Metaspace;
        use tokenizers::models::bpe::BPE;
        let vocab: tokenizers::models::bpe::Vocab =
            [("<unk>", 0), ("<0xE6>", 1), ("\u{2581}the", 2), ("a", 3)]
                .into_iter()
                .map(|(t, i)| (t.to_string(), i))
                .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .build()
            .unwrap();
        let mut t = Tokenizer::new(bpe);
        t.with_decoder(Some(Metaspace::default()));
        t.add_special_tokens([tokenizers::AddedToken::from("</s>", true)])
            .unwrap();
        let eos = t.token_to_id("</s>").unwrap();
        let p = token_pieces(&t, &[1, 2, 3, eos, 999]).unwrap();
        let bytes: Vec<&[u8]> = p.iter().map(|p| &p.bytes[..]).collect();
        assert_eq!(bytes, [&[0xE6][..], b" the", b"a", b"</s>", b""]);
        let special: Vec<bool> = p.iter().map(|p| p.special).collect();
        assert_eq!(special, [false, false, false, true, true]);
    }

    #[test]
    fn offsets_count_characters_and_skip_special_pieces() {
        let piece = |b: &[u8], special| TokenPiece {
            bytes: b.to_vec(),
            special,
        };
        // "<s>", "a", then "é" split over two tokens, then "b".
        let pieces = [
            piece(b"<s>", true),
            piece(b"a", false),
            piece(&[0xC3], false),
            piece(&[0xA9], false),
            piece(b"b", false),
        ];
        assert_eq!(text_offsets(&pieces, 2), (vec![2, 2, 3, 4, 4], 5));
        assert_eq!(pieces[2].text(), "bytes:\\xc3");
        assert_eq!(pieces[1].text(), "a");
    }
}
