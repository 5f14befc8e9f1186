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
//!
//! Each term is one function in the file of its name, the name `x-kvroute-costs` prints
//! (`prefill.rs`, `recompute.rs`, `duplicate.rs`, `decode.rs`, `interference.rs`,
//! `memory.rs`, `balance.rs`, `share.rs`, `adapter.rs`), with its tests; [`terms`] adds them
//! up. What they read is in `inputs.rs`; candidates and picking are here.

mod adapter;
mod balance;
mod decode;
mod duplicate;
mod inputs;
mod interference;
mod memory;
mod prefill;
mod recompute;
mod share;
#[cfg(test)]
mod testutil;

pub use inputs::{Candidate, Pool, RequestShape, SelectParams};
pub use recompute::recompute_factor;
pub use share::request_share;

use crate::ids::WorkerId;
use crate::rng::Rng;
use inputs::Basis;

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

/// [`cost`], term by term. A term scaled by `prefill_load_scale` takes its unscaled product
/// first: a huge scale times a zero term must stay 0, never NaN.
pub fn terms(p: &SelectParams, c: &Candidate, r: &RequestShape, pool: &Pool) -> CostTerms {
    let b = Basis::of(p, c, r);
    CostTerms {
        prefill: prefill::prefill(p, c, &b),
        recompute: recompute::recompute(p, c, pool, &b),
        duplicate: duplicate::duplicate(p, c, r, pool, &b),
        decode: decode::decode(p, c, r, &b),
        interference: interference::interference(p, c, &b),
        memory: memory::memory(p, c, &b),
        balance: balance::balance(p, c, &b),
        share: share::share(p, c, r, pool),
        adapter: adapter::adapter(p, c, &b),
    }
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
    use super::testutil::*;
    use super::*;
    use crate::load::{Report, WorkerView};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
    fn uncached_tokens_saturates() {
        assert_eq!(uncached_tokens(1000, 160), 840);
        assert_eq!(uncached_tokens(100, 160), 0);
    }
}
