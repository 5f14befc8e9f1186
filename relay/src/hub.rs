//! Shared state: every engine's index, its stats, and the broadcast of deltas to streams.

use crate::index::{Delta, EngineIndex};
use crate::share::Share;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::broadcast;

/// One worker's delta, as broadcast to every stream.
#[derive(Debug, Clone)]
pub struct Change {
    pub worker: usize,
    pub delta: Delta,
    /// The engine's timestamp of the batch behind it (unix ns; 0: not from a batch).
    pub engine_ns: u64,
}

/// Counters of one engine (read by /metrics and /health).
#[derive(Default, Debug)]
pub struct EngineStats {
    pub connected: AtomicBool,
    pub batches: AtomicU64,
    pub events: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub blocks_removed: AtomicU64,
    pub gaps_repaired: AtomicU64,
    pub gaps_unrepaired: AtomicU64,
    pub restarts: AtomicU64,
    pub orphans: AtomicU64,
    pub size_mismatch: AtomicU64,
    pub bad_events: AtomicU64,
    pub unknown_events: AtomicU64,
    pub decode_errors: AtomicU64,
    /// Panics of the engine task (restarted by `engine::supervise`).
    pub task_panics: AtomicU64,
    pub last_seq: AtomicU64,
    /// Unix ms of the last batch received, 0 before the first.
    pub last_event_ms: AtomicU64,
}

pub struct Worker {
    pub name: String,
    pub endpoint: String,
    pub replay: Option<String>,
    pub model: String,
    pub index: EngineIndex,
    /// The relay lost this engine (as announced to streams).
    pub stale: bool,
    pub stats: Arc<EngineStats>,
}

pub struct State {
    pub workers: Vec<Worker>,
    pub tx: broadcast::Sender<Arc<Vec<Change>>>,
}

/// Process-wide counters.
#[derive(Default, Debug)]
pub struct HubStats {
    pub streams_open: AtomicU64,
    pub streams_total: AtomicU64,
    pub updates_sent: AtomicU64,
    pub lagged_resnapshots: AtomicU64,
}

pub struct Hub {
    state: Mutex<State>,
    pub block_size: u32,
    pub epoch: u64,
    pub stats: HubStats,
    /// Gateways' decisions shared between streams (and relays, with `--nats`).
    pub share: Arc<Share>,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

pub fn random_epoch() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_ns());
    h.write_u32(std::process::id());
    h.finish() | 1
}

/// Engine definition (from the command line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSpec {
    pub name: String,
    pub endpoint: String,
    pub replay: Option<String>,
    pub model: String,
}

impl Hub {
    pub fn new(block_size: u32, capacity: usize) -> Arc<Hub> {
        let (tx, _) = broadcast::channel(capacity.max(1));
        Arc::new(Hub {
            state: Mutex::new(State {
                workers: Vec::new(),
                tx,
            }),
            block_size,
            epoch: random_epoch(),
            stats: HubStats::default(),
            share: Arc::new(Share::new(random_epoch())),
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers an engine; returns its worker index (existing one if the name is known).
    pub fn add_engine(&self, spec: &EngineSpec) -> (usize, Arc<EngineStats>) {
        let mut st = self.lock();
        if let Some(i) = st.workers.iter().position(|w| w.name == spec.name) {
            let stats = st.workers[i].stats.clone();
            return (i, stats);
        }
        let stats = Arc::new(EngineStats::default());
        st.workers.push(Worker {
            name: spec.name.clone(),
            endpoint: spec.endpoint.clone(),
            replay: spec.replay.clone(),
            model: spec.model.clone(),
            index: EngineIndex::new(&spec.model, self.block_size),
            stale: true,
            stats: stats.clone(),
        });
        (st.workers.len() - 1, stats)
    }
}

impl State {
    /// Broadcasts changes (call with the lock held so snapshots and deltas stay ordered).
    pub fn publish(&self, changes: Vec<Change>) {
        if !changes.is_empty() {
            let _ = self.tx.send(Arc::new(changes));
        }
    }

    pub fn set_stale(&mut self, worker: usize, stale: bool) {
        let Some(w) = self.workers.get_mut(worker) else {
            return;
        };
        if w.stale == stale {
            return;
        }
        w.stale = stale;
        let delta = Delta {
            stale,
            ..Delta::default()
        };
        self.publish(vec![Change {
            worker,
            delta,
            engine_ns: 0,
        }]);
    }

    pub fn indexed_blocks(&self) -> usize {
        self.workers.iter().map(|w| w.index.blocks.len()).sum()
    }

    pub fn state_bytes(&self) -> usize {
        self.workers.iter().map(|w| w.index.blocks.bytes()).sum()
    }
}

pub fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Relaxed);
}
