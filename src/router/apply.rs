//! Events into this replica's tables (load, index, speculative entries, adapters), the same
//! for local decisions and those replicated from other threads, and periodic housekeeping.

use super::Router;
use crate::events::Event;
use crate::ids::{WorkerId, CHARS_PER_TOKEN_RANGE};
use crate::index::Pending;

impl Router {
    /// Speculative entries of local decisions wait here so they are made after the request
    /// is on its way (the filter calls `flush` from a callback of its own); anything routed
    /// or confirmed before that flushes first, so no decision ever misses an earlier one.
    pub fn flush(&mut self) -> usize {
        let jobs = core::mem::take(&mut self.pending);
        let n = jobs.len();
        for (id, p) in jobs {
            self.speculative.add(id, p);
        }
        n
    }

    /// Leading blocks of `hashes` each worker holds or is about to hold (confirmed index
    /// entries, continued by those of requests still unanswered).
    pub fn held_blocks(&self, hashes: &[u64], now_ms: u64, out: &mut [u32]) {
        self.index.lookup(hashes, now_ms, out);
        self.speculative.extend(hashes, out);
    }

    /// Unconfirmed requests (speculative index entries).
    pub fn speculative_requests(&self) -> usize {
        self.speculative.unconfirmed() + self.pending.len()
    }

    /// Applies an event, local or replicated from another thread.
    pub fn apply(&mut self, e: &Event, now_ms: u64) {
        match e {
            Event::Routed(r) => {
                self.load.add(r);
                self.sketch.insert(&r.blocks);
                self.adapters.on_routed(r.id, r.worker, r.adapter, r.now_ms);
                if let Some(pw) = r.prefill_worker {
                    self.adapters.touch(pw, r.adapter, r.now_ms);
                }
                self.speculative.add(
                    r.id,
                    Pending {
                        worker: r.worker,
                        prefill: r.prefill_worker,
                        hashes: r.blocks.clone(),
                        at_ms: r.now_ms,
                        confirmed: false,
                        cached: r.cached_blocks,
                    },
                );
            }
            Event::PrefillDone { id } => {
                self.load.prefill_done(*id);
            }
            Event::Confirmed { id } => {
                self.flush();
                if self.speculative.get(*id).is_some_and(|p| self.fed(p)) {
                    // The engine's own events say what it cached. The pick counts until they
                    // have arrived (usually already: the engine reports blocks when it
                    // computes them, before the first token), and never beyond
                    // `relay.speculative_ms`: a lingering pick would hide evictions.
                    if !self.engine_reported(*id, now_ms) {
                        let until = now_ms.saturating_add(self.cfg.relay.speculative_ms);
                        self.confirmed.push_back((until, *id));
                    }
                } else if let Some(p) = self.speculative.confirm(*id) {
                    // Its worker holds the blocks pinned until the request ends (see
                    // `Speculative`), and they enter the index then. A prefill worker freed
                    // them when it handed the KV over, which came before this answer.
                    let worker = p.worker;
                    if let Some(pw) = p.prefill.filter(|&pw| pw != p.worker) {
                        self.index.insert(pw, &p.hashes, now_ms);
                    }
                    self.fit_lru(worker);
                }
            }
            Event::Free { id } => {
                self.load.free(*id);
                self.adapters.end(*id);
                // Ended without a successful first byte (rejected, aborted, failed): the
                // engine cached nothing we can count on. Requests confirmed on an engine-fed
                // worker leave on their own deadline (`confirmed`).
                self.flush();
                if !self.confirmed.iter().any(|&(_, c)| c == *id) {
                    // Ended after an answer: the engine freed its blocks just now, so they are
                    // its most recent evictable ones.
                    if let Some(p) = self.speculative.take(*id).filter(|p| p.confirmed) {
                        self.fit_lru(p.worker);
                        self.index.insert(p.worker, &p.hashes, now_ms);
                    }
                }
            }
            Event::Report { worker, report } => self.load.report(*worker, *report),
            Event::Failed { worker, at_ms } => {
                self.load
                    .mark_failed(*worker, *at_ms, self.cfg.health.cooldown_ms);
            }
            Event::Recovered { worker } => self.load.mark_ok(*worker),
            Event::Forget { worker, hashes } => self.index.truncate(*worker, hashes, 0),
            Event::EngineRemoved { worker, hashes } => {
                let before = self.index.entries(*worker);
                self.index.truncate(*worker, hashes, 0);
                let gone = u32::try_from(before.saturating_sub(self.index.entries(*worker)))
                    .unwrap_or(u32::MAX);
                self.count_engine_blocks(*worker, |c| {
                    if gone > 0 {
                        c.full_at = c.held;
                    }
                    c.held = c.held.saturating_sub(gone);
                });
            }
            Event::EngineStored { worker, hashes } => {
                let before = self.index.entries(*worker);
                self.index.insert(*worker, hashes, now_ms);
                let new = u32::try_from(self.index.entries(*worker).saturating_sub(before))
                    .unwrap_or(u32::MAX);
                self.count_engine_blocks(*worker, |c| c.held = c.held.saturating_add(new));
                self.settle_confirmed(*worker, now_ms, false);
            }
            Event::TextTokens { text, tokens } => self.twins.learn(text, tokens),
            Event::PeerGone { tag } => {
                self.purge_peer(*tag);
            }
            Event::Hinted { worker, hash } => {
                // The key moves with its requests: only its latest worker keeps it.
                let mut holds = [0u32; crate::ids::MAX_WORKERS];
                self.index.lookup(&[*hash], now_ms, &mut holds);
                for (w, &b) in holds.iter().enumerate() {
                    if b > 0 && w != usize::from(*worker) {
                        if let Ok(w) = WorkerId::try_from(w) {
                            self.index.truncate(w, &[*hash], 0);
                        }
                    }
                }
                if usize::from(*worker) < self.cfg.workers.len() {
                    self.index.insert(*worker, &[*hash], now_ms);
                }
            }
            Event::Lora { worker, report } => self.adapters.on_report(*worker, report, now_ms),
            Event::EngineCleared { worker } => {
                self.index.clear(*worker);
                self.count_engine_blocks(*worker, |c| c.held = 0);
                self.settle_confirmed(*worker, now_ms, true);
            }
            Event::EngineFeed { worker, on } => {
                let w = usize::from(*worker);
                if w < self.cfg.workers.len() {
                    if self.engine_fed.len() <= w {
                        self.engine_fed.resize(w + 1, false);
                    }
                    if let Some(f) = self.engine_fed.get_mut(w) {
                        *f = *on;
                    }
                    // Fed, the engine's removals bound what the index holds; an LRU of the
                    // index's own would drop blocks the engine still has (its KV also holds
                    // running requests' blocks, which the index does not count).
                    if let Some(cfg) = self.cfg.workers.get(w) {
                        let kv = self.cfg.kv_blocks(cfg);
                        let cap = if *on {
                            kv.saturating_mul(2).saturating_add(1024)
                        } else {
                            kv
                        };
                        self.index.set_capacity(*worker, cap);
                    }
                }
            }
            Event::Calibrate { chars_per_token } => {
                if chars_per_token.is_finite() && CHARS_PER_TOKEN_RANGE.contains(chars_per_token) {
                    self.chars_per_token = *chars_per_token;
                }
            }
        }
    }

    /// Updates what worker `w`'s engine reports holding.
    fn count_engine_blocks(&mut self, w: WorkerId, f: impl FnOnce(&mut super::EngineCache)) {
        let wi = usize::from(w);
        if wi >= self.cfg.workers.len() {
            return;
        }
        if self.engine_blocks.len() <= wi {
            self.engine_blocks
                .resize(wi + 1, super::EngineCache::default());
        }
        if let Some(c) = self.engine_blocks.get_mut(wi) {
            f(c);
        }
    }

    /// Bounds worker `w`'s LRU by the room its KV has for ended prompts: its capacity less
    /// the blocks running requests pin there ([`Speculative::reserved`]). Engine-fed workers
    /// keep the wide bound their events need.
    fn fit_lru(&mut self, w: WorkerId) {
        if self.engine_fed(w) {
            return;
        }
        let Some(wc) = self.cfg.workers.get(usize::from(w)) else {
            return;
        };
        let kv = self.cfg.kv_blocks(wc);
        // An engine preempts before running requests fill its whole KV; the floor keeps a
        // miscount (estimated token counts, a lost end) from wiping what the worker caches.
        let cap = kv.saturating_sub(self.speculative.reserved(w)).max(kv / 4);
        self.index.set_capacity(w, cap);
    }

    /// Periodic housekeeping: lost requests and stale index entries.
    pub fn tick(&mut self, now_ms: u64) -> (usize, usize) {
        self.flush();
        // Another thread's pick whose event came before the pick was read (the request
        // already ended) is charged until its window ends; releasing it is no lost request.
        self.load.expire_provisional(now_ms);
        let lost = self.load.expire(now_ms);
        // A confirmation or end that never arrived (lost with its VM).
        self.speculative
            .expire(now_ms.saturating_sub(self.cfg.load.request_ttl_ms));
        while let Some(&(until, id)) = self.confirmed.front() {
            if until > now_ms {
                break;
            }
            self.confirmed.pop_front();
            self.unreported(id, now_ms);
        }
        let stale = self.index.expire(now_ms, 4096);
        (lost, stale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::hashing::HashParams;
    use crate::request::{parse, ApiKind};
    use crate::router::testutil::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn replicas_converge_through_events() {
        let mut a = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 3);
        let mut b = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 2, 4);
        let text = doc(5, 8000);
        let d = routed(a.route(ApiKind::Completions, &completion(&text), 0));
        let mut evs = vec![d.event.clone()];
        evs.extend(a.on_first_byte(&d, true, 1));
        let msg = crate::events::encode(0, &evs);
        for e in crate::events::decode(&msg).unwrap().1 {
            b.apply(&e, 1);
        }
        assert_eq!(b.worker_view(d.decode, 2).inflight, 1);
        // b has never seen the prompt but routes it where a did, while a's request decodes.
        let db = routed(b.route(ApiKind::Completions, &completion(&text), 2));
        assert_eq!(db.decode, d.decode);
        assert_ne!(db.id, d.id);
        assert_eq!(b.worker_view(d.decode, 2).inflight, 2);
    }

    /// One decode worker with room for 64 blocks (1024 tokens).
    fn small_worker() -> Router {
        let json = r#"{"workers":[{"name":"d0","endpoint":"127.0.0.1:8001","kv_blocks":64}],
            "disaggregation":{"threshold_tokens":0}}"#;
        Router::new(Config::from_json(json.as_bytes()).unwrap(), 1, 3)
    }

    #[test]
    fn rejected_requests_do_not_evict_a_warm_prefix() {
        let mut r = small_worker();
        let warm = doc(8, 2000); // ~31 blocks
        let d = routed(r.route(ApiKind::Completions, &completion(&warm), 0));
        r.on_first_byte(&d, true, 1);
        r.on_finish(&d, 2);
        // Four prompts over the worker's whole capacity, each answered 400 by the engine.
        for i in 0..4u64 {
            let big = doc(100 + i, 8000);
            let b = routed(r.route(ApiKind::Completions, &completion(&big), 10 + i));
            r.on_first_byte(&b, false, 11 + i);
            r.on_finish(&b, 12 + i);
        }
        // A client that gave up before any answer leaves nothing either.
        let gone = routed(r.route(ApiKind::Completions, &completion(&doc(200, 8000)), 20));
        r.on_finish(&gone, 21);
        assert_eq!(r.speculative_requests(), 0);
        let again = routed(r.route(ApiKind::Completions, &completion(&warm), 30));
        assert!(again.predicted_hit() > 0.9, "{}", again.predicted_hit());
    }

    /// The engine pins a running request's blocks: a prompt still answering is held however
    /// much came after it, and when it ends its blocks are the worker's most recent.
    #[test]
    fn a_running_prompt_stays_held_and_is_most_recent_when_it_ends() {
        let mut r = small_worker();
        let long = doc(8, 2000); // ~31 of the worker's 64 blocks
        let d = routed(r.route(ApiKind::Completions, &completion(&long), 0));
        r.on_first_byte(&d, true, 1);
        let n = d.hashes().len() as u32;
        // While it streams, two other prompts fill the worker's capacity and finish: an LRU
        // ordered by routing or answer time would have dropped the first prompt by now.
        for i in 0..2u64 {
            let o = routed(r.route(
                ApiKind::Completions,
                &completion(&doc(100 + i, 2000)),
                10 + i,
            ));
            r.on_first_byte(&o, true, 11 + i);
            r.on_finish(&o, 12 + i);
        }
        let mut held = vec![0u32; 1];
        r.index().lookup(d.hashes(), 20, &mut held);
        assert!(held[0] < n, "not in the index yet ({} of {n})", held[0]);
        r.held_blocks(d.hashes(), 20, &mut held);
        assert_eq!(held[0], n, "but it is still running");
        assert_eq!(
            r.speculative_requests(),
            0,
            "confirmed requests are not speculative"
        );
        r.on_finish(&d, 30);
        r.index().lookup(d.hashes(), 31, &mut held);
        assert_eq!(held[0], n, "freed last: back in the index");
        // The last prompt routed before it ended is what the next one evicts first.
        let next = routed(r.route(ApiKind::Completions, &completion(&doc(300, 2000)), 40));
        r.on_first_byte(&next, true, 41);
        r.on_finish(&next, 42);
        r.index().lookup(d.hashes(), 43, &mut held);
        assert_eq!(held[0], n, "most recently freed, so kept");
        // A request that ends without an answer leaves nothing, confirmed or not.
        let failed = routed(r.route(ApiKind::Completions, &completion(&doc(400, 2000)), 50));
        r.on_first_byte(&failed, false, 51);
        r.on_finish(&failed, 52);
        r.index().lookup(failed.hashes(), 53, &mut held);
        assert_eq!(held[0], 0);
    }

    #[test]
    fn running_requests_take_room_from_ended_prompts() {
        let mut r = small_worker();
        let mut held = vec![0u32; 1];
        let old = routed(r.route(ApiKind::Completions, &completion(&doc(1, 2000)), 0));
        r.on_first_byte(&old, true, 1);
        r.on_finish(&old, 2);
        let n = old.hashes().len() as u32;
        r.index().lookup(old.hashes(), 3, &mut held);
        assert_eq!(held[0], n);
        // A second prompt of the same size runs while a third comes and goes: with ~31 of
        // the 64 blocks pinned, the engine has room for the third and little of the first.
        let running = routed(r.route(ApiKind::Completions, &completion(&doc(2, 2000)), 10));
        r.on_first_byte(&running, true, 11);
        let n_running = running.hashes().len() as u32;
        let third = routed(r.route(ApiKind::Completions, &completion(&doc(3, 2000)), 20));
        r.on_first_byte(&third, true, 21);
        r.on_finish(&third, 22);
        r.index().lookup(third.hashes(), 23, &mut held);
        assert_eq!(held[0], third.hashes().len() as u32);
        r.index().lookup(old.hashes(), 23, &mut held);
        assert!(
            held[0] <= 64 - n_running - n,
            "the first prompt's blocks made room: {} of {n} left",
            held[0]
        );
        // Ended, the running prompt frees its room and is the newest content.
        r.on_finish(&running, 30);
        r.index().lookup(running.hashes(), 31, &mut held);
        assert_eq!(held[0], n_running);
        r.index().lookup(third.hashes(), 31, &mut held);
        assert_eq!(held[0], third.hashes().len() as u32);
    }

    #[test]
    fn a_burst_sees_unconfirmed_picks_and_a_confirmed_prompt_stays() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 3);
        let text = doc(9, 8000);
        let first = routed(r.route(ApiKind::Completions, &completion(&text), 0));
        // Not answered yet: the next identical request still sees the pick.
        let second = routed(r.route(ApiKind::Completions, &completion(&text), 1));
        assert_eq!(r.speculative_requests(), 2);
        let mut held = vec![0u32; 6];
        r.flush();
        r.held_blocks(first.hashes(), 1, &mut held);
        let n = first.hashes().len() as u32;
        assert_eq!(held[usize::from(first.decode)], n);
        assert_eq!(held[usize::from(second.decode)], n);
        r.index().lookup(first.hashes(), 1, &mut held);
        assert_eq!(held, vec![0; 6], "nothing confirmed yet");
        r.on_first_byte(&first, true, 2);
        r.on_finish(&first, 3);
        r.on_finish(&second, 3);
        assert_eq!(r.speculative_requests(), 0);
        let third = routed(r.route(ApiKind::Completions, &completion(&text), 4));
        assert_eq!(third.decode, first.decode);
        assert!(third.predicted_hit() > 0.9, "{}", third.predicted_hit());
    }

    #[test]
    fn replicas_confirm_or_drop_speculative_entries_by_event() {
        let cfg0 = r#","disaggregation":{"threshold_tokens":0}"#;
        let mut a = Router::new(cfg(cfg0), 1, 3);
        let mut b = Router::new(cfg(cfg0), 2, 4);
        let ok = doc(10, 8000);
        let bad = doc(11, 8000);
        let d_ok = routed(a.route(ApiKind::Completions, &completion(&ok), 0));
        let d_bad = routed(a.route(ApiKind::Completions, &completion(&bad), 0));
        let mut evs = vec![d_ok.event.clone(), d_bad.event.clone()];
        evs.extend(a.on_first_byte(&d_ok, true, 1));
        evs.extend(a.on_first_byte(&d_bad, false, 1));
        assert!(evs.contains(&Event::Confirmed { id: d_ok.id }));
        assert!(!evs.contains(&Event::Confirmed { id: d_bad.id }));
        evs.push(a.on_finish(&d_ok, 2));
        evs.push(a.on_finish(&d_bad, 2));
        let msg = crate::events::encode(0, &evs);
        for e in crate::events::decode(&msg).unwrap().1 {
            b.apply(&e, 2);
        }
        assert_eq!(b.speculative_requests(), 0);
        let mut held = vec![0u32; 6];
        for (text, want) in [(&ok, true), (&bad, false)] {
            let body = completion(text);
            let req = parse(ApiKind::Completions, &body).unwrap();
            let ph = crate::hashing::prompt_hashes(&req, &HashParams::from_config(b.config()));
            b.index().lookup(&ph.blocks, 3, &mut held);
            assert_eq!(held.iter().any(|&n| n > 0), want);
        }
    }
}
