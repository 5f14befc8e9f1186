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
//!
//! Pinned blocks take room in the engine's KV that its evictable cache no longer has:
//! `reserved` counts, per worker, the distinct blocks confirmed requests hold there that
//! were not cached when they were routed, and the router shrinks that worker's LRU by as
//! many. Without it the LRU keeps ended prompts the engine has already evicted to make room
//! for the running ones, and under eviction pressure predicts hits that are not there.

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
    /// Leading blocks `worker` already held (index or requests in flight) when routed: the
    /// rest are new to its KV.
    pub cached: u32,
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
    /// Per worker: blocks held by confirmed requests there that were new to its KV (counted
    /// once however many requests share them).
    reserved: Vec<u32>,
}

impl Speculative {
    /// Maps hashed under the secret `key` (see `keyed_mix`).
    pub fn new(key: u64) -> Self {
        Speculative {
            reqs: HashMap::with_hasher(KeyedState(key)),
            confirmed: 0,
            held: HashMap::with_hasher(KeyedState(key)),
            reserved: Vec::new(),
        }
    }

    /// Blocks confirmed requests pin on worker `w` beyond what it had cached: room its
    /// evictable cache does not have while they run.
    pub fn reserved(&self, w: WorkerId) -> u32 {
        self.reserved.get(usize::from(w)).copied().unwrap_or(0)
    }

    /// Adds `more` to worker `w`'s reserved blocks and takes `less` from them.
    fn reserve(&mut self, w: WorkerId, more: u32, less: u32) {
        let wi = usize::from(w);
        if self.reserved.len() <= wi {
            self.reserved.resize(wi + 1, 0);
        }
        if let Some(r) = self.reserved.get_mut(wi) {
            *r = r.saturating_add(more).saturating_sub(less);
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
        let mut reserved = 0u32;
        for w in workers(p) {
            for &h in &p.hashes {
                if let Some(c) = self.held.get_mut(&slot(h, w)) {
                    if c.confirmed == 0 && c.reserving {
                        reserved += 1;
                    }
                    c.confirmed = c.confirmed.saturating_add(1);
                }
            }
        }
        let worker = p.worker;
        self.reserve(worker, reserved, 0);
        self.reqs.get(&id)
    }

    /// Records request `id`; a second `add` for the same id replaces nothing (replicas may see
    /// a decision twice only through a bug, and must not double-count it).
    pub fn add(&mut self, id: RequestId, p: Pending) {
        if p.hashes.is_empty() || self.reqs.contains_key(&id) {
            return;
        }
        for w in workers(&p) {
            for (k, &h) in p.hashes.iter().enumerate() {
                let c = self.held.entry(slot(h, w)).or_insert_with(|| Held {
                    // Only the serving worker keeps the blocks while the request runs (a
                    // prefill worker hands them over and caches them at once).
                    reserving: w == p.worker && k >= p.cached as usize,
                    ..Held::default()
                });
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
        let mut released = 0u32;
        for w in workers(&p) {
            for &h in &p.hashes {
                if let Entry::Occupied(mut e) = self.held.entry(slot(h, w)) {
                    let c = e.get_mut();
                    let was_pinned = c.confirmed > 0;
                    let last = c.all <= 1;
                    if last {
                        c.confirmed = 0;
                    } else {
                        c.all -= 1;
                        if p.confirmed {
                            c.confirmed = c.confirmed.saturating_sub(1);
                        }
                    }
                    if was_pinned && c.confirmed == 0 && c.reserving {
                        released += 1;
                    }
                    if last {
                        e.remove();
                    }
                }
            }
        }
        self.reserve(p.worker, 0, released);
        if self.reqs.is_empty() {
            self.confirmed = 0;
            self.reserved.iter_mut().for_each(|r| *r = 0);
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

    /// Requests whose id matches `pred` and whose whole prompt `hashes` extends by at least a
    /// block (block hashes are chained: their last one matching is enough), and whose last
    /// block no other request in flight expects on that worker: a block several requests
    /// share ends a shared prefix (a system prompt), not one conversation's turn.
    pub fn extended_by(&self, hashes: &[u64], pred: impl Fn(RequestId) -> bool) -> Vec<RequestId> {
        self.reqs
            .iter()
            .filter(|(id, p)| {
                pred(**id)
                    && p.hashes.len() < hashes.len()
                    && p.hashes
                        .len()
                        .checked_sub(1)
                        .and_then(|i| hashes.get(i))
                        .is_some_and(|h| p.hashes.last() == Some(h))
                    && p.hashes
                        .last()
                        .and_then(|h| self.held.get(&slot(*h, p.worker)))
                        .is_some_and(|c| c.all == 1)
            })
            .map(|(id, _)| *id)
            .collect()
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
    /// 16 bits keep the entry at 8 bytes; more confirmed requests than that sharing one
    /// block on one worker is beyond any engine's batch.
    confirmed: u16,
    /// The block was new to the worker's KV when the first request holding it was routed
    /// (see [`Speculative::reserved`]).
    reserving: bool,
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
            cached: 0,
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
    fn confirmed_requests_reserve_their_new_blocks_once() {
        let mut s = Speculative::default();
        // Two leading blocks were cached when it was routed: three are new.
        let mut a = pending(1, &[10, 11, 12, 13, 14], 1);
        a.cached = 2;
        s.add(1, a);
        // Shares the first four with the first request and adds one of its own.
        s.add(2, pending(1, &[10, 11, 12, 13, 20], 2));
        s.add(3, pending(0, &[10, 11], 3));
        assert_eq!(s.reserved(1), 0, "nothing runs before it is answered");
        s.confirm(2);
        // 10 and 11 were created by the first request as cached; 12, 13 and 20 are new.
        assert_eq!(s.reserved(1), 3);
        s.confirm(1);
        assert_eq!(s.reserved(1), 4, "14; the shared ones count once");
        s.confirm(3);
        assert_eq!((s.reserved(0), s.reserved(1)), (2, 4));
        s.take(2);
        assert_eq!(
            s.reserved(1),
            3,
            "20 is free; 12 and 13 are still held by the first"
        );
        s.take(1);
        assert_eq!(s.reserved(1), 0);
        assert_eq!(s.reserved(0), 2);
        s.take(3);
        assert_eq!((s.reserved(0), s.reserved(9)), (0, 0));
    }

    #[test]
    fn a_prefill_worker_reserves_nothing() {
        let mut s = Speculative::default();
        let mut p = pending(0, &[7, 8], 1);
        p.prefill = Some(2);
        s.add(9, p);
        s.confirm(9);
        assert_eq!((s.reserved(0), s.reserved(2)), (2, 0));
        s.take(9);
        assert_eq!(s.reserved(0), 0);
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
