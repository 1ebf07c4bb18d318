//! Multi-turn chat that keeps its KV cache between turns: each turn prefills only what the
//! chat template adds (the end of the last reply, the new user message, the assistant header)
//! on top of the cache, evicting under the engine's budget as a long prompt would, so a long
//! conversation runs in the fixed memory of N + B slots.

use std::time::Instant;

use keydiff_cache::KvCache;
use keydiff_model::Message;

use crate::engine::{Engine, GenerateParams, Output, Prompt, StopReason};
use crate::error::{EngineError, Result};
use crate::Event;

/// A conversation: its messages and the cache that holds them.
pub struct Conversation {
    pub(crate) messages: Vec<Message>,
    pub(crate) cache: Option<KvCache>,
    /// The template text the cache holds (with `pending`): what the next turn's rendering must
    /// start with for the cache to be reused.
    pub(crate) fed_text: String,
    /// The reply's last token, sampled but not yet in the cache (none after an end-of-turn
    /// token, which the template writes itself).
    pub(crate) pending: Option<u32>,
    /// The tokens the cache holds, in order (its first slots while it has not evicted).
    pub(crate) fed_tokens: Vec<u32>,
    /// The engine that made the cache ([`Engine::id`]).
    pub(crate) engine: Option<u64>,
}

impl Conversation {
    /// A new conversation, with a system message when given.
    pub fn new(system: Option<&str>) -> Self {
        Self {
            messages: system
                .map(|s| vec![Message::new("system", s.to_string())])
                .unwrap_or_default(),
            cache: None,
            fed_text: String::new(),
            pending: None,
            fed_tokens: Vec::new(),
            engine: None,
        }
    }

    /// The messages so far (system, user and assistant).
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Tokens the conversation has seen (the absolute position of the next one).
    pub fn position(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.position())
    }

    /// Slots the cache holds now (at most N + B with a budget).
    pub fn cache_len(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.len())
    }
}

impl Engine {
    /// One turn of `conv`: appends the user message `user`, prefills what the chat template
    /// adds on top of the cache, and generates the reply (appended as the assistant message).
    ///
    /// The cache is reused when the template's rendering of the whole conversation starts
    /// with the text it already holds (true of ChatML, Llama 3 and most templates). A
    /// template that rewrites earlier turns (Qwen 3's drops the reasoning of earlier replies)
    /// keeps the tokens the cache and the conversation's tokens have in common, where the
    /// cache can be cut back to them (it never evicted, and its policy keeps no attention
    /// sums); otherwise the conversation is prefilled afresh, which `stats.prefix_tokens` = 0
    /// shows. `params.prompt` is ignored; `Output::prompt_tokens`
    /// are the tokens this turn prefilled, and `stats.prefix_tokens` the tokens kept from
    /// earlier turns. With a budget the cache holds at most N + B slots whatever the length
    /// of the conversation; without one it grows (at least doubling) up to the context.
    pub fn chat_turn(
        &self,
        conv: &mut Conversation,
        user: &str,
        params: &GenerateParams,
        mut on_event: impl FnMut(Event<'_>),
    ) -> Result<Output> {
        self.check_params(params)?;
        if params.prompt_logprobs.is_some() {
            return Err(EngineError::BadParams(
                "prompt logprobs are not available in a chat turn, which prefills only what \
                 the conversation adds"
                    .into(),
            ));
        }
        if user.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let t0 = Instant::now();
        let mut messages = conv.messages.clone();
        messages.push(Message::new("user", user.to_string()));
        let text = self.render_chat(&messages)?;
        let reuse = conv.cache.is_some() && text.starts_with(&conv.fed_text);
        let (feed, kept) = if reuse {
            let delta = &text[conv.fed_text.len()..];
            let mut ids: Vec<u32> = conv.pending.into_iter().collect();
            ids.extend(self.tokenize_special(delta)?);
            (ids, conv.position())
        } else {
            let ids = self.prompt_tokens(&Prompt::Chat(messages.clone()))?;
            let common = (conv.fed_tokens.iter().zip(&ids))
                .take_while(|(a, b)| a == b)
                .count();
            // At least one token is fed, for the logits of the reply's first.
            let keep = common.min(ids.len() - 1);
            match conv.cache.as_mut() {
                Some(c) if keep > 0 && keep <= c.len() && c.can_truncate() => {
                    tracing::info!(
                        kept = keep,
                        "the chat template rewrites earlier turns: going on from the tokens \
                         in common"
                    );
                    c.truncate(keep)?;
                    conv.fed_tokens.truncate(keep);
                    (ids[keep..].to_vec(), keep)
                }
                cache => {
                    if cache.is_some() {
                        tracing::warn!(
                            "the chat template rewrites earlier turns: prefilling the \
                             conversation afresh"
                        );
                    }
                    conv.cache = None;
                    conv.fed_tokens.clear();
                    (ids, 0)
                }
            }
        };
        if feed.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.check_vocab(&feed)?;
        let context = self.within_context(kept + feed.len())?;
        let need = (kept + feed.len())
            .saturating_add(params.max_tokens)
            .min(context);
        if conv.cache.is_some() {
            self.check_owner(conv.engine, "the conversation")?;
        }
        conv.engine = Some(self.id());
        let cfg = self.config().cache.clone();
        let mut cache = match conv.cache.take() {
            // A budgeted cache gets its N + B slots once; a full one what this turn needs.
            None => self.new_cache(if cfg.budget.is_some() { context } else { need })?,
            Some(c) if cfg.budget.is_none() && c.capacity() < need => {
                let grown = need.max(2 * c.capacity()).min(context);
                self.check_cache_memory(&cfg, grown, 0)?;
                c.grown(grown)?
            }
            Some(c) => c,
        };
        // On an error the cache (which may hold part of this turn) is dropped: the next turn
        // prefills the conversation afresh, without the failed message.
        let (mut out, last) = self.run_request_after(
            &mut cache,
            &conv.fed_tokens,
            &feed,
            0,
            params,
            t0,
            &mut on_event,
        )?;
        if out.stats.stop_reason == StopReason::Cancelled && out.tokens.is_empty() {
            // Cancelled before the reply began (perhaps inside the prefill): the turn is not
            // recorded, and the next one prefills the conversation afresh.
            return Ok(out);
        }
        out.stats.prefix_tokens = kept;
        // The cache holds what was fed and the reply but for its last token.
        conv.fed_tokens.extend(&feed);
        conv.fed_tokens
            .extend(&out.tokens[..out.tokens.len().saturating_sub(1)]);
        let content = self.detokenize(&out.tokens)?;
        conv.pending = match out.stats.stop_reason {
            StopReason::Eos => None,
            _ => last,
        };
        conv.fed_text = format!("{text}{content}");
        messages.push(Message::new("assistant", content));
        conv.messages = messages;
        conv.cache = Some(cache);
        // The next turn may come from another thread (see [`Engine`]).
        self.settle()?;
        Ok(out)
    }
}
