//! A request in, a decision out: parse, hash, look the prompt up, score the candidates,
//! pick (and a prefill worker when disaggregated), then charge the pick here and make the
//! event that replicates it.

use super::{Decision, Fallback, RouteResult, Router, USAGE_WARMUP};
use crate::config::{DisaggMode, UnknownModel};
use crate::events::Event;
use crate::hashing::{hint_hash, prompt_hashes_limited, token_prompt_hashes, HashParams};
use crate::ids::{RequestId, WorkerId};
use crate::index::Pending;
use crate::ladder::Ladder;
use crate::load::NewRequest;
use crate::request::{parse, ApiKind, ParseError, Prompt};
use crate::select::{self, Outcome, RequestShape};
use crate::stall;

impl Router {
    /// Whether this stream, whose client asked for usage, is read chunk by chunk for it.
    fn read_usage(&mut self) -> bool {
        let n = self.usage_streams;
        self.usage_streams = n.saturating_add(1);
        n < USAGE_WARMUP || n.is_multiple_of(u64::from(self.cfg.limits.usage_read_every.max(1)))
    }

    fn next_id(&mut self) -> RequestId {
        self.seq = (self.seq + 1) & 0xFFFF_FFFF;
        self.origin | self.seq
    }

    /// Parses the body, scores every worker and records the decision (load and index).
    pub fn route(&mut self, kind: ApiKind, body: &[u8], now_ms: u64) -> RouteResult {
        self.route_tokens(kind, body, None, now_ms)
    }

    /// `route`, with the engine's token ids for a text prompt (`tokenize`): the prompt then
    /// hashes exactly. Ignored for a request that sent token ids itself.
    pub fn route_tokens(
        &mut self,
        kind: ApiKind,
        body: &[u8],
        tokens: Option<&[u32]>,
        now_ms: u64,
    ) -> RouteResult {
        self.route_hinted(kind, body, tokens, None, now_ms)
    }

    /// `route_tokens`, with the value of the request's session header
    /// (`hints.session_header`): a hint, when the body has no `prompt_cache_key`.
    pub fn route_hinted(
        &mut self,
        kind: ApiKind,
        body: &[u8],
        tokens: Option<&[u32]>,
        session: Option<&str>,
        now_ms: u64,
    ) -> RouteResult {
        self.flush();
        if body.len() > self.cfg.limits.max_route_bytes as usize {
            let pool = self.decode_pool.clone();
            return self.route_fallback(Fallback::TooLarge, &pool, now_ms);
        }
        let req = match parse(kind, body) {
            Ok(r) => r,
            Err(e) => {
                let pool = self.decode_pool.clone();
                return self.route_fallback(Fallback::Parse(describe(&e)), &pool, now_ms);
            }
        };
        let adapter = self.adapter_of(&req.model);
        let decode_pool = self.pool_for(&self.decode_pool, &req.model);
        if decode_pool.is_empty() {
            let model = req.model.to_string();
            return match self.cfg.unknown_model {
                UnknownModel::Reject => RouteResult::UnknownModel(model),
                UnknownModel::Pass => {
                    let pool = self.decode_pool.clone();
                    self.route_fallback(Fallback::UnknownModel(model), &pool, now_ms)
                }
            };
        }
        let prefill_pool = self.pool_for(&self.prefill_pool, &req.model);
        let params = HashParams::from_config(&self.cfg);
        let max_blocks = self.cfg.limits.max_blocks as usize;
        let ph = match tokens {
            Some(t) if !matches!(req.prompt, Prompt::Tokens(_)) => {
                token_prompt_hashes(&req, t, &params, max_blocks)
            }
            _ => prompt_hashes_limited(&req, &params, max_blocks),
        };
        let hint = req
            .cache_key
            .as_deref()
            .or(session)
            .filter(|k| !k.is_empty())
            .map(|k| hint_hash(&req.model, req.cache_salt.as_deref(), k));
        // The parsed prompt (a batch's every entry) is not needed past hashing.
        let max_tokens = req.max_tokens;
        let stream = req.stream;
        let usage_at_end_only = req.stream && !(req.include_usage && self.read_usage());
        drop(req);
        let bs = self.cfg.block_size.max(1);
        // Text blocks are `block_size * configured chars_per_token` bytes; how many tokens
        // that is follows the calibrated ratio.
        let (prompt_tokens, tokens_per_block, prompt_bytes) = if ph.exact {
            (ph.est_tokens, f64::from(bs), 0.0)
        } else {
            let bytes = f64::from(ph.est_tokens) * self.cfg.chars_per_token;
            let tokens = (bytes / self.chars_per_token)
                .ceil()
                .min(f64::from(u32::MAX)) as u32;
            (
                tokens,
                f64::from(bs) * self.cfg.chars_per_token / self.chars_per_token,
                bytes,
            )
        };
        let output = max_tokens
            .unwrap_or(DEFAULT_OUTPUT_TOKENS)
            .min(MAX_OUTPUT_ESTIMATE);
        let prompt_blocks = prompt_tokens.div_ceil(bs);
        let shape = RequestShape {
            prompt_tokens,
            total_blocks: prompt_blocks + output.div_ceil(bs),
        };

        // Confirmed: what the index says each worker holds, and the prompts of answered
        // requests still running (pinned in the engine, see `Speculative`); held adds the
        // routed requests not yet answered, which no cache holds until their prefill ran.
        self.end_continued_peer_requests(&ph.blocks, now_ms);
        let mut confirmed = vec![0u32; self.cfg.workers.len()];
        self.index.lookup(&ph.blocks, now_ms, &mut confirmed);
        // Placed (`Candidate::placed_tokens`): what this router's own picks hold, on an
        // engine-fed worker only as far as its engine still holds it; kept only where that
        // differs from what is held (a copy the router did not place, or a placement the
        // engine evicted).
        let mut placed = None;
        if !ph.exact {
            let mut engine = vec![0u32; confirmed.len()];
            self.engine_held_text(&ph.blocks, now_ms, &mut engine);
            if engine.iter().any(|&b| b > 0) {
                let own: Vec<u32> = confirmed
                    .iter()
                    .zip(&engine)
                    .enumerate()
                    .map(|(w, (&text, &eng))| {
                        let fed = WorkerId::try_from(w).is_ok_and(|w| self.engine_fed(w));
                        if fed {
                            text.min(eng)
                        } else {
                            text
                        }
                    })
                    .collect();
                for (c, e) in confirmed.iter_mut().zip(&engine) {
                    *c = (*c).max(*e);
                }
                placed = (own != confirmed).then_some(own);
            }
        }
        self.speculative
            .extend_confirmed(&ph.blocks, &mut confirmed);
        let mut held = confirmed.clone();
        self.speculative.extend(&ph.blocks, &mut held);
        let placed = placed.map(|mut own_confirmed| {
            self.speculative
                .extend_confirmed(&ph.blocks, &mut own_confirmed);
            let mut own = own_confirmed.clone();
            self.speculative.extend(&ph.blocks, &mut own);
            (own, own_confirmed)
        });
        let to_tokens = |blocks: &[u32], w: WorkerId| -> u32 {
            let b = blocks.get(usize::from(w)).copied().unwrap_or(0);
            ((f64::from(b) * tokens_per_block) as u32).min(prompt_tokens)
        };
        let overlap_tokens = |w: WorkerId| to_tokens(&held, w);
        let confirmed_tokens = |w: WorkerId| to_tokens(&confirmed, w);
        // Seen before (this VM's requests and those replicated from the others), then
        // remembered: the ladder's top rung.
        let seen = u32::try_from(self.sketch.observe(&ph.blocks)).unwrap_or(u32::MAX);

        // The request's family: the longest prefix some worker holds, named by its last block.
        let best = held.iter().copied().max().unwrap_or(0);
        let family = best
            .checked_sub(1)
            .and_then(|i| ph.blocks.get(i as usize))
            .copied();
        let family_share = |w: WorkerId| -> Option<f64> {
            let f = family?;
            (held.get(usize::from(w)).copied().unwrap_or(0) >= best)
                .then(|| self.families.share(f, w, now_ms))
        };
        let mut decode_cands =
            self.candidates(&decode_pool, &overlap_tokens, &confirmed_tokens, now_ms);
        for c in &mut decode_cands {
            c.family_share = family_share(c.id);
            c.adapter_loads = self.adapter_loads(c.id, adapter);
            if let Some((own, own_confirmed)) = &placed {
                c.placed_tokens = to_tokens(own, c.id);
                c.placed_confirmed_tokens = to_tokens(own_confirmed, c.id);
            }
        }
        // A hint is one more block at the head of the prompt, cached (confirmed) where the
        // key went last: prefix affinity and its load trade-off, at the weight of one block.
        let decode_shape = match hint {
            Some(h) => {
                let mut holds = vec![0u32; self.cfg.workers.len()];
                self.index.lookup(&[h], now_ms, &mut holds);
                for c in &mut decode_cands {
                    if holds.get(usize::from(c.id)).is_some_and(|&b| b > 0) {
                        c.overlap_tokens = c.overlap_tokens.saturating_add(bs);
                        c.confirmed_tokens = c.confirmed_tokens.saturating_add(bs);
                        c.placed_tokens = c.placed_tokens.saturating_add(bs);
                        c.placed_confirmed_tokens = c.placed_confirmed_tokens.saturating_add(bs);
                    }
                }
                RequestShape {
                    prompt_tokens: prompt_tokens.saturating_add(bs),
                    ..shape
                }
            }
            None => shape,
        };
        let pick = match select::pick(&self.sel, &decode_cands, &decode_shape, &mut self.rng) {
            Outcome::Picked(p) => p,
            Outcome::Rejected => return RouteResult::Rejected,
            Outcome::NoCandidates => {
                return self.route_fallback(Fallback::NoCandidates, &decode_pool, now_ms);
            }
        };
        let alternates = self.alternates(&decode_cands, &decode_shape, pick.id);
        let considered = if self.cfg.debug_headers {
            select::explain(&self.sel, &decode_cands, &decode_shape)
        } else {
            Vec::new()
        };
        // The prompt's own cached tokens there (without a hint's virtual block).
        let decode_overlap = overlap_tokens(pick.id);

        let mut prefill = None;
        let mut serve_overlap = decode_overlap;
        let threshold = self.cfg.disaggregation.threshold_tokens;
        if threshold > 0 && !prefill_pool.is_empty() {
            let uncached = select::uncached_tokens(prompt_tokens, decode_overlap);
            if uncached > threshold {
                let mut cands =
                    self.candidates(&prefill_pool, &overlap_tokens, &confirmed_tokens, now_ms);
                for c in &mut cands {
                    c.adapter_loads = self.adapter_loads(c.id, adapter);
                }
                if let Outcome::Picked(pp) = select::pick(&self.sel, &cands, &shape, &mut self.rng)
                {
                    // The pool only pays when prefilling there costs no more than on the
                    // decode worker, by the terms that price a prefill wherever it runs: the
                    // wait for it, the delay it adds to whoever queues behind it, and the
                    // passes its streams sit out. Equal costs go to the pool.
                    let pool_pays = !self.cfg.disaggregation.compare_cost
                        || select::prefill_cost(&self.sel, &cands, pp.id, &shape)
                            <= select::prefill_cost(
                                &self.sel,
                                &decode_cands,
                                pick.id,
                                &decode_shape,
                            );
                    if pool_pays {
                        prefill = Some(pp.id);
                        serve_overlap = pp.overlap_tokens;
                    }
                }
            }
        }

        let eligible_prefill: &[WorkerId] = if threshold > 0 { &prefill_pool } else { &[] };
        let fleet = self.fleet_blocks(&held, [&decode_pool, eligible_prefill], now_ms);
        let serving = held
            .get(usize::from(prefill.unwrap_or(pick.id)))
            .copied()
            .unwrap_or(0);
        let ladder = Ladder::from_blocks(seen, fleet, serving, |b| {
            ((f64::from(b) * tokens_per_block) as u32).min(prompt_tokens)
        });
        self.families.record(family, pick.id, now_ms);
        let id = self.next_id();
        let hashed_blocks = u32::try_from(ph.blocks.len()).unwrap_or(u32::MAX);
        let cached_blocks = (f64::from(serve_overlap) / tokens_per_block).floor() as u32;
        let routed = NewRequest {
            id,
            worker: pick.id,
            prefill_worker: prefill,
            blocks: ph.blocks,
            cached_blocks,
            tail_blocks: prompt_blocks.saturating_sub(hashed_blocks) + output.div_ceil(bs),
            prefill_tokens: select::uncached_tokens(prompt_tokens, serve_overlap),
            now_ms,
            adapter,
        };
        // Load is charged now; the speculative entry waits in `pending` for `flush`.
        self.load.add(&routed);
        self.adapters.on_routed(id, pick.id, adapter, now_ms);
        if let Some(pw) = prefill {
            self.adapters.touch(pw, adapter, now_ms);
        }
        self.pending.push((
            id,
            Pending {
                worker: pick.id,
                prefill,
                hashes: routed.blocks.clone(),
                at_ms: now_ms,
                confirmed: false,
                cached: routed.cached_blocks,
            },
        ));
        let event = Event::Routed(routed);
        let hinted = hint.map(|hash| {
            let e = Event::Hinted {
                worker: pick.id,
                hash,
            };
            self.apply(&e, now_ms);
            e
        });
        let target = match (prefill, self.cfg.disaggregation.mode) {
            (Some(p), DisaggMode::Kvroute) => p,
            _ => pick.id,
        };
        let view = self.worker_view(target, now_ms);
        let first_byte_timeout_ms = stall::first_byte_timeout_ms(
            &self.cfg,
            &stall::Wait {
                prefill_tokens: view.prefill_tokens,
                prefilling: view.prefilling,
                stream,
                max_tokens,
                speed: self
                    .cfg
                    .workers
                    .get(usize::from(target))
                    .map_or(1.0, |c| c.speed),
            },
        );
        RouteResult::Routed(Decision {
            id,
            target,
            decode: pick.id,
            prefill,
            alternates,
            overlap_tokens: serve_overlap,
            decode_overlap_tokens: decode_overlap,
            prompt_tokens,
            exact_tokens: ph.exact,
            fallback: None,
            all_busy: pick.all_busy,
            event,
            hinted,
            prompt_bytes_est: prompt_bytes,
            considered,
            usage_at_end_only,
            first_byte_timeout_ms,
            ladder,
        })
    }

    /// Least-loaded healthy worker of `pool` for a request we cannot cache-route.
    fn route_fallback(&mut self, why: Fallback, pool: &[WorkerId], now_ms: u64) -> RouteResult {
        let cands = self.candidates(pool, &|_| 0, &|_| 0, now_ms);
        let shape = RequestShape::default();
        let pick = match select::pick(&self.sel, &cands, &shape, &mut self.rng) {
            Outcome::Picked(p) => p,
            Outcome::Rejected => return RouteResult::Rejected,
            Outcome::NoCandidates => return RouteResult::Rejected,
        };
        let alternates = self.alternates(&cands, &shape, pick.id);
        let id = self.next_id();
        let event = Event::Routed(NewRequest {
            id,
            worker: pick.id,
            prefill_worker: None,
            blocks: Vec::new(),
            cached_blocks: 0,
            tail_blocks: 0,
            prefill_tokens: 0,
            now_ms,
            adapter: 0,
        });
        self.apply(&event, now_ms);
        RouteResult::Routed(Decision {
            id,
            target: pick.id,
            decode: pick.id,
            prefill: None,
            alternates,
            overlap_tokens: 0,
            decode_overlap_tokens: 0,
            prompt_tokens: 0,
            exact_tokens: false,
            fallback: Some(why),
            all_busy: pick.all_busy,
            event,
            hinted: None,
            prompt_bytes_est: 0.0,
            considered: Vec::new(),
            // The body was not read: every chunk might carry usage.
            usage_at_end_only: false,
            // Nothing says how long its answer may take.
            first_byte_timeout_ms: None,
            ladder: Ladder::default(),
        })
    }
}

/// Output tokens assumed when a request does not say (vLLM would run to the context limit).
const DEFAULT_OUTPUT_TOKENS: u32 = 256;
/// Cap for the output estimate, so one huge `max_tokens` does not look like a full cache.
const MAX_OUTPUT_ESTIMATE: u32 = 4096;

fn describe(e: &ParseError) -> String {
    e.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Role};
    use crate::feedback::OrcaLoad;
    use crate::router::testutil::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn keyed(prompt: &str, key: &str) -> Vec<u8> {
        serde_json::to_vec(
            &serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 8,
            "prompt_cache_key": key}),
        )
        .unwrap()
    }

    /// Requests with one key and unrelated text keep to one worker while it is quiet, and
    /// leave it when its queue is long; the key then lives on the new worker only.
    #[test]
    fn a_cache_key_keeps_its_worker_while_load_allows() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 9);
        let first = routed(r.route(ApiKind::Completions, &keyed(&doc(1, 2000), "agent-7"), 0));
        assert!(first.hinted.is_some());
        r.on_first_byte(&first, true, 5);
        r.on_finish(&first, 10);
        for i in 0..8u64 {
            let d = routed(r.route(
                ApiKind::Completions,
                &keyed(&doc(10 + i, 2000), "agent-7"),
                20 + i,
            ));
            assert_eq!(d.decode, first.decode, "request {i}");
            assert_eq!(
                d.overlap_tokens, 0,
                "no text in common: the hint is not cache"
            );
            r.on_finish(&d, 30 + i);
        }
        // Without the key the same requests spread.
        let spread: std::collections::HashSet<_> = (0..8u64)
            .map(|i| {
                let d = routed(r.route(
                    ApiKind::Completions,
                    &completion(&doc(40 + i, 2000)),
                    50 + i,
                ));
                r.on_finish(&d, 60 + i);
                d.decode
            })
            .collect();
        assert!(spread.len() > 1, "{spread:?}");
        // Its worker's queue grows long: the key's next request goes elsewhere, and stays.
        let hot = first.decode;
        for i in 0..16u64 {
            r.apply(
                &Event::Routed(NewRequest {
                    id: 1 << 40 | i,
                    worker: hot,
                    prefill_worker: None,
                    blocks: Vec::new(),
                    cached_blocks: 0,
                    tail_blocks: 150,
                    prefill_tokens: 2000,
                    now_ms: 70,
                    adapter: 0,
                }),
                70,
            );
        }
        let moved = routed(r.route(ApiKind::Completions, &keyed(&doc(200, 2000), "agent-7"), 80));
        assert_ne!(moved.decode, hot);
        let mut holds = vec![0u32; 6];
        let Some(Event::Hinted { hash, .. }) = moved.hinted else {
            panic!("no hint")
        };
        r.index().lookup(&[hash], 80, &mut holds);
        assert_eq!(holds.iter().sum::<u32>(), 1);
        assert_eq!(holds[usize::from(moved.decode)], 1);
        // The session header is the same hint when the body has no key.
        let a =
            routed(r.route_hinted(ApiKind::Completions, &completion("x"), None, Some("s1"), 90));
        r.on_finish(&a, 91);
        let b =
            routed(r.route_hinted(ApiKind::Completions, &completion("y"), None, Some("s1"), 92));
        assert_eq!(a.decode, b.decode);
    }

    #[test]
    fn same_long_prefix_returns_to_its_worker() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 7);
        let base = doc(1, 8000);
        let first = routed(r.route(ApiKind::Completions, &completion(&base), 0));
        r.on_first_byte(&first, true, 5);
        r.on_finish(&first, 10);
        for i in 0..5 {
            let d = routed(r.route(
                ApiKind::Completions,
                &completion(&format!("{base} question {i}")),
                100 + i,
            ));
            assert_eq!(d.decode, first.decode);
            assert!(d.predicted_hit() > 0.9, "{}", d.predicted_hit());
            r.on_finish(&d, 200 + i);
        }
        assert_eq!(r.load().totals(), (0, 0, 0));
    }

    #[test]
    fn long_cold_prompt_goes_to_prefill_pool_and_repeat_stays_on_decode() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":1000}"#), 1, 3);
        let long = doc(2, 40_000); // ~10k tokens at 4 chars per token
        let d = routed(r.route(ApiKind::Completions, &completion(&long), 0));
        let p = d.prefill.expect("disaggregated");
        assert_eq!(d.target, p);
        assert!(r.config().workers[usize::from(p)].role == Role::Prefill);
        r.on_first_byte(&d, true, 4);
        r.on_finish(&d, 5);
        let again = routed(r.route(ApiKind::Completions, &completion(&long), 10));
        assert_eq!(again.prefill, None, "cached on the decode worker now");
        assert_eq!(again.decode, d.decode);
        assert_eq!(again.target, d.decode);
    }

    /// Long cold prompts arrive faster than anything finishes: the pool takes them while its
    /// queue is no deeper than the decode workers' would be, then they prefill locally.
    #[test]
    fn prefill_pool_only_while_its_queue_is_shorter() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":1000}"#), 1, 3);
        let (mut pool, mut local) = (0, 0);
        for i in 0..12 {
            let d = routed(r.route(ApiKind::Completions, &completion(&doc(100 + i, 40_000)), i));
            match d.prefill {
                Some(_) => pool += 1,
                None => local += 1,
            }
        }
        // Two pool workers against four decode workers: the pool takes its share, not all.
        assert!((2..=6).contains(&pool), "pool {pool}, local {local}");
        assert!(local >= 6, "pool {pool}, local {local}");
    }

    /// Without the cost comparison every prompt over the threshold goes to the pool, however
    /// deep its queue (llm-d's rule).
    #[test]
    fn prefill_pool_takes_every_long_prompt_without_the_cost_comparison() {
        let extra = r#","disaggregation":{"threshold_tokens":1000,"compare_cost":false}"#;
        let mut r = Router::new(cfg(extra), 1, 3);
        for i in 0..12 {
            let d = routed(r.route(ApiKind::Completions, &completion(&doc(100 + i, 40_000)), i));
            assert!(d.prefill.is_some(), "request {i} prefilled locally");
        }
    }

    #[test]
    fn llm_d_mode_steers_to_decode_and_names_prefill() {
        let mut r = Router::new(
            cfg(r#","disaggregation":{"threshold_tokens":1000,"mode":"llm-d"}"#),
            1,
            3,
        );
        let d = routed(r.route(ApiKind::Completions, &completion(&doc(3, 40_000)), 0));
        assert!(d.prefill.is_some());
        assert_eq!(d.target, d.decode);
    }

    #[test]
    fn unparseable_body_falls_back_and_is_counted_as_load() {
        let mut r = Router::new(cfg(""), 1, 3);
        let d = routed(r.route(ApiKind::Completions, b"{not json", 0));
        assert_eq!(d.fallback.as_ref().map(Fallback::kind), Some("parse_error"));
        assert_eq!(r.worker_view(d.target, 0).inflight, 1);
        r.on_finish(&d, 1);
        assert_eq!(r.load().totals(), (0, 0, 0));
    }

    #[test]
    fn unusable_costs_fall_back_as_no_candidates() {
        // Every cost overflows to infinity, so scoring cannot rank the workers.
        let mut r = Router::new(
            cfg(
                r#","scoring":{"prefill_load_scale":1e308},"disaggregation":{"threshold_tokens":0}"#,
            ),
            1,
            3,
        );
        let d = routed(r.route(ApiKind::Completions, &completion(&doc(7, 8000)), 0));
        assert_eq!(d.fallback, Some(Fallback::NoCandidates));
        assert_eq!(
            d.fallback.as_ref().map(Fallback::kind),
            Some("no_candidates")
        );
        assert_eq!(r.worker_view(d.target, 0).inflight, 1);
        r.on_finish(&d, 1);
        assert_eq!(r.load().totals(), (0, 0, 0));
    }

    /// The ladder's rungs: a cold prompt has none; its repeat was seen, is held and routed
    /// to its holder; another VM sees it through the replicated event; a prompt a worker
    /// forgot is still workload reuse but no longer fleet-held.
    #[test]
    fn ladder_rungs_follow_the_workload_the_fleet_and_the_pick() {
        let extra = r#","disaggregation":{"threshold_tokens":0}"#;
        let mut a = Router::new(cfg(extra), 1, 3);
        let mut b = Router::new(cfg(extra), 2, 4);
        let text = doc(8, 8000);
        let d = routed(a.route(ApiKind::Completions, &completion(&text), 0));
        assert_eq!(d.ladder, Ladder::default());
        for e in [d.event.clone()]
            .iter()
            .chain(&a.on_first_byte(&d, true, 1))
        {
            b.apply(e, 1);
        }
        a.on_finish(&d, 2);
        let again = routed(a.route(
            ApiKind::Completions,
            &completion(&format!("{text} next")),
            3,
        ));
        let l = again.ladder;
        assert!(l.routed > again.prompt_tokens * 9 / 10, "{l:?}");
        assert_eq!((l.workload, l.fleet), (l.routed, l.routed), "{l:?}");
        assert_eq!(l.routed, again.overlap_tokens);
        // The other VM never routed it, yet saw it (and its worker holds it: in flight).
        let on_b = routed(b.route(ApiKind::Completions, &completion(&text), 3));
        assert!(
            on_b.ladder.workload > on_b.prompt_tokens * 9 / 10,
            "{:?}",
            on_b.ladder
        );
        assert_eq!(on_b.ladder.fleet, on_b.ladder.workload);
        // Every worker forgot it: seen, not held.
        a.on_finish(&again, 4);
        let hashes = again.hashes().to_vec();
        for w in 0..6 {
            a.apply(
                &Event::Forget {
                    worker: w,
                    hashes: hashes.clone(),
                },
                5,
            );
        }
        let forgot = routed(a.route(ApiKind::Completions, &completion(&text), 6));
        assert!(
            forgot.ladder.workload > forgot.prompt_tokens * 9 / 10,
            "{:?}",
            forgot.ladder
        );
        assert_eq!((forgot.ladder.fleet, forgot.ladder.routed), (0, 0));
        // A fallback has no ladder.
        let f = routed(a.route(ApiKind::Completions, b"{broken", 7));
        assert_eq!(f.ladder, Ladder::default());
    }

    /// Load beats cache: the holder is busy, the pick goes elsewhere, and `fleet - routed`
    /// is what that cost.
    #[test]
    fn ladder_shows_the_load_trade() {
        let extra = r#","disaggregation":{"threshold_tokens":0}"#;
        let mut r = Router::new(cfg(extra), 1, 3);
        let text = doc(9, 2000);
        let first = routed(r.route(ApiKind::Completions, &completion(&text), 0));
        r.on_first_byte(&first, true, 1);
        r.on_finish(&first, 2);
        // Pile long cold prompts onto the holder's queue by reporting it busy.
        r.on_orca(
            first.decode,
            &OrcaLoad {
                kv_usage: Some(0.5),
                waiting: Some(50),
                running: Some(8),
            },
            3,
        );
        let d = routed(r.route(ApiKind::Completions, &completion(&text), 4));
        assert_ne!(d.decode, first.decode);
        assert!(
            d.ladder.fleet > 0 && d.ladder.routed < d.ladder.fleet,
            "{:?}",
            d.ladder
        );
        assert_eq!(d.ladder.workload, d.ladder.fleet);
    }

    #[test]
    fn request_ids_stay_distinct_past_65536_vm_creations() {
        let body = completion("hello");
        let ids: Vec<RequestId> = [1u64, 1 + (1 << 16), 1 + (1 << 20), u64::from(u32::MAX)]
            .iter()
            .map(|&origin| {
                let mut r = Router::new(cfg(""), origin, 3);
                routed(r.route(ApiKind::Completions, &body, 0)).id
            })
            .collect();
        let mut uniq = ids.clone();
        uniq.sort_unstable();
        uniq.dedup();
        assert_eq!(uniq.len(), ids.len(), "{ids:x?}");
    }

    #[test]
    fn limits_bound_what_one_request_costs() {
        let extra = r#","disaggregation":{"threshold_tokens":0},"limits":{"max_route_bytes":20000,"max_blocks":10}"#;
        let mut r = Router::new(cfg(extra), 1, 3);
        // Over max_route_bytes: not parsed, counted as its own fallback, still load.
        let d = routed(r.route(ApiKind::Completions, &completion(&doc(12, 30_000)), 0));
        assert_eq!(d.fallback, Some(Fallback::TooLarge));
        assert_eq!(d.fallback.as_ref().map(Fallback::kind), Some("too_large"));
        assert!(d.hashes().is_empty());
        assert_eq!(r.worker_view(d.target, 0).inflight, 1);
        r.on_finish(&d, 1);
        // Within it but over max_blocks: only the leading blocks are hashed and replicated,
        // the token estimate still covers the whole prompt, and the prefix keeps its affinity.
        let text = doc(13, 16_000); // ~250 blocks of 64 bytes
        let d = routed(r.route(ApiKind::Completions, &completion(&text), 2));
        assert_eq!(d.fallback, None);
        assert_eq!(d.hashes().len(), 10);
        assert!(d.prompt_tokens > 3000, "{}", d.prompt_tokens);
        let Event::Routed(ev) = &d.event else {
            panic!("not routed")
        };
        assert_eq!(ev.blocks.len(), 10);
        r.on_first_byte(&d, true, 3);
        r.on_finish(&d, 4);
        let again = routed(r.route(
            ApiKind::Completions,
            &completion(&format!("{text} and more")),
            5,
        ));
        assert_eq!(again.decode, d.decode);
        assert_eq!(again.overlap_tokens, 10 * 16);
        assert!(Config::from_json(br#"{"limits":{"max_blocks":0}}"#).is_err());
        assert_eq!(Config::default().limits.max_route_bytes, 8 << 20);
    }

    #[test]
    fn streams_asking_for_usage_are_read_for_it_after_a_warm_up_only_when_sampled() {
        fn stream(usage: bool) -> Vec<u8> {
            let mut b =
                serde_json::json!({"model": "m", "prompt": "q", "max_tokens": 4, "stream": true});
            if usage {
                b["stream_options"] = serde_json::json!({"include_usage": true});
            }
            serde_json::to_vec(&b).unwrap()
        }
        fn read_chunks(r: &mut Router, body: &[u8]) -> bool {
            let d = routed(r.route(ApiKind::Completions, body, 0));
            r.on_finish(&d, 0);
            !d.usage_at_end_only
        }
        let mut r = Router::new(cfg(r#","limits":{"usage_read_every":4}"#), 1, 3);
        let warm = usize::try_from(USAGE_WARMUP).unwrap();
        let read: Vec<bool> = (0..warm + 8)
            .map(|_| read_chunks(&mut r, &stream(true)))
            .collect();
        assert!(read[..warm].iter().all(|&x| x));
        assert_eq!(
            read[warm..],
            [true, false, false, false, true, false, false, false]
        );
        // A stream without usage asked is never read before its end, and does not count.
        assert!(!read_chunks(&mut r, &stream(false)));
        assert!(read_chunks(&mut r, &stream(true)));
        assert!(!read_chunks(&mut r, &stream(true)));
        // A response that is not a stream is one body: always read, and not counted.
        assert!(read_chunks(&mut r, &completion("q")));
        let mut every = Router::new(cfg(r#","limits":{"usage_read_every":1}"#), 1, 3);
        assert!((0..warm + 8).all(|_| read_chunks(&mut every, &stream(true))));
        assert_eq!(Config::default().limits.usage_read_every, 8);
        assert!(Config::from_json(br#"{"limits":{"usage_read_every":0}}"#).is_err());
    }
}
