//! Precise mode's stream from kvroute-relay: one VM of the process holds it (a lease in
//! shared data, like the metrics poller), turns each update into engine events, applies
//! them and replicates them to every other VM. Without the stream, or before its snapshot
//! is complete, every worker routes on predictions; nothing on a request's path waits for it.

use super::state::State;
use crate::events::{self, Event};
use crate::ids::WorkerId;
use crate::precise::peers;
use crate::precise::wire::{Update, WatchRequest, METHOD, SERVICE};
use prost::Message;
use proxy_wasm::types::{BufferType, LogLevel};

/// The lease is renewed every tick and lapses after 3 s (three times this), so a VM whose
/// thread stopped hands the stream over quickly.
const LEASE_PERIOD_MS: u64 = 1_000;
/// A stream whose snapshot has not completed by then is dropped and reopened.
const SNAPSHOT_DEADLINE_MS: u64 = 30_000;
/// Decisions waiting for the stream beyond this are dropped (counted): the relay is slow or
/// the stream is down, and other gateways will see this one's load again from later ones.
const SHARE_BUFFER_BYTES: usize = 4 << 20;

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
            } else {
                self.relay.peers.expire(now);
                // The gauges are one per process, shared by every VM: the holder restates
                // them, so a VM that handed the stream over cannot leave them wrong.
                let fed = self.relay.feed.fed_workers() as u64;
                self.metrics
                    .precise_live
                    .record(u64::from(self.relay.feed.is_live()));
                self.metrics.precise_fed_workers.record(fed);
                self.publish_relay_state();
            }
            return;
        }
        if now < self.relay.retry_at_ms
            || !self.hold_lease(&self.relay.lease_key, now, LEASE_PERIOD_MS)
        {
            return;
        }
        let share = self.router.config().relay.share_decisions;
        let gateway = self.gateway_name();
        let bearer = match self.relay_bearer() {
            Ok(b) => b,
            Err(why) => {
                self.relay_failed(&why);
                return;
            }
        };
        let metadata: Vec<(&str, &[u8])> = bearer
            .iter()
            .map(|b| ("authorization", b.as_bytes()))
            .collect();
        let Some(token) = self.host.grpc_open(&cluster, SERVICE, METHOD, &metadata) else {
            self.relay_failed(&format!(
                "could not open a gRPC stream on cluster {cluster} (unknown cluster?)"
            ));
            return;
        };
        let req = WatchRequest {
            gateway,
            block_size,
            group: self.relay.group.clone(),
            ..WatchRequest::default()
        };
        // Without sharing the request is all this side ever sends.
        if !self.host.grpc_send(token, &req.encode_to_vec(), !share) {
            self.host.grpc_cancel(token);
            self.relay_failed("could not send the watch request");
            return;
        }
        self.relay.token = Some(token);
        self.relay.sent_token = bearer.is_some();
        self.relay.opened_ms = now;
        self.relay.sharing = share;
        self.relay.feed.restart();
    }

    /// `Bearer <token>` from the VM's environment variable `relay.token_env`, if it is set.
    /// The token is never logged.
    fn relay_bearer(&self) -> Result<Option<String>, String> {
        let var = &self.router.config().relay.token_env;
        let token = match (var.is_empty(), self.host.env(var)) {
            (false, Some(t)) if !t.is_empty() => t,
            _ => return Ok(None),
        };
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "the relay token in {var} (relay.token_env) is not printable ASCII without spaces"
            ));
        }
        Ok(Some(format!("Bearer {token}")))
    }

    /// This process's gateway name: made once by the first VM that holds the stream and kept
    /// in shared data, so a VM taking the stream over speaks for the same gateway.
    fn gateway_name(&mut self) -> String {
        if !self.relay.gateway.is_empty() {
            return self.relay.gateway.clone();
        }
        let (cur, cas) = self.bus.get(&self.relay.gateway_key);
        let name = match cur.and_then(|v| String::from_utf8(v).ok()) {
            Some(n) if !n.is_empty() => n,
            _ => {
                // The clock alone is not unique across processes started together; std's
                // RandomState draws its keys from the host (WASI random_get in Envoy).
                let salt = {
                    use std::hash::{BuildHasher, Hasher};
                    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                    h.write_u64(self.host.now_ns());
                    h.finish()
                };
                let n = format!("{}-{salt:016x}", self.plugin_name);
                // A VM that lost the race reads the winner's name next time: the lease makes
                // that a VM which does not hold the stream anyway.
                self.bus.set(&self.relay.gateway_key, n.as_bytes(), cas);
                n
            }
        };
        self.relay.gateway = name.clone();
        name
    }

    /// Queues one of this process's replication messages for other gateways (when this VM
    /// holds a sharing stream).
    pub(super) fn relay_share(&mut self, msg: &[u8]) {
        if !self.relay.sharing_now() {
            return;
        }
        // Only decisions and their end leave, in messages peers accept (`precise::peers`).
        for m in events::peer_messages(msg, peers::MAX_ROUTED_PER_MESSAGE) {
            if self.relay.out_bytes + m.len() > SHARE_BUFFER_BYTES {
                self.metrics.peers_dropped.inc();
                continue;
            }
            self.relay.out_bytes += m.len();
            self.relay.out.push(m);
        }
    }

    /// Sends the queued decisions to the relay.
    pub(super) fn relay_flush(&mut self) {
        let Some(token) = self.relay.token else {
            return;
        };
        if self.relay.out.is_empty() {
            return;
        }
        let n = self.relay.out.len() as u64;
        let req = WatchRequest {
            decisions: core::mem::take(&mut self.relay.out),
            ..WatchRequest::default()
        };
        self.relay.out_bytes = 0;
        if self.host.grpc_send(token, &req.encode_to_vec(), false) {
            self.metrics.peers_sent.add(n);
        } else {
            self.metrics.peers_dropped.add(n);
        }
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
        self.relay.last_update_ms = now_ns / 1_000_000;
        if update.sent_unix_ns > 0 {
            self.metrics
                .precise_delay_us
                .record(now_ns.saturating_sub(update.sent_unix_ns) / 1000);
        }
        if update.engine_unix_ns > 0 {
            self.metrics
                .precise_engine_delay_us
                .record(now_ns.saturating_sub(update.engine_unix_ns) / 1000);
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
                self.apply_peers(&update);
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
        // 16: UNAUTHENTICATED, the relay wants a token this gateway lacks or has wrong.
        if status == 16 {
            let var = self.router.config().relay.token_env.clone();
            let why = if self.relay.sent_token {
                format!("the relay refused this gateway's token (gRPC status 16, UNAUTHENTICATED): {var} (relay.token_env) holds another token than the relay's")
            } else {
                format!("the relay refused this gateway (gRPC status 16, UNAUTHENTICATED): it requires a token and the Wasm VM has none in {var} (relay.token_env; list it in vm_config.environment_variables)")
            };
            if !core::mem::replace(&mut self.relay.unauthenticated_logged, true) {
                self.relay.quiet = false;
            }
            self.relay_lost(&why);
            return;
        }
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
            // Handed over: the new holder owns the process's gauges now.
            let evs = self.relay.feed.lost();
            self.apply_engine_events(evs);
        }
    }

    /// Back to predictions for every worker, and retry later.
    fn relay_lost(&mut self, why: &str) {
        let evs = self.relay.feed.lost();
        self.apply_engine_events(evs);
        self.metrics.precise_live.record(0);
        self.metrics.precise_fed_workers.record(0);
        self.publish_relay_state();
        self.relay_failed(why);
    }

    /// The stream's state for the status page of every VM (`crate::status`).
    pub(super) fn publish_relay_state(&self) {
        self.bus
            .set(&self.relay.state_key, &self.relay_record(), None);
    }

    fn relay_record(&self) -> Vec<u8> {
        let r = &self.relay;
        crate::status::encode_precise(
            r.token.is_some() && r.feed.is_live(),
            u32::try_from(r.feed.fed_workers()).unwrap_or(u32::MAX),
            u32::try_from(r.peers.charged()).unwrap_or(u32::MAX),
            r.last_update_ms,
        )
    }

    /// This VM's view of the stream when it holds it, else the holder's shared record.
    pub(super) fn relay_state(&self, now_ms: u64) -> crate::status::PreciseState {
        if self.router.config().relay.cluster.is_empty() {
            return crate::status::PreciseState::default();
        }
        let rec = if self.relay.token.is_some() {
            Some(self.relay_record())
        } else {
            self.bus.get(&self.relay.state_key).0
        };
        rec.and_then(|b| crate::status::decode_precise(&b, now_ms))
            .unwrap_or(crate::status::PreciseState {
                enabled: true,
                ..Default::default()
            })
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

    /// Other gateways' decisions, and gateways that are gone. What a peer may tell and how
    /// much it may charge is `precise::peers`' policy; every refusal is counted.
    fn apply_peers(&mut self, u: &Update) {
        if u.peers.is_empty() && u.gone.is_empty() {
            return;
        }
        let own = self.relay.gateway.clone();
        let now_ns = self.host.now_ns();
        let now_ms = self.host.now_ms();
        if self.relay.peers.workers() != self.router.config().workers.len() {
            self.relay.peers = peers::Peers::new(self.router.config());
        }
        let mut evs = Vec::new();
        let mut no = peers::Refusals::default();
        for p in u.peers.iter().filter(|p| p.gateway != own) {
            let tag = peers::peer_tag(&p.gateway);
            if p.sent_unix_ns > 0 {
                self.metrics
                    .peers_delay_us
                    .record(now_ns.saturating_sub(p.sent_unix_ns) / 1000);
            }
            for msg in &p.decisions {
                match events::decode_counted(msg) {
                    Ok(d) => {
                        self.metrics.peers_received.add(d.events.len() as u64);
                        let r = self.relay.peers.adopt(d.events, tag, now_ms, &mut evs);
                        no.refused += r.refused;
                        no.capped += r.capped;
                        no.clamped += r.clamped;
                    }
                    Err(_) => self.metrics.peers_errors.inc(),
                }
            }
        }
        self.metrics.peers_refused.add(no.refused);
        self.metrics.peers_capped.add(no.capped);
        self.metrics.peers_clamped.add(no.clamped);
        if no.refused + no.capped > 0 && !core::mem::replace(&mut self.relay.refusal_logged, true) {
            self.host.log(
                LogLevel::Warn,
                &format!(
                    "kvroute: refused {} event(s) a peer gateway may not send and {} decision(s) over the peer caps (logged once; see kvroute_peers_refused_total, kvroute_peers_capped_total)",
                    no.refused, no.capped
                ),
            );
        }
        for g in u.gone.iter().filter(|g| **g != own) {
            self.metrics.peers_gone.inc();
            // Debug, not Info: every stream that closes anywhere in the group is announced to
            // every gateway (one line per Envoy per close); the count is in peers_gone.
            self.host.log(
                LogLevel::Debug,
                &format!("kvroute: gateway {g} is gone; releasing the requests it had charged"),
            );
            let tag = peers::peer_tag(g);
            self.relay.peers.gone(tag);
            evs.push(Event::PeerGone { tag });
        }
        self.apply_engine_events(evs);
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
        self.broadcast_local(&evs);
    }
}
