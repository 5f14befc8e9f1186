//! An idle engine restarting (a new process on the same endpoints, cache empty) is announced
//! `cleared` within a probe period of listening again; a panicking engine task is restarted.
//!
//! The fake engine runs on its own thread and tokio runtime, like a process: stopping it
//! drops the runtime, which closes every socket and connection at once.

use bytes::Bytes;
use kvroute::precise::wire::{Phase, Update, WatchRequest, METHOD, SERVICE};
use kvroute_relay::engine::{self, EngineOpts};
use kvroute_relay::hub::{EngineSpec, Hub};
use kvroute_relay::vllm::{batch, chain, Ev};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::codec::ProstCodec;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const BS: u32 = 4;

fn msg(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).unwrap()
}

/// A fake vLLM engine "process": PUB + ROUTER replay bound on the given endpoints, its
/// first batches published (and buffered) at start-up.
struct Proc {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub_ep: String,
    replay_ep: String,
    /// When both sockets were bound.
    bound_at: Instant,
}

impl Proc {
    fn start(pub_ep: &str, replay_ep: &str, batches: Vec<Vec<u8>>) -> Proc {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (pub_ep, replay_ep) = (pub_ep.to_owned(), replay_ep.to_owned());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let mut publisher = PubSocket::new();
                let p = publisher.bind(&pub_ep).await.unwrap().to_string();
                let mut router = RouterSocket::new();
                let r = router.bind(&replay_ep).await.unwrap().to_string();
                let bound_at = Instant::now();
                let buffer: Vec<(u64, Vec<u8>)> = batches
                    .into_iter()
                    .enumerate()
                    .map(|(i, b)| (i as u64, b))
                    .collect();
                for (seq, payload) in &buffer {
                    let m = msg(vec![
                        Bytes::from_static(b"kv"),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        Bytes::from(payload.clone()),
                    ]);
                    publisher.send(m).await.unwrap();
                }
                let buffer = Arc::new(Mutex::new(buffer));
                tokio::spawn(async move {
                    while let Ok(req) = router.recv().await {
                        let f = req.into_vec();
                        assert_eq!(f.len(), 3, "replay request frames: {f:?}");
                        let start = u64::from_be_bytes(f[2].as_ref().try_into().unwrap());
                        let items: Vec<(u64, Vec<u8>)> = buffer
                            .lock()
                            .unwrap()
                            .iter()
                            .filter(|(s, _)| *s >= start)
                            .cloned()
                            .collect();
                        for (seq, payload) in items {
                            let m = msg(vec![
                                f[0].clone(),
                                Bytes::new(),
                                Bytes::copy_from_slice(&seq.to_be_bytes()),
                                Bytes::from(payload),
                            ]);
                            if router.send(m).await.is_err() {
                                break;
                            }
                        }
                        let end = msg(vec![
                            f[0].clone(),
                            Bytes::new(),
                            Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                            Bytes::new(),
                        ]);
                        let _ = router.send(end).await;
                    }
                });
                ready_tx.send((p, r, bound_at)).unwrap();
                let _ = stop_rx.await;
                drop(publisher);
            });
            rt.shutdown_timeout(Duration::from_secs(1));
        });
        let (pub_ep, replay_ep, bound_at) = ready_rx.recv().unwrap();
        Proc {
            stop: Some(stop_tx),
            thread: Some(thread),
            pub_ep,
            replay_ep,
            bound_at,
        }
    }

    fn kill(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

type Stream = tonic::codec::Streaming<Update>;

async fn watch(hub: Arc<Hub>) -> Stream {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(kvroute_relay::grpc::serve(hub, l));
    let ch = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut g = tonic::client::Grpc::new(ch);
    g.ready().await.unwrap();
    let path = http::uri::PathAndQuery::try_from(format!("/{SERVICE}/{METHOD}")).unwrap();
    let req = WatchRequest {
        gateway: "test".into(),
        block_size: BS,
        ..WatchRequest::default()
    };
    g.server_streaming(tonic::Request::new(req), path, ProstCodec::default())
        .await
        .unwrap()
        .into_inner()
}

async fn next(s: &mut Stream) -> Update {
    tokio::time::timeout(Duration::from_secs(10), s.message())
        .await
        .expect("no update within 10 s")
        .unwrap()
        .expect("stream ended")
}

/// Reads updates until one has worker "w" matching `f`; returns when it was read.
async fn until_worker(
    s: &mut Stream,
    f: impl Fn(&kvroute::precise::wire::WorkerDelta) -> bool,
) -> Instant {
    loop {
        let u = next(s).await;
        if u.workers.iter().any(|w| w.worker == "w" && f(w)) {
            return Instant::now();
        }
    }
}

async fn wait_live(hub: &Hub) {
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

fn opts() -> EngineOpts {
    EngineOpts {
        probe_interval: Duration::from_millis(50),
        ..EngineOpts::default()
    }
}

/// Two batches of the first process: start-up AllBlocksCleared, then 3 stored blocks.
fn first_life() -> Vec<Vec<u8>> {
    vec![
        batch(&[Ev::Cleared], false),
        batch(&[chain(None, 100, 3, BS, 0)], true),
    ]
}

/// Starts process A, the relay and a watcher; returns them once the watcher holds A's blocks.
async fn setup() -> (Proc, Arc<Hub>, Stream) {
    let a = Proc::start("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", first_life());
    let hub = Hub::new(BS, 1024);
    let spec = EngineSpec {
        name: "w".into(),
        endpoint: a.pub_ep.clone(),
        replay: Some(a.replay_ep.clone()),
        model: "m".into(),
    };
    tokio::spawn(engine::supervise(hub.clone(), spec, opts()));
    wait_live(&hub).await;
    let mut s = watch(hub.clone()).await;
    let snap = next(&mut s).await;
    assert_eq!(snap.phase, Phase::SnapshotEnd as i32);
    assert_eq!(snap.workers[0].stored.len(), 3);
    assert!(!snap.workers[0].stale);
    (a, hub, s)
}

/// Restarts the engine after `down` of downtime; returns bind → cleared.
async fn restart_after(down: Duration) -> Duration {
    let (a, hub, mut s) = setup().await;
    // Idle for a while, so that only the probe can notice the restart.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (pub_ep, replay_ep) = (a.pub_ep.clone(), a.replay_ep.clone());
    a.kill();
    if down > Duration::from_millis(300) {
        // Down long enough for 3 failed probes: announced stale first.
        until_worker(&mut s, |w| w.stale).await;
    } else {
        tokio::time::sleep(down).await;
    }
    // The new process: same endpoints, empty cache; its start-up batch 0 is AllBlocksCleared.
    let b = tokio::task::spawn_blocking(move || {
        Proc::start(&pub_ep, &replay_ep, vec![batch(&[Ev::Cleared], false)])
    })
    .await
    .unwrap();
    let cleared_at = until_worker(&mut s, |w| w.cleared).await;
    let latency = cleared_at.saturating_duration_since(b.bound_at);
    // Back to live, holding nothing.
    wait_live(&hub).await;
    assert_eq!(hub.lock().workers[0].index.blocks.len(), 0);
    let stats = hub.lock().workers[0].stats.clone();
    assert_eq!(stats.restarts.load(Relaxed), 1);
    tokio::task::spawn_blocking(move || b.kill()).await.unwrap();
    latency
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_engine_restart_is_cleared_quickly() {
    // A quick restart (the old process gone, the new one bound 20 ms later): the probe's
    // kept connection fails, the next probe finds the new process.
    let quick = restart_after(Duration::from_millis(20)).await;
    eprintln!(
        "restart (20 ms down) → cleared: {:.1} ms",
        quick.as_secs_f64() * 1e3
    );
    // A long outage: stale first, then cleared once the new process listens.
    let slow = restart_after(Duration::from_millis(1000)).await;
    eprintln!(
        "restart (stale first) → cleared: {:.1} ms",
        slow.as_secs_f64() * 1e3
    );
    assert!(quick < Duration::from_millis(300), "{quick:?}");
    assert!(slow < Duration::from_millis(300), "{slow:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_engine_task_is_restarted() {
    let a = Proc::start("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", first_life());
    let hub = Hub::new(BS, 1024);
    let spec = EngineSpec {
        name: "w".into(),
        endpoint: a.pub_ep.clone(),
        replay: Some(a.replay_ep.clone()),
        model: "m".into(),
    };
    let flag = Arc::new(AtomicBool::new(false));
    let o = EngineOpts {
        inject_panic: Some(flag.clone()),
        ..opts()
    };
    tokio::spawn(engine::supervise(hub.clone(), spec, o));
    wait_live(&hub).await;
    let mut s = watch(hub.clone()).await;
    assert_eq!(next(&mut s).await.workers[0].stored.len(), 3);
    flag.store(true, SeqCst);
    // Stale and cleared, then live again with the blocks replayed from the engine's buffer.
    until_worker(&mut s, |w| w.stale).await;
    wait_live(&hub).await;
    for _ in 0..100 {
        if hub.lock().workers[0].index.blocks.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(hub.lock().workers[0].index.blocks.len(), 3);
    let stats = hub.lock().workers[0].stats.clone();
    assert_eq!(stats.task_panics.load(Relaxed), 1);
    let m = kvroute_relay::metrics::render_metrics(&hub);
    assert!(
        m.contains("kvroute_relay_engine_task_panics_total{worker=\"w\"} 1"),
        "{m}"
    );
    tokio::task::spawn_blocking(move || a.kill()).await.unwrap();
}
