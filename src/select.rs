//! Worker selection: predicted prefill wait, recompute cost, decode work and memory,
//! busy thresholds, health, and seeded sampling.
//!
//! Cost, in KV blocks (lower wins); `s` = prefill_load_scale:
//!   uncached  = max(0, prompt_tokens / block_size - credit * overlap)
//!   prefill   = s * ((pending_prefill_tokens + waiting_requests * overhead) / block_size
//!                    + uncached)                                          the wait for it
//!   recompute = s * uncached * min(recompute_weight_max, recompute_weight_min + recompute_weight *
//!                 requests waiting for prefill there, or on the pool's median worker if more)
//!   duplicate = s * blocks confirmed cached on another worker but not here
//!                 * (copy_weight + duplicate_weight * indexed blocks / kv_blocks)
//!   decode    = decode_weight * (in-flight context blocks + the request's blocks)
//!   interfere = s * decode_interference * requests in flight on the worker
//!                 * (uncached + request overhead / block_size)
//!   memory    = max(0, max(active_blocks, reported_kv_usage * kv_blocks) + new blocks
//!                      - kv_watermark * kv_blocks)
//!   balance   = cache_balance * blocks the request writes * (recently written / kv_blocks)
//!   adapter   = s * adapter loads (0 held, 1 free slot or an idle adapter replaced, 2 when
//!                 the replaced adapter is held nowhere else or every slot is busy: see
//!                 `crate::lora::Fit`) * lora.load_ms * prefill_tokens_per_s / block_size
//!   share     = s * prompt blocks * focus * (max(0, share - 1) + request_ratio_weight
//!                 * max(0, share - request_ratio)), share = the worker's recent requests
//!                 (less a slack) over the pool's mean, focus = min(1, family share /
//!                 request_ratio_family) where the worker holds the request's family, at
//!                 least (share - request_ratio) / (request_ratio - 1); in a saturated fleet
//!                 (the median worker has prefill waiting) instead
//!                 s * mean blocks per request in flight * request_ratio_weight
//!                   * max(0, share - request_ratio_saturated), whatever the worker's in-flight
//! prefill, recompute, decode and interfere are divided by the worker's `speed` (time, not
//! blocks: a mixed fleet balances by time), and the share is counted per unit of speed.
//! At low load the cost is the wait for the first token plus what recomputing costs everyone
//! else (recompute_weight_min: recomputed tokens share the worker's batches, and a copy
//! duplicates cache the fleet has; copy_weight: a copy of a cached prefix is a lost hit), so
//! an idle cold worker beats a warm one only when the warm one's queue is longer than that. As queues grow, prefill recomputed on a busy worker delays whoever queues
//! behind it, so the recompute term grows with the queues and keeps each prefix family where
//! it is cached, spilling only to a worker with room to recompute it. Into a full cache a copy
//! of a prefix held elsewhere also pushes out content no one else holds (duplicate), which
//! partitions the working set under eviction pressure. Decode work (per request, not per
//! shared block) is what spreads a burst of identical cached requests. Each prefill placed on a worker
//! is also a pass every stream there waits out (chunked prefill); the interference term
//! prices that, which lowers TPOT near saturation. Past saturation the long prompts it moves
//! off busy workers leave the short ones to pile onto whichever worker stays cheap for them,
//! so there the share term stays on with a looser ratio. Request share is what keeps a
//! Zipf-hot prefix family from making one worker a hot spot.

use crate::config::Config;
use crate::ids::WorkerId;
use crate::load::WorkerView;
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelectParams {
    pub block_size: u32,
    pub overlap_credit: f64,
    pub prefill_load_scale: f64,
    pub staged_decode: bool,
    pub temperature: f64,
    pub cache_balance: f64,
    pub recompute_weight: f64,
    pub recompute_weight_max: f64,
    pub recompute_weight_min: f64,
    pub decode_weight: f64,
    pub decode_interference: f64,
    pub kv_watermark: f64,
    pub duplicate_weight: f64,
    pub copy_weight: f64,
    pub request_ratio: f64,
    pub request_ratio_weight: f64,
    pub request_ratio_slack: f64,
    pub request_ratio_min_inflight: u32,
    pub request_ratio_family: f64,
    pub request_ratio_saturated: f64,
    /// Prefill tokens one waiting request's fixed overhead is worth
    /// (`load.prefill_overhead_ms` at `load.prefill_tokens_per_s`).
    pub request_overhead_tokens: f64,
    /// Prefill tokens one adapter load is worth (`lora.load_ms` at
    /// `load.prefill_tokens_per_s`).
    pub adapter_load_tokens: f64,
    pub busy_kv_usage: f64,
    pub busy_waiting: u32,
    pub busy_inflight: u32,
    pub reject_when_all_busy: bool,
}

/// The configuration's defaults.
impl Default for SelectParams {
    fn default() -> Self {
        Self::from_config(&Config::default())
    }
}

/// The request as selection sees it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RequestShape {
    /// Estimated (or exact) prompt tokens, all of them.
    pub prompt_tokens: u32,
    /// Blocks the request occupies in KV: the prompt rounded up plus its expected output.
    /// The output part is private to the request, which is what makes identical fully
    /// cached requests still add load.
    pub total_blocks: u32,
}

/// One worker that may take the request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: WorkerId,
    /// Prompt tokens covered by the leading index blocks the worker holds.
    pub overlap_tokens: u32,
    pub kv_blocks: u32,
    /// Blocks the worker's cache is believed to hold: ended prompts in the prefix index and
    /// the blocks running requests pin there (together at most `kv_blocks`).
    pub indexed_blocks: u32,
    pub load: WorkerView,
    /// Of `overlap_tokens`, those the index confirms (answered requests): a copy of them
    /// elsewhere loses a real cache hit. The rest belongs to routed requests not yet
    /// answered, cached nowhere until their prefill runs (and never on a worker that holds
    /// requests without answering them).
    pub confirmed_tokens: u32,
    /// Share of this worker's recent requests from the request's prefix family
    /// ([`crate::family`]), when the worker holds all of that prefix; None when it does not
    /// (a request placed here is new to it) or the prefix is new to every worker.
    pub family_share: Option<f64>,
    /// Throughput relative to the other workers (`workers[].speed`, > 0): its prefill,
    /// recompute, interference and decode terms are divided by it, and its request share
    /// is counted per unit of speed.
    pub speed: f64,
    /// Adapter loads placing the request here costs ([`crate::lora::Fit::loads`]); 0 for a
    /// request without an adapter.
    pub adapter_loads: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    pub id: WorkerId,
    pub cost: f64,
    pub overlap_tokens: u32,
    /// Every healthy candidate was over a busy threshold.
    pub all_busy: bool,
    /// No candidate was healthy; the pick ignored health (fail open).
    pub none_healthy: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    Picked(Pick),
    /// Every worker is busy and the config asks to shed load.
    Rejected,
    NoCandidates,
}

impl SelectParams {
    pub fn from_config(cfg: &Config) -> Self {
        SelectParams {
            block_size: cfg.block_size,
            overlap_credit: cfg.scoring.overlap_credit,
            prefill_load_scale: cfg.scoring.prefill_load_scale,
            staged_decode: cfg.scoring.staged_decode,
            temperature: cfg.scoring.temperature,
            cache_balance: cfg.scoring.cache_balance,
            recompute_weight: cfg.scoring.recompute_weight,
            recompute_weight_max: cfg.scoring.recompute_weight_max,
            recompute_weight_min: cfg.scoring.recompute_weight_min,
            decode_weight: cfg.scoring.decode_weight,
            decode_interference: cfg.scoring.decode_interference,
            kv_watermark: cfg.scoring.kv_watermark,
            duplicate_weight: cfg.scoring.duplicate_weight,
            copy_weight: cfg.scoring.copy_weight,
            request_ratio: cfg.scoring.request_ratio,
            request_ratio_weight: cfg.scoring.request_ratio_weight,
            request_ratio_slack: cfg.scoring.request_ratio_slack,
            request_ratio_min_inflight: cfg.scoring.request_ratio_min_inflight,
            request_ratio_family: cfg.scoring.request_ratio_family,
            request_ratio_saturated: cfg.scoring.request_ratio_saturated,
            request_overhead_tokens: cfg.load.prefill_overhead_ms as f64
                * cfg.load.prefill_tokens_per_s
                / 1000.0,
            adapter_load_tokens: cfg.lora.load_ms as f64 * cfg.load.prefill_tokens_per_s / 1000.0,
            busy_kv_usage: cfg.busy.kv_usage,
            busy_waiting: cfg.busy.waiting_requests,
            busy_inflight: cfg.busy.inflight_requests,
            reject_when_all_busy: cfg.busy.reject_when_all_busy,
        }
    }
}

/// What the cost of one worker depends on beyond that worker: the pool as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Pool {
    /// Requests waiting for prefill on the median healthy worker: how scarce prefill capacity
    /// is across the pool, untouched by one hot worker's queue.
    pub waiting: u32,
    /// The longest confirmed cached prefix any worker holds for this request, in tokens.
    pub best_confirmed_tokens: u32,
    /// Recent requests per healthy worker of speed 1, on average
    /// ([`WorkerView::recent_requests`]; a worker of speed 2 counts as two).
    pub mean_recent: f64,
    /// Requests in flight per healthy worker of speed 1, on average.
    pub mean_inflight: f64,
    /// Context blocks per request in flight across the healthy workers, on average (0 with
    /// nothing in flight): what one more request weighs on a worker, whatever its size.
    pub mean_request_blocks: f64,
}

impl Pool {
    pub fn of(cands: &[Candidate]) -> Pool {
        let mut w: Vec<u32> = cands
            .iter()
            .filter(|c| c.load.healthy)
            .map(|c| c.load.prefilling)
            .collect();
        let mid = w.len().saturating_sub(1) / 2;
        let waiting = if w.is_empty() {
            0
        } else {
            w.select_nth_unstable(mid);
            w.get(mid).copied().unwrap_or(0)
        };
        let healthy = cands.iter().filter(|c| c.load.healthy);
        // `speed` is the fleet's capacity in units of a speed-1 worker.
        let (speed, sum, inflight, context) =
            healthy.fold((0.0, 0.0, 0.0, 0.0), |(n, s, f, b), c| {
                (
                    n + speed_of(c),
                    s + c.load.recent_requests,
                    f + f64::from(c.load.inflight),
                    b + c.load.context_blocks as f64,
                )
            });
        Pool {
            waiting,
            best_confirmed_tokens: cands.iter().map(|c| c.confirmed_tokens).max().unwrap_or(0),
            mean_recent: if speed > 0.0 { sum / speed } else { 0.0 },
            mean_inflight: if speed > 0.0 { inflight / speed } else { 0.0 },
            mean_request_blocks: if inflight > 0.0 {
                context / inflight
            } else {
                0.0
            },
        }
    }
}

/// `c.speed`, or 1 where it is not a usable factor.
fn speed_of(c: &Candidate) -> f64 {
    if c.speed.is_finite() && c.speed > 0.0 {
        c.speed
    } else {
        1.0
    }
}

/// Weight of the prefill `c` would recompute, on top of the wait it causes: recomputed work
/// delays whoever queues behind it, and a queue grows as utilisation / (1 - utilisation), so
/// the requests waiting for prefill on `c`, or on the pool's median worker if more
/// (`fleet`, [`Pool::waiting`]), stand for that delay. With idle workers around a prefix is
/// recomputed for free; a busy fleet keeps each prefix where it is cached.
pub fn recompute_factor(p: &SelectParams, c: &Candidate, fleet: u32) -> f64 {
    (p.recompute_weight_min + p.recompute_weight * f64::from(c.load.prefilling.max(fleet)))
        .min(p.recompute_weight_max)
}

/// `c`'s recent requests in units of the pool's mean, less `request_ratio_slack` requests
/// (the first requests of a run say little about shares); `None` when the term is off, `c`
/// has fewer than `request_ratio_min_inflight` requests in flight, or (below saturation) no
/// more than the pool's average.
pub fn request_share(p: &SelectParams, c: &Candidate, pool: &Pool) -> Option<f64> {
    // A worker with (almost) nothing in flight is idle when the request lands, however many
    // came before: no hot spot, and a quiet fleet's sequential requests keep their worker.
    // Below saturation nor is one with no more in flight than the average worker: requests
    // differ in size, and a worker that took many short ones is not the busy one.
    // Once the median worker has prefill waiting the fleet is saturated: every queue is
    // priced by the wait and recompute terms, so the usual ratio would only move requests
    // away from their caches, and a looser cap (`request_ratio_saturated`, see `hot_spot`)
    // holds instead. That cap must see the worker that took many short ones: the terms
    // that move long prompts off busy workers leave the short ones to pile up there, and
    // they finish too fast to keep it above the average in flight.
    // Shares are per unit of speed: a worker twice as fast is meant to take twice the share.
    let saturated = pool.waiting > 0;
    let speed = speed_of(c);
    if p.request_ratio <= 0.0
        || (saturated && p.request_ratio_saturated <= 0.0)
        || c.load.inflight < p.request_ratio_min_inflight
        || (!saturated && f64::from(c.load.inflight) / speed <= pool.mean_inflight)
    {
        return None;
    }
    Some((c.load.recent_requests - p.request_ratio_slack) / speed / pool.mean_recent.max(1.0))
}

/// Cost of sending request `r` to `c`, one of the candidates `pool` was made of.
pub fn cost(p: &SelectParams, c: &Candidate, r: &RequestShape, pool: &Pool) -> f64 {
    terms(p, c, r, pool).total()
}

/// What prefilling `r` on `w`, one of `cands`, costs: the wait for it, the delay it adds to
/// whoever queues behind it and the passes the streams there sit out ([`CostTerms`]'
/// prefill, recompute and interference); infinite when `w` is not among `cands`. Compares a
/// prefill pool worker with the decode worker chosen for the request.
pub fn prefill_cost(p: &SelectParams, cands: &[Candidate], w: WorkerId, r: &RequestShape) -> f64 {
    let pool = Pool::of(cands);
    cands.iter().find(|c| c.id == w).map_or(f64::INFINITY, |c| {
        let t = terms(p, c, r, &pool);
        t.prefill + t.recompute + t.interference
    })
}

/// The terms [`cost`] adds up, each in KV blocks (debug headers show them).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CostTerms {
    /// The wait for this request's prefill, scaled.
    pub prefill: f64,
    /// What recomputing the uncached part costs whoever queues behind it, scaled.
    pub recompute: f64,
    /// Copies of blocks another worker holds, written into a full cache, scaled.
    pub duplicate: f64,
    pub decode: f64,
    /// What this request's prefill passes cost the streams on `c`, scaled.
    pub interference: f64,
    pub memory: f64,
    pub balance: f64,
    /// The request-share (hot spot) term.
    pub share: f64,
    /// Adapter loads, as the prefill they delay, scaled.
    pub adapter: f64,
}

impl CostTerms {
    pub fn total(&self) -> f64 {
        self.prefill
            + self.recompute
            + self.duplicate
            + self.decode
            + self.interference
            + self.memory
            + self.balance
            + self.share
            + self.adapter
    }
}

/// [`cost`], term by term.
pub fn terms(p: &SelectParams, c: &Candidate, r: &RequestShape, pool: &Pool) -> CostTerms {
    let bs = f64::from(p.block_size.max(1));
    let kv = f64::from(c.kv_blocks.max(1));
    let overlap = f64::from(c.overlap_tokens.min(r.prompt_tokens)) / bs;
    let uncached = (f64::from(r.prompt_tokens) / bs - p.overlap_credit * overlap).max(0.0);
    // Each request waiting ahead also costs its fixed scheduling overhead, so a worker that
    // accepts requests and never starts them (stalled, or a black hole) stops attracting
    // short prompts long before its token count would say so.
    let waiting = f64::from(c.load.prefilling) * p.request_overhead_tokens;
    let prefill = (c.load.prefill_tokens + waiting) / bs + uncached;
    let decode = p.decode_weight * (c.load.context_blocks as f64 + f64::from(r.total_blocks));
    let reported = c
        .load
        .report
        .map(|rep| f64::from(rep.kv_usage).clamp(0.0, 1.0) * kv)
        .unwrap_or(0.0);
    let written = (f64::from(r.total_blocks) - overlap).max(0.0);
    // Staged: while its prefill is pending the request adds only blocks that already exist.
    let new_blocks = if p.staged_decode { 0.0 } else { written };
    let held = (c.load.active_blocks as f64).max(reported) + new_blocks;
    let memory = (held - p.kv_watermark * kv).max(0.0);
    // Cache pressure: the share of this worker's cache rewritten recently. Writing many new
    // blocks to a churning cache evicts content other requests would have hit; a mostly
    // cached request writes little, so affinity keeps winning.
    // Capped at 1: beyond a full turnover the cache holds nothing older to protect, and an
    // uncapped value would let write volume outweigh cache hits at high request rates.
    let pressure = (c.load.fresh_blocks / kv).min(1.0);
    let fullness = (f64::from(c.indexed_blocks) / kv).min(1.0);
    // Blocks another worker is confirmed to hold that this one would write again: each is
    // a lost cache hit (copy_weight), and into a full cache it also pushes out content
    // nobody else holds, which some later request will recompute (duplicate_weight).
    // Unanswered requests' blocks are cached nowhere yet; counting them would let a worker
    // that takes requests and never answers attract its prompts' families.
    let duplicate = f64::from(
        pool.best_confirmed_tokens
            .min(r.prompt_tokens)
            .saturating_sub(c.overlap_tokens),
    ) / bs;
    // With chunked prefill each pass that carries this request's prefill is also a decode
    // step of every stream on `c`: those decoding now, and those queued ahead of it, which
    // will be decoding by then, all wait it out (TPOT). Counting only the streams decoding
    // now would make a worker whose requests all queue look free of interference. A fully
    // cached request still costs a pass (its fixed overhead).
    let streams = f64::from(c.load.inflight);
    let interference =
        p.decode_interference * streams * (uncached + p.request_overhead_tokens / bs);
    let s = p.prefill_load_scale;
    // Work on `c` takes 1 / speed of the time: queue, prefill and decode are priced in time
    // (in blocks of a speed-1 worker), so a mixed fleet balances by time, not by blocks.
    let speed = speed_of(c);
    CostTerms {
        prefill: s * (prefill / speed),
        // Unscaled products first: a huge scale times a zero term must stay 0, never NaN.
        recompute: s * (recompute_factor(p, c, pool.waiting) * uncached / speed),
        duplicate: s * (duplicate * (p.copy_weight + p.duplicate_weight * fullness)),
        decode: decode / speed,
        interference: s * (interference / speed),
        memory,
        balance: p.cache_balance * written * pressure,
        // A worker taking far more than its share of requests is a hot spot whatever its
        // queues say now: a prefix family held there and elsewhere moves at once, one held
        // only there pays to be copied once the excess outweighs recomputing the prompt, and
        // that copy then shares the family's traffic.
        share: hot_spot(p, c, r, pool),
        // A load stalls the engine's step (vLLM loads adapters inside it): everyone there
        // waits for it as for prefill.
        adapter: s * (c.adapter_loads * p.adapter_load_tokens / bs),
    }
}

/// The request-share term of [`cost`], in the request's prompt blocks: each mean of share
/// above the mean costs one prompt (a new prefix goes where fewer requests went), and each
/// above `request_ratio` costs `request_ratio_weight` more (a hot spot sheds what is cached
/// elsewhere at once and copies what is not once that outweighs recomputing it). 0, never
/// 0 x infinity, while `c` is within the mean.
fn hot_spot(p: &SelectParams, c: &Candidate, r: &RequestShape, pool: &Pool) -> f64 {
    let Some(share) = request_share(p, c, pool) else {
        return 0.0;
    };
    let bs = f64::from(p.block_size.max(1));
    let prompt = (f64::from(r.prompt_tokens) / bs).max(1.0);
    if pool.waiting > 0 {
        // Saturated: the queues price every worker, and only a worker far past its share
        // (request_ratio_saturated) is a hot spot. The excess is a count of requests, so
        // each request pays for it alike, at the size of the average request in flight:
        // priced by its own prompt, a hot worker would repel the long prompts and keep
        // collecting the short ones.
        let excess = p.request_ratio_weight * (share - p.request_ratio_saturated).max(0.0);
        let per_request = if pool.mean_request_blocks > 0.0 {
            pool.mean_request_blocks
        } else {
            prompt
        };
        return p.prefill_load_scale * (excess * per_request);
    }
    let excess =
        (share - 1.0).max(0.0) + p.request_ratio_weight * (share - p.request_ratio).max(0.0);
    if excess <= 0.0 {
        return 0.0;
    }
    // Shed the family that makes the worker hot: each copy of it takes its later requests
    // along. A bystander's request pays in proportion to the share it brings, until the
    // worker is past the ratio by as much again as the ratio is above the mean: by then
    // copying the hot family has not been enough, and every request is shed alike.
    let family = match c.family_share {
        Some(f) if p.request_ratio_family > 0.0 => (f / p.request_ratio_family).clamp(0.0, 1.0),
        _ => 1.0,
    };
    let past = if p.request_ratio > 1.0 {
        ((share - p.request_ratio) / (p.request_ratio - 1.0)).clamp(0.0, 1.0)
    } else {
        1.0
    };
    let focus = family.max(past);
    if focus <= 0.0 {
        return 0.0;
    }
    p.prefill_load_scale * (focus * (excess * prompt))
}

fn is_busy(p: &SelectParams, c: &Candidate) -> bool {
    if p.busy_inflight > 0 && c.load.inflight >= p.busy_inflight {
        return true;
    }
    match c.load.report {
        Some(rep) => {
            (p.busy_kv_usage > 0.0 && f64::from(rep.kv_usage) >= p.busy_kv_usage)
                || (p.busy_waiting > 0 && rep.waiting >= p.busy_waiting)
        }
        None => false,
    }
}

/// Picks among `cands`: healthy and not busy first, then healthy busy ones (unless the
/// config sheds load), then anyone (fail open: a request is better tried than dropped).
pub fn pick(p: &SelectParams, cands: &[Candidate], r: &RequestShape, rng: &mut Rng) -> Outcome {
    if cands.is_empty() {
        return Outcome::NoCandidates;
    }
    let any_healthy = cands.iter().any(|c| c.load.healthy);
    let any_free = cands.iter().any(|c| c.load.healthy && !is_busy(p, c));
    if any_healthy && !any_free && p.reject_when_all_busy {
        return Outcome::Rejected;
    }
    let eligible = |c: &Candidate| {
        if any_free {
            c.load.healthy && !is_busy(p, c)
        } else {
            !any_healthy || c.load.healthy
        }
    };
    let pool = Pool::of(cands);
    let mut best: Vec<(usize, f64)> = Vec::with_capacity(cands.len());
    for (i, c) in cands.iter().enumerate() {
        if eligible(c) {
            best.push((i, cost(p, c, r, &pool)));
        }
    }
    let Some(i) = choose(p.temperature, &best, rng) else {
        return Outcome::NoCandidates;
    };
    let Some(c) = cands.get(i) else {
        return Outcome::NoCandidates;
    };
    let cost = best
        .iter()
        .find(|(j, _)| *j == i)
        .map(|(_, c)| *c)
        .unwrap_or(0.0);
    Outcome::Picked(Pick {
        id: c.id,
        cost,
        overlap_tokens: c.overlap_tokens,
        all_busy: any_healthy && !any_free,
        none_healthy: !any_healthy,
    })
}

/// One candidate as [`pick`] saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Considered {
    pub id: WorkerId,
    pub overlap_tokens: u32,
    /// Requests waiting for prefill there, and their uncached tokens.
    pub prefilling: u32,
    pub prefill_tokens: f64,
    /// [`Candidate::family_share`].
    pub family_share: Option<f64>,
    pub terms: CostTerms,
}

/// Every candidate's cost terms, as [`pick`] saw them (for debug headers: why a request
/// went where it went).
pub fn explain(p: &SelectParams, cands: &[Candidate], r: &RequestShape) -> Vec<Considered> {
    let pool = Pool::of(cands);
    cands
        .iter()
        .map(|c| Considered {
            id: c.id,
            overlap_tokens: c.overlap_tokens,
            prefilling: c.load.prefilling,
            prefill_tokens: c.load.prefill_tokens,
            family_share: c.family_share,
            terms: terms(p, c, r, &pool),
        })
        .collect()
}

/// Index into `scored` chosen by lowest cost (uniform among ties) or, with a temperature,
/// by sampling `exp(-(c - min) / ((max - min) * T))`.
fn choose(temperature: f64, scored: &[(usize, f64)], rng: &mut Rng) -> Option<usize> {
    let min = scored.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
    let max = scored.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
    if !min.is_finite() {
        return None;
    }
    let spread = max - min;
    if temperature > 0.0 && spread > 0.0 {
        let weight = |c: f64| (-(c - min) / (spread * temperature)).exp();
        let total: f64 = scored.iter().map(|s| weight(s.1)).sum();
        let mut x = rng.next_f64() * total;
        for s in scored {
            x -= weight(s.1);
            if x <= 0.0 {
                return Some(s.0);
            }
        }
        return scored.last().map(|s| s.0);
    }
    // Costs are sums of block counts; anything this close is the same cost.
    let tol = 1e-6 * min.abs().max(1.0);
    let ties = scored.iter().filter(|s| s.1 - min <= tol).count();
    let k = rng.below(ties);
    scored
        .iter()
        .filter(|s| s.1 - min <= tol)
        .nth(k)
        .map(|s| s.0)
}

/// Tokens the chosen worker would have to compute: the disaggregation input.
pub fn uncached_tokens(prompt_tokens: u32, overlap_tokens: u32) -> u32 {
    prompt_tokens.saturating_sub(overlap_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{LoadParams, LoadTable, NewRequest, Report};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cand(id: u16, overlap: u32, load: WorkerView) -> Candidate {
        Candidate {
            id,
            overlap_tokens: overlap * 16,
            kv_blocks: 1000,
            indexed_blocks: 0,
            load,
            confirmed_tokens: overlap * 16,
            family_share: None,
            speed: 1.0,
            adapter_loads: 0.0,
        }
    }

    fn idle() -> WorkerView {
        WorkerView {
            healthy: true,
            ..WorkerView::default()
        }
    }

    fn shape(tokens: u32) -> RequestShape {
        RequestShape {
            prompt_tokens: tokens,
            total_blocks: tokens.div_ceil(16),
        }
    }

    fn picked(o: Outcome) -> Pick {
        match o {
            Outcome::Picked(p) => p,
            other => panic!("expected a pick, got {other:?}"),
        }
    }

    /// A worker twice as fast does the same queue in half the time: with twice the queue of
    /// a speed-1 worker it costs the same; with the same queue it wins. Its request share is
    /// counted per unit of speed, so twice the requests make it no hot spot.
    #[test]
    fn a_faster_worker_is_priced_in_time() {
        let p = SelectParams::default();
        let r = shape(1600);
        let queued = |tokens: f64, prefilling: u32, inflight: u32| WorkerView {
            prefill_tokens: tokens,
            prefilling,
            inflight,
            context_blocks: u64::from(inflight) * 100,
            ..idle()
        };
        let fast = |v: WorkerView| Candidate {
            speed: 2.0,
            ..cand(0, 0, v)
        };
        let slow = cand(1, 0, queued(4000.0, 2, 2));
        let same = fast(queued(4000.0, 2, 2));
        let pool = Pool::of(&[same, slow]);
        let (a, b) = (terms(&p, &same, &r, &pool), terms(&p, &slow, &r, &pool));
        for (x, y) in [
            (a.prefill, b.prefill),
            (a.recompute, b.recompute),
            (a.decode, b.decode),
            (a.interference, b.interference),
        ] {
            assert!(x > 0.0 && (2.0 * x - y).abs() < 1e-9, "{a:?} vs {b:?}");
        }
        assert_eq!(picked(pick(&p, &[same, slow], &r, &mut Rng::new(1))).id, 0);
        assert_eq!(picked(pick(&p, &[slow, same], &r, &mut Rng::new(1))).id, 0);
        // Twice the recent requests of a speed-1 worker, on twice the speed.
        let recent = |n: f64, inflight: u32| WorkerView {
            recent_requests: n,
            inflight,
            ..idle()
        };
        let busy_fast = fast(recent(80.0, 8));
        let others = [cand(1, 0, recent(40.0, 4)), cand(2, 0, recent(40.0, 4))];
        let pool = Pool::of(&[busy_fast, others[0], others[1]]);
        assert_eq!(request_share(&p, &busy_fast, &pool), None);
        assert_eq!(terms(&p, &busy_fast, &r, &pool).share, 0.0);
        // The same traffic on a speed-1 worker is a hot spot.
        let busy_slow = cand(0, 0, recent(80.0, 8));
        let pool = Pool::of(&[busy_slow, others[0], others[1]]);
        assert!(terms(&p, &busy_slow, &r, &pool).share > 0.0);
    }

    /// A cold 8k-token prompt: the prefill pool's queue is a little longer than the decode
    /// worker's, but the decode worker has six short requests waiting and twenty streams
    /// running, all of which a local prefill would hold up; the pool costs less.
    #[test]
    fn a_prefill_costs_the_requests_queued_behind_it_too() {
        let p = SelectParams::default();
        let pool = cand(
            0,
            0,
            WorkerView {
                prefill_tokens: 2000.0,
                prefilling: 1,
                inflight: 1,
                ..idle()
            },
        );
        let decode = cand(
            1,
            0,
            WorkerView {
                prefill_tokens: 1500.0,
                prefilling: 6,
                inflight: 20,
                ..idle()
            },
        );
        let r = shape(8000);
        assert!(pool.load.prefill_tokens > decode.load.prefill_tokens);
        let on_pool = prefill_cost(&p, &[pool], 0, &r);
        let on_decode = prefill_cost(&p, &[decode], 1, &r);
        assert!(on_pool < on_decode, "pool {on_pool} decode {on_decode}");
        // Alone with the same load the two cost the same; an unknown worker never wins.
        assert_eq!(
            prefill_cost(&p, &[pool], 0, &r),
            prefill_cost(&p, &[cand(1, 0, pool.load)], 1, &r)
        );
        assert_eq!(prefill_cost(&p, &[pool], 7, &r), f64::INFINITY);
    }

    #[test]
    fn repeat_prefix_returns_to_its_worker_when_loads_are_equal() {
        let p = SelectParams::default();
        for seed in 0..20 {
            let cands = [cand(0, 0, idle()), cand(1, 100, idle()), cand(2, 0, idle())];
            assert_eq!(
                picked(pick(&p, &cands, &shape(1600), &mut Rng::new(seed))).id,
                1
            );
        }
    }

    #[test]
    fn affinity_beats_a_small_idle_difference() {
        let p = SelectParams::default();
        let busyish = WorkerView {
            inflight: 1,
            active_blocks: 20,
            prefill_tokens: 0.0,
            healthy: true,
            ..idle()
        };
        let cands = [cand(0, 0, idle()), cand(1, 90, busyish)];
        assert_eq!(
            picked(pick(&p, &cands, &shape(1600), &mut Rng::new(3))).id,
            1
        );
    }

    #[test]
    fn load_beats_a_short_shared_prefix() {
        let p = SelectParams::default();
        let loaded = WorkerView {
            inflight: 4,
            active_blocks: 400,
            prefill_tokens: 3000.0,
            healthy: true,
            ..idle()
        };
        let cands = [cand(0, 2, loaded), cand(1, 0, idle())];
        assert_eq!(
            picked(pick(&p, &cands, &shape(1600), &mut Rng::new(3))).id,
            1
        );
    }

    #[test]
    fn ties_are_broken_randomly_across_workers() {
        let p = SelectParams::default();
        let cands = [
            cand(0, 0, idle()),
            cand(1, 0, idle()),
            cand(2, 0, idle()),
            cand(3, 0, idle()),
        ];
        let mut rng = Rng::new(11);
        let mut seen = [0u32; 4];
        for _ in 0..400 {
            seen[usize::from(picked(pick(&p, &cands, &shape(100), &mut rng)).id)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
    }

    /// 64 identical requests arrive before any finishes; each pick is charged at once, so the
    /// burst spreads once the decode work piled on the holder outweighs the shared prefix.
    #[test]
    fn burst_of_identical_requests_spreads() {
        let p = SelectParams::default();
        let mut t = LoadTable::new(4, LoadParams::default());
        let blocks: Vec<u64> = (0..128).collect();
        // Worker 0 has served this prompt before; a pick records the prompt on its worker.
        let mut overlap = [128u32, 0, 0, 0];
        let mut rng = Rng::new(5);
        let mut per = [0u32; 4];
        // 2048 prompt tokens plus 256 expected output tokens.
        let r = RequestShape {
            prompt_tokens: 2048,
            total_blocks: 128 + 16,
        };
        for id in 0..64u64 {
            let cands: Vec<Candidate> = (0..4u16)
                .map(|w| cand(w, overlap[usize::from(w)], t.view(w, 0, 0)))
                .collect();
            let pk = picked(pick(&p, &cands, &r, &mut rng));
            per[usize::from(pk.id)] += 1;
            overlap[usize::from(pk.id)] = 128;
            let cached = pk.overlap_tokens / 16;
            t.add(&NewRequest {
                id,
                worker: pk.id,
                prefill_worker: None,
                blocks: blocks.clone(),
                cached_blocks: cached,
                tail_blocks: 16,
                prefill_tokens: uncached_tokens(2048, pk.overlap_tokens),
                now_ms: 0,
                adapter: 0,
            });
        }
        // Copying the prefix costs recompute_weight_min extra (its tokens share the copier's
        // batches), so the burst spreads over as many workers as its decode work needs.
        assert!(
            per.iter().filter(|&&n| n > 0).count() >= 3,
            "at least three workers take part: {per:?}"
        );
        assert!(
            per.iter().all(|&n| n <= 32),
            "no worker takes more than half: {per:?}"
        );
        assert!(
            per[0] >= per[1],
            "the warm worker takes at least its share: {per:?}"
        );
    }

    /// Sequential requests sharing only a short prefix: nothing is in flight, so without a
    /// balancing term every one of them would go to the worker holding the shared block.
    #[test]
    fn short_shared_prefix_does_not_attract_everything() {
        let p = SelectParams::default();
        let mut t = LoadTable::new(4, LoadParams::default());
        let mut rng = Rng::new(9);
        let mut per = [0u32; 4];
        for id in 0..40u64 {
            // Every prompt: 1 shared block then 99 of its own; worker 0 held the shared block.
            let blocks: Vec<u64> = core::iter::once(7)
                .chain((0..99).map(|i| id * 1000 + i))
                .collect();
            let now = id * 1000;
            let cands: Vec<Candidate> = (0..4u16)
                .map(|w| cand(w, u32::from(w == 0), t.view(w, now, 0)))
                .collect();
            let pk = picked(pick(&p, &cands, &shape(1600), &mut rng));
            per[usize::from(pk.id)] += 1;
            t.add(&NewRequest {
                id,
                worker: pk.id,
                prefill_worker: None,
                blocks: blocks.clone(),
                cached_blocks: pk.overlap_tokens / 16,
                tail_blocks: 0,
                prefill_tokens: 1600,
                now_ms: now,
                adapter: 0,
            });
            t.free(id); // finished before the next one arrives
        }
        assert!(per.iter().all(|&n| n >= 5), "{per:?}");
    }

    #[test]
    fn unhealthy_and_busy_workers_are_avoided_but_fail_open() {
        let p = SelectParams {
            busy_waiting: 4,
            ..SelectParams::default()
        };
        let sick = WorkerView {
            healthy: false,
            ..idle()
        };
        let busy = WorkerView {
            report: Some(Report {
                kv_usage: 0.1,
                waiting: 9,
                running: None,
                at_ms: 0,
            }),
            ..idle()
        };
        let mut rng = Rng::new(1);
        let warm_sick = [cand(0, 100, sick), cand(1, 0, idle())];
        assert_eq!(picked(pick(&p, &warm_sick, &shape(1600), &mut rng)).id, 1);
        let warm_busy = [cand(0, 100, busy), cand(1, 0, idle())];
        assert_eq!(picked(pick(&p, &warm_busy, &shape(1600), &mut rng)).id, 1);
        let all_sick = [cand(0, 100, sick), cand(1, 0, sick)];
        let pk = picked(pick(&p, &all_sick, &shape(1600), &mut rng));
        assert!(pk.none_healthy);
        assert_eq!(pk.id, 0);
        let all_busy = [cand(0, 100, busy)];
        assert!(picked(pick(&p, &all_busy, &shape(1600), &mut rng)).all_busy);
        let shed = SelectParams {
            reject_when_all_busy: true,
            ..p
        };
        assert_eq!(
            pick(&shed, &all_busy, &shape(1600), &mut rng),
            Outcome::Rejected
        );
        assert_eq!(pick(&p, &[], &shape(1), &mut rng), Outcome::NoCandidates);
    }

    #[test]
    fn reported_kv_usage_raises_cost() {
        let p = SelectParams::default();
        let reported = WorkerView {
            report: Some(Report {
                kv_usage: 0.9,
                waiting: 0,
                running: None,
                at_ms: 0,
            }),
            ..idle()
        };
        // Another gateway filled worker 0; our own table thinks it is idle.
        let cands = [cand(0, 10, reported), cand(1, 0, idle())];
        assert_eq!(
            picked(pick(&p, &cands, &shape(1600), &mut Rng::new(2))).id,
            1
        );
    }

    #[test]
    fn temperature_samples_but_prefers_cheap() {
        let p = SelectParams {
            temperature: 0.5,
            ..SelectParams::default()
        };
        let loaded = WorkerView {
            prefill_tokens: 8000.0,
            ..idle()
        };
        let cands = [cand(0, 0, idle()), cand(1, 0, loaded)];
        let mut rng = Rng::new(4);
        let mut cheap = 0;
        for _ in 0..1000 {
            if picked(pick(&p, &cands, &shape(160), &mut rng)).id == 0 {
                cheap += 1;
            }
        }
        // weights 1 and e^-2: P(cheap) = 1 / (1 + 0.135) = 0.88
        assert!((830..930).contains(&cheap), "{cheap}");
    }

    #[test]
    fn staged_decode_still_prefers_the_cached_worker() {
        let p = SelectParams {
            staged_decode: true,
            cache_balance: 0.0,
            ..SelectParams::default()
        };
        let r = shape(1600);
        let cold = cost(&p, &cand(0, 0, idle()), &r, &Pool::default());
        let warm = cost(&p, &cand(1, 100, idle()), &r, &Pool::default());
        assert!(warm < cold);
        let q = SelectParams {
            staged_decode: false,
            cache_balance: 0.0,
            ..SelectParams::default()
        };
        assert!(
            cost(&q, &cand(1, 100, idle()), &r, &Pool::default())
                < cost(&q, &cand(0, 0, idle()), &r, &Pool::default())
        );
    }

    /// The holder of a 1600-token prefix has 3200 tokens of prefill queued; the other workers
    /// are idle (low load: recomputing there delays nobody) or have requests waiting too.
    #[test]
    fn affinity_tightens_as_queues_grow() {
        // Only the queue-driven part of the recompute weight.
        let p = SelectParams {
            recompute_weight_min: 0.0,
            copy_weight: 0.0,
            ..SelectParams::default()
        };
        let queued = |prefilling: u32, tokens: f64| WorkerView {
            prefilling,
            prefill_tokens: tokens,
            inflight: prefilling,
            ..idle()
        };
        let r = shape(1600);
        let low = [
            cand(0, 100, queued(1, 3200.0)),
            cand(1, 0, idle()),
            cand(2, 0, idle()),
        ];
        assert_ne!(picked(pick(&p, &low, &r, &mut Rng::new(1))).id, 0);
        // Every worker has a queue: recomputing the prefix on one delays whoever queues there.
        let high = [
            cand(0, 100, queued(4, 3200.0)),
            cand(1, 0, queued(3, 1000.0)),
            cand(2, 0, queued(3, 1000.0)),
        ];
        assert_eq!(Pool::of(&high).waiting, 3);
        assert_eq!(recompute_factor(&p, &high[1], 0), 3.0);
        // A cold worker with no queue of its own still pays the fleet's scarcity.
        assert_eq!(
            recompute_factor(&p, &cand(3, 0, idle()), Pool::of(&high).waiting),
            3.0
        );
        for seed in 0..10 {
            assert_eq!(picked(pick(&p, &high, &r, &mut Rng::new(seed))).id, 0);
        }
        // Without the recompute term the idle-ish cold workers win, as at low load.
        let flat = SelectParams {
            recompute_weight: 0.0,
            ..p
        };
        assert_ne!(picked(pick(&flat, &high, &r, &mut Rng::new(1))).id, 0);
        // The factor is capped.
        let deep = cand(0, 0, queued(1000, 0.0));
        assert_eq!(recompute_factor(&p, &deep, 0), p.recompute_weight_max);
    }

    /// Decode work counts each request's whole context: a worker decoding many long requests
    /// loses a fully cached request to an idle one once that work outweighs the prefill.
    #[test]
    fn decode_work_outweighs_a_cached_prefix_eventually() {
        let p = SelectParams::default();
        let free_copies = SelectParams {
            recompute_weight_min: 0.0,
            copy_weight: 0.0,
            ..p
        };
        let decoding = |requests: u64| WorkerView {
            inflight: requests as u32,
            context_blocks: requests * 110,
            active_blocks: 110,
            ..idle()
        };
        let r = shape(1600);
        let few = [cand(0, 100, decoding(4)), cand(1, 0, idle())];
        assert_eq!(picked(pick(&p, &few, &r, &mut Rng::new(1))).id, 0);
        let many = [cand(0, 100, decoding(40)), cand(1, 0, idle())];
        assert_eq!(
            picked(pick(&free_copies, &many, &r, &mut Rng::new(1))).id,
            1
        );
        // A copy also costs (1 + recompute_weight_min + copy_weight) x its prefill: it shares
        // the copier's batches and loses the hit.
        assert_eq!(picked(pick(&p, &many, &r, &mut Rng::new(1))).id, 0);
        let more = [cand(0, 100, decoding(200)), cand(1, 0, idle())];
        assert_eq!(picked(pick(&p, &more, &r, &mut Rng::new(1))).id, 1);
    }

    /// A worker holding a short prompt's prefix but sitting on requests it never starts (no
    /// first byte) loses the next one to an idle worker: each waiting request costs its
    /// fixed overhead even when its own prefill was predicted cached.
    #[test]
    fn stalled_worker_stops_attracting_short_prompts() {
        let p = SelectParams::default();
        let stalled = WorkerView {
            prefilling: 4,
            inflight: 4,
            prefill_tokens: 4.0 * 48.0,
            ..idle()
        };
        let r = shape(160);
        let cands = [cand(0, 8, stalled), cand(1, 0, idle()), cand(2, 0, idle())];
        assert_ne!(picked(pick(&p, &cands, &r, &mut Rng::new(1))).id, 0);
    }

    /// A document cached on a worker with one request queued: an idle worker with room in
    /// its cache may copy it (same wait, space is free), one whose cache is full may not.
    #[test]
    fn duplicates_cost_only_under_eviction_pressure() {
        let p = SelectParams {
            cache_balance: 0.0,
            recompute_weight_min: 0.0,
            copy_weight: 0.0,
            ..SelectParams::default()
        };
        let holder = WorkerView {
            prefilling: 1,
            inflight: 1,
            prefill_tokens: 1600.0,
            ..idle()
        };
        let r = shape(1600);
        let roomy = [cand(0, 100, holder), cand(1, 0, idle())];
        assert_eq!(Pool::of(&roomy).best_confirmed_tokens, 1600);
        assert_eq!(picked(pick(&p, &roomy, &r, &mut Rng::new(1))).id, 1);
        let full_cache = Candidate {
            indexed_blocks: 1000,
            ..cand(1, 0, idle())
        };
        let full = [cand(0, 100, holder), full_cache];
        assert_eq!(picked(pick(&p, &full, &r, &mut Rng::new(1))).id, 0);
    }

    /// An agent's context cached on a worker with four contexts' worth of prefill queued: an
    /// idle worker would start sooner, but copying the context recomputes it and loses its
    /// hit, so it stays; once the queue is ten contexts deep it moves.
    #[test]
    fn a_copy_costs_its_lost_hit_even_with_room() {
        let p = SelectParams {
            cache_balance: 0.0,
            ..SelectParams::default()
        };
        let queued = |tokens: f64| WorkerView {
            prefilling: 1,
            inflight: 1,
            prefill_tokens: tokens,
            ..idle()
        };
        // 1600 tokens held, 160 new ones.
        let r = shape(1760);
        let short = [cand(0, 100, queued(6400.0)), cand(1, 0, idle())];
        assert_eq!(picked(pick(&p, &short, &r, &mut Rng::new(1))).id, 0);
        let no_copy_cost = SelectParams {
            copy_weight: 0.0,
            ..p
        };
        assert_eq!(
            picked(pick(&no_copy_cost, &short, &r, &mut Rng::new(1))).id,
            1
        );
        let deep = [cand(0, 100, queued(16_000.0)), cand(1, 0, idle())];
        assert_eq!(picked(pick(&p, &deep, &r, &mut Rng::new(1))).id, 1);
    }

    /// Streams on a worker wait out every pass that carries a prefill (chunked prefill): a
    /// cold prompt goes where fewer of them run, all else equal, and a fully cached one still
    /// pays for its pass.
    #[test]
    fn prefill_avoids_workers_with_many_decoding_streams() {
        let p = SelectParams {
            cache_balance: 0.0,
            decode_interference: 0.25,
            ..SelectParams::default()
        };
        let decoding = |n: u32| WorkerView {
            inflight: n,
            ..idle()
        };
        let r = shape(1600);
        let many = cand(0, 0, decoding(20));
        let few = cand(1, 0, decoding(2));
        for seed in 0..10 {
            assert_eq!(
                picked(pick(&p, &[many, few], &r, &mut Rng::new(seed))).id,
                1
            );
        }
        let pool = Pool::of(&[many, few]);
        let overhead = p.request_overhead_tokens / 16.0;
        let want = p.decode_interference * 20.0 * (100.0 + overhead);
        assert!(want > 0.0);
        assert!((terms(&p, &many, &r, &pool).interference - want).abs() < 1e-9);
        // Requests queued ahead of it will be decoding when its prefill runs: they count.
        let waiting = WorkerView {
            inflight: 20,
            prefilling: 20,
            ..idle()
        };
        assert!((terms(&p, &cand(0, 0, waiting), &r, &pool).interference - want).abs() < 1e-9);
        let cached = terms(&p, &cand(0, 100, decoding(20)), &r, &pool).interference;
        assert!((cached - p.decode_interference * 20.0 * overhead).abs() < 1e-9);
        let off = SelectParams {
            decode_interference: 0.0,
            ..p
        };
        assert_eq!(terms(&off, &many, &r, &pool).interference, 0.0);
    }

    /// Above the watermark every further block held costs a block of prefill.
    #[test]
    fn memory_counts_only_above_the_watermark() {
        let p = SelectParams {
            cache_balance: 0.0,
            decode_weight: 0.0,
            ..SelectParams::default()
        };
        let held = |blocks: u64| WorkerView {
            active_blocks: blocks,
            ..idle()
        };
        let r = shape(160);
        let base = cost(&p, &cand(0, 0, idle()), &r, &Pool::default());
        assert_eq!(cost(&p, &cand(0, 0, held(800)), &r, &Pool::default()), base);
        // 950 held + 10 new against 900 allowed.
        assert!(
            (cost(&p, &cand(0, 0, held(950)), &r, &Pool::default()) - base - 60.0).abs() < 1e-9
        );
    }

    /// Requests, half of them one hot prefix family and half unique prompts, each finishing
    /// `overlap` picks later. Cheap prefills, so no queue ever says the family's worker is
    /// a hot spot: only the request share can.
    fn hot_family(p: &SelectParams, overlap: u64) -> ([u32; 4], u32) {
        let mut t = LoadTable::new(4, LoadParams::default());
        let mut rng = Rng::new(21);
        let mut per = [0u32; 4];
        let mut holds = [false; 4];
        let mut copies = 0;
        for id in 0..400u64 {
            // The family: an 8000-token document; the rest: 160-token prompts of their own.
            let hot = id % 2 == 0;
            let (tokens, blocks) = if hot { (8000, 500) } else { (160, 10) };
            let now = id * 10;
            let cands: Vec<Candidate> = (0..4u16)
                .map(|w| {
                    let held = if hot && holds[usize::from(w)] {
                        blocks
                    } else {
                        0
                    };
                    cand(w, held, t.view(w, now, 0))
                })
                .collect();
            let pk = picked(pick(p, &cands, &shape(tokens), &mut rng));
            let w = usize::from(pk.id);
            per[w] += 1;
            if hot && !holds[w] {
                holds[w] = true;
                copies += 1;
            }
            t.add(&NewRequest {
                id,
                worker: pk.id,
                prefill_worker: None,
                blocks: (0..u64::from(blocks))
                    .map(|b| if hot { b } else { id * 1000 + b })
                    .collect(),
                cached_blocks: pk.overlap_tokens / 16,
                tail_blocks: 0,
                prefill_tokens: uncached_tokens(tokens, pk.overlap_tokens),
                now_ms: now,
                adapter: 0,
            });
            // Prefill takes no time here; decoding lasts `overlap` picks.
            t.prefill_done(id);
            if let Some(done) = id.checked_sub(overlap) {
                t.free(done);
            }
        }
        (per, copies)
    }

    fn max_over_mean(per: &[u32]) -> f64 {
        let mean = f64::from(per.iter().sum::<u32>()) / per.len() as f64;
        f64::from(per.iter().copied().max().unwrap_or(0)) / mean
    }

    #[test]
    fn a_hot_prefix_family_is_copied_instead_of_making_a_hot_spot() {
        let off = SelectParams {
            request_ratio: 0.0,
            ..SelectParams::default()
        };
        let (per, copies) = hot_family(&off, 6);
        assert!(max_over_mean(&per) >= 1.9, "{per:?}");
        assert_eq!(copies, 1, "{per:?}");
        let (per, copies) = hot_family(&SelectParams::default(), 6);
        assert!(max_over_mean(&per) <= 1.5, "{per:?}");
        assert!((2..=3).contains(&copies), "{copies} copies: {per:?}");
        // One at a time, every worker is idle when a request lands: nothing to spread.
        let (per, copies) = hot_family(&SelectParams::default(), 0);
        assert_eq!(copies, 1, "{per:?}");
    }

    /// Blocks a worker holds only for requests it has not answered are cached nowhere yet:
    /// copying them loses no hit, so a worker that takes requests and never answers them
    /// does not attract its prompts' families (tests/e2e/test_chaos.py, the black hole).
    #[test]
    fn unanswered_blocks_are_no_lost_hit() {
        let p = SelectParams::default();
        let r = shape(1600);
        let other = cand(1, 0, idle());
        let copy = |holder: Candidate| terms(&p, &other, &r, &Pool::of(&[holder, other])).duplicate;
        assert!(copy(cand(0, 100, idle())) > 0.0);
        let unanswered = Candidate {
            confirmed_tokens: 0,
            ..cand(0, 100, idle())
        };
        assert_eq!(copy(unanswered), 0.0);
    }

    /// A hot worker sheds the prefix family that makes it hot, not a bystander: moving either
    /// costs the same copy, and only the family's copy takes its later requests along.
    #[test]
    fn a_hot_worker_sheds_its_hot_family_not_a_bystander() {
        let p = SelectParams::default();
        // 1.33 means: past the ratio, not yet by as much again.
        let hot = WorkerView {
            recent_requests: 36.0,
            inflight: 12,
            ..idle()
        };
        let calm = WorkerView {
            recent_requests: 20.0,
            inflight: 3,
            ..idle()
        };
        let r = shape(8000);
        // Where a request of a family with `share` of the holder's requests goes.
        let pick_for = |p: &SelectParams, holder: WorkerView, share: Option<f64>| {
            let holder = Candidate {
                family_share: share,
                ..cand(0, 500, holder)
            };
            let c = [holder, cand(1, 0, calm), cand(2, 0, calm), cand(3, 0, calm)];
            picked(pick(p, &c, &r, &mut Rng::new(1))).id
        };
        assert_eq!(
            pick_for(&p, hot, Some(0.02)),
            0,
            "a bystander keeps its cache"
        );
        assert_ne!(pick_for(&p, hot, Some(0.5)), 0, "the hot family is copied");
        // Unknown family (a new prefix) or focus off: shed as before.
        assert_ne!(pick_for(&p, hot, None), 0);
        let off = SelectParams {
            request_ratio_family: 0.0,
            ..p
        };
        assert_ne!(pick_for(&off, hot, Some(0.02)), 0);
        // Far past the ratio copying the hot family has not been enough: anything goes.
        let hotter = WorkerView {
            recent_requests: 60.0,
            ..hot
        };
        assert_ne!(pick_for(&p, hotter, Some(0.02)), 0);
    }

    /// A lone session on a quiet fleet keeps its worker however long it runs.
    #[test]
    fn a_lone_session_keeps_its_worker() {
        let p = SelectParams::default();
        let mut t = LoadTable::new(4, LoadParams::default());
        let mut rng = Rng::new(4);
        for id in 0..40u64 {
            let cands: Vec<Candidate> = (0..4u16)
                .map(|w| cand(w, if w == 2 { 100 } else { 0 }, t.view(w, id * 1000, 0)))
                .collect();
            let pk = picked(pick(&p, &cands, &shape(1700), &mut rng));
            assert_eq!(pk.id, 2, "turn {id}");
            t.add(&NewRequest {
                id,
                worker: pk.id,
                prefill_worker: None,
                blocks: (0..106).collect(),
                cached_blocks: 100,
                tail_blocks: 0,
                prefill_tokens: 100,
                now_ms: id * 1000,
                adapter: 0,
            });
            t.free(id);
        }
    }

    /// Under overload requests differ in size: a worker that took many short requests but has
    /// fewer in flight than the average is not the busy one, and its share does not count.
    #[test]
    fn request_share_counts_only_on_a_worker_busier_than_average() {
        let p = SelectParams::default();
        let w = |recent: f64, inflight: u32| WorkerView {
            recent_requests: recent,
            inflight,
            ..idle()
        };
        let many_short = cand(0, 0, w(100.0, 3));
        let few_long = cand(1, 0, w(20.0, 9));
        let pool = Pool::of(&[many_short, few_long]);
        assert_eq!(request_share(&p, &many_short, &pool), None);
        let busy = cand(0, 0, w(100.0, 12));
        let pool = Pool::of(&[busy, few_long]);
        let share = request_share(&p, &busy, &pool).unwrap_or(0.0);
        assert!(share > p.request_ratio, "{share}");
    }

    /// Once the median worker has prefill waiting the fleet is saturated and the queues price
    /// every worker: the share term counts only past `request_ratio_saturated`, for every
    /// request alike, and not at all with it 0 (Mooncake conversation at speed 32, dev: TTFT
    /// p50 worse than with the term off in 5 of 5 runs while the usual ratio counted there).
    #[test]
    fn a_saturated_fleet_caps_request_share_only_far_past_the_mean() {
        let p = SelectParams::default();
        let w = |recent: f64, inflight: u32, prefilling: u32| WorkerView {
            recent_requests: recent,
            inflight,
            prefilling,
            ..idle()
        };
        let share_cost = |p: &SelectParams, hot: Candidate, prefilling: u32| {
            let calm = [
                cand(1, 0, w(20.0, 3, prefilling)),
                cand(2, 0, w(20.0, 3, prefilling)),
            ];
            let pool = Pool::of(&[hot, calm[0], calm[1]]);
            assert_eq!(pool.waiting, prefilling);
            terms(p, &hot, &shape(1600), &pool).share
        };
        // Twice the mean is a hot spot either way, for a bystander's request too.
        let hot = Candidate {
            family_share: Some(0.01),
            ..cand(0, 100, w(100.0, 12, 0))
        };
        assert!(share_cost(&p, hot, 0) > 0.0);
        assert!(share_cost(&p, hot, 1) > 0.0);
        // Within the saturated ratio nothing is charged: mean (40 + 30 + 30) / 3, share
        // (40 - 4 slack) / 33.3 = 1.08.
        let mild = cand(0, 100, w(40.0, 12, 0));
        let calm = [cand(1, 0, w(30.0, 3, 1)), cand(2, 0, w(30.0, 3, 1))];
        let pool = Pool::of(&[mild, calm[0], calm[1]]);
        assert_eq!(pool.waiting, 1);
        assert!(request_share(&p, &mild, &pool).is_some());
        assert_eq!(terms(&p, &mild, &shape(1600), &pool).share, 0.0);
        // Off: a saturated fleet is left to the queues.
        let off = SelectParams {
            request_ratio_saturated: 0.0,
            ..p
        };
        assert_eq!(share_cost(&off, hot, 1), 0.0);
        let hot_pool = Pool::of(&[hot, cand(1, 0, w(20.0, 3, 2)), cand(2, 0, w(20.0, 3, 1))]);
        assert_eq!(request_share(&off, &hot, &hot_pool), None);
    }

    /// Past saturation a hot worker charges every request the same: the excess counts
    /// requests, each priced at the pool's mean context blocks per request in flight. Priced
    /// by its own prompt, a worker hot with short requests would keep attracting them (the
    /// Mooncake conversation pile-up: max/mean requests 1.73-1.86 at speed 32 on dev windows
    /// 4000 and 10000, 1.42-1.51 with this price). And it is charged with fewer requests in
    /// flight than the average worker, since short requests leave quickly.
    #[test]
    fn a_saturated_hot_spot_prices_each_request_alike() {
        let p = SelectParams::default();
        let w = |recent: f64, inflight: u32, context: u64| WorkerView {
            recent_requests: recent,
            inflight,
            prefilling: 1,
            context_blocks: context,
            ..idle()
        };
        // Hot by count (share (100 - 4) / 46.7 = 2.06) with 3 short requests in flight,
        // fewer than the others' 6 long ones.
        let hot = cand(0, 0, w(100.0, 3, 300));
        let others = [cand(1, 0, w(20.0, 6, 6000)), cand(2, 0, w(20.0, 6, 6000))];
        let pool = Pool::of(&[hot, others[0], others[1]]);
        assert!(pool.mean_inflight > 3.0);
        // (300 + 6000 + 6000) / 15 requests in flight.
        assert!((pool.mean_request_blocks - 820.0).abs() < 1e-9);
        let short = terms(&p, &hot, &shape(320), &pool).share;
        let long = terms(&p, &hot, &shape(32000), &pool).share;
        assert!(short > 0.0);
        assert_eq!(short, long);
        let share = (100.0 - p.request_ratio_slack) / pool.mean_recent;
        let want = p.prefill_load_scale
            * (p.request_ratio_weight * (share - p.request_ratio_saturated) * 820.0);
        assert!((short - want).abs() < 1e-6 * want, "{short} vs {want}");
        // No context known in flight (no blocks charged yet): the request's own prompt is
        // the price.
        let hot = cand(0, 0, w(100.0, 3, 0));
        let others = [cand(1, 0, w(20.0, 6, 0)), cand(2, 0, w(20.0, 6, 0))];
        let pool = Pool::of(&[hot, others[0], others[1]]);
        assert_eq!(pool.mean_request_blocks, 0.0);
        let short = terms(&p, &hot, &shape(320), &pool).share;
        let long = terms(&p, &hot, &shape(32000), &pool).share;
        assert!(short > 0.0);
        assert!(
            (long - 100.0 * short).abs() < 1e-6 * long,
            "{short} vs {long}"
        );
    }

    #[test]
    fn uncached_tokens_saturates() {
        assert_eq!(uncached_tokens(1000, 160), 840);
        assert_eq!(uncached_tokens(100, 160), 0);
    }
}
