//! loadgen: an OpenAI streaming load generator for kvroute benchmarks.
//!
//! Modes:
//! - `run` (default): replay a Mooncake trace or a synthetic workload against `--target`, or,
//!   with `--oracle-workers`, route every request itself by probing each worker's cache.
//! - `latency`: closed-loop non-streaming requests of fixed prompt sizes (proxy overhead).
//! - `saturate`: closed-loop small requests for a fixed time (requests per second).
//!
//! Writes `summary.json` and `requests.jsonl` to `--out`.

mod ceiling;
mod client;
mod stats;
mod text;
mod workload;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};

use client::{HttpClient, Outcome};
use workload::{Api, Mooncake, Synthetic};

const HELP: &str = "\
loadgen: OpenAI streaming load generator (Mooncake trace replay, synthetic chats, oracle)

usage: loadgen [--mode run|latency|saturate] [flags]

target (one of):
  --target URL              router or worker base URL, e.g. http://127.0.0.1:10000
  --oracle-workers URLS     comma-separated worker base URLs: probe /v1/cache/probe on every
                            worker before each request and send to the cheapest (oracle)
  --oracle-prefill-scale F  oracle cost per token of pending prefill (requests sent to the
                            worker and not at their first token yet, plus this request's
                            uncached tokens from the probe) [1.0]
  --oracle-held-weight F    oracle cost per token of KV held by in-flight requests
                            (prompt + max_tokens, plus this request's uncached tokens) [1.0]
  --oracle-block-size N     tokens per block in the cost (scale only) [16]

run mode:
  --workload mooncake|synthetic   [mooncake]
  --speed F                 arrival speed factor: trace time / F (synthetic: rate x F,
                            think time / F) [1]
  --max-output N            cap max_tokens (0 = none) [0]
  --seed N                  text and sampling seed [1]
  --corpus-seed N           synthetic: seed of the system prompts and documents only [--seed]
                            (a second client on the same corpus with its own sessions)
  --api completions|chat    [completions for mooncake, chat for synthetic]
  --model NAME              model field (omitted when empty) []
  --adapters N              each conversation (synthetic: session; mooncake: --session-block
                            hash) names one of N LoRA adapters, `adapter-0` .. `adapter-N-1`,
                            as its model, drawn with Zipf popularity (--adapter-zipf) [0: off]
  --adapter-zipf S          Zipf exponent of adapter popularity [1.0]
  --timeout-s F             per-request timeout [600]
  --warmup N                leave the first N requests out of the summary [0]
  --sim-speedup F           the fleet's --speedup: summary also reports simulated seconds [1]
  --label NAME              name stored in the summary []
  --out DIR                 write summary.json and requests.jsonl there
  --threads N               tokio worker threads [1]
  --stream-usage on|off     ask for usage in the stream's last chunk
                            (stream_options.include_usage), as this harness needs for
                            prompt and cached tokens; off sends streams as most clients do [on]
  --fleet-size N            workers in the fleet (for max/mean requests per worker) [seen]
  --ceiling-block N         after the run, the infinite-cache reuse ceiling: tokenize every
                            prompt sent as the mock worker does, hash N-token blocks (chained,
                            like the worker's prefix cache) and count the share of prompt
                            tokens some earlier request already had (0 = skip) [16]
 mooncake:
  --trace PATH              JSONL trace (timestamp, input_length, output_length, hash_ids)
  --start N / --count N     slice of the trace [0 / all]
  --block-tokens N          tokens per trace block (512 in the trace; smaller scales prompts
                            down so a replay fits a small fleet) [512]
  --max-input-tokens N      truncate longer prompts (after scaling; 0 = none) [0]
  --session-block K         x-session-id = hash_ids[K] (K=1: the block after the shared
                            system prompt) [1]
  --burst AT:LEN:F          a burst: the part of the slice's trace time from AT to AT+LEN
                            (fractions of its span, 0-1) arrives F x faster on top of
                            --speed, the rest as recorded; requests.jsonl gives each
                            request's phase (before, burst, after) [none]
 synthetic:
  --sessions N              conversations [200]
  --rate R                  new conversations per second (Poisson) [4]
  --turns A-B               turns per conversation, uniform [1-6]
  --think-ms MS             pause between a reply and the next turn [500]
  --system-prompts K        shared system prompts, Zipf popularity [20]
  --zipf S                  Zipf exponent for system prompts and documents [1.1]
  --system-tokens N         [1000]
  --user-tokens N           tokens per user turn [100]
  --tool-tokens A-B         agentic sessions: every user turn after the first also carries
                            tool output of A-B tokens (uniform), so the context grows by it
                            plus the reply each turn [none]
  --docs D                  long documents [10]
  --doc-tokens N            [8000]
  --doc-fraction F          share of conversations that are questions on a document [0.3]
  --max-tokens N            output tokens per turn [64]

latency / saturate modes (--target may list several URLs, comma-separated; latency mode
interleaves them request by request):
  --prompt-tokens LIST      prompt sizes, e.g. 1000,8000,32000,128000 [1000]
  --requests N              requests per size (latency) [200]
  --prompts LIST            latency: same (one prompt repeated), warm (one document, a new
                            question each request), cold (a new prompt each request);
                            comma-separated, each measured in turn [same]
  --concurrency N           closed-loop clients [1 latency, 32 saturate]
  --duration-s F            saturate: seconds per size [5]
";

pub struct Args {
    pub mode: String,
    pub target: Option<String>,
    pub oracle_workers: Vec<String>,
    pub oracle_prefill_scale: f64,
    pub oracle_block_size: f64,
    pub oracle_held_weight: f64,
    pub workload: String,
    pub speed: f64,
    pub max_output: u64,
    pub seed: u64,
    pub corpus_seed: Option<u64>,
    pub api: Option<Api>,
    pub model: String,
    pub adapters: usize,
    pub adapter_zipf: f64,
    pub timeout: Duration,
    pub warmup: usize,
    pub sim_speedup: f64,
    pub label: String,
    pub out: Option<String>,
    pub threads: usize,
    pub stream_usage: bool,
    pub trace: Option<String>,
    pub start: usize,
    pub count: usize,
    pub block_tokens: usize,
    pub max_input_tokens: usize,
    pub session_block: usize,
    pub burst: Option<workload::Burst>,
    pub sessions: usize,
    pub rate: f64,
    pub turns: (usize, usize),
    pub think_ms: f64,
    pub system_prompts: usize,
    pub zipf: f64,
    pub system_tokens: usize,
    pub user_tokens: usize,
    pub tool_tokens: Option<(usize, usize)>,
    pub ceiling_block: usize,
    pub docs: usize,
    pub doc_tokens: usize,
    pub doc_fraction: f64,
    pub max_tokens: u64,
    pub prompt_tokens: Vec<usize>,
    pub prompts: Vec<stats::PromptKind>,
    pub requests: usize,
    pub concurrency: usize,
    pub duration_s: f64,
    pub fleet_size: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        mode: "run".into(),
        target: None,
        oracle_workers: Vec::new(),
        oracle_prefill_scale: 1.0,
        oracle_block_size: 16.0,
        oracle_held_weight: 1.0,
        workload: "mooncake".into(),
        speed: 1.0,
        max_output: 0,
        seed: 1,
        corpus_seed: None,
        api: None,
        model: String::new(),
        adapters: 0,
        adapter_zipf: 1.0,
        timeout: Duration::from_secs(600),
        warmup: 0,
        sim_speedup: 1.0,
        label: String::new(),
        out: None,
        threads: 1,
        stream_usage: true,
        trace: None,
        start: 0,
        count: usize::MAX,
        block_tokens: 512,
        max_input_tokens: 0,
        session_block: 1,
        burst: None,
        sessions: 200,
        rate: 4.0,
        turns: (1, 6),
        think_ms: 500.0,
        system_prompts: 20,
        zipf: 1.1,
        system_tokens: 1000,
        user_tokens: 100,
        tool_tokens: None,
        ceiling_block: 16,
        docs: 10,
        doc_tokens: 8000,
        doc_fraction: 0.3,
        max_tokens: 64,
        prompt_tokens: vec![1000],
        prompts: vec![stats::PromptKind::Same],
        requests: 200,
        concurrency: 0,
        duration_s: 5.0,
        fleet_size: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        if f == "-h" || f == "--help" {
            print!("{HELP}");
            std::process::exit(0);
        }
        let v = it.next().ok_or_else(|| format!("{f} needs a value"))?;
        macro_rules! num {
            () => {
                v.parse().map_err(|_| format!("{f}: bad value {v:?}"))?
            };
        }
        match f.as_str() {
            "--mode" => a.mode = v,
            "--target" => a.target = Some(v.trim_end_matches('/').to_string()),
            "--oracle-workers" => {
                a.oracle_workers = v
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.trim_end_matches('/').to_string())
                    .collect()
            }
            "--oracle-prefill-scale" => a.oracle_prefill_scale = num!(),
            "--oracle-block-size" => a.oracle_block_size = num!(),
            "--oracle-held-weight" => a.oracle_held_weight = num!(),
            "--workload" => a.workload = v,
            "--speed" => a.speed = num!(),
            "--max-output" => a.max_output = num!(),
            "--seed" => a.seed = num!(),
            "--corpus-seed" => a.corpus_seed = Some(num!()),
            "--adapters" => a.adapters = num!(),
            "--adapter-zipf" => a.adapter_zipf = num!(),
            "--api" => {
                a.api = Some(match v.as_str() {
                    "completions" => Api::Completions,
                    "chat" => Api::Chat,
                    _ => return Err(format!("--api: {v:?} is not completions or chat")),
                })
            }
            "--model" => a.model = v,
            "--timeout-s" => a.timeout = Duration::from_secs_f64(num!()),
            "--warmup" => a.warmup = num!(),
            "--sim-speedup" => a.sim_speedup = num!(),
            "--label" => a.label = v,
            "--out" => a.out = Some(v),
            "--threads" => a.threads = num!(),
            "--stream-usage" => {
                a.stream_usage = match v.as_str() {
                    "on" => true,
                    "off" => false,
                    _ => return Err(format!("--stream-usage: on or off, not {v:?}")),
                }
            }
            "--trace" => a.trace = Some(v),
            "--start" => a.start = num!(),
            "--count" => a.count = num!(),
            "--block-tokens" => a.block_tokens = num!(),
            "--max-input-tokens" => a.max_input_tokens = num!(),
            "--session-block" => a.session_block = num!(),
            "--burst" => {
                a.burst = Some(workload::Burst::parse(&v).map_err(|e| format!("{f}: {e}"))?)
            }
            "--sessions" => a.sessions = num!(),
            "--rate" => a.rate = num!(),
            "--turns" => {
                let (x, y) = v.split_once('-').unwrap_or((&v, &v));
                a.turns = (
                    x.parse().map_err(|_| format!("{f}: bad value"))?,
                    y.parse().map_err(|_| format!("{f}: bad value"))?,
                );
                if a.turns.0 == 0 || a.turns.1 < a.turns.0 {
                    return Err(format!("{f}: want A-B with 1 <= A <= B"));
                }
            }
            "--think-ms" => a.think_ms = num!(),
            "--system-prompts" => a.system_prompts = num!(),
            "--zipf" => a.zipf = num!(),
            "--system-tokens" => a.system_tokens = num!(),
            "--user-tokens" => a.user_tokens = num!(),
            "--tool-tokens" => {
                let (x, y) = v.split_once('-').unwrap_or((&v, &v));
                let r: (usize, usize) = (
                    x.parse().map_err(|_| format!("{f}: bad value"))?,
                    y.parse().map_err(|_| format!("{f}: bad value"))?,
                );
                if r.1 < r.0 {
                    return Err(format!("{f}: want A-B with A <= B"));
                }
                a.tool_tokens = Some(r);
            }
            "--ceiling-block" => a.ceiling_block = num!(),
            "--docs" => a.docs = num!(),
            "--doc-tokens" => a.doc_tokens = num!(),
            "--doc-fraction" => a.doc_fraction = num!(),
            "--max-tokens" => a.max_tokens = num!(),
            "--prompt-tokens" => {
                a.prompt_tokens = v
                    .split(',')
                    .map(|s| s.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| format!("{f}: bad list"))?
            }
            "--prompts" => {
                a.prompts = v
                    .split(',')
                    .map(|s| stats::PromptKind::parse(s.trim()))
                    .collect::<Option<_>>()
                    .ok_or_else(|| format!("{f}: same, warm or cold"))?
            }
            "--requests" => a.requests = num!(),
            "--concurrency" => a.concurrency = num!(),
            "--duration-s" => a.duration_s = num!(),
            "--fleet-size" => a.fleet_size = num!(),
            _ => return Err(format!("unknown flag {f} (see --help)")),
        }
    }
    if a.target.is_none() && a.oracle_workers.is_empty() {
        return Err("need --target or --oracle-workers".into());
    }
    if a.speed.is_nan() || a.speed <= 0.0 || a.sim_speedup.is_nan() || a.sim_speedup <= 0.0 {
        return Err("--speed and --sim-speedup must be > 0".into());
    }
    if a.block_tokens == 0 {
        return Err("--block-tokens must be >= 1".into());
    }
    Ok(a)
}

/// The oracle: per-worker load it tracks itself, plus true cache overlap from probes.
pub struct Oracle {
    workers: Vec<String>,
    prefill_scale: f64,
    held_weight: f64,
    block: f64,
    state: Mutex<OracleState>,
}

struct OracleState {
    /// Uncached prompt tokens of requests sent and not yet at their first token.
    prefill: Vec<f64>,
    /// Prompt + max output tokens of requests in flight (the KV they hold or will).
    held: Vec<f64>,
    inflight: Vec<u32>,
    rng: u64,
}

pub struct Pick {
    pub worker: usize,
    pub uncached: f64,
    pub held: f64,
    pub cached: u64,
}

impl Oracle {
    fn new(
        workers: Vec<String>,
        prefill_scale: f64,
        held_weight: f64,
        block: f64,
        seed: u64,
    ) -> Self {
        let n = workers.len();
        Oracle {
            workers,
            prefill_scale,
            held_weight,
            block,
            state: Mutex::new(OracleState {
                prefill: vec![0.0; n],
                held: vec![0.0; n],
                inflight: vec![0; n],
                rng: seed,
            }),
        }
    }

    /// Probes every worker, picks the lowest cost and books the request there (at pick time,
    /// so a burst does not herd onto one worker).
    async fn pick(&self, c: &HttpClient, body: &Bytes, max_tokens: u64) -> Result<Pick, String> {
        let mut hs = Vec::with_capacity(self.workers.len());
        for w in &self.workers {
            let (c, w, b) = (c.clone(), w.clone(), body.clone());
            hs.push(tokio::spawn(async move { client::probe(&c, &w, b).await }));
        }
        let mut probes = Vec::with_capacity(hs.len());
        for h in hs {
            probes.push(h.await.map_err(|e| e.to_string())?);
        }
        let mut st = self.state.lock().unwrap();
        let mut best: Option<(f64, u32, u64, usize)> = None;
        for (i, p) in probes.iter().enumerate() {
            let Ok((prompt, cached)) = p else { continue };
            let uncached = prompt.saturating_sub(*cached) as f64;
            let cost = (self.prefill_scale * (st.prefill[i] + uncached)
                + self.held_weight * (st.held[i] + uncached))
                / self.block;
            let tie = text::splitmix(&mut st.rng);
            let key = (cost, st.inflight[i], tie, i);
            if best.is_none_or(|b| (key.0, key.1, key.2) < (b.0, b.1, b.2)) {
                best = Some(key);
            }
        }
        let Some((_, _, _, w)) = best else {
            return Err(format!(
                "every probe failed: {:?}",
                probes[0].as_ref().err()
            ));
        };
        let (prompt, cached) = *probes[w].as_ref().unwrap();
        let uncached = prompt.saturating_sub(cached) as f64;
        let held = (prompt + max_tokens) as f64;
        st.prefill[w] += uncached;
        st.held[w] += held;
        st.inflight[w] += 1;
        Ok(Pick {
            worker: w,
            uncached,
            held,
            cached,
        })
    }

    fn first_token(&self, p: &Pick) {
        let mut st = self.state.lock().unwrap();
        st.prefill[p.worker] = (st.prefill[p.worker] - p.uncached).max(0.0);
    }

    fn done(&self, p: &Pick, prefill_released: bool) {
        let mut st = self.state.lock().unwrap();
        if !prefill_released {
            st.prefill[p.worker] = (st.prefill[p.worker] - p.uncached).max(0.0);
        }
        st.held[p.worker] = (st.held[p.worker] - p.held).max(0.0);
        st.inflight[p.worker] = st.inflight[p.worker].saturating_sub(1);
    }
}

/// Shared by every request task.
pub struct Ctx {
    pub client: HttpClient,
    pub target: Option<String>,
    pub oracle: Option<Oracle>,
    pub timeout: Duration,
    pub start: Instant,
    pub records: Mutex<Vec<Value>>,
    /// Inter-token gaps per request index.
    pub gaps: Mutex<Vec<(usize, Vec<f32>)>>,
    /// Every body sent (dispatch time, request index), for the reuse ceiling after the run.
    pub sent: Mutex<Vec<(f64, usize, Bytes)>>,
    /// Ask for usage in streams (`--stream-usage`).
    pub stream_usage: bool,
}

/// One request as the workloads describe it.
pub struct Job {
    pub idx: usize,
    pub session: String,
    pub path: &'static str,
    pub body: Value,
    pub max_tokens: u64,
    /// Seconds after start the request was due.
    pub due: f64,
    pub keep_text: bool,
    pub extra: Value,
}

/// Sends one request (via the oracle if configured), records it, returns the outcome.
pub async fn dispatch(ctx: &Arc<Ctx>, mut job: Job) -> Outcome {
    if !ctx.stream_usage {
        if let Some(o) = job.body.as_object_mut() {
            o.remove("stream_options");
        }
    }
    let t0 = Instant::now();
    let t_dispatch = t0.duration_since(ctx.start).as_secs_f64();
    let body = Bytes::from(serde_json::to_vec(&job.body).expect("json"));
    ctx.sent
        .lock()
        .unwrap()
        .push((t_dispatch, job.idx, body.clone()));
    let headers = [("x-session-id", job.session.clone())];
    let mut oracle_cached = None;
    let mut probe_s = None;
    let o = if let Some(or) = &ctx.oracle {
        match or.pick(&ctx.client, &body, job.max_tokens).await {
            Err(e) => Outcome {
                error: Some(e),
                e2e: t0.elapsed().as_secs_f64(),
                ..Default::default()
            },
            Ok(p) => {
                oracle_cached = Some(p.cached);
                // The request leaves now: its TTFT starts after the probes, which are the
                // oracle's bookkeeping, not part of serving it.
                probe_s = Some(t0.elapsed().as_secs_f64());
                let t_send = Instant::now();
                let p = Arc::new(p);
                let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let (ctx2, p2, r2) = (ctx.clone(), p.clone(), released.clone());
                let on_first: client::FirstToken = Box::new(move || {
                    if let Some(or) = &ctx2.oracle {
                        or.first_token(&p2);
                        r2.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                });
                let url = format!("{}{}", or.workers[p.worker], job.path);
                let o = client::send(
                    &ctx.client,
                    &url,
                    body,
                    &headers,
                    t_send,
                    job.keep_text,
                    ctx.timeout,
                    Some(on_first),
                )
                .await;
                or.done(&p, released.load(std::sync::atomic::Ordering::Relaxed));
                o
            }
        }
    } else {
        let url = format!("{}{}", ctx.target.as_deref().unwrap_or(""), job.path);
        client::send(
            &ctx.client,
            &url,
            body,
            &headers,
            t0,
            job.keep_text,
            ctx.timeout,
            None,
        )
        .await
    };
    let itl_mean = if o.gaps.is_empty() {
        Value::Null
    } else {
        json!(o.gaps.iter().sum::<f32>() / o.gaps.len() as f32)
    };
    let mut rec = json!({
        "i": job.idx,
        "session": job.session,
        "due": job.due,
        "t": t_dispatch,
        "late": (t_dispatch - job.due).max(0.0),
        "status": o.status,
        "error": o.error,
        "worker": o.worker,
        "ttft": o.ttft,
        "e2e": o.e2e,
        "itl_mean": itl_mean,
        "out_tokens": o.out_tokens,
        "max_tokens": job.max_tokens,
        "prompt_tokens": o.prompt_tokens,
        "cached_tokens": o.cached_tokens,
        "engine_ttft": o.engine_ttft,
        "engine_e2e": o.engine_e2e,
    });
    // Where the client's TTFT went, wall seconds (the mock's clock stamps, same machine): to
    // the worker's receipt, from its first token's send back to this client, and the
    // worker's own delay in sending that token after its engine schedule produced it.
    if let (Some(arr), Some(sent), Some(ttft), Some(ettft)) =
        (o.engine_arrived, o.engine_first_sent, o.ttft, o.engine_ttft)
    {
        rec["sent_unix"] = json!(o.t0_unix);
        rec["path_in"] = json!(arr - o.t0_unix);
        rec["path_out"] = json!(o.t0_unix + ttft - sent);
        rec["engine_send_lag"] = json!(sent - arr - ettft);
    }
    if !o.route_costs.is_empty() {
        rec["route_costs"] = json!(o.route_costs);
    }
    if !o.prefill_worker.is_empty() {
        rec["prefill_worker"] = json!(o.prefill_worker);
        rec["prefill_cached_tokens"] = json!(o.prefill_cached_tokens);
    }
    if let Some(c) = oracle_cached {
        rec["oracle_probe_cached"] = json!(c);
        rec["probe_s"] = json!(probe_s);
    }
    if let (Some(m), Some(e)) = (rec.as_object_mut(), job.extra.as_object()) {
        for (k, v) in e {
            m.insert(k.clone(), v.clone());
        }
    }
    ctx.records.lock().unwrap().push(rec);
    if !o.gaps.is_empty() {
        ctx.gaps.lock().unwrap().push((job.idx, o.gaps.clone()));
    }
    o
}

fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("loadgen: {e}");
            std::process::exit(2);
        }
    };
    let rt = if a.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(a.threads)
            .enable_all()
            .build()
    }
    .expect("runtime");
    let code = rt.block_on(async_main(a));
    std::process::exit(code);
}

async fn async_main(a: Args) -> i32 {
    match a.mode.as_str() {
        "run" => run(a).await,
        "latency" | "saturate" => stats::closed_loop(&a).await,
        m => {
            eprintln!("loadgen: unknown --mode {m}");
            2
        }
    }
}

async fn run(a: Args) -> i32 {
    let oracle = (!a.oracle_workers.is_empty()).then(|| {
        Oracle::new(
            a.oracle_workers.clone(),
            a.oracle_prefill_scale,
            a.oracle_held_weight,
            a.oracle_block_size,
            a.seed,
        )
    });
    let ctx = Arc::new(Ctx {
        client: client::new_client(),
        target: a.target.clone(),
        oracle,
        timeout: a.timeout,
        start: Instant::now(),
        records: Mutex::new(Vec::new()),
        gaps: Mutex::new(Vec::new()),
        sent: Mutex::new(Vec::new()),
        stream_usage: a.stream_usage,
    });
    let res = match a.workload.as_str() {
        "mooncake" => match Mooncake::load(&a) {
            Ok(m) => {
                eprintln!(
                    "loadgen: {} trace requests over {:.1} s, {} prompt tokens on average",
                    m.len(),
                    m.span(),
                    m.mean_input()
                );
                m.run(ctx.clone()).await;
                Ok(())
            }
            Err(e) => Err(e),
        },
        "synthetic" => {
            Synthetic::new(&a).run(ctx.clone()).await;
            Ok(())
        }
        w => Err(format!("unknown --workload {w}")),
    };
    if let Err(e) = res {
        eprintln!("loadgen: {e}");
        return 2;
    }
    let mut records = std::mem::take(&mut *ctx.records.lock().unwrap());
    let mut sent = std::mem::take(&mut *ctx.sent.lock().unwrap());
    if a.ceiling_block > 0 {
        let ideal = ceiling::ideal_cached(&mut sent, a.ceiling_block);
        for r in &mut records {
            let i = r["i"].as_u64().unwrap_or(u64::MAX) as usize;
            if let Some(&(c, n)) = ideal.get(&i) {
                r["ideal_cached_tokens"] = json!(c);
                r["ideal_prompt_tokens"] = json!(n);
            }
        }
    }
    drop(sent);
    stats::add_tpot(&mut records, a.sim_speedup);
    let gaps = std::mem::take(&mut *ctx.gaps.lock().unwrap());
    let summary = stats::summarize(&a, &records, gaps);
    eprintln!("{}", stats::one_line(&summary));
    if let Some(dir) = &a.out {
        if let Err(e) = write_out(dir, &summary, &records) {
            eprintln!("loadgen: writing {dir}: {e}");
            return 1;
        }
    } else {
        println!("{}", serde_json::to_string_pretty(&summary).unwrap());
    }
    0
}

fn write_out(dir: &str, summary: &Value, records: &[Value]) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        format!("{dir}/summary.json"),
        serde_json::to_string_pretty(summary).unwrap(),
    )?;
    let mut sorted: Vec<&Value> = records.iter().collect();
    sorted.sort_by(|x, y| {
        x["t"]
            .as_f64()
            .partial_cmp(&y["t"].as_f64())
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let mut f = std::io::BufWriter::new(std::fs::File::create(format!("{dir}/requests.jsonl"))?);
    for r in sorted {
        writeln!(f, "{r}")?;
    }
    f.flush()
}
