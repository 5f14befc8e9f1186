//! Plugin configuration: the JSON users put in the Envoy YAML, with documented defaults and
//! validation errors that name the offending field (`workers[2].endpoint: ...`).
//!
//! Unknown keys are rejected: a typo such as `"temprature"` must fail loudly at load time
//! instead of silently running with the default.

use crate::ids::{CHARS_PER_TOKEN_RANGE, DEFAULT_CHARS_PER_TOKEN, MAX_WORKERS};
use core::fmt;
use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Every worker the router may pick: decode, prefill and combined engines.
    pub workers: Vec<WorkerConfig>,
    /// Tokens per KV block; must match the engines' block size (vLLM's default is 16).
    pub block_size: u32,
    /// Bytes of prompt text per token, the starting estimate for text prompts; calibrated
    /// from the `usage.prompt_tokens` workers return.
    pub chars_per_token: f64,
    /// Request paths that are parsed and routed; all other requests pass through untouched.
    pub routes: Vec<String>,
    /// Models (and adapters) a worker serves unless it lists its own in `workers[].models`.
    /// Empty: any model.
    pub models: Vec<String>,
    /// What a request for a model no worker serves gets.
    pub unknown_model: UnknownModel,
    pub steering: SteeringConfig,
    pub scoring: ScoringConfig,
    pub busy: BusyConfig,
    pub disaggregation: DisaggConfig,
    pub index: IndexConfig,
    pub load: LoadConfig,
    pub health: HealthConfig,
    pub limits: LimitsConfig,
    pub metrics: MetricsConfig,
    /// kvroute-relay: the engines' KV events (precise mode) and other gateways' decisions.
    /// `precise` is accepted as another name of this section.
    #[serde(alias = "precise")]
    pub relay: RelayConfig,
    pub tokenize: TokenizeConfig,
    pub status: StatusConfig,
    pub hints: HintsConfig,
    pub lora: LoraConfig,
    /// Add `x-kvroute-worker` (and friends) to responses, naming the chosen worker.
    pub debug_headers: bool,
    /// Seed for tie-breaking and temperature sampling; 0 derives one per VM.
    pub seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            workers: Vec::new(),
            block_size: 16,
            chars_per_token: DEFAULT_CHARS_PER_TOKEN,
            routes: vec!["/v1/completions".into(), "/v1/chat/completions".into()],
            models: Vec::new(),
            unknown_model: UnknownModel::Reject,
            steering: SteeringConfig::default(),
            scoring: ScoringConfig::default(),
            busy: BusyConfig::default(),
            disaggregation: DisaggConfig::default(),
            index: IndexConfig::default(),
            load: LoadConfig::default(),
            health: HealthConfig::default(),
            limits: LimitsConfig::default(),
            metrics: MetricsConfig::default(),
            relay: RelayConfig::default(),
            tokenize: TokenizeConfig::default(),
            status: StatusConfig::default(),
            hints: HintsConfig::default(),
            lora: LoraConfig::default(),
            debug_headers: false,
            seed: 0,
        }
    }
}

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
pub struct ScoringConfig {
    /// Blocks of prefill work saved per cached block (Dynamo's overlap credit).
    pub overlap_credit: f64,
    /// Weight of pending prefill blocks against active decode blocks. Dynamo defaults to 1
    /// and reports 16-32 best on agentic traces.
    pub prefill_load_scale: f64,
    /// Count only the cached prefix as decode blocks until the prefill is done.
    pub staged_decode: bool,
    /// 0 picks the lowest cost (random among ties); > 0 samples with softmax over costs.
    pub temperature: f64,
    /// Weight of cache pressure: blocks the request would write, times the share of the
    /// worker's cache written recently (decaying with `cache_balance_half_life_ms`). Spreads
    /// unrelated prompts so the fleet's caches add up instead of one worker churning while
    /// others sit on stale content; 0 disables.
    pub cache_balance: f64,
    pub cache_balance_half_life_ms: u64,
    /// Extra weight on the prefill a request would recompute, per request waiting for prefill
    /// on the worker that would recompute it (a queue's length grows as utilisation /
    /// (1 - utilisation)): recomputing on a busy worker delays whoever queues behind it, so
    /// affinity tightens as load rises, and an idle worker still recomputes for free. 0
    /// disables.
    pub recompute_weight: f64,
    /// Upper bound of that extra weight.
    pub recompute_weight_max: f64,
    /// Extra weight on recomputed prefill even with no queue anywhere: the recomputed
    /// tokens share the worker's batches with everyone decoding there, and the copy they
    /// make duplicates cache the fleet already has.
    pub recompute_weight_min: f64,
    /// Cost of one block of an in-flight request's context, counted per request: every
    /// decode step attends over each request's whole context, so a worker decoding many long
    /// requests is slower for the next one even when they share a prefix in memory.
    pub decode_weight: f64,
    /// Weight of a request's prefill (uncached blocks plus its fixed overhead) per request in
    /// flight on the worker: with chunked prefill every pass that carries prefill tokens is
    /// also a decode step of each stream there, so a prefill placed among many streams slows
    /// all of them (TPOT). 0 disables.
    pub decode_interference: f64,
    /// Weight of writing again blocks another worker already holds, times the writer's cache
    /// pressure: under eviction pressure a duplicate pushes out content no one else holds.
    pub duplicate_weight: f64,
    /// Weight of recomputing blocks another worker already holds, whatever the cache's
    /// fullness: each is prefill the fleet did once already and a lost cache hit.
    pub copy_weight: f64,
    /// Share of a worker's KV above which every further block held costs as much as a block
    /// of prefill (preemption and eviction of cached prefixes start there).
    pub kv_watermark: f64,
    /// A worker whose recent requests (decaying with `cache_balance_half_life_ms`) exceed
    /// this many times the fleet's mean is a hot spot: the excess costs
    /// `request_ratio_weight` x the excess (in means) x the request's prompt blocks, so
    /// requests cached elsewhere too leave first, and a prefix held only there is copied
    /// to a second worker once the excess outweighs recomputing it. 0 disables.
    pub request_ratio: f64,
    pub request_ratio_weight: f64,
    /// Recent requests a worker may take beyond the ratio before it counts (a run's first
    /// requests say little about shares).
    pub request_ratio_slack: f64,
    /// Requests in flight below which a worker is no hot spot whatever its share: it is idle
    /// when the request lands (a quiet fleet's sequential requests keep their worker).
    pub request_ratio_min_inflight: u32,
    /// Share of a hot worker's recent requests a prefix family (the longest prefix some
    /// worker holds for the request) must bring for the hot-spot term to shed it at full
    /// weight; a family bringing less is shed in proportion: moving a bystander costs the
    /// same copy and relieves the worker of little. 0 sheds every request alike.
    pub request_ratio_family: f64,
    /// Share of recent requests a worker may reach while the fleet is saturated (the median
    /// worker has prefill waiting), where the request-share term above otherwise rests;
    /// beyond it every request is shed alike. It bounds the short cached requests that
    /// `decode_interference` leaves to pile onto one worker. 0 leaves saturated fleets to the
    /// queues.
    pub request_ratio_saturated: f64,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        Self {
            overlap_credit: 1.0,
            prefill_load_scale: 1.0,
            staged_decode: false,
            temperature: 0.0,
            cache_balance: 1.0,
            cache_balance_half_life_ms: 60_000,
            recompute_weight: 1.0,
            recompute_weight_max: 8.0,
            recompute_weight_min: 2.0,
            decode_weight: 0.05,
            decode_interference: 0.12,
            duplicate_weight: 4.0,
            copy_weight: 4.0,
            kv_watermark: 0.9,
            request_ratio: 1.25,
            request_ratio_weight: 128.0,
            request_ratio_slack: 4.0,
            request_ratio_min_inflight: 2,
            request_ratio_family: 0.25,
            request_ratio_saturated: 1.3,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BusyConfig {
    /// A worker reporting at least this KV usage (0..1) is busy. 0 disables.
    pub kv_usage: f64,
    /// A worker reporting at least this many waiting requests is busy. 0 disables.
    pub waiting_requests: u32,
    /// A worker with this many in-flight requests from this router is busy. 0 disables.
    pub inflight_requests: u32,
    /// Reports older than this are ignored.
    pub report_max_age_ms: u64,
    /// When every worker is busy: false routes anyway (lowest cost), true answers 429.
    pub reject_when_all_busy: bool,
}

impl Default for BusyConfig {
    fn default() -> Self {
        Self {
            kv_usage: 0.98,
            waiting_requests: 32,
            inflight_requests: 0,
            report_max_age_ms: 5_000,
            reject_when_all_busy: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DisaggMode {
    /// Steer to the prefill worker; name the decode worker in `decode_header`.
    Kvroute,
    /// llm-d's form: steer to the decode worker; name the prefill worker in
    /// `x-prefiller-host-port`.
    LlmD,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggConfig {
    /// Use the prefill pool when the uncached tokens on the chosen worker exceed this.
    /// 0 disables disaggregation. Dynamo's default is 5000.
    pub threshold_tokens: u32,
    /// Use the pool only when prefilling there costs no more than on the decode worker (the
    /// wait for it, the delay to requests queued behind it, the streams it slows). Off, every
    /// prompt over the threshold goes to the pool (llm-d's rule).
    pub compare_cost: bool,
    pub mode: DisaggMode,
    pub decode_header: String,
    pub prefiller_header: String,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            threshold_tokens: 5000,
            compare_cost: true,
            mode: DisaggMode::Kvroute,
            decode_header: "x-kvroute-decode-endpoint".into(),
            prefiller_header: "x-prefiller-host-port".into(),
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
    /// How long a worker that failed (5xx, 429, connect error) is avoided.
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

/// A configuration problem, naming the field as a path into the JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid kvroute config: {}", self.message)
        } else {
            write!(
                f,
                "invalid kvroute config: {}: {}",
                self.field, self.message
            )
        }
    }
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

impl Config {
    /// Parses and validates the plugin configuration. An empty body means all defaults
    /// (which then fails validation: at least one worker is required).
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let cfg: Config = serde_json::from_slice(bytes).map_err(|e| {
            // serde names unknown or mistyped keys in its message; keep it whole.
            err("", format!("{e}"))
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.workers.is_empty() {
            return Err(err("workers", "at least one worker is required"));
        }
        if self.workers.len() > MAX_WORKERS {
            return Err(err(
                "workers",
                format!("at most {MAX_WORKERS} workers are supported"),
            ));
        }
        if !self.workers.iter().any(|w| w.role != Role::Prefill) {
            return Err(err(
                "workers",
                "at least one worker must have role \"both\" or \"decode\"",
            ));
        }
        for (i, w) in self.workers.iter().enumerate() {
            let at = |k: &str| format!("workers[{i}].{k}");
            if w.name.is_empty()
                || !w
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                // Names become parts of Envoy stat names and Prometheus labels.
                return Err(err(
                    at("name"),
                    "must be non-empty letters, digits, '-' or '_'",
                ));
            }
            if let Some(j) = self.workers.iter().take(i).position(|o| o.name == w.name) {
                return Err(err(
                    at("name"),
                    format!("duplicate of workers[{j}].name {:?}", w.name),
                ));
            }
            if !is_header_value(w.cluster_name()) {
                return Err(err(at("cluster"), "must be a non-empty header-safe string"));
            }
            if let Some(ep) = &w.endpoint {
                if !is_host_port(ep) {
                    return Err(err(at("endpoint"), format!("{ep:?} is not host:port")));
                }
            } else if self.steering.mode == SteeringMode::Endpoint {
                return Err(err(
                    at("endpoint"),
                    "required when steering.mode is \"endpoint\"",
                ));
            } else if self.disaggregation.threshold_tokens > 0
                && self.workers.iter().any(|o| o.role == Role::Prefill)
            {
                // The other side of a prefill/decode pair is named by host:port.
                return Err(err(
                    at("endpoint"),
                    "required when a prefill pool is configured",
                ));
            }
            if w.kv_blocks == Some(0) {
                return Err(err(at("kv_blocks"), "must be at least 1"));
            }
            if !(w.speed.is_finite() && w.speed > 0.0 && w.speed <= 1000.0) {
                return Err(err(at("speed"), "must be above 0 and at most 1000"));
            }
            for (j, m) in w.models.iter().enumerate() {
                if m.is_empty() {
                    return Err(err(at(&format!("models[{j}]")), "must not be empty"));
                }
            }
        }
        if self.block_size == 0 || self.block_size > 4096 {
            return Err(err("block_size", "must be between 1 and 4096"));
        }
        if !(self.chars_per_token.is_finite()
            && CHARS_PER_TOKEN_RANGE.contains(&self.chars_per_token))
        {
            let (lo, hi) = (CHARS_PER_TOKEN_RANGE.start(), CHARS_PER_TOKEN_RANGE.end());
            return Err(err(
                "chars_per_token",
                format!("must be between {lo} and {hi}"),
            ));
        }
        for (j, m) in self.models.iter().enumerate() {
            if m.is_empty() {
                return Err(err(format!("models[{j}]"), "must not be empty"));
            }
        }
        if self.routes.is_empty() {
            return Err(err("routes", "at least one path is required"));
        }
        for (i, r) in self.routes.iter().enumerate() {
            if !r.starts_with('/') {
                return Err(err(format!("routes[{i}]"), "must start with '/'"));
            }
        }
        if !is_header_name(self.steering.header_name()) {
            return Err(err("steering.header", "must be a lowercase header name"));
        }
        let s = &self.scoring;
        for (name, v) in [
            ("scoring.overlap_credit", s.overlap_credit),
            ("scoring.prefill_load_scale", s.prefill_load_scale),
            ("scoring.temperature", s.temperature),
            ("scoring.cache_balance", s.cache_balance),
            ("scoring.recompute_weight", s.recompute_weight),
            ("scoring.recompute_weight_max", s.recompute_weight_max),
            ("scoring.recompute_weight_min", s.recompute_weight_min),
            ("scoring.decode_weight", s.decode_weight),
            ("scoring.decode_interference", s.decode_interference),
            ("scoring.duplicate_weight", s.duplicate_weight),
            ("scoring.copy_weight", s.copy_weight),
            ("scoring.request_ratio_weight", s.request_ratio_weight),
            ("scoring.request_ratio_slack", s.request_ratio_slack),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(err(name, "must be a finite number >= 0"));
            }
        }
        // Below 1 every worker would be over it at once; 0 is the documented off switch.
        for (name, v) in [
            ("scoring.request_ratio", s.request_ratio),
            ("scoring.request_ratio_saturated", s.request_ratio_saturated),
        ] {
            if !(v.is_finite() && (v == 0.0 || v >= 1.0)) {
                return Err(err(name, "must be 0 (off) or at least 1"));
            }
        }
        if !(s.request_ratio_family.is_finite() && (0.0..=1.0).contains(&s.request_ratio_family)) {
            return Err(err(
                "scoring.request_ratio_family",
                "must be between 0 (off) and 1",
            ));
        }
        if !(s.kv_watermark.is_finite() && s.kv_watermark > 0.0 && s.kv_watermark <= 1.0) {
            return Err(err("scoring.kv_watermark", "must be above 0 and at most 1"));
        }
        if !(self.busy.kv_usage.is_finite() && (0.0..=1.0).contains(&self.busy.kv_usage)) {
            return Err(err("busy.kv_usage", "must be between 0 and 1"));
        }
        for (name, h) in [
            (
                "disaggregation.decode_header",
                &self.disaggregation.decode_header,
            ),
            (
                "disaggregation.prefiller_header",
                &self.disaggregation.prefiller_header,
            ),
        ] {
            if !is_header_name(h) {
                return Err(err(name, "must be a lowercase header name"));
            }
        }
        let sh = &self.hints.session_header;
        if !sh.is_empty() && !is_header_name(sh) {
            return Err(err(
                "hints.session_header",
                "must be a lowercase header name or empty (off)",
            ));
        }
        if self.index.default_kv_blocks == 0 {
            return Err(err("index.default_kv_blocks", "must be at least 1"));
        }
        if self.limits.max_route_bytes == 0 {
            return Err(err("limits.max_route_bytes", "must be at least 1"));
        }
        if self.limits.max_blocks == 0 {
            return Err(err("limits.max_blocks", "must be at least 1"));
        }
        if self.limits.usage_read_every == 0 {
            return Err(err(
                "limits.usage_read_every",
                "must be at least 1 (1 reads every stream)",
            ));
        }
        if self.load.request_ttl_ms == 0 {
            return Err(err("load.request_ttl_ms", "must be at least 1"));
        }
        let slack = self.health.prefill_slack;
        if !(slack.is_finite() && slack >= 0.0) {
            return Err(err("health.prefill_slack", "must be a finite number >= 0"));
        }
        let tps = self.load.prefill_tokens_per_s;
        if !(tps.is_finite() && tps > 0.0) {
            return Err(err("load.prefill_tokens_per_s", "must be > 0"));
        }
        for (j, a) in self.lora.adapters.iter().enumerate() {
            let at = format!("lora.adapters[{j}]");
            if a.is_empty() {
                return Err(err(at, "must not be empty"));
            }
            if self.lora.adapters.get(..j).is_some_and(|p| p.contains(a)) {
                return Err(err(at, "is listed twice"));
            }
        }
        if self.lora.max_loras == 0 {
            return Err(err("lora.max_loras", "must be at least 1"));
        }
        let m = &self.metrics;
        if m.poll_ms > 0 && m.poll_ms < 250 {
            return Err(err(
                "metrics.poll_ms",
                "must be 0 (off) or at least 250 (the filter's tick)",
            ));
        }
        if !m.path.starts_with('/') || !is_header_value(&m.path) {
            return Err(err("metrics.path", "must be a path starting with '/'"));
        }
        if !m.cluster_suffix.is_empty() && !is_header_value(&m.cluster_suffix) {
            return Err(err("metrics.cluster_suffix", "must be header-safe"));
        }
        if m.timeout_ms == 0 || m.timeout_ms > 60_000 {
            return Err(err("metrics.timeout_ms", "must be between 1 and 60000"));
        }
        if m.max_bytes == 0 {
            return Err(err("metrics.max_bytes", "must be at least 1"));
        }
        let t = &self.tokenize;
        if !t.cluster.is_empty() && !is_header_value(&t.cluster) {
            return Err(err("tokenize.cluster", "must be an Envoy cluster name"));
        }
        if !t.path.starts_with('/') || !is_header_value(&t.path) {
            return Err(err("tokenize.path", "must be a path starting with '/'"));
        }
        if t.timeout_ms == 0 || t.timeout_ms > 10_000 {
            return Err(err("tokenize.timeout_ms", "must be between 1 and 10000"));
        }
        if t.max_bytes == 0 {
            return Err(err("tokenize.max_bytes", "must be at least 1"));
        }
        let sp = &self.status.path;
        if !sp.is_empty() {
            if !sp.starts_with('/') || !is_header_value(sp) || sp.contains('?') {
                return Err(err(
                    "status.path",
                    "must be a path starting with '/' (no query)",
                ));
            }
            let canon = crate::steer::canonical_path(sp);
            if let Some(r) = self
                .routes
                .iter()
                .find(|r| crate::steer::canonical_path(r) == canon)
            {
                return Err(err(
                    "status.path",
                    format!("{sp:?} is also an inference route ({r:?} in routes)"),
                ));
            }
        }
        let p = &self.relay;
        if !p.cluster.is_empty() && !is_header_value(&p.cluster) {
            return Err(err("relay.cluster", "must be an Envoy cluster name"));
        }
        if p.speculative_ms > 600_000 {
            return Err(err("relay.speculative_ms", "must be at most 600000"));
        }
        let env_name = |s: &str| {
            s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !s.starts_with(|c: char| c.is_ascii_digit())
        };
        if !env_name(&p.token_env) {
            return Err(err(
                "relay.token_env",
                "must be an environment variable name (letters, digits, _) or empty",
            ));
        }
        if p.retry_min_ms == 0 || p.retry_min_ms > p.retry_max_ms || p.retry_max_ms > 600_000 {
            return Err(err(
                "relay.retry_min_ms",
                "must be at least 1 and at most relay.retry_max_ms (at most 600000)",
            ));
        }
        Ok(())
    }

    pub fn kv_blocks(&self, w: &WorkerConfig) -> u32 {
        w.kv_blocks.unwrap_or(self.index.default_kv_blocks)
    }

    /// The models `w` serves: its own list, else the top-level one; empty means any.
    pub fn worker_models<'a>(&'a self, w: &'a WorkerConfig) -> &'a [String] {
        if w.models.is_empty() {
            &self.models
        } else {
            &w.models
        }
    }

    /// Whether `w` serves `model`. A request without a model (engines then serve their only
    /// one) may go to any worker.
    pub fn serves(&self, w: &WorkerConfig, model: &str) -> bool {
        let list = self.worker_models(w);
        model.is_empty() || list.is_empty() || list.iter().any(|m| m == model)
    }

    /// Whether some worker is limited to a list of models (requests are then matched to
    /// workers by model).
    pub fn has_model_lists(&self) -> bool {
        !self.models.is_empty() || self.workers.iter().any(|w| !w.models.is_empty())
    }
}

fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn is_header_value(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| (0x21..0x7f).contains(&b))
}

fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    !host.is_empty() && is_header_value(host) && port.parse::<u16>().is_ok_and(|p| p > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::from_json(s.as_bytes())
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = parse(r#"{"workers":[{"name":"w1"}]}"#).unwrap();
        assert_eq!(c.block_size, 16);
        assert_eq!(c.workers[0].cluster_name(), "w1");
        assert_eq!(c.workers[0].role, Role::Both);
        assert_eq!(c.steering.header_name(), "x-kvroute-cluster");
        assert_eq!(c.disaggregation.threshold_tokens, 5000);
        assert_eq!(c.kv_blocks(&c.workers[0]), 16_384);
    }

    #[test]
    fn typo_in_key_is_rejected_by_name() {
        let e = parse(r#"{"workers":[{"name":"w1"}],"scoring":{"temprature":1}}"#).unwrap_err();
        assert!(e.to_string().contains("temprature"), "{e}");
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{}"#, "workers"),
            (
                r#"{"workers":[{"name":"a"},{"name":"a"}]}"#,
                "workers[1].name",
            ),
            (r#"{"workers":[{"name":"a.b"}]}"#, "workers[0].name"),
            (
                r#"{"workers":[{"name":"a","endpoint":"nope"}]}"#,
                "workers[0].endpoint",
            ),
            (
                r#"{"workers":[{"name":"a","kv_blocks":0}]}"#,
                "workers[0].kv_blocks",
            ),
            (r#"{"workers":[{"name":"a","role":"prefill"}]}"#, "workers"),
            (r#"{"workers":[{"name":"a"}],"block_size":0}"#, "block_size"),
            (
                r#"{"workers":[{"name":"a","models":["m",""]}]}"#,
                "workers[0].models[1]",
            ),
            (r#"{"workers":[{"name":"a"}],"models":[""]}"#, "models[0]"),
            (
                r#"{"workers":[{"name":"a","speed":0}]}"#,
                "workers[0].speed",
            ),
            (
                r#"{"workers":[{"name":"a"}],"hints":{"session_header":"X-S"}}"#,
                "hints.session_header",
            ),
            (
                r#"{"workers":[{"name":"a"}],"health":{"prefill_slack":-1}}"#,
                "health.prefill_slack",
            ),
            (
                r#"{"workers":[{"name":"a"}],"busy":{"kv_usage":2}}"#,
                "busy.kv_usage",
            ),
            (
                r#"{"workers":[{"name":"a"}],"scoring":{"temperature":-1}}"#,
                "scoring.temperature",
            ),
            (
                r#"{"workers":[{"name":"a"}],"scoring":{"request_ratio_saturated":0.5}}"#,
                "scoring.request_ratio_saturated",
            ),
            (
                r#"{"workers":[{"name":"a"}],"scoring":{"request_ratio_family":1.5}}"#,
                "scoring.request_ratio_family",
            ),
            (r#"{"workers":[{"name":"a"}],"routes":["v1"]}"#, "routes[0]"),
            (
                r#"{"workers":[{"name":"a"}],"steering":{"mode":"endpoint"}}"#,
                "workers[0].endpoint",
            ),
            (
                r#"{"workers":[{"name":"a"},{"name":"p","role":"prefill","endpoint":"h:1"}]}"#,
                "workers[0].endpoint",
            ),
        ];
        for (json, field) in cases {
            let e = parse(json).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
            assert!(e.to_string().contains(field));
        }
    }

    #[test]
    fn worker_models_default_to_the_top_level_list_then_any() {
        let c = parse(
            r#"{"workers":[{"name":"a","models":["m1","m1-lora"]},{"name":"b"}],"models":["m2"]}"#,
        )
        .unwrap();
        let (a, b) = (&c.workers[0], &c.workers[1]);
        assert!(c.serves(a, "m1") && c.serves(a, "m1-lora") && !c.serves(a, "m2"));
        assert!(c.serves(b, "m2") && !c.serves(b, "m1"));
        // No model in the request: any worker.
        assert!(c.serves(a, "") && c.serves(b, ""));
        assert_eq!(c.unknown_model, UnknownModel::Reject);
        let any = parse(r#"{"workers":[{"name":"a"}],"unknown_model":"pass"}"#).unwrap();
        assert!(any.serves(&any.workers[0], "whatever") && !any.has_model_lists());
        assert_eq!(any.unknown_model, UnknownModel::Pass);
        assert!(parse(r#"{"workers":[{"name":"a"}],"unknown_model":"drop"}"#).is_err());
    }

    #[test]
    fn endpoint_mode_header_default() {
        let c = parse(r#"{"workers":[{"name":"a","endpoint":"10.0.0.1:8000"}],"steering":{"mode":"endpoint"}}"#)
            .unwrap();
        assert_eq!(c.steering.header_name(), "x-gateway-destination-endpoint");
    }

    #[test]
    fn wrong_type_is_an_error_not_a_panic() {
        assert!(parse(r#"{"workers":"w1"}"#).is_err());
        assert!(parse(r#"[]"#).is_err());
        assert!(parse("").is_err());
        assert!(
            parse(r#"{"workers":[{"name":"a"}],"disaggregation":{"mode":"sideways"}}"#).is_err()
        );
    }

    #[test]
    fn metrics_section() {
        let c = parse(r#"{"workers":[{"name":"a"}]}"#).unwrap();
        assert_eq!(c.metrics.poll_ms, 0);
        assert_eq!(c.metrics.path, "/metrics");
        let c =
            parse(r#"{"workers":[{"name":"a"}],"metrics":{"poll_ms":500,"path":"/m"}}"#).unwrap();
        assert_eq!((c.metrics.poll_ms, c.metrics.path.as_str()), (500, "/m"));
        for (json, field) in [
            (r#"{"poll_ms":200}"#, "metrics.poll_ms"),
            (r#"{"path":"metrics"}"#, "metrics.path"),
            (r#"{"path":"/a b"}"#, "metrics.path"),
            (r#"{"timeout_ms":0}"#, "metrics.timeout_ms"),
            (r#"{"max_bytes":0}"#, "metrics.max_bytes"),
            (r#"{"cluster_suffix":"a b"}"#, "metrics.cluster_suffix"),
        ] {
            let e = parse(&format!(
                r#"{{"workers":[{{"name":"a"}}],"metrics":{json}}}"#
            ))
            .unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
        }
        assert!(parse(r#"{"workers":[{"name":"a"}],"metrics":{"poll":1}}"#).is_err());
    }

    #[test]
    fn relay_section() {
        let c = parse(r#"{"workers":[{"name":"a"}]}"#).unwrap();
        assert_eq!(c.relay.cluster, "");
        let c = parse(r#"{"workers":[{"name":"a"}],"relay":{"cluster":"relay"}}"#).unwrap();
        assert_eq!(
            (c.relay.cluster.as_str(), c.relay.speculative_ms),
            ("relay", 1000)
        );
        for (json, field) in [
            (r#"{"cluster":"a b"}"#, "relay.cluster"),
            (r#"{"retry_min_ms":0}"#, "relay.retry_min_ms"),
            (r#"{"retry_min_ms":9000}"#, "relay.retry_min_ms"),
            (r#"{"speculative_ms":700000}"#, "relay.speculative_ms"),
            (r#"{"token_env":"A-B"}"#, "relay.token_env"),
            (r#"{"token_env":"1A"}"#, "relay.token_env"),
        ] {
            let e =
                parse(&format!(r#"{{"workers":[{{"name":"a"}}],"relay":{json}}}"#)).unwrap_err();
            assert_eq!(e.field, field, "{json}");
        }
        assert!(parse(r#"{"workers":[{"name":"a"}],"relay":{"clustr":"x"}}"#).is_err());
        // The section's other name.
        let c = parse(r#"{"workers":[{"name":"a"}],"precise":{"cluster":"r"}}"#).unwrap();
        assert_eq!(c.relay.cluster, "r");
    }

    #[test]
    fn status_section() {
        let c = parse(r#"{"workers":[{"name":"a"}]}"#).unwrap();
        assert_eq!(c.status.path, "");
        let c = parse(r#"{"workers":[{"name":"a"}],"status":{"path":"/kvroute/status"}}"#).unwrap();
        assert_eq!(c.status.path, "/kvroute/status");
        for json in [
            r#"{"status":{"path":"status"}}"#,
            r#"{"status":{"path":"/a b"}}"#,
            r#"{"status":{"path":"/s?x=1"}}"#,
            r#"{"status":{"path":"/v1/completions"}}"#,
            r#"{"status":{"path":"/v1//completions/"}}"#,
            r#"{"routes":["/x"],"status":{"path":"/x"}}"#,
        ] {
            let e = parse(&format!(r#"{{"workers":[{{"name":"a"}}],{}"#, &json[1..])).unwrap_err();
            assert_eq!(e.field, "status.path", "{json}: {e}");
        }
        assert!(parse(r#"{"workers":[{"name":"a"}],"status":{"paht":"/s"}}"#).is_err());
    }

    #[test]
    fn lora_section() {
        let c = parse(r#"{"workers":[{"name":"a"}]}"#).unwrap();
        assert_eq!(
            (c.lora.adapters.len(), c.lora.max_loras, c.lora.load_ms),
            (0, 1, 50)
        );
        let c = parse(r#"{"workers":[{"name":"a"}],"models":["m"],"lora":{"adapters":["x","y"],"max_loras":2,"load_ms":80}}"#)
            .unwrap();
        assert_eq!(
            (c.lora.adapters, c.lora.max_loras, c.lora.load_ms),
            (vec!["x".to_string(), "y".to_string()], 2, 80)
        );
        for (json, field) in [
            (r#"{"adapters":[""]}"#, "lora.adapters[0]"),
            (r#"{"adapters":["x","x"]}"#, "lora.adapters[1]"),
            (r#"{"max_loras":0}"#, "lora.max_loras"),
        ] {
            let e = parse(&format!(
                r#"{{"workers":[{{"name":"a"}}],"models":["m"],"lora":{json}}}"#
            ))
            .unwrap_err();
            assert_eq!(e.field, field, "{json}");
        }
        assert!(parse(r#"{"workers":[{"name":"a"}],"lora":{"adapter":["x"]}}"#).is_err());
    }

    #[test]
    fn tokenize_section() {
        let c = parse(r#"{"workers":[{"name":"a"}]}"#).unwrap();
        assert_eq!(
            (c.tokenize.cluster.as_str(), c.tokenize.timeout_ms),
            ("", 1_000)
        );
        for (json, field) in [
            (r#"{"cluster":"a b"}"#, "tokenize.cluster"),
            (r#"{"path":"tokenize"}"#, "tokenize.path"),
            (r#"{"timeout_ms":0}"#, "tokenize.timeout_ms"),
            (r#"{"max_bytes":0}"#, "tokenize.max_bytes"),
        ] {
            let e = parse(&format!(
                r#"{{"workers":[{{"name":"a"}}],"tokenize":{json}}}"#
            ))
            .unwrap_err();
            assert_eq!(e.field, field, "{json}");
        }
    }
}
