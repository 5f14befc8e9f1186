//! Envoy stats. Names put label values in the middle (`kvroute.worker.<name>.decisions_total`)
//! so the `stats_tags` regexes in the bootstrap turn them into Prometheus labels
//! (`kvroute_worker_decisions_total{worker="..."}`); see envoy/demo.yaml.
//!
//! Every VM defines the same names; Envoy keeps one stat per name for the whole process, so
//! counters add up across threads and gauges (computed from each VM's full replica) agree.

use super::host::Calls;
use crate::ladder::Rungs;
use proxy_wasm::types::MetricType;
use std::rc::Rc;

/// A defined stat (or none, when the host refused to define it: then updates are no-ops).
#[derive(Clone)]
pub struct Id {
    id: Option<u32>,
    host: Rc<Calls>,
}

impl Id {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        // Envoy refuses (and we would count as a host error) an increment of zero.
        if n == 0 {
            return;
        }
        if let Some(id) = self.id {
            self.host.increment_metric(id, n);
        }
    }
    /// The process-wide value (every VM's increments), 0 when the host has none.
    pub fn value(&self) -> u64 {
        self.id.and_then(|id| self.host.get_metric(id)).unwrap_or(0)
    }

    /// Gauge value, or a histogram sample.
    pub fn record(&self, v: u64) {
        if let Some(id) = self.id {
            self.host.record_metric(id, v);
        }
    }
}

#[derive(Clone)]
pub struct WorkerMetrics {
    pub decisions: Id,
    pub failures: Id,
    pub inflight: Id,
    pub prefill_tokens: Id,
    pub active_blocks: Id,
    pub kv_usage_pct: Id,
    pub waiting: Id,
    pub healthy: Id,
    pub index_blocks: Id,
    pub scrape_errors: Id,
}

/// The reuse ladder's counters (`kvroute_reuse_tokens_total{rung}`): one per rung, and the
/// prompt tokens they are out of.
#[derive(Clone)]
pub struct Reuse {
    pub prompt: Id,
    pub workload: Id,
    pub fleet: Id,
    pub routed: Id,
    /// Not defined for requests without the engine's cached count.
    pub served: Option<Id>,
}

impl Reuse {
    fn define(c: &dyn Fn(&str) -> Id, name: &str, served: bool) -> Reuse {
        let rung = |r: &str| c(&format!("kvroute.{name}.{r}.total"));
        Reuse {
            prompt: rung("prompt"),
            workload: rung("workload"),
            fleet: rung("fleet"),
            routed: rung("routed"),
            served: served.then(|| rung("served")),
        }
    }

    pub fn add(&self, r: &Rungs) {
        self.prompt.add(r.prompt);
        self.workload.add(r.workload);
        self.fleet.add(r.fleet);
        self.routed.add(r.routed);
        if let (Some(id), Some(v)) = (&self.served, r.served) {
            id.add(v);
        }
    }
}

#[derive(Clone)]
pub struct Metrics {
    pub routed: Id,
    pub fallback: Id,
    pub rejected: Id,
    /// Requests for a model no worker serves, answered 404 by the filter.
    pub model_not_found: Id,
    pub fallback_parse: Id,
    pub fallback_model: Id,
    pub fallback_no_candidates: Id,
    pub fallback_too_large: Id,
    pub disagg_prefill: Id,
    pub disagg_local: Id,
    pub predicted_hit_pct: Id,
    pub actual_hit_pct: Id,
    pub route_time_us: Id,
    pub orca_reports: Id,
    pub usage_reports: Id,
    pub overpredicted: Id,
    pub repl_sent: Id,
    pub repl_received: Id,
    pub repl_errors: Id,
    pub repl_wakeups: Id,
    pub repl_delay_us: Id,
    pub repl_peers: Id,
    pub peer_picks: Id,
    pub index_blocks: Id,
    pub index_bytes: Id,
    pub index_probe_giveups: Id,
    pub active_requests: Id,
    pub expired_requests: Id,
    pub chars_per_token_milli: Id,
    /// Engine `/metrics` scrapes that gave a load report, and those that failed.
    pub scrapes_ok: Id,
    pub scrapes_error: Id,
    pub scrape_us: Id,
    /// Precise mode: the relay stream is live (snapshot received), per VM holding it.
    pub precise_live: Id,
    pub precise_fed_workers: Id,
    pub precise_updates: Id,
    pub precise_stored: Id,
    pub precise_removed: Id,
    /// Streams that ended or were dropped (each one is a fallback to predictions).
    pub precise_stream_failures: Id,
    pub precise_unknown_workers: Id,
    /// Relay send to this VM's receipt, from the update's `sent_unix_ns`.
    pub precise_delay_us: Id,
    /// The engine's event (its batch timestamp) to this VM's index.
    pub precise_engine_delay_us: Id,
    /// Tokenize calls (off the request path) answered with token ids, and those that failed
    /// or timed out; how long the answer took.
    /// Decisions shared with other gateways through the relay: sent, dropped (stream down
    /// or slow), received, unreadable; peers gone; delay from the peer's relay to here.
    pub peers_sent: Id,
    pub peers_dropped: Id,
    pub peers_received: Id,
    pub peers_errors: Id,
    pub peers_gone: Id,
    pub peers_refused: Id,
    pub peers_capped: Id,
    pub peers_clamped: Id,
    pub peers_delay_us: Id,
    pub tokenize_ok: Id,
    pub tokenize_failed: Id,
    pub tokenize_us: Id,
    /// Text blocks whose engine block this VM has learned (`twins`).
    pub text_blocks: Id,
    /// The ladder over requests whose engine reported its cached tokens (in the engine's
    /// tokens), and over the others (in the router's, no `served`).
    pub reuse: Reuse,
    pub reuse_unreported: Reuse,
    pub workers: Vec<WorkerMetrics>,
}

impl Metrics {
    /// Defines every stat, and makes `host` count its failed calls in `host_errors`.
    pub fn define(host: &Rc<Calls>, worker_names: &[&str]) -> Metrics {
        use MetricType::{Counter, Gauge, Histogram};
        let define = |kind, name: &str| Id {
            id: host.define_metric(kind, name),
            host: Rc::clone(host),
        };
        let c = |n: &str| define(Counter, n);
        let g = |n: &str| define(Gauge, n);
        let h = |n: &str| define(Histogram, n);
        host.set_error_metric(host.define_metric(Counter, "kvroute.host_errors.total"));
        Metrics {
            routed: c("kvroute.requests.routed.total"),
            fallback: c("kvroute.requests.fallback.total"),
            rejected: c("kvroute.requests.rejected.total"),
            model_not_found: c("kvroute.requests.model_not_found.total"),
            fallback_parse: c("kvroute.fallbacks.parse_error.total"),
            fallback_model: c("kvroute.fallbacks.unknown_model.total"),
            fallback_no_candidates: c("kvroute.fallbacks.no_candidates.total"),
            fallback_too_large: c("kvroute.fallbacks.too_large.total"),
            disagg_prefill: c("kvroute.disagg_decisions.prefill.total"),
            disagg_local: c("kvroute.disagg_decisions.local.total"),
            predicted_hit_pct: h("kvroute.predicted_hit_pct"),
            actual_hit_pct: h("kvroute.actual_hit_pct"),
            route_time_us: h("kvroute.route_time_us"),
            orca_reports: c("kvroute.feedback.orca.total"),
            usage_reports: c("kvroute.feedback.usage.total"),
            overpredicted: c("kvroute.feedback.overpredicted.total"),
            repl_sent: c("kvroute.replication.sent.total"),
            repl_received: c("kvroute.replication.received.total"),
            repl_errors: c("kvroute.replication.errors.total"),
            repl_wakeups: c("kvroute.replication.wakeups.total"),
            repl_delay_us: h("kvroute.replication_delay_us"),
            repl_peers: g("kvroute.replication_peers"),
            peer_picks: c("kvroute.replication.peer_picks.total"),
            index_blocks: g("kvroute.index_blocks"),
            index_bytes: g("kvroute.index_bytes"),
            index_probe_giveups: g("kvroute.index_probe_giveups"),
            active_requests: g("kvroute.active_requests"),
            expired_requests: c("kvroute.expired_requests.total"),
            chars_per_token_milli: g("kvroute.chars_per_token_milli"),
            // kvroute_feedback_total{kind="metrics"} / {kind="metrics_error"}, next to the
            // ORCA and usage feedback counts.
            scrapes_ok: c("kvroute.feedback.metrics.total"),
            scrapes_error: c("kvroute.feedback.metrics_error.total"),
            scrape_us: h("kvroute.metrics_scrape_us"),
            precise_live: g("kvroute.precise.stream_live"),
            precise_fed_workers: g("kvroute.precise.fed_workers"),
            precise_updates: c("kvroute.precise.updates.total"),
            precise_stored: c("kvroute.precise.blocks_stored.total"),
            precise_removed: c("kvroute.precise.blocks_removed.total"),
            precise_stream_failures: c("kvroute.precise.stream_failures.total"),
            precise_unknown_workers: c("kvroute.precise.unknown_workers.total"),
            precise_delay_us: h("kvroute.precise.event_delay_us"),
            precise_engine_delay_us: h("kvroute.precise.engine_delay_us"),
            peers_sent: c("kvroute.peers.sent.total"),
            peers_dropped: c("kvroute.peers.dropped.total"),
            peers_received: c("kvroute.peers.received.total"),
            peers_errors: c("kvroute.peers.errors.total"),
            peers_gone: c("kvroute.peers.gone.total"),
            // What a peer gateway may not tell (`precise::peers`), decisions over its caps,
            // and decisions stamped in this gateway's future.
            peers_refused: c("kvroute.peers.refused.total"),
            peers_capped: c("kvroute.peers.capped.total"),
            peers_clamped: c("kvroute.peers.clamped.total"),
            peers_delay_us: h("kvroute.peers.delay_us"),
            tokenize_ok: c("kvroute.tokenize.ok.total"),
            tokenize_failed: c("kvroute.tokenize.failed.total"),
            tokenize_us: h("kvroute.tokenize_us"),
            text_blocks: g("kvroute.precise.text_blocks"),
            // kvroute_reuse_tokens_total{rung="prompt|workload|fleet|routed|served"}
            reuse: Reuse::define(&c, "reuse_tokens", true),
            reuse_unreported: Reuse::define(&c, "reuse_unreported_tokens", false),
            workers: worker_names
                .iter()
                .map(|w| WorkerMetrics {
                    decisions: c(&format!("kvroute.worker.{w}.decisions_total")),
                    failures: c(&format!("kvroute.worker.{w}.failures_total")),
                    inflight: g(&format!("kvroute.worker.{w}.inflight")),
                    prefill_tokens: g(&format!("kvroute.worker.{w}.prefill_tokens")),
                    active_blocks: g(&format!("kvroute.worker.{w}.active_blocks")),
                    kv_usage_pct: g(&format!("kvroute.worker.{w}.kv_usage_pct")),
                    waiting: g(&format!("kvroute.worker.{w}.waiting")),
                    healthy: g(&format!("kvroute.worker.{w}.healthy")),
                    index_blocks: g(&format!("kvroute.worker.{w}.index_blocks")),
                    scrape_errors: c(&format!("kvroute.worker.{w}.scrape_errors_total")),
                })
                .collect(),
        }
    }

    /// The counters the status page shows, totals and over recent windows, with their names
    /// there (`reuse_*`: the ladder, `crate::status::ladder`).
    pub fn window(&self) -> Vec<(&'static str, &Id)> {
        let mut v = vec![
            ("routed", &self.routed),
            ("fallback", &self.fallback),
            ("rejected", &self.rejected),
            ("fallback_parse_error", &self.fallback_parse),
            ("fallback_unknown_model", &self.fallback_model),
            ("fallback_no_candidates", &self.fallback_no_candidates),
            ("fallback_too_large", &self.fallback_too_large),
            ("disagg_prefill", &self.disagg_prefill),
            ("disagg_local", &self.disagg_local),
            ("feedback_usage", &self.usage_reports),
            ("feedback_orca", &self.orca_reports),
            ("feedback_metrics_error", &self.scrapes_error),
            ("overpredicted", &self.overpredicted),
            ("expired_requests", &self.expired_requests),
            ("replication_errors", &self.repl_errors),
            ("precise_stream_failures", &self.precise_stream_failures),
            ("tokenize_failed", &self.tokenize_failed),
            ("reuse_prompt", &self.reuse.prompt),
            ("reuse_workload", &self.reuse.workload),
            ("reuse_fleet", &self.reuse.fleet),
            ("reuse_routed", &self.reuse.routed),
            ("reuse_unreported_prompt", &self.reuse_unreported.prompt),
            ("reuse_unreported_workload", &self.reuse_unreported.workload),
            ("reuse_unreported_fleet", &self.reuse_unreported.fleet),
            ("reuse_unreported_routed", &self.reuse_unreported.routed),
        ];
        if let Some(served) = &self.reuse.served {
            v.push(("reuse_served", served));
        }
        v
    }

    pub fn worker(&self, w: u16) -> Option<&WorkerMetrics> {
        self.workers.get(usize::from(w))
    }
}
