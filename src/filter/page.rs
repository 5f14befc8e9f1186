//! The status page (config `status.path`, `crate::status`): the adapter's half, reading the
//! VM's state and Envoy's counters into a `Page`.

use super::state::State;
use crate::config::Role;
use crate::status::{Counters, IndexState, Page, ReplicaState, ReportState, WorkerState};

impl State {
    /// Samples the page's counters when a sample is due (every VM, on its tick).
    pub(super) fn sample_counters(&mut self, now_ms: u64) {
        if self.router.config().status.path.is_empty() || !self.window.due(now_ms) {
            return;
        }
        let values = self
            .metrics
            .window()
            .iter()
            .map(|(_, id)| id.value())
            .collect();
        self.window.push(now_ms, values);
    }

    /// The page's JSON. A VM that has not routed yet keeps only a backlog of its peers'
    /// events: it applies them first and from then on keeps a full replica (as a routing VM).
    pub fn status_page(&mut self) -> Vec<u8> {
        self.start_serving();
        let now = self.host.now_ms();
        let r = &self.router;
        let cfg = r.config();
        let max_age = cfg.busy.report_max_age_ms;
        let workers = cfg
            .workers
            .iter()
            .enumerate()
            .filter_map(|(i, wc)| {
                let w = u16::try_from(i).ok()?;
                let v = r.worker_view(w, now);
                let last = r.load().view(w, now, u64::MAX).report;
                Some(WorkerState {
                    name: wc.name.clone(),
                    role: match wc.role {
                        Role::Both => "both",
                        Role::Decode => "decode",
                        Role::Prefill => "prefill",
                    },
                    healthy: v.healthy,
                    inflight: v.inflight,
                    prefill_tokens: v.prefill_tokens.max(0.0) as u64,
                    active_blocks: v.active_blocks,
                    index_blocks: r.index().entries(w) as u64,
                    engine_fed: r.engine_fed(w),
                    report: last.map(|rep| {
                        let age_ms = now.saturating_sub(rep.at_ms);
                        ReportState {
                            kv_usage: rep.kv_usage,
                            waiting: rep.waiting,
                            age_ms,
                            stale: age_ms > max_age,
                        }
                    }),
                })
            })
            .collect();
        let named = self.metrics.window();
        let names: Vec<&str> = named.iter().map(|(n, _)| *n).collect();
        let current: Vec<u64> = named.iter().map(|(_, id)| id.value()).collect();
        let page = Page {
            version: env!("CARGO_PKG_VERSION"),
            now_ms: now,
            block_size: cfg.block_size,
            chars_per_token: r.chars_per_token(),
            active_requests: r.load().active_requests() as u64,
            index: IndexState {
                blocks: r.index().blocks() as u64,
                bytes: r.index().memory_bytes() as u64,
            },
            workers,
            precise: self.relay_state(now),
            replication: ReplicaState {
                id: self.repl.as_ref().map(|x| x.id()).unwrap_or(0),
                peers: self.repl.as_ref().map(|x| x.peers() as u64).unwrap_or(0),
                serving: self.serving,
            },
            counters: Counters::build(&names, &current, &self.window, now),
        };
        page.to_json()
    }
}
