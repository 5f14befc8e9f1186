//! Fleets and requests the router's tests share.

use super::{Decision, RouteResult};
use crate::config::Config;
use crate::rng::Rng;

pub(super) fn cfg(extra: &str) -> Config {
    let json = format!(
        r#"{{"workers":[
            {{"name":"d0","endpoint":"127.0.0.1:8001"}},
            {{"name":"d1","endpoint":"127.0.0.1:8002"}},
            {{"name":"d2","endpoint":"127.0.0.1:8003"}},
            {{"name":"d3","endpoint":"127.0.0.1:8004"}},
            {{"name":"p0","endpoint":"127.0.0.1:8101","role":"prefill"}},
            {{"name":"p1","endpoint":"127.0.0.1:8102","role":"prefill"}}
        ]{extra}}}"#
    );
    Config::from_json(json.as_bytes()).unwrap()
}

pub(super) fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 16}))
        .unwrap()
}

pub(super) fn routed(r: RouteResult) -> Decision {
    match r {
        RouteResult::Routed(d) => d,
        r => panic!("not routed: {r:?}"),
    }
}

pub(super) fn doc(seed: u64, bytes: usize) -> String {
    let mut r = Rng::new(seed);
    (0..bytes / 6)
        .map(|_| ["alpha ", "bravo ", "delta ", "gamma ", "kappa "][r.below(5)])
        .collect()
}
