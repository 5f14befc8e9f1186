//! What happens to a routed request after the pick: its first byte, confirmation, end or
//! failure, and what the answer reports (load, usage, adapters).

use super::{Decision, Router, UsageOutcome};
use crate::events::Event;
use crate::feedback::{OrcaLoad, Usage};
use crate::ids::WorkerId;
use crate::load::Report;
use crate::lora::LoraReport;

impl Router {
    /// First response byte: the prompt has been computed. `success` (a 2xx answer) also
    /// confirms the request's index entries; any other answer leaves them speculative until
    /// the request ends and drops them.
    pub fn on_first_byte(&mut self, d: &Decision, success: bool, now_ms: u64) -> Vec<Event> {
        let mut out = vec![self.on_prefill_done(d, now_ms)];
        out.extend(self.on_confirmed(d, success, now_ms));
        out
    }

    /// The first half of [`Router::on_first_byte`]: the prompt's prefill left the worker's
    /// queue (cheap; the load it frees matters to the very next pick).
    pub fn on_prefill_done(&mut self, d: &Decision, now_ms: u64) -> Event {
        let e = Event::PrefillDone { id: d.id };
        self.apply(&e, now_ms);
        e
    }

    /// The second half: a 2xx answer confirms the request's blocks (computed, pinned on the
    /// worker until the request ends, when `on_finish` puts them into the index). It walks
    /// every block of the prompt, so the filter runs this after the first byte went on to
    /// the client (at the next chunk or when the request ends).
    pub fn on_confirmed(&mut self, d: &Decision, success: bool, now_ms: u64) -> Option<Event> {
        if !success || d.hashes().is_empty() {
            return None;
        }
        let e = Event::Confirmed { id: d.id };
        self.apply(&e, now_ms);
        Some(e)
    }

    /// The request is over (success or not): release its load; a confirmed prompt enters
    /// the index (inserting a cold prompt's blocks costs a few hundred microseconds: the
    /// filter calls this from its log callback, after the answer's last byte).
    pub fn on_finish(&mut self, d: &Decision, now_ms: u64) -> Event {
        let e = Event::Free { id: d.id };
        self.apply(&e, now_ms);
        e
    }

    /// A worker failed (its own 5xx, refused, reset, timeout): cool it down. The request's
    /// blocks were never confirmed, so they leave with its `Free`; nothing is forgotten from
    /// the index, where other requests' confirmed blocks on that worker live (`Forget` is
    /// still applied when a peer of an older build sends it).
    pub fn on_failure(&mut self, _d: &Decision, worker: WorkerId, now_ms: u64) -> Vec<Event> {
        let out = vec![Event::Failed {
            worker,
            at_ms: now_ms,
        }];
        for e in &out {
            self.apply(e, now_ms);
        }
        out
    }

    /// A worker answered well: end its cooldown early if it had one.
    pub fn on_success(&mut self, worker: WorkerId, now_ms: u64) -> Option<Event> {
        let healthy = self.worker_view(worker, now_ms).healthy;
        if healthy {
            return None;
        }
        let e = Event::Recovered { worker };
        self.apply(&e, now_ms);
        Some(e)
    }

    /// A worker's adapters from its metrics (`vllm:lora_requests_info`).
    pub fn on_lora(&mut self, worker: WorkerId, report: LoraReport, now_ms: u64) -> Event {
        let e = Event::Lora { worker, report };
        self.apply(&e, now_ms);
        e
    }

    pub fn on_orca(&mut self, worker: WorkerId, o: &OrcaLoad, now_ms: u64) -> Event {
        // A report may carry only some metrics; keep the others from the last one.
        let prev = self.load.last_report(worker);
        let e = Event::Report {
            worker,
            report: Report {
                kv_usage: o.kv_usage.or(prev.map(|r| r.kv_usage)).unwrap_or(0.0),
                waiting: o.waiting.or(prev.map(|r| r.waiting)).unwrap_or(0),
                running: o.running,
                at_ms: now_ms,
            },
        };
        self.apply(&e, now_ms);
        e
    }

    /// Usage reported by the engine: calibrate chars per token (text prompts) and measure
    /// how good the prediction was.
    pub fn on_usage(
        &mut self,
        d: &Decision,
        u: &Usage,
        now_ms: u64,
    ) -> (UsageOutcome, Option<Event>) {
        let mut out = UsageOutcome::default();
        if u.prompt_tokens == 0 || d.fallback.is_some() {
            return (out, None);
        }
        if let Some(c) = u.cached_tokens {
            out.actual_hit = Some(f64::from(c.min(u.prompt_tokens)) / f64::from(u.prompt_tokens));
            // Compare fractions: the token estimate of a text prompt may be off while the
            // block prediction is right. One block of slack for the engine's partial block.
            let predicted = d.predicted_hit() * f64::from(u.prompt_tokens);
            out.overpredicted = f64::from(c) + f64::from(self.cfg.block_size) < predicted;
        }
        let mut ev = None;
        if !d.exact_tokens && d.prompt_bytes_est > 0.0 {
            let observed = d.prompt_bytes_est / f64::from(u.prompt_tokens);
            let upstream = usize::from(d.target);
            if let Some(next) = self.calib.observe(upstream, observed, self.chars_per_token) {
                if (next - self.chars_per_token).abs() > 0.01 {
                    let e = Event::Calibrate {
                        chars_per_token: next,
                    };
                    self.apply(&e, now_ms);
                    ev = Some(e);
                }
            }
        }
        (out, ev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ApiKind;
    use crate::router::testutil::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn failure_cools_down_and_forgets_uncomputed_blocks() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 3);
        let half = doc(4, 4000);
        let text = format!("{half}{}", doc(40, 4000));
        // An earlier request confirmed the first half on its worker.
        let first = routed(r.route(ApiKind::Completions, &completion(&half), 0));
        r.on_first_byte(&first, true, 0);
        r.on_finish(&first, 0);
        let d = routed(r.route(ApiKind::Completions, &completion(&text), 0));
        assert_eq!(d.decode, first.decode);
        let evs = r.on_failure(&d, d.decode, 1);
        assert_eq!(evs.len(), 1, "{evs:?}");
        assert!(matches!(evs[0], Event::Failed { .. }));
        r.on_finish(&d, 1);
        assert_eq!(r.speculative_requests(), 0);
        // The confirmed half stays, the failed request's own blocks are gone.
        let mut held = vec![0u32; 6];
        r.held_blocks(d.hashes(), 2, &mut held);
        assert_eq!(held[usize::from(d.decode)] as usize, first.hashes().len());
        assert!(!r.worker_view(d.decode, 2).healthy);
        let again = routed(r.route(ApiKind::Completions, &completion(&text), 3));
        assert_ne!(again.decode, d.decode, "avoids the failed worker");
        assert_eq!(again.overlap_tokens, 0);
    }

    #[test]
    fn partial_orca_report_keeps_the_other_metric() {
        let mut r = Router::new(cfg(""), 1, 3);
        let full = OrcaLoad {
            kv_usage: Some(0.5),
            waiting: Some(3),
            running: None,
        };
        r.on_orca(0, &full, 10);
        let partial = OrcaLoad {
            kv_usage: None,
            waiting: Some(7),
            running: None,
        };
        r.on_orca(0, &partial, 20);
        let rep = r.worker_view(0, 20).report.unwrap();
        assert_eq!((rep.kv_usage, rep.waiting), (0.5, 7));
    }

    #[test]
    fn usage_calibrates_chars_per_token() {
        let mut r = Router::new(cfg(""), 1, 3);
        let d = routed(r.route(ApiKind::Completions, &completion(&doc(6, 4000)), 0));
        let u = Usage {
            prompt_tokens: d.prompt_tokens / 2,
            completion_tokens: 1,
            cached_tokens: Some(0),
        };
        let before = r.chars_per_token();
        let (_, ev) = r.on_usage(&d, &u, 1);
        assert!(ev.is_some());
        assert!(r.chars_per_token() > before);
    }
}
