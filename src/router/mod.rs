//! The routing engine of one Envoy worker thread: its replica of the prefix index and load
//! table, and the request lifecycle (route, prefill done, finish, feedback) expressed as
//! events, so the same code applies local decisions and those replicated from other threads.
//!
//! One file per part of that lifecycle: `route` (a request in, a decision out), `pool` (the
//! candidates it scores), `apply` (events into the tables, and housekeeping), `lifecycle`
//! (what the answer tells), `engine` (precise mode: the engines' own events), `peers`
//! (other threads' and gateways' requests) and `decision` (what routing returns).

mod apply;
mod decision;
mod engine;
mod lifecycle;
mod peers;
mod pool;
mod route;
#[cfg(test)]
mod testutil;

pub use decision::{Decision, Fallback, RouteResult, UsageOutcome};

use crate::calibrate::Calibrator;
use crate::config::{Config, Role};
use crate::family::Families;
use crate::ids::{mix, RequestId, WorkerId};
use crate::index::{Pending, PrefixIndex, Speculative};
use crate::ladder::Sketch;
use crate::load::{LoadParams, LoadTable, WorkerView};
use crate::lora::Adapters;
use crate::rng::Rng;
use crate::select::SelectParams;
use crate::twins::Twins;
use std::collections::VecDeque;

/// An engine-fed worker's cache as its engine reports it. The index's entries are no measure
/// of how full it is: a text pick the engine reported is held there twice, under its token and
/// its text blocks.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct EngineCache {
    /// Blocks stored less blocks removed (as far as the index took them).
    pub held: u32,
    /// Blocks it held when it last evicted (an engine evicts only when it needs the room):
    /// its real size, where that is less than the configured `kv_blocks`. 0 before any.
    pub full_at: u32,
}

pub struct Router {
    cfg: Config,
    sel: SelectParams,
    decode_pool: Vec<WorkerId>,
    prefill_pool: Vec<WorkerId>,
    index: PrefixIndex,
    load: LoadTable,
    rng: Rng,
    /// Calibrated from usage; the hashing block length stays on the configured value so
    /// calibration never changes block hashes.
    chars_per_token: f64,
    /// Per-upstream calibration state behind `chars_per_token`.
    calib: Calibrator,
    origin: u64,
    seq: u64,
    /// Routed prompts not yet confirmed by a successful first byte: seen by lookups, kept out
    /// of the index (so a rejected request evicts nothing).
    speculative: Speculative,
    /// Local decisions not yet in `speculative`: (request, its blocks).
    pending: Vec<(RequestId, Pending)>,
    /// Per worker: kvroute-relay streams this engine's own KV events (precise mode), so the
    /// index follows the engine and confirmed picks stay speculative until it reports them.
    engine_fed: Vec<bool>,
    /// Per engine-fed worker: what its engine reports holding (see [`EngineCache`]).
    engine_blocks: Vec<EngineCache>,
    /// Confirmed requests on engine-fed workers, kept speculative until the engine's events
    /// have had time to arrive: (drop at ms, request).
    confirmed: VecDeque<(u64, RequestId)>,
    /// This VM's recent requests by prefix family and worker (the hot-spot term's focus).
    families: Families,
    /// Streams routed whose client asked for usage (which of them are read for it).
    usage_streams: u64,
    /// Some worker serves only listed models: pools are filtered by the request's model.
    model_lists: bool,
    /// Text blocks -> the engine blocks they end in (`tokenize` answers, see `twins`).
    twins: Twins,
    /// Block hashes of recent requests, this VM's and (replicated) every other's: the
    /// ladder's `workload` rung.
    sketch: Sketch,
    /// LoRA adapters each worker holds, as picks and metrics tell.
    adapters: Adapters,
}

/// Streams with usage a VM reads in full before sampling (`limits.usage_read_every`): the
/// calibration's per-worker averages start from these.
pub const USAGE_WARMUP: u64 = 64;

impl Router {
    /// `origin` distinguishes this replica's request ids from other threads' (its low 32
    /// bits go into the top of every id: the replication member id, unique for 2^32 VM
    /// creations; the low 32 bits count this VM's requests, and wrap only after 2^32 of them,
    /// long after the earlier ones with the same id have ended or expired).
    /// The tables' hash key is derived from `seed`; see `with_hash_key`.
    pub fn new(cfg: Config, origin: u64, seed: u64) -> Self {
        Self::with_hash_key(cfg, origin, seed, mix(seed ^ 0x6a09_e667_f3bc_c908))
    }

    /// `hash_key`: per-process secret for the index and load tables' hashing (hash
    /// flooding); the filter takes it from the host's clock at configuration, apart from a
    /// configured `seed` (which may be known).
    pub fn with_hash_key(cfg: Config, origin: u64, seed: u64, hash_key: u64) -> Self {
        let sel = SelectParams::from_config(&cfg);
        let params = LoadParams {
            hash_key,
            ..LoadParams::from_config(&cfg)
        };
        let mut index = PrefixIndex::with_key(cfg.index.ttl_ms, hash_key);
        let mut decode_pool = Vec::new();
        let mut prefill_pool = Vec::new();
        for (i, w) in cfg.workers.iter().enumerate() {
            let Ok(id) = WorkerId::try_from(i) else { break };
            index.set_capacity(id, cfg.kv_blocks(w));
            match w.role {
                Role::Prefill => prefill_pool.push(id),
                Role::Both | Role::Decode => decode_pool.push(id),
            }
        }
        // Size the hash table up front: growing it rehashes every entry inside one request.
        let total: u64 = cfg
            .workers
            .iter()
            .map(|w| u64::from(cfg.kv_blocks(w)))
            .sum();
        index.reserve(usize::try_from(total.min(1 << 20)).unwrap_or(1 << 20));
        let mut load = LoadTable::new(cfg.workers.len(), params);
        for (i, w) in cfg.workers.iter().enumerate() {
            if let Ok(id) = WorkerId::try_from(i) {
                load.set_speed(id, w.speed);
            }
        }
        let sketch = Sketch::for_fleet(total, hash_key.rotate_left(7) ^ 0x5851_f42d_4c95_7f2d);
        let chars_per_token = cfg.chars_per_token;
        let cfg_model_lists = cfg.has_model_lists();
        let calib = Calibrator::new(cfg.workers.len());
        let adapters = Adapters::new(
            cfg.workers.len(),
            cfg.lora.max_loras,
            cfg.load.request_ttl_ms,
        );
        let families = Families::new(
            cfg.workers.len(),
            cfg.scoring.cache_balance_half_life_ms,
            hash_key,
        );
        Router {
            cfg,
            sel,
            decode_pool,
            prefill_pool,
            index,
            load,
            rng: Rng::new(seed),
            chars_per_token,
            calib,
            origin: (origin & 0xFFFF_FFFF) << 32,
            seq: 0,
            speculative: Speculative::new(hash_key),
            pending: Vec::new(),
            engine_fed: Vec::new(),
            engine_blocks: Vec::new(),
            confirmed: VecDeque::new(),
            adapters,
            families,
            usage_streams: 0,
            model_lists: cfg_model_lists,
            twins: Twins::new(hash_key ^ 0x7477_696e),
            sketch,
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    pub fn load(&self) -> &LoadTable {
        &self.load
    }

    /// Recent requests' blocks (the reuse ladder's `workload` rung).
    pub fn sketch(&self) -> &Sketch {
        &self.sketch
    }

    pub fn chars_per_token(&self) -> f64 {
        self.chars_per_token
    }

    pub fn worker_view(&self, w: WorkerId, now_ms: u64) -> WorkerView {
        self.load.view(w, now_ms, self.cfg.busy.report_max_age_ms)
    }

    pub fn adapters(&self) -> &Adapters {
        &self.adapters
    }

    pub fn worker_name(&self, w: WorkerId) -> &str {
        self.cfg
            .workers
            .get(usize::from(w))
            .map(|c| c.name.as_str())
            .unwrap_or("")
    }

    pub fn worker_cluster(&self, w: WorkerId) -> &str {
        self.cfg
            .workers
            .get(usize::from(w))
            .map(|c| c.cluster_name())
            .unwrap_or("")
    }

    pub fn worker_endpoint(&self, w: WorkerId) -> Option<&str> {
        self.cfg
            .workers
            .get(usize::from(w))
            .and_then(|c| c.endpoint.as_deref())
    }
}
