//! Helpers shared by the integration tests: in-process workers on free ports and a small
//! HTTP client that records when each body frame arrived.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderMap;
use hyper::{Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use mock_worker::{Config, Handle};
use serde_json::Value;

pub async fn worker(args: &str) -> Handle {
    let args = args
        .split_whitespace()
        .map(String::from)
        .chain(["--port".into(), "0".into()]);
    let cfg = Config::from_args(args).unwrap().unwrap();
    mock_worker::start(cfg).await.unwrap()
}

pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: String,
    /// Time from sending to the first body frame.
    pub first_frame: Duration,
    pub frames: Vec<Bytes>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
    /// The JSON payloads of an SSE body, checking the framing; the bool says `[DONE]` ended it.
    pub fn sse(&self) -> (Vec<Value>, bool) {
        assert!(
            self.body.ends_with("\n\n"),
            "SSE body must end with a blank line"
        );
        let mut out = vec![];
        let mut done = false;
        for event in self.body.split("\n\n").filter(|e| !e.is_empty()) {
            assert!(!done, "data after [DONE]");
            if event.starts_with(':') {
                continue; // an SSE comment (the engine-timing report)
            }
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad SSE event {event:?}"));
            if data == "[DONE]" {
                done = true;
            } else {
                out.push(
                    serde_json::from_str(data)
                        .unwrap_or_else(|e| panic!("bad chunk JSON {e}: {data}")),
                );
            }
        }
        (out, done)
    }
}

/// The `x-mock-engine-timing` report (ttft, e2e): the header, or the stream's comment line.
pub fn engine_timing(r: &Resp) -> Option<(f64, f64)> {
    let v = match r.header("x-mock-engine-timing") {
        Some(h) => h.to_string(),
        None => r
            .body
            .split("\n\n")
            .find_map(|e| e.strip_prefix(": x-mock-engine-timing "))?
            .to_string(),
    };
    let mut it = v
        .split(';')
        .map(|kv| kv.split_once('=').unwrap().1.parse().unwrap());
    Some((it.next()?, it.next()?))
}

/// A stream's wall-clock stamps from its timing comment (unix seconds): when the worker
/// received the request and when it sent the first token.
pub fn engine_wall_stamps(r: &Resp) -> Option<(f64, f64)> {
    let v = r
        .body
        .split("\n\n")
        .find_map(|e| e.strip_prefix(": x-mock-engine-timing "))?;
    let field = |k: &str| {
        v.split(';')
            .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
            .and_then(|x| x.parse().ok())
    };
    Some((field("arrived")?, field("first_sent")?))
}

pub async fn request(
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Resp {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut b = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let t0 = Instant::now();
    let resp = client
        .request(b.body(Full::new(Bytes::from(body.to_string()))).unwrap())
        .await
        .unwrap();
    let (parts, mut incoming) = resp.into_parts();
    let mut frames = vec![];
    let mut first_frame = None;
    while let Some(f) = incoming.frame().await {
        if let Ok(data) = f.unwrap().into_data() {
            first_frame.get_or_insert_with(|| t0.elapsed());
            frames.push(data);
        }
    }
    let body = String::from_utf8(frames.iter().flat_map(|f| f.to_vec()).collect()).unwrap();
    Resp {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
        first_frame: first_frame.unwrap_or_default(),
        frames,
    }
}

pub async fn post(addr: SocketAddr, path: &str, body: &str, headers: &[(&str, &str)]) -> Resp {
    request(addr, Method::POST, path, body, headers).await
}

/// POSTs a JSON body and reads the answer as JSON.
pub async fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Value {
    post(addr, path, &body.to_string(), &[]).await.json()
}

pub async fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, Method::GET, path, "", &[]).await
}

/// One sample of a Prometheus metric (first series with that exact name).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// English-like text of about `words` words, distinct per `seed`.
pub fn text(seed: u32, words: usize) -> String {
    const W: [&str; 12] = [
        "cache", "router", "prefix", "token", "engine", "request", "block", "memory", "latency",
        "worker", "stream", "model",
    ];
    let mut s = format!("Document {seed}.");
    for i in 0..words {
        s.push(' ');
        s.push_str(W[(i * 7 + seed as usize * 3 + i / 12) % W.len()]);
        if i % 9 == 8 {
            s.push(',');
        }
    }
    s
}
