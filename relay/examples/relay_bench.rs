//! Throughput of the relay's hot path on one core: decode a vLLM batch, re-key its stored
//! blocks, apply it to the index (and build the delta streams would get). Also reports the
//! index's bytes per indexed block.
//!
//!     cargo run --release -p kvroute-relay --example relay_bench [-- BLOCKS_HELD]

use kvroute_relay::decode::decode_batch;
use kvroute_relay::index::{Counts, DeltaBuilder, EngineIndex};
use kvroute_relay::vllm::{batch, Ev, Hash};
use std::time::Instant;

const BS: u32 = 16;
const PER_EVENT: usize = 8;

/// One batch: a chain of PER_EVENT new blocks (half the time continuing the previous chain),
/// plus the eviction of the PER_EVENT blocks stored `held` blocks ago (steady state).
fn payloads(n: usize, held: usize, bytes_hashes: bool, map: bool) -> Vec<Vec<u8>> {
    let h = |i: usize| {
        if bytes_hashes {
            Hash::Bytes(
                (i as u64)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    .to_be_bytes()
                    .repeat(4),
            )
        } else {
            Hash::Int((i as i64).wrapping_mul(0x2545_f491_4f6c_dd1d))
        }
    };
    let mut out = Vec::with_capacity(n);
    let mut next = 0usize;
    for b in 0..n {
        let parent = (b % 2 == 1 && next > 0).then(|| h(next - 1));
        let hashes: Vec<Hash> = (next..next + PER_EVENT).map(h).collect();
        let tokens: Vec<u32> = (0..PER_EVENT as u32 * BS)
            .map(|t| (t.wrapping_mul(2_654_435_761) ^ b as u32) % 128_000)
            .collect();
        let mut evs = vec![Ev::Stored {
            hashes,
            parent,
            tokens,
            block_size: BS,
            lora_name: None,
        }];
        if next >= held {
            evs.push(Ev::Removed(
                (next - held..next - held + PER_EVENT).map(h).collect(),
            ));
        }
        next += PER_EVENT;
        out.push(batch(&evs, map));
    }
    out
}

fn run(label: &str, held: usize, bytes_hashes: bool, map: bool) {
    let n = held / PER_EVENT + 200_000;
    let ps = payloads(n, held, bytes_hashes, map);
    let bytes: usize = ps.iter().map(Vec::len).sum();
    // Bound above what the run holds: this measures the steady state, not eviction.
    let mut ix = EngineIndex::with_max_blocks("meta-llama/Llama-3.1-8B-Instruct", BS, 2 * held);
    let mut c = Counts::default();
    let mut sent = 0usize;
    let t = Instant::now();
    for p in &ps {
        let b = decode_batch(p).expect("decodes");
        let mut d = DeltaBuilder::default();
        for e in &b.events {
            ix.apply(e, &mut d, &mut c);
        }
        sent += d.finish().stored.len();
    }
    let secs = t.elapsed().as_secs_f64();
    let events = c.blocks_stored + c.blocks_removed;
    println!(
        "{label:<34} {:>9.0} block events/s  ({} stored + {} removed in {secs:.2} s, {:.1} MB/s of payload, {sent} hashes in deltas)",
        events as f64 / secs,
        c.blocks_stored,
        c.blocks_removed,
        bytes as f64 / secs / 1e6,
    );
    println!(
        "{:<34} {} blocks indexed, {} bytes, {:.1} bytes/block",
        "",
        ix.blocks.len(),
        ix.blocks.bytes(),
        ix.blocks.bytes() as f64 / ix.blocks.len().max(1) as f64
    );
    assert_eq!(c.orphans + c.bad_events + c.size_mismatch + c.evicted, 0);
}

fn main() {
    let held: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    println!(
        "decode + re-key + apply, one thread, {PER_EVENT} blocks of {BS} tokens per BlockStored, {held} blocks held:"
    );
    run("array form, int hashes", held, false, false);
    run("map form, int hashes", held, false, true);
    run("array form, 32-byte hashes", held, true, false);
    // Bytes per block over a range of sizes (hash tables grow in powers of two).
    println!("bytes per indexed block (index is also the snapshot set):");
    for n in [10_000usize, 100_000, 500_000, 1_000_000, 2_000_000] {
        let mut ix = EngineIndex::with_max_blocks("m", 1, n);
        for i in 0..n as u64 {
            ix.blocks
                .insert(i.wrapping_mul(0x9e37_79b9_7f4a_7c15), i, 0);
        }
        println!(
            "  {n:>9} blocks: {:.1} bytes/block",
            ix.blocks.bytes() as f64 / n as f64
        );
    }
}
