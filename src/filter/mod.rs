//! The proxy-wasm adapter: every host call lives here, behind `Host` (host.rs) and
//! `SharedBus` (bus.rs), so the contexts run natively against a fake host in tests.
//! Policy (what to route, which headers to set, how to read an answer) is in the pure core.
//! Nothing here may panic on request data: a panic kills the VM and with it the traffic of
//! one Envoy worker thread.

mod bus;
mod ffi;
mod host;
mod http;
mod metrics;
mod page;
mod relay;
mod relay_stream;
mod root;
mod state;
#[cfg(test)]
mod tests;

use proxy_wasm::types::LogLevel;
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        let host = Rc::new(host::Calls::new(Box::new(host::ProxyHost)));
        Box::new(root::Root::new(host, |vm_id| Box::new(bus::HostBus { vm_id })))
    });
}}
