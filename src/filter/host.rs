//! Every proxy-wasm host call the adapter makes, behind `Host` (shared data and queues are
//! behind `SharedBus`, see bus.rs). `ProxyHost` forwards to the raw ABI (ffi.rs: no SDK
//! wrapper that can panic); tests drive the contexts with a fake. `Calls` is what the adapter uses: it counts failed calls
//! in `kvroute.host_errors.total` instead of dropping them.

use super::ffi;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status};
use std::cell::Cell;
use std::time::Duration;

/// What a host call answers: a `Status` other than `Ok` is an error.
pub type HostResult<T> = Result<T, Status>;

/// `ProxyHost` and the tests' `FakeHost` both implement every method, so each long signature
/// stands three times (`duplicates` pairs them); only the bodies differ.
pub trait Host {
    /// A header's value as raw bytes: clients can send any byte in a value (h2c `:path`).
    fn header(&self, map: MapType, name: &str) -> HostResult<Option<Vec<u8>>>;
    /// Every header of a map, in order (one host call for all of them).
    fn headers(&self, map: MapType) -> HostResult<Vec<(String, Vec<u8>)>>;
    /// `None` removes the header.
    fn set_header(&self, map: MapType, name: &str, value: Option<&str>) -> HostResult<()>;
    fn buffer(&self, kind: BufferType, start: usize, max: usize) -> HostResult<Option<Vec<u8>>>;
    fn property(&self, path: &[&str]) -> HostResult<Option<Vec<u8>>>;
    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) -> HostResult<()>;
    /// Wall-clock nanoseconds (the same clock in every VM of the process).
    fn now_ns(&self) -> HostResult<u64>;
    fn log(&self, level: LogLevel, msg: &str) -> HostResult<()>;
    fn define_metric(&self, kind: MetricType, name: &str) -> HostResult<u32>;
    fn increment_metric(&self, id: u32, n: i64) -> HostResult<()>;
    fn record_metric(&self, id: u32, v: u64) -> HostResult<()>;
    /// A counter's or gauge's value, summed over every VM of the process.
    fn get_metric(&self, id: u32) -> HostResult<u64>;
    fn set_tick_period(&self, period: Duration) -> HostResult<()>;
    /// A call to an Envoy cluster; the answer arrives in `on_http_call_response` of the
    /// context that made it, with the returned token.
    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> HostResult<u32>;
    /// Opens a gRPC stream on an Envoy cluster; its messages and close arrive in the root
    /// context's `on_grpc_stream_message` / `on_grpc_stream_close` with the returned token.
    /// `metadata`: the stream's initial metadata (request headers).
    fn grpc_open(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> HostResult<u32>;
    fn grpc_send(&self, token: u32, msg: &[u8], end_stream: bool) -> HostResult<()>;
    /// Drops a stream; the host sends no close callback for it.
    fn grpc_cancel(&self, token: u32) -> HostResult<()>;
    /// A variable of the VM's environment (Envoy passes those its `vm_config` lists in
    /// `environment_variables`; WASI `environ_get`).
    fn env(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

pub struct ProxyHost;

impl Host for ProxyHost {
    fn header(&self, map: MapType, name: &str) -> HostResult<Option<Vec<u8>>> {
        ffi::header(map, name)
    }

    fn headers(&self, map: MapType) -> HostResult<Vec<(String, Vec<u8>)>> {
        ffi::headers(map)
    }

    fn set_header(&self, map: MapType, name: &str, value: Option<&str>) -> HostResult<()> {
        ffi::set_header(map, name, value)
    }

    fn buffer(&self, kind: BufferType, start: usize, max: usize) -> HostResult<Option<Vec<u8>>> {
        ffi::buffer(kind, start, max)
    }

    fn property(&self, path: &[&str]) -> HostResult<Option<Vec<u8>>> {
        ffi::property(path)
    }

    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) -> HostResult<()> {
        ffi::send_response(status, headers, body)
    }

    fn now_ns(&self) -> HostResult<u64> {
        ffi::now_ns()
    }

    fn log(&self, level: LogLevel, msg: &str) -> HostResult<()> {
        ffi::log(level, msg)
    }

    fn define_metric(&self, kind: MetricType, name: &str) -> HostResult<u32> {
        ffi::define_metric(kind, name)
    }

    fn increment_metric(&self, id: u32, n: i64) -> HostResult<()> {
        ffi::increment_metric(id, n)
    }

    fn record_metric(&self, id: u32, v: u64) -> HostResult<()> {
        ffi::record_metric(id, v)
    }

    fn get_metric(&self, id: u32) -> HostResult<u64> {
        ffi::get_metric(id)
    }

    fn set_tick_period(&self, period: Duration) -> HostResult<()> {
        ffi::set_tick_period_ms(u32::try_from(period.as_millis()).unwrap_or(u32::MAX))
    }

    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> HostResult<u32> {
        // Through the SDK, unlike the other calls: its dispatcher must learn the token to
        // route the answer to the root context (it has no public way to register one). It
        // panics only on a status Envoy's http_call never returns (Ok, BadArgument for an
        // unknown cluster, InternalFailure).
        proxy_wasm::hostcalls::dispatch_http_call(cluster, headers.to_vec(), body, vec![], timeout)
    }

    fn grpc_open(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> HostResult<u32> {
        // Through the SDK for the same reason as `http_call` (its dispatcher routes the
        // stream's callbacks by token). Envoy answers Ok, ParseFailure (unknown cluster) or
        // InternalFailure, which the SDK returns as errors; it panics on no other.
        proxy_wasm::hostcalls::open_grpc_stream(cluster, service, method, metadata.to_vec())
    }

    fn grpc_send(&self, token: u32, msg: &[u8], end_stream: bool) -> HostResult<()> {
        ffi::grpc_send(token, msg, end_stream)
    }

    fn grpc_cancel(&self, token: u32) -> HostResult<()> {
        ffi::grpc_cancel(token)
    }
}

/// A header map read at once (`Calls::headers`).
pub struct Headers(Vec<(String, Vec<u8>)>);

impl Headers {
    /// The first value of `name`, as `Calls::header` reads it (bytes that are not UTF-8
    /// become U+FFFD).
    pub fn get(&self, name: &str) -> Option<String> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.0.iter().any(|(k, _)| k == name)
    }
}

/// The host as the adapter uses it: failures are counted, then read as "absent".
pub struct Calls {
    host: Box<dyn Host>,
    /// The `kvroute.host_errors.total` counter, once defined.
    errors: Cell<Option<u32>>,
}

impl Calls {
    pub fn new(host: Box<dyn Host>) -> Calls {
        Calls {
            host,
            errors: Cell::new(None),
        }
    }

    pub fn set_error_metric(&self, id: Option<u32>) {
        self.errors.set(id);
    }

    fn ok<T>(&self, r: HostResult<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(_) => {
                self.count_error();
                None
            }
        }
    }

    fn count_error(&self) {
        if let Some(id) = self.errors.get() {
            // If counting fails too, the host has nowhere left to report to.
            if self.host.increment_metric(id, 1).is_err() {
                self.errors.set(None);
            }
        }
    }

    /// A header's value; bytes that are not UTF-8 become U+FFFD, so such a value never
    /// equals a route or a number and the request is treated as any other unknown one.
    pub fn header(&self, map: MapType, name: &str) -> Option<String> {
        self.ok(self.host.header(map, name))
            .flatten()
            .map(|v| match String::from_utf8(v) {
                Ok(s) => s,
                Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
            })
    }

    /// Every header of a map, read in one host call; `None` if the call failed (callers then
    /// fall back to `header`).
    pub fn headers(&self, map: MapType) -> Option<Headers> {
        self.ok(self.host.headers(map)).map(Headers)
    }

    pub fn set_header(&self, map: MapType, name: &str, value: Option<&str>) {
        self.ok(self.host.set_header(map, name, value));
    }

    pub fn buffer(&self, kind: BufferType, max: usize) -> Option<Vec<u8>> {
        self.ok(self.host.buffer(kind, 0, max)).flatten()
    }

    pub fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.ok(self.host.property(path)).flatten()
    }

    pub fn property_string(&self, path: &[&str]) -> Option<String> {
        self.property(path).and_then(|b| String::from_utf8(b).ok())
    }

    pub fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        self.ok(self.host.send_response(status, headers, body));
    }

    /// 0 when the host has no clock to give (then every duration reads as 0).
    pub fn now_ns(&self) -> u64 {
        self.ok(self.host.now_ns()).unwrap_or(0)
    }

    pub fn now_ms(&self) -> u64 {
        self.now_ns() / 1_000_000
    }

    pub fn log(&self, level: LogLevel, msg: &str) {
        self.ok(self.host.log(level, msg));
    }

    pub fn define_metric(&self, kind: MetricType, name: &str) -> Option<u32> {
        self.ok(self.host.define_metric(kind, name))
    }

    pub fn increment_metric(&self, id: u32, n: u64) {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        self.ok(self.host.increment_metric(id, n));
    }

    pub fn record_metric(&self, id: u32, v: u64) {
        self.ok(self.host.record_metric(id, v));
    }

    pub fn get_metric(&self, id: u32) -> Option<u64> {
        self.ok(self.host.get_metric(id))
    }

    /// False if the host refused the period (then the timer keeps its old one).
    pub fn set_tick_period(&self, period: Duration) -> bool {
        self.ok(self.host.set_tick_period(period)).is_some()
    }

    pub fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Option<u32> {
        self.ok(self.host.http_call(cluster, headers, body, timeout))
    }

    pub fn grpc_open(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> Option<u32> {
        self.ok(self.host.grpc_open(cluster, service, method, metadata))
    }

    pub fn env(&self, name: &str) -> Option<String> {
        self.host.env(name)
    }

    pub fn grpc_send(&self, token: u32, msg: &[u8], end_stream: bool) -> bool {
        self.ok(self.host.grpc_send(token, msg, end_stream))
            .is_some()
    }

    pub fn grpc_cancel(&self, token: u32) {
        self.ok(self.host.grpc_cancel(token));
    }
}
