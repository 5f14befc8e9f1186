//! The reuse ladder: for each routed request, how much of its prompt could have come from a
//! prefix cache at four levels, so the gap between two levels names one cause of a low hit
//! rate (docs/diagnosing.md):
//!
//! - `workload`: leading blocks some earlier request already sent (an infinite cache's
//!   hit, up to the window of [`Sketch`]);
//! - `fleet`: the longest prefix any eligible worker holds at decision time;
//! - `routed`: the prefix the worker that computes the prompt holds (the prefill worker when
//!   the prefill pool takes the request: its cache is the one read, and its usage is what
//!   the client gets back);
//! - `served`: what the engine reported cached (`usage.prompt_tokens_details.cached_tokens`).
//!
//! `workload >= fleet >= routed` holds by construction (a block a worker holds was seen, even
//! when the window forgot it or another gateway sent it); `served` is the engine's own count
//! and differs from `routed` by the index's error.

use crate::feedback::Usage;
use crate::ids::keyed_mix;

/// Slots per bucket: one bucket is 8 fingerprints and 8 stamps, 64 bytes.
const WAYS: usize = 8;
/// Bytes one slot takes: a 4-byte fingerprint and a 4-byte recency stamp.
pub const SLOT_BYTES: usize = 8;
/// Bounds of the sketch, in slots (blocks remembered): 32 KiB to 4 MiB per VM.
pub const MIN_SLOTS: usize = 1 << 12;
pub const MAX_SLOTS: usize = 1 << 19;
/// Slots per block of fleet KV: the window is several times what the fleet can cache, so
/// `workload - fleet` shows what more KV would buy.
pub const SLOTS_PER_KV_BLOCK: u64 = 4;

/// Block hashes seen in recent requests: a fixed-size, set-associative table of 32-bit
/// fingerprints with a recency stamp, the least recently seen slot of a bucket replaced
/// first. Its window is about its slot count in distinct blocks (an LRU cache of that many
/// blocks). A fingerprint collision makes a block look seen: with 8 slots a bucket and 32
/// bits, about one lookup in 500 million.
#[derive(Debug, Clone)]
pub struct Sketch {
    fps: Vec<u32>,
    stamps: Vec<u32>,
    /// Buckets minus one (a power of two minus one).
    mask: usize,
    /// Requests inserted (wraps after 2^32; ages compare by wrapping difference).
    clock: u32,
    key: u64,
}

impl Sketch {
    /// At least `slots` slots (rounded up to a power of two, at least one bucket).
    pub fn with_slots(slots: usize, key: u64) -> Sketch {
        let slots = slots.max(WAYS).next_power_of_two();
        Sketch {
            fps: vec![0; slots],
            stamps: vec![0; slots],
            mask: slots / WAYS - 1,
            clock: 0,
            key,
        }
    }

    /// Sized for a fleet caching `kv_blocks` blocks in all: [`SLOTS_PER_KV_BLOCK`] slots a
    /// block, within [`MIN_SLOTS`]..=[`MAX_SLOTS`].
    pub fn for_fleet(kv_blocks: u64, key: u64) -> Sketch {
        let want = kv_blocks.saturating_mul(SLOTS_PER_KV_BLOCK);
        let slots = usize::try_from(want)
            .unwrap_or(MAX_SLOTS)
            .clamp(MIN_SLOTS, MAX_SLOTS);
        Sketch::with_slots(slots, key)
    }

    pub fn slots(&self) -> usize {
        self.fps.len()
    }

    /// Memory the table takes.
    pub fn bytes(&self) -> usize {
        self.slots() * SLOT_BYTES
    }

    /// (first slot of the bucket, fingerprint) of a block hash.
    fn place(&self, h: u64) -> (usize, u32) {
        let m = keyed_mix(h, self.key);
        let bucket = (m as usize) & self.mask;
        let fp = ((m >> 32) as u32).max(1);
        (bucket * WAYS, fp)
    }

    fn find(&self, h: u64) -> Option<usize> {
        let (start, fp) = self.place(h);
        let ways = self.fps.get(start..start + WAYS)?;
        ways.iter().position(|&f| f == fp).map(|i| start + i)
    }

    /// How many leading blocks of a prompt were seen: up to its last seen block. Block
    /// hashes are chained, so a seen block means its whole prefix was sent; an earlier block
    /// that its bucket dropped since does not cut the prefix short (a long prefix would
    /// otherwise rarely survive whole in a full table).
    pub fn leading(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .rposition(|&h| self.find(h).is_some())
            .map_or(0, |i| i + 1)
    }

    /// Remembers a request's blocks.
    pub fn insert(&mut self, hashes: &[u64]) {
        if hashes.is_empty() {
            return;
        }
        self.clock = self.clock.wrapping_add(1);
        let now = self.clock;
        for &h in hashes {
            let (start, fp) = self.place(h);
            let slot = match self.find(h) {
                Some(i) => i,
                None => {
                    // The empty or least recently seen slot of the bucket.
                    let Some(stamps) = self.stamps.get(start..start + WAYS) else {
                        continue;
                    };
                    let oldest = (0..WAYS)
                        .max_by_key(|&i| {
                            let empty = self.fps.get(start + i).is_some_and(|&f| f == 0);
                            let age = stamps.get(i).map_or(0, |&s| now.wrapping_sub(s));
                            (empty, age)
                        })
                        .unwrap_or(0);
                    start + oldest
                }
            };
            if let (Some(f), Some(s)) = (self.fps.get_mut(slot), self.stamps.get_mut(slot)) {
                *f = fp;
                *s = now;
            }
        }
    }

    /// The prompt's seen leading blocks, then remembers it.
    pub fn observe(&mut self, hashes: &[u64]) -> usize {
        let seen = self.leading(hashes);
        self.insert(hashes);
        seen
    }
}

/// One decision's rungs, in the router's prompt tokens (estimated for text prompts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ladder {
    pub workload: u32,
    pub fleet: u32,
    pub routed: u32,
}

/// What one request adds to the ladder's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rungs {
    pub prompt: u64,
    pub workload: u64,
    pub fleet: u64,
    pub routed: u64,
    /// Only when the engine reported its cached tokens.
    pub served: Option<u64>,
}

impl Ladder {
    /// From the blocks seen before (`seen`), the most any eligible worker holds (`fleet`)
    /// and what the serving worker holds (`routed`), all in blocks; `tokens` converts a
    /// block count to prompt tokens (capped at the prompt). The rungs are made ordered:
    /// whatever a worker holds was seen, and the serving worker is one of the eligible.
    pub fn from_blocks(seen: u32, fleet: u32, routed: u32, tokens: impl Fn(u32) -> u32) -> Ladder {
        let fleet = fleet.max(routed);
        let workload = seen.max(fleet);
        Ladder {
            workload: tokens(workload),
            fleet: tokens(fleet),
            routed: tokens(routed),
        }
    }

    /// The request's rungs. With the engine's usage carrying cached tokens, all are in the
    /// engine's tokens: the router's estimates scaled by the engine's prompt count over the
    /// router's (exact for token-id prompts; for text, the estimate's error on this very
    /// prompt cancels), `served` the engine's count. Otherwise in the router's tokens and
    /// without `served`.
    pub fn rungs(&self, prompt_tokens: u32, usage: Option<&Usage>) -> Rungs {
        match usage {
            Some(u) if u.prompt_tokens > 0 && prompt_tokens > 0 => {
                if let Some(cached) = u.cached_tokens {
                    let engine = u64::from(u.prompt_tokens);
                    let scale = |v: u32| -> u64 {
                        (u64::from(v) * engine + u64::from(prompt_tokens) / 2)
                            / u64::from(prompt_tokens)
                    };
                    return Rungs {
                        prompt: engine,
                        workload: scale(self.workload).min(engine),
                        fleet: scale(self.fleet).min(engine),
                        routed: scale(self.routed).min(engine),
                        served: Some(u64::from(cached).min(engine)),
                    };
                }
                self.estimated(prompt_tokens)
            }
            _ => self.estimated(prompt_tokens),
        }
    }

    fn estimated(&self, prompt_tokens: u32) -> Rungs {
        Rungs {
            prompt: u64::from(prompt_tokens),
            workload: u64::from(self.workload),
            fleet: u64::from(self.fleet),
            routed: u64::from(self.routed),
            served: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn chain(root: u64, n: usize) -> Vec<u64> {
        let mut h = root;
        (0..n)
            .map(|i| {
                h = keyed_mix(h ^ (i as u64 + 1), root);
                h
            })
            .collect()
    }

    #[test]
    fn sizes_from_the_fleet_within_bounds() {
        assert_eq!(Sketch::for_fleet(0, 1).slots(), MIN_SLOTS);
        assert_eq!(Sketch::for_fleet(10_000, 1).slots(), 1 << 16);
        assert_eq!(Sketch::for_fleet(u64::MAX, 1).slots(), MAX_SLOTS);
        assert_eq!(Sketch::for_fleet(u64::MAX, 1).bytes(), 4 << 20);
        assert_eq!(Sketch::with_slots(0, 1).slots(), WAYS);
        assert_eq!(Sketch::with_slots(100, 1).slots(), 128);
    }

    #[test]
    fn counts_leading_blocks_seen_before() {
        let mut s = Sketch::with_slots(1 << 12, 7);
        let doc = chain(1, 40);
        assert_eq!(s.observe(&doc), 0);
        assert_eq!(s.observe(&doc), 40);
        // The same document with another question: its leading 40 blocks, not the tail.
        let mut longer = doc.clone();
        longer.extend(chain(99, 10));
        assert_eq!(s.observe(&longer), 40);
        assert_eq!(s.leading(&longer), 50);
        // A prompt that shares only the first blocks.
        let mut branch = doc[..10].to_vec();
        branch.extend(chain(3, 30));
        assert_eq!(s.observe(&branch), 10);
        assert_eq!(s.leading(&[]), 0);
    }

    #[test]
    fn the_window_is_about_its_slot_count() {
        // 4096 slots: 16 prompts of 128 blocks fit, the first of 64 such prompts does not.
        let mut s = Sketch::with_slots(4096, 3);
        let prompts: Vec<Vec<u64>> = (0..64).map(|i| chain(1000 + i, 128)).collect();
        for p in prompts.iter().take(16) {
            s.insert(p);
        }
        let kept: usize = prompts.iter().take(16).map(|p| s.leading(p)).sum();
        assert!(kept >= 16 * 128 * 95 / 100, "{kept}");
        for p in prompts.iter().skip(16) {
            s.insert(p);
        }
        // The oldest prompts went first (a stray block of theirs may remain), the newest
        // stayed.
        let blocks_kept = |ps: &[Vec<u64>]| -> usize {
            ps.iter()
                .map(|p| p.iter().filter(|&&h| s.find(h).is_some()).count())
                .sum()
        };
        assert!(
            blocks_kept(&prompts[..8]) < 8 * 128 / 20,
            "{}",
            blocks_kept(&prompts[..8])
        );
        assert!(blocks_kept(&prompts[56..]) > 8 * 128 * 95 / 100);
        let recent: usize = prompts.iter().skip(56).map(|p| s.leading(p)).sum();
        assert!(recent >= 8 * 128 * 90 / 100, "{recent}");
        // A prompt seen again stays (refreshed), under a stream of new ones.
        let hot = chain(5, 32);
        s.insert(&hot);
        for i in 0..200 {
            s.insert(&chain(20_000 + i, 32));
            if i % 10 == 0 {
                s.insert(&hot);
            }
        }
        assert_eq!(s.leading(&hot), 32);
    }

    #[test]
    fn unrelated_prompts_are_not_seen() {
        let mut s = Sketch::with_slots(1 << 14, 11);
        for i in 0..100 {
            s.insert(&chain(i, 64));
        }
        let false_hits: usize = (0..1000).map(|i| s.leading(&chain(1_000_000 + i, 8))).sum();
        assert_eq!(false_hits, 0);
    }

    #[test]
    fn ladder_is_ordered_and_capped() {
        let t = |b: u32| (b * 16).min(100);
        let l = Ladder::from_blocks(2, 5, 3, t);
        // A worker held 5 blocks though only 2 were seen (another gateway's request).
        assert_eq!(
            l,
            Ladder {
                workload: 80,
                fleet: 80,
                routed: 48
            }
        );
        let l = Ladder::from_blocks(9, 0, 4, t);
        assert_eq!((l.workload, l.fleet, l.routed), (100, 64, 64));
    }

    #[test]
    fn rungs_in_engine_tokens_when_reported() {
        let l = Ladder {
            workload: 800,
            fleet: 600,
            routed: 400,
        };
        let u = |cached| Usage {
            prompt_tokens: 1100,
            completion_tokens: 3,
            cached_tokens: cached,
        };
        // Estimated 1000 tokens, the engine counted 1100: rungs scale by 1.1.
        let r = l.rungs(1000, Some(&u(Some(384))));
        assert_eq!(
            r,
            Rungs {
                prompt: 1100,
                workload: 880,
                fleet: 660,
                routed: 440,
                served: Some(384)
            }
        );
        // No cached tokens in usage, or no usage: the router's tokens, no served rung.
        let est = Rungs {
            prompt: 1000,
            workload: 800,
            fleet: 600,
            routed: 400,
            served: None,
        };
        assert_eq!(l.rungs(1000, Some(&u(None))), est);
        assert_eq!(l.rungs(1000, None), est);
        // Nothing divides by zero; served never exceeds the prompt.
        assert_eq!(l.rungs(0, Some(&u(Some(5)))).prompt, 0);
        let r = l.rungs(
            1000,
            Some(&Usage {
                prompt_tokens: 100,
                completion_tokens: 0,
                cached_tokens: Some(500),
            }),
        );
        assert_eq!((r.workload, r.served), (80, Some(100)));
    }
}
