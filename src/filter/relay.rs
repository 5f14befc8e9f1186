//! Precise mode's stream from kvroute-relay: one VM of the process holds it (a lease in
//! shared data, like the metrics poller), turns each update into engine events, applies
//! them and replicates them to every other VM. Without the stream, or before its snapshot
//! is complete, every worker routes on predictions; nothing on a request's path waits for it.

use super::state::State;
use crate::events::{self, Event};
use crate::ids::WorkerId;
use crate::precise::wire::{Update, WatchRequest, METHOD, SERVICE};
use crate::precise::Feed;
use prost::Message;
use proxy_wasm::types::{BufferType, LogLevel};

/// The lease is renewed every tick and lapses after 3 s (three times this), so a VM whose
/// thread stopped hands the stream over quickly.
const LEASE_PERIOD_MS: u64 = 1_000;
/// A stream whose snapshot has not completed by then is dropped and reopened.
const SNAPSHOT_DEADLINE_MS: u64 = 30_000;

#[derive(Default)]
pub struct RelayStream {
    token: Option<u32>,
    opened_ms: u64,
    feed: Feed,
    retry_at_ms: u64,
    backoff_ms: u64,
    lease_key: String,
    /// The last failure was logged; the next one is not until the stream was live again.
    quiet: bool,
}

impl RelayStream {
    pub fn new(ns: &str) -> RelayStream {
        RelayStream {
            feed: Feed::new(),
            lease_key: format!("{ns}/relay-stream"),
            ..RelayStream::default()
        }
    }

    /// This VM holds the stream (for the root context's gRPC callbacks).
    pub fn holds(&self, token: u32) -> bool {
        self.token == Some(token)
    }
}

impl State {
    /// Opens the stream when this VM should hold it and it is not open; renews the lease.
    pub(super) fn relay_tick(&mut self, now: u64) {
        let cfg = &self.router.config().relay;
        if cfg.cluster.is_empty() {
            return;
        }
        let (cluster, block_size) = (cfg.cluster.clone(), self.router.config().block_size);
        if self.relay.token.is_some() {
            if !self.hold_lease(&self.relay.lease_key, now, LEASE_PERIOD_MS) {
                self.relay_drop("another thread took over the relay stream", false);
            } else if !self.relay.feed.is_live()
                && now.saturating_sub(self.relay.opened_ms) > SNAPSHOT_DEADLINE_MS
            {
                self.relay_drop("the relay sent no complete snapshot within 30 s", true);
            }
            return;
        }
        if now < self.relay.retry_at_ms
            || !self.hold_lease(&self.relay.lease_key, now, LEASE_PERIOD_MS)
        {
            return;
        }
        let Some(token) = self.host.grpc_open(&cluster, SERVICE, METHOD) else {
            self.relay_failed(&format!(
                "could not open a gRPC stream on cluster {cluster} (unknown cluster?)"
            ));
            return;
        };
        let req = WatchRequest {
            gateway: format!(
                "{}/replica-{}",
                self.plugin_name,
                self.repl.as_ref().map_or(0, |r| r.id())
            ),
            block_size,
            ..WatchRequest::default()
        };
        if !self.host.grpc_send(token, &req.encode_to_vec(), true) {
            self.host.grpc_cancel(token);
            self.relay_failed("could not send the watch request");
            return;
        }
        self.relay.token = Some(token);
        self.relay.opened_ms = now;
        self.relay.feed.restart();
    }

    /// One message of the stream.
    pub fn on_relay_message(&mut self, token: u32, size: usize) {
        if !self.relay.holds(token) {
            return;
        }
        let bytes = self
            .host
            .buffer(BufferType::GrpcReceiveBuffer, size)
            .unwrap_or_default();
        let update = match Update::decode(bytes.as_slice()) {
            Ok(u) => u,
            Err(e) => {
                self.relay_drop(&format!("undecodable relay update: {e}"), true);
                return;
            }
        };
        let now_ns = self.host.now_ns();
        if update.sent_unix_ns > 0 {
            self.metrics
                .precise_delay_us
                .record(now_ns.saturating_sub(update.sent_unix_ns) / 1000);
        }
        let workers = &self.router.config().workers;
        let lookup = |name: &str| {
            workers
                .iter()
                .position(|w| w.name == name)
                .and_then(|i| WorkerId::try_from(i).ok())
        };
        let mut evs = Vec::new();
        match self.relay.feed.apply(&update, lookup, &mut evs) {
            Ok(a) => {
                self.metrics.precise_updates.inc();
                self.metrics.precise_stored.add(a.stored);
                self.metrics.precise_removed.add(a.removed);
                self.metrics.precise_unknown_workers.add(a.unknown_workers);
                self.apply_engine_events(evs);
                if a.went_live {
                    self.relay.backoff_ms = 0;
                    self.relay.quiet = false;
                    let fed = self.relay.feed.fed_workers();
                    self.metrics.precise_live.record(1);
                    self.metrics.precise_fed_workers.record(fed as u64);
                    self.host.log(
                        LogLevel::Info,
                        &format!(
                            "kvroute: relay stream live, {fed} worker(s) follow their engines' KV events (relay epoch {:x})",
                            self.relay.feed.epoch()
                        ),
                    );
                }
                if a.unknown_workers > 0 && a.went_live {
                    self.host.log(
                        LogLevel::Warn,
                        "kvroute: the relay describes workers this filter does not know (check the relay's --engine names)",
                    );
                }
            }
            Err(e) => self.relay_drop(&e.to_string(), true),
        }
    }

    /// The relay (or Envoy) ended the stream.
    pub fn on_relay_close(&mut self, token: u32, status: u32) {
        if !self.relay.holds(token) {
            return;
        }
        self.relay.token = None;
        self.relay_lost(&format!("the relay stream closed (gRPC status {status})"));
    }

    /// Ends the stream from this side.
    fn relay_drop(&mut self, why: &str, failure: bool) {
        if let Some(t) = self.relay.token.take() {
            self.host.grpc_cancel(t);
        }
        if failure {
            self.relay_lost(why);
        } else {
            let evs = self.relay.feed.lost();
            self.apply_engine_events(evs);
            self.metrics.precise_live.record(0);
            self.metrics.precise_fed_workers.record(0);
        }
    }

    /// Back to predictions for every worker, and retry later.
    fn relay_lost(&mut self, why: &str) {
        let evs = self.relay.feed.lost();
        self.apply_engine_events(evs);
        self.metrics.precise_live.record(0);
        self.metrics.precise_fed_workers.record(0);
        self.relay_failed(why);
    }

    fn relay_failed(&mut self, why: &str) {
        self.metrics.precise_stream_failures.inc();
        let cfg = &self.router.config().relay;
        let backoff = if self.relay.backoff_ms == 0 {
            cfg.retry_min_ms
        } else {
            self.relay
                .backoff_ms
                .saturating_mul(2)
                .min(cfg.retry_max_ms)
        };
        self.relay.backoff_ms = backoff;
        self.relay.retry_at_ms = self.host.now_ms().saturating_add(backoff);
        if !core::mem::replace(&mut self.relay.quiet, true) {
            self.host.log(
                LogLevel::Warn,
                &format!("kvroute: {why}; routing on predictions until the relay is back (retrying from {backoff} ms)"),
            );
        }
    }

    /// Engine events apply here like any replicated event, and go to the other VMs.
    fn apply_engine_events(&mut self, evs: Vec<Event>) {
        if evs.is_empty() {
            return;
        }
        if self.serving {
            let now = self.host.now_ms();
            for e in &evs {
                self.router.apply(e, now);
            }
        } else {
            self.backlog.push(events::encode(self.host.now_ns(), &evs));
        }
        self.broadcast(&evs);
    }
}
