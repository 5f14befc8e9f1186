//! Workloads: Mooncake trace replay and synthetic conversations.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::text::{push_words, seed_of, splitmix, unit, Zipf};
use crate::{dispatch, Args, Ctx, Job};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Api {
    Completions,
    Chat,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }
}

fn base_body(model: &str, max_tokens: u64) -> Value {
    let mut b = json!({
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if !model.is_empty() {
        b["model"] = json!(model);
    }
    b
}

/// `--adapters`: the model a conversation names, one of `n` adapters drawn by Zipf
/// popularity from the conversation's key, so every turn of it uses the same adapter.
pub struct AdapterPick {
    zipf: Option<Zipf>,
    seed: u64,
}

impl AdapterPick {
    pub fn new(a: &Args) -> Self {
        AdapterPick {
            zipf: (a.adapters > 0).then(|| Zipf::new(a.adapters, a.adapter_zipf)),
            seed: a.seed,
        }
    }

    /// The adapter of conversation `key`, or `base` when adapters are off.
    pub fn model(&self, key: u64, base: &str) -> String {
        match &self.zipf {
            Some(z) => {
                let mut st = seed_of(&[self.seed, 0x00ad_a97e, key]);
                format!("adapter-{}", z.sample(&mut st))
            }
            None => base.to_string(),
        }
    }
}

struct TraceReq {
    ts_ms: f64,
    tokens: usize,
    max_tokens: u64,
    hash_ids: Vec<u64>,
    session: String,
}

/// A window of the trace replayed faster than the rest (`--burst AT:LEN:F`): load above the
/// fleet's capacity for a while, then back to the recorded rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Burst {
    /// Start and length of the window, as fractions of the slice's trace span.
    pub at: f64,
    pub len: f64,
    /// How much faster than `--speed` the window's requests arrive.
    pub factor: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Before,
    Burst,
    After,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Before => "before",
            Phase::Burst => "burst",
            Phase::After => "after",
        }
    }
}

impl Burst {
    pub fn parse(v: &str) -> Result<Burst, String> {
        let parts: Vec<&str> = v.split(':').collect();
        let [at, len, factor] = parts.as_slice() else {
            return Err(format!("want AT:LEN:F, not {v:?}"));
        };
        let num = |x: &str| {
            x.trim()
                .parse::<f64>()
                .map_err(|_| format!("bad number {x:?}"))
        };
        let b = Burst {
            at: num(at)?,
            len: num(len)?,
            factor: num(factor)?,
        };
        if !(b.at >= 0.0 && b.len > 0.0 && b.at + b.len <= 1.0) {
            return Err("want 0 <= AT, 0 < LEN and AT + LEN <= 1".into());
        }
        if !(b.factor.is_finite() && b.factor > 0.0) {
            return Err("F must be > 0".into());
        }
        Ok(b)
    }

    /// The window's start and end in trace seconds, of a slice spanning `span`.
    fn window(&self, span: f64) -> (f64, f64) {
        (self.at * span, (self.at + self.len) * span)
    }

    /// Trace seconds since the slice's first request (`x`, of a slice spanning `span`) to
    /// replay seconds at speed 1: the window runs `factor` x faster, and what follows it
    /// keeps its recorded gaps, shifted earlier by the time the window saved.
    pub fn map(&self, x: f64, span: f64) -> f64 {
        let (a, b) = self.window(span);
        if x <= a {
            x
        } else if x <= b {
            a + (x - a) / self.factor
        } else {
            a + (b - a) / self.factor + (x - b)
        }
    }

    pub fn phase(&self, x: f64, span: f64) -> Phase {
        let (a, b) = self.window(span);
        if x < a {
            Phase::Before
        } else if x < b {
            Phase::Burst
        } else {
            Phase::After
        }
    }
}

pub struct Mooncake {
    reqs: Vec<TraceReq>,
    burst: Option<Burst>,
    /// Text of every full block, generated before the replay starts so that building a
    /// prompt at its arrival time is a copy, not text generation.
    blocks: HashMap<u64, String>,
    block_tokens: usize,
    speed: f64,
    seed: u64,
    api: Api,
    model: String,
    adapters: AdapterPick,
}

impl Mooncake {
    pub fn load(a: &Args) -> Result<Self, String> {
        let path = a
            .trace
            .as_deref()
            .ok_or("--trace is required for --workload mooncake")?;
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        let mut reqs = Vec::new();
        for (n, line) in text.lines().enumerate().skip(a.start).take(a.count) {
            if line.trim().is_empty() {
                continue;
            }
            let v: Value =
                serde_json::from_str(line).map_err(|e| format!("{path}:{}: {e}", n + 1))?;
            let input = v["input_length"]
                .as_u64()
                .ok_or(format!("{path}:{}: no input_length", n + 1))?;
            let output = v["output_length"].as_u64().unwrap_or(1).max(1);
            let hash_ids: Vec<u64> = v["hash_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(|h| h.as_u64()).collect())
                .unwrap_or_default();
            if hash_ids.is_empty() {
                return Err(format!("{path}:{}: no hash_ids", n + 1));
            }
            // Scale 512-token trace blocks to --block-tokens, keep block boundaries aligned.
            let mut tokens = ((input as usize) * a.block_tokens).div_ceil(512).max(1);
            tokens = tokens.min(hash_ids.len() * a.block_tokens);
            if a.max_input_tokens > 0 {
                tokens = tokens.min(a.max_input_tokens);
            }
            let max_tokens = if a.max_output > 0 {
                output.min(a.max_output)
            } else {
                output
            };
            let session = hash_ids[a.session_block.min(hash_ids.len() - 1)].to_string();
            reqs.push(TraceReq {
                ts_ms: v["timestamp"].as_f64().unwrap_or(0.0),
                tokens,
                max_tokens,
                hash_ids,
                session,
            });
        }
        if reqs.is_empty() {
            return Err(format!("{path}: no requests in the slice"));
        }
        let mut m = Mooncake {
            reqs,
            burst: a.burst,
            blocks: HashMap::new(),
            block_tokens: a.block_tokens,
            speed: a.speed,
            seed: a.seed,
            api: a.api.unwrap_or(Api::Completions),
            model: a.model.clone(),
            adapters: AdapterPick::new(a),
        };
        m.generate_blocks();
        Ok(m)
    }

    fn block_seed(&self, h: u64) -> u64 {
        seed_of(&[self.seed, 0x0074_7261_6365, h])
    }

    fn generate_blocks(&mut self) {
        let mut blocks = HashMap::new();
        for r in &self.reqs {
            let full = r.tokens / self.block_tokens;
            for &h in r.hash_ids.iter().take(full) {
                blocks.entry(h).or_insert_with(|| {
                    let mut s = String::with_capacity(self.block_tokens * 4);
                    push_words(&mut s, self.block_seed(h), self.block_tokens);
                    s
                });
            }
        }
        self.blocks = blocks;
    }

    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Trace seconds from the slice's first request to its last.
    fn trace_span(&self) -> f64 {
        let t0 = self.reqs[0].ts_ms;
        self.reqs.iter().map(|r| r.ts_ms - t0).fold(0.0, f64::max) / 1000.0
    }

    /// Wall seconds after the start at which request `i` is due, and its burst phase.
    fn due(&self, i: usize, span: f64) -> (f64, Option<Phase>) {
        let x = (self.reqs[i].ts_ms - self.reqs[0].ts_ms) / 1000.0;
        match &self.burst {
            Some(b) => (b.map(x, span) / self.speed, Some(b.phase(x, span))),
            None => (x / self.speed, None),
        }
    }

    /// Wall seconds the arrivals span at this speed.
    pub fn span(&self) -> f64 {
        let span = self.trace_span();
        match &self.burst {
            Some(b) => b.map(span, span) / self.speed,
            None => span / self.speed,
        }
    }

    pub fn mean_input(&self) -> usize {
        self.reqs.iter().map(|r| r.tokens).sum::<usize>() / self.reqs.len()
    }

    /// The prompt of one request: each hash id expands to the same `block_tokens` tokens.
    fn prompt(&self, r: &TraceReq) -> String {
        let mut s = String::with_capacity(r.tokens * 4);
        let mut left = r.tokens;
        for &h in &r.hash_ids {
            if left == 0 {
                break;
            }
            let n = left.min(self.block_tokens);
            match self.blocks.get(&h) {
                Some(text) if n == self.block_tokens => s.push_str(text),
                _ => push_words(&mut s, self.block_seed(h), n),
            }
            left -= n;
        }
        s
    }

    pub async fn run(self, ctx: Arc<Ctx>) {
        let me = Arc::new(self);
        let span = me.trace_span();
        let mut hs = Vec::with_capacity(me.reqs.len());
        for i in 0..me.reqs.len() {
            let (due, phase) = me.due(i, span);
            tokio::time::sleep_until((ctx.start + Duration::from_secs_f64(due.max(0.0))).into())
                .await;
            let (me, ctx) = (me.clone(), ctx.clone());
            hs.push(tokio::spawn(async move {
                let r = &me.reqs[i];
                let text = me.prompt(r);
                let key = r.session.parse::<u64>().unwrap_or(0);
                let model = me.adapters.model(key, &me.model);
                let mut body = base_body(&model, r.max_tokens);
                match me.api {
                    Api::Completions => body["prompt"] = json!(text),
                    Api::Chat => body["messages"] = json!([{"role": "user", "content": text}]),
                }
                let job = Job {
                    idx: i,
                    session: r.session.clone(),
                    path: me.api.path(),
                    body,
                    max_tokens: r.max_tokens,
                    due,
                    keep_text: false,
                    extra: match phase {
                        Some(p) => json!({"blocks": r.hash_ids.len(), "phase": p.name()}),
                        None => json!({"blocks": r.hash_ids.len()}),
                    },
                };
                dispatch(&ctx, job).await;
            }));
        }
        for h in hs {
            let _ = h.await;
        }
    }
}

/// Shared system prompts (Zipf popularity), multi-turn chats that append turns, and
/// questions about long documents (Zipf popularity too).
pub struct Synthetic {
    sessions: usize,
    rate: f64,
    turns: (usize, usize),
    think: f64,
    sys: Zipf,
    docs: Zipf,
    n_docs: usize,
    system_tokens: usize,
    user_tokens: usize,
    /// Tool output carried by every user turn after the first, uniform in this range.
    tool_tokens: Option<(usize, usize)>,
    doc_tokens: usize,
    doc_fraction: f64,
    max_tokens: u64,
    seed: u64,
    /// Seeds the shared texts (system prompts, documents); `seed` the sessions. Another client
    /// on the same corpus runs with this equal and `seed` different.
    corpus_seed: u64,
    api: Api,
    model: String,
    adapters: AdapterPick,
    counter: AtomicUsize,
}

impl Synthetic {
    pub fn new(a: &Args) -> Self {
        let max_tokens = if a.max_output > 0 {
            a.max_tokens.min(a.max_output)
        } else {
            a.max_tokens
        };
        Synthetic {
            sessions: a.sessions,
            rate: a.rate * a.speed,
            turns: a.turns,
            think: a.think_ms / 1000.0 / a.speed,
            sys: Zipf::new(a.system_prompts.max(1), a.zipf),
            docs: Zipf::new(a.docs.max(1), a.zipf),
            n_docs: a.docs,
            system_tokens: a.system_tokens,
            user_tokens: a.user_tokens.max(1),
            tool_tokens: a.tool_tokens,
            doc_tokens: a.doc_tokens,
            doc_fraction: a.doc_fraction,
            max_tokens: max_tokens.max(1),
            seed: a.seed,
            corpus_seed: a.corpus_seed.unwrap_or(a.seed),
            api: a.api.unwrap_or(Api::Chat),
            model: a.model.clone(),
            adapters: AdapterPick::new(a),
            counter: AtomicUsize::new(0),
        }
    }

    fn words(&self, parts: &[u64], n: usize) -> String {
        let mut s = String::with_capacity(n * 5);
        push_words(&mut s, seed_of(parts), n);
        s
    }

    /// One user turn: the document (first turn of a document conversation), tool output
    /// (turns after the first, with `--tool-tokens`), then the question or instruction.
    fn user_message(&self, s: usize, turn: usize, doc: Option<usize>, st: &mut u64) -> String {
        let mut user = String::new();
        if let (Some(doc), 0) = (doc, turn) {
            user.push_str("Document:");
            user.push_str(&self.words(&[self.corpus_seed, 2, doc as u64], self.doc_tokens));
            user.push_str("\nQuestion:");
        }
        if let Some((lo, hi)) = self.tool_tokens.filter(|_| turn > 0) {
            let n = lo + (splitmix(st) as usize) % (hi - lo + 1);
            user.push_str("Tool output:");
            user.push_str(&self.words(&[self.seed, 4, s as u64, turn as u64], n));
            user.push_str("\nUser:");
        }
        user.push_str(&self.words(&[self.seed, 3, s as u64, turn as u64], self.user_tokens));
        user
    }

    async fn session(self: Arc<Self>, ctx: Arc<Ctx>, s: usize, arrival: f64) {
        let mut st = seed_of(&[self.seed, 0x5e55, s as u64]);
        let sys = self.sys.sample(&mut st);
        let is_doc = self.n_docs > 0 && unit(&mut st) < self.doc_fraction;
        let doc = self.docs.sample(&mut st);
        let turns = self.turns.0 + (splitmix(&mut st) as usize) % (self.turns.1 - self.turns.0 + 1);
        let mut msgs: Vec<Value> = Vec::new();
        // Completions API: the conversation is flattened into one growing prompt.
        let mut flat = String::new();
        if self.system_tokens > 0 {
            let t = format!(
                "System:{}",
                self.words(&[self.corpus_seed, 1, sys as u64], self.system_tokens)
            );
            flat.push_str(&t);
            msgs.push(json!({"role": "system", "content": t}));
        }
        let mut due = arrival;
        for turn in 0..turns {
            let user = self.user_message(s, turn, is_doc.then_some(doc), &mut st);
            flat.push_str("\nUser:");
            flat.push_str(&user);
            flat.push_str("\nAssistant:");
            msgs.push(json!({"role": "user", "content": user}));
            let mut body = base_body(&self.adapters.model(s as u64, &self.model), self.max_tokens);
            match self.api {
                Api::Chat => body["messages"] = json!(msgs),
                Api::Completions => body["prompt"] = json!(flat),
            }
            let job = Job {
                idx: self.counter.fetch_add(1, Ordering::Relaxed),
                session: format!("s{s}"),
                path: self.api.path(),
                body,
                max_tokens: self.max_tokens,
                due,
                keep_text: true,
                extra: json!({
                    "turn": turn,
                    "kind": if is_doc { "doc" } else { "chat" },
                    "system": sys,
                    "doc": if is_doc { json!(doc) } else { Value::Null },
                }),
            };
            let o = dispatch(&ctx, job).await;
            if o.error.is_some() {
                return;
            }
            flat.push_str(&o.text);
            msgs.push(json!({"role": "assistant", "content": o.text}));
            tokio::time::sleep(Duration::from_secs_f64(self.think)).await;
            due = ctx.start.elapsed().as_secs_f64();
        }
    }

    pub async fn run(self, ctx: Arc<Ctx>) {
        let me = Arc::new(self);
        let mut st = seed_of(&[me.seed, 0xa771]);
        let mut t = 0.0;
        let mut hs = Vec::with_capacity(me.sessions);
        for s in 0..me.sessions {
            tokio::time::sleep_until((ctx.start + Duration::from_secs_f64(t)).into()).await;
            hs.push(tokio::spawn(me.clone().session(ctx.clone(), s, t)));
            // Poisson arrivals.
            t += -(1.0 - unit(&mut st)).ln() / me.rate.max(1e-9);
        }
        for h in hs {
            let _ = h.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mock_worker::tokenizer;

    fn req(tokens: usize, hash_ids: &[u64]) -> TraceReq {
        TraceReq {
            ts_ms: 0.0,
            tokens,
            max_tokens: 1,
            hash_ids: hash_ids.to_vec(),
            session: String::new(),
        }
    }

    #[test]
    fn prompts_share_exactly_the_trace_prefix() {
        let mut m = Mooncake {
            reqs: vec![req(24, &[0, 1, 2]), req(20, &[0, 1, 5])],
            burst: None,
            blocks: HashMap::new(),
            block_tokens: 8,
            speed: 1.0,
            seed: 3,
            api: Api::Completions,
            model: String::new(),
            adapters: AdapterPick {
                zipf: None,
                seed: 0,
            },
        };
        let uncached = [m.prompt(&m.reqs[0]), m.prompt(&m.reqs[1])];
        m.generate_blocks();
        // Full blocks come from the pre-generated texts, the partial one is made on the fly.
        assert_eq!(m.blocks.len(), 3);
        let (a, b) = (m.prompt(&m.reqs[0]), m.prompt(&m.reqs[1]));
        assert_eq!([a.clone(), b.clone()], uncached);
        let (ta, tb) = (tokenizer::encode(&a), tokenizer::encode(&b));
        assert_eq!((ta.len(), tb.len()), (24, 20));
        assert_eq!(ta[..16], tb[..16]);
        assert_ne!(ta[16..20], tb[16..20]);
        // A partial last block shares the full block's tokens up to its cut.
        let c = m.prompt(&req(19, &[0, 1, 2]));
        assert_eq!(tokenizer::encode(&c)[..16], ta[..16]);
    }

    #[test]
    fn a_burst_compresses_its_window_and_shifts_what_follows() {
        let b = Burst::parse("0.4:0.2:4").unwrap();
        let span = 100.0;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        // Before the window: as recorded. Inside: 4x faster. After: recorded gaps, 15 s early.
        assert!(close(b.map(10.0, span), 10.0));
        assert!(close(b.map(40.0, span), 40.0));
        assert!(close(b.map(48.0, span), 42.0));
        assert!(close(b.map(60.0, span), 45.0));
        assert!(close(b.map(70.0, span), 55.0));
        assert!(close(b.map(100.0, span), 85.0));
        assert_eq!(
            [
                b.phase(39.9, span),
                b.phase(40.0, span),
                b.phase(60.5, span)
            ],
            [Phase::Before, Phase::Burst, Phase::After]
        );
        let mut m = Mooncake {
            reqs: (0..5)
                .map(|i| TraceReq {
                    ts_ms: 25_000.0 * f64::from(i),
                    ..req(8, &[0])
                })
                .collect(),
            burst: Some(Burst::parse("0.25:0.5:2").unwrap()),
            blocks: HashMap::new(),
            block_tokens: 8,
            speed: 2.0,
            seed: 1,
            api: Api::Completions,
            model: String::new(),
            adapters: AdapterPick {
                zipf: None,
                seed: 0,
            },
        };
        // 100 s of trace, 25-75 s twice as fast (25 s saved), all of it at speed 2.
        assert!(close(m.span(), 37.5));
        let want = [
            (0.0, Phase::Before),
            (12.5, Phase::Burst),
            (18.75, Phase::Burst),
            (25.0, Phase::After),
            (37.5, Phase::After),
        ];
        for (i, (t, p)) in want.into_iter().enumerate() {
            let (due, phase) = m.due(i, 100.0);
            assert!(close(due, t) && phase == Some(p), "{i}: {due} {phase:?}");
        }
        m.burst = None;
        assert_eq!(m.due(4, 100.0), (50.0, None));
    }

    #[test]
    fn burst_flags_are_checked() {
        for bad in [
            "0.5:0.6:2",
            "0.1:0:2",
            "-0.1:0.2:2",
            "0.1:0.2:0",
            "0.1:0.2",
            "a:b:c",
            "0.1:0.2:inf",
        ] {
            assert!(Burst::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            Burst::parse("0:1:1.5"),
            Ok(Burst {
                at: 0.0,
                len: 1.0,
                factor: 1.5
            })
        );
    }

    fn synthetic(tool_tokens: Option<(usize, usize)>) -> Synthetic {
        Synthetic {
            sessions: 1,
            rate: 1.0,
            turns: (1, 1),
            think: 0.0,
            sys: Zipf::new(1, 1.1),
            docs: Zipf::new(1, 1.1),
            n_docs: 0,
            system_tokens: 0,
            user_tokens: 20,
            tool_tokens,
            doc_tokens: 0,
            doc_fraction: 0.0,
            max_tokens: 1,
            seed: 7,
            corpus_seed: 7,
            api: Api::Chat,
            model: String::new(),
            adapters: AdapterPick {
                zipf: None,
                seed: 0,
            },
            counter: AtomicUsize::new(0),
        }
    }

    #[test]
    fn tool_output_of_the_drawn_size_after_the_first_turn() {
        let plain = synthetic(None);
        let w = synthetic(Some((500, 3000)));
        let mut st = 5;
        // The first turn is the task alone; without --tool-tokens every turn is.
        assert_eq!(tokenizer::count(&w.user_message(0, 0, None, &mut st)), 20);
        assert_eq!(
            tokenizer::count(&plain.user_message(0, 3, None, &mut st)),
            20
        );
        let sizes: Vec<usize> = (1..60)
            .map(|turn| tokenizer::count(&w.user_message(0, turn, None, &mut st)) - 20)
            .collect();
        // "Tool output:" and "\nUser:" add a few tokens to the drawn size.
        assert!(
            sizes.iter().all(|&n| (500..=3000 + 16).contains(&n)),
            "{sizes:?}"
        );
        assert!(
            sizes.iter().any(|&n| n < 1200) && sizes.iter().any(|&n| n > 2300),
            "{sizes:?}"
        );
        // Deterministic in the session's sampling state.
        let (mut a, mut b) = (9, 9);
        assert_eq!(
            w.user_message(3, 2, None, &mut a),
            w.user_message(3, 2, None, &mut b)
        );
    }

    #[test]
    fn corpus_seed_shares_documents_not_questions() {
        let doc = |seed, corpus_seed| Synthetic {
            n_docs: 4,
            doc_tokens: 300,
            seed,
            corpus_seed,
            ..synthetic(None)
        };
        let (a, b, c) = (doc(7, 7), doc(8, 7), doc(8, 8));
        let mut st = 1;
        let (ma, mb, mc) = (
            a.user_message(0, 0, Some(2), &mut st),
            b.user_message(0, 0, Some(2), &mut st),
            c.user_message(0, 0, Some(2), &mut st),
        );
        let document = |m: &str| m.split("\nQuestion:").next().unwrap_or("").to_string();
        assert_eq!(document(&ma), document(&mb));
        assert_ne!(document(&mb), document(&mc));
        assert_ne!(ma, mb, "the sessions' own text follows --seed");
    }
}
