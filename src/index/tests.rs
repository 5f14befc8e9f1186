//! `PrefixIndex` against its specification: unit cases, structural invariants after every
//! step, and a brute-force model (a `Vec` LRU per worker) under proptest.

use super::blocks::SPILLED;
use super::lru::{local_of, worker_of};
use super::*;
use crate::ids::mix;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

impl PrefixIndex {
    /// Entries of w that `lookup` at `now_ms` would count.
    fn fresh_entries(&self, w: usize, now_ms: u64) -> usize {
        let thr = self.threshold(now_ms);
        let Some(wk) = self.workers.get(w) else {
            return 0;
        };
        let mut l = wk.head;
        let mut n = 0;
        while let Some(node) = wk.nodes.get(l) {
            if self.holder_stamp(node.block, w).unwrap() as u64 >= thr {
                n += 1;
            }
            l = node.next;
        }
        n
    }

    /// Structural invariants; panics with a message when one is broken.
    fn check(&self) {
        let mut holders_total = 0usize;
        let mut live = 0usize;
        for i in 0..self.blocks_len {
            if !self.blocks.get(i).unwrap().is_free() {
                live += 1;
            }
        }
        assert_eq!(live, self.table.len(), "live slots not all indexed");
        for b in self.table.values() {
            let blk = self.blocks.get(b).expect("block slot");
            assert!(!blk.is_free());
            assert_eq!(
                self.find_block(blk.hash),
                Some(b),
                "table/block hash mismatch"
            );
            let ids: Vec<u32> = if blk.b == SPILLED {
                let o = self.holders.record(blk.a).expect("overflow record");
                assert!(o.held.len() >= 3, "overflow with {} holders", o.held.len());
                let mut bits = [0; 4];
                o.held
                    .iter()
                    .for_each(|&(id, _)| bit_set(&mut bits, worker_of(id)));
                assert_eq!(bits, o.bits);
                o.held.iter().map(|&(id, _)| id).collect()
            } else {
                assert_ne!(blk.a, NIL, "indexed block without holders");
                [blk.a, blk.b].into_iter().filter(|&x| x != NIL).collect()
            };
            let mut ws: Vec<usize> = ids.iter().map(|&id| worker_of(id)).collect();
            ws.sort_unstable();
            ws.dedup();
            assert_eq!(ws.len(), ids.len(), "worker twice in a holder set");
            for id in ids {
                let n = self.workers[worker_of(id)]
                    .nodes
                    .get(local_of(id))
                    .expect("node");
                assert_eq!(n.block, b);
                holders_total += 1;
            }
        }
        let mut nodes_total = 0usize;
        for (w, wk) in self.workers.iter().enumerate() {
            let mut l = wk.head;
            let mut prev = NIL;
            let mut n = 0u32;
            let mut last_stamp = u32::MAX;
            while l != NIL {
                let node = wk.nodes.get(l).expect("linked node");
                assert_eq!(node.prev, prev);
                let stamp = self
                    .holder_stamp(node.block, w)
                    .expect("listed node not a holder");
                assert!(stamp <= last_stamp, "LRU list not sorted by stamp");
                last_stamp = stamp;
                prev = l;
                l = node.next;
                n += 1;
            }
            assert_eq!(wk.tail, prev);
            assert_eq!(n, wk.count);
            assert!(wk.count <= wk.cap);
            if wk.count > 0 {
                assert_eq!(wk.tail_stamp, last_stamp, "cached tail stamp");
            }
            nodes_total += n as usize;
        }
        assert_eq!(nodes_total, holders_total);
    }

    fn find_block(&self, h: u64) -> Option<u32> {
        self.locate(h, &mut Cursor::new(1))
    }
}

const T0: u64 = 1_700_000_000_000;

fn look(ix: &PrefixIndex, hashes: &[u64], now: u64, n: usize) -> Vec<u32> {
    let mut out = vec![u32::MAX; n];
    ix.lookup(hashes, now, &mut out);
    out
}

#[test]
fn leading_run_stops_at_first_hole() {
    let mut ix = PrefixIndex::new(60_000);
    ix.insert(0, &[1, 2, 3, 4], T0);
    ix.insert(1, &[1, 2, 4], T0);
    ix.insert(2, &[2, 3], T0);
    assert_eq!(look(&ix, &[1, 2, 3, 4, 5], T0, 4), vec![4, 2, 0, 0]);
    assert_eq!(look(&ix, &[9, 1], T0, 3), vec![0, 0, 0]);
    assert_eq!(look(&ix, &[], T0, 3), vec![0, 0, 0]);
    assert_eq!(look(&ix, &[1, 2, 3, 4], T0, 1), vec![4]);
    ix.check();
}

#[test]
fn capacity_evicts_least_recently_used_deepest_first() {
    let mut ix = PrefixIndex::new(60_000);
    ix.set_capacity(0, 4);
    ix.insert(0, &[1, 2, 3], T0);
    ix.insert(0, &[10, 11], T0 + 1);
    // LRU order now (old -> new): 3, 2, 1, 11, 10 minus one eviction: 3 went first.
    assert_eq!(ix.entries(0), 4);
    assert_eq!(look(&ix, &[1, 2, 3], T0 + 1, 1), vec![2]);
    ix.insert(0, &[1], T0 + 2); // touch 1: now 2 is least recently used
    ix.insert(0, &[20], T0 + 3);
    assert_eq!(look(&ix, &[1, 2], T0 + 3, 1), vec![1]);
    assert_eq!(look(&ix, &[10, 11], T0 + 3, 1), vec![2]);
    // A prompt longer than the capacity keeps its first blocks.
    ix.insert(0, &[30, 31, 32, 33, 34, 35], T0 + 4);
    assert_eq!(look(&ix, &[30, 31, 32, 33, 34, 35], T0 + 4, 1), vec![4]);
    assert_eq!(ix.blocks(), 4);
    ix.check();
}

#[test]
fn capacity_is_per_worker_and_shrinking_evicts() {
    let mut ix = PrefixIndex::new(60_000);
    ix.set_capacity(1, 2);
    ix.insert(0, &[1, 2, 3], T0);
    ix.insert(1, &[1, 2, 3], T0);
    assert_eq!((ix.entries(0), ix.entries(1)), (3, 2));
    ix.set_capacity(0, 1);
    assert_eq!(look(&ix, &[1, 2, 3], T0, 2), vec![1, 2]);
    ix.set_capacity(0, 0);
    ix.insert(0, &[1, 2], T0);
    assert_eq!(ix.entries(0), 0);
    assert_eq!(ix.entries(5), 0);
    ix.check();
}

#[test]
fn ttl_expiry_and_refresh() {
    let mut ix = PrefixIndex::new(1000);
    ix.insert(0, &[1, 2, 3], T0);
    ix.insert(1, &[1, 2], T0 + 500);
    assert_eq!(look(&ix, &[1, 2, 3], T0 + 1000, 2), vec![3, 2]);
    assert_eq!(look(&ix, &[1, 2, 3], T0 + 1001, 2), vec![0, 2]);
    // Refresh the first block only: the hole at block 2 stops the run.
    ix.insert(0, &[1], T0 + 1001);
    assert_eq!(look(&ix, &[1, 2, 3], T0 + 1002, 2), vec![1, 2]);
    assert_eq!((ix.fresh_entries(0, T0 + 1002), ix.entries(0)), (1, 3));
    assert_eq!(ix.expire(T0 + 1002, usize::MAX), 2);
    assert_eq!((ix.entries(0), ix.entries(1), ix.blocks()), (1, 2, 2));
    assert_eq!(ix.expire(T0 + 5000, usize::MAX), 3);
    assert_eq!(ix.blocks(), 0);
    assert_eq!(look(&ix, &[1], T0 + 5000, 2), vec![0, 0]);
    ix.check();
}

#[test]
fn expire_is_bounded_and_resumes() {
    let mut ix = PrefixIndex::new(10);
    let hashes: Vec<u64> = (0..100).collect();
    ix.insert(3, &hashes, T0);
    ix.insert(200, &hashes, T0);
    let mut total = 0;
    let mut calls = 0;
    loop {
        let n = ix.expire(T0 + 100, 16);
        assert!(n <= 16);
        total += n;
        calls += 1;
        if n == 0 && ix.blocks() == 0 {
            break;
        }
        assert!(calls < 100, "expire makes no progress");
    }
    assert_eq!(total, 200);
    assert_eq!(ix.expire(T0 + 100, 0), 0);
    ix.check();
}

#[test]
fn truncate_drops_only_the_tail_of_one_worker() {
    let mut ix = PrefixIndex::new(60_000);
    ix.insert(0, &[1, 2, 3, 4], T0);
    ix.insert(1, &[1, 2, 3, 4], T0);
    ix.truncate(0, &[1, 2, 3, 4], 1);
    assert_eq!(look(&ix, &[1, 2, 3, 4], T0, 2), vec![1, 4]);
    assert_eq!(ix.entries(0), 1);
    ix.truncate(1, &[1, 2, 3, 4], 9);
    ix.truncate(1, &[1, 2, 3, 4], 4);
    assert_eq!(ix.entries(1), 4);
    ix.truncate(1, &[1, 2, 3, 4], 0);
    assert_eq!((ix.entries(1), ix.blocks()), (0, 1));
    ix.check();
}

#[test]
fn all_256_workers_including_0_and_255() {
    let mut ix = PrefixIndex::new(60_000);
    for w in 0..MAX_WORKERS as u16 {
        ix.insert(w, &[1, 2, 3], T0);
    }
    ix.insert(0, &[4], T0);
    ix.insert(255, &[4, 5], T0);
    let out = look(&ix, &[1, 2, 3, 4, 5], T0, MAX_WORKERS);
    assert_eq!(out[0], 4);
    assert_eq!(out[255], 5);
    assert!(out[1..255].iter().all(|&n| n == 3));
    let out = look(&ix, &[4, 5], T0, MAX_WORKERS);
    assert_eq!((out[0], out[1], out[255]), (1, 0, 2));
    ix.check();
    for w in 0..MAX_WORKERS as u16 - 1 {
        ix.truncate(w, &[1, 2, 3], 0);
    }
    ix.check();
    assert_eq!(look(&ix, &[1, 2, 3], T0, MAX_WORKERS)[255], 3);
    assert_eq!(ix.blocks(), 5);
}

#[test]
fn out_of_range_workers_are_ignored() {
    let mut ix = PrefixIndex::new(60_000);
    for w in [256u16, 1000, u16::MAX] {
        ix.set_capacity(w, 5);
        ix.insert(w, &[1, 2], T0);
        ix.truncate(w, &[1, 2], 0);
        assert_eq!(ix.entries(w), 0);
    }
    assert_eq!(ix.blocks(), 0);
    ix.insert(1, &[1, 2], T0);
    let out = look(&ix, &[1, 2], T0, 300);
    assert_eq!(out[1], 2);
    assert!(out[256..].iter().all(|&n| n == 0));
    ix.lookup(&[1, 2], T0, &mut []);
    ix.check();
}

#[test]
fn odd_clocks_and_duplicate_hashes_do_not_break_it() {
    let mut ix = PrefixIndex::new(u64::MAX);
    ix.insert(0, &[1, 1, 2, 1], T0);
    assert_eq!(ix.entries(0), 2);
    ix.insert(0, &[3], T0 - 5000); // clock going backwards stamps with the latest time
    ix.insert(0, &[4], 0);
    ix.insert(0, &[5], u64::MAX);
    assert_eq!(look(&ix, &[5], u64::MAX, 1), vec![1]);
    assert_eq!(look(&ix, &[1], 0, 1), vec![0]); // expired: older than MAX_TTL_MS
    ix.lookup(&[1, 2, 3], u64::MAX, &mut [0; 3]);
    ix.expire(u64::MAX, usize::MAX);
    ix.check();
    ix.truncate(0, &[], usize::MAX);
}

#[test]
fn rebase_keeps_fresh_entries_exact() {
    let mut ix = PrefixIndex::new(MAX_TTL_MS);
    ix.insert(0, &[1, 2], T0);
    let t1 = T0 + (u32::MAX as u64) - 10;
    ix.insert(1, &[1, 2, 3], t1); // no rebase yet
    let t2 = t1 + 100; // forces a rebase; worker 0 is older than 2^31 ms: dropped
    ix.insert(2, &[1], t2);
    assert_eq!(look(&ix, &[1, 2, 3], t2, 3), vec![0, 3, 1]);
    assert_eq!(ix.entries(0), 0);
    ix.check();
    assert_eq!(look(&ix, &[1, 2, 3], t1 + MAX_TTL_MS, 3), vec![0, 3, 1]);
    assert_eq!(look(&ix, &[1, 2, 3], t1 + MAX_TTL_MS + 1, 3), vec![0, 0, 1]);
}

#[test]
fn reserve_presizes_without_changing_contents() {
    let mut ix = PrefixIndex::new(60_000);
    ix.insert(4, &[1, 2, 3], T0);
    let before = ix.memory_bytes();
    ix.reserve(100_000);
    assert!(ix.memory_bytes() >= before + 100_000 * 5);
    let table = ix.table.allocation_size();
    let hashes: Vec<u64> = (10..100_000).collect();
    ix.insert(5, &hashes, T0);
    assert_eq!(
        ix.table.allocation_size(),
        table,
        "table grew after reserve"
    );
    assert_eq!(look(&ix, &[1, 2, 3], T0, 6)[4..], [3, 0]);
    ix.check();
}

#[test]
fn memory_estimate_is_sane() {
    let mut ix = PrefixIndex::new(60_000);
    let empty = ix.memory_bytes();
    assert!(empty < 64 * 1024, "empty index uses {empty} bytes");
    let n = 100_000u64;
    for c in 0..(n / 1000) {
        let hashes: Vec<u64> = (0..1000).map(|i| mix(c * 1000 + i + 1)).collect();
        ix.insert((c % 16) as u16, &hashes, T0);
        if c % 2 == 0 {
            ix.insert((c % 16 + 1) as u16, &hashes, T0);
        }
    }
    assert_eq!(ix.probes_given_up(), 0);
    assert_eq!(ix.blocks(), n as usize);
    let per_block = ix.memory_bytes() as f64 / n as f64;
    // Lower bound: 24-byte block + 1.5 x 12-byte nodes; upper bound: the 64-byte target.
    assert!(
        (40.0..64.0).contains(&per_block),
        "{per_block} bytes per block"
    );
    ix.check();
}

#[cfg(not(target_arch = "wasm32"))]
mod props {
    use super::*;
    use proptest::prelude::*;

    const WORKERS: u16 = 6;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u16, Vec<u64>),
        Lookup(Vec<u64>),
        Truncate(u16, Vec<u64>, usize),
        Expire(usize),
        Advance(u64),
        SetCap(u16, u32),
    }

    fn worker() -> impl Strategy<Value = u16> {
        prop_oneof![8 => 0..WORKERS, 1 => Just(300u16)]
    }

    fn hashes() -> impl Strategy<Value = Vec<u64>> {
        prop::collection::vec(0u64..12, 0..9)
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (worker(), hashes()).prop_map(|(w, h)| Op::Insert(w, h)),
            6 => hashes().prop_map(Op::Lookup),
            2 => (worker(), hashes(), 0usize..10).prop_map(|(w, h, k)| Op::Truncate(w, h, k)),
            2 => (0usize..12).prop_map(Op::Expire),
            4 => prop_oneof![10 => 0u64..40, 1 => Just(5_000_000_000u64)].prop_map(Op::Advance),
            1 => (worker(), 0u32..9).prop_map(|(w, c)| Op::SetCap(w, c)),
        ]
    }

    /// Per worker: Vec-based LRU, front = least recently used, (hash, touched_ms).
    struct Model {
        ttl: u64,
        caps: Vec<u32>,
        lru: Vec<Vec<(u64, u64)>>,
    }

    impl Model {
        fn fresh(&self, w: usize, h: u64, now: u64) -> bool {
            self.lru[w]
                .iter()
                .any(|&(x, t)| x == h && now.saturating_sub(t) <= self.ttl)
        }

        fn insert(&mut self, w: usize, hashes: &[u64], now: u64) {
            let hashes = &hashes[..hashes.len().min(self.caps[w] as usize)];
            for &h in hashes.iter().rev() {
                let l = &mut self.lru[w];
                if let Some(p) = l.iter().position(|&(x, _)| x == h) {
                    l.remove(p);
                } else if self.caps[w] == 0 {
                    continue;
                }
                l.push((h, now));
                if l.len() > self.caps[w] as usize {
                    l.remove(0);
                }
            }
        }

        fn lookup(&self, hashes: &[u64], now: u64, n: usize) -> Vec<u32> {
            (0..n)
                .map(|w| {
                    if w >= self.lru.len() {
                        return 0;
                    }
                    hashes
                        .iter()
                        .take_while(|&&h| self.fresh(w, h, now))
                        .count() as u32
                })
                .collect()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
        #[test]
        fn matches_brute_force_model(
            ttl in 0u64..100,
            start in prop_oneof![Just(0u64), Just(1_700_000_000_000u64), Just(u64::MAX / 2)],
            caps in prop::collection::vec(1u32..9, WORKERS as usize),
            ops in prop::collection::vec(op(), 1..80),
        ) {
            let mut ix = PrefixIndex::new(ttl);
            let mut m = Model { ttl, caps: caps.clone(), lru: vec![Vec::new(); WORKERS as usize] };
            for (w, &c) in caps.iter().enumerate() {
                ix.set_capacity(w as u16, c);
            }
            let mut now = start;
            for op in ops {
                match op {
                    Op::Insert(w, h) => {
                        ix.insert(w, &h, now);
                        if w < WORKERS {
                            m.insert(w as usize, &h, now);
                        }
                    }
                    Op::Lookup(h) => {
                        let n = WORKERS as usize + 2;
                        let mut out = vec![u32::MAX; n];
                        ix.lookup(&h, now, &mut out);
                        prop_assert_eq!(out, m.lookup(&h, now, n), "lookup {:?} at {}", h, now);
                    }
                    Op::Truncate(w, h, keep) => {
                        ix.truncate(w, &h, keep);
                        if w < WORKERS {
                            let drop: Vec<u64> = h.get(keep..).unwrap_or(&[]).to_vec();
                            m.lru[w as usize].retain(|(x, _)| !drop.contains(x));
                        }
                    }
                    Op::Expire(k) => {
                        // The model keeps expired entries: they are invisible to lookups and
                        // always the least recently used, so evicting them or not is the same.
                        prop_assert!(ix.expire(now, k) <= k);
                    }
                    Op::Advance(dt) => now = now.saturating_add(dt),
                    Op::SetCap(w, c) => {
                        ix.set_capacity(w, c);
                        if w < WORKERS {
                            m.caps[w as usize] = c;
                            let l = &mut m.lru[w as usize];
                            while l.len() > c as usize {
                                l.remove(0);
                            }
                        }
                    }
                }
                ix.check();
                for w in 0..WORKERS as usize {
                    let fresh = m.lru[w].iter().filter(|&&(_, t)| now.saturating_sub(t) <= ttl).count();
                    prop_assert_eq!(ix.fresh_entries(w, now), fresh, "worker {}", w);
                    prop_assert!(ix.entries(w as u16) <= m.lru[w].len());
                }
            }
            ix.expire(now, usize::MAX);
            ix.check();
            let mut distinct = std::collections::BTreeSet::new();
            for w in 0..WORKERS as usize {
                let fresh: Vec<u64> = m.lru[w].iter().filter(|&&(_, t)| now.saturating_sub(t) <= ttl).map(|&(h, _)| h).collect();
                prop_assert_eq!(ix.entries(w as u16), fresh.len());
                distinct.extend(fresh);
            }
            prop_assert_eq!(ix.blocks(), distinct.len());
        }
    }
}

/// Inverse of `mix` (xorshift and odd multiply are bijections), to craft hashes that land
/// where an attacker wants.
fn unmix(y: u64) -> u64 {
    fn unshift(y: u64, s: u32) -> u64 {
        let mut x = y;
        for _ in 0..64 / s + 1 {
            x = y ^ (x >> s);
        }
        x
    }
    let c: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut inv = c;
    for _ in 0..6 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(inv)));
    }
    unshift(unshift(y, 29).wrapping_mul(inv), 31)
}

/// Block hashes whose mixed value (under `key`, or the public `mix` when None) shares its
/// top 24 bits: one home line in any table of up to 16M lines.
fn colliding(n: u64, key: Option<u64>) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let m = 0xABCD_EF00_0000_0000 | (i + 1) << 8 | (i % 255 + 1);
            match key {
                None => unmix(m),
                Some(k) => unmix(unmix(m) ^ k.rotate_left(32)) ^ k,
            }
        })
        .collect()
}

#[test]
fn crafted_collisions_for_the_public_mix_spread_under_a_key() {
    let key = 0x1234_5678_9abc_def1;
    let hashes = colliding(4096, None);
    assert!(hashes.iter().all(|&h| mix(h) >> 40 == 0xAB_CDEF));
    let mut homes: Vec<u64> = hashes.iter().map(|&h| keyed_mix(h, key) >> 48).collect();
    homes.sort_unstable();
    homes.dedup();
    assert!(homes.len() > 3900, "{} distinct homes of 4096", homes.len());
    let mut ix = PrefixIndex::with_key(60_000, key);
    ix.reserve(8192);
    ix.insert(0, &hashes, T0);
    assert_eq!(ix.probes_given_up(), 0);
    assert_eq!(look(&ix, &hashes, T0, 1), vec![4096]);
    ix.check();
}

#[test]
fn probes_are_bounded_when_the_key_is_known() {
    let key = 77;
    let flood = colliding(2000, Some(key));
    assert!(flood.iter().all(|&h| keyed_mix(h, key) >> 40 == 0xAB_CDEF));
    let mut ix = PrefixIndex::with_key(60_000, key);
    ix.reserve(8192);
    ix.insert(0, &flood, T0);
    // With the key known, the flood fills at most MAX_PROBE_LINES lines past its home line;
    // the rest gives up at once (counted) instead of walking the table.
    let held = ix.entries(0);
    assert!(held <= table::MAX_PROBE_LINES * 12, "{held}");
    assert!(held >= 12, "{held}");
    assert!(ix.probes_given_up() >= (2000 - held) as u64);
    // The blocks that did go in are found; an honest prompt is unaffected.
    let found = flood
        .iter()
        .filter(|&&h| look(&ix, &[h], T0, 1) == vec![1])
        .count();
    assert_eq!(found, held);
    assert!(held < 2000);
    let honest: Vec<u64> = (1..=500).map(|i| i * 7919).collect();
    // Keys homed at the start of the flooded run of lines are refused too (a few); the
    // rest of an honest prompt is indexed.
    ix.insert(1, &honest, T0);
    let found = honest
        .iter()
        .filter(|&&h| look(&ix, &[h], T0, 2) == vec![0, 1])
        .count();
    assert!(found >= 490, "{found} of 500");
    ix.check();
}
