//! The fleet: each worker's name, how Envoy reaches it, its role, capacity, models and
//! speed.

use serde::Deserialize;

/// The answer to a request for a model no worker serves (`unknown_model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnknownModel {
    /// The filter answers OpenAI's 404 `model_not_found` itself; no worker sees it.
    Reject,
    /// The least-loaded decode worker gets it, not cache-routed (a fallback, counted).
    Pass,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Serves whole requests (prefill and decode); the usual aggregated engine.
    Both,
    /// Decode side of a disaggregated fleet; chosen like `both`.
    Decode,
    /// Prefill pool: only used when the uncached part of a prompt exceeds the threshold.
    Prefill,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Unique name, used in metrics and debug headers.
    pub name: String,
    /// Envoy cluster that reaches this worker (cluster steering). Defaults to `name`.
    #[serde(default)]
    pub cluster: Option<String>,
    /// `host:port` of the worker (endpoint steering, and the decode endpoint named to a
    /// prefill worker).
    #[serde(default)]
    pub endpoint: Option<String>,
    #[serde(default = "default_role")]
    pub role: Role,
    /// KV cache capacity in blocks of `block_size` tokens (vLLM: `num_gpu_blocks`).
    #[serde(default)]
    pub kv_blocks: Option<u32>,
    /// Models and adapter names this worker serves (the request's `model`); empty: the
    /// top-level `models`, and when that is empty too, any model.
    #[serde(default)]
    pub models: Vec<String>,
    /// Prefill and decode throughput relative to the other workers (2: twice as fast). A
    /// worker's queued and new work is priced in time, divided by this.
    #[serde(default = "default_speed")]
    pub speed: f64,
}

fn default_speed() -> f64 {
    1.0
}

fn default_role() -> Role {
    Role::Both
}

impl WorkerConfig {
    pub fn cluster_name(&self) -> &str {
        self.cluster.as_deref().unwrap_or(&self.name)
    }
}
