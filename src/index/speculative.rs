//! Prompts of requests in flight: what each is expected to hold in its worker's KV cache.
//! They enter the `PrefixIndex` only when the request ends, after a successful answer.
//!
//! Until the worker answers, an entry is speculative: lookups see it, so a burst of
//! identical requests sees each other's picks (no herding onto the same cold worker), but
//! it evicts nothing. A request the engine rejects (400 for an oversize prompt, a client
//! abort before the answer) is simply dropped and leaves the warm prefixes of its worker
//! untouched.
//!
//! A 2xx answer confirms it (`confirm`): the engine computed those blocks, and keeps them
//! pinned while the request decodes, however much else it caches meanwhile. When the
//! request ends they become evictable, the most recently freed last, and that is when they
//! go into the index's LRU. Inserted when the request was routed or answered instead, a
//! long answer's prompt would age in the LRU while the engine still held it, and the next
//! turn of that conversation would look like a miss on every worker.

use crate::ids::{KeyedState, RequestId, WorkerId};
use hashbrown::hash_map::Entry;
use hashbrown::HashMap;

/// One request's expected blocks and where they go.
#[derive(Debug, Clone, PartialEq)]
pub struct Pending {
    pub worker: WorkerId,
    pub prefill: Option<WorkerId>,
    pub hashes: Vec<u64>,
    pub at_ms: u64,
    /// The worker answered: the blocks are computed, pinned until the request ends.
    pub confirmed: bool,
}

/// Requests in flight and, per (block, worker), how many of them expect or hold it.
#[derive(Debug, Default)]
pub struct Speculative {
    reqs: HashMap<RequestId, Pending, KeyedState>,
    /// How many of `reqs` are confirmed.
    confirmed: usize,
    /// Keyed by `slot(block, worker)`: how many requests expect the block there, and how
    /// many of those are confirmed.
    held: HashMap<u64, Held, KeyedState>,
}

impl Speculative {
    /// Maps hashed under the secret `key` (see `keyed_mix`).
    pub fn new(key: u64) -> Self {
        Speculative {
            reqs: HashMap::with_hasher(KeyedState(key)),
            confirmed: 0,
            held: HashMap::with_hasher(KeyedState(key)),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Requests not confirmed yet.
    pub fn unconfirmed(&self) -> usize {
        self.reqs.len().saturating_sub(self.confirmed)
    }

    /// Marks request `id` confirmed and returns it (a prefill worker's blocks go into the
    /// index now), once: `None` when it is unknown or was already confirmed.
    pub fn confirm(&mut self, id: RequestId) -> Option<&Pending> {
        let p = self.reqs.get_mut(&id)?;
        if p.confirmed {
            return None;
        }
        p.confirmed = true;
        self.confirmed += 1;
        for w in workers(p) {
            for &h in &p.hashes {
                if let Some(c) = self.held.get_mut(&slot(h, w)) {
                    c.confirmed = c.confirmed.saturating_add(1);
                }
            }
        }
        Some(p)
    }

    /// Records request `id`; a second `add` for the same id replaces nothing (replicas may see
    /// a decision twice only through a bug, and must not double-count it).
    pub fn add(&mut self, id: RequestId, p: Pending) {
        if p.hashes.is_empty() || self.reqs.contains_key(&id) {
            return;
        }
        for w in workers(&p) {
            for &h in &p.hashes {
                let c = self.held.entry(slot(h, w)).or_default();
                c.all = c.all.saturating_add(1);
            }
        }
        self.reqs.insert(id, p);
    }

    pub fn get(&self, id: RequestId) -> Option<&Pending> {
        self.reqs.get(&id)
    }

    /// Removes request `id` and returns it (to insert into the index when confirmed).
    pub fn take(&mut self, id: RequestId) -> Option<Pending> {
        let p = self.reqs.remove(&id)?;
        if p.confirmed {
            self.confirmed = self.confirmed.saturating_sub(1);
        }
        for w in workers(&p) {
            for &h in &p.hashes {
                if let Entry::Occupied(mut e) = self.held.entry(slot(h, w)) {
                    let c = e.get_mut();
                    if c.all <= 1 {
                        e.remove();
                    } else {
                        c.all -= 1;
                        if p.confirmed {
                            c.confirmed = c.confirmed.saturating_sub(1);
                        }
                    }
                }
            }
        }
        if self.reqs.is_empty() {
            self.confirmed = 0;
            // Every count is back to 0; drop a large allocation left by a huge prompt.
            self.held.clear();
            if self.held.capacity() > 4096 {
                self.held.shrink_to_fit();
            }
        }
        Some(p)
    }

    /// Extends each worker's leading run `out[w]` (from the index) through blocks that
    /// requests in flight expect or hold on that worker.
    pub fn extend(&self, hashes: &[u64], out: &mut [u32]) {
        self.extend_where(hashes, out, |c| c.all > 0);
    }

    /// `extend` through the blocks of confirmed requests only: blocks the engine computed.
    pub fn extend_confirmed(&self, hashes: &[u64], out: &mut [u32]) {
        if self.confirmed > 0 {
            self.extend_where(hashes, out, |c| c.confirmed > 0);
        }
    }

    fn extend_where(&self, hashes: &[u64], out: &mut [u32], counts: impl Fn(&Held) -> bool) {
        if self.held.is_empty() {
            return;
        }
        for (w, run) in out.iter_mut().enumerate() {
            let Ok(wid) = WorkerId::try_from(w) else {
                break;
            };
            let mut k = *run as usize;
            while let Some(&h) = hashes.get(k) {
                if !self.held.get(&slot(h, wid)).is_some_and(&counts) {
                    break;
                }
                k += 1;
            }
            *run = u32::try_from(k).unwrap_or(u32::MAX);
        }
    }

    /// Drops every request whose id matches `pred`; returns how many.
    pub fn drop_matching(&mut self, pred: impl Fn(RequestId) -> bool) -> usize {
        let ids: Vec<RequestId> = self.reqs.keys().copied().filter(|&id| pred(id)).collect();
        for id in &ids {
            self.take(*id);
        }
        ids.len()
    }

    /// Drops requests picked at or before `before_ms` (their confirmation or end was lost);
    /// returns how many.
    pub fn expire(&mut self, before_ms: u64) -> usize {
        let old: Vec<RequestId> = self
            .reqs
            .iter()
            .filter(|(_, p)| p.at_ms <= before_ms)
            .map(|(&id, _)| id)
            .collect();
        for id in &old {
            self.take(*id);
        }
        old.len()
    }
}

/// Requests in flight expecting one block on one worker.
#[derive(Debug, Default, Clone, Copy)]
struct Held {
    all: u32,
    confirmed: u32,
}

/// One u64 per (block, worker): the block hash (xxh3 output, not chosen by clients) moved by
/// a per-worker odd constant. Two pairs share a key only if their hashes differ by exactly
/// the difference of those constants: a 2^-64 accident, as for block hashes themselves.
#[inline]
fn slot(h: u64, w: WorkerId) -> u64 {
    h ^ (u64::from(w) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn workers(p: &Pending) -> impl Iterator<Item = WorkerId> {
    let second = p.prefill.filter(|&x| x != p.worker);
    core::iter::once(p.worker).chain(second)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(worker: WorkerId, hashes: &[u64], at_ms: u64) -> Pending {
        Pending {
            worker,
            prefill: None,
            hashes: hashes.to_vec(),
            at_ms,
            confirmed: false,
        }
    }

    #[test]
    fn extends_runs_and_forgets_on_take() {
        let mut s = Speculative::default();
        s.add(1, pending(1, &[10, 11, 12], 5));
        s.add(2, pending(1, &[10, 11], 6));
        let mut out = [0u32, 0, 0];
        s.extend(&[10, 11, 12, 13], &mut out);
        assert_eq!(out, [0, 3, 0]);
        // The index already had 1 block for worker 0 and 2 for worker 2: runs stay theirs
        // unless the speculative blocks continue them.
        let mut out = [1u32, 2, 2];
        s.extend(&[10, 11, 12, 13], &mut out);
        assert_eq!(out, [1, 3, 2]);
        assert!(s.take(1).is_some());
        let mut out = [0u32; 3];
        s.extend(&[10, 11, 12], &mut out);
        assert_eq!(out, [0, 2, 0]);
        assert_eq!(s.take(1), None);
        assert_eq!(s.expire(6), 1);
        assert!(s.is_empty());
        let mut out = [0u32; 3];
        s.extend(&[10], &mut out);
        assert_eq!(out, [0, 0, 0]);
    }

    #[test]
    fn confirmed_requests_count_as_computed_until_taken() {
        let mut s = Speculative::default();
        s.add(1, pending(1, &[10, 11, 12], 5));
        s.add(2, pending(1, &[10, 11], 6));
        let confirmed = |s: &Speculative| {
            let mut out = [0u32; 2];
            s.extend_confirmed(&[10, 11, 12], &mut out);
            out
        };
        assert_eq!(confirmed(&s), [0, 0]);
        assert_eq!(s.confirm(2).map(|p| p.hashes.len()), Some(2));
        assert_eq!(s.confirm(2), None, "once");
        assert_eq!(s.confirm(9), None);
        assert_eq!(confirmed(&s), [0, 2]);
        assert_eq!((s.len(), s.unconfirmed()), (2, 1));
        // The unconfirmed request that shares the blocks leaves: the confirmed one still holds.
        assert!(s.take(1).is_some_and(|p| !p.confirmed));
        assert_eq!(confirmed(&s), [0, 2]);
        let mut out = [0u32; 2];
        s.extend(&[10, 11, 12], &mut out);
        assert_eq!(out, [0, 2]);
        assert!(s.take(2).is_some_and(|p| p.confirmed));
        assert_eq!(confirmed(&s), [0, 0]);
        assert_eq!((s.len(), s.unconfirmed()), (0, 0));
    }

    #[test]
    fn prefill_worker_counts_too_and_duplicates_are_ignored() {
        let mut s = Speculative::default();
        let mut p = pending(0, &[7, 8], 1);
        p.prefill = Some(2);
        s.add(9, p.clone());
        s.add(9, p);
        let mut out = [0u32; 3];
        s.extend(&[7, 8], &mut out);
        assert_eq!(out, [2, 0, 2]);
        s.take(9);
        let mut out = [0u32; 3];
        s.extend(&[7, 8], &mut out);
        assert_eq!(out, [0, 0, 0]);
        assert_eq!(s.len(), 0);
    }
}
