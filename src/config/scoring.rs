//! How a worker is chosen: the cost terms' weights (`scoring`), when a worker counts as busy
//! (`busy`) and when a prompt goes to the prefill pool (`disaggregation`).

use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScoringConfig {
    /// Blocks of prefill work saved per cached block (Dynamo's overlap credit).
    pub overlap_credit: f64,
    /// Weight of pending prefill blocks against active decode blocks. Dynamo defaults to 1
    /// and reports 16-32 best on agentic traces.
    pub prefill_load_scale: f64,
    /// Count only the cached prefix as decode blocks until the prefill is done.
    pub staged_decode: bool,
    /// 0 picks the lowest cost (random among ties); > 0 samples with softmax over costs.
    pub temperature: f64,
    /// Weight of cache pressure: blocks the request would write, times the share of the
    /// worker's cache written recently (decaying with `cache_balance_half_life_ms`). Spreads
    /// unrelated prompts so the fleet's caches add up instead of one worker churning while
    /// others sit on stale content; 0 disables.
    pub cache_balance: f64,
    pub cache_balance_half_life_ms: u64,
    /// Extra weight on the prefill a request would recompute, per request waiting for prefill
    /// on the worker that would recompute it (a queue's length grows as utilisation /
    /// (1 - utilisation)): recomputing on a busy worker delays whoever queues behind it, so
    /// affinity tightens as load rises, and an idle worker still recomputes for free. 0
    /// disables.
    pub recompute_weight: f64,
    /// Upper bound of that extra weight.
    pub recompute_weight_max: f64,
    /// Extra weight on recomputed prefill even with no queue anywhere: the recomputed
    /// tokens share the worker's batches with everyone decoding there, and the copy they
    /// make duplicates cache the fleet already has.
    pub recompute_weight_min: f64,
    /// Cost of one block of an in-flight request's context, counted per request: every
    /// decode step attends over each request's whole context, so a worker decoding many long
    /// requests is slower for the next one even when they share a prefix in memory.
    pub decode_weight: f64,
    /// Weight of a request's prefill (uncached blocks plus its fixed overhead) per request in
    /// flight on the worker: with chunked prefill every pass that carries prefill tokens is
    /// also a decode step of each stream there, so a prefill placed among many streams slows
    /// all of them (TPOT). 0 disables.
    pub decode_interference: f64,
    /// Weight of writing again blocks another worker already holds, times the writer's cache
    /// pressure: under eviction pressure a duplicate pushes out content no one else holds.
    pub duplicate_weight: f64,
    /// Weight of recomputing blocks another worker already holds, whatever the cache's
    /// fullness: each is prefill the fleet did once already and a lost cache hit.
    pub copy_weight: f64,
    /// Share of a worker's KV above which every further block held costs as much as a block
    /// of prefill (preemption and eviction of cached prefixes start there).
    pub kv_watermark: f64,
    /// A worker whose recent requests (decaying with `cache_balance_half_life_ms`) exceed
    /// this many times the fleet's mean is a hot spot: the excess costs
    /// `request_ratio_weight` x the excess (in means) x the request's prompt blocks, so
    /// requests cached elsewhere too leave first, and a prefix held only there is copied
    /// to a second worker once the excess outweighs recomputing it. 0 disables.
    pub request_ratio: f64,
    pub request_ratio_weight: f64,
    /// Recent requests a worker may take beyond the ratio before it counts (a run's first
    /// requests say little about shares).
    pub request_ratio_slack: f64,
    /// Requests in flight below which a worker is no hot spot whatever its share: it is idle
    /// when the request lands (a quiet fleet's sequential requests keep their worker).
    pub request_ratio_min_inflight: u32,
    /// Share of a hot worker's recent requests a prefix family (the longest prefix some
    /// worker holds for the request) must bring for the hot-spot term to shed it at full
    /// weight; a family bringing less is shed in proportion: moving a bystander costs the
    /// same copy and relieves the worker of little. 0 sheds every request alike.
    pub request_ratio_family: f64,
    /// Share of recent requests a worker may reach while the fleet is saturated (the median
    /// worker has prefill waiting), where the request-share term above otherwise rests;
    /// beyond it every request is shed alike. It bounds the short cached requests that
    /// `decode_interference` leaves to pile onto one worker. 0 leaves saturated fleets to the
    /// queues.
    pub request_ratio_saturated: f64,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        Self {
            overlap_credit: 1.0,
            prefill_load_scale: 1.0,
            staged_decode: false,
            temperature: 0.0,
            cache_balance: 1.0,
            cache_balance_half_life_ms: 60_000,
            recompute_weight: 1.0,
            recompute_weight_max: 8.0,
            recompute_weight_min: 2.0,
            decode_weight: 0.05,
            decode_interference: 0.12,
            duplicate_weight: 4.0,
            copy_weight: 4.0,
            kv_watermark: 0.9,
            request_ratio: 1.25,
            request_ratio_weight: 128.0,
            request_ratio_slack: 4.0,
            request_ratio_min_inflight: 2,
            request_ratio_family: 0.25,
            request_ratio_saturated: 1.3,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BusyConfig {
    /// A worker reporting at least this KV usage (0..1) is busy. 0 disables.
    pub kv_usage: f64,
    /// A worker reporting at least this many waiting requests is busy. 0 disables.
    pub waiting_requests: u32,
    /// A worker with this many in-flight requests from this router is busy. 0 disables.
    pub inflight_requests: u32,
    /// Reports older than this are ignored.
    pub report_max_age_ms: u64,
    /// When every worker is busy: false routes anyway (lowest cost), true answers 429.
    pub reject_when_all_busy: bool,
}

impl Default for BusyConfig {
    fn default() -> Self {
        Self {
            kv_usage: 0.98,
            waiting_requests: 32,
            inflight_requests: 0,
            report_max_age_ms: 5_000,
            reject_when_all_busy: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DisaggMode {
    /// Steer to the prefill worker; name the decode worker in `decode_header`.
    Kvroute,
    /// llm-d's form: steer to the decode worker; name the prefill worker in
    /// `x-prefiller-host-port`.
    LlmD,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggConfig {
    /// Use the prefill pool when the uncached tokens on the chosen worker exceed this.
    /// 0 disables disaggregation. Dynamo's default is 5000.
    pub threshold_tokens: u32,
    /// Use the pool only when prefilling there costs no more than on the decode worker (the
    /// wait for it, the delay to requests queued behind it, the streams it slows). Off, every
    /// prompt over the threshold goes to the pool (llm-d's rule).
    pub compare_cost: bool,
    pub mode: DisaggMode,
    pub decode_header: String,
    pub prefiller_header: String,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            threshold_tokens: 5000,
            compare_cost: true,
            mode: DisaggMode::Kvroute,
            decode_header: "x-kvroute-decode-endpoint".into(),
            prefiller_header: "x-prefiller-host-port".into(),
        }
    }
}
