//! ORCA load reports (`endpoint-load-metrics`) as vLLM writes them.
//!
//! vLLM builds the report from its Prometheus gauges: `num_requests_waiting` then
//! `kv_cache_usage_perc` (the order its stat logger registers them), each a Python float.
//! TEXT joins `named_metrics.<name>=<repr(float)>` with `", "`; JSON is Python's
//! `json.dumps` of `{"named_metrics": {...}}` (separators `", "` and `": "`). The format
//! name is matched case-insensitively; anything but text/json gets no header.

use hyper::header::HeaderValue;

use crate::engine::Load;

/// Python's `repr(float)`: the shortest digits that round-trip, in fixed notation with at
/// least one decimal when the decimal exponent is in [-4, 16), else `d.ddde-05` style.
pub fn py_float(v: f64) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    // Rust's `{:e}` prints the same shortest round-trip digits: `3.125e-1`, `2e0`.
    let sci = format!("{v:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let fixed = format!("{v}");
        if fixed.contains('.') {
            fixed
        } else {
            format!("{fixed}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// Which report to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// vLLM's: waiting and KV usage, floats, `", "` separators.
    Vllm,
    /// The mock's old report (`--orca-on-stream`): KV usage, waiting and running, `,`.
    Legacy,
}

/// The `endpoint-load-metrics` value for the requested format, if it is TEXT or JSON.
pub fn report(format: Option<&HeaderValue>, load: Load, style: Style) -> Option<HeaderValue> {
    let f = format?.to_str().ok()?.trim().to_ascii_lowercase();
    let s = match (style, f.as_str()) {
        (Style::Vllm, "text") => format!(
            "TEXT named_metrics.num_requests_waiting={}, named_metrics.kv_cache_usage_perc={}",
            py_float(load.waiting as f64),
            py_float(load.kv_usage)
        ),
        (Style::Vllm, "json") => format!(
            "JSON {{\"named_metrics\": {{\"num_requests_waiting\": {}, \"kv_cache_usage_perc\": {}}}}}",
            py_float(load.waiting as f64),
            py_float(load.kv_usage)
        ),
        (Style::Legacy, "text") => format!(
            "TEXT named_metrics.kv_cache_usage_perc={},named_metrics.num_requests_waiting={},named_metrics.num_requests_running={}",
            load.kv_usage, load.waiting, load.running
        ),
        (Style::Legacy, "json") => format!(
            "JSON {}",
            serde_json::json!({"named_metrics": {"kv_cache_usage_perc": load.kv_usage,
                "num_requests_waiting": load.waiting, "num_requests_running": load.running}})
        ),
        _ => return None,
    };
    HeaderValue::from_str(&s).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        for (v, want) in [
            (0.0, "0.0"),
            (2.0, "2.0"),
            (0.31, "0.31"),
            (0.3125, "0.3125"),
            (1e-4, "0.0001"),
            (1.0 / 26624.0, "3.7560096153846156e-05"),
            (1e16, "1e+16"),
            (123456789.0, "123456789.0"),
        ] {
            assert_eq!(py_float(v), want, "{v}");
        }
    }

    #[test]
    fn vllm_report_byte_for_byte() {
        let load = Load {
            running: 5,
            waiting: 2,
            kv_usage: 0.3125,
        };
        let text = HeaderValue::from_static("TEXT");
        assert_eq!(
            report(Some(&text), load, Style::Vllm).unwrap(),
            "TEXT named_metrics.num_requests_waiting=2.0, named_metrics.kv_cache_usage_perc=0.3125"
        );
        let json = HeaderValue::from_static("json");
        assert_eq!(
            report(Some(&json), load, Style::Vllm).unwrap(),
            r#"JSON {"named_metrics": {"num_requests_waiting": 2.0, "kv_cache_usage_perc": 0.3125}}"#
        );
        assert!(report(Some(&HeaderValue::from_static("BINARY")), load, Style::Vllm).is_none());
        assert!(report(None, load, Style::Vllm).is_none());
        assert_eq!(
            report(Some(&text), load, Style::Legacy).unwrap(),
            "TEXT named_metrics.kv_cache_usage_perc=0.3125,named_metrics.num_requests_waiting=2,named_metrics.num_requests_running=5"
        );
    }
}
