//! Which prefix family each worker's recent requests came from, so the hot-spot term can
//! shed the family that makes a worker hot rather than a bystander.
//!
//! A request's family is the longest prefix some worker already holds for it, named by the
//! hash of that prefix's last block: every question on one tenant's system prompt or one
//! document shares it, and each later turn of a conversation starts a family of its own
//! (its previous turn). Moving a request whose family brings most of a hot worker's traffic
//! relieves the worker for every later request of that family once copied; moving a
//! bystander costs the same copy and relieves almost nothing.
//!
//! Counts are per VM (each Envoy thread sees a sample of the traffic) and only ever read
//! as a share of the same VM's count for the worker, which that sample estimates. They
//! decay with the cache-balance half-life, like the load table's recent requests.

use hashbrown::HashMap;

use crate::ids::{KeyedState, WorkerId};

/// Families remembered at most; past it the least recently seen half is forgotten.
pub const MAX_FAMILIES: usize = 4096;

#[derive(Debug, Clone, Copy, Default)]
struct Decaying {
    value: f64,
    at_ms: u64,
}

impl Decaying {
    fn at(&self, now_ms: u64, half_life_ms: u64) -> f64 {
        crate::load::decay(self.value, self.at_ms, now_ms, half_life_ms)
    }

    fn add(&mut self, now_ms: u64, half_life_ms: u64) {
        self.value = self.at(now_ms, half_life_ms) + 1.0;
        self.at_ms = self.at_ms.max(now_ms);
    }
}

#[derive(Debug, Clone, Default)]
struct Family {
    seen_ms: u64,
    /// Per worker that took some of it; usually one or two.
    counts: Vec<(WorkerId, Decaying)>,
}

#[derive(Debug, Clone)]
pub struct Families {
    half_life_ms: u64,
    cap: usize,
    by_key: HashMap<u64, Family, KeyedState>,
    /// Every routed request per worker, family or not.
    totals: Vec<Decaying>,
}

impl Families {
    pub fn new(workers: usize, half_life_ms: u64, hash_key: u64) -> Self {
        Self::with_cap(workers, half_life_ms, hash_key, MAX_FAMILIES)
    }

    pub fn with_cap(workers: usize, half_life_ms: u64, hash_key: u64, cap: usize) -> Self {
        Families {
            half_life_ms,
            cap: cap.max(2),
            by_key: HashMap::with_hasher(KeyedState(hash_key)),
            totals: vec![Decaying::default(); workers],
        }
    }

    /// A request went to `worker`; `family` is None for a prefix no worker held.
    pub fn record(&mut self, family: Option<u64>, worker: WorkerId, now_ms: u64) {
        let hl = self.half_life_ms;
        let Some(total) = self.totals.get_mut(usize::from(worker)) else {
            return;
        };
        total.add(now_ms, hl);
        let Some(key) = family else {
            return;
        };
        if !self.by_key.contains_key(&key) && self.by_key.len() >= self.cap {
            self.forget_oldest();
        }
        let f = self.by_key.entry(key).or_default();
        f.seen_ms = f.seen_ms.max(now_ms);
        match f.counts.iter_mut().find(|(w, _)| *w == worker) {
            Some((_, c)) => c.add(now_ms, hl),
            None => {
                let mut c = Decaying::default();
                c.add(now_ms, hl);
                f.counts.push((worker, c));
            }
        }
    }

    /// Share (0..=1) of `worker`'s recent requests that belonged to `family`.
    pub fn share(&self, family: u64, worker: WorkerId, now_ms: u64) -> f64 {
        let hl = self.half_life_ms;
        let total = self
            .totals
            .get(usize::from(worker))
            .map_or(0.0, |t| t.at(now_ms, hl));
        if total <= 0.0 {
            return 0.0;
        }
        let mine = self
            .by_key
            .get(&family)
            .and_then(|f| f.counts.iter().find(|(w, _)| *w == worker))
            .map_or(0.0, |(_, c)| c.at(now_ms, hl));
        (mine / total).clamp(0.0, 1.0)
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Drops the least recently seen half: O(n) once every `cap / 2` new families.
    fn forget_oldest(&mut self) {
        let mut seen: Vec<u64> = self.by_key.values().map(|f| f.seen_ms).collect();
        let mid = seen.len() / 2;
        if seen.is_empty() {
            return;
        }
        seen.select_nth_unstable(mid);
        let cut = seen.get(mid).copied().unwrap_or(0);
        self.by_key.retain(|_, f| f.seen_ms > cut);
        // All seen at one instant: nothing is older, so forget them all rather than grow.
        if self.by_key.len() >= self.cap {
            self.by_key.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn share_is_the_family_fraction_of_the_worker_requests() {
        let mut f = Families::new(3, 60_000, 7);
        for _ in 0..6 {
            f.record(Some(1), 0, 0);
        }
        for k in 0..2 {
            f.record(Some(100 + k), 0, 0);
        }
        f.record(None, 0, 0);
        f.record(None, 0, 0);
        assert!(
            (f.share(1, 0, 0) - 0.6).abs() < 1e-9,
            "{}",
            f.share(1, 0, 0)
        );
        assert!((f.share(100, 0, 0) - 0.1).abs() < 1e-9);
        // Another worker took none of it, and an unknown family is no share.
        assert_eq!(f.share(1, 1, 0), 0.0);
        assert_eq!(f.share(999, 0, 0), 0.0);
        // Out-of-range workers are ignored, never a panic.
        f.record(Some(1), 9, 0);
        assert_eq!(f.share(1, 9, 0), 0.0);
    }

    #[test]
    fn old_requests_count_less() {
        let mut f = Families::new(1, 1_000, 7);
        for _ in 0..4 {
            f.record(Some(1), 0, 0);
        }
        // Two half-lives later four old requests weigh one; four new ones of another family
        // are now 4 / 5 of the worker's traffic.
        for _ in 0..4 {
            f.record(Some(2), 0, 2_000);
        }
        assert!((f.share(2, 0, 2_000) - 0.8).abs() < 1e-6);
        assert!((f.share(1, 0, 2_000) - 0.2).abs() < 1e-6);
    }

    #[test]
    fn memory_stays_bounded_and_recent_families_survive() {
        let mut f = Families::with_cap(2, 60_000, 7, 64);
        for k in 0..10_000u64 {
            f.record(Some(k), 0, k);
            f.record(Some(u64::MAX), 1, k);
            assert!(f.len() <= 64);
        }
        assert!(f.share(9_999, 0, 10_000) > 0.0);
        assert!(f.share(u64::MAX, 1, 10_000) > 0.99);
    }
}
