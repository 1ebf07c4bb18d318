//! Several requests decoded together.
//!
//! Each request is prefilled alone, in chunks of B, evicting under its own KV budget as a
//! single request does; then every running request's next token goes through the model in one
//! pass ([`keydiff_model::Model::forward_batch`]): the linears and the LM head read their
//! weights once for all of them, which is what bounds a decode step (memory bandwidth), while
//! attention and eviction run per request on its own cache. Requests can join between steps
//! and leave when they end (continuous batching): [`Batch`]. [`Engine::generate_batch`] runs
//! a list of requests to the end.
//!
//! A request's tokens and text are the ones it gets alone (its sampler, penalties, seed, stop
//! strings, logprobs and cancel are its own), up to the difference between a matmul over one
//! row and over several: none for kernels that compute each row alike (candle's CPU Q8_0, so
//! SmolLM2's decode copies: tested bit for bit), the last bits for dense f32 GEMMs, and more
//! where candle picks another kernel for several rows (its CPU Q6K on x86 repacks the weights
//! and quantizes the activations otherwise: up to 0.33 in one of Qwen's logits). Sampled text
//! can then diverge where two tokens are close.

use std::time::Instant;

use keydiff_cache::KvCache;

use crate::engine::Decoding;
use crate::error::Result;
use crate::{Engine, Event, GenerateParams, Output};

/// Requests being decoded together on one engine (see the module docs). Ids are the
/// caller's, to route events and outputs.
pub struct Batch<'e> {
    engine: &'e Engine,
    running: Vec<Running<'e>>,
}

/// A running request: its cache, its state, and the token it feeds next.
struct Running<'e> {
    id: u64,
    cache: KvCache,
    decoding: Decoding<'e>,
    next: u32,
}

impl Engine {
    /// An empty batch on this engine.
    pub fn batch(&self) -> Batch<'_> {
        Batch {
            engine: self,
            running: Vec::new(),
        }
    }

    /// Runs `requests` to their ends, decoding them together: each is prefilled in turn (its
    /// first token sampled as soon as its prefill ends), then all running ones step together
    /// until each ends. `on_event` gets each request's events with its index. A request
    /// refused or failed on its own (an empty or too long prompt, a cache that does not fit in
    /// memory beside the others', bad parameters, a failed sample) gets its error in its
    /// place; the others run. The outer error is a failed model pass, which ends them all.
    pub fn generate_batch(
        &self,
        requests: &[GenerateParams],
        mut on_event: impl FnMut(usize, Event<'_>),
    ) -> Result<Vec<Result<Output>>> {
        let mut outputs: Vec<Option<Result<Output>>> = requests.iter().map(|_| None).collect();
        let mut batch = self.batch();
        for (i, params) in requests.iter().enumerate() {
            match batch.add(i as u64, params, |e| on_event(i, e)) {
                Ok(Some(out)) => outputs[i] = Some(Ok(out)),
                Ok(None) => {}
                Err(e) => outputs[i] = Some(Err(e)),
            }
        }
        while !batch.is_empty() {
            for (id, out) in batch.step(|id, e| on_event(id as usize, e))? {
                outputs[id as usize] = Some(out);
            }
        }
        Ok(outputs
            .into_iter()
            .map(|o| o.expect("every request ends"))
            .collect())
    }
}

impl<'e> Batch<'e> {
    /// Requests running.
    pub fn len(&self) -> usize {
        self.running.len()
    }

    /// True when no request is running.
    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// The ids of the running requests, in the order they joined.
    pub fn ids(&self) -> Vec<u64> {
        self.running.iter().map(|r| r.id).collect()
    }

    /// Bytes held by the running requests' KV caches.
    pub fn cache_bytes(&self) -> usize {
        self.running.iter().map(|r| r.cache.bytes()).sum()
    }

    /// Bytes of the running requests' caches that the memory budget does not see yet: all of
    /// them under a configured limit (it is not measured); under a measured budget on the CPU,
    /// the slots not written yet (a zeroed allocation's pages are mapped when first written,
    /// so `MemAvailable` counts them free until then; slots fill up to N + B under a budget);
    /// none on a GPU, whose allocations take their memory at once.
    fn unseen_bytes(&self) -> u64 {
        let e = self.engine;
        let measured = e.config().memory_limit.is_none();
        if measured && !e.config().device.is_cpu() {
            return 0;
        }
        self.running
            .iter()
            .map(|r| {
                let (bytes, cap) = (r.cache.bytes() as u64, r.cache.capacity().max(1) as u64);
                if measured {
                    bytes * (cap - (r.cache.len() as u64).min(cap)) / cap
                } else {
                    bytes
                }
            })
            .sum()
    }

    /// Prefills a request (its events go to `on_event`; the running requests wait) and samples
    /// its first token. It then runs with the others' steps, or, when that token already ends
    /// it, its output is returned here. Its KV cache is planned beside the running ones'.
    /// `id` must not be a running request's.
    pub fn add(
        &mut self,
        id: u64,
        params: &GenerateParams,
        mut on_event: impl FnMut(Event<'_>),
    ) -> Result<Option<Output>> {
        let t0 = Instant::now();
        let e = self.engine;
        if self.running.iter().any(|r| r.id == id) {
            return Err(crate::EngineError::BadParams(format!(
                "request id {id} is already running in this batch"
            )));
        }
        let (prompt, mut cache) = e.request_cache(params, self.unseen_bytes())?;
        let mut decoding =
            e.prefill_request(&mut cache, prompt, 0, params.clone(), t0, &mut on_event)?;
        match decoding.next(cache.position(), &mut on_event)? {
            Some(next) => {
                self.running.push(Running {
                    id,
                    cache,
                    decoding,
                    next,
                });
                Ok(None)
            }
            None => Ok(Some(decoding.finish(&cache, &mut on_event).0)),
        }
    }

    /// One decode step of every running request: their next tokens go through the model
    /// together, then each samples the token after. Returns the requests that ended, with
    /// their ids, in the order they joined: each with its output, or the error that ended it
    /// alone (a failed sample: the others go on). The outer error is a failed model pass,
    /// which ends the batch: its requests' caches are in an unknown state.
    #[allow(clippy::type_complexity)]
    pub fn step(
        &mut self,
        mut on_event: impl FnMut(u64, Event<'_>),
    ) -> Result<Vec<(u64, Result<Output>)>> {
        if self.running.is_empty() {
            return Ok(Vec::new());
        }
        let tokens: Vec<u32> = self.running.iter().map(|r| r.next).collect();
        let rows = {
            let mut caches: Vec<&mut KvCache> =
                self.running.iter_mut().map(|r| &mut r.cache).collect();
            self.engine
                .model()
                .forward_batch(&tokens, &mut caches)
                .map_err(crate::EngineError::from)
                .and_then(|l| Ok(l.to_vec2::<f32>()?))
        };
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                self.running.clear();
                return Err(e);
            }
        };
        let mut ended = Vec::new();
        let mut still = Vec::with_capacity(self.running.len());
        for (mut r, row) in std::mem::take(&mut self.running).into_iter().zip(rows) {
            let id = r.id;
            r.decoding.fed(row);
            let mut events = |e: Event<'_>| on_event(id, e);
            match r.decoding.next(r.cache.position(), &mut events) {
                Ok(Some(next)) => {
                    r.next = next;
                    still.push(r);
                }
                Ok(None) => ended.push((id, Ok(r.decoding.finish(&r.cache, &mut events).0))),
                Err(e) => ended.push((id, Err(e))),
            }
        }
        self.running = still;
        Ok(ended)
    }
}
