//! `memory`: above the watermark every further block held costs as much as a block of
//! prefill (preemption and eviction of cached prefixes start there).
//!   memory = max(0, max(active_blocks, reported_kv_usage * kv_blocks) + new blocks
//!                   - kv_watermark * kv_blocks)

use super::inputs::{Basis, Candidate, SelectParams};

pub(super) fn memory(p: &SelectParams, c: &Candidate, b: &Basis) -> f64 {
    let reported = c
        .load
        .report
        .map(|rep| f64::from(rep.kv_usage).clamp(0.0, 1.0) * b.kv)
        .unwrap_or(0.0);
    // Staged: while its prefill is pending the request adds only blocks that already exist.
    let new_blocks = if p.staged_decode { 0.0 } else { b.written };
    let held = (c.load.active_blocks as f64).max(reported) + new_blocks;
    (held - p.kv_watermark * b.kv).max(0.0)
}

#[cfg(test)]
mod tests {
    use crate::load::{Report, WorkerView};
    use crate::rng::Rng;
    use crate::select::testutil::*;
    use crate::select::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
}
