//! Other gateways' routing decisions (shared through kvroute-relay over NATS): which of their
//! events a gateway adopts, and the request ids they get here.
//!
//! A request id is unique only within its gateway (replica member id and a counter), so a
//! peer's ids are moved into a space of their own: the top 24 bits name the peer (top bit
//! set, which local ids never have), the low 40 bits are the peer's id mixed. That keeps two
//! gateways' requests apart and lets a gateway that is gone be purged by its prefix.

use crate::config::Config;
use crate::events::Event;
use crate::ids::{mix, RequestId, WorkerId};
use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64;

const LOW_BITS: u32 = 40;
const LOW_MASK: u64 = (1 << LOW_BITS) - 1;

/// A peer's message with more decisions than this is refused whole: this build never
/// writes one ([`events::peer_messages`] splits at it), so it is forged or broken (one
/// probe charged 3,000 requests in a single 870 KiB message).
pub const MAX_ROUTED_PER_MESSAGE: usize = 64;
/// Requests one peer may have charged here at once. A gateway's share of a fleet's
/// concurrency is far below this; beyond it its decisions are not charged (counted).
pub const MAX_PEER_REQUESTS: usize = 4096;
/// Peers with charges here at once: forged gateway names cannot each get their own caps.
pub const MAX_PEERS: usize = 64;

/// The id prefix of a peer gateway's requests (24 bits, top bit set).
pub fn peer_tag(gateway: &str) -> u64 {
    0x80_0000 | (xxh3_64(gateway.as_bytes()) & 0x7F_FFFF)
}

/// Whether `id` is another gateway's request (whichever).
pub fn is_peer_id(id: RequestId) -> bool {
    id >> 63 == 1
}

/// Whether `id` belongs to the peer with `tag`.
pub fn is_peer_request(id: RequestId, tag: u64) -> bool {
    id >> LOW_BITS == tag
}

fn peer_id(tag: u64, id: RequestId) -> RequestId {
    (tag << LOW_BITS) | (mix(id) & LOW_MASK)
}

/// What a peer was not allowed to do, per message (for the `kvroute_peers_*` counters).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Refusals {
    /// Events that are not a peer's to send (another worker's health or load report,
    /// forgetting blocks, calibration, engine state, gone gateways).
    pub refused: u64,
    /// Decisions over a cap (per message, per peer, per worker, number of peers) or naming a
    /// worker this gateway does not have.
    pub capped: u64,
    /// Decisions stamped later than this gateway's clock, moved back to it.
    pub clamped: u64,
}

/// What one peer has charged here: the caps are checked against it.
#[derive(Debug, Default)]
struct Ledger {
    requests: HashMap<RequestId, Charge>,
    /// Per worker: KV blocks of the peer's requests decoding there, and prefill tokens
    /// still to compute there.
    blocks: Vec<u64>,
    tokens: Vec<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Charge {
    worker: WorkerId,
    prefill_worker: WorkerId,
    blocks: u64,
    tokens: u64,
    expires_ms: u64,
}

/// Other gateways' decisions as this gateway accepts them: data about their own requests,
/// bounded by what the fleet could hold, never authority over workers.
#[derive(Debug, Default)]
pub struct Peers {
    /// Per worker: KV capacity in blocks (a peer cannot have more in flight on a worker
    /// than its KV holds, nor more prompt tokens waiting there than fit in it).
    kv_blocks: Vec<u64>,
    block_size: u64,
    request_ttl_ms: u64,
    ledgers: HashMap<u64, Ledger>,
}

impl Peers {
    pub fn new(cfg: &Config) -> Peers {
        Peers {
            kv_blocks: cfg
                .workers
                .iter()
                .map(|w| u64::from(cfg.kv_blocks(w)))
                .collect(),
            block_size: u64::from(cfg.block_size.max(1)),
            request_ttl_ms: cfg.load.request_ttl_ms,
            ledgers: HashMap::new(),
        }
    }

    /// Workers this was made for (a new configuration makes a new one).
    pub fn workers(&self) -> usize {
        self.kv_blocks.len()
    }

    /// Requests peers have charged here.
    pub fn charged(&self) -> usize {
        self.ledgers.values().map(|l| l.requests.len()).sum()
    }

    /// The events of one message of peer `tag` this gateway applies, with ids moved into the
    /// peer's space and timestamps no later than `now_ms`, appended to `out`. Decisions and
    /// what followed them (first byte, confirmation, end) are the peer's to tell; a worker's
    /// health, load reports and what engines hold are each gateway's own observation (its
    /// responses, its scrapes, its relay), so a peer's word on them is refused.
    pub fn adopt(
        &mut self,
        events: Vec<Event>,
        tag: u64,
        now_ms: u64,
        out: &mut Vec<Event>,
    ) -> Refusals {
        let mut r = Refusals::default();
        let routed = events
            .iter()
            .filter(|e| matches!(e, Event::Routed(_)))
            .count();
        let too_many = routed > MAX_ROUTED_PER_MESSAGE;
        for e in events {
            match e {
                Event::Routed(mut req) => {
                    if too_many {
                        r.capped += 1;
                        continue;
                    }
                    if req.now_ms > now_ms {
                        // A decision cannot come from this gateway's future: stamped later,
                        // its charge would outlive the TTL (u64::MAX: until Envoy restarts).
                        req.now_ms = now_ms;
                        r.clamped += 1;
                    }
                    req.id = peer_id(tag, req.id);
                    if self.charge(tag, &req) {
                        out.push(Event::Routed(req));
                    } else {
                        r.capped += 1;
                    }
                }
                Event::PrefillDone { id } => {
                    let id = peer_id(tag, id);
                    self.prefill_done(tag, id);
                    out.push(Event::PrefillDone { id });
                }
                Event::Confirmed { id } => out.push(Event::Confirmed {
                    id: peer_id(tag, id),
                }),
                Event::Free { id } => {
                    let id = peer_id(tag, id);
                    self.release(tag, id);
                    out.push(Event::Free { id });
                }
                // `events::is_peer_event` is false for all of these: this build never sends
                // them to peers, so one arriving is forged or from an older build.
                Event::Report { .. }
                | Event::Failed { .. }
                | Event::Recovered { .. }
                | Event::Forget { .. }
                | Event::Calibrate { .. }
                | Event::EngineStored { .. }
                | Event::EngineRemoved { .. }
                | Event::EngineCleared { .. }
                | Event::Lora { .. }
                | Event::EngineFeed { .. }
                | Event::PeerGone { .. }
                | Event::Hinted { .. }
                | Event::TextTokens { .. } => r.refused += 1,
            }
        }
        r
    }

    /// Whether the peer may charge `req` (already in its id space), and records it. A repeat
    /// of a charged id passes (the load table ignores it).
    fn charge(&mut self, tag: u64, req: &crate::load::NewRequest) -> bool {
        let n = self.kv_blocks.len();
        let pw = req.prefill_worker.unwrap_or(req.worker);
        let (Some(&kv), Some(&pkv)) = (
            self.kv_blocks.get(usize::from(req.worker)),
            self.kv_blocks.get(usize::from(pw)),
        ) else {
            return false;
        };
        if !self.ledgers.contains_key(&tag) {
            if self.ledgers.len() >= MAX_PEERS {
                self.expire(req.now_ms);
            }
            if self.ledgers.len() >= MAX_PEERS {
                return false;
            }
        }
        let ledger = self.ledgers.entry(tag).or_insert_with(|| Ledger {
            requests: HashMap::new(),
            blocks: vec![0; n],
            tokens: vec![0; n],
        });
        if ledger.requests.contains_key(&req.id) {
            return true;
        }
        // Every request holds at least one block while it runs.
        let blocks = (req.blocks.len() as u64 + u64::from(req.tail_blocks)).max(1);
        let tokens = u64::from(req.prefill_tokens);
        let held = ledger.blocks.get(usize::from(req.worker)).copied();
        let waiting = ledger.tokens.get(usize::from(pw)).copied();
        let fits = ledger.requests.len() < MAX_PEER_REQUESTS
            && held.is_some_and(|h| h.saturating_add(blocks) <= kv)
            && waiting
                .is_some_and(|t| t.saturating_add(tokens) <= pkv.saturating_mul(self.block_size));
        if !fits {
            if ledger.requests.is_empty() {
                self.ledgers.remove(&tag);
            }
            return false;
        }
        if let Some(b) = ledger.blocks.get_mut(usize::from(req.worker)) {
            *b += blocks;
        }
        if let Some(t) = ledger.tokens.get_mut(usize::from(pw)) {
            *t += tokens;
        }
        ledger.requests.insert(
            req.id,
            Charge {
                worker: req.worker,
                prefill_worker: pw,
                blocks,
                tokens,
                expires_ms: req.now_ms.saturating_add(self.request_ttl_ms),
            },
        );
        true
    }

    fn prefill_done(&mut self, tag: u64, id: RequestId) {
        let Some(l) = self.ledgers.get_mut(&tag) else {
            return;
        };
        if let Some(c) = l.requests.get_mut(&id) {
            if let Some(t) = l.tokens.get_mut(usize::from(c.prefill_worker)) {
                *t = t.saturating_sub(c.tokens);
            }
            c.tokens = 0;
        }
    }

    fn release(&mut self, tag: u64, id: RequestId) {
        let Some(l) = self.ledgers.get_mut(&tag) else {
            return;
        };
        if let Some(c) = l.requests.remove(&id) {
            uncharge(l, &c);
        }
        if l.requests.is_empty() {
            self.ledgers.remove(&tag);
        }
    }

    /// The peer is gone: everything it charged is released (`Event::PeerGone`).
    pub fn gone(&mut self, tag: u64) {
        self.ledgers.remove(&tag);
    }

    /// Forgets charges past the request TTL, as the load table releases them.
    pub fn expire(&mut self, now_ms: u64) {
        self.ledgers.retain(|_, l| {
            let dead: Vec<(RequestId, Charge)> = l
                .requests
                .iter()
                .filter(|(_, c)| c.expires_ms <= now_ms)
                .map(|(id, c)| (*id, *c))
                .collect();
            for (id, c) in dead {
                l.requests.remove(&id);
                uncharge(l, &c);
            }
            !l.requests.is_empty()
        });
    }
}

fn uncharge(l: &mut Ledger, c: &Charge) {
    if let Some(b) = l.blocks.get_mut(usize::from(c.worker)) {
        *b = b.saturating_sub(c.blocks);
    }
    if let Some(t) = l.tokens.get_mut(usize::from(c.prefill_worker)) {
        *t = t.saturating_sub(c.tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{LoadParams, LoadTable, NewRequest, Report};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Four workers of 100 KV blocks (16 tokens each), requests live 10 s.
    fn peers() -> Peers {
        let json = r#"{"workers":[
            {"name":"d0","endpoint":"127.0.0.1:8001","kv_blocks":100},
            {"name":"d1","endpoint":"127.0.0.1:8002","kv_blocks":100},
            {"name":"d2","endpoint":"127.0.0.1:8003","kv_blocks":100},
            {"name":"d3","endpoint":"127.0.0.1:8004","kv_blocks":100}
        ],"block_size":16,"load":{"request_ttl_ms":10000}}"#;
        Peers::new(&Config::from_json(json.as_bytes()).unwrap())
    }

    fn routed(id: RequestId, worker: WorkerId, blocks: usize, tokens: u32, now_ms: u64) -> Event {
        Event::Routed(NewRequest {
            id,
            worker,
            prefill_worker: None,
            blocks: (0..blocks as u64).collect(),
            cached_blocks: 0,
            tail_blocks: 1,
            prefill_tokens: tokens,
            now_ms,
            adapter: 0,
        })
    }

    fn adopt(p: &mut Peers, evs: Vec<Event>, tag: u64, now: u64) -> (Vec<Event>, Refusals) {
        let mut out = Vec::new();
        let r = p.adopt(evs, tag, now, &mut out);
        (out, r)
    }

    #[test]
    fn peer_ids_live_apart_from_local_ids_and_from_each_other() {
        let (a, b) = (peer_tag("gw-a"), peer_tag("gw-b"));
        assert_ne!(a, b);
        // A local id: replica member id in the high 32 bits (small), counter below.
        let local: RequestId = (7 << 32) | 99;
        let evs = vec![routed(local, 1, 1, 10, 1), Event::Free { id: local }];
        let mut p = peers();
        let (from_a, _) = adopt(&mut p, evs.clone(), a, 5);
        let (from_b, _) = adopt(&mut p, evs, b, 5);
        let ids = |v: &[Event]| -> Vec<RequestId> {
            v.iter()
                .filter_map(|e| match e {
                    Event::Routed(r) => Some(r.id),
                    Event::Free { id } => Some(*id),
                    _ => None,
                })
                .collect()
        };
        let (ia, ib) = (ids(&from_a), ids(&from_b));
        assert_eq!(ia.len(), 2);
        assert_eq!(ia[0], ia[1], "the same request keeps one id");
        assert_ne!(ia[0], ib[0]);
        assert!(is_peer_request(ia[0], a) && !is_peer_request(ia[0], b));
        assert!(!is_peer_request(local, a));
        assert_eq!(p.charged(), 0, "freed");
    }

    /// A peer tells its own decisions and their end; a worker's health, load, forgetting,
    /// calibration and engine state are not its to tell (one forged message once sent 16 of
    /// 16 requests to the one worker left, on both gateways).
    #[test]
    fn a_peer_cannot_speak_for_workers() {
        let report = Report {
            kv_usage: 1.0,
            waiting: 1000,
            running: None,
            at_ms: u64::MAX,
        };
        let evs = vec![
            Event::Failed {
                worker: 1,
                at_ms: u64::MAX,
            },
            Event::Recovered { worker: 2 },
            Event::Report { worker: 3, report },
            Event::Forget {
                worker: 0,
                hashes: vec![1, 2],
            },
            Event::Calibrate {
                chars_per_token: 9.0,
            },
            Event::EngineCleared { worker: 0 },
            Event::EngineStored {
                worker: 0,
                hashes: vec![1],
            },
            Event::EngineRemoved {
                worker: 0,
                hashes: vec![1],
            },
            Event::EngineFeed {
                worker: 0,
                on: false,
            },
            Event::PeerGone { tag: 0x80_0001 },
            routed(1, 0, 2, 32, 5),
            Event::PrefillDone { id: 1 },
            Event::Confirmed { id: 1 },
            Event::Free { id: 1 },
        ];
        let (out, r) = adopt(&mut peers(), evs, peer_tag("x"), 10);
        assert_eq!(r.refused, 10);
        assert_eq!((r.capped, r.clamped), (0, 0));
        assert_eq!(out.len(), 4);
        assert!(out.iter().all(crate::events::is_peer_event));
    }

    /// A decision stamped in the future is charged from now: it expires by this gateway's
    /// clock, not the peer's (at_ms = u64::MAX once charged until Envoy restarted).
    #[test]
    fn future_timestamps_are_clamped_to_the_local_clock() {
        let mut p = peers();
        let now = 1_000_000;
        let (out, r) = adopt(
            &mut p,
            vec![
                routed(1, 0, 2, 32, u64::MAX),
                routed(2, 0, 2, 32, now + 3_600_000),
            ],
            peer_tag("x"),
            now,
        );
        assert_eq!(r.clamped, 2);
        let mut load = LoadTable::new(
            4,
            LoadParams {
                request_ttl_ms: 10_000,
                ..LoadParams::default()
            },
        );
        for e in &out {
            let Event::Routed(req) = e else {
                panic!("{e:?}")
            };
            assert_eq!(req.now_ms, now);
            assert!(load.add(req));
        }
        assert_eq!(load.expire(now + 9_999), 0);
        assert_eq!(load.expire(now + 10_000), 2, "gone by the local clock");
        p.expire(now + 10_000);
        assert_eq!(p.charged(), 0);
    }

    /// 3,000 decisions in one message (870 KiB) is nothing this build writes: refused whole.
    #[test]
    fn a_message_with_too_many_decisions_is_refused() {
        let mut p = peers();
        let flood: Vec<Event> = (0..3000)
            .map(|i| routed(i, (i % 4) as u16, 0, 0, 5))
            .collect();
        let (out, r) = adopt(&mut p, flood, peer_tag("x"), 10);
        assert!(out.is_empty());
        assert_eq!(r.capped, 3000);
        assert_eq!(p.charged(), 0);
        let ok: Vec<Event> = (0..MAX_ROUTED_PER_MESSAGE as u64)
            .map(|i| routed(i, (i % 4) as u16, 0, 0, 5))
            .collect();
        let (out, r) = adopt(&mut p, ok, peer_tag("x"), 10);
        assert_eq!((out.len(), r.capped), (MAX_ROUTED_PER_MESSAGE, 0));
    }

    /// One peer cannot charge more than a worker's KV holds (blocks, prompt tokens) nor more
    /// than `MAX_PEER_REQUESTS` requests; its end events give the room back.
    #[test]
    fn what_one_peer_charges_is_capped() {
        let mut p = peers();
        let tag = peer_tag("x");
        // 9 blocks + 1 tail each: ten fill worker 0's 100 blocks, the eleventh does not fit.
        let evs: Vec<Event> = (0..11).map(|i| routed(i, 0, 9, 0, 5)).collect();
        let (out, r) = adopt(&mut p, evs, tag, 10);
        assert_eq!((out.len(), r.capped), (10, 1));
        // Another peer has its own room; worker 1 has room for this one.
        assert_eq!(
            adopt(&mut p, vec![routed(11, 0, 9, 0, 5)], peer_tag("y"), 10)
                .1
                .capped,
            0
        );
        assert_eq!(
            adopt(&mut p, vec![routed(12, 1, 9, 0, 5)], tag, 10)
                .1
                .capped,
            0
        );
        // A repeat is not charged twice; a free makes room.
        assert_eq!(
            adopt(&mut p, vec![routed(0, 0, 9, 0, 5)], tag, 10).1.capped,
            0
        );
        assert_eq!(
            adopt(&mut p, vec![routed(13, 0, 9, 0, 5)], tag, 10)
                .1
                .capped,
            1
        );
        adopt(&mut p, vec![Event::Free { id: 3 }], tag, 10);
        assert_eq!(
            adopt(&mut p, vec![routed(13, 0, 9, 0, 5)], tag, 10)
                .1
                .capped,
            0
        );
        // Prompt tokens waiting on a worker: at most its KV in tokens (100 x 16).
        let (_, r) = adopt(
            &mut p,
            vec![routed(20, 2, 1, 1600, 5), routed(21, 2, 1, 1, 5)],
            tag,
            10,
        );
        assert_eq!(r.capped, 1);
        adopt(&mut p, vec![Event::PrefillDone { id: 20 }], tag, 10);
        assert_eq!(
            adopt(&mut p, vec![routed(21, 2, 1, 1, 5)], tag, 10)
                .1
                .capped,
            0
        );
        // A worker this gateway does not have.
        assert_eq!(
            adopt(&mut p, vec![routed(30, 9, 1, 1, 5)], tag, 10)
                .1
                .capped,
            1
        );
        // Requests: at most MAX_PEER_REQUESTS, whatever the workers' room.
        let mut big = peers();
        big.kv_blocks = vec![u64::MAX / 4; 4];
        let mut n = 0;
        for m in 0..(MAX_PEER_REQUESTS / MAX_ROUTED_PER_MESSAGE + 2) as u64 {
            let evs = (0..MAX_ROUTED_PER_MESSAGE as u64)
                .map(|i| routed(m << 32 | i, (i % 4) as u16, 0, 0, 5))
                .collect();
            n += adopt(&mut big, evs, tag, 10).0.len();
        }
        assert_eq!(n, MAX_PEER_REQUESTS);
        assert_eq!(big.charged(), MAX_PEER_REQUESTS);
        // Gone or past the TTL, the room is back.
        big.gone(tag);
        assert_eq!(big.charged(), 0);
        p.expire(10_005);
        assert_eq!(p.charged(), 0);
    }

    #[test]
    fn forged_gateway_names_get_no_caps_of_their_own() {
        let mut p = peers();
        let mut charged = 0;
        for g in 0..MAX_PEERS + 10 {
            let (out, _) = adopt(
                &mut p,
                vec![routed(1, 0, 0, 0, 5)],
                peer_tag(&format!("g{g}")),
                10,
            );
            charged += out.len();
        }
        // Tags are 23 bits: distinct names may share one, never exceed the limit.
        assert!(charged <= MAX_PEERS, "{charged}");
        assert!(p.ledgers.len() <= MAX_PEERS);
        p.expire(10_005);
        assert_eq!(
            adopt(
                &mut p,
                vec![routed(1, 0, 0, 0, 20_000)],
                peer_tag("late"),
                20_000
            )
            .0
            .len(),
            1
        );
    }
}
