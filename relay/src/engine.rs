//! One task per engine: a ZMQ SUB on its KV event stream, sequence tracking, gap repair through
//! its ROUTER replay socket, and application of decoded events to the shared index.
//!
//! vLLM's wire (vllm/distributed/kv_events.py, ZmqEventPublisher): PUB multipart
//! `[topic, seq (8 bytes big-endian, from 0), payload]`. Replay: the ROUTER expects
//! `[identity, "", start_seq (8 bytes big-endian)]`, i.e. a DEALER sends `["", start_seq]`,
//! and answers `["", seq, payload]` for every buffered batch with seq >= start, then
//! `["", -1 (8 bytes, signed), ""]`.

use crate::clock::now_ms;
use crate::counter::add;
use crate::decode::decode_batch;
use crate::hub::{Change, EngineSpec, EngineStats, Hub};
use crate::index::{Counts, DeltaBuilder};
use crate::replay::{judge, payload_hash, replay, start_probe, ProbeFuture, Verdict};
use crate::zmtp::Dealer;
use bytes::Bytes;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket};

/// Timing knobs (tests shorten them).
#[derive(Debug, Clone)]
pub struct EngineOpts {
    /// Longest a replay may take.
    pub replay_timeout: Duration,
    /// Without events for this long, check the engine's publisher still listens.
    pub probe_after: Duration,
    /// Engines without a replay socket (or with probing off): without events for this long,
    /// open a fresh subscription, in case the engine restarted unnoticed.
    pub refresh_after: Duration,
    /// Probe period of the replay socket (`--probe-ms`); zero turns probing off.
    pub probe_interval: Duration,
    /// A probe without its END marker within this long has failed.
    pub probe_timeout: Duration,
    /// This many probes failing in a row: the engine is lost (stale).
    pub probe_failures: u32,
    /// A batch the replay socket showed but the subscription has not delivered this long
    /// after: the subscription is dead, re-subscribe.
    pub behind_grace: Duration,
    /// Test hook: when set, the engine task panics (and clears it) at its next wake-up.
    #[doc(hidden)]
    pub inject_panic: Option<Arc<AtomicBool>>,
}

impl Default for EngineOpts {
    fn default() -> Self {
        EngineOpts {
            replay_timeout: Duration::from_secs(2),
            probe_after: Duration::from_secs(5),
            refresh_after: Duration::from_secs(30),
            probe_interval: Duration::from_millis(50),
            probe_timeout: Duration::from_millis(500),
            probe_failures: 3,
            behind_grace: Duration::from_secs(1),
            inject_panic: None,
        }
    }
}

/// Sequence bookkeeping of one engine.
struct Seq {
    /// Last applied seq.
    last: Option<u64>,
    /// xxh3 of the payload of batch `last`.
    hash: u64,
    /// Messages at or above this seq but not above `last` are duplicates of a replay.
    dup_floor: u64,
    /// Bumped whenever the index is cleared: a probe started before is moot.
    generation: u64,
}

struct Engine {
    hub: Arc<Hub>,
    worker: usize,
    name: String,
    stats: Arc<EngineStats>,
    spec: EngineSpec,
    opts: EngineOpts,
    seq: Seq,
    logged_size_mismatch: bool,
    decode_errors_logged: u64,
}

/// Runs an engine's subscription forever (in the calling task: a panic ends it; see
/// [`supervise`]).
pub async fn run(hub: Arc<Hub>, spec: EngineSpec, opts: EngineOpts) {
    let (worker, stats) = hub.add_engine(&spec);
    let mut e = Engine {
        hub,
        worker,
        name: spec.name.clone(),
        stats,
        spec,
        opts,
        seq: Seq {
            last: None,
            hash: 0,
            dup_floor: u64::MAX,
            generation: 0,
        },
        logged_size_mismatch: false,
        decode_errors_logged: 0,
    };
    e.run().await;
}

/// Runs [`run`] in its own task and restarts it when it panics (zeromq 0.4 has `todo!()`s on
/// some socket errors): the panic is logged and counted, the worker announced stale and
/// cleared, and the task restarted after a backoff (100 ms doubling to 10 s, back to 100 ms
/// after a minute without panics). Only effective where panics unwind: a binary built with
/// `panic = "abort"` (the workspace's release profile) dies instead; build the relay with
/// `--profile relay`.
pub async fn supervise(hub: Arc<Hub>, spec: EngineSpec, opts: EngineOpts) {
    let (worker, stats) = hub.add_engine(&spec);
    let mut backoff = Duration::from_millis(100);
    loop {
        let started = Instant::now();
        let task = tokio::spawn(run(hub.clone(), spec.clone(), opts.clone()));
        let why = match task.await {
            Ok(()) => "ended".to_owned(),
            Err(e) if e.is_panic() => {
                add(&stats.task_panics, 1);
                let p = e.into_panic();
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".to_owned());
                format!("panicked ({msg})")
            }
            Err(_) => return, // cancelled: the runtime is shutting down
        };
        if started.elapsed() >= Duration::from_secs(60) {
            backoff = Duration::from_millis(100);
        }
        eprintln!(
            "kvroute-relay: engine {}: task {why}; marked stale and cleared, restarting in {} ms",
            spec.name,
            backoff.as_millis()
        );
        stats.connected.store(false, Relaxed);
        {
            let mut st = hub.lock();
            st.set_stale(worker, true);
            clear_worker(&mut st, worker);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

fn clear_worker(st: &mut crate::hub::State, worker: usize) {
    let mut d = DeltaBuilder::default();
    let mut stale = false;
    if let Some(w) = st.workers.get_mut(worker) {
        w.index.clear(&mut d);
        stale = w.stale;
    }
    // A live `cleared` without `stale` tells gateways the worker is described again.
    let mut delta = d.finish();
    delta.stale = stale;
    st.publish(vec![Change {
        worker,
        delta,
        engine_ns: 0,
    }]);
}

fn split_frames(msg: zeromq::ZmqMessage) -> Option<(u64, Bytes)> {
    let mut v = msg.into_vec();
    let payload = v.pop()?;
    let seq = v.pop()?;
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

/// Whether something accepts TCP connections at a `tcp://host:port` endpoint.
async fn reachable(endpoint: &str, timeout: Duration) -> bool {
    let addr = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
    matches!(
        tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

enum Exit {
    /// The engine stopped listening.
    Lost,
    /// Re-subscribe (idle for long, a restart, or a subscription that stopped delivering).
    Refresh,
}

impl Engine {
    fn probing(&self) -> bool {
        self.spec.replay.is_some() && !self.opts.probe_interval.is_zero()
    }

    fn check_injected_panic(&self) {
        if let Some(flag) = &self.opts.inject_panic {
            if flag.swap(false, SeqCst) {
                panic!("injected panic (test hook)");
            }
        }
    }

    /// Waits until the publisher (and the replay socket, if any) accept connections: the
    /// zeromq crate's `connect` backs off for seconds on a refused connection.
    async fn wait_reachable(&self) {
        let every = if self.probing() {
            self.opts.probe_interval
        } else {
            Duration::from_secs(1)
        };
        let timeout = self.opts.probe_timeout.max(Duration::from_millis(100));
        let mut logged = false;
        loop {
            self.check_injected_panic();
            let up = reachable(&self.spec.endpoint, timeout).await
                && match &self.spec.replay {
                    Some(r) => reachable(r, timeout).await,
                    None => true,
                };
            if up {
                return;
            }
            if !logged {
                logged = true;
                eprintln!(
                    "kvroute-relay: engine {}: not reachable at {}; retrying every {} ms",
                    self.name,
                    self.spec.endpoint,
                    every.as_millis()
                );
            }
            tokio::time::sleep(every).await;
        }
    }

    async fn run(&mut self) {
        let mut reconnecting = false;
        loop {
            self.wait_reachable().await;
            let mut sub = SubSocket::new();
            let mut monitor = sub.monitor();
            if !reconnecting {
                eprintln!(
                    "kvroute-relay: engine {}: connecting to {}",
                    self.name, self.spec.endpoint
                );
            }
            let connect_timeout = Duration::from_secs(2);
            match tokio::time::timeout(connect_timeout, sub.connect(&self.spec.endpoint)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    eprintln!(
                        "kvroute-relay: engine {}: cannot connect to {}: {e}; retrying in 1 s",
                        self.name, self.spec.endpoint
                    );
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                Err(_) => continue, // it went away again
            }
            if let Err(e) = sub.subscribe("").await {
                eprintln!("kvroute-relay: engine {}: subscribe failed: {e}", self.name);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            while let Ok(ev) = monitor.try_recv() {
                if let SocketEvent::Connected(ep, _) = ev {
                    if !reconnecting {
                        eprintln!("kvroute-relay: engine {}: connected to {ep}", self.name);
                    }
                }
            }
            self.stats.connected.store(true, Relaxed);
            self.resync_after_connect().await;
            let exit = self.receive(&mut sub).await;
            drop(sub);
            match exit {
                Exit::Lost => {
                    eprintln!(
                        "kvroute-relay: engine {}: lost; marked stale, reconnecting",
                        self.name
                    );
                    self.stats.connected.store(false, Relaxed);
                    self.hub.lock().set_stale(self.worker, true);
                    reconnecting = false;
                }
                Exit::Refresh => reconnecting = true,
            }
        }
    }

    /// After (re)connecting: learn what we missed through the replay socket.
    async fn resync_after_connect(&mut self) {
        match self.seq.last {
            None => self.replay_from_start().await,
            Some(last) => match self.try_replay(last).await {
                Some(frames) => match judge(Some((last, self.seq.hash)), &frames) {
                    Verdict::Same { .. } => {
                        // Same engine process (it still buffers our last batch).
                        self.seq.dup_floor = last;
                        self.apply_frames(frames, Some(last));
                    }
                    Verdict::Changed { restart, why } => {
                        self.changed(restart, &why);
                        self.replay_from_start().await;
                    }
                },
                None => {
                    self.note_unrepaired("no replay to verify the sequence after reconnecting");
                    self.clear();
                    self.seq.last = None;
                }
            },
        }
        self.hub.lock().set_stale(self.worker, false);
    }

    /// First contact (or after a clear): the replay buffer's batches are a suffix of the
    /// engine's history, safe to apply onto an empty index.
    async fn replay_from_start(&mut self) {
        let frames = self.try_replay(0).await.unwrap_or_default();
        self.seq.dup_floor = frames.first().map_or(u64::MAX, |f| f.0);
        self.apply_frames(frames, None);
    }

    /// Our last batch is gone from the engine: announce cleared, forget the sequence.
    fn changed(&mut self, restart: bool, why: &str) {
        if restart {
            add(&self.stats.restarts, 1);
            eprintln!(
                "kvroute-relay: engine {}: restarted ({why}); announcing cleared",
                self.name
            );
        } else {
            self.note_unrepaired(&format!("cannot verify the sequence: {why}"));
        }
        self.clear();
        self.seq.last = None;
        self.seq.dup_floor = u64::MAX;
    }

    async fn try_replay(&self, from: u64) -> Option<Vec<(u64, Bytes)>> {
        let ep = self.spec.replay.as_deref()?;
        match replay(ep, from, self.opts.replay_timeout).await {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!(
                    "kvroute-relay: engine {}: replay from {from} failed: {e}",
                    self.name
                );
                None
            }
        }
    }

    /// Applies replayed batches above `after` in order; stops at a hole.
    fn apply_frames(&mut self, frames: Vec<(u64, Bytes)>, after: Option<u64>) {
        let mut next = after.map(|a| a.wrapping_add(1));
        for (seq, payload) in frames {
            if after.is_some_and(|a| seq <= a) {
                continue;
            }
            if next.is_some_and(|n| seq != n) {
                break;
            }
            self.apply_batch(seq, &payload);
            next = Some(seq.wrapping_add(1));
        }
    }

    fn note_unrepaired(&self, why: &str) {
        add(&self.stats.gaps_unrepaired, 1);
        eprintln!(
            "kvroute-relay: engine {}: {why}; announcing cleared (blocks may have been missed)",
            self.name
        );
    }

    fn clear(&mut self) {
        self.seq.generation += 1;
        clear_worker(&mut self.hub.lock(), self.worker);
    }

    /// Receives live batches; with a replay socket, probes it every `probe_interval` (one
    /// probe outstanding at a time, on a kept connection).
    async fn receive(&mut self, sub: &mut SubSocket) -> Exit {
        let probing = self.probing();
        let replay_ep = self.spec.replay.clone().unwrap_or_default();
        let mut conn: Option<Dealer> = None;
        let mut inflight: Option<ProbeFuture> = None;
        let mut next_probe = Instant::now();
        let mut failures = 0u32;
        // (a seq the replay socket showed, when): the subscription must deliver it.
        let mut behind: Option<(u64, Instant)> = None;
        let mut last_rx = Instant::now();
        let mut last_tcp_probe = Instant::now();
        let mut last_idle_log: Option<Instant> = None;
        let mut slow_tick = Instant::now() + Duration::from_secs(1);
        loop {
            self.check_injected_panic();
            if probing && inflight.is_none() && Instant::now() >= next_probe {
                let last = self.seq.last.map(|l| (l, self.seq.hash));
                inflight = Some(start_probe(
                    conn.take(),
                    replay_ep.clone(),
                    self.seq.generation,
                    last,
                    self.opts.probe_timeout,
                ));
            }
            let wake = if probing && inflight.is_none() {
                next_probe.min(slow_tick)
            } else {
                slow_tick
            };
            let probe = async {
                match inflight.as_mut() {
                    Some(f) => f.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = sub.recv() => match r {
                    Ok(msg) => {
                        last_rx = Instant::now();
                        match split_frames(msg) {
                            Some((seq, payload)) => self.on_message(seq, payload).await,
                            None => add(&self.stats.decode_errors, 1),
                        }
                    }
                    Err(e) => {
                        eprintln!("kvroute-relay: engine {}: receive failed: {e}", self.name);
                        return Exit::Lost;
                    }
                },
                done = probe => {
                    inflight = None;
                    next_probe = Instant::now() + self.opts.probe_interval;
                    conn = done.conn;
                    match done.result {
                        Err(e) => {
                            failures += 1;
                            if failures >= self.opts.probe_failures {
                                eprintln!(
                                    "kvroute-relay: engine {}: {failures} probes of {replay_ep} failed (last: {e})",
                                    self.name
                                );
                                return Exit::Lost;
                            }
                        }
                        Ok(frames) => {
                            failures = 0;
                            if done.generation != self.seq.generation {
                                continue; // judged against a state since cleared
                            }
                            match judge(done.last, &frames) {
                                Verdict::Changed { restart, why } => {
                                    self.changed(restart, &why);
                                    return Exit::Refresh;
                                }
                                Verdict::Same { newest } => {
                                    let last = self.seq.last;
                                    if behind.is_some_and(|(t, _)| last.is_some_and(|l| l >= t)) {
                                        behind = None;
                                    }
                                    if let Some(n) = newest {
                                        if behind.is_none() && last.is_none_or(|l| n > l) {
                                            behind = Some((n, Instant::now()));
                                        }
                                    }
                                    if let Some((t, since)) = behind {
                                        if since.elapsed() >= self.opts.behind_grace {
                                            eprintln!(
                                                "kvroute-relay: engine {}: the subscription did not deliver batch {t} within {} ms; re-subscribing",
                                                self.name,
                                                self.opts.behind_grace.as_millis()
                                            );
                                            return Exit::Refresh;
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                _ = tokio::time::sleep_until(wake.into()) => {}
            }
            if Instant::now() < slow_tick {
                continue;
            }
            slow_tick = Instant::now() + Duration::from_secs(1);
            let idle = last_rx.elapsed();
            if idle >= self.opts.probe_after && last_tcp_probe.elapsed() >= self.opts.probe_after {
                last_tcp_probe = Instant::now();
                if !reachable(&self.spec.endpoint, Duration::from_secs(1)).await {
                    eprintln!(
                        "kvroute-relay: engine {}: nothing listens on {}",
                        self.name, self.spec.endpoint
                    );
                    return Exit::Lost;
                }
                if last_idle_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    last_idle_log = Some(Instant::now());
                    eprintln!(
                        "kvroute-relay: engine {}: no events for {} s (still listening)",
                        self.name,
                        idle.as_secs()
                    );
                }
            }
            if !probing && idle >= self.opts.refresh_after {
                return Exit::Refresh;
            }
        }
    }

    async fn on_message(&mut self, seq: u64, payload: Bytes) {
        match self.seq.last {
            None => self.apply_batch(seq, &payload),
            Some(last) if seq == last.wrapping_add(1) => {
                // In order from the live stream: no duplicates of a replay can follow.
                self.seq.dup_floor = u64::MAX;
                self.apply_batch(seq, &payload);
            }
            Some(last) if seq > last => {
                // Gap: fetch last+1.. from the replay buffer.
                let want = last + 1;
                match self.try_replay(want).await {
                    Some(frames) if frames.first().map(|f| f.0) == Some(want) => {
                        add(&self.stats.gaps_repaired, 1);
                        eprintln!(
                            "kvroute-relay: engine {}: gap {want}..{} repaired by replay",
                            self.name,
                            seq - 1
                        );
                        self.seq.dup_floor = want;
                        self.apply_frames(frames, Some(last));
                    }
                    other => {
                        self.note_unrepaired(&format!(
                            "gap {want}..{} not covered by replay",
                            seq - 1
                        ));
                        self.clear();
                        self.seq.last = None;
                        self.seq.dup_floor = want;
                        if let Some(frames) = other {
                            self.apply_frames(frames, None);
                        }
                    }
                }
                match self.seq.last {
                    Some(l) if seq <= l => {}
                    Some(l) if seq != l + 1 => {
                        // Replay ended before this message: the hole remains.
                        self.note_unrepaired("replay ended before the live stream");
                        self.clear();
                        self.seq.last = None;
                        self.apply_batch(seq, &payload);
                    }
                    _ => {
                        self.seq.dup_floor = u64::MAX;
                        self.apply_batch(seq, &payload);
                    }
                }
            }
            Some(_) if seq >= self.seq.dup_floor => {} // already applied from a replay
            Some(last) => {
                // The sequence went backwards: the engine restarted.
                add(&self.stats.restarts, 1);
                eprintln!(
                    "kvroute-relay: engine {}: sequence went back from {last} to {seq}: engine restarted; announcing cleared",
                    self.name
                );
                self.clear();
                self.seq.last = None;
                self.seq.dup_floor = u64::MAX;
                if seq > 0 {
                    if let Some(frames) = self.try_replay(0).await {
                        self.seq.dup_floor = 0;
                        self.apply_frames(frames, None);
                    }
                }
                match self.seq.last {
                    Some(l) if seq <= l => {}
                    _ => self.apply_batch(seq, &payload),
                }
            }
        }
    }

    /// Decodes one batch and applies it to the index; a batch that does not decode counts as
    /// lost events (announces cleared).
    fn apply_batch(&mut self, seq: u64, payload: &[u8]) {
        self.seq.last = Some(seq);
        self.seq.hash = payload_hash(payload);
        let s = &self.stats;
        s.last_seq.store(seq, Relaxed);
        s.last_event_ms.store(now_ms(), Relaxed);
        add(&s.batches, 1);
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                add(&s.decode_errors, 1);
                if self.decode_errors_logged < 10 {
                    self.decode_errors_logged += 1;
                    eprintln!(
                        "kvroute-relay: engine {}: batch {seq} does not decode ({e}); announcing cleared",
                        self.name
                    );
                }
                self.clear();
                return;
            }
        };
        add(&s.events, batch.events.len() as u64);
        add(&s.unknown_events, u64::from(batch.unknown_events));
        let mut c = Counts::default();
        let mut d = DeltaBuilder::default();
        let mut st = self.hub.lock();
        if let Some(w) = st.workers.get_mut(self.worker) {
            for ev in &batch.events {
                w.index.apply(ev, &mut d, &mut c);
            }
        }
        if !d.is_empty() {
            // vLLM stamps a batch with time.time() when it is made.
            let engine_ns = if batch.ts.is_finite() && batch.ts > 0.0 {
                (batch.ts * 1e9) as u64
            } else {
                0
            };
            st.publish(vec![Change {
                worker: self.worker,
                delta: d.finish(),
                engine_ns,
            }]);
        }
        drop(st);
        add(&s.blocks_stored, c.blocks_stored);
        add(&s.blocks_removed, c.blocks_removed);
        add(&s.orphans, c.orphans);
        add(&s.size_mismatch, c.size_mismatch);
        add(&s.bad_events, c.bad_events);
        add(&s.evicted, c.evicted);
        if c.size_mismatch > 0 && !self.logged_size_mismatch {
            self.logged_size_mismatch = true;
            eprintln!(
                "kvroute-relay: engine {}: blocks with a block size other than --block-size {}; they are not re-keyed (counted in kvroute_relay_block_size_mismatch_total)",
                self.name, self.hub.block_size
            );
        }
    }
}
