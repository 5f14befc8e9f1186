//! End to end: a fake vLLM engine (zeromq PUB + ROUTER replay, vLLM's framing) feeds the relay;
//! a tonic client watches the gRPC stream.

mod common;

use common::{hand_fed, next, start_relay, watch, FakeEngine, Stream};
use kvroute::hashing::{chain_seed, token_block_hash};
use kvroute::precise::wire::{Phase, Update};
use kvroute_relay::engine::{self, EngineOpts};
use kvroute_relay::hub::Hub;
use kvroute_relay::vllm::{batch, chain, Ev, Hash};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

const BS: u32 = 4;

fn kv(model: &str, blocks: &[Vec<u32>]) -> Vec<u64> {
    let seed = chain_seed(model, None);
    let mut parent = None;
    blocks
        .iter()
        .map(|b| {
            let h = token_block_hash(parent, b, seed);
            parent = Some(h);
            h
        })
        .collect()
}

fn toks(first: u32, n: usize) -> Vec<Vec<u32>> {
    (0..n as u32)
        .map(|i| (0..BS).map(|j| first + i * BS + j).collect())
        .collect()
}

/// Reads updates until `done` holds over everything seen for worker "w"; returns them.
async fn until(
    s: &mut Stream,
    mut seq: u64,
    done: impl Fn(&[Update]) -> bool,
) -> (Vec<Update>, u64) {
    let mut seen = Vec::new();
    while !done(&seen) {
        let u = next(s).await;
        seq += 1;
        assert_eq!(u.seq, seq, "seq +1 per update");
        assert_eq!(u.phase, Phase::Live as i32);
        seen.push(u);
    }
    (seen, seq)
}

fn stored(us: &[Update]) -> Vec<u64> {
    us.iter()
        .flat_map(|u| &u.workers)
        .flat_map(|w| w.stored.clone())
        .collect()
}

fn removed(us: &[Update]) -> Vec<u64> {
    us.iter()
        .flat_map(|u| &u.workers)
        .flat_map(|w| w.removed.clone())
        .collect()
}

fn any_cleared(us: &[Update]) -> bool {
    us.iter().flat_map(|u| &u.workers).any(|w| w.cleared)
}

fn opts() -> EngineOpts {
    EngineOpts {
        replay_timeout: Duration::from_secs(2),
        probe_after: Duration::from_secs(5),
        refresh_after: Duration::from_secs(3600),
        ..EngineOpts::default()
    }
}

/// Runs engine "w" of `eng` in a new hub; returns the hub once the engine is live.
async fn relay_on(eng: &FakeEngine, capacity: usize, o: EngineOpts) -> Arc<Hub> {
    let hub = Hub::new(BS, capacity);
    tokio::spawn(engine::run(hub.clone(), eng.spec(), o));
    common::wait_live(&hub).await;
    // Give the subscription time to reach the publisher.
    tokio::time::sleep(Duration::from_millis(300)).await;
    hub
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_deltas_gap_repair_and_restart() {
    let mut eng = FakeEngine::start().await;
    // Batch 0 happens before the relay subscribes: it must come from the replay buffer.
    eng.emit(0, &[chain(None, 100, 2, BS, 0)], false).await;
    let a = kv("m", &toks(0, 2));

    let hub = relay_on(&eng, 1024, opts()).await;
    let url = start_relay(hub.clone()).await;

    let mut s = watch(&url, BS).await.unwrap();
    let snap = next(&mut s).await;
    assert_eq!(snap.seq, 1);
    assert_eq!(snap.epoch, hub.epoch);
    assert_ne!(snap.sent_unix_ns, 0);
    assert_eq!(snap.phase, Phase::SnapshotEnd as i32);
    assert_eq!(snap.workers.len(), 1);
    let w = &snap.workers[0];
    assert_eq!((w.worker.as_str(), w.cleared, w.stale), ("w", true, false));
    assert_eq!(w.stored, a);

    // A live delta: block 2 under block 1 (engine hash 101), in map form (odd seq).
    eng.emit(1, &[chain(Some(101), 102, 1, BS, 8)], false).await;
    let b = kv("m", &toks(0, 3))[2];
    let (_, seq) = until(&mut s, 1, |us| stored(us).contains(&b)).await;

    // Batch 2 is lost on the wire; batch 3 reveals the gap, the replay repairs it.
    eng.emit(2, &[chain(Some(102), 103, 1, BS, 12)], true).await;
    eng.emit(3, &[Ev::Removed(vec![Hash::Int(100)])], false)
        .await;
    let c = kv("m", &toks(0, 4))[3];
    let (_, seq) = until(&mut s, seq, |us| {
        stored(us).contains(&c) && removed(us).contains(&a[0])
    })
    .await;
    let stats = hub.lock().workers[0].stats.clone();
    assert_eq!(stats.gaps_repaired.load(Relaxed), 1);
    assert_eq!(stats.gaps_unrepaired.load(Relaxed), 0);

    // The engine restarts: its sequence starts over at 0 → cleared, then the new blocks.
    eng.buffer.lock().unwrap().clear();
    eng.emit(0, &[chain(None, 500, 1, BS, 1000)], false).await;
    let d = kv("m", &toks(1000, 1));
    let (us, seq) = until(&mut s, seq, |us| stored(us).contains(&d[0])).await;
    assert!(any_cleared(&us));
    assert_eq!(stats.restarts.load(Relaxed), 1);
    assert_eq!(hub.lock().workers[0].index.blocks.len(), 1);

    // A gap the replay cannot cover (batches 1-2 never buffered) → cleared, never stale data.
    eng.emit(3, &[chain(None, 600, 1, BS, 2000)], false).await;
    let e = kv("m", &toks(2000, 1));
    let (us, _) = until(&mut s, seq, |us| stored(us).contains(&e[0])).await;
    assert!(any_cleared(&us));
    assert_eq!(stats.gaps_unrepaired.load(Relaxed), 1);
    assert_eq!(hub.lock().workers[0].index.blocks.len(), 1);

    // A second watcher gets the current state as its snapshot.
    let mut s2 = watch(&url, BS).await.unwrap();
    let snap = next(&mut s2).await;
    assert_eq!(snap.phase, Phase::SnapshotEnd as i32);
    assert_eq!(snap.workers[0].stored, e);

    let m = kvroute_relay::metrics::render_metrics(&hub);
    assert!(
        m.contains("kvroute_relay_gaps_repaired_total{worker=\"w\"} 1"),
        "{m}"
    );
    assert!(m.contains("kvroute_relay_streams_open 2"), "{m}");
}

#[tokio::test]
async fn block_size_mismatch_is_failed_precondition() {
    let hub = Hub::new(16, 16);
    let url = start_relay(hub).await;
    let err = watch(&url, 32).await.expect_err("mismatch accepted");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.message().contains("block_size"), "{}", err.message());
}

#[tokio::test]
async fn empty_relay_sends_an_empty_snapshot_end() {
    let hub = Hub::new(16, 16);
    let url = start_relay(hub).await;
    let mut s = watch(&url, 16).await.unwrap();
    let u = next(&mut s).await;
    assert_eq!((u.seq, u.phase), (1, Phase::SnapshotEnd as i32));
    assert!(u.workers.is_empty());
}

#[tokio::test]
async fn big_snapshots_are_chunked() {
    let hub = Hub::new(1, 16);
    let (w, _) = hub.add_engine(&hand_fed("big"));
    let n = 70_000u64;
    {
        let mut st = hub.lock();
        for i in 0..n {
            st.workers[w].index.blocks.insert(i, i + 1, 0);
        }
    }
    let url = start_relay(hub).await;
    let mut s = watch(&url, 1).await.unwrap();
    let mut total = 0;
    let mut phases = Vec::new();
    let mut cleared = 0;
    loop {
        let u = next(&mut s).await;
        for w in &u.workers {
            assert!(w.stored.len() <= 32768);
            total += w.stored.len();
            cleared += usize::from(w.cleared);
        }
        phases.push(u.phase);
        if u.phase == Phase::SnapshotEnd as i32 {
            break;
        }
    }
    assert_eq!(total as u64, n);
    assert_eq!(
        cleared, 1,
        "cleared only on the worker's first snapshot part"
    );
    assert_eq!(phases, vec![1, 1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lagging_stream_gets_a_fresh_snapshot() {
    use kvroute_relay::hub::Change;
    use kvroute_relay::index::Delta;
    let hub = Hub::new(1, 2);
    let (w, _) = hub.add_engine(&hand_fed("w"));
    let url = start_relay(hub.clone()).await;
    let mut s = watch(&url, 1).await.unwrap();
    assert_eq!(next(&mut s).await.phase, Phase::SnapshotEnd as i32);
    // The client reads nothing while far more changes arrive than the stream can buffer.
    for i in 0..300u64 {
        let mut st = hub.lock();
        let stored: Vec<u64> = (i * 1000..(i + 1) * 1000).collect();
        for &h in &stored {
            st.workers[w].index.blocks.insert(h, h, 0);
        }
        st.publish(vec![Change {
            worker: w,
            delta: Delta {
                stored,
                ..Delta::default()
            },
            engine_ns: 0,
        }]);
    }
    let mut seq = 1;
    let mut resnapshot = false;
    while !resnapshot {
        let u = next(&mut s).await;
        seq += 1;
        assert_eq!(u.seq, seq);
        resnapshot = u.phase != Phase::Live as i32;
    }
    assert!(hub.stats.lagged_resnapshots.load(Relaxed) >= 1);
    // The fresh snapshot holds every block.
    let mut total = 0;
    let mut u = next(&mut s).await;
    loop {
        total += u.workers.iter().map(|w| w.stored.len()).sum::<usize>();
        if u.phase == Phase::SnapshotEnd as i32 {
            break;
        }
        u = next(&mut s).await;
    }
    assert!(total > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_engine_is_marked_stale() {
    let eng = FakeEngine::start().await;
    let o = EngineOpts {
        probe_after: Duration::from_millis(300),
        ..opts()
    };
    let hub = relay_on(&eng, 64, o).await;
    let url = start_relay(hub.clone()).await;
    let mut s = watch(&url, BS).await.unwrap();
    let snap = next(&mut s).await;
    assert!(!snap.workers[0].stale);
    drop(eng.publisher);
    let (us, _) = until(&mut s, 1, |us| {
        us.iter().flat_map(|u| &u.workers).any(|w| w.stale)
    })
    .await;
    assert_eq!(us.last().unwrap().workers[0].worker, "w");
    assert!(!hub.lock().workers[0].stats.connected.load(Relaxed));
}

/// Live copies of batches the relay already took from the replay are duplicates, not a
/// restart; once the live stream is back in order, a sequence going back is a restart again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_batches_seen_live_are_duplicates() {
    let mut eng = FakeEngine::start().await;
    eng.emit(0, &[chain(None, 100, 1, BS, 0)], true).await;
    let hub = relay_on(&eng, 64, opts()).await;
    let stats = hub.lock().workers[0].stats.clone();
    assert_eq!(
        hub.lock().workers[0].index.blocks.len(),
        1,
        "batch 0 from the replay"
    );
    let url = start_relay(hub.clone()).await;
    let mut s = watch(&url, BS).await.unwrap();
    next(&mut s).await;
    // Batch 0 arrives live too (it was queued while the relay replayed).
    let payload = batch(&[chain(None, 100, 1, BS, 0)], false);
    eng.publish_on(b"", 0, payload).await;
    eng.emit(1, &[chain(Some(100), 101, 1, BS, 4)], false).await;
    let b = kv("m", &toks(0, 2))[1];
    let (us, seq) = until(&mut s, 1, |us| stored(us).contains(&b)).await;
    assert!(!any_cleared(&us));
    assert_eq!(stats.restarts.load(Relaxed), 0);
    // Now a restart: a new process, whose replay buffer starts empty (with the old batches
    // left in it, the relay's next probe would read the old batch 0 and count a second restart).
    eng.buffer.lock().unwrap().clear();
    eng.emit(0, &[chain(None, 7, 1, BS, 100)], false).await;
    let c = kv("m", &toks(100, 1))[0];
    until(&mut s, seq, |us| stored(us).contains(&c)).await;
    assert_eq!(stats.restarts.load(Relaxed), 1);
}
