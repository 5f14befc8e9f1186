//! Decision sharing between relays over a real nats-server (issue 15): two in-process relays
//! on one nats-server, a bidirectional tonic client per relay.
//!
//! nats-server: see `common::nats`. Without one the NATS tests print a notice and pass, unless
//! `KVROUTE_REQUIRE_NATS=1`, which makes them fail.

mod common;

use common::nats::{nats_binary, NatsServer};
use common::{hand_fed, pct, start_relay, watch_bidi};
use kvroute::precise::wire::{Phase, Update, WatchRequest};
use kvroute_relay::clock::now_ns;
use kvroute_relay::hub::{Change, Hub};
use kvroute_relay::index::Delta;
use kvroute_relay::nats::{start_nats, NatsOpts};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

const BS: u32 = 16;

/// A relay in this process: its hub (one engine "w", fed by hand) and gRPC address.
async fn relay(nats: Option<&str>, peer_timeout_ms: u64) -> (Arc<Hub>, String) {
    let hub = Hub::new(BS, 1024);
    hub.add_engine(&hand_fed("w"));
    if let Some(url) = nats {
        start_nats(
            hub.share.clone(),
            NatsOpts {
                url: url.to_owned(),
                prefix: "test.decisions".into(),
                peer_timeout: Duration::from_millis(peer_timeout_ms),
            },
        )
        .await
        .unwrap();
    }
    let addr = start_relay(hub.clone()).await;
    (hub, addr)
}

/// A relay: its hub and gRPC address.
type Relay = (Arc<Hub>, String);

/// nats-server and relays A and B on it (peer timeout `peer_timeout_ms`); None: no
/// nats-server, the test is skipped.
async fn two_relays(test: &str, peer_timeout_ms: u64) -> Option<(NatsServer, Relay, Relay)> {
    let nats = NatsServer::start(nats_binary(test)?).await;
    let a = relay(Some(&nats.url()), peer_timeout_ms).await;
    let b = relay(Some(&nats.url()), peer_timeout_ms).await;
    Some((nats, a, b))
}

/// A KV delta on the relay's engine (as if the engine had stored `hash`).
fn kv(hub: &Hub, hash: u64) {
    hub.lock().publish(vec![Change {
        worker: 0,
        delta: Delta {
            stored: vec![hash],
            ..Delta::default()
        },
        engine_ns: 0,
    }]);
}

struct Client {
    /// Dropping it half-closes the request stream.
    tx: Option<mpsc::Sender<WatchRequest>>,
    rx: tonic::Streaming<Update>,
    seq: u64,
}

async fn watch_req(addr: &str, first: WatchRequest) -> Result<Client, tonic::Status> {
    let (tx, rx) = watch_bidi(addr, first, 1024).await?;
    Ok(Client {
        tx: Some(tx),
        rx,
        seq: 0,
    })
}

async fn watch(addr: &str, gateway: &str, group: &str) -> Client {
    let mut c = watch_req(
        addr,
        WatchRequest {
            gateway: gateway.into(),
            block_size: BS,
            group: group.into(),
            ..WatchRequest::default()
        },
    )
    .await
    .unwrap();
    // Snapshot (one empty engine): SNAPSHOT_END first.
    let u = c.next(Duration::from_secs(5)).await.expect("snapshot");
    assert_eq!(u.phase, Phase::SnapshotEnd as i32);
    c
}

impl Client {
    async fn send(&self, decisions: Vec<Vec<u8>>) {
        let tx = self.tx.as_ref().expect("half-closed");
        tx.send(WatchRequest {
            decisions,
            ..WatchRequest::default()
        })
        .await
        .unwrap();
    }

    /// Next Update within `wait` (None on timeout); checks seq +1 and the stream stays up.
    async fn next(&mut self, wait: Duration) -> Option<Update> {
        let u = tokio::time::timeout(wait, self.rx.message()).await.ok()?;
        let u = u.expect("stream broke").expect("stream ended");
        self.seq += 1;
        assert_eq!(u.seq, self.seq, "seq +1 per Update");
        Some(u)
    }

    /// Waits for an Update with peer decisions within `wait`.
    async fn peers(&mut self, wait: Duration) -> Option<Update> {
        self.until(wait, |u| !u.peers.is_empty()).await
    }

    /// Waits for an Update with a KV delta within `wait`.
    async fn kv_delta(&mut self, wait: Duration) -> Option<Update> {
        self.until(wait, |u| !u.workers.is_empty()).await
    }

    /// Waits for an Update announcing `gateway` gone within `wait`.
    async fn gone(&mut self, wait: Duration, gateway: &str) -> Option<Update> {
        self.until(wait, |u| u.gone.iter().any(|x| x == gateway))
            .await
    }

    /// Waits for an Update satisfying `f` (others are skipped) within `wait`.
    async fn until(
        &mut self,
        wait: Duration,
        mut f: impl FnMut(&Update) -> bool,
    ) -> Option<Update> {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let u = self.next(left).await?;
            if f(&u) {
                return Some(u);
            }
        }
    }
}

/// Sends decision `d` from `from` until `to` gets peer decisions (a try every 200 ms, failing
/// with `what` after `limit`); returns that Update.
async fn share_until_seen(
    from: &Client,
    to: &mut Client,
    d: &[u8],
    limit: Duration,
    what: &str,
) -> Update {
    let t0 = Instant::now();
    loop {
        from.send(vec![d.to_vec()]).await;
        if let Some(u) = to.peers(Duration::from_millis(200)).await {
            return u;
        }
        assert!(t0.elapsed() < limit, "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_reach_the_other_relay() {
    let Some((_nats, (_ha, a), (hb, b))) =
        two_relays("decisions_reach_the_other_relay", 3000).await
    else {
        return;
    };
    let ca = watch(&a, "gw-a", "g").await;
    let mut ca2 = watch(&a, "gw-a2", "g").await;
    let mut cb = watch(&b, "gw-b", "g").await;
    // Let both relays connect (and subscribe) before measuring.
    let t0 = Instant::now();
    while !hb
        .share
        .stats
        .nats_connected
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "relay B never connected"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    ca.send(vec![b"warm".to_vec()]).await;
    cb.peers(Duration::from_secs(5))
        .await
        .expect("first decision never reached relay B");
    ca2.peers(Duration::from_secs(5))
        .await
        .expect("local stream of the same group got nothing");

    const N: usize = 200;
    let mut delays = Vec::new();
    let mut got = 0usize;
    let mut local = 0usize;
    for i in 0..N {
        let d = format!("decision-{i}").into_bytes();
        ca.send(vec![d.clone()]).await;
        let u = cb
            .peers(Duration::from_secs(2))
            .await
            .unwrap_or_else(|| panic!("decision {i} did not reach relay B"));
        let now = now_ns();
        for p in &u.peers {
            assert_eq!(p.gateway, "gw-a");
            got += p.decisions.len();
            assert!(p.decisions.contains(&d));
            delays.push(now.saturating_sub(p.sent_unix_ns) as f64 / 1e6);
        }
        while let Some(u) = ca2.next(Duration::from_millis(0)).await {
            local += u.peers.iter().map(|p| p.decisions.len()).sum::<usize>();
        }
    }
    while let Some(u) = ca2.next(Duration::from_millis(200)).await {
        local += u.peers.iter().map(|p| p.decisions.len()).sum::<usize>();
    }
    assert_eq!(got, N);
    assert_eq!(
        local, N,
        "the other local stream of the group gets every decision"
    );
    let (p50, p99, max) = (
        pct(&mut delays, 0.5),
        pct(&mut delays, 0.99),
        pct(&mut delays, 1.0),
    );
    println!(
        "relay A -> NATS -> relay B -> client: {N} decisions, propagation p50 {p50:.3} ms, p99 {p99:.3} ms, max {max:.3} ms"
    );
    // Speed is the benchmark's to report (printed above); what this asserts is behaviour:
    // a decision goes out when it is made, not with the next heartbeat 500 ms later. (A
    // 50 ms bound here failed once in ten runs at load average 13.)
    assert!(
        p50 < 400.0,
        "p50 {p50} ms: decisions wait for something periodic"
    );
    // Batching: a burst goes out in few messages and arrives whole.
    let burst: Vec<Vec<u8>> = (0..500).map(|i| vec![i as u8; 100]).collect();
    for chunk in burst.chunks(50) {
        ca.send(chunk.to_vec()).await;
    }
    let mut n = 0;
    while n < 500 {
        let u = cb
            .peers(Duration::from_secs(2))
            .await
            .expect("burst incomplete");
        n += u.peers.iter().map(|p| p.decisions.len()).sum::<usize>();
    }
    assert_eq!(n, 500);
    // gw-a2 sent nothing: relay B knows it from relay A's heartbeats (every 500 ms).
    let t0 = Instant::now();
    while hb.share.peers_known() < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "heartbeat never listed gw-a2"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = kvroute_relay::metrics::render_metrics(&hb);
    assert!(m.contains("kvroute_relay_decision_propagation_ms_count"));
    assert!(m.contains("kvroute_relay_nats_connected 1"));
    assert!(m.contains("kvroute_relay_peers_known 2"), "{m}");
    let h = kvroute_relay::metrics::render_health(&hb);
    assert!(
        h.contains("\"nats\":\"connected\",\"peers_known\":2"),
        "{h}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_stream_is_gone_promptly() {
    let Some((_nats, (ha, a), (_hb, b))) = two_relays("closed_stream_is_gone_promptly", 3000).await
    else {
        return;
    };
    let ca = watch(&a, "gw-a", "g").await;
    let mut ca2 = watch(&a, "gw-a2", "g").await;
    let mut cb = watch(&b, "gw-b", "g").await;
    share_until_seen(&ca, &mut cb, b"x", Duration::from_secs(5), "no sharing").await;
    let closed = Instant::now();
    drop(ca);
    let u = cb
        .gone(Duration::from_secs(3), "gw-a")
        .await
        .expect("relay B's client never got gone for gw-a");
    let remote = closed.elapsed();
    assert_eq!(u.gone, vec!["gw-a".to_owned()]);
    ca2.gone(Duration::from_secs(2), "gw-a")
        .await
        .expect("the other local stream never got gone for gw-a");
    println!(
        "stream closed -> gone at the other relay's client: {:.1} ms",
        remote.as_secs_f64() * 1e3
    );
    // A remote gone waits out GONE_CONFIRM (a heartbeat could still contradict it).
    assert!(remote >= kvroute_relay::share::GONE_CONFIRM);
    assert!(remote < kvroute_relay::share::GONE_CONFIRM + Duration::from_millis(1000));
    // Once only: no second gone for gw-a (heartbeats go on, 500 ms apart).
    assert!(cb.gone(Duration::from_millis(1200), "gw-a").await.is_none());
    let m = kvroute_relay::metrics::render_metrics(&ha);
    assert!(m.contains("kvroute_relay_gone_announcements_total{cause=\"local\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_outage_then_recovery() {
    let Some((mut nats, (_ha, a), (hb, b))) = two_relays("nats_outage_then_recovery", 1000).await
    else {
        return;
    };
    let ca = watch(&a, "gw-a", "g").await;
    let mut cb = watch(&b, "gw-b", "g").await;
    share_until_seen(&ca, &mut cb, b"x", Duration::from_secs(5), "no sharing").await;
    nats.kill();
    let killed = Instant::now();
    // KV deltas still flow; the streams stay up; the peer goes gone after the timeout.
    kv(&hb, 42);
    let u = cb
        .kv_delta(Duration::from_secs(2))
        .await
        .expect("KV delta during the outage");
    assert_eq!(u.workers[0].stored, vec![42]);
    ca.send(vec![b"lost".to_vec()]).await;
    let u = cb
        .gone(Duration::from_secs(4), "gw-a")
        .await
        .expect("peer never went gone during the outage");
    let after = killed.elapsed();
    println!(
        "NATS killed -> peer gone after {:.0} ms (peer timeout 1000 ms)",
        after.as_secs_f64() * 1e3
    );
    assert!(after >= Duration::from_millis(900), "{after:?}");
    assert!(u.peers.is_empty());
    kv(&hb, 43);
    cb.kv_delta(Duration::from_secs(2))
        .await
        .expect("KV delta after gone");
    let m = kvroute_relay::metrics::render_metrics(&hb);
    assert!(m.contains("kvroute_relay_nats_connected 0"), "{m}");
    // nats-server back on the same port: the clients reconnect and sharing resumes.
    nats.restart().await;
    let back = Instant::now();
    let u = share_until_seen(
        &ca,
        &mut cb,
        b"again",
        Duration::from_secs(10),
        "sharing did not resume",
    )
    .await;
    assert_eq!(u.peers[0].gateway, "gw-a");
    println!(
        "nats-server restarted -> sharing resumed after {:.0} ms",
        back.elapsed().as_secs_f64() * 1e3
    );
    // Streams never broke (Client::next panics on a broken stream) and seq stayed +1.
    kv(&hb, 44);
    cb.kv_delta(Duration::from_secs(2))
        .await
        .expect("KV delta after recovery");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_do_not_mix() {
    let Some((_nats, (_ha, a), (_hb, b))) = two_relays("groups_do_not_mix", 3000).await else {
        return;
    };
    let c1 = watch(&a, "gw-a1", "g1").await;
    let c2 = watch(&a, "gw-a2", "g2").await;
    let mut a3 = watch(&a, "gw-a3", "g2").await;
    let mut b1 = watch(&b, "gw-b1", "g1").await;
    let mut b2 = watch(&b, "gw-b2", "g2").await;
    share_until_seen(&c1, &mut b1, b"one", Duration::from_secs(5), "no sharing").await;
    c2.send(vec![b"two".to_vec()]).await;
    let u = b2.peers(Duration::from_secs(2)).await.expect("g2 decision");
    assert_eq!(u.peers[0].gateway, "gw-a2");
    assert!(u.peers.iter().all(|p| p.decisions == vec![b"two".to_vec()]));
    let u = a3
        .peers(Duration::from_secs(2))
        .await
        .expect("g2 decision, local");
    assert!(u.peers.iter().all(|p| p.gateway == "gw-a2"));
    for _ in 0..20 {
        c1.send(vec![b"one".to_vec()]).await;
    }
    // g1 traffic never shows up in g2 streams, nor g2 in g1.
    for c in [&mut b2, &mut a3] {
        assert!(c.peers(Duration::from_millis(300)).await.is_none());
    }
    let mut n = 0;
    while let Some(u) = b1.next(Duration::from_millis(300)).await {
        for p in &u.peers {
            assert_eq!(p.gateway, "gw-a1");
            n += p.decisions.len();
        }
    }
    assert_eq!(n, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_closing_client_keeps_receiving() {
    let Some((_nats, (_ha, a), (hb, b))) =
        two_relays("half_closing_client_keeps_receiving", 3000).await
    else {
        return;
    };
    let ca = watch(&a, "gw-a", "g").await;
    let mut cb = watch(&b, "old-filter", "g").await;
    cb.tx = None; // half-close, as older filters do after their first message
    kv(&hb, 7);
    let u = cb
        .kv_delta(Duration::from_secs(2))
        .await
        .expect("KV delta after half-close");
    assert_eq!(u.workers[0].stored, vec![7]);
    share_until_seen(
        &ca,
        &mut cb,
        b"x",
        Duration::from_secs(5),
        "peers after half-close",
    )
    .await;
    // ... and gone announcements.
    drop(ca);
    assert!(cb.gone(Duration::from_secs(2), "gw-a").await.is_some());
}

/// No NATS: two streams of one relay share; validation of the first message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_sharing_without_nats() {
    let (hub, a) = relay(None, 3000).await;
    let c1 = watch(&a, "gw-1", "g").await;
    let mut c2 = watch(&a, "gw-2", "g").await;
    let mut c3 = watch(&a, "gw-3", "other").await;
    c1.send(vec![b"d1".to_vec(), b"d2".to_vec()]).await;
    let u = c2
        .peers(Duration::from_secs(2))
        .await
        .expect("local peer decisions");
    assert_eq!(u.peers[0].gateway, "gw-1");
    assert_eq!(u.peers[0].decisions, vec![b"d1".to_vec(), b"d2".to_vec()]);
    assert_eq!(u.phase, Phase::Live as i32);
    kv(&hub, 9);
    c2.kv_delta(Duration::from_secs(2)).await.expect("KV delta");
    drop(c1);
    c2.gone(Duration::from_secs(2), "gw-1")
        .await
        .expect("gone for a closed local stream");
    assert!(c3
        .until(Duration::from_millis(300), |u| !u.peers.is_empty()
            || !u.gone.is_empty())
        .await
        .is_none());

    let bad = |gateway: &str, block_size: u32| WatchRequest {
        gateway: gateway.into(),
        block_size,
        ..WatchRequest::default()
    };
    let e = watch_req(&a, bad("", BS))
        .await
        .err()
        .expect("empty gateway");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let e = watch_req(&a, bad("gw", BS + 1))
        .await
        .err()
        .expect("block size");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    let m = kvroute_relay::metrics::render_metrics(&hub);
    assert!(m.contains("kvroute_relay_decisions_local_total 2"), "{m}");
    assert!(
        m.contains("kvroute_relay_decisions_forwarded_total 2"),
        "{m}"
    );
}

/// A forged `gone` published straight onto NATS, naming a real gateway, once made the other
/// gateways drop its load. From a relay id that does not speak for the gateway it is refused;
/// with the right relay id (read off any heartbeat) the gateway's next heartbeat contradicts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_gone_on_nats_drops_no_live_gateway() {
    use kvroute_relay::share::{subject, ShareMsg};
    use prost::Message as _;
    let Some((nats, (ha, a), (hb, b))) =
        two_relays("a_forged_gone_on_nats_drops_no_live_gateway", 3000).await
    else {
        return;
    };
    let ca = watch(&a, "gw-a", "g").await;
    let mut cb = watch(&b, "gw-b", "g").await;
    share_until_seen(&ca, &mut cb, b"x", Duration::from_secs(5), "no sharing").await;
    let forger = async_nats::connect(nats.url()).await.unwrap();
    for relay in [0xdead_beef, ha.share.relay_id] {
        let msg = ShareMsg {
            relay,
            group: "g".into(),
            gone: vec!["gw-a".into(), "gw-b".into()],
            ..ShareMsg::default()
        };
        forger
            .publish(subject("test.decisions", "g"), msg.encode_to_vec().into())
            .await
            .unwrap();
    }
    forger.flush().await.unwrap();
    // Twice the confirmation window: a believed gone would have been announced by then.
    assert!(
        cb.gone(2 * kvroute_relay::share::GONE_CONFIRM, "gw-a")
            .await
            .is_none(),
        "relay B announced the live gw-a gone"
    );
    let m = kvroute_relay::metrics::render_metrics(&hb);
    // gw-b is connected to B: both forgeries naming it are refused there.
    for (reason, n) in [
        ("gone_other_relay", 1),
        ("gone_local_gateway", 2),
        ("gone_still_alive", 1),
    ] {
        assert!(
            m.contains(&format!(
                "kvroute_relay_peer_claims_refused_total{{reason=\"{reason}\"}} {n}"
            )),
            "{reason}: {m}"
        );
    }
    assert!(m.contains("kvroute_relay_gone_announcements_total{cause=\"remote\"} 0"));
    drop(ca);
}
