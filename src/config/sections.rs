//! The configuration's other sections, in the order `Config` lists them: each a struct of
//! its keys with their defaults.

use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SteeringMode {
    /// Set `header` to the chosen worker's Envoy cluster; the route uses `cluster_header`.
    Cluster,
    /// Set `x-gateway-destination-endpoint: ip:port[,fallback]` (Gateway API Inference
    /// Extension) for ORIGINAL_DST or `override_host` clusters.
    Endpoint,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SteeringConfig {
    pub mode: SteeringMode,
    /// Request header that carries the decision (fixed default `x-kvroute-cluster`; in
    /// endpoint mode `x-gateway-destination-endpoint`).
    pub header: Option<String>,
    /// In endpoint mode, how many fallback endpoints follow the chosen one.
    pub fallbacks: u32,
}

impl Default for SteeringConfig {
    fn default() -> Self {
        Self {
            mode: SteeringMode::Cluster,
            header: None,
            fallbacks: 2,
        }
    }
}

impl SteeringConfig {
    pub fn header_name(&self) -> &str {
        match (&self.header, self.mode) {
            (Some(h), _) => h,
            (None, SteeringMode::Cluster) => "x-kvroute-cluster",
            (None, SteeringMode::Endpoint) => "x-gateway-destination-endpoint",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IndexConfig {
    /// Index entries not touched for this long count as evicted (Dynamo: 120 s).
    pub ttl_ms: u64,
    /// Capacity for workers without `kv_blocks`.
    pub default_kv_blocks: u32,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            ttl_ms: 120_000,
            default_kv_blocks: 16_384,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoadConfig {
    /// An active request never released (lost response, dead VM) is dropped after this.
    pub request_ttl_ms: u64,
    /// Let predicted prefill tokens drain linearly instead of waiting for the first byte.
    pub prefill_decay: bool,
    /// Expected prefill speed and fixed overhead, for the decay.
    pub prefill_tokens_per_s: f64,
    pub prefill_overhead_ms: u64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            request_ttl_ms: 600_000,
            prefill_decay: false,
            prefill_tokens_per_s: 10_000.0,
            prefill_overhead_ms: 20,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// How long a worker that failed (its own 5xx, a connect error or reset, a timeout) is
    /// avoided; a 429 is a limit, not a failure (`crate::feedback::classify`).
    pub cooldown_ms: u64,
    /// The least time a try may wait for its worker's response headers before Envoy resets
    /// it and retries on another worker (`x-envoy-upstream-rq-per-try-timeout-ms`, set per
    /// request, see `crate::stall`). 0: no per-try bound.
    pub first_byte_timeout_ms: u64,
    /// The bound also grows with the predicted prefill ahead of the answer (the worker's
    /// queued prefill plus this prompt, at `load.prefill_tokens_per_s`), times this.
    pub prefill_slack: f64,
    /// A non-streaming answer sends its headers only when the whole generation is done: its
    /// bound grows by this per `max_tokens` token. Without `max_tokens` it gets no bound.
    pub output_token_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            cooldown_ms: 5_000,
            first_byte_timeout_ms: 30_000,
            prefill_slack: 4.0,
            output_token_ms: 250,
        }
    }
}

/// Bounds on the work and memory one request may cost the router.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// A body larger than this is not parsed or hashed: the request goes to the least-loaded
    /// worker as a `too_large` fallback (counted), and only this many bytes (+1) are ever
    /// copied into the filter.
    pub max_route_bytes: u32,
    /// Only the first this many blocks of a prompt are hashed, looked up, recorded and
    /// replicated; the rest still counts as load. The leading blocks carry the prompt's
    /// affinity, so a long prompt is still routed to the worker holding its prefix.
    pub max_blocks: u32,
    /// A stream whose client asked for `usage` (`stream_options.include_usage`) is read
    /// chunk by chunk, because its usage comes in the chunk before the last. Each read is
    /// two crossings into the VM, 1-2 us of Envoy's CPU per token streamed, for a report
    /// that only feeds calibration and the hit-rate stats: so after a VM's first
    /// [`crate::router::USAGE_WARMUP`] such streams, only one in this many is read; the
    /// others only at their last chunk. 1 reads every stream.
    pub usage_read_every: u32,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_route_bytes: 8 << 20,
            max_blocks: 65_536,
            usage_read_every: 8,
        }
    }
}

/// Load read from the engines' Prometheus endpoints, for engines that send no ORCA
/// `endpoint-load-metrics` header (llama.cpp, SGLang, vLLM's streaming responses).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Scrape every worker this often (one VM scrapes and replicates the result); 0 is off.
    /// Polls run on the filter's 250 ms tick, so this is at least 250.
    pub poll_ms: u64,
    /// Path of the engine's Prometheus text endpoint.
    pub path: String,
    /// The scrape goes to the Envoy cluster `<worker's cluster><cluster_suffix>`. Empty: the
    /// worker's own cluster; when that cluster fails over to other workers (envoy/demo.yaml),
    /// give each worker a cluster of its own endpoint only, e.g. `-metrics`, so a scrape never
    /// reads another worker's load.
    pub cluster_suffix: String,
    /// A scrape not answered within this counts as an error.
    pub timeout_ms: u64,
    /// A response body longer than this is not parsed (an error).
    pub max_bytes: u32,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            poll_ms: 0,
            path: "/metrics".into(),
            cluster_suffix: String::new(),
            timeout_ms: 1_000,
            max_bytes: 1 << 20,
        }
    }
}

/// kvroute-relay's gRPC stream: the engines' own KV cache events (precise mode) and, from
/// gateways sharing the relay's NATS, their routing decisions.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Envoy cluster of kvroute-relay (HTTP/2). Empty: precise mode is off and the index
    /// holds kvroute's own predictions only.
    pub cluster: String,
    /// A pick confirmed on an engine-fed worker still counts for this long (until the
    /// engine's own event for it has arrived), then only the engine's events do.
    pub speculative_ms: u64,
    /// Reconnect backoff after the stream fails: starts here, doubles up to `retry_max_ms`.
    pub retry_min_ms: u64,
    pub retry_max_ms: u64,
    /// Send this gateway's decisions to the relay, and apply other gateways' decisions it
    /// sends back (gateway replicas sharing one view over NATS). Off: the stream carries
    /// engine events only.
    pub share_decisions: bool,
    /// The Wasm VM's environment variable holding the relay's token, sent as
    /// `authorization: Bearer <token>` on the stream (Envoy: `vm_config.environment_variables`,
    /// e.g. `host_env_keys: [KVROUTE_RELAY_TOKEN]`). Unset or empty in the VM: no token is
    /// sent. The token itself never appears in the plugin configuration.
    pub token_env: String,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            cluster: String::new(),
            speculative_ms: 1_000,
            retry_min_ms: 250,
            retry_max_ms: 8_000,
            share_decisions: true,
            token_env: "KVROUTE_RELAY_TOKEN".into(),
        }
    }
}

/// Token ids for text and chat prompts from an engine's tokenizer (`POST /tokenize`), asked
/// beside the request (never on its path) while a worker is engine-fed: they map the prompt's
/// text blocks to the engines' blocks, so precise mode sees text prompts (see `twins`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizeConfig {
    /// Envoy cluster of engines that tokenize exactly as the workers do (the workers' own
    /// pool, or any one of them). Empty: off.
    pub cluster: String,
    pub path: String,
    /// An answer later than this teaches nothing (counted as failed); requests never wait.
    pub timeout_ms: u64,
    /// A longer answer is not read (routed on the text).
    pub max_bytes: u32,
}

impl Default for TokenizeConfig {
    fn default() -> Self {
        Self {
            cluster: String::new(),
            path: "/tokenize".into(),
            timeout_ms: 1_000,
            max_bytes: 8 << 20,
        }
    }
}

/// The status page (`crate::status`): a GET to `path` on a listener running the filter is
/// answered by the filter itself with a JSON page of the router's state, never routed.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StatusConfig {
    /// Empty: off. Put it on an internal listener only (docs/diagnosing.md, "The status page").
    pub path: String,
}

/// Client hints: requests with the same key (OpenAI's `prompt_cache_key` field, else the
/// session header) prefer the worker that served the key last, as if it held one more
/// cached block of their prompt (`crate::hashing::hint_hash`), so load still decides.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HintsConfig {
    /// Request header carrying a session id; empty: not read.
    pub session_header: String,
}

impl Default for HintsConfig {
    fn default() -> Self {
        Self {
            session_header: "x-session-id".into(),
        }
    }
}

/// LoRA adapters (see `crate::lora`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// Model names that are LoRA adapters (a request names one in `model`); the cost then
    /// prefers a worker holding the adapter, then one with a free adapter slot.
    pub adapters: Vec<String>,
    /// Adapter slots per worker (vLLM's `--max-loras`, default 1) until the worker's
    /// metrics report its `max_lora`.
    pub max_loras: u32,
    /// Time an engine takes to load an adapter, charged where a request would load one
    /// (priced as prefill at `load.prefill_tokens_per_s`).
    pub load_ms: u64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            adapters: Vec::new(),
            max_loras: 1,
            load_ms: 50,
        }
    }
}
