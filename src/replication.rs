//! Membership and fan-out between the VMs of one Envoy process (one VM per worker thread).
//!
//! Every VM keeps a full replica of the router state and sends its events to the others
//! through proxy-wasm shared queues. Membership lives in one small shared-data record,
//! updated with compare-and-swap: each VM appends itself when it starts and refreshes its
//! heartbeat on every tick. Envoy also starts short-lived VMs (a canary that is configured
//! and destroyed; the main thread's VM) whose queues keep accepting messages nobody reads,
//! so senders skip members whose heartbeat is older than `stale_ms`, and a member silent for
//! `forget_ms` is dropped from the record. A peer that goes stale is reported once by
//! `take_departed`, so the survivors release the requests it charged and will never end.
//! The group name carries a hash of the configuration (`namespace`): worker ids are indices
//! into the worker list, so VMs of two configurations must never exchange events.
//!
//! The host is behind `SharedBus`, so the protocol is tested natively with an in-memory bus.

/// The proxy-wasm shared data and shared queue calls this module needs.
pub trait SharedBus {
    /// Value and CAS token of a shared-data key.
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes if `cas` still matches; false on a CAS mismatch or any error.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool;
    fn register_queue(&self, name: &str) -> Option<u32>;
    fn resolve_queue(&self, name: &str) -> Option<u32>;
    fn enqueue(&self, queue: u32, msg: &[u8]) -> bool;
    fn dequeue(&self, queue: u32) -> Option<Vec<u8>>;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Member {
    id: u32,
    heartbeat_ms: u64,
    /// The VM wants each message as it is sent (it routes, or holds the relay stream).
    urgent: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Peer {
    id: u32,
    queue: u32,
    urgent: bool,
    /// Messages for a peer that is not urgent, framed (`BATCH`), sent together by `flush`:
    /// each enqueue wakes the peer's thread, which on a small machine costs the sender tens
    /// of microseconds and the peer a callback.
    batch: Vec<u8>,
}

/// First byte of a queue message that carries several messages (`u32` LE length, then the
/// message, each). Replication messages start with their version byte, never this.
const BATCH: u8 = 0xBA;
/// A batch this large is sent at once instead of waiting for the next `flush`.
const BATCH_MAX: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub stale_ms: u64,
    pub forget_ms: u64,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            stale_ms: 2_000,
            forget_ms: 30_000,
        }
    }
}

#[derive(Debug)]
pub struct Replicator {
    ns: String,
    id: u32,
    queue: u32,
    peers: Vec<Peer>,
    timing: Timing,
    /// CAS token of the membership record when `peers` was last rebuilt.
    seen_cas: Option<u32>,
    /// Peers whose heartbeat went stale since the last `take_departed`.
    departed: Vec<u32>,
    /// What this VM announces in the membership record (`set_urgent`).
    urgent: bool,
}

/// CAS retries before giving up until the next tick (contention is a handful of VMs).
const CAS_RETRIES: usize = 16;

impl Replicator {
    /// Joins the group named `ns` (plugin-specific, so two kvroute filters do not mix).
    pub fn join(bus: &dyn SharedBus, ns: &str, now_ms: u64, timing: Timing) -> Option<Replicator> {
        let id = next_member_id(bus, ns)?;
        let queue = bus.register_queue(&queue_name(ns, id))?;
        let mut r = Replicator {
            ns: ns.to_string(),
            id,
            queue,
            peers: Vec::new(),
            timing,
            seen_cas: None,
            departed: Vec::new(),
            urgent: false,
        };
        r.heartbeat(bus, now_ms);
        Some(r)
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Refreshes our heartbeat and the list of live peers; call on every tick.
    pub fn heartbeat(&mut self, bus: &dyn SharedBus, now_ms: u64) {
        let key = members_key(&self.ns);
        for _ in 0..CAS_RETRIES {
            let (bytes, cas) = bus.get(&key);
            let mut members = decode_members(bytes.as_deref().unwrap_or(&[]));
            members.retain(|m| {
                m.id != self.id && now_ms.saturating_sub(m.heartbeat_ms) <= self.timing.forget_ms
            });
            members.push(Member {
                id: self.id,
                heartbeat_ms: now_ms,
                urgent: self.urgent,
            });
            if bus.set(&key, &encode_members(&members), cas) {
                break;
            }
        }
        self.seen_cas = None;
        self.refresh(bus, now_ms);
    }

    /// Announces whether this VM wants every message as soon as it is sent (it routes, or
    /// forwards the process's decisions to the relay) or can take them in batches (a thread
    /// that has not routed yet, Envoy's main-thread VM). Written at once when it changes, so
    /// that peers holding a batch for this VM send it with their next message.
    pub fn set_urgent(&mut self, bus: &dyn SharedBus, now_ms: u64, urgent: bool) {
        if self.urgent != urgent {
            self.urgent = urgent;
            self.heartbeat(bus, now_ms);
        }
    }

    /// Rebuilds the peer list when the membership record changed since we last looked, so
    /// a VM that joined a moment ago gets events before our next heartbeat.
    fn refresh(&mut self, bus: &dyn SharedBus, now_ms: u64) {
        let (bytes, cas) = bus.get(&members_key(&self.ns));
        if cas.is_some() && cas == self.seen_cas {
            return;
        }
        self.seen_cas = cas;
        let members = decode_members(bytes.as_deref().unwrap_or(&[]));
        let live: Vec<(u32, bool)> = members
            .iter()
            .filter(|m| {
                m.id != self.id && now_ms.saturating_sub(m.heartbeat_ms) <= self.timing.stale_ms
            })
            .map(|m| (m.id, m.urgent))
            .collect();
        let departed = &mut self.departed;
        self.peers.retain(|p| {
            let alive = live.iter().any(|(id, _)| *id == p.id);
            if !alive {
                departed.push(p.id);
            }
            alive
        });
        for (id, urgent) in live {
            if let Some(p) = self.peers.iter_mut().find(|p| p.id == id) {
                // A peer that became urgent first gets what waited for it, in order.
                if urgent && !p.urgent {
                    send_batch(bus, p);
                }
                p.urgent = urgent;
                continue;
            }
            if let Some(queue) = bus.resolve_queue(&queue_name(&self.ns, id)) {
                self.peers.push(Peer {
                    id,
                    queue,
                    urgent,
                    batch: Vec::new(),
                });
            }
        }
    }

    /// Whether a peer wanted messages at once when the membership record was last read.
    pub fn any_urgent(&self) -> bool {
        self.peers.iter().any(|p| p.urgent)
    }

    /// Sends the batches waiting for peers that are not urgent; call on every tick.
    pub fn flush(&mut self, bus: &dyn SharedBus) {
        for p in &mut self.peers {
            send_batch(bus, p);
        }
    }

    /// Peers declared dead (no heartbeat for `stale_ms`) since the last call: a VM that
    /// crashed or was torn down never sends the ends of its requests, so the survivors
    /// release what it had charged instead of waiting for the load TTL.
    pub fn take_departed(&mut self) -> Vec<u32> {
        core::mem::take(&mut self.departed)
    }

    /// Sends one message to every live peer: now to urgent peers, with the next `flush` (or
    /// once their batch is large) to the others. Returns how many peers accepted or will be
    /// sent it.
    pub fn broadcast(&mut self, bus: &dyn SharedBus, now_ms: u64, msg: &[u8]) -> usize {
        self.refresh(bus, now_ms);
        let Ok(len) = u32::try_from(msg.len()) else {
            return 0;
        };
        let mut n = 0;
        for p in &mut self.peers {
            if p.urgent {
                n += usize::from(bus.enqueue(p.queue, msg));
                continue;
            }
            if p.batch.is_empty() {
                p.batch.push(BATCH);
            }
            p.batch.extend_from_slice(&len.to_le_bytes());
            p.batch.extend_from_slice(msg);
            n += 1;
            if p.batch.len() >= BATCH_MAX {
                send_batch(bus, p);
            }
        }
        n
    }

    /// Puts an empty message in our own queue: Envoy then calls `on_queue_ready` on this
    /// VM after the current callback, which is how deferred work leaves the request path.
    pub fn wake_self(&self, bus: &dyn SharedBus) -> bool {
        bus.enqueue(self.queue, &[])
    }

    /// Everything waiting in our queue (at most `max` queue messages), batches split back
    /// into the messages they carry.
    pub fn drain(&self, bus: &dyn SharedBus, max: usize) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for _ in 0..max {
            match bus.dequeue(self.queue) {
                Some(m) if m.first() == Some(&BATCH) => {
                    unbatch(m.get(1..).unwrap_or(&[]), &mut out)
                }
                Some(m) => out.push(m),
                None => break,
            }
        }
        out
    }
}

/// Sends a peer's waiting batch (dropped if its queue refuses it, as a message would be).
fn send_batch(bus: &dyn SharedBus, p: &mut Peer) {
    if !p.batch.is_empty() {
        bus.enqueue(p.queue, &p.batch);
        p.batch.clear();
    }
}

/// The messages of a batch's body; a cut-off tail is dropped.
fn unbatch(mut b: &[u8], out: &mut Vec<Vec<u8>>) {
    while let Some((len, rest)) = b.split_first_chunk::<4>() {
        let len = u32::from_le_bytes(*len) as usize;
        let Some(msg) = rest.get(..len) else { return };
        out.push(msg.to_vec());
        b = rest.get(len..).unwrap_or(&[]);
    }
}

/// The replication group of one filter configuration: the plugin name plus a hash of the
/// configuration bytes. Worker ids are indices into the configured worker list, so VMs of
/// an old configuration still draining after a reload must never apply the events of the
/// new one (or the reverse); a different generation puts them in disjoint groups. The
/// filter's version is part of it too: an upgrade with an unchanged configuration must not
/// mix builds that may not read each other's messages.
pub fn namespace(plugin: &str, config: &[u8]) -> String {
    // FNV-1a: stable across processes, which is all a generation tag needs.
    let build = env!("CARGO_PKG_VERSION").as_bytes();
    let wire = [crate::events::WIRE_VERSION];
    let h = [build, &wire, config]
        .iter()
        .flat_map(|part| part.iter())
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    format!("{plugin}@{h:016x}")
}

fn members_key(ns: &str) -> String {
    format!("kvroute/{ns}/members")
}

fn queue_name(ns: &str, id: u32) -> String {
    format!("kvroute/{ns}/q{id}")
}

fn next_member_id(bus: &dyn SharedBus, ns: &str) -> Option<u32> {
    let key = format!("kvroute/{ns}/next_id");
    for _ in 0..CAS_RETRIES {
        let (bytes, cas) = bus.get(&key);
        let cur = bytes
            .and_then(|b| b.get(..4).and_then(|s| s.try_into().ok()))
            .map(u32::from_le_bytes)
            .unwrap_or(0);
        let next = cur.wrapping_add(1);
        if bus.set(&key, &next.to_le_bytes(), cas) {
            return Some(next);
        }
    }
    None
}

/// The top bit of a member's heartbeat (milliseconds never reach it) is its `urgent` flag.
const URGENT_BIT: u64 = 1 << 63;

fn encode_members(ms: &[Member]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ms.len() * 12);
    for m in ms {
        out.extend_from_slice(&m.id.to_le_bytes());
        let flag = if m.urgent { URGENT_BIT } else { 0 };
        out.extend_from_slice(&((m.heartbeat_ms & !URGENT_BIT) | flag).to_le_bytes());
    }
    out
}

fn decode_members(b: &[u8]) -> Vec<Member> {
    b.chunks_exact(12)
        .filter_map(|c| {
            let id = u32::from_le_bytes(c.get(..4)?.try_into().ok()?);
            let word = u64::from_le_bytes(c.get(4..12)?.try_into().ok()?);
            Some(Member {
                id,
                heartbeat_ms: word & !URGENT_BIT,
                urgent: word & URGENT_BIT != 0,
            })
        })
        .collect()
}

/// An in-memory `SharedBus` for tests: one per simulated Envoy process.
#[cfg(test)]
pub mod memory {
    use super::SharedBus;
    use std::cell::RefCell;
    use std::collections::{HashMap, VecDeque};

    #[derive(Default)]
    pub struct MemoryBus {
        data: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        queues: RefCell<Vec<(String, VecDeque<Vec<u8>>)>>,
    }

    impl SharedBus for MemoryBus {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            match self.data.borrow().get(key) {
                Some((v, cas)) => (Some(v.clone()), Some(*cas)),
                None => (None, None),
            }
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            let mut d = self.data.borrow_mut();
            let cur = d.get(key).map(|(_, c)| *c);
            if cas.is_some() && cas != cur {
                return false;
            }
            let next = cur.unwrap_or(0) + 1;
            d.insert(key.to_string(), (value.to_vec(), next));
            true
        }
        fn register_queue(&self, name: &str) -> Option<u32> {
            let mut q = self.queues.borrow_mut();
            q.push((name.to_string(), VecDeque::new()));
            u32::try_from(q.len() - 1).ok()
        }
        fn resolve_queue(&self, name: &str) -> Option<u32> {
            self.queues
                .borrow()
                .iter()
                .position(|(n, _)| n == name)
                .and_then(|i| u32::try_from(i).ok())
        }
        fn enqueue(&self, queue: u32, msg: &[u8]) -> bool {
            match self.queues.borrow_mut().get_mut(queue as usize) {
                Some((_, q)) => {
                    q.push_back(msg.to_vec());
                    true
                }
                None => false,
            }
        }
        fn dequeue(&self, queue: u32) -> Option<Vec<u8>> {
            self.queues
                .borrow_mut()
                .get_mut(queue as usize)
                .and_then(|(_, q)| q.pop_front())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::memory::MemoryBus;
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn vms_find_each_other_and_exchange_messages() {
        let bus = MemoryBus::default();
        let t = Timing::default();
        let mut a = Replicator::join(&bus, "ns", 0, t).unwrap();
        let mut b = Replicator::join(&bus, "ns", 10, t).unwrap();
        let mut c = Replicator::join(&bus, "ns", 20, t).unwrap();
        assert_ne!(a.id(), b.id());
        for r in [&mut a, &mut b, &mut c] {
            r.set_urgent(&bus, 100, true);
        }
        assert_eq!((a.peers(), b.peers(), c.peers()), (2, 2, 2));
        assert_eq!(a.broadcast(&bus, 100, b"hello"), 2);
        assert_eq!(b.drain(&bus, 10), vec![b"hello".to_vec()]);
        assert_eq!(c.drain(&bus, 10), vec![b"hello".to_vec()]);
        assert!(a.drain(&bus, 10).is_empty(), "no message to self");
    }

    #[test]
    fn a_member_that_just_joined_gets_the_next_message() {
        let bus = MemoryBus::default();
        let t = Timing::default();
        let mut a = Replicator::join(&bus, "ns", 0, t).unwrap();
        assert_eq!(a.broadcast(&bus, 1, b"early"), 0);
        let mut b = Replicator::join(&bus, "ns", 5, t).unwrap();
        b.set_urgent(&bus, 5, true);
        // No heartbeat of `a` in between: the changed record alone makes `a` see `b`.
        assert_eq!(a.broadcast(&bus, 6, b"now"), 1);
        assert_eq!(b.drain(&bus, 10), vec![b"now".to_vec()]);
    }

    #[test]
    fn peers_that_do_not_route_get_batches_in_order() {
        let bus = MemoryBus::default();
        let t = Timing::default();
        let mut a = Replicator::join(&bus, "ns", 0, t).unwrap();
        let mut b = Replicator::join(&bus, "ns", 0, t).unwrap();
        a.set_urgent(&bus, 1, true);
        // b does not route: a keeps its messages until a flush.
        assert_eq!(a.broadcast(&bus, 2, b"one"), 1);
        assert_eq!(a.broadcast(&bus, 2, b""), 1);
        assert_eq!(a.broadcast(&bus, 2, b"three"), 1);
        assert!(b.drain(&bus, 10).is_empty());
        a.flush(&bus);
        a.flush(&bus);
        assert_eq!(
            b.drain(&bus, 10),
            vec![b"one".to_vec(), vec![], b"three".to_vec()]
        );
        // b's messages reach the urgent a at once.
        assert_eq!(b.broadcast(&bus, 3, b"to a"), 1);
        assert_eq!(a.drain(&bus, 10), vec![b"to a".to_vec()]);
        // b starts routing: what waited for it comes before the next message.
        assert!(!a.any_urgent());
        assert_eq!(a.broadcast(&bus, 4, b"four"), 1);
        b.set_urgent(&bus, 5, true);
        assert_eq!(a.broadcast(&bus, 6, b"five"), 1);
        assert!(a.any_urgent());
        assert_eq!(b.drain(&bus, 10), vec![b"four".to_vec(), b"five".to_vec()]);
        // And back (a thread that stops holding the relay stream, say).
        b.set_urgent(&bus, 7, false);
        assert_eq!(a.broadcast(&bus, 8, b"six"), 1);
        assert!(b.drain(&bus, 10).is_empty());
        a.flush(&bus);
        assert_eq!(b.drain(&bus, 10), vec![b"six".to_vec()]);
    }

    #[test]
    fn batches_are_sent_when_large_and_cut_tails_are_dropped() {
        let bus = MemoryBus::default();
        let t = Timing::default();
        let mut a = Replicator::join(&bus, "ns", 0, t).unwrap();
        let b = Replicator::join(&bus, "ns", 0, t).unwrap();
        let big = vec![7u8; BATCH_MAX / 2];
        assert_eq!(a.broadcast(&bus, 1, &big), 1);
        assert!(b.drain(&bus, 10).is_empty());
        assert_eq!(a.broadcast(&bus, 1, &big), 1);
        assert_eq!(b.drain(&bus, 10), vec![big.clone(), big]);
        let mut out = Vec::new();
        unbatch(&[2, 0, 0, 0, b'o', b'k', 9, 0, 0, 0, 1, 2], &mut out);
        unbatch(&[1, 0], &mut out);
        assert_eq!(out, vec![b"ok".to_vec()]);
        assert_ne!(crate::events::WIRE_VERSION, BATCH);
    }

    #[test]
    fn the_urgent_flag_rides_in_the_heartbeat() {
        let ms = [
            Member {
                id: 3,
                heartbeat_ms: 1_700_000_000_000,
                urgent: true,
            },
            Member {
                id: 4,
                heartbeat_ms: 5,
                urgent: false,
            },
        ];
        assert_eq!(decode_members(&encode_members(&ms)), ms.to_vec());
    }

    #[test]
    fn silent_members_stop_receiving_and_are_forgotten() {
        let bus = MemoryBus::default();
        let t = Timing {
            stale_ms: 1_000,
            forget_ms: 5_000,
        };
        let mut a = Replicator::join(&bus, "ns", 0, t).unwrap();
        let canary = Replicator::join(&bus, "ns", 0, t).unwrap();
        a.heartbeat(&bus, 500);
        assert_eq!(a.peers(), 1);
        a.heartbeat(&bus, 2_000); // the canary never beat again
        assert_eq!(a.peers(), 0);
        assert_eq!(a.broadcast(&bus, 2_000, b"x"), 0);
        assert!(canary.drain(&bus, 10).is_empty());
        a.heartbeat(&bus, 10_000);
        let (bytes, _) = bus.get("kvroute/ns/members");
        assert_eq!(
            decode_members(&bytes.unwrap()).len(),
            1,
            "canary dropped from the record"
        );
    }

    #[test]
    fn namespaces_do_not_mix_and_garbage_records_are_tolerated() {
        let bus = MemoryBus::default();
        assert!(bus.set("kvroute/x/members", &[1, 2, 3], None));
        let mut a = Replicator::join(&bus, "x", 0, Timing::default()).unwrap();
        let mut b = Replicator::join(&bus, "y", 0, Timing::default()).unwrap();
        a.heartbeat(&bus, 1);
        b.heartbeat(&bus, 1);
        assert_eq!((a.peers(), b.peers()), (0, 0));
    }

    #[test]
    fn stale_peers_are_reported_departed_once() {
        let bus = MemoryBus::default();
        let t = Timing {
            stale_ms: 1_000,
            forget_ms: 5_000,
        };
        let mut a = Replicator::join(&bus, "ns", 0, t).unwrap();
        let b = Replicator::join(&bus, "ns", 0, t).unwrap();
        a.heartbeat(&bus, 900);
        assert!(a.take_departed().is_empty());
        a.heartbeat(&bus, 1_500);
        assert_eq!(a.take_departed(), vec![b.id()]);
        a.heartbeat(&bus, 2_000);
        assert!(a.take_departed().is_empty(), "reported once");
    }

    #[test]
    fn the_generation_follows_the_configuration_bytes() {
        let old = namespace("kv", br#"{"workers":[{"name":"x"},{"name":"y"}]}"#);
        let same = namespace("kv", br#"{"workers":[{"name":"x"},{"name":"y"}]}"#);
        let reordered = namespace("kv", br#"{"workers":[{"name":"y"},{"name":"x"}]}"#);
        assert_eq!(old, same);
        assert_ne!(old, reordered);
        assert!(old.starts_with("kv@"));
        assert_ne!(
            old,
            namespace("kv2", br#"{"workers":[{"name":"x"},{"name":"y"}]}"#)
        );
    }
}
