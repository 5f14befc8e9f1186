//! One OpenAI request, streamed and timed; the cache probe the oracle uses.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Called once when the first content token arrives (the oracle's prefill accounting).
pub type FirstToken = Box<dyn FnOnce() + Send>;

pub fn new_client() -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .pool_idle_timeout(Duration::from_secs(30))
        .build(http)
}

/// What one request saw.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub status: u16,
    pub error: Option<String>,
    pub worker: String,
    /// Seconds from dispatch to the first content token.
    pub ttft: Option<f64>,
    /// Seconds from dispatch to the end of the response.
    pub e2e: f64,
    /// Gaps between consecutive content tokens, seconds.
    pub gaps: Vec<f32>,
    pub out_tokens: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Generated text (kept only when asked: multi-turn chats append it).
    pub text: String,
    /// The mock engine's own TTFT and end-to-end time (`x-mock-engine-timing`), seconds on its
    /// schedule: free of client, router and CPU-contention delays.
    pub engine_ttft: Option<f64>,
    pub engine_e2e: Option<f64>,
    /// Unix seconds: when the worker received the request and sent its first token (the
    /// mock's report), and this client's dispatch (`t0`) on the same clock.
    pub engine_arrived: Option<f64>,
    pub engine_first_sent: Option<f64>,
    pub t0_unix: f64,
    /// kvroute's per-candidate costs (`x-kvroute-costs`, present when its debug headers are
    /// on): why the request went where it went.
    pub route_costs: String,
    /// The prefill pool worker that computed the prompt and handed its KV to `worker`
    /// (`x-prefill-worker-id`), and the prompt tokens its own cache held
    /// (`x-prefill-cached-tokens`); empty / None when the request was not handed off.
    pub prefill_worker: String,
    pub prefill_cached_tokens: Option<u64>,
}

/// Name of the mock's engine-timing report (a header, or an SSE comment line).
pub const ENGINE_TIMING: &str = "x-mock-engine-timing";

/// Reads `ttft=..;e2e=..` into the outcome.
fn read_engine_timing(v: &str, o: &mut Outcome) {
    for kv in v.trim().split(';') {
        match kv.split_once('=') {
            Some(("ttft", x)) => o.engine_ttft = x.parse().ok(),
            Some(("e2e", x)) => o.engine_e2e = x.parse().ok(),
            Some(("arrived", x)) => o.engine_arrived = x.parse().ok(),
            Some(("first_sent", x)) => o.engine_first_sent = x.parse().ok(),
            _ => {}
        }
    }
}

fn header_str(h: &hyper::HeaderMap, name: &str) -> String {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

/// Sends `body` to `url` and reads the (SSE or plain JSON) response to the end. Times are
/// measured from `t0`, which the caller takes at dispatch (so the oracle's probes count).
#[allow(clippy::too_many_arguments)]
pub async fn send(
    c: &HttpClient,
    url: &str,
    body: Bytes,
    headers: &[(&str, String)],
    t0: Instant,
    keep_text: bool,
    timeout: Duration,
    on_first: Option<FirstToken>,
) -> Outcome {
    let fut = send_inner(c, url, body, headers, t0, keep_text, on_first);
    match tokio::time::timeout(timeout, fut).await {
        Ok(o) => o,
        Err(_) => Outcome {
            error: Some(format!("timeout after {:.0} s", timeout.as_secs_f64())),
            e2e: t0.elapsed().as_secs_f64(),
            ..Default::default()
        },
    }
}

// `send` without its timeout: the same parameters, so `duplicates` pairs the two lists.
async fn send_inner(
    c: &HttpClient,
    url: &str,
    body: Bytes,
    headers: &[(&str, String)],
    t0: Instant,
    keep_text: bool,
    mut on_first: Option<FirstToken>,
) -> Outcome {
    let mut o = Outcome::default();
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    o.t0_unix = since_epoch - t0.elapsed().as_secs_f64();
    let mut rb = Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        rb = rb.header(*k, v.as_str());
    }
    let req = rb.body(Full::new(body)).expect("request");
    let resp = match c.request(req).await {
        Ok(r) => r,
        Err(e) => {
            o.error = Some(format!("connect/send: {e}"));
            o.e2e = t0.elapsed().as_secs_f64();
            return o;
        }
    };
    o.status = resp.status().as_u16();
    o.worker = header_str(resp.headers(), "x-worker-id");
    o.route_costs = header_str(resp.headers(), "x-kvroute-costs");
    o.prefill_worker = header_str(resp.headers(), "x-prefill-worker-id");
    o.prefill_cached_tokens = header_str(resp.headers(), "x-prefill-cached-tokens")
        .parse()
        .ok();
    read_engine_timing(&header_str(resp.headers(), ENGINE_TIMING), &mut o);
    let streaming = header_str(resp.headers(), "content-type").starts_with("text/event-stream");
    let mut body = resp.into_body();
    if o.status != 200 {
        let b = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let s = String::from_utf8_lossy(&b);
        o.error = Some(format!(
            "HTTP {}: {}",
            o.status,
            s.chars().take(200).collect::<String>()
        ));
        o.e2e = t0.elapsed().as_secs_f64();
        return o;
    }
    let mut buf = BytesMut::new();
    let mut last_tok: Option<Instant> = None;
    loop {
        match body.frame().await {
            None => break,
            Some(Err(e)) => {
                o.error = Some(format!("body: {e}"));
                break;
            }
            Some(Ok(f)) => {
                let Ok(d) = f.into_data() else { continue };
                let now = Instant::now();
                buf.extend_from_slice(&d);
                if !streaming {
                    continue;
                }
                // Consume complete SSE events.
                while let Some(p) = find(&buf, b"\n\n") {
                    let ev = buf.split_to(p + 2);
                    handle_event(&ev[..p], now, t0, &mut last_tok, &mut o, keep_text);
                    if o.ttft.is_some() {
                        if let Some(f) = on_first.take() {
                            f();
                        }
                    }
                }
            }
        }
    }
    o.e2e = t0.elapsed().as_secs_f64();
    if !streaming && o.error.is_none() {
        match serde_json::from_slice::<Value>(&buf) {
            Ok(v) => {
                o.ttft = Some(o.e2e);
                if let Some(ch) = v["choices"].get(0) {
                    let t = ch["text"]
                        .as_str()
                        .or(ch["message"]["content"].as_str())
                        .unwrap_or("");
                    if keep_text {
                        o.text.push_str(t);
                    }
                }
                read_usage(&v["usage"], &mut o);
                o.out_tokens = o.completion_tokens;
            }
            Err(e) => o.error = Some(format!("bad JSON: {e}")),
        }
    }
    if o.error.is_none() && o.ttft.is_none() && o.completion_tokens > 0 {
        o.error = Some("stream ended without tokens".into());
    }
    o
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

fn read_usage(u: &Value, o: &mut Outcome) {
    if u.is_object() {
        o.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
        o.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
        o.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
    }
}

fn handle_event(
    ev: &[u8],
    now: Instant,
    t0: Instant,
    last_tok: &mut Option<Instant>,
    o: &mut Outcome,
    keep_text: bool,
) {
    for line in ev.split(|&b| b == b'\n') {
        if let Some(c) = line.strip_prefix(b": ") {
            if let Some(v) = c.strip_prefix(ENGINE_TIMING.as_bytes()) {
                read_engine_timing(&String::from_utf8_lossy(v), o);
            }
            continue;
        }
        let Some(data) = line.strip_prefix(b"data:") else {
            continue;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" || data.is_empty() {
            continue;
        }
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            o.error = Some("bad SSE JSON".into());
            continue;
        };
        if v.get("error").is_some() {
            o.error = Some(format!("stream error: {}", v["error"]));
            continue;
        }
        if let Some(ch) = v["choices"].get(0) {
            let t = ch["text"].as_str().or(ch["delta"]["content"].as_str());
            if let Some(t) = t.filter(|t| !t.is_empty()) {
                if o.ttft.is_none() {
                    o.ttft = Some(now.duration_since(t0).as_secs_f64());
                }
                if let Some(l) = *last_tok {
                    o.gaps.push(now.duration_since(l).as_secs_f32());
                }
                *last_tok = Some(now);
                o.out_tokens += 1;
                if keep_text {
                    o.text.push_str(t);
                }
            }
        }
        read_usage(&v["usage"], o);
    }
}

/// `POST /v1/cache/probe` on one worker: (prompt_tokens, cached_tokens).
pub async fn probe(c: &HttpClient, base: &str, body: Bytes) -> Result<(u64, u64), String> {
    let req = Request::post(format!("{base}/v1/cache/probe"))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .expect("request");
    let r = c.request(req).await.map_err(|e| format!("probe: {e}"))?;
    let st = r.status();
    let b = r
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("probe body: {e}"))?
        .to_bytes();
    if !st.is_success() {
        return Err(format!("probe HTTP {st}"));
    }
    let v: Value = serde_json::from_slice(&b).map_err(|e| format!("probe JSON: {e}"))?;
    Ok((
        v["prompt_tokens"].as_u64().unwrap_or(0),
        v["cached_tokens"].as_u64().unwrap_or(0),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_timing_from_header_value_and_sse_comment() {
        let mut o = Outcome::default();
        read_engine_timing("ttft=0.012500;e2e=0.250000", &mut o);
        assert_eq!((o.engine_ttft, o.engine_e2e), (Some(0.0125), Some(0.25)));
        let mut o = Outcome::default();
        let t0 = Instant::now();
        let mut last = None;
        let mut feed = |ev: &[u8], o: &mut Outcome| handle_event(ev, t0, t0, &mut last, o, false);
        feed(b"data: {\"choices\":[{\"text\":\" a\"}]}", &mut o);
        feed(b": x-mock-engine-timing ttft=0.1;e2e=0.3", &mut o);
        feed(
            b": x-mock-engine-timing ttft=0.1;e2e=0.3;arrived=100.25;first_sent=100.5",
            &mut o,
        );
        assert_eq!(
            (o.engine_arrived, o.engine_first_sent),
            (Some(100.25), Some(100.5))
        );
        feed(b": keep-alive", &mut o);
        assert_eq!(o.out_tokens, 1);
        assert!(o.error.is_none(), "comments are not data");
        assert_eq!((o.engine_ttft, o.engine_e2e), (Some(0.1), Some(0.3)));
    }
}
