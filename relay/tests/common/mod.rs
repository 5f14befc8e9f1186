//! What the relay's integration tests (and the nats_bench example) share: a fake vLLM engine
//! (zeromq PUB + ROUTER replay, vLLM's framing), a relay's gRPC server on a free port, the
//! tonic Watch client, and (in `nats`) a nats-server child process.
//!
//! Each test binary uses only part of it.
#![allow(dead_code)]

pub mod nats;

use bytes::Bytes;
use kvroute::precise::wire::{Update, WatchRequest, METHOD, SERVICE};
use kvroute_relay::hub::{EngineSpec, Hub};
use kvroute_relay::vllm::{batch, Ev};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::ProstCodec;
use tonic::transport::Channel;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// A server-streaming Watch: the Updates a gateway reads.
pub type Stream = tonic::codec::Streaming<Update>;

/// Replay buffer of the fake engine: (seq, payload).
pub type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

pub fn msg(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).unwrap()
}

/// A fake vLLM engine: publishes batches and answers replay requests from its buffer.
pub struct FakeEngine {
    pub publisher: PubSocket,
    pub buffer: Buffer,
    pub pub_ep: String,
    pub replay_ep: String,
    /// When both sockets were bound.
    pub bound_at: Instant,
}

impl FakeEngine {
    /// An engine on free ports, nothing buffered yet.
    pub async fn start() -> FakeEngine {
        FakeEngine::bind("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", Vec::new()).await
    }

    /// An engine bound on the given endpoints whose first `batches` (seq 0, 1, ...) are
    /// buffered before the replay answers and then published.
    pub async fn bind(pub_ep: &str, replay_ep: &str, batches: Vec<Vec<u8>>) -> FakeEngine {
        let mut publisher = PubSocket::new();
        let pub_ep = publisher.bind(pub_ep).await.unwrap().to_string();
        let mut router = RouterSocket::new();
        let replay_ep = router.bind(replay_ep).await.unwrap().to_string();
        let bound_at = Instant::now();
        let buffer: Buffer = Arc::new(Mutex::new(
            batches
                .into_iter()
                .enumerate()
                .map(|(i, b)| (i as u64, b))
                .collect(),
        ));
        tokio::spawn(answer_replays(router, buffer.clone()));
        let mut eng = FakeEngine {
            publisher,
            buffer,
            pub_ep,
            replay_ep,
            bound_at,
        };
        let first: Vec<(u64, Vec<u8>)> = eng.buffer.lock().unwrap().clone();
        for (seq, payload) in first {
            eng.publish(seq, payload).await;
        }
        eng
    }

    /// Engine "w" of model "m" on this engine's endpoints.
    pub fn spec(&self) -> EngineSpec {
        engine_spec(&self.pub_ep, &self.replay_ep)
    }

    /// Buffers batch `seq` for replay and publishes it unless `drop`.
    pub async fn emit(&mut self, seq: u64, evs: &[Ev], drop: bool) {
        let payload = batch(evs, seq % 2 == 1);
        self.buffer.lock().unwrap().push((seq, payload.clone()));
        if !drop {
            self.publish(seq, payload).await;
        }
    }

    /// Publishes `payload` as batch `seq` (topic "kv") without buffering it.
    pub async fn publish(&mut self, seq: u64, payload: Vec<u8>) {
        self.publish_on(b"kv", seq, payload).await;
    }

    pub async fn publish_on(&mut self, topic: &'static [u8], seq: u64, payload: Vec<u8>) {
        let m = msg(vec![
            Bytes::from_static(topic),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ]);
        self.publisher.send(m).await.unwrap();
    }
}

/// Answers each replay request ([identity, "", start_seq]: what vLLM's ROUTER requires,
/// exactly 3 frames) with the buffered batches from start_seq on, then the end marker (-1).
async fn answer_replays(mut router: RouterSocket, buffer: Buffer) {
    while let Ok(req) = router.recv().await {
        let f = req.into_vec();
        assert_eq!(f.len(), 3, "replay request frames: {f:?}");
        assert!(f[1].is_empty());
        let start = u64::from_be_bytes(f[2].as_ref().try_into().unwrap());
        let items: Vec<(u64, Vec<u8>)> = buffer
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let reply =
            |seq: Bytes, payload: Bytes| msg(vec![f[0].clone(), Bytes::new(), seq, payload]);
        for (seq, payload) in items {
            let m = reply(Bytes::copy_from_slice(&seq.to_be_bytes()), payload.into());
            if router.send(m).await.is_err() {
                return;
            }
        }
        let end = reply(Bytes::copy_from_slice(&(-1i64).to_be_bytes()), Bytes::new());
        if router.send(end).await.is_err() {
            return;
        }
    }
}

/// Engine "w" of model "m" publishing on `pub_ep`, replaying on `replay_ep`.
pub fn engine_spec(pub_ep: &str, replay_ep: &str) -> EngineSpec {
    EngineSpec {
        name: "w".into(),
        endpoint: pub_ep.into(),
        replay: Some(replay_ep.into()),
        model: "m".into(),
        kv_blocks: None,
    }
}

/// An engine the tests feed by hand (nothing listens on its endpoint): `name`, model "m".
pub fn hand_fed(name: &str) -> EngineSpec {
    EngineSpec {
        name: name.into(),
        endpoint: "tcp://127.0.0.1:1".into(),
        replay: None,
        model: "m".into(),
        kv_blocks: None,
    }
}

/// Waits (up to 10 s) until the hub has engines and all are connected and not stale.
pub async fn wait_live(hub: &Hub) {
    for _ in 0..400 {
        let live = {
            let st = hub.lock();
            !st.workers.is_empty()
                && st
                    .workers
                    .iter()
                    .all(|w| !w.stale && w.stats.connected.load(Relaxed))
        };
        if live {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("engine never became live");
}

/// Serves the hub's gRPC on a free port; returns its URL.
pub async fn start_relay(hub: Arc<Hub>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(kvroute_relay::grpc::serve(hub, l));
    format!("http://{addr}")
}

/// A ready gRPC client of the relay at `url`.
pub async fn grpc(url: &str) -> tonic::client::Grpc<Channel> {
    let ch = tonic::transport::Endpoint::from_shared(url.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut g = tonic::client::Grpc::new(ch);
    g.ready().await.unwrap();
    g
}

/// The Watch method's path.
pub fn watch_path() -> http::uri::PathAndQuery {
    http::uri::PathAndQuery::try_from(format!("/{SERVICE}/{METHOD}")).unwrap()
}

/// Watches as gateway "test" with one request (server streaming, like older filters).
pub async fn watch(url: &str, block_size: u32) -> Result<Stream, tonic::Status> {
    watch_as_gateway(url, "test", block_size).await
}

/// Watches as `gateway` with one request (server streaming).
pub async fn watch_as_gateway(
    url: &str,
    gateway: &str,
    block_size: u32,
) -> Result<Stream, tonic::Status> {
    let req = WatchRequest {
        gateway: gateway.into(),
        block_size,
        ..WatchRequest::default()
    };
    grpc(url)
        .await
        .server_streaming(
            tonic::Request::new(req),
            watch_path(),
            ProstCodec::default(),
        )
        .await
        .map(tonic::Response::into_inner)
}

/// Watches with `first` as the first request of a bidirectional stream; returns the sender
/// of further requests (`capacity` of them queued at most) and the Updates.
pub async fn watch_bidi(
    url: &str,
    first: WatchRequest,
    capacity: usize,
) -> Result<(mpsc::Sender<WatchRequest>, Stream), tonic::Status> {
    let mut g = grpc(url).await;
    let (tx, rx) = mpsc::channel(capacity);
    tx.send(first).await.unwrap();
    let rx = g
        .streaming(
            tonic::Request::new(ReceiverStream::new(rx)),
            watch_path(),
            ProstCodec::<WatchRequest, Update>::default(),
        )
        .await?
        .into_inner();
    Ok((tx, rx))
}

/// The next Update (within 10 s).
pub async fn next(s: &mut Stream) -> Update {
    tokio::time::timeout(Duration::from_secs(10), s.message())
        .await
        .expect("no update within 10 s")
        .unwrap()
        .expect("stream ended")
}

/// The `p` quantile (0 to 1) of `v` (sorted in place); NaN if empty.
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
}
