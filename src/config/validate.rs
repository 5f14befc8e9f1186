//! Every check beyond the JSON's shape: each failure names its field as a path into the
//! JSON (`workers[2].endpoint`), so a config is fixed from the message alone.

use super::{err, Config, ConfigError, Role, SteeringMode};
use crate::ids::{CHARS_PER_TOKEN_RANGE, MAX_WORKERS};

impl Config {
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
            let canon = crate::urlpath::canonical_path(sp);
            if let Some(r) = self
                .routes
                .iter()
                .find(|r| crate::urlpath::canonical_path(r) == canon)
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
    use crate::config::tests::parse;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
