//! `prefill`: the wait for this request's prefill on the worker: the prefill queued there,
//! each waiting request's fixed overhead, and the request's own uncached blocks.
//!   prefill = s * ((pending_prefill_tokens + waiting_requests * overhead) / block_size
//!                  + uncached) / speed

use super::inputs::{Basis, Candidate, SelectParams};

/// The wait for this request's prefill, scaled.
pub(super) fn prefill(p: &SelectParams, c: &Candidate, b: &Basis) -> f64 {
    // Each request waiting ahead also costs its fixed scheduling overhead, so a worker that
    // accepts requests and never starts them (stalled, or a black hole) stops attracting
    // short prompts long before its token count would say so.
    let waiting = f64::from(c.load.prefilling) * p.request_overhead_tokens;
    let prefill = (c.load.prefill_tokens + waiting) / b.bs + b.uncached;
    p.prefill_load_scale * (prefill / b.speed)
}

#[cfg(test)]
mod tests {
    use crate::load::WorkerView;
    use crate::rng::Rng;
    use crate::select::testutil::*;
    use crate::select::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
}
