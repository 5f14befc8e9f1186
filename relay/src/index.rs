//! Per-engine index: the re-keying of stored blocks (`kvroute::hashing::token_block_hash`
//! chained over the engine's parent links) into the engine's `BlockTable`, and the deltas it
//! makes for the gateways.

use crate::blocks::{BlockTable, Removal, DEFAULT_MAX_BLOCKS};
use crate::decode::{Event, Stored};
use hashbrown::HashMap;
use kvroute::hashing::{chain_seed, token_block_hash};

/// Net effect of a run of events on one worker: `cleared` applies first, and `stored` and
/// `removed` are disjoint so their order of application does not matter.
#[derive(Default, Debug, Clone, PartialEq)]
pub struct DeltaBuilder {
    pub cleared: bool,
    pub stale: bool,
    stored: Vec<u64>,
    removed: Vec<u64>,
    /// Last operation per hash: true = stored.
    last: HashMap<u64, bool>,
}

impl DeltaBuilder {
    pub fn clear(&mut self) {
        self.cleared = true;
        self.stored.clear();
        self.removed.clear();
        self.last.clear();
    }

    pub fn store(&mut self, h: u64) {
        self.stored.push(h);
        self.last.insert(h, true);
    }

    pub fn remove(&mut self, h: u64) {
        self.removed.push(h);
        self.last.insert(h, false);
    }

    /// Hashes listed so far (an upper bound on the final count).
    pub fn hashes(&self) -> usize {
        self.stored.len() + self.removed.len()
    }

    pub fn is_empty(&self) -> bool {
        !self.cleared && !self.stale && self.stored.is_empty() && self.removed.is_empty()
    }

    /// Merges a later delta into this one.
    pub fn merge(&mut self, later: &Delta) {
        if later.cleared {
            self.clear();
        }
        self.stale = later.stale;
        for &h in &later.stored {
            self.store(h);
        }
        for &h in &later.removed {
            self.remove(h);
        }
    }

    pub fn finish(self) -> Delta {
        let last = self.last;
        let mut seen = hashbrown::HashSet::with_capacity(self.stored.len() + self.removed.len());
        let mut keep = |h: &u64, want: bool| last.get(h) == Some(&want) && seen.insert(*h);
        let stored = self.stored.into_iter().filter(|h| keep(h, true)).collect();
        let removed = self
            .removed
            .into_iter()
            .filter(|h| keep(h, false))
            .collect();
        Delta {
            cleared: self.cleared,
            stale: self.stale,
            stored,
            removed,
        }
    }
}

/// A finished per-worker delta.
#[derive(Default, Debug, Clone, PartialEq)]
pub struct Delta {
    pub cleared: bool,
    pub stale: bool,
    pub stored: Vec<u64>,
    pub removed: Vec<u64>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        !self.cleared && !self.stale && self.stored.is_empty() && self.removed.is_empty()
    }
}

/// What applying events counted.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    /// Stored blocks whose parent this index does not hold (not re-keyed).
    pub orphans: u64,
    /// Stored blocks with an engine block size other than ours (not re-keyed).
    pub size_mismatch: u64,
    /// Stored events whose token count does not match their blocks.
    pub bad_events: u64,
    /// Blocks evicted because the engine's table was full (announced removed).
    pub evicted: u64,
}

/// One engine's re-keying state.
pub struct EngineIndex {
    pub blocks: BlockTable,
    block_size: u32,
    model_seed: u64,
    lora_seeds: HashMap<String, u64>,
}

impl EngineIndex {
    pub fn new(model: &str, block_size: u32) -> Self {
        EngineIndex::with_max_blocks(model, block_size, DEFAULT_MAX_BLOCKS)
    }

    /// An index holding at most `max_blocks` blocks (see [`BlockTable::evict`]).
    pub fn with_max_blocks(model: &str, block_size: u32, max_blocks: usize) -> Self {
        EngineIndex {
            blocks: BlockTable::with_max(max_blocks),
            block_size,
            model_seed: chain_seed(model, None),
            lora_seeds: HashMap::new(),
        }
    }

    fn seed(&mut self, lora: Option<&str>) -> u64 {
        match lora {
            None => self.model_seed,
            Some(name) => {
                if let Some(s) = self.lora_seeds.get(name) {
                    return *s;
                }
                let s = chain_seed(name, None);
                if self.lora_seeds.len() < 4096 {
                    self.lora_seeds.insert(name.to_owned(), s);
                }
                s
            }
        }
    }

    /// Drops everything (AllBlocksCleared, restart, unrepaired gap).
    pub fn clear(&mut self, out: &mut DeltaBuilder) {
        self.blocks.clear();
        out.clear();
    }

    pub fn apply(&mut self, ev: &Event<'_>, out: &mut DeltaBuilder, c: &mut Counts) {
        match ev {
            Event::Cleared => self.clear(out),
            Event::Removed(hashes) => {
                for h in hashes {
                    match self.blocks.remove(*h) {
                        Removal::NotHeld => {}
                        Removal::CopyLeft => c.blocks_removed += 1,
                        Removal::Gone { kvroute, announce } => {
                            if announce {
                                out.remove(kvroute);
                            }
                            c.blocks_removed += 1;
                        }
                    }
                }
            }
            Event::Stored(s) => self.store(s, out, c),
        }
    }

    fn store(&mut self, s: &Stored<'_>, out: &mut DeltaBuilder, c: &mut Counts) {
        let n = s.block_hashes.len() as u64;
        let bs = self.block_size as usize;
        let engine_bs = match s.block_size {
            Some(b) => b as usize,
            None if !s.block_hashes.is_empty() => s.token_ids.len() / s.block_hashes.len(),
            None => bs,
        };
        if engine_bs != bs {
            c.size_mismatch += n;
            return;
        }
        if s.token_ids.len() != s.block_hashes.len().saturating_mul(bs) {
            c.bad_events += 1;
            return;
        }
        let (mut parent, mut depth) = match s.parent {
            None => (None, 0u32),
            Some(p) => match self.blocks.get(p) {
                Some((kv, d)) => (Some(kv), d.saturating_add(1)),
                None => {
                    c.orphans += n;
                    return;
                }
            },
        };
        let seed = self.seed(s.lora_name);
        let mut parent_engine = s.parent;
        for (i, (h, tokens)) in s
            .block_hashes
            .iter()
            .zip(s.token_ids.chunks_exact(bs))
            .enumerate()
        {
            if let Some(p) = parent_engine {
                self.blocks.touch(p);
            }
            if self.blocks.is_full() {
                c.evicted += self.blocks.evict(|kv| out.remove(kv)) as u64;
                if parent_engine.is_some_and(|p| self.blocks.get(p).is_none()) {
                    // Only when every older chain is gone already: the rest of this one
                    // would hang under a block the gateways no longer have.
                    c.orphans += n - i as u64;
                    return;
                }
            }
            let kv = token_block_hash(parent, tokens, seed);
            // An engine hash stored again under other tokens or another parent: the
            // gateways must drop the hash they were told before (unless another block
            // still holds it).
            if let Some(before) = self.blocks.insert_under(*h, kv, depth, parent_engine) {
                out.remove(before);
            }
            out.store(kv);
            c.blocks_stored += 1;
            parent = Some(kv);
            parent_engine = Some(*h);
            depth = depth.saturating_add(1);
        }
    }
}
