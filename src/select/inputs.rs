//! What selection reads: the configured weights, the request, each candidate worker, the
//! pool as a whole, and the per-candidate quantities several cost terms share.

use crate::config::Config;
use crate::ids::WorkerId;
use crate::load::WorkerView;

/// The scoring weights of `crate::config::ScoringConfig` by the same names (`duplicates`
/// pairs the two lists), with the busy thresholds and the prices derived from `load` and
/// `lora`: one flat `Copy` value per router, so a term reads `p.<knob>` whatever section the
/// knob is configured in.
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
    /// Of `overlap_tokens` and `confirmed_tokens`, those this router's own placements hold
    /// (its picks, and the text picks an engine reported) where the engine, if it reports,
    /// still holds them. They differ where an engine reports a copy this router did not place
    /// (traffic past the gateway, or another gateway's) or evicted a placement. Keeping a
    /// stray copy warm costs what making one does (`duplicate`) while another worker's engine
    /// holds the router's own placement; with none anywhere it is a plain hit.
    pub placed_tokens: u32,
    pub placed_confirmed_tokens: u32,
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

/// What the cost of one worker depends on beyond that worker: the pool as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Pool {
    /// Requests waiting for prefill on the median healthy worker: how scarce prefill capacity
    /// is across the pool, untouched by one hot worker's queue.
    pub waiting: u32,
    /// The longest confirmed cached prefix any worker holds for this request, in tokens.
    pub best_confirmed_tokens: u32,
    /// The same through this router's own placements ([`Candidate::placed_confirmed_tokens`]).
    pub best_placed_confirmed_tokens: u32,
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
            best_placed_confirmed_tokens: cands
                .iter()
                .map(|c| c.placed_confirmed_tokens)
                .max()
                .unwrap_or(0),
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
pub(super) fn speed_of(c: &Candidate) -> f64 {
    if c.speed.is_finite() && c.speed > 0.0 {
        c.speed
    } else {
        1.0
    }
}

/// What several cost terms share, once per candidate: the request's size on `c` in blocks,
/// and `c`'s speed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Basis {
    /// Tokens per block.
    pub(super) bs: f64,
    /// `c`'s KV capacity in blocks.
    pub(super) kv: f64,
    /// Prompt blocks `c` would compute: all but the cached ones credited.
    pub(super) uncached: f64,
    /// Blocks the request writes into `c`'s KV: its prompt and output less the cached prefix.
    pub(super) written: f64,
    /// Work on `c` takes 1 / speed of the time: queue, prefill and decode are priced in time
    /// (in blocks of a speed-1 worker), so a mixed fleet balances by time, not by blocks.
    pub(super) speed: f64,
}

impl Basis {
    pub(super) fn of(p: &SelectParams, c: &Candidate, r: &RequestShape) -> Basis {
        let bs = f64::from(p.block_size.max(1));
        let overlap = f64::from(c.overlap_tokens.min(r.prompt_tokens)) / bs;
        Basis {
            bs,
            kv: f64::from(c.kv_blocks.max(1)),
            uncached: (f64::from(r.prompt_tokens) / bs - p.overlap_credit * overlap).max(0.0),
            written: (f64::from(r.total_blocks) - overlap).max(0.0),
            speed: speed_of(c),
        }
    }
}
