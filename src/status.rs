//! The status page (config `status.path`): one JSON document with what an operator asks
//! first. Per-worker load and health as this router sees them, the index, precise mode,
//! replication, and the counters over the last minute and the last five (a window, not only
//! totals). The adapter fills a [`Page`] and answers it locally; nothing here calls the host.
//!
//! Size: a fixed part (about 2 KiB) plus one entry per worker (about 300 bytes with a short
//! name); workers are at most [`crate::ids::MAX_WORKERS`], so the page stays under 100 KiB.

use serde::Serialize;
use std::collections::VecDeque;

/// Counters are sampled this often for the windowed view.
pub const SAMPLE_MS: u64 = 10_000;
/// The windows the page shows, in milliseconds (one minute, five minutes).
pub const WINDOWS_MS: [u64; 2] = [60_000, 300_000];
/// Samples kept: enough to span the longest window.
const KEPT: usize = (300_000 / SAMPLE_MS) as usize + 1;

/// Periodic samples of a fixed list of counters (process-wide values), from which the page
/// reports how much each grew over a recent span.
#[derive(Debug, Default, Clone)]
pub struct Window {
    samples: VecDeque<(u64, Vec<u64>)>,
}

impl Window {
    /// A sample is due (none yet, or the last is `SAMPLE_MS` old).
    pub fn due(&self, now_ms: u64) -> bool {
        self.samples
            .back()
            .is_none_or(|(t, _)| now_ms.saturating_sub(*t) >= SAMPLE_MS)
    }

    pub fn push(&mut self, now_ms: u64, values: Vec<u64>) {
        self.samples.push_back((now_ms, values));
        while self.samples.len() > KEPT {
            self.samples.pop_front();
        }
    }

    /// How much each counter grew from the sample closest to `span_ms` ago (the newest one at
    /// least that old, else the oldest) to `current`, and the span that covers in fact (ms).
    /// `None` before the first sample. A counter that went down (a restart) counts from 0.
    pub fn delta(&self, current: &[u64], now_ms: u64, span_ms: u64) -> Option<(u64, Vec<u64>)> {
        let cutoff = now_ms.saturating_sub(span_ms);
        let (t, base) = self
            .samples
            .iter()
            .rev()
            .find(|(t, _)| *t <= cutoff)
            .or_else(|| self.samples.front())?;
        let grew = current
            .iter()
            .enumerate()
            .map(|(i, &c)| match base.get(i) {
                Some(&b) if b <= c => c - b,
                _ => c,
            })
            .collect();
        Some((now_ms.saturating_sub(*t), grew))
    }
}

/// The whole page.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Page {
    pub version: &'static str,
    /// Wall clock of the answer (Unix ms).
    pub now_ms: u64,
    pub block_size: u32,
    pub chars_per_token: f64,
    /// Requests in flight through this gateway (every thread).
    pub active_requests: u64,
    pub index: IndexState,
    pub workers: Vec<WorkerState>,
    pub precise: PreciseState,
    pub replication: ReplicaState,
    /// Counter totals since Envoy started, then what they grew by over each recent span.
    pub counters: Counters,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct IndexState {
    pub blocks: u64,
    pub bytes: u64,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct WorkerState {
    pub name: String,
    pub role: &'static str,
    pub healthy: bool,
    pub inflight: u32,
    /// Predicted prefill tokens still to compute.
    pub prefill_tokens: u64,
    /// KV blocks held by the requests in flight.
    pub active_blocks: u64,
    /// Blocks the prefix index says the worker holds.
    pub index_blocks: u64,
    /// Its engine's own KV events describe its cache (precise mode).
    pub engine_fed: bool,
    /// The last load report (ORCA header or a scrape of its metrics), however old.
    pub report: Option<ReportState>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct ReportState {
    pub kv_usage: f32,
    pub waiting: u32,
    pub age_ms: u64,
    /// Older than `busy.report_max_age_ms`: routing ignores it.
    pub stale: bool,
}

#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct PreciseState {
    /// `relay.cluster` is set.
    pub enabled: bool,
    /// The relay stream delivered its snapshot and is running.
    pub live: bool,
    pub fed_workers: u32,
    /// Since the last update from the relay; `None` before the first.
    pub last_update_age_ms: Option<u64>,
    /// Requests other gateways (through the relay) have in flight here.
    pub peer_requests: u64,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct ReplicaState {
    /// This VM's member id (0: it could not join and routes on its own state).
    pub id: u32,
    /// Other live VMs of this Envoy sharing decisions with this one.
    pub peers: u64,
    /// This VM routes (holds the full replica); it did when it answers this page.
    pub serving: bool,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Counters {
    pub total: Vec<(String, u64)>,
    pub windows: Vec<Span>,
}

/// What the counters grew by over `span_ms` (at most the window asked for: less while Envoy
/// is younger than it).
#[derive(Debug, Default, Clone, Serialize)]
pub struct Span {
    pub window_ms: u64,
    pub span_ms: u64,
    pub grew: Vec<(String, u64)>,
}

impl Counters {
    /// Totals `current` (in the order of `names`), and each window from `w`.
    pub fn build(names: &[&str], current: &[u64], w: &Window, now_ms: u64) -> Counters {
        let named = |vals: &[u64]| -> Vec<(String, u64)> {
            names
                .iter()
                .zip(vals.iter())
                .map(|(n, v)| (n.to_string(), *v))
                .collect()
        };
        Counters {
            total: named(current),
            windows: WINDOWS_MS
                .iter()
                .filter_map(|&span| {
                    let (span_ms, grew) = w.delta(current, now_ms, span)?;
                    Some(Span {
                        window_ms: span,
                        span_ms,
                        grew: named(&grew),
                    })
                })
                .collect(),
        }
    }
}

/// Pairs as a JSON object (`{"routed": 12, ...}`) rather than an array of pairs.
fn object(pairs: &[(String, u64)]) -> serde_json::Value {
    serde_json::Value::Object(
        pairs
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::from(*v)))
            .collect(),
    )
}

/// The rungs of the reuse ladder, in order (`crate::ladder`), after the prompt tokens they
/// are shares of.
const RUNGS: [&str; 5] = ["prompt", "workload", "fleet", "routed", "served"];

/// The reuse ladder out of the counters `reuse_<rung>` (requests whose engine reported its
/// cached tokens) and `reuse_unreported_<rung>` (the others, without `served`): tokens per
/// rung and each rung's share of the prompt tokens. `None` without the counters.
fn ladder(pairs: &[(String, u64)]) -> Option<serde_json::Value> {
    let get = |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    let part = |prefix: &str| {
        let prompt = get(&format!("{prefix}prompt"))?;
        let mut tokens = serde_json::Map::new();
        let mut share = serde_json::Map::new();
        for r in RUNGS {
            let Some(v) = get(&format!("{prefix}{r}")) else {
                continue;
            };
            tokens.insert(r.into(), v.into());
            if r != "prompt" && prompt > 0 {
                let x = (v as f64 / prompt as f64 * 1000.0).round() / 1000.0;
                share.insert(r.into(), x.into());
            }
        }
        let mut m = serde_json::Map::new();
        m.insert("tokens".into(), tokens.into());
        m.insert("share".into(), share.into());
        Some(serde_json::Value::Object(m))
    };
    let mut m = serde_json::Map::new();
    m.insert("reported".into(), part("reuse_")?);
    if let Some(u) = part("reuse_unreported_") {
        m.insert("unreported".into(), u);
    }
    Some(serde_json::Value::Object(m))
}

impl Page {
    /// The JSON body. Counters are objects keyed by name, windows keyed `last_60s`, ...; the
    /// reuse ladder, when its counters are there, also on its own (`ladder`, same keys).
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_value(self).unwrap_or(serde_json::Value::Null);
        let mut ladders = serde_json::Map::new();
        if let Some(c) = v.get_mut("counters") {
            let mut out = serde_json::Map::new();
            out.insert("total".into(), object(&self.counters.total));
            if let Some(l) = ladder(&self.counters.total) {
                ladders.insert("total".into(), l);
            }
            for s in &self.counters.windows {
                let key = format!("last_{}s", s.window_ms / 1000);
                let mut m = serde_json::Map::new();
                m.insert("span_ms".into(), s.span_ms.into());
                m.insert("grew".into(), object(&s.grew));
                out.insert(key.clone(), serde_json::Value::Object(m));
                if let Some(mut l) = ladder(&s.grew) {
                    if let Some(o) = l.as_object_mut() {
                        o.insert("span_ms".into(), s.span_ms.into());
                    }
                    ladders.insert(key, l);
                }
            }
            *c = serde_json::Value::Object(out);
        }
        if let (Some(o), false) = (v.as_object_mut(), ladders.is_empty()) {
            o.insert("ladder".into(), serde_json::Value::Object(ladders));
        }
        serde_json::to_vec(&v).unwrap_or_default()
    }
}

/// The precise-mode state the VM holding the relay stream shares with the others (one record
/// in shared data, rewritten on its tick): live, fed workers, peer requests, last update
/// (Unix ms, 0 for none). 17 bytes.
pub fn encode_precise(live: bool, fed: u32, peer_requests: u32, last_update_ms: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(17);
    v.push(u8::from(live));
    v.extend_from_slice(&fed.to_le_bytes());
    v.extend_from_slice(&peer_requests.to_le_bytes());
    v.extend_from_slice(&last_update_ms.to_le_bytes());
    v
}

/// The shared record read back as page fields for a page answered at `now_ms`; `None` for a
/// record that is not one.
pub fn decode_precise(b: &[u8], now_ms: u64) -> Option<PreciseState> {
    let live = *b.first()? != 0;
    let fed = u32::from_le_bytes(b.get(1..5)?.try_into().ok()?);
    let peers = u32::from_le_bytes(b.get(5..9)?.try_into().ok()?);
    let last = u64::from_le_bytes(b.get(9..17)?.try_into().ok()?);
    Some(PreciseState {
        enabled: true,
        live,
        fed_workers: fed,
        last_update_age_ms: (last > 0).then(|| now_ms.saturating_sub(last)),
        peer_requests: u64::from(peers),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn window_reports_growth_over_each_span() {
        let mut w = Window::default();
        assert!(w.due(0));
        assert_eq!(w.delta(&[5], 0, 60_000), None);
        // One sample every 10 s, counter growing by 10 per sample.
        for i in 0..40u64 {
            let now = i * SAMPLE_MS;
            assert!(w.due(now));
            w.push(now, vec![i * 10, 7]);
            assert!(!w.due(now + SAMPLE_MS - 1));
        }
        let now = 39 * SAMPLE_MS + 5_000;
        let (span, grew) = w.delta(&[400, 7], now, 60_000).unwrap();
        // The newest sample at least 60 s old is from 65 s ago.
        assert_eq!(span, 65_000);
        assert_eq!(grew, vec![400 - 330, 0]);
        // Five minutes: 31 samples kept, the oldest 300 s before the newest.
        let (span, grew) = w.delta(&[400, 7], now, 300_000).unwrap();
        assert_eq!(span, 305_000);
        assert_eq!(grew[0], 400 - 90);
        assert_eq!(w.samples.len(), KEPT);
    }

    #[test]
    fn young_window_covers_what_it_has_and_restarts_count_from_zero() {
        let mut w = Window::default();
        w.push(1_000, vec![50, 9]);
        let (span, grew) = w.delta(&[80, 3], 21_000, 60_000).unwrap();
        assert_eq!(span, 20_000);
        // The second counter went down: counted from 0.
        assert_eq!(grew, vec![30, 3]);
    }

    #[test]
    fn page_json_has_named_counters_and_windows() {
        let mut w = Window::default();
        w.push(0, vec![1, 0]);
        let page = Page {
            version: "x",
            now_ms: 30_000,
            workers: vec![WorkerState {
                name: "w1".into(),
                role: "both",
                healthy: true,
                inflight: 2,
                report: Some(ReportState {
                    kv_usage: 0.5,
                    waiting: 1,
                    age_ms: 10,
                    stale: false,
                }),
                ..WorkerState::default()
            }],
            counters: Counters::build(&["routed", "fallback"], &[11, 2], &w, 30_000),
            ..Page::default()
        };
        let v: serde_json::Value = serde_json::from_slice(&page.to_json()).unwrap();
        assert_eq!(v["counters"]["total"]["routed"], 11);
        assert_eq!(v["counters"]["last_60s"]["grew"]["routed"], 10);
        assert_eq!(v["counters"]["last_60s"]["grew"]["fallback"], 2);
        assert_eq!(v["counters"]["last_60s"]["span_ms"], 30_000);
        assert_eq!(v["counters"]["last_300s"]["grew"]["routed"], 10);
        assert_eq!(v["workers"][0]["name"], "w1");
        assert_eq!(v["workers"][0]["report"]["waiting"], 1);
        assert_eq!(v["precise"]["enabled"], false);
        assert_eq!(v["precise"]["last_update_age_ms"], serde_json::Value::Null);
    }

    #[test]
    fn ladder_view_has_tokens_and_shares_per_window() {
        let names = [
            "routed",
            "reuse_prompt",
            "reuse_workload",
            "reuse_fleet",
            "reuse_routed",
            "reuse_served",
            "reuse_unreported_prompt",
            "reuse_unreported_routed",
        ];
        let mut w = Window::default();
        w.push(0, vec![0, 1000, 800, 600, 500, 400, 0, 0]);
        let page = Page {
            counters: Counters::build(
                &names,
                &[5, 3000, 2400, 1800, 1500, 1000, 64, 32],
                &w,
                20_000,
            ),
            ..Page::default()
        };
        let v: serde_json::Value = serde_json::from_slice(&page.to_json()).unwrap();
        let total = &v["ladder"]["total"]["reported"];
        assert_eq!(total["tokens"]["prompt"], 3000);
        assert_eq!(total["tokens"]["served"], 1000);
        assert_eq!(total["share"]["workload"], 0.8);
        assert_eq!(total["share"]["served"], 0.333);
        assert_eq!(total["share"].get("prompt"), None);
        let last = &v["ladder"]["last_60s"];
        assert_eq!(last["span_ms"], 20_000);
        assert_eq!(last["reported"]["tokens"]["routed"], 1000);
        assert_eq!(last["reported"]["share"]["routed"], 0.5);
        assert_eq!(last["unreported"]["share"]["routed"], 0.5);
        assert_eq!(last["unreported"]["tokens"].get("served"), None);
        // Without the ladder's counters there is no ladder.
        let page = Page {
            counters: Counters::build(&["routed"], &[5], &w, 20_000),
            ..Page::default()
        };
        let v: serde_json::Value = serde_json::from_slice(&page.to_json()).unwrap();
        assert_eq!(v.get("ladder"), None);
    }

    #[test]
    fn page_size_is_bounded_by_the_fleet() {
        let w = Window::default();
        let page = Page {
            version: "x",
            workers: (0..crate::ids::MAX_WORKERS)
                .map(|i| WorkerState {
                    name: format!("worker-{i:04}"),
                    role: "decode",
                    inflight: u32::MAX,
                    prefill_tokens: u64::MAX,
                    active_blocks: u64::MAX,
                    index_blocks: u64::MAX,
                    report: Some(ReportState {
                        kv_usage: 1.0,
                        waiting: u32::MAX,
                        age_ms: u64::MAX,
                        stale: true,
                    }),
                    ..WorkerState::default()
                })
                .collect(),
            counters: Counters::build(&["a"; 24], &[u64::MAX; 24], &w, 0),
            ..Page::default()
        };
        let n = page.to_json().len();
        assert!(n < 100 << 10, "{n} bytes");
    }

    #[test]
    fn precise_record_round_trips() {
        let b = encode_precise(true, 3, 7, 1_000);
        assert_eq!(b.len(), 17);
        let p = decode_precise(&b, 1_250).unwrap();
        assert_eq!(
            p,
            PreciseState {
                enabled: true,
                live: true,
                fed_workers: 3,
                last_update_age_ms: Some(250),
                peer_requests: 7,
            }
        );
        let never = decode_precise(&encode_precise(false, 0, 0, 0), 5).unwrap();
        assert_eq!(never.last_update_age_ms, None);
        assert_eq!(decode_precise(&b[..16], 0), None);
        assert_eq!(decode_precise(&[], 0), None);
    }
}
