//! One HTTP stream: buffer an inference request, route it, steer it, and feed what the
//! worker answers back into the router.

use super::host::Calls;
use super::state::State;
use crate::events::Event;
use crate::feedback::{self, Outcome, UsageTail};
use crate::request::ApiKind;
use crate::router::{Decision, Fallback, RouteResult};
use crate::steer::{self, ORCA_RESPONSE};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, LogLevel, MapType};
use std::cell::RefCell;
use std::rc::Rc;

const BUSY_BODY: &[u8] =
    br#"{"error":{"message":"all inference workers are busy","type":"overloaded","code":429}}"#;

pub struct Http {
    host: Rc<Calls>,
    st: Option<Rc<RefCell<State>>>,
    kind: Option<ApiKind>,
    routed: bool,
    /// A tokenize call in flight: its token, the request body it is for, sent at (ns), the
    /// text block hashes the request was routed on.
    tokenizing: Option<(u32, Vec<u8>, u64, Vec<u64>)>,
    decision: Option<Decision>,
    saw_response: bool,
    /// The response status was 2xx (its body confirms the request's blocks as computed).
    success: bool,
    first_byte: bool,
    /// The first byte of a 2xx answer went to the client and its blocks are not confirmed
    /// yet: confirming walks every block of the prompt, so it waits for the next chunk or
    /// the end, off the first byte.
    confirm_due: bool,
    finished: bool,
    tail: UsageTail,
    /// The request's session header (`hints.session_header`), a routing hint.
    session: Option<String>,
    /// The engine's cached tokens were read and the request counted on the reuse ladder.
    served: Option<u64>,
}

impl Http {
    /// The routing decision, for tests that follow a request into the index.
    #[cfg(test)]
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    pub fn new(host: Rc<Calls>, st: Option<Rc<RefCell<State>>>) -> Self {
        Http {
            host,
            st,
            kind: None,
            routed: false,
            tokenizing: None,
            decision: None,
            saw_response: false,
            success: false,
            first_byte: false,
            confirm_due: false,
            finished: false,
            tail: UsageTail::default(),
            session: None,
            served: None,
        }
    }

    /// Runs `f` with the VM state unless it is already borrowed (never expected: proxy-wasm
    /// callbacks do not nest, but a double borrow must not become a panic).
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> Option<R> {
        let st = self.st.as_ref()?;
        let mut s = st.try_borrow_mut().ok()?;
        Some(f(&mut s))
    }

    /// Routes the request on its text at once. With `tokenize` on and a worker engine-fed,
    /// it then asks an engine for the prompt's token ids off the request path, unless every
    /// text block but the last is already mapped: the answer teaches which engine block each
    /// text block ends in (`twins`), so later prompts sharing it are looked up in what the
    /// engines report.
    fn route_or_tokenize(&mut self, body: Vec<u8>) -> Action {
        let action = self.route(&body, None);
        if action != Action::Continue {
            return action;
        }
        let Some(kind) = self.kind else {
            return action;
        };
        let Some(text) = self.decision.as_ref().map(|d| d.hashes().to_vec()) else {
            return action;
        };
        let call = self
            .with(|s| {
                let c = s.router.config();
                let t = &c.tokenize;
                (!t.cluster.is_empty() && s.router.wants_tokens(&text))
                    .then(|| (t.cluster.clone(), t.path.clone(), t.timeout_ms))
            })
            .flatten();
        let Some((cluster, path, timeout_ms)) = call else {
            return action;
        };
        let Some(req) = crate::tokenize::request_body(kind, &body) else {
            return action;
        };
        let headers = [
            (":method", "POST"),
            (":path", path.as_str()),
            (":authority", cluster.as_str()),
            ("content-type", "application/json"),
        ];
        let timeout = std::time::Duration::from_millis(timeout_ms);
        match self.host.http_call(&cluster, &headers, Some(&req), timeout) {
            Some(token) => self.tokenizing = Some((token, body, self.host.now_ns(), text)),
            None => {
                self.with(|s| s.metrics.tokenize_failed.inc());
            }
        }
        action
    }

    fn route(&mut self, body: &[u8], tokens: Option<&[u32]>) -> Action {
        self.routed = true;
        let Some(kind) = self.kind else {
            return Action::Continue;
        };
        let host = &self.host;
        let t0 = host.now_ns();
        let now = t0 / 1_000_000;
        let outcome = self.with(|s| {
            s.start_serving();
            s.read_peer_picks(now);
            let session = self.session.as_deref();
            let res = s.router.route_hinted(kind, body, tokens, session, now);
            s.metrics
                .route_time_us
                .record(host.now_ns().saturating_sub(t0) / 1000);
            match res {
                RouteResult::Rejected => {
                    s.metrics.rejected.inc();
                    Err(None)
                }
                RouteResult::UnknownModel(model) => {
                    s.metrics.model_not_found.inc();
                    Err(Some(model))
                }
                RouteResult::Routed(d) => {
                    for (name, value) in steer::request_headers(&s.router, &d) {
                        host.set_header(MapType::HttpRequestHeaders, name, Some(&value));
                    }
                    record_decision(s, &d);
                    s.publish_pick(&d, now);
                    s.broadcast(std::slice::from_ref(&d.event));
                    if let Some(e) = &d.hinted {
                        s.broadcast(std::slice::from_ref(e));
                    }
                    s.defer_flush();
                    Ok(d)
                }
            }
        });
        match outcome {
            Some(Ok(d)) => {
                self.decision = Some(d);
                Action::Continue
            }
            Some(Err(None)) => {
                host.send_response(
                    429,
                    &[("content-type", "application/json"), ("retry-after", "1")],
                    BUSY_BODY,
                );
                Action::Pause
            }
            Some(Err(Some(model))) => {
                host.send_response(
                    404,
                    &[("content-type", "application/json")],
                    &steer::model_not_found_body(&model),
                );
                Action::Pause
            }
            // Not configured: pass through to the route's default.
            None => Action::Continue,
        }
    }

    /// Answers the status page here (config `status.path`); the request never goes on.
    fn status_page(&mut self, method: Option<&str>) -> Action {
        let json = [
            ("content-type", "application/json"),
            ("cache-control", "no-store"),
        ];
        match method {
            Some("GET") => {
                let body = self.with(|s| s.status_page()).unwrap_or_default();
                self.host.send_response(200, &json, &body);
            }
            _ => self.host.send_response(
                405,
                &[("allow", "GET"), ("content-type", "application/json")],
                br#"{"error":{"message":"the status page answers GET only","code":405}}"#,
            ),
        }
        Action::Pause
    }

    /// The buffered request body, at most `limits.max_route_bytes + 1` bytes of it: a body
    /// over the limit is routed as `too_large` and the rest is never copied into the VM.
    fn request_body(&self, size: usize) -> Vec<u8> {
        let limit = self
            .with(|s| s.router.config().limits.max_route_bytes as usize)
            .unwrap_or(usize::MAX);
        self.host
            .buffer(
                BufferType::HttpRequestBody,
                size.min(limit.saturating_add(1)),
            )
            .unwrap_or_default()
    }

    fn response_headers(&mut self, d: &Decision) {
        let host = &self.host;
        let all = host.headers(MapType::HttpResponseHeaders);
        let header = |name| match &all {
            Some(a) => a.get(name),
            None => host.header(MapType::HttpResponseHeaders, name),
        };
        let status: u32 = header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        let orca = header(ORCA_RESPONSE);
        // Set by Envoy with `include_attempt_count_in_response`.
        let attempts: u32 = header("x-envoy-attempt-count")
            .and_then(|s| s.parse().ok())
            .unwrap_or(1);
        // Only an ip:port endpoint is compared with the upstream address (`same_host`).
        let comparable = self
            .with(|s| {
                s.router
                    .worker_endpoint(d.target)
                    .is_some_and(|ep| ep.parse::<std::net::SocketAddr>().is_ok())
            })
            .unwrap_or(false);
        let upstream = comparable
            .then(|| host.property_string(&["upstream", "address"]))
            .flatten();
        // `via_upstream`, or why Envoy answered itself (overflow, no healthy upstream...);
        // `classify` reads it only for a 5xx.
        let details = (status >= 500)
            .then(|| host.property_string(&["response", "code_details"]))
            .flatten();
        let now = host.now_ms();
        let debug = self.with(|s| {
            let mut evs: Vec<Event> = Vec::new();
            let same_host =
                feedback::same_host(s.router.worker_endpoint(d.target), upstream.as_deref());
            let outcome = feedback::classify(Some(status), attempts, same_host, details.as_deref());
            match outcome {
                Outcome::Failure => record_failure(s, d, now, &mut evs),
                Outcome::Success => evs.extend(s.router.on_success(d.target, now)),
                Outcome::Neutral | Outcome::ClientGone => {}
            }
            if let Some(load) = orca.as_deref().and_then(feedback::parse_orca) {
                s.metrics.orca_reports.inc();
                evs.push(s.router.on_orca(d.target, &load, now));
            }
            s.broadcast(&evs);
            let debug = s
                .router
                .config()
                .debug_headers
                .then(|| steer::debug_headers(&s.router, d));
            (outcome, debug)
        });
        // A 2xx that Envoy had to get from elsewhere (a retry, a failover host) does not
        // prove the chosen worker computed the prompt.
        let outcome = debug.as_ref().map(|(o, _)| *o);
        self.success = (200..300).contains(&status) && outcome != Some(Outcome::Failure);
        let debug = debug.map(|(_, h)| h);
        if let Some(Some(headers)) = debug {
            if let Some(f) = &d.fallback {
                host.log(
                    LogLevel::Debug,
                    &format!("kvroute: fallback routing: {f:?}"),
                );
            }
            for (k, v) in headers {
                host.set_header(MapType::HttpResponseHeaders, k, Some(&v));
            }
        }
    }

    fn response_body(&mut self, d: &Decision, body_size: usize, end_of_stream: bool) {
        if body_size > 0 {
            if !self.first_byte {
                self.first_byte = true;
                self.confirm_due = self.success;
                let now = self.host.now_ms();
                self.with(|s| {
                    let e = s.router.on_prefill_done(d, now);
                    s.broadcast(&[e]);
                });
            } else {
                self.confirm(d);
            }
            // Each callback sees only the new chunk; the stream passes through unbuffered.
            // Reading it costs two crossings into the VM (the call and its allocation), for
            // every token of a stream: skipped where no usage can come before the end. An
            // engine that sends usage unasked (vLLM --enable-force-include-usage) is still
            // read when its usage comes with the end of the stream.
            if !d.usage_at_end_only || end_of_stream {
                if let Some(chunk) = self.host.buffer(BufferType::HttpResponseBody, body_size) {
                    self.tail.push(&chunk);
                }
            }
        }
        if end_of_stream {
            if let Some(u) = self.tail.usage() {
                let now = self.host.now_ms();
                self.served = self
                    .with(|s| {
                        let rungs = d.ladder.rungs(d.prompt_tokens, Some(&u));
                        if d.fallback.is_none() && rungs.served.is_some() {
                            s.metrics.reuse.add(&rungs);
                        }
                        rungs.served.filter(|_| d.fallback.is_none())
                    })
                    .flatten();
                self.with(|s| {
                    s.metrics.usage_reports.inc();
                    let (out, ev) = s.router.on_usage(d, &u, now);
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
    }

    /// Confirms the request's blocks (computed, pinned until it ends) if its first byte left
    /// them due.
    fn confirm(&mut self, d: &Decision) {
        if !std::mem::take(&mut self.confirm_due) {
            return;
        }
        let now = self.host.now_ms();
        self.with(|s| {
            if let Some(e) = s.router.on_confirmed(d, true, now) {
                s.broadcast(&[e]);
            }
        });
    }

    fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let Some(d) = self.decision.take() else {
            return;
        };
        // Before the request's load is freed: confirmed blocks go into the index with it,
        // blocks still speculative leave with it.
        self.confirm(&d);
        // No response headers at all: connect failure, reset or timeout upstream, unless the
        // client went away first. With a response, on_http_response_headers judged it.
        let outcome = if self.saw_response {
            Outcome::Neutral
        } else {
            let details = self.host.property_string(&["response", "code_details"]);
            feedback::classify(None, 1, None, details.as_deref())
        };
        let now = self.host.now_ms();
        let served = self.served;
        let explained = self.with(|s| {
            if served.is_none() && d.fallback.is_none() {
                s.metrics
                    .reuse_unreported
                    .add(&d.ladder.rungs(d.prompt_tokens, None));
            }
            let explained = (s.router.config().debug_headers && d.fallback.is_none())
                .then(|| steer::explain_line(&s.router, &d, served));
            let mut evs = Vec::new();
            if outcome == Outcome::Failure {
                record_failure(s, &d, now, &mut evs);
            }
            evs.push(s.router.on_finish(&d, now));
            s.broadcast(&evs);
            s.publish_end(&d, now);
            explained
        });
        if let Some(Some(line)) = explained {
            self.host.log(LogLevel::Debug, &line);
        }
    }
}

fn record_failure(s: &mut State, d: &Decision, now: u64, evs: &mut Vec<Event>) {
    if let Some(wm) = s.metrics.worker(d.target) {
        wm.failures.inc();
    }
    evs.extend(s.router.on_failure(d, d.target, now));
}

fn record_decision(s: &State, d: &Decision) {
    let m = &s.metrics;
    match &d.fallback {
        Some(f) => {
            m.fallback.inc();
            match f {
                Fallback::Parse(_) => m.fallback_parse.inc(),
                Fallback::UnknownModel(_) => m.fallback_model.inc(),
                Fallback::NoCandidates => m.fallback_no_candidates.inc(),
                Fallback::TooLarge => m.fallback_too_large.inc(),
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

    /// The tokenize call's answer (or its failure: no headers). Either way the request is
    /// routed now, on exact token ids when the answer has them.
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some((token, body, sent_ns, text)) = self.tokenizing.take() else {
            return;
        };
        if token != token_id {
            self.tokenizing = Some((token, body, sent_ns, text));
            return;
        }
        let host = &self.host;
        let max = self
            .with(|s| s.router.config().tokenize.max_bytes as usize)
            .unwrap_or(0);
        let ok = num_headers > 0
            && host
                .header(MapType::HttpCallResponseHeaders, ":status")
                .as_deref()
                == Some("200")
            && body_size <= max;
        let tokens = if ok {
            host.buffer(BufferType::HttpCallResponseBody, body_size)
                .and_then(|b| crate::tokenize::parse_tokens(&b))
        } else {
            None
        };
        let now_ns = host.now_ns();
        let waited_us = now_ns.saturating_sub(sent_ns) / 1000;
        let kind = self.kind;
        self.with(|s| {
            s.metrics.tokenize_us.record(waited_us);
            let Some(tokens) = tokens else {
                s.metrics.tokenize_failed.inc();
                return;
            };
            s.metrics.tokenize_ok.inc();
            let learned = kind.and_then(|k| {
                s.router
                    .learn_tokens(k, &body, &text, &tokens, now_ns / 1_000_000)
            });
            if let Some(e) = learned {
                s.broadcast(std::slice::from_ref(&e));
            }
            s.metrics.text_blocks.record(s.router.twins_len() as u64);
        });
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(st) = &self.st else {
            return Action::Continue;
        };
        let Ok(s) = st.try_borrow() else {
            return Action::Continue;
        };
        let host = &self.host;
        // One call reads every header (each host call costs microseconds in Envoy's V8);
        // without it, each header is asked for on its own.
        let all = host.headers(MapType::HttpRequestHeaders);
        // A client must never choose the worker itself.
        for h in s.intercept.strip() {
            if all.as_ref().is_none_or(|a| a.contains(h)) {
                host.set_header(MapType::HttpRequestHeaders, h, None);
            }
        }
        let header = |name| match &all {
            Some(a) => a.get(name),
            None => host.header(MapType::HttpRequestHeaders, name),
        };
        let method = header(":method");
        let path = header(":path").unwrap_or_default();
        let status = s.intercept.is_status(&path);
        let matched = s.intercept.matches(method.as_deref(), &path);
        if status {
            drop(s);
            return self.status_page(method.as_deref());
        }
        let Some(m) = matched else {
            return Action::Continue;
        };
        let session_header = &s.router.config().hints.session_header;
        let session = (!session_header.is_empty())
            .then(|| header(session_header.as_str()))
            .flatten();
        drop(s);
        self.session = session;
        self.kind = Some(m.kind);
        if let Some(p) = m.rewrite {
            host.set_header(MapType::HttpRequestHeaders, ":path", Some(&p));
        }
        if end_of_stream {
            return self.route(&[], None);
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
        let body = self.request_body(body_size);
        self.route_or_tokenize(body)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.kind.is_none() || self.routed {
            return Action::Continue;
        }
        let body = self.request_body(usize::MAX);
        self.route_or_tokenize(body)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.saw_response = true;
        // Taken out and put back rather than cloned: a decision carries its prompt's block
        // hashes (8 bytes a block).
        let Some(d) = self.decision.take() else {
            return Action::Continue;
        };
        self.response_headers(&d);
        self.decision = Some(d);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(d) = self.decision.take() else {
            return Action::Continue;
        };
        self.response_body(&d, body_size, end_of_stream);
        self.decision = Some(d);
        Action::Continue
    }

    fn on_log(&mut self) {
        self.finish();
    }
}
