//! Native benchmark of the whole routing core: `Router::route` on real JSON bodies against a
//! prefix index held at ~1M blocks.
//! `make bench-core` (= `cargo run --profile bench-core --no-default-features --example bench_core`)
//!
//! Workload
//! - A 16 MiB corpus of English-like text (~4 bytes per token, paragraph breaks as JSON `\n`
//!   escapes, so the parser takes its unescaping path as it would on real prompts).
//! - A prompt of S tokens is 8 segments of the corpus: a shared part (system prompt / shared
//!   document, 25%), six turns (65%) and a last user turn (10%). `/v1/completions` sends
//!   them concatenated as `prompt`; `/v1/chat/completions` as 8 messages (system, 3 user /
//!   assistant pairs, final user turn).
//! - Each request is one of: 50% warm (an earlier prompt of the same case with a new last
//!   turn: ~90% cached), 30% group (one of 16 shared prefixes, rest new: ~25% cached), 20%
//!   cold (all new).
//! - Workers get `kv_blocks = 1.1M / workers`; before measuring, the index is filled through
//!   `route` with the same mix (2k-32k-token prompts) until every worker's LRU is full, so
//!   measured requests evict as much as they add and the index stays at ~1M blocks.
//! - 32 requests are in flight: each routed request gets `on_first_byte` 8 requests later and
//!   `on_finish` 32 requests later (timed separately, as "fin"). Warm requests only follow up
//!   finished requests, as a conversation's next turn would.
//! - The 32k / 64-worker break-down times `request::parse`, `hashing::prompt_hashes` and
//!   `PrefixIndex::lookup` on their own, on the same bodies and router, just before routing
//!   each body; the select and load-accounting pieces of the rest are replayed through the
//!   public API (`select::pick`, a standalone `LoadTable`) as estimates.
//! - Simulated clock: 1 ms per request, well inside the index TTL (nothing expires; eviction
//!   is by capacity).
//!
//! `BENCH_CORE_OVERHEAD=1` instead breaks down the work of one request in `make overhead`'s
//! setting (one worker, `/v1/completions`, a text prompt of 1k / 8k / 32k tokens with `\n`
//! and `\"` escapes like loadgen's, warm = one document and a new question each time, cold =
//! a new prompt each time): what runs before the request is forwarded (parse, hash, the rest
//! of `Router::route`), after it (the deferred flush and event encoding), on the other VMs
//! (decode + apply), and on the response path (`on_first_byte`, `on_finish`). Native; in
//! Envoy's V8 the same work takes about 1.5-3x as long, and every host call adds ~1-8 µs.

use kvroute::config::Config;
use kvroute::hashing::{prompt_hashes, HashParams};
use kvroute::load::{LoadParams, LoadTable, NewRequest};
use kvroute::request::{parse, ApiKind};
use kvroute::router::{Decision, RouteResult, Router};
use kvroute::select::{self, Candidate, RequestShape, SelectParams};
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

// ---- live heap accounting, for the router's total memory

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            LIVE.fetch_add(l.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(l);
        if !p.is_null() {
            LIVE.fetch_add(l.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Ordering::Relaxed);
            LIVE.fetch_add(new, Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live_heap() -> usize {
    LIVE.load(Ordering::Relaxed)
}

// ---- parameters

const TARGET_BLOCKS: usize = 1_000_000;
/// Index capacity over all workers, in (block, worker) entries. Blocks shared by several
/// workers count once per holder, so ~1.1M entries hold ~1M distinct blocks.
const TOTAL_ENTRIES: usize = 1_100_000;
const BLOCK_SIZE: u32 = 16;
const BYTES_PER_TOKEN: usize = 4;
const INFLIGHT: usize = 32;
/// Requests get their first byte (prefill done) this many requests after being routed.
const FIRST_BYTE_AFTER: usize = 8;
const RING: usize = 32;
const GROUPS: usize = 16;
const WORKERS: [usize; 3] = [8, 64, 256];
const SIZES: [usize; 4] = [1024, 8192, 32768, 131072];
const CORPUS_BYTES: usize = 16 << 20;
const T0: u64 = 1_700_000_000_000;
const TARGET_ROUTE_US: f64 = 150.0;
const TARGET_BYTES_PER_BLOCK: f64 = 64.0;

fn iterations(tokens: usize) -> usize {
    match tokens {
        t if t <= 1024 => 6000,
        t if t <= 8192 => 3000,
        t if t <= 32768 => 1500,
        _ => 400,
    }
}

// ---- random numbers (SplitMix64)

struct Rand(u64);

impl Rand {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        ((self.next() >> 32).wrapping_mul(n as u64) >> 32) as usize
    }
}

// ---- corpus and prompts

/// English-like text, stored already JSON-escaped (paragraph breaks are the two bytes `\n`).
struct Corpus {
    text: Vec<u8>,
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "a",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "model",
    "request",
    "cache",
    "worker",
    "prefix",
    "token",
    "latency",
    "throughput",
    "cluster",
    "memory",
    "server",
    "function",
    "return",
    "value",
    "system",
    "answer",
    "question",
    "document",
    "section",
    "table",
    "result",
    "between",
    "through",
    "because",
    "however",
    "important",
    "different",
    "following",
    "example",
    "information",
    "available",
    "process",
    "development",
    "government",
    "international",
    "experience",
    "particular",
    "understand",
    "together",
    "another",
    "without",
    "something",
    "children",
    "problem",
    "number",
    "people",
    "should",
    "could",
    "about",
    "after",
    "first",
    "other",
    "these",
    "where",
    "while",
    "under",
];

impl Corpus {
    fn new(bytes: usize, seed: u64) -> Self {
        let mut r = Rand(seed);
        let mut text = Vec::with_capacity(bytes + 64);
        let mut sentence = 0;
        let mut paragraph = 0;
        while text.len() < bytes {
            let w = WORDS[r.below(WORDS.len())];
            if sentence == 0 {
                text.push(w.as_bytes()[0].to_ascii_uppercase());
                text.extend_from_slice(&w.as_bytes()[1..]);
            } else {
                text.extend_from_slice(w.as_bytes());
            }
            sentence += 1;
            paragraph += 1;
            if sentence > 6 + r.below(14) {
                text.push(if r.below(8) == 0 { b'?' } else { b'.' });
                sentence = 0;
                if paragraph > 60 + r.below(60) {
                    text.extend_from_slice(b"\\n\\n");
                    paragraph = 0;
                    continue;
                }
            } else if r.below(12) == 0 {
                text.push(b',');
            }
            text.push(b' ');
        }
        Corpus { text }
    }

    /// A random piece of about `len` bytes that starts and ends at a space (never inside an
    /// escape sequence).
    fn seg(&self, r: &mut Rand, len: usize) -> Seg {
        let len = len.max(8);
        let limit = self.text.len() - len - 256;
        let mut start = r.below(limit);
        while self.text[start] != b' ' {
            start += 1;
        }
        let mut end = start + len;
        while self.text[end] != b' ' {
            end += 1;
        }
        Seg {
            start: start as u32,
            end: end as u32,
        }
    }

    fn bytes(&self, s: Seg) -> &[u8] {
        &self.text[s.start as usize..s.end as usize]
    }
}

#[derive(Clone, Copy)]
struct Seg {
    start: u32,
    end: u32,
}

/// Segment lengths of a prompt of `tokens` tokens: shared 25%, six turns 65%, last 10%.
fn layout(tokens: usize) -> [usize; 8] {
    let b = tokens * BYTES_PER_TOKEN;
    let turn = b * 65 / 100 / 6;
    [b / 4, turn, turn, turn, turn, turn, turn, b / 10]
}

#[derive(Clone, Copy, PartialEq)]
enum Mix {
    Warm = 0,
    Group = 1,
    Cold = 2,
}

/// Prompt generator for one case: shared prefixes and a ring of recently finished prompts to
/// follow up.
struct Workload {
    id: u64,
    tokens: usize,
    groups: Vec<Seg>,
    ring: Vec<[Seg; 8]>,
    ring_pos: usize,
    r: Rand,
}

impl Workload {
    fn new(c: &Corpus, tokens: usize, seed: u64) -> Self {
        let mut r = Rand(seed);
        let lens = layout(tokens);
        let groups = (0..GROUPS).map(|_| c.seg(&mut r, lens[0])).collect();
        Workload {
            id: seed,
            tokens,
            groups,
            ring: Vec::new(),
            ring_pos: 0,
            r,
        }
    }

    fn next(&mut self, c: &Corpus) -> ([Seg; 8], Mix) {
        let lens = layout(self.tokens);
        let roll = self.r.below(100);
        let (segs, mix) = if roll < 50 && !self.ring.is_empty() {
            let mut s = self.ring[self.r.below(self.ring.len())];
            s[7] = c.seg(&mut self.r, lens[7]);
            (s, Mix::Warm)
        } else {
            let mut s = [Seg { start: 0, end: 0 }; 8];
            for (k, len) in lens.iter().enumerate() {
                s[k] = c.seg(&mut self.r, *len);
            }
            if roll < 80 {
                s[0] = self.groups[self.r.below(GROUPS)];
                (s, Mix::Group)
            } else {
                (s, Mix::Cold)
            }
        };
        (segs, mix)
    }

    /// A request of this workload finished: its conversation can now be followed up.
    fn retired(&mut self, segs: [Seg; 8]) {
        if self.ring.len() < RING {
            self.ring.push(segs);
        } else {
            self.ring[self.ring_pos] = segs;
            self.ring_pos = (self.ring_pos + 1) % RING;
        }
    }
}

fn body(c: &Corpus, kind: ApiKind, segs: &[Seg; 8], out: &mut Vec<u8>) {
    out.clear();
    match kind {
        ApiKind::Completions => {
            out.extend_from_slice(br#"{"model":"llama-3.1-8b-instruct","prompt":""#);
            for s in segs {
                out.extend_from_slice(c.bytes(*s));
            }
            out.extend_from_slice(
                br#"","max_tokens":256,"temperature":0.7,"stream":true,"stream_options":{"include_usage":true}}"#,
            );
        }
        ApiKind::ChatCompletions => {
            out.extend_from_slice(br#"{"model":"llama-3.1-8b-instruct","messages":["#);
            for (k, s) in segs.iter().enumerate() {
                let role: &[u8] = match k {
                    0 => b"system",
                    k if k % 2 == 1 => b"user",
                    7 => b"user",
                    _ => b"assistant",
                };
                if k > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(br#"{"role":""#);
                out.extend_from_slice(role);
                out.extend_from_slice(br#"","content":""#);
                out.extend_from_slice(c.bytes(*s));
                out.extend_from_slice(br#""}"#);
            }
            out.extend_from_slice(
                br#"],"max_completion_tokens":256,"temperature":0.7,"stream":true,"stream_options":{"include_usage":true}}"#,
            );
        }
    }
}

// ---- the router under test

fn config(workers: usize) -> Config {
    let cap = TOTAL_ENTRIES.div_ceil(workers);
    let list: Vec<String> = (0..workers)
        .map(|i| {
            format!(
                r#"{{"name":"w{i}","endpoint":"10.0.{}.{}:8000","kv_blocks":{cap}}}"#,
                i / 250,
                i % 250 + 1
            )
        })
        .collect();
    let json = format!(
        r#"{{"workers":[{}],"block_size":{BLOCK_SIZE},"chars_per_token":{BYTES_PER_TOKEN}.0,
            "index":{{"ttl_ms":600000}},"disaggregation":{{"threshold_tokens":0}}}}"#,
        list.join(",")
    );
    Config::from_json(json.as_bytes()).expect("bench config")
}

struct InFlight {
    d: Decision,
    workload: u64,
    segs: [Seg; 8],
    first_byte: bool,
}

struct Step {
    route_ns: u64,
    /// `on_first_byte` + `on_finish` work done in this step (for older requests).
    release_ns: u64,
    hit: f64,
    blocks: usize,
    /// Prompt blocks the chosen worker was not predicted to hold (inserted into its LRU).
    new_blocks: usize,
    /// The request that finished in this step: (workload id, prompt).
    retired: Option<(u64, [Seg; 8])>,
}

struct Bench {
    router: Router,
    workers: usize,
    now: u64,
    inflight: VecDeque<InFlight>,
}

impl Bench {
    /// Routes one body (timed), then gives the request routed `FIRST_BYTE_AFTER` steps ago
    /// its first byte and finishes the one routed `INFLIGHT` steps ago (timed together).
    fn step(&mut self, kind: ApiKind, b: &[u8], workload: u64, segs: [Seg; 8]) -> Step {
        self.now += 1;
        let t = Instant::now();
        let r = self.router.route(kind, black_box(b), self.now);
        let route_ns = t.elapsed().as_nanos() as u64;
        let d = match r {
            RouteResult::Routed(d) => d,
            r => panic!("not routed: {r:?}"),
        };
        assert!(d.fallback.is_none(), "fallback: {:?}", d.fallback);
        let hit = d.predicted_hit();
        let blocks = d.hashes().len();
        let new_blocks = blocks.saturating_sub((d.overlap_tokens / BLOCK_SIZE) as usize);
        self.inflight.push_back(InFlight {
            d,
            workload,
            segs,
            first_byte: false,
        });
        let t = Instant::now();
        // The filter runs the index insert after the request left (a self-addressed queue
        // wake-up), so it is not part of route time; it is counted with the release work.
        self.router.flush();
        let n = self.inflight.len();
        if n > FIRST_BYTE_AFTER {
            if let Some(f) = self.inflight.get_mut(n - 1 - FIRST_BYTE_AFTER) {
                if !f.first_byte {
                    f.first_byte = true;
                    self.router.on_first_byte(&f.d, true, self.now);
                }
            }
        }
        let mut retired = None;
        if n > INFLIGHT {
            if let Some(old) = self.inflight.pop_front() {
                self.router.on_finish(&old.d, self.now);
                retired = Some((old.workload, old.segs));
            }
        }
        let release_ns = t.elapsed().as_nanos() as u64;
        Step {
            route_ns,
            release_ns,
            hit,
            blocks,
            new_blocks,
            retired,
        }
    }

    fn drain(&mut self) {
        while let Some(old) = self.inflight.pop_front() {
            if !old.first_byte {
                self.router.on_first_byte(&old.d, true, self.now);
            }
            self.router.on_finish(&old.d, self.now);
        }
    }

    fn entries(&self) -> usize {
        (0..self.workers)
            .map(|w| self.router.index().entries(w as u16))
            .sum()
    }
}

/// Fills the index through `route` until every worker's LRU is at capacity.
fn fill(c: &Corpus, workers: usize, seed: u64) -> (Bench, usize, f64) {
    let router = Router::new(config(workers), 1, seed);
    let mut bench = Bench {
        router,
        workers,
        now: T0,
        inflight: VecDeque::new(),
    };
    let cap = TOTAL_ENTRIES.div_ceil(workers);
    let total_cap = cap * workers;
    let sizes = [2048, 8192, 16384, 32768];
    let mut loads: Vec<Workload> = sizes
        .iter()
        .enumerate()
        .map(|(i, &t)| Workload::new(c, t, seed ^ ((i as u64 + 1) * 7919)))
        .collect();
    let mut r = Rand(seed);
    let mut buf = Vec::new();
    let mut routes = 0;
    let start = Instant::now();
    // Full when all but a few workers are within a block of capacity.
    let full = |b: &Bench| {
        (0..workers)
            .filter(|&w| b.router.index().entries(w as u16) + 1 >= cap)
            .count()
            * 100
            >= workers * 99
    };
    while !(bench.entries() * 1000 >= total_cap * 995 && full(&bench)) && routes < 200_000 {
        let k = r.below(loads.len());
        let (segs, _) = loads[k].next(c);
        let kind = if r.below(2) == 0 {
            ApiKind::Completions
        } else {
            ApiKind::ChatCompletions
        };
        body(c, kind, &segs, &mut buf);
        let st = bench.step(kind, &buf, loads[k].id, segs);
        if let Some((id, segs)) = st.retired {
            if let Some(l) = loads.iter_mut().find(|l| l.id == id) {
                l.retired(segs);
            }
        }
        routes += 1;
    }
    bench.drain();
    (bench, routes, start.elapsed().as_secs_f64())
}

// ---- statistics

struct Stats {
    sorted: Vec<u64>,
}

impl Stats {
    fn new(mut v: Vec<u64>) -> Self {
        v.sort_unstable();
        Stats { sorted: v }
    }
    fn pct(&self, p: f64) -> f64 {
        if self.sorted.is_empty() {
            return 0.0;
        }
        let i = ((self.sorted.len() as f64 - 1.0) * p).round() as usize;
        self.sorted[i] as f64 / 1000.0
    }
    fn max(&self) -> f64 {
        self.sorted.last().copied().unwrap_or(0) as f64 / 1000.0
    }
}

struct CaseResult {
    route: Stats,
    finish: Stats,
    hit: f64,
    blocks: f64,
}

fn api_name(k: ApiKind) -> &'static str {
    match k {
        ApiKind::Completions => "completions",
        ApiKind::ChatCompletions => "chat",
    }
}

const WARMUP: usize = 2 * RING + INFLIGHT;

/// Generates, builds and routes the workload's next request.
fn one(b: &mut Bench, c: &Corpus, wl: &mut Workload, kind: ApiKind, buf: &mut Vec<u8>) -> Step {
    let (segs, _) = wl.next(c);
    body(c, kind, &segs, buf);
    let st = b.step(kind, buf, wl.id, segs);
    if let Some((id, segs)) = st.retired {
        if id == wl.id {
            wl.retired(segs);
        }
    }
    st
}

fn run_case(b: &mut Bench, c: &Corpus, kind: ApiKind, tokens: usize, seed: u64) -> CaseResult {
    let mut wl = Workload::new(c, tokens, seed);
    let mut buf = Vec::new();
    // Warm-up: fills the ring of finished prompts and puts the group prefixes in the index.
    for _ in 0..WARMUP {
        one(b, c, &mut wl, kind, &mut buf);
    }
    let n = iterations(tokens);
    let mut route = Vec::with_capacity(n);
    let mut finish = Vec::with_capacity(n);
    let (mut hit, mut blocks) = (0.0, 0usize);
    for _ in 0..n {
        let st = one(b, c, &mut wl, kind, &mut buf);
        route.push(st.route_ns);
        finish.push(st.release_ns);
        hit += st.hit;
        blocks += st.blocks;
    }
    CaseResult {
        route: Stats::new(route),
        finish: Stats::new(finish),
        hit: hit / n as f64,
        blocks: blocks as f64 / n as f64,
    }
}

/// 32k tokens, 64 workers: the pieces of `route` timed on their own.
fn breakdown(b: &mut Bench, c: &Corpus, kind: ApiKind, full_p50: f64, seed: u64) {
    let tokens = 32768;
    let n = 1000;
    let mut wl = Workload::new(c, tokens, seed);
    let hp = HashParams {
        block_size: b.router.config().block_size,
        chars_per_token: b.router.config().chars_per_token,
    };
    let mut buf = Vec::new();
    for _ in 0..WARMUP {
        one(b, c, &mut wl, kind, &mut buf);
    }
    let (mut t_parse, mut t_hash, mut t_lookup, mut t_select, mut t_route) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut hit = 0.0;
    let mut by_mix: [(Vec<u64>, usize); 3] = Default::default();
    let mut held = vec![0u32; b.workers];
    let sp = select_params(b.router.config());
    let mut rng = kvroute::rng::Rng::new(seed);
    let mut all_hashes = Vec::new();
    for _ in 0..n {
        let (segs, mix) = wl.next(c);
        body(c, kind, &segs, &mut buf);
        let now = b.now + 1;
        // parse, then hash the parsed request
        let t = Instant::now();
        let req = parse(kind, black_box(&buf)).expect("parse");
        t_parse.push(t.elapsed().as_nanos() as u64);
        let t = Instant::now();
        let ph = prompt_hashes(black_box(&req), &hp);
        t_hash.push(t.elapsed().as_nanos() as u64);
        drop(req);
        // index lookup alone (read-only, before route inserts the prompt)
        let t = Instant::now();
        b.router
            .index()
            .lookup(black_box(&ph.blocks), now, &mut held);
        t_lookup.push(t.elapsed().as_nanos() as u64);
        black_box(&held);
        // candidates + pick + alternates, as route does them (over the live load table)
        let tokens_est = ph.est_tokens;
        let shape = RequestShape {
            prompt_tokens: tokens_est,
            total_blocks: tokens_est.div_ceil(BLOCK_SIZE) + 16,
        };
        let t = Instant::now();
        let cands: Vec<Candidate> = (0..b.workers)
            .map(|w| Candidate {
                id: w as u16,
                overlap_tokens: held[w] * BLOCK_SIZE,
                kv_blocks: (TOTAL_ENTRIES.div_ceil(b.workers)) as u32,
                indexed_blocks: b.router.index().entries(w as u16) as u32,
                load: b.router.worker_view(w as u16, now),
                confirmed_tokens: held[w] * BLOCK_SIZE,
                placed_tokens: held[w] * BLOCK_SIZE,
                placed_confirmed_tokens: held[w] * BLOCK_SIZE,
                family_share: None,
                speed: 1.0,
                adapter_loads: 0.0,
            })
            .collect();
        let pick = select::pick(&sp, &cands, &shape, &mut rng);
        let mut rest: Vec<(f64, u16)> = cands
            .iter()
            .map(|c| {
                (
                    select::cost(&sp, c, &shape, &select::Pool::of(&cands)),
                    c.id,
                )
            })
            .collect();
        rest.sort_by(|a, b| a.0.total_cmp(&b.0));
        black_box((&pick, &rest));
        t_select.push(t.elapsed().as_nanos() as u64);
        let st = b.step(kind, &buf, wl.id, segs);
        if let Some((id, segs)) = st.retired {
            if id == wl.id {
                wl.retired(segs);
            }
        }
        t_route.push(st.route_ns);
        let m = &mut by_mix[mix as usize];
        m.0.push(st.route_ns);
        m.1 += st.new_blocks;
        hit += st.hit;
        all_hashes.push(ph.blocks);
    }
    // Load accounting (LoadTable add + free) on a standalone table with the same window.
    let mut lt = LoadTable::new(b.workers, LoadParams::default());
    let (mut t_add, mut t_free) = (Vec::new(), Vec::new());
    for (i, h) in all_hashes.iter().enumerate() {
        let req = NewRequest {
            id: i as u64 + 1,
            worker: (i % b.workers) as u16,
            prefill_worker: None,
            blocks: h.clone(),
            cached_blocks: 0,
            tail_blocks: 16,
            prefill_tokens: 1000,
            now_ms: T0 + i as u64,
            adapter: 0,
        };
        let t = Instant::now();
        lt.add(&req);
        t_add.push(t.elapsed().as_nanos() as u64);
        if i >= INFLIGHT {
            let t = Instant::now();
            lt.free((i - INFLIGHT) as u64 + 1);
            t_free.push(t.elapsed().as_nanos() as u64);
        }
    }
    let ph: Vec<u64> = t_parse.iter().zip(&t_hash).map(|(a, b)| a + b).collect();
    let rest: Vec<u64> = (0..n)
        .map(|i| t_route[i].saturating_sub(ph[i] + t_lookup[i]))
        .collect();
    let s = Stats::new;
    let (parse_s, hash_s, ph_s, lookup_s, rest_s, select_s, route_s, add_s, free_s) = (
        s(t_parse),
        s(t_hash),
        s(ph),
        s(t_lookup),
        s(rest),
        s(t_select),
        s(t_route),
        s(t_add),
        s(t_free),
    );
    let full = route_s.pct(0.5);
    println!(
        "  {} (n={n}, hit {:.1}%; route p50 {:.1} µs in this pass, {:.1} µs in the table above):",
        api_name(kind),
        hit / n as f64 * 100.0,
        full,
        full_p50
    );
    println!(
        "    {:<50} {:>9} {:>9} {:>8}",
        "piece", "p50 µs", "p99 µs", "% route"
    );
    let line = |name: &str, x: &Stats| {
        println!(
            "    {:<50} {:>9.1} {:>9.1} {:>7.0}%",
            name,
            x.pct(0.5),
            x.pct(0.99),
            x.pct(0.5) / full * 100.0
        )
    };
    line("Router::route (full path)", &route_s);
    line("parse + hash (request::parse + prompt_hashes)", &ph_s);
    line("  request::parse", &parse_s);
    line("  hashing::prompt_hashes", &hash_s);
    line("index lookup (PrefixIndex::lookup)", &lookup_s);
    line(
        "the rest (route - parse+hash - lookup, per request)",
        &rest_s,
    );
    line("  ~ candidates + pick + alternates (replayed)", &select_s);
    line("  ~ LoadTable::add (standalone table, same hashes)", &add_s);
    let remainder = rest_s.pct(0.5) - select_s.pct(0.5) - add_s.pct(0.5);
    println!(
        "    {:<50} {:>9.1} {:>9} {:>7.0}%",
        "  ~ index insert + eviction, copies (remainder)",
        remainder,
        "",
        remainder / full * 100.0
    );
    line("(on_finish path) LoadTable::free, standalone", &free_s);
    println!("    route time by request type (what insert + eviction cost per new block):");
    for (name, (v, new)) in ["warm", "shared prefix", "cold"].iter().zip(by_mix) {
        let k = v.len().max(1);
        let st = Stats::new(v);
        println!(
            "      {:<14} n={:<4} new blocks/request {:>6.0}   route p50 {:>7.1} µs  p99 {:>7.1} µs",
            name,
            st.sorted.len(),
            new as f64 / k as f64,
            st.pct(0.5),
            st.pct(0.99)
        );
    }
}

fn select_params(cfg: &Config) -> SelectParams {
    SelectParams::from_config(cfg)
}

struct Mem {
    blocks: usize,
    bytes: usize,
    entries: usize,
    heap: usize,
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "n/a".into())
}

fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

// ---- the `make overhead` setting, piece by piece

fn overhead_body(c: &Corpus, r: &mut Rand, doc: Option<Seg>, tokens: usize, i: usize) -> Vec<u8> {
    let seg = doc.unwrap_or_else(|| c.seg(r, tokens * BYTES_PER_TOKEN));
    let mut b = Vec::with_capacity(tokens * BYTES_PER_TOKEN + 128);
    b.extend_from_slice(br#"{"prompt":""#);
    // loadgen's prompts carry a quote or a newline every ~40 bytes (code, JSON and log genres).
    // (The corpus is escaped already: a cut never follows a backslash.)
    let (mut since, mut k) = (0, 0);
    for &ch in c.bytes(seg) {
        b.push(ch);
        since += 1;
        if since >= 40 && ch != b'\\' {
            b.extend_from_slice(if k % 3 == 0 { br#"\""# } else { br"\n" });
            (since, k) = (0, k + 1);
        }
    }
    b.extend_from_slice(
        format!(r#" question {i}","max_tokens":1,"model":"mock-model"}}"#).as_bytes(),
    );
    b
}

fn overhead() {
    let cfg = r#"{"workers":[{"name":"w0","cluster":"w0","endpoint":"127.0.0.1:1","kv_blocks":16384}],
        "block_size":16,"debug_headers":true,"disaggregation":{"threshold_tokens":0}}"#;
    let cfg = Config::from_json(cfg.as_bytes()).expect("config");
    let params = HashParams::from_config(&cfg);
    let corpus = Corpus::new(CORPUS_BYTES, 7);
    println!("kvroute bench-core, `make overhead` setting: one worker, /v1/completions text prompts (µs per request, p50 / p90)");
    println!("load average at start: {}", loadavg());
    println!(
        "{:>6} {:>5} {:>7} {:>7} | {:>13} {:>13} {:>13} {:>13} | {:>13} {:>13} | {:>13} {:>13} {:>13}",
        "tokens", "kind", "KiB", "blocks", "parse", "hash", "route (all)", "route - p - h",
        "flush", "encode", "peer apply", "first byte", "finish"
    );
    for tokens in [1000usize, 8000, 32000] {
        for warm in [true, false] {
            let mut r = Rand(tokens as u64 * 2 + u64::from(warm));
            let mut router = Router::new(cfg.clone(), 1, 1);
            let mut peer = Router::new(cfg.clone(), 2, 2);
            let doc = warm.then(|| corpus.seg(&mut r, tokens * BYTES_PER_TOKEN));
            let iters = if tokens >= 32000 { 300 } else { 1500 };
            let names = [
                "parse", "hash", "route", "rest", "flush", "encode", "peer", "first", "finish",
            ];
            let mut t: Vec<Vec<u64>> = vec![Vec::with_capacity(iters); names.len()];
            let (mut kib, mut blocks) = (0.0, 0.0);
            for i in 0..iters + 50 {
                let now = T0 + i as u64;
                let body = overhead_body(&corpus, &mut r, doc, tokens, i);
                let ns = |t0: Instant| t0.elapsed().as_nanos() as u64;
                let t0 = Instant::now();
                let req = parse(ApiKind::Completions, &body).expect("parses");
                let parse_ns = ns(t0);
                let t0 = Instant::now();
                let ph = black_box(prompt_hashes(&req, &params));
                let hash_ns = ns(t0);
                drop(req);
                let t0 = Instant::now();
                let d = match router.route(ApiKind::Completions, &body, now) {
                    RouteResult::Routed(d) => d,
                    r => panic!("not routed: {r:?}"),
                };
                let route_ns = ns(t0);
                let t0 = Instant::now();
                router.flush();
                let flush_ns = ns(t0);
                let t0 = Instant::now();
                let msg = kvroute::events::encode(now, std::slice::from_ref(&d.event));
                let encode_ns = ns(t0);
                let t0 = Instant::now();
                for e in kvroute::events::decode(&msg).expect("decodes").1 {
                    peer.apply(&e, now);
                }
                let peer_ns = ns(t0);
                let t0 = Instant::now();
                let evs = router.on_first_byte(&d, true, now);
                let first_ns = ns(t0);
                let t0 = Instant::now();
                let fin = router.on_finish(&d, now);
                let finish_ns = ns(t0);
                for e in evs.iter().chain([&fin]) {
                    peer.apply(e, now);
                }
                if i >= 50 {
                    let rest = route_ns.saturating_sub(parse_ns + hash_ns);
                    for (k, v) in [
                        parse_ns, hash_ns, route_ns, rest, flush_ns, encode_ns, peer_ns, first_ns,
                        finish_ns,
                    ]
                    .into_iter()
                    .enumerate()
                    {
                        t[k].push(v);
                    }
                    kib = body.len() as f64 / 1024.0;
                    blocks = ph.blocks.len() as f64;
                }
            }
            let st: Vec<Stats> = t.into_iter().map(Stats::new).collect();
            let cell = |k: usize| format!("{:.1} / {:.1}", st[k].pct(0.5), st[k].pct(0.9));
            println!(
                "{:>6} {:>5} {:>7.1} {:>7.0} | {:>13} {:>13} {:>13} {:>13} | {:>13} {:>13} | {:>13} {:>13} {:>13}",
                tokens,
                if warm { "warm" } else { "cold" },
                kib,
                blocks,
                cell(0), cell(1), cell(2), cell(3), cell(4), cell(5), cell(6), cell(7), cell(8)
            );
        }
    }
    println!("route (all) = Router::route (parse + hash + index lookup + select + load charge); flush and encode run");
    println!("after the request left (on_queue_ready); peer apply = decode + apply on another VM's router;");
    println!("first byte = on_first_byte(success) (the prompt's blocks marked computed), on the response path;");
    println!("finish = on_finish (the index insert of a confirmed prompt), from the log callback after the answer.");
}

fn main() {
    if std::env::var_os("BENCH_CORE_OVERHEAD").is_some() {
        overhead();
        return;
    }
    let started = Instant::now();
    println!("kvroute bench-core: Router::route (parse + hash + index lookup + select + record) on real JSON bodies");
    println!(
        "load average at start: {}   (cpus: {})",
        loadavg(),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    println!(
        "block_size {BLOCK_SIZE} tokens, {BYTES_PER_TOKEN} bytes/token (64-byte text blocks); index capacity {TOTAL_ENTRIES} entries over the workers; {INFLIGHT} requests in flight"
    );
    println!("mix: 50% warm (finished prompt + new last turn), 30% shared 25% prefix + new, 20% cold; chat = 8 messages");
    println!("columns: blocks = hashed blocks per request; hit% = mean predicted cache hit; fin = deferred index insert (off the request path) + on_first_byte + on_finish");
    println!("         work per routed request (not part of route); idx blks = index blocks after the case");
    let corpus = Corpus::new(CORPUS_BYTES, 42);

    let mut idx_rows = Vec::new();
    let mut target_rows = Vec::new();
    // BENCH_CORE_QUICK=1: only the 32k-token cases at 64 workers (for A/B comparisons).
    let quick = std::env::var_os("BENCH_CORE_QUICK").is_some();
    for (wi, &workers) in WORKERS.iter().enumerate() {
        if quick && workers != 64 {
            continue;
        }
        let before = live_heap();
        let (mut bench, routes, secs) = fill(&corpus, workers, 1000 + wi as u64);
        let router_heap = live_heap() - before;
        let ix = bench.router.index();
        let blocks = ix.blocks();
        let filled = Mem {
            blocks,
            bytes: ix.memory_bytes(),
            entries: bench.entries(),
            heap: router_heap,
        };
        let bpb = ix.memory_bytes() as f64 / blocks as f64;
        println!();
        if blocks.abs_diff(TARGET_BLOCKS) > TARGET_BLOCKS / 5 {
            println!("   note: index holds {blocks} blocks, more than 20% off the {TARGET_BLOCKS} target");
        }
        println!(
            "== {workers} workers, kv_blocks {} each: filled with {routes} routes in {secs:.1} s -> {blocks} blocks, {:.2} holders/block, index {:.1} MiB ({bpb:.1} B/block), router heap {:.1} MiB",
            TOTAL_ENTRIES.div_ceil(workers),
            bench.entries() as f64 / blocks as f64,
            mib(ix.memory_bytes()),
            mib(router_heap),
        );
        println!(
            "{:>7} {:>11} {:>7} {:>7} {:>6} {:>9} {:>9} {:>9} {:>6} {:>10} {:>10} {:>9}",
            "workers",
            "api",
            "tokens",
            "blocks",
            "iters",
            "p50 µs",
            "p99 µs",
            "max µs",
            "hit%",
            "fin p50µs",
            "fin p99µs",
            "idx blks"
        );
        for (si, &tokens) in SIZES.iter().enumerate() {
            if quick && tokens != 32768 {
                continue;
            }
            for kind in [ApiKind::Completions, ApiKind::ChatCompletions] {
                let seed = (wi as u64) << 32 | (si as u64) << 8 | kind as u64;
                let r = run_case(&mut bench, &corpus, kind, tokens, seed);
                println!(
                    "{:>7} {:>11} {:>7} {:>7.0} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>6.1} {:>10.1} {:>10.1} {:>9}",
                    workers,
                    api_name(kind),
                    format!("{}k", tokens / 1024),
                    r.blocks,
                    r.route.sorted.len(),
                    r.route.pct(0.5),
                    r.route.pct(0.99),
                    r.route.max(),
                    r.hit * 100.0,
                    r.finish.pct(0.5),
                    r.finish.pct(0.99),
                    bench.router.index().blocks()
                );
                let cap = TOTAL_ENTRIES.div_ceil(workers) as f64;
                if r.blocks > cap && kind == ApiKind::ChatCompletions {
                    println!("        ^ {workers} workers: a {}k prompt ({:.0} blocks) exceeds a worker's kv_blocks ({cap}); its index entries evict each other", tokens / 1024, r.blocks);
                }
                if workers == 64 && tokens == 32768 {
                    target_rows.push((kind, r.route.pct(0.5), r.route.pct(0.99)));
                }
            }
        }
        bench.drain();
        let ix = bench.router.index();
        let after = Mem {
            blocks: ix.blocks(),
            bytes: ix.memory_bytes(),
            entries: bench.entries(),
            heap: live_heap() - before,
        };
        idx_rows.push((workers, filled, after));
        if workers == 64 {
            println!();
            println!("-- break-down, 32k tokens, 64 workers (pieces timed separately on the same bodies and router):");
            for kind in [ApiKind::Completions, ApiKind::ChatCompletions] {
                let full = target_rows
                    .iter()
                    .find(|t| t.0 == kind)
                    .map(|t| t.1)
                    .unwrap_or(0.0);
                breakdown(&mut bench, &corpus, kind, full, 77 + kind as u64);
            }
        }
        drop(bench);
    }

    println!();
    println!("-- memory (index: PrefixIndex::memory_bytes; router heap: live heap of Router::new + its use, counted by a");
    println!("   wrapping global allocator: index + load table + config; all requests finished)");
    println!(
        "{:>7} {:<12} {:>9} {:>10} {:>10} {:>9} {:>9} {:>16}",
        "workers",
        "state",
        "blocks",
        "holders/b",
        "index MiB",
        "B/block",
        "B/entry",
        "router heap MiB"
    );
    for (w, filled, after) in &idx_rows {
        for (state, m) in [("after fill", filled), ("after runs", after)] {
            println!(
                "{:>7} {:<12} {:>9} {:>10.2} {:>10.1} {:>9.1} {:>9.1} {:>16.1}",
                w,
                state,
                m.blocks,
                m.entries as f64 / m.blocks as f64,
                mib(m.bytes),
                m.bytes as f64 / m.blocks as f64,
                m.bytes as f64 / m.entries as f64,
                mib(m.heap)
            );
        }
    }
    println!();
    println!("-- targets");
    for (kind, p50, p99) in &target_rows {
        println!(
            "  32k tokens, 64 workers, {:<11} route p50 {:>7.1} µs <= {TARGET_ROUTE_US} µs: {}   (p99 {:.1} µs: {})",
            api_name(*kind),
            p50,
            if *p50 <= TARGET_ROUTE_US { "PASS" } else { "MISS" },
            p99,
            if *p99 <= TARGET_ROUTE_US { "PASS" } else { "MISS" },
        );
    }
    for (w, filled, after) in &idx_rows {
        for (state, m) in [("after fill", filled), ("after runs", after)] {
            let bpb = m.bytes as f64 / m.blocks as f64;
            println!(
                "  index {w:>3} workers, {state:<10} ({:>7} blocks, {:.2} holders/block): {bpb:5.1} B/block <= {TARGET_BYTES_PER_BLOCK}: {}",
                m.blocks,
                m.entries as f64 / m.blocks as f64,
                if bpb <= TARGET_BYTES_PER_BLOCK { "PASS" } else { "MISS" }
            );
        }
    }
    println!();
    println!(
        "load average at end: {}   total {:.1} s",
        loadavg(),
        started.elapsed().as_secs_f64()
    );
}
