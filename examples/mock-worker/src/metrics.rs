//! Prometheus exposition with vLLM's metric names.
//!
//! Counters live inside the engine state (only the engine loop writes them, under the same
//! lock it already holds), so no atomics are needed.

use std::fmt::Write;

use crate::engine::Load;

/// vLLM's TTFT buckets, in seconds.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

#[derive(Debug, Default, Clone)]
pub struct Histogram {
    counts: [u64; TTFT_BUCKETS.len()],
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = TTFT_BUCKETS.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum += v;
    }
}

#[derive(Debug, Default, Clone)]
pub struct Metrics {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub request_success: u64,
    pub aborted: u64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub preemptions: u64,
    /// Cached blocks evicted to make room (not a vLLM metric; the benchmark reports it).
    pub evicted_blocks: u64,
    pub ttft: Histogram,
    /// `--kv-events` batches dropped because the publisher's queue was full.
    pub kv_event_batches_dropped: u64,
    pub passes: u64,
    pub simulated_seconds: f64,
    pub lag_seconds: f64,
}

/// The routes that tokenize without the engine (`mock:tokenize_requests_total{route}`).
pub const PREPARE_ROUTES: [&str; 3] = [
    "/tokenize",
    "/v1/completions/render",
    "/v1/chat/completions/render",
];

pub struct Info<'a> {
    pub model: &'a str,
    pub block_size: usize,
    pub kv_blocks: usize,
    pub name: &'a str,
    /// Successful requests per route of `PREPARE_ROUTES`.
    pub prepared: [u64; PREPARE_ROUTES.len()],
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// vLLM's `vllm:lora_requests_info`: one series per label set ever current, valued with
/// when it last was (unix seconds; a reader takes the newest), labels in vLLM 0.32's order
/// (seen on the CPU build: max_lora, running, waiting); and
/// the mock's count of adapter loads.
pub fn render_lora(o: &mut String, max_lora: usize, info: &[((String, String), f64)], loads: u64) {
    family(
        o,
        "vllm:lora_requests_info",
        "gauge",
        "Running stats on lora requests.",
    );
    for ((waiting, running), t) in info {
        let _ = writeln!(
            o,
            "vllm:lora_requests_info{{max_lora=\"{max_lora}\",running_lora_adapters=\"{running}\",waiting_lora_adapters=\"{waiting}\"}} {t}"
        );
    }
    let name = "mock:lora_loads_total";
    family(
        o,
        name,
        "counter",
        "Adapters loaded into a slot (the first use of one counts).",
    );
    let _ = writeln!(o, "{name} {loads}");
}

pub fn render(m: &Metrics, load: Load, info: &Info) -> String {
    let mut o = String::with_capacity(4096);
    // vLLM labels every engine metric with `engine` (its data-parallel index; one engine
    // here) and `model_name`, printed sorted by name as prometheus_client does.
    let l = format!(
        "engine=\"0\",model_name=\"{}\"",
        info.model.replace('\\', "\\\\").replace('"', "\\\"")
    );
    // Here and below, tables with one row per metric: `duplicates` reports their rows as
    // alike, which they are by design (each says what its metric is; the logic is in the
    // loops after them).
    let gauges = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            load.running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            load.waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            load.kv_usage,
        ),
    ];
    for (name, help, v) in gauges {
        family(&mut o, name, "gauge", help);
        let _ = writeln!(o, "{name}{{{l}}} {v}");
    }
    // vLLM registers these through prometheus_client, which exposes counters with a `_total`
    // suffix; the bare names are what dashboards and our docs call them. Both are served.
    let counters = [
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in tokens.",
            m.prefix_cache_queries,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in tokens.",
            m.prefix_cache_hits,
        ),
    ];
    for (name, help, v) in counters {
        family(&mut o, name, "counter", help);
        let _ = writeln!(o, "{name}{{{l}}} {v}");
        let total = format!("{name}_total");
        family(&mut o, &total, "counter", help);
        let _ = writeln!(o, "{total}{{{l}}} {v}");
    }
    let totals = [
        (
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            m.prompt_tokens,
            "",
        ),
        (
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            m.generation_tokens,
            "",
        ),
        (
            "vllm:request_success_total",
            "Count of successfully processed requests.",
            m.request_success,
            ",finished_reason=\"length\"",
        ),
        (
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions.",
            m.preemptions,
            "",
        ),
        (
            "mock:kv_evicted_blocks_total",
            "Cached KV blocks evicted to make room for new ones.",
            m.evicted_blocks,
            "",
        ),
        (
            "mock:requests_aborted_total",
            "Requests dropped because the client went away.",
            m.aborted,
            "",
        ),
        (
            "mock:kv_event_batches_dropped_total",
            "KV cache event batches dropped (publisher queue full) instead of slowing the engine.",
            m.kv_event_batches_dropped,
            "",
        ),
        (
            "mock:engine_passes_total",
            "Scheduler passes run.",
            m.passes,
            "",
        ),
    ];
    for (name, help, v, extra) in totals {
        family(&mut o, name, "counter", help);
        let _ = writeln!(o, "{name}{{{l}{extra}}} {v}");
    }
    let secs = [
        ("mock:engine_simulated_seconds_total", "Sum of modelled pass durations (after --speedup).", m.simulated_seconds),
        ("mock:engine_lag_seconds_total", "Sum over passes of how late their results were delivered against the engine's schedule; grows when the process, not the model, is the bottleneck (simulated times are unaffected).", m.lag_seconds),
    ];
    for (name, help, v) in secs {
        family(&mut o, name, "counter", help);
        let _ = writeln!(o, "{name}{{{l}}} {v}");
    }
    let name = "mock:tokenize_requests_total";
    family(
        &mut o,
        name,
        "counter",
        "Requests answered by /tokenize and the render endpoints (tokenized without the engine).",
    );
    for (route, v) in PREPARE_ROUTES.iter().zip(info.prepared) {
        let _ = writeln!(o, "{name}{{{l},route=\"{route}\"}} {v}");
    }
    family(
        &mut o,
        "vllm:cache_config_info",
        "gauge",
        "Information of the KV cache config.",
    );
    let _ = writeln!(
        o,
        "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",{l},num_gpu_blocks=\"{}\"}} 1",
        info.block_size, info.kv_blocks
    );
    let h = "vllm:time_to_first_token_seconds";
    family(
        &mut o,
        h,
        "histogram",
        "Histogram of time to first token in seconds.",
    );
    let mut cum = 0;
    for (b, c) in TTFT_BUCKETS.iter().zip(m.ttft.counts) {
        cum += c;
        let _ = writeln!(o, "{h}_bucket{{{l},le=\"{b}\"}} {cum}");
    }
    let _ = writeln!(o, "{h}_bucket{{{l},le=\"+Inf\"}} {}", m.ttft.count);
    let _ = writeln!(o, "{h}_sum{{{l}}} {}", m.ttft.sum);
    let _ = writeln!(o, "{h}_count{{{l}}} {}", m.ttft.count);
    family(
        &mut o,
        "mock:worker_info",
        "gauge",
        "The worker id sent in x-worker-id.",
    );
    let _ = writeln!(o, "mock:worker_info{{{l},worker_id=\"{}\"}} 1", info.name);
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_vllm_names() {
        let mut m = Metrics::default();
        m.ttft.observe(0.03);
        m.ttft.observe(100.0);
        m.prefix_cache_hits = 7;
        m.evicted_blocks = 5;
        let s = render(
            &m,
            Load {
                running: 2,
                waiting: 3,
                kv_usage: 0.25,
            },
            &Info {
                model: "m",
                block_size: 16,
                kv_blocks: 16384,
                name: "w",
                prepared: [4, 0, 1],
            },
        );
        for needle in [
            "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2",
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25",
            "vllm:prefix_cache_hits{engine=\"0\",model_name=\"m\"} 7",
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 7",
            "vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"True\",engine=\"0\",model_name=\"m\",num_gpu_blocks=\"16384\"} 1",
            "vllm:num_preemptions_total{engine=\"0\",model_name=\"m\"} 0",
            "mock:kv_evicted_blocks_total{engine=\"0\",model_name=\"m\"} 5",
            "mock:kv_event_batches_dropped_total{engine=\"0\",model_name=\"m\"} 0",
            "mock:tokenize_requests_total{engine=\"0\",model_name=\"m\",route=\"/tokenize\"} 4",
            "mock:tokenize_requests_total{engine=\"0\",model_name=\"m\",route=\"/v1/chat/completions/render\"} 1",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"m\",le=\"0.04\"} 1",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"m\",le=\"80\"} 1",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"m\",le=\"+Inf\"} 2",
            "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 2",
        ] {
            assert!(s.contains(needle), "missing {needle}\n{s}");
        }
    }
}
