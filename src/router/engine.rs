//! Precise mode: workers whose engines stream their own KV events (through kvroute-relay).
//! Their picks stay speculative until the engine reports the blocks, and text prompts reach
//! the engines' token blocks through what tokenize answers taught (`twins`).

use super::Router;
use crate::events::Event;
use crate::hashing::{token_prompt_hashes, HashParams};
use crate::ids::{RequestId, WorkerId};
use crate::index::Pending;
use crate::request::{parse, ApiKind, Prompt};
use crate::twins::Twins;

impl Router {
    /// Whether the engine's own KV events describe this worker's cache (precise mode).
    pub fn engine_fed(&self, w: WorkerId) -> bool {
        self.engine_fed
            .get(usize::from(w))
            .copied()
            .unwrap_or(false)
    }

    /// How much of an engine-fed worker's cache is taken, in blocks of the configured
    /// `kv_blocks` (what the cost terms divide by); `None` when not fed. An engine found
    /// smaller than configured (it evicted holding fewer) is full at its own size: counted
    /// against the configured size it would look to have room it does not have, and copies
    /// into it would look free (engines with half the configured KV: hit 0.013 lower).
    pub(super) fn held_by_engine(&self, w: WorkerId, kv_blocks: u32) -> Option<u32> {
        if !self.engine_fed(w) {
            return None;
        }
        let c = self
            .engine_blocks
            .get(usize::from(w))
            .copied()
            .unwrap_or_default();
        if c.full_at == 0 || c.full_at >= kv_blocks {
            return Some(c.held);
        }
        let scaled = u64::from(c.held) * u64::from(kv_blocks) / u64::from(c.full_at);
        Some(u32::try_from(scaled).unwrap_or(u32::MAX))
    }

    /// A pick's blocks are the engine's to confirm: every worker it goes to is engine-fed.
    pub(super) fn fed(&self, p: &Pending) -> bool {
        self.engine_fed(p.worker) && p.prefill.is_none_or(|w| self.engine_fed(w))
    }

    /// Drops a confirmed pick once the index (the engine's reports) holds its whole prompt
    /// on every worker it went to; true when dropped. A pick routed on text then also enters
    /// the index under its text blocks, as in predicted mode: the engine's later removals
    /// (token blocks) leave that placement, so a prompt the engine evicted still finds the
    /// worker it was placed on instead of looking cold everywhere. Placing evicted documents
    /// by load alone spread them over more workers (docqa with engines holding half the
    /// configured kv_blocks: 1.19 workers per document against 1.01, hit 0.669 against
    /// predicted mode's 0.685, bench/results/precise-before, issue 42), and each worker's
    /// cache then churned through more of them. A reset (`EngineCleared`) still drops everything at once.
    pub(super) fn engine_reported(&mut self, id: RequestId, now_ms: u64) -> bool {
        let Some(p) = self.speculative.get(id) else {
            return true;
        };
        // Chained hashes name a whole prefix and engines evict a chain from its end, so the
        // pick's last block stands for all of it: this runs for every pick on a worker at each
        // of its engine's event batches, and walking every block there (plus its text's map)
        // cost each Envoy thread a lookup per block per batch (issue 42).
        let Some(&last) = p.hashes.last() else {
            return true;
        };
        let mut held = [0u32; crate::ids::MAX_WORKERS];
        self.index.lookup(&[last], now_ms, &mut held);
        // A pick routed on text: the engine reports its last block under the token block the
        // text was learned to end in.
        let tr = self.twins.translate_one(last);
        if let Some(tok) = tr {
            let mut eng = [0u32; crate::ids::MAX_WORKERS];
            self.index.lookup(&[tok], now_ms, &mut eng);
            for (h, e) in held.iter_mut().zip(eng) {
                *h = (*h).max(e);
            }
        }
        let done = core::iter::once(p.worker)
            .chain(p.prefill)
            .all(|w| held.get(usize::from(w)).is_some_and(|&n| n >= 1));
        if done {
            if let Some(p) = self.speculative.take(id) {
                if tr.is_some() {
                    for w in core::iter::once(p.worker).chain(p.prefill) {
                        self.index.insert(w, &p.hashes, now_ms);
                    }
                }
            }
        }
        done
    }

    /// A confirmed pick the engine has not reported within `relay.speculative_ms` leaves
    /// the speculative entries. A pick on text whose end no tokenize answer mapped to engine
    /// blocks (see `twins`) cannot be checked against the engine: it goes into the index as a
    /// prediction, as in predicted mode, instead of vanishing, on each of its workers whose
    /// engine still holds the part of it that is mapped (a known system prompt or document
    /// before a new question). Otherwise its document, or a conversation's earlier turns
    /// past that known part, would look cold to the next request: late tokenize answers cost
    /// precise mode hit rate that way, and so did a new question on a known prompt (no
    /// tokenize is asked for it, see `Twins::wants`), whose next turn then found only the
    /// shared prefix held anywhere. A pick mapped to its end that the engine never reported
    /// is not held.
    pub(super) fn unreported(&mut self, id: RequestId, now_ms: u64) {
        let Some(p) = self.speculative.take(id) else {
            return;
        };
        let mapped = self.twins.translate(&p.hashes);
        if mapped.len() >= p.hashes.len() {
            return;
        }
        let mut engine = [0u32; crate::ids::MAX_WORKERS];
        if !mapped.is_empty() {
            self.index.lookup(&mapped, now_ms, &mut engine);
        }
        let mapped = u32::try_from(mapped.len()).unwrap_or(u32::MAX);
        let mut held = [0u32; crate::ids::MAX_WORKERS];
        self.index.lookup(&p.hashes, now_ms, &mut held);
        let full = u32::try_from(p.hashes.len()).unwrap_or(u32::MAX);
        for w in core::iter::once(p.worker).chain(p.prefill) {
            let engine_has_prefix = engine.get(usize::from(w)).is_some_and(|&n| n >= mapped);
            if engine_has_prefix && held.get(usize::from(w)).is_some_and(|&n| n < full) {
                self.index.insert(w, &p.hashes, now_ms);
            }
        }
    }

    /// After engine events for `worker`: confirmed picks on it that the engine has now
    /// reported leave; after a reset (`cleared`) all of them do, whatever they expected.
    pub(super) fn settle_confirmed(&mut self, worker: WorkerId, now_ms: u64, cleared: bool) {
        if self.confirmed.is_empty() {
            return;
        }
        let queue = core::mem::take(&mut self.confirmed);
        for (until, id) in queue {
            let on_worker = self
                .speculative
                .get(id)
                .is_some_and(|p| p.worker == worker || p.prefill == Some(worker));
            let gone = if !on_worker {
                self.speculative.get(id).is_none()
            } else if cleared {
                self.speculative.take(id);
                true
            } else {
                self.engine_reported(id, now_ms)
            };
            if !gone {
                self.confirmed.push_back((until, id));
            }
        }
    }

    /// Raises `out[w]` to the leading text blocks of `text` whose learned engine block worker
    /// `w`'s engine reports holding (precise mode for text prompts, see `twins`).
    pub(super) fn engine_held_text(&self, text: &[u64], now_ms: u64, out: &mut [u32]) {
        if !self.engine_fed.iter().any(|&f| f) {
            return;
        }
        let tr = self.twins.translate(text);
        if tr.is_empty() {
            return;
        }
        let mut eng = vec![0u32; out.len()];
        self.index.lookup(&tr, now_ms, &mut eng);
        for (o, e) in out.iter_mut().zip(eng) {
            *o = (*o).max(e);
        }
    }

    /// Whether a tokenize answer for this text prompt would teach `twins` anything (and a
    /// worker is engine-fed, the only case where it is used).
    pub fn wants_tokens(&self, text: &[u64]) -> bool {
        !text.is_empty() && self.engine_fed.iter().any(|&f| f) && self.twins.wants(text)
    }

    /// What a tokenize answer teaches: the request's text block hashes (`text`, as routed)
    /// paired with the engine blocks they end in. `None` when the body no longer parses,
    /// the prompt was token ids, or nothing pairs.
    pub fn learn_tokens(
        &mut self,
        kind: ApiKind,
        body: &[u8],
        text: &[u64],
        tokens: &[u32],
        now_ms: u64,
    ) -> Option<Event> {
        let req = parse(kind, body).ok()?;
        if matches!(req.prompt, Prompt::Tokens(_)) {
            return None;
        }
        let params = HashParams::from_config(&self.cfg);
        let ph = token_prompt_hashes(&req, tokens, &params, self.cfg.limits.max_blocks as usize);
        let (t, k) = Twins::pairs(text, &ph.blocks);
        if t.is_empty() {
            return None;
        }
        let e = Event::TextTokens { text: t, tokens: k };
        self.apply(&e, now_ms);
        Some(e)
    }

    /// Text block mappings held (`kvroute_precise_text_blocks`).
    pub fn twins_len(&self) -> usize {
        self.twins.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::testutil::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A router whose first four workers are engine-fed, with disaggregation off.
    fn fed_router() -> Router {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 3);
        for w in 0..4 {
            r.apply(
                &Event::EngineFeed {
                    worker: w,
                    on: true,
                },
                0,
            );
        }
        r
    }

    #[test]
    fn engine_fed_workers_trust_engine_events_over_their_own_picks() {
        let mut r = fed_router();
        assert!(r.engine_fed(2) && !r.engine_fed(4));
        let text = doc(6, 8000);
        let d = routed(r.route(ApiKind::Completions, &completion(&text), 5));
        let w = usize::from(d.decode);
        let n = d.hashes().len() as u32;
        r.on_first_byte(&d, true, 10);
        r.on_finish(&d, 20);
        let mut held = vec![0u32; 6];
        // Confirmed on an engine-fed worker: still counted while the engine's event is due.
        r.held_blocks(d.hashes(), 30, &mut held);
        assert_eq!(held[w], n);
        // The engine never reported it and no tokenize answer mapped its text to engine
        // blocks: after `relay.speculative_ms` it stays as a prediction (predicted mode's).
        r.tick(10 + 2_000);
        r.held_blocks(d.hashes(), 2_010, &mut held);
        assert_eq!(held[w], n, "an unmapped text pick is kept as a prediction");
        assert_eq!(r.speculative_requests(), 0);
        r.apply(&Event::EngineCleared { worker: d.decode }, 2_020);
        r.held_blocks(d.hashes(), 2_020, &mut held);
        assert_eq!(held[w], 0, "a reset drops it");
        // What the engine reports is held, and a reset (restart) drops it at once.
        let other = (d.decode + 1) % 4;
        r.apply(
            &Event::EngineStored {
                worker: other,
                hashes: d.hashes().to_vec(),
            },
            2_100,
        );
        r.held_blocks(d.hashes(), 2_100, &mut held);
        assert_eq!(held[usize::from(other)], n);
        let again = routed(r.route(ApiKind::Completions, &completion(&text), 2_200));
        assert_eq!(again.decode, other);
        r.on_first_byte(&again, true, 2_210);
        r.on_finish(&again, 2_220);
        r.apply(&Event::EngineCleared { worker: other }, 2_300);
        r.tick(2_210 + 2_000);
        r.held_blocks(d.hashes(), 4_300, &mut held);
        assert_eq!(held[usize::from(other)], 0);
        // Without the feed, a confirmed pick goes into the index as before.
        r.apply(
            &Event::EngineFeed {
                worker: other,
                on: false,
            },
            4_400,
        );
        let third = routed(r.route(ApiKind::Completions, &completion(&text), 4_500));
        r.on_first_byte(&third, true, 4_510);
        r.on_finish(&third, 4_520);
        r.tick(9_000);
        r.held_blocks(d.hashes(), 9_000, &mut held);
        let kept = usize::from(third.decode);
        assert_eq!(held[kept], n);

        // Once the text maps to engine blocks the engine's word decides, on every worker: a
        // mapped pick it never reported is not held, and what it reports is held for text.
        for w in 0..4 {
            r.apply(&Event::EngineCleared { worker: w }, 9_100);
            r.apply(
                &Event::EngineFeed {
                    worker: w,
                    on: true,
                },
                9_100,
            );
        }
        let toks: Vec<u64> = (0..u64::from(n)).map(|i| 0xabc0_0000 + i).collect();
        let (t, k) = Twins::pairs(d.hashes(), &toks);
        r.apply(&Event::TextTokens { text: t, tokens: k }, 9_100);
        let fourth = routed(r.route(ApiKind::Completions, &completion(&text), 9_200));
        assert_eq!(fourth.overlap_tokens, 0);
        r.on_first_byte(&fourth, true, 9_210);
        r.on_finish(&fourth, 9_220);
        r.tick(9_210 + 2_000);
        r.held_blocks(d.hashes(), 11_300, &mut held);
        assert_eq!(
            held[usize::from(fourth.decode)],
            0,
            "a mapped pick the engine never reported"
        );
        let holder = (fourth.decode + 2) % 4;
        r.apply(
            &Event::EngineStored {
                worker: holder,
                hashes: toks.clone(),
            },
            11_400,
        );
        let fifth = routed(r.route(ApiKind::Completions, &completion(&text), 11_500));
        assert_eq!(fifth.decode, holder);
        assert!(fifth.overlap_tokens > 0);
    }

    /// A text document routed at 5 ms, its tokens learned (engine blocks `tag + i`), its
    /// first byte at 10, the engine's report of it at 20 and its end at 30: (the pick, the
    /// engine blocks).
    fn reported_document(
        r: &mut Router,
        text: &str,
        tag: u64,
    ) -> (crate::router::Decision, Vec<u64>) {
        let first = routed(r.route(ApiKind::Completions, &completion(text), 5));
        let toks: Vec<u64> = (0..first.hashes().len() as u64).map(|i| tag + i).collect();
        let (t, k) = Twins::pairs(first.hashes(), &toks);
        r.apply(&Event::TextTokens { text: t, tokens: k }, 6);
        r.on_first_byte(&first, true, 10);
        r.apply(
            &Event::EngineStored {
                worker: first.decode,
                hashes: toks.clone(),
            },
            20,
        );
        r.on_finish(&first, 30);
        (first, toks)
    }

    #[test]
    fn a_reported_text_pick_keeps_its_placement_after_the_engine_evicts_it() {
        let mut r = fed_router();
        let text = doc(7, 8000);
        let (first, toks) = reported_document(&mut r, &text, 0xdef0_0000);
        let n = first.hashes().len() as u32;
        let home = first.decode;
        // The engine reported the prompt: the pick left the speculative entries.
        assert_eq!(r.speculative_requests(), 0);
        assert_eq!(
            r.index().entries(home),
            2 * n as usize,
            "token and text blocks"
        );
        assert_eq!(r.held_by_engine(home, 1000), Some(n));
        // It evicts it: no engine block is left, yet the worker the text was placed on
        // still holds it in the index, as predicted mode would have it.
        r.apply(
            &Event::EngineRemoved {
                worker: home,
                hashes: toks.clone(),
            },
            40,
        );
        let mut held = vec![0u32; 6];
        r.held_blocks(first.hashes(), 50, &mut held);
        assert_eq!(held[usize::from(home)], n);
        // What the cache holds is the engine's count: the placement is no second copy.
        assert_eq!(r.held_by_engine(home, 1000), Some(0));
        assert_eq!(r.held_by_engine(4, 1000), None, "not engine-fed");
        assert_eq!(held.iter().filter(|&&b| b > 0).count(), 1);
        let again = routed(r.route(ApiKind::Completions, &completion(&text), 60));
        assert_eq!(
            again.decode, home,
            "the evicted document goes back to its worker"
        );
        r.on_first_byte(&again, true, 61);
        r.on_finish(&again, 62);
        // A reset is the engine's word for everything it held: the placement goes too.
        r.apply(&Event::EngineCleared { worker: home }, 70);
        r.held_blocks(first.hashes(), 80, &mut held);
        assert_eq!(held[usize::from(home)], 0);
    }

    /// A new question on a known document asks no tokenize (`Twins::wants`): its pick maps
    /// only through the document. Unreported past `relay.speculative_ms`, it stays as a
    /// prediction where the engine still holds the document, so the next turn finds the
    /// question too; where the engine dropped the document, the question is not kept.
    #[test]
    fn a_pick_mapped_only_through_its_prefix_is_kept_where_the_engine_holds_that_prefix() {
        let mut r = fed_router();
        let text = doc(8, 8000);
        let (first, toks) = reported_document(&mut r, &text, 0xfed0_0000);
        let n = first.hashes().len();
        let home = first.decode;
        let turn = |q: u64| format!("{text}{}", doc(100 + q, 600));
        let mut held = vec![0u32; 6];
        for (q, evicted) in [(1, false), (2, true)] {
            let t0 = 1_000 * q * 10;
            let ask = routed(r.route(ApiKind::Completions, &completion(&turn(q)), t0));
            assert_eq!(ask.decode, home);
            assert!(!r.wants_tokens(ask.hashes()), "mostly known: no tokenize");
            let m = ask.hashes().len() as u32;
            assert!(m as usize > n);
            r.on_first_byte(&ask, true, t0 + 10);
            r.on_finish(&ask, t0 + 20);
            if evicted {
                r.apply(
                    &Event::EngineRemoved {
                        worker: home,
                        hashes: toks.clone(),
                    },
                    t0 + 30,
                );
            }
            r.tick(t0 + 10 + 2_000);
            assert_eq!(r.speculative_requests(), 0);
            r.held_blocks(ask.hashes(), t0 + 2_100, &mut held);
            if evicted {
                // The document's own placement stays (see `engine_reported`); the question's
                // blocks were never confirmed.
                assert!(held[usize::from(home)] < m, "question {q}");
            } else {
                assert_eq!(held[usize::from(home)], m, "question {q}");
            }
        }
    }

    /// Traffic past the gateway leaves copies of a document on other workers, which the
    /// engines report. While the gateway's own placement holds the document its requests stay
    /// there rather than spread over the stray copies and keep each of them warm; once that
    /// engine evicts it, or for a document the gateway never placed, they go to the engine
    /// that holds it.
    #[test]
    fn a_copy_the_gateway_did_not_place_does_not_draw_its_documents_away() {
        let mut r = fed_router();
        let text = doc(9, 8000);
        let (first, toks) = reported_document(&mut r, &text, 0xc0c0_0000);
        let home = first.decode;
        let stray = (home + 1) % 4;
        r.apply(
            &Event::EngineStored {
                worker: stray,
                hashes: toks.clone(),
            },
            40,
        );
        let mut held = vec![0u32; 6];
        r.held_blocks(&toks, 50, &mut held);
        assert_eq!(held[usize::from(stray)], toks.len() as u32);
        // Two at once: the second finds the first in flight at home, and still stays.
        let mut both = Vec::new();
        for t in [60, 61] {
            let d = routed(r.route(ApiKind::Completions, &completion(&text), t));
            assert_eq!(d.decode, home, "at {t}");
            both.push(d);
        }
        for d in &both {
            r.on_first_byte(d, true, 62);
            r.on_finish(d, 63);
        }
        r.tick(63 + 2_000);
        // Once home's engine evicts it, the stray copy is the one that holds it.
        r.apply(
            &Event::EngineRemoved {
                worker: home,
                hashes: toks.clone(),
            },
            2_100,
        );
        let d = routed(r.route(ApiKind::Completions, &completion(&text), 2_200));
        assert_eq!(d.decode, stray, "the live copy, not the evicted placement");
        r.on_finish(&d, 2_210);
        // Another document only the engine of `stray` holds (another gateway placed it).
        let other = doc(10, 8000);
        let probe = routed(r.route(ApiKind::Completions, &completion(&other), 3_000));
        let toks: Vec<u64> = (0..probe.hashes().len() as u64)
            .map(|i| 0xc1c1_0000 + i)
            .collect();
        let (t, k) = Twins::pairs(probe.hashes(), &toks);
        r.apply(&Event::TextTokens { text: t, tokens: k }, 3_001);
        r.on_finish(&probe, 3_002);
        r.tick(3_002 + 2_000);
        let holder = (probe.decode + 2) % 4;
        r.apply(
            &Event::EngineStored {
                worker: holder,
                hashes: toks,
            },
            5_100,
        );
        let d = routed(r.route(ApiKind::Completions, &completion(&other), 5_200));
        assert_eq!(d.decode, holder);
    }

    /// How full an engine's cache is: its own count; one that evicted holding fewer blocks
    /// than configured is counted full at that size.
    #[test]
    fn an_engine_is_as_full_as_it_reports_at_its_own_size() {
        let mut r = fed_router();
        let hashes: Vec<u64> = (0..100u64).map(|i| 0x5eed_0000 + i).collect();
        let stored = |r: &mut Router, h: &[u64]| {
            r.apply(
                &Event::EngineStored {
                    worker: 0,
                    hashes: h.to_vec(),
                },
                10,
            )
        };
        stored(&mut r, &hashes);
        stored(&mut r, &hashes[..10]);
        assert_eq!(
            r.held_by_engine(0, 1000),
            Some(100),
            "a block stored again counts once"
        );
        r.apply(
            &Event::EngineRemoved {
                worker: 0,
                hashes: hashes[90..].to_vec(),
            },
            20,
        );
        // It evicted holding 100 of 1000 configured: 90 held is 90 % full.
        assert_eq!(r.held_by_engine(0, 1000), Some(900));
        assert_eq!(
            r.held_by_engine(0, 50),
            Some(90),
            "no larger than configured"
        );
        r.apply(&Event::EngineCleared { worker: 0 }, 30);
        assert_eq!(r.held_by_engine(0, 1000), Some(0));
    }
}
