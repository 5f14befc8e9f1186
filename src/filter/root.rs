//! Root context: reads the configuration, creates the VM's state and runs periodic work.

use super::host::Calls;
use super::http::Http;
use super::state::{State, HOUSEKEEPING};
use crate::config::Config;
use crate::replication::{self, SharedBus};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};
use std::cell::RefCell;
use std::rc::Rc;

/// Makes the replication bus of a VM from its `vm_id`.
pub type BusFactory = fn(String) -> Box<dyn SharedBus>;

pub struct Root {
    host: Rc<Calls>,
    bus: BusFactory,
    state: Option<Rc<RefCell<State>>>,
}

impl Root {
    pub fn new(host: Rc<Calls>, bus: BusFactory) -> Root {
        Root {
            host,
            bus,
            state: None,
        }
    }
}

impl Context for Root {
    /// A metrics scrape's answer: the root context makes the scrapes. The signature is
    /// proxy-wasm's, the same as `Http`'s for tokenize answers (`duplicates` pairs them).
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(st) = &self.state {
            if let Ok(mut s) = st.try_borrow_mut() {
                s.on_scrape(token_id, num_headers, body_size);
            }
        }
    }

    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        if let Some(st) = &self.state {
            if let Ok(mut s) = st.try_borrow_mut() {
                s.on_relay_message(token_id, message_size);
            }
        }
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        if let Some(st) = &self.state {
            if let Ok(mut s) = st.try_borrow_mut() {
                s.on_relay_close(token_id, status_code);
            }
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let host = &self.host;
        let bytes = host
            .buffer(BufferType::PluginConfiguration, usize::MAX)
            .unwrap_or_default();
        let cfg = match Config::from_json(&bytes) {
            Ok(c) => c,
            Err(e) => {
                // Returning false makes Envoy reject the filter configuration.
                host.log(LogLevel::Error, &e.to_string());
                return false;
            }
        };
        let vm_id = host.property_string(&["plugin_vm_id"]).unwrap_or_default();
        let plugin = host
            .property_string(&["plugin_name"])
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "kvroute".into());
        let ns = replication::namespace(&plugin, &bytes);
        let state = State::configure(Rc::clone(host), cfg, (self.bus)(vm_id), &ns);
        self.state = Some(Rc::new(RefCell::new(state)));
        host.set_tick_period(HOUSEKEEPING);
        true
    }

    fn on_tick(&mut self) {
        if let Some(st) = &self.state {
            if let Ok(mut s) = st.try_borrow_mut() {
                s.on_timer();
            }
        }
    }

    fn on_queue_ready(&mut self, _queue_id: u32) {
        if let Some(st) = &self.state {
            if let Ok(mut s) = st.try_borrow_mut() {
                s.metrics.repl_wakeups.inc();
                s.drain();
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never None: the SDK panics on it. Unconfigured, the context passes traffic through.
        Some(Box::new(Http::new(
            Rc::clone(&self.host),
            self.state.clone(),
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
