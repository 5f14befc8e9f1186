//! Ids and limits shared by the index, the load table, the events and the configuration,
//! defined once so the modules cannot drift apart.

use core::hash::{BuildHasher, Hasher};
use core::ops::RangeInclusive;

/// Dense index into the router's worker list.
pub type WorkerId = u16;

/// Worker ids `0..MAX_WORKERS` are valid; anything else is ignored. The index keeps worker
/// sets as 256-bit sets and node ids with the worker in 8 bits, so this cannot grow alone.
pub const MAX_WORKERS: usize = 256;

/// Globally unique across Envoy threads: the replicating VM's id sits in the high bits.
pub type RequestId = u64;

/// Bytes of text per token assumed for text prompts until `usage` calibrates it.
pub const DEFAULT_CHARS_PER_TOKEN: f64 = 4.0;

/// Chars-per-token values the configuration accepts and calibration may reach; outside it
/// an estimate is a measurement error, not a tokenizer.
pub const CHARS_PER_TOKEN_RANGE: RangeInclusive<f64> = 0.5..=64.0;

/// Spreads a block hash over every bit with one multiply-xorshift. Block hashes are
/// already xxh3 output, but tests and callers may feed small integers, and the hash tables
/// take their home slot from the high bits and their tag from the low ones.
#[inline]
pub fn mix(h: u64) -> u64 {
    let x = (h ^ (h >> 31)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^ (x >> 29)
}

/// `mix` under a per-process secret key: which table line or bucket a block hash lands in
/// cannot be predicted without the key, so prompts crafted to collide under the public
/// `mix` (block hashes are xxh3 of client text, searchable by brute force) spread like any
/// others. Two rounds, so a chosen input difference does not pass through the key.
#[inline]
pub fn keyed_mix(h: u64, key: u64) -> u64 {
    mix(mix(h ^ key) ^ key.rotate_left(32))
}

/// Hasher for maps keyed by block hashes (and small tuples of them): block hashes are
/// already hash output (xxh3), so `keyed_mix` replaces a general-purpose hash.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockHasher {
    state: u64,
    key: u64,
}

impl Hasher for BlockHasher {
    #[inline]
    fn finish(&self) -> u64 {
        keyed_mix(self.state, self.key)
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.state = self.state.rotate_left(8) ^ u64::from(b);
        }
    }

    /// Keys are single u64s: `finish` does all the mixing.
    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.state ^= x;
    }
}

/// Builds `BlockHasher`s under one secret key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyedState(pub u64);

impl BuildHasher for KeyedState {
    type Hasher = BlockHasher;
    #[inline]
    fn build_hasher(&self) -> BlockHasher {
        BlockHasher {
            state: 0,
            key: self.0,
        }
    }
}
