//! Plugin configuration: the JSON users put in the Envoy YAML, with documented defaults and
//! validation errors that name the offending field (`workers[2].endpoint: ...`).
//!
//! Unknown keys are rejected: a typo such as `"temprature"` must fail loudly at load time
//! instead of silently running with the default.
//!
//! The sections live by theme: `workers` (the fleet), `scoring` (what picks a worker and
//! when it counts as busy or disaggregated), `sections` (all the others), and `validate`
//! (every check beyond the JSON's shape).

mod scoring;
mod sections;
mod validate;
mod workers;

pub use scoring::{BusyConfig, DisaggConfig, DisaggMode, ScoringConfig};
pub use sections::{
    HealthConfig, HintsConfig, IndexConfig, LimitsConfig, LoadConfig, LoraConfig, MetricsConfig,
    RelayConfig, StatusConfig, SteeringConfig, SteeringMode, TokenizeConfig,
};
pub use workers::{Role, UnknownModel, WorkerConfig};

use crate::ids::DEFAULT_CHARS_PER_TOKEN;
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

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    pub(super) fn parse(s: &str) -> Result<Config, ConfigError> {
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
}
