//! Shared state: every engine's index, its stats, and the broadcast of deltas to streams.

use crate::clock::random_epoch;
use crate::index::{Delta, EngineIndex};
use crate::share::Share;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};
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
    /// Blocks evicted because the engine's index was full.
    pub evicted: AtomicU64,
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
    /// Streams refused: over `--max-streams-per-client` / over `--max-streams`.
    pub streams_refused_per_client: AtomicU64,
    pub streams_refused_total: AtomicU64,
    /// Hashes left out of snapshots by `--max-snapshot-blocks`.
    pub snapshot_truncated: AtomicU64,
}

/// Bounds on what engines and clients can make the relay hold (README, "Limits").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// An engine's KV cache capacity in blocks when its `--engine` has no `kv_blocks=`
    /// (`--kv-blocks`).
    pub kv_blocks: u64,
    /// An engine's index holds at most `kv_blocks x index_factor` blocks (`--index-factor`):
    /// room for the engine's events to run ahead of its evictions, never unbounded.
    pub index_factor: u64,
    /// Watch streams open at once (`--max-streams`).
    pub max_streams: usize,
    /// Watch streams open at once from one IP address (`--max-streams-per-client`).
    pub max_streams_per_client: usize,
    /// Hashes in one snapshot over all engines (`--max-snapshot-blocks`).
    pub max_snapshot_blocks: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            kv_blocks: 131_072,
            index_factor: 2,
            max_streams: 256,
            max_streams_per_client: 16,
            max_snapshot_blocks: 4 << 20,
        }
    }
}

impl Limits {
    /// The index bound of an engine.
    pub fn max_blocks(&self, spec: &EngineSpec) -> usize {
        let b = spec
            .kv_blocks
            .unwrap_or(self.kv_blocks)
            .saturating_mul(self.index_factor);
        usize::try_from(b).unwrap_or(usize::MAX)
    }
}

/// Open Watch streams, in total and per client address.
#[derive(Default, Debug)]
pub struct StreamGate {
    open: Mutex<(usize, HashMap<Option<IpAddr>, usize>)>,
}

/// Why a stream was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    PerClient,
    Total,
}

/// One open stream's place; released when dropped.
#[derive(Debug)]
pub struct StreamSlot {
    gate: Arc<StreamGate>,
    client: Option<IpAddr>,
}

impl StreamGate {
    pub fn open(
        self: &Arc<Self>,
        client: Option<IpAddr>,
        limits: &Limits,
    ) -> Result<StreamSlot, Refused> {
        let mut g = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if g.0 >= limits.max_streams {
            return Err(Refused::Total);
        }
        let n = g.1.entry(client).or_insert(0);
        if *n >= limits.max_streams_per_client {
            return Err(Refused::PerClient);
        }
        *n += 1;
        g.0 += 1;
        Ok(StreamSlot {
            gate: self.clone(),
            client,
        })
    }

    /// Streams open from `client`.
    pub fn open_from(&self, client: Option<IpAddr>) -> usize {
        let g = self.open.lock().unwrap_or_else(|p| p.into_inner());
        g.1.get(&client).copied().unwrap_or(0)
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut g = self.gate.open.lock().unwrap_or_else(|p| p.into_inner());
        g.0 = g.0.saturating_sub(1);
        if let Some(n) = g.1.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                g.1.remove(&self.client);
            }
        }
    }
}

pub struct Hub {
    state: Mutex<State>,
    pub block_size: u32,
    pub epoch: u64,
    pub stats: HubStats,
    /// Gateways' decisions shared between streams (and relays, with `--nats`).
    pub share: Arc<Share>,
    /// Who may open a Watch stream (`--token-file`).
    pub auth: crate::auth::Auth,
    pub limits: Limits,
    pub streams: Arc<StreamGate>,
}

/// Engine definition (from the command line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSpec {
    pub name: String,
    pub endpoint: String,
    pub replay: Option<String>,
    pub model: String,
    /// The engine's KV cache capacity in blocks (`kv_blocks=`; default `--kv-blocks`).
    pub kv_blocks: Option<u64>,
}

impl Hub {
    pub fn new(block_size: u32, capacity: usize) -> Arc<Hub> {
        Hub::with_limits(block_size, capacity, Limits::default())
    }

    pub fn with_limits(block_size: u32, capacity: usize, limits: Limits) -> Arc<Hub> {
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
            auth: crate::auth::Auth::default(),
            limits,
            streams: Arc::default(),
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
            index: EngineIndex::with_max_blocks(
                &spec.model,
                self.block_size,
                self.limits.max_blocks(spec),
            ),
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

    /// Per worker: name, stale, and its hashes (parents first) for a snapshot of at most
    /// `max` hashes in all; the budget left by small workers goes to larger ones. Returns
    /// the hashes left out too.
    pub fn snapshot_parts(&self, max: usize) -> (Vec<(String, bool, Vec<u64>)>, usize) {
        let mut order: Vec<usize> = (0..self.workers.len()).collect();
        order.sort_by_key(|&i| self.workers.get(i).map_or(0, |w| w.index.blocks.len()));
        let mut budget = vec![0usize; self.workers.len()];
        let mut left = max;
        for (k, &i) in order.iter().enumerate() {
            let share = left / (order.len() - k);
            let len = self.workers.get(i).map_or(0, |w| w.index.blocks.len());
            budget[i] = len.min(share);
            left -= budget[i];
        }
        let mut cut = 0;
        let parts = self
            .workers
            .iter()
            .zip(budget)
            .map(|(w, b)| {
                cut += w.index.blocks.len() - b;
                (w.name.clone(), w.stale, w.index.blocks.snapshot_at_most(b))
            })
            .collect();
        (parts, cut)
    }

    pub fn state_bytes(&self) -> usize {
        self.workers.iter().map(|w| w.index.blocks.bytes()).sum()
    }
}
