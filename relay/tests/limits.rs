//! The relay's limits (README, "Limits"): an engine's index stays bounded under a flood of
//! blocks, eviction keeps chains whole and hot prefixes held, gateways see every eviction,
//! snapshots are capped, and streams are capped per client and in total.

mod common;

use common::{hand_fed, next, start_relay, watch, watch_as_gateway};
use kvroute::precise::wire::{Phase, Update};
use kvroute_relay::decode::decode_batch;
use kvroute_relay::hub::{Change, Hub, Limits};
use kvroute_relay::index::{Counts, DeltaBuilder, EngineIndex};
use kvroute_relay::vllm::{batch, chain};
use prost::Message as _;
use std::collections::HashSet;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

const BS: u32 = 4;

/// Applies one vLLM batch to `ix` the way the engine task does; returns the delta.
fn apply(ix: &mut EngineIndex, payload: &[u8], c: &mut Counts) -> kvroute_relay::index::Delta {
    let b = decode_batch(payload).unwrap();
    let mut d = DeltaBuilder::default();
    for e in &b.events {
        ix.apply(e, &mut d, c);
    }
    d.finish()
}

/// Event `i` of a flood: 8 new blocks, every other event continuing the previous chain.
fn flood_event(i: i64) -> Vec<u8> {
    let parent = (i % 2 == 1).then_some(i * 8 - 1);
    batch(&[chain(parent, i * 8, 8, BS, i as u32 * 32)], i % 3 == 0)
}

#[test]
fn a_flood_of_blocks_stays_bounded() {
    let max = 2 * 1000;
    let mut ix = EngineIndex::with_max_blocks("m", BS, max);
    let mut c = Counts::default();
    let mut peak = 0;
    let mut bytes_peak = 0;
    // 100,000 blocks into an index of 2,000: never-computed blocks, never removed.
    for i in 0..12_500 {
        apply(&mut ix, &flood_event(i), &mut c);
        peak = peak.max(ix.blocks.len());
        bytes_peak = bytes_peak.max(ix.blocks.bytes());
    }
    assert_eq!(c.blocks_stored, 100_000);
    assert!(peak <= max, "{peak} blocks held, bound {max}");
    assert!(ix.blocks.len() >= max - max / 8 - 8);
    assert_eq!(c.evicted, 100_000 - ix.blocks.len() as u64);
    // 32 bytes per entry plus control bytes, in a table sized for `max` entries, and the
    // set of held kvroute hashes (8 bytes plus a control byte per slot).
    assert!(bytes_peak <= 4096 * (33 + 9) + 128, "{bytes_peak} bytes");
    assert_eq!(
        ix.blocks.dangling(),
        0,
        "eviction left a child without its parent"
    );
    let snap = ix.blocks.snapshot();
    assert_eq!(snap.len(), ix.blocks.len());
    // The newest chain survived whole.
    let last = ix.blocks.get(12_499 * 8 + 7).expect("newest block held");
    assert_eq!(
        last.1, 15,
        "depth of the last block of the last two-event chain"
    );
}

#[test]
fn eviction_keeps_a_hot_prefix_and_drops_old_conversations() {
    let mut ix = EngineIndex::with_max_blocks("m", BS, 512);
    let mut c = Counts::default();
    // A shared system prompt of 16 blocks (engine hashes 0..16), stored once.
    apply(&mut ix, &batch(&[chain(None, 0, 16, BS, 0)], false), &mut c);
    // 2,000 conversations, each 4 new blocks under the system prompt (vLLM never
    // republishes the prompt's blocks: only the new children name its last block).
    for k in 0..2_000i64 {
        let first = 1_000 + k * 4;
        let p = batch(&[chain(Some(15), first, 4, BS, 10_000 + k as u32)], false);
        apply(&mut ix, &p, &mut c);
    }
    assert!(ix.blocks.len() <= 512);
    assert!(c.evicted > 7_000);
    for h in 0..16 {
        assert!(
            ix.blocks.get(h).is_some(),
            "system prompt block {h} evicted"
        );
    }
    assert!(
        ix.blocks.get(1_000).is_none(),
        "the oldest conversation is still held"
    );
    assert!(ix.blocks.get(1_000 + 1_999 * 4 + 3).is_some());
    assert_eq!(ix.blocks.dangling(), 0);
    assert_eq!(c.orphans, 0);
}

/// What a gateway holds after applying `u` to `held`.
fn follow(held: &mut HashSet<u64>, u: &Update) {
    for w in &u.workers {
        if w.cleared {
            held.clear();
        }
        for h in &w.stored {
            held.insert(*h);
        }
        for h in &w.removed {
            held.remove(h);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_see_evictions_and_snapshots_stay_small() {
    let limits = Limits {
        kv_blocks: 1_000,
        index_factor: 2,
        ..Limits::default()
    };
    let hub = Hub::with_limits(BS, 1 << 16, limits);
    let (w, stats) = hub.add_engine(&hand_fed("w"));
    assert_eq!(hub.lock().workers[w].index.blocks.max(), 2_000);
    let url = start_relay(hub.clone()).await;
    let mut s = watch(&url, BS).await.unwrap();
    let mut held = HashSet::new();
    follow(&mut held, &next(&mut s).await);

    // 40,000 blocks in 5,000 batches, each published as the engine task does.
    for i in 0..5_000 {
        let mut c = Counts::default();
        let mut st = hub.lock();
        let d = apply(&mut st.workers[w].index, &flood_event(i), &mut c);
        st.publish(vec![Change {
            worker: w,
            delta: d,
            engine_ns: 0,
        }]);
        drop(st);
        stats.evicted.fetch_add(c.evicted, Relaxed);
    }
    let want: HashSet<u64> = hub.lock().workers[w]
        .index
        .blocks
        .snapshot()
        .into_iter()
        .collect();
    assert!(want.len() <= 2_000);
    // The stream's view converges on the relay's index: every eviction was announced.
    while held != want {
        follow(&mut held, &next(&mut s).await);
        assert!(held.len() <= 2_000 + 4_096, "{} held", held.len());
    }
    let m = kvroute_relay::metrics::render_metrics(&hub);
    let evicted = stats.evicted.load(Relaxed);
    assert_eq!(evicted, 40_000 - want.len() as u64);
    assert!(
        m.contains(&format!(
            "kvroute_relay_index_evicted_blocks_total{{worker=\"w\"}} {evicted}"
        )),
        "{m}"
    );
    assert!(
        m.contains("kvroute_relay_index_max_blocks{worker=\"w\"} 2000"),
        "{m}"
    );

    // A new stream's snapshot: at most the bound, in bytes too (8 per hash + framing).
    let mut s2 = watch(&url, BS).await.unwrap();
    let snap = next(&mut s2).await;
    assert_eq!(snap.phase, Phase::SnapshotEnd as i32);
    let n: usize = snap.workers.iter().map(|w| w.stored.len()).sum();
    assert_eq!(n, want.len());
    assert!(
        snap.encoded_len() <= 2_000 * 10 + 256,
        "{} bytes",
        snap.encoded_len()
    );
}

#[tokio::test]
async fn snapshots_are_cut_to_max_snapshot_blocks() {
    let limits = Limits {
        max_snapshot_blocks: 1_000,
        ..Limits::default()
    };
    let hub = Hub::with_limits(1, 16, limits);
    let (a, _) = hub.add_engine(&hand_fed("a"));
    let (b, _) = hub.add_engine(&hand_fed("b"));
    {
        let mut st = hub.lock();
        // a: 100 blocks; b: one chain of 5,000 (depth = position).
        for i in 0..100u64 {
            st.workers[a].index.blocks.insert(i, i, 0);
        }
        for i in 0..5_000u64 {
            st.workers[b]
                .index
                .blocks
                .insert(10_000 + i, 10_000 + i, i as u32);
        }
    }
    let url = start_relay(hub.clone()).await;
    let mut s = watch(&url, 1).await.unwrap();
    let u = next(&mut s).await;
    assert_eq!(u.phase, Phase::SnapshotEnd as i32);
    let by: Vec<(String, Vec<u64>)> = u
        .workers
        .iter()
        .map(|w| (w.worker.clone(), w.stored.clone()))
        .collect();
    assert_eq!(by[0].1.len(), 100, "the small engine keeps everything");
    // The large one gets the rest of the budget: its shallowest 900 blocks, in order.
    assert_eq!(by[1].1, (10_000..10_900).collect::<Vec<u64>>());
    assert_eq!(hub.stats.snapshot_truncated.load(Relaxed), 4_100);
    let m = kvroute_relay::metrics::render_metrics(&hub);
    assert!(
        m.contains("kvroute_relay_snapshot_truncated_blocks_total 4100"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_capped_per_client_and_in_total() {
    let limits = Limits {
        max_streams_per_client: 2,
        ..Limits::default()
    };
    let hub = Hub::with_limits(16, 16, limits);
    let url = start_relay(hub.clone()).await;
    let mut s1 = watch_as_gateway(&url, "g1", 16).await.unwrap();
    let _s2 = watch_as_gateway(&url, "g2", 16).await.unwrap();
    next(&mut s1).await;
    let local = Some("127.0.0.1".parse().unwrap());
    assert_eq!(hub.streams.open_from(local), 2);
    let err = watch_as_gateway(&url, "g3", 16)
        .await
        .expect_err("a third stream from one client");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(
        err.message().contains("--max-streams-per-client"),
        "{}",
        err.message()
    );
    assert_eq!(hub.stats.streams_refused_per_client.load(Relaxed), 1);
    // A closed stream gives its place back.
    drop(s1);
    for _ in 0..200 {
        if hub.streams.open_from(local) < 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut s3 = watch_as_gateway(&url, "g3", 16).await.unwrap();
    next(&mut s3).await;
    let m = kvroute_relay::metrics::render_metrics(&hub);
    assert!(
        m.contains("kvroute_relay_streams_refused_per_client_total 1"),
        "{m}"
    );

    // In total.
    let limits = Limits {
        max_streams: 2,
        ..Limits::default()
    };
    let hub = Hub::with_limits(16, 16, limits);
    let url = start_relay(hub.clone()).await;
    let _a = watch_as_gateway(&url, "a", 16).await.unwrap();
    let _b = watch_as_gateway(&url, "b", 16).await.unwrap();
    let err = watch_as_gateway(&url, "c", 16)
        .await
        .expect_err("over --max-streams");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(
        err.message().contains("--max-streams)"),
        "{}",
        err.message()
    );
    assert_eq!(hub.stats.streams_refused_total.load(Relaxed), 1);
    assert_eq!(hub.stats.streams_refused_per_client.load(Relaxed), 0);
}
