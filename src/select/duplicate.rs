//! `duplicate`: blocks another worker is confirmed to hold that this one would write again.
//! Each is a lost cache hit (`copy_weight`), and into a full cache it also pushes out content
//! nobody else holds, which some later request will recompute (`duplicate_weight`): that
//! partitions the working set under eviction pressure.
//!   duplicate = s * blocks confirmed cached on another worker but not here
//!                 * (copy_weight + duplicate_weight * indexed blocks / kv_blocks)

use super::inputs::{Basis, Candidate, Pool, RequestShape, SelectParams};

/// Copies of blocks another worker holds, written into a full cache, scaled.
pub(super) fn duplicate(
    p: &SelectParams,
    c: &Candidate,
    r: &RequestShape,
    pool: &Pool,
    b: &Basis,
) -> f64 {
    let fullness = (f64::from(c.indexed_blocks) / b.kv).min(1.0);
    // Unanswered requests' blocks are cached nowhere yet; counting them would let a worker
    // that takes requests and never answers attract its prompts' families.
    let duplicate = f64::from(
        pool.best_confirmed_tokens
            .min(r.prompt_tokens)
            .saturating_sub(c.overlap_tokens),
    ) / b.bs;
    p.prefill_load_scale * (duplicate * (p.copy_weight + p.duplicate_weight * fullness))
}

#[cfg(test)]
mod tests {
    use crate::load::WorkerView;
    use crate::rng::Rng;
    use crate::select::testutil::*;
    use crate::select::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
}
