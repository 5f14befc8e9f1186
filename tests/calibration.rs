//! Chars-per-token calibration through the router's public API: one upstream whose `usage`
//! is wrong must not skew the estimate every route uses (issue 12).

use kvroute::config::Config;
use kvroute::feedback::Usage;
use kvroute::request::ApiKind;
use kvroute::router::{RouteResult, Router};

#[test]
fn one_bad_upstream_does_not_skew_chars_per_token() {
    let cfg = Config::from_json(
        br#"{"workers":[{"name":"a"},{"name":"b"},{"name":"c"},{"name":"bad"}],
             "disaggregation":{"threshold_tokens":0}}"#,
    )
    .unwrap();
    let mut r = Router::new(cfg, 1, 3);
    let mut per_worker = [0u32; 4];
    for i in 0..400u64 {
        let prompt = format!("request {i} ") + &"lorem ipsum dolor sit amet ".repeat(40);
        let body = serde_json::to_vec(&serde_json::json!({"model":"m","prompt":prompt})).unwrap();
        let RouteResult::Routed(d) = r.route(ApiKind::Completions, &body, i) else {
            panic!("rejected");
        };
        let w = usize::from(d.target);
        per_worker[w] += 1;
        // Honest engines: 4.2 bytes per token. The bad one reports 8x the tokens.
        let honest = (d.prompt_bytes_est / 4.2).round() as u32;
        let prompt_tokens = if w == 3 { honest * 8 } else { honest };
        let u = Usage {
            prompt_tokens,
            completion_tokens: 1,
            cached_tokens: None,
        };
        let _ = r.on_usage(&d, &u, i);
        let _ = r.on_finish(&d, i);
    }
    assert!(per_worker.iter().all(|&n| n >= 30), "{per_worker:?}");
    let cpt = r.chars_per_token();
    assert!(
        (cpt - 4.2).abs() < 0.1,
        "chars per token {cpt}, picks {per_worker:?}"
    );
}
