//! One engine's blocks as the relay holds them: engine hash -> kvroute hash, depth and copies;
//! bounded, past the bound the least recently used blocks go, children before parents.

use hashbrown::{HashMap, HashTable};

/// Deepest depth an entry records (24 bits; the other 8 of its word count copies). A held
/// chain is never longer than the table's bound, so only tables of more than 16 M blocks
/// could reach it; past it, depths saturate and only the snapshot's order within those
/// depths suffers.
pub const MAX_DEPTH: u32 = (1 << 24) - 1;

/// Most copies of one engine block an entry counts (8 bits). vLLM keeps a second physical
/// copy of a block it recomputed (a prompt cached up to its last token, a multiple of the
/// block size long), each with its own `BlockStored` and `BlockRemoved`. Past this the count
/// stays put while stores go on, so a block with more copies is announced removed after
/// this many removals: an under-count, never a claim of a block the engine no longer holds.
pub const MAX_COPIES: u32 = u8::MAX as u32;

/// One indexed block, 32 bytes (u32 words keep the alignment at 4, so no padding).
#[derive(Clone, Copy, Debug)]
struct Entry {
    engine: [u32; 2],
    kvroute: [u32; 2],
    /// The parent's engine hash (unused at depth 0): storing a child refreshes its ancestors.
    parent: [u32; 2],
    /// Low 24 bits: blocks before this one in its chain (the snapshot lists parents before
    /// children by sorting on it). High 8 bits: copies of the block the engine holds (the
    /// count rides in this word so an entry stays 32 bytes).
    level: u32,
    /// Recency generation: an ancestor's is never below its descendants' (see `evict`).
    gen: u32,
}

impl Entry {
    fn depth(&self) -> u32 {
        self.level & MAX_DEPTH
    }

    fn copies(&self) -> u32 {
        self.level >> 24
    }

    fn set_copies(&mut self, n: u32) {
        self.level = self.depth() | (n.min(MAX_COPIES) << 24);
    }

    /// Eviction order, smallest first: older generations, and within one the deepest blocks
    /// (children before their parents), so eviction never leaves a child without its parent.
    fn evict_key(&self) -> u64 {
        (u64::from(self.gen) << 32) | u64::from(u32::MAX - self.depth())
    }
}

/// Which kvroute hashes held blocks re-key to, and how many blocks hold each where more
/// than one do (the engine hashes more than the tokens: a cache salt, extra keys). The
/// gateways are told a hash is removed only when its last holder goes. Shared hashes are
/// rare, so they are counted in a side map and the common case costs 8 bytes a slot.
#[derive(Default)]
struct KvHolders {
    held: HashTable<[u32; 2]>,
    /// Kvroute hash -> holders, for hashes with two or more.
    shared: HashMap<u64, u32>,
}

impl KvHolders {
    fn count(&self, kvroute: u64) -> u32 {
        let k = split(kvroute);
        match self.held.find(mix(kvroute), |x| *x == k) {
            None => 0,
            Some(_) if self.shared.is_empty() => 1,
            Some(_) => self.shared.get(&kvroute).copied().unwrap_or(1),
        }
    }

    fn hold(&mut self, kvroute: u64) {
        let k = split(kvroute);
        match self
            .held
            .entry(mix(kvroute), |x| *x == k, |x| mix(join(*x)))
        {
            hashbrown::hash_table::Entry::Occupied(_) => {
                let n = self.shared.entry(kvroute).or_insert(1);
                *n = n.saturating_add(1);
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(k);
            }
        }
    }

    /// One block holding `kvroute` went; true when it was the last.
    fn release(&mut self, kvroute: u64) -> bool {
        // Most tables share no hash: skip hashing the key into an empty map.
        if let Some(n) = (!self.shared.is_empty())
            .then(|| self.shared.get_mut(&kvroute))
            .flatten()
        {
            *n -= 1;
            if *n <= 1 {
                self.shared.remove(&kvroute);
            }
            return false;
        }
        let k = split(kvroute);
        if let Ok(o) = self.held.find_entry(mix(kvroute), |x| *x == k) {
            o.remove();
        }
        true
    }

    /// Forgets every hash; `clear` keeps the allocation and drops the tombstones erasing
    /// leaves.
    fn clear(&mut self) {
        self.held.clear();
        self.shared = HashMap::new();
    }

    fn bytes(&self) -> usize {
        self.held.allocation_size() + self.shared.allocation_size()
    }
}

/// What removing one copy of an engine block did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// The index did not hold the block.
    NotHeld,
    /// Another copy of the block is still held.
    CopyLeft,
    /// The block's last copy went; `announce` when no other held block re-keys to its
    /// kvroute hash either (the gateways must drop it).
    Gone { kvroute: u64, announce: bool },
}

fn split(v: u64) -> [u32; 2] {
    [v as u32, (v >> 32) as u32]
}

fn join(v: [u32; 2]) -> u64 {
    u64::from(v[0]) | (u64::from(v[1]) << 32)
}

fn mix(k: u64) -> u64 {
    let x = (k ^ (k >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 29)
}

/// Default bound of one engine's table when nothing sets it: 2 x 131072 blocks (see
/// `hub::Limits`), a few MiB.
pub const DEFAULT_MAX_BLOCKS: usize = 2 * 131_072;

/// Engine hash -> (kvroute hash, depth) for every block an engine holds, at most `max` of
/// them: an engine that announces more blocks than it can hold (a bug or a hostile
/// publisher) cannot grow the relay without bound.
pub struct BlockTable {
    table: HashTable<Entry>,
    /// Kvroute hashes of the held blocks.
    holders: KvHolders,
    max: usize,
    /// Current recency generation; bumped every `max / 16` inserts.
    gen: u32,
    inserts_in_gen: usize,
}

impl Default for BlockTable {
    fn default() -> Self {
        BlockTable::with_max(DEFAULT_MAX_BLOCKS)
    }
}

impl BlockTable {
    /// A table holding at most `max` blocks (at least 16).
    pub fn with_max(max: usize) -> Self {
        BlockTable {
            table: HashTable::new(),
            holders: KvHolders::default(),
            max: max.max(16),
            gen: 0,
            inserts_in_gen: 0,
        }
    }

    pub fn max(&self) -> usize {
        self.max
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Heap bytes held by the table.
    pub fn bytes(&self) -> usize {
        self.table.allocation_size() + self.holders.bytes()
    }

    pub fn get(&self, engine: u64) -> Option<(u64, u32)> {
        let e = split(engine);
        self.table
            .find(mix(engine), |x| x.engine == e)
            .map(|x| (join(x.kvroute), x.depth()))
    }

    /// Copies of `engine` held (0 when not held).
    pub fn copies(&self, engine: u64) -> u32 {
        let e = split(engine);
        self.table
            .find(mix(engine), |x| x.engine == e)
            .map_or(0, Entry::copies)
    }

    /// Held engine blocks that re-key to `kvroute`.
    pub fn holders(&self, kvroute: u64) -> u32 {
        self.holders.count(kvroute)
    }

    fn hold(&mut self, kvroute: u64) {
        self.holders.hold(kvroute);
    }

    fn release(&mut self, kvroute: u64) -> bool {
        self.holders.release(kvroute)
    }

    /// Inserts a root-level entry (no parent link); see [`BlockTable::insert_under`].
    pub fn insert(&mut self, engine: u64, kvroute: u64, depth: u32) {
        let _ = self.insert_under(engine, kvroute, depth, None);
    }

    /// Inserts a block whose parent's engine hash is `parent`, or counts one more copy of it
    /// when it is held under the same kvroute hash; one held under another kvroute hash (the
    /// engine hash stored again under another chain) is replaced, its copies forgotten. The
    /// caller makes room first (`is_full` / `evict`): the table never grows past `max`
    /// through [`crate::index::EngineIndex`], which evicts before inserting.
    /// Returns a kvroute hash no held block has any more (the replaced one's).
    pub fn insert_under(
        &mut self,
        engine: u64,
        kvroute: u64,
        depth: u32,
        parent: Option<u64>,
    ) -> Option<u64> {
        let e = split(engine);
        let mut entry = Entry {
            engine: e,
            kvroute: split(kvroute),
            parent: split(parent.unwrap_or(0)),
            level: depth.min(MAX_DEPTH),
            gen: self.gen,
        };
        entry.set_copies(1);
        match self
            .table
            .entry(mix(engine), |x| x.engine == e, |x| mix(join(x.engine)))
        {
            hashbrown::hash_table::Entry::Occupied(mut o) => {
                let before = join(o.get().kvroute);
                if before == kvroute {
                    entry.set_copies(o.get().copies().saturating_add(1));
                    *o.get_mut() = entry;
                    return None;
                }
                *o.get_mut() = entry;
                self.hold(kvroute);
                return self.release(before).then_some(before);
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(entry);
            }
        }
        self.hold(kvroute);
        self.inserts_in_gen += 1;
        if self.inserts_in_gen >= (self.max / 16).max(1) {
            self.inserts_in_gen = 0;
            self.gen = self.gen.saturating_add(1);
        }
        None
    }

    /// Marks `engine` and its ancestors used now (a new block was stored under it). Stops at
    /// the first ancestor already in the current generation: its own ancestors are too.
    pub fn touch(&mut self, engine: u64) {
        let gen = self.gen;
        let mut cur = Some(engine);
        // Depth bounds the walk even if hostile input made a cycle of parent links.
        let mut left = self.table.len();
        while let Some(h) = cur.take() {
            let e = split(h);
            let Some(x) = self.table.find_mut(mix(h), |x| x.engine == e) else {
                break;
            };
            if x.gen >= gen || left == 0 {
                break;
            }
            left -= 1;
            x.gen = gen;
            if x.depth() > 0 {
                cur = Some(join(x.parent));
            }
        }
    }

    /// Held blocks whose parent is not held (a consistency check for tests: eviction never
    /// makes one).
    pub fn dangling(&self) -> usize {
        self.table
            .iter()
            .filter(|x| {
                let p = join(x.parent);
                x.depth() > 0 && self.table.find(mix(p), |y| join(y.engine) == p).is_none()
            })
            .count()
    }

    pub fn is_full(&self) -> bool {
        self.table.len() >= self.max
    }

    /// Evicts down to 7/8 of `max` (so eviction runs once per `max / 8` inserts, not per
    /// insert): least recently used chains first, children before their parents, each
    /// evicted block with all its copies. Calls `gone` with each kvroute hash no kept block
    /// has; returns the blocks evicted.
    pub fn evict(&mut self, mut gone: impl FnMut(u64)) -> usize {
        let keep = self.max - self.max / 8;
        let n = self.table.len().saturating_sub(keep);
        if n == 0 {
            return 0;
        }
        let mut keys: Vec<u64> = self.table.iter().map(Entry::evict_key).collect();
        let (_, nth, _) = keys.select_nth_unstable(n - 1);
        let threshold = *nth;
        // Ties at the threshold are evicted only as far as needed.
        let below = keys.iter().filter(|k| **k < threshold).count();
        drop(keys);
        let mut ties = n - below;
        // Into a fresh table sized for `max`: erasing in place would leave tombstones, and a
        // table of tombstones grows (to 4x the entries, measured) instead of reusing them.
        let mut kept = HashTable::with_capacity(self.max.min(self.table.len()));
        let mut evicted = Vec::with_capacity(n);
        for x in self.table.drain() {
            let k = x.evict_key();
            if k < threshold || (k == threshold && ties > 0) {
                if k == threshold {
                    ties -= 1;
                }
                evicted.push(join(x.kvroute));
            } else {
                kept.insert_unique(mix(join(x.engine)), x, |y| mix(join(y.engine)));
            }
        }
        self.table = kept;
        // The holders are rebuilt from what stays (no tombstones either).
        self.holders.clear();
        for x in self.table.iter() {
            self.holders.hold(join(x.kvroute));
        }
        for kv in evicted {
            if self.holders(kv) == 0 {
                gone(kv);
            }
        }
        n
    }

    /// Removes one copy of `engine` (one `BlockRemoved`).
    pub fn remove(&mut self, engine: u64) -> Removal {
        let e = split(engine);
        let kvroute = match self.table.find_entry(mix(engine), |x| x.engine == e) {
            Ok(mut o) if o.get().copies() > 1 => {
                let x = o.get_mut();
                x.set_copies(x.copies() - 1);
                return Removal::CopyLeft;
            }
            Ok(o) => join(o.remove().0.kvroute),
            Err(_) => return Removal::NotHeld,
        };
        Removal::Gone {
            kvroute,
            announce: self.release(kvroute),
        }
    }

    pub fn clear(&mut self) {
        self.table = HashTable::new();
        self.holders = KvHolders::default();
    }

    /// Every held kvroute hash, parents before children.
    pub fn snapshot(&self) -> Vec<u64> {
        self.snapshot_at_most(usize::MAX)
    }

    /// The `limit` shallowest held kvroute hashes, parents before children, each once
    /// (blocks that re-key to one hash have one depth): a cut keeps whole prefixes (what a
    /// prefix match can use).
    pub fn snapshot_at_most(&self, limit: usize) -> Vec<u64> {
        let mut v: Vec<(u32, u64)> = self
            .table
            .iter()
            .map(|x| (x.depth(), join(x.kvroute)))
            .collect();
        if limit < v.len() {
            v.select_nth_unstable_by_key(limit, |x| x.0);
            v.truncate(limit);
        }
        v.sort_unstable();
        v.dedup();
        v.into_iter().map(|x| x.1).collect()
    }
}
