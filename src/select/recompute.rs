//! `recompute`: prefill redone on a busy worker delays everyone queued behind it, so the
//! recomputed blocks weigh more as queues grow and a busy fleet keeps each prefix where it
//! is cached; an idle worker still recomputes almost for free.
//!   recompute = s * uncached * min(recompute_weight_max, recompute_weight_min +
//!                 recompute_weight * requests waiting for prefill there, or on the pool's
//!                 median worker if more) / speed

use super::inputs::{Basis, Candidate, Pool, SelectParams};

/// Weight of the prefill `c` would recompute, on top of the wait it causes: recomputed work
/// delays whoever queues behind it, and a queue grows as utilisation / (1 - utilisation), so
/// the requests waiting for prefill on `c`, or on the pool's median worker if more
/// (`fleet`, [`Pool::waiting`]), stand for that delay. With idle workers around a prefix is
/// recomputed for free; a busy fleet keeps each prefix where it is cached.
pub fn recompute_factor(p: &SelectParams, c: &Candidate, fleet: u32) -> f64 {
    (p.recompute_weight_min + p.recompute_weight * f64::from(c.load.prefilling.max(fleet)))
        .min(p.recompute_weight_max)
}

/// What recomputing the uncached part costs whoever queues behind it, scaled.
pub(super) fn recompute(p: &SelectParams, c: &Candidate, pool: &Pool, b: &Basis) -> f64 {
    p.prefill_load_scale * (recompute_factor(p, c, pool.waiting) * b.uncached / b.speed)
}

#[cfg(test)]
mod tests {
    use crate::load::WorkerView;
    use crate::rng::Rng;
    use crate::select::testutil::*;
    use crate::select::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
}
