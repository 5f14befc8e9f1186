//! The VM's state, shared by the root context and every HTTP context of one Envoy worker
//! thread: the router replica, stats, replication and the work deferred out of requests.

use super::host::Calls;
use super::metrics::Metrics;
use super::relay_stream::RelayStream;
use crate::config::{Config, Role};
use crate::events::{self, Event};
use crate::feedback::OrcaLoad;
use crate::ids::WorkerId;
use crate::lora::LoraReport;
use crate::picks;
use crate::prom;
use crate::replication::{Replicator, SharedBus, Timing};
use crate::router::{Decision, Router};
use crate::steer::Intercept;
use proxy_wasm::types::{BufferType, LogLevel, MapType};
use std::rc::Rc;
use std::time::Duration;

/// Replication messages handled per queue wake-up before yielding back to Envoy.
const DRAIN_MAX: usize = 4096;

/// Heartbeats, expiry and gauges run on this period; peers are considered gone after
/// `Timing::stale_ms` without a heartbeat.
pub const HOUSEKEEPING: Duration = Duration::from_millis(HOUSEKEEPING_MS);
const HOUSEKEEPING_MS: u64 = 250;

/// How long work deferred out of a request callback waits. Envoy delivers a queue message
/// this VM sends itself in the same event-loop pass, and writes a request to the upstream
/// socket only in the next one, so deferred work woken that way (the index inserts, the
/// encoding, waking the peer threads) would run between the routing decision and the write.
/// The root's timer fires in a later pass, after the write, and peers still hear of a
/// decision within milliseconds. (Measured on the benchmark, the gain is within noise.)
const DEFER_MS: u64 = 1;

/// Compare-and-swap attempts at adding a pick to the shared record (two threads rarely
/// collide more than once: each holds Envoy's lock for a copy of under a kilobyte).
const PICK_RETRIES: usize = 4;

pub struct State {
    pub(super) host: Rc<Calls>,
    pub router: Router,
    pub metrics: Metrics,
    /// Routes and client headers of interest, fixed by the configuration.
    pub intercept: Intercept,
    pub(super) bus: Box<dyn SharedBus>,
    pub(super) repl: Option<Replicator>,
    /// This VM has routed a request; until then replicated events wait in `backlog`.
    pub(super) serving: bool,
    started_ms: u64,
    pub(super) backlog: Backlog,
    /// Events for the other VMs, sent by `run_deferred`: this VM's own decisions (shared
    /// with other gateways through the relay), and what it learnt from the relay (not).
    outbox: Vec<Event>,
    outbox_local: Vec<Event>,
    /// Deferred work waits for the timer (or, where the host refused it, a queue wake-up).
    wake_pending: bool,
    /// The root timer's period as last set (`DEFER_MS` while work waits).
    timer_ms: u64,
    next_housekeeping_ms: u64,
    poller: Poller,
    pub(super) relay: RelayStream,
    pub(super) plugin_name: String,
    /// Shared-data key of the other threads' recent picks ([`crate::picks`]), and the
    /// record as last read, with its CAS token (the write after routing starts from it).
    picks_key: String,
    picks_seen: (Vec<u8>, Option<u32>),
    /// Samples of the status page's counters (`crate::status`), when the page is on.
    pub(super) window: crate::status::Window,
}

/// Scrapes of the engines' Prometheus endpoints (config `metrics`). One VM of the process
/// scrapes at a time (a lease in shared data, taken over when its holder stops renewing it)
/// and replicates each result as a `Report` event, as if the worker had sent ORCA.
#[derive(Default)]
struct Poller {
    next_ms: u64,
    /// Calls in flight, at most one per worker: token, worker, sent at (ns).
    pending: Vec<(u32, WorkerId, u64)>,
    /// Workers whose last scrape failed (a change is logged once, not every poll).
    failing: Vec<bool>,
    lease_key: String,
}

/// How long after it starts a VM asks its peers for every message at once (see `configure`).
const STARTUP_URGENT_MS: u64 = 10_000;

/// The lease: holder's replica id (u32 LE), valid until (ms, u64 LE).
fn lease_value(id: u32, until_ms: u64) -> Vec<u8> {
    let mut v = id.to_le_bytes().to_vec();
    v.extend_from_slice(&until_ms.to_le_bytes());
    v
}

fn read_lease(v: &[u8]) -> Option<(u32, u64)> {
    let id = u32::from_le_bytes(v.get(..4)?.try_into().ok()?);
    let until = u64::from_le_bytes(v.get(4..12)?.try_into().ok()?);
    Some((id, until))
}

/// Raw replication messages kept by a VM that does not route (yet), oldest dropped first.
#[derive(Default)]
pub(super) struct Backlog {
    msgs: std::collections::VecDeque<Vec<u8>>,
    bytes: usize,
}

/// Enough for the recent history a late-starting worker thread needs.
const BACKLOG_BYTES: usize = 8 << 20;

impl Backlog {
    pub(super) fn push(&mut self, msg: Vec<u8>) {
        self.bytes += msg.len();
        self.msgs.push_back(msg);
        while self.bytes > BACKLOG_BYTES {
            match self.msgs.pop_front() {
                Some(old) => self.bytes -= old.len(),
                None => break,
            }
        }
    }

    fn take_all(&mut self) -> Vec<Vec<u8>> {
        self.bytes = 0;
        self.msgs.drain(..).collect()
    }
}

impl State {
    /// Sets up one VM for a validated configuration: joins replication under `ns` (the
    /// plugin name), seeds the router and defines the stats.
    pub fn configure(host: Rc<Calls>, cfg: Config, bus: Box<dyn SharedBus>, ns: &str) -> State {
        let now = host.now_ms();
        let mut repl = Replicator::join(bus.as_ref(), ns, now, Timing::default());
        // Until `STARTUP_URGENT_MS` have passed every VM takes messages at once: which threads
        // will route is not known yet, and a thread whose first request comes right after
        // another thread's would otherwise route it before that thread's next tick sends what
        // it batched (a fresh Envoy taking traffic at once).
        if let Some(r) = &mut repl {
            r.set_urgent(bus.as_ref(), now, true);
        }
        if repl.is_none() {
            host.log(
                LogLevel::Warn,
                "kvroute: could not join replication; this thread routes on its own state",
            );
        }
        let origin = repl
            .as_ref()
            .map(|r| u64::from(r.id()))
            .unwrap_or(now & 0xFFFF);
        let seed = if cfg.seed != 0 {
            cfg.seed ^ origin
        } else {
            host.now_ns() ^ (origin << 32)
        };
        let names: Vec<&str> = cfg.workers.iter().map(|w| w.name.as_str()).collect();
        let metrics = Metrics::define(&host, &names);
        let prefill = cfg
            .workers
            .iter()
            .filter(|w| w.role == Role::Prefill)
            .count();
        host.log(
            LogLevel::Info,
            &format!(
                "kvroute: configured {} workers ({} decode, {prefill} prefill), block_size {}, steering header {}, replica {}",
                cfg.workers.len(),
                cfg.workers.len() - prefill,
                cfg.block_size,
                cfg.steering.header_name(),
                repl.as_ref().map(|r| r.id()).unwrap_or(0),
            ),
        );
        let intercept = Intercept::from_config(&cfg);
        // The tables' hash key comes from the clock, never from a configured seed.
        let hash_key = host.now_ns().rotate_left(17) ^ origin;
        State {
            host,
            router: Router::with_hash_key(cfg, origin, seed, hash_key),
            metrics,
            intercept,
            bus,
            repl,
            serving: false,
            started_ms: now,
            backlog: Backlog::default(),
            outbox: Vec::new(),
            outbox_local: Vec::new(),
            wake_pending: false,
            timer_ms: HOUSEKEEPING_MS,
            next_housekeeping_ms: 0,
            poller: Poller {
                lease_key: format!("{ns}/metrics-poller"),
                ..Poller::default()
            },
            relay: RelayStream::new(ns),
            picks_key: format!("{ns}/picks"),
            picks_seen: (Vec::new(), None),
            window: crate::status::Window::default(),
            plugin_name: ns.split('@').next().unwrap_or("kvroute").to_string(),
        }
    }

    /// Whether other routing threads exist whose picks this one must see at once.
    fn shares_picks(&self) -> bool {
        self.repl.as_ref().is_some_and(|r| r.peers() > 0)
    }

    /// Before routing: charges what the other threads picked in the last moments and this
    /// one has not heard of yet (their events leave with the deferred-work timer).
    pub fn read_peer_picks(&mut self, now_ms: u64) {
        if !self.shares_picks() {
            return;
        }
        let (bytes, cas) = self.bus.get(&self.picks_key);
        let bytes = bytes.unwrap_or_default();
        let n = self.router.note_peer_picks(&picks::decode(&bytes), now_ms);
        self.metrics.peer_picks.add(n as u64);
        self.picks_seen = (bytes, cas);
    }

    /// After routing: adds this decision to the shared record. A write that loses the
    /// compare-and-swap to another thread's re-reads and retries a few times; one that still
    /// loses only leaves the others to learn of the pick from its event.
    pub fn publish_pick(&mut self, d: &Decision, now_ms: u64) {
        if !self.shares_picks() {
            return;
        }
        let Some(pick) = d.pick() else { return };
        let (mut bytes, mut cas) = core::mem::take(&mut self.picks_seen);
        for _ in 0..PICK_RETRIES {
            if self
                .bus
                .set(&self.picks_key, &picks::merge(&bytes, pick, now_ms), cas)
            {
                return;
            }
            let (b, c) = self.bus.get(&self.picks_key);
            bytes = b.unwrap_or_default();
            cas = c;
        }
    }

    /// After a request ended: marks its pick ended in the shared record while the record
    /// still shows it, so no other thread charges (or keeps charging) a request that is over
    /// before its end event arrives (`picks`). Past the window there is nothing to write.
    pub fn publish_end(&mut self, d: &Decision, now_ms: u64) {
        let Some(pick) = d.pick() else { return };
        if !self.shares_picks() || !picks::fresh(&pick, now_ms) {
            return;
        }
        for _ in 0..PICK_RETRIES {
            let (bytes, cas) = self.bus.get(&self.picks_key);
            let Some(next) = bytes.and_then(|b| picks::end(&b, pick.id)) else {
                return;
            };
            if self.bus.set(&self.picks_key, &next, cas) {
                return;
            }
        }
    }

    /// Queues events this VM already applied for the other VMs. They leave in one message
    /// from the deferred-work timer, after Envoy sent the request upstream, so request
    /// callbacks only push onto a vector.
    pub fn broadcast(&mut self, evs: &[Event]) {
        if evs.is_empty() {
            return;
        }
        self.outbox.extend_from_slice(evs);
        self.schedule();
    }

    /// `broadcast` for events that came from the relay (engines, other gateways): the other
    /// VMs apply them, the relay is not sent them back.
    pub(super) fn broadcast_local(&mut self, evs: &[Event]) {
        if evs.is_empty() {
            return;
        }
        self.outbox_local.extend_from_slice(evs);
        self.schedule();
    }

    /// Runs the index inserts of this VM's own decisions outside the request path.
    pub fn defer_flush(&mut self) {
        self.schedule();
    }

    /// Makes sure deferred work runs soon: the root timer, shortened to `DEFER_MS`. If the
    /// host refuses that, a self-addressed wake-up; without either, the work runs now.
    fn schedule(&mut self) {
        if self.wake_pending {
            return;
        }
        // Nothing has to leave before the next tick when no peer wants messages at once and
        // no relay stream takes them: the events go out with the tick (idle peers get them in
        // a batch then anyway), and the router flushes its pending entries before it routes
        // again. A wake-up (enqueue, callback, dequeues) is ~10-30 us of this thread's time.
        if !self.relay.sharing_now() && self.repl.as_ref().is_some_and(|r| !r.any_urgent()) {
            return;
        }
        if self.set_timer(DEFER_MS)
            || self
                .repl
                .as_ref()
                .is_some_and(|r| r.wake_self(self.bus.as_ref()))
        {
            self.wake_pending = true;
        } else {
            self.run_deferred();
        }
    }

    fn set_timer(&mut self, ms: u64) -> bool {
        if self.timer_ms == ms {
            return true;
        }
        let ok = self.host.set_tick_period(Duration::from_millis(ms));
        if ok {
            self.timer_ms = ms;
        }
        ok
    }

    /// The root's timer: the deferred work, if it waits, then housekeeping when it is due.
    /// The timer goes back to the housekeeping period, less what has passed of it.
    pub fn on_timer(&mut self) {
        if self.wake_pending {
            self.run_deferred();
        }
        let now = self.host.now_ms();
        if now >= self.next_housekeeping_ms {
            self.tick();
            self.next_housekeeping_ms = now + HOUSEKEEPING_MS;
        }
        if !self.wake_pending {
            let rest = self.next_housekeeping_ms.saturating_sub(now);
            self.set_timer(rest.clamp(1, HOUSEKEEPING_MS));
        }
    }

    fn run_deferred(&mut self) {
        self.wake_pending = false;
        self.router.flush();
        for shared in [true, false] {
            let evs = if shared {
                core::mem::take(&mut self.outbox)
            } else {
                core::mem::take(&mut self.outbox_local)
            };
            let to_relay = shared && self.relay.sharing_now();
            if evs.is_empty() || (self.repl.is_none() && !to_relay) {
                continue;
            }
            let msg = events::encode(self.host.now_ns(), &evs);
            if let Some(r) = &mut self.repl {
                let n = r.broadcast(self.bus.as_ref(), self.host.now_ms(), &msg);
                self.metrics.repl_sent.add((n * evs.len()) as u64);
            }
            if to_relay {
                self.relay_share(&msg);
            }
        }
        self.relay_flush();
    }

    pub fn drain(&mut self) {
        self.run_deferred();
        let Some(r) = &self.repl else { return };
        for msg in r.drain(self.bus.as_ref(), DRAIN_MAX) {
            if msg.is_empty() {
                continue; // a wake-up, see defer_flush
            }
            // Other VMs of this process only ever send their own decisions here (the relay's
            // events reach them from this VM, the one holding its stream).
            self.relay_share(&msg);
            if self.serving {
                self.apply_message(&msg);
            } else {
                self.backlog.push(msg);
            }
        }
        self.relay_flush();
    }

    /// Called before this VM routes for the first time. Envoy's main-thread VM (and any
    /// worker thread that has not seen traffic yet) only keeps a bounded backlog of raw
    /// messages instead of applying every event: on two cores, replaying each decision on
    /// the main thread measurably slowed the worker threads. The backlog is applied here.
    pub fn start_serving(&mut self) {
        if self.serving {
            return;
        }
        self.serving = true;
        // Peers send to a routing VM at once, no longer in batches.
        if let Some(r) = &mut self.repl {
            r.set_urgent(self.bus.as_ref(), self.host.now_ms(), true);
        }
        for msg in self.backlog.take_all() {
            self.apply_message(&msg);
        }
    }

    fn apply_message(&mut self, msg: &[u8]) {
        let now = self.host.now_ms();
        {
            match events::decode_counted(msg) {
                Ok(events::Decoded {
                    sent_ns,
                    events: evs,
                    skipped,
                    first_error,
                }) => {
                    if let Some(e) = first_error {
                        // The readable events of the message still apply.
                        self.metrics.repl_errors.add(u64::from(skipped));
                        self.host.log(
                            LogLevel::Warn,
                            &format!("kvroute: skipped {skipped} replication event(s): {e}"),
                        );
                    }
                    self.metrics.repl_received.add(evs.len() as u64);
                    self.metrics
                        .repl_delay_us
                        .record(self.host.now_ns().saturating_sub(sent_ns) / 1000);
                    for e in &evs {
                        self.router.apply(e, now);
                    }
                }
                Err(e) => {
                    self.metrics.repl_errors.inc();
                    self.host.log(
                        LogLevel::Warn,
                        &format!("kvroute: dropped replication message: {e}"),
                    );
                }
            }
        }
    }

    pub fn tick(&mut self) {
        let now = self.host.now_ms();
        if let Some(r) = &mut self.repl {
            r.heartbeat(self.bus.as_ref(), now);
            self.metrics.repl_peers.record(r.peers() as u64);
            for id in r.take_departed() {
                let n = self.router.purge_origin(u64::from(id));
                self.metrics.expired_requests.add(n as u64);
            }
        }
        self.drain();
        self.poll(now);
        self.relay_tick(now);
        self.sample_counters(now);
        // The VM holding the relay stream forwards every VM's decisions: it wants them at once.
        let urgent = self.serving
            || self.relay.sharing_now()
            || now.saturating_sub(self.started_ms) < STARTUP_URGENT_MS;
        if let Some(r) = &mut self.repl {
            r.set_urgent(self.bus.as_ref(), now, urgent);
            r.flush(self.bus.as_ref());
        }
        let (lost, _) = self.router.tick(now);
        self.metrics.expired_requests.add(lost as u64);
        // Gauges are process-wide and every VM writes them: only VMs that route hold the
        // replicated state (the others keep a raw backlog) and may publish it.
        if self.serving {
            self.publish_gauges(now);
        }
    }

    /// Starts a scrape of every worker when one is due and this VM holds the lease.
    fn poll(&mut self, now: u64) {
        let m = &self.router.config().metrics;
        let (period, timeout_ms) = (m.poll_ms, m.timeout_ms);
        if period == 0 || now < self.poller.next_ms {
            return;
        }
        self.poller.next_ms = now + period;
        // The host answers every call, at the latest at its timeout; a call it never
        // answered (a VM restarted under it) is given up after twice that.
        let now_ns = self.host.now_ns();
        let give_up_ns = timeout_ms
            .saturating_mul(2_000_000)
            .saturating_add(1_000_000_000);
        let before = self.poller.pending.len();
        self.poller
            .pending
            .retain(|p| now_ns.saturating_sub(p.2) < give_up_ns);
        self.metrics
            .scrapes_error
            .add((before - self.poller.pending.len()) as u64);
        if !self.hold_lease(&self.poller.lease_key, now, period) {
            return;
        }
        let path = m.path.clone();
        let targets: Vec<(WorkerId, String)> = self
            .router
            .config()
            .workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| {
                let id = WorkerId::try_from(i).ok()?;
                Some((id, format!("{}{}", w.cluster_name(), m.cluster_suffix)))
            })
            .collect();
        for (w, cluster) in targets {
            if self.poller.pending.iter().any(|p| p.1 == w) {
                continue;
            }
            let headers = [
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", cluster.as_str()),
                ("accept", "text/plain"),
            ];
            match self
                .host
                .http_call(&cluster, &headers, None, Duration::from_millis(timeout_ms))
            {
                Some(token) => self.poller.pending.push((token, w, now_ns)),
                None => self.scrape_failed(w, "the call could not start (unknown cluster?)"),
            }
        }
    }

    /// True when this VM is (now) the one that holds `key`'s lease (scrapes, or holds the
    /// relay stream). Without replication every VM holds its own.
    pub(super) fn hold_lease(&self, key: &str, now: u64, period: u64) -> bool {
        let Some(me) = self.repl.as_ref().map(|r| r.id()) else {
            return true;
        };
        let (cur, cas) = self.bus.get(key);
        if let Some((owner, until)) = cur.as_deref().and_then(read_lease) {
            if owner != me && until > now {
                return false;
            }
        }
        let until = now + period.saturating_mul(3).max(1_000);
        let written = self.bus.set(key, &lease_value(me, until), cas);
        // Envoy checks no CAS on a key that does not exist yet, so VMs starting together can
        // all create it and each believe it won (two relay streams, the loser zeroing the
        // shared gauges when it hands over). A created lease is only a claim: it is held from
        // the next call on, when it is read back as this VM's.
        written && cas.is_some()
    }

    /// The answer to a scrape (`on_http_call_response`); `None` headers means no answer
    /// (timeout, connection failure).
    pub fn on_scrape(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let Some(pos) = self.poller.pending.iter().position(|p| p.0 == token) else {
            return;
        };
        let (_, w, sent_ns) = self.poller.pending.swap_remove(pos);
        let now_ns = self.host.now_ns();
        match self.read_scrape(num_headers, body_size) {
            Ok((load, lora)) => {
                self.metrics.scrapes_ok.inc();
                self.metrics
                    .scrape_us
                    .record(now_ns.saturating_sub(sent_ns) / 1000);
                let ev = self.router.on_orca(w, &load, now_ns / 1_000_000);
                match lora {
                    Some(r) => {
                        let lev = self.router.on_lora(w, r, now_ns / 1_000_000);
                        self.broadcast(&[ev, lev]);
                    }
                    None => self.broadcast(&[ev]),
                }
                if let Some(f) = self.poller.failing.get_mut(usize::from(w)) {
                    if core::mem::take(f) {
                        let name = self.router.worker_name(w);
                        self.host.log(
                            LogLevel::Info,
                            &format!("kvroute: metrics of worker {name} readable again"),
                        );
                    }
                }
            }
            Err(why) => self.scrape_failed(w, why),
        }
    }

    /// The load a scrape reports and, when adapters are configured, its LoRA adapters.
    fn read_scrape(
        &self,
        num_headers: usize,
        body_size: usize,
    ) -> Result<(OrcaLoad, Option<LoraReport>), &'static str> {
        if num_headers == 0 {
            return Err("no answer (timeout, refused or reset)");
        }
        let status = self
            .host
            .header(MapType::HttpCallResponseHeaders, ":status");
        if status.as_deref() != Some("200") {
            return Err("status other than 200");
        }
        let max = self.router.config().metrics.max_bytes as usize;
        if body_size > max {
            return Err("body longer than metrics.max_bytes");
        }
        let body = self
            .host
            .buffer(BufferType::HttpCallResponseBody, body_size)
            .unwrap_or_default();
        let text = String::from_utf8_lossy(&body);
        let load = prom::parse_load(&text)
            .ok_or("no load metric kvroute knows (llamacpp:, vllm:, sglang:)")?;
        let lora = if self.router.config().lora.adapters.is_empty() {
            None
        } else {
            prom::parse_lora(&text)
        };
        Ok((load, lora))
    }

    fn scrape_failed(&mut self, w: WorkerId, why: &str) {
        self.metrics.scrapes_error.inc();
        if let Some(wm) = self.metrics.worker(w) {
            wm.scrape_errors.inc();
        }
        let n = self.router.config().workers.len();
        if self.poller.failing.len() < n {
            self.poller.failing.resize(n, false);
        }
        if let Some(f) = self.poller.failing.get_mut(usize::from(w)) {
            if !core::mem::replace(f, true) {
                let name = self.router.worker_name(w);
                self.host.log(
                    LogLevel::Warn,
                    &format!("kvroute: scraping the metrics of worker {name} failed: {why}"),
                );
            }
        }
    }

    fn publish_gauges(&self, now: u64) {
        let r = &self.router;
        self.metrics.index_blocks.record(r.index().blocks() as u64);
        self.metrics
            .index_bytes
            .record(r.index().memory_bytes() as u64);
        self.metrics
            .index_probe_giveups
            .record(r.index().probes_given_up());
        self.metrics
            .active_requests
            .record(r.load().active_requests() as u64);
        self.metrics
            .chars_per_token_milli
            .record((r.chars_per_token() * 1000.0) as u64);
        for (i, wm) in self.metrics.workers.iter().enumerate() {
            let Ok(w) = u16::try_from(i) else { break };
            let v = r.worker_view(w, now);
            wm.inflight.record(u64::from(v.inflight));
            wm.prefill_tokens.record(v.prefill_tokens as u64);
            wm.active_blocks.record(v.active_blocks);
            wm.healthy.record(u64::from(v.healthy));
            wm.index_blocks.record(r.index().entries(w) as u64);
            if let Some(rep) = v.report {
                wm.kv_usage_pct
                    .record((f64::from(rep.kv_usage) * 100.0) as u64);
                wm.waiting.record(u64::from(rep.waiting));
            }
        }
    }
}
