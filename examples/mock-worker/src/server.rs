//! HTTP front end (hyper 1, HTTP/1.1): OpenAI routes, SSE streaming, ORCA load reports,
//! metrics, the cache probe and the prefill-to-decode handoff.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::api::{self, ApiError, Kind, Parsed};
use crate::config::{Config, Role};
use crate::engine::{self, Arrival, Event, NewRequest, Shared, Timing, Usage};
use crate::kv;
use crate::kv_events;
use crate::metrics;
use crate::orca;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type RespBody = UnsyncBoxBody<Bytes, BoxError>;

/// Request header on a decode worker: the first N prompt tokens arrive as transferred KV.
pub const KV_TRANSFER_HEADER: &str = "x-kvroute-kv-transfer";
pub const WORKER_ID_HEADER: &str = "x-worker-id";
pub const PREFILL_WORKER_ID_HEADER: &str = "x-prefill-worker-id";
pub const PREFILL_CACHED_HEADER: &str = "x-prefill-cached-tokens";
pub const ORCA_FORMAT_HEADER: &str = "endpoint-load-metrics-format";
pub const ORCA_HEADER: &str = "endpoint-load-metrics";
/// The decode worker's own ORCA report, kept when a prefill worker relays its response.
pub const DECODE_ORCA_HEADER: &str = "x-decode-endpoint-load-metrics";
/// The engine's own timing of a request (seconds on its schedule, see `engine::Timing`):
/// a response header on JSON responses, an SSE comment line before `[DONE]` on streams.
pub const TIMING_HEADER: &str = "x-mock-engine-timing";

fn timing_value(t: &Timing) -> String {
    format!("ttft={:.6};e2e={:.6}", t.ttft, t.e2e)
}

/// Wall-clock seconds since the epoch: comparable with a client's clock on the same machine.
fn unix_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Largest accepted request body; far above any prompt within --max-model-len.
const BODY_LIMIT: usize = 64 << 20;

struct Ctx {
    shared: Arc<Shared>,
    client: Client<HttpConnector, Full<Bytes>>,
    warned_no_decode: AtomicBool,
    seq: AtomicU64,
    /// Requests answered by `/tokenize` and the two render routes, in `metrics::PREPARE_ROUTES`
    /// order: what shows that a router (vllm-router's cache_aware) tokenizes through us.
    prepared: [AtomicU64; metrics::PREPARE_ROUTES.len()],
}

/// A running server (used by `main` and by in-process tests).
pub struct Handle {
    pub addr: SocketAddr,
    pub name: String,
    pub shared: Arc<Shared>,
    /// Where the KV cache events are published (`--kv-events`), as bound.
    pub kv_events: Option<kv_events::Endpoints>,
}

/// Binds, spawns the engine loop and the accept loop on the current runtime, and returns.
pub async fn start(mut cfg: Config) -> std::io::Result<Handle> {
    cfg.validate().map_err(std::io::Error::other)?;
    if let Some(warning) = cfg.fit_context_to_kv() {
        eprintln!("mock-worker: warning: {warning}");
    }
    if cfg.role == Role::Prefill && cfg.allowed_decode_endpoints.is_empty() {
        eprintln!(
            "mock-worker: warning: no --allowed-decode-endpoints: this prefill worker hands off to any {} a client names",
            cfg.decode_endpoint_header
        );
    }
    let listener = TcpListener::bind((cfg.host.as_str(), cfg.port)).await?;
    let addr = listener.local_addr()?;
    let name = cfg.worker_name(addr.port());
    let shared = Shared::new(cfg, name.clone());
    let kv_events = match &shared.cfg.kv_events {
        Some(endpoint) => {
            let cfg = &shared.cfg;
            let (tx, rx) = mpsc::channel(kv_events::QUEUE);
            let settings = kv_events::Settings {
                endpoint: endpoint.clone(),
                replay: cfg.kv_events_replay.clone(),
                topic: cfg.kv_events_topic.clone(),
                buffer: cfg.kv_events_buffer,
                format: cfg.kv_events_format,
            };
            let bound = kv_events::start(settings, rx)
                .await
                .map_err(std::io::Error::other)?;
            shared.state.lock().unwrap().publish_events(tx);
            Some(bound)
        }
        None => None,
    };
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new()).build(http);
    let ctx = Arc::new(Ctx {
        shared: shared.clone(),
        client,
        warned_no_decode: AtomicBool::new(false),
        seq: AtomicU64::new(0),
        prepared: Default::default(),
    });
    // The engine loop gets its own OS thread (with its own timer runtime) so that hundreds of
    // busy connections cannot delay a pass: the kernel wakes the mostly-sleeping engine thread
    // promptly, and tokens that pile up meanwhile leave in one write per connection.
    let engine_shared = shared.clone();
    std::thread::Builder::new()
        .name(format!("engine-{}", addr.port()))
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("engine runtime");
            rt.block_on(engine::run(engine_shared));
        })?;
    tokio::spawn(accept_loop(listener, ctx));
    Ok(Handle {
        addr,
        name,
        shared,
        kv_events,
    })
}

async fn accept_loop(listener: TcpListener, ctx: Arc<Ctx>) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Typically out of file descriptors: back off instead of spinning.
                eprintln!("mock-worker: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| handle(req, ctx.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn full(b: impl Into<Bytes>) -> RespBody {
    Full::new(b.into()).map_err(|e| match e {}).boxed_unsync()
}

fn respond(
    status: StatusCode,
    ctype: &'static str,
    body: impl Into<Bytes>,
    worker: &str,
) -> Response<RespBody> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(ctype));
    if let Ok(v) = HeaderValue::from_str(worker) {
        h.insert(WORKER_ID_HEADER, v);
    }
    r
}

/// Starlette's `{"detail": ...}` body, which vLLM sends for unknown paths and methods.
fn detail(status: StatusCode, text: &str, worker: &str) -> Response<RespBody> {
    let body = format!("{{\"detail\":{}}}", serde_json::Value::from(text));
    respond(status, "application/json", body, worker)
}

fn error(e: &ApiError, worker: &str) -> Response<RespBody> {
    respond(
        StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST),
        "application/json",
        e.body(),
        worker,
    )
}

impl Ctx {
    /// The ORCA report for a response, if the request asked for one and this kind of
    /// response carries it: vLLM reports only on non-streaming JSON responses.
    fn orca(&self, format: Option<&HeaderValue>, stream: bool) -> Option<HeaderValue> {
        let legacy = self.shared.cfg.orca_on_stream;
        if stream && !legacy {
            return None;
        }
        let style = if legacy {
            orca::Style::Legacy
        } else {
            orca::Style::Vllm
        };
        orca::report(format, self.shared.load(), style)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn handle(req: Request<Incoming>, ctx: Arc<Ctx>) -> Result<Response<RespBody>, Infallible> {
    let name = ctx.shared.name.as_str();
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let resp = match (method.clone(), path.as_str()) {
        (Method::GET, "/health") => respond(StatusCode::OK, "text/plain", "", name),
        (Method::GET, "/v1/models") => {
            let cfg = &ctx.shared.cfg;
            // vLLM lists each adapter after the base model, its parent.
            let mut data = vec![json!({
                "id": cfg.model, "object": "model", "created": 0, "owned_by": "kvroute-mock",
                "root": cfg.model, "parent": null, "max_model_len": cfg.max_model_len})];
            data.extend(cfg.lora_modules.iter().map(|n| {
                json!({
                "id": n, "object": "model", "created": 0, "owned_by": "kvroute-mock",
                "root": n, "parent": cfg.model, "max_model_len": null})
            }));
            let body = json!({"object": "list", "data": data});
            respond(StatusCode::OK, "application/json", body.to_string(), name)
        }
        (Method::GET, "/metrics") => {
            let cfg = &ctx.shared.cfg;
            let text = {
                let st = ctx.shared.state.lock().unwrap();
                let info = metrics::Info {
                    model: &cfg.model,
                    block_size: cfg.block_size,
                    kv_blocks: cfg.kv_blocks,
                    name,
                    prepared: ctx.prepared.each_ref().map(|c| c.load(Ordering::Relaxed)),
                };
                let mut text = metrics::render(&st.metrics, st.load(), &info);
                if !cfg.lora_modules.is_empty() {
                    metrics::render_lora(
                        &mut text,
                        cfg.max_loras,
                        &st.lora_info,
                        st.lora_slots.loads,
                    );
                }
                text
            };
            respond(StatusCode::OK, "text/plain; version=0.0.4", text, name)
        }
        (Method::POST, "/v1/completions") => inference(req, ctx.clone(), Kind::Completion).await,
        (Method::POST, "/v1/chat/completions") => inference(req, ctx.clone(), Kind::Chat).await,
        (Method::POST, "/v1/cache/probe") => probe(req, &ctx).await,
        (Method::POST, "/tokenize") => tokenize(req, &ctx).await,
        (Method::POST, "/reset_prefix_cache") => {
            ctx.shared.state.lock().unwrap().reset_prefix_cache();
            respond(StatusCode::OK, "text/plain", "", name)
        }
        (Method::POST, "/v1/completions/render") => render(req, &ctx, Kind::Completion).await,
        (Method::POST, "/v1/chat/completions/render") => render(req, &ctx, Kind::Chat).await,
        (
            _,
            "/health"
            | "/v1/models"
            | "/metrics"
            | "/v1/completions"
            | "/v1/chat/completions"
            | "/v1/cache/probe"
            | "/tokenize"
            | "/reset_prefix_cache"
            | "/v1/completions/render"
            | "/v1/chat/completions/render",
        ) => detail(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed", name),
        // FastAPI's own answer for a path no route serves.
        _ => detail(StatusCode::NOT_FOUND, "Not Found", name),
    };
    Ok(resp)
}

async fn read_body(body: Incoming) -> Result<Bytes, ApiError> {
    match Limited::new(body, BODY_LIMIT).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::other(
            413,
            "RequestEntityTooLarge",
            format!("request body over {BODY_LIMIT} bytes"),
        )),
        Err(e) => Err(ApiError::bad(
            format!("could not read the request body: {e}"),
            None,
        )),
    }
}

/// Reads and parses a request body (`chat`: see `api::parse`).
async fn read_parsed(body: Incoming, chat: Option<bool>) -> Result<(Bytes, Parsed), ApiError> {
    let b = read_body(body).await?;
    let p = api::parse(&b, chat)?;
    Ok((b, p))
}

/// The oracle's side channel. Parsing, tokenizing and hashing run on the blocking pool, not
/// on the thread that serves (and stamps the arrival of) inference requests, and never on
/// the engine thread; the engine state is locked only for the hash lookups.
async fn probe(req: Request<Incoming>, ctx: &Ctx) -> Response<RespBody> {
    let name = ctx.shared.name.as_str();
    let body = match read_body(req.into_body()).await {
        Ok(b) => b,
        Err(e) => return error(&e, name),
    };
    let bs = ctx.shared.cfg.block_size;
    let loras = ctx.shared.cfg.lora_modules.clone();
    let work = tokio::task::spawn_blocking(move || {
        api::parse(&body, None).map(|p| {
            let mut hashes = Vec::with_capacity(p.tokens.len() / bs);
            let lora = lora_id(&p, &loras);
            let root = engine::request_root(p.cache_salt.as_deref(), lora, &loras);
            kv::extend_hashes(&mut hashes, root, &p.tokens, bs);
            (p.tokens.len(), hashes)
        })
    });
    let (len, hashes) = match work.await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => return error(&e, name),
        Err(e) => {
            let e = ApiError::other(500, "InternalServerError", format!("probe failed: {e}"));
            return error(&e, name);
        }
    };
    let cached = ctx.shared.state.lock().unwrap().probe_hashes(&hashes, len);
    let body = json!({"prompt_tokens": len, "cached_tokens": cached});
    respond(StatusCode::OK, "application/json", body.to_string(), name)
}

/// vLLM's `POST /tokenize`: a completions-style `{"prompt": ..}` or a chat-style
/// `{"messages": ..}` body; answers `{"count","max_model_len","tokens","token_strs"}` with the
/// ids the engine would cache (the same tokenizer and chat template as inference).
async fn tokenize(req: Request<Incoming>, ctx: &Ctx) -> Response<RespBody> {
    let name = ctx.shared.name.as_str();
    let parsed = match read_parsed(req.into_body(), None).await {
        Ok((_, p)) => p,
        Err(e) => return error(&e, name),
    };
    if let Err(e) = check_model(&parsed, &ctx.shared.cfg) {
        return error(&e, name);
    }
    let out = json!({
        "count": parsed.tokens.len(),
        "max_model_len": ctx.shared.cfg.max_model_len,
        "tokens": parsed.tokens,
        // Ids are hashes of text pieces, with no vocabulary to print them from.
        "token_strs": null,
    });
    ctx.prepared[0].fetch_add(1, Ordering::Relaxed);
    respond(StatusCode::OK, "application/json", out.to_string(), name)
}

/// vLLM's render endpoints: the request as the engine would receive it, without running
/// it. Completions answer a list (one entry per prompt of a batch), chat one object.
async fn render(req: Request<Incoming>, ctx: &Ctx, kind: Kind) -> Response<RespBody> {
    let name = ctx.shared.name.as_str();
    let cfg = &ctx.shared.cfg;
    let (body, mut parsed) = match read_parsed(req.into_body(), Some(kind == Kind::Chat)).await {
        Ok(v) => v,
        Err(e) => return error(&e, name),
    };
    let prompts = match kind {
        Kind::Chat => vec![std::mem::take(&mut parsed.tokens)],
        Kind::Completion => {
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            match api::completion_prompts(&v["prompt"], true) {
                Ok(p) => p,
                Err(e) => return error(&e, name),
            }
        }
    };
    let model = parsed.model.clone().unwrap_or_else(|| cfg.model.clone());
    let mut out = Vec::with_capacity(prompts.len());
    for tokens in prompts {
        let mut one = Parsed {
            tokens,
            ..parsed.clone()
        };
        if let Err(e) = check(&mut one, cfg) {
            return error(&e, name);
        }
        let n = ctx.seq.fetch_add(1, Ordering::Relaxed);
        let prefix = if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        };
        out.push(json!({
            "request_id": format!("{prefix}-{name}-{n}"),
            "token_ids": one.tokens,
            "features": null,
            "sampling_params": {"max_tokens": one.max_tokens},
            "model": model,
            "stream": one.stream,
            "cache_salt": one.cache_salt,
            "priority": 0,
        }));
    }
    let out = match kind {
        Kind::Chat => out.pop().unwrap_or_default(),
        Kind::Completion => serde_json::Value::Array(out),
    };
    let route = if kind == Kind::Chat { 2 } else { 1 };
    ctx.prepared[route].fetch_add(1, Ordering::Relaxed);
    respond(StatusCode::OK, "application/json", out.to_string(), name)
}

/// The LoRA adapter a request names in `model` (vLLM's `lora_int_id`: 1-based position in
/// `--lora-modules`), 0 for the base model or any other name.
fn lora_id(p: &Parsed, adapters: &[String]) -> u16 {
    p.model
        .as_ref()
        .and_then(|m| adapters.iter().position(|a| a == m))
        .map_or(0, |i| u16::try_from(i + 1).unwrap_or(0))
}

fn check_model(p: &Parsed, cfg: &Config) -> Result<(), ApiError> {
    match &p.model {
        Some(m) if m != &cfg.model && !cfg.accept_any_model && !cfg.lora_modules.contains(m) => {
            Err(ApiError::not_found(
                format!("The model `{m}` does not exist."),
                Some("model"),
            ))
        }
        _ => Ok(()),
    }
}

/// Validates what the engine can serve, and fills in vLLM's default `max_tokens`.
fn check(p: &mut Parsed, cfg: &Config) -> Result<(), ApiError> {
    check_model(p, cfg)?;
    let len = p.tokens.len();
    let limit = cfg.max_model_len;
    // What the client asked for: an absent max_tokens asks for no particular length.
    let asked = if p.max_tokens_given { p.max_tokens } else { 0 };
    // A prompt that leaves no room for one output token is refused even without max_tokens.
    if len + asked > limit || len >= limit {
        return Err(ApiError::bad(
            format!(
                "You passed {len} input tokens and requested {asked} output tokens. However, the model's context length is only {limit} tokens, resulting in a maximum input length of {} tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={len})",
                limit.saturating_sub(asked)
            ),
            Some("input_tokens"),
        ));
    }
    if !p.max_tokens_given {
        // vLLM: chat generates up to the rest of the context; completions default to 16.
        p.max_tokens = match p.kind {
            Kind::Chat => limit - len,
            Kind::Completion => api::DEFAULT_MAX_TOKENS.min(limit - len),
        };
    }
    // A sequence larger than the whole cache could never run; refuse it rather than
    // preempting it forever (vLLM refuses to start with such a max_model_len instead).
    let cap = cfg.kv_blocks * cfg.block_size;
    if len + p.max_tokens > cap {
        return Err(ApiError::bad(
            format!(
                "prompt plus max_tokens ({}) exceeds the KV cache capacity of {cap} tokens",
                len + p.max_tokens
            ),
            Some("max_tokens"),
        ));
    }
    Ok(())
}

fn header_str<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

async fn inference(req: Request<Incoming>, ctx: Arc<Ctx>, kind: Kind) -> Response<RespBody> {
    // Stamped on receipt of the headers, before the body is read and parsed.
    let arrival = ctx.shared.arrive();
    let arrived_unix = unix_secs();
    let shared = &ctx.shared;
    let name = shared.name.as_str();
    let cfg = &shared.cfg;
    let orca_fmt = req.headers().get(ORCA_FORMAT_HEADER).cloned();
    let decode_ep = header_str(&req, &cfg.decode_endpoint_header).map(str::to_string);
    if let Some(ep) = decode_ep.as_deref() {
        // Only a prefill worker acts on the header (POSTs to it): refuse any address outside
        // its pool before reading the body.
        if cfg.role == Role::Prefill && !cfg.decode_allowed(ep.trim()) {
            return error(
                &ApiError::bad(
                    format!(
                        "{}: {ep:?} is not an allowed decode endpoint",
                        cfg.decode_endpoint_header
                    ),
                    None,
                ),
                name,
            );
        }
    }
    let transferred = match header_str(&req, KV_TRANSFER_HEADER).map(|v| v.trim().parse::<usize>())
    {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            return error(
                &ApiError::bad(format!("{KV_TRANSFER_HEADER} must be a token count"), None),
                name,
            );
        }
    };
    let path = req.uri().path().to_string();
    let (body, mut parsed) = match read_parsed(req.into_body(), Some(kind == Kind::Chat)).await {
        Ok(v) => v,
        Err(e) => return error(&e, name),
    };
    if let Err(e) = check(&mut parsed, cfg) {
        return error(&e, name);
    }

    if cfg.role == Role::Prefill {
        match decode_ep {
            Some(ep) => {
                return prefill_handoff(ctx.clone(), parsed, body, path, ep, orca_fmt, arrival)
                    .await
            }
            None => {
                if !ctx.warned_no_decode.swap(true, Ordering::Relaxed) {
                    eprintln!(
                        "mock-worker {name}: warning: prefill-role worker got a request without {}; serving it locally (logged once)",
                        cfg.decode_endpoint_header
                    );
                }
            }
        }
    }

    let prompt_len = parsed.tokens.len();
    let rx = shared.submit(
        NewRequest {
            tokens: std::mem::take(&mut parsed.tokens),
            max_tokens: parsed.max_tokens,
            salt: parsed.cache_salt.take(),
            transferred,
            lora: lora_id(&parsed, &cfg.lora_modules),
        },
        arrival,
    );
    let n = ctx.seq.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Chat => format!("chatcmpl-{name}-{n}"),
        Kind::Completion => format!("cmpl-{name}-{n}"),
    };
    let model = parsed.model.clone().unwrap_or_else(|| cfg.model.clone());
    if parsed.stream {
        // Streaming headers go out now, so a (legacy) load report is taken now.
        let orca = ctx.orca(orca_fmt.as_ref(), true);
        let sse = SseBody::new(rx, &id, &model, &parsed, cfg, arrived_unix);
        let mut r = Response::new(sse.boxed_unsync());
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert("cache-control", HeaderValue::from_static("no-cache"));
        if let Ok(v) = HeaderValue::from_str(name) {
            h.insert(WORKER_ID_HEADER, v);
        }
        if let Some(v) = orca {
            h.insert(ORCA_HEADER, v);
        }
        return r;
    }
    let (usage, timing) = match wait_done(rx).await {
        Some(u) => u,
        None => {
            let e = ApiError::other(
                500,
                "InternalServerError",
                "request was dropped by the engine",
            );
            return error(&e, name);
        }
    };
    debug_assert_eq!(usage.prompt_tokens, prompt_len);
    let text: String = (0..usage.completion_tokens)
        .map(engine::output_text)
        .collect();
    let choice = match kind {
        Kind::Chat => {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": "length"})
        }
        Kind::Completion => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"})
        }
    };
    let body = json!({
        "id": id,
        "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": unix_now(),
        "model": model,
        "choices": [choice],
        "usage": usage_json(&usage, cfg.enable_prompt_tokens_details, false, kind),
    });
    let mut r = respond(StatusCode::OK, "application/json", body.to_string(), name);
    if let Some(v) = ctx.orca(orca_fmt.as_ref(), false) {
        r.headers_mut().insert(ORCA_HEADER, v);
    }
    if cfg.engine_timing {
        if let Ok(v) = HeaderValue::from_str(&timing_value(&timing)) {
            r.headers_mut().insert(TIMING_HEADER, v);
        }
    }
    r
}

/// vLLM's `usage`. `prompt_tokens_details` only with `--enable-prompt-tokens-details`, and
/// then even when nothing was cached (vLLM reports `cached_tokens: 0`). Without the flag a
/// JSON response carries `"prompt_tokens_details": null` (pydantic's full dump) and a stream
/// omits the field (vLLM dumps stream chunks with `exclude_unset`). vLLM 0.32's details also
/// have `created_cache_tokens` (chat: the prompt tokens the request added to the cache;
/// completions: null) and `multimodal_tokens` (null), left out of stream chunks when null,
/// and a JSON body has `completion_tokens_details: null`.
fn usage_json(u: &Usage, details: bool, stream: bool, kind: Kind) -> serde_json::Value {
    let mut v = json!({
        "prompt_tokens": u.prompt_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "completion_tokens": u.completion_tokens,
    });
    if details {
        let created = match kind {
            Kind::Chat => json!(u.created_cache_tokens),
            Kind::Completion => serde_json::Value::Null,
        };
        let mut d = json!({"cached_tokens": u.cached_tokens,
            "created_cache_tokens": created, "multimodal_tokens": null});
        if stream {
            // vLLM's stream chunks leave out the null fields.
            if let Some(m) = d.as_object_mut() {
                m.retain(|_, x| !x.is_null());
            }
        }
        v["prompt_tokens_details"] = d;
    } else if !stream {
        v["prompt_tokens_details"] = serde_json::Value::Null;
    }
    if !stream {
        v["completion_tokens_details"] = serde_json::Value::Null;
    }
    v
}

async fn wait_done(mut rx: mpsc::UnboundedReceiver<Event>) -> Option<(Usage, Timing)> {
    while let Some(e) = rx.recv().await {
        if let Event::Done(u, t) = e {
            return Some((u, t));
        }
    }
    None
}

/// Prefill role: compute the prompt here, wait out the simulated KV transfer, then let the
/// decode worker produce the output and relay its response.
async fn prefill_handoff(
    ctx: Arc<Ctx>,
    parsed: Parsed,
    body: Bytes,
    path: String,
    decode: String,
    orca_fmt: Option<HeaderValue>,
    arrival: Arrival,
) -> Response<RespBody> {
    let shared = &ctx.shared;
    let name = shared.name.as_str();
    let cfg = &shared.cfg;
    let lora = lora_id(&parsed, &cfg.lora_modules);
    let rx = shared.submit(
        NewRequest {
            tokens: parsed.tokens,
            max_tokens: 1,
            lora,
            salt: parsed.cache_salt,
            transferred: 0,
        },
        arrival,
    );
    let Some((usage, _)) = wait_done(rx).await else {
        let e = ApiError::other(
            500,
            "InternalServerError",
            "prefill was dropped by the engine",
        );
        return error(&e, name);
    };
    let own_orca = ctx.orca(orca_fmt.as_ref(), parsed.stream);
    let secs = usage.prompt_tokens as f64 * cfg.kv_bytes_per_token
        / cfg.kv_transfer_bandwidth
        / cfg.speedup;
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;

    let uri = format!("http://{decode}{path}");
    let mut out = Request::builder()
        .method(Method::POST)
        .uri(&uri)
        .header(CONTENT_TYPE, "application/json")
        .header(KV_TRANSFER_HEADER, usage.prompt_tokens.to_string());
    if let Some(f) = &orca_fmt {
        out = out.header(ORCA_FORMAT_HEADER, f.clone());
    }
    let out = match out.body(Full::new(body)) {
        Ok(r) => r,
        Err(e) => {
            return error(
                &ApiError::bad(format!("bad decode endpoint {decode:?}: {e}"), None),
                name,
            );
        }
    };
    let resp = match ctx.client.request(out).await {
        Ok(r) => r,
        Err(e) => {
            let e = ApiError::other(
                502,
                "BadGateway",
                format!("decode worker {decode} failed: {e}"),
            );
            return error(&e, name);
        }
    };
    let (mut parts, incoming) = resp.into_parts();
    let h = &mut parts.headers;
    if let Some(v) = h.remove(ORCA_HEADER) {
        h.insert(HeaderName::from_static(DECODE_ORCA_HEADER), v);
    }
    if let Some(v) = own_orca {
        h.insert(ORCA_HEADER, v);
    }
    if let Ok(v) = HeaderValue::from_str(name) {
        h.insert(PREFILL_WORKER_ID_HEADER, v);
    }
    h.insert(
        PREFILL_CACHED_HEADER,
        HeaderValue::from(usage.cached_tokens),
    );
    // The relay is chunk by chunk: hyper hands frames through as they arrive.
    let body = incoming.map_err(|e| Box::new(e) as BoxError).boxed_unsync();
    Response::from_parts(parts, body)
}

/// Pre-rendered pieces of one request's SSE chunks, so a token costs one small allocation.
struct SseBody {
    rx: mpsc::UnboundedReceiver<Event>,
    head: String,
    kind: Kind,
    max_tokens: usize,
    include_usage: bool,
    details: bool,
    timing: bool,
    finished: bool,
    /// Wall clock (unix seconds) at arrival and when the first token's chunk was handed to
    /// the connection: with the engine's ttft they split a client's TTFT into the path to
    /// the worker, the engine, the worker's own delivery lag and the path back.
    arrived_unix: f64,
    first_sent_unix: Option<f64>,
}

impl SseBody {
    fn new(
        rx: mpsc::UnboundedReceiver<Event>,
        id: &str,
        model: &str,
        p: &Parsed,
        cfg: &Config,
        arrived_unix: f64,
    ) -> Self {
        let kind = p.kind;
        let object = if kind == Kind::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let head = format!(
            "{{\"id\":{},\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":[",
            json!(id),
            unix_now(),
            json!(model)
        );
        SseBody {
            rx,
            head,
            kind,
            max_tokens: p.max_tokens,
            include_usage: p.include_usage,
            details: cfg.enable_prompt_tokens_details,
            timing: cfg.engine_timing,
            finished: false,
            arrived_unix,
            first_sent_unix: None,
        }
    }

    fn render(&mut self, e: Event) -> String {
        match e {
            Event::Token(i) => {
                if i == 0 {
                    self.first_sent_unix = Some(unix_secs());
                }
                self.token_chunk(i)
            }
            Event::Done(u, t) => {
                self.finished = true;
                self.final_chunk(&u, &t)
            }
        }
    }

    fn token_chunk(&self, i: usize) -> String {
        let word = engine::output_text(i);
        let finish = if i + 1 >= self.max_tokens {
            "\"length\""
        } else {
            "null"
        };
        let mut s = String::with_capacity(self.head.len() + 160);
        if i == 0 && self.kind == Kind::Chat {
            s.push_str("data: ");
            s.push_str(&self.head);
            s.push_str("{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
        }
        s.push_str("data: ");
        s.push_str(&self.head);
        match self.kind {
            Kind::Chat => {
                s.push_str("{\"index\":0,\"delta\":{\"content\":\"");
                s.push_str(word);
                s.push_str("\"},\"logprobs\":null,\"finish_reason\":");
            }
            Kind::Completion => {
                s.push_str("{\"index\":0,\"text\":\"");
                s.push_str(word);
                s.push_str("\",\"logprobs\":null,\"finish_reason\":");
            }
        }
        s.push_str(finish);
        s.push_str("}]}\n\n");
        s
    }

    fn final_chunk(&self, u: &Usage, t: &Timing) -> String {
        let mut s = String::new();
        if self.include_usage {
            s.push_str("data: ");
            s.push_str(&self.head);
            s.push_str("],\"usage\":");
            s.push_str(&usage_json(u, self.details, true, self.kind).to_string());
            s.push_str("}\n\n");
        }
        if self.timing {
            // An SSE comment: clients skip it (vLLM's keep-alives are comments too).
            s.push_str(": ");
            s.push_str(TIMING_HEADER);
            s.push(' ');
            s.push_str(&timing_value(t));
            if let Some(first) = self.first_sent_unix {
                let _ = write!(s, ";arrived={:.6};first_sent={first:.6}", self.arrived_unix);
            }
            s.push_str("\n\n");
        }
        s.push_str("data: [DONE]\n\n");
        s
    }
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        let mut buf = match self.rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => {
                self.finished = true;
                return Poll::Ready(Some(Err("engine dropped the request".into())));
            }
            Poll::Ready(Some(e)) => self.render(e),
        };
        // Events that queued up while the connection was busy go out in the same write: each
        // is still its own SSE event, but a loaded process makes fewer syscalls instead of
        // falling further behind.
        while !self.finished && buf.len() < 16 * 1024 {
            match self.rx.try_recv() {
                Ok(e) => {
                    let more = self.render(e);
                    buf.push_str(&more);
                }
                Err(_) => break,
            }
        }
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(buf)))))
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }
}
