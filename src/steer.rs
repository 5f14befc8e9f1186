//! The HTTP surface of a routing decision, as data: which requests the filter intercepts,
//! which client headers it removes, the headers that carry a decision to Envoy and to the
//! workers, and the debug headers on the response. The adapter only applies these lists.

use crate::config::{Config, DisaggMode, SteeringMode};
use crate::request::ApiKind;
use crate::router::{Decision, Router};
use crate::select;
use crate::urlpath::canonical_path;
use std::borrow::Cow;
use std::fmt::Write;

/// Asks the worker to attach its load (ORCA) to the response.
pub const ORCA_REQUEST: &str = "endpoint-load-metrics-format";
/// The worker's load report on the response.
pub const ORCA_RESPONSE: &str = "endpoint-load-metrics";

/// The KV hand-off header a prefill worker sends to the decode worker (token count it
/// transferred); a decode worker that trusts it reports those tokens as cached.
pub const KV_TRANSFER: &str = "x-kvroute-kv-transfer";

/// Both default steering header names: whichever mode is configured, a client must not
/// set the other one either (an Envoy route may still act on it).
const STEERING_DEFAULTS: [&str; 2] = ["x-kvroute-cluster", "x-gateway-destination-endpoint"];

/// What the filter looks at on a request's headers, fixed at configure time.
#[derive(Debug, Clone, PartialEq)]
pub struct Intercept {
    /// Configured routes in canonical form (see `canonical_path`).
    routes: Vec<(String, ApiKind)>,
    strip: Vec<String>,
    /// The status page's path in canonical form (`status.path`), if it is on.
    status: Option<String>,
}

/// An intercepted request: its API, and the `:path` to forward when the client's differs
/// from the canonical route (trailing or repeated slashes, percent-encoding, dot segments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    pub kind: ApiKind,
    pub rewrite: Option<String>,
}

impl Intercept {
    pub fn from_config(cfg: &Config) -> Intercept {
        let routes = cfg
            .routes
            .iter()
            .map(|r| {
                let kind = if r.ends_with("/chat/completions") {
                    ApiKind::ChatCompletions
                } else {
                    ApiKind::Completions
                };
                (canonical_path(r).unwrap_or_else(|| r.clone()), kind)
            })
            .collect();
        let mut strip: Vec<String> = Vec::new();
        for h in [
            cfg.steering.header_name(),
            STEERING_DEFAULTS[0],
            STEERING_DEFAULTS[1],
            cfg.disaggregation.decode_header.as_str(),
            cfg.disaggregation.prefiller_header.as_str(),
            KV_TRANSFER,
        ] {
            // Config validation keeps header names lowercase, as Envoy stores them.
            if !strip.iter().any(|s| s == h) {
                strip.push(h.to_string());
            }
        }
        let status = Some(&cfg.status.path)
            .filter(|p| !p.is_empty())
            .and_then(|p| canonical_path(p));
        Intercept {
            routes,
            strip,
            status,
        }
    }

    /// The request is for the status page (any method: the filter answers it, a GET with the
    /// page, others with 405; it never goes upstream).
    pub fn is_status(&self, path: &str) -> bool {
        let Some(status) = &self.status else {
            return false;
        };
        let raw = path.split_once('?').map_or(path, |(p, _)| p);
        canonical_path(raw).as_ref() == Some(status)
    }

    /// Headers a client must never send: they would choose the worker itself, or make a
    /// worker trust a KV hand-off that never happened.
    pub fn strip(&self) -> &[String] {
        &self.strip
    }

    /// The API of an inference request (a POST to a configured route), or `None` for
    /// traffic that passes through untouched. The path is compared in canonical form, so
    /// every spelling an engine would serve as the route (FastAPI redirects a trailing
    /// slash, uvicorn decodes `%XX`) is routed and accounted, and forwarded canonical.
    pub fn matches(&self, method: Option<&str>, path: &str) -> Option<Matched> {
        if method != Some("POST") {
            return None;
        }
        let (raw, query) = match path.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (path, None),
        };
        let canon = canonical_path(raw)?;
        let (route, kind) = self.routes.iter().find(|(r, _)| *r == canon)?;
        let rewrite = (raw != route).then(|| match query {
            Some(q) => format!("{route}?{q}"),
            None => route.clone(),
        });
        Some(Matched {
            kind: *kind,
            rewrite,
        })
    }
}

/// Request headers that carry the decision: the steering header (a cluster name, or the
/// target endpoint followed by its alternates), the disaggregation hand-off header, and the
/// ORCA request.
pub fn request_headers<'a>(r: &'a Router, d: &Decision) -> Vec<(&'a str, Cow<'a, str>)> {
    let cfg = r.config();
    let mut out = Vec::with_capacity(4);
    let header = cfg.steering.header_name();
    match cfg.steering.mode {
        SteeringMode::Cluster => out.push((header, Cow::Borrowed(r.worker_cluster(d.target)))),
        SteeringMode::Endpoint => {
            let list: Vec<&str> = std::iter::once(d.target)
                .chain(d.alternates.iter().copied())
                .filter_map(|w| r.worker_endpoint(w))
                .collect();
            if !list.is_empty() {
                out.push((header, Cow::Owned(list.join(","))));
            }
        }
    }
    if let Some(p) = d.prefill {
        let (name, worker) = match cfg.disaggregation.mode {
            DisaggMode::Kvroute => (cfg.disaggregation.decode_header.as_str(), d.decode),
            DisaggMode::LlmD => (cfg.disaggregation.prefiller_header.as_str(), p),
        };
        if let Some(ep) = r.worker_endpoint(worker) {
            out.push((name, Cow::Borrowed(ep)));
        }
    }
    out.push((ORCA_REQUEST, Cow::Borrowed("TEXT")));
    if let Some(ms) = d.first_byte_timeout_ms {
        out.push((crate::stall::PER_TRY_TIMEOUT, Cow::Owned(ms.to_string())));
    }
    out
}

/// Longest model name echoed back in a `model_not_found` answer.
const ECHO_MODEL_BYTES: usize = 256;

/// OpenAI's answer to a model it does not serve (HTTP 404), naming the model (at most
/// [`ECHO_MODEL_BYTES`] of it, JSON-escaped).
pub fn model_not_found_body(model: &str) -> Vec<u8> {
    let mut end = model.len().min(ECHO_MODEL_BYTES);
    while !model.is_char_boundary(end) {
        end = end.saturating_sub(1);
    }
    let name = model.get(..end).unwrap_or_default();
    let body = serde_json::json!({"error": {
        "message": format!("The model `{name}` does not exist."),
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }});
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Response headers that show the decision (config `debug_headers`).
pub fn debug_headers(r: &Router, d: &Decision) -> Vec<(&'static str, String)> {
    let mut h = vec![
        ("x-kvroute-worker", r.worker_name(d.decode).to_string()),
        (
            "x-kvroute-predicted-cached-tokens",
            d.overlap_tokens.to_string(),
        ),
        ("x-kvroute-prompt-tokens", d.prompt_tokens.to_string()),
    ];
    if let Some(p) = d.prefill {
        h.push(("x-kvroute-prefill-worker", r.worker_name(p).to_string()));
        h.push((
            "x-kvroute-decode-cached-tokens",
            d.decode_overlap_tokens.to_string(),
        ));
    }
    match &d.fallback {
        Some(f) => h.push(("x-kvroute-fallback", f.kind().to_string())),
        None => h.push(("x-kvroute-ladder", ladder_header(d))),
    }
    if !d.considered.is_empty() {
        h.push(("x-kvroute-costs", costs_header(r, &d.considered)));
        h.push(("x-kvroute-why", why_header(r, d)));
    }
    h
}

/// Candidates `x-kvroute-costs` lists at most (then `; +N more`): a response header stays
/// a few kilobytes whatever the fleet's size.
pub const MAX_COSTS_LISTED: usize = 16;
/// Bytes of a worker's name a cost entry shows at most.
const MAX_NAME_SHOWN: usize = 64;

/// The request's reuse ladder in its prompt tokens (`crate::ladder`; `served` comes with
/// the body and is in the debug log line).
pub fn ladder_header(d: &Decision) -> String {
    let l = &d.ladder;
    format!(
        "workload={} fleet={} routed={} prompt={}",
        l.workload, l.fleet, l.routed, d.prompt_tokens
    )
}

/// The debug log line of a finished request (`debug_headers`): its ladder, with `served`
/// when the engine reported it (`-` otherwise), and [`why_header`].
pub fn explain_line(r: &Router, d: &Decision, served: Option<u64>) -> String {
    let mut s = format!(
        "kvroute: ladder request={:x} worker={} {}",
        d.id,
        r.worker_name(d.target),
        ladder_header(d)
    );
    match served {
        Some(v) => {
            let _ = write!(s, " served={v} (engine tokens)");
        }
        None => s.push_str(" served=-"),
    }
    if !d.considered.is_empty() {
        s.push_str("; ");
        s.push_str(&why_header(r, d));
    }
    s
}

/// The chosen decode worker's cost terms and the runner-up's (the cheapest other one):
/// `chosen <entry>; runner-up <entry>`, entries as in `x-kvroute-costs`.
pub fn why_header(r: &Router, d: &Decision) -> String {
    let mut s = String::new();
    let chosen = d.considered.iter().find(|c| c.id == d.decode);
    let runner_up = d
        .considered
        .iter()
        .filter(|c| c.id != d.decode)
        .min_by(|a, b| a.terms.total().total_cmp(&b.terms.total()));
    if let Some(c) = chosen {
        s.push_str("chosen ");
        cost_entry(&mut s, r, c);
    }
    if let Some(c) = runner_up {
        if !s.is_empty() {
            s.push_str("; ");
        }
        s.push_str("runner-up ");
        cost_entry(&mut s, r, c);
    }
    s
}

/// Each decode candidate (at most [`MAX_COSTS_LISTED`]): `name cost=.. cached=..
/// waiting=.. pending=.. [family=..] [term=..]`, family the share of the worker's recent
/// requests from the request's prefix family (where it holds it), terms in KV blocks and
/// only where non-zero, candidates separated by `; `.
fn costs_header(r: &Router, considered: &[select::Considered]) -> String {
    let mut s = String::new();
    for c in considered.iter().take(MAX_COSTS_LISTED) {
        if !s.is_empty() {
            s.push_str("; ");
        }
        cost_entry(&mut s, r, c);
    }
    if considered.len() > MAX_COSTS_LISTED {
        let _ = write!(s, "; +{} more", considered.len() - MAX_COSTS_LISTED);
    }
    s
}

fn cost_entry(s: &mut String, r: &Router, c: &select::Considered) {
    {
        let t = &c.terms;
        let name = r.worker_name(c.id);
        let name = name
            .get(..name.floor_char_boundary(MAX_NAME_SHOWN))
            .unwrap_or(name);
        let _ = write!(
            s,
            "{} cost={:.1} cached={} waiting={} pending={:.0}",
            name,
            t.total(),
            c.overlap_tokens,
            c.prefilling,
            c.prefill_tokens
        );
        if let Some(f) = c.family_share {
            let _ = write!(s, " family={f:.2}");
        }
        for (name, v) in [
            ("prefill", t.prefill),
            ("recompute", t.recompute),
            ("duplicate", t.duplicate),
            ("decode", t.decode),
            ("interference", t.interference),
            ("memory", t.memory),
            ("balance", t.balance),
            ("share", t.share),
            ("adapter", t.adapter),
        ] {
            if v != 0.0 {
                let _ = write!(s, " {name}={v:.1}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn model_not_found_is_openai_shaped_and_bounded() {
        let v: serde_json::Value =
            serde_json::from_slice(&super::model_not_found_body("a\"b")).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["message"], "The model `a\"b` does not exist.");
        let long = "é".repeat(1000);
        let body = super::model_not_found_body(&long);
        assert!(body.len() < 400, "{}", body.len());
        assert!(serde_json::from_slice::<serde_json::Value>(&body).is_ok());
    }

    use super::*;
    use crate::router::RouteResult;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn router(extra: &str) -> Router {
        let json = format!(
            r#"{{"workers":[
                {{"name":"d0","endpoint":"10.0.0.1:8000","cluster":"c-d0"}},
                {{"name":"d1","endpoint":"10.0.0.2:8000"}},
                {{"name":"d2","endpoint":"w2.local:8000"}},
                {{"name":"p0","endpoint":"10.0.1.1:8000","role":"prefill"}}
            ]{extra}}}"#
        );
        Router::new(Config::from_json(json.as_bytes()).unwrap(), 1, 5)
    }

    fn decide(r: &mut Router, prompt_bytes: usize) -> Decision {
        let prompt = "lorem ipsum dolor ".repeat(prompt_bytes / 18 + 1);
        let body = serde_json::to_vec(&serde_json::json!({"model":"m","prompt":prompt})).unwrap();
        match r.route(ApiKind::Completions, &body, 0) {
            RouteResult::Routed(d) => d,
            r => panic!("not routed: {r:?}"),
        }
    }

    fn get<'a>(h: &'a [(&str, Cow<'_, str>)], name: &str) -> Option<&'a str> {
        h.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_ref())
    }

    fn get_owned(h: &[(&str, String)], name: &str) -> Option<String> {
        h.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone())
    }

    fn kind(i: &Intercept, method: &str, path: &str) -> Option<ApiKind> {
        i.matches(Some(method), path).map(|m| m.kind)
    }

    #[test]
    fn intercepts_posts_to_configured_routes_only() {
        let cfg = Config::from_json(
            br#"{"workers":[{"name":"a"}],"routes":["/v1/completions","/x/chat/completions"]}"#,
        )
        .unwrap();
        let i = Intercept::from_config(&cfg);
        assert_eq!(
            kind(&i, "POST", "/v1/completions?stream=1"),
            Some(ApiKind::Completions)
        );
        assert_eq!(
            kind(&i, "POST", "/x/chat/completions"),
            Some(ApiKind::ChatCompletions)
        );
        assert_eq!(kind(&i, "GET", "/v1/completions"), None);
        assert_eq!(i.matches(None, "/v1/completions"), None);
        assert_eq!(kind(&i, "POST", "/v1/chat/completions"), None);
        assert_eq!(kind(&i, "POST", "/v1/completions/render"), None);
        assert_eq!(kind(&i, "POST", "/v1/completionsx"), None);
        assert_eq!(
            i.strip(),
            [
                "x-kvroute-cluster",
                "x-gateway-destination-endpoint",
                "x-kvroute-decode-endpoint",
                "x-prefiller-host-port",
                "x-kvroute-kv-transfer"
            ]
        );
    }

    #[test]
    fn status_page_path_matches_in_any_spelling_only_when_on() {
        let off =
            Intercept::from_config(&Config::from_json(br#"{"workers":[{"name":"a"}]}"#).unwrap());
        assert!(!off.is_status("/"));
        assert!(!off.is_status(""));
        let cfg =
            Config::from_json(br#"{"workers":[{"name":"a"}],"status":{"path":"/kvroute/status"}}"#)
                .unwrap();
        let i = Intercept::from_config(&cfg);
        for p in [
            "/kvroute/status",
            "/kvroute/status/",
            "//kvroute/%73tatus?x=1",
        ] {
            assert!(i.is_status(p), "{p}");
        }
        for p in ["/kvroute", "/kvroute/status/x", "/v1/completions", ""] {
            assert!(!i.is_status(p), "{p}");
        }
    }

    #[test]
    fn other_spellings_of_a_route_match_and_are_rewritten_canonical() {
        let cfg = Config::from_json(br#"{"workers":[{"name":"a"}]}"#).unwrap();
        let i = Intercept::from_config(&cfg);
        let m = |p: &str| i.matches(Some("POST"), p);
        assert_eq!(
            m("/v1/completions"),
            Some(Matched {
                kind: ApiKind::Completions,
                rewrite: None
            })
        );
        assert_eq!(m("/v1/completions?a=1").unwrap().rewrite, None);
        for (path, want) in [
            ("/v1/completions/", "/v1/completions"),
            ("//v1//completions", "/v1/completions"),
            ("/v1/completions//?a=1", "/v1/completions?a=1"),
            ("/v1/%63ompletions", "/v1/completions"),
            ("/v1/./x/../completions", "/v1/completions"),
            ("/v1/chat%2Fcompletions/", "/v1/chat/completions"),
        ] {
            let got = m(path).unwrap_or_else(|| panic!("{path} not matched"));
            assert_eq!(got.rewrite.as_deref(), Some(want), "{path}");
        }
        assert_eq!(
            m("/v1/chat/completions/").unwrap().kind,
            ApiKind::ChatCompletions
        );
        // Not a route in any spelling, or not decodable: passes through.
        assert_eq!(m("/v1/completions%"), None);
        assert_eq!(m("/v1/completions%ff"), None);
        assert_eq!(m("/v1/completions\u{fffd}"), None);
    }

    #[test]
    fn configured_steering_header_is_stripped_once() {
        let cfg = Config::from_json(
            br#"{"workers":[{"name":"a","endpoint":"10.0.0.1:80"}],"steering":{"mode":"endpoint","header":"x-pick"}}"#,
        )
        .unwrap();
        let i = Intercept::from_config(&cfg);
        assert_eq!(i.strip().first().map(String::as_str), Some("x-pick"));
        assert_eq!(i.strip().len(), 6);
        let cfg =
            Config::from_json(br#"{"workers":[{"name":"a","endpoint":"10.0.0.1:80"}],"steering":{"mode":"endpoint"}}"#)
                .unwrap();
        assert_eq!(Intercept::from_config(&cfg).strip().len(), 5);
    }

    #[test]
    fn a_request_carries_its_per_try_bound() {
        let mut r = router(r#","disaggregation":{"threshold_tokens":0}"#);
        let body = br#"{"model":"m","prompt":"hello there","max_tokens":10}"#;
        let RouteResult::Routed(d) = r.route(ApiKind::Completions, body, 0) else {
            panic!("rejected")
        };
        // 30 s floor + 4 x the prefill estimate + 10 tokens x 250 ms.
        let ms: u64 = get(&request_headers(&r, &d), crate::stall::PER_TRY_TIMEOUT)
            .unwrap()
            .parse()
            .unwrap();
        assert!((32_500..32_700).contains(&ms), "{ms}");
        // No max_tokens and not a stream: no bound, Envoy's route decides.
        let body = br#"{"model":"m","prompt":"hello there"}"#;
        let RouteResult::Routed(d) = r.route(ApiKind::Completions, body, 0) else {
            panic!("rejected")
        };
        assert_eq!(d.first_byte_timeout_ms, None);
        assert_eq!(
            get(&request_headers(&r, &d), crate::stall::PER_TRY_TIMEOUT),
            None
        );
    }

    #[test]
    fn cluster_mode_names_the_target_cluster() {
        let mut r = router(r#","disaggregation":{"threshold_tokens":0}"#);
        let d = decide(&mut r, 100);
        let h = request_headers(&r, &d);
        let want = r.worker_cluster(d.target).to_string();
        assert_eq!(get(&h, "x-kvroute-cluster"), Some(want.as_str()));
        assert_eq!(get(&h, ORCA_REQUEST), Some("TEXT"));
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn endpoint_mode_lists_target_then_alternates_with_endpoints() {
        let mut r = router(
            r#","steering":{"mode":"endpoint","fallbacks":3},"disaggregation":{"threshold_tokens":0}"#,
        );
        let mut d = decide(&mut r, 100);
        d.target = 1;
        d.alternates = vec![2, 0];
        let h = request_headers(&r, &d);
        assert_eq!(
            get(&h, "x-gateway-destination-endpoint"),
            Some("10.0.0.2:8000,w2.local:8000,10.0.0.1:8000")
        );
        d.target = 2;
        d.alternates.clear();
        let h = request_headers(&r, &d);
        assert_eq!(
            get(&h, "x-gateway-destination-endpoint"),
            Some("w2.local:8000")
        );
        assert_eq!(get(&h, ORCA_REQUEST), Some("TEXT"));
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn disaggregation_headers_per_mode() {
        let mut r = router(r#","disaggregation":{"threshold_tokens":100}"#);
        let d = decide(&mut r, 20_000);
        assert_eq!(d.prefill, Some(3));
        let h = request_headers(&r, &d);
        assert_eq!(get(&h, "x-kvroute-cluster"), Some("p0"));
        let decode_ep = r.worker_endpoint(d.decode).unwrap().to_string();
        assert_eq!(
            get(&h, "x-kvroute-decode-endpoint"),
            Some(decode_ep.as_str())
        );
        assert_eq!(get(&h, "x-prefiller-host-port"), None);

        let mut r = router(r#","disaggregation":{"threshold_tokens":100,"mode":"llm-d"}"#);
        let d = decide(&mut r, 20_000);
        assert_eq!(d.prefill, Some(3));
        let h = request_headers(&r, &d);
        let decode_cluster = r.worker_cluster(d.decode).to_string();
        assert_eq!(get(&h, "x-kvroute-cluster"), Some(decode_cluster.as_str()));
        assert_eq!(get(&h, "x-prefiller-host-port"), Some("10.0.1.1:8000"));
        assert_eq!(get(&h, "x-kvroute-decode-endpoint"), None);
    }

    #[test]
    fn debug_headers_show_the_decision() {
        let mut r = router(r#","disaggregation":{"threshold_tokens":100}"#);
        let d = decide(&mut r, 20_000);
        let h = debug_headers(&r, &d);
        let names: Vec<&str> = h.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            names,
            [
                "x-kvroute-worker",
                "x-kvroute-predicted-cached-tokens",
                "x-kvroute-prompt-tokens",
                "x-kvroute-prefill-worker",
                "x-kvroute-decode-cached-tokens",
                "x-kvroute-ladder"
            ]
        );
        assert_eq!(h[0].1, r.worker_name(d.decode));
        assert_eq!(h[2].1, d.prompt_tokens.to_string());
        assert_eq!(h[3].1, "p0");

        let mut r = router("");
        let d = match r.route(ApiKind::Completions, b"{broken", 0) {
            RouteResult::Routed(d) => d,
            r => panic!("not routed: {r:?}"),
        };
        let h = debug_headers(&r, &d);
        assert_eq!(h.len(), 4);
        assert_eq!(h[3], ("x-kvroute-fallback", "parse_error".to_string()));
    }

    #[test]
    fn debug_costs_explain_the_pick() {
        let mut r = router(r#","debug_headers":true"#);
        let first = decide(&mut r, 4_000);
        // The same prompt again: the worker that holds it now is the cheapest by its cache.
        let d = decide(&mut r, 4_000);
        assert_eq!(d.decode, first.decode);
        let h = debug_headers(&r, &d);
        let costs = get_owned(&h, "x-kvroute-costs").expect("x-kvroute-costs");
        let per: Vec<(&str, f64)> = costs
            .split("; ")
            .map(|c| {
                let name = c.split(' ').next().unwrap();
                let cost = c
                    .split(' ')
                    .find_map(|kv| kv.strip_prefix("cost="))
                    .unwrap()
                    .parse()
                    .unwrap();
                (name, cost)
            })
            .collect();
        assert_eq!(per.len(), 3, "{costs}");
        let best = per
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|p| p.0)
            .unwrap();
        assert_eq!(best, r.worker_name(d.decode), "{costs}");
        assert!(costs.contains(" recompute="), "{costs}");
        assert!(
            costs.contains(&format!("{} cost=", r.worker_name(d.decode))),
            "{costs}"
        );
        // The holder's entry says how much of the prompt it holds; the others hold none.
        let holder = costs
            .split("; ")
            .find(|c| c.starts_with(r.worker_name(d.decode)))
            .unwrap();
        assert!(!holder.contains(" cached=0 "), "{costs}");
        assert_eq!(costs.matches(" cached=0 ").count(), 2, "{costs}");
        // The first request started the prefix, the second was its family's first: half of
        // the holder's requests, and a share only the holder has.
        let third = decide(&mut r, 4_000);
        let h = debug_headers(&r, &third);
        let costs = get_owned(&h, "x-kvroute-costs").expect("x-kvroute-costs");
        let holder = costs
            .split("; ")
            .find(|c| c.starts_with(r.worker_name(first.decode)))
            .unwrap();
        assert!(holder.contains(" family=0.50 "), "{costs}");
        assert_eq!(costs.matches(" family=").count(), 1, "{costs}");
        // Why: the chosen worker's entry and the cheapest other one's, nothing else.
        let why = get_owned(&h, "x-kvroute-why").expect("x-kvroute-why");
        let (chosen, runner_up) = why.split_once("; ").expect(&why);
        assert_eq!(chosen, format!("chosen {holder}"));
        let others: Vec<&str> = costs.split("; ").filter(|c| *c != holder).collect();
        let cost_of = |c: &str| -> f64 {
            c.split(' ')
                .find_map(|kv| kv.strip_prefix("cost="))
                .unwrap()
                .parse()
                .unwrap()
        };
        let cheapest = others
            .iter()
            .min_by(|a, b| cost_of(a).total_cmp(&cost_of(b)))
            .unwrap();
        assert_eq!(runner_up, format!("runner-up {cheapest}"));
        // The ladder: seen, held and routed to its holder.
        let ladder = get_owned(&h, "x-kvroute-ladder").expect("x-kvroute-ladder");
        let l = third.ladder;
        assert!(l.routed > 0 && l.workload == l.routed, "{ladder}");
        assert_eq!(
            ladder,
            format!(
                "workload={} fleet={} routed={} prompt={}",
                l.workload, l.fleet, l.routed, third.prompt_tokens
            )
        );
    }

    #[test]
    fn debug_headers_stay_bounded_on_a_large_fleet() {
        let long = "w".repeat(300);
        let workers: Vec<String> = (0..40)
            .map(|i| format!(r#"{{"name":"{long}{i}","endpoint":"10.0.0.{i}:8000"}}"#))
            .collect();
        let json = format!(
            r#"{{"workers":[{}],"debug_headers":true}}"#,
            workers.join(",")
        );
        let mut r = Router::new(Config::from_json(json.as_bytes()).unwrap(), 1, 5);
        let d = decide(&mut r, 4_000);
        let h = debug_headers(&r, &d);
        let costs = get_owned(&h, "x-kvroute-costs").unwrap();
        assert_eq!(costs.split("; ").count(), MAX_COSTS_LISTED + 1, "{costs}");
        assert!(costs.ends_with("; +24 more"), "{costs}");
        assert!(costs.len() < 4096, "{}", costs.len());
        let why = get_owned(&h, "x-kvroute-why").unwrap();
        assert!(why.len() < 512 && why.contains("runner-up "), "{why}");
    }
}
