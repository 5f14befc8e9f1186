//! An idle engine restarting (a new process on the same endpoints, cache empty) is announced
//! `cleared` within a probe period of listening again; a panicking engine task is restarted.
//!
//! The fake engine runs on its own thread and tokio runtime, like a process: stopping it
//! drops the runtime, which closes every socket and connection at once.

mod common;

use common::{engine_spec, next, start_relay, wait_live, FakeEngine, Stream};
use kvroute::precise::wire::Phase;
use kvroute_relay::engine::{self, EngineOpts};
use kvroute_relay::hub::{EngineSpec, Hub};
use kvroute_relay::vllm::{batch, chain, Ev};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BS: u32 = 4;

/// A fake vLLM engine "process": the fake engine on its own thread and runtime, bound on the
/// given endpoints, its first batches published (and buffered) at start-up.
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
                let eng = FakeEngine::bind(&pub_ep, &replay_ep, batches).await;
                let ready = (eng.pub_ep.clone(), eng.replay_ep.clone(), eng.bound_at);
                ready_tx.send(ready).unwrap();
                let _ = stop_rx.await;
                drop(eng);
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

    fn spec(&self) -> EngineSpec {
        engine_spec(&self.pub_ep, &self.replay_ep)
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

/// Serves the hub's gRPC and watches it.
async fn watch(hub: Arc<Hub>) -> Stream {
    common::watch(&start_relay(hub).await, BS).await.unwrap()
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

/// Starts process A (its first life) and a relay supervising it; returns them once live.
async fn supervised(o: EngineOpts) -> (Proc, Arc<Hub>) {
    let a = Proc::start("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", first_life());
    let hub = Hub::new(BS, 1024);
    tokio::spawn(engine::supervise(hub.clone(), a.spec(), o));
    wait_live(&hub).await;
    (a, hub)
}

/// Starts process A, the relay and a watcher; returns them once the watcher holds A's blocks.
async fn setup() -> (Proc, Arc<Hub>, Stream) {
    let (a, hub) = supervised(opts()).await;
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
    let flag = Arc::new(AtomicBool::new(false));
    let o = EngineOpts {
        inject_panic: Some(flag.clone()),
        ..opts()
    };
    let (a, hub) = supervised(o).await;
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
