//! Paged KV cache with prefix caching, modelled on vLLM's block manager.
//!
//! Blocks are reference-counted by the requests that hold them. A block whose count drops to
//! zero stays in the hash map (its content is still valid) and joins the tail of a free queue;
//! allocation takes from the head, so the least recently freed block is evicted first. A
//! request frees its blocks leaf first, so within one chain the deepest block is evicted
//! before its parents and a surviving prefix stays usable.
//!
//! As in vLLM 0.32, a full block computed again while an equal block is cached (a prompt hit
//! up to its last block, whose last token must be recomputed) is cached too: both copies are
//! announced (BlockStored) and removed (BlockRemoved) one by one, and both take capacity
//! until evicted. `KvCache::single_copies` brings back the old mock, which left the
//! duplicate uncached.

use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::kv_events::KvEvent;

pub type BlockId = u32;
const NONE: u32 = u32::MAX;
const HASH_SEED: u64 = 1337;

/// Chained hash of one full block: identifies the whole prefix up to and including it.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut buf = [0u8; 8 + 4 * 64];
    let n = 8 + 4 * tokens.len();
    if n <= buf.len() {
        buf[..8].copy_from_slice(&parent.to_le_bytes());
        for (i, t) in tokens.iter().enumerate() {
            buf[8 + 4 * i..12 + 4 * i].copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&buf[..n], HASH_SEED)
    } else {
        let mut v = Vec::with_capacity(n);
        v.extend_from_slice(&parent.to_le_bytes());
        for t in tokens {
            v.extend_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&v, HASH_SEED)
    }
}

/// The root of a hash chain; a salt gives a disjoint chain.
pub fn chain_root(salt: Option<&str>) -> u64 {
    salt.map_or(0, |s| xxh3_64_with_seed(s.as_bytes(), HASH_SEED ^ 0x5a17))
}

/// The root of a request's chain for LoRA adapter `lora` (`None`: the base model): vLLM
/// puts the adapter's name into every block hash, so an adapter's blocks never match the
/// base model's or another adapter's. Seeding the root has the same effect on hits.
pub fn adapter_root(root: u64, lora: Option<&str>) -> u64 {
    lora.map_or(root, |n| {
        xxh3_64_with_seed(n.as_bytes(), HASH_SEED ^ 0x10ea ^ root)
    })
}

/// Appends the chained hashes of every full block of `tokens` past the ones already in
/// `hashes`.
pub fn extend_hashes(hashes: &mut Vec<u64>, root: u64, tokens: &[u32], block_size: usize) {
    let full = tokens.len() / block_size;
    while hashes.len() < full {
        let i = hashes.len();
        let parent = if i == 0 { root } else { hashes[i - 1] };
        hashes.push(block_hash(
            parent,
            &tokens[i * block_size..(i + 1) * block_size],
        ));
    }
}

#[derive(Clone, Copy)]
struct Block {
    refs: u32,
    /// Set once the block is full and computed; NONE-free blocks without a hash hold nothing
    /// reusable.
    hash: Option<u64>,
    prev: u32,
    next: u32,
    in_free: bool,
}

pub struct KvCache {
    blocks: Vec<Block>,
    /// The copy of each cached prefix that hits serve (the first cached).
    map: HashMap<u64, BlockId>,
    /// Further copies of a cached prefix, in caching order (rare: see the module doc).
    copies: HashMap<u64, Vec<BlockId>>,
    keep_copies: bool,
    head: u32,
    tail: u32,
    free_len: usize,
    pub evictions: u64,
    /// vLLM's KV cache events since the last `take_events`; `None` when nobody listens.
    events: Option<Vec<KvEvent>>,
}

impl KvCache {
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0 && capacity < NONE as usize);
        let mut c = KvCache {
            blocks: vec![
                Block {
                    refs: 0,
                    hash: None,
                    prev: NONE,
                    next: NONE,
                    in_free: false
                };
                capacity
            ],
            map: HashMap::with_capacity(capacity),
            copies: HashMap::new(),
            keep_copies: true,
            head: NONE,
            tail: NONE,
            free_len: 0,
            evictions: 0,
            events: None,
        };
        for b in 0..capacity as u32 {
            c.push_back(b);
        }
        c
    }

    /// The old mock: a block equal to a cached one is not cached again (`--no-duplicate-blocks`).
    pub fn single_copies(mut self) -> Self {
        self.keep_copies = false;
        self
    }

    pub fn capacity(&self) -> usize {
        self.blocks.len()
    }
    /// Blocks available for allocation, including cached blocks nobody holds.
    pub fn free(&self) -> usize {
        self.free_len
    }
    /// vLLM's `kv_cache_usage_perc`: the fraction of blocks held by requests.
    pub fn usage(&self) -> f64 {
        1.0 - self.free_len as f64 / self.blocks.len() as f64
    }
    pub fn cached_blocks(&self) -> usize {
        self.map.len() + self.copies.values().map(Vec::len).sum::<usize>()
    }

    /// Starts recording KV cache events (for `--kv-events`).
    pub fn enable_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events recorded since the last call (empty when not recording).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// vLLM's `reset_prefix_cache`: forgets every cached prefix (blocks held by running
    /// requests keep their content but are no longer shared) and records AllBlocksCleared.
    pub fn reset_prefix_cache(&mut self) {
        self.map.clear();
        self.copies.clear();
        for b in &mut self.blocks {
            b.hash = None;
        }
        if let Some(ev) = &mut self.events {
            ev.push(KvEvent::AllBlocksCleared);
        }
    }

    fn push_back(&mut self, b: BlockId) {
        let blk = &mut self.blocks[b as usize];
        blk.prev = self.tail;
        blk.next = NONE;
        blk.in_free = true;
        if self.tail != NONE {
            self.blocks[self.tail as usize].next = b;
        } else {
            self.head = b;
        }
        self.tail = b;
        self.free_len += 1;
    }

    fn push_front(&mut self, b: BlockId) {
        let blk = &mut self.blocks[b as usize];
        blk.prev = NONE;
        blk.next = self.head;
        blk.in_free = true;
        if self.head != NONE {
            self.blocks[self.head as usize].prev = b;
        } else {
            self.tail = b;
        }
        self.head = b;
        self.free_len += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let Block { prev, next, .. } = self.blocks[b as usize];
        if prev != NONE {
            self.blocks[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NONE {
            self.blocks[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
        let blk = &mut self.blocks[b as usize];
        blk.in_free = false;
        blk.prev = NONE;
        blk.next = NONE;
        self.free_len -= 1;
    }

    /// Number of leading `hashes` present in the cache. Read-only: probing never changes
    /// eviction order.
    pub fn lookup(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.map.contains_key(h))
            .count()
    }

    /// Of the first `n` hit blocks, how many sit in the free queue (taking them reduces what
    /// can be allocated).
    pub fn free_among_hits(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .filter(|h| self.blocks[self.map[h] as usize].refs == 0)
            .count()
    }

    /// Takes a reference on each cached block of `hashes` (all must be present) and appends
    /// them to `out`.
    pub fn acquire_hits(&mut self, hashes: &[u64], out: &mut Vec<BlockId>) {
        for h in hashes {
            let b = self.map[h];
            if self.blocks[b as usize].in_free {
                self.unlink(b);
            }
            self.blocks[b as usize].refs += 1;
            out.push(b);
        }
    }

    /// Allocates `n` fresh blocks onto `out`, evicting the least recently freed cached blocks.
    /// All or nothing.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        if n > self.free_len {
            return false;
        }
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            let blk = &mut self.blocks[b as usize];
            if let Some(h) = blk.hash.take() {
                if self.forget(h, b) {
                    if let Some(ev) = &mut self.events {
                        ev.push(KvEvent::BlockRemoved {
                            block_hashes: vec![h],
                        });
                    }
                }
                self.evictions += 1;
            }
            self.blocks[b as usize].refs = 1;
            out.push(b);
        }
        true
    }

    /// Drops block `b`'s entry for `hash` (a further copy takes over hits); false when `b`
    /// held none.
    fn forget(&mut self, hash: u64, b: BlockId) -> bool {
        let copies = self.copies.get_mut(&hash);
        if self.map.get(&hash) == Some(&b) {
            match copies {
                Some(v) => {
                    let next = v.remove(0);
                    if v.is_empty() {
                        self.copies.remove(&hash);
                    }
                    self.map.insert(hash, next);
                }
                None => {
                    self.map.remove(&hash);
                }
            }
            return true;
        }
        let Some(v) = copies else { return false };
        let Some(i) = v.iter().position(|&x| x == b) else {
            return false;
        };
        v.remove(i);
        if v.is_empty() {
            self.copies.remove(&hash);
        }
        true
    }

    /// Marks a held, now full and computed block as holding the prefix `hash`. If an equal
    /// block is already cached, the first one keeps serving hits and this one is cached as a
    /// further copy (vLLM 0.32), or, with `single_copies`, not cached at all.
    /// Returns whether the block was cached.
    pub fn register(&mut self, b: BlockId, hash: u64) -> bool {
        let blk = &mut self.blocks[b as usize];
        if blk.hash.is_some() {
            return false;
        }
        match self.map.entry(hash) {
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(b);
            }
            std::collections::hash_map::Entry::Occupied(_) if self.keep_copies => {
                self.copies.entry(hash).or_default().push(b);
            }
            std::collections::hash_map::Entry::Occupied(_) => return false,
        }
        blk.hash = Some(hash);
        true
    }

    /// Registers blocks `from..to` of one request (`blocks`, `hashes` and `tokens` are the
    /// request's, from its first block) and records what entered the cache as BlockStored
    /// events: one per run of newly cached blocks, its parent the hash of the block before
    /// the run (`None` for a run starting at the first block), with the run's tokens.
    pub fn register_run(
        &mut self,
        blocks: &[BlockId],
        hashes: &[u64],
        tokens: &[u32],
        block_size: usize,
        from: usize,
        to: usize,
    ) {
        let mut run: Option<usize> = None;
        for j in from..to {
            let stored = self.register(blocks[j], hashes[j]);
            if self.events.is_none() {
                continue;
            }
            match (stored, run) {
                (true, None) => run = Some(j),
                (false, Some(start)) => {
                    self.stored(hashes, tokens, block_size, start, j);
                    run = None;
                }
                _ => {}
            }
        }
        if let Some(start) = run {
            self.stored(hashes, tokens, block_size, start, to);
        }
    }

    fn stored(&mut self, hashes: &[u64], tokens: &[u32], bs: usize, from: usize, to: usize) {
        if let Some(ev) = &mut self.events {
            ev.push(KvEvent::BlockStored {
                block_hashes: hashes[from..to].to_vec(),
                parent_block_hash: from.checked_sub(1).map(|p| hashes[p]),
                token_ids: tokens[from * bs..to * bs].to_vec(),
                block_size: bs,
            });
        }
    }

    /// Drops a request's references, leaf first. Blocks with reusable content go to the tail
    /// of the free queue; empty ones to the head, because keeping them protects nothing.
    pub fn release(&mut self, blocks: &mut Vec<BlockId>) {
        while let Some(b) = blocks.pop() {
            let blk = &mut self.blocks[b as usize];
            debug_assert!(blk.refs > 0);
            blk.refs -= 1;
            if blk.refs == 0 {
                if blk.hash.is_some() {
                    self.push_back(b);
                } else {
                    self.push_front(b);
                }
            }
        }
    }

    #[cfg(test)]
    pub fn refs(&self, b: BlockId) -> u32 {
        self.blocks[b as usize].refs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(seed: u32, blocks: usize) -> Vec<u64> {
        let toks: Vec<u32> = (0..(blocks * 4) as u32).map(|i| i + seed * 1000).collect();
        let mut h = vec![];
        extend_hashes(&mut h, 0, &toks, 4);
        h
    }

    /// Holds a chain as one request would: allocate, register, and return the blocks.
    fn fill(c: &mut KvCache, hashes: &[u64]) -> Vec<BlockId> {
        let hit = c.lookup(hashes);
        let mut blocks = vec![];
        c.acquire_hits(&hashes[..hit], &mut blocks);
        assert!(c.allocate(hashes.len() - hit, &mut blocks));
        for (b, h) in blocks.clone().into_iter().zip(hashes) {
            c.register(b, *h);
        }
        blocks
    }

    #[test]
    fn prefix_reuse_after_release() {
        let mut c = KvCache::new(8);
        let a = chain(1, 3);
        let mut held = fill(&mut c, &a);
        assert_eq!(c.usage(), 3.0 / 8.0);
        c.release(&mut held);
        assert_eq!(c.free(), 8);
        assert_eq!(c.lookup(&a), 3);
        // A longer request with the same prefix reuses the 3 blocks and takes 2 new ones.
        let mut longer = chain(1, 5);
        assert_eq!(&longer[..3], &a[..]);
        let b = fill(&mut c, &longer);
        assert_eq!(c.free(), 3);
        assert_eq!(c.evictions, 0);
        longer.truncate(0);
        drop(b);
    }

    #[test]
    fn eviction_is_lru_and_leaf_first() {
        let mut c = KvCache::new(6);
        let a = chain(1, 3);
        let b = chain(2, 3);
        let mut ha = fill(&mut c, &a);
        let mut hb = fill(&mut c, &b);
        c.release(&mut ha); // a freed first: least recently used
        c.release(&mut hb);
        let mut out = vec![];
        assert!(c.allocate(1, &mut out));
        // The leaf of the older chain went; its first two blocks still hit.
        assert_eq!(c.lookup(&a), 2);
        assert_eq!(c.lookup(&b), 3);
        assert!(c.allocate(2, &mut out));
        assert_eq!(c.lookup(&a), 0);
        assert_eq!(c.lookup(&b), 3);
        assert!(c.allocate(1, &mut out));
        assert_eq!(c.lookup(&b), 2, "then the leaf of the next chain");
        assert_eq!(c.evictions, 4);
    }

    #[test]
    fn probing_does_not_touch_lru_order() {
        let mut c = KvCache::new(4);
        let a = chain(1, 2);
        let b = chain(2, 2);
        let mut ha = fill(&mut c, &a);
        let mut hb = fill(&mut c, &b);
        c.release(&mut ha);
        c.release(&mut hb);
        for _ in 0..10 {
            assert_eq!(c.lookup(&a), 2);
        }
        let mut out = vec![];
        assert!(c.allocate(2, &mut out));
        assert_eq!(c.lookup(&a), 0, "a was still least recent");
        assert_eq!(c.lookup(&b), 2);
    }

    #[test]
    fn held_blocks_are_never_evicted() {
        let mut c = KvCache::new(4);
        let a = chain(1, 2);
        let held = fill(&mut c, &a);
        // A second holder of the same prefix shares the blocks.
        let mut second = vec![];
        c.acquire_hits(&a, &mut second);
        assert_eq!(second, held);
        assert!(held.iter().all(|&b| c.refs(b) == 2));
        let mut out = vec![];
        assert!(!c.allocate(3, &mut out), "only 2 blocks are free");
        assert!(out.is_empty(), "failed allocation takes nothing");
        assert!(c.allocate(2, &mut out));
        assert!(!c.allocate(1, &mut out));
        assert_eq!(c.lookup(&a), 2);
        c.release(&mut second);
        assert_eq!(c.free(), 0, "still held by the first request");
        let mut first = held.clone();
        c.release(&mut first);
        assert_eq!(c.free(), 2);
        assert_eq!(c.lookup(&a), 2);
    }

    #[test]
    fn events_record_stored_runs_and_evictions() {
        // The old mock (`single_copies`): a block already cached elsewhere splits the run.
        let mut c = KvCache::new(4).single_copies();
        c.enable_events();
        let toks: Vec<u32> = (0..12).collect();
        let mut h = vec![];
        extend_hashes(&mut h, 0, &toks, 4);
        // Another request already cached block 1: runs split around it.
        let mut other = vec![];
        assert!(c.allocate(1, &mut other));
        c.register(other[0], h[1]);
        let mut blocks = vec![];
        assert!(c.allocate(3, &mut blocks));
        c.register_run(&blocks, &h, &toks, 4, 0, 3);
        let stored = |hashes: &[u64], parent, tokens: &[u32]| KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 4,
        };
        assert_eq!(
            c.take_events(),
            vec![
                stored(&h[..1], None, &toks[..4]),
                stored(&h[2..3], Some(h[1]), &toks[8..12]),
            ]
        );
        assert!(c.take_events().is_empty());
        c.release(&mut blocks);
        // The unregistered duplicate goes first (no event), then the leaf of the chain.
        let mut out = vec![];
        assert!(c.allocate(2, &mut out));
        assert_eq!(
            c.take_events(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![h[2]]
            }],
            "the leaf went first"
        );
        c.reset_prefix_cache();
        assert_eq!(c.cached_blocks(), 0);
        assert_eq!(c.lookup(&h), 0);
        assert_eq!(c.take_events(), vec![KvEvent::AllBlocksCleared]);
        // Not recording: nothing accumulates.
        let mut quiet = KvCache::new(2);
        let mut b = vec![];
        assert!(quiet.allocate(1, &mut b));
        quiet.register_run(&b, &h, &toks, 4, 0, 1);
        assert!(quiet.take_events().is_empty());
    }

    #[test]
    fn a_recomputed_block_is_cached_as_a_copy_as_in_vllm_032() {
        let mut c = KvCache::new(4);
        c.enable_events();
        let toks: Vec<u32> = (0..8).collect();
        let mut h = vec![];
        extend_hashes(&mut h, 0, &toks, 4);
        let mut first = vec![];
        assert!(c.allocate(2, &mut first));
        c.register_run(&first, &h, &toks, 4, 0, 2);
        c.release(&mut first);
        // The same 8 tokens again: block 0 hits, block 1 is recomputed (it holds the last
        // prompt token) and stored as a second copy, in one event like vLLM's.
        let mut second = vec![];
        c.acquire_hits(&h[..1], &mut second);
        assert!(c.allocate(1, &mut second));
        c.take_events();
        c.register_run(&second, &h, &toks, 4, 1, 2);
        let copy = second[1];
        assert_eq!(
            c.take_events(),
            vec![KvEvent::BlockStored {
                block_hashes: vec![h[1]],
                parent_block_hash: Some(h[0]),
                token_ids: toks[4..8].to_vec(),
                block_size: 4,
            }]
        );
        assert_eq!(c.cached_blocks(), 3);
        c.release(&mut second);
        // Both copies leave one by one, each with its BlockRemoved; the prefix hits until the
        // last copy is gone.
        let removed = |i: usize| KvEvent::BlockRemoved {
            block_hashes: vec![h[i]],
        };
        let mut out = vec![];
        assert!(c.allocate(2, &mut out));
        assert!(!out.contains(&copy), "the copy was freed last");
        assert_eq!(c.take_events(), vec![removed(1)]);
        assert_eq!(c.lookup(&h), 2, "the copy serves block 1 now");
        assert!(c.allocate(1, &mut out));
        assert_eq!(c.take_events(), vec![removed(1)]);
        assert_eq!(c.lookup(&h), 1);
        assert!(c.allocate(1, &mut out));
        assert_eq!(c.take_events(), vec![removed(0)]);
        assert_eq!((c.lookup(&h), c.cached_blocks()), (0, 0));
    }

    #[test]
    fn unhashed_blocks_are_reused_before_cached_ones() {
        let mut c = KvCache::new(3);
        let a = chain(1, 1);
        let mut ha = fill(&mut c, &a);
        c.release(&mut ha);
        let mut partial = vec![];
        assert!(c.allocate(1, &mut partial));
        c.release(&mut partial); // never registered: goes to the head
        let mut out = vec![];
        assert!(c.allocate(2, &mut out));
        assert_eq!(c.lookup(&a), 1);
    }
}
