//! Chars-per-token calibration from the `usage` engines report, kept per upstream so that
//! one upstream with wrong counts (another tokenizer or model behind the same name, a proxy
//! rewriting bodies, a buggy engine) cannot drag the estimate every route uses.
//!
//! Each worker has its own slow EMA of observed prompt bytes per token; the estimate is the
//! median of the workers that have reported. With one or two reporting workers this is the
//! plain EMA (nothing to outvote); from three on, a single outlier moves the estimate at
//! most to its nearest honest neighbour.

/// Weight of one report in a worker's EMA: one odd request must not swing the estimate.
const ALPHA: f64 = 0.1;
use crate::ids::CHARS_PER_TOKEN_RANGE as RANGE;

#[derive(Debug, Clone, PartialEq)]
pub struct Calibrator {
    /// Per worker: its EMA, once it has reported.
    workers: Vec<Option<f64>>,
}

impl Calibrator {
    pub fn new(workers: usize) -> Calibrator {
        Calibrator {
            workers: vec![None; workers],
        }
    }

    /// Records that `worker` answered a text prompt of `bytes_per_token` (prompt bytes over
    /// reported prompt tokens); `current` is the estimate in use, the starting point of a
    /// worker's first EMA. Returns the new estimate, or `None` for an implausible report
    /// or an unknown worker.
    pub fn observe(&mut self, worker: usize, bytes_per_token: f64, current: f64) -> Option<f64> {
        if !(bytes_per_token.is_finite() && RANGE.contains(&bytes_per_token)) {
            return None;
        }
        let slot = self.workers.get_mut(worker)?;
        let prev = slot.unwrap_or(current);
        *slot = Some((1.0 - ALPHA) * prev + ALPHA * bytes_per_token);
        median(self.workers.iter().flatten().copied())
    }
}

fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let mid = n / 2;
    match n {
        0 => None,
        _ if n % 2 == 1 => v.get(mid).copied(),
        _ => Some((v.get(mid - 1)? + v.get(mid)?) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn one_worker_is_the_plain_ema() {
        let mut c = Calibrator::new(1);
        let e = c.observe(0, 5.0, 4.0).unwrap();
        assert!((e - 4.1).abs() < 1e-9, "{e}");
        let e = c.observe(0, 5.0, e).unwrap();
        assert!((e - 4.19).abs() < 1e-9, "{e}");
    }

    #[test]
    fn one_bad_upstream_does_not_move_the_estimate() {
        let mut c = Calibrator::new(4);
        let mut est = 4.0;
        // Three honest workers at 4.2 bytes per token, one reporting 8x the tokens.
        for _ in 0..200 {
            for w in 0..3 {
                est = c.observe(w, 4.2, est).unwrap();
            }
            est = c.observe(3, 0.525, est).unwrap();
        }
        assert!((est - 4.2).abs() < 0.01, "{est}");
        // The same reports through a single global EMA end far off.
        let mut global = 4.0;
        for _ in 0..200 {
            for obs in [4.2, 4.2, 4.2, 0.525] {
                global = 0.9 * global + 0.1 * obs;
            }
        }
        assert!(global < 3.6, "{global}");
    }

    #[test]
    fn implausible_reports_and_unknown_workers_are_ignored() {
        let mut c = Calibrator::new(2);
        assert_eq!(c.observe(0, f64::NAN, 4.0), None);
        assert_eq!(c.observe(0, 0.1, 4.0), None);
        assert_eq!(c.observe(0, 100.0, 4.0), None);
        assert_eq!(c.observe(2, 4.0, 4.0), None);
        assert_eq!(c, Calibrator::new(2));
        // Two workers: their mean.
        let a = c.observe(0, 6.0, 4.0).unwrap();
        let b = c.observe(1, 2.0, a).unwrap();
        assert!((a - 4.2).abs() < 1e-9 && (b - (4.2 + (0.9 * 4.2 + 0.2)) / 2.0).abs() < 1e-9);
    }
}
