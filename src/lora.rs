//! LoRA adapters: which adapters each worker holds in its slots, as far as this router can
//! tell, and what placing a request for an adapter there costs in adapter loads.
//!
//! vLLM holds at most `--max-loras` adapters in the engine at once. A request for another
//! adapter loads it (the engine step that needs it waits for the load) into a free slot, or
//! in place of the least recently used adapter no running request uses; when every slot
//! serves running requests it waits until one is released. What a worker holds comes from
//! two sources: this router's own picks (the adapter is held from the moment a request for
//! it is sent, so a burst sees it at once and does not load it on every worker), and, when
//! the metrics poller is on, vLLM's `vllm:lora_requests_info` (the adapters of its running
//! requests and `max_lora`), which also covers traffic other routers sent.
//!
//! Adapters are named by a hash of their model name ([`adapter_id`]); the prefix index needs
//! nothing more, because block hashes are already seeded by the model name.

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::ids::{RequestId, WorkerId};

/// A LoRA adapter, by a hash of its name; never 0 (0 is "no adapter" on the wire).
pub type AdapterId = u64;

pub fn adapter_id(name: &str) -> AdapterId {
    xxh3_64_with_seed(name.as_bytes(), 0x10_7a_da_97).max(1)
}

/// Where a request for an adapter would stand on a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// The worker holds the adapter: no load.
    Held,
    /// A slot is free: one load.
    Free,
    /// The least recently used idle adapter makes room: this load, and when `orphan` (no
    /// other worker holds the one evicted) the load its next request will pay.
    Replace { orphan: bool },
    /// Every slot serves running requests: the request waits for one to finish, then loads.
    Busy,
}

impl Fit {
    /// Adapter loads this placement costs (see the variants).
    pub fn loads(self) -> f64 {
        match self {
            Fit::Held => 0.0,
            Fit::Free | Fit::Replace { orphan: false } => 1.0,
            Fit::Replace { orphan: true } | Fit::Busy => 2.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    adapter: AdapterId,
    /// Last pick or report that used it.
    used_ms: u64,
    /// This router's requests in flight on it.
    inflight: u32,
    /// The worker's last report listed it among its running requests' adapters.
    running: bool,
}

#[derive(Debug, Clone, Default)]
struct Worker {
    /// From the worker's `max_lora` once reported, else the configured default.
    max: u32,
    /// At most `max` slots, in no order (LRU by `used_ms`).
    slots: Vec<Slot>,
}

impl Worker {
    fn find(&self, a: AdapterId) -> Option<usize> {
        self.slots.iter().position(|s| s.adapter == a)
    }

    /// The least recently used slot no request uses.
    fn idle_lru(&self) -> Option<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.inflight == 0 && !s.running)
            .min_by_key(|(_, s)| s.used_ms)
            .map(|(i, _)| i)
    }

    /// Makes `a` held (evicting as the engine would) and returns its slot.
    fn hold(&mut self, a: AdapterId, now_ms: u64) -> Option<&mut Slot> {
        let i = match self.find(a) {
            Some(i) => i,
            None => {
                if self.slots.len() >= self.max.max(1) as usize {
                    // The engine evicts an idle adapter; with none idle the request waits
                    // for one, and this router cannot tell which: the oldest goes.
                    let victim = self.idle_lru().or_else(|| {
                        let lru = self.slots.iter().enumerate().min_by_key(|(_, s)| s.used_ms);
                        lru.map(|(i, _)| i)
                    })?;
                    self.slots.swap_remove(victim);
                }
                self.slots.push(Slot {
                    adapter: a,
                    used_ms: now_ms,
                    inflight: 0,
                    running: false,
                });
                self.slots.len() - 1
            }
        };
        let s = self.slots.get_mut(i)?;
        s.used_ms = s.used_ms.max(now_ms);
        Some(s)
    }
}

/// What an adapter report from a worker's metrics says (see [`crate::prom::parse_lora`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoraReport {
    pub max_lora: Option<u32>,
    pub running: Vec<AdapterId>,
    pub waiting: Vec<AdapterId>,
}

/// In-flight requests remembered at most; past it the oldest are dropped (a request whose
/// end never arrived).
const MAX_REQUESTS: usize = 1 << 16;

#[derive(Debug, Clone, Default)]
pub struct Adapters {
    workers: Vec<Worker>,
    /// This router's requests in flight on an adapter: worker, adapter, sent at.
    requests: HashMap<RequestId, (WorkerId, AdapterId, u64)>,
    /// A request older than this has ended whether or not its end was seen (the load
    /// table's `load.request_ttl_ms`).
    ttl_ms: u64,
}

impl Adapters {
    /// `max_loras`: slots per worker until a worker reports its own.
    pub fn new(workers: usize, max_loras: u32, ttl_ms: u64) -> Self {
        Adapters {
            workers: vec![
                Worker {
                    max: max_loras.max(1),
                    slots: Vec::new(),
                };
                workers
            ],
            requests: HashMap::new(),
            ttl_ms,
        }
    }

    pub fn fit(&self, w: WorkerId, a: AdapterId) -> Fit {
        let Some(wk) = self.workers.get(usize::from(w)) else {
            return Fit::Free;
        };
        if wk.find(a).is_some() {
            return Fit::Held;
        }
        if wk.slots.len() < wk.max.max(1) as usize {
            return Fit::Free;
        }
        match wk.idle_lru().and_then(|i| wk.slots.get(i)) {
            Some(victim) => Fit::Replace {
                orphan: !self.held_elsewhere(w, victim.adapter),
            },
            None => Fit::Busy,
        }
    }

    fn held_elsewhere(&self, w: WorkerId, a: AdapterId) -> bool {
        self.workers
            .iter()
            .enumerate()
            .any(|(i, wk)| i != usize::from(w) && wk.find(a).is_some())
    }

    /// Workers holding `a`.
    pub fn holders(&self, a: AdapterId) -> usize {
        self.workers.iter().filter(|w| w.find(a).is_some()).count()
    }

    /// A request for `a` was sent to `w`: the worker holds `a` from now on.
    pub fn on_routed(&mut self, id: RequestId, w: WorkerId, a: AdapterId, now_ms: u64) {
        if a == 0 {
            return;
        }
        let Some(wk) = self.workers.get_mut(usize::from(w)) else {
            return;
        };
        if let Some(s) = wk.hold(a, now_ms) {
            s.inflight = s.inflight.saturating_add(1);
        }
        let n = self.requests.len();
        if n >= MAX_REQUESTS || (n > 0 && n.is_multiple_of(1024)) {
            self.expire(now_ms);
        }
        if self.requests.len() < MAX_REQUESTS {
            self.requests.insert(id, (w, a, now_ms));
        }
    }

    /// Ends the requests older than the TTL (their end was lost: a peer died, a VM reset).
    fn expire(&mut self, now_ms: u64) {
        let before = now_ms.saturating_sub(self.ttl_ms);
        let old: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, v)| v.2 < before)
            .map(|(k, _)| *k)
            .collect();
        for id in old {
            self.end(id);
        }
    }

    /// `w` ran a request's prefill for `a` (disaggregation): it holds `a`, idle.
    pub fn touch(&mut self, w: WorkerId, a: AdapterId, now_ms: u64) {
        if a == 0 {
            return;
        }
        if let Some(wk) = self.workers.get_mut(usize::from(w)) {
            let _ = wk.hold(a, now_ms);
        }
    }

    /// The request ended (or was dropped): its adapter's slot is idle when no other is on it.
    pub fn end(&mut self, id: RequestId) {
        let Some((w, a, _)) = self.requests.remove(&id) else {
            return;
        };
        let slot = self
            .workers
            .get_mut(usize::from(w))
            .and_then(|wk| wk.slots.iter_mut().find(|s| s.adapter == a));
        if let Some(s) = slot {
            s.inflight = s.inflight.saturating_sub(1);
        }
    }

    /// The worker's own account: its slot count, and the adapters its running requests use
    /// (held, and busy until the next report). Adapters this router placed there and the
    /// worker no longer runs stay held: vLLM keeps an idle adapter until it needs the slot.
    pub fn on_report(&mut self, w: WorkerId, r: &LoraReport, now_ms: u64) {
        let Some(wk) = self.workers.get_mut(usize::from(w)) else {
            return;
        };
        if let Some(m) = r.max_lora.filter(|&m| m > 0) {
            wk.max = m;
            while wk.slots.len() > m as usize {
                let victim = wk.idle_lru().unwrap_or(0);
                if victim >= wk.slots.len() {
                    break;
                }
                wk.slots.swap_remove(victim);
            }
        }
        for s in &mut wk.slots {
            s.running = false;
        }
        for &a in &r.running {
            if let Some(s) = wk.hold(a, now_ms) {
                s.running = true;
            }
        }
    }

    /// Forgets what `w` held (it restarted, or was failed).
    pub fn clear(&mut self, w: WorkerId) {
        if let Some(wk) = self.workers.get_mut(usize::from(w)) {
            wk.slots.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const A: AdapterId = 11;
    const B: AdapterId = 12;
    const C: AdapterId = 13;

    #[test]
    fn ids_are_never_zero_and_differ() {
        assert_ne!(adapter_id("sql"), adapter_id("chat"));
        assert_ne!(adapter_id(""), 0);
    }

    #[test]
    fn a_pick_holds_the_adapter_and_fills_slots_before_replacing() {
        let mut a = Adapters::new(2, 2, 60_000);
        assert_eq!(a.fit(0, A), Fit::Free);
        a.on_routed(1, 0, A, 10);
        assert_eq!((a.fit(0, A), a.fit(1, A)), (Fit::Held, Fit::Free));
        a.on_routed(2, 0, B, 11);
        // Both slots busy with requests in flight: a third adapter waits.
        assert_eq!(a.fit(0, C), Fit::Busy);
        a.end(1);
        // A is idle and held nowhere else: replacing it costs its next load too.
        assert_eq!(a.fit(0, C), Fit::Replace { orphan: true });
        a.on_routed(3, 1, A, 12);
        assert_eq!(a.fit(0, C), Fit::Replace { orphan: false });
        a.on_routed(4, 0, C, 13);
        // C took idle A's slot; B and C have requests in flight.
        assert_eq!(
            (a.fit(0, A), a.fit(0, B), a.fit(0, C)),
            (Fit::Busy, Fit::Held, Fit::Held)
        );
        assert_eq!(a.holders(A), 1);
    }

    #[test]
    fn loads_order_the_fits() {
        let l: Vec<f64> = [
            Fit::Held,
            Fit::Free,
            Fit::Replace { orphan: false },
            Fit::Replace { orphan: true },
            Fit::Busy,
        ]
        .iter()
        .map(|f| f.loads())
        .collect();
        assert_eq!(l, [0.0, 1.0, 1.0, 2.0, 2.0]);
    }

    #[test]
    fn reports_set_slots_and_pin_running_adapters() {
        let mut a = Adapters::new(1, 1, 60_000);
        a.on_routed(1, 0, A, 10);
        a.end(1);
        let r = LoraReport {
            max_lora: Some(2),
            running: vec![B],
            waiting: vec![C],
        };
        a.on_report(0, &r, 20);
        assert_eq!((a.fit(0, A), a.fit(0, B)), (Fit::Held, Fit::Held));
        // A is idle, B runs: C would replace A.
        assert_eq!(a.fit(0, C), Fit::Replace { orphan: true });
        a.on_report(
            0,
            &LoraReport {
                max_lora: Some(1),
                ..r
            },
            30,
        );
        // One slot now: idle A went, B runs.
        assert_eq!(
            (a.fit(0, A), a.fit(0, B), a.fit(0, C)),
            (Fit::Busy, Fit::Held, Fit::Busy)
        );
        a.on_report(0, &LoraReport::default(), 40);
        assert_eq!(a.fit(0, C), Fit::Replace { orphan: true });
        a.clear(0);
        assert_eq!(a.fit(0, C), Fit::Free);
        // Unknown workers and requests are ignored.
        a.on_routed(9, 7, A, 1);
        a.end(12345);
        a.on_report(7, &LoraReport::default(), 1);
        assert_eq!(a.fit(7, A), Fit::Free);
    }
}
