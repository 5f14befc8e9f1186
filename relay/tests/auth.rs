//! Authentication on both transports (issue 46): a gRPC client without the relay token, or
//! with another, is refused with UNAUTHENTICATED, gets no snapshot and changes nothing; a NATS
//! client without the relays' credentials can neither publish on nor read the gateways'
//! subjects.
//!
//! The NATS test needs nats-server (see `common::nats`; KVROUTE_REQUIRE_NATS=1 makes its
//! absence a failure).

mod common;

use common::nats::{nats_binary, NatsServer};
use common::{grpc, hand_fed, start_relay, watch_path, Stream};
use kvroute::precise::wire::{PeerDecisions, Phase, Update, WatchRequest};
use kvroute_relay::hub::Hub;
use kvroute_relay::metrics::render_metrics;
use kvroute_relay::nats::{start_nats_as, NatsCreds, NatsOpts};
use kvroute_relay::share::{subject, ShareMsg};
use prost::Message as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt as _;
use tonic::codec::ProstCodec;

const BS: u32 = 16;
const TOKEN: &str = "test-token-0123456789abcdef";

/// A Watch stream whose first request is `first`, sending `authorization` when given.
async fn watch_as(
    url: &str,
    authorization: Option<&str>,
    first: WatchRequest,
) -> Result<(mpsc::Sender<WatchRequest>, Stream), tonic::Status> {
    let mut g = grpc(url).await;
    let (tx, rx) = mpsc::channel(16);
    tx.send(first).await.unwrap();
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    if let Some(a) = authorization {
        req.metadata_mut()
            .insert("authorization", a.parse().unwrap());
    }
    let s = g
        .streaming(
            req,
            watch_path(),
            ProstCodec::<WatchRequest, Update>::default(),
        )
        .await?
        .into_inner();
    Ok((tx, s))
}

fn first(gateway: &str, decisions: Vec<Vec<u8>>) -> WatchRequest {
    WatchRequest {
        gateway: gateway.into(),
        block_size: BS,
        group: "g".into(),
        decisions,
    }
}

/// The next Update within `wait`; None on timeout or a stream that ended.
async fn next_within(s: &mut Stream, wait: Duration) -> Option<Update> {
    tokio::time::timeout(wait, s.message())
        .await
        .ok()
        .and_then(|r| r.ok().flatten())
}

/// A relay with engine "w", requiring TOKEN.
async fn relay_with_token() -> (Arc<Hub>, String) {
    let hub = Hub::new(BS, 1024);
    hub.auth.require(TOKEN).unwrap();
    hub.add_engine(&hand_fed("w"));
    let url = start_relay(hub.clone()).await;
    (hub, url)
}

fn refused(r: Result<(mpsc::Sender<WatchRequest>, Stream), tonic::Status>) -> tonic::Status {
    match r {
        Ok(_) => panic!("the relay opened a Watch stream without the right token"),
        Err(s) => s,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_without_the_token_gets_nothing_and_changes_nothing() {
    let (hub, url) = relay_with_token().await;
    let bearer = format!("Bearer {TOKEN}");
    // The legitimate gateway: its snapshot holds block 7.
    let (_tx, mut good) = watch_as(&url, Some(&bearer), first("gw-good", vec![]))
        .await
        .expect("the right token is accepted");
    let snap = next_within(&mut good, Duration::from_secs(5))
        .await
        .expect("snapshot");
    assert_eq!(snap.phase, Phase::SnapshotEnd as i32);
    assert_eq!(snap.workers[0].worker, "w");

    // No token, another token, another scheme: refused before anything is read.
    let forged = || vec![b"forged decision".to_vec()];
    let wrong = format!("Bearer {TOKEN}x");
    for (auth, what) in [
        (None, "missing"),
        (Some(wrong.as_str()), "wrong"),
        (Some("Bearer nope"), "wrong"),
        (Some(TOKEN), "missing"),
    ] {
        let s = refused(watch_as(&url, auth, first("gw-evil", forged())).await);
        assert_eq!(s.code(), tonic::Code::Unauthenticated, "{what}: {s:?}");
        assert!(!s.message().contains(TOKEN), "the token is never echoed");
    }
    // Its decisions (in the first request and later ones) reached no one.
    assert!(
        next_within(&mut good, Duration::from_millis(500))
            .await
            .is_none(),
        "the legitimate gateway was sent something after unauthenticated calls"
    );
    assert_eq!(hub.share.stats.local.load(Relaxed), 0);
    assert_eq!(hub.stats.streams_total.load(Relaxed), 1);
    let m = render_metrics(&hub);
    assert!(
        m.contains("kvroute_relay_unauthenticated_total{reason=\"missing\"} 2"),
        "{m}"
    );
    assert!(
        m.contains("kvroute_relay_unauthenticated_total{reason=\"wrong\"} 2"),
        "{m}"
    );
    // An unknown method is refused the same way: nothing is revealed without the token.
    let mut g = grpc(&url).await;
    let s = g
        .unary::<WatchRequest, Update, _>(
            tonic::Request::new(WatchRequest::default()),
            http::uri::PathAndQuery::from_static("/kvroute.relay.v1.Relay/Other"),
            ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(s.code(), tonic::Code::Unauthenticated);
    // With the token, it is unknown.
    g.ready().await.unwrap();
    let mut r = tonic::Request::new(WatchRequest::default());
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let s = g
        .unary::<WatchRequest, Update, _>(
            r,
            http::uri::PathAndQuery::from_static("/kvroute.relay.v1.Relay/Other"),
            ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(s.code(), tonic::Code::Unimplemented, "{s:?}");
    assert!(s.message().contains("unknown method"), "{s:?}");
}

const NATS_CONF: &str = r#"
authorization {
  users = [
    { user: relay, password: "relay-password-0123456789",
      permissions: { publish: ["test.decisions.>"], subscribe: ["test.decisions.>"] } }
    { user: other, password: "other-password-0123456789",
      permissions: { publish: ["other.>"], subscribe: ["other.>", "_INBOX.>"] } }
  ]
}
"#;

fn creds(user: &str, password: &str) -> Option<NatsCreds> {
    Some(NatsCreds {
        user: user.into(),
        password: password.into(),
    })
}

async fn relay_on_nats(url: &str) -> (Arc<Hub>, String) {
    let hub = Hub::new(BS, 1024);
    hub.add_engine(&hand_fed("w"));
    let opts = NatsOpts {
        url: url.to_owned(),
        prefix: "test.decisions".into(),
        peer_timeout: Duration::from_secs(3),
    };
    start_nats_as(
        hub.share.clone(),
        opts,
        creds("relay", "relay-password-0123456789"),
    )
    .await
    .unwrap();
    let addr = start_relay(hub.clone()).await;
    (hub, addr)
}

async fn connect(url: &str, who: Option<(&str, &str)>) -> Result<async_nats::Client, String> {
    let mut o = async_nats::ConnectOptions::new();
    if let Some((u, p)) = who {
        o = o.user_and_password(u.into(), p.into());
    }
    match tokio::time::timeout(Duration::from_secs(5), o.connect(url)).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_without_credentials_can_neither_publish_nor_read() {
    let Some(bin) = nats_binary("nats_without_credentials_can_neither_publish_nor_read") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvroute-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("nats.conf");
    std::fs::write(&conf, NATS_CONF).unwrap();
    let nats = NatsServer::start_with(bin, vec!["-c".into(), conf.display().to_string()]).await;
    let url = nats.url();
    let (ha, a) = relay_on_nats(&url).await;
    let (hb, b) = relay_on_nats(&url).await;
    let t0 = Instant::now();
    while !(ha.share.stats.nats_connected.load(Relaxed)
        && hb.share.stats.nats_connected.load(Relaxed))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "relays never connected with their credentials"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The relays' own path works with credentials: A's gateway reaches B's.
    let (tx_a, _sa) = watch_as(&a, None, first("gw-a", vec![])).await.unwrap();
    let (_tx_b, mut sb) = watch_as(&b, None, first("gw-b", vec![])).await.unwrap();
    let snap = next_within(&mut sb, Duration::from_secs(5)).await.unwrap();
    assert_eq!(snap.phase, Phase::SnapshotEnd as i32);
    let t0 = Instant::now();
    loop {
        tx_a.send(WatchRequest {
            decisions: vec![b"real".to_vec()],
            ..WatchRequest::default()
        })
        .await
        .unwrap();
        if let Some(u) = next_within(&mut sb, Duration::from_millis(200)).await {
            if u.peers.iter().any(|p| p.gateway == "gw-a") {
                break;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "gw-a's decisions never reached relay B"
        );
    }
    let heard = hb.share.stats.from_nats.load(Relaxed);

    // Without credentials, or with a wrong password: no connection at all.
    for who in [
        None,
        Some(("relay", "wrong-password")),
        Some(("nobody", "x")),
    ] {
        let r = connect(&url, who).await;
        assert!(r.is_err(), "{who:?} connected to NATS");
    }
    // A user of the same server without the gateways' subjects: its publish is refused by the
    // server and its subscription gets nothing, while the relays keep publishing heartbeats.
    let other = connect(&url, Some(("other", "other-password-0123456789")))
        .await
        .expect("user other connects");
    let mut sub = other.subscribe("test.decisions.>").await.unwrap();
    let forged = ShareMsg {
        relay: 42,
        group: "g".into(),
        peers: vec![PeerDecisions {
            gateway: "gw-evil".into(),
            decisions: vec![b"forged".to_vec()],
            sent_unix_ns: 1,
        }],
        ..ShareMsg::default()
    };
    for _ in 0..5 {
        let _ = other
            .publish(
                subject("test.decisions", "g"),
                forged.encode_to_vec().into(),
            )
            .await;
    }
    let _ = other.flush().await;
    let got = tokio::time::timeout(Duration::from_millis(1500), sub.next()).await;
    assert!(
        !matches!(got, Ok(Some(_))),
        "a user without permission read the gateways' subject"
    );
    // Relay B took none of it: no decisions from gw-evil, no more decisions heard than
    // gw-a's (which stopped).
    let deadline = Instant::now() + Duration::from_millis(500);
    while let Some(u) =
        next_within(&mut sb, deadline.saturating_duration_since(Instant::now())).await
    {
        assert!(
            u.peers.iter().all(|p| p.gateway != "gw-evil"),
            "forged decisions reached a gateway"
        );
    }
    let after = hb.share.stats.from_nats.load(Relaxed);
    assert!(
        after - heard <= 2,
        "relay B heard {} more decisions",
        after - heard
    );
    drop(tx_a);
    drop(nats);
    let _ = std::fs::remove_dir_all(&dir);
}
