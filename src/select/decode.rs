//! `decode`: every decode step attends over each request's whole context, so a worker
//! decoding many long requests is slower for the next one even when they share a prefix in
//! memory. Counted per request, not per shared block, it is what spreads a burst of
//! identical cached requests.
//!   decode = decode_weight * (in-flight context blocks + the request's blocks) / speed

use super::inputs::{Basis, Candidate, RequestShape, SelectParams};

pub(super) fn decode(p: &SelectParams, c: &Candidate, r: &RequestShape, b: &Basis) -> f64 {
    let decode = p.decode_weight * (c.load.context_blocks as f64 + f64::from(r.total_blocks));
    decode / b.speed
}

#[cfg(test)]
mod tests {
    use crate::load::{LoadParams, LoadTable, NewRequest, WorkerView};
    use crate::rng::Rng;
    use crate::select::testutil::*;
    use crate::select::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// 64 identical requests arrive before any finishes; each pick is charged at once, so the
    /// burst spreads once the decode work piled on the holder outweighs the shared prefix.
    #[test]
    fn burst_of_identical_requests_spreads() {
        let p = SelectParams::default();
        let mut t = LoadTable::new(4, LoadParams::default());
        let blocks: Vec<u64> = (0..128).collect();
        // Worker 0 has served this prompt before; a pick records the prompt on its worker.
        let mut overlap = [128u32, 0, 0, 0];
        let mut rng = Rng::new(5);
        let mut per = [0u32; 4];
        // 2048 prompt tokens plus 256 expected output tokens.
        let r = RequestShape {
            prompt_tokens: 2048,
            total_blocks: 128 + 16,
        };
        for id in 0..64u64 {
            let cands: Vec<Candidate> = (0..4u16)
                .map(|w| cand(w, overlap[usize::from(w)], t.view(w, 0, 0)))
                .collect();
            let pk = picked(pick(&p, &cands, &r, &mut rng));
            per[usize::from(pk.id)] += 1;
            overlap[usize::from(pk.id)] = 128;
            let cached = pk.overlap_tokens / 16;
            t.add(&NewRequest {
                id,
                worker: pk.id,
                prefill_worker: None,
                blocks: blocks.clone(),
                cached_blocks: cached,
                tail_blocks: 16,
                prefill_tokens: uncached_tokens(2048, pk.overlap_tokens),
                now_ms: 0,
                adapter: 0,
            });
        }
        // Copying the prefix costs recompute_weight_min extra (its tokens share the copier's
        // batches), so the burst spreads over as many workers as its decode work needs.
        assert!(
            per.iter().filter(|&&n| n > 0).count() >= 3,
            "at least three workers take part: {per:?}"
        );
        assert!(
            per.iter().all(|&n| n <= 32),
            "no worker takes more than half: {per:?}"
        );
        assert!(
            per[0] >= per[1],
            "the warm worker takes at least its share: {per:?}"
        );
    }

    /// Decode work counts each request's whole context: a worker decoding many long requests
    /// loses a fully cached request to an idle one once that work outweighs the prefill.
    #[test]
    fn decode_work_outweighs_a_cached_prefix_eventually() {
        let p = SelectParams::default();
        let free_copies = SelectParams {
            recompute_weight_min: 0.0,
            copy_weight: 0.0,
            ..p
        };
        let decoding = |requests: u64| WorkerView {
            inflight: requests as u32,
            context_blocks: requests * 110,
            active_blocks: 110,
            ..idle()
        };
        let r = shape(1600);
        let few = [cand(0, 100, decoding(4)), cand(1, 0, idle())];
        assert_eq!(picked(pick(&p, &few, &r, &mut Rng::new(1))).id, 0);
        let many = [cand(0, 100, decoding(40)), cand(1, 0, idle())];
        assert_eq!(
            picked(pick(&free_copies, &many, &r, &mut Rng::new(1))).id,
            1
        );
        // A copy also costs (1 + recompute_weight_min + copy_weight) x its prefill: it shares
        // the copier's batches and loses the hit.
        assert_eq!(picked(pick(&p, &many, &r, &mut Rng::new(1))).id, 0);
        let more = [cand(0, 100, decoding(200)), cand(1, 0, idle())];
        assert_eq!(picked(pick(&p, &more, &r, &mut Rng::new(1))).id, 1);
    }
}
