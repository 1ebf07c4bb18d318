//! An OpenAI-compatible HTTP server over one [`Engine`].
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `"stream": true`
//! as server-sent events, both with `logprobs`), `GET /v1/models`, `POST /tokenize`,
//! `POST /detokenize`, `GET /tokenizer_info`, `GET /health` (JSON) and `GET /metrics`
//! (Prometheus text).
//!
//! By default one engine runs one request at a time, as the engine is built to (a long prompt
//! under a fixed KV budget), keeping the last request's cache for the next
//! ([`ServerConfig::prompt_cache`]); with [`ServerConfig::max_batch`] above 1, up to that many
//! requests decode together, joining between steps, their prompts prefilled a chunk per step
//! beside the running requests' tokens ([`keydiff::Batch`]), and the caches of the last
//! `max_batch` requests are kept for the next ones. Requests wait in a
//! bounded queue and start in arrival order; when the queue is full a request gets 503 at
//! once. A request whose client goes away (a closed stream, or a dropped connection) is
//! cancelled at its next prefill chunk or token, so it frees the engine for the next one.
//!
//! ```no_run
//! use keydiff::{Engine, EngineConfig, ModelSource};
//! use keydiff_server::{Server, ServerConfig};
//! let engine = Engine::load(&ModelSource::parse("models/SmolLM2-135M-Instruct.Q4_1.gguf")?,
//!                           &EngineConfig::default())?;
//! let server = Server::bind("127.0.0.1:8080", engine, ServerConfig::new("smollm2"))?;
//! server.run(async { let _ = tokio::signal::ctrl_c().await; })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod api;
mod error;
mod logprobs;

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use keydiff::{
    CancelToken, Engine, Event, GenerateParams, Output, PromptCache, Reuse, StopReason,
    TokenLogprob,
};
use serde_json::{json, Value};
use tokio::sync::mpsc;

pub use error::{ApiError, ServerError};

use api::{ChatRequest, CompletionRequest, Defaults, Mapped};
use keydiff::reasoning::{Piece, ReasoningFormat, ReasoningStream};
use keydiff::tools::{Tool, ToolChoice, ToolStream, ToolSyntax};

/// Largest request body: a prompt at the longest contexts (128K tokens as text or ids) fits
/// many times over; axum's default of 2 MB would not.
const MAX_BODY_BYTES: usize = 64 << 20;

/// How the server presents the model and queues requests.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model id `/v1/models` lists and responses carry. Requests may name any model:
    /// there is one.
    pub model_id: String,
    /// Requests that may wait while one runs; beyond that a request gets 503.
    pub max_queue: usize,
    /// Tokens generated when a request sets no `max_tokens` (`None`: until end of generation
    /// or the context, as vLLM does).
    pub max_tokens: Option<usize>,
    /// Keep the last request's KV cache, so that a request that starts with its tokens (a
    /// growing conversation, another question on the same document) prefills only the rest
    /// ([`Engine::generate_cached`]; llama.cpp's `cache_prompt`), reusing what [`Reuse`] says
    /// (`None`: every request prefills its whole prompt). With `max_batch` above 1 the last
    /// `max_batch` requests' caches are kept, and a request starts from the one that holds
    /// most of its prompt ([`keydiff::Batch::keep_prompts`]).
    pub prompt_cache: Option<Reuse>,
    /// When set, every endpoint but `/health` needs `Authorization: Bearer <key>` (401
    /// otherwise), as vLLM's and llama.cpp's `--api-key`.
    pub api_key: Option<String>,
    /// Requests decoded together at most (continuous batching, [`keydiff::Batch`]): all
    /// running ones step through the model together; waiting requests join between steps,
    /// and their prompts are prefilled in the steps ([`ServerConfig::prefill_tokens`] a step)
    /// beside the running requests' tokens, which so wait a chunk, not a whole prefill. 1
    /// runs one request at a time.
    pub max_batch: usize,
    /// With `max_batch` above 1, prompt tokens a step takes from joining requests, a chunk
    /// (at most B) from each in arrival order ([`keydiff::Batch::set_prefill_tokens`]);
    /// `None`: one chunk.
    pub prefill_tokens: Option<usize>,
    /// Whether chat replies' `<think>` blocks come back apart, as `reasoning_content`
    /// (llama.cpp's `--reasoning-format`; `Auto`: for chat templates that write `</think>`).
    pub reasoning_format: ReasoningFormat,
    /// Use the checkpoint's recommended sampling (GGUF `general.sampling.*`,
    /// `generation_config.json`) for the fields a request leaves out, as vLLM's
    /// `--generation-config auto` and llama.cpp's server do; false: the API's own defaults.
    pub generation_config: bool,
    /// Where `POST /slots/{id}?action=save|restore` write and read prompt caches
    /// (llama.cpp's `--slot-save-path`); `None`: those actions are refused (501).
    pub slot_save_path: Option<std::path::PathBuf>,
    /// Decode every request speculatively by n-gram lookup ([`keydiff::NgramSpec`]; the same
    /// output in fewer passes). In a batch (`max_batch` above 1) each request's draft runs in
    /// the batch's steps beside the others' rows; a batch refuses `exact`.
    pub speculative: Option<keydiff::NgramSpec>,
    /// Answer browsers' CORS preflights and allow any origin (llama-server's and vLLM's
    /// default); false: no CORS headers, so pages of other origins cannot read answers.
    pub cors: bool,
}

impl ServerConfig {
    /// `model_id`, a queue of 16, no default token limit.
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            max_queue: 16,
            max_tokens: None,
            prompt_cache: Some(Reuse::Exact),
            api_key: None,
            max_batch: 1,
            prefill_tokens: None,
            reasoning_format: ReasoningFormat::Auto,
            generation_config: true,
            slot_save_path: None,
            speculative: None,
            cors: true,
        }
    }
}

/// Counters `/health` reports.
#[derive(Debug, Default)]
struct Counters {
    /// Waiting in the queue.
    queued: AtomicUsize,
    /// Running now (at most `max_batch`).
    running: AtomicUsize,
    /// Finished and answered.
    completed: AtomicU64,
    /// Stopped because their client went away (or dropped while queued).
    cancelled: AtomicU64,
    /// Failed with an error.
    failed: AtomicU64,
    /// Refused because the queue was full.
    rejected: AtomicU64,
    prompt_tokens: AtomicU64,
    /// Prompt tokens taken from the prompt cache instead of being prefilled.
    cached_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    /// Speculative decoding: tokens drafted, and those taken.
    draft_tokens: AtomicU64,
    accepted_tokens: AtomicU64,
    /// KV caches the prompt cache keeps for later requests, and their bytes.
    kept_caches: AtomicUsize,
    kept_bytes: AtomicU64,
    /// Sums over completed requests, in microseconds: time to first token, prefill, decode.
    ttft_us: AtomicU64,
    prefill_us: AtomicU64,
    decode_us: AtomicU64,
}

/// What the worker tells a request's handler.
enum Msg {
    /// The first prefill chunk ran: the request was accepted.
    Started,
    /// The prompt's tokens and their log-probabilities (all but the first), after the prefill.
    PromptLogprobs(Vec<u32>, Vec<TokenLogprob>),
    /// A generated token's log-probability (of completion `.0`), before the text it completes.
    Logprob(usize, TokenLogprob),
    Text(usize, String),
    /// Completion `.0` of several ended (streams only: its last chunk goes now).
    Ended(usize, Box<Output>),
    /// A slot action's answer.
    Slot(Result<Value, ApiError>),
    /// The request ended: every completion's output, in order, or why it failed.
    Done(Result<Vec<Output>, ApiError>),
}

struct Job {
    params: GenerateParams,
    /// The prompts after the first (`params.prompt`) of a batch of prompts.
    more: Vec<keydiff::Prompt>,
    /// Completions of each prompt (`n`, or `best_of`).
    n: usize,
    /// The client reads a stream: send it logprobs as they come (a whole answer takes them
    /// from the output).
    stream: bool,
    ticket: Arc<Ticket>,
    events: mpsc::UnboundedSender<Msg>,
    /// A slot action instead of a generation (`POST /slots/{id}`).
    slot: Option<SlotTask>,
}

/// What `POST /slots/{id}?action=...` asks of the worker (llama.cpp's slot actions): a kept
/// prompt cache saved to a file, restored from one, or freed.
struct SlotTask {
    id: usize,
    action: SlotAction,
}

enum SlotAction {
    /// The file's name as given, and its path under `--slot-save-path`.
    Save(String, PathBuf),
    Restore(String, PathBuf),
    Erase,
}

impl Job {
    fn prompts(&self) -> usize {
        1 + self.more.len()
    }

    /// Completions of all its prompts: completion `j` of prompt `k` is choice `k·n + j`.
    fn choices(&self) -> usize {
        self.prompts() * self.n
    }

    /// The request of prompt `k`.
    fn params_for(&self, k: usize) -> GenerateParams {
        match k {
            0 => self.params.clone(),
            k => GenerateParams {
                prompt: self.more[k - 1].clone(),
                ..self.params.clone()
            },
        }
    }
}

/// A job's place in the queue, shared by its handler and the worker.
struct Ticket {
    cancel: CancelToken,
    /// [`QUEUED`], [`STARTED`] or [`GONE`]: whichever of the worker (taking it) and the
    /// handler (dropped while it waits) moves it off `QUEUED` first takes it out of the
    /// queue count.
    state: AtomicU8,
}

const QUEUED: u8 = 0;
const STARTED: u8 = 1;
const GONE: u8 = 2;

impl Ticket {
    fn leave(&self, to: u8) -> bool {
        self.state
            .compare_exchange(QUEUED, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

struct AppState {
    /// Shared with the worker, for tokenization while it generates.
    engine: Arc<Engine>,
    cfg: ServerConfig,
    context: usize,
    policy: String,
    budget: Option<usize>,
    jobs: std_mpsc::Sender<Job>,
    counters: Arc<Counters>,
}

/// A bound server, not serving yet.
pub struct Server {
    listener: std::net::TcpListener,
    app: Router,
    worker: Worker,
}

/// The thread that runs requests ([`router`]): one at a time, or batched.
pub struct Worker {
    thread: std::thread::JoinHandle<()>,
    stop: Arc<Stop>,
}

/// Shutdown, shared by [`Worker`] and its thread.
#[derive(Default)]
struct Stop {
    stopping: CancelToken,
    /// The running requests' tokens.
    running: std::sync::Mutex<Vec<CancelToken>>,
}

impl Stop {
    fn stop(&self) {
        self.stopping.cancel();
        for t in self.running().iter() {
            t.cancel();
        }
    }

    fn running(&self) -> std::sync::MutexGuard<'_, Vec<CancelToken>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets a request that ended.
    fn finished(&self, token: &CancelToken) {
        self.running().retain(|t| !t.same(token));
    }
}

impl Worker {
    /// Stops the running requests at their next chunk or token and refuses the queued ones
    /// (503, "the server is shutting down"); later requests are refused too.
    pub fn stop_requests(&self) {
        self.stop.stop();
    }

    /// Waits for the thread to end, which it does once the router (holding the queue) is
    /// dropped.
    pub fn join(self) -> Result<(), ServerError> {
        self.thread.join().map_err(|_| ServerError::Worker)
    }
}

impl Server {
    /// Listens on `addr` (`host:port`; port 0 picks a free one, see [`Server::local_addr`])
    /// and starts the generation worker that owns `engine`.
    pub fn bind(addr: &str, engine: Engine, cfg: ServerConfig) -> Result<Self, ServerError> {
        Self::from_listener(listen(addr)?, engine, cfg)
    }

    /// Serves on a listener bound beforehand (with [`listen`], say, before a model that takes
    /// a while to load, so that a taken port fails at once).
    pub fn from_listener(
        listener: std::net::TcpListener,
        engine: Engine,
        cfg: ServerConfig,
    ) -> Result<Self, ServerError> {
        listener.set_nonblocking(true)?;
        let (app, worker) = router(engine, cfg);
        Ok(Self {
            listener,
            app,
            worker,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `shutdown` completes, on a runtime of its own: blocks the calling thread,
    /// which must not be inside an async runtime (that is refused: await
    /// [`Server::serve`] there). Then the running requests are stopped at their next chunk
    /// or token and queued ones are refused (each client gets an error saying the server is
    /// shutting down), the answers are delivered, and the worker ends.
    pub fn run(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(ServerError::InRuntime);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let Self {
            listener,
            app,
            worker,
        } = self;
        rt.block_on(serve_until(listener, app, &worker, shutdown))?;
        // Dropping the runtime drops whatever still holds the router (the queue's senders):
        // the worker ends.
        drop(rt);
        worker.join()
    }

    /// [`Server::run`] on the caller's Tokio runtime (a program that embeds the server in its
    /// own async code).
    pub async fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let Self {
            listener,
            app,
            worker,
        } = self;
        serve_until(listener, app, &worker, shutdown).await?;
        // The router is gone with `axum::serve`, and the requests it ran (stopped and
        // answered) with their connections: the worker ends once its queue's last sender
        // is dropped.
        tokio::task::spawn_blocking(move || worker.join())
            .await
            .map_err(|_| ServerError::Worker)?
    }

    /// Serves on a thread of its own until the handle is stopped or dropped.
    pub fn spawn(self) -> ServerHandle {
        let addr = self.local_addr();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            self.run(async move {
                let _ = rx.await;
            })
        });
        ServerHandle {
            addr,
            stop: Some(tx),
            thread: Some(thread),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` completes, then stops the worker's requests
/// (see [`Server::run`]).
async fn serve_until(
    listener: std::net::TcpListener,
    app: axum::Router,
    worker: &Worker,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let stop = worker.stop.clone();
    let listener = tokio::net::TcpListener::from_std(listener)?;
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            stop.stop();
        })
        .await?;
    Ok(())
}

/// Binds `addr` (`host:port`), naming it in the error.
pub fn listen(addr: &str) -> Result<std::net::TcpListener, ServerError> {
    std::net::TcpListener::bind(addr).map_err(|error| ServerError::Bind {
        addr: addr.to_string(),
        error,
    })
}

/// A server running on its own thread ([`Server::spawn`]).
pub struct ServerHandle {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), ServerError>>>,
}

impl ServerHandle {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its base URL, `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops it and waits until it has stopped.
    pub fn stop(mut self) -> Result<(), ServerError> {
        self.shut()
    }

    fn shut(&mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| ServerError::Worker)?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.shut();
    }
}

/// The routes over `engine`, and the worker thread that runs its requests (one at a time, or up
/// to `max_batch` together).
/// To serve them in an app of your own: on shutdown call [`Worker::stop_requests`], let the
/// server finish, drop the router, then [`Worker::join`] ([`Server::run`] does this).
pub fn router(engine: Engine, cfg: ServerConfig) -> (Router, Worker) {
    // Unbounded: `submit` bounds the jobs that still wait, and a job whose client left is
    // not one of them.
    let (jobs, rx) = std_mpsc::channel();
    let counters = Arc::new(Counters::default());
    let cache = engine.config().cache.clone();
    let engine = Arc::new(engine);
    let state = Arc::new(AppState {
        engine: engine.clone(),
        context: engine.model_config().context(),
        policy: cache.policy.name(),
        budget: cache.budget,
        cfg,
        jobs,
        counters: counters.clone(),
    });
    let stop = Arc::new(Stop::default());
    let shared = stop.clone();
    let max_batch = state.cfg.max_batch.max(1);
    let prefill_tokens = state.cfg.prefill_tokens;
    let prompt_cache = state.cfg.prompt_cache.map(PromptCache::with_reuse);
    let thread = std::thread::Builder::new()
        .name("keydiff-worker".into())
        .spawn(move || {
            work(
                engine,
                rx,
                counters,
                shared,
                prompt_cache,
                (max_batch, prefill_tokens),
            )
        })
        .expect("cannot start the generation thread");
    let worker = Worker { thread, stop };
    let guarded = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/infill", post(infill))
        .route("/completion", post(llama_completion))
        .route("/completions", post(llama_completion))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/tokenizer_info", get(tokenizer_info))
        .route("/metrics", get(metrics))
        .route("/slots/{id}", post(slot_action))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            authorize,
        ));
    let app = Router::new()
        .merge(guarded)
        .route("/health", get(health))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(state.clone(), edge))
        .with_state(state);
    (app, worker)
}

/// What every response goes through. CORS (unless `ServerConfig::cors` is off) as
/// llama-server and vLLM answer it by default:
/// a browser's preflight (`OPTIONS` with an `Origin`) is answered here for every path,
/// before the API key is asked for (browsers send none with it), and responses to a request
/// with an `Origin` allow any origin. And the errors the router makes itself (no such path,
/// another method, a body past the limit) come in OpenAI's JSON form, as the handlers'.
async fn edge(
    State(st): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use axum::http::{header, HeaderValue, Method, StatusCode};
    let origin = st.cfg.cors && req.headers().contains_key(header::ORIGIN);
    if origin && req.method() == Method::OPTIONS {
        let asked = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or(HeaderValue::from_static("*"));
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_ORIGIN,
            HeaderValue::from_static("*"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("86400"),
        );
        return r;
    }
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let mut r = next.run(req).await;
    let status = r.status();
    let json = r
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !json && (status.is_client_error() || status.is_server_error()) {
        let message = match status {
            StatusCode::NOT_FOUND => format!("no endpoint {method} {path}"),
            StatusCode::METHOD_NOT_ALLOWED => format!("{path} does not take {method}"),
            StatusCode::PAYLOAD_TOO_LARGE => {
                format!("the request body is larger than {MAX_BODY_BYTES} bytes")
            }
            s => s.canonical_reason().unwrap_or("error").to_string(),
        };
        let allow = r.headers().get(header::ALLOW).cloned();
        r = ApiError {
            status,
            kind: match status {
                s if s.is_server_error() => "server_error",
                StatusCode::NOT_FOUND => "not_found_error",
                _ => "invalid_request_error",
            },
            message,
            param: None,
        }
        .into_response();
        if let Some(a) = allow {
            r.headers_mut().insert(header::ALLOW, a);
        }
    }
    if origin {
        r.headers_mut().insert(
            header::ACCESS_CONTROL_ALLOW_ORIGIN,
            HeaderValue::from_static("*"),
        );
    }
    r
}

/// Refuses a request without the server's API key (when it has one).
async fn authorize(
    State(st): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let given = req
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        // Compared in time independent of where they differ.
        let same = given.len() == key.len()
            && given
                .bytes()
                .zip(key.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if !same {
            return ApiError {
                status: axum::http::StatusCode::UNAUTHORIZED,
                kind: "invalid_request_error",
                message: "missing or incorrect API key (Authorization: Bearer <key>)".into(),
                param: None,
            }
            .into_response();
        }
    }
    next.run(req).await
}

/// The worker: runs queued requests in order until every sender is gone.
fn work(
    engine: Arc<Engine>,
    rx: std_mpsc::Receiver<Job>,
    counters: Arc<Counters>,
    stop: Arc<Stop>,
    prompt_cache: Option<PromptCache>,
    (max_batch, prefill_tokens): (usize, Option<usize>),
) {
    if max_batch > 1 {
        let reuse = prompt_cache.map(|pc| pc.reuse());
        let limits = (max_batch, prefill_tokens);
        work_batched(&engine, &rx, &counters, &stop, limits, reuse);
    } else {
        work_one_by_one(&engine, &rx, &counters, &stop, prompt_cache);
    }
}

/// Takes `job` off the queue for running: false when its client left while it waited, or the
/// server is stopping (it is then answered).
fn take(job: &Job, counters: &Counters, stop: &Stop) -> bool {
    if !job.ticket.leave(STARTED) {
        // Its client left while it waited (and took it out of the count).
        counters.cancelled.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    counters.queued.fetch_sub(1, Ordering::Relaxed);
    // Published before the check, so that a stop either sees this token or is seen.
    stop.running().push(job.ticket.cancel.clone());
    if stop.stopping.is_cancelled() {
        stop.finished(&job.ticket.cancel);
        counters.cancelled.fetch_add(1, Ordering::Relaxed);
        let _ = job.events.send(Msg::Done(Err(ApiError::unavailable(
            "the server is shutting down",
        ))));
        return false;
    }
    true
}

/// What a job's handler hears of an engine event of its completion `choice` (`started`:
/// whether it heard `Started`).
fn message(job: &Job, started: &mut bool, choice: usize, ev: Event<'_>) -> Option<Msg> {
    Some(match ev {
        Event::Prefill { .. } if !*started => {
            *started = true;
            Msg::Started
        }
        Event::Prefill { .. } => return None,
        Event::PromptLogprobs { .. } | Event::Logprob(_) if !job.stream => return None,
        Event::PromptLogprobs { tokens, logprobs } => {
            Msg::PromptLogprobs(tokens.to_vec(), logprobs.to_vec())
        }
        Event::Logprob(t) => Msg::Logprob(choice, t.clone()),
        Event::Text(t) => Msg::Text(choice, t.to_string()),
    })
}

/// Tells a stream of several completions that completion `choice` ended.
fn ended(job: &Job, choice: usize, out: &Output) {
    if job.stream && job.n > 1 {
        let _ = job.events.send(Msg::Ended(choice, Box::new(out.clone())));
    }
}

/// Collects the completions of a job as they end; the first error fails it (and cancels the
/// others, which then end at their next token).
struct Completions {
    /// The choice of `outs[0]`.
    base: usize,
    outs: Vec<Option<Output>>,
    failed: Option<ApiError>,
    left: usize,
}

impl Completions {
    /// Choices `base..base + n`.
    fn new(base: usize, n: usize) -> Self {
        Self {
            base,
            outs: (0..n).map(|_| None).collect(),
            failed: None,
            left: n,
        }
    }

    /// Completion `choice` ended; true when it was the last.
    fn ended(&mut self, job: &Job, choice: usize, out: Result<Output, ApiError>) -> bool {
        match out {
            Ok(o) => {
                ended(job, choice, &o);
                self.outs[choice - self.base] = Some(o);
            }
            Err(e) => {
                if self.failed.is_none() {
                    job.ticket.cancel.cancel();
                    self.failed = Some(e);
                }
            }
        }
        self.left -= 1;
        self.left == 0
    }

    /// `n` completions that will not run (their job was cancelled before their prompt
    /// joined); true when they were the last.
    fn skip(&mut self, n: usize) -> bool {
        self.left = self.left.saturating_sub(n);
        self.left == 0
    }

    /// The outputs, in order (fewer than asked when some were skipped), or the first error.
    fn result(self) -> Result<Vec<Output>, ApiError> {
        match self.failed {
            Some(e) => Err(e),
            None => Ok(self.outs.into_iter().flatten().collect()),
        }
    }
}

/// A panic's message, for the client and the log.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let what = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("unknown");
    tracing::error!("generation panicked: {what}");
    format!("generation failed: {what}")
}

/// Answers a job that ended (its completions' outputs, or why it failed) and counts it.
fn settle(job: Job, result: Result<Vec<Output>, ApiError>, counters: &Counters, stop: &Stop) {
    stop.finished(&job.ticket.cancel);
    // Its completions share the cancel: one cancelled means all were, and a cancel can leave
    // a batch's later prompts unrun.
    let choices = job.choices();
    let cancelled = |outs: &[Output]| {
        let cut = outs.len() < choices
            || outs
                .iter()
                .any(|o| o.stats.stop_reason == StopReason::Cancelled);
        cut.then(|| outs.iter().map(|o| o.tokens.len()).sum::<usize>())
    };
    if let Some(tokens) = result.as_deref().ok().and_then(cancelled) {
        counters.cancelled.fetch_add(1, Ordering::Relaxed);
        if job.events.is_closed() {
            tracing::info!("request cancelled after {tokens} tokens: its client went away");
        } else {
            // Its client is there: the server is stopping.
            let _ = job.events.send(Msg::Done(Err(ApiError::unavailable(format!(
                "the server is shutting down: generation stopped after {tokens} tokens"
            )))));
        }
        return;
    }
    match &result {
        Ok(outs) => {
            let out = &outs[0];
            let s = &out.stats;
            let generated: usize = outs.iter().map(|o| o.tokens.len()).sum();
            let decode_s = outs.iter().map(|o| o.stats.decode_s).fold(0.0, f64::max);
            // Each prompt once (its completions share its prefill).
            let prompts = || outs.iter().step_by(job.n.max(1)).map(|o| &o.stats);
            let prompt_tokens: usize = prompts().map(|s| s.prompt_tokens).sum();
            let cached: usize = prompts().map(|s| s.prefix_tokens).sum();
            let prefill_s: f64 = prompts().map(|s| s.prefill_s).sum();
            counters.completed.fetch_add(1, Ordering::Relaxed);
            counters
                .prompt_tokens
                .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
            counters
                .cached_tokens
                .fetch_add(cached as u64, Ordering::Relaxed);
            counters
                .generated_tokens
                .fetch_add(generated as u64, Ordering::Relaxed);
            let spec = outs.iter().filter_map(|o| o.stats.speculative);
            let (drafted, accepted) =
                spec.fold((0, 0), |(d, a), c| (d + c.drafted, a + c.accepted));
            counters
                .draft_tokens
                .fetch_add(drafted as u64, Ordering::Relaxed);
            counters
                .accepted_tokens
                .fetch_add(accepted as u64, Ordering::Relaxed);
            let us = |x: f64| (x * 1e6).round() as u64;
            counters.ttft_us.fetch_add(us(s.ttft_s), Ordering::Relaxed);
            counters
                .prefill_us
                .fetch_add(us(prefill_s), Ordering::Relaxed);
            counters
                .decode_us
                .fetch_add(us(decode_s), Ordering::Relaxed);
            tracing::info!(
                "request: prompt {} tok ({} cached), TTFT {:.3} s, prefill {:.1} tok/s, {} generated \
                 ({} completions) in {:.3} s, peak KV {} B, {} evictions, stop {:?}",
                s.prompt_tokens,
                s.prefix_tokens,
                s.ttft_s,
                s.prefill_tok_s,
                generated,
                outs.len(),
                decode_s,
                s.peak_kv_bytes,
                s.eviction.evictions,
                s.stop_reason
            );
        }
        Err(e) => {
            counters.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("request failed ({}): {}", e.status, e.message);
        }
    }
    let _ = job.events.send(Msg::Done(result));
}

/// One request at a time, with the prompt cache.
fn work_one_by_one(
    engine: &Engine,
    rx: &std_mpsc::Receiver<Job>,
    counters: &Counters,
    stop: &Stop,
    mut prompt_cache: Option<PromptCache>,
) {
    while let Ok(job) = rx.recv() {
        if !take(&job, counters, stop) {
            continue;
        }
        if let Some(task) = &job.slot {
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                slot_one_by_one(engine, prompt_cache.as_mut(), task)
            }))
            .unwrap_or_else(|panic| Err(ApiError::internal(panic_message(&*panic))));
            if let Some(pc) = &prompt_cache {
                counters.kept(usize::from(!pc.is_empty()), pc.bytes());
            }
            answer_slot(job, r, stop);
            continue;
        }
        counters.running.store(1, Ordering::Relaxed);
        let mut started = false;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            // A client that leaves drops its handler's ticket guard, which cancels the request.
            // A batch of prompts runs prompt after prompt.
            let mut outs: Vec<Output> = Vec::with_capacity(job.choices());
            for k in 0..job.prompts() {
                // Cancelled: the later prompts do not run (`settle` answers it as cancelled).
                let cut = |o: &Output| o.stats.stop_reason == StopReason::Cancelled;
                if job.params.is_cancelled() || outs.iter().any(cut) {
                    break;
                }
                let params = job.params_for(k);
                let base = k * job.n;
                if job.n > 1 {
                    let held = prompt_cache.as_ref().map_or(0, PromptCache::bytes);
                    outs.extend(run_n(
                        engine,
                        &job,
                        &params,
                        base,
                        held as u64,
                        &mut started,
                    )?);
                    continue;
                }
                let on_event = |ev: Event<'_>| {
                    if let Some(msg) = message(&job, &mut started, base, ev) {
                        let _ = job.events.send(msg);
                    }
                };
                let out = match prompt_cache.as_mut() {
                    Some(pc) => engine.generate_cached(&params, pc, on_event),
                    None => engine.generate(&params, on_event),
                };
                outs.push(out?);
            }
            Ok(outs)
        }));
        if result.is_err() {
            // A panic may have left the held cache half-written.
            if let Some(pc) = prompt_cache.as_mut() {
                pc.clear();
            }
        }
        if let Some(pc) = &prompt_cache {
            counters.kept(usize::from(!pc.is_empty()), pc.bytes());
        }
        counters.running.store(0, Ordering::Relaxed);
        let result = match result {
            Ok(r) => r,
            Err(panic) => Err(ApiError::internal(panic_message(&*panic))),
        };
        settle(job, result, counters, stop);
    }
}

/// Prompt `params` of a job with several completions of each, alone: prefilled once, the
/// completions (choices `base..base + n`) decoded together ([`keydiff::Batch::join_n`]). The
/// prompt cache (`held` bytes) is neither used nor changed.
fn run_n(
    engine: &Engine,
    job: &Job,
    params: &GenerateParams,
    base: usize,
    held: u64,
    started: &mut bool,
) -> Result<Vec<Output>, ApiError> {
    let ids: Vec<u64> = (0..job.n as u64).collect();
    let mut batch = engine.batch();
    batch.hold_outside(held);
    batch.join_n(&ids, params)?;
    let mut done = Completions::new(base, job.n);
    while !batch.is_empty() {
        let ended = batch.step(|id, ev| {
            if let Some(msg) = message(job, started, base + id as usize, ev) {
                let _ = job.events.send(msg);
            }
        })?;
        for (id, out) in ended {
            done.ended(job, base + id as usize, out.map_err(ApiError::from));
        }
    }
    done.result()
}

/// Continuous batching: up to `max_batch` requests run together ([`keydiff::Batch`]).
/// Between two steps, waiting requests join (their prompts are prefilled in the following
/// steps, `prefill_tokens` a step) and ended ones leave. With a prompt cache, the caches of
/// the last `max_batch` requests are kept (a slot's each, as llama.cpp's server keeps them),
/// and a joining request starts from the one that holds most of its prompt.
fn work_batched(
    engine: &Engine,
    rx: &std_mpsc::Receiver<Job>,
    counters: &Counters,
    stop: &Stop,
    (max_batch, prefill_tokens): (usize, Option<usize>),
    prompt_cache: Option<Reuse>,
) {
    let new_batch = || {
        let mut b = engine.batch();
        if let Some(t) = prefill_tokens {
            b.set_prefill_tokens(t);
        }
        if let Some(reuse) = prompt_cache {
            b.keep_prompts(reuse, max_batch);
        }
        b
    };
    let mut batch = new_batch();
    // The running jobs by their first completion's batch id, with whether they heard
    // `Started` and their completions so far; completion i of a job has batch id first + i.
    let mut running: HashMap<u64, (Job, bool, Completions)> = HashMap::new();
    let owner = |id: u64, running: &HashMap<u64, (Job, bool, Completions)>| {
        running
            .iter()
            .find(|(&first, (job, _, _))| (first..first + job.choices() as u64).contains(&id))
            .map(|(&first, _)| (first, (id - first) as usize))
    };
    let mut next_id = 0u64;
    // A job taken from the queue that waits for room for its completions.
    let mut pending: Option<Job> = None;
    // The prompts of taken jobs that have not joined yet, by their job's first id and their
    // index: a batch of prompts joins prompt by prompt, as room frees.
    let mut waiting: VecDeque<(u64, usize)> = VecDeque::new();
    loop {
        // Joining: the prompts of jobs already taken first; then wait for a request when none
        // runs, else take those already queued, while their completions fit in `max_batch`
        // (a prompt with more completions runs alone).
        loop {
            if let Some(&(first, k)) = waiting.front() {
                let Some((job, _, _)) = running.get(&first) else {
                    waiting.pop_front();
                    continue;
                };
                let (n, cancelled) = (job.n, job.params.is_cancelled());
                if !cancelled && !batch.is_empty() && batch.len() + n > max_batch {
                    break;
                }
                waiting.pop_front();
                let params = (!cancelled).then(|| job.params_for(k));
                let Some(params) = params else {
                    // Its client left, or the server is stopping: this prompt does not run.
                    if let Some((_, _, done)) = running.get_mut(&first) {
                        if done.skip(n) {
                            if let Some((job, _, done)) = running.remove(&first) {
                                settle(job, done.result(), counters, stop);
                            }
                        }
                    }
                    continue;
                };
                let ids: Vec<u64> = (0..n).map(|j| first + (k * n + j) as u64).collect();
                let joined =
                    std::panic::catch_unwind(AssertUnwindSafe(|| batch.join_n(&ids, &params)));
                let failed = match joined {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(ApiError::from(e)),
                    Err(panic) => Some(ApiError::internal(panic_message(&*panic))),
                };
                if let Some(e) = failed {
                    if let Some((job, _, done)) = running.get_mut(&first) {
                        let mut last = false;
                        for j in 0..n {
                            last = done.ended(job, k * n + j, Err(e.clone()));
                        }
                        if last {
                            if let Some((job, _, done)) = running.remove(&first) {
                                settle(job, done.result(), counters, stop);
                            }
                        }
                    }
                }
                counters.running.store(batch.len(), Ordering::Relaxed);
                // Joining may take or free kept caches.
                counters.kept(batch.kept_tokens().len(), batch.kept_bytes());
                continue;
            }
            let job = match pending.take() {
                Some(job) => job,
                None if batch.is_empty() => match rx.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                },
                None => match rx.try_recv() {
                    Ok(job) => job,
                    Err(_) => break,
                },
            };
            if !batch.is_empty() && batch.len() + job.n > max_batch {
                pending = Some(job);
                break;
            }
            if !take(&job, counters, stop) {
                continue;
            }
            if let Some(task) = &job.slot {
                let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    slot_batched(engine, &mut batch, prompt_cache, task)
                }))
                .unwrap_or_else(|panic| Err(ApiError::internal(panic_message(&*panic))));
                counters.kept(batch.kept_tokens().len(), batch.kept_bytes());
                answer_slot(job, r, stop);
                continue;
            }
            let first = next_id;
            let total = job.choices();
            next_id += total as u64;
            waiting.extend((0..job.prompts()).map(|k| (first, k)));
            running.insert(first, (job, false, Completions::new(0, total)));
        }
        if batch.is_empty() {
            continue;
        }
        let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| {
            batch.step(|id, ev| {
                if let Some((first, choice)) = owner(id, &running) {
                    if let Some((job, started, _)) = running.get_mut(&first) {
                        if let Some(msg) = message(job, started, choice, ev) {
                            let _ = job.events.send(msg);
                        }
                    }
                }
            })
        }));
        match stepped {
            Ok(Ok(ended)) => {
                for (id, out) in ended {
                    let Some((first, choice)) = owner(id, &running) else {
                        continue;
                    };
                    let Some((job, _, done)) = running.get_mut(&first) else {
                        continue;
                    };
                    if done.ended(job, choice, out.map_err(ApiError::from)) {
                        if let Some((job, _, done)) = running.remove(&first) {
                            settle(job, done.result(), counters, stop);
                        }
                    }
                }
            }
            failed => {
                // The step failed for all: every running request is answered with why (and
                // the kept caches go with the batch).
                let why = match failed {
                    Ok(Err(e)) => ApiError::from(e),
                    Err(panic) => ApiError::internal(panic_message(&*panic)),
                    Ok(Ok(_)) => unreachable!("matched above"),
                };
                batch = new_batch();
                waiting.clear();
                for (_, (job, _, _)) in running.drain() {
                    settle(job, Err(why.clone()), counters, stop);
                }
            }
        }
        counters.running.store(batch.len(), Ordering::Relaxed);
        counters.kept(batch.kept_tokens().len(), batch.kept_bytes());
    }
}

/// Answers a slot action.
fn answer_slot(job: Job, r: Result<Value, ApiError>, stop: &Stop) {
    stop.finished(&job.ticket.cancel);
    if let Err(e) = &r {
        tracing::warn!("slot action failed ({}): {}", e.status, e.message);
    }
    let _ = job.events.send(Msg::Slot(r));
}

/// A slot action one request at a time: slot 0 is the prompt cache.
fn slot_one_by_one(
    engine: &Engine,
    pc: Option<&mut PromptCache>,
    task: &SlotTask,
) -> Result<Value, ApiError> {
    let Some(pc) = pc else {
        return Err(no_prompt_cache());
    };
    if task.id != 0 {
        return Err(bad_slot(task.id, 1));
    }
    let t0 = Instant::now();
    match &task.action {
        SlotAction::Save(name, path) => saved(engine, pc, task.id, name, path, t0),
        SlotAction::Restore(name, path) => {
            let n = engine
                .restore_prompt_cache(path, pc)
                .map_err(|e| slot_file_error(e, name, path))?;
            Ok(restored(task.id, name, path, n, t0))
        }
        SlotAction::Erase => {
            let n = pc.tokens().len();
            pc.clear();
            Ok(json!({"id_slot": task.id, "n_erased": n}))
        }
    }
}

/// A slot action under `--max-batch K`: slot `i` is the `i`-th kept cache, most recently used
/// first; a restored cache is kept as the most recently used (slot 0).
fn slot_batched(
    engine: &Engine,
    batch: &mut keydiff::Batch<'_>,
    reuse: Option<Reuse>,
    task: &SlotTask,
) -> Result<Value, ApiError> {
    let (Some(_), slots) = (reuse, batch.max_kept()) else {
        return Err(no_prompt_cache());
    };
    if task.id >= slots {
        return Err(bad_slot(task.id, slots));
    }
    let t0 = Instant::now();
    match &task.action {
        SlotAction::Save(name, path) => match batch.kept_cache(task.id) {
            Some(pc) => saved(engine, pc, task.id, name, path, t0),
            None => Err(empty_slot(task.id)),
        },
        SlotAction::Restore(name, path) => {
            let n = batch
                .restore(path)
                .map_err(|e| slot_file_error(e, name, path))?;
            Ok(restored(0, name, path, n, t0))
        }
        SlotAction::Erase => Ok(json!({
            "id_slot": task.id,
            "n_erased": batch.forget_kept(task.id).unwrap_or(0),
        })),
    }
}

/// Saves `pc` as slot `id`'s file: llama.cpp's answer.
fn saved(
    engine: &Engine,
    pc: &PromptCache,
    id: usize,
    name: &str,
    path: &Path,
    t0: Instant,
) -> Result<Value, ApiError> {
    match engine.save_prompt_cache(pc, path) {
        Ok(Some(bytes)) => Ok(json!({
            "id_slot": id,
            "filename": name,
            "n_saved": pc.tokens().len(),
            "n_written": bytes,
            "timings": {"save_ms": t0.elapsed().as_secs_f64() * 1e3},
        })),
        Ok(None) => Err(empty_slot(id)),
        Err(e) => {
            let mut e = slot_file_error(e, name, path);
            if e.status == axum::http::StatusCode::BAD_REQUEST {
                // Writing failed: the server's fault, not the request's.
                e = ApiError::internal(e.message);
            }
            Err(e)
        }
    }
}

/// An engine error about slot file `path`, naming it as the client did (`name`), not by the
/// server's directory.
fn slot_file_error(e: keydiff::EngineError, name: &str, path: &Path) -> ApiError {
    let mut e = ApiError::from(e);
    e.message = e.message.replace(&path.display().to_string(), name);
    e
}

fn restored(id: usize, name: &str, path: &Path, tokens: usize, t0: Instant) -> Value {
    json!({
        "id_slot": id,
        "filename": name,
        "n_restored": tokens,
        "n_read": std::fs::metadata(path).map_or(0, |m| m.len()),
        "timings": {"restore_ms": t0.elapsed().as_secs_f64() * 1e3},
    })
}

fn no_prompt_cache() -> ApiError {
    ApiError::invalid(
        "this server keeps no prompt cache (--prompt-cache off): its slots hold nothing",
        None,
    )
}

fn bad_slot(id: usize, slots: usize) -> ApiError {
    ApiError::invalid(
        format!(
            "invalid slot {id}: this server has {slots} (0 to {})",
            slots - 1
        ),
        Some("id_slot"),
    )
}

fn empty_slot(id: usize) -> ApiError {
    ApiError::invalid(
        format!(
            "slot {id} holds no prompt cache to save (none ran yet, or it could not be reused: \
             under --prompt-cache exact a cache that evicted is not kept)"
        ),
        Some("id_slot"),
    )
}

impl Counters {
    /// Notes what the prompt cache keeps now.
    fn kept(&self, caches: usize, bytes: usize) {
        self.kept_caches.store(caches, Ordering::Relaxed);
        self.kept_bytes.store(bytes as u64, Ordering::Relaxed);
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Queues a request, unless `max_queue` requests wait already; its messages arrive on the
/// returned receiver. Dropping the guard cancels it, and takes it out of the queue when it
/// has not started.
fn submit(
    st: &AppState,
    params: GenerateParams,
    more: Vec<keydiff::Prompt>,
    n: usize,
    stream: bool,
) -> Result<(mpsc::UnboundedReceiver<Msg>, TicketGuard), ApiError> {
    queue(st, params, more, n, stream, None)
}

/// Queues a job: a request, or with `slot` a slot action (which takes no room in a batch).
fn queue(
    st: &AppState,
    mut params: GenerateParams,
    more: Vec<keydiff::Prompt>,
    n: usize,
    stream: bool,
    slot: Option<SlotTask>,
) -> Result<(mpsc::UnboundedReceiver<Msg>, TicketGuard), ApiError> {
    let max = st.cfg.max_queue.max(1);
    let c = &st.counters;
    if c.queued
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
            (q < max).then_some(q + 1)
        })
        .is_err()
    {
        c.rejected.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::unavailable(format!(
            "server busy: {max} requests are waiting; retry later"
        )));
    }
    let ticket = Arc::new(Ticket {
        cancel: CancelToken::new(),
        state: AtomicU8::new(QUEUED),
    });
    params.cancel = Some(ticket.cancel.clone());
    let (events, rx) = mpsc::unbounded_channel();
    let guard = TicketGuard {
        ticket: ticket.clone(),
        counters: st.counters.clone(),
    };
    let job = Job {
        params,
        more,
        n,
        stream,
        ticket,
        events,
        slot,
    };
    match st.jobs.send(job) {
        Ok(()) => Ok((rx, guard)),
        // The guard takes it out of the count.
        Err(_) => Err(ApiError::internal("the generation worker has stopped")),
    }
}

/// Held by a request's handler (and its stream): dropped, because the client went away or
/// the answer is complete, it cancels the request, and takes it out of the queue count when
/// it had not started.
struct TicketGuard {
    ticket: Arc<Ticket>,
    counters: Arc<Counters>,
}

impl Drop for TicketGuard {
    fn drop(&mut self) {
        self.ticket.cancel.cancel();
        if self.ticket.leave(GONE) {
            self.counters.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Which endpoint a response is for.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
    /// llama.cpp's own endpoints (`/completion`, `/infill`), answered in llama.cpp's form.
    Llama,
}

/// The response shapes of one request.
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    /// Text sent before the generated text (`echo`).
    echo: Option<String>,
    /// The echoed texts of a batch's prompts after the first.
    more_echoes: Vec<String>,
    /// Per prompt: its echo is the text as sent, where special-token text (parsed into
    /// special tokens) is written out, so those tokens take their text's room in
    /// `text_offset`.
    echo_as_sent: Vec<bool>,
    /// Choices returned per prompt (`n`).
    n: usize,
    /// The engine whose tokens the logprobs name, when the request asked for logprobs.
    logprobs: Option<Arc<Engine>>,
    /// The text offsets of each completion's logprobs, across a stream's chunks.
    offsets: Vec<logprobs::CompletionLogprobs>,
    /// Read the replies for calls to these tools, in this syntax, as `tool_choice` asked.
    tools: Option<(ToolSyntax, Vec<Tool>, ToolChoice)>,
    /// Split chat replies into `reasoning_content` and `content`; `Some(true)`: the prompt
    /// left the reply inside a `<think>` block.
    reasoning: Option<bool>,
    /// How llama.cpp's own endpoints shape the answer.
    llama: api::LlamaReply,
    /// `stream_options.include_usage`: every chunk carries `"usage": null` but the last.
    usage_null: bool,
}

impl Reply {
    /// The reply to `prompts` prompts with `n` choices each.
    fn new(kind: Kind, model: &str, prompts: usize, n: usize) -> Self {
        let prefix = match kind {
            Kind::Completion | Kind::Llama => "cmpl",
            Kind::Chat => "chatcmpl",
        };
        Self {
            kind,
            id: format!("{prefix}-{:016x}", rand::random::<u64>()),
            created: unix_now(),
            model: model.to_string(),
            echo: None,
            more_echoes: Vec::new(),
            echo_as_sent: Vec::new(),
            n,
            logprobs: None,
            usage_null: false,
            offsets: (0..prompts * n).map(|_| Default::default()).collect(),
            tools: None,
            reasoning: None,
            llama: api::LlamaReply::default(),
        }
    }

    /// The `logprobs` of completion `choice`'s generated tokens `lps` (`null` unless the
    /// request asked).
    fn generated_logprobs(
        &mut self,
        choice: usize,
        lps: &[TokenLogprob],
    ) -> Result<Value, ApiError> {
        let Some(engine) = &self.logprobs else {
            return Ok(Value::Null);
        };
        match self.kind {
            Kind::Completion => {
                let tokens: Vec<u32> = lps.iter().map(|e| e.token).collect();
                let entries: Vec<_> = lps.iter().map(Some).collect();
                self.offsets[choice].object(engine, &tokens, &entries)
            }
            Kind::Chat => logprobs::chat(engine, lps),
            // `n_predict: 0` left its one sampled token out.
            Kind::Llama if self.llama.prefill_only => Ok(Value::Null),
            Kind::Llama => logprobs::llama(engine, lps),
        }
    }

    /// The completion `logprobs` of an echoed prompt, `tokens` with the log-probabilities of
    /// all but the first (`lps`), then of completion `choice`'s generated tokens `generated`.
    fn prompt_logprobs(
        &mut self,
        choice: usize,
        tokens: &[u32],
        lps: &[TokenLogprob],
        generated: &[TokenLogprob],
    ) -> Result<Value, ApiError> {
        let Some(engine) = &self.logprobs else {
            return Ok(Value::Null);
        };
        let tokens: Vec<u32> = tokens
            .iter()
            .copied()
            .chain(generated.iter().map(|e| e.token))
            .collect();
        let entries: Vec<_> = std::iter::once(None)
            .chain(lps.iter().chain(generated).map(Some))
            .collect();
        let as_sent = (self.echo_as_sent)
            .get(choice / self.n.max(1))
            .copied()
            .unwrap_or(false);
        let written = if as_sent {
            tokens.len() - generated.len()
        } else {
            0
        };
        self.offsets[choice].object_with_written_specials(engine, &tokens, &entries, written)
    }

    /// A response object: `id`, `object`, `created`, `model` and `choices`.
    fn envelope(&self, object: &str, choices: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        // OpenAI: with include_usage, the chunks before the last carry a null usage.
        if self.usage_null && object == self.chunk_object() {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The `object` of a streamed chunk.
    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Completion | Kind::Llama => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }

    /// llama.cpp's answer on its own endpoints (and its last streamed chunk, with `content`
    /// empty):
    /// the text, `stop`, the token counts, why it stopped and llama.cpp's `timings`, plus
    /// the engine's figures.
    fn llama_object(&self, out: &Output, streamed: bool) -> Value {
        let s = &out.stats;
        let l = &self.llama;
        let predicted = if l.prefill_only {
            0
        } else {
            s.generated_tokens
        };
        let stop_type = match s.stop_reason {
            _ if l.prefill_only => "limit",
            StopReason::Eos => "eos",
            StopReason::StopString => "word",
            StopReason::MaxTokens | StopReason::Context | StopReason::Indent => "limit",
            StopReason::Cancelled => "none",
        };
        // A stream's last object carries no text: its chunks did.
        let content = if streamed || l.prefill_only {
            ""
        } else {
            &out.text
        };
        let prefilled = s.prompt_tokens.saturating_sub(s.prefix_tokens);
        let per = |n: usize, secs: f64| {
            let ms = secs * 1e3;
            (ms, ms / n.max(1) as f64, n as f64 / secs.max(1e-9))
        };
        let (prompt_ms, prompt_per_token_ms, prompt_per_second) = per(prefilled, s.prefill_s);
        let decode_s = if l.prefill_only { 0.0 } else { s.decode_s };
        let (predicted_ms, predicted_per_token_ms, predicted_per_second) = per(predicted, decode_s);
        let mut v = json!({
            "index": 0,
            "content": content,
            "id_slot": 0,
            "stop": true,
            "model": self.model,
            "tokens_predicted": predicted,
            "tokens_evaluated": s.prompt_tokens,
            // What the cache holds now, as llama.cpp counts it (the last token sampled is not
            // fed); `timings.cache_n` is what came from the prompt cache.
            "tokens_cached": s.prompt_tokens + predicted.saturating_sub(1),
            // The project's files were cut, or the context ended the reply.
            "truncated": l.cut > 0 || s.stop_reason == StopReason::Context,
            "stop_type": stop_type,
            "stopped_eos": stop_type == "eos",
            "stopped_word": stop_type == "word",
            "stopping_word": match stop_type {
                "word" => out.stop_string.as_deref().unwrap_or(""),
                _ => "",
            },
            "stopped_limit": stop_type == "limit",
            "timings": {
                "cache_n": s.prefix_tokens,
                "prompt_n": prefilled,
                "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_per_token_ms,
                "prompt_per_second": prompt_per_second,
                "predicted_n": predicted,
                "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_per_token_ms,
                "predicted_per_second": predicted_per_second,
            },
            "keydiff": api::stats(out),
        });
        // llama.cpp's speculative counts, when the request drafted.
        if let Some(c) = s.speculative.filter(|c| c.drafted > 0) {
            v["timings"]["draft_n"] = json!(c.drafted);
            v["timings"]["draft_n_accepted"] = json!(c.accepted);
        }
        if l.fields.is_empty() {
            return v;
        }
        // llama.cpp's `response_fields`: the paths asked for, as flat keys.
        let picked: serde_json::Map<String, Value> = (l.fields.iter())
            .filter_map(|path| {
                let mut at = &v;
                for key in path.split('/') {
                    at = at.get(key)?;
                }
                Some((path.clone(), at.clone()))
            })
            .collect();
        Value::Object(picked)
    }

    fn full(&mut self, outs: &[Output]) -> Result<Value, ApiError> {
        if self.kind == Kind::Llama {
            let out = outs
                .first()
                .ok_or_else(|| ApiError::internal("no output"))?;
            let mut v = self.llama_object(out, false);
            let probs = self.generated_logprobs(0, out.logprobs.as_deref().unwrap_or_default())?;
            let fields = &self.llama.fields;
            if !probs.is_null()
                && (fields.is_empty() || fields.iter().any(|f| f == "completion_probabilities"))
            {
                v["completion_probabilities"] = probs;
            }
            return Ok(v);
        }
        let mut choices = Vec::with_capacity(outs.len());
        for (i, out) in outs.iter().enumerate() {
            let reason = api::finish_reason(out.stats.stop_reason);
            let echo = match i / self.n.max(1) {
                0 => self.echo.as_deref(),
                k => self.more_echoes.get(k - 1).map(String::as_str),
            };
            let text = format!("{}{}", echo.unwrap_or(""), out.text);
            let generated = out.logprobs.as_deref().unwrap_or_default();
            let logprobs = match (self.kind, &out.prompt_logprobs) {
                (Kind::Completion, Some(p)) if self.echo.is_some() => {
                    self.prompt_logprobs(i, &out.prompt_tokens, p, generated)?
                }
                _ => self.generated_logprobs(i, generated)?,
            };
            let mut choice = match self.kind {
                Kind::Completion => {
                    json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason})
                }
                Kind::Llama => unreachable!("answered above"),
                Kind::Chat => {
                    let (reasoning, text) = match self.reasoning {
                        Some(open) => {
                            let s = keydiff::reasoning::split(&text, open);
                            (s.reasoning, s.content)
                        }
                        None => (None, text),
                    };
                    let mut message = json!({"role": "assistant", "content": text});
                    if let Some(r) = reasoning {
                        // DeepSeek's and llama.cpp's name, and vLLM's since late 2025: clients read
                        // one or the other.
                        message["reasoning_content"] = r.clone().into();
                        message["reasoning"] = r.into();
                    }
                    let mut reason = reason;
                    if let Some((syntax, tools, choice)) = &self.tools {
                        let p = syntax.parse(&text, tools);
                        if !p.calls.is_empty() {
                            let content = p.content.trim();
                            message["content"] = match content.is_empty() {
                                true => Value::Null,
                                false => content.into(),
                            };
                            message["tool_calls"] = api::tool_calls(&p.calls, false);
                            reason = tool_reason(reason, choice);
                        }
                    }
                    json!({
                        "index": i,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": reason,
                    })
                }
            };
            if outs.len() > 1 {
                choice["keydiff"] = api::stats(out);
            }
            choices.push(choice);
        }
        let object = match self.kind {
            Kind::Completion | Kind::Llama => "text_completion",
            Kind::Chat => "chat.completion",
        };
        let mut v = self.envelope(object, Value::Array(choices));
        v["usage"] = api::usage(outs, self.n);
        v["keydiff"] = outs.first().map_or(Value::Null, api::stats);
        Ok(v)
    }

    /// One streamed chunk of completion `choice`: a piece of text (`None` with `finish` for
    /// its last one) and the `logprobs` of the tokens it completes.
    fn chunk(
        &self,
        choice: usize,
        text: Option<&str>,
        role: bool,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        let choice = match self.kind {
            // llama.cpp's stream: the text, `stop`, and the probabilities of its tokens.
            Kind::Llama => {
                let mut v = json!({"index": 0, "content": text.unwrap_or(""), "stop": false});
                if !logprobs.is_null() {
                    v["completion_probabilities"] = logprobs;
                }
                return v;
            }
            Kind::Completion => json!({
                "index": choice,
                "text": text.unwrap_or(""),
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        self.envelope(self.chunk_object(), json!([choice]))
    }

    /// A streamed chunk of chat completion `choice`'s reasoning.
    fn reasoning_chunk(&self, choice: usize, text: &str, logprobs: Value) -> Value {
        let delta = json!({"reasoning_content": text, "reasoning": text});
        let c =
            json!({"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": null});
        self.envelope(self.chunk_object(), json!([c]))
    }

    /// The chunk of completion `choice` that carries its calls.
    fn tool_calls_chunk(&self, choice: usize, calls: &[keydiff::tools::ToolCall]) -> Value {
        let delta = json!({"tool_calls": api::tool_calls(calls, true)});
        let c = json!({"index": choice, "delta": delta, "logprobs": null, "finish_reason": null});
        self.envelope(self.chunk_object(), json!([c]))
    }

    /// The chunk that closes a stream with `stream_options.include_usage`.
    fn usage_chunk(&self, outs: &[Output]) -> Value {
        let mut v = self.envelope(self.chunk_object(), json!([]));
        v["usage"] = api::usage(outs, self.n);
        v
    }
}

/// Text prompts as llama-server and vLLM read them on their completion endpoints: in the
/// model's own format, special-token text such as `<|im_start|>` parsed
/// ([`Engine::tokenize_formatted`]). Returns the texts (for `echo`), `None` for prompts that
/// were token ids or a fill in the middle.
async fn formatted_prompts(
    st: &AppState,
    mapped: &mut api::Mapped,
) -> Result<Vec<Option<String>>, ApiError> {
    let texts: Vec<Option<String>> = std::iter::once(&mapped.params.prompt)
        .chain(&mapped.more)
        .map(|p| match p {
            keydiff::Prompt::Text(t) => Some(t.clone()),
            _ => None,
        })
        .collect();
    if texts.iter().all(Option::is_none) {
        return Ok(texts);
    }
    let batch = texts.len() > 1;
    let each = texts.clone();
    let ids = with_engine(st, move |e| {
        each.iter()
            .enumerate()
            .map(|(k, t)| {
                t.as_ref()
                    .map(|t| {
                        (e.check_text_fits(t).and_then(|()| e.tokenize_formatted(t))).map_err(
                            |err| match batch {
                                true => {
                                    ApiError::invalid(format!("prompt {k}: {err}"), Some("prompt"))
                                }
                                false => err.into(),
                            },
                        )
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>, ApiError>>()
    })
    .await?;
    for (p, ids) in std::iter::once(&mut mapped.params.prompt)
        .chain(mapped.more.iter_mut())
        .zip(ids)
    {
        if let Some(ids) = ids {
            *p = keydiff::Prompt::Tokens(ids);
        }
    }
    Ok(texts)
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let mut mapped = api::parse::<CompletionRequest>(&body)?.map(defaults(&st))?;
    let texts = formatted_prompts(&st, &mut mapped).await?;
    let prompts = 1 + mapped.more.len();
    if prompts > 1 {
        // A bad prompt of a batch is refused before any of them runs.
        let all: Vec<keydiff::Prompt> = std::iter::once(&mapped.params.prompt)
            .chain(&mapped.more)
            .cloned()
            .collect();
        with_engine(&st, move |e| {
            for (k, p) in all.iter().enumerate() {
                let checked = e
                    .prompt_tokens(p)
                    .and_then(|ids| e.within_context(ids.len()));
                if let Err(err) = checked {
                    return Err(ApiError::invalid(
                        format!("prompt {k}: {err}"),
                        Some("prompt"),
                    ));
                }
            }
            Ok(())
        })
        .await?;
    }
    let mut reply = Reply::new(Kind::Completion, &st.cfg.model_id, prompts, mapped.n);
    if mapped.echo {
        let mut echoes = Vec::with_capacity(prompts);
        reply.echo_as_sent = texts.iter().map(Option::is_some).collect();
        for (p, text) in std::iter::once(&mapped.params.prompt)
            .chain(&mapped.more)
            .zip(texts)
        {
            echoes.push(match (p, text) {
                (_, Some(t)) => t,
                (keydiff::Prompt::Tokens(ids), None) => {
                    let ids = ids.clone();
                    with_engine(&st, move |e| {
                        e.check_vocab(&ids)?;
                        Ok(e.detokenize(&ids)?)
                    })
                    .await?
                }
                (keydiff::Prompt::Text(t), None) => t.clone(),
                (
                    keydiff::Prompt::Chat(_)
                    | keydiff::Prompt::ChatTools { .. }
                    | keydiff::Prompt::Infill { .. },
                    None,
                ) => {
                    unreachable!("completions take no messages, and echo no suffix")
                }
            });
        }
        reply.more_echoes = echoes.split_off(1);
        reply.echo = echoes.pop();
    }
    Ok(respond(st, mapped, reply).await)
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut mapped = api::parse::<ChatRequest>(&body)?.map(defaults(&st))?;
    let mut reply = Reply::new(Kind::Chat, &st.cfg.model_id, 1, mapped.n);
    reply.reasoning = st
        .engine
        .reasoning_start(&mapped.params.prompt, st.cfg.reasoning_format)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    // Tool calls and response formats shape the answer: the reasoning before it is free,
    // and a lazy grammar's trigger inside it does not count.
    if mapped.answer_format {
        let format = std::mem::replace(&mut mapped.params.sampling.format, keydiff::Format::Text);
        mapped.params.sampling.format = format.after_reasoning(reply.reasoning);
    }
    Ok(respond(st, mapped, reply).await)
}

/// OpenAI's `finish_reason` of a reply that called functions: `tool_calls` where it ended by
/// itself (`stop`), else what ended it (`length`: the calls were read nonetheless). A call
/// to the function `tool_choice` named ends with `stop`, as in OpenAI's API and vLLM.
fn tool_reason(reason: &'static str, choice: &ToolChoice) -> &'static str {
    match (reason, choice) {
        (_, ToolChoice::Function(_)) => reason,
        ("stop", _) => "tool_calls",
        (r, _) => r,
    }
}

/// `POST /infill` (llama.cpp's).
async fn infill(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let mut mapped = api::parse::<api::InfillRequest>(&body)?.map(defaults(&st))?;
    // The project's files are cut from their start, as llama.cpp cuts them: to 5/8 of the
    // context (the same cut for every request on the same files, whatever the prefix), and
    // further where the reply would have less room than it asks for (a quarter of the
    // context at most).
    if let keydiff::Prompt::Infill {
        prefix,
        suffix,
        repo,
    } = &mapped.params.prompt
    {
        let (prefix, suffix) = (prefix.clone(), suffix.clone());
        let repo = repo.clone().unwrap_or_default();
        let want = mapped.params.max_tokens;
        let (ids, cut) = with_engine(&st, move |e| {
            let context = e.model_config().context();
            let room = want.min(context / 4);
            Ok(e.infill_within(&prefix, &suffix, &repo, room, context / 8 * 5)?)
        })
        .await?;
        if cut > 0 {
            tracing::info!("/infill: the project's files lost {cut} tokens to fit the context");
        }
        mapped.params.prompt = keydiff::Prompt::Tokens(ids);
        mapped.llama.cut = cut;
    }
    let reply = Reply::new(Kind::Llama, &st.cfg.model_id, 1, mapped.n);
    Ok(respond(st, mapped, reply).await)
}

/// `POST /completion` and `/completions` (llama.cpp's own).
async fn llama_completion(
    State(st): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut mapped = api::parse::<api::LlamaCompletionRequest>(&body)?.map(defaults(&st))?;
    // llama.cpp parses special-token text in this endpoint's prompts (a prompt written in
    // the chat format), where keydiff's own text prompts keep it as text.
    formatted_prompts(&st, &mut mapped).await?;
    let reply = Reply::new(Kind::Llama, &st.cfg.model_id, 1, mapped.n);
    Ok(respond(st, mapped, reply).await)
}

fn defaults(st: &AppState) -> Defaults {
    Defaults {
        max_tokens: st.cfg.max_tokens,
        tool_syntax: st.engine.tool_syntax(),
        sampling: match st.cfg.generation_config {
            true => st.engine.sampling_defaults(),
            false => keydiff::SamplingDefaults::default(),
        },
        speculative: st.cfg.speculative,
    }
}

/// A message of a request that answers with its prompt only ([`api::Mapped::prompt_only`]):
/// the one token it generated, its text and its log-probability left out.
fn only_the_prompt(msg: Msg) -> Option<Msg> {
    let strip = |out: &mut Output| {
        out.text.clear();
        out.tokens.clear();
        if let Some(l) = &mut out.logprobs {
            l.clear();
        }
        out.stop_string = None;
        out.stats.generated_tokens = 0;
        out.stats.stop_reason = StopReason::MaxTokens;
    };
    match msg {
        Msg::Text(..) | Msg::Logprob(..) => None,
        Msg::Ended(i, mut out) => {
            strip(&mut out);
            Some(Msg::Ended(i, out))
        }
        Msg::Done(Ok(mut outs)) => {
            outs.iter_mut().for_each(strip);
            Some(Msg::Done(Ok(outs)))
        }
        m => Some(m),
    }
}

/// Runs a mapped request and answers it, whole or as a stream.
async fn respond(st: Arc<AppState>, m: Mapped, mut reply: Reply) -> Response {
    let Mapped {
        mut params,
        more,
        n,
        best_of,
        hide_logprobs,
        stream,
        include_usage,
        echo: _,
        answer_format: _,
        tools,
        llama,
        bias_texts,
        prompt_only,
    } = m;
    reply.usage_null = stream && include_usage && reply.kind != Kind::Llama;
    // llama.cpp's logit bias on a text: on each of its tokens (as a continuation, as there).
    if !bias_texts.is_empty() {
        let biased = with_engine(&st, move |e| {
            let mut out = Vec::new();
            for (text, bias) in bias_texts {
                out.extend(
                    e.tokenize_continuation(&text)?
                        .into_iter()
                        .map(|t| (t, bias)),
                );
            }
            Ok(out)
        })
        .await;
        match biased {
            Ok(b) => params.sampling.logit_bias.extend(b),
            Err(e) => return e.into_response(),
        }
    }
    reply.tools = tools;
    reply.llama = llama;
    if params.logprobs.is_some() && !hide_logprobs {
        reply.logprobs = Some(st.engine.clone());
    }
    // An echoed prompt with logprobs is sent once they are known, after the prefill.
    let echo_waits = params.prompt_logprobs.is_some();
    let (mut rx, guard) = match submit(&st, params, more, best_of, stream) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    // Wait until the request is running (or has failed): a request refused by the engine
    // (a prompt beyond the context, a cache that does not fit) gets its status code even
    // when it asked for a stream.
    let first = match rx.recv().await {
        Some(Msg::Done(Err(e))) => return e.into_response(),
        Some(m) => m,
        None => return ApiError::internal("the generation worker stopped").into_response(),
    };
    if !stream {
        let mut msg = Some(first);
        loop {
            if prompt_only {
                // A message left out: the next one (a channel's end stays `None`).
                match msg.take().map(only_the_prompt) {
                    Some(None) => {
                        msg = rx.recv().await;
                        continue;
                    }
                    m => msg = m.flatten(),
                }
            }
            match msg.take() {
                Some(Msg::Done(Ok(outs))) => {
                    // `usage` counts every completion generated, returned or not.
                    let usage = api::usage(&outs, best_of);
                    let outs = api::best(outs, best_of, n);
                    // Logprobs of a long prompt make a large body: built off the async threads.
                    let built = tokio::task::spawn_blocking(move || {
                        let mut v = reply.full(&outs)?;
                        if reply.kind != Kind::Llama {
                            v["usage"] = usage;
                        }
                        Ok::<_, ApiError>(v)
                    })
                    .await;
                    return match built {
                        Ok(Ok(v)) => Json(v).into_response(),
                        Ok(Err(e)) => e.into_response(),
                        Err(e) => ApiError::internal(format!("building the response: {e}"))
                            .into_response(),
                    };
                }
                Some(Msg::Done(Err(e))) => return e.into_response(),
                Some(_) => {}
                None => return ApiError::internal("the generation worker stopped").into_response(),
            }
            msg = rx.recv().await;
        }
    }
    let (tx, mut sse_rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
    tokio::spawn(async move {
        let _guard = guard;
        let send = |v: Value| tx.send(Ok(SseEvent::default().data(v.to_string())));
        let fail = |e: ApiError| {
            let _ = send(json!({ "error": e.body() }));
        };
        let mut pending = Some(first);
        // Each completion's logprobs of tokens whose text has not been sent yet, and whether
        // its last chunk went.
        let mut lps: Vec<Vec<TokenLogprob>> = (0..n).map(|_| Vec::new()).collect();
        let mut finished = vec![false; n];
        // With tools, each completion's text that may be a call, held back until it ends.
        let mut held: Vec<Option<ToolStream>> = (0..n)
            .map(|_| {
                reply
                    .tools
                    .as_ref()
                    .map(|(syntax, ..)| ToolStream::new(*syntax))
            })
            .collect();
        // Splitting reasoning from content, each completion's stream of pieces.
        let mut thinking: Vec<Option<ReasoningStream>> = (0..n)
            .map(|_| reply.reasoning.map(ReasoningStream::new))
            .collect();
        // Completion `i`'s last chunks: with tools, the content held back and the calls;
        // then the logprobs of tokens whose text was not sent with text (an end of turn, a
        // cut stop string, calls), the finish reason and the engine's figures.
        let last_chunks = |reply: &mut Reply,
                           lps: &mut Vec<TokenLogprob>,
                           held: &mut Option<ToolStream>,
                           thinking: &mut Option<ReasoningStream>,
                           i: usize,
                           out: &Output| {
            let mut chunks = Vec::new();
            let mut reason = api::finish_reason(out.stats.stop_reason);
            let rest = thinking.take().map(ReasoningStream::finish);
            for piece in rest.into_iter().flatten() {
                match piece {
                    Piece::Reasoning(r) => chunks.push(reply.reasoning_chunk(i, &r, Value::Null)),
                    Piece::Content(c) => {
                        let c = match held {
                            Some(h) => h.push(&c),
                            None => c,
                        };
                        if !c.is_empty() {
                            chunks.push(reply.chunk(i, Some(&c), false, None, Value::Null));
                        }
                    }
                }
            }
            if let (Some(h), Some((_, tools, choice))) = (held.take(), &reply.tools) {
                let p = h.finish(tools);
                if !p.content.is_empty() {
                    chunks.push(reply.chunk(i, Some(&p.content), false, None, Value::Null));
                }
                if !p.calls.is_empty() {
                    chunks.push(reply.tool_calls_chunk(i, &p.calls));
                    reason = tool_reason(reason, choice);
                }
            }
            let rest = match lps.is_empty() {
                true => Ok(Value::Null),
                false => reply.generated_logprobs(i, &std::mem::take(lps)),
            };
            rest.map(|l| {
                let last = match reply.kind {
                    Kind::Llama => {
                        let mut last = reply.llama_object(out, true);
                        if !l.is_null() {
                            last["completion_probabilities"] = l;
                        }
                        last
                    }
                    _ => {
                        let mut last = reply.chunk(i, None, false, Some(reason), l);
                        last["keydiff"] = api::stats(out);
                        last
                    }
                };
                chunks.push(last);
                chunks
            })
        };
        loop {
            let msg = match pending.take() {
                Some(m) => m,
                None => tokio::select! {
                    m = rx.recv() => match m {
                        Some(m) => m,
                        // The worker is gone without an answer: say so, not a clean end.
                        None => Msg::Done(Err(ApiError::internal(
                            "the generation worker stopped",
                        ))),
                    },
                    // The client went away: dropping `_guard` cancels the request.
                    _ = tx.closed() => return,
                },
            };
            let Some(msg) = (match prompt_only {
                true => only_the_prompt(msg),
                false => Some(msg),
            }) else {
                continue;
            };
            let chunks: Result<Vec<Value>, ApiError> = match msg {
                Msg::Started => {
                    // The chat role, or an echoed prompt, opens each completion's stream.
                    match reply.kind {
                        Kind::Chat => Ok((0..n)
                            .map(|i| reply.chunk(i, Some(""), true, None, Value::Null))
                            .collect()),
                        Kind::Completion | Kind::Llama if echo_waits => continue,
                        Kind::Completion | Kind::Llama => match reply.echo.take() {
                            Some(e) => Ok((0..n)
                                .map(|i| reply.chunk(i, Some(&e), false, None, Value::Null))
                                .collect()),
                            None => continue,
                        },
                    }
                }
                Msg::PromptLogprobs(tokens, p) => {
                    let Some(e) = reply.echo.take() else { continue };
                    // A long prompt's logprobs: built off the async threads.
                    let built = tokio::task::spawn_blocking(move || {
                        let chunks = (0..n)
                            .map(|i| {
                                let l = reply.prompt_logprobs(i, &tokens, &p, &[])?;
                                Ok(reply.chunk(i, Some(&e), false, None, l))
                            })
                            .collect();
                        (chunks, reply)
                    })
                    .await;
                    match built {
                        Ok((chunks, back)) => {
                            reply = back;
                            chunks
                        }
                        Err(e) => {
                            fail(ApiError::internal(format!("building the response: {e}")));
                            let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
                            return;
                        }
                    }
                }
                Msg::Logprob(i, t) => {
                    lps[i].push(t);
                    continue;
                }
                // `n_predict: 0`: the prompt only.
                Msg::Text(..) if reply.llama.prefill_only => continue,
                Msg::Text(i, t) => {
                    let pieces = match &mut thinking[i] {
                        Some(r) => r.push(&t),
                        None => vec![Piece::Content(t)],
                    };
                    // (reasoning?, text) to send, content through the tool calls' hold.
                    let mut sends = Vec::new();
                    for piece in pieces {
                        match piece {
                            Piece::Reasoning(r) => sends.push((true, r)),
                            Piece::Content(c) => {
                                let c = match &mut held[i] {
                                    Some(h) => h.push(&c),
                                    None => c,
                                };
                                if !c.is_empty() {
                                    sends.push((false, c));
                                }
                            }
                        }
                    }
                    // Held back: its tokens' logprobs go with the text that comes.
                    if sends.is_empty() {
                        continue;
                    }
                    reply
                        .generated_logprobs(i, &std::mem::take(&mut lps[i]))
                        .map(|l| {
                            let mut l = Some(l);
                            sends
                                .iter()
                                .map(|(reasoning, t)| {
                                    let l = l.take().unwrap_or(Value::Null);
                                    match reasoning {
                                        true => reply.reasoning_chunk(i, t, l),
                                        false => reply.chunk(i, Some(t), false, None, l),
                                    }
                                })
                                .collect()
                        })
                }
                Msg::Ended(i, out) => {
                    finished[i] = true;
                    last_chunks(
                        &mut reply,
                        &mut lps[i],
                        &mut held[i],
                        &mut thinking[i],
                        i,
                        &out,
                    )
                }
                Msg::Done(Ok(outs)) => {
                    let lasts: Result<Vec<Value>, ApiError> = outs
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| !finished[*i])
                        .map(|(i, out)| {
                            last_chunks(
                                &mut reply,
                                &mut lps[i],
                                &mut held[i],
                                &mut thinking[i],
                                i,
                                out,
                            )
                        })
                        .collect::<Result<Vec<_>, _>>()
                        .map(|v| v.concat());
                    match lasts {
                        Ok(mut chunks) => {
                            if include_usage {
                                chunks.push(reply.usage_chunk(&outs));
                            }
                            for c in chunks {
                                let _ = send(c);
                            }
                        }
                        Err(e) => fail(e),
                    }
                    break;
                }
                Msg::Done(Err(e)) => {
                    fail(e);
                    break;
                }
                Msg::Slot(_) => {
                    fail(ApiError::internal("a slot action's answer in a stream"));
                    break;
                }
            };
            let sent = match chunks {
                Ok(cs) => cs.into_iter().try_for_each(|c| send(c).map_err(|_| ())),
                Err(e) => {
                    fail(e);
                    break;
                }
            };
            if sent.is_err() {
                return;
            }
        }
        // llama.cpp ends its own streams without `[DONE]`.
        if reply.kind != Kind::Llama {
            let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
        }
    });
    let events = futures_util::stream::poll_fn(move |cx| sse_rx.poll_recv(cx));
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.cfg.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "keydiff",
            "max_model_len": st.context,
        }],
    }))
}

/// Runs `f` on the engine off the async threads (tokenizing a long prompt takes a while).
async fn with_engine<T: Send + 'static>(
    st: &AppState,
    f: impl FnOnce(&Engine) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let engine = st.engine.clone();
    tokio::task::spawn_blocking(move || f(&engine))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
}

async fn tokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let req = api::parse::<api::TokenizeRequest>(&body)?;
    let raw = req.raw_text().map(str::to_string);
    let prompt = req.prompt()?;
    let tokens = with_engine(&st, move |e| match (raw, prompt) {
        (Some(text), _) => Ok(e.tokenize_special(&text)?),
        // As `/v1/completions` reads a text prompt.
        (None, keydiff::Prompt::Text(text)) => Ok(e.tokenize_formatted(&text)?),
        (None, prompt) => Ok(e.prompt_tokens(&prompt)?),
    })
    .await?;
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": st.context,
        "tokens": tokens,
    })))
}

/// `GET /tokenizer_info` (vLLM's): the special tokens, the chat template and the context, for
/// clients that tokenize through this server (lm-evaluation-harness's remote tokenizer).
async fn tokenizer_info(State(st): State<Arc<AppState>>) -> Json<Value> {
    let e = &st.engine;
    Json(json!({
        "tokenizer_class": "keydiff",
        "bos_token": e.bos_token(),
        "eos_token": e.eos_token(),
        "pad_token": null,
        "add_bos_token": e.adds_bos(),
        "chat_template": e.chat_template(),
        "model_max_length": st.context,
    }))
}

async fn detokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let req: api::DetokenizeRequest = api::parse(&body)?;
    let text = with_engine(&st, move |e| {
        e.check_vocab(&req.tokens)?;
        Ok(e.detokenize(&req.tokens)?)
    })
    .await?;
    Ok(Json(json!({ "prompt": text })))
}

/// `POST /slots/{id}?action=save|restore|erase` (llama.cpp's slot actions): saves slot `id`'s
/// prompt cache to `{"filename": ...}` under `--slot-save-path`, restores one from there, or
/// frees it. Queued as a request is, and run between requests (a batch's steps).
async fn slot_action(
    State(st): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
    uri: axum::http::Uri,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let id: usize = id.parse().map_err(|_| {
        ApiError::invalid(
            format!("invalid slot id `{id}`: expected a number"),
            Some("id_slot"),
        )
    })?;
    let action = uri
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("action="))
        .unwrap_or("");
    let file = |st: &AppState| -> Result<(String, PathBuf), ApiError> {
        let Some(dir) = &st.cfg.slot_save_path else {
            return Err(ApiError {
                status: axum::http::StatusCode::NOT_IMPLEMENTED,
                kind: "not_supported_error",
                message: "slot save and restore need a directory for the files: start the \
                          server with --slot-save-path DIR"
                    .into(),
                param: None,
            });
        };
        let req: api::SlotFileRequest = api::parse(&body)?;
        api::check_slot_filename(&req.filename)?;
        let path = dir.join(&req.filename);
        Ok((req.filename, path))
    };
    let action = match action {
        "save" => {
            let (name, path) = file(&st)?;
            SlotAction::Save(name, path)
        }
        "restore" => {
            let (name, path) = file(&st)?;
            SlotAction::Restore(name, path)
        }
        "erase" => SlotAction::Erase,
        other => {
            return Err(ApiError::invalid(
                format!("invalid slot action `{other}` (expected ?action=save, restore or erase)"),
                Some("action"),
            ))
        }
    };
    let task = SlotTask { id, action };
    let (mut rx, _guard) = queue(
        &st,
        GenerateParams::default(),
        Vec::new(),
        0,
        false,
        Some(task),
    )?;
    loop {
        match rx.recv().await {
            Some(Msg::Slot(r)) => return r.map(Json),
            Some(Msg::Done(Err(e))) => return Err(e),
            Some(_) => {}
            None => return Err(ApiError::internal("the generation worker stopped")),
        }
    }
}

/// Prometheus text exposition of the counters.
async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    use std::fmt::Write;
    let c = &st.counters;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let secs = |a: &AtomicU64| n(a) as f64 / 1e6;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, String)]| {
        let _ = writeln!(
            out,
            "# HELP keydiff_{name} {help}\n# TYPE keydiff_{name} {kind}"
        );
        for (labels, v) in samples {
            let _ = writeln!(out, "keydiff_{name}{labels} {v}");
        }
    };
    metric(
        "requests_total",
        "counter",
        "Requests by outcome.",
        &[
            ("{outcome=\"completed\"}", n(&c.completed).to_string()),
            ("{outcome=\"cancelled\"}", n(&c.cancelled).to_string()),
            ("{outcome=\"failed\"}", n(&c.failed).to_string()),
            ("{outcome=\"rejected\"}", n(&c.rejected).to_string()),
        ],
    );
    let gauge = |a: &AtomicUsize| a.load(Ordering::Relaxed).to_string();
    metric(
        "requests_queued",
        "gauge",
        "Requests waiting.",
        &[("", gauge(&c.queued))],
    );
    metric(
        "requests_running",
        "gauge",
        "Requests running (at most the server's --max-batch).",
        &[("", gauge(&c.running))],
    );
    metric(
        "prompt_cache_entries",
        "gauge",
        "KV caches kept for later requests (at most the server's --max-batch).",
        &[("", gauge(&c.kept_caches))],
    );
    metric(
        "prompt_cache_bytes",
        "gauge",
        "Bytes of the KV caches kept for later requests.",
        &[("", n(&c.kept_bytes).to_string())],
    );
    for (name, help, v) in [
        (
            "prompt_tokens_total",
            "Prompt tokens of completed requests.",
            &c.prompt_tokens,
        ),
        (
            "cached_prompt_tokens_total",
            "Prompt tokens reused from the prompt cache.",
            &c.cached_tokens,
        ),
        (
            "generated_tokens_total",
            "Tokens generated by completed requests.",
            &c.generated_tokens,
        ),
        (
            "spec_decode_draft_tokens_total",
            "Tokens drafted by speculative decoding (serve --spec-type).",
            &c.draft_tokens,
        ),
        (
            "spec_decode_accepted_tokens_total",
            "Drafted tokens that were the tokens sampled.",
            &c.accepted_tokens,
        ),
    ] {
        metric(name, "counter", help, &[("", n(v).to_string())]);
    }
    let done = n(&c.completed).to_string();
    for (name, help, v) in [
        (
            "time_to_first_token_seconds",
            "Time to first token of completed requests.",
            &c.ttft_us,
        ),
        (
            "prefill_seconds",
            "Prefill time of completed requests.",
            &c.prefill_us,
        ),
        (
            "decode_seconds",
            "Decode time of completed requests.",
            &c.decode_us,
        ),
    ] {
        metric(
            name,
            "summary",
            help,
            &[("_sum", secs(v).to_string()), ("_count", done.clone())],
        );
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        out,
    )
        .into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Json<Value> {
    let c = &st.counters;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    Json(json!({
        "status": "ok",
        "model": st.cfg.model_id,
        "context": st.context,
        "policy": st.policy,
        "budget": st.budget,
        "queued": c.queued.load(Ordering::Relaxed),
        "running": c.running.load(Ordering::Relaxed),
        "max_queue": st.cfg.max_queue,
        "completed": n(&c.completed),
        "cancelled": n(&c.cancelled),
        "failed": n(&c.failed),
        "rejected": n(&c.rejected),
        "prompt_tokens": n(&c.prompt_tokens),
        "cached_prompt_tokens": n(&c.cached_tokens),
        "prompt_cache_entries": c.kept_caches.load(Ordering::Relaxed),
        "prompt_cache_bytes": n(&c.kept_bytes),
        "prompt_cache": match st.cfg.prompt_cache {
            None => "off",
            Some(Reuse::Exact) => "exact",
            Some(Reuse::Continue) => "continue",
        },
        "generated_tokens": n(&c.generated_tokens),
        "spec_draft_tokens": n(&c.draft_tokens),
        "spec_accepted_tokens": n(&c.accepted_tokens),
    }))
}
