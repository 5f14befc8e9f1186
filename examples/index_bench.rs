//! Memory and speed of the prefix index at ~1M blocks.
//! `cargo run --release --example index_bench --no-default-features`
//!
//! Workload: 50 groups with a 200-block shared prefix; each chain is its group prefix plus
//! 1800 unique blocks (2000 blocks), routed to one worker, every other chain also to a second
//! worker (1.5 holders per unique block), until 1M distinct blocks are indexed.

use kvroute::ids::WorkerId;
use kvroute::index::PrefixIndex;
use std::hint::black_box;
use std::time::Instant;

const TARGET_BLOCKS: usize = 1_000_000;
const CHAIN: u64 = 2000;
const PREFIX: u64 = 200;
const GROUPS: u64 = 50;
const TTL_MS: u64 = 120_000;
const T0: u64 = 1_700_000_000_000;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn chain(c: u64) -> Vec<u64> {
    let g = c % GROUPS;
    (0..CHAIN)
        .map(|i| {
            if i < PREFIX {
                splitmix((1 << 62) | (g << 32) | i)
            } else {
                splitmix((c << 32) | i)
            }
        })
        .collect()
}

struct Filled {
    ix: PrefixIndex,
    chains: u64,
    inserted: u64,
    insert_ns: f64,
}

fn fill(workers: u64, reserve: bool) -> Filled {
    let mut ix = PrefixIndex::new(TTL_MS);
    if reserve {
        ix.reserve(TARGET_BLOCKS);
    }
    for w in 0..workers {
        ix.set_capacity(w as WorkerId, 1 << 20);
    }
    let chains: Vec<Vec<u64>> = (0..((TARGET_BLOCKS as u64 - GROUPS * PREFIX) / (CHAIN - PREFIX)
        + 1))
        .map(chain)
        .collect();
    let mut inserted = 0u64;
    let start = Instant::now();
    let mut c = 0u64;
    let mut worst = 0u128;
    for h in &chains {
        if ix.blocks() >= TARGET_BLOCKS {
            break;
        }
        let one = Instant::now();
        ix.insert((c % workers) as WorkerId, h, T0);
        worst = worst.max(one.elapsed().as_micros());
        inserted += h.len() as u64;
        if c.is_multiple_of(2) {
            ix.insert(((c + 1) % workers) as WorkerId, h, T0);
            inserted += h.len() as u64;
        }
        c += 1;
    }
    let insert_ns = start.elapsed().as_nanos() as f64 / inserted as f64;
    let holders: usize = (0..workers).map(|w| ix.entries(w as WorkerId)).sum();
    println!(
        "        fill {workers} workers (reserve: {reserve}): {} entries, {:.2} holders/block, slowest insert of a 2000-block chain {} µs",
        holders,
        holders as f64 / ix.blocks() as f64,
        worst
    );
    Filled {
        ix,
        chains: c,
        inserted,
        insert_ns,
    }
}

/// Mean µs per lookup of `prompts` (round robin), `out` sized for `workers`.
fn time_lookup(
    ix: &PrefixIndex,
    prompts: &[Vec<u64>],
    now: u64,
    workers: usize,
) -> (f64, Vec<u32>) {
    let mut out = vec![0u32; workers];
    let iters = 2000;
    let start = Instant::now();
    for i in 0..iters {
        let p = &prompts[i % prompts.len()];
        ix.lookup(black_box(p), now, &mut out);
        black_box(&out);
    }
    let us = start.elapsed().as_nanos() as f64 / iters as f64 / 1000.0;
    (us, out)
}

/// Steady state at capacity: every insert evicts, so table slots are freed and reused.
fn churn(target: usize) {
    let workers = 64u64;
    let mut ix = PrefixIndex::new(TTL_MS);
    ix.reserve(target);
    for w in 0..workers {
        ix.set_capacity(w as WorkerId, (target as u64 / workers) as u32);
    }
    let mut worst = 0u128;
    let mut total = 0u128;
    let mut steady = Vec::new();
    let rounds = 3 * target as u64 / (CHAIN - PREFIX);
    for c in 0..rounds {
        let h = chain(c);
        let one = Instant::now();
        ix.insert((c % workers) as WorkerId, &h, T0 + c);
        let us = one.elapsed().as_micros();
        total += us;
        if c > rounds / 3 {
            worst = worst.max(us);
            steady.push(us);
        }
    }
    steady.sort_unstable();
    println!(
        "        churn at capacity (64 x {} blocks, 3M inserts): {} blocks, {:.1} B/block, mean insert {} µs, steady p50 {} µs, slowest {} µs",
        target as u64 / workers,
        ix.blocks(),
        ix.memory_bytes() as f64 / ix.blocks() as f64,
        total / rounds as u128,
        steady.get(steady.len() / 2).copied().unwrap_or(0),
        worst
    );
}

fn main() {
    // `index_bench churn`: only the steady-state churn (the insert + eviction path).
    if std::env::args().nth(1).as_deref() == Some("churn") {
        let blocks = std::env::args()
            .nth(2)
            .and_then(|s| s.parse().ok())
            .unwrap_or(TARGET_BLOCKS);
        for _ in 0..3 {
            churn(blocks);
        }
        return;
    }
    println!(
        "{:>7} {:>9} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "workers",
        "blocks",
        "B/block",
        "ins ns/b",
        "touch ns/b",
        "hit µs",
        "miss µs",
        "hot µs",
        "stale µs",
        "µs/100b"
    );
    for workers in [8u64, 64, 256] {
        if workers == 64 {
            fill(workers, true);
        }
        let Filled {
            mut ix,
            chains,
            inserted,
            insert_ns,
        } = fill(workers, false);
        let blocks = ix.blocks();
        let bytes = ix.memory_bytes() as f64 / blocks as f64;

        // Stored chains: the holders match all 2000 blocks, the rest of the group 200.
        let stored: Vec<Vec<u64>> = (0..64).map(|i| chain(i * 7 % chains)).collect();
        let (hit, out) = time_lookup(&ix, &stored, T0, workers as usize);
        assert!(out.contains(&(CHAIN as u32)));
        // New chains in a known group: everyone in the group stops after the prefix.
        let fresh: Vec<Vec<u64>> = (0..64).map(|i| chain(1_000_000 + i)).collect();
        let (miss, _) = time_lookup(&ix, &fresh, T0, workers as usize);

        // Re-inserting a stored chain (a follow-up request): every block is a touch.
        let start = Instant::now();
        for (i, p) in stored.iter().enumerate() {
            ix.insert((i as u64 * 7 % chains % workers) as WorkerId, p, T0);
        }
        let touch_ns = start.elapsed().as_nanos() as f64 / (stored.len() as f64 * CHAIN as f64);

        // Worst case: one 2000-block prompt held by every worker.
        let hot = chain(2_000_000);
        for w in 0..workers {
            ix.insert(w as WorkerId, &hot, T0 + TTL_MS / 2);
        }
        let hot_v = vec![hot];
        let (hot_us, out) = time_lookup(&ix, &hot_v, T0 + TTL_MS / 2, workers as usize);
        assert!(out.iter().all(|&n| n == CHAIN as u32));
        // Same, after the fill expired but before `expire` ran: every worker has stale
        // entries, so every holder's stamp is read.
        let (stale_us, out) = time_lookup(&ix, &hot_v, T0 + TTL_MS + 1, workers as usize);
        assert!(out.iter().all(|&n| n == CHAIN as u32));

        println!(
            "{:>7} {:>9} {:>8.1} {:>9.1} {:>10.1} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
            workers,
            blocks,
            bytes,
            insert_ns,
            touch_ns,
            hit,
            miss,
            hot_us,
            stale_us,
            hit / (CHAIN as f64 / 100.0)
        );
        black_box(inserted);

        let start = Instant::now();
        let mut removed = 0;
        loop {
            let n = ix.expire(T0 + TTL_MS + 1, 4096);
            removed += n;
            if n == 0 {
                break;
            }
        }
        let _ = removed;
        if workers == 64 {
            println!(
                "        expire of {} entries in 4096-entry calls: {:.1} ns/entry",
                removed,
                start.elapsed().as_nanos() as f64 / removed.max(1) as f64
            );
        }
    }
    churn(TARGET_BLOCKS);
}
