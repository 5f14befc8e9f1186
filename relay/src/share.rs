//! Sharing the gateways' routing decisions (issue 15): among the local Watch streams of a
//! group, and with `--nats`, with the other relays over NATS (see README "Sharing decisions").
//!
//! Nothing here waits on a stream or on NATS: streams get bounded queues (`STREAM_QUEUE`
//! events) and the NATS publisher a bounded queue (`nats::OUT_QUEUE`); what does not fit is
//! dropped and counted. The connection to NATS itself is in `nats`.

use crate::clock::now_ns;
use crate::counter::{add, render_labeled, Histogram};
use kvroute::precise::wire::PeerDecisions;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Events queued per local stream (peers' decisions and gone gateways).
pub const STREAM_QUEUE: usize = 8192;
/// Every relay lists its connected gateways (per group) this often.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// Default `--peer-timeout-ms`.
pub const PEER_TIMEOUT_MS: u64 = 3000;
/// Another relay's `gone` for a gateway is announced here only if no heartbeat lists the
/// gateway alive for this long after it: the relay that held the gateway's stream stops
/// listing it, so a forged `gone` for a gateway that is still connected somewhere is
/// contradicted by the next heartbeat (every `HEARTBEAT`) and ignored.
pub const GONE_CONFIRM: Duration = Duration::from_millis(2 * HEARTBEAT.as_millis() as u64);
/// Gateways of other relays tracked at once (forged heartbeats cannot grow the table).
pub const MAX_PEERS: usize = 1024;

/// The NATS payload (one message per group and flush, or per heartbeat), on subject
/// `<prefix>.<group_fingerprint(group)>`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ShareMsg {
    /// Random id of the publishing relay process (a relay ignores its own messages).
    #[prost(fixed64, tag = "1")]
    pub relay: u64,
    /// The gateways' group (`WatchRequest.group`), in full.
    #[prost(string, tag = "2")]
    pub group: String,
    /// Decisions of the relay's local gateways, at most one entry per gateway; its
    /// `sent_unix_ns` is when the relay received the first of them from the gateway.
    #[prost(message, repeated, tag = "3")]
    pub peers: Vec<PeerDecisions>,
    /// Heartbeat: every gateway of this group connected to the relay.
    #[prost(string, repeated, tag = "4")]
    pub alive: Vec<String>,
    /// Gateways of this group whose stream to the relay closed.
    #[prost(string, repeated, tag = "5")]
    pub gone: Vec<String>,
}

/// 16 hex digits naming a group in NATS subjects (xxh3-64 of the group string).
pub fn group_fingerprint(group: &str) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(group.as_bytes()))
}

pub fn subject(prefix: &str, group: &str) -> String {
    format!("{prefix}.{}", group_fingerprint(group))
}

/// What a local stream is sent besides KV deltas.
#[derive(Debug, Clone)]
pub enum PeerEvent {
    Decisions(Arc<PeerDecisions>),
    Gone(Arc<str>),
}

/// A local decision or gone gateway on its way to the NATS publisher.
pub(crate) enum Out {
    Decisions {
        group: String,
        gateway: String,
        decisions: Vec<Vec<u8>>,
        at_ns: u64,
    },
    Gone {
        group: String,
        gateway: String,
    },
}

struct Local {
    gateway: Arc<str>,
    group: String,
    tx: mpsc::Sender<PeerEvent>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    streams: HashMap<u64, Local>,
    /// Gateways of other relays: (group, gateway) → who speaks for it and when.
    peers: HashMap<(String, String), Peer>,
}

/// A gateway of another relay.
struct Peer {
    /// The relay that last listed it alive or sent its decisions: only that relay may
    /// announce it gone.
    relay: u64,
    last: Instant,
    /// That relay said it is gone; announced after `GONE_CONFIRM` unless heard alive.
    gone_at: Option<Instant>,
}

impl State {
    fn is_local(&self, group: &str, gateway: &str) -> bool {
        self.streams
            .values()
            .any(|l| l.group == group && &*l.gateway == gateway)
    }
}

#[derive(Default, Debug)]
pub struct ShareStats {
    /// Decisions received from local gateways.
    pub local: AtomicU64,
    /// Decisions published to NATS.
    pub published: AtomicU64,
    /// NATS messages published (batches and heartbeats).
    pub messages_published: AtomicU64,
    /// Decisions received from other relays.
    pub from_nats: AtomicU64,
    /// Decisions sent to local streams (one per decision and stream).
    pub forwarded: AtomicU64,
    /// Decisions dropped: a stream's queue was full.
    pub dropped_stream: AtomicU64,
    /// Decisions dropped: the NATS queue was full.
    pub dropped_queue: AtomicU64,
    /// Decisions dropped: NATS disconnected (or the publish failed).
    pub dropped_nats: AtomicU64,
    /// Gone events dropped (a stream's queue was full).
    pub dropped_gone: AtomicU64,
    pub nats_connected: AtomicBool,
    pub nats_errors: AtomicU64,
    /// NATS messages that did not decode.
    pub bad_messages: AtomicU64,
    /// Claims from other relays refused: a gone from a relay that does not speak for the
    /// gateway, a gone for a gateway connected here, a gone contradicted by a heartbeat, a
    /// gateway beyond `MAX_PEERS`.
    pub refused_gone_other_relay: AtomicU64,
    pub refused_gone_local: AtomicU64,
    pub refused_gone_alive: AtomicU64,
    pub refused_peers_full: AtomicU64,
    /// Gone announcements to local streams, by cause.
    pub gone_local: AtomicU64,
    pub gone_remote: AtomicU64,
    pub gone_timeout: AtomicU64,
    /// sent_unix_ns → the Update holding it handed to the stream.
    pub delay: Histogram,
}

pub struct Share {
    /// Random per relay process; in every NATS message it publishes.
    pub relay_id: u64,
    state: Mutex<State>,
    pub stats: ShareStats,
    pub(crate) out: OnceLock<mpsc::Sender<Out>>,
    pub(crate) peer_timeout_ms: AtomicU64,
    /// `GONE_CONFIRM` (shorter in tests).
    gone_confirm_ms: AtomicU64,
    /// Set once the NATS connection was lost (so the next connect logs "recovered").
    pub(crate) lost: AtomicBool,
}

impl Share {
    pub fn new(relay_id: u64) -> Share {
        Share {
            relay_id,
            state: Mutex::default(),
            stats: ShareStats::default(),
            out: OnceLock::new(),
            peer_timeout_ms: AtomicU64::new(PEER_TIMEOUT_MS),
            gone_confirm_ms: AtomicU64::new(GONE_CONFIRM.as_millis() as u64),
            lost: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A local stream opened: returns its id and the queue of its peer events.
    pub fn register(&self, gateway: &str, group: &str) -> (u64, mpsc::Receiver<PeerEvent>) {
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        let mut st = self.lock();
        st.next_id += 1;
        let id = st.next_id;
        st.streams.insert(
            id,
            Local {
                gateway: gateway.into(),
                group: group.to_owned(),
                tx,
            },
        );
        (id, rx)
    }

    /// A local stream closed: its gateway is gone for the other local streams of its group
    /// and (published at once) for the other relays.
    pub fn unregister(&self, id: u64) {
        let mut st = self.lock();
        let Some(l) = st.streams.remove(&id) else {
            return;
        };
        // Another stream of the same gateway (a reconnect racing the old stream's end)?
        if st
            .streams
            .values()
            .any(|o| o.gateway == l.gateway && o.group == l.group)
        {
            return;
        }
        add(&self.stats.gone_local, 1);
        self.fanout(&st, &l.group, None, &PeerEvent::Gone(l.gateway.clone()));
        drop(st);
        if let Some(out) = self.out.get() {
            let _ = out.try_send(Out::Gone {
                group: l.group,
                gateway: l.gateway.to_string(),
            });
        }
    }

    /// Sends `ev` to every local stream of `group` but `except`; never waits.
    fn fanout(&self, st: &State, group: &str, except: Option<u64>, ev: &PeerEvent) {
        for (id, l) in &st.streams {
            if Some(*id) == except || l.group != group {
                continue;
            }
            if l.tx.try_send(ev.clone()).is_err() {
                match ev {
                    PeerEvent::Decisions(p) => {
                        add(&self.stats.dropped_stream, p.decisions.len() as u64)
                    }
                    PeerEvent::Gone(_) => add(&self.stats.dropped_gone, 1),
                }
            }
        }
    }

    /// Decisions from local stream `id`: to the other local streams of its group and to NATS.
    pub fn local_decisions(&self, id: u64, mut decisions: Vec<Vec<u8>>) {
        if decisions.is_empty() {
            return;
        }
        let n = decisions.len() as u64;
        add(&self.stats.local, n);
        let at_ns = now_ns();
        let st = self.lock();
        let Some(l) = st.streams.get(&id) else {
            return;
        };
        let (gateway, group) = (l.gateway.to_string(), l.group.clone());
        let local_peers = st.streams.iter().any(|(o, x)| *o != id && x.group == group);
        let out = self.out.get();
        if local_peers {
            let ds = if out.is_some() {
                decisions.clone()
            } else {
                std::mem::take(&mut decisions)
            };
            let p = Arc::new(PeerDecisions {
                gateway: gateway.clone(),
                decisions: ds,
                sent_unix_ns: at_ns,
            });
            self.fanout(&st, &group, Some(id), &PeerEvent::Decisions(p));
        }
        drop(st);
        let Some(out) = out else {
            return;
        };
        if !self.stats.nats_connected.load(Relaxed) {
            add(&self.stats.dropped_nats, n);
            return;
        }
        let msg = Out::Decisions {
            group,
            gateway,
            decisions,
            at_ns,
        };
        if out.try_send(msg).is_err() {
            add(&self.stats.dropped_queue, n);
        }
    }

    /// A message from another relay. It speaks for its own gateways only: another relay's
    /// gateway cannot be announced gone by it, nor can a gateway connected here.
    pub fn on_remote(&self, msg: ShareMsg) {
        if msg.relay == self.relay_id {
            return;
        }
        let mut st = self.lock();
        if !st.streams.values().any(|l| l.group == msg.group) {
            return;
        }
        let now = Instant::now();
        let group = msg.group;
        for gw in msg.alive {
            self.heard(&mut st, &group, gw, msg.relay, now);
        }
        for p in msg.peers {
            add(&self.stats.from_nats, p.decisions.len() as u64);
            self.heard(&mut st, &group, p.gateway.clone(), msg.relay, now);
            self.fanout(&st, &group, None, &PeerEvent::Decisions(Arc::new(p)));
        }
        for gw in msg.gone {
            if st.is_local(&group, &gw) {
                add(&self.stats.refused_gone_local, 1);
                continue;
            }
            match st.peers.get_mut(&(group.clone(), gw)) {
                Some(p) if p.relay != msg.relay => add(&self.stats.refused_gone_other_relay, 1),
                Some(p) => {
                    p.gone_at.get_or_insert(now);
                }
                // Never heard of here: nothing of it to release.
                None => {}
            }
        }
    }

    /// `relay` lists `gw` alive (a heartbeat or its decisions).
    fn heard(&self, st: &mut State, group: &str, gw: String, relay: u64, now: Instant) {
        let key = (group.to_owned(), gw);
        if let Some(p) = st.peers.get_mut(&key) {
            if p.gone_at.take().is_some() {
                // Announced gone, yet alive: the gone was forged (or the gateway is back
                // already); either way its requests are still running.
                add(&self.stats.refused_gone_alive, 1);
            }
            p.relay = relay;
            p.last = now;
            return;
        }
        if st.peers.len() >= MAX_PEERS {
            add(&self.stats.refused_peers_full, 1);
            return;
        }
        st.peers.insert(
            key,
            Peer {
                relay,
                last: now,
                gone_at: None,
            },
        );
    }

    /// Announces peers silent for longer than the peer timeout as gone (once each), and
    /// those their relay said are gone once no heartbeat contradicted it.
    pub fn reap(&self) {
        let timeout = Duration::from_millis(self.peer_timeout_ms.load(Relaxed));
        let confirm = Duration::from_millis(self.gone_confirm_ms.load(Relaxed));
        let mut guard = self.lock();
        let st = &mut *guard;
        let now = Instant::now();
        let mut expired = Vec::new();
        let streams = &st.streams;
        st.peers.retain(|(group, gw), p| {
            if !streams.values().any(|l| &l.group == group) {
                return false;
            }
            if p.gone_at.is_some_and(|t| now.duration_since(t) >= confirm) {
                expired.push((group.clone(), gw.clone(), true));
                return false;
            }
            if now.duration_since(p.last) > timeout {
                expired.push((group.clone(), gw.clone(), false));
                return false;
            }
            true
        });
        for (group, gw, said) in expired {
            add(
                if said {
                    &self.stats.gone_remote
                } else {
                    &self.stats.gone_timeout
                },
                1,
            );
            self.fanout(st, &group, None, &PeerEvent::Gone(gw.into()));
        }
    }

    /// Local gateways per group (for heartbeats).
    pub(crate) fn local_groups(&self) -> Vec<(String, Vec<String>)> {
        let st = self.lock();
        let mut m: HashMap<&str, Vec<String>> = HashMap::new();
        for l in st.streams.values() {
            let v = m.entry(l.group.as_str()).or_default();
            if !v.iter().any(|g| **g == *l.gateway) {
                v.push(l.gateway.to_string());
            }
        }
        m.into_iter().map(|(g, v)| (g.to_owned(), v)).collect()
    }

    pub fn peers_known(&self) -> usize {
        self.lock().peers.len()
    }

    pub fn nats_enabled(&self) -> bool {
        self.out.get().is_some()
    }

    /// Prometheus text of the sharing metrics. One table row or call per metric: `duplicates`
    /// reports them as alike, which they are by design (each says what its metric is; the
    /// logic is in the loops and `render_labeled`).
    pub fn render(&self, o: &mut String) {
        let s = &self.stats;
        let counters: [(&str, &str, u64); 6] = [
            (
                "kvroute_relay_decisions_local_total",
                "Decisions received from local gateways",
                s.local.load(Relaxed),
            ),
            (
                "kvroute_relay_decisions_published_total",
                "Decisions published to NATS",
                s.published.load(Relaxed),
            ),
            (
                "kvroute_relay_nats_messages_published_total",
                "NATS messages published (decision batches, gone, heartbeats)",
                s.messages_published.load(Relaxed),
            ),
            (
                "kvroute_relay_decisions_nats_received_total",
                "Decisions received from other relays over NATS",
                s.from_nats.load(Relaxed),
            ),
            (
                "kvroute_relay_decisions_forwarded_total",
                "Decisions sent to local streams (one per decision and stream)",
                s.forwarded.load(Relaxed),
            ),
            (
                "kvroute_relay_nats_errors_total",
                "NATS disconnects, client/server errors, failed publishes, undecodable messages",
                s.nats_errors.load(Relaxed) + s.bad_messages.load(Relaxed),
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        render_labeled(
            o,
            "kvroute_relay_decisions_dropped_total",
            "Decisions dropped (reason: stream_queue full, nats_queue full, nats_down) and gone events dropped (gone_event)",
            "reason",
            &[
                ("stream_queue", &s.dropped_stream),
                ("nats_queue", &s.dropped_queue),
                ("nats_down", &s.dropped_nats),
                ("gone_event", &s.dropped_gone),
            ],
        );
        render_labeled(
            o,
            "kvroute_relay_peer_claims_refused_total",
            &format!("Claims of other relays refused (reason: gone from a relay that does not speak for the gateway, gone for a gateway connected here, gone contradicted by a heartbeat, more than {MAX_PEERS} peers)"),
            "reason",
            &[
                ("gone_other_relay", &s.refused_gone_other_relay),
                ("gone_local_gateway", &s.refused_gone_local),
                ("gone_still_alive", &s.refused_gone_alive),
                ("peers_full", &s.refused_peers_full),
            ],
        );
        render_labeled(
            o,
            "kvroute_relay_gone_announcements_total",
            "Gateways announced gone to local streams (cause: local stream closed, remote relay said so, peer timeout)",
            "cause",
            &[
                ("local", &s.gone_local),
                ("remote", &s.gone_remote),
                ("timeout", &s.gone_timeout),
            ],
        );
        let gauges = [
            (
                "kvroute_relay_nats_connected",
                "1 while connected to NATS (0 also without --nats)",
                u64::from(s.nats_connected.load(Relaxed)),
            ),
            (
                "kvroute_relay_peers_known",
                "Gateways of other relays heard from within the peer timeout",
                self.peers_known() as u64,
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        s.delay.render(
            o,
            "kvroute_relay_decision_propagation_ms",
            "Delay from a decision's sent_unix_ns to its Update handed to a local stream, ms",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn subjects_and_payload() {
        assert_eq!(group_fingerprint("g").len(), 16);
        assert_ne!(group_fingerprint("a"), group_fingerprint("b"));
        assert!(subject("kvroute.decisions", "x").starts_with("kvroute.decisions."));
        let m = ShareMsg {
            relay: 7,
            group: "g".into(),
            peers: vec![PeerDecisions {
                gateway: "p".into(),
                decisions: vec![vec![1, 2]],
                sent_unix_ns: 3,
            }],
            alive: vec!["a".into()],
            gone: vec!["z".into()],
        };
        let b = m.encode_to_vec();
        assert_eq!(ShareMsg::decode(b.as_slice()).ok(), Some(m));
    }

    /// A forged `gone` naming real gateways once made gateways drop each other's load: only
    /// the relay that speaks for a gateway may say it is gone, never for a gateway connected
    /// here, and a heartbeat listing it alive cancels it.
    #[tokio::test]
    async fn a_gone_is_believed_only_from_the_gateways_relay_and_if_not_contradicted() {
        let s = Share::new(1);
        let (_a, mut ra) = s.register("a", "g");
        let hb = |relay, gw: &str| ShareMsg {
            relay,
            group: "g".into(),
            alive: vec![gw.into()],
            ..ShareMsg::default()
        };
        let gone = |relay, gw: &str| ShareMsg {
            relay,
            group: "g".into(),
            gone: vec![gw.into()],
            ..ShareMsg::default()
        };
        s.on_remote(hb(2, "r"));
        s.gone_confirm_ms.store(20, Relaxed);
        // Another relay, or any relay for the gateway connected here: refused at once.
        s.on_remote(gone(3, "r"));
        s.on_remote(gone(2, "a"));
        // r's own relay (or someone using its id): pending, then contradicted by a heartbeat.
        s.on_remote(gone(2, "r"));
        s.on_remote(hb(2, "r"));
        std::thread::sleep(Duration::from_millis(30));
        s.reap();
        assert!(ra.try_recv().is_err(), "no gone reached the local stream");
        assert_eq!(s.peers_known(), 1);
        let st = &s.stats;
        assert_eq!(st.refused_gone_other_relay.load(Relaxed), 1);
        assert_eq!(st.refused_gone_local.load(Relaxed), 1);
        assert_eq!(st.refused_gone_alive.load(Relaxed), 1);
        // A real gone: its relay says so and lists it no more.
        s.on_remote(gone(2, "r"));
        s.reap();
        assert!(ra.try_recv().is_err(), "not before the confirmation window");
        std::thread::sleep(Duration::from_millis(30));
        s.reap();
        assert!(matches!(ra.try_recv(), Ok(PeerEvent::Gone(g)) if &*g == "r"));
        assert_eq!(st.gone_remote.load(Relaxed), 1);
        let mut m = String::new();
        s.render(&mut m);
        assert!(
            m.contains("kvroute_relay_peer_claims_refused_total{reason=\"gone_still_alive\"} 1"),
            "{m}"
        );
        // Forged heartbeats cannot grow the table without bound.
        for i in 0..MAX_PEERS + 5 {
            s.on_remote(hb(9, &format!("x{i}")));
        }
        assert_eq!(s.peers_known(), MAX_PEERS);
        assert_eq!(st.refused_peers_full.load(Relaxed), 5);
    }

    #[tokio::test]
    async fn local_sharing_and_gone() {
        let s = Share::new(1);
        let (a, _ra) = s.register("a", "g");
        let (_b, mut rb) = s.register("b", "g");
        let (_c, mut rc) = s.register("c", "other");
        s.local_decisions(a, vec![vec![1], vec![2]]);
        match rb.try_recv() {
            Ok(PeerEvent::Decisions(p)) => {
                assert_eq!(p.gateway, "a");
                assert_eq!(p.decisions, vec![vec![1], vec![2]]);
            }
            e => panic!("{e:?}"),
        }
        assert!(rc.try_recv().is_err());
        s.unregister(a);
        assert!(matches!(rb.try_recv(), Ok(PeerEvent::Gone(g)) if &*g == "a"));
        assert!(rc.try_recv().is_err());
        // Remote peers: known only for groups with local streams; gone once after timeout.
        s.on_remote(ShareMsg {
            relay: 2,
            group: "g".into(),
            alive: vec!["r".into()],
            ..ShareMsg::default()
        });
        s.on_remote(ShareMsg {
            relay: 2,
            group: "nobody".into(),
            alive: vec!["q".into()],
            ..ShareMsg::default()
        });
        s.on_remote(ShareMsg {
            relay: 1,
            group: "g".into(),
            alive: vec!["mine".into()],
            ..ShareMsg::default()
        });
        assert_eq!(s.peers_known(), 1);
        s.peer_timeout_ms.store(0, Relaxed);
        std::thread::sleep(Duration::from_millis(2));
        s.reap();
        s.reap();
        assert!(matches!(rb.try_recv(), Ok(PeerEvent::Gone(g)) if &*g == "r"));
        assert!(rb.try_recv().is_err());
        assert_eq!(s.peers_known(), 0);
    }
}
