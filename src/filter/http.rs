//! One HTTP stream: buffer an inference request, route it, steer it, and feed what the
//! worker answers back into the router.

use super::root::State;
use super::{log, now_ms, now_ns};
use crate::config::{DisaggMode, SteeringMode};
use crate::events::Event;
use crate::feedback::{parse_orca, UsageTail};
use crate::request::ApiKind;
use crate::router::{Decision, RouteResult};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, LogLevel, MapType};
use std::cell::RefCell;
use std::rc::Rc;

const ORCA_REQUEST: &str = "endpoint-load-metrics-format";
const ORCA_RESPONSE: &str = "endpoint-load-metrics";

pub struct Http {
    st: Option<Rc<RefCell<State>>>,
    kind: Option<ApiKind>,
    routed: bool,
    decision: Option<Decision>,
    saw_response: bool,
    first_byte: bool,
    finished: bool,
    tail: UsageTail,
}

impl Http {
    pub fn new(st: Option<Rc<RefCell<State>>>) -> Self {
        Http {
            st,
            kind: None,
            routed: false,
            decision: None,
            saw_response: false,
            first_byte: false,
            finished: false,
            tail: UsageTail::default(),
        }
    }

    /// Runs `f` with the VM state unless it is already borrowed (never expected: proxy-wasm
    /// callbacks do not nest, but a double borrow must not become a panic).
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> Option<R> {
        let st = self.st.as_ref()?;
        let mut s = st.try_borrow_mut().ok()?;
        Some(f(&mut s))
    }

    fn route(&mut self, body: &[u8]) -> Action {
        self.routed = true;
        let Some(kind) = self.kind else {
            return Action::Continue;
        };
        let t0 = now_ns();
        let now = now_ms();
        let outcome = self.with(|s| {
            s.start_serving();
            let res = s.router.route(kind, body, now);
            s.metrics
                .route_time_us
                .record(now_ns().saturating_sub(t0) / 1000);
            match res {
                RouteResult::Rejected => {
                    s.metrics.rejected.inc();
                    None
                }
                RouteResult::Routed(d) => {
                    steer(s, &d);
                    record_decision(s, &d);
                    s.broadcast(std::slice::from_ref(&d.event));
                    s.defer_flush();
                    Some(d)
                }
            }
        });
        match outcome {
            Some(Some(d)) => {
                self.decision = Some(d);
                Action::Continue
            }
            Some(None) => {
                let body = br#"{"error":{"message":"all inference workers are busy","type":"overloaded","code":429}}"#;
                let _ = hostcalls::send_http_response(
                    429,
                    vec![("content-type", "application/json"), ("retry-after", "1")],
                    Some(body),
                );
                Action::Pause
            }
            // Not configured: pass through to the route's default.
            None => Action::Continue,
        }
    }

    fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let Some(d) = self.decision.take() else {
            return;
        };
        // No response headers at all: connect failure, reset or timeout upstream, unless the
        // client went away first (not the worker's fault).
        let worker_failed = !self.saw_response
            && !hostcalls::get_property(vec!["response", "code_details"])
                .ok()
                .flatten()
                .is_some_and(|d| d.starts_with(b"downstream"));
        self.with(|s| {
            let now = now_ms();
            let mut evs = Vec::new();
            if worker_failed {
                if let Some(wm) = s.metrics.worker(d.target) {
                    wm.failures.inc();
                }
                evs.extend(s.router.on_failure(&d, d.target, now));
            }
            evs.push(s.router.on_finish(&d, now));
            s.broadcast(&evs);
        });
    }
}

fn set_request_header(name: &str, value: &str) {
    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
}

fn steer(s: &State, d: &Decision) {
    let r = &s.router;
    let cfg = r.config();
    let header = cfg.steering.header_name();
    match cfg.steering.mode {
        SteeringMode::Cluster => set_request_header(header, r.worker_cluster(d.target)),
        SteeringMode::Endpoint => {
            let list: Vec<&str> = std::iter::once(d.target)
                .chain(d.alternates.iter().copied())
                .filter_map(|w| r.worker_endpoint(w))
                .collect();
            if !list.is_empty() {
                set_request_header(header, &list.join(","));
            }
        }
    }
    if let Some(p) = d.prefill {
        match cfg.disaggregation.mode {
            DisaggMode::Kvroute => {
                if let Some(ep) = r.worker_endpoint(d.decode) {
                    set_request_header(&cfg.disaggregation.decode_header, ep);
                }
            }
            DisaggMode::LlmD => {
                if let Some(ep) = r.worker_endpoint(p) {
                    set_request_header(&cfg.disaggregation.prefiller_header, ep);
                }
            }
        }
    }
    set_request_header(ORCA_REQUEST, "TEXT");
}

fn record_decision(s: &State, d: &Decision) {
    let m = &s.metrics;
    match &d.fallback {
        Some(f) => {
            m.fallback.inc();
            match f.kind() {
                "unknown_model" => m.fallback_model.inc(),
                _ => m.fallback_parse.inc(),
            }
        }
        None => {
            m.routed.inc();
            m.predicted_hit_pct
                .record((d.predicted_hit() * 100.0).round() as u64);
            if s.router.config().disaggregation.threshold_tokens > 0 {
                if d.prefill.is_some() {
                    m.disagg_prefill.inc()
                } else {
                    m.disagg_local.inc()
                }
            }
        }
    }
    if let Some(wm) = m.worker(d.decode) {
        wm.decisions.inc();
    }
}

impl Context for Http {
    fn on_done(&mut self) -> bool {
        self.finish();
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(st) = &self.st else {
            return Action::Continue;
        };
        let (routes, strip) = match st.try_borrow() {
            Ok(s) => {
                let cfg = s.router.config();
                let strip = [
                    cfg.steering.header_name().to_string(),
                    cfg.disaggregation.decode_header.clone(),
                    cfg.disaggregation.prefiller_header.clone(),
                ];
                (cfg.routes.clone(), strip)
            }
            Err(_) => return Action::Continue,
        };
        // A client must never choose the worker itself.
        for h in &strip {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, h, None);
        }
        let method = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":method")
            .ok()
            .flatten();
        let path = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path")
            .ok()
            .flatten()
            .unwrap_or_default();
        let path = path.split('?').next().unwrap_or("");
        if method.as_deref() != Some("POST") || !routes.iter().any(|r| r == path) {
            return Action::Continue;
        }
        self.kind = Some(if path.ends_with("/chat/completions") {
            ApiKind::ChatCompletions
        } else {
            ApiKind::Completions
        });
        if end_of_stream {
            return self.route(&[]);
        }
        // Hold the headers until the body is in (needs allow_on_headers_stop_iteration).
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.kind.is_none() || self.routed {
            return Action::Continue;
        }
        if !end_of_stream {
            // Envoy buffers until the end of the body.
            return Action::Pause;
        }
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        self.route(&body)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.kind.is_none() || self.routed {
            return Action::Continue;
        }
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        self.route(&body)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.saw_response = true;
        let Some(d) = self.decision.clone() else {
            return Action::Continue;
        };
        let status: u32 = hostcalls::get_map_value(MapType::HttpResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let orca = hostcalls::get_map_value(MapType::HttpResponseHeaders, ORCA_RESPONSE)
            .ok()
            .flatten();
        // Set by Envoy with `include_attempt_count_in_response`: > 1 means the first try (on
        // the chosen worker, priority 0 of its cluster) failed and a retry answered.
        let attempts: u32 =
            hostcalls::get_map_value(MapType::HttpResponseHeaders, "x-envoy-attempt-count")
                .ok()
                .flatten()
                .and_then(|s| s.parse().ok())
                .unwrap_or(1);
        let upstream = hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten()
            .and_then(|b| String::from_utf8(b).ok());
        let debug = self.with(|s| {
            let now = now_ms();
            let mut evs: Vec<Event> = Vec::new();
            let failed = status >= 500 || status == 429;
            // With priority failover, Envoy may have retried on another worker: the chosen
            // one did not answer. Only comparable when the endpoint is an IP literal.
            // Whether the answer verifiably came from the chosen worker: only an IP endpoint
            // can be compared with the upstream address (DNS names resolve elsewhere).
            let same_host = match (s.router.worker_endpoint(d.target), upstream.as_deref()) {
                (Some(ep), Some(up)) if is_ip_endpoint(ep) => Some(ep == up),
                _ => None,
            };
            let moved = attempts > 1 || same_host == Some(false);
            if failed || moved {
                if let Some(wm) = s.metrics.worker(d.target) {
                    wm.failures.inc();
                }
                evs.extend(s.router.on_failure(&d, d.target, now));
            } else if (200..300).contains(&status) && same_host == Some(true) {
                // Ending a cooldown early needs proof the worker itself answered; an outlier
                // ejection in Envoy can serve the chosen cluster from its failover hosts.
                evs.extend(s.router.on_success(d.target, now));
            }
            if let Some(load) = orca.as_deref().and_then(parse_orca) {
                s.metrics.orca_reports.inc();
                evs.push(s.router.on_orca(d.target, &load, now));
            }
            s.broadcast(&evs);
            s.router
                .config()
                .debug_headers
                .then(|| debug_headers(s, &d))
        });
        if let Some(Some(headers)) = debug {
            for (k, v) in headers {
                let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, k, Some(&v));
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(d) = self.decision.clone() else {
            return Action::Continue;
        };
        if body_size > 0 {
            if !self.first_byte {
                self.first_byte = true;
                self.with(|s| {
                    let e = s.router.on_first_byte(&d, now_ms());
                    s.broadcast(&[e]);
                });
            }
            // Each callback sees only the new chunk; the stream passes through unbuffered.
            if let Ok(Some(chunk)) =
                hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size)
            {
                self.tail.push(&chunk);
            }
        }
        if end_of_stream {
            if let Some(u) = self.tail.usage() {
                self.with(|s| {
                    s.metrics.usage_reports.inc();
                    let (out, ev) = s.router.on_usage(&d, &u, now_ms());
                    if let Some(hit) = out.actual_hit {
                        s.metrics
                            .actual_hit_pct
                            .record((hit * 100.0).round() as u64);
                    }
                    if out.overpredicted {
                        s.metrics.overpredicted.inc();
                    }
                    if let Some(e) = ev {
                        s.broadcast(&[e]);
                    }
                });
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.finish();
    }
}

fn debug_headers(s: &State, d: &Decision) -> Vec<(&'static str, String)> {
    let r = &s.router;
    let mut h = vec![
        ("x-kvroute-worker", r.worker_name(d.decode).to_string()),
        (
            "x-kvroute-predicted-cached-tokens",
            d.overlap_tokens.to_string(),
        ),
        ("x-kvroute-prompt-tokens", d.prompt_tokens.to_string()),
    ];
    if let Some(p) = d.prefill {
        h.push(("x-kvroute-prefill-worker", r.worker_name(p).to_string()));
        h.push((
            "x-kvroute-decode-cached-tokens",
            d.decode_overlap_tokens.to_string(),
        ));
    }
    if let Some(f) = &d.fallback {
        h.push(("x-kvroute-fallback", f.kind().to_string()));
        log(
            LogLevel::Debug,
            &format!("kvroute: fallback routing: {f:?}"),
        );
    }
    h
}

fn is_ip_endpoint(ep: &str) -> bool {
    ep.parse::<std::net::SocketAddr>().is_ok()
}
