//! Summaries, and the closed-loop latency / saturation modes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};

use crate::text::{push_words, seed_of};
use crate::{client, Args};

/// Nearest-rank percentile of sorted data.
pub fn pct(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let k = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[k.clamp(1, sorted.len()) - 1])
}

fn dist(mut v: Vec<f64>, scale: f64) -> Value {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mean = if v.is_empty() {
        None
    } else {
        Some(v.iter().sum::<f64>() / v.len() as f64 * scale)
    };
    let p = |q| pct(&v, q).map(|x| x * scale);
    json!({"p50": p(50.0), "p90": p(90.0), "p95": p(95.0), "p99": p(99.0), "max": p(100.0), "mean": mean, "n": v.len()})
}

/// Time per output token after the first, per request: (e2e - ttft) / (output tokens - 1), as
/// `tpot` (wall seconds) and `tpot_sim` (simulated seconds, x `sim_speedup`); null for
/// failed requests and replies of fewer than two tokens.
pub fn tpot(r: &Value) -> Option<f64> {
    let (e2e, ttft, n) = (
        r["e2e"].as_f64()?,
        r["ttft"].as_f64()?,
        r["out_tokens"].as_u64()?,
    );
    (r["error"].is_null() && n >= 2).then(|| (e2e - ttft).max(0.0) / (n - 1) as f64)
}

pub fn add_tpot(records: &mut [Value], sim_speedup: f64) {
    for r in records.iter_mut() {
        let t = tpot(r);
        r["tpot"] = json!(t);
        r["tpot_sim"] = json!(t.map(|x| x * sim_speedup));
    }
}

pub fn summarize(a: &Args, records: &[Value], gaps: Vec<(usize, Vec<f32>)>) -> Value {
    let measured: Vec<&Value> = records
        .iter()
        .filter(|r| r["i"].as_u64().unwrap_or(0) as usize >= a.warmup)
        .collect();
    let ok: Vec<&Value> = measured
        .iter()
        .copied()
        .filter(|r| r["error"].is_null())
        .collect();
    let errors: Vec<&Value> = measured
        .iter()
        .copied()
        .filter(|r| !r["error"].is_null())
        .collect();
    let f = |r: &Value, k: &str| r[k].as_f64();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| f(r, "ttft")).collect();
    let e2e: Vec<f64> = ok.iter().filter_map(|r| f(r, "e2e")).collect();
    let tpot: Vec<f64> = ok.iter().filter_map(|r| tpot(r)).collect();
    // The mock engine's own timings (absent against a real engine or a non-mock worker).
    let engine_ttft: Vec<f64> = ok.iter().filter_map(|r| f(r, "engine_ttft")).collect();
    let engine_e2e: Vec<f64> = ok.iter().filter_map(|r| f(r, "engine_e2e")).collect();
    // Where the rest of the client's TTFT went, wall seconds (main.rs, `path_in`).
    let path_in: Vec<f64> = ok.iter().filter_map(|r| f(r, "path_in")).collect();
    let path_out: Vec<f64> = ok.iter().filter_map(|r| f(r, "path_out")).collect();
    let send_lag: Vec<f64> = ok.iter().filter_map(|r| f(r, "engine_send_lag")).collect();
    let itl: Vec<f64> = gaps
        .iter()
        .filter(|(i, _)| *i >= a.warmup)
        .flat_map(|(_, g)| g.iter().map(|&x| x as f64))
        .collect();
    let late: Vec<f64> = measured.iter().filter_map(|r| f(r, "late")).collect();
    let t_first = measured
        .iter()
        .filter_map(|r| f(r, "t"))
        .fold(f64::INFINITY, f64::min);
    let t_last = measured
        .iter()
        .filter_map(|r| Some(f(r, "t")? + f(r, "e2e")?))
        .fold(f64::NEG_INFINITY, f64::max);
    let duration = (t_last - t_first).max(1e-9);
    let due_min = measured
        .iter()
        .filter_map(|r| f(r, "due"))
        .fold(f64::INFINITY, f64::min);
    let due_max = measured
        .iter()
        .filter_map(|r| f(r, "due"))
        .fold(f64::NEG_INFINITY, f64::max);
    let offered = if due_max > due_min {
        measured.len() as f64 / (due_max - due_min)
    } else {
        0.0
    };
    let sum = |rs: &[&Value], k: &str| rs.iter().filter_map(|r| r[k].as_u64()).sum::<u64>();
    let prompt = sum(&ok, "prompt_tokens");
    let cached = sum(&ok, "cached_tokens");
    let out_tokens = sum(&ok, "out_tokens");
    let mut per: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    for r in &ok {
        let w = r["worker"].as_str().unwrap_or("").to_string();
        let e = per
            .entry(if w.is_empty() { "?".into() } else { w })
            .or_default();
        e.0 += 1;
        e.1 += r["prompt_tokens"].as_u64().unwrap_or(0);
        e.2 += r["cached_tokens"].as_u64().unwrap_or(0);
    }
    let n_workers = if a.fleet_size > 0 {
        a.fleet_size.max(per.len())
    } else {
        per.len()
    };
    let max_req = per.values().map(|e| e.0).max().unwrap_or(0) as f64;
    let mean_req = if n_workers > 0 {
        ok.len() as f64 / n_workers as f64
    } else {
        0.0
    };
    let per_worker: serde_json::Map<String, Value> = per
        .iter()
        .map(|(k, e)| {
            (
                k.clone(),
                json!({"requests": e.0, "prompt_tokens": e.1, "cached_tokens": e.2,
                       "hit_rate": if e.1 > 0 { e.2 as f64 / e.1 as f64 } else { 0.0 }}),
            )
        })
        .collect();
    let mut sample_errors: Vec<String> = errors
        .iter()
        .filter_map(|r| r["error"].as_str().map(String::from))
        .collect();
    sample_errors.sort();
    sample_errors.dedup();
    sample_errors.truncate(5);
    // Infinite-cache reuse ceiling (records carry it when --ceiling-block > 0): after the
    // warm-up, like hit_rate, and over the whole run, like the engines' own counters.
    let all: Vec<&Value> = records.iter().collect();
    let ceiling = |rs: &[&Value]| {
        let p = sum(rs, "ideal_prompt_tokens");
        (p > 0).then(|| sum(rs, "ideal_cached_tokens") as f64 / p as f64)
    };
    let s = a.sim_speedup;
    json!({
        "label": a.label,
        "workload": a.workload,
        "mode": if a.oracle_workers.is_empty() { "target" } else { "oracle" },
        "speed": a.speed,
        "sim_speedup": s,
        "requests": measured.len(),
        "warmup_excluded": records.len() - measured.len(),
        "ok": ok.len(),
        "errors": errors.len(),
        "error_samples": sample_errors,
        "duration_s": duration,
        "offered_rps": offered,
        "throughput_rps": ok.len() as f64 / duration,
        "output_tps": out_tokens as f64 / duration,
        "offered_rps_sim": offered / s,
        "throughput_rps_sim": ok.len() as f64 / duration / s,
        "ttft_s": dist(ttft.clone(), 1.0),
        "ttft_sim_s": dist(ttft, s),
        "itl_s": dist(itl.clone(), 1.0),
        "itl_sim_s": dist(itl, s),
        "tpot_s": dist(tpot.clone(), 1.0),
        "tpot_sim_s": dist(tpot, s),
        "e2e_s": dist(e2e.clone(), 1.0),
        "e2e_sim_s": dist(e2e, s),
        "late_s": dist(late, 1.0),
        "engine_ttft_sim_s": dist(engine_ttft, s),
        "engine_e2e_sim_s": dist(engine_e2e, s),
        "path_in_s": dist(path_in, 1.0),
        "path_out_s": dist(path_out, 1.0),
        "engine_send_lag_s": dist(send_lag, 1.0),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": out_tokens,
        "hit_rate": if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 },
        "reuse_ceiling": ceiling(&measured),
        "reuse_ceiling_all": ceiling(&all),
        "fleet_size": n_workers,
        "per_worker": per_worker,
        "max_over_mean_requests": if mean_req > 0.0 { max_req / mean_req } else { 0.0 },
        // Requests a prefill pool computed and handed to their decode worker.
        "handed_off": ok.iter().filter(|r| r["prefill_worker"].is_string()).count(),
    })
}

pub fn one_line(s: &Value) -> String {
    let g = |p: &str, k: &str| s[p][k].as_f64().unwrap_or(f64::NAN);
    format!(
        "{} ok {}/{} | offered {:.2} rps, done {:.2} rps | TTFT sim p50 {:.3} p90 {:.3} s | hit {:.3} | max/mean {:.2}",
        s["label"].as_str().unwrap_or(""),
        s["ok"],
        s["requests"],
        s["offered_rps"].as_f64().unwrap_or(0.0),
        s["throughput_rps"].as_f64().unwrap_or(0.0),
        g("ttft_sim_s", "p50"),
        g("ttft_sim_s", "p90"),
        s["hit_rate"].as_f64().unwrap_or(0.0),
        s["max_over_mean_requests"].as_f64().unwrap_or(0.0),
    )
}

/// The prompts of a latency measurement (`--prompts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptKind {
    /// One prompt, repeated: everything cached after the first request.
    Same,
    /// One document with a new question each request: the chat / RAG case, a long cached
    /// prefix and a new tail.
    Warm,
    /// A new prompt each request: every block is new to a cache-aware router's index.
    Cold,
}

impl PromptKind {
    pub fn parse(s: &str) -> Option<PromptKind> {
        match s {
            "same" => Some(PromptKind::Same),
            "warm" => Some(PromptKind::Warm),
            "cold" => Some(PromptKind::Cold),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            PromptKind::Same => "same",
            PromptKind::Warm => "warm",
            PromptKind::Cold => "cold",
        }
    }
}

/// The body of closed-loop request `i` (every target gets the same `i` in turn).
fn latency_body(model: &str, seed: u64, n: usize, kind: PromptKind, i: usize) -> Bytes {
    let mut prompt = String::with_capacity(n * 5 + 24);
    match kind {
        PromptKind::Cold => {
            push_words(&mut prompt, seed_of(&[seed, 0xc01d, n as u64, i as u64]), n)
        }
        PromptKind::Same | PromptKind::Warm => {
            push_words(&mut prompt, seed_of(&[seed, 0x1a7, n as u64]), n)
        }
    }
    if kind == PromptKind::Warm {
        prompt.push_str(&format!(" question {i}"));
    }
    let mut b = json!({"prompt": prompt, "max_tokens": 1});
    if !model.is_empty() {
        b["model"] = json!(model);
    }
    Bytes::from(serde_json::to_vec(&b).unwrap())
}

/// `--mode latency`: for each prompt size (and each `--prompts` kind), closed-loop non-streaming requests with
/// `max_tokens` 1. Several comma-separated `--target`s are measured interleaved (request i goes
/// to target i mod n), so drift in machine load hits every target alike. `--mode saturate`:
/// the same for `--duration-s` with more clients, one target after the other.
pub async fn closed_loop(a: &Args) -> i32 {
    let Some(target) = a.target.clone() else {
        eprintln!("loadgen: --target is required in this mode");
        return 2;
    };
    let targets: Vec<String> = target
        .split(',')
        .map(|t| t.trim_end_matches('/').to_string())
        .collect();
    let saturate = a.mode == "saturate";
    let conc = if a.concurrency > 0 {
        a.concurrency
    } else if saturate {
        32
    } else {
        1
    };
    let c = client::new_client();
    let mut results = Vec::new();
    let groups: Vec<Vec<String>> = if saturate {
        targets.iter().map(|t| vec![t.clone()]).collect()
    } else {
        vec![targets.clone()]
    };
    let kinds = if saturate {
        vec![PromptKind::Same]
    } else {
        a.prompts.clone()
    };
    let cells: Vec<(usize, PromptKind)> = a
        .prompt_tokens
        .iter()
        .flat_map(|&n| kinds.iter().map(move |&k| (n, k)))
        .collect();
    for (n, kind) in cells {
        let body = latency_body(&a.model, a.seed, n, PromptKind::Same, 0);
        for group in &groups {
            let urls: Arc<Vec<String>> = Arc::new(
                group
                    .iter()
                    .map(|t| format!("{t}/v1/completions"))
                    .collect(),
            );
            let nt = urls.len();
            // Warm up connections and caches.
            for u in urls.iter() {
                for _ in 0..conc.max(5) {
                    let _ = client::send(
                        &c,
                        u,
                        body.clone(),
                        &[],
                        Instant::now(),
                        false,
                        a.timeout,
                        None,
                    )
                    .await;
                }
            }
            let lat: Arc<Mutex<Vec<Vec<f64>>>> = Arc::new(Mutex::new(vec![Vec::new(); nt]));
            let errors = Arc::new(AtomicUsize::new(0));
            let issued = Arc::new(AtomicUsize::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let total = if saturate {
                usize::MAX
            } else {
                a.requests * nt
            };
            let t0 = Instant::now();
            let mut hs = Vec::new();
            for _ in 0..conc {
                let (c, urls, body, lat, errors, issued, stop) = (
                    c.clone(),
                    urls.clone(),
                    body.clone(),
                    lat.clone(),
                    errors.clone(),
                    issued.clone(),
                    stop.clone(),
                );
                let timeout = a.timeout;
                let (model, seed) = (a.model.clone(), a.seed);
                hs.push(tokio::spawn(async move {
                    let mut mine = vec![Vec::new(); urls.len()];
                    while !stop.load(Ordering::Relaxed) {
                        let k = issued.fetch_add(1, Ordering::Relaxed);
                        if k >= total {
                            break;
                        }
                        let j = k % urls.len();
                        // Request k goes to target k mod n with prompt k / n: every target
                        // sees the same prompts in the same order.
                        let b = match kind {
                            PromptKind::Same => body.clone(),
                            _ => latency_body(&model, seed, n, kind, k / urls.len()),
                        };
                        let t = Instant::now();
                        let o = client::send(&c, &urls[j], b, &[], t, false, timeout, None).await;
                        if o.error.is_some() {
                            errors.fetch_add(1, Ordering::Relaxed);
                        } else {
                            mine[j].push(t.elapsed().as_secs_f64() * 1000.0);
                        }
                    }
                    let mut l = lat.lock().unwrap();
                    for (j, m) in mine.into_iter().enumerate() {
                        l[j].extend(m);
                    }
                }));
            }
            if saturate {
                tokio::time::sleep(Duration::from_secs_f64(a.duration_s)).await;
                stop.store(true, Ordering::Relaxed);
            }
            for h in hs {
                let _ = h.await;
            }
            let wall = t0.elapsed().as_secs_f64();
            let all = std::mem::take(&mut *lat.lock().unwrap());
            for (j, mut v) in all.into_iter().enumerate() {
                v.sort_by(|x, y| x.partial_cmp(y).unwrap());
                let r = json!({
                    "target": group[j],
                    "prompt_tokens": n,
                    "prompt_kind": kind.name(),
                    "body_bytes": body.len(),
                    "concurrency": conc,
                    "requests": v.len(),
                    "errors": errors.load(Ordering::Relaxed),
                    "rps": v.len() as f64 / wall,
                    "p50_ms": pct(&v, 50.0),
                    "p90_ms": pct(&v, 90.0),
                    "p99_ms": pct(&v, 99.0),
                    "mean_ms": if v.is_empty() { None } else { Some(v.iter().sum::<f64>() / v.len() as f64) },
                });
                eprintln!("loadgen {}: {r}", a.mode);
                results.push(r);
            }
        }
    }
    let out = json!({"label": a.label, "mode": a.mode, "targets": targets, "results": results});
    if let Some(dir) = &a.out {
        let _ = std::fs::create_dir_all(dir);
        if let Err(e) = std::fs::write(
            format!("{dir}/summary.json"),
            serde_json::to_string_pretty(&out).unwrap(),
        ) {
            eprintln!("loadgen: {e}");
            return 1;
        }
    } else {
        println!("{}", serde_json::to_string_pretty(&out).unwrap());
    }
    0
}

#[cfg(test)]
mod tpot_tests {
    use super::*;

    #[test]
    fn tpot_is_the_decode_time_per_token_after_the_first() {
        let mut rs = vec![
            json!({"e2e": 1.0, "ttft": 0.2, "out_tokens": 5, "error": null}),
            json!({"e2e": 1.0, "ttft": 0.2, "out_tokens": 1, "error": null}),
            json!({"e2e": 1.0, "ttft": 0.2, "out_tokens": 5, "error": "boom"}),
            json!({"e2e": null, "ttft": null, "out_tokens": 0, "error": null}),
        ];
        add_tpot(&mut rs, 4.0);
        assert!((rs[0]["tpot"].as_f64().unwrap() - 0.2).abs() < 1e-9);
        assert!((rs[0]["tpot_sim"].as_f64().unwrap() - 0.8).abs() < 1e-9);
        for r in &rs[1..] {
            assert!(r["tpot"].is_null() && r["tpot_sim"].is_null());
        }
    }
}

#[cfg(test)]
mod latency_prompt_tests {
    use super::*;

    fn prompt(kind: PromptKind, i: usize) -> String {
        let v: Value = serde_json::from_slice(&latency_body("m", 1, 1000, kind, i)).unwrap();
        v["prompt"].as_str().unwrap().to_string()
    }

    #[test]
    fn same_repeats_warm_shares_the_document_cold_is_new_each_time() {
        assert_eq!(prompt(PromptKind::Same, 0), prompt(PromptKind::Same, 7));
        let (w0, w1) = (prompt(PromptKind::Warm, 0), prompt(PromptKind::Warm, 1));
        assert_ne!(w0, w1);
        let doc = prompt(PromptKind::Same, 0);
        assert!(w0.starts_with(&doc) && w1.starts_with(&doc));
        assert_eq!(w1.len() - doc.len(), " question 1".len());
        let (c0, c1) = (prompt(PromptKind::Cold, 0), prompt(PromptKind::Cold, 1));
        assert_ne!(c0, c1);
        // A new prompt from its first word: nothing for a prefix cache to reuse.
        assert_ne!(c0.split(' ').nth(1), c1.split(' ').nth(1));
        assert_eq!(prompt(PromptKind::Cold, 3), prompt(PromptKind::Cold, 3));
        assert_eq!(PromptKind::parse("warm"), Some(PromptKind::Warm));
        assert_eq!(PromptKind::parse("hot"), None);
    }
}
