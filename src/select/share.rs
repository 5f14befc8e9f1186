//! `share`: request share. A worker taking far more than its share of requests is a hot
//! spot whatever its queues say now; the term keeps a Zipf-hot prefix family from making one
//! worker one. A family held there and elsewhere moves at once, one held only there pays to
//! be copied once the excess outweighs recomputing the prompt, and that copy then shares the
//! family's traffic. Past saturation, where the interference term leaves short prompts to
//! pile onto whichever worker stays cheap for them, it stays on with a looser ratio.

use super::inputs::{speed_of, Candidate, Pool, RequestShape, SelectParams};

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
    // away from their caches, and a looser cap (`request_ratio_saturated`, see `share`)
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

/// The request-share term of [`super::cost`], in the request's prompt blocks: each mean of share
/// above the mean costs one prompt (a new prefix goes where fewer requests went), and each
/// above `request_ratio` costs `request_ratio_weight` more (a hot spot sheds what is cached
/// elsewhere at once and copies what is not once that outweighs recomputing it). 0, never
/// 0 x infinity, while `c` is within the mean.
pub(super) fn share(p: &SelectParams, c: &Candidate, r: &RequestShape, pool: &Pool) -> f64 {
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

#[cfg(test)]
mod tests {
    use crate::load::{LoadParams, LoadTable, NewRequest, WorkerView};
    use crate::rng::Rng;
    use crate::select::testutil::*;
    use crate::select::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
}
