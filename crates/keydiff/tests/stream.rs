//! [`TextStream`] (incremental: a window of the last tokens decoded, stops looked for in the new
//! text) against a naive reference that decodes every token so far on each token and looks
//! through all of it: the same pieces joined, the same text, the same stop. On the tokenizers
//! of the two GGUF models the tests use (byte-level BPE) and on a SentencePiece-style one
//! (Llama 2's decoders: `▁` for a space, byte fallback, the first space stripped), with random
//! tokens (bytes cut inside characters, invalid sequences, special tokens) and stops cut from
//! the text itself.

use std::path::Path;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file;
use keydiff::TextStream;
use proptest::prelude::*;
use tokenizers::Tokenizer;

fn gguf_tokenizer(rel: &str) -> Tokenizer {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    let mut f = std::fs::File::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-models.sh)", path.display()));
    let ct = gguf_file::Content::read(&mut f).unwrap();
    keydiff_model::tokenizer::tokenizer_from_gguf(&ct)
        .unwrap()
        .tokenizer
}

fn smollm2() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| gguf_tokenizer("models/SmolLM2-135M-Instruct.Q4_1.gguf"))
}

fn qwen() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| gguf_tokenizer("models/qwen2.5-coder-0.5b-instruct.gguf"))
}

/// Pieces of a SentencePiece vocabulary after the special tokens and the 256 byte tokens.
const SP_PIECES: &[&str] = &[
    "▁", "▁the", "▁a", "a", "b", "c", "ab", "▁x", "x", "\n", "▁▁", "▁\n", "你", "好", "▁你", "é",
    ".", ",", "▁(", ")", "\t",
];

/// A tokenizer with Llama 2's decoders: `<unk>`, `<s>`, `</s>` (special), `<0x00>`..`<0xFF>`,
/// then [`SP_PIECES`].
fn sentencepiece() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let mut vocab = serde_json::Map::new();
        let pieces = ["<unk>", "<s>", "</s>"].map(String::from).into_iter();
        let bytes = (0..=255u8).map(|b| format!("<0x{b:02X}>"));
        let rest = SP_PIECES.iter().map(|s| s.to_string());
        for (i, p) in pieces.chain(bytes).chain(rest).enumerate() {
            vocab.insert(p, i.into());
        }
        let special = |id: u32, content: &str| {
            serde_json::json!({"id": id, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        };
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": []}
        });
        json.to_string().parse().unwrap()
    })
}

fn decode(tok: &Tokenizer, ids: &[u32]) -> String {
    tok.decode(ids, true).unwrap()
}

/// The first place `text` ends at: a stop (the earliest, of two at one place the first
/// given), or llama.cpp's indentation rule; and the stop, if a stop ended it.
fn first_cut(text: &str, stops: &[String], indent: usize) -> Option<(usize, Option<String>)> {
    let string = (stops.iter().enumerate())
        .filter(|(_, s)| !s.is_empty())
        .filter_map(|(i, s)| Some((text.find(s.as_str())?, i)))
        .min();
    let below = (indent > 0).then(|| below_indent(text, indent)).flatten();
    match (string, below) {
        (Some((at, i)), b) if b.is_none_or(|b| at <= b) => Some((at, Some(stops[i].clone()))),
        (_, Some(b)) => Some((b, None)),
        _ => None,
    }
}

/// llama.cpp's `n_indent`, written out for the reference: on a line after the first, the
/// first character other than a space or a tab, where fewer than `n` came before it.
fn below_indent(text: &str, n: usize) -> Option<usize> {
    let mut start = text.find('\n')? + 1;
    loop {
        let line = &text[start..];
        let ws = line.len() - line.trim_start_matches([' ', '\t']).len();
        if ws == line.len() {
            return None;
        }
        if ws < n {
            return Some(start + ws);
        }
        start += line.find('\n')? + 1;
    }
}

/// The reference: after each token all tokens decoded, the complete text (no trailing
/// U+FFFD) looked through; at the end the lossy decoding. The text, whether it was cut, and
/// the stop string that cut it.
fn naive(
    tok: &Tokenizer,
    ids: &[u32],
    stops: &[String],
    indent: usize,
) -> (String, bool, Option<String>) {
    for i in 1..=ids.len() {
        let all = decode(tok, &ids[..i]);
        let complete = all.trim_end_matches('\u{FFFD}');
        if let Some((at, stop)) = first_cut(complete, stops, indent) {
            return (complete[..at].to_string(), true, stop);
        }
    }
    let all = decode(tok, ids);
    match first_cut(&all, stops, indent) {
        Some((at, stop)) => (all[..at].to_string(), true, stop),
        None => (all, false, None),
    }
}

/// Streams `ids`; checks the pieces, the text and the stop against [`naive`].
fn check(tok: &Tokenizer, ids: &[u32], stops: &[String], indent: usize) {
    let (want, want_stop, want_string) = naive(tok, ids, stops, indent);
    let mut s = TextStream::new(tok, stops.to_vec()).stop_below_indent(indent);
    let mut joined = String::new();
    for &t in ids {
        let piece = s.push(t).unwrap();
        // Nothing is handed out that a stop could still take back.
        joined.push_str(&piece);
        assert!(
            want.starts_with(&joined),
            "ids {ids:?}, stops {stops:?}, indent {indent}: handed out {joined:?}, want {want:?}"
        );
    }
    joined.push_str(&s.finish());
    assert_eq!(
        joined, want,
        "ids {ids:?}, stops {stops:?}, indent {indent}"
    );
    assert_eq!(s.text(), want, "ids {ids:?}, stops {stops:?}");
    assert_eq!(s.stopped(), want_stop, "ids {ids:?}, stops {stops:?}");
    assert_eq!(
        s.stop_string(),
        want_string.as_deref(),
        "ids {ids:?}, stops {stops:?}"
    );
}

/// Token ids: mostly a real text's (so that stops and lines come), some random ones (bytes of
/// a character apart, invalid sequences, special tokens).
fn ids(tok: &'static Tokenizer, text: &'static str) -> impl Strategy<Value = Vec<u32>> {
    let real = tok.encode(text, false).unwrap().get_ids().to_vec();
    let vocab = tok.get_vocab_size(true) as u32;
    let n = real.len();
    (
        0..n,
        1..48usize,
        prop::collection::vec((0..4u8, 0..vocab), 48),
    )
        .prop_map(move |(start, len, noise)| {
            (0..len)
                .map(|i| match noise[i] {
                    (0, id) => id,
                    _ => real[(start + i) % n],
                })
                .collect()
        })
}

/// Token ids for the SentencePiece tokenizer: whole characters of a real text (a piece, or
/// the byte tokens of its UTF-8), pieces and special tokens. Its byte-fallback decoder turns
/// every byte of a group of byte tokens that is not valid UTF-8 into U+FFFD, earlier bytes of
/// the group too: text already shown would change, so that no incremental detokenizer can
/// stream a group that stays invalid. Models emit the bytes of whole characters.
fn sp_ids() -> impl Strategy<Value = Vec<u32>> {
    let tok = sentencepiece();
    let chars: Vec<Vec<u32>> = TEXT
        .chars()
        .map(|c| tok.encode(c.to_string(), false).unwrap().get_ids().to_vec())
        .collect();
    let pieces = 259..tok.get_vocab_size(true) as u32;
    let unit = prop_oneof![
        6 => (0..chars.len()).prop_map(move |i| chars[i].clone()),
        2 => pieces.prop_map(|id| vec![id]),
        1 => (0..3u32).prop_map(|id| vec![id]),
    ];
    prop::collection::vec(unit, 1..40).prop_map(|units| units.concat())
}

/// A stop cut from the full decoding of `ids` (so that it comes), or a fixed one.
fn stops_for(tok: &Tokenizer, ids: &[u32], picks: &[(usize, usize)]) -> Vec<String> {
    let text = decode(tok, ids);
    let mut stops: Vec<String> = picks
        .iter()
        .filter_map(|&(at, len)| {
            let chars: Vec<char> = text.chars().collect();
            let at = at % chars.len().max(1);
            let piece: String = chars.iter().skip(at).take(len).collect();
            (!piece.is_empty()).then_some(piece)
        })
        .collect();
    stops.push("\n\n".to_string());
    stops
}

const TEXT: &str = "fn main() {\n    let x = 1;\n    println!(\"{x}\");\n}\n\nThe café \
    serves 你好世界 and こんにちは; naïve résumé — ok.\n  indented\nnot\n\t\ttabs\n";

fn stream_matches_reference(
    tok: &'static Tokenizer,
    ids: impl Strategy<Value = Vec<u32>>,
) -> impl Strategy<Value = ()> {
    (
        ids,
        prop::collection::vec((0..400usize, 1..6usize), 0..3),
        prop_oneof![Just(0usize), Just(1), Just(2), Just(4)],
    )
        .prop_map(move |(ids, picks, indent)| {
            let stops = stops_for(tok, &ids, &picks);
            check(tok, &ids, &stops, indent);
            check(tok, &ids, &[], indent);
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn smollm2_stream_matches_full_decoding(
        () in stream_matches_reference(smollm2(), ids(smollm2(), TEXT))
    ) {}

    #[test]
    fn qwen_stream_matches_full_decoding(
        () in stream_matches_reference(qwen(), ids(qwen(), TEXT))
    ) {}

    #[test]
    fn sentencepiece_stream_matches_full_decoding(
        () in stream_matches_reference(sentencepiece(), sp_ids())
    ) {}
}

/// A reply as long as a long generation: the whole text comes out, in the right order, and
/// a stop at its very end is found.
#[test]
fn a_long_reply_streams_whole_and_stops_at_its_end() {
    let tok = smollm2();
    let text: String = (0..400).map(|i| format!("line {i}: 你好 café\n")).collect();
    let mut ids = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
    let tail = tok.encode("THE END", false).unwrap().get_ids().to_vec();
    ids.extend(&tail);
    ids.extend(tok.encode(" and more", false).unwrap().get_ids());
    let mut s = TextStream::new(tok, vec!["THE END".into()]);
    let mut joined = String::new();
    for &t in &ids {
        joined.push_str(&s.push(t).unwrap());
    }
    joined.push_str(&s.finish());
    assert_eq!(joined, text);
    assert!(s.stopped());
}

/// The SentencePiece decoder strips the first token's leading space only: a reply's first
/// word loses it (as the full decoding does), later words keep theirs though each is the first
/// of a window.
#[test]
fn sentencepiece_spaces_survive_the_window() {
    let tok = sentencepiece();
    let id = |p: &str| tok.token_to_id(p).unwrap();
    let ids = [id("▁the"), id("▁a"), id("▁x"), id("▁"), id("▁the")];
    let mut s = TextStream::new(tok, vec![]);
    let mut joined = String::new();
    for t in ids {
        joined.push_str(&s.push(t).unwrap());
    }
    joined.push_str(&s.finish());
    assert_eq!(joined, "the a x  the");
    assert_eq!(joined, decode(tok, &ids));
}

/// A stop before a character whose bytes are split over tokens is found on the token that
/// brings it, not once the character is complete (the request ends there, with its stop as
/// the reason, not at its token limit).
#[test]
fn a_stop_before_a_split_character_is_found_at_once() {
    let tok = smollm2();
    // A text whose tokens have the space and the first byte(s) of a character in one token,
    // the character's other bytes after it.
    let (ids, first) = "你好世界こんにちは😀𝔘☃жψ"
        .chars()
        .find_map(|c| {
            let ids = tok
                .encode(format!("x {c}"), false)
                .unwrap()
                .get_ids()
                .to_vec();
            let at = ids.iter().position(|&t| decode(tok, &[t]) == " \u{FFFD}")?;
            Some((ids, at))
        })
        .expect("a character split after the space");
    let mut s = TextStream::new(tok, vec![" ".into()]);
    let mut joined = String::new();
    for &t in &ids[..=first] {
        joined.push_str(&s.push(t).unwrap());
    }
    assert!(
        s.stopped(),
        "the stop is in the complete text {:?}",
        s.text()
    );
    joined.push_str(&s.finish());
    assert_eq!(joined, "x");
}

/// A group of byte-fallback tokens that never makes a character: the decoder then rewrites
/// text already out ("\n" becomes U+FFFD beside the stray byte). The stream neither panics
/// nor loses what follows, and its text is the full decoding. While a character's bytes come
/// whole (`\n` and `€` in one group), the window waits instead of decoding everything.
#[test]
fn byte_fallback_groups_rewritten_or_whole() {
    let tok = sentencepiece();
    let id = |p: &str| tok.token_to_id(p).unwrap();
    let ids = [id("▁the"), id("<0x0A>"), id("<0xE2>"), id("a")];
    let mut s = TextStream::new(tok, vec![]);
    let mut joined = String::new();
    for t in ids {
        joined.push_str(&s.push(t).unwrap());
    }
    joined.push_str(&s.finish());
    assert_eq!(s.text(), decode(tok, &ids));
    assert!(
        joined.starts_with("the\n") && joined.ends_with('a'),
        "{joined:?}"
    );
    // "x\n€x": the newline and the euro sign's three bytes are one group of byte tokens.
    let ids = [
        id("x"),
        id("<0x0A>"),
        id("<0xE2>"),
        id("<0x82>"),
        id("<0xAC>"),
        id("x"),
    ];
    check(tok, &ids, &["€".to_string()], 0);
    check(tok, &ids, &[], 0);
}
