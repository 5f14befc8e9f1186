//! The workers a request may go to and what scoring sees of each: the pools serving its
//! model, their candidates (cache held, load, adapters), and the runners-up named as
//! fallbacks.

use super::Router;
use crate::ids::WorkerId;
use crate::lora::{adapter_id, AdapterId};
use crate::select::{self, Candidate, RequestShape};

impl Router {
    /// The workers of `pool` that serve `model` (all of it when no worker lists models).
    pub(super) fn pool_for(&self, pool: &[WorkerId], model: &str) -> Vec<WorkerId> {
        let serves = |w: &WorkerId| {
            !self.model_lists
                || self
                    .cfg
                    .workers
                    .get(usize::from(*w))
                    .is_some_and(|c| self.cfg.serves(c, model))
        };
        pool.iter().copied().filter(serves).collect()
    }

    /// The longest prefix (blocks, of `held`) a healthy worker of the eligible pools holds:
    /// the ladder's `fleet` rung.
    pub(super) fn fleet_blocks(&self, held: &[u32], pools: [&[WorkerId]; 2], now_ms: u64) -> u32 {
        pools
            .iter()
            .flat_map(|p| p.iter())
            .filter(|&&w| self.worker_view(w, now_ms).healthy)
            .map(|&w| held.get(usize::from(w)).copied().unwrap_or(0))
            .max()
            .unwrap_or(0)
    }

    pub(super) fn candidates(
        &self,
        pool: &[WorkerId],
        overlap: &dyn Fn(WorkerId) -> u32,
        confirmed: &dyn Fn(WorkerId) -> u32,
        now_ms: u64,
    ) -> Vec<Candidate> {
        pool.iter()
            .map(|&w| Candidate {
                id: w,
                overlap_tokens: overlap(w),
                kv_blocks: self
                    .cfg
                    .workers
                    .get(usize::from(w))
                    .map(|c| self.cfg.kv_blocks(c))
                    .unwrap_or(1),
                // What its KV holds: ended prompts, and the running requests' own blocks
                // that took their room.
                indexed_blocks: u32::try_from(self.index.entries(w))
                    .unwrap_or(u32::MAX)
                    .saturating_add(self.speculative.reserved(w)),
                load: self.worker_view(w, now_ms),
                confirmed_tokens: confirmed(w),
                family_share: None,
                speed: self
                    .cfg
                    .workers
                    .get(usize::from(w))
                    .map_or(1.0, |c| c.speed),
                adapter_loads: 0.0,
            })
            .collect()
    }

    pub(super) fn alternates(
        &self,
        cands: &[Candidate],
        shape: &RequestShape,
        chosen: WorkerId,
    ) -> Vec<WorkerId> {
        let n = self.cfg.steering.fallbacks as usize;
        if n == 0 {
            return Vec::new();
        }
        let pool = select::Pool::of(cands);
        let mut rest: Vec<(f64, WorkerId)> = cands
            .iter()
            .filter(|c| c.id != chosen && c.load.healthy)
            .map(|c| (select::cost(&self.sel, c, shape, &pool), c.id))
            .collect();
        rest.sort_by(|a, b| a.0.total_cmp(&b.0));
        rest.into_iter().take(n).map(|(_, w)| w).collect()
    }

    /// The adapter a request's `model` names (`lora.adapters`), 0 for none.
    pub(super) fn adapter_of(&self, model: &str) -> AdapterId {
        if self.cfg.lora.adapters.iter().any(|a| a == model) {
            adapter_id(model)
        } else {
            0
        }
    }

    pub(super) fn adapter_loads(&self, w: WorkerId, adapter: AdapterId) -> f64 {
        if adapter == 0 {
            0.0
        } else {
            self.adapters.fit(w, adapter).loads()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::config::Config;
    use crate::request::ApiKind;
    use crate::router::{Fallback, RouteResult};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Two models on disjoint pools: decode a0-a1 and prefill pa serve model A (and its
    /// adapter), b0-b1 and pb model B.
    fn two_models(extra: &str) -> Router {
        let json = format!(
            r#"{{"workers":[
                {{"name":"a0","endpoint":"127.0.0.1:8001","models":["A","A-lora"]}},
                {{"name":"a1","endpoint":"127.0.0.1:8002","models":["A","A-lora"]}},
                {{"name":"b0","endpoint":"127.0.0.1:8003","models":["B"]}},
                {{"name":"b1","endpoint":"127.0.0.1:8004","models":["B"]}},
                {{"name":"pa","endpoint":"127.0.0.1:8101","role":"prefill","models":["A","A-lora"]}},
                {{"name":"pb","endpoint":"127.0.0.1:8102","role":"prefill","models":["B"]}}
            ],"disaggregation":{{"threshold_tokens":1000,"compare_cost":false}}{extra}}}"#
        );
        Router::new(Config::from_json(json.as_bytes()).unwrap(), 1, 5)
    }

    fn model_request(model: &str, prompt: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 8}))
            .unwrap()
    }

    #[test]
    fn requests_stay_in_their_models_pools() {
        let mut r = two_models("");
        let name = |r: &Router, w: WorkerId| r.config().workers[usize::from(w)].name.clone();
        for i in 0..24u64 {
            let (model, pool) = match i % 3 {
                0 => ("A", 'a'),
                1 => ("A-lora", 'a'),
                _ => ("B", 'b'),
            };
            // Long cold prompts go through the prefill pool of their model only.
            let d = routed(r.route(
                ApiKind::Completions,
                &model_request(model, &doc(i, 40_000)),
                i,
            ));
            assert!(
                name(&r, d.decode).starts_with(pool),
                "{model} -> {}",
                name(&r, d.decode)
            );
            let p = d.prefill.expect("disaggregated");
            assert_eq!(name(&r, p), format!("p{pool}"));
            assert!(d.alternates.iter().all(|&w| name(&r, w).starts_with(pool)));
            let short = routed(r.route(ApiKind::Completions, &model_request(model, "hi"), i));
            assert!(name(&r, short.decode).starts_with(pool));
        }
        // No model: any worker, as before.
        let d = routed(r.route(ApiKind::Completions, br#"{"prompt":"x"}"#, 99));
        assert_eq!(d.fallback, None);
    }

    #[test]
    fn a_model_no_worker_serves_is_rejected_or_passed_on() {
        let mut r = two_models("");
        assert_eq!(
            r.route(ApiKind::Completions, &model_request("C", "x"), 0),
            RouteResult::UnknownModel("C".into())
        );
        assert_eq!(r.load().totals(), (0, 0, 0), "nothing charged");
        let mut r = two_models(r#","unknown_model":"pass""#);
        let d = routed(r.route(ApiKind::Completions, &model_request("C", "x"), 0));
        assert_eq!(d.fallback, Some(Fallback::UnknownModel("C".into())));
        // The top-level list is every worker's default.
        let json = r#"{"workers":[{"name":"a"},{"name":"b","models":["B"]}],"models":["A"]}"#;
        let mut r = Router::new(Config::from_json(json.as_bytes()).unwrap(), 1, 5);
        for (model, worker) in [("A", 0), ("B", 1)] {
            let d = routed(r.route(ApiKind::Completions, &model_request(model, "x"), 0));
            assert_eq!(d.decode, worker);
        }
        assert!(matches!(
            r.route(ApiKind::Completions, &model_request("C", "x"), 0),
            RouteResult::UnknownModel(_)
        ));
    }
}
