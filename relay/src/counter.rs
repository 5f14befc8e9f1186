//! Counters and the delay histogram behind `/metrics`: updated from any task without a lock.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

pub fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Relaxed);
}

/// A counter with one label, in Prometheus text: a series per `(label value, counter)`.
pub fn render_labeled(
    o: &mut String,
    name: &str,
    help: &str,
    label: &str,
    series: &[(&str, &AtomicU64)],
) {
    let _ = writeln!(
        o,
        "# HELP {name} {help}
# TYPE {name} counter"
    );
    for (value, c) in series {
        let _ = writeln!(o, "{name}{{{label}=\"{value}\"}} {}", c.load(Relaxed));
    }
}

/// Upper bounds (ms) of the propagation delay histogram.
pub const DELAY_BUCKETS_MS: [f64; 13] = [
    0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0,
];

#[derive(Default, Debug)]
pub struct Histogram {
    buckets: [AtomicU64; DELAY_BUCKETS_MS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn observe_ns(&self, ns: u64) {
        let ms = ns as f64 / 1e6;
        if let Some(i) = DELAY_BUCKETS_MS.iter().position(|b| ms <= *b) {
            if let Some(b) = self.buckets.get(i) {
                add(b, 1);
            }
        }
        add(&self.count, 1);
        add(&self.sum_ns, ns);
    }

    pub fn render(&self, o: &mut String, name: &str, help: &str) {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in DELAY_BUCKETS_MS.iter().zip(&self.buckets) {
            cum += c.load(Relaxed);
            let _ = writeln!(o, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let count = self.count.load(Relaxed);
        let sum = self.sum_ns.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(
            o,
            "{name}_bucket{{le=\"+Inf\"}} {count}\n{name}_sum {sum}\n{name}_count {count}"
        );
    }
}
