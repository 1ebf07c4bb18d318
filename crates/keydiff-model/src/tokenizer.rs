//! Byte-level BPE tokenizer built from GGUF `tokenizer.ggml.*` metadata.
//!
//! Mirrors llama.cpp's `src/llama-vocab.cpp` (as vendored by llama-cpp-python 0.3.36): the
//! pre-tokenizer follows `tokenizer.ggml.pre`, special tokens are those llama.cpp parses in text,
//! and the end-of-generation set is llama.cpp's. Unknown pre-tokenizers are refused, never guessed.

use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// A tokenizer built from GGUF metadata, with the facts generation needs.
pub struct GgufTokenizer {
    /// Byte-level BPE with the model's pre-tokenizer. Special tokens are parsed in text, as
    /// llama.cpp's `special=true`; `set_encode_special_tokens(true)` gives its `special=false`.
    /// No post-processor adds BOS.
    pub tokenizer: Tokenizer,
    /// `tokenizer.ggml.bos_token_id`, if the file has one.
    pub bos_id: Option<u32>,
    /// Tokens that end generation (llama.cpp's EOG set): EOS, EOT, EOM and known end markers.
    pub eos_ids: Vec<u32>,
    /// Whether the engine must prepend `bos_id` to a prompt: `tokenizer.ggml.add_bos_token`, else
    /// llama.cpp's default for the pre-tokenizer (true only for Llama 3).
    pub add_bos: bool,
    /// `tokenizer.chat_template`, the model's Jinja chat template.
    pub chat_template: Option<String>,
    /// Text of the BOS token, for the chat template's `bos_token`.
    pub bos_token: Option<String>,
    /// Text of the EOS token, for the chat template's `eos_token`.
    pub eos_token: Option<String>,
    /// The fill-in-the-middle tokens, when the file has all three.
    pub fim: Option<Fim>,
}

/// Fill-in-the-middle tokens: a prompt is `prefix` + text before the hole + `suffix` + text
/// after it + `middle`, and the model writes the hole (llama.cpp's infill, PSM order).
/// `repo` and `file_sep`, where the model has them, put other files of the project before
/// it (Qwen2.5-Coder's `<|repo_name|>` and `<|file_sep|>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fim {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    pub repo: Option<u32>,
    pub file_sep: Option<u32>,
}

impl Fim {
    /// The FIM tokens a vocabulary has by text (`id_of` finds a token's id), as llama.cpp
    /// detects them when the GGUF keys are absent; `None` unless all three are there.
    pub fn by_text(id_of: impl Fn(&str) -> Option<u32>) -> Option<Fim> {
        let find = |texts: &[&str]| texts.iter().find_map(|t| id_of(t));
        Some(Fim {
            prefix: find(FIM_PRE.1)?,
            suffix: find(FIM_SUF.1)?,
            middle: find(FIM_MID.1)?,
            repo: find(FIM_REP.1),
            file_sep: find(FIM_SEP.1),
        })
    }
}

// GGUF keys (llama.cpp src/llama-arch.cpp).
const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS_ID: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS_ID: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT_ID: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM_ID: &str = "tokenizer.ggml.eom_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

// `llama_token_type` values of `tokenizer.ggml.token_type` (llama.cpp include/llama.h).
const TOKEN_TYPE_UNKNOWN: u32 = 2;
const TOKEN_TYPE_CONTROL: u32 = 3;
const TOKEN_TYPE_USER_DEFINED: u32 = 4;

/// Texts llama.cpp treats as end of generation wherever they are in the vocab
/// (llama-vocab.cpp, "maintain a list of tokens that cause end-of-generation"). It also promotes
/// them to control tokens, so they are parsed in text.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// FIM tokens llama.cpp detects by text when their key is absent (llama-vocab.cpp, "auto-detect
/// special tokens by text"), each with its key. All become control tokens; pad, repo and
/// file-separator also end generation.
const FIM_PRE: (&str, &[&str]) = (
    "tokenizer.ggml.fim_pre_token_id",
    &[
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ],
);
const FIM_SUF: (&str, &[&str]) = (
    "tokenizer.ggml.fim_suf_token_id",
    &[
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ],
);
const FIM_MID: (&str, &[&str]) = (
    "tokenizer.ggml.fim_mid_token_id",
    &[
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ],
);
const FIM_PAD: (&str, &[&str]) = (
    "tokenizer.ggml.fim_pad_token_id",
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
);
const FIM_REP: (&str, &[&str]) = (
    "tokenizer.ggml.fim_rep_token_id",
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
);
const FIM_SEP: (&str, &[&str]) = ("tokenizer.ggml.fim_sep_token_id", &["<|file_sep|>"]);

/// GPT-2's regex as llama.cpp writes it (`LLAMA_VOCAB_PRE_TYPE_GPT2`). Text between matches
/// becomes its own piece, so it equals the `ByteLevel(use_regex)` regex, which adds `|\s+`.
const REGEX_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's regex in llama.cpp's spelling: `(?i:'s|…)` written out as `'[sS]|…`, which avoids
/// Unicode case folding (`ſ`, `K`) that llama.cpp does not do.
const REGEX_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's regex: Llama 3's with single digits (`\p{N}` instead of `\p{N}{1,3}`).
const REGEX_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_DEFAULT`: four regexes applied one after another.
const REGEXES_DEFAULT: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|]+",
    REGEX_GPT2,
    r"\p{N}+",
    "[0-9][0-9][0-9]",
];

/// The pre-tokenizers we support, by `tokenizer.ggml.pre`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pre {
    /// `default`, or no key at all: llama.cpp's fallback (it warns that quality degrades).
    Default,
    /// `gpt-2` (llama.cpp's spelling) or `gpt2`: the GPT-2 regex.
    Gpt2,
    /// `smollm`: every digit alone, then the GPT-2 regex.
    Smollm,
    /// `llama3`, `llama-v3`, `llama-bpe`: the Llama 3 regex, merges ignored for whole-word tokens.
    Llama3,
    /// `qwen2`: NFC, then the Qwen2 regex.
    Qwen2,
}

/// The `tokenizer.ggml.pre` names llama.cpp (`llama-vocab.cpp`) reads as each of the
/// pre-tokenizers here: the names converters write for other models on the same tokenizer
/// (DeepSeek-R1's Qwen distills, Falcon 3, Pixtral, ...). `gpt2` is keydiff's own spelling.
const PRE_GPT2: &[&str] = &[
    "gpt-2",
    "gpt2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "exaone4",
];
const PRE_LLAMA3: &[&str] = &[
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
];
const PRE_QWEN2: &[&str] = &["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"];

/// Every `tokenizer.ggml.pre` keydiff reads, for messages.
pub(crate) fn known_pre_tokenizers() -> String {
    let mut all = vec!["default", "smollm"];
    all.extend(PRE_GPT2.iter().chain(PRE_LLAMA3).chain(PRE_QWEN2));
    all.join(", ")
}

impl Pre {
    fn parse(value: Option<&str>) -> Result<Self> {
        match value {
            None => {
                tracing::warn!(
                    "GGUF has no `{KEY_PRE}`: using llama.cpp's `default` pre-tokenizer; \
                     tokenization may differ from the model's training"
                );
                Ok(Self::Default)
            }
            Some("default") => Ok(Self::Default),
            Some(v) if PRE_GPT2.contains(&v) => Ok(Self::Gpt2),
            Some("smollm") => Ok(Self::Smollm),
            Some(v) if PRE_LLAMA3.contains(&v) => Ok(Self::Llama3),
            Some(v) if PRE_QWEN2.contains(&v) => Ok(Self::Qwen2),
            Some(other) => Err(ModelError::UnknownPreTokenizer(other.to_string())),
        }
    }

    /// The pre-tokenizer, as in the models' tokenizer.json (and llama.cpp's regex lists).
    fn pre_tokenizer(self) -> Result<PreTokenizerWrapper> {
        let bytes_only = || ByteLevel::new(false, false, false).into();
        let steps: Vec<PreTokenizerWrapper> = match self {
            Self::Default => {
                let mut steps = REGEXES_DEFAULT
                    .iter()
                    .map(|re| isolate(re))
                    .collect::<Result<Vec<_>>>()?;
                steps.push(bytes_only());
                steps
            }
            Self::Gpt2 => vec![ByteLevel::new(false, false, true).into()],
            Self::Smollm => vec![
                Digits::new(true).into(),
                ByteLevel::new(false, false, true).into(),
            ],
            Self::Llama3 => vec![isolate(REGEX_LLAMA3)?, bytes_only()],
            Self::Qwen2 => vec![isolate(REGEX_QWEN2)?, bytes_only()],
        };
        Ok(Sequence::new(steps).into())
    }

    /// llama.cpp sets `ignore_merges` for Llama 3: a pre-token found whole in the vocab is kept.
    fn ignore_merges(self) -> bool {
        self == Self::Llama3
    }

    /// llama.cpp's `add_bos` when `tokenizer.ggml.add_bos_token` is absent: true only for Llama 3
    /// among these; every other BPE vocab starts from false.
    fn add_bos_default(self) -> bool {
        self == Self::Llama3
    }
}

/// A regex split that keeps both matches and the text between them as pieces, as llama.cpp does.
fn isolate(regex: &str) -> Result<PreTokenizerWrapper> {
    let split = Split::new(
        SplitPattern::Regex(regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| ModelError::Tokenizer(format!("bad pre-tokenizer regex `{regex}`: {e}")))?;
    Ok(split.into())
}

/// Builds the tokenizer and generation facts from a GGUF file's metadata.
///
/// Only byte-level BPE (`tokenizer.ggml.model = gpt2`) is supported; the pre-tokenizer must be
/// one llama.cpp names and we implement, or absent (llama.cpp's `default`).
pub fn tokenizer_from_gguf(ct: &Content) -> Result<GgufTokenizer> {
    let model = string(ct, KEY_MODEL)?.ok_or_else(|| missing(KEY_MODEL))?;
    if model != "gpt2" {
        return Err(ModelError::Tokenizer(format!(
            "`{KEY_MODEL} = {model}` is not supported: only byte-level BPE (`gpt2`) is"
        )));
    }
    let pre = Pre::parse(string(ct, KEY_PRE)?)?;

    let tokens = string_array(ct, KEY_TOKENS)?.ok_or_else(|| missing(KEY_TOKENS))?;
    let merges = string_array(ct, KEY_MERGES)?
        .ok_or_else(|| missing(KEY_MERGES))?
        .into_iter()
        .map(split_merge)
        .collect::<Result<Vec<_>>>()?;
    let types = match ct.metadata.get(KEY_TOKEN_TYPE) {
        Some(v) => Some(u32_array(v, KEY_TOKEN_TYPE)?),
        None => None,
    };
    if let Some(types) = &types {
        if types.len() != tokens.len() {
            return Err(ModelError::Tokenizer(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
    }

    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges())
        .build()
        .map_err(tok_err)?;
    let mut tokenizer = Tokenizer::new(bpe);
    if pre == Pre::Qwen2 {
        // Qwen2's tokenizer.json normalizes to NFC; llama.cpp does not (differs only on
        // decomposed input).
        tokenizer.with_normalizer(Some(NFC)).map_err(tok_err)?;
    }
    tokenizer.with_pre_tokenizer(Some(pre.pre_tokenizer()?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::new(false, false, false)));

    // Which tokens llama.cpp matches in text before BPE: control and unknown ones (with
    // `parse_special`), user-defined ones (always), plus the ones it promotes to control by text.
    let id_of = |text: &str| tokens.iter().position(|t| t == text).map(|i| i as u32);
    let mut special = vec![false; tokens.len()];
    let mut user_defined = vec![false; tokens.len()];
    if let Some(types) = &types {
        for (i, &ty) in types.iter().enumerate() {
            special[i] = ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_UNKNOWN;
            user_defined[i] = ty == TOKEN_TYPE_USER_DEFINED;
        }
    }
    // A FIM token comes from its key, else from its text; only a text match promotes it.
    let fim = |(key, texts): (&str, &[&str])| -> Result<(Option<u32>, bool)> {
        Ok(match token_id(ct, key, tokens.len())? {
            Some(id) => (Some(id), false),
            None => (texts.iter().find_map(|t| id_of(t)), true),
        })
    };
    let eog_by_text: Vec<u32> = tokens
        .iter()
        .enumerate()
        .filter(|(_, t)| EOG_TEXTS.contains(&t.as_str()))
        .map(|(i, _)| i as u32)
        .collect();
    let mut promoted = eog_by_text.clone();
    let mut eog = Vec::new();
    let mut fim_ids = Vec::new();
    for (group, ends) in [
        (FIM_PRE, false),
        (FIM_SUF, false),
        (FIM_MID, false),
        (FIM_PAD, true),
        (FIM_REP, true),
        (FIM_SEP, true),
    ] {
        let (id, by_text) = fim(group)?;
        fim_ids.push(id);
        if let Some(id) = id {
            if by_text {
                promoted.push(id);
            }
            if ends {
                eog.push(id);
            }
        }
    }
    for id in promoted {
        special[id as usize] = true;
    }

    let eos_id = token_id(ct, KEY_EOS_ID, tokens.len())?;
    let eot_id = token_id(ct, KEY_EOT_ID, tokens.len())?;
    let eom_id = token_id(ct, KEY_EOM_ID, tokens.len())?;
    let mut eos_ids = Vec::new();
    for id in [eos_id, eot_id, eom_id]
        .into_iter()
        .flatten()
        .chain(eog_by_text)
        .chain(eog)
    {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }

    // Content is the GGUF text as is: control and user-defined tokens are stored as raw text
    // (convert_hf_to_gguf.py), and `normalized(false)` matches them before NFC, like llama.cpp.
    let added = |want: &[bool], is_special: bool| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(want)
            .filter(|(_, &w)| w)
            .map(|(t, _)| AddedToken::from(t.clone(), is_special).normalized(false))
            .collect()
    };
    let user_defined: Vec<bool> = user_defined
        .iter()
        .zip(&special)
        .map(|(&u, &s)| u && !s)
        .collect();
    tokenizer
        .add_special_tokens(added(&special, true))
        .map_err(tok_err)?;
    tokenizer
        .add_tokens(added(&user_defined, false))
        .map_err(tok_err)?;

    let bos_id = token_id(ct, KEY_BOS_ID, tokens.len())?;
    let add_bos = match ct.metadata.get(KEY_ADD_BOS) {
        Some(v) => v.to_bool().map_err(|e| bad_value(KEY_ADD_BOS, e))?,
        None => pre.add_bos_default(),
    };
    if add_bos && bos_id.is_none() {
        return Err(ModelError::Tokenizer(format!(
            "BOS must be added (`{KEY_ADD_BOS}` or the pre-tokenizer's default) but `{KEY_BOS_ID}` is missing"
        )));
    }
    let text_of = |id: Option<u32>| -> Result<Option<String>> {
        id.map(|id| tokenizer.decode(&[id], false).map_err(tok_err))
            .transpose()
    };
    let bos_token = text_of(bos_id)?;
    let eos_token = text_of(eos_id)?;
    let chat_template = string(ct, KEY_CHAT_TEMPLATE)?.map(str::to_string);

    let fim = match fim_ids[..3] {
        [Some(prefix), Some(suffix), Some(middle)] => Some(Fim {
            prefix,
            suffix,
            middle,
            repo: fim_ids[4],
            file_sep: fim_ids[5],
        }),
        _ => None,
    };
    Ok(GgufTokenizer {
        tokenizer,
        bos_id,
        eos_ids,
        add_bos,
        chat_template,
        bos_token,
        eos_token,
        fim,
    })
}

/// Splits a merge `"a b"` at the first space after the first byte, as llama.cpp does.
fn split_merge(merge: String) -> Result<(String, String)> {
    merge
        .char_indices()
        .skip(1)
        .find(|&(_, c)| c == ' ')
        .map(|(i, _)| (merge[..i].to_string(), merge[i + 1..].to_string()))
        .ok_or_else(|| ModelError::Tokenizer(format!("bad merge `{merge}` in `{KEY_MERGES}`")))
}

fn string<'a>(ct: &'a Content, key: &str) -> Result<Option<&'a str>> {
    ct.metadata
        .get(key)
        .map(|v| {
            v.to_string()
                .map(String::as_str)
                .map_err(|e| bad_value(key, e))
        })
        .transpose()
}

fn string_array(ct: &Content, key: &str) -> Result<Option<Vec<String>>> {
    let Some(v) = ct.metadata.get(key) else {
        return Ok(None);
    };
    let items = v.to_vec().map_err(|e| bad_value(key, e))?;
    items
        .iter()
        .map(|v| v.to_string().cloned().map_err(|e| bad_value(key, e)))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn u32_array(v: &Value, key: &str) -> Result<Vec<u32>> {
    let items = v.to_vec().map_err(|e| bad_value(key, e))?;
    items.iter().map(|v| to_u32(v, key)).collect()
}

/// A token id key, checked to lie in the vocab. llama.cpp warns and ignores an id out of range;
/// we refuse it, since the file is then broken.
fn token_id(ct: &Content, key: &str, n_tokens: usize) -> Result<Option<u32>> {
    let Some(v) = ct.metadata.get(key) else {
        return Ok(None);
    };
    let id = to_u32(v, key)?;
    if id as usize >= n_tokens {
        return Err(ModelError::Tokenizer(format!(
            "`{key} = {id}` is outside the vocab of {n_tokens} tokens"
        )));
    }
    Ok(Some(id))
}

fn to_u32(v: &Value, key: &str) -> Result<u32> {
    let n: i128 = match *v {
        Value::U8(x) => x.into(),
        Value::I8(x) => x.into(),
        Value::U16(x) => x.into(),
        Value::I16(x) => x.into(),
        Value::U32(x) => x.into(),
        Value::I32(x) => x.into(),
        Value::U64(x) => x.into(),
        Value::I64(x) => x.into(),
        ref other => {
            return Err(ModelError::Tokenizer(format!(
                "`{key}` holds {other:?}, expected an integer"
            )))
        }
    };
    u32::try_from(n)
        .map_err(|_| ModelError::Tokenizer(format!("`{key}` holds {n}, expected a u32")))
}

fn missing(key: &str) -> ModelError {
    ModelError::MissingKey(key.to_string())
}

fn bad_value(key: &str, e: candle_core::Error) -> ModelError {
    ModelError::Tokenizer(format!("`{key}`: {}", keydiff_cache::without_backtrace(e)))
}

fn tok_err(e: tokenizers::Error) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::VersionedMagic;
    use std::collections::HashMap;

    const SPECIALS: &[&str] = &["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>"];
    const USER_DEFINED: &str = "<tool_call>";

    /// Every byte-level char, a few merged tokens, then control and user-defined tokens.
    fn content(pre: Option<&str>, model: &str) -> Content {
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort();
        let mut tokens: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
        let merges = ["1 2", "12 3", "4 5", "Ġ 1", "h i", "Ġ w", "Ġw o"];
        tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
        let mut types = vec![1i32; tokens.len()];
        for s in SPECIALS {
            tokens.push(s.to_string());
            types.push(TOKEN_TYPE_CONTROL as i32);
        }
        tokens.push(USER_DEFINED.to_string());
        types.push(TOKEN_TYPE_USER_DEFINED as i32);
        let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as u32;

        let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
        let mut metadata = HashMap::new();
        metadata.insert(KEY_MODEL.to_string(), Value::String(model.to_string()));
        if let Some(pre) = pre {
            metadata.insert(KEY_PRE.to_string(), Value::String(pre.to_string()));
        }
        metadata.insert(KEY_BOS_ID.into(), Value::U32(id("<|im_start|>")));
        metadata.insert(KEY_EOS_ID.into(), Value::U32(id("<|endoftext|>")));
        metadata.insert(KEY_CHAT_TEMPLATE.into(), Value::String("{{ x }}".into()));
        metadata.insert(
            KEY_TOKEN_TYPE.into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        );
        metadata.insert(
            KEY_MERGES.into(),
            strings(merges.iter().map(|m| m.to_string()).collect()),
        );
        metadata.insert(KEY_TOKENS.into(), strings(tokens));
        Content {
            magic: VersionedMagic::GgufV3,
            metadata,
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        }
    }

    fn load(pre: Option<&str>) -> GgufTokenizer {
        tokenizer_from_gguf(&content(pre, "gpt2")).unwrap()
    }

    fn pieces(tok: &GgufTokenizer, text: &str) -> Vec<String> {
        let enc = tok.tokenizer.encode(text, false).unwrap();
        enc.get_ids()
            .iter()
            .map(|&id| tok.tokenizer.id_to_token(id).unwrap())
            .collect()
    }

    #[test]
    fn smollm_splits_every_digit() {
        let tok = load(Some("smollm"));
        // The merges `1 2` and `12 3` exist, but digits are pre-tokenized one by one.
        assert_eq!(pieces(&tok, "12345"), ["1", "2", "3", "4", "5"]);
        assert_eq!(pieces(&tok, "hi 12"), ["hi", "Ġ", "1", "2"]);
    }

    #[test]
    fn llama3_groups_three_digits() {
        let tok = load(Some("llama3"));
        assert_eq!(pieces(&tok, "12345"), ["123", "45"]);
        assert!(tok.add_bos, "llama.cpp adds BOS for llama3 by default");
    }

    #[test]
    fn qwen2_single_digits_and_nfc() {
        let tok = load(Some("qwen2"));
        assert_eq!(pieces(&tok, "12345"), ["1", "2", "3", "4", "5"]);
        let ids = |s: &str| tok.tokenizer.encode(s, false).unwrap().get_ids().to_vec();
        assert_eq!(ids("e\u{301}"), ids("\u{e9}"));
        assert!(!tok.add_bos);
    }

    /// The names llama.cpp reads as Qwen 2's, Llama 3's or GPT-2's pre-tokenizer tokenize as
    /// those do (and Llama 3's add BOS as llama.cpp's do); an unknown name is refused with
    /// every known one listed.
    #[test]
    fn pre_tokenizer_aliases_are_llama_cpp_s() {
        for (alias, of) in [
            ("deepseek-r1-qwen", "qwen2"),
            ("megrez", "qwen2"),
            ("falcon3", "llama3"),
            ("pixtral", "llama3"),
            ("phi-2", "gpt2"),
            ("exaone4", "gpt2"),
        ] {
            let (a, b) = (load(Some(alias)), load(Some(of)));
            let text = "Hello 12345 wörld\n\n  e\u{301} it's";
            let ids =
                |t: &GgufTokenizer| t.tokenizer.encode(text, false).unwrap().get_ids().to_vec();
            assert_eq!(ids(&a), ids(&b), "{alias} as {of}");
            assert_eq!(a.add_bos, b.add_bos, "{alias}");
        }
        let err = Pre::parse(Some("tekken")).unwrap_err().to_string();
        assert!(
            err.contains("`tokenizer.ggml.pre = tekken`") && err.contains("deepseek-r1-qwen"),
            "{err}"
        );
    }

    #[test]
    fn missing_pre_is_llama_cpp_default() {
        let tok = load(None);
        assert_eq!(pieces(&tok, "12345"), ["123", "45"]);
        assert_eq!(pieces(&tok, "hi wo"), ["hi", "Ġwo"]);
    }

    #[test]
    fn unknown_pre_is_an_error() {
        let err = tokenizer_from_gguf(&content(Some("deepseek-llm"), "gpt2"))
            .err()
            .unwrap();
        assert!(matches!(err, ModelError::UnknownPreTokenizer(ref p) if p == "deepseek-llm"));
    }

    #[test]
    fn sentencepiece_model_is_an_error() {
        let err = tokenizer_from_gguf(&content(Some("default"), "llama"))
            .err()
            .unwrap();
        assert!(
            matches!(err, ModelError::Tokenizer(ref m) if m.contains("llama")),
            "{err}"
        );
    }

    #[test]
    fn special_tokens_are_one_id() {
        let tok = load(Some("smollm"));
        let text = "<|im_start|>hi<tool_call>12<|im_end|>";
        assert_eq!(
            pieces(&tok, text),
            ["<|im_start|>", "hi", USER_DEFINED, "1", "2", "<|im_end|>"]
        );
        let ids = tok
            .tokenizer
            .encode(text, false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(tok.tokenizer.decode(&ids, false).unwrap(), text);
        // Control tokens are special (skipped on request), user-defined ones are text.
        assert_eq!(tok.tokenizer.decode(&ids, true).unwrap(), "hi<tool_call>12");
    }

    #[test]
    fn generation_facts() {
        let tok = load(Some("smollm"));
        let id = |t: &str| tok.tokenizer.token_to_id(t).unwrap();
        assert_eq!(tok.bos_id, Some(id("<|im_start|>")));
        assert_eq!(tok.bos_token.as_deref(), Some("<|im_start|>"));
        assert_eq!(tok.eos_token.as_deref(), Some("<|endoftext|>"));
        assert_eq!(
            tok.eos_ids,
            [id("<|endoftext|>"), id("<|im_end|>"), id("<|eot_id|>")]
        );
        assert!(!tok.add_bos);
        assert_eq!(tok.chat_template.as_deref(), Some("{{ x }}"));
    }

    #[test]
    fn add_bos_key_overrides_default() {
        let mut ct = content(Some("llama3"), "gpt2");
        ct.metadata.insert(KEY_ADD_BOS.into(), Value::Bool(false));
        assert!(!tokenizer_from_gguf(&ct).unwrap().add_bos);
        let mut ct = content(Some("smollm"), "gpt2");
        ct.metadata.insert(KEY_ADD_BOS.into(), Value::Bool(true));
        assert!(tokenizer_from_gguf(&ct).unwrap().add_bos);
    }

    #[test]
    fn text_round_trips() {
        for pre in ["smollm", "llama3", "qwen2", "gpt-2", "default"] {
            let tok = load(Some(pre));
            let text = "It's 2024, héllo  wörld!\n\n\tok 😀";
            let ids = tok
                .tokenizer
                .encode(text, false)
                .unwrap()
                .get_ids()
                .to_vec();
            assert_eq!(tok.tokenizer.decode(&ids, false).unwrap(), text, "{pre}");
        }
    }

    #[test]
    fn fim_tokens_come_from_their_keys_else_their_texts() {
        assert_eq!(load(None).fim, None, "no FIM tokens, no infill");
        let mut c = content(None, "gpt2");
        let Some(Value::Array(tokens)) = c.metadata.get_mut(KEY_TOKENS) else {
            panic!("tokens")
        };
        let first = tokens.len() as u32;
        for t in [
            "<|fim_prefix|>",
            "<|fim_suffix|>",
            "<|fim_middle|>",
            "<fim_prefix>",
            "<|file_sep|>",
        ] {
            tokens.push(Value::String(t.into()));
        }
        let Some(Value::Array(types)) = c.metadata.get_mut(KEY_TOKEN_TYPE) else {
            panic!("types")
        };
        types.extend((0..5).map(|_| Value::I32(1)));
        let fim = tokenizer_from_gguf(&c).unwrap().fim;
        let want = Fim {
            prefix: first,
            suffix: first + 1,
            middle: first + 2,
            repo: None,
            file_sep: Some(first + 4),
        };
        assert_eq!(fim, Some(want));
        // The GGUF key wins over the text.
        c.metadata.insert(FIM_PRE.0.into(), Value::U32(first + 3));
        let fim = tokenizer_from_gguf(&c).unwrap().fim;
        assert_eq!(
            fim,
            Some(Fim {
                prefix: first + 3,
                ..want
            })
        );
        // The texts are found as they are for a tokenizer.json, too.
        let t = tokenizer_from_gguf(&c).unwrap().tokenizer;
        assert_eq!(Fim::by_text(|x| t.token_to_id(x)), Some(want));
    }
}
