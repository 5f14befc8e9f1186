//! Approximate prefix index: block hash -> the workers believed to hold that block in KV cache.
//!
//! Each worker has its own LRU bounded by its KV capacity in blocks, and every entry has a TTL,
//! because without KV events from the engines our view can only age out (Dynamo's approximate
//! mode, llm-d's per-server LRU).
//!
//! # Layout (45-55 bytes per block measured at 1M blocks with 1.03-1.65 holders per block)
//! - `table.rs`: `SlotTable` of block slots, open addressing over 64-byte lines of 12 slots
//!   (12 one-byte tags, a spill count, 12 u32 slots), sized for 3/4 load: ~7 bytes per block,
//!   and finding, adding or removing a key reads one cache line unless its home line
//!   overflowed. The 64-bit hash lives in the block record, not in the table.
//! - `blocks.rs`: paged slab of 24-byte records `{hash, a, b, sa, sb}`.
//! - `holders.rs`: a record holds up to two holders inline (node id + touch stamp each), the
//!   common case. A third holder spills the set into an `Overflow` record (256-bit worker
//!   bitset + (node id, stamp) pairs), so a hot shared prefix costs one bitset read per block
//!   on lookup, whatever the number of holders.
//! - `lru.rs`: per-worker paged node slab: 12-byte nodes `{prev, next, block}` forming an
//!   intrusive doubly linked LRU list. The worker is not stored: it is implied by the slab and
//!   encoded in the node id (`worker << 24 | local`). Stamps sit in the block record rather
//!   than the node so a lookup reads one record per block, never the nodes.
//! - stamps are u32 milliseconds since `epoch`; the epoch is rebased (O(entries), once per ~24
//!   days of uptime) before they would overflow.
//!
//! Paged slabs instead of `Vec`s keep capacity slack to one page per slab (a doubling `Vec`
//! wastes up to half its allocation) and never copy tens of MB on growth inside a request.
//!
//! A prompt's blocks are created together, so they sit in adjacent slots; lookups and inserts
//! try the neighbour of the previous block's slot before probing the hash table, which turns
//! most per-block cache misses into sequential reads.
//!
//! Inserting new blocks is bound by cache misses (its table line; the record, node and table
//! line of the LRU entry each one evicts). `insert` loads them for the next 32 hashes in tight
//! loops of independent reads before doing the work, so the misses overlap instead of
//! following one another (no prefetch instructions: the filter runs as wasm). Eviction reuses
//! the evicted node for the new entry, and the LRU tail stamp is re-read once per `insert`.
//!
//! # Semantics
//! - An entry is expired when `now_ms - touched_ms > ttl_ms`; expired entries are misses for
//!   `lookup` even before `expire` frees them.
//! - Time is made monotonic internally: an `insert` with an earlier `now_ms` than a previous one
//!   stamps with the latest time seen, so each LRU list stays sorted by stamp and expired
//!   entries are always at its tail (that is what makes `expire` cheap).
//! - `insert` touches `hashes` from last to first, so the first blocks of a prompt end up most
//!   recently used and capacity eviction takes the deepest blocks first. Evicting a prompt's
//!   first block would make the rest of it useless to a leading-run lookup; engines evict
//!   leaf-first for the same reason.

mod blocks;
mod holders;
mod lru;
mod speculative;
mod table;

pub use speculative::{Pending, Speculative};

use crate::ids::{keyed_mix, WorkerId, MAX_WORKERS};
use blocks::{Block, Pages, BLOCK_PAGE, FREE, FREE_BLOCK, NIL};
use holders::{any, bit_set, Bits, OverflowPool};
use lru::{Worker, LOCAL_LIMIT};
use table::{Probe, SlotTable};

/// Capacity of a worker whose capacity was never set: 16384 blocks of 64 tokens (the Dynamo
/// mocker default), expressed in 16-token blocks (vLLM's default block size).
const DEFAULT_CAPACITY: u32 = 16384 * 4;

/// Largest per-worker capacity; node ids keep the worker in their top 8 bits.
const MAX_CAPACITY: u32 = LOCAL_LIMIT;

/// Longest TTL; longer values are clamped. Stamps are u32 ms and a rebase keeps 2^31 ms of
/// history, so entries older than that must already be expired for the rebase to be exact.
const MAX_TTL_MS: u64 = (1 << 31) - 1;

const REBASE_KEEP_MS: u64 = 1 << 31;
/// Hashes an `insert` prepares (loads ahead) at a time.
const WARM_CHUNK: usize = 32;

/// Block hash -> workers holding it, with per-worker LRU capacity and TTL.
pub struct PrefixIndex {
    table: SlotTable,
    blocks: Pages<Block, BLOCK_PAGE>,
    blocks_len: u32,
    blocks_free: u32,
    holders: OverflowPool,
    workers: Vec<Worker>,
    ttl: u64,
    /// Absolute ms of stamp 0.
    epoch: u64,
    /// Latest `now_ms` seen by `insert` (time made monotonic).
    clock: u64,
    /// Next worker `expire` looks at, so bounded calls make progress over all workers.
    expire_cursor: usize,
    /// Secret key of the table hashing (`keyed_mix`): crafted prompts cannot pile up.
    key: u64,
}

impl PrefixIndex {
    /// `ttl_ms`: entries not touched for longer are misses. Clamped to `MAX_TTL_MS`.
    pub fn new(ttl_ms: u64) -> Self {
        Self::with_key(ttl_ms, 0)
    }

    /// `new` with the table hashed under a secret `key` (the filter supplies one per VM).
    pub fn with_key(ttl_ms: u64, key: u64) -> Self {
        PrefixIndex {
            table: SlotTable::new(),
            blocks: Pages::new(),
            blocks_len: 0,
            blocks_free: NIL,
            holders: OverflowPool::default(),
            workers: (0..MAX_WORKERS)
                .map(|_| Worker::new(DEFAULT_CAPACITY))
                .collect(),
            ttl: ttl_ms.min(MAX_TTL_MS),
            epoch: 0,
            clock: 0,
            expire_cursor: 0,
            key,
        }
    }

    /// KV capacity of worker w in blocks: its LRU never holds more (evict least recently used
    /// first). Clamped to `MAX_CAPACITY`; 0 makes the worker hold nothing.
    pub fn set_capacity(&mut self, w: WorkerId, blocks: u32) {
        let wi = w as usize;
        let Some(wk) = self.workers.get_mut(wi) else {
            return;
        };
        wk.cap = blocks.min(MAX_CAPACITY);
        self.evict_to(wi, blocks.min(MAX_CAPACITY));
    }

    /// Table probes that gave up at the probe bound (a flood of colliding blocks: those
    /// blocks are not indexed).
    pub fn probes_given_up(&self) -> u64 {
        self.table.probes_given_up()
    }

    /// Pre-size the hash table for `blocks` distinct blocks. Growing it later rehashes every
    /// entry inside one `insert` (tens of ms at 1M blocks), so a filter should reserve its
    /// expected size at configuration time.
    pub fn reserve(&mut self, blocks: usize) {
        let table_blocks = &self.blocks;
        let key = self.key;
        self.table.reserve(blocks, |b| {
            table_blocks.get(b).map_or(0, |x| keyed_mix(x.hash, key))
        });
    }

    /// Number of leading blocks of `hashes` each worker holds: out[w] for w < out.len().
    /// Counting stops for a worker at its first miss; expired entries are misses. Slots at or
    /// beyond `MAX_WORKERS` are set to 0.
    pub fn lookup(&self, hashes: &[u64], now_ms: u64, out: &mut [u32]) {
        out.iter_mut().for_each(|o| *o = 0);
        let thr = self.threshold(now_ms);
        let mut active: Bits = [0; 4];
        let mut stale: Bits = [0; 4];
        for (w, wk) in self.workers.iter().enumerate().take(out.len()) {
            if wk.count > 0 {
                bit_set(&mut active, w);
                if (wk.tail_stamp as u64) < thr {
                    bit_set(&mut stale, w);
                }
            }
        }
        if !any(&active) {
            return;
        }
        let mut cursor = Cursor::new(1u32.wrapping_neg());
        for (i, &h) in hashes.iter().enumerate() {
            let held = match self.locate(h, &mut cursor) {
                Some(b) => self.fresh_holders(b, &active, &stale, thr),
                None => [0; 4],
            };
            let run = u32::try_from(i).unwrap_or(u32::MAX);
            for k in 0..4 {
                let (Some(a), Some(&h)) = (active.get_mut(k), held.get(k)) else {
                    continue;
                };
                let mut dropped = *a & !h;
                while dropped != 0 {
                    let w = k * 64 + dropped.trailing_zeros() as usize;
                    dropped &= dropped - 1;
                    if let Some(o) = out.get_mut(w) {
                        *o = run;
                    }
                }
                *a &= h;
            }
            if !any(&active) {
                return;
            }
        }
        let full = u32::try_from(hashes.len()).unwrap_or(u32::MAX);
        for (k, word) in active.iter().enumerate() {
            let mut rest = *word;
            while rest != 0 {
                let w = k * 64 + rest.trailing_zeros() as usize;
                rest &= rest - 1;
                if let Some(o) = out.get_mut(w) {
                    *o = full;
                }
            }
        }
    }

    /// Record that worker w holds all of `hashes` (touches existing entries: LRU order + TTL
    /// refresh). Touched last to first, so the prompt's first blocks are evicted last.
    pub fn insert(&mut self, w: WorkerId, hashes: &[u64], now_ms: u64) {
        let wi = w as usize;
        let cap = match self.workers.get(wi) {
            Some(wk) => wk.cap,
            None => return,
        };
        if cap == 0 || hashes.is_empty() {
            return;
        }
        // The worker cannot hold more than its capacity, and a prompt longer than that must
        // not flush its whole LRU: only the leading `cap` blocks (the reusable part) count.
        let hashes = hashes.get(..cap as usize).unwrap_or(hashes);
        let stamp = self.stamp_for(now_ms);
        let mut cursor = Cursor::new(1);
        // A hash that is not next to the previous block is likely new: load what it and the
        // hashes after it will miss on (table lines of new blocks, records and table lines of
        // the entries they evict) all at once, so the misses overlap. Runs of blocks found
        // next to each other (a cached prefix) need no table and no eviction: no warm-up.
        let mut warmed = 0usize;
        for (k, &h) in hashes.iter().rev().enumerate() {
            let near = self.predict(h, &mut cursor);
            if near.is_none() && warmed == 0 {
                let end = hashes.len() - k;
                let start = end.saturating_sub(WARM_CHUNK);
                if let Some(chunk) = hashes.get(start..end) {
                    self.warm_insert(wi, chunk, &cursor);
                }
                warmed = end - start;
            }
            warmed = warmed.saturating_sub(1);
            self.insert_one(wi, cap, h, near, stamp, &mut cursor);
        }
        // The tail stamp is only read outside `insert`: re-read it once.
        self.fix_tail(wi);
    }

    /// `near`: h's slot if `predict` found it.
    fn insert_one(
        &mut self,
        wi: usize,
        cap: u32,
        h: u64,
        near: Option<u32>,
        stamp: u32,
        cursor: &mut Cursor,
    ) {
        let located = match near {
            Some(b) => Some((b, false)),
            None => self.locate_or_create(h, cursor),
        };
        let Some((b, created)) = located else {
            return;
        };
        if !created {
            if let Some(l) = self.holder_touch(b, wi, stamp) {
                if let Some(wk) = self.workers.get_mut(wi) {
                    if wk.head != l {
                        wk.unlink(l);
                        wk.push_front(l);
                    }
                }
                return;
            }
        }
        // Cannot drop block b: w does not hold it.
        // More entries than the capacity only after a capacity change that did not evict:
        // never happens, but evict down to it.
        while let Some(wk) = self.workers.get(wi) {
            if wk.count <= cap || wk.tail == NIL {
                break;
            }
            let tail = wk.tail;
            self.drop_entry(wi, tail);
        }
        let at_cap = self
            .workers
            .get(wi)
            .is_some_and(|wk| wk.count >= cap && wk.tail != NIL);
        let slot = if at_cap {
            // Evict the LRU entry and reuse its node for b.
            self.workers
                .get_mut(wi)
                .and_then(|wk| wk.recycle_tail(b))
                .map(|(l, old)| {
                    if self.holder_remove(old, wi) {
                        self.drop_block(old);
                    }
                    l
                })
        } else {
            self.workers.get_mut(wi).and_then(|wk| wk.alloc(b))
        };
        let added = match slot {
            Some(l) => {
                let ok = self.holder_add(b, wi, l, stamp);
                if !ok {
                    if let Some(wk) = self.workers.get_mut(wi) {
                        wk.release(l);
                    }
                }
                ok
            }
            None => false,
        };
        if !added && self.holders_empty(b) {
            self.drop_block(b);
        }
    }

    /// Loads what inserting `chunk` (last to first) for worker wi is about to miss on: the
    /// table lines of the hashes that are not next to the previous block (likely new) and
    /// the records their tags point at, then the records and table lines of the LRU entries
    /// their insertion will evict. Each round is a tight loop of independent loads, so the
    /// misses are in flight together rather than one after another. Only a hint: nothing is
    /// changed.
    fn warm_insert(&self, wi: usize, chunk: &[u64], cursor: &Cursor) {
        let mut acc = 0u64;
        let mut c = Cursor {
            prev: cursor.prev,
            step: cursor.step,
            fresh: cursor.fresh,
        };
        let mut ms = [0u64; WARM_CHUNK];
        let mut n = 0usize;
        for &h in chunk.iter().rev() {
            if self.predict(h, &mut c).is_none() {
                c.fresh = true;
                if let Some(m) = ms.get_mut(n) {
                    *m = keyed_mix(h, self.key);
                    n += 1;
                }
            }
        }
        for &m in ms.iter().take(n) {
            acc ^= u64::from(self.table.warm(m));
        }
        for &m in ms.iter().take(n) {
            acc ^= self
                .table
                .warm_probe(m, |v| self.blocks.get(v).map_or(0, |x| x.hash));
        }
        let Some(wk) = self.workers.get(wi) else {
            return;
        };
        let evict = (wk.count + n as u32).saturating_sub(wk.cap) as usize;
        let mut ids = [NIL; WARM_CHUNK];
        let mut e = 0usize;
        let mut l = wk.tail;
        for id in ids.iter_mut().take(evict) {
            let Some(node) = wk.nodes.get(l) else {
                break;
            };
            *id = node.block;
            l = node.prev;
            e += 1;
        }
        for &b in ids.iter().take(e) {
            acc ^= self.blocks.get(b).map_or(0, |x| x.hash);
        }
        for &b in ids.iter().take(e) {
            acc ^= self.blocks.get(b).map_or(0, |x| {
                u64::from(self.table.warm(keyed_mix(x.hash, self.key)))
            });
        }
        core::hint::black_box(acc);
    }

    /// Correction: worker w holds only the first `keep` of `hashes`; drop its entries for
    /// `hashes[keep..]`.
    pub fn truncate(&mut self, w: WorkerId, hashes: &[u64], keep: usize) {
        let wi = w as usize;
        if wi >= MAX_WORKERS {
            return;
        }
        let mut cursor = Cursor::new(1u32.wrapping_neg());
        for &h in hashes.get(keep..).unwrap_or(&[]) {
            if let Some(b) = self.locate(h, &mut cursor) {
                if let Some(l) = self.holder_find(b, wi) {
                    self.remove_node(wi, l);
                }
            }
        }
    }

    /// Drops every entry of worker w (its engine reported an empty cache).
    pub fn clear(&mut self, w: WorkerId) {
        self.evict_to(w as usize, 0);
    }

    /// Drop expired entries, looking at no more than `max_work` entries (each worker visited
    /// costs one too). Returns the number of entries dropped. Expired entries sit at the tail
    /// of their worker's LRU list, so nothing fresh is scanned beyond one entry per worker.
    pub fn expire(&mut self, now_ms: u64, max_work: usize) -> usize {
        let thr = self.threshold(now_ms);
        let mut work = 0usize;
        let mut removed = 0usize;
        for _ in 0..MAX_WORKERS {
            let wi = self.expire_cursor % MAX_WORKERS;
            loop {
                if work >= max_work {
                    return removed;
                }
                work += 1;
                let Some(wk) = self.workers.get(wi) else {
                    break;
                };
                if wk.count == 0 || (wk.tail_stamp as u64) >= thr {
                    break;
                }
                let tail = wk.tail;
                self.remove_node(wi, tail);
                removed += 1;
            }
            self.expire_cursor = (wi + 1) % MAX_WORKERS;
        }
        removed
    }

    /// Distinct block hashes indexed (including expired entries not yet dropped by `expire`).
    pub fn blocks(&self) -> usize {
        self.table.len()
    }

    /// Blocks held by w (including expired entries not yet dropped by `expire`).
    pub fn entries(&self, w: WorkerId) -> usize {
        self.workers
            .get(w as usize)
            .map_or(0, |wk| wk.count as usize)
    }

    /// Heap bytes allocated by the index (allocations, not live entries; allocator headers
    /// excluded, they are negligible next to the page-sized allocations).
    pub fn memory_bytes(&self) -> usize {
        let workers: usize = self.workers.iter().map(|wk| wk.nodes.heap_bytes()).sum();
        self.table.allocation_size()
            + self.blocks.heap_bytes()
            + self.workers.capacity() * core::mem::size_of::<Worker>()
            + workers
            + self.holders.heap_bytes()
    }

    // ---- time ----

    /// Stamps of fresh entries are >= the returned value.
    fn threshold(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.ttl).saturating_sub(self.epoch)
    }

    fn stamp_for(&mut self, now_ms: u64) -> u32 {
        let now = now_ms.max(self.clock);
        self.clock = now;
        if self.table.is_empty() {
            self.epoch = now;
        }
        if now.saturating_sub(self.epoch) > u32::MAX as u64 {
            self.rebase(now);
        }
        u32::try_from(now.saturating_sub(self.epoch)).unwrap_or(u32::MAX)
    }

    /// Move the epoch to `now - 2^31`. Entries older than the new epoch are older than
    /// `MAX_TTL_MS`, hence expired: drop them, then shift the remaining stamps.
    fn rebase(&mut self, now: u64) {
        let new_epoch = now.saturating_sub(REBASE_KEEP_MS);
        let shift = new_epoch.saturating_sub(self.epoch);
        for wi in 0..MAX_WORKERS {
            while let Some(wk) = self.workers.get(wi) {
                if wk.count == 0 || (wk.tail_stamp as u64) >= shift {
                    break;
                }
                let tail = wk.tail;
                self.remove_node(wi, tail);
            }
        }
        // Live stamps are all >= shift now, so it fits in u32 whenever any remain; stamps of
        // free slots are meaningless and only saturate.
        let s = u32::try_from(shift).unwrap_or(u32::MAX);
        for blk in self.blocks.iter_mut() {
            blk.sa = blk.sa.saturating_sub(s);
            blk.sb = blk.sb.saturating_sub(s);
        }
        self.holders.rebase(s);
        for wk in self.workers.iter_mut() {
            if wk.count > 0 {
                wk.tail_stamp = wk.tail_stamp.saturating_sub(s);
            }
        }
        self.epoch = new_epoch;
    }

    // ---- blocks and holder sets ----

    /// Slot of hash h: first the neighbour of the previous block's slot (blocks of one prompt
    /// are created together, in adjacent slots), then the table.
    #[inline]
    fn locate(&self, h: u64, cursor: &mut Cursor) -> Option<u32> {
        if let Some(b) = self.predict(h, cursor) {
            return Some(b);
        }
        let blocks = &self.blocks;
        let b = self.table.find(keyed_mix(h, self.key), |b| {
            blocks.get(b).is_some_and(|x| x.hash == h)
        })?;
        cursor.prev = b;
        cursor.fresh = false;
        Some(b)
    }

    /// A live slot whose hash is h is h's slot: every live slot is in the table, keys unique.
    #[inline]
    fn predict(&self, h: u64, cursor: &mut Cursor) -> Option<u32> {
        if cursor.fresh {
            return None;
        }
        for step in [cursor.step, cursor.step.wrapping_neg()] {
            let cand = cursor.prev.wrapping_add(step);
            if let Some(blk) = self.blocks.get(cand) {
                if blk.hash == h && !blk.is_free() {
                    cursor.prev = cand;
                    cursor.step = step;
                    return Some(cand);
                }
            }
        }
        None
    }

    /// Slot of h, created without holders when h is not indexed; true when created.
    /// `predict` already failed for h.
    fn locate_or_create(&mut self, h: u64, cursor: &mut Cursor) -> Option<(u32, bool)> {
        let next = if self.blocks_free != NIL {
            self.blocks_free
        } else if self.blocks_len < FREE {
            if self.blocks_len as usize >= self.blocks.slots() {
                self.blocks.grow(FREE_BLOCK);
            }
            self.blocks_len
        } else {
            // 4 billion blocks: only reachable by misuse; refuse rather than wrap.
            return self.locate(h, cursor).map(|b| (b, false));
        };
        let blocks = &self.blocks;
        let key = self.key;
        let probe = self.table.find_or_insert(
            keyed_mix(h, key),
            next,
            |b| blocks.get(b).is_some_and(|x| x.hash == h),
            |b| blocks.get(b).map_or(0, |x| keyed_mix(x.hash, key)),
        );
        match probe {
            Probe::Found(b) => {
                cursor.prev = b;
                cursor.fresh = false;
                Some((b, false))
            }
            Probe::Added => {
                if next == self.blocks_free {
                    self.blocks_free = self.blocks.get(next).map_or(NIL, |x| x.a);
                } else {
                    self.blocks_len += 1;
                }
                if let Some(blk) = self.blocks.get_mut(next) {
                    *blk = Block::new(h);
                }
                cursor.prev = next;
                cursor.fresh = true;
                Some((next, true))
            }
            Probe::Full => None,
        }
    }

    fn drop_block(&mut self, b: u32) {
        let Some(blk) = self.blocks.get(b) else {
            return;
        };
        if blk.is_free() {
            return;
        }
        self.table.remove(keyed_mix(blk.hash, self.key), b);
        let free = self.blocks_free;
        if let Some(blk) = self.blocks.get_mut(b) {
            *blk = Block {
                a: free,
                ..FREE_BLOCK
            };
            self.blocks_free = b;
        }
    }

    fn holders_empty(&self, b: u32) -> bool {
        self.blocks.get(b).is_none_or(|x| x.a == NIL)
    }

    fn holder_find(&self, b: u32, w: usize) -> Option<u32> {
        self.holders.find(self.blocks.get(b)?, w)
    }

    fn holder_stamp(&self, b: u32, w: usize) -> Option<u32> {
        self.holders.stamp(self.blocks.get(b)?, w)
    }

    /// If w holds b: refresh its stamp and return its node.
    fn holder_touch(&mut self, b: u32, w: usize, stamp: u32) -> Option<u32> {
        self.holders.touch(self.blocks.get_mut(b)?, w, stamp)
    }

    fn holder_add(&mut self, b: u32, w: usize, l: u32, stamp: u32) -> bool {
        match self.blocks.get_mut(b) {
            Some(blk) => self.holders.add(blk, w, l, stamp),
            None => false,
        }
    }

    /// Removes w from the holders of b; true when b has no holder left.
    fn holder_remove(&mut self, b: u32, w: usize) -> bool {
        match self.blocks.get_mut(b) {
            Some(blk) => self.holders.remove(blk, w),
            None => false,
        }
    }

    /// Holders of b among `active` whose entry is fresh.
    #[inline]
    fn fresh_holders(&self, b: u32, active: &Bits, stale: &Bits, thr: u64) -> Bits {
        match self.blocks.get(b) {
            Some(blk) => self.holders.fresh(blk, active, stale, thr),
            None => [0; 4],
        }
    }

    // ---- entries ----

    /// Re-read the stamp of w's LRU tail after its list changed.
    fn fix_tail(&mut self, wi: usize) {
        let Some(wk) = self.workers.get(wi) else {
            return;
        };
        let stamp = match wk.nodes.get(wk.tail) {
            Some(n) => self.holder_stamp(n.block, wi).unwrap_or(0),
            None => u32::MAX,
        };
        if let Some(wk) = self.workers.get_mut(wi) {
            wk.tail_stamp = stamp;
        }
    }

    fn remove_node(&mut self, wi: usize, l: u32) {
        let was_tail = self.workers.get(wi).is_some_and(|wk| wk.tail == l);
        self.drop_entry(wi, l);
        if was_tail {
            self.fix_tail(wi);
        }
    }

    /// Removes node l of worker wi without updating `tail_stamp`.
    fn drop_entry(&mut self, wi: usize, l: u32) {
        let Some(wk) = self.workers.get_mut(wi) else {
            return;
        };
        let Some(b) = wk.nodes.get(l).map(|n| n.block) else {
            return;
        };
        if b == NIL {
            return;
        }
        wk.release(l);
        if self.holder_remove(b, wi) {
            self.drop_block(b);
        }
    }

    fn evict_to(&mut self, wi: usize, keep: u32) {
        loop {
            let Some(wk) = self.workers.get(wi) else {
                return;
            };
            if wk.count <= keep || wk.tail == NIL {
                return;
            }
            let tail = wk.tail;
            self.remove_node(wi, tail);
        }
    }
}

/// Where the previous block of a walk was found and in which direction its neighbour lies.
struct Cursor {
    prev: u32,
    step: u32,
    /// `prev` was just created: its neighbours are unrelated blocks, do not try them.
    fresh: bool,
}

impl Cursor {
    fn new(step: u32) -> Self {
        Cursor {
            prev: NIL,
            step,
            fresh: false,
        }
    }
}

#[cfg(test)]
mod tests;
