//! dynamo-glue: the bench's proxy in front of NVIDIA Dynamo's selection service (the dynamo-*
//! policies of bench/peers_dynamo.py, issue 43). Dynamo's router does the routing; this only
//! carries requests to and from it and decides nothing:
//!
//! 1. reads the request body and asks a worker for its token ids (`POST /tokenize` with the
//!    body unchanged, the workers taken in turn: any worker tokenizes the same);
//! 2. `POST /select_and_reserve {selection_id, token_ids}` to the selection service, which picks
//!    the worker and books the request's load there (the ids are copied as the worker wrote
//!    them, not parsed);
//! 3. forwards the unchanged request to the endpoint it named and streams the answer back;
//! 4. reports `prefill_complete` at the answer's first body bytes (the first token) and frees
//!    the reservation (`DELETE /reservations/{id}`) once the answer ended or the client left.
//!
//! A failed tokenize or selection answers the client with that error (no fallback of ours).
//! `GET /_glue/stats`: requests routed, and the wall ms from body read to worker named
//! (tokenize + selection) and of the tokenize call alone, p50/p90/p99.
//!
//! In Rust (hyper, like the mock worker it sits beside) so that, on a 2-core machine, the glue
//! costs Dynamo no more than Envoy's path costs kvroute: a Python glue (aiohttp) spent ~5 ms CPU
//! per request and, CPU-starved under load, queued requests for 100+ ms before Dynamo saw them.
//!
//! Usage: dynamo-glue --port P --select http://127.0.0.1:S --workers URL[,URL...]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::task::JoinHandle;

type Out = UnsyncBoxBody<Bytes, hyper::Error>;
type HttpClient = Client<HttpConnector, Full<Bytes>>;

const STATS_PATH: &str = "/_glue/stats";
/// Hop-by-hop and length headers, set again on the way out.
const SKIP: [&str; 5] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
];

struct Glue {
    select: String,
    workers: Vec<String>,
    turn: AtomicUsize,
    seq: AtomicUsize,
    client: HttpClient,
    pick_ms: Mutex<Vec<f64>>,
    tokenize_ms: Mutex<Vec<f64>>,
}

fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<Out> {
    let mut r = Response::new(
        Full::new(body.into())
            .map_err(|never: Infallible| match never {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// The select_and_reserve body for a /tokenize answer: its flat id list copied as written.
fn select_body(sid: &str, tokenized: &[u8]) -> Option<Vec<u8>> {
    let find = |hay: &[u8], needle: &[u8], from: usize| {
        hay.get(from..)?
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|i| i + from)
    };
    let key = find(tokenized, b"\"tokens\"", 0)?;
    let start = find(tokenized, b"[", key)?;
    let end = find(tokenized, b"]", start)?;
    let ids = tokenized.get(start..=end)?;
    let mut out = Vec::with_capacity(ids.len() + 64);
    out.extend_from_slice(b"{\"selection_id\":\"");
    out.extend_from_slice(sid.as_bytes());
    out.extend_from_slice(b"\",\"token_ids\":");
    out.extend_from_slice(ids);
    out.push(b'}');
    Some(out)
}

fn quantiles(v: &Mutex<Vec<f64>>) -> serde_json::Value {
    let mut v = v.lock().map(|g| g.clone()).unwrap_or_default();
    if v.is_empty() {
        return serde_json::json!({});
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| {
        let i = ((p / 100.0) * v.len() as f64) as usize;
        (v[i.min(v.len() - 1)] * 1000.0).round() / 1000.0
    };
    serde_json::json!({"p50": q(50.0), "p90": q(90.0), "p99": q(99.0)})
}

impl Glue {
    async fn post(&self, url: &str, body: Vec<u8>) -> Result<(StatusCode, Bytes), String> {
        let req = Request::post(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let r = self.client.request(req).await.map_err(|e| e.to_string())?;
        let st = r.status();
        let b = r
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((st, b))
    }

    async fn call(self: Arc<Self>, method: Method, path: String) {
        let url = format!("{}{}", self.select, path);
        if let Ok(req) = Request::builder()
            .method(method)
            .uri(url)
            .body(Full::new(Bytes::new()))
        {
            if let Ok(r) = self.client.request(req).await {
                let _ = r.into_body().collect().await;
            }
        }
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Out> {
        let (parts, body) = req.into_parts();
        if parts.method == Method::GET && parts.uri.path() == STATS_PATH {
            let n = self.pick_ms.lock().map(|v| v.len()).unwrap_or(0);
            let doc = serde_json::json!({"routed": n, "pick_ms": quantiles(&self.pick_ms),
                                         "tokenize_ms": quantiles(&self.tokenize_ms)});
            return full(StatusCode::OK, doc.to_string());
        }
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return full(StatusCode::BAD_REQUEST, e.to_string()),
        };
        let t0 = Instant::now();
        let path = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        if parts.method != Method::POST || !path.starts_with("/v1/") {
            // /v1/models, /health, metrics: not routed, the first worker answers.
            let w = self.workers.first().cloned().unwrap_or_default();
            return self.forward(parts, w, path, body, None).await;
        }
        let i = self.turn.fetch_add(1, Ordering::Relaxed) % self.workers.len().max(1);
        let tok_url = format!(
            "{}/tokenize",
            self.workers.get(i).cloned().unwrap_or_default()
        );
        let tokenized = match self.post(&tok_url, body.to_vec()).await {
            Ok((StatusCode::OK, b)) => b,
            Ok((st, b)) => return full(st, b),
            Err(e) => return full(StatusCode::BAD_GATEWAY, format!("tokenize: {e}")),
        };
        let tok_ms = t0.elapsed().as_secs_f64() * 1e3;
        let sid = format!(
            "{}-{}",
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
        let Some(sel) = select_body(&sid, &tokenized) else {
            return full(
                StatusCode::BAD_GATEWAY,
                "tokenize: no token ids in the answer",
            );
        };
        let url = format!("{}/select_and_reserve", self.select);
        let pick = match self.post(&url, sel).await {
            Ok((StatusCode::OK, b)) => b,
            Ok((st, b)) => return full(st, b),
            Err(e) => return full(StatusCode::BAD_GATEWAY, format!("select: {e}")),
        };
        let endpoint = serde_json::from_slice::<serde_json::Value>(&pick)
            .ok()
            .and_then(|v| {
                v.get("endpoint")?
                    .as_str()
                    .map(|s| s.trim_end_matches('/').to_string())
            });
        let Some(endpoint) = endpoint else {
            return full(StatusCode::BAD_GATEWAY, "select: no endpoint in the answer");
        };
        if let (Ok(mut p), Ok(mut t)) = (self.pick_ms.lock(), self.tokenize_ms.lock()) {
            p.push(t0.elapsed().as_secs_f64() * 1e3);
            t.push(tok_ms);
        }
        self.forward(parts, endpoint, path, body, Some(sid)).await
    }

    async fn forward(
        self: Arc<Self>,
        parts: hyper::http::request::Parts,
        worker: String,
        path: String,
        body: Bytes,
        sid: Option<String>,
    ) -> Response<Out> {
        let mut b = Request::builder()
            .method(parts.method)
            .uri(format!("{worker}{path}"));
        for (k, v) in parts.headers.iter() {
            if !SKIP.contains(&k.as_str()) {
                b = b.header(k, v);
            }
        }
        let sent = match b.body(Full::new(body)) {
            Ok(r) => self.client.request(r).await,
            Err(e) => return full(StatusCode::BAD_GATEWAY, e.to_string()),
        };
        let up = match sent {
            Ok(r) => r,
            Err(e) => {
                if let Some(sid) = sid {
                    tokio::spawn(self.call(Method::DELETE, format!("/reservations/{sid}")));
                }
                return full(StatusCode::BAD_GATEWAY, format!("forward: {e}"));
            }
        };
        let (mut head, inner) = up.into_parts();
        for h in SKIP {
            head.headers.remove(h);
        }
        let body = match sid {
            None => inner.boxed_unsync(),
            Some(sid) => Tracked {
                inner,
                glue: self,
                sid,
                prefill: None,
            }
            .boxed_unsync(),
        };
        Response::from_parts(head, body)
    }
}

/// The answer's body on its way to the client: the first data frame reports prefill done,
/// the end (or the client going away, which drops it) frees the reservation.
struct Tracked {
    inner: Incoming,
    glue: Arc<Glue>,
    sid: String,
    prefill: Option<JoinHandle<()>>,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let out = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &out {
            if self.prefill.is_none() && f.is_data() {
                let path = format!("/reservations/{}/prefill_complete", self.sid);
                self.prefill = Some(tokio::spawn(self.glue.clone().call(Method::POST, path)));
            }
        }
        out
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let prefill = self.prefill.take();
        let glue = self.glue.clone();
        let path = format!("/reservations/{}", self.sid);
        tokio::spawn(async move {
            if let Some(p) = prefill {
                let _ = p.await;
            }
            glue.call(Method::DELETE, path).await;
        });
    }
}

fn main() {
    let (mut port, mut select, mut workers) = (None, None, Vec::new());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--port", Some(v)) => port = v.parse::<u16>().ok(),
            ("--select", Some(v)) => select = Some(v.trim_end_matches('/').to_string()),
            ("--workers", Some(v)) => {
                workers = v
                    .split(',')
                    .map(|w| w.trim_end_matches('/').to_string())
                    .collect()
            }
            _ => {
                eprintln!("usage: dynamo-glue --port P --select URL --workers URL[,URL...]");
                std::process::exit(2);
            }
        }
    }
    let (Some(port), Some(select), false) = (port, select, workers.is_empty()) else {
        eprintln!("dynamo-glue: --port, --select and --workers are required");
        std::process::exit(2);
    };
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build(http);
    let glue = Arc::new(Glue {
        select,
        workers,
        turn: AtomicUsize::new(0),
        seq: AtomicUsize::new(0),
        client,
        pick_ms: Mutex::new(Vec::new()),
        tokenize_ms: Mutex::new(Vec::new()),
    });
    // Two threads: the machine's cores; the glue's CPU is measured per request.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            eprintln!("dynamo-glue: {e}");
            std::process::exit(1)
        });
    rt.block_on(async move {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("dynamo-glue: {addr}: {e}");
                std::process::exit(1)
            }
        };
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let glue = glue.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let glue = glue.clone();
                    async move { Ok::<_, Infallible>(glue.handle(req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
}
