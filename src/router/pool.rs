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
            .map(|&w| {
                let kv_blocks = self
                    .cfg
                    .workers
                    .get(usize::from(w))
                    .map(|c| self.cfg.kv_blocks(c))
                    .unwrap_or(1);
                let (overlap_tokens, confirmed_tokens) = (overlap(w), confirmed(w));
                Candidate {
                    id: w,
                    overlap_tokens,
                    kv_blocks,
                    // What its KV holds: ended prompts (the engine's count when it reports
                    // them), and the running requests' own blocks that took their room.
                    indexed_blocks: self
                        .held_by_engine(w, kv_blocks)
                        .unwrap_or_else(|| u32::try_from(self.index.entries(w)).unwrap_or(u32::MAX))
                        .saturating_add(self.speculative.reserved(w)),
                    load: self.worker_view(w, now_ms),
                    confirmed_tokens,
                    // All of it, unless the request's route says what only the engines hold.
                    placed_tokens: overlap_tokens,
                    placed_confirmed_tokens: confirmed_tokens,
                    family_share: None,
                    speed: self
                        .cfg
                        .workers
                        .get(usize::from(w))
                        .map_or(1.0, |c| c.speed),
                    adapter_loads: 0.0,
                }
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
    use super::*;
    use crate::config::Config;
    use crate::request::ApiKind;
    use crate::router::testutil::*;
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

/// The router's use of adapters, end to end through `Router::route`.
#[cfg(test)]
mod lora {
    use crate::config::Config;
    use crate::lora::{adapter_id, LoraReport};
    use crate::request::ApiKind;
    use crate::router::{Decision, RouteResult, Router};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn router(max_loras: u32, load_ms: u64) -> Router {
        let json = format!(
            r#"{{"workers":[{{"name":"w0"}},{{"name":"w1"}},{{"name":"w2"}},{{"name":"w3"}}],
                "models":["base","a1","a2","a3"],
                "lora":{{"adapters":["a1","a2","a3"],"max_loras":{max_loras},"load_ms":{load_ms}}}}}"#
        );
        Router::new(Config::from_json(json.as_bytes()).unwrap(), 1, 7)
    }

    fn route(r: &mut Router, model: &str, prompt: &str, now_ms: u64) -> Decision {
        let body = serde_json::to_vec(
            &serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 8}),
        )
        .unwrap();
        match r.route(ApiKind::Completions, &body, now_ms) {
            RouteResult::Routed(d) => d,
            other => panic!("not routed: {other:?}"),
        }
    }

    fn text(i: u64) -> String {
        format!("question {i}: ").repeat(20)
    }

    #[test]
    fn an_adapter_request_goes_where_the_adapter_is_held() {
        let mut r = router(1, 50);
        let first = route(&mut r, "a1", &text(0), 0);
        r.on_finish(&first, 5);
        // Other prompts for the adapter, one at a time: all to its worker.
        for i in 1..20 {
            let d = route(&mut r, "a1", &text(i), 10 * i);
            assert_eq!(d.decode, first.decode, "request {i}");
            r.on_finish(&d, 10 * i + 5);
        }
        assert_eq!(r.adapters().holders(adapter_id("a1")), 1);
    }

    /// A burst of `n` different prompts of `chars` each for adapter `a`, none finishing:
    /// requests per worker.
    fn burst(r: &mut Router, a: &str, n: u64, chars: usize) -> [u32; 4] {
        let mut per = [0u32; 4];
        for i in 0..n {
            let t = text(i);
            let d = route(r, a, &t.repeat(chars / t.len() + 1)[..chars], 0);
            per[usize::from(d.decode)] += 1;
        }
        per
    }

    #[test]
    fn a_burst_for_a_new_adapter_loads_it_on_few_workers_yet_spreads_under_load() {
        // Short prompts: the adapter's worker takes requests until its queue outweighs a
        // load elsewhere (200 ms: a rank-64 adapter), then one more worker loads it.
        let mut r = router(1, 200);
        // Each queued request is worth its fixed overhead and tokens, ~1/6 of such a load.
        let per = burst(&mut r, "a2", 10, 200);
        assert_eq!(r.adapters().holders(adapter_id("a2")), 2, "{per:?}");
        assert_eq!(per.iter().filter(|&&n| n > 0).count(), 2, "{per:?}");
        assert!(per.iter().all(|&n| n == 0 || n >= 4), "{per:?}");
        // Long prompts: the queue of one is worth more than a load; the burst spreads.
        let mut r = router(1, 200);
        let per = burst(&mut r, "a2", 16, 12_000);
        assert_eq!(r.adapters().holders(adapter_id("a2")), 4, "{per:?}");
        assert!(per.iter().all(|&n| (2..=6).contains(&n)), "{per:?}");
    }

    #[test]
    fn two_adapters_take_separate_workers_with_one_slot_each() {
        let mut r = router(1, 50);
        let a = route(&mut r, "a1", &text(1), 0);
        let b = route(&mut r, "a2", &text(2), 1);
        assert_ne!(a.decode, b.decode, "a1's worker has no free slot for a2");
        r.on_finish(&a, 2);
        r.on_finish(&b, 3);
        let a2 = route(&mut r, "a1", &text(3), 4);
        let b2 = route(&mut r, "a2", &text(4), 5);
        assert_eq!((a2.decode, b2.decode), (a.decode, b.decode));
    }

    #[test]
    fn adapters_go_only_to_workers_serving_them_and_an_unknown_one_is_refused() {
        let json = r#"{"workers":[
                {"name":"w0","models":["base","a1"]},{"name":"w1","models":["base","a1"]},
                {"name":"w2","models":["base","a2"]},{"name":"w3","models":["base","a2"]}],
                "lora":{"adapters":["a1","a2","a3"]}}"#;
        let mut r = Router::new(Config::from_json(json.as_bytes()).unwrap(), 1, 7);
        for i in 0..12 {
            let d = route(&mut r, "a1", &text(i), i);
            assert!(d.decode < 2, "{}", d.decode);
        }
        let body = serde_json::to_vec(&serde_json::json!({"model": "a3", "prompt": "x"})).unwrap();
        assert_eq!(
            r.route(ApiKind::Completions, &body, 20),
            RouteResult::UnknownModel("a3".into())
        );
    }

    #[test]
    fn a_metrics_report_places_adapters_this_router_never_sent() {
        let mut r = router(1, 50);
        let report = LoraReport {
            max_lora: Some(2),
            running: vec![adapter_id("a3")],
            waiting: vec![],
        };
        let ev = r.on_lora(2, report, 0);
        assert!(matches!(ev, crate::events::Event::Lora { worker: 2, .. }));
        let d = route(&mut r, "a3", &text(7), 1);
        assert_eq!(d.decode, 2);
    }
}
