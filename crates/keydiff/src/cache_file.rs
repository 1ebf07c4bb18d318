//! A [`PromptCache`] saved to a file and loaded again (llama.cpp's `--prompt-cache`): a long
//! document prefilled once under a budget, kept as its N slots per layer and head, goes on in a
//! later process without its prefill.
//!
//! The file is safetensors: per layer `layers.{i}.keys` and `layers.{i}.values`
//! (`[kv_heads, len, head_dim]` in the cache's dtype, or u8 `[kv_heads, len, head_dim / 32 ·
//! bytes]` of a quantized cache's blocks, `q8_0`, `q4_0`, ...; keys and values each in their
//! own type, which the header names),
//! `layers.{i}.positions` (u32) and `layers.{i}.state` (f32, `[kv_heads, len]`), only the used
//! slots; a prompt cache that holds its whole prompt also has `prompt_logits` (f32, `[vocab]`,
//! the logits the prompt left: the same prompt again needs no prefill); its metadata has `format: keydiff-kv-cache` and, under `keydiff`, a JSON [`Header`]:
//! the model's digest, the cache settings, the tokens the cache stands for and what a continued
//! conversation needs.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::safetensors::Load;
use candle_core::{Device, Tensor};
use keydiff_cache::{CacheConfig, CacheCounters, KvCache, KvCacheParts, LayerParts};
use keydiff_model::{Loaded, ModelFormat};
use sha2::{Digest, Sha256};

use keydiff_model::Message;

use crate::conversation::Conversation;
use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::prompt_cache::{PromptCache, Reuse};

/// The `format` a cache file's metadata names.
pub const CACHE_FILE_FORMAT: &str = "keydiff-kv-cache";
/// The version of the layout this keydiff writes; it reads this one and the ones before it
/// (version 2 added `prompt_logits`).
pub const CACHE_FILE_VERSION: u32 = 2;
/// The tensor of the logits the whole prompt left.
const PROMPT_LOGITS: &str = "prompt_logits";

/// What a cache file holds besides its tensors.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Header {
    version: u32,
    /// The keydiff that wrote it.
    written_by: String,
    model: ModelId,
    /// What the cache holds (`f32`, `f16`, `q8_0`, `f16/q4_0`, ...).
    kv_dtype: String,
    /// Whether it holds keys or values Hadamard-rotated (files written before the rotation
    /// existed hold none).
    #[serde(default)]
    kv_rotated: bool,
    cache: CacheConfig,
    /// Tokens seen: the position of the next one.
    position: usize,
    counters: CacheCounters,
    policy_state: Vec<u64>,
    /// Each layer's next position.
    next_positions: Vec<usize>,
    /// The tokens the cache was fed.
    tokens: Vec<u32>,
    /// How many of them were the prompt.
    prompt_len: usize,
    /// The text they stand for, when known (a conversation goes on from it).
    text: Option<String>,
    /// Generated tokens in the text that the cache was not fed.
    pending: Vec<u32>,
    /// A saved [`Conversation`]'s messages (`keydiff chat`); none for a prompt cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    messages: Option<Vec<SavedMessage>>,
    /// With `prompt_logits`: a digest of the prompt tokens they follow ([`tokens_digest`]),
    /// so that logits are never taken for another prompt (a header edited by hand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    logits_for: Option<String>,
}

/// SHA-256 of token ids (little-endian u32s), in hex.
fn tokens_digest(tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A conversation's message in a cache file.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct SavedMessage {
    role: String,
    content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<String>,
}

/// Which model a cache was made with.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct ModelId {
    /// See [`Engine::model_digest`].
    digest: String,
    /// Where it was loaded from (for messages only: the same file elsewhere is the same model).
    origin: String,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Model files up to this size are hashed whole.
const WHOLE_BYTES: u64 = 64 << 20;
/// Beyond it: the first MiB (GGUF metadata, safetensors headers) and 256 windows of 64 KiB
/// spread over the file.
const HEAD_BYTES: u64 = 1 << 20;
const SAMPLES: u64 = 256;
const SAMPLE_BYTES: u64 = 64 << 10;

/// SHA-256 over each file the model was read from (its size, and its bytes: all of them up to
/// 64 MiB, beyond that the first MiB and 256 windows of 64 KiB spread over it, 17 MiB read
/// where the whole of an 8B model would take seconds), the model's hyper-parameters as it runs
/// them (RoPE settings included), and for random weights their origin (preset and seed).
/// Another checkpoint, quantization or fine-tune changes the sampled weight bytes (a
/// fine-tune changes every linear, and linears fill such files); the same file copied
/// elsewhere keeps its digest. Beyond 64 MiB it is a sample: two files that differ only in
/// bytes no window reads (a few norm weights, say) share a digest.
pub(crate) fn model_digest(loaded: &Loaded) -> std::result::Result<String, String> {
    let mut h = Sha256::new();
    h.update(b"keydiff model digest 1\0");
    for path in &loaded.files {
        let io = |e: std::io::Error| format!("{}: {e}", path.display());
        let mut f = std::fs::File::open(path).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        h.update(len.to_le_bytes());
        if len <= WHOLE_BYTES {
            std::io::copy(&mut f, &mut h).map_err(io)?;
            continue;
        }
        let mut read_at = |at: u64, n: u64| -> std::result::Result<(), String> {
            let mut buf = vec![0u8; n as usize];
            f.seek(SeekFrom::Start(at)).map_err(io)?;
            f.read_exact(&mut buf).map_err(io)?;
            h.update(&buf);
            Ok(())
        };
        read_at(0, HEAD_BYTES)?;
        for k in 0..SAMPLES {
            read_at((len - SAMPLE_BYTES) * k / (SAMPLES - 1), SAMPLE_BYTES)?;
        }
    }
    let cfg = serde_json::to_string(loaded.model.config()).map_err(|e| e.to_string())?;
    h.update(cfg.as_bytes());
    if loaded.format == ModelFormat::Random {
        h.update(loaded.origin.as_bytes());
    }
    Ok(h.finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>())
}

/// The settings of a cache in a line, for messages.
fn describe(c: &CacheConfig) -> String {
    match c.budget {
        None => format!("a full cache in chunks of {}", c.chunk),
        Some(n) => format!(
            "policy {}, budget {n}, chunk {}, window {}, sinks {}, evict-every {}",
            c.policy.name(),
            c.chunk,
            c.window,
            c.sinks,
            c.evict_every()
        ),
    }
}

impl Engine {
    /// Writes the cache `pc` holds to `path` (through a temporary file beside it, renamed over
    /// `path`, so that a reader never sees half a file), with the tokens it stands for and
    /// this model's digest; the bytes written. `None` when `pc` holds nothing: it keeps only
    /// caches it may reuse (an evicted cache only under [`Reuse::Continue`]).
    pub fn save_prompt_cache(&self, pc: &PromptCache, path: &Path) -> Result<Option<u64>> {
        let Some(cache) = pc.cache().filter(|c| c.position() > 0) else {
            return Ok(None);
        };
        let saved = Saved {
            tokens: &pc.tokens,
            prompt_len: pc.prompt_len,
            text: pc.text.as_deref(),
            pending: &pc.pending,
            messages: None,
            logits: pc.logits.as_ref(),
        };
        self.write_cache_file(cache, saved, path).map(Some)
    }

    /// Writes `conv` (its messages and its cache) to `path`, as
    /// [`Engine::save_prompt_cache`] writes a prompt cache: `keydiff chat --prompt-cache`
    /// resumes it in a later process. The bytes written; `None` before its first turn.
    pub fn save_conversation(&self, conv: &Conversation, path: &Path) -> Result<Option<u64>> {
        let Some(cache) = conv.cache.as_ref().filter(|c| c.position() > 0) else {
            return Ok(None);
        };
        if let Some(m) = conv.messages.iter().find(|m| !m.tool_calls.is_empty()) {
            return Err(EngineError::BadParams(format!(
                "a conversation with tool calls cannot be saved (a `{}` message has them)",
                m.role
            )));
        }
        let messages = conv
            .messages
            .iter()
            .map(|m| SavedMessage {
                role: m.role.clone(),
                content: m.content.clone(),
                reasoning_content: m.reasoning_content.clone(),
            })
            .collect();
        let pending: Vec<u32> = conv.pending.into_iter().collect();
        let saved = Saved {
            tokens: &conv.fed_tokens,
            prompt_len: conv.fed_tokens.len(),
            text: Some(&conv.fed_text),
            pending: &pending,
            messages: Some(messages),
            logits: None,
        };
        self.write_cache_file(cache, saved, path).map(Some)
    }

    fn write_cache_file(&self, cache: &KvCache, saved: Saved<'_>, path: &Path) -> Result<u64> {
        let bad = |reason: String| EngineError::CacheFile {
            path: path.to_path_buf(),
            reason,
        };
        let parts = cache.parts()?;
        let m = self.model_config();
        let header = Header {
            version: CACHE_FILE_VERSION,
            written_by: format!("keydiff {}", env!("CARGO_PKG_VERSION")),
            model: ModelId {
                digest: self.model_digest()?,
                origin: self.loaded().origin.clone(),
                layers: m.num_layers,
                kv_heads: m.num_kv_heads,
                head_dim: m.head_dim,
            },
            kv_dtype: self.model().kv_dtype().to_string(),
            kv_rotated: self.model().kv_rotated(),
            cache: parts.config.clone(),
            position: parts.position,
            counters: parts.counters,
            policy_state: parts.policy_state.clone(),
            next_positions: parts.layers.iter().map(|l| l.next_position).collect(),
            tokens: saved.tokens.to_vec(),
            prompt_len: saved.prompt_len,
            text: saved.text.map(str::to_owned),
            pending: saved.pending.to_vec(),
            messages: saved.messages,
            logits_for: saved
                .logits
                .map(|_| tokens_digest(&saved.tokens[..saved.prompt_len])),
        };
        let json = serde_json::to_string(&header).map_err(|e| bad(e.to_string()))?;
        let meta = HashMap::from([
            ("format".to_string(), CACHE_FILE_FORMAT.to_string()),
            ("keydiff".to_string(), json),
        ]);
        // Contiguous host copies, so that writing them cannot fail half-way.
        let host = |t: &Tensor| t.to_device(&Device::Cpu)?.contiguous();
        let mut tensors = Vec::with_capacity(4 * parts.layers.len());
        for (i, l) in parts.layers.iter().enumerate() {
            for (name, t) in [
                ("keys", &l.keys),
                ("values", &l.values),
                ("positions", &l.positions),
                ("state", &l.state),
            ] {
                tensors.push((format!("layers.{i}.{name}"), host(t)?));
            }
        }
        if let Some(l) = saved.logits {
            let l = l.to_dtype(candle_core::DType::F32)?;
            tensors.push((PROMPT_LOGITS.to_string(), host(&l)?));
        }
        let tmp = temporary_beside(path);
        safetensors::serialize_to_file(tensors, Some(meta), &tmp).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            bad(format!("cannot write {}: {e}", tmp.display()))
        })?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            bad(format!("cannot move {} over it: {e}", tmp.display()))
        })?;
        let bytes = std::fs::metadata(path)
            .map_err(|e| bad(e.to_string()))?
            .len();
        tracing::info!(
            path = %path.display(),
            tokens = saved.tokens.len(),
            slots = cache.len(),
            bytes,
            "KV cache saved"
        );
        Ok(bytes)
    }

    /// Reads a cache [`Engine::save_prompt_cache`] wrote into a [`PromptCache`] that reuses as
    /// `reuse` says, on this engine's device. Refused, with the reason, when the file is not
    /// one (or is damaged), was made with another model (see [`Engine::model_digest`]),
    /// another cache dtype or other cache settings than this engine's, holds a cache that
    /// evicted while `reuse` is [`Reuse::Exact`] (which could reuse none of it), or does not
    /// fit in memory.
    pub fn load_prompt_cache(&self, path: &Path, reuse: Reuse) -> Result<PromptCache> {
        self.load_prompt_cache_beside(path, reuse, 0)
    }

    /// [`Engine::load_prompt_cache`] beside `held` bytes that the memory budget does not see
    /// (caches a server keeps or runs).
    pub fn load_prompt_cache_beside(
        &self,
        path: &Path,
        reuse: Reuse,
        held: u64,
    ) -> Result<PromptCache> {
        let (h, cache, logits) = self.read_cache_file(path, reuse, held)?;
        if h.messages.is_some() {
            // Its caller would save a prompt cache over it: the conversation would be lost.
            return Err(EngineError::CacheFile {
                path: path.to_path_buf(),
                reason: "it holds a conversation (chat --prompt-cache), not a prompt cache".into(),
            });
        }
        let mut pc = PromptCache::with_reuse(reuse);
        pc.tokens = h.tokens;
        pc.prompt_len = h.prompt_len;
        pc.cache = Some(cache);
        pc.engine = Some(self.id());
        // Its copies to the device may still run (see [`Engine`]).
        self.settle()?;
        pc.text = h.text;
        pc.pending = h.pending;
        pc.logits = logits;
        Ok(pc)
    }

    /// Reads a conversation [`Engine::save_conversation`] wrote, to go on with its next turn
    /// (refused, with the reason, as [`Engine::load_prompt_cache`] refuses a file, and when
    /// the file holds a prompt cache rather than a conversation).
    pub fn load_conversation(&self, path: &Path) -> Result<Conversation> {
        let (h, cache, _) = self.read_cache_file(path, Reuse::Continue, 0)?;
        // Its copies to the device may still run (see [`Engine`]).
        self.settle()?;
        let bad = |reason: &str| EngineError::CacheFile {
            path: path.to_path_buf(),
            reason: reason.into(),
        };
        let messages = h.messages.ok_or_else(|| {
            bad("it holds a prompt cache (run --prompt-cache), not a conversation")
        })?;
        let (Some(text), [] | [_]) = (h.text, h.pending.as_slice()) else {
            return Err(bad(
                "its conversation has no text, or more than one pending token",
            ));
        };
        if h.prompt_len != h.tokens.len() {
            return Err(bad("its conversation's tokens do not add up"));
        }
        Ok(Conversation {
            messages: messages
                .into_iter()
                .map(|m| Message {
                    role: m.role,
                    content: m.content,
                    reasoning_content: m.reasoning_content,
                    ..Message::default()
                })
                .collect(),
            cache: Some(cache),
            engine: Some(self.id()),
            fed_text: text,
            pending: h.pending.first().copied(),
            fed_tokens: h.tokens,
        })
    }

    /// Reads and checks a cache file (see [`Engine::load_prompt_cache`]): its header, its
    /// cache and the logits its whole prompt left (when it has them), on this engine's device.
    fn read_cache_file(
        &self,
        path: &Path,
        reuse: Reuse,
        held: u64,
    ) -> Result<(Header, KvCache, Option<Tensor>)> {
        let bad = |reason: String| EngineError::CacheFile {
            path: path.to_path_buf(),
            reason,
        };
        let file = std::fs::File::open(path).map_err(|e| {
            bad(if e.kind() == std::io::ErrorKind::NotFound {
                "no such file".into()
            } else {
                e.to_string()
            })
        })?;
        // Mapped, not read: the tensors are copied once, layer by layer, and only after the
        // header has been checked and the cache planned against the memory there is.
        // SAFETY: the file is only read, and a cache file is not modified while it is loaded
        // (it is replaced by a rename when saved again).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| bad(e.to_string()))?;
        let bytes: &[u8] = &map;
        let not_st = |e: safetensors::SafeTensorError| bad(format!("not a safetensors file: {e}"));
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(not_st)?;
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes).map_err(not_st)?;
        let meta = header.metadata().clone().unwrap_or_default();
        if meta.get("format").map(String::as_str) != Some(CACHE_FILE_FORMAT) {
            return Err(bad(format!(
                "not a keydiff KV cache (its metadata has no `format: {CACHE_FILE_FORMAT}`)"
            )));
        }
        let json = meta
            .get("keydiff")
            .ok_or_else(|| bad("its metadata has no `keydiff` header".into()))?;
        let version = serde_json::from_str::<serde_json::Value>(json)
            .ok()
            .and_then(|v| v.get("version").and_then(|v| v.as_u64()));
        if !version.is_some_and(|v| (1..=CACHE_FILE_VERSION as u64).contains(&v)) {
            return Err(bad(format!(
                "a cache file of version {}; this keydiff reads versions 1 to {CACHE_FILE_VERSION}",
                version.map_or("(none)".into(), |v| v.to_string())
            )));
        }
        let mut h: Header =
            serde_json::from_str(json).map_err(|e| bad(format!("its header: {e}")))?;
        let digest = self.model_digest()?;
        if h.model.digest != digest {
            let short = |d: &str| d.chars().take(12).collect::<String>();
            return Err(bad(format!(
                "made with another model ({}, digest {}…); this one is {} (digest {}…)",
                h.model.origin,
                short(&h.model.digest),
                self.loaded().origin,
                short(&digest)
            )));
        }
        let kv_dtype = self.model().kv_dtype().to_string();
        if h.kv_dtype != kv_dtype {
            return Err(bad(format!(
                "holds a {} cache; this run's is {kv_dtype} (--kv-dtype, --cache-type-k/-v)",
                h.kv_dtype
            )));
        }
        let rotated = self.model().kv_rotated();
        if h.kv_rotated != rotated {
            let on = |r: bool| if r { "rotated" } else { "not rotated" };
            return Err(bad(format!(
                "holds a {} {kv_dtype} cache; this run's is {} (--no-kv-rotation)",
                on(h.kv_rotated),
                on(rotated)
            )));
        }
        let cfg = &self.config().cache;
        if &h.cache != cfg {
            return Err(bad(format!(
                "made under {}; this run has {}",
                describe(&h.cache),
                describe(cfg)
            )));
        }
        // What `PromptCache::store` would not keep under exact reuse: it could stand for none
        // of a prompt (but the same prompt again, when it holds that prompt's logits).
        let sums = cfg.policy.stats_need() == keydiff_cache::StatsNeed::AllRows;
        let whole = st.tensor(PROMPT_LOGITS).is_ok() && h.position == h.prompt_len;
        if reuse == Reuse::Exact && (h.counters.evictions > 0 || sums) && !whole {
            return Err(bad(format!(
                "its cache {}, and exact reuse takes only what a fresh prefill shares \
                 (continue goes on from it)",
                if sums {
                    "sums attention over every token (H2O)"
                } else {
                    "has evicted"
                }
            )));
        }
        let m = self.model_config();
        if h.tokens.len() != h.position || h.prompt_len > h.tokens.len() {
            return Err(bad(format!(
                "its header lists {} tokens ({} of the prompt) for a cache that saw {}",
                h.tokens.len(),
                h.prompt_len,
                h.position
            )));
        }
        if h.position == 0 || h.position > m.context() {
            return Err(bad(format!(
                "it saw {} tokens; the context is {}",
                h.position,
                m.context()
            )));
        }
        self.check_vocab(&h.tokens)
            .and_then(|()| self.check_vocab(&h.pending))
            .map_err(|e| bad(e.to_string()))?;
        let logits_view = st.tensor(PROMPT_LOGITS).ok();
        let cache_tensors = st.len() - usize::from(logits_view.is_some());
        if h.next_positions.len() != m.num_layers || cache_tensors != 4 * m.num_layers {
            return Err(bad(format!(
                "{} layers and {cache_tensors} cache tensors; a cache of this model's {} layers \
                 has {}",
                h.next_positions.len(),
                m.num_layers,
                4 * m.num_layers
            )));
        }
        if let Some(v) = &logits_view {
            let want = [m.vocab_size];
            if v.shape() != want || v.dtype() != safetensors::Dtype::F32 {
                return Err(bad(format!(
                    "tensor `{PROMPT_LOGITS}` is {:?} {:?}; this model's logits are {want:?} F32",
                    v.shape(),
                    v.dtype()
                )));
            }
            if h.logits_for.as_deref() != Some(&tokens_digest(&h.tokens[..h.prompt_len])) {
                return Err(bad(format!(
                    "its `{PROMPT_LOGITS}` do not follow the {} prompt tokens its header lists",
                    h.prompt_len
                )));
            }
            // They stand for the cache as the prompt left it: where it went on past the
            // prompt, it must be one that can be cut back there.
            if h.prompt_len != h.position && (h.counters.evictions > 0 || sums) {
                return Err(bad(format!(
                    "it has the prompt's logits, but its cache went on {} tokens past the \
                     prompt's {} and cannot be cut back to it",
                    h.position - h.prompt_len,
                    h.prompt_len
                )));
            }
        }
        // Every tensor's shape, before anything is copied: the slots are layer 0's keys'.
        let view = |i: usize, name: &str| {
            let key = format!("layers.{i}.{name}");
            st.tensor(&key)
                .map(|v| (key.clone(), v))
                .map_err(|_| bad(format!("tensor `{key}` is missing")))
        };
        let (_, k0) = view(0, "keys")?;
        let len = match k0.shape() {
            [_, len, _] => *len,
            other => return Err(bad(format!("layer 0's keys are {other:?}"))),
        };
        let (kv, d) = (m.num_kv_heads, m.head_dim);
        let types = self.model().kv_dtype();
        let slot_bytes = types.slot_bytes(d);
        let st_of = |t: keydiff_cache::KvType| safetensors::Dtype::from(t.storage_dtype());
        for i in 0..m.num_layers {
            for (name, shape, dtype) in [
                ("keys", vec![kv, len, types.k.row_len(d)], st_of(types.k)),
                ("values", vec![kv, len, types.v.row_len(d)], st_of(types.v)),
                ("positions", vec![kv, len], safetensors::Dtype::U32),
                ("state", vec![kv, len], safetensors::Dtype::F32),
            ] {
                let (key, v) = view(i, name)?;
                if v.shape() != shape.as_slice() || v.dtype() != dtype {
                    return Err(bad(format!(
                        "tensor `{key}` is {:?} {:?}; this model's cache of {len} slots needs \
                         {shape:?} {dtype:?}",
                        v.shape(),
                        v.dtype()
                    )));
                }
            }
        }
        // Room to go on: a budgeted cache's N + B slots (as a conversation's), a full one's
        // slots (it grows when a request needs more). On the CPU each layer's slots pass
        // through a host copy on their way in.
        let capacity = match cfg.budget {
            Some(_) => cfg.slots_for(m.context()).max(len),
            None => len,
        };
        let passing = if self.config().device.is_cpu() {
            (m.num_layers * kv * len * (slot_bytes + 8)) as u64
        } else {
            0
        };
        self.check_cache_memory_beside(cfg, capacity, passing, held)?;
        let mut layers = Vec::with_capacity(m.num_layers);
        for (i, &next_position) in h.next_positions.iter().enumerate() {
            let get = |name: &str| -> Result<Tensor> {
                let (key, v) = view(i, name)?;
                v.load(&Device::Cpu).map_err(|e| {
                    let e = keydiff_cache::without_backtrace(e);
                    bad(format!("tensor `{key}`: {e}"))
                })
            };
            layers.push(LayerParts {
                kv: types,
                keys: get("keys")?,
                values: get("values")?,
                positions: get("positions")?,
                state: get("state")?,
                next_position,
            });
        }
        let parts = KvCacheParts {
            config: h.cache.clone(),
            position: h.position,
            counters: h.counters,
            policy_state: std::mem::take(&mut h.policy_state),
            layers,
        };
        let mut cache = KvCache::from_parts(&parts, capacity, &self.config().device)
            .map_err(|e| bad(e.to_string()))?;
        cache.set_evict_per_layer(self.config().evict_per_layer);
        let logits = match logits_view {
            Some(v) => Some(v.load(&self.config().device).map_err(|e| {
                let e = keydiff_cache::without_backtrace(e);
                bad(format!("tensor `{PROMPT_LOGITS}`: {e}"))
            })?),
            None => None,
        };
        tracing::info!(
            path = %path.display(),
            tokens = h.tokens.len(),
            slots = len,
            "KV cache loaded"
        );
        Ok((h, cache, logits))
    }

    /// Loads a saved prompt cache in place of the one `pc` holds ([`Engine::load_prompt_cache`],
    /// reusing as `pc` does), planned beside it (both exist until the new one is in); `pc` is
    /// left as it was when the file is refused. The tokens it holds.
    pub fn restore_prompt_cache(&self, path: &Path, pc: &mut PromptCache) -> Result<usize> {
        let held = match self.config().memory_limit {
            Some(_) => pc.bytes() as u64,
            // A measured budget sees the held cache's written slots, and the rest is never
            // written while it is held.
            None => 0,
        };
        let loaded = self.load_prompt_cache_beside(path, pc.reuse(), held)?;
        let prompt_only = pc.prompt_only;
        *pc = loaded;
        pc.set_prompt_only(prompt_only);
        Ok(pc.tokens().len())
    }

    /// A digest of the model as this engine runs it: the files it was read from, sampled, and
    /// its hyper-parameters (see the module's documentation). Saved caches carry it, and a
    /// cache made with another model is refused. Computed once.
    pub fn model_digest(&self) -> Result<String> {
        if let Some(d) = self.digest_cell().get() {
            return Ok(d.clone());
        }
        // Kept once made; a failure to read the files is not kept (it may pass).
        let d = model_digest(self.loaded())
            .map_err(|e| EngineError::BadParams(format!("cannot read the model's files: {e}")))?;
        Ok(self.digest_cell().get_or_init(|| d).clone())
    }
}

/// What a cache file holds beside the cache.
struct Saved<'a> {
    tokens: &'a [u32],
    prompt_len: usize,
    text: Option<&'a str>,
    pending: &'a [u32],
    messages: Option<Vec<SavedMessage>>,
    /// The logits the whole prompt left (a prompt cache's).
    logits: Option<&'a Tensor>,
}

/// `path` with `.tmp-<pid>` added to its name.
fn temporary_beside(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}
