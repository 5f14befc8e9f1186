//! `duplicate`: blocks another worker is confirmed to hold that this one would write again.
//! Each is a lost cache hit (`copy_weight`), and into a full cache it also pushes out content
//! nobody else holds, which some later request will recompute (`duplicate_weight`): that
//! partitions the working set under eviction pressure. A copy an engine reports that this
//! router did not place (traffic past the gateway) counts as missing here while another
//! worker's engine still holds the router's own placement (`Candidate::placed_tokens`):
//! refreshing it keeps a second copy alive, which costs the same room, and the gateway's
//! traffic would otherwise spread over every stray copy.
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
    let missing = |best: u32, here: u32| best.min(r.prompt_tokens).saturating_sub(here);
    let duplicate = f64::from(
        missing(pool.best_confirmed_tokens, c.overlap_tokens)
            .max(missing(pool.best_placed_confirmed_tokens, c.placed_tokens)),
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
            placed_confirmed_tokens: 0,
            ..cand(0, 100, idle())
        };
        assert_eq!(copy(unanswered), 0.0);
    }

    /// A document the gateway placed on worker 0 and the engines also report on worker 1
    /// (a request that bypassed the gateway): worker 1 is a hit, yet taking it keeps a second
    /// copy alive, so it costs as a copy would. With no placement of the gateway's anywhere
    /// (another gateway's copy) it is a plain hit.
    #[test]
    fn a_copy_the_router_did_not_place_costs_as_one_while_its_own_placement_holds() {
        let p = SelectParams::default();
        let r = shape(1600);
        let placed = cand(0, 100, idle());
        let stray = Candidate {
            placed_tokens: 0,
            placed_confirmed_tokens: 0,
            ..cand(1, 100, idle())
        };
        let cold = cand(2, 0, idle());
        let dup = |c: &Candidate, all: &[Candidate]| terms(&p, c, &r, &Pool::of(all)).duplicate;
        let fleet = [placed, stray, cold];
        assert_eq!(dup(&placed, &fleet), 0.0);
        assert!(dup(&stray, &fleet) > 0.0);
        assert!((dup(&stray, &fleet) - dup(&cold, &fleet)).abs() < 1e-9);
        assert_eq!(picked(pick(&p, &fleet, &r, &mut Rng::new(1))).id, 0);
        let unplaced = Candidate {
            placed_tokens: 0,
            placed_confirmed_tokens: 0,
            ..cand(0, 0, idle())
        };
        let fleet = [unplaced, stray, cold];
        assert_eq!(dup(&stray, &fleet), 0.0);
        assert_eq!(picked(pick(&p, &fleet, &r, &mut Rng::new(1))).id, 1);
    }
}
