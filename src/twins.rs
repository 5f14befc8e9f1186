//! Text blocks read through engine blocks (precise mode without tokenizing on the request
//! path).
//!
//! Engines report their KV cache in blocks of token ids, which a text or chat prompt's block
//! hashes (chunks of canonical text) never match. Asking the engine's `/tokenize` before
//! routing makes them match, but puts a call on every request's path: measured under CPU
//! contention it waited ~100 ms p50 and missed a 100 ms timeout on a quarter of the requests
//! (issue 42). Instead the filter routes on the text at once, asks `/tokenize` off the path,
//! and learns from the answer which engine block each text block of that prompt ends in. A
//! later prompt sharing those text blocks is then looked up in the engine-fed index through
//! them: "held" means the engine reports the token block the text block was learned to end in.
//!
//! The alignment is proportional (text block `i` of `n` ends near token block
//! `(i + 1) * m / n` of `m`), moved back by a margin for the uneven density of text (the
//! tokenize answer has no offsets): a text block is never mapped past its own end unless the
//! density varies by more than the margin, and a worker that evicted the last few token blocks
//! of a text block but holds the one before may be credited with it (at most the margin). Since
//! chained hashes name a whole prefix, an entry is right for every prompt sharing the text
//! block, whichever prompt it was learned from.

use crate::ids::KeyedState;
use hashbrown::HashMap;
use std::collections::VecDeque;

/// Entries kept per VM (16 bytes each plus the map's overhead, ~10 MiB at most): the text
/// blocks of the most recently learned prompts; the oldest are forgotten first.
pub const CAPACITY: usize = 1 << 18;

/// Text block hash -> the engine (token) block hash it is known to end in.
#[derive(Debug)]
pub struct Twins {
    map: HashMap<u64, u64, KeyedState>,
    order: VecDeque<u64>,
    cap: usize,
}

/// Token blocks of slack before the proportional position: 2, plus 1 in 32 (3 %).
fn margin(m: usize) -> usize {
    2 + m / 32
}

/// For each of `n` text blocks, the index of the token block (of `m`) it is mapped to.
pub fn align(n: usize, m: usize) -> impl Iterator<Item = usize> {
    let back = margin(m);
    (0..n).map(move |i| {
        let end = (i + 1).saturating_mul(m) / n.max(1);
        end.saturating_sub(1 + back)
    })
}

impl Twins {
    pub fn new(key: u64) -> Self {
        Self::with_capacity(key, CAPACITY)
    }

    pub fn with_capacity(key: u64, cap: usize) -> Self {
        Twins {
            map: HashMap::with_hasher(KeyedState(key)),
            order: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The pairs (text block, token block) one prompt teaches: its text and token chains.
    /// Nothing when either is empty.
    pub fn pairs(text: &[u64], tokens: &[u64]) -> (Vec<u64>, Vec<u64>) {
        if text.is_empty() || tokens.is_empty() {
            return (Vec::new(), Vec::new());
        }
        let mut t = Vec::with_capacity(text.len());
        let mut k = Vec::with_capacity(text.len());
        for (&h, j) in text.iter().zip(align(text.len(), tokens.len())) {
            if let Some(&tok) = tokens.get(j) {
                t.push(h);
                k.push(tok);
            }
        }
        (t, k)
    }

    /// Records pairs (from [`Twins::pairs`], here or on another VM). Known text blocks keep
    /// their first mapping.
    pub fn learn(&mut self, text: &[u64], tokens: &[u64]) {
        for (&t, &k) in text.iter().zip(tokens) {
            if self.map.contains_key(&t) {
                continue;
            }
            if self.map.len() >= self.cap {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
            self.map.insert(t, k);
            self.order.push_back(t);
        }
    }

    /// Whether asking for this prompt's tokens is worth a call: more of its text blocks than
    /// one, and than an eighth, are past the leading ones already mapped. A new question on a
    /// known document asks nothing (measured on docqa: one call per request otherwise, each an
    /// engine-side tokenization of the whole prompt).
    pub fn wants(&self, text: &[u64]) -> bool {
        let known = text
            .iter()
            .take_while(|h| self.map.contains_key(*h))
            .count();
        let unknown = text.len().saturating_sub(known);
        unknown > (text.len() / 8).max(1) || (known == 0 && unknown > 0)
    }

    /// The engine block one text block is known to end in.
    pub fn translate_one(&self, text: u64) -> Option<u64> {
        self.map.get(&text).copied()
    }

    /// The engine blocks of the leading text blocks known here, one per text block (empty
    /// when the first is unknown).
    pub fn translate(&self, text: &[u64]) -> Vec<u64> {
        if self.map.is_empty() {
            return Vec::new();
        }
        text.iter()
            .map_while(|h| self.map.get(h).copied())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn alignment_stays_behind_the_proportional_end() {
        let a: Vec<usize> = align(4, 4).collect();
        assert_eq!(a, vec![0, 0, 0, 1]);
        // 100 text blocks over 100 token blocks: 5 back (2 + 100/32).
        let a: Vec<usize> = align(100, 100).collect();
        assert_eq!(a[99], 94);
        assert_eq!(a[10], 5);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        // More text blocks than token blocks: never past the last.
        assert!(align(50, 10).all(|j| j < 10));
    }

    #[test]
    fn a_shared_prefix_translates_through_any_prompt_that_taught_it() {
        let mut t = Twins::new(7);
        let text: Vec<u64> = (1..=40).collect();
        let toks: Vec<u64> = (1001..=1040).collect();
        assert!(t.wants(&text));
        let (a, b) = Twins::pairs(&text, &toks);
        assert_eq!(a.len(), 40);
        t.learn(&a, &b);
        assert!(!t.wants(&text));
        // Another prompt: the same first 30 text blocks, then its own.
        let mut other: Vec<u64> = (1..=30).collect();
        other.extend(500..510);
        let tr = t.translate(&other);
        assert_eq!(tr.len(), 30);
        assert_eq!(tr[29], b[29]);
        // 10 of 40 unknown: worth a call; 2 of 40 (a new question on a known document): not.
        assert!(t.wants(&other));
        let mut question: Vec<u64> = (1..=38).collect();
        question.extend([600, 601]);
        assert!(!t.wants(&question));
        // Unknown first block: nothing.
        assert!(t.translate(&[999, 1, 2]).is_empty());
        // A one-block prompt is worth learning until known.
        assert!(t.wants(&[77]));
    }

    #[test]
    fn oldest_entries_go_first_at_capacity() {
        let mut t = Twins::with_capacity(1, 4);
        t.learn(&[1, 2, 3], &[11, 12, 13]);
        t.learn(&[4, 5], &[14, 15]);
        assert_eq!(t.len(), 4);
        assert!(t.translate(&[1]).is_empty());
        assert_eq!(t.translate(&[2, 3, 4, 5]), vec![12, 13, 14, 15]);
        // A known block keeps its first mapping and takes no room.
        t.learn(&[5], &[99]);
        assert_eq!(t.translate(&[2, 3, 4, 5]), vec![12, 13, 14, 15]);
        assert!(Twins::pairs(&[], &[1]).0.is_empty());
    }
}
