//! Per-worker load as the router predicts it, corrected by what workers report.
//!
//! The load is charged at pick time (so a burst of identical requests sees its own earlier
//! picks and spreads), the prefill part is released at the first response byte, the rest when
//! the request ends. Every active entry carries an expiry, because a lost response or a dead
//! VM would otherwise leak load forever.

use crate::config::Config;
use crate::ids::{KeyedState, RequestId, WorkerId};
use hashbrown::hash_map::Entry;
use hashbrown::{HashMap, HashSet};
use std::collections::VecDeque;

/// What a worker told us about itself (ORCA `endpoint-load-metrics`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    pub kv_usage: f32,
    pub waiting: u32,
    pub running: Option<u32>,
    pub at_ms: u64,
}

/// A routing decision to charge; replicated as `Event::Routed`.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRequest {
    pub id: RequestId,
    /// Worker that holds the KV blocks while the request decodes.
    pub worker: WorkerId,
    /// Worker that computes the prefill when it is not `worker` (disaggregation).
    pub prefill_worker: Option<WorkerId>,
    /// Hashes of the prompt's full blocks.
    pub blocks: Vec<u64>,
    /// Leading blocks already cached on the prefill side.
    pub cached_blocks: u32,
    /// Blocks beyond the hashed ones (partial tail, expected output); never shared.
    pub tail_blocks: u32,
    /// Prompt tokens the prefill worker has to compute.
    pub prefill_tokens: u32,
    pub now_ms: u64,
    /// The LoRA adapter the request uses (`crate::lora::adapter_id`), 0 for none.
    pub adapter: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadParams {
    pub request_ttl_ms: u64,
    pub prefill_decay: bool,
    pub prefill_tokens_per_s: f64,
    pub prefill_overhead_ms: u64,
    pub staged_decode: bool,
    pub fresh_half_life_ms: u64,
    /// Secret key of the block maps' hashing (hash flooding); the adapter supplies it.
    pub hash_key: u64,
}

impl LoadParams {
    pub fn from_config(cfg: &Config) -> Self {
        LoadParams {
            request_ttl_ms: cfg.load.request_ttl_ms,
            prefill_decay: cfg.load.prefill_decay,
            prefill_tokens_per_s: cfg.load.prefill_tokens_per_s,
            prefill_overhead_ms: cfg.load.prefill_overhead_ms,
            staged_decode: cfg.scoring.staged_decode,
            fresh_half_life_ms: cfg.scoring.cache_balance_half_life_ms,
            hash_key: 0,
        }
    }
}

/// The configuration's defaults.
impl Default for LoadParams {
    fn default() -> Self {
        Self::from_config(&Config::default())
    }
}

type BlockRefs = HashMap<u64, u32, KeyedState>;

fn context_blocks(blocks: &[u64], tail_blocks: u32) -> u64 {
    blocks.len() as u64 + u64::from(tail_blocks)
}

/// A worker's block map keeps its allocation when it empties if it holds at most this many
/// entries (a 128k-token prompt's 8k blocks do not stay allocated on every worker that saw
/// one); a map that is mostly empty is shrunk.
const KEEP_REFS: usize = 4096;

#[derive(Debug, Clone)]
struct Active {
    worker: WorkerId,
    prefill_worker: WorkerId,
    blocks: Vec<u64>,
    /// Blocks of `blocks` charged to `worker` so far (all of them unless staged and pending).
    charged: usize,
    tail_blocks: u32,
    prefill_tokens: u32,
    prefill_pending: bool,
    prefill_start_ms: u64,
    prefill_dur_ms: u64,
    expires_ms: u64,
    /// Charged from another thread's pick before its event arrived ([`crate::picks`]): the
    /// event replaces it, or it is released at `expires_ms`.
    provisional: bool,
}

#[derive(Debug, Clone, Default)]
struct WorkerLoad {
    inflight: u32,
    prefill_tokens: u64,
    /// Requests whose prefill is pending on this worker, in pick order (oldest first).
    pending: Vec<RequestId>,
    prefill_horizon_ms: u64,
    /// Active prompt blocks with the number of requests holding each: shared prefixes
    /// count once, as they do in the engine's paged KV cache.
    block_refs: BlockRefs,
    /// Active requests with blocks charged here (the contributors to `block_refs`).
    holders: u32,
    private_blocks: u64,
    /// Every active request's blocks, shared prefixes counted per request: each decode step
    /// attends over each request's whole context, so this is what decoding costs here.
    context_blocks: u64,
    report: Option<Report>,
    unhealthy_until_ms: u64,
    failures: u32,
    fresh_blocks: f64,
    /// Requests routed here, decaying like `fresh_blocks` (same clock and half-life).
    recent_requests: f64,
    fresh_at_ms: u64,
    /// `workers[].speed`: predicted prefills take 1 / speed of the time (0: unset, 1).
    speed: f64,
}

impl WorkerLoad {
    /// The predicted prefill of request `id` (`tokens`) is no longer pending here.
    fn prefill_finished(&mut self, id: RequestId, tokens: u32) {
        self.prefill_tokens = self.prefill_tokens.saturating_sub(u64::from(tokens));
        self.pending.retain(|x| *x != id);
        if self.pending.is_empty() {
            self.prefill_horizon_ms = 0;
        }
    }

    /// Bounds the block map's allocation after releases.
    fn trim(&mut self) {
        let cap = self.block_refs.capacity();
        if cap <= KEEP_REFS {
            return;
        }
        if self.block_refs.is_empty() {
            self.block_refs = BlockRefs::with_hasher(*self.block_refs.hasher());
        } else if self.block_refs.len() * 8 < cap {
            self.block_refs.shrink_to(self.block_refs.len() * 2);
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct LoadTable {
    params: LoadParams,
    workers: Vec<WorkerLoad>,
    active: HashMap<RequestId, Active>,
    /// Ids charged provisionally, oldest first (most are replaced by their event).
    provisional: Vec<RequestId>,
    /// The last requests that ended, oldest first: a pick read after its request's whole
    /// life was replicated here must not be charged again (a phantom in-flight request
    /// would make a quiet worker look busy and push a session off its cache).
    ended: VecDeque<RequestId>,
    ended_set: HashSet<RequestId, KeyedState>,
}

/// Ended requests remembered against phantom provisional charges: more than end within a
/// pick's window at thousands of requests per second.
const ENDED_KEPT: usize = 1024;

/// A read-only view of one worker's load at a point in time, for selection and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WorkerView {
    pub inflight: u32,
    /// Predicted prefill tokens still to compute (decayed when enabled).
    pub prefill_tokens: f64,
    /// Requests whose prefill this worker has not finished (queued or running).
    pub prefilling: u32,
    /// KV blocks held by active requests, shared prefixes once (memory).
    pub active_blocks: u64,
    /// Blocks of every active request's context, shared prefixes per request (decode work).
    pub context_blocks: u64,
    pub fresh_blocks: f64,
    /// Requests routed here recently (decaying with the cache-pressure half-life): the
    /// worker's share of the traffic, whatever each request cost.
    pub recent_requests: f64,
    pub healthy: bool,
    /// Latest report if it is younger than the age limit asked for.
    pub report: Option<Report>,
}

impl LoadTable {
    pub fn new(workers: usize, params: LoadParams) -> Self {
        Self {
            params,
            workers: (0..workers)
                .map(|_| WorkerLoad {
                    block_refs: BlockRefs::with_hasher(KeyedState(params.hash_key)),
                    ..WorkerLoad::default()
                })
                .collect(),
            active: HashMap::new(),
            provisional: Vec::new(),
            ended: VecDeque::new(),
            ended_set: HashSet::with_hasher(KeyedState(params.hash_key)),
        }
    }

    /// Worker `w`'s relative throughput (`workers[].speed`): its predicted prefills decay in
    /// 1 / speed of the time. Ignored unless finite and > 0.
    pub fn set_speed(&mut self, w: WorkerId, speed: f64) {
        if let Some(wl) = self.workers.get_mut(usize::from(w)) {
            if speed.is_finite() && speed > 0.0 {
                wl.speed = speed;
            }
        }
    }

    pub fn active_requests(&self) -> usize {
        self.active.len()
    }

    #[cfg(test)]
    fn contains(&self, id: RequestId) -> bool {
        self.active.contains_key(&id)
    }

    /// Charges a routing decision. A duplicate id (a replayed event) is ignored; a
    /// provisional charge of the same id is replaced.
    pub fn add(&mut self, r: &NewRequest) -> bool {
        let counted = self.active.get(&r.id).is_some_and(|a| a.provisional);
        if counted {
            self.free(r.id);
        }
        self.charge(r, None, counted)
    }

    /// Charges another thread's pick until its event arrives ([`crate::picks`]): load and
    /// the request's count, without blocks or writes (the event brings them), and
    /// released at `until_ms` if no event replaced it by then.
    pub fn add_provisional(&mut self, r: &NewRequest, until_ms: u64) -> bool {
        let added = self.charge(r, Some(until_ms), false);
        if added {
            self.provisional.push(r.id);
        }
        added
    }

    /// Releases `id`'s charge if it is provisional (its thread says it ended before its
    /// events arrived); a charge from its events waits for its end event.
    pub fn free_provisional(&mut self, id: RequestId) -> bool {
        self.active.get(&id).is_some_and(|a| a.provisional) && self.free(id)
    }

    /// Releases provisional charges past their time; returns how many.
    pub fn expire_provisional(&mut self, now_ms: u64) -> usize {
        let mut released = 0;
        let ids = core::mem::take(&mut self.provisional);
        for id in ids {
            match self.active.get(&id) {
                Some(a) if a.provisional && a.expires_ms <= now_ms => {
                    self.free(id);
                    released += 1;
                }
                Some(a) if a.provisional => self.provisional.push(id),
                _ => {}
            }
        }
        released
    }

    fn charge(&mut self, r: &NewRequest, provisional_until: Option<u64>, counted: bool) -> bool {
        let n = self.workers.len();
        let prefill_worker = r.prefill_worker.unwrap_or(r.worker);
        if usize::from(r.worker) >= n
            || usize::from(prefill_worker) >= n
            || self.active.contains_key(&r.id)
            || (provisional_until.is_some() && self.ended_set.contains(&r.id))
        {
            return false;
        }
        let p = self.params;
        let cached = (r.cached_blocks as usize).min(r.blocks.len());
        let charged = if p.staged_decode && r.prefill_tokens > 0 {
            cached
        } else {
            r.blocks.len()
        };
        let pending = r.prefill_tokens > 0;
        let mut start = r.now_ms;
        let mut dur = 0;
        if let Some(pw) = self.workers.get_mut(usize::from(prefill_worker)) {
            if pending {
                // Prefills run one after another on a worker: this one starts when the
                // previously predicted ones are done (oldest first).
                start = r.now_ms.max(pw.prefill_horizon_ms);
                let speed = if pw.speed > 0.0 { pw.speed } else { 1.0 };
                dur = ((p.prefill_overhead_ms as f64
                    + f64::from(r.prefill_tokens) * 1000.0 / p.prefill_tokens_per_s)
                    / speed) as u64;
                pw.prefill_horizon_ms = start.saturating_add(dur);
                pw.prefill_tokens += u64::from(r.prefill_tokens);
                pw.pending.push(r.id);
            }
        }
        let fresh = (r.blocks.len() - cached) as f64 + f64::from(r.tail_blocks);
        if let Some(w) = self.workers.get_mut(usize::from(r.worker)) {
            w.inflight += 1;
            w.private_blocks += u64::from(r.tail_blocks);
            w.context_blocks += context_blocks(&r.blocks, r.tail_blocks);
            if charged > 0 {
                if w.block_refs.is_empty() {
                    w.block_refs.reserve(charged);
                }
                for h in r.blocks.iter().take(charged) {
                    *w.block_refs.entry(*h).or_insert(0) += 1;
                }
                w.holders += 1;
            }
            // A provisional charge counts the request in the worker's recent share at once
            // (the share term sees the other thread's pick too) but no writes, which need
            // the blocks; the event that replaces it counts only the writes.
            let provisional = provisional_until.is_some();
            let decayed = decay(
                w.fresh_blocks,
                w.fresh_at_ms,
                r.now_ms,
                p.fresh_half_life_ms,
            );
            w.fresh_blocks = decayed + if provisional { 0.0 } else { fresh };
            w.recent_requests = decay(
                w.recent_requests,
                w.fresh_at_ms,
                r.now_ms,
                p.fresh_half_life_ms,
            ) + if counted { 0.0 } else { 1.0 };
            w.fresh_at_ms = w.fresh_at_ms.max(r.now_ms);
        }
        self.active.insert(
            r.id,
            Active {
                worker: r.worker,
                prefill_worker,
                blocks: r.blocks.clone(),
                charged,
                tail_blocks: r.tail_blocks,
                prefill_tokens: r.prefill_tokens,
                prefill_pending: pending,
                prefill_start_ms: start,
                prefill_dur_ms: dur,
                expires_ms: provisional_until
                    .unwrap_or_else(|| r.now_ms.saturating_add(p.request_ttl_ms)),
                provisional: provisional_until.is_some(),
            },
        );
        true
    }

    /// The first output byte arrived: the prompt is computed and its blocks are resident.
    pub fn prefill_done(&mut self, id: RequestId) -> bool {
        let Some(a) = self.active.get_mut(&id) else {
            return false;
        };
        if !a.prefill_pending {
            return false;
        }
        a.prefill_pending = false;
        if let Some(pw) = self.workers.get_mut(usize::from(a.prefill_worker)) {
            pw.prefill_finished(id, a.prefill_tokens);
        }
        if a.charged < a.blocks.len() {
            if let Some(w) = self.workers.get_mut(usize::from(a.worker)) {
                if a.charged == 0 {
                    w.holders += 1;
                }
                for h in a.blocks.iter().skip(a.charged) {
                    *w.block_refs.entry(*h).or_insert(0) += 1;
                }
            }
            a.charged = a.blocks.len();
        }
        true
    }

    /// The request ended (or failed): release everything it holds.
    pub fn free(&mut self, id: RequestId) -> bool {
        let Some(a) = self.active.remove(&id) else {
            return false;
        };
        if !a.provisional && self.ended_set.insert(id) {
            self.ended.push_back(id);
            if self.ended.len() > ENDED_KEPT {
                if let Some(old) = self.ended.pop_front() {
                    self.ended_set.remove(&old);
                }
            }
        }
        if a.prefill_pending {
            // What `prefill_done` does, except charging the rest of the blocks only to release
            // them right away.
            if let Some(pw) = self.workers.get_mut(usize::from(a.prefill_worker)) {
                pw.prefill_finished(id, a.prefill_tokens);
            }
        }
        if let Some(w) = self.workers.get_mut(usize::from(a.worker)) {
            w.inflight = w.inflight.saturating_sub(1);
            w.private_blocks = w.private_blocks.saturating_sub(u64::from(a.tail_blocks));
            w.context_blocks = w
                .context_blocks
                .saturating_sub(context_blocks(&a.blocks, a.tail_blocks));
            if a.charged > 0 {
                if w.holders <= 1 {
                    // The only contributor: the map holds exactly its blocks.
                    w.block_refs.clear();
                } else {
                    for h in a.blocks.iter().take(a.charged) {
                        if let Entry::Occupied(mut e) = w.block_refs.entry(*h) {
                            if *e.get() <= 1 {
                                e.remove();
                            } else {
                                *e.get_mut() -= 1;
                            }
                        }
                    }
                }
                w.holders = w.holders.saturating_sub(1);
                w.trim();
            }
        }
        if self.active.capacity() > KEEP_REFS && self.active.len() * 8 < self.active.capacity() {
            self.active.shrink_to(self.active.len() * 2);
        }
        true
    }

    /// Releases requests past their TTL; returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let dead: Vec<RequestId> = self
            .active
            .iter()
            .filter(|(_, a)| a.expires_ms <= now_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in &dead {
            self.free(*id);
        }
        dead.len()
    }

    /// Releases every request whose id matches `pred`; returns how many.
    pub fn free_matching(&mut self, pred: impl Fn(RequestId) -> bool) -> usize {
        let ids: Vec<RequestId> = self.active.keys().copied().filter(|id| pred(*id)).collect();
        for id in &ids {
            self.free(*id);
        }
        ids.len()
    }

    pub fn report(&mut self, w: WorkerId, r: Report) {
        if let Some(wl) = self.workers.get_mut(usize::from(w)) {
            if wl.report.is_none_or(|old| old.at_ms <= r.at_ms) {
                wl.report = Some(r);
            }
        }
    }

    /// The latest report, however old.
    pub fn last_report(&self, w: WorkerId) -> Option<Report> {
        self.workers.get(usize::from(w)).and_then(|wl| wl.report)
    }

    /// A failure (5xx, 429, connect error) puts the worker on cooldown.
    pub fn mark_failed(&mut self, w: WorkerId, now_ms: u64, cooldown_ms: u64) {
        if let Some(wl) = self.workers.get_mut(usize::from(w)) {
            wl.failures = wl.failures.saturating_add(1);
            wl.unhealthy_until_ms = wl
                .unhealthy_until_ms
                .max(now_ms.saturating_add(cooldown_ms));
        }
    }

    /// A success ends a cooldown early: the worker demonstrably answers again.
    pub fn mark_ok(&mut self, w: WorkerId) {
        if let Some(wl) = self.workers.get_mut(usize::from(w)) {
            wl.failures = 0;
            wl.unhealthy_until_ms = 0;
        }
    }

    pub fn view(&self, w: WorkerId, now_ms: u64, report_max_age_ms: u64) -> WorkerView {
        let Some(wl) = self.workers.get(usize::from(w)) else {
            return WorkerView::default();
        };
        WorkerView {
            inflight: wl.inflight,
            prefill_tokens: self.effective_prefill(wl, now_ms),
            prefilling: u32::try_from(wl.pending.len()).unwrap_or(u32::MAX),
            active_blocks: wl.block_refs.len() as u64 + wl.private_blocks,
            context_blocks: wl.context_blocks,
            fresh_blocks: decay(
                wl.fresh_blocks,
                wl.fresh_at_ms,
                now_ms,
                self.params.fresh_half_life_ms,
            ),
            recent_requests: decay(
                wl.recent_requests,
                wl.fresh_at_ms,
                now_ms,
                self.params.fresh_half_life_ms,
            ),
            healthy: wl.unhealthy_until_ms <= now_ms,
            report: wl
                .report
                .filter(|r| now_ms.saturating_sub(r.at_ms) <= report_max_age_ms),
        }
    }

    fn effective_prefill(&self, wl: &WorkerLoad, now_ms: u64) -> f64 {
        if !self.params.prefill_decay {
            return wl.prefill_tokens as f64;
        }
        wl.pending
            .iter()
            .filter_map(|id| self.active.get(id))
            .map(|a| {
                let elapsed = now_ms.saturating_sub(a.prefill_start_ms) as f64;
                let left = if a.prefill_dur_ms == 0 {
                    0.0
                } else {
                    1.0 - elapsed / a.prefill_dur_ms as f64
                };
                f64::from(a.prefill_tokens) * left.clamp(0.0, 1.0)
            })
            .sum()
    }

    /// Heap bytes held by the per-worker block maps and the active-request map (the request
    /// records' own block lists excluded).
    pub fn memory_bytes(&self) -> usize {
        self.workers
            .iter()
            .map(|w| w.block_refs.allocation_size() + w.pending.capacity() * 8)
            .sum::<usize>()
            + self.active.allocation_size()
            + self.workers.capacity() * core::mem::size_of::<WorkerLoad>()
    }

    /// Totals across workers, for tests: (inflight, prefill tokens, active blocks).
    #[cfg(test)]
    pub(crate) fn totals(&self) -> (u64, u64, u64) {
        self.workers.iter().fold((0, 0, 0), |(i, p, b), w| {
            (
                i + u64::from(w.inflight),
                p + w.prefill_tokens,
                b + w.block_refs.len() as u64 + w.private_blocks,
            )
        })
    }
}

pub(crate) fn decay(value: f64, at_ms: u64, now_ms: u64, half_life_ms: u64) -> f64 {
    if half_life_ms == 0 || value == 0.0 {
        return 0.0;
    }
    let dt = now_ms.saturating_sub(at_ms) as f64;
    value * (-dt / half_life_ms as f64 * core::f64::consts::LN_2).exp()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn req(
        id: RequestId,
        w: WorkerId,
        blocks: &[u64],
        cached: u32,
        tokens: u32,
        now: u64,
    ) -> NewRequest {
        NewRequest {
            id,
            worker: w,
            prefill_worker: None,
            blocks: blocks.to_vec(),
            cached_blocks: cached,
            tail_blocks: 1,
            prefill_tokens: tokens,
            now_ms: now,
            adapter: 0,
        }
    }

    #[test]
    fn shared_prefix_blocks_count_once_and_everything_returns_to_zero() {
        let mut t = LoadTable::new(2, LoadParams::default());
        let a = [1, 2, 3, 4];
        let b = [1, 2, 9];
        assert!(t.add(&req(1, 0, &a, 0, 64, 0)));
        assert!(t.add(&req(2, 0, &b, 2, 16, 0)));
        let v = t.view(0, 0, 1000);
        assert_eq!(v.inflight, 2);
        assert_eq!(v.active_blocks, 5 + 2); // {1,2,3,4,9} + two private tails
        assert_eq!(v.prefill_tokens, 80.0);
        assert!(t.prefill_done(1));
        assert!(!t.prefill_done(1), "second prefill_done is a no-op");
        assert_eq!(t.view(0, 0, 1000).prefill_tokens, 16.0);
        assert!(t.free(1));
        assert_eq!(t.view(0, 0, 1000).active_blocks, 3 + 1);
        assert!(t.free(2));
        assert!(!t.free(2));
        assert_eq!(t.totals(), (0, 0, 0));
        assert_eq!(t.active_requests(), 0);
    }

    #[test]
    fn block_maps_do_not_keep_a_burst_allocated() {
        let mut t = LoadTable::new(4, LoadParams::default());
        let empty = t.memory_bytes();
        // A burst of long prompts, several per worker, with shared prefixes.
        let prompts: Vec<Vec<u64>> = (0..16u64)
            .map(|i| {
                (0..8192u64)
                    .map(|b| if b < 512 { b } else { i << 32 | b })
                    .collect()
            })
            .collect();
        for (i, p) in prompts.iter().enumerate() {
            assert!(t.add(&req(i as u64, (i % 4) as u16, p, 0, 100, 0)));
        }
        let v = t.view(1, 0, 0);
        assert_eq!(v.active_blocks, 512 + 4 * (8192 - 512) + 4);
        let full = t.memory_bytes();
        assert!(full > 4 * 8192 * 12, "{full}");
        // Free all but one request per worker: the maps shrink to what is left.
        for i in 4..16u64 {
            assert!(t.free(i));
        }
        assert_eq!(t.view(1, 0, 0).active_blocks, 8192 + 1);
        for i in 0..4u64 {
            assert!(t.free(i));
        }
        assert_eq!(t.totals(), (0, 0, 0));
        let after = t.memory_bytes();
        assert!(
            after <= empty + 4 * 1024,
            "{empty} -> {full} -> {after} bytes"
        );
        // Small maps keep their allocation (no reallocation per request).
        t.add(&req(100, 0, &prompts[0][..1000], 0, 100, 0));
        let small = t.memory_bytes();
        t.free(100);
        assert_eq!(t.memory_bytes(), small);
    }

    #[test]
    fn sole_holder_free_and_shared_free_agree() {
        let mut t = LoadTable::new(1, LoadParams::default());
        let a = [1, 2, 3, 4];
        let b = [1, 2, 5];
        t.add(&req(1, 0, &a, 0, 0, 0));
        t.add(&req(2, 0, &b, 0, 0, 0));
        t.add(&req(3, 0, &[], 0, 0, 0)); // holds no blocks
        assert_eq!(t.view(0, 0, 0).active_blocks, 5 + 3);
        t.free(1); // shared: per-block release
        assert_eq!(t.view(0, 0, 0).active_blocks, 3 + 2);
        t.free(2); // sole holder of blocks: cleared at once
        assert_eq!(t.view(0, 0, 0).active_blocks, 1);
        t.add(&req(4, 0, &a, 0, 0, 0));
        assert_eq!(t.view(0, 0, 0).active_blocks, 4 + 2);
        t.free(3);
        t.free(4);
        assert_eq!(t.totals(), (0, 0, 0));
    }

    #[test]
    fn duplicate_and_out_of_range_are_ignored() {
        let mut t = LoadTable::new(1, LoadParams::default());
        assert!(t.add(&req(1, 0, &[1], 0, 16, 0)));
        assert!(!t.add(&req(1, 0, &[1], 0, 16, 0)));
        assert!(!t.add(&req(2, 5, &[1], 0, 16, 0)));
        assert_eq!(t.view(0, 0, 0).inflight, 1);
        assert_eq!(t.view(9, 0, 0), WorkerView::default());
    }

    #[test]
    fn staged_decode_moves_suffix_at_prefill_done() {
        let p = LoadParams {
            staged_decode: true,
            ..LoadParams::default()
        };
        let mut t = LoadTable::new(1, p);
        let r = NewRequest {
            tail_blocks: 0,
            ..req(1, 0, &[1, 2, 3, 4], 1, 48, 0)
        };
        t.add(&r);
        assert_eq!(t.view(0, 0, 0).active_blocks, 1);
        t.prefill_done(1);
        assert_eq!(t.view(0, 0, 0).active_blocks, 4);
        t.free(1);
        assert_eq!(t.totals(), (0, 0, 0));
    }

    #[test]
    fn disaggregated_request_charges_prefill_and_decode_sides() {
        let mut t = LoadTable::new(2, LoadParams::default());
        let r = NewRequest {
            prefill_worker: Some(1),
            ..req(1, 0, &[1, 2], 0, 32, 0)
        };
        t.add(&r);
        assert_eq!(t.view(1, 0, 0).prefill_tokens, 32.0);
        assert_eq!(t.view(1, 0, 0).inflight, 0);
        assert_eq!(t.view(0, 0, 0).prefill_tokens, 0.0);
        assert_eq!(t.view(0, 0, 0).inflight, 1);
        t.free(1);
        assert_eq!(t.totals(), (0, 0, 0));
    }

    #[test]
    fn prefill_decays_oldest_first() {
        let p = LoadParams {
            prefill_decay: true,
            prefill_tokens_per_s: 1000.0,
            prefill_overhead_ms: 0,
            ..LoadParams::default()
        };
        let mut t = LoadTable::new(1, p);
        t.add(&req(1, 0, &[1], 0, 1000, 0)); // 1 s of prefill: [0, 1000)
        t.add(&req(2, 0, &[2], 0, 1000, 0)); // queued behind it: [1000, 2000)
        assert_eq!(t.view(0, 0, 0).prefill_tokens, 2000.0);
        assert_eq!(t.view(0, 500, 0).prefill_tokens, 1500.0);
        assert_eq!(t.view(0, 1500, 0).prefill_tokens, 500.0);
        assert_eq!(t.view(0, 5000, 0).prefill_tokens, 0.0);
        // Twice as fast: the same prefills are done in half the time.
        let mut t = LoadTable::new(1, p);
        t.set_speed(0, 2.0);
        t.add(&req(1, 0, &[1], 0, 1000, 0));
        t.add(&req(2, 0, &[2], 0, 1000, 0));
        assert_eq!(t.view(0, 250, 0).prefill_tokens, 1500.0);
        assert_eq!(t.view(0, 1000, 0).prefill_tokens, 0.0);
    }

    #[test]
    fn ttl_expiry_releases_lost_requests() {
        let p = LoadParams {
            request_ttl_ms: 100,
            ..LoadParams::default()
        };
        let mut t = LoadTable::new(1, p);
        t.add(&req(1, 0, &[1], 0, 16, 0));
        t.add(&req(2, 0, &[2], 0, 16, 50));
        assert_eq!(t.expire(99), 0);
        assert_eq!(t.expire(100), 1);
        assert!(t.contains(2));
        assert_eq!(t.expire(150), 1);
        assert_eq!(t.totals(), (0, 0, 0));
    }

    #[test]
    fn health_cooldown_and_report_age() {
        let mut t = LoadTable::new(1, LoadParams::default());
        t.mark_failed(0, 1000, 500);
        assert!(!t.view(0, 1200, 0).healthy);
        assert!(t.view(0, 1500, 0).healthy);
        t.mark_failed(0, 2000, 500);
        t.mark_ok(0);
        assert!(t.view(0, 2000, 0).healthy);
        t.report(
            0,
            Report {
                kv_usage: 0.5,
                waiting: 3,
                running: None,
                at_ms: 100,
            },
        );
        t.report(
            0,
            Report {
                kv_usage: 0.9,
                waiting: 0,
                running: None,
                at_ms: 50,
            },
        ); // older: ignored
        assert_eq!(t.view(0, 200, 1000).report.map(|r| r.waiting), Some(3));
        assert_eq!(t.view(0, 2000, 1000).report, None);
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Add {
            w: u16,
            blocks: Vec<u64>,
            cached: u32,
            tokens: u32,
        },
        PrefillDone(usize),
        Free(usize),
        Expire(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (
                0u16..4,
                prop::collection::vec(0u64..12, 0..8),
                0u32..8,
                0u32..200
            )
                .prop_map(|(w, blocks, cached, tokens)| Op::Add {
                    w,
                    blocks,
                    cached,
                    tokens
                }),
            (0usize..40).prop_map(Op::PrefillDone),
            (0usize..40).prop_map(Op::Free),
            (0u64..50).prop_map(Op::Expire),
        ]
    }

    proptest! {
        /// Whatever the order of events, releasing everything returns every counter to zero,
        /// and active blocks always equal the distinct charged blocks per worker.
        #[test]
        fn bookkeeping_returns_to_zero(ops in prop::collection::vec(op(), 0..60), staged in any::<bool>(), decay in any::<bool>()) {
            let p = LoadParams { staged_decode: staged, prefill_decay: decay, request_ttl_ms: 30, ..LoadParams::default() };
            let mut t = LoadTable::new(4, p);
            let mut now = 0;
            let mut next = 0u64;
            let mut model: Vec<(u64, u16, Vec<u64>, usize)> = Vec::new();
            for o in ops {
                match o.clone() {
                    Op::Add { w, blocks, cached, tokens } => {
                        next += 1;
                        t.add(&NewRequest { id: next, worker: w, prefill_worker: Some((w + 1) % 4), blocks: blocks.clone(), cached_blocks: cached, tail_blocks: 1, prefill_tokens: tokens, now_ms: now, adapter: 0 });
                    }
                    Op::PrefillDone(i) => { t.prefill_done(i as u64); }
                    Op::Free(i) => { t.free(i as u64); }
                    Op::Expire(dt) => { now += dt; t.expire(now); }
                }
                // Model: (worker, blocks, charged) of every request still active.
                match o {
                    Op::Add { w, blocks, cached, tokens } if t.contains(next) && !model.iter().any(|m| m.0 == next) => {
                        let charged = if staged && tokens > 0 { (cached as usize).min(blocks.len()) } else { blocks.len() };
                        model.push((next, w, blocks, charged));
                    }
                    Op::PrefillDone(i) => {
                        if let Some(m) = model.iter_mut().find(|m| m.0 == i as u64) {
                            m.3 = m.2.len();
                        }
                    }
                    _ => {}
                }
                model.retain(|m| t.contains(m.0));
                for w in 0..4 {
                    let v = t.view(w, now, 0);
                    prop_assert!(v.prefill_tokens >= 0.0);
                    let mine: Vec<_> = model.iter().filter(|m| m.1 == w).collect();
                    let distinct: std::collections::BTreeSet<u64> = mine.iter().flat_map(|m| m.2[..m.3].iter().copied()).collect();
                    prop_assert_eq!(v.active_blocks, distinct.len() as u64 + mine.len() as u64, "worker {}", w);
                    prop_assert_eq!(v.inflight as usize, mine.len());
                }
            }
            t.expire(u64::MAX);
            prop_assert_eq!(t.totals(), (0, 0, 0));
            for w in 0..4 { prop_assert_eq!(t.view(w, now, 0).prefill_tokens, 0.0); }
            prop_assert!(t.memory_bytes() < 64 * 1024);
        }
    }
}
