//! One VM's side of the kvroute-relay stream, as data: the stream it holds (if any), its
//! lease, backoff, engine feed and the decisions waiting to be sent. `State` owns it, and
//! driving it (relay.rs) needs the rest of `State`; kept apart from the driver, it lets
//! state.rs name it without depending on relay.rs, which depends on state.rs.

use crate::precise::peers;
use crate::precise::Feed;

#[derive(Default)]
pub struct RelayStream {
    pub(super) token: Option<u32>,
    pub(super) opened_ms: u64,
    pub(super) feed: Feed,
    pub(super) retry_at_ms: u64,
    pub(super) backoff_ms: u64,
    pub(super) lease_key: String,
    /// Shared-data key of this Envoy process's gateway name (one per process, whichever VM
    /// holds the stream), and the name once read.
    pub(super) gateway_key: String,
    pub(super) gateway: String,
    /// The replication namespace: gateways share decisions only within it.
    pub(super) group: String,
    /// This process's decisions (replication messages) not sent to the relay yet.
    pub(super) out: Vec<Vec<u8>>,
    pub(super) out_bytes: usize,
    /// The stream was opened to share decisions (not half-closed after the request).
    pub(super) sharing: bool,
    /// The last failure was logged; the next one is not until the stream was live again.
    pub(super) quiet: bool,
    /// The open stream carries a token (`relay.token_env`), for the refusal's log line.
    pub(super) sent_token: bool,
    /// The relay's refusal (UNAUTHENTICATED) was logged: it is logged even when the failure
    /// before it was (relay down).
    pub(super) unauthenticated_logged: bool,
    /// Other gateways' charges here, against the caps on what one peer may charge.
    pub(super) peers: peers::Peers,
    /// A refused peer event was logged (once per VM: the counters say the rest).
    pub(super) refusal_logged: bool,
    /// When the last update arrived (Unix ms, 0: none yet), and the shared-data key where
    /// the holder publishes its state for the other VMs' status pages.
    pub(super) last_update_ms: u64,
    pub(super) state_key: String,
}

impl RelayStream {
    pub fn new(ns: &str) -> RelayStream {
        RelayStream {
            feed: Feed::new(),
            lease_key: format!("{ns}/relay-stream"),
            gateway_key: format!("{ns}/gateway-name"),
            group: ns.to_string(),
            state_key: format!("{ns}/relay-state"),
            ..RelayStream::default()
        }
    }

    /// This VM holds a stream that takes this process's decisions.
    pub fn sharing_now(&self) -> bool {
        self.token.is_some() && self.sharing
    }

    /// This VM holds the stream (for the root context's gRPC callbacks).
    pub fn holds(&self, token: u32) -> bool {
        self.token == Some(token)
    }
}
