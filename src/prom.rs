//! Worker load from an engine's Prometheus text exposition (`GET /metrics`), for engines that
//! send no ORCA `endpoint-load-metrics` header: llama.cpp's llama-server, SGLang, and vLLM on
//! streaming responses. The filter scrapes each worker on a timer and applies the result like
//! an ORCA report (`Router::on_orca`).
//!
//! Read per engine (other series are ignored):
//!
//! | engine | waiting | running | KV usage (0..1) |
//! |---|---|---|---|
//! | llama.cpp | `llamacpp:requests_deferred` | `llamacpp:requests_processing` | `llamacpp:kv_cache_usage_ratio` |
//! | vLLM | `vllm:num_requests_waiting` | `vllm:num_requests_running` | `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before 0.10) |
//! | SGLang | `sglang:num_queue_reqs` | `sglang:num_running_reqs` | `sglang:token_usage` |
//!
//! Several series of one metric (labels: one per model, or per data-parallel rank) add up for
//! the request counts; KV usage takes the highest. Input is whatever the upstream sent: the
//! parser never panics, skips lines it cannot read and ignores NaN, infinities and negative
//! values.

use crate::feedback::OrcaLoad;

/// Which figure of the load report a metric feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Waiting,
    Running,
    KvUsage,
}

const KNOWN: &[(&str, Field)] = &[
    ("llamacpp:requests_deferred", Field::Waiting),
    ("llamacpp:requests_processing", Field::Running),
    ("llamacpp:kv_cache_usage_ratio", Field::KvUsage),
    ("vllm:num_requests_waiting", Field::Waiting),
    ("vllm:num_requests_running", Field::Running),
    ("vllm:kv_cache_usage_perc", Field::KvUsage),
    ("vllm:gpu_cache_usage_perc", Field::KvUsage),
    ("sglang:num_queue_reqs", Field::Waiting),
    ("sglang:num_running_reqs", Field::Running),
    ("sglang:token_usage", Field::KvUsage),
];

/// One sample line: the metric name and its value (labels and timestamp are dropped).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub value: f64,
}

/// Reads one line of the text format: `name[{labels}] value [timestamp]`. Comments, blank
/// lines and anything malformed give `None`.
pub fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_len = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    if name_len == 0 {
        return None;
    }
    let (name, rest) = line.split_at_checked(name_len)?;
    let rest = match rest.strip_prefix('{') {
        Some(labels) => skip_labels(labels)?,
        None => rest,
    };
    // At least one blank between the name (or labels) and the value.
    if !rest.starts_with([' ', '\t']) {
        return None;
    }
    let value = rest.split_ascii_whitespace().next()?;
    let value = value.parse::<f64>().ok()?;
    Some(Sample { name, value })
}

/// The text after the closing `}` of a label set that started just before `s`. Label values
/// are quoted and may contain `}`, `"` escaped as `\"`, and `\\`.
fn skip_labels(s: &str) -> Option<&str> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if escaped {
            escaped = false;
            continue;
        }
        match c {
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return s.get(i + 1..),
            _ => {}
        }
    }
    None
}

/// The load an engine's `/metrics` text describes, or `None` when it holds none of the
/// series this module knows (another engine, an error page, the wrong path).
pub fn parse_load(text: &str) -> Option<OrcaLoad> {
    let mut waiting: Option<f64> = None;
    let mut running: Option<f64> = None;
    let mut kv: Option<f64> = None;
    for line in text.lines() {
        let Some(s) = parse_line(line) else { continue };
        let Some(field) = KNOWN.iter().find(|(n, _)| *n == s.name).map(|(_, f)| *f) else {
            continue;
        };
        if !(s.value.is_finite() && s.value >= 0.0) {
            continue;
        }
        match field {
            Field::Waiting => waiting = Some(waiting.unwrap_or(0.0) + s.value),
            Field::Running => running = Some(running.unwrap_or(0.0) + s.value),
            Field::KvUsage => kv = Some(kv.unwrap_or(0.0).max(s.value)),
        }
    }
    let count = |v: f64| v.round().min(f64::from(u32::MAX)) as u32;
    let out = OrcaLoad {
        kv_usage: kv.map(|v| v.min(1.0) as f32),
        waiting: waiting.map(count),
        running: running.map(count),
    };
    (!out.is_empty()).then_some(out)
}

/// The label values of a sample line, unescaped, in order: `(name, value)`; `None` when the
/// line has no label set or it is malformed.
pub fn parse_labels(line: &str) -> Option<Vec<(&str, String)>> {
    let start = line.find('{')?;
    let mut rest = line.get(start + 1..)?;
    let mut out = Vec::new();
    loop {
        rest = rest.trim_start_matches([' ', ',']);
        if rest.starts_with('}') {
            return Some(out);
        }
        let eq = rest.find('=')?;
        let name = rest.get(..eq)?.trim();
        rest = rest.get(eq + 1..)?.trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut escaped = false;
        let mut end = None;
        for (i, c) in rest.char_indices() {
            if escaped {
                value.push(match c {
                    'n' => '\n',
                    c => c,
                });
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                end = Some(i);
                break;
            } else {
                value.push(c);
            }
        }
        rest = rest.get(end? + 1..)?;
        out.push((name, value));
    }
}

/// vLLM's `vllm:lora_requests_info`: `max_lora` and the comma-separated adapter names of
/// its running and waiting requests as label values. vLLM never removes a label set, so
/// every set ever current is exposed, valued with when it last was (unix seconds): the
/// newest is the engine's state. `None` when the text has no such series.
pub fn parse_lora(text: &str) -> Option<crate::lora::LoraReport> {
    let mut best: Option<(f64, &str)> = None;
    for line in text.lines() {
        let line = line.trim_start();
        if !line.starts_with("vllm:lora_requests_info{") {
            continue;
        }
        let Some(s) = parse_line(line) else { continue };
        if s.name != "vllm:lora_requests_info" || !s.value.is_finite() {
            continue;
        }
        if best.is_none_or(|(v, _)| s.value > v) {
            best = Some((s.value, line));
        }
    }
    let labels = parse_labels(best?.1)?;
    let ids = |key: &str| -> Vec<crate::lora::AdapterId> {
        let mut v: Vec<crate::lora::AdapterId> = labels
            .iter()
            .filter(|(k, _)| *k == key)
            .flat_map(|(_, names)| names.split(','))
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(crate::lora::adapter_id)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let max_lora = labels
        .iter()
        .find(|(k, _)| *k == "max_lora")
        .and_then(|(_, v)| v.trim().parse::<u32>().ok());
    Some(crate::lora::LoraReport {
        max_lora,
        running: ids("running_lora_adapters"),
        waiting: ids("waiting_lora_adapters"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const LLAMA: &str = "\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12345
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
";

    const VLLM: &str = r#"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_requests_waiting_by_reason{reason="x"} 99
"#;

    const SGLANG: &str = r#"sglang:num_queue_reqs{model_name="m",tp_rank="0"} 5.0
sglang:num_running_reqs{model_name="m",tp_rank="0"} 2.0
sglang:token_usage{model_name="m",tp_rank="0"} 0.75 1700000000000
"#;

    #[test]
    fn llama_cpp() {
        let l = parse_load(LLAMA).unwrap();
        assert_eq!(l.waiting, Some(2));
        assert_eq!(l.running, Some(3));
        assert_eq!(l.kv_usage, None);
        let with_kv = format!("{LLAMA}llamacpp:kv_cache_usage_ratio 0.125\n");
        assert_eq!(parse_load(&with_kv).unwrap().kv_usage, Some(0.125));
    }

    #[test]
    fn vllm_sums_counts_and_takes_the_highest_usage() {
        let l = parse_load(VLLM).unwrap();
        assert_eq!(l.waiting, Some(5));
        assert_eq!(l.running, Some(7));
        assert_eq!(l.kv_usage, Some(0.5));
        let old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.3\n";
        assert_eq!(parse_load(old).unwrap().kv_usage, Some(0.3));
    }

    #[test]
    fn sglang_with_timestamps() {
        let l = parse_load(SGLANG).unwrap();
        assert_eq!(
            (l.waiting, l.running, l.kv_usage),
            (Some(5), Some(2), Some(0.75))
        );
    }

    #[test]
    fn labels_with_braces_quotes_and_escapes() {
        let s = parse_line(r#"vllm:num_requests_waiting{a="}",b="x\"}y",c="\\"} 3"#).unwrap();
        assert_eq!((s.name, s.value), ("vllm:num_requests_waiting", 3.0));
        assert_eq!(parse_line(r#"m{a="unterminated} 3"#), None);
        assert_eq!(parse_line("m{a=\"1\"}3"), None);
        assert_eq!(parse_line("  m 1e3").map(|s| s.value), Some(1000.0));
        assert_eq!(parse_line("m +Inf").map(|s| s.value), Some(f64::INFINITY));
    }

    #[test]
    fn bad_values_and_other_engines_are_ignored() {
        assert_eq!(parse_load(""), None);
        assert_eq!(parse_load("<html>404 not found</html>"), None);
        assert_eq!(parse_load("process_cpu_seconds_total 12\n"), None);
        let bad = "llamacpp:requests_deferred NaN\nllamacpp:requests_processing -1\n\
                   llamacpp:kv_cache_usage_ratio +Inf\nllamacpp:requests_deferred\n";
        assert_eq!(parse_load(bad), None);
        // Above 1 (a percentage by mistake) is clamped; huge counts saturate.
        let l = parse_load("sglang:token_usage 75\nsglang:num_queue_reqs 1e300\n").unwrap();
        assert_eq!((l.kv_usage, l.waiting), (Some(1.0), Some(u32::MAX)));
    }

    #[test]
    fn lora_info_takes_the_newest_label_set() {
        use crate::lora::adapter_id as id;
        let text = r#"# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7643e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="chat",waiting_lora_adapters="sql,b\"x"} 1.7644e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7642e9
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
"#;
        let r = parse_lora(text).unwrap();
        assert_eq!(r.max_lora, Some(2));
        assert_eq!(r.running, vec![id("chat")]);
        let mut w = vec![id("sql"), id("b\"x")];
        w.sort_unstable();
        assert_eq!(r.waiting, w);
        assert_eq!(parse_lora(VLLM), None);
        // vLLM 0.32 (CPU build, --max-loras 1), as served: old label sets stay.
        let real = "vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"sql\"} 1.7958853459156249e+09
vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.7958853459874575e+09
vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"chat\",waiting_lora_adapters=\"chat\"} 1.7958853475324786e+09
";
        let r = parse_lora(real).unwrap();
        assert_eq!(
            (r.max_lora, r.running, r.waiting),
            (Some(1), vec![id("chat")], vec![id("chat")])
        );
        assert_eq!(
            parse_labels(r#"m{a="x\\y\"",b="1"} 2"#).unwrap(),
            vec![("a", "x\\y\"".to_string()), ("b", "1".to_string())]
        );
        assert_eq!(parse_labels(r#"m{a="x} 2"#), None);
        assert_eq!(parse_labels("m 2"), None);
    }

    #[test]
    fn never_panics_on_arbitrary_bytes() {
        // A cheap deterministic fuzz: every prefix of tricky inputs, and pseudo-random text.
        let tricky = format!("{LLAMA}{VLLM}{SGLANG}m{{\"\\é}} 1\n\u{0}{{}}\r\n#\n:: 2\n");
        for end in 0..=tricky.len() {
            if let Some(t) = tricky.get(..end) {
                let _ = parse_load(t);
                let _ = parse_labels(t);
            }
        }
        let alphabet: Vec<char> = "ab:_{}\"\\= \n\t#0123456789.eE+-NaInf,é".chars().collect();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..2000 {
            let mut s = String::new();
            for _ in 0..(x % 64) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                s.push(alphabet[(x % alphabet.len() as u64) as usize]);
            }
            let _ = parse_load(&s);
            let _ = parse_lora(&format!("vllm:lora_requests_info{{{s}"));
            x = x.wrapping_add(1);
        }
    }
}
