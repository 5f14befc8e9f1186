//! Every kvroute plugin configuration the repository ships loads with `Config::from_json`,
//! the parser the filter runs at configure time: the Envoy bootstraps (envoy/, the compose
//! quickstart, whose one envoy.yaml serves both of its gateways, bench/envoy/) and the
//! Kubernetes manifests under deploy/ (Istio EnvoyFilter and WasmPlugin, Envoy Gateway
//! EnvoyExtensionPolicy; deploy/relay/ and deploy/workers/ carry none). A key the parser does not know, a value
//! of the wrong type or out of range fails here with the file and the parser's message.

use std::path::{Path, PathBuf};

use kvroute::config::Config;
use serde_json::Value;

const WASM_FILTER: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn yaml_files(dir: &Path, recursive: bool, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for p in paths {
        if p.is_dir() && recursive {
            yaml_files(&p, true, out);
        } else if p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(p);
        }
    }
}

/// The shipped files that hold Envoy or Kubernetes configuration.
fn shipped_files() -> Vec<PathBuf> {
    let r = root();
    let mut files = Vec::new();
    yaml_files(&r.join("envoy"), false, &mut files);
    files.push(r.join("examples/docker-compose/envoy.yaml"));
    yaml_files(&r.join("bench/envoy"), false, &mut files);
    yaml_files(&r.join("deploy"), true, &mut files);
    files
}

/// Every YAML document of a file, as JSON values.
fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(d)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
            serde_json::to_value(v).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// (where in the document, the plugin configuration as JSON text) for every kvroute
/// configuration in one document.
fn plugin_configs(doc: &Value) -> Vec<(String, String)> {
    let mut found = Vec::new();
    // Envoy's wasm HTTP filter, wherever it sits (bootstrap, EnvoyFilter patch).
    fn walk(v: &Value, at: &str, found: &mut Vec<(String, String)>) {
        match v {
            Value::Object(m) => {
                if m.get("@type").and_then(Value::as_str) == Some(WASM_FILTER) {
                    let value = &v["config"]["configuration"]["value"];
                    match value.as_str() {
                        Some(s) => {
                            found.push((format!("{at}.config.configuration.value"), s.to_string()))
                        }
                        None => found.push((
                            format!("{at}: no string configuration.value"),
                            String::new(),
                        )),
                    }
                }
                for (k, x) in m {
                    walk(x, &format!("{at}.{k}"), found);
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    walk(x, &format!("{at}[{i}]"), found);
                }
            }
            _ => {}
        }
    }
    walk(doc, "", &mut found);
    match doc["kind"].as_str() {
        // Istio hands pluginConfig to the filter as JSON.
        Some("WasmPlugin") => {
            found.push((
                "spec.pluginConfig".into(),
                doc["spec"]["pluginConfig"].to_string(),
            ));
        }
        // Envoy Gateway: one config per wasm extension.
        Some("EnvoyExtensionPolicy") => {
            for (i, w) in doc["spec"]["wasm"]
                .as_array()
                .into_iter()
                .flatten()
                .enumerate()
            {
                found.push((format!("spec.wasm[{i}].config"), w["config"].to_string()));
            }
        }
        _ => {}
    }
    found
}

fn load_all() -> (Vec<(String, usize)>, Vec<String>) {
    let r = root();
    let mut counts = Vec::new();
    let mut errors = Vec::new();
    for f in shipped_files() {
        let name = f.strip_prefix(&r).unwrap_or(&f).display().to_string();
        let mut n = 0;
        for doc in documents(&f) {
            for (at, json) in plugin_configs(&doc) {
                n += 1;
                if let Err(e) = Config::from_json(json.as_bytes()) {
                    errors.push(format!("{name} ({at}): {e}"));
                }
            }
        }
        counts.push((name, n));
    }
    (counts, errors)
}

#[test]
fn every_shipped_plugin_configuration_loads() {
    let (counts, errors) = load_all();
    assert!(
        errors.is_empty(),
        "shipped kvroute configurations the filter rejects:\n  {}",
        errors.join("\n  ")
    );
    let total: usize = counts.iter().map(|(_, n)| n).sum();
    // The files that must carry a kvroute configuration (a lost one would pass silently).
    for must in [
        "envoy/demo.yaml",
        "envoy/demo-precise.yaml",
        "examples/docker-compose/envoy.yaml",
        "bench/envoy/kvroute.yaml",
        "deploy/istio/wasmplugin.yaml",
        "deploy/istio/kvroute-envoyfilter.yaml",
        "deploy/envoy-gateway/extension-policy.yaml",
    ] {
        let n = counts
            .iter()
            .find(|(f, _)| f == must)
            .map_or(0, |(_, n)| *n);
        assert!(
            n >= 1,
            "{must}: no kvroute configuration found (files and counts: {counts:?})"
        );
    }
    assert!(total >= 6, "{counts:?}");
}

/// The configurations that ship precise mode and gateway replicas (the compose quickstart's
/// two gateways, the Kubernetes examples next to deploy/relay/relay.yaml) name the relay's
/// cluster and a tokenizer, and share decisions: losing either key would silently turn
/// precise mode off while everything else still loads.
#[test]
fn precise_mode_configurations_name_the_relay_and_a_tokenizer() {
    let r = root();
    for file in [
        "envoy/demo-precise.yaml",
        "examples/docker-compose/envoy.yaml",
        "deploy/istio/wasmplugin.yaml",
        "deploy/istio/kvroute-envoyfilter.yaml",
        "deploy/envoy-gateway/extension-policy.yaml",
    ] {
        let mut n = 0;
        for doc in documents(&r.join(file)) {
            for (at, json) in plugin_configs(&doc) {
                let cfg = Config::from_json(json.as_bytes())
                    .unwrap_or_else(|e| panic!("{file} ({at}): {e}"));
                assert!(
                    !cfg.relay.cluster.is_empty(),
                    "{file} ({at}): no relay.cluster"
                );
                assert!(
                    !cfg.tokenize.cluster.is_empty(),
                    "{file} ({at}): no tokenize.cluster"
                );
                assert!(
                    cfg.relay.share_decisions,
                    "{file} ({at}): relay.share_decisions off"
                );
                n += 1;
            }
        }
        assert!(n >= 1, "{file}: no kvroute configuration found");
    }
}

#[test]
fn a_key_the_parser_does_not_know_is_caught() {
    let f = root().join("envoy/demo.yaml");
    let docs = documents(&f);
    let (_, json) = plugin_configs(&docs[0])
        .into_iter()
        .next()
        .expect("demo.yaml has a kvroute configuration");
    let mut cfg: Value = serde_json::from_str(&json).expect("JSON");
    assert!(Config::from_json(json.as_bytes()).is_ok());
    cfg["worker_count"] = Value::from(4);
    let err = Config::from_json(cfg.to_string().as_bytes()).expect_err("unknown key accepted");
    assert!(err.to_string().contains("worker_count"), "{err}");
    cfg.as_object_mut().map(|m| m.remove("worker_count"));
    cfg["block_size"] = Value::from(0);
    assert!(
        Config::from_json(cfg.to_string().as_bytes()).is_err(),
        "block_size 0 accepted"
    );
}
