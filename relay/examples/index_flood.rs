//! Memory of the relay under an index flood: one engine publishes BLOCKS never-removed blocks
//! (chains of 8, as a hostile or broken engine could), applied and published exactly as the
//! engine task does. Prints the blocks held, the index's bytes, a new stream's snapshot size
//! and the process's RSS, with the default limits and with none (the relay before limits).
//!
//!     cargo run --release -p kvroute-relay --example index_flood [-- BLOCKS [unbounded]]

use kvroute::precise::wire::{Phase, Update, WorkerDelta};
use kvroute_relay::decode::decode_batch;
use kvroute_relay::hub::{Change, EngineSpec, Hub, Limits};
use kvroute_relay::index::{Counts, DeltaBuilder};
use kvroute_relay::vllm::{batch, chain};
use prost::Message as _;

const BS: u32 = 16;

fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let blocks: usize = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let unbounded = args.next().as_deref() == Some("unbounded");
    let limits = if unbounded {
        Limits {
            kv_blocks: u64::MAX,
            index_factor: 1,
            max_snapshot_blocks: usize::MAX,
            ..Limits::default()
        }
    } else {
        Limits::default()
    };
    let hub = Hub::with_limits(BS, 1024, limits);
    let spec = EngineSpec {
        name: "flood".into(),
        endpoint: "tcp://127.0.0.1:1".into(),
        replay: None,
        model: "m".into(),
        kv_blocks: None,
    };
    let (w, _) = hub.add_engine(&spec);
    let rss0 = rss_kib("VmRSS:");
    let mut c = Counts::default();
    for i in 0..(blocks / 8) as i64 {
        let parent = (i % 2 == 1).then_some(i * 8 - 1);
        let payload = batch(&[chain(parent, i * 8, 8, BS, i as u32 * 128)], false);
        let b = decode_batch(&payload).expect("decodes");
        let mut d = DeltaBuilder::default();
        let mut st = hub.lock();
        for e in &b.events {
            st.workers[w].index.apply(e, &mut d, &mut c);
        }
        st.publish(vec![Change {
            worker: w,
            delta: d.finish(),
            engine_ns: 0,
        }]);
    }
    let (held, bytes, max, parts) = {
        let st = hub.lock();
        let ix = &st.workers[w].index.blocks;
        let (parts, _) = st.snapshot_parts(hub.limits.max_snapshot_blocks);
        (ix.len(), ix.bytes(), ix.max(), parts)
    };
    let snapshot = Update {
        phase: Phase::SnapshotEnd as i32,
        workers: parts
            .into_iter()
            .map(|(worker, stale, stored)| WorkerDelta {
                worker,
                cleared: true,
                stored,
                removed: Vec::new(),
                stale,
            })
            .collect(),
        ..Update::default()
    };
    println!(
        "{}: {} blocks stored, {held} held (bound {}), {} evicted; index {:.1} MiB; snapshot {:.2} MB; RSS {:.1} MiB at start, {:.1} MiB after (peak {:.1} MiB)",
        if unbounded { "no limits" } else { "default limits" },
        c.blocks_stored,
        if unbounded { "none".to_owned() } else { max.to_string() },
        c.evicted,
        bytes as f64 / 1048576.0,
        snapshot.encoded_len() as f64 / 1e6,
        rss0 as f64 / 1024.0,
        rss_kib("VmRSS:") as f64 / 1024.0,
        rss_kib("VmHWM:") as f64 / 1024.0,
    );
}
