//! `interference`: with chunked prefill each pass that carries this request's prefill is
//! also a decode step of every stream on the worker, so a prefill placed among many streams
//! slows all of them (TPOT); pricing it lowers TPOT near saturation.
//!   interfere = s * decode_interference * requests in flight on the worker
//!                 * (uncached + request overhead / block_size) / speed

use super::inputs::{Basis, Candidate, SelectParams};

/// What this request's prefill passes cost the streams on `c`, scaled.
pub(super) fn interference(p: &SelectParams, c: &Candidate, b: &Basis) -> f64 {
    // Those decoding now, and those queued ahead of it, which will be decoding by then, all
    // wait it out. Counting only the streams decoding now would make a worker whose requests
    // all queue look free of interference. A fully cached request still costs a pass (its
    // fixed overhead).
    let streams = f64::from(c.load.inflight);
    let interference =
        p.decode_interference * streams * (b.uncached + p.request_overhead_tokens / b.bs);
    p.prefill_load_scale * (interference / b.speed)
}

#[cfg(test)]
mod tests {
    use crate::load::WorkerView;
    use crate::rng::Rng;
    use crate::select::testutil::*;
    use crate::select::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
}
