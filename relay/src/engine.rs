//! One task per engine: a ZMQ SUB on its KV event stream, sequence tracking, gap repair through
//! its ROUTER replay socket, and application of decoded events to the shared index.
//!
//! vLLM's wire (vllm/distributed/kv_events.py, ZmqEventPublisher): PUB multipart
//! `[topic, seq (8 bytes big-endian, from 0), payload]`. Replay: the ROUTER expects
//! `[identity, "", start_seq (8 bytes big-endian)]`, i.e. a DEALER sends `["", start_seq]`,
//! and answers `["", seq, payload]` for every buffered batch with seq >= start, then
//! `["", -1 (8 bytes, signed), ""]`.

use crate::decode::decode_batch;
use crate::hub::{add, now_ms, Change, EngineSpec, EngineStats, Hub};
use crate::index::{Counts, DeltaBuilder};
use bytes::Bytes;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Timing knobs (tests shorten them).
#[derive(Debug, Clone)]
pub struct EngineOpts {
    /// Longest a replay may take.
    pub replay_timeout: Duration,
    /// Without events for this long, check the engine still listens.
    pub probe_after: Duration,
    /// Without events for this long, open a fresh subscription (and verify the sequence
    /// through a replay), in case the engine restarted unnoticed.
    pub refresh_after: Duration,
}

impl Default for EngineOpts {
    fn default() -> Self {
        EngineOpts {
            replay_timeout: Duration::from_secs(2),
            probe_after: Duration::from_secs(5),
            refresh_after: Duration::from_secs(30),
        }
    }
}

/// Sequence bookkeeping of one engine.
struct Seq {
    /// Last applied seq.
    last: Option<u64>,
    /// Messages at or above this seq but not above `last` are duplicates of a replay.
    dup_floor: u64,
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

/// Runs an engine's subscription forever.
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
            dup_floor: u64::MAX,
        },
        logged_size_mismatch: false,
        decode_errors_logged: 0,
    };
    e.run().await;
}

fn split_frames(msg: ZmqMessage) -> Option<(u64, Bytes)> {
    let mut v = msg.into_vec();
    let payload = v.pop()?;
    let seq = v.pop()?;
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

/// Asks an engine's replay socket for every batch from `from` on.
pub async fn replay(
    endpoint: &str,
    from: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, String> {
    let work = async {
        let mut d = DealerSocket::new();
        d.connect(endpoint).await.map_err(|e| e.to_string())?;
        let mut m = ZmqMessage::from(Bytes::new());
        m.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        d.send(m).await.map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        loop {
            let msg = d.recv().await.map_err(|e| e.to_string())?;
            let (seq, payload) = split_frames(msg).ok_or("malformed replay frame")?;
            if seq == u64::MAX {
                break;
            }
            out.push((seq, payload));
        }
        Ok::<_, String>(out)
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(format!("no end of replay within {timeout:?}")),
    }
}

/// Whether something accepts TCP connections at a `tcp://host:port` endpoint.
async fn probe(endpoint: &str) -> bool {
    let addr = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
    matches!(
        tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

enum Exit {
    /// The engine stopped listening.
    Lost,
    /// Idle for long: re-subscribe.
    Refresh,
}

impl Engine {
    async fn run(&mut self) {
        let mut reconnecting = false;
        loop {
            let mut sub = SubSocket::new();
            let mut monitor = sub.monitor();
            if !reconnecting {
                eprintln!(
                    "kvroute-relay: engine {}: connecting to {}",
                    self.name, self.spec.endpoint
                );
            }
            if let Err(e) = sub.connect(&self.spec.endpoint).await {
                eprintln!(
                    "kvroute-relay: engine {}: cannot connect to {}: {e}; retrying in 1 s",
                    self.name, self.spec.endpoint
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
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
                        "kvroute-relay: engine {}: lost (nothing listens on {}); marked stale, reconnecting",
                        self.name, self.spec.endpoint
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
            None => {
                // First contact: the replay buffer's batches are a suffix of the engine's
                // history, safe to apply onto an empty index.
                let frames = self.try_replay(0).await.unwrap_or_default();
                self.seq.dup_floor = frames.first().map_or(u64::MAX, |f| f.0);
                self.apply_frames(frames, None);
            }
            Some(last) => match self.try_replay(last).await {
                Some(frames) if frames.first().map(|f| f.0) == Some(last) => {
                    // Same engine process (it still buffers our last batch).
                    self.seq.dup_floor = last;
                    self.apply_frames(frames, Some(last));
                }
                Some(frames) => {
                    // Restarted, or too much happened while we were away.
                    self.note_unrepaired("cannot verify the sequence after reconnecting");
                    self.clear();
                    self.seq.last = None;
                    self.seq.dup_floor = frames.first().map_or(u64::MAX, |f| f.0);
                    self.apply_frames(frames, None);
                }
                None => {
                    self.note_unrepaired("no replay to verify the sequence after reconnecting");
                    self.clear();
                    self.seq.last = None;
                }
            },
        }
        self.hub.lock().set_stale(self.worker, false);
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
        let mut st = self.hub.lock();
        let mut d = DeltaBuilder::default();
        if let Some(w) = st.workers.get_mut(self.worker) {
            w.index.clear(&mut d);
        }
        let delta = d.finish();
        st.publish(vec![Change {
            worker: self.worker,
            delta,
        }]);
    }

    async fn receive(&mut self, sub: &mut SubSocket) -> Exit {
        let mut last_rx = Instant::now();
        let mut last_probe = Instant::now();
        let mut last_idle_log: Option<Instant> = None;
        loop {
            match tokio::time::timeout(Duration::from_secs(1), sub.recv()).await {
                Ok(Ok(msg)) => {
                    last_rx = Instant::now();
                    match split_frames(msg) {
                        Some((seq, payload)) => self.on_message(seq, payload).await,
                        None => {
                            add(&self.stats.decode_errors, 1);
                        }
                    }
                }
                Ok(Err(e)) => {
                    eprintln!("kvroute-relay: engine {}: receive failed: {e}", self.name);
                    return Exit::Lost;
                }
                Err(_) => {
                    let idle = last_rx.elapsed();
                    if idle >= self.opts.probe_after
                        && last_probe.elapsed() >= self.opts.probe_after
                    {
                        last_probe = Instant::now();
                        if !probe(&self.spec.endpoint).await {
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
                    if idle >= self.opts.refresh_after {
                        return Exit::Refresh;
                    }
                }
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
            st.publish(vec![Change {
                worker: self.worker,
                delta: d.finish(),
            }]);
        }
        drop(st);
        add(&s.blocks_stored, c.blocks_stored);
        add(&s.blocks_removed, c.blocks_removed);
        add(&s.orphans, c.orphans);
        add(&s.size_mismatch, c.size_mismatch);
        add(&s.bad_events, c.bad_events);
        if c.size_mismatch > 0 && !self.logged_size_mismatch {
            self.logged_size_mismatch = true;
            eprintln!(
                "kvroute-relay: engine {}: blocks with a block size other than --block-size {}; they are not re-keyed (counted in kvroute_relay_block_size_mismatch_total)",
                self.name, self.hub.block_size
            );
        }
    }
}
