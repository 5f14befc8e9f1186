//! Requests this replica did not route: other threads' picks charged before their events
//! arrive, and the requests of replicas and gateways that are gone or have moved on.

use super::Router;
use crate::events::Event;
use crate::ids::RequestId;
use crate::load::NewRequest;
use crate::picks::{self, Pick};

impl Router {
    /// Charges, provisionally, what other threads picked moments ago and this one has not
    /// heard of yet ([`crate::picks`]); call before routing. Returns how many were charged.
    pub fn note_peer_picks(&mut self, picks: &[Pick], now_ms: u64) -> usize {
        self.load.expire_provisional(now_ms);
        let mut charged = 0;
        for p in picks {
            if p.id & !0xFFFF_FFFF == self.origin || !picks::fresh(p, now_ms) {
                continue;
            }
            if p.ended {
                self.load.free_provisional(p.id);
                continue;
            }
            let r = NewRequest {
                id: p.id,
                worker: p.worker,
                prefill_worker: p.prefill_worker,
                blocks: Vec::new(),
                cached_blocks: 0,
                tail_blocks: p.blocks,
                prefill_tokens: p.prefill_tokens,
                now_ms: p.at_ms,
                adapter: 0,
            };
            // Released just after the pick leaves the window, so it is never charged twice.
            let until = p.at_ms.saturating_add(picks::WINDOW_MS + 1);
            if self.load.add_provisional(&r, until) {
                charged += 1;
            }
        }
        charged
    }

    /// Releases the requests started by replica `origin`, declared dead by replication: it
    /// will never send their ends. Our own origin is never purged.
    pub fn purge_origin(&mut self, origin: u64) -> usize {
        // Ids carry their replica's origin in the high 32 bits (see `next_id`).
        let tag = (origin & 0xFFFF_FFFF) << 32;
        if tag == self.origin {
            return 0;
        }
        self.load.free_matching(|id| id >> 32 == tag >> 32)
    }

    /// Releases every request of the peer gateway with id prefix `tag` (it is gone: it will
    /// never send their ends) and drops the blocks they were expected to leave.
    /// A prompt that extends the whole prompt of another gateway's request still in flight
    /// here is that conversation's next turn: its client has read the answer, so that
    /// request was answered and has ended; its end events are only still on their way from
    /// the other gateway (a few ms at idle, tens under load). Applied now, so the next turn
    /// finds its prompt cached on its worker, not that worker busy prefilling it: charged as
    /// running, the first turn moved one in two second turns sent at once through the other
    /// gateway (issue 46). The late events then find nothing left to do. Only peers' requests:
    /// this gateway's own end before their client can send another turn.
    ///
    /// A prefix the worker already held when that request came (in the index) is a shared
    /// one, like a request in flight's last block that others expect too (see
    /// `Speculative::extended_by`): such a request may still run, and stays.
    pub(super) fn end_continued_peer_requests(&mut self, hashes: &[u64], now_ms: u64) {
        let ids = self
            .speculative
            .extended_by(hashes, crate::precise::peers::is_peer_id);
        let mut run = vec![0u32; self.cfg.workers.len()];
        for id in ids {
            let Some(p) = self.speculative.get(id) else {
                continue;
            };
            self.index.lookup(&p.hashes, now_ms, &mut run);
            if run.get(usize::from(p.worker)).copied().unwrap_or(0) as usize >= p.hashes.len() {
                continue;
            }
            self.apply(&Event::Confirmed { id }, now_ms);
            self.apply(&Event::Free { id }, now_ms);
        }
    }

    pub fn purge_peer(&mut self, tag: u64) -> usize {
        let mine = |id: RequestId| crate::precise::peers::is_peer_request(id, tag);
        self.flush();
        self.speculative.drop_matching(mine);
        self.load.free_matching(mine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ApiKind;
    use crate::router::testutil::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The next turn of a conversation another gateway routed arrives before that gateway's
    /// end events for the first turn: it still goes to the first turn's worker, whose load
    /// no longer counts the first turn. A prompt that only shares a prefix, or repeats the
    /// whole prompt, ends nothing.
    #[test]
    fn the_next_turn_ends_the_peer_request_it_continues() {
        let extra = r#","disaggregation":{"threshold_tokens":0}"#;
        let first = doc(70, 320);
        let mut a = Router::new(cfg(extra), 1, 7);
        let d = routed(a.route(ApiKind::Completions, &completion(&first), 10));
        let mut adopted = Vec::new();
        let mut peers = crate::precise::peers::Peers::new(&cfg(extra));
        let tag = crate::precise::peers::peer_tag("a");
        peers.adopt(vec![d.event.clone()], tag, 10, &mut adopted);
        // `as_peer: false` applies the decision as a local one, which this never ends: the
        // behaviour peers' requests had before.
        let moves = |seed: u64, as_peer: bool| {
            let mut b = Router::new(cfg(extra), 2, seed);
            for e in if as_peer {
                &adopted[..]
            } else {
                core::slice::from_ref(&d.event)
            } {
                b.apply(e, 10);
            }
            assert_eq!(b.worker_view(d.decode, 11).inflight, 1);
            // The same prompt again, or one sharing only its first block, ends nothing.
            let shared = first[..70].to_string() + &doc(71, 300);
            for p in [&first, &shared] {
                let x = routed(b.route(ApiKind::Completions, &completion(p), 11));
                b.apply(&Event::Free { id: x.id }, 11);
                assert_eq!(b.worker_view(d.decode, 11).inflight, 1);
            }
            let next = format!("{first} answer of turn one, and the user's next question");
            let n = routed(b.route(ApiKind::Completions, &completion(&next), 12));
            assert!(n.decode_overlap_tokens > 0 || n.decode != d.decode);
            if as_peer {
                let running = u32::from(n.decode == d.decode);
                assert_eq!(
                    b.worker_view(d.decode, 12).inflight,
                    running,
                    "turn one ended"
                );
            }
            n.decode != d.decode
        };
        let moved = |as_peer| (0..20).filter(|&s| moves(s, as_peer)).count();
        assert_eq!(moved(true), 0, "next turns moved");
        assert!(moved(false) >= 10, "{} of 20", moved(false));

        // A prefix that is not the peer's own: its worker held it already (an earlier request
        // ended there), or another request in flight expects it too. It stays charged.
        let longer = format!("{first} and a different question after the shared part");
        for shared_by in ["index", "in flight"] {
            let mut b = Router::new(cfg(extra), 2, 3);
            if shared_by == "index" {
                let mut earlier = d.event.clone();
                if let Event::Routed(r) = &mut earlier {
                    r.id = 77;
                }
                b.apply(&earlier, 5);
                b.apply(&Event::Confirmed { id: 77 }, 6);
                b.apply(&Event::Free { id: 77 }, 7);
            }
            for e in &adopted {
                b.apply(e, 10);
            }
            if shared_by == "in flight" {
                let mut other = Vec::new();
                peers.adopt(
                    vec![d.event.clone()],
                    crate::precise::peers::peer_tag("c"),
                    10,
                    &mut other,
                );
                for e in &other {
                    b.apply(e, 10);
                }
            }
            let before = b.worker_view(d.decode, 11).inflight;
            let n = routed(b.route(ApiKind::Completions, &completion(&longer), 12));
            let after = b.worker_view(d.decode, 12).inflight;
            assert_eq!(
                after,
                before + u32::from(n.decode == d.decode),
                "{shared_by}"
            );
        }
    }

    /// Two threads routing one burst: without the shared record each sees every worker
    /// idle and their cold prompts pile onto the same workers; with it each charges the
    /// other's picks and the burst spreads. The event that follows replaces the provisional
    /// charge, and a charge whose event never came is released after the window.
    #[test]
    fn peer_picks_spread_a_burst_routed_on_two_threads() {
        let extra = r#","disaggregation":{"threshold_tokens":0}"#;
        let burst: Vec<Vec<u8>> = (0..4).map(|i| completion(&doc(40 + i, 20_000))).collect();
        let workers_used = |share: bool| {
            let mut a = Router::new(cfg(extra), 1, 7);
            let mut b = Router::new(cfg(extra), 2, 7);
            let mut record = picks::encode(&[]);
            let mut used = Vec::new();
            for (i, body) in burst.iter().enumerate() {
                let r = if i % 2 == 0 { &mut a } else { &mut b };
                if share {
                    r.note_peer_picks(&picks::decode(&record), 10);
                }
                let d = routed(r.route(ApiKind::Completions, body, 10));
                if let Some(p) = d.pick() {
                    record = picks::merge(&record, p, 10);
                }
                used.push(d.decode);
            }
            used.sort_unstable();
            used.dedup();
            used.len()
        };
        assert_eq!(workers_used(true), 4);
        // Same seeds, no record: each thread repeats the other's choices.
        assert!(workers_used(false) < 4);

        let mut a = Router::new(cfg(extra), 1, 7);
        let mut b = Router::new(cfg(extra), 2, 9);
        let d = routed(a.route(ApiKind::Completions, &burst[0], 10));
        let pick = d.pick().expect("routed");
        assert_eq!(b.note_peer_picks(&[pick], 10), 1);
        assert_eq!(b.note_peer_picks(&[pick], 11), 0, "charged once");
        assert_eq!(a.note_peer_picks(&[pick], 11), 0, "its own pick");
        let provisional = b.load().totals();
        assert_eq!(provisional.1, u64::from(pick.prefill_tokens));
        b.apply(&d.event, 12);
        assert_eq!(
            b.load().totals(),
            a.load().totals(),
            "the event replaced it"
        );
        b.note_peer_picks(&[], 10 + picks::WINDOW_MS + 1);
        assert_eq!(
            b.load().totals(),
            a.load().totals(),
            "a real charge is not expired"
        );

        let mut c = Router::new(cfg(extra), 3, 9);
        c.note_peer_picks(&[pick], 10);
        assert_eq!(c.load().totals().0, 1);
        assert_eq!(c.note_peer_picks(&[pick], 10 + picks::WINDOW_MS), 0);
        assert_eq!(c.load().totals().0, 1, "still inside the window");
        c.note_peer_picks(&[], 10 + picks::WINDOW_MS + 1);
        assert_eq!(c.load().totals(), (0, 0, 0), "never replaced: released");
        // A pick read after its request's whole life reached this thread is not charged:
        // a phantom in flight would make a quiet worker look busy (e2e: a session's
        // sequential turns on two threads then left their worker).
        let mut e = Router::new(cfg(extra), 4, 9);
        let mut evs = vec![d.event.clone()];
        evs.extend(a.on_first_byte(&d, true, 15));
        evs.extend(a.on_confirmed(&d, true, 16));
        evs.push(a.on_finish(&d, 20));
        for ev in &evs {
            e.apply(ev, 21);
        }
        assert_eq!(e.load().totals(), (0, 0, 0));
        assert_eq!(e.note_peer_picks(&[pick], 30), 0);
        assert_eq!(e.load().totals(), (0, 0, 0));
        // With no request to route, housekeeping releases it, and not as a lost request.
        c.note_peer_picks(&[pick], 10);
        assert_eq!(c.tick(10 + picks::WINDOW_MS + 1).0, 0);
        assert_eq!(c.load().totals(), (0, 0, 0));
    }
}
