//! The adapter driven natively: contexts over a fake host that keeps headers, bodies,
//! properties, stats and local responses in memory.

use super::host::{Calls, Host, HostResult};
use super::http::Http;
use super::root::Root;
use super::state::State;
use crate::config::Config;
use crate::replication::memory::MemoryBus;
use crate::replication::SharedBus;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, LogLevel, MapType, MetricType, Status};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

/// A local response: status, headers, body.
type Sent = (u32, Vec<(String, String)>, Vec<u8>);
/// An HTTP call the filter made: token, cluster, headers.
type Call = (u32, String, Vec<(String, String)>);

#[derive(Default)]
struct Fake {
    /// Header values are bytes: clients and upstreams can send any byte.
    request: Vec<(String, Vec<u8>)>,
    response: Vec<(String, Vec<u8>)>,
    request_body: Vec<u8>,
    /// The response chunk the current body callback sees.
    response_chunk: Vec<u8>,
    /// Response body reads (each a copy into the VM).
    response_reads: u32,
    plugin_config: Vec<u8>,
    properties: HashMap<String, String>,
    sent: Vec<Sent>,
    now_ns: u64,
    logs: Vec<(LogLevel, String)>,
    /// name, kind, counter sum, last recorded value
    metrics: Vec<(String, MetricType, i64, Option<u64>)>,
    /// Calls that answer with an error.
    failing: Vec<&'static str>,
    /// HTTP calls made: token, cluster, headers.
    calls: Vec<Call>,
    /// The answer the current `on_http_call_response` reads.
    call_headers: Vec<(String, Vec<u8>)>,
    call_body: Vec<u8>,
    /// Bodies of the HTTP calls made, in `calls` order.
    call_bodies: Vec<Option<Vec<u8>>>,
    /// gRPC streams opened: token, cluster, service/method; messages sent; cancelled.
    grpc_opened: Vec<(u32, String, String)>,
    /// Each opened stream's initial metadata, in `grpc_opened` order.
    grpc_metadata: Vec<Vec<(String, Vec<u8>)>>,
    /// The VM's environment.
    env: HashMap<String, String>,
    grpc_sent: Vec<(u32, Vec<u8>, bool)>,
    grpc_cancelled: Vec<u32>,
    /// The message the current `on_grpc_stream_message` reads.
    grpc_message: Vec<u8>,
    /// Every root timer period set, in ms.
    tick_periods: Vec<u128>,
}

#[derive(Clone, Default)]
struct FakeHost(Rc<RefCell<Fake>>);

impl FakeHost {
    fn fails(&self, call: &'static str) -> HostResult<()> {
        if self.0.borrow().failing.contains(&call) {
            Err(Status::InternalFailure)
        } else {
            Ok(())
        }
    }
}

fn map(f: &mut Fake, m: MapType) -> &mut Vec<(String, Vec<u8>)> {
    match m {
        MapType::HttpResponseHeaders => &mut f.response,
        MapType::HttpCallResponseHeaders => &mut f.call_headers,
        _ => &mut f.request,
    }
}

impl Host for FakeHost {
    fn header(&self, m: MapType, name: &str) -> HostResult<Option<Vec<u8>>> {
        self.fails("header")?;
        let mut f = self.0.borrow_mut();
        Ok(map(&mut f, m)
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone()))
    }

    fn headers(&self, m: MapType) -> HostResult<Vec<(String, Vec<u8>)>> {
        self.fails("headers")?;
        Ok(map(&mut self.0.borrow_mut(), m).clone())
    }

    fn set_header(&self, m: MapType, name: &str, value: Option<&str>) -> HostResult<()> {
        self.fails("set_header")?;
        let mut f = self.0.borrow_mut();
        let h = map(&mut f, m);
        h.retain(|(k, _)| k != name);
        if let Some(v) = value {
            h.push((name.to_string(), v.as_bytes().to_vec()));
        }
        Ok(())
    }

    fn buffer(&self, kind: BufferType, start: usize, max: usize) -> HostResult<Option<Vec<u8>>> {
        self.fails("buffer")?;
        if kind == BufferType::HttpResponseBody {
            self.0.borrow_mut().response_reads += 1;
        }
        let f = self.0.borrow();
        let b = match kind {
            BufferType::HttpRequestBody => &f.request_body,
            BufferType::HttpResponseBody => &f.response_chunk,
            BufferType::PluginConfiguration => &f.plugin_config,
            BufferType::HttpCallResponseBody => &f.call_body,
            BufferType::GrpcReceiveBuffer => &f.grpc_message,
            _ => return Ok(None),
        };
        let end = b.len().min(start.saturating_add(max));
        Ok(b.get(start..end).map(<[u8]>::to_vec))
    }

    fn property(&self, path: &[&str]) -> HostResult<Option<Vec<u8>>> {
        self.fails("property")?;
        let f = self.0.borrow();
        Ok(f.properties
            .get(&path.join("."))
            .map(|v| v.as_bytes().to_vec()))
    }

    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) -> HostResult<()> {
        self.fails("send_response")?;
        let headers = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.0
            .borrow_mut()
            .sent
            .push((status, headers, body.to_vec()));
        Ok(())
    }

    fn now_ns(&self) -> HostResult<u64> {
        self.fails("now")?;
        Ok(self.0.borrow().now_ns)
    }

    fn log(&self, level: LogLevel, msg: &str) -> HostResult<()> {
        self.0.borrow_mut().logs.push((level, msg.to_string()));
        Ok(())
    }

    fn define_metric(&self, kind: MetricType, name: &str) -> HostResult<u32> {
        let mut f = self.0.borrow_mut();
        f.metrics.push((name.to_string(), kind, 0, None));
        Ok(u32::try_from(f.metrics.len() - 1).unwrap())
    }

    fn increment_metric(&self, id: u32, n: i64) -> HostResult<()> {
        // Envoy refuses a counter increment that is not positive.
        if n <= 0 {
            return Err(Status::BadArgument);
        }
        self.0.borrow_mut().metrics[id as usize].2 += n;
        Ok(())
    }

    fn record_metric(&self, id: u32, v: u64) -> HostResult<()> {
        self.0.borrow_mut().metrics[id as usize].3 = Some(v);
        Ok(())
    }

    fn get_metric(&self, id: u32) -> HostResult<u64> {
        let f = self.0.borrow();
        let m = f.metrics.get(id as usize).ok_or(Status::NotFound)?;
        Ok(m.3.unwrap_or(m.2 as u64))
    }

    fn set_tick_period(&self, period: Duration) -> HostResult<()> {
        self.fails("set_tick_period")?;
        self.0.borrow_mut().tick_periods.push(period.as_millis());
        Ok(())
    }

    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        _timeout: Duration,
    ) -> HostResult<u32> {
        self.fails("http_call")?;
        let mut f = self.0.borrow_mut();
        let token = 100 + f.calls.len() as u32;
        f.call_bodies.push(body.map(<[u8]>::to_vec));
        let headers = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        f.calls.push((token, cluster.to_string(), headers));
        Ok(token)
    }

    fn grpc_open(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> HostResult<u32> {
        self.fails("grpc_open")?;
        let mut f = self.0.borrow_mut();
        f.grpc_metadata.push(
            metadata
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_vec()))
                .collect(),
        );
        let token = 500 + f.grpc_opened.len() as u32;
        f.grpc_opened
            .push((token, cluster.to_string(), format!("{service}/{method}")));
        Ok(token)
    }

    fn grpc_send(&self, token: u32, msg: &[u8], end_stream: bool) -> HostResult<()> {
        self.fails("grpc_send")?;
        self.0
            .borrow_mut()
            .grpc_sent
            .push((token, msg.to_vec(), end_stream));
        Ok(())
    }

    fn grpc_cancel(&self, token: u32) -> HostResult<()> {
        self.0.borrow_mut().grpc_cancelled.push(token);
        Ok(())
    }

    fn env(&self, name: &str) -> Option<String> {
        self.0.borrow().env.get(name).cloned()
    }
}

/// One configured VM over a fake host.
struct Vm {
    fake: FakeHost,
    host: Rc<Calls>,
    state: Rc<RefCell<State>>,
}

const WORKERS: &str = r#""workers":[
    {"name":"d0","endpoint":"10.0.0.1:8000","cluster":"pool-d0"},
    {"name":"d1","endpoint":"10.0.0.2:8000","cluster":"pool-d1"},
    {"name":"p0","endpoint":"10.0.1.1:8000","role":"prefill"}
]"#;

impl Vm {
    /// `extra` is appended to the worker list of the plugin configuration.
    fn new(extra: &str) -> Vm {
        Vm::with_bus(extra, Box::new(MemoryBus::default()))
    }

    fn with_bus(extra: &str, bus: Box<dyn SharedBus>) -> Vm {
        let json = format!(r#"{{{WORKERS},"seed":7{extra}}}"#);
        let cfg = Config::from_json(json.as_bytes()).unwrap();
        let fake = FakeHost::default();
        fake.0.borrow_mut().now_ns = 1_000_000_000;
        let host = Rc::new(Calls::new(Box::new(fake.clone())));
        let state = State::configure(Rc::clone(&host), cfg, bus, "kvroute");
        Vm {
            fake,
            host,
            state: Rc::new(RefCell::new(state)),
        }
    }

    fn http(&self) -> Http {
        Http::new(Rc::clone(&self.host), Some(Rc::clone(&self.state)))
    }

    fn f(&self) -> std::cell::RefMut<'_, Fake> {
        self.fake.0.borrow_mut()
    }

    fn request(&self, method: &str, path: &str, extra: &[(&str, &str)]) {
        let mut f = self.f();
        f.request = vec![
            (":method".into(), method.into()),
            (":path".into(), path.into()),
        ];
        f.request
            .extend(extra.iter().map(|(k, v)| (k.to_string(), (*v).into())));
        f.response.clear();
    }

    fn req_header(&self, name: &str) -> Option<String> {
        let v = self.fake.header(MapType::HttpRequestHeaders, name).unwrap();
        v.map(|v| String::from_utf8(v).unwrap())
    }

    fn resp_header(&self, name: &str) -> Option<String> {
        let v = self.fake.header(MapType::HttpResponseHeaders, name);
        v.unwrap().map(|v| String::from_utf8(v).unwrap())
    }

    fn counter(&self, name: &str) -> i64 {
        let f = self.fake.0.borrow();
        let m = f.metrics.iter().find(|m| m.0 == name);
        m.unwrap_or_else(|| panic!("no stat {name}")).2
    }

    fn recorded(&self, name: &str) -> Option<u64> {
        let f = self.fake.0.borrow();
        f.metrics.iter().find(|m| m.0 == name).and_then(|m| m.3)
    }

    /// Runs a completion POST through the request callbacks up to the routing decision.
    fn post(&self, prompt: &str) -> (Http, Action) {
        self.post_json(serde_json::json!({"model":"m","prompt":prompt,"max_tokens":4}))
    }

    fn post_json(&self, json: serde_json::Value) -> (Http, Action) {
        let body = serde_json::to_vec(&json).unwrap();
        self.request("POST", "/v1/completions", &[]);
        self.f().request_body = body.clone();
        let mut h = self.http();
        assert_eq!(h.on_http_request_headers(3, false), Action::Pause);
        let a = h.on_http_request_body(body.len(), true);
        (h, a)
    }

    /// Answers the request with `status` and response headers, then ends the stream.
    fn answer(&self, h: &mut Http, status: &str, headers: &[(&str, &str)]) {
        {
            let mut f = self.f();
            f.response = vec![(":status".into(), status.into())];
            f.response
                .extend(headers.iter().map(|(k, v)| (k.to_string(), (*v).into())));
        }
        assert_eq!(h.on_http_response_headers(2, false), Action::Continue);
    }

    fn body_chunk(&self, h: &mut Http, chunk: &[u8], end: bool) {
        self.f().response_chunk = chunk.to_vec();
        assert_eq!(h.on_http_response_body(chunk.len(), end), Action::Continue);
    }

    fn done(&self, h: &mut Http) {
        h.on_log();
        assert!(h.on_done());
    }

    fn failures(&self, worker: &str) -> i64 {
        self.counter(&format!("kvroute.worker.{worker}.failures_total"))
    }

    fn inflight(&self) -> usize {
        self.state.borrow().router.load().active_requests()
    }
}

const NO_DISAGG: &str = r#","disaggregation":{"threshold_tokens":0}"#;

#[test]
fn inference_post_pauses_until_the_body_is_complete() {
    let vm = Vm::new(NO_DISAGG);
    vm.request("POST", "/v1/completions?x=1", &[]);
    let body = br#"{"model":"m","prompt":"hello there"}"#;
    vm.f().request_body = body.to_vec();
    let mut h = vm.http();
    assert_eq!(h.on_http_request_headers(3, false), Action::Pause);
    assert_eq!(h.on_http_request_body(10, false), Action::Pause);
    assert_eq!(vm.req_header("x-kvroute-cluster"), None);
    assert_eq!(h.on_http_request_body(body.len(), true), Action::Continue);
    let cluster = vm.req_header("x-kvroute-cluster").unwrap();
    assert!(cluster == "pool-d0" || cluster == "pool-d1", "{cluster}");
    assert_eq!(vm.counter("kvroute.requests.routed.total"), 1);
    assert_eq!(vm.inflight(), 1);
    // Later body callbacks (none expected) and a second finish change nothing.
    assert_eq!(h.on_http_request_body(0, true), Action::Continue);
    vm.done(&mut h);
    vm.done(&mut h);
    assert_eq!(vm.inflight(), 0);
}

#[test]
fn other_traffic_passes_through_untouched() {
    let vm = Vm::new(NO_DISAGG);
    for (method, path) in [
        ("GET", "/v1/completions"),
        ("POST", "/v1/models"),
        ("POST", "/v1/completions/extra"),
    ] {
        vm.request(method, path, &[]);
        let mut h = vm.http();
        assert_eq!(h.on_http_request_headers(3, false), Action::Continue);
        assert_eq!(h.on_http_request_body(5, false), Action::Continue);
        assert_eq!(h.on_http_request_trailers(0), Action::Continue);
        assert_eq!(vm.req_header("x-kvroute-cluster"), None, "{method} {path}");
        vm.done(&mut h);
    }
    assert_eq!(vm.counter("kvroute.requests.routed.total"), 0);
    assert_eq!(vm.counter("kvroute.requests.fallback.total"), 0);
}

#[test]
fn unconfigured_context_passes_through() {
    let fake = FakeHost::default();
    let host = Rc::new(Calls::new(Box::new(fake.clone())));
    fake.0.borrow_mut().request = vec![
        (":method".into(), "POST".into()),
        (":path".into(), "/v1/completions".into()),
    ];
    let mut h = Http::new(host, None);
    assert_eq!(h.on_http_request_headers(2, false), Action::Continue);
    assert_eq!(h.on_http_request_body(5, true), Action::Continue);
}

#[test]
fn headers_only_post_routes_at_once_as_a_parse_fallback() {
    let vm = Vm::new(NO_DISAGG);
    vm.request("POST", "/v1/chat/completions", &[]);
    let mut h = vm.http();
    assert_eq!(h.on_http_request_headers(3, true), Action::Continue);
    assert!(vm.req_header("x-kvroute-cluster").is_some());
    assert_eq!(vm.counter("kvroute.fallbacks.parse_error.total"), 1);
    assert_eq!(vm.counter("kvroute.requests.fallback.total"), 1);
}

#[test]
fn trailers_route_on_the_buffered_body() {
    let vm = Vm::new(NO_DISAGG);
    vm.request("POST", "/v1/completions", &[]);
    vm.f().request_body = br#"{"model":"m","prompt":"with trailers"}"#.to_vec();
    let mut h = vm.http();
    assert_eq!(h.on_http_request_headers(3, false), Action::Pause);
    assert_eq!(h.on_http_request_body(10, false), Action::Pause);
    assert_eq!(h.on_http_request_trailers(1), Action::Continue);
    assert_eq!(vm.counter("kvroute.requests.routed.total"), 1);
}

#[test]
fn client_sent_steering_and_handoff_headers_are_removed() {
    let vm = Vm::new(NO_DISAGG);
    let forged = [
        ("x-kvroute-cluster", "pool-evil"),
        ("x-kvroute-decode-endpoint", "6.6.6.6:1"),
        ("x-prefiller-host-port", "6.6.6.6:2"),
        ("x-kvroute-kv-transfer", "1134"),
        ("x-gateway-destination-endpoint", "6.6.6.6:3"),
        ("x-other", "kept"),
    ];
    // Also on traffic that is not routed.
    vm.request("GET", "/health", &forged);
    let mut h = vm.http();
    assert_eq!(h.on_http_request_headers(5, true), Action::Continue);
    assert_eq!(vm.req_header("x-kvroute-cluster"), None);
    assert_eq!(vm.req_header("x-kvroute-decode-endpoint"), None);
    assert_eq!(vm.req_header("x-prefiller-host-port"), None);
    assert_eq!(vm.req_header("x-kvroute-kv-transfer"), None);
    assert_eq!(vm.req_header("x-gateway-destination-endpoint"), None);
    assert_eq!(vm.req_header("x-other").as_deref(), Some("kept"));

    vm.request("POST", "/v1/completions", &forged);
    let mut h = vm.http();
    assert_eq!(h.on_http_request_headers(5, true), Action::Continue);
    assert_ne!(
        vm.req_header("x-kvroute-cluster").as_deref(),
        Some("pool-evil")
    );
    assert_eq!(vm.req_header("x-kvroute-decode-endpoint"), None);
}

#[test]
fn cluster_steering_names_the_cluster_and_asks_for_orca() {
    let vm = Vm::new(NO_DISAGG);
    let (_h, a) = vm.post("cluster mode prompt");
    assert_eq!(a, Action::Continue);
    let d = chosen(&vm);
    let want = ["pool-d0", "pool-d1"][usize::from(d)];
    assert_eq!(vm.req_header("x-kvroute-cluster").as_deref(), Some(want));
    assert_eq!(
        vm.req_header("endpoint-load-metrics-format").as_deref(),
        Some("TEXT")
    );
    assert_eq!(vm.req_header("x-gateway-destination-endpoint"), None);
}

/// The worker a request went to, read back from its per-worker decision counter.
fn chosen(vm: &Vm) -> u16 {
    if vm.counter("kvroute.worker.d0.decisions_total") > 0 {
        0
    } else {
        assert_eq!(vm.counter("kvroute.worker.d1.decisions_total"), 1);
        1
    }
}

#[test]
fn endpoint_steering_lists_the_target_then_alternates() {
    let vm = Vm::new(r#","steering":{"mode":"endpoint"},"disaggregation":{"threshold_tokens":0}"#);
    let (_h, _) = vm.post("endpoint mode prompt");
    let d = chosen(&vm);
    let (first, second) = if d == 0 {
        ("10.0.0.1:8000", "10.0.0.2:8000")
    } else {
        ("10.0.0.2:8000", "10.0.0.1:8000")
    };
    assert_eq!(
        vm.req_header("x-gateway-destination-endpoint"),
        Some(format!("{first},{second}"))
    );
    assert_eq!(vm.req_header("x-kvroute-cluster"), None);
}

/// A prompt long enough to exceed a 100-token disaggregation threshold.
fn long_prompt() -> String {
    "the quick brown fox jumps over the lazy dog ".repeat(200)
}

#[test]
fn kvroute_disaggregation_steers_to_prefill_and_names_decode() {
    let vm = Vm::new(r#","disaggregation":{"threshold_tokens":100}"#);
    let (_h, _) = vm.post(&long_prompt());
    let d = chosen(&vm);
    assert_eq!(
        vm.req_header("x-kvroute-cluster").as_deref(),
        Some("p0"),
        "steered to the prefill worker"
    );
    let decode_ep = ["10.0.0.1:8000", "10.0.0.2:8000"][usize::from(d)];
    assert_eq!(
        vm.req_header("x-kvroute-decode-endpoint").as_deref(),
        Some(decode_ep)
    );
    assert_eq!(vm.req_header("x-prefiller-host-port"), None);
    assert_eq!(vm.counter("kvroute.disagg_decisions.prefill.total"), 1);
}

#[test]
fn llm_d_disaggregation_steers_to_decode_and_names_prefiller() {
    let vm = Vm::new(r#","disaggregation":{"threshold_tokens":100,"mode":"llm-d"}"#);
    let (_h, _) = vm.post(&long_prompt());
    let d = chosen(&vm);
    assert_eq!(
        vm.req_header("x-kvroute-cluster").as_deref(),
        Some(["pool-d0", "pool-d1"][usize::from(d)])
    );
    assert_eq!(
        vm.req_header("x-prefiller-host-port").as_deref(),
        Some("10.0.1.1:8000")
    );
    assert_eq!(vm.req_header("x-kvroute-decode-endpoint"), None);
}

/// Routes one request, answers it as given and returns the failures counted on its worker.
fn failures_after(status: &str, headers: &[(&str, &str)], upstream: Option<&str>) -> i64 {
    failures_after_reply(status, headers, upstream, None)
}

/// As `failures_after`, with Envoy's `response.code_details` for the answer.
fn failures_after_reply(
    status: &str,
    headers: &[(&str, &str)],
    upstream: Option<&str>,
    details: Option<&str>,
) -> i64 {
    let vm = Vm::new(NO_DISAGG);
    if let Some(d) = details {
        vm.f()
            .properties
            .insert("response.code_details".into(), d.into());
    }
    let (mut h, _) = vm.post("classify me");
    let d = chosen(&vm);
    let ep = ["10.0.0.1:8000", "10.0.0.2:8000"][usize::from(d)];
    if let Some(up) = upstream {
        let up = if up == "same" { ep } else { up };
        vm.f()
            .properties
            .insert("upstream.address".into(), up.into());
    }
    vm.answer(&mut h, status, headers);
    vm.done(&mut h);
    assert_eq!(vm.inflight(), 0);
    vm.failures(["d0", "d1"][usize::from(d)])
}

#[test]
fn server_error_is_a_worker_failure() {
    assert_eq!(failures_after("503", &[], Some("same")), 1);
    assert_eq!(failures_after("500", &[], None), 1);
    assert_eq!(failures_after("200", &[], Some("same")), 0);
    assert_eq!(failures_after("404", &[], None), 0);
}

#[test]
fn too_many_requests_is_not_a_worker_failure() {
    assert_eq!(failures_after("429", &[], Some("same")), 0);
    let local = Some("local_rate_limited");
    assert_eq!(failures_after_reply("429", &[], None, local), 0);
}

#[test]
fn envoy_local_replies_are_not_worker_failures_but_upstream_5xx_are() {
    for d in [
        "upstream_reset_before_response_started{overflow}",
        "no_healthy_upstream",
    ] {
        assert_eq!(failures_after_reply("503", &[], None, Some(d)), 0, "{d}");
    }
    let up = Some("via_upstream");
    assert_eq!(failures_after_reply("503", &[], Some("same"), up), 1);
    let refused = Some("upstream_reset_before_response_started{connection_failure}");
    assert_eq!(failures_after_reply("503", &[], None, refused), 1);
}

/// Sets a request header to raw bytes (not expressible through `Vm::request`).
fn raw_header(vm: &Vm, name: &str, value: &[u8]) {
    let mut f = vm.f();
    f.request.retain(|(k, _)| k != name);
    f.request.push((name.to_string(), value.to_vec()));
}

#[test]
fn header_values_that_are_not_utf8_pass_through_without_routing() {
    let vm = Vm::new(NO_DISAGG);
    vm.request("POST", "/", &[("x-kvroute-kv-transfer", "99")]);
    raw_header(&vm, ":path", b"/v1/completions\xff\x80");
    let mut h = vm.http();
    assert_eq!(h.on_http_request_headers(3, false), Action::Continue);
    assert_eq!(h.on_http_request_body(5, true), Action::Continue);
    // Still stripped, and nothing routed or held.
    assert_eq!(vm.req_header("x-kvroute-kv-transfer"), None);
    assert_eq!(vm.counter("kvroute.requests.routed.total"), 0);
    vm.request("POST", "/v1/completions", &[]);
    raw_header(&vm, ":method", b"PO\xc3ST");
    let mut h = vm.http();
    assert_eq!(h.on_http_request_headers(3, false), Action::Continue);

    // A routed request whose answer carries bytes that are not UTF-8.
    let (mut h, a) = vm.post("prompt with a bad answer");
    assert_eq!(a, Action::Continue);
    vm.answer(&mut h, "200", &[]);
    {
        let mut f = vm.f();
        f.response = vec![
            (":status".into(), b"2\xff0".to_vec()),
            ("endpoint-load-metrics".into(), b"TEXT \xfe=1".to_vec()),
            ("x-envoy-attempt-count".into(), b"\x80".to_vec()),
        ];
    }
    assert_eq!(h.on_http_response_headers(3, false), Action::Continue);
    vm.done(&mut h);
    assert_eq!(vm.inflight(), 0);
    assert_eq!(vm.counter("kvroute.requests.routed.total"), 1);
}

#[test]
fn other_spellings_of_a_route_are_routed_and_forwarded_canonical() {
    let vm = Vm::new(NO_DISAGG);
    let body = br#"{"model":"m","prompt":"slashes"}"#;
    for (path, want) in [
        ("/v1/completions/", "/v1/completions"),
        ("//v1/completions?x=1", "/v1/completions?x=1"),
        ("/v1/%63hat/completions/", "/v1/chat/completions"),
    ] {
        vm.request("POST", path, &[]);
        vm.f().request_body = body.to_vec();
        let mut h = vm.http();
        assert_eq!(h.on_http_request_headers(3, false), Action::Pause, "{path}");
        assert_eq!(vm.req_header(":path").as_deref(), Some(want), "{path}");
        assert_eq!(h.on_http_request_body(body.len(), true), Action::Continue);
        assert!(vm.req_header("x-kvroute-cluster").is_some(), "{path}");
        assert_eq!(vm.inflight(), 1, "{path}: load accounted");
        vm.done(&mut h);
    }
    assert_eq!(vm.counter("kvroute.requests.routed.total"), 2);
    // The chat body is not a chat request: a parse fallback, still routed and counted.
    assert_eq!(vm.counter("kvroute.requests.fallback.total"), 1);
    // The canonical spelling is forwarded as sent.
    vm.request("POST", "/v1/completions?y=2", &[]);
    let mut h = vm.http();
    assert_eq!(h.on_http_request_headers(3, false), Action::Pause);
    assert_eq!(
        vm.req_header(":path").as_deref(),
        Some("/v1/completions?y=2")
    );
}

#[test]
fn a_retried_answer_is_a_failure_of_the_chosen_worker() {
    assert_eq!(
        failures_after("200", &[("x-envoy-attempt-count", "2")], Some("same")),
        1
    );
    assert_eq!(
        failures_after("200", &[("x-envoy-attempt-count", "1")], Some("same")),
        0
    );
}

#[test]
fn an_answer_from_another_upstream_is_a_failure() {
    assert_eq!(failures_after("200", &[], Some("10.9.9.9:8000")), 1);
}

#[test]
fn client_gone_before_any_answer_is_not_a_worker_failure() {
    let vm = Vm::new(NO_DISAGG);
    let (mut h, _) = vm.post("leaving early");
    let d = chosen(&vm);
    let name = ["d0", "d1"][usize::from(d)];
    vm.f().properties.insert(
        "response.code_details".into(),
        "downstream_remote_disconnect".into(),
    );
    vm.done(&mut h);
    assert_eq!(vm.failures(name), 0);
    assert_eq!(vm.inflight(), 0);

    // No answer because the upstream reset: the worker failed.
    let vm = Vm::new(NO_DISAGG);
    let (mut h, _) = vm.post("leaving early");
    let d = chosen(&vm);
    vm.f().properties.insert(
        "response.code_details".into(),
        "upstream_reset_before_response_started{connection_failure}".into(),
    );
    vm.done(&mut h);
    assert_eq!(vm.failures(["d0", "d1"][usize::from(d)]), 1);
}

#[test]
fn last_sse_chunk_feeds_usage() {
    let vm = Vm::new(NO_DISAGG);
    let (mut h, _) = vm.post("stream me please");
    vm.answer(&mut h, "200", &[]);
    vm.body_chunk(
        &mut h,
        b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n",
        false,
    );
    assert_eq!(vm.counter("kvroute.feedback.usage.total"), 0);
    vm.body_chunk(
        &mut h,
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n",
        false,
    );
    vm.body_chunk(&mut h, b"data: [DONE]\n\n", true);
    assert_eq!(vm.counter("kvroute.feedback.usage.total"), 1);
    assert_eq!(vm.recorded("kvroute.actual_hit_pct"), Some(50));
    vm.done(&mut h);
}

#[test]
fn a_stream_without_usage_asked_is_read_only_at_its_end() {
    let vm = Vm::new(NO_DISAGG);
    let token = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
    // The client asked for usage: every chunk may be the one carrying it.
    let (mut h, _) = vm.post_json(serde_json::json!({"model":"m","prompt":"with usage",
        "stream":true,"stream_options":{"include_usage":true}}));
    vm.answer(&mut h, "200", &[]);
    for _ in 0..3 {
        vm.body_chunk(&mut h, token, false);
    }
    assert_eq!(vm.f().response_reads, 3);
    vm.done(&mut h);

    // It did not: the tokens pass unread, and the index is still confirmed on the second.
    let (mut h, _) = vm.post_json(serde_json::json!({"model":"m","prompt":"z".repeat(400),
        "stream":true}));
    let d = h.decision().unwrap().clone();
    vm.answer(&mut h, "200", &[]);
    let before = vm.f().response_reads;
    for _ in 0..3 {
        vm.body_chunk(&mut h, token, false);
    }
    assert_eq!(vm.f().response_reads, before);
    let w = usize::from(d.decode);
    assert!(!d.hashes().is_empty());
    assert_eq!(vm.held(d.hashes())[w] as usize, d.hashes().len());
    // Usage an engine sends unasked still counts when it comes with the end.
    vm.body_chunk(
        &mut h,
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n",
        true,
    );
    assert_eq!(vm.f().response_reads, before + 1);
    assert_eq!(vm.counter("kvroute.feedback.usage.total"), 1);
    vm.done(&mut h);
}

#[test]
fn json_body_feeds_usage_at_end_of_stream() {
    let vm = Vm::new(NO_DISAGG);
    let (mut h, _) = vm.post("json body");
    vm.answer(
        &mut h,
        "200",
        &[(
            "endpoint-load-metrics",
            "TEXT named_metrics.kv_cache_usage_perc=0.25",
        )],
    );
    assert_eq!(vm.counter("kvroute.feedback.orca.total"), 1);
    vm.body_chunk(
        &mut h,
        br#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":10,"completion_tokens":2}}"#,
        true,
    );
    assert_eq!(vm.counter("kvroute.feedback.usage.total"), 1);
    // No cached_tokens reported: no actual hit to record.
    assert_eq!(vm.recorded("kvroute.actual_hit_pct"), None);
    // An empty end-of-stream callback after a body without usage feeds nothing.
    let (mut h, _) = vm.post("json body 2");
    vm.answer(&mut h, "200", &[]);
    vm.body_chunk(&mut h, br#"{"choices":[]}"#, true);
    assert_eq!(vm.counter("kvroute.feedback.usage.total"), 1);
}

#[test]
fn every_worker_busy_sheds_with_429_when_configured() {
    let vm = Vm::new(
        r#","disaggregation":{"threshold_tokens":0},"busy":{"inflight_requests":1,"reject_when_all_busy":true}"#,
    );
    let (_a, first) = vm.post("one");
    let (_b, second) = vm.post("two");
    assert_eq!((first, second), (Action::Continue, Action::Continue));
    assert!(vm.f().sent.is_empty());
    let (_c, third) = vm.post("three");
    assert_eq!(third, Action::Pause);
    let f = vm.fake.0.borrow();
    assert_eq!(f.sent.len(), 1);
    let (status, headers, body) = &f.sent[0];
    assert_eq!(*status, 429);
    assert!(headers.contains(&("retry-after".to_string(), "1".to_string())));
    assert!(String::from_utf8_lossy(body).contains("overloaded"));
    drop(f);
    assert_eq!(vm.counter("kvroute.requests.rejected.total"), 1);
    assert_eq!(vm.counter("kvroute.requests.routed.total"), 2);
}

#[test]
fn a_model_no_worker_serves_gets_404_from_the_filter() {
    let vm = Vm::new(r#","models":["m"]"#);
    let (_a, served) = vm.post("one");
    assert_eq!(served, Action::Continue);
    let (_b, other) = vm.post_json(serde_json::json!({"model":"other","prompt":"two"}));
    assert_eq!(other, Action::Pause);
    assert_eq!(vm.req_header("x-kvroute-cluster"), None);
    let f = vm.fake.0.borrow();
    let (status, _, body) = &f.sent[0];
    assert_eq!(*status, 404);
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    drop(f);
    assert_eq!(vm.counter("kvroute.requests.model_not_found.total"), 1);
    assert_eq!(vm.counter("kvroute.requests.routed.total"), 1);
    // Passed through instead: the least-loaded worker, counted as a fallback.
    let vm = Vm::new(r#","models":["m"],"unknown_model":"pass""#);
    let (_c, a) = vm.post_json(serde_json::json!({"model":"other","prompt":"two"}));
    assert_eq!(a, Action::Continue);
    assert!(vm.req_header("x-kvroute-cluster").is_some());
    assert_eq!(vm.counter("kvroute.fallbacks.unknown_model.total"), 1);
    assert_eq!(vm.counter("kvroute.requests.model_not_found.total"), 0);
}

#[test]
fn busy_workers_are_still_used_when_shedding_is_off() {
    let vm = Vm::new(r#","disaggregation":{"threshold_tokens":0},"busy":{"inflight_requests":1}"#);
    for p in ["one", "two", "three"] {
        assert_eq!(vm.post(p).1, Action::Continue);
    }
    assert!(vm.f().sent.is_empty());
    assert_eq!(vm.counter("kvroute.requests.rejected.total"), 0);
}

#[test]
fn failed_host_calls_are_counted() {
    let vm = Vm::new(NO_DISAGG);
    assert_eq!(vm.counter("kvroute.host_errors.total"), 0);
    vm.f().failing.push("set_header");
    let (_h, a) = vm.post("errors");
    assert_eq!(a, Action::Continue);
    // The three request headers (steering, ORCA, per-try bound) failed; no header to strip
    // was sent.
    assert_eq!(vm.counter("kvroute.host_errors.total"), 3);
    assert_eq!(vm.req_header("x-kvroute-cluster"), None);
    vm.f().failing.clear();
    let (mut h, _) = vm.post("errors");
    assert_eq!(vm.counter("kvroute.host_errors.total"), 3);
    vm.f().failing = vec!["property", "header", "headers"];
    vm.answer(&mut h, "200", &[]);
    // The header map, then (one by one) :status, the ORCA header, the attempt count, and
    // the upstream address (the code details are read only for a 5xx).
    assert_eq!(vm.counter("kvroute.host_errors.total"), 8);
    // An unreadable :method passes the request through.
    vm.request("POST", "/v1/completions", &[]);
    let mut h = vm.http();
    assert_eq!(h.on_http_request_headers(2, false), Action::Continue);
    assert_eq!(vm.counter("kvroute.host_errors.total"), 11);
}

#[test]
fn debug_headers_show_the_decision_on_the_response() {
    let vm = Vm::new(r#","debug_headers":true,"disaggregation":{"threshold_tokens":0}"#);
    let (mut h, _) = vm.post("debug me");
    let d = chosen(&vm);
    vm.answer(&mut h, "200", &[]);
    assert_eq!(
        vm.resp_header("x-kvroute-worker").as_deref(),
        Some(["d0", "d1"][usize::from(d)])
    );
    assert!(vm.resp_header("x-kvroute-prompt-tokens").is_some());
    assert_eq!(vm.resp_header("x-kvroute-fallback"), None);
    let costs = vm.resp_header("x-kvroute-costs").unwrap_or_default();
    assert!(
        costs.starts_with("d0 cost=") && costs.contains("; d1 cost="),
        "{costs}"
    );

    let vm = Vm::new(NO_DISAGG);
    let (mut h, _) = vm.post("no debug");
    vm.answer(&mut h, "200", &[]);
    assert_eq!(vm.resp_header("x-kvroute-worker"), None);
    assert_eq!(vm.resp_header("x-kvroute-costs"), None);
}

#[test]
fn root_configures_from_the_plugin_configuration() {
    let fake = FakeHost::default();
    let host = Rc::new(Calls::new(Box::new(fake.clone())));
    let mut root = Root::new(host, |_| Box::new(MemoryBus::default()));
    fake.0.borrow_mut().plugin_config = br#"{"workers":[]}"#.to_vec();
    assert!(!root.on_configure(0), "an invalid configuration is refused");
    assert!(fake
        .0
        .borrow()
        .logs
        .iter()
        .any(|(l, _)| *l == LogLevel::Error));
    fake.0.borrow_mut().plugin_config = br#"{"workers":[{"name":"w"}]}"#.to_vec();
    assert!(root.on_configure(0));
    let f = fake.0.borrow();
    assert!(f
        .metrics
        .iter()
        .any(|m| m.0 == "kvroute.worker.w.decisions_total"));
    assert!(f
        .logs
        .iter()
        .any(|(_, m)| m.contains("configured 1 workers")));
}

/// One in-memory bus seen by several VMs of a simulated Envoy process. With a key suffix,
/// this VM's first read of such a key comes before another VM's write: the interleaving of
/// two threads starting together.
struct Process(Rc<MemoryBus>, Option<(&'static str, std::cell::Cell<bool>)>);

impl SharedBus for Process {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        if let Some((suffix, read)) = &self.1 {
            if key.ends_with(suffix) && !read.replace(true) {
                return (None, None);
            }
        }
        self.0.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        self.0.set(key, value, cas)
    }
    fn register_queue(&self, name: &str) -> Option<u32> {
        self.0.register_queue(name)
    }
    fn resolve_queue(&self, name: &str) -> Option<u32> {
        self.0.resolve_queue(name)
    }
    fn enqueue(&self, queue: u32, msg: &[u8]) -> bool {
        self.0.enqueue(queue, msg)
    }
    fn dequeue(&self, queue: u32) -> Option<Vec<u8>> {
        self.0.dequeue(queue)
    }
}

/// Two VMs of one Envoy process (one bus), configured alike.
fn two_vms(extra: &str) -> (Rc<MemoryBus>, Vm, Vm) {
    let bus = Rc::new(MemoryBus::default());
    let a = Vm::with_bus(extra, Box::new(Process(Rc::clone(&bus), None)));
    let b = Vm::with_bus(extra, Box::new(Process(Rc::clone(&bus), None)));
    (bus, a, b)
}

/// Past the first timer (housekeeping, peers known) and serving.
fn serve(vms: &[&Vm]) {
    for vm in vms {
        vm.state.borrow_mut().on_timer();
        vm.state.borrow_mut().start_serving();
    }
}

#[test]
fn decisions_leave_after_the_callback_and_wait_until_the_peer_routes() {
    let (bus, a, b) = two_vms(NO_DISAGG);
    // a's first timer runs housekeeping: a learns of b, which wants messages at once.
    a.state.borrow_mut().on_timer();
    let (_h, _) = a.post("replicate me");
    assert_eq!((a.inflight(), b.inflight()), (1, 0));
    // Nothing was sent inside the request callback: the event waits for a's timer, cut to
    // 1 ms so it fires after Envoy wrote the request upstream. A message a sent itself would
    // run before that write, so none is sent.
    assert_eq!(a.counter("kvroute.replication.sent.total"), 0);
    assert_eq!(a.f().tick_periods, [1]);
    assert_eq!(bus.dequeue(0), None, "no self-addressed wake-up");
    a.f().now_ns += 1_000_000;
    a.state.borrow_mut().on_timer();
    assert_eq!(a.counter("kvroute.replication.sent.total"), 1);
    // The timer is back on the rest of the housekeeping period; a second decision shortens
    // it again, once.
    assert_eq!(a.f().tick_periods, [1, 249]);
    let (_h2, _) = a.post("and me");
    let (_h3, _) = a.post("and me too");
    assert_eq!(a.f().tick_periods, [1, 249, 1]);
    a.f().now_ns += 1_000_000;
    a.state.borrow_mut().on_timer();
    assert_eq!(a.counter("kvroute.replication.sent.total"), 3);
    assert_eq!(a.f().tick_periods, [1, 249, 1, 248]);
    // When the period is over, housekeeping runs and the full period is back.
    a.f().now_ns += 248_000_000;
    a.state.borrow_mut().on_timer();
    assert_eq!(a.f().tick_periods, [1, 249, 1, 248, 250]);
    // b has not routed yet: a sends it its messages in batches, on a's ticks.
    b.state.borrow_mut().drain();
    assert_eq!(b.counter("kvroute.replication.received.total"), 0);
    a.state.borrow_mut().tick();
    // And b keeps them raw until it routes.
    b.state.borrow_mut().drain();
    assert_eq!(b.inflight(), 0);
    b.state.borrow_mut().start_serving();
    assert_eq!(b.inflight(), 3);
    assert_eq!(b.counter("kvroute.replication.received.total"), 3);
}

#[test]
fn a_thread_charges_the_others_picks_before_their_events_arrive() {
    let (_bus, a, b) = two_vms(NO_DISAGG);
    serve(&[&a, &b]);
    // Two requests of one burst, one on each thread, before either event left.
    let (_ha, _) = a.post("the first of a burst");
    assert_eq!(a.counter("kvroute.replication.sent.total"), 0);
    let (_hb, _) = b.post("the second of a burst");
    assert_eq!(b.inflight(), 2, "b charged a's pick from the shared record");
    assert_eq!(b.counter("kvroute.replication.peer_picks.total"), 1);
    // The events arrive: a's replaces b's provisional charge instead of doubling it.
    for vm in [&a, &b] {
        vm.f().now_ns += 1_000_000;
        vm.state.borrow_mut().on_timer();
    }
    for vm in [&a, &b] {
        vm.state.borrow_mut().drain();
    }
    assert_eq!((a.inflight(), b.inflight()), (2, 2));
    // A single VM (no peer) never touches the record.
    let solo = Vm::new(NO_DISAGG);
    let (_h, _) = solo.post("alone");
    assert_eq!(solo.counter("kvroute.replication.peer_picks.total"), 0);
}

#[test]
fn a_finished_request_is_not_in_flight_where_the_next_one_lands() {
    let (_bus, a, b) = two_vms(NO_DISAGG);
    serve(&[&a, &b]);
    // A client's request ends on a; its next one reaches b before a's timer sent any event
    // (a CPU-starved Envoy): the shared record says the first one is over.
    let (mut h, _) = a.post("one conversation");
    a.answer(&mut h, "200", &[]);
    a.body_chunk(&mut h, b"{}", true);
    a.done(&mut h);
    assert_eq!(a.inflight(), 0);
    let (mut h2, _) = b.post("one conversation, next turn");
    assert_eq!(b.counter("kvroute.replication.received.total"), 0);
    assert_eq!(b.inflight(), 1, "only its own: a's request ended");
    assert_eq!(b.counter("kvroute.replication.peer_picks.total"), 0);

    // b's request is charged on a, provisionally, while it runs; its end releases it there
    // at a's next decision, still before any event arrived.
    let (_h3, _) = a.post("something else");
    assert_eq!(a.inflight(), 2, "a's own and b's running one");
    b.answer(&mut h2, "200", &[]);
    b.body_chunk(&mut h2, b"{}", true);
    b.done(&mut h2);
    let (_h4, _) = a.post("and more");
    assert_eq!(a.inflight(), 2, "a's two, not b's ended one");
    assert_eq!(a.counter("kvroute.replication.received.total"), 0);
}

#[test]
fn a_host_that_refuses_the_short_timer_gets_a_queue_wake_up() {
    let (bus, a, _b) = two_vms(NO_DISAGG);
    a.state.borrow_mut().on_timer();
    a.f().failing.push("set_tick_period");
    let (_h, _) = a.post("replicate me");
    assert_eq!(bus.dequeue(0), Some(Vec::new()), "a woke itself instead");
    a.state.borrow_mut().drain();
    assert_eq!(a.counter("kvroute.replication.sent.total"), 1);
}

#[test]
fn idle_ticks_make_no_host_errors() {
    // Envoy refuses a zero counter increment; a tick with nothing expired must not try one.
    let vm = Vm::new(NO_DISAGG);
    let (mut h, _) = vm.post("tick");
    vm.answer(&mut h, "200", &[]);
    for _ in 0..8 {
        vm.f().now_ns += 250_000_000;
        vm.state.borrow_mut().tick();
    }
    assert_eq!(vm.counter("kvroute.host_errors.total"), 0);
    // A routing VM publishes its index gauges, the hash-flood give-ups among them.
    assert_eq!(vm.recorded("kvroute.index_probe_giveups"), Some(0));
    assert!(vm.recorded("kvroute.index_blocks").is_some());
}

#[test]
fn a_dead_peers_requests_are_released_by_the_survivors() {
    let (_bus, a, b) = two_vms(NO_DISAGG);
    a.state.borrow_mut().start_serving();
    let (_mine, _) = a.post("a's own request");
    let (_h1, _) = b.post("in flight when b crashes");
    let (_h2, _) = b.post("also in flight");
    b.state.borrow_mut().drain();
    a.state.borrow_mut().drain();
    assert_eq!(a.inflight(), 3, "a holds b's two requests and its own");
    // b crashes: no more heartbeats, no ends for its requests. One tick within stale_ms
    // keeps them; the first tick after it releases them (not the 600 s TTL).
    a.f().now_ns += 1_000_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.inflight(), 3);
    a.f().now_ns += 1_500_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.inflight(), 1, "only a's own request is left");
    assert_eq!(a.counter("kvroute.expired_requests.total"), 2);
}

thread_local! {
    static SHARED: Rc<MemoryBus> = Rc::new(MemoryBus::default());
}

/// A root over the thread's shared bus, configured with `workers` as plugin `kv`.
fn root_with(workers: &str) -> (FakeHost, Root) {
    let fake = FakeHost::default();
    let host = Rc::new(Calls::new(Box::new(fake.clone())));
    let mut root = Root::new(host, |_| Box::new(Process(SHARED.with(Rc::clone), None)));
    {
        let mut f = fake.0.borrow_mut();
        f.plugin_config = format!(r#"{{"workers":{workers}}}"#).into_bytes();
        f.properties.insert("plugin_name".into(), "kv".into());
    }
    assert!(root.on_configure(0));
    (fake, root)
}

#[test]
fn vms_of_a_reordered_configuration_never_join_the_old_ones() {
    let old = r#"[{"name":"x"},{"name":"y"}]"#;
    let reordered = r#"[{"name":"y"},{"name":"x"}]"#;
    let (fa, mut a) = root_with(old);
    let (fb, mut b) = root_with(reordered);
    let (fc, mut c) = root_with(old);
    for r in [&mut a, &mut b, &mut c] {
        r.on_tick();
    }
    let peers = |f: &FakeHost| {
        let f = f.0.borrow();
        let m = f
            .metrics
            .iter()
            .find(|m| m.0 == "kvroute.replication_peers");
        m.and_then(|m| m.3)
    };
    // Worker 0 is x for a and c, y for b: b must not hear a's or c's events.
    assert_eq!(peers(&fa), Some(1));
    assert_eq!(peers(&fc), Some(1));
    assert_eq!(peers(&fb), Some(0));
}

const POLL: &str =
    r#","disaggregation":{"threshold_tokens":0},"metrics":{"poll_ms":500,"cluster_suffix":"-m"}"#;

const LLAMA_METRICS: &str = "# TYPE llamacpp:requests_processing gauge\n\
    llamacpp:requests_processing 3\nllamacpp:requests_deferred 2\n";

impl Vm {
    /// Sets what the next `on_http_call_response` reads: a status and body, or no answer at
    /// all (`None`); returns its (headers, body size).
    fn set_call_answer(&self, answer: Option<(&str, &str)>) -> (usize, usize) {
        let mut f = self.f();
        match answer {
            Some((status, body)) => {
                f.call_headers = vec![(":status".into(), status.into())];
                f.call_body = body.as_bytes().to_vec();
                (1, body.len())
            }
            None => {
                f.call_headers.clear();
                f.call_body.clear();
                (0, 0)
            }
        }
    }

    /// Answers the scrape with `token`.
    fn scrape_answer(&self, token: u32, answer: Option<(&str, &str)>) {
        let (n, size) = self.set_call_answer(answer);
        self.state.borrow_mut().on_scrape(token, n, size);
    }

    fn calls(&self) -> Vec<(u32, String)> {
        self.f().calls.iter().map(|c| (c.0, c.1.clone())).collect()
    }

    fn waiting(&self, w: u16) -> Option<u32> {
        let now = self.host.now_ms();
        let s = self.state.borrow();
        s.router.worker_view(w, now).report.map(|r| r.waiting)
    }
}

#[test]
fn one_vm_scrapes_engine_metrics_and_replicates_the_load() {
    let (_bus, a, b) = two_vms(POLL);
    b.state.borrow_mut().start_serving();
    // The first poll only claims the lease (the key is new); the next one holds it.
    a.state.borrow_mut().tick();
    b.state.borrow_mut().tick();
    assert!(a.calls().is_empty() && b.calls().is_empty());
    for vm in [&a, &b] {
        vm.f().now_ns += 500_000_000;
        vm.state.borrow_mut().tick();
    }
    let calls = a.calls();
    assert_eq!(
        calls.iter().map(|c| c.1.as_str()).collect::<Vec<_>>(),
        ["pool-d0-m", "pool-d1-m", "p0-m"]
    );
    assert!(b.calls().is_empty(), "a holds the lease");
    let f = a.f();
    let h = &f.calls[0].2;
    assert!(h.contains(&(":path".into(), "/metrics".into())));
    assert!(h.contains(&(":method".into(), "GET".into())));
    drop(f);

    a.f().now_ns += 3_000_000;
    a.scrape_answer(calls[0].0, Some(("200", LLAMA_METRICS)));
    assert_eq!(a.waiting(0), Some(2));
    assert_eq!(a.counter("kvroute.feedback.metrics.total"), 1);
    assert_eq!(a.recorded("kvroute.metrics_scrape_us"), Some(3000));
    a.state.borrow_mut().drain();
    b.state.borrow_mut().drain();
    assert_eq!(b.waiting(0), Some(2), "the report reached the other VM");

    // Failures: no answer, an error status, a page without load metrics; logged once.
    a.scrape_answer(calls[1].0, None);
    a.scrape_answer(calls[2].0, Some(("503", LLAMA_METRICS)));
    a.scrape_answer(calls[2].0, Some(("200", LLAMA_METRICS)));
    assert_eq!(a.counter("kvroute.feedback.metrics_error.total"), 2);
    assert_eq!(a.counter("kvroute.worker.d1.scrape_errors_total"), 1);
    assert_eq!(a.waiting(1), None);

    // The next poll skips nothing (all answered) and reads a body of another engine.
    a.f().now_ns += 500_000_000;
    a.state.borrow_mut().tick();
    let next = a.calls();
    assert_eq!(next.len(), 6);
    a.scrape_answer(next[4].0, Some(("200", "<html>not here</html>")));
    a.scrape_answer(next[4].0, Some(("200", LLAMA_METRICS)));
    assert_eq!(a.counter("kvroute.worker.d1.scrape_errors_total"), 2);
    let warns = a
        .f()
        .logs
        .iter()
        .filter(|(l, m)| *l == LogLevel::Warn && m.contains("worker d1"))
        .count();
    assert_eq!(warns, 1, "a worker that keeps failing is logged once");

    // a stops renewing its lease (its thread went away): b takes over.
    b.f().now_ns += 2_100_000_000;
    b.state.borrow_mut().tick();
    assert_eq!(b.calls().len(), 3);
}

#[test]
fn scrapes_are_bounded_and_off_by_default() {
    let off = Vm::new(NO_DISAGG);
    off.state.borrow_mut().tick();
    assert!(off.calls().is_empty());

    let a = Vm::new(POLL);
    a.state.borrow_mut().tick();
    a.f().now_ns += 500_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.calls().len(), 3);
    // Unanswered calls are not repeated while they are in flight...
    a.f().now_ns += 500_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.calls().len(), 3);
    // ... and are given up (counted) once the host should long have answered.
    a.f().now_ns += 3_000_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.counter("kvroute.feedback.metrics_error.total"), 3);
    assert_eq!(a.calls().len(), 6);
    // A call the host refuses is an error too, not a panic.
    a.f().failing.push("http_call");
    a.f().now_ns += 3_500_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.counter("kvroute.feedback.metrics_error.total"), 9);
    assert_eq!(a.calls().len(), 6);
}

const PRECISE: &str = r#","disaggregation":{"threshold_tokens":0},"relay":{"cluster":"relay"}"#;

impl Vm {
    fn relay_update(&self, token: u32, u: &crate::precise::wire::Update) {
        use prost::Message;
        self.f().grpc_message = u.encode_to_vec();
        let n = self.f().grpc_message.len();
        self.state.borrow_mut().on_relay_message(token, n);
    }

    fn held(&self, hashes: &[u64]) -> Vec<u32> {
        let now = self.host.now_ms();
        let mut out = vec![0u32; 3];
        self.state
            .borrow()
            .router
            .held_blocks(hashes, now, &mut out);
        out
    }
}

fn relay_update(
    seq: u64,
    phase: crate::precise::wire::Phase,
    deltas: &[(&str, bool, &[u64], &[u64])],
) -> crate::precise::wire::Update {
    crate::precise::wire::Update {
        seq,
        epoch: 1,
        phase: phase as i32,
        workers: deltas
            .iter()
            .map(|(w, c, s, r)| crate::precise::wire::WorkerDelta {
                worker: (*w).into(),
                cleared: *c,
                stored: s.to_vec(),
                removed: r.to_vec(),
                stale: false,
            })
            .collect(),
        sent_unix_ns: 900_000_000,
        ..Default::default()
    }
}

#[test]
fn the_relay_token_comes_from_the_vm_environment_and_a_refusal_says_so() {
    let (_bus, a, _b) = two_vms(PRECISE);
    a.f().env.insert(
        "KVROUTE_RELAY_TOKEN".into(),
        "secret-token-0123456789".into(),
    );
    a.state.borrow_mut().start_serving();
    for _ in 0..2 {
        a.state.borrow_mut().tick();
    }
    assert_eq!(a.f().grpc_opened.len(), 1);
    assert_eq!(
        a.f().grpc_metadata[0],
        vec![(
            "authorization".to_string(),
            b"Bearer secret-token-0123456789".to_vec()
        )]
    );
    a.state.borrow_mut().on_relay_close(500, 16);
    let logs = a.f().logs.clone();
    let refusal: Vec<_> = logs
        .iter()
        .filter(|(l, m)| *l == LogLevel::Warn && m.contains("UNAUTHENTICATED"))
        .collect();
    assert_eq!(refusal.len(), 1, "{logs:?}");
    assert!(refusal[0]
        .1
        .contains("holds another token than the relay's"));
    assert!(refusal[0].1.contains("routing on predictions"));
    assert!(
        logs.iter().all(|(_, m)| !m.contains("secret-token")),
        "the token is never logged"
    );
    // Without the variable: no metadata, and the refusal names what is missing.
    a.f().env.clear();
    a.f().now_ns += 1_000_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.f().grpc_opened.len(), 2);
    assert!(a.f().grpc_metadata[1].is_empty());
    a.state.borrow_mut().on_relay_close(501, 16);
    assert_eq!(a.counter("kvroute.precise.stream_failures.total"), 2);
    assert!(
        a.f().logs.iter().all(|(_, m)| !m.contains("has none")),
        "logged once per VM"
    );
    // A token that is not a header value is not sent (and the stream is not opened).
    a.f()
        .env
        .insert("KVROUTE_RELAY_TOKEN".into(), "two words".into());
    a.f().now_ns += 1_000_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.f().grpc_opened.len(), 2);
    assert_eq!(a.counter("kvroute.precise.stream_failures.total"), 3);
}

#[test]
fn one_vm_holds_the_relay_stream_and_every_vm_follows_the_engines() {
    use crate::precise::wire::{Phase, WatchRequest};
    use prost::Message;
    let (_bus, a, b) = two_vms(PRECISE);
    a.state.borrow_mut().start_serving();
    b.state.borrow_mut().start_serving();
    // a claims the new lease on its first tick and opens the stream on its second; b never
    // does while a renews it.
    for _ in 0..2 {
        a.state.borrow_mut().tick();
        b.state.borrow_mut().tick();
    }
    let opened = a.f().grpc_opened.clone();
    assert_eq!(
        opened,
        vec![(500, "relay".into(), "kvroute.relay.v1.Relay/Watch".into())]
    );
    assert!(b.f().grpc_opened.is_empty(), "a holds the lease");
    let (tok, msg, end) = a.f().grpc_sent[0].clone();
    assert_eq!((tok, end), (500, false), "kept open to share decisions");
    let req = WatchRequest::decode(msg.as_slice()).unwrap();
    assert_eq!(req.block_size, 16);
    assert!(req.gateway.starts_with("kvroute-"), "{}", req.gateway);
    assert_eq!(req.group, "kvroute");

    // Before the snapshot: predictions. A pick confirmed on d0 is held.
    let (mut h, _) = a.post(&"x".repeat(400));
    a.answer(&mut h, "200", &[]);
    a.body_chunk(&mut h, b"{}", true);
    let d = h.decision().unwrap().clone();
    a.done(&mut h);
    let w = usize::from(d.decode);
    let hashes = d.hashes().to_vec();
    assert_eq!(a.held(&hashes)[w] as usize, hashes.len());

    // The snapshot says the engine of that worker holds only the first block, and the other
    // decode worker holds all of them.
    let other = if w == 0 { "d1" } else { "d0" };
    let mine = if w == 0 { "d0" } else { "d1" };
    a.relay_update(
        500,
        &relay_update(1, Phase::Snapshot, &[(mine, true, &hashes[..1], &[])]),
    );
    a.relay_update(
        500,
        &relay_update(
            2,
            Phase::SnapshotEnd,
            &[(other, true, &hashes, &[]), ("nobody", true, &[], &[])],
        ),
    );
    assert_eq!(a.counter("kvroute.precise.updates.total"), 2);
    assert_eq!(a.counter("kvroute.precise.unknown_workers.total"), 1);
    assert_eq!(a.recorded("kvroute.precise.fed_workers"), Some(2));
    assert_eq!(a.recorded("kvroute.precise.event_delay_us"), Some(100_000));
    a.state.borrow_mut().drain();
    b.state.borrow_mut().drain();
    for vm in [&a, &b] {
        let held = vm.held(&hashes);
        let s = vm.state.borrow();
        assert!(s.router.engine_fed(0) && s.router.engine_fed(1));
        assert!(!s.router.engine_fed(2), "p0 is not in the snapshot");
        assert_eq!(held[1 - w] as usize, hashes.len());
        assert_eq!(s.router.index().entries(d.decode), 1);
    }

    // A gap: the stream is dropped, every worker falls back, and it is reopened later.
    a.relay_update(500, &relay_update(4, Phase::Live, &[]));
    assert_eq!(a.f().grpc_cancelled, vec![500]);
    assert_eq!(a.counter("kvroute.precise.stream_failures.total"), 1);
    assert!(!a.state.borrow().router.engine_fed(0));
    a.state.borrow_mut().drain();
    b.state.borrow_mut().drain();
    assert!(!b.state.borrow().router.engine_fed(0));
    a.f().now_ns += 300_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.f().grpc_opened.len(), 2);
    // The relay closing the new stream is a failure too; backoff doubles.
    a.state.borrow_mut().on_relay_close(501, 14);
    assert_eq!(a.counter("kvroute.precise.stream_failures.total"), 2);
    a.f().now_ns += 300_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(
        a.f().grpc_opened.len(),
        2,
        "waits 500 ms after the second failure"
    );
    a.f().now_ns += 300_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.f().grpc_opened.len(), 3);
    let warns = a
        .f()
        .logs
        .iter()
        .filter(|(l, m)| *l == LogLevel::Warn && m.contains("routing on predictions"))
        .count();
    assert_eq!(warns, 1, "a relay that stays down is logged once");
}

#[test]
fn vms_starting_together_open_one_relay_stream_and_a_handover_keeps_the_gauge_true() {
    use crate::precise::wire::Phase;
    let bus = Rc::new(MemoryBus::default());
    let racy = || {
        Box::new(Process(
            Rc::clone(&bus),
            Some(("/relay-stream", Default::default())),
        ))
    };
    let a = Vm::with_bus(PRECISE, racy());
    let b = Vm::with_bus(PRECISE, racy());
    // Both see no lease and both create it: Envoy checks no CAS on a new key.
    for _ in 0..3 {
        a.state.borrow_mut().tick();
        b.state.borrow_mut().tick();
    }
    let streams = a.f().grpc_opened.len() + b.f().grpc_opened.len();
    assert_eq!(streams, 1, "one stream per process");
    assert_eq!(b.f().grpc_opened.len(), 1, "the last writer holds it");
    b.relay_update(
        500,
        &relay_update(1, Phase::SnapshotEnd, &[("d0", true, &[], &[])]),
    );
    assert_eq!(b.recorded("kvroute.precise.stream_live"), Some(1));

    // b's thread stalls past its lease: a takes over, then b wakes and hands over. The
    // gauge is one per process: b must not zero it under a's stream.
    a.f().now_ns += 3_500_000_000;
    a.state.borrow_mut().tick();
    assert_eq!(a.f().grpc_opened.len(), 1);
    a.state.borrow_mut().tick();
    assert_eq!(
        a.recorded("kvroute.precise.stream_live"),
        Some(0),
        "not live yet"
    );
    b.f().now_ns += 3_500_000_000;
    b.state.borrow_mut().tick();
    assert_eq!(b.f().grpc_cancelled, vec![500]);
    assert_eq!(b.recorded("kvroute.precise.stream_live"), Some(1));
    assert_eq!(b.counter("kvroute.precise.stream_failures.total"), 0);
    let tok = a.f().grpc_opened[0].0;
    a.relay_update(
        tok,
        &relay_update(1, Phase::SnapshotEnd, &[("d0", true, &[], &[])]),
    );
    a.state.borrow_mut().tick();
    assert_eq!(a.recorded("kvroute.precise.stream_live"), Some(1));
    assert_eq!(a.recorded("kvroute.precise.fed_workers"), Some(1));
}

#[test]
fn precise_mode_is_off_without_a_cluster_and_an_unknown_cluster_is_not_fatal() {
    let off = Vm::new(NO_DISAGG);
    off.state.borrow_mut().tick();
    assert!(off.f().grpc_opened.is_empty());
    let a = Vm::new(PRECISE);
    a.f().failing.push("grpc_open");
    a.state.borrow_mut().tick();
    a.state.borrow_mut().tick();
    assert_eq!(a.counter("kvroute.precise.stream_failures.total"), 1);
    let (h, _) = a.post("still routes");
    assert!(h.decision().is_some());
}

const TOKENIZE: &str =
    r#","disaggregation":{"threshold_tokens":0},"tokenize":{"cluster":"pool-d0","timeout_ms":50}"#;

impl Vm {
    /// Answers the HTTP call `token` of context `h` (None: no answer, a timeout).
    fn call_answer(&self, h: &mut Http, token: u32, answer: Option<(&str, &str)>) {
        let (n, size) = self.set_call_answer(answer);
        h.on_http_call_response(token, n, size, 0);
    }
}

#[test]
fn text_prompts_route_at_once_and_tokenize_teaches_every_vm_the_engine_blocks() {
    use crate::precise::wire::Phase;
    let cfg = format!(
        "{PRECISE}{}",
        &TOKENIZE[TOKENIZE.find(",\"tokenize\"").unwrap()..]
    );
    let (_bus, a, b) = two_vms(&cfg);
    for vm in [&a, &b] {
        vm.state.borrow_mut().start_serving();
    }
    for _ in 0..2 {
        a.state.borrow_mut().tick();
        b.state.borrow_mut().tick();
    }
    // No worker engine-fed yet: nothing to learn, no call.
    let text = "lorem ipsum dolor ".repeat(120);
    let (mut h0, action) = a.post(&text);
    assert_eq!(action, Action::Continue);
    assert!(h0.decision().is_some());
    assert!(a.f().calls.is_empty());
    a.done(&mut h0);
    a.relay_update(
        500,
        &relay_update(
            1,
            Phase::SnapshotEnd,
            &[("d0", true, &[], &[]), ("d1", true, &[], &[])],
        ),
    );
    a.state.borrow_mut().drain();
    b.state.borrow_mut().drain();

    // Routed on the text at once; the tokenize call goes out beside it.
    let (mut h, action) = a.post(&text);
    assert_eq!(action, Action::Continue, "never waits for the tokenizer");
    let d = h.decision().expect("routed").clone();
    assert!(!d.exact_tokens);
    let (token, cluster, headers) = a.f().calls[0].clone();
    assert_eq!(cluster, "pool-d0");
    assert!(headers.contains(&(":path".into(), "/tokenize".into())));
    let sent: serde_json::Value =
        serde_json::from_slice(a.f().call_bodies[0].as_ref().unwrap()).unwrap();
    assert_eq!(sent, serde_json::json!({"model":"m","prompt": text}));
    a.f().now_ns += 2_000_000;
    let ids: Vec<u32> = (0..540).collect();
    let answer = serde_json::json!({"count": 540, "tokens": ids}).to_string();
    a.call_answer(&mut h, token, Some(("200", &answer)));
    a.done(&mut h);
    assert_eq!(a.counter("kvroute.tokenize.ok.total"), 1);
    assert_eq!(a.recorded("kvroute.tokenize_us"), Some(2000));
    let n = d.hashes().len();
    assert!(n > 20, "{n} text blocks");
    assert_eq!(a.recorded("kvroute.precise.text_blocks"), Some(n as u64));
    // The engine's own blocks of those ids, as the relay re-keys them.
    let tok_blocks = {
        let body = serde_json::json!({"model":"m","prompt": ids}).to_string();
        let req =
            crate::request::parse(crate::request::ApiKind::Completions, body.as_bytes()).unwrap();
        crate::hashing::prompt_hashes(&req, &crate::hashing::HashParams::default()).blocks
    };
    // d1's engine reports holding the whole prompt (as a client sending token ids, or
    // another gateway, put it there): the next text prompt sharing it sees d1 holding it,
    // on both VMs.
    a.relay_update(
        500,
        &relay_update(2, Phase::Live, &[("d1", false, &tok_blocks, &[])]),
    );
    a.state.borrow_mut().drain();
    b.state.borrow_mut().drain();
    for vm in [&a, &b] {
        assert_eq!(
            vm.held(d.hashes())[1],
            0,
            "the index holds token blocks only"
        );
        let next = format!("{text} and a new question");
        let (h2, _) = vm.post(&next);
        let d2 = h2.decision().unwrap();
        assert_eq!(d2.decode, 1, "the engine-reported holder wins");
        assert!(d2.overlap_tokens > 0);
    }
    // Learned prompts ask no more (only their last block is new).
    let calls = a.f().calls.len();
    let (_h, _) = a.post(&text);
    assert_eq!(a.f().calls.len(), calls);

    // A failed or missing answer is counted and changes nothing for the request.
    let (mut h, _) = a.post(&"other words entirely ".repeat(80));
    let token = a.f().calls.last().unwrap().0;
    a.call_answer(&mut h, token, Some(("503", "{}")));
    assert_eq!(a.counter("kvroute.tokenize.failed.total"), 1);
    a.f().failing.push("http_call");
    let (h, action) = a.post(&"refused call ".repeat(80));
    assert_eq!(action, Action::Continue);
    assert!(h.decision().is_some());
    assert_eq!(a.counter("kvroute.tokenize.failed.total"), 2);
}

/// Two gateways (Envoy processes): separate buses, each one VM holding its relay stream, live.
fn two_gateways(cfg: &str) -> (Vm, Vm) {
    let vm = || Vm::with_bus(cfg, Box::new(Process(Rc::new(MemoryBus::default()), None)));
    let (a, b) = (vm(), vm());
    for vm in [&a, &b] {
        vm.state.borrow_mut().start_serving();
        vm.state.borrow_mut().tick();
        vm.state.borrow_mut().tick();
        vm.relay_update(
            500,
            &relay_update(1, crate::precise::wire::Phase::SnapshotEnd, &[]),
        );
    }
    (a, b)
}

/// The name a gateway gave itself in its watch request.
fn gateway_name(vm: &Vm) -> String {
    use prost::Message;
    crate::precise::wire::WatchRequest::decode(vm.f().grpc_sent[0].1.as_slice())
        .unwrap()
        .gateway
}

#[test]
fn gateways_share_decisions_through_the_relay_and_release_a_gone_ones_load() {
    use crate::precise::wire::{PeerDecisions, Phase, WatchRequest};
    use prost::Message;
    let (a, b) = two_gateways(PRECISE);
    let (name_a, name_b) = (gateway_name(&a), gateway_name(&b));
    assert_ne!(name_a, name_b, "each process names itself");

    // A routes and confirms a long prompt; its decisions go to its relay.
    let prompt = "y".repeat(600);
    let (mut h, _) = a.post(&prompt);
    a.answer(&mut h, "200", &[]);
    a.body_chunk(&mut h, b"{}", false);
    a.state.borrow_mut().drain();
    let target = h.decision().unwrap().decode;
    let decisions: Vec<Vec<u8>> = a
        .f()
        .grpc_sent
        .iter()
        .skip(1)
        .flat_map(|(_, m, end)| {
            assert!(!end);
            WatchRequest::decode(m.as_slice()).unwrap().decisions
        })
        .collect();
    assert!(!decisions.is_empty());
    assert!(a.counter("kvroute.peers.sent.total") >= 1);

    // B's relay hands them over: B charges the load and knows the prompt's blocks.
    let mut u = relay_update(2, Phase::Live, &[]);
    u.peers = vec![PeerDecisions {
        gateway: name_a.clone(),
        decisions,
        sent_unix_ns: 999_000_000,
    }];
    b.relay_update(500, &u);
    assert!(b.counter("kvroute.peers.received.total") >= 2);
    assert_eq!(b.recorded("kvroute.peers.delay_us"), Some(1_000));
    assert_eq!(b.inflight(), 1, "A's request is charged on B");
    let (hb, _) = b.post(&prompt);
    assert_eq!(hb.decision().unwrap().decode, target, "B follows A's cache");
    // B's own decision is not sent back as A's.
    assert!(b.counter("kvroute.peers.received.total") < 10);

    // A is gone: B releases the load A charged (and only that).
    let mut u = relay_update(3, Phase::Live, &[]);
    u.gone = vec![name_a];
    b.relay_update(500, &u);
    assert_eq!(b.inflight(), 1, "B's own request stays");
    assert_eq!(b.counter("kvroute.peers.gone.total"), 1);
}

/// The next turn of a conversation reaches the other gateway before the first turn's end
/// events do (they follow the answer by a few ms; the client sends at once): that gateway
/// still sends it to the first turn's worker, and no longer counts the first turn there.
#[test]
fn the_next_turn_through_the_other_gateway_beats_the_first_turns_end_events() {
    use crate::precise::wire::{PeerDecisions, Phase, WatchRequest};
    use prost::Message;
    let cfg = r#","disaggregation":{"threshold_tokens":0},"relay":{"cluster":"relay"}"#;
    let moved = (0..12u64)
        .filter(|&i| {
            let (a, b) = two_gateways(cfg);
            let name_a = gateway_name(&a);
            let user = format!("conversation {i}: {}", "lorem ipsum dolor sit amet ".repeat(12));
            let turn1 = serde_json::json!({"model": "m", "max_tokens": 8, "prompt": user});
            let (h, _) = a.post_json(turn1);
            // Only the decision has left A yet.
            a.state.borrow_mut().drain();
            let decisions: Vec<Vec<u8>> = a
                .f()
                .grpc_sent
                .iter()
                .skip(1)
                .flat_map(|(_, m, _)| WatchRequest::decode(m.as_slice()).unwrap().decisions)
                .collect();
            let mut u = relay_update(2, Phase::Live, &[]);
            u.peers = vec![PeerDecisions {
                gateway: name_a,
                decisions,
                sent_unix_ns: 0,
            }];
            b.relay_update(500, &u);
            assert_eq!(b.inflight(), 1);
            let turn2 = serde_json::json!({"model": "m", "max_tokens": 8,
                "prompt": format!("{user} assistant: the answer of turn one, a few sentences long. user: go on")});
            let (h2, _) = b.post_json(turn2);
            assert_eq!(b.inflight(), 1, "turn one ended, turn two runs");
            h2.decision().unwrap().decode != h.decision().unwrap().decode
        })
        .count();
    assert_eq!(moved, 0);
}

/// A peer's message is data about its own requests: a forged one that fails two workers,
/// reports a third busy (stamped u64::MAX) and charges a request stamped u64::MAX changes
/// no worker's health or load report, and the charge ends by this gateway's clock.
#[test]
fn a_forged_peer_message_cannot_steer_or_outlive_the_local_clock() {
    use crate::events::{encode, Event};
    use crate::load::{NewRequest, Report};
    use crate::precise::wire::{PeerDecisions, Phase};
    let cfg = format!(r#"{PRECISE},"load":{{"request_ttl_ms":2000}}"#);
    let b = Vm::with_bus(&cfg, Box::new(Process(Rc::new(MemoryBus::default()), None)));
    b.state.borrow_mut().start_serving();
    b.state.borrow_mut().tick();
    b.state.borrow_mut().tick();
    b.relay_update(500, &relay_update(1, Phase::SnapshotEnd, &[]));
    let busy = Report {
        kv_usage: 1.0,
        waiting: 10_000,
        running: None,
        at_ms: u64::MAX,
    };
    let forged = encode(
        0,
        &[
            Event::Failed {
                worker: 0,
                at_ms: u64::MAX,
            },
            Event::Failed {
                worker: 1,
                at_ms: u64::MAX,
            },
            Event::Report {
                worker: 2,
                report: busy,
            },
            Event::Routed(NewRequest {
                id: 1,
                worker: 2,
                prefill_worker: None,
                blocks: vec![1, 2],
                cached_blocks: 0,
                tail_blocks: 1,
                prefill_tokens: 100,
                now_ms: u64::MAX,
                adapter: 0,
            }),
        ],
    );
    let mut u = relay_update(2, Phase::Live, &[]);
    u.peers = vec![PeerDecisions {
        gateway: "forger".into(),
        decisions: vec![forged],
        sent_unix_ns: 0,
    }];
    b.relay_update(500, &u);
    assert_eq!(b.counter("kvroute.peers.refused.total"), 3);
    assert_eq!(b.counter("kvroute.peers.clamped.total"), 1);
    assert_eq!(b.inflight(), 1, "the decision itself is data: charged");
    let now = b.host.now_ms();
    for w in 0..3 {
        let v = b.state.borrow().router.worker_view(w, now);
        assert!(v.healthy, "worker {w}");
        assert_eq!(v.report, None, "worker {w}");
    }
    // The request TTL by this gateway's clock ends the charge.
    b.f().now_ns += 2_500_000_000;
    b.state.borrow_mut().tick();
    assert_eq!(b.inflight(), 0);
}

/// The first byte goes on to the client before the prompt's blocks are inserted into the
/// index (a cold prompt's insert costs hundreds of microseconds in V8): they are confirmed
/// at the next chunk, or when a one-chunk answer ends; a failed answer never confirms.
#[test]
fn the_index_insert_waits_until_the_first_byte_has_gone() {
    let vm = Vm::new("");
    let (mut h, _) = vm.post(&"y".repeat(400));
    let d = h.decision().unwrap().clone();
    let w = usize::from(d.decode);
    let blocks = d.hashes().len();
    assert!(blocks > 0);
    vm.answer(&mut h, "200", &[]);
    vm.body_chunk(&mut h, b"data: {}\n\n", false);
    assert_eq!(
        vm.held(d.hashes())[w],
        0,
        "not yet confirmed at the first byte"
    );
    assert_eq!(
        vm.state.borrow().router.worker_view(d.decode, 0).prefilling,
        0,
        "prefill done at once"
    );
    vm.body_chunk(&mut h, b"data: {}\n\n", false);
    assert_eq!(
        vm.held(d.hashes())[w] as usize,
        blocks,
        "confirmed at the next chunk"
    );
    vm.body_chunk(&mut h, b"data: [DONE]\n\n", true);
    vm.done(&mut h);
    assert_eq!(
        vm.held(d.hashes())[w] as usize,
        blocks,
        "kept after the request ends"
    );

    // One chunk that ends the answer: confirmed when the request ends.
    let (mut h, _) = vm.post(&"z".repeat(400));
    let d = h.decision().unwrap().clone();
    let w = usize::from(d.decode);
    vm.answer(&mut h, "200", &[]);
    vm.body_chunk(&mut h, b"{}", true);
    assert_eq!(vm.held(d.hashes())[w], 0);
    vm.done(&mut h);
    assert_eq!(vm.held(d.hashes())[w] as usize, d.hashes().len());

    // A 4xx never confirms.
    let (mut h, _) = vm.post(&"q".repeat(400));
    let d = h.decision().unwrap().clone();
    let w = usize::from(d.decode);
    vm.answer(&mut h, "400", &[]);
    vm.body_chunk(&mut h, b"{}", false);
    vm.body_chunk(&mut h, b"{}", true);
    vm.done(&mut h);
    assert_eq!(vm.held(d.hashes())[w], 0);
}

#[test]
fn a_routed_request_tells_envoy_how_long_a_try_may_wait() {
    let vm = Vm::new(NO_DISAGG);
    let _ = vm.post("bounded");
    // 30 s floor + 4 x the prefill estimate + 4 tokens x 250 ms (not a stream).
    let ms: u64 = vm
        .req_header("x-envoy-upstream-rq-per-try-timeout-ms")
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!((31_000..31_200).contains(&ms), "{ms}");
    let _ = vm.post_json(serde_json::json!({"model":"m","prompt":"unbounded"}));
    assert_eq!(
        vm.req_header("x-envoy-upstream-rq-per-try-timeout-ms"),
        None
    );
}

const STATUS: &str =
    r#","disaggregation":{"threshold_tokens":0},"status":{"path":"/kvroute/status"}"#;

impl Vm {
    /// A request for the status page: the action and the local answer, if one was sent.
    fn status(&self, method: &str, path: &str) -> (Action, Option<(u32, serde_json::Value)>) {
        self.request(method, path, &[]);
        self.f().sent.clear();
        let mut h = self.http();
        let a = h.on_http_request_headers(2, true);
        self.done(&mut h);
        let sent = self.f().sent.pop();
        (
            a,
            sent.map(|(code, _, body)| (code, serde_json::from_slice(&body).unwrap_or_default())),
        )
    }
}

#[test]
fn the_status_page_is_off_by_default() {
    let vm = Vm::new(NO_DISAGG);
    let (a, sent) = vm.status("GET", "/kvroute/status");
    assert_eq!(a, Action::Continue);
    assert!(sent.is_none());
}

#[test]
fn the_status_page_is_answered_locally_with_the_routers_state() {
    let vm = Vm::new(STATUS);
    let (mut h, a) = vm.post("a prompt long enough to fill a couple of blocks of text here");
    assert_eq!(a, Action::Continue);
    let target = chosen(&vm);
    vm.state.borrow_mut().tick();
    let (a, sent) = vm.status("GET", "/kvroute/status?pretty=1");
    assert_eq!(a, Action::Pause, "never goes upstream");
    let (code, page) = sent.unwrap();
    assert_eq!(code, 200);
    assert_eq!(vm.req_header("x-kvroute-cluster"), None);
    let workers = page["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 3);
    assert_eq!(workers[2]["role"], "prefill");
    let inflight: Vec<u64> = workers
        .iter()
        .map(|w| w["inflight"].as_u64().unwrap())
        .collect();
    let mut want = vec![0, 0, 0];
    want[usize::from(target)] = 1;
    assert_eq!(inflight, want);
    assert_eq!(page["active_requests"], 1);
    assert_eq!(page["counters"]["total"]["routed"], 1);
    assert_eq!(
        page["counters"]["last_60s"]["grew"]["routed"], 0,
        "sampled after"
    );
    // The reuse ladder's view, out of its counters.
    let ladder = &page["ladder"]["total"];
    assert!(ladder["reported"]["tokens"]["served"].is_u64(), "{ladder}");
    assert!(
        ladder["unreported"]["tokens"]["prompt"].is_u64(),
        "{ladder}"
    );
    assert!(ladder["unreported"]["tokens"].get("served").is_none());
    assert_eq!(page["precise"]["enabled"], false);
    assert_eq!(page["replication"]["serving"], true);
    // A load report shows with its age.
    vm.answer(
        &mut h,
        "200",
        &[(
            "endpoint-load-metrics",
            "TEXT named_metrics.kv_cache_usage_perc=0.25,named_metrics.num_requests_waiting=3",
        )],
    );
    vm.f().now_ns += 2_000_000_000;
    let (_, sent) = vm.status("GET", "/kvroute/status");
    let page = sent.unwrap().1;
    let rep = &page["workers"][usize::from(target)]["report"];
    assert_eq!(rep["waiting"], 3);
    assert_eq!(rep["age_ms"], 2_000);
    assert_eq!(rep["stale"], false);
    vm.done(&mut h);
    // Other methods get 405, still locally.
    let (a, sent) = vm.status("POST", "/kvroute/status");
    assert_eq!(a, Action::Pause);
    assert_eq!(sent.unwrap().0, 405);
    // Inference routes still route.
    let (_h, a) = vm.post("another");
    assert_eq!(a, Action::Continue);
    assert_eq!(vm.counter("kvroute.requests.routed.total"), 2);
}

#[test]
fn the_status_page_windows_count_what_happened_since_the_samples() {
    let vm = Vm::new(STATUS);
    vm.state.borrow_mut().tick();
    for p in ["one", "two", "three"] {
        let (mut h, _) = vm.post(p);
        vm.done(&mut h);
    }
    vm.f().now_ns += 30_000_000_000;
    let (_, sent) = vm.status("GET", "/kvroute/status");
    let page = sent.unwrap().1;
    assert_eq!(page["counters"]["last_60s"]["grew"]["routed"], 3);
    assert_eq!(page["counters"]["last_60s"]["span_ms"], 30_000);
    assert_eq!(page["counters"]["last_300s"]["grew"]["routed"], 3);
}

#[test]
fn every_vms_status_page_shows_the_relay_stream_its_holder_runs() {
    use crate::precise::wire::Phase;
    let cfg = r#","disaggregation":{"threshold_tokens":0},"relay":{"cluster":"relay"},"status":{"path":"/s"}"#;
    let (_bus, a, b) = two_vms(cfg);
    a.state.borrow_mut().start_serving();
    for _ in 0..2 {
        a.state.borrow_mut().tick();
    }
    let tok = a.f().grpc_opened[0].0;
    let (_, sent) = b.status("GET", "/s");
    let p = &sent.unwrap().1["precise"];
    assert_eq!(
        (p["enabled"].clone(), p["live"].clone()),
        (true.into(), false.into())
    );
    a.relay_update(
        tok,
        &relay_update(1, Phase::SnapshotEnd, &[("d0", true, &[], &[])]),
    );
    a.state.borrow_mut().tick();
    b.f().now_ns = a.f().now_ns + 500_000_000;
    for vm in [&a, &b] {
        let (_, sent) = vm.status("GET", "/s");
        let p = &sent.unwrap().1["precise"];
        assert_eq!(p["live"], true);
        assert_eq!(p["fed_workers"], 1);
        assert!(p["last_update_age_ms"].as_u64().is_some());
    }
    let (_, sent) = b.status("GET", "/s");
    assert_eq!(sent.unwrap().1["precise"]["last_update_age_ms"], 500);
}
