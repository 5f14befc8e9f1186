//! `balance`: cache pressure. Writing many new blocks into a cache rewritten recently
//! evicts content other requests would have hit; spreading unrelated prompts makes the
//! fleet's caches add up instead of one worker churning while others sit on stale content.
//!   balance = cache_balance * blocks the request writes * (recently written / kv_blocks)

use super::inputs::{Basis, Candidate, SelectParams};

pub(super) fn balance(p: &SelectParams, c: &Candidate, b: &Basis) -> f64 {
    // A mostly cached request writes little, so affinity keeps winning. Capped at 1: beyond a
    // full turnover the cache holds nothing older to protect, and an uncapped value would let
    // write volume outweigh cache hits at high request rates.
    let pressure = (c.load.fresh_blocks / b.kv).min(1.0);
    p.cache_balance * b.written * pressure
}

#[cfg(test)]
mod tests {
    use crate::load::{LoadParams, LoadTable, NewRequest};
    use crate::rng::Rng;
    use crate::select::testutil::*;
    use crate::select::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Sequential requests sharing only a short prefix: nothing is in flight, so without a
    /// balancing term every one of them would go to the worker holding the shared block.
    #[test]
    fn short_shared_prefix_does_not_attract_everything() {
        let p = SelectParams::default();
        let mut t = LoadTable::new(4, LoadParams::default());
        let mut rng = Rng::new(9);
        let mut per = [0u32; 4];
        for id in 0..40u64 {
            // Every prompt: 1 shared block then 99 of its own; worker 0 held the shared block.
            let blocks: Vec<u64> = core::iter::once(7)
                .chain((0..99).map(|i| id * 1000 + i))
                .collect();
            let now = id * 1000;
            let cands: Vec<Candidate> = (0..4u16)
                .map(|w| cand(w, u32::from(w == 0), t.view(w, now, 0)))
                .collect();
            let pk = picked(pick(&p, &cands, &shape(1600), &mut rng));
            per[usize::from(pk.id)] += 1;
            t.add(&NewRequest {
                id,
                worker: pk.id,
                prefill_worker: None,
                blocks: blocks.clone(),
                cached_blocks: pk.overlap_tokens / 16,
                tail_blocks: 0,
                prefill_tokens: 1600,
                now_ms: now,
                adapter: 0,
            });
            t.free(id); // finished before the next one arrives
        }
        assert!(per.iter().all(|&n| n >= 5), "{per:?}");
    }
}
