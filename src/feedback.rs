//! What workers tell us back: ORCA load reports (`endpoint-load-metrics`) and the `usage`
//! object of OpenAI responses (non-streaming body, or the last SSE chunk).

use serde::Deserialize;

/// Load as a worker reports it in `endpoint-load-metrics` (vLLM's named metrics).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OrcaLoad {
    pub kv_usage: Option<f32>,
    pub waiting: Option<u32>,
    pub running: Option<u32>,
}

impl OrcaLoad {
    pub fn is_empty(&self) -> bool {
        self.kv_usage.is_none() && self.waiting.is_none() && self.running.is_none()
    }
}

/// Parses `TEXT k=v,k=v` or `JSON {...}` (a missing format prefix is read as TEXT).
/// Unknown metrics are ignored; an unreadable header gives `None`.
pub fn parse_orca(value: &str) -> Option<OrcaLoad> {
    let v = value.trim();
    if let Some(json) = v.strip_prefix("JSON") {
        return parse_orca_json(json.trim());
    }
    let text = v.strip_prefix("TEXT").unwrap_or(v).trim();
    let mut out = OrcaLoad::default();
    for pair in text.split(',') {
        let Some((k, val)) = pair.split_once('=') else {
            continue;
        };
        set_metric(&mut out, k.trim(), val.trim().parse::<f64>().ok());
    }
    (!out.is_empty()).then_some(out)
}

fn parse_orca_json(json: &str) -> Option<OrcaLoad> {
    #[derive(Deserialize)]
    struct Orca {
        #[serde(default)]
        named_metrics: std::collections::BTreeMap<String, f64>,
    }
    let o: Orca = serde_json::from_str(json).ok()?;
    let mut out = OrcaLoad::default();
    for (k, v) in &o.named_metrics {
        set_metric(&mut out, &format!("named_metrics.{k}"), Some(*v));
    }
    (!out.is_empty()).then_some(out)
}

fn set_metric(out: &mut OrcaLoad, key: &str, v: Option<f64>) {
    let Some(v) = v.filter(|v| v.is_finite() && *v >= 0.0) else {
        return;
    };
    match key {
        "named_metrics.kv_cache_usage_perc" => out.kv_usage = Some((v as f32).min(1.0)),
        "named_metrics.num_requests_waiting" => {
            out.waiting = Some(v.min(f64::from(u32::MAX)) as u32)
        }
        "named_metrics.num_requests_running" => {
            out.running = Some(v.min(f64::from(u32::MAX)) as u32)
        }
        _ => {}
    }
}

/// Token counts an engine reports for a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// `prompt_tokens_details.cached_tokens`, when the engine reports it.
    pub cached_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct UsageWire {
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
    #[serde(default)]
    prompt_tokens_details: Option<DetailsWire>,
}

#[derive(Deserialize)]
struct DetailsWire {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

/// Keeps the tail of a response body as it streams past, so the `usage` object (last in
/// vLLM's bodies and in the final SSE chunk) can be read at the end without buffering the
/// whole response.
#[derive(Debug, Default)]
pub struct UsageTail {
    buf: Vec<u8>,
}

/// Enough for the final SSE chunk with usage, or the end of a JSON body.
const TAIL: usize = 8 * 1024;

impl UsageTail {
    pub fn push(&mut self, chunk: &[u8]) {
        if chunk.len() >= TAIL {
            self.buf.clear();
            self.buf
                .extend_from_slice(chunk.get(chunk.len() - TAIL..).unwrap_or(chunk));
            return;
        }
        self.buf.extend_from_slice(chunk);
        if self.buf.len() > 2 * TAIL {
            let cut = self.buf.len() - TAIL;
            self.buf.drain(..cut);
        }
    }

    /// The last `"usage": {...}` object in the retained tail, if it parses.
    pub fn usage(&self) -> Option<Usage> {
        find_usage(&self.buf)
    }
}

fn find_usage(body: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\"";
    let mut end = body.len();
    while let Some(pos) = rfind(body.get(..end)?, KEY) {
        let after = body.get(pos + KEY.len()..)?;
        let colon = after.iter().position(|b| !b.is_ascii_whitespace())?;
        if after.get(colon) == Some(&b':') {
            let value = after.get(colon + 1..)?;
            let mut de =
                serde_json::Deserializer::from_slice(value).into_iter::<Option<UsageWire>>();
            if let Some(Ok(Some(u))) = de.next() {
                return Some(Usage {
                    prompt_tokens: u.prompt_tokens,
                    completion_tokens: u.completion_tokens,
                    cached_tokens: u.prompt_tokens_details.and_then(|d| d.cached_tokens),
                });
            }
        }
        end = pos;
    }
    None
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (0..=hay.len() - needle.len())
        .rev()
        .find(|&i| hay.get(i..i + needle.len()) == Some(needle))
}

/// What a response (or its absence) says about the worker the request was steered to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The worker failed: an error status, or Envoy had to retry elsewhere, or no answer.
    Failure,
    /// A success verifiably served by the chosen worker (may end its cooldown early).
    Success,
    /// Nothing to learn about the worker's health.
    Neutral,
    /// The client went away before any answer: not the worker's fault.
    ClientGone,
}

/// Envoy's `response.code_details` for an answer the worker itself sent.
pub const VIA_UPSTREAM: &str = "via_upstream";

/// Whether a reply Envoy generated (its `code_details`) says the chosen worker failed:
/// a reset or refused connection, or no answer in time. Envoy's other local replies are
/// about Envoy's own state (circuit breaker overflow `...{overflow}`, `no_healthy_upstream`,
/// `cluster_not_found`, rate limiters, a configured stream duration) and say nothing of
/// the worker's health.
fn blames_worker(details: &str) -> bool {
    let reset = details.starts_with("upstream_reset") && !details.contains("{overflow");
    reset
        || details.starts_with("upstream_response_timeout")
        || details.starts_with("upstream_per_try_timeout")
        || details.starts_with("upstream_per_try_idle_timeout")
}

/// Classifies the answer to a steered request.
///
/// `status` is `None` when no response headers arrived (connect failure, reset, timeout, or
/// a client that left first, which `code_details` starting with `downstream` tells apart).
/// `attempts` is Envoy's `x-envoy-attempt-count`: above 1, the first try on the chosen
/// worker (priority 0 of its cluster) failed and a retry answered. `same_host` says whether
/// the upstream address equals the chosen worker's endpoint (`None`: not comparable).
/// `code_details` is Envoy's `response.code_details` (`None`: unknown, so a 5xx counts).
///
/// A 429 is never the worker's failure: it is a limit (a per-tenant rate limiter in front
/// of or inside the engine), and a cooldown would move every tenant's traffic off a healthy
/// worker. A 5xx counts only if the worker sent it or Envoy's reply blames the worker.
pub fn classify(
    status: Option<u32>,
    attempts: u32,
    same_host: Option<bool>,
    code_details: Option<&str>,
) -> Outcome {
    let Some(status) = status else {
        return match code_details {
            Some(d) if d.starts_with("downstream") => Outcome::ClientGone,
            Some(d) if d != VIA_UPSTREAM && !blames_worker(d) => Outcome::Neutral,
            _ => Outcome::Failure,
        };
    };
    let failed = status >= 500
        && match code_details {
            None | Some(VIA_UPSTREAM) => true,
            Some(d) => blames_worker(d),
        };
    // With priority failover, Envoy may have retried on another worker.
    let moved = attempts > 1 || same_host == Some(false);
    if failed || moved {
        Outcome::Failure
    } else if (200..300).contains(&status) && same_host == Some(true) {
        // Ending a cooldown early needs proof the worker itself answered; an outlier
        // ejection in Envoy can serve the chosen cluster from its failover hosts.
        Outcome::Success
    } else {
        Outcome::Neutral
    }
}

/// Whether the answer verifiably came from `endpoint`: only an `ip:port` endpoint can be
/// compared with the upstream address (a DNS name resolves to something else).
pub fn same_host(endpoint: Option<&str>, upstream: Option<&str>) -> Option<bool> {
    match (endpoint, upstream) {
        (Some(ep), Some(up)) if ep.parse::<std::net::SocketAddr>().is_ok() => Some(ep == up),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn orca_text_and_json() {
        let t = parse_orca(
            "TEXT named_metrics.kv_cache_usage_perc=0.31,named_metrics.num_requests_waiting=2",
        )
        .unwrap();
        assert_eq!(t.kv_usage, Some(0.31));
        assert_eq!(t.waiting, Some(2));
        assert_eq!(t.running, None);
        let j = parse_orca(
            r#"JSON {"named_metrics":{"kv_cache_usage_perc":0.5,"num_requests_running":7}}"#,
        )
        .unwrap();
        assert_eq!(j.kv_usage, Some(0.5));
        assert_eq!(j.running, Some(7));
        let bare = parse_orca("named_metrics.num_requests_waiting=4, cpu_utilization=0.3").unwrap();
        assert_eq!(bare.waiting, Some(4));
        assert_eq!(parse_orca("TEXT cpu_utilization=0.3"), None);
        assert_eq!(parse_orca("JSON {broken"), None);
        assert_eq!(
            parse_orca("TEXT named_metrics.kv_cache_usage_perc=-1"),
            None
        );
        assert_eq!(
            parse_orca("TEXT named_metrics.kv_cache_usage_perc=nan"),
            None
        );
    }

    #[test]
    fn usage_from_json_body_and_sse_tail() {
        let body = br#"{"id":"x","choices":[{"text":"hi \"usage\""}],"usage":{"prompt_tokens":100,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        assert_eq!(
            find_usage(body),
            Some(Usage {
                prompt_tokens: 100,
                completion_tokens: 5,
                cached_tokens: Some(64)
            })
        );
        let sse = b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
        let mut tail = UsageTail::default();
        for chunk in sse.chunks(7) {
            tail.push(chunk);
        }
        assert_eq!(
            tail.usage(),
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: 2,
                cached_tokens: None
            })
        );
        assert_eq!(find_usage(b"{\"usage\":null}"), None);
        assert_eq!(find_usage(b"garbage \"usage\""), None);
    }

    #[test]
    fn usage_tail_is_bounded_and_keeps_the_end() {
        let mut tail = UsageTail::default();
        let filler = vec![b'x'; 100_000];
        tail.push(&filler);
        for _ in 0..100 {
            tail.push(&filler[..999]);
        }
        tail.push(br#","usage":{"prompt_tokens":3,"completion_tokens":1}}"#);
        assert!(tail.buf.len() <= 2 * TAIL);
        assert_eq!(tail.usage().map(|u| u.prompt_tokens), Some(3));
    }
    #[test]
    fn classify_statuses_retries_and_hosts() {
        use Outcome::*;
        assert_eq!(classify(Some(200), 1, Some(true), None), Success);
        assert_eq!(classify(Some(200), 1, None, None), Neutral);
        assert_eq!(classify(Some(404), 1, Some(true), None), Neutral);
        assert_eq!(classify(Some(500), 1, Some(true), None), Failure);
        assert_eq!(classify(Some(503), 1, None, None), Failure);
        assert_eq!(classify(Some(429), 1, Some(true), None), Neutral);
        assert_eq!(classify(Some(200), 2, Some(true), None), Failure);
        assert_eq!(classify(Some(200), 1, Some(false), None), Failure);
        // Status 0 stands for a missing :status: neither failure nor proof.
        assert_eq!(classify(Some(0), 1, Some(true), None), Neutral);
    }

    #[test]
    fn classify_envoy_local_replies_and_limits() {
        use Outcome::*;
        let up = Some(VIA_UPSTREAM);
        assert_eq!(classify(Some(503), 1, Some(true), up), Failure);
        assert_eq!(classify(Some(500), 1, None, up), Failure);
        // A rate limit, wherever it comes from, is not a failure.
        assert_eq!(classify(Some(429), 1, Some(true), up), Neutral);
        assert_eq!(
            classify(Some(429), 1, None, Some("local_rate_limited")),
            Neutral
        );
        for d in [
            "upstream_reset_before_response_started{overflow}",
            "no_healthy_upstream",
            "cluster_not_found",
            "maintenance_mode",
            "upstream_max_stream_duration_reached",
        ] {
            assert_eq!(classify(Some(503), 1, None, Some(d)), Neutral, "{d}");
            assert_eq!(classify(None, 1, None, Some(d)), Neutral, "{d}");
        }
        for d in [
            "upstream_reset_before_response_started{connection_failure}",
            "upstream_reset_before_response_started{remote_reset}",
            "upstream_response_timeout",
            "upstream_per_try_timeout",
        ] {
            assert_eq!(classify(Some(503), 1, None, Some(d)), Failure, "{d}");
            assert_eq!(classify(Some(504), 1, None, Some(d)), Failure, "{d}");
        }
        // A retry elsewhere still means the first pick failed, whatever answered.
        assert_eq!(classify(Some(429), 2, None, up), Failure);
    }

    #[test]
    fn classify_missing_response() {
        use Outcome::*;
        assert_eq!(classify(None, 1, None, None), Failure);
        assert_eq!(
            classify(
                None,
                1,
                None,
                Some("upstream_reset_before_response_started")
            ),
            Failure
        );
        assert_eq!(
            classify(None, 1, None, Some("downstream_remote_disconnect")),
            ClientGone
        );
    }

    #[test]
    fn same_host_needs_an_ip_endpoint() {
        assert_eq!(
            same_host(Some("10.0.0.1:8000"), Some("10.0.0.1:8000")),
            Some(true)
        );
        assert_eq!(
            same_host(Some("10.0.0.1:8000"), Some("10.0.0.2:8000")),
            Some(false)
        );
        assert_eq!(
            same_host(Some("worker-a:8000"), Some("10.0.0.2:8000")),
            None
        );
        assert_eq!(same_host(None, Some("10.0.0.2:8000")), None);
        assert_eq!(same_host(Some("10.0.0.1:8000"), None), None);
    }
}
