//! The proxy-wasm adapter: every host call lives here, behind the small interfaces the pure
//! core uses (`SharedBus` for replication, plain `now_ms` values for time, `Metrics`).
//! Nothing here may panic on request data: a panic kills the VM and with it the traffic of
//! one Envoy worker thread.

mod bus;
mod http;
mod metrics;
mod root;

use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> { Box::new(root::Root::default()) });
}}

/// Wall-clock milliseconds from the host (the same clock in every VM of the process).
pub(crate) fn now_ms() -> u64 {
    now_ns() / 1_000_000
}

pub(crate) fn now_ns() -> u64 {
    proxy_wasm::hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

pub(crate) fn log(level: LogLevel, msg: &str) {
    let _ = proxy_wasm::hostcalls::log(level, msg);
}
