//! mock-bench: how many concurrent streams one mock worker sustains before the process, not
//! the simulated engine, becomes the bottleneck.
//!
//! For each stream count N it keeps N closed-loop users streaming (each sends a short prompt,
//! reads the stream to the end, sends the next), then over a measurement window compares the
//! worker's own pass counters (`mock:engine_passes_total`, `mock:engine_simulated_seconds_total`)
//! with wall time. keep-up = simulated / wall: 1.00 means every pass lasted what the model
//! says; below ~0.95 the process is the bottleneck. It also reports client-side token rate and
//! inter-token latency against the model's mean pass time, and (with `--pid`) the worker's
//! CPU use in cores and VmRSS.
//!
//! Run the worker and the client on different cores, e.g.
//!   taskset -c 0 mock-worker --port 8300 --speedup 10 --max-num-seqs 4096 &
//!   taskset -c 1 mock-bench --target 127.0.0.1:8300 --streams 250,500,1000 --pid $!

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

struct Args {
    target: SocketAddr,
    streams: Vec<usize>,
    max_tokens: usize,
    prompt_words: usize,
    warmup: Duration,
    window: Duration,
    pid: Option<u32>,
}

const HELP: &str = "\
mock-bench: closed-loop streaming load against one mock-worker

  --target HOST:PORT   worker address [default: 127.0.0.1:8300]
  --streams LIST       comma-separated concurrent stream counts [default: 100,250,500,1000]
  --max-tokens N       mean output tokens per request (spread over N/2..3N/2) [default: 100]
  --prompt-words N     words per prompt (about 1.2 tokens each) [default: 24]
  --warmup SECS        ramp time before measuring each step [default: 2]
  --window SECS        measurement window per step [default: 3]
  --pid PID            worker process id, to report its VmRSS
";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        target: "127.0.0.1:8300".parse().unwrap(),
        streams: vec![100, 250, 500, 1000],
        max_tokens: 100,
        prompt_words: 24,
        warmup: Duration::from_secs(2),
        window: Duration::from_secs(3),
        pid: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        if f == "-h" || f == "--help" {
            print!("{HELP}");
            std::process::exit(0);
        }
        let v = it.next().ok_or_else(|| format!("{f} needs a value"))?;
        let bad = |_| format!("{f}: bad value {v:?}");
        match f.as_str() {
            "--target" => a.target = v.parse().map_err(|_| format!("{f}: bad value {v:?}"))?,
            "--streams" => {
                a.streams = v
                    .split(',')
                    .map(|s| s.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| format!("{f}: bad list"))?
            }
            "--max-tokens" => a.max_tokens = v.parse().map_err(bad)?,
            "--prompt-words" => a.prompt_words = v.parse().map_err(bad)?,
            "--warmup" => {
                a.warmup =
                    Duration::from_secs_f64(v.parse().map_err(|_| format!("{f}: bad value"))?)
            }
            "--window" => {
                a.window =
                    Duration::from_secs_f64(v.parse().map_err(|_| format!("{f}: bad value"))?)
            }
            "--pid" => a.pid = Some(v.parse().map_err(bad)?),
            _ => return Err(format!("unknown flag {f}")),
        }
    }
    Ok(a)
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn get_text(c: &HttpClient, target: SocketAddr, path: &str) -> String {
    let req = Request::get(format!("http://{target}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let r = c.request(req).await.expect("worker unreachable");
    String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).into_owned()
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// CPU seconds (user + system) the process has used; clock ticks are 100/s on Linux.
fn cpu_secs(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / 100.0)
        })
        .unwrap_or(f64::NAN)
}

fn rss_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[derive(Default)]
struct Counters {
    tokens: AtomicU64,
    requests: AtomicU64,
    errors: AtomicU64,
}

/// One closed-loop user. Gaps between frames inside the window go to `gaps` (microseconds).
async fn user(
    c: HttpClient,
    a: Arc<ArgsLite>,
    id: usize,
    stop: Arc<AtomicBool>,
    measuring: Arc<AtomicBool>,
    k: Arc<Counters>,
    gaps: Arc<Mutex<Vec<u32>>>,
) {
    let mut local_gaps = Vec::new();
    let mut round = 0usize;
    while !stop.load(Ordering::Relaxed) {
        // Distinct prompts so the run is not one giant cache hit.
        let mut prompt = format!("user {id} round {round}:");
        for w in 0..a.prompt_words {
            prompt.push_str([" alpha", " beta", " gamma", " delta"][(w + id) % 4]);
        }
        // Lengths spread over [M/2, 3M/2) so users do not finish and restart in lockstep.
        let max_tokens = a.max_tokens / 2 + (id * 7919 + round * 31) % a.max_tokens.max(1);
        round += 1;
        let body = format!(r#"{{"prompt":"{prompt}","max_tokens":{max_tokens},"stream":true}}"#);
        let req = Request::post(format!("http://{}/v1/completions", a.target))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let Ok(resp) = c.request(req).await else {
            k.errors.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut body = resp.into_body();
        let mut last: Option<Instant> = None;
        while let Some(f) = body.frame().await {
            let Ok(f) = f else {
                k.errors.fetch_add(1, Ordering::Relaxed);
                break;
            };
            if let Ok(d) = f.into_data() {
                let n = d.windows(2).filter(|w| w == b"\n\n").count() as u64;
                let now = Instant::now();
                if measuring.load(Ordering::Relaxed) {
                    k.tokens.fetch_add(n, Ordering::Relaxed);
                    if let Some(l) = last {
                        local_gaps.push((now - l).as_micros().min(u32::MAX as u128) as u32);
                    }
                }
                last = Some(now);
            }
        }
        k.requests.fetch_add(1, Ordering::Relaxed);
    }
    gaps.lock().unwrap().extend(local_gaps);
}

struct ArgsLite {
    target: SocketAddr,
    max_tokens: usize,
    prompt_words: usize,
}

fn pct(v: &[u32], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p) as usize] as f64 / 1000.0
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("mock-bench: {e}");
            std::process::exit(2);
        }
    };
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.set_nodelay(true);
    let c: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(usize::MAX)
        .build(http);
    let lite = Arc::new(ArgsLite {
        target: a.target,
        max_tokens: a.max_tokens,
        prompt_words: a.prompt_words,
    });
    if let Some(pid) = a.pid {
        println!("worker VmRSS idle: {} kB", rss_kb(pid).unwrap_or(0));
    }
    println!(
        "{:>7} {:>7} {:>8} {:>8} {:>7} {:>7} {:>5} {:>9} {:>9} {:>7} {:>7} {:>6} {:>6} {:>8}",
        "streams",
        "running",
        "passes/s",
        "model_ms",
        "real_ms",
        "keep-up",
        "kv",
        "gen_tok/s",
        "recv_tok/s",
        "itl_p50",
        "itl_p99",
        "cpu",
        "errors",
        "rss_kB"
    );
    for &n in &a.streams {
        let stop = Arc::new(AtomicBool::new(false));
        let measuring = Arc::new(AtomicBool::new(false));
        let k = Arc::new(Counters::default());
        let gaps = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::with_capacity(n);
        for id in 0..n {
            tasks.push(tokio::spawn(user(
                c.clone(),
                lite.clone(),
                id,
                stop.clone(),
                measuring.clone(),
                k.clone(),
                gaps.clone(),
            )));
        }
        tokio::time::sleep(a.warmup).await;
        let m0 = get_text(&c, a.target, "/metrics").await;
        let c0 = a.pid.map_or(f64::NAN, cpu_secs);
        let t0 = Instant::now();
        measuring.store(true, Ordering::Relaxed);
        tokio::time::sleep(a.window / 2).await;
        let mid = get_text(&c, a.target, "/metrics").await;
        let rss = a.pid.and_then(rss_kb).unwrap_or(0);
        tokio::time::sleep(a.window / 2).await;
        measuring.store(false, Ordering::Relaxed);
        let m1 = get_text(&c, a.target, "/metrics").await;
        let dt = t0.elapsed().as_secs_f64();
        let cpu = (a.pid.map_or(f64::NAN, cpu_secs) - c0) / dt;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            let _ = t.await;
        }
        let passes =
            metric(&m1, "mock:engine_passes_total") - metric(&m0, "mock:engine_passes_total");
        let sim = metric(&m1, "mock:engine_simulated_seconds_total")
            - metric(&m0, "mock:engine_simulated_seconds_total");
        let gen = metric(&m1, "vllm:generation_tokens_total")
            - metric(&m0, "vllm:generation_tokens_total");
        let mut g = std::mem::take(&mut *gaps.lock().unwrap());
        g.sort_unstable();
        println!(
            "{:>7} {:>7} {:>8.0} {:>8.3} {:>7.3} {:>7.2} {:>5.2} {:>9.0} {:>9.0} {:>7.2} {:>7.2} {:>6.2} {:>6} {:>8}",
            n,
            metric(&mid, "vllm:num_requests_running"),
            passes / dt,
            sim / passes * 1000.0,
            dt / passes * 1000.0,
            sim / dt,
            metric(&mid, "vllm:kv_cache_usage_perc"),
            gen / dt,
            k.tokens.load(Ordering::Relaxed) as f64 / dt,
            pct(&g, 0.5),
            pct(&g, 0.99),
            cpu,
            k.errors.load(Ordering::Relaxed),
            rss
        );
        // Let the worker drain before the next step.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
