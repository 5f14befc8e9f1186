//! The simulated engine: a vLLM-style continuous-batching scheduler over the paged KV cache,
//! driven by one loop task whose passes last as long as Dynamo's mocker model says.
//!
//! Each pass is split in two halves around the sleep: `schedule` decides what runs (and
//! allocates KV), `commit` applies the results (computed tokens, new output tokens). As in
//! vLLM, full blocks are registered in the prefix cache when they are allocated for the
//! tokens scheduled (so a later request scheduled in the same pass already hits them);
//! `--cache-at-pass-end` registers them in `commit` instead (the mock's old behaviour).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify};

use crate::config::Config;
use crate::kv::{self, BlockId, KvCache};
use crate::kv_events::{Batch, KvEvent};
use crate::metrics::Metrics;
use crate::tokenizer;

/// Output vocabulary: short words so each is exactly one token with its leading space, and
/// the generated text re-tokenizes to the ids the engine cached (a client that sends the
/// answer back in the next chat turn gets cache hits on it, as with a real engine).
pub const WORDS: [&str; 32] = [
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "it", "by",
    "at", "from", "his", "an", "were", "are", "which", "this", "be", "or", "has", "had", "not",
    "but", "one", "its", "new", "after",
];

pub fn output_text(i: usize) -> &'static str {
    static TEXTS: OnceLock<Vec<String>> = OnceLock::new();
    &TEXTS.get_or_init(|| WORDS.iter().map(|w| format!(" {w}")).collect())[i % WORDS.len()]
}

fn output_token(i: usize) -> u32 {
    static IDS: OnceLock<Vec<u32>> = OnceLock::new();
    IDS.get_or_init(|| {
        (0..WORDS.len())
            .map(|i| tokenizer::piece_id(output_text(i)))
            .collect()
    })[i % WORDS.len()]
}

/// Prefill attention against context already in the KV cache, ms per (new token x context
/// token). Dynamo's prefill model `4.21e-7 t^2 + 0.01518 t + 16.5` is fitted on cold prompts,
/// where its quadratic term is attention: token i attends to i earlier tokens, so the work is
/// about t^2 / 2 token pairs and one pair costs 2 x 4.21e-7 ms. A chunk of t new tokens on
/// top of c tokens already in context adds t x c pairs.
pub const CONTEXT_ATTENTION_MS: f64 = 2.0 * 4.21e-7;

/// Dynamo mocker: milliseconds of one pass with `t` new prefill tokens at KV usage `p`.
/// `context_pairs` is the sum over prefilling requests of new tokens x tokens already in
/// their context (0 with `--no-context-attention`).
pub fn pass_ms(t: usize, context_pairs: f64, decoding: bool, p: f64) -> f64 {
    let prefill = if t > 0 {
        let t = t as f64;
        4.21e-7 * t * t + 0.01518 * t + 16.5 + CONTEXT_ATTENTION_MS * context_pairs
    } else {
        0.0
    };
    let decode = if decoding {
        (-25.74 * p * p + 54.01 * p + 5.74).max(1.0)
    } else {
        0.0
    };
    prefill + decode
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// vLLM 0.32's `created_cache_tokens`: prompt tokens this request added to the prefix
    /// cache (its full prompt blocks, less what it found cached).
    pub created_cache_tokens: usize,
}

/// When a request's work happened on the engine's own schedule (simulated time in wall-clock
/// units: what a client would see if the process always kept up).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Arrival to the end of the pass that produced the first output token, seconds.
    pub ttft: f64,
    /// Arrival to the end of the pass that produced the last output token, seconds.
    pub e2e: f64,
}

#[derive(Debug)]
pub enum Event {
    /// Output token number `i` (0-based) was produced.
    Token(usize),
    Done(Usage, Timing),
}

pub struct NewRequest {
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    pub salt: Option<String>,
    /// Leading prompt tokens whose KV arrives from a prefill worker instead of being computed.
    pub transferred: usize,
    /// LoRA adapter: 0 the base model, i the i-th of `--lora-modules` (1-based, as vLLM's
    /// `lora_int_id`).
    pub lora: u16,
}

struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    generated: usize,
    root: u64,
    hashes: Vec<u64>,
    blocks: Vec<BlockId>,
    /// Tokens whose KV is computed (or received).
    computed: usize,
    /// Full blocks already registered in the cache.
    registered: usize,
    /// Tokens scheduled in the current pass.
    scheduled: usize,
    /// Length to (re)compute at admission: the prompt, plus output so far after preemption.
    prefill_target: usize,
    transferred: usize,
    lora: u16,
    cached_tokens: Option<usize>,
    arrival: Instant,
    /// Scheduled end of the pass that produced the first output token.
    first_token: Option<Instant>,
    tx: mpsc::UnboundedSender<Event>,
}

impl Seq {
    /// Tokenized prompt to queued sequence; the hashing happens here, outside the engine lock.
    fn new(
        req: NewRequest,
        bs: usize,
        lora_names: &[String],
        arrival: Instant,
    ) -> (Seq, mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let root = request_root(req.salt.as_deref(), req.lora, lora_names);
        let mut hashes = Vec::with_capacity((req.tokens.len() + req.max_tokens) / bs + 1);
        kv::extend_hashes(&mut hashes, root, &req.tokens, bs);
        let prompt_len = req.tokens.len();
        let mut tokens = req.tokens;
        // Room for the whole output up front: no reallocation while decoding.
        tokens.reserve_exact(req.max_tokens);
        let seq = Seq {
            tokens,
            prompt_len,
            max_tokens: req.max_tokens,
            generated: 0,
            root,
            hashes,
            blocks: Vec::new(),
            computed: 0,
            registered: 0,
            scheduled: 0,
            prefill_target: prompt_len,
            transferred: req.transferred,
            lora: req.lora,
            cached_tokens: None,
            arrival,
            first_token: None,
            tx,
        };
        (seq, rx)
    }
}

/// The chain root of a request with this salt and adapter (see `kv::adapter_root`).
pub fn request_root(salt: Option<&str>, lora: u16, lora_names: &[String]) -> u64 {
    let name = usize::from(lora)
        .checked_sub(1)
        .and_then(|i| lora_names.get(i));
    kv::adapter_root(kv::chain_root(salt), name.map(String::as_str))
}

/// The engine's adapter slots (vLLM's `--max-loras`), least recently used first.
#[derive(Debug, Default)]
pub struct LoraSlots {
    max: usize,
    /// Adapter ids held, least recently used first.
    held: Vec<u16>,
    pub loads: u64,
}

impl LoraSlots {
    /// Makes room for `lora` and holds it, evicting the least recently used adapter that no
    /// request in `busy` uses; whether it had to be loaded. `None`: every slot is busy.
    fn acquire(&mut self, lora: u16, busy: &[u16]) -> Option<bool> {
        if let Some(i) = self.held.iter().position(|&l| l == lora) {
            self.held.remove(i);
            self.held.push(lora);
            return Some(false);
        }
        if self.held.len() >= self.max {
            let i = self.held.iter().position(|l| !busy.contains(l))?;
            self.held.remove(i);
        }
        self.held.push(lora);
        self.loads += 1;
        Some(true)
    }

    pub fn held(&self) -> &[u16] {
        &self.held
    }
}

/// What one pass costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pass {
    /// Adapter loads the pass waits for, ms (vLLM loads them inside the step).
    pub lora_load_ms: f64,
    pub prefill_tokens: usize,
    /// Sum over prefilling requests of tokens scheduled x tokens already in their context.
    pub context_pairs: f64,
    pub decode_seqs: usize,
    pub usage: f64,
    pub preempted: usize,
}

impl Pass {
    pub fn ms(&self) -> f64 {
        self.lora_load_ms
            + pass_ms(
                self.prefill_tokens,
                self.context_pairs,
                self.decode_seqs > 0,
                self.usage,
            )
    }
}

pub struct EngineState {
    pub cache: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    block_size: usize,
    max_batched_tokens: usize,
    max_num_seqs: usize,
    context_attention: bool,
    cache_at_schedule: bool,
    /// `Format::legacy`: AllBlocksCleared at start-up and at once on a reset.
    legacy_events: bool,
    pub metrics: Metrics,
    pub lora_names: Vec<String>,
    pub lora_slots: LoraSlots,
    lora_load_ms: f64,
    /// vLLM's `vllm:lora_requests_info` series: label values (waiting, running adapters)
    /// and when each was last current (unix seconds); vLLM never removes a label set.
    pub lora_info: Vec<((String, String), f64)>,
    /// `--kv-events`: where each step's KV cache events go (never waited on).
    events_tx: Option<mpsc::Sender<Batch>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
}

impl EngineState {
    pub fn new(cfg: &Config) -> Self {
        // vLLM's null block: one of num_gpu_blocks is never allocated.
        let usable = if cfg.null_block {
            cfg.kv_blocks.saturating_sub(1).max(1)
        } else {
            cfg.kv_blocks
        };
        let cache = KvCache::new(usable);
        EngineState {
            cache: if cfg.duplicate_blocks {
                cache
            } else {
                cache.single_copies()
            },
            legacy_events: cfg.kv_events_format.legacy(),
            waiting: VecDeque::new(),
            running: Vec::with_capacity(cfg.max_num_seqs),
            block_size: cfg.block_size,
            max_batched_tokens: cfg.max_batched_tokens,
            max_num_seqs: cfg.max_num_seqs,
            context_attention: cfg.context_attention,
            cache_at_schedule: !cfg.cache_at_pass_end,
            metrics: Metrics::default(),
            lora_names: cfg.lora_modules.clone(),
            lora_slots: LoraSlots {
                max: cfg.max_loras,
                ..LoraSlots::default()
            },
            lora_load_ms: cfg.lora_load_ms,
            lora_info: Vec::new(),
            events_tx: None,
        }
    }

    /// Adapter names of the waiting and the running requests, comma-separated in order of
    /// first appearance, as vLLM labels `vllm:lora_requests_info`.
    fn lora_labels(&self) -> (String, String) {
        let names = |it: &mut dyn Iterator<Item = u16>| {
            let mut seen: Vec<u16> = Vec::new();
            for l in it {
                if l > 0 && !seen.contains(&l) {
                    seen.push(l);
                }
            }
            let v: Vec<&str> = seen
                .iter()
                .filter_map(|&l| self.lora_names.get(usize::from(l) - 1))
                .map(String::as_str)
                .collect();
            v.join(",")
        };
        (
            names(&mut self.waiting.iter().map(|s| s.lora)),
            names(&mut self.running.iter().map(|s| s.lora)),
        )
    }

    /// Stamps the current label set of `vllm:lora_requests_info` (after every pass, as vLLM
    /// records its stats each step). The list is bounded: the stalest sets go first.
    fn record_lora_info(&mut self) {
        if self.lora_names.is_empty() {
            return;
        }
        let labels = self.lora_labels();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        match self.lora_info.iter_mut().find(|(l, _)| *l == labels) {
            Some(e) => e.1 = now,
            None => {
                if self.lora_info.len() >= 256 {
                    self.lora_info.remove(0);
                }
                self.lora_info.push((labels, now));
            }
        }
        self.lora_info.sort_by(|a, b| a.1.total_cmp(&b.1));
    }

    /// Starts publishing KV cache events to `tx`; the old mock's formats begin with
    /// AllBlocksCleared (vLLM 0.32 publishes nothing before its first cache change).
    pub fn publish_events(&mut self, tx: mpsc::Sender<Batch>) {
        self.cache.enable_events();
        self.events_tx = Some(tx);
        if self.legacy_events {
            self.send_batch(vec![KvEvent::AllBlocksCleared]);
        }
    }

    /// Hands this step's events to the publisher, or drops and counts them when its queue is
    /// full: the engine never waits for subscribers.
    fn flush_events(&mut self) {
        if self.events_tx.is_some() {
            let events = self.cache.take_events();
            if !events.is_empty() {
                self.send_batch(events);
            }
        }
    }

    fn send_batch(&mut self, events: Vec<KvEvent>) {
        if let Some(tx) = &self.events_tx {
            if tx.try_send(Batch::now(events)).is_err() {
                self.metrics.kv_event_batches_dropped += 1;
            }
        }
    }

    /// vLLM's `POST /reset_prefix_cache`. Its AllBlocksCleared leaves with the next pass's
    /// events, as vLLM's does with its next step's (the old formats: at once).
    pub fn reset_prefix_cache(&mut self) {
        self.cache.reset_prefix_cache();
        if self.legacy_events {
            self.flush_events();
        }
    }

    pub fn load(&self) -> Load {
        Load {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_usage: self.cache.usage(),
        }
    }

    /// Prompt tokens that would be served from cache now: full blocks only, and never the
    /// last prompt token (it must be computed to produce the first output token).
    fn hit_blocks(&self, hashes: &[u64], len: usize) -> usize {
        let max = (len - 1) / self.block_size;
        self.cache.lookup(&hashes[..max.min(hashes.len())])
    }

    /// Read-only cache probe: (prompt tokens, cached tokens).
    pub fn probe(&self, tokens: &[u32], salt: Option<&str>) -> (usize, usize) {
        let mut hashes = Vec::new();
        let root = request_root(salt, 0, &self.lora_names);
        kv::extend_hashes(&mut hashes, root, tokens, self.block_size);
        (
            tokens.len(),
            self.hit_blocks(&hashes, tokens.len()) * self.block_size,
        )
    }

    pub fn submit(&mut self, req: NewRequest, arrival: Instant) -> mpsc::UnboundedReceiver<Event> {
        let (seq, rx) = Seq::new(req, self.block_size, &self.lora_names, arrival);
        self.enqueue(seq);
        rx
    }

    /// Queues in arrival order: a request whose parsing took longer than a later one's still
    /// goes first, as it would had the engine received it on arrival.
    fn enqueue(&mut self, seq: Seq) {
        let at = self
            .waiting
            .iter()
            .rposition(|w| w.arrival <= seq.arrival)
            .map_or(0, |i| i + 1);
        self.waiting.insert(at, seq);
    }

    /// Arrival of the earliest queued request.
    pub fn first_arrival(&self) -> Option<Instant> {
        self.waiting.iter().map(|s| s.arrival).min()
    }

    /// Prefix-cache probe over precomputed block hashes; see `hit_blocks`.
    pub fn probe_hashes(&self, hashes: &[u64], len: usize) -> usize {
        self.hit_blocks(hashes, len) * self.block_size
    }

    /// Registers the full blocks of the first `upto` tokens not registered yet.
    fn register_full(cache: &mut KvCache, s: &mut Seq, upto: usize, bs: usize) {
        let full = upto / bs;
        if full > s.registered {
            kv::extend_hashes(&mut s.hashes, s.root, &s.tokens[..full * bs], bs);
            cache.register_run(&s.blocks, &s.hashes, &s.tokens, bs, s.registered, full);
            s.registered = full;
        }
    }

    fn preempt(cache: &mut KvCache, mut s: Seq) -> Seq {
        cache.release(&mut s.blocks);
        s.computed = 0;
        s.registered = 0;
        s.scheduled = 0;
        s
    }

    /// First half of a pass. Returns `None` when there is nothing to run.
    pub fn schedule(&mut self) -> Option<Pass> {
        self.schedule_at(None)
    }

    /// `schedule` for a pass starting at `start`: requests that arrived after it wait for
    /// the next pass, as they would on an engine that received them on arrival.
    pub fn schedule_at(&mut self, start: Option<Instant>) -> Option<Pass> {
        let bs = self.block_size;
        let mut budget = self.max_batched_tokens;
        let mut preempted = 0;
        let cache = &mut self.cache;

        // Running requests first, in admission order: one token each when decoding, the next
        // chunk when still prefilling.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let n = (s.tokens.len() - s.computed).min(budget);
            let need = (s.computed + n).div_ceil(bs).saturating_sub(s.blocks.len());
            if cache.allocate(need, &mut self.running[i].blocks) {
                let s = &mut self.running[i];
                s.scheduled = n;
                if self.cache_at_schedule {
                    Self::register_full(cache, s, s.computed + n, bs);
                }
                budget -= n;
                i += 1;
                continue;
            }
            // Out of KV: recompute-preempt the newest request and retry (possibly this one).
            let victim = self.running.pop().expect("running is not empty");
            self.waiting.push_front(Self::preempt(cache, victim));
            preempted += 1;
        }

        // Then admit waiting requests FCFS, unless this pass already had to preempt. As in
        // vLLM, a request whose adapter needs a slot while every slot serves running
        // requests stays waiting, and the ones behind it may pass.
        let mut busy: Vec<u16> = self
            .running
            .iter()
            .map(|s| s.lora)
            .filter(|&l| l > 0)
            .collect();
        busy.sort_unstable();
        busy.dedup();
        let mut loads = 0usize;
        let mut j = 0;
        while preempted == 0 && budget > 0 && self.running.len() < self.max_num_seqs {
            let Some(s) = self.waiting.get(j) else { break };
            if start.is_some_and(|t| s.arrival > t) {
                break;
            }
            if s.tx.is_closed() {
                self.waiting.remove(j);
                continue;
            }
            let lora = s.lora;
            if lora > 0 && !busy.contains(&lora) && busy.len() >= self.lora_slots.max {
                j += 1;
                continue;
            }
            let len = s.tokens.len();
            let hit = {
                let max = (len - 1) / bs;
                cache.lookup(&s.hashes[..max.min(s.hashes.len())])
            };
            let first = s.cached_tokens.is_none();
            let transferred = if first { s.transferred.min(len - 1) } else { 0 };
            let computed = (hit * bs).max(transferred);
            let n = (len - computed).min(budget);
            let need = (computed + n).div_ceil(bs) - hit;
            let available = cache.free() - cache.free_among_hits(&s.hashes[..hit]);
            if need > available {
                break;
            }
            if lora > 0 {
                match self.lora_slots.acquire(lora, &busy) {
                    Some(loaded) => {
                        loads += usize::from(loaded);
                        if !busy.contains(&lora) {
                            busy.push(lora);
                        }
                    }
                    None => {
                        j += 1;
                        continue;
                    }
                }
            }
            let mut s = self.waiting.remove(j).unwrap();
            cache.acquire_hits(&s.hashes[..hit], &mut s.blocks);
            assert!(cache.allocate(need, &mut s.blocks));
            // Transferred KV arrived already computed: its full blocks become cacheable now.
            let full = computed / bs;
            kv::extend_hashes(&mut s.hashes, s.root, &s.tokens[..full * bs], bs);
            if full > hit {
                cache.register_run(&s.blocks, &s.hashes, &s.tokens, bs, hit, full);
            }
            s.registered = full;
            s.computed = computed;
            s.scheduled = n;
            s.prefill_target = len;
            if self.cache_at_schedule {
                Self::register_full(cache, &mut s, computed + n, bs);
            }
            if first {
                s.cached_tokens = Some(computed);
                self.metrics.prefix_cache_queries += s.prompt_len as u64;
                self.metrics.prefix_cache_hits += (hit * bs) as u64;
            }
            budget -= n;
            self.running.push(s);
        }
        self.metrics.preemptions += preempted as u64;
        self.metrics.evicted_blocks = self.cache.evictions;
        self.flush_events();

        let mut pass = Pass {
            lora_load_ms: loads as f64 * self.lora_load_ms,
            prefill_tokens: 0,
            context_pairs: 0.0,
            decode_seqs: 0,
            usage: self.cache.usage(),
            preempted,
        };
        for s in &self.running {
            if s.scheduled == 0 {
                continue;
            }
            if s.computed < s.prefill_target {
                pass.prefill_tokens += s.scheduled;
                if self.context_attention {
                    pass.context_pairs += s.scheduled as f64 * s.computed as f64;
                }
            } else {
                pass.decode_seqs += 1;
            }
        }
        (pass.prefill_tokens > 0 || pass.decode_seqs > 0).then_some(pass)
    }

    /// Second half of a pass: the scheduled tokens are computed at `now`, the pass's end on
    /// the engine's schedule.
    pub fn commit(&mut self, now: Instant) {
        let bs = self.block_size;
        let cache = &mut self.cache;
        let m = &mut self.metrics;
        self.running.retain_mut(|s| {
            if s.scheduled == 0 {
                return true;
            }
            s.computed += s.scheduled;
            s.scheduled = 0;
            Self::register_full(cache, s, s.computed, bs);
            if s.computed < s.tokens.len() {
                return true; // chunked prefill continues next pass
            }
            let idx = s.generated;
            s.generated += 1;
            s.tokens.push(output_token(idx));
            m.generation_tokens += 1;
            if idx == 0 {
                s.first_token = Some(now);
                m.ttft
                    .observe(now.saturating_duration_since(s.arrival).as_secs_f64());
            }
            let alive = s.tx.send(Event::Token(idx)).is_ok();
            let done = s.generated >= s.max_tokens;
            if done {
                m.request_success += 1;
                m.prompt_tokens += s.prompt_len as u64;
                let since = |t: Instant| t.saturating_duration_since(s.arrival).as_secs_f64();
                let timing = Timing {
                    ttft: since(s.first_token.unwrap_or(now)),
                    e2e: since(now),
                };
                let _ = s.tx.send(Event::Done(
                    Usage {
                        prompt_tokens: s.prompt_len,
                        completion_tokens: s.generated,
                        cached_tokens: s.cached_tokens.unwrap_or(0),
                        created_cache_tokens: (s.prompt_len / bs * bs)
                            .saturating_sub(s.cached_tokens.unwrap_or(0)),
                    },
                    timing,
                ));
            }
            if done || !alive {
                if !done {
                    m.aborted += 1;
                }
                cache.release(&mut s.blocks);
                return false;
            }
            true
        });
        self.flush_events();
        self.record_lora_info();
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// When the next pass can start, given the end of the last one: at once if requests are
    /// running, else when the first queued request arrived (stamped on receipt, however long
    /// reading and parsing it took). `None` when there is nothing to do.
    pub fn next_start(&self, clock: Instant) -> Option<Instant> {
        if !self.running.is_empty() {
            return Some(clock);
        }
        self.first_arrival().map(|a| a.max(clock))
    }
}

/// Everything the HTTP side shares with the engine loop.
pub struct Shared {
    pub cfg: Config,
    pub name: String,
    pub state: Mutex<EngineState>,
    pub wake: Notify,
    /// Requests received (arrival stamped) but not yet submitted: still reading or parsing.
    pending: Mutex<Vec<(u64, Instant)>>,
    pending_changed: Notify,
    next_arrival: std::sync::atomic::AtomicU64,
    /// Before any request can arrive: the engine's clock starts here, not when its task first
    /// runs (on a loaded machine that can be after the first arrival, which would then wait).
    created: Instant,
}

/// A request between its arrival and its submission to the engine. The engine holds back a
/// pass while a request that arrived before the pass's start is still being parsed, so
/// parsing and tokenizing time (which a loaded process stretches) does not reorder admission.
pub struct Arrival {
    shared: Arc<Shared>,
    id: u64,
    pub at: Instant,
}

impl Drop for Arrival {
    fn drop(&mut self) {
        self.shared
            .pending
            .lock()
            .unwrap()
            .retain(|&(id, _)| id != self.id);
        self.shared.pending_changed.notify_waiters();
    }
}

impl Shared {
    pub fn new(cfg: Config, name: String) -> Arc<Self> {
        Arc::new(Shared {
            state: Mutex::new(EngineState::new(&cfg)),
            cfg,
            name,
            wake: Notify::new(),
            pending: Mutex::new(Vec::new()),
            pending_changed: Notify::new(),
            next_arrival: std::sync::atomic::AtomicU64::new(0),
            created: Instant::now(),
        })
    }

    /// Stamps a request's arrival; call on receipt, before reading the body.
    pub fn arrive(self: &Arc<Self>) -> Arrival {
        let id = self
            .next_arrival
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let at = Instant::now();
        self.pending.lock().unwrap().push((id, at));
        Arrival {
            shared: self.clone(),
            id,
            at,
        }
    }

    pub fn submit(&self, req: NewRequest, arrival: Arrival) -> mpsc::UnboundedReceiver<Event> {
        let (seq, rx) = Seq::new(req, self.cfg.block_size, &self.cfg.lora_modules, arrival.at);
        self.state.lock().unwrap().enqueue(seq);
        // Queued before the arrival leaves the pending list, so the engine sees it in one or
        // the other.
        drop(arrival);
        self.wake.notify_one();
        rx
    }

    pub fn load(&self) -> Load {
        self.state.lock().unwrap().load()
    }

    /// Waits (boundedly) until no request that arrived before `start` is still being parsed.
    async fn await_arrivals_before(&self, start: Instant) {
        let give_up = Instant::now() + MAX_PARSE_WAIT;
        loop {
            let changed = self.pending_changed.notified();
            let blocking = self
                .pending
                .lock()
                .unwrap()
                .iter()
                .any(|&(_, at)| at < start);
            let now = Instant::now();
            if !blocking || now >= give_up {
                return;
            }
            let _ = tokio::time::timeout(give_up - now, changed).await;
        }
    }
}

/// How long a pass waits for requests that arrived before it but are still being parsed.
const MAX_PARSE_WAIT: Duration = Duration::from_millis(50);

/// How far the loop may fall behind its schedule before it gives up catching up. Passes run
/// on an absolute schedule: each starts when the previous one was due to end, not when the
/// thread happened to wake, so a late wake-up (timer granularity, CPU taken by the router or
/// other processes) delays delivery but not the simulated times, and later passes run back to
/// back until the schedule is met. Only a stall longer than this (a stopped process) resets
/// the schedule to now; the difference is counted in `mock:engine_lag_seconds_total`.
const MAX_CATCH_UP: Duration = Duration::from_secs(1);

pub async fn run(shared: Arc<Shared>) {
    let speedup = shared.cfg.speedup;
    // End of the last pass on the schedule (the engine's simulated clock).
    let mut clock = shared.created;
    loop {
        let next = shared.state.lock().unwrap().next_start(clock);
        let Some(mut start) = next else {
            shared.wake.notified().await;
            continue;
        };
        let now = Instant::now();
        let mut lag = Duration::ZERO;
        if now.saturating_duration_since(start) > MAX_CATCH_UP {
            lag = now - start;
            start = now;
        }
        shared.await_arrivals_before(start).await;
        let pass = shared.state.lock().unwrap().schedule_at(Some(start));
        let Some(pass) = pass else {
            // Nothing could run (the queue cannot be admitted): wait for a change.
            shared.wake.notified().await;
            continue;
        };
        let dur = Duration::from_secs_f64(pass.ms() / 1000.0 / speedup);
        let end = start + dur;
        clock = end;
        if end > Instant::now() {
            tokio::time::sleep_until(end.into()).await;
        } else {
            tokio::task::yield_now().await;
        }
        lag += Instant::now().saturating_duration_since(end);
        let mut st = shared.state.lock().unwrap();
        st.commit(end);
        st.metrics.passes += 1;
        st.metrics.simulated_seconds += dur.as_secs_f64();
        st.metrics.lag_seconds += lag.as_secs_f64();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(kv_blocks: usize, budget: usize, seqs: usize) -> Config {
        Config {
            kv_blocks,
            max_batched_tokens: budget,
            max_num_seqs: seqs,
            block_size: 4,
            // The scheduling tests count blocks as given (`kv_blocks_include_vllms_null_block`).
            null_block: false,
            ..Config::default()
        }
    }

    fn req(seed: u32, len: usize, max_tokens: usize) -> NewRequest {
        NewRequest {
            tokens: (0..len as u32).map(|i| seed * 100_000 + i).collect(),
            max_tokens,
            salt: None,
            transferred: 0,
            lora: 0,
        }
    }

    /// Runs passes until idle; returns the passes.
    fn drain(st: &mut EngineState) -> Vec<Pass> {
        let mut v = vec![];
        while let Some(p) = st.schedule() {
            st.commit(Instant::now());
            v.push(p);
            assert!(v.len() < 10_000, "engine does not converge");
        }
        v
    }

    fn done(rx: &mut mpsc::UnboundedReceiver<Event>) -> Usage {
        let mut tokens = 0;
        while let Ok(e) = rx.try_recv() {
            match e {
                Event::Token(i) => {
                    assert_eq!(i, tokens);
                    tokens += 1;
                }
                Event::Done(u, _) => {
                    assert_eq!(u.completion_tokens, tokens);
                    return u;
                }
            }
        }
        panic!("request did not finish");
    }

    #[test]
    fn timing_model_matches_dynamo() {
        assert_eq!(pass_ms(0, 0.0, false, 0.0), 0.0);
        assert!((pass_ms(1000, 0.0, false, 0.0) - (0.421 + 15.18 + 16.5)).abs() < 1e-9);
        assert!((pass_ms(0, 0.0, true, 0.0) - 5.74).abs() < 1e-9);
        assert!((pass_ms(0, 0.0, true, 0.5) - (-6.435 + 27.005 + 5.74)).abs() < 1e-9);
    }

    #[test]
    fn token_budget_bounds_every_pass_and_prefill_is_chunked() {
        let mut st = EngineState::new(&cfg(1000, 64, 8));
        let mut rxs: Vec<_> = (0..4)
            .map(|i| st.submit(req(i, 100, 5), Instant::now()))
            .collect();
        let passes = drain(&mut st);
        for p in &passes {
            assert!(p.prefill_tokens + p.decode_seqs <= 64, "{p:?}");
        }
        // 400 prompt tokens at 64 per pass need at least 7 passes of prefill.
        assert!(passes.iter().filter(|p| p.prefill_tokens > 0).count() >= 7);
        assert_eq!(passes.iter().map(|p| p.prefill_tokens).sum::<usize>(), 400);
        for rx in &mut rxs {
            assert_eq!(
                done(rx),
                Usage {
                    prompt_tokens: 100,
                    completion_tokens: 5,
                    cached_tokens: 0,
                    created_cache_tokens: 100,
                }
            );
        }
    }

    #[test]
    fn decode_one_token_per_running_request_per_pass() {
        let mut st = EngineState::new(&cfg(1000, 1000, 8));
        let mut rxs: Vec<_> = (0..3)
            .map(|i| st.submit(req(i, 10, 4), Instant::now()))
            .collect();
        let p = st.schedule().unwrap();
        assert_eq!((p.prefill_tokens, p.decode_seqs), (30, 0));
        st.commit(Instant::now());
        for rx in &mut rxs {
            assert!(matches!(rx.try_recv(), Ok(Event::Token(0))));
        }
        let p = st.schedule().unwrap();
        assert_eq!((p.prefill_tokens, p.decode_seqs), (0, 3));
    }

    #[test]
    fn prefix_hit_skips_prefill_and_is_reported() {
        let mut st = EngineState::new(&cfg(1000, 1000, 8));
        let mut a = st.submit(req(1, 50, 2), Instant::now());
        drain(&mut st);
        assert_eq!(done(&mut a).cached_tokens, 0);
        assert_eq!(st.probe(&req(1, 50, 2).tokens, None), (50, 48));
        assert_eq!(st.probe(&req(1, 50, 2).tokens, Some("salt")), (50, 0));
        let mut b = st.submit(req(1, 50, 2), Instant::now());
        let p = st.schedule().unwrap();
        assert_eq!(p.prefill_tokens, 2, "only the tail after 12 cached blocks");
        st.commit(Instant::now());
        drain(&mut st);
        assert_eq!(done(&mut b).cached_tokens, 48);
        assert_eq!(
            (
                st.metrics.prefix_cache_queries,
                st.metrics.prefix_cache_hits
            ),
            (100, 48)
        );
    }

    #[test]
    fn same_prefix_scheduled_in_the_same_pass_already_hits() {
        // vLLM caches full blocks when it allocates them: B, admitted right after A in the
        // same pass, finds A's 12 full blocks and prefills only the last 2 tokens.
        let mut st = EngineState::new(&cfg(1000, 1000, 8));
        let mut a = st.submit(req(1, 50, 2), Instant::now());
        let mut b = st.submit(req(1, 50, 2), Instant::now());
        let p = st.schedule().unwrap();
        assert_eq!(p.prefill_tokens, 50 + 2);
        drain(&mut st);
        assert_eq!(done(&mut a).cached_tokens, 0);
        assert_eq!(done(&mut b).cached_tokens, 48);
        // The old behaviour: blocks become hits only when their pass ends.
        let mut st = EngineState::new(&Config {
            cache_at_pass_end: true,
            ..cfg(1000, 1000, 8)
        });
        let _a = st.submit(req(1, 50, 2), Instant::now());
        let mut b = st.submit(req(1, 50, 2), Instant::now());
        assert_eq!(st.schedule().unwrap().prefill_tokens, 100);
        st.commit(Instant::now());
        drain(&mut st);
        assert_eq!(done(&mut b).cached_tokens, 0);
    }

    #[test]
    fn chunked_prefill_blocks_hit_before_the_request_finishes() {
        // A's first 64-token chunk is registered when scheduled, so B (same prompt) admitted
        // in the next pass skips it while A is still prefilling.
        let mut st = EngineState::new(&cfg(1000, 64, 8));
        let _a = st.submit(req(1, 200, 2), Instant::now());
        st.schedule();
        st.commit(Instant::now());
        let mut b = st.submit(req(1, 200, 2), Instant::now());
        drain(&mut st);
        assert!(
            done(&mut b).cached_tokens >= 128,
            "B hit A's scheduled chunks"
        );
    }

    #[test]
    fn prefill_after_a_long_hit_pays_attention_to_the_context() {
        // A 2k suffix after a 30k hit costs about twice a cold 2k prompt (Dynamo's quadratic
        // term read as attention: 2 x 4.21e-7 ms per new token x context token).
        let cold = pass_ms(2000, 0.0, false, 0.0);
        let warm = pass_ms(2000, 2000.0 * 30_000.0, false, 0.0);
        assert!((cold - 48.544).abs() < 1e-9, "{cold}");
        assert!((warm - cold - 50.52).abs() < 1e-9, "{warm}");
        let run = |attention: bool| {
            let mut st = EngineState::new(&Config {
                context_attention: attention,
                ..cfg(20_000, 40_000, 8)
            });
            let _a = st.submit(req(1, 30_000, 1), Instant::now());
            drain(&mut st);
            let mut long = req(1, 32_000, 1);
            long.tokens[30_000..]
                .iter_mut()
                .for_each(|t| *t += 7_000_000);
            let _b = st.submit(long, Instant::now());
            st.schedule().unwrap()
        };
        let p = run(true);
        // All 30,000 tokens (7,500 full blocks of 4) hit; the other 2,000 are prefilled.
        assert_eq!(p.prefill_tokens, 2000);
        assert_eq!(p.context_pairs, 2000.0 * 30_000.0);
        assert_eq!(p.ms(), warm);
        assert!(p.ms() > 1.9 * cold, "{}", p.ms());
        let flat = run(false);
        assert_eq!(flat.context_pairs, 0.0);
        assert_eq!(flat.ms(), cold);
        // Chunked prefill of a cold prompt pays for the earlier chunks too.
        let mut st = EngineState::new(&cfg(1000, 64, 8));
        let _c = st.submit(req(3, 192, 1), Instant::now());
        let pairs: Vec<f64> = drain(&mut st).iter().map(|p| p.context_pairs).collect();
        assert_eq!(pairs, vec![0.0, 64.0 * 64.0, 64.0 * 128.0]);
    }

    #[test]
    fn requests_queue_in_arrival_order_whatever_their_parse_time() {
        let t0 = Instant::now();
        let mut st = EngineState::new(&cfg(1000, 1000, 8));
        // B arrived first but its (longer) parse finished after A's and C's.
        let _a = st.submit(req(1, 8, 1), t0 + Duration::from_millis(5));
        let _c = st.submit(req(3, 8, 1), t0 + Duration::from_millis(9));
        let _b = st.submit(req(2, 8, 1), t0);
        let order: Vec<u32> = st.waiting.iter().map(|s| s.tokens[0] / 100_000).collect();
        assert_eq!(order, vec![2, 1, 3]);
        assert_eq!(st.first_arrival(), Some(t0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pass_waits_for_requests_that_arrived_before_it_but_are_still_parsing() {
        let shared = Shared::new(cfg(1000, 1000, 8), "t".into());
        // Nothing pending: no wait.
        let t = Instant::now();
        shared.await_arrivals_before(Instant::now()).await;
        assert!(t.elapsed() < Duration::from_millis(5));
        // A request stamped before the pass start and submitted 15 ms later holds the pass.
        let arrival = shared.arrive();
        let start = Instant::now();
        let s2 = shared.clone();
        let submitter = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(15)).await;
            s2.submit(req(1, 8, 1), arrival)
        });
        shared.await_arrivals_before(start).await;
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(14), "{waited:?}");
        let _rx = submitter.await.unwrap();
        assert_eq!(shared.load().waiting, 1);
        // A request that arrives after the pass start does not hold it.
        let late = shared.arrive();
        let t = Instant::now();
        shared.await_arrivals_before(start).await;
        assert!(t.elapsed() < Duration::from_millis(5));
        // One that never gets submitted holds a pass only so long.
        let t = Instant::now();
        shared.await_arrivals_before(Instant::now()).await;
        assert!(t.elapsed() >= MAX_PARSE_WAIT);
        drop(late);
    }

    #[test]
    fn a_pass_admits_only_requests_that_arrived_before_it_started() {
        let t0 = Instant::now();
        let mut st = EngineState::new(&cfg(1000, 1000, 8));
        assert_eq!(st.next_start(t0), None);
        let _a = st.submit(req(1, 8, 4), t0 + Duration::from_millis(2));
        let _b = st.submit(req(2, 8, 4), t0 + Duration::from_millis(7));
        // Idle: the pass starts when A arrived, even if the engine learns of it later.
        let start = st.next_start(t0).unwrap();
        assert_eq!(start, t0 + Duration::from_millis(2));
        let p = st.schedule_at(Some(start)).unwrap();
        assert_eq!(p.prefill_tokens, 8, "B arrived after the pass began");
        st.commit(start + Duration::from_millis(3));
        // Busy: the next pass starts when this one ended.
        let clock = start + Duration::from_millis(3);
        assert_eq!(st.next_start(clock), Some(clock));
        assert_eq!(st.schedule_at(Some(clock)).unwrap().prefill_tokens, 0);
        let end = start + Duration::from_millis(10);
        st.commit(end);
        assert_eq!(st.schedule_at(Some(end)).unwrap().prefill_tokens, 8);
    }

    #[test]
    fn kv_events_never_block_the_engine_and_drops_are_counted() {
        let mut st = EngineState::new(&cfg(100, 1000, 8));
        // Room for one batch: the first request's stored blocks fill it.
        let (tx, mut rx) = mpsc::channel(1);
        st.publish_events(tx);
        assert!(
            rx.try_recv().is_err(),
            "vLLM 0.32 publishes nothing at start-up"
        );
        let _a = st.submit(req(1, 20, 2), Instant::now());
        drain(&mut st);
        let _b = st.submit(req(3, 20, 2), Instant::now());
        drain(&mut st);
        assert!(st.metrics.kv_event_batches_dropped >= 1);
        let first = rx.try_recv().unwrap();
        assert!(matches!(first.events[..], [KvEvent::BlockStored { .. }]));
        assert!(rx.try_recv().is_err());
        // With room, a step's stored blocks arrive as one batch with the prompt's tokens.
        let (tx, mut rx) = mpsc::channel(64);
        let mut st = EngineState::new(&cfg(100, 1000, 8));
        st.publish_events(tx);
        let r = req(2, 10, 1);
        let prompt = r.tokens.clone();
        let _b = st.submit(r, Instant::now());
        st.schedule();
        let batch = rx.try_recv().unwrap();
        assert_eq!(batch.data_parallel_rank, Some(0));
        match &batch.events[..] {
            [KvEvent::BlockStored {
                block_hashes,
                parent_block_hash: None,
                token_ids,
                block_size: 4,
            }] => {
                assert_eq!(block_hashes.len(), 2);
                assert_eq!(token_ids[..], prompt[..8]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(st.metrics.kv_event_batches_dropped, 0);
        // A reset's AllBlocksCleared goes out with the next step's events, as vLLM's.
        drain(&mut st);
        while rx.try_recv().is_ok() {}
        st.reset_prefix_cache();
        assert!(rx.try_recv().is_err());
        let _c = st.submit(req(4, 3, 1), Instant::now());
        st.schedule();
        assert_eq!(
            rx.try_recv().unwrap().events,
            vec![KvEvent::AllBlocksCleared]
        );
    }

    #[test]
    fn old_event_formats_clear_at_start_up_and_at_once() {
        let old = Config {
            kv_events_format: crate::kv_events::Format::Map,
            ..cfg(100, 1000, 8)
        };
        let mut st = EngineState::new(&old);
        let (tx, mut rx) = mpsc::channel(8);
        st.publish_events(tx);
        assert_eq!(
            rx.try_recv().unwrap().events,
            vec![KvEvent::AllBlocksCleared]
        );
        st.reset_prefix_cache();
        assert_eq!(
            rx.try_recv().unwrap().events,
            vec![KvEvent::AllBlocksCleared]
        );
    }

    #[test]
    fn kv_blocks_include_vllms_null_block() {
        let st = EngineState::new(&Config {
            null_block: true,
            ..cfg(16, 1000, 8)
        });
        assert_eq!(st.cache.capacity(), 15);
        assert_eq!(EngineState::new(&cfg(16, 1000, 8)).cache.capacity(), 16);
    }

    fn lora_cfg(max_loras: usize) -> Config {
        Config {
            lora_modules: vec!["a".into(), "b".into(), "c".into()],
            max_loras,
            lora_load_ms: 40.0,
            ..cfg(1000, 1000, 8)
        }
    }

    fn lora_req(seed: u32, lora: u16, max_tokens: usize) -> NewRequest {
        NewRequest {
            lora,
            ..req(seed, 20, max_tokens)
        }
    }

    #[test]
    fn an_adapter_has_its_own_prefix_cache() {
        let mut st = EngineState::new(&lora_cfg(2));
        let mut a = st.submit(lora_req(1, 1, 1), Instant::now());
        drain(&mut st);
        assert_eq!(done(&mut a).cached_tokens, 0);
        let mut b = st.submit(lora_req(1, 2, 1), Instant::now());
        drain(&mut st);
        assert_eq!(done(&mut b).cached_tokens, 0, "same tokens, other adapter");
        let mut base = st.submit(lora_req(1, 0, 1), Instant::now());
        drain(&mut st);
        assert_eq!(done(&mut base).cached_tokens, 0, "same tokens, base model");
        let mut again = st.submit(lora_req(1, 1, 1), Instant::now());
        drain(&mut st);
        assert_eq!(done(&mut again).cached_tokens, 16);
    }

    #[test]
    fn adapter_slots_load_on_demand_and_evict_the_least_recently_used_idle_one() {
        let mut st = EngineState::new(&lora_cfg(2));
        let mut loads = vec![];
        for lora in [1, 2, 1, 3, 1, 2] {
            let mut rx = st.submit(lora_req(lora.into(), lora, 1), Instant::now());
            let p = st.schedule().unwrap();
            loads.push(p.lora_load_ms);
            st.commit(Instant::now());
            drain(&mut st);
            done(&mut rx);
        }
        // a, b load; a is held; c replaces b (a used more recently); a held; b replaces c.
        assert_eq!(loads, [40.0, 40.0, 0.0, 40.0, 0.0, 40.0]);
        assert_eq!(st.lora_slots.loads, 4);
        assert_eq!(st.lora_slots.held(), [1, 2]);
    }

    #[test]
    fn a_request_waits_while_running_adapters_hold_every_slot_and_others_pass_it() {
        let mut st = EngineState::new(&lora_cfg(1));
        let _a = st.submit(lora_req(1, 1, 50), Instant::now());
        st.schedule();
        st.commit(Instant::now());
        let _b = st.submit(lora_req(2, 2, 1), Instant::now());
        let _a2 = st.submit(lora_req(3, 1, 1), Instant::now());
        let _base = st.submit(lora_req(4, 0, 1), Instant::now());
        let p = st.schedule().unwrap();
        assert_eq!(p.lora_load_ms, 0.0);
        assert_eq!(
            st.load().running,
            3,
            "a's second request and the base one pass b"
        );
        st.commit(Instant::now());
        assert_eq!(st.lora_labels(), ("b".to_string(), "a".to_string()));
        assert_eq!(
            st.lora_info.last().map(|(l, _)| l.clone()),
            Some(("b".into(), "a".into()))
        );
        drain(&mut st);
        assert_eq!(st.lora_slots.loads, 2, "b loads once a's requests are done");
        assert_eq!(
            st.lora_info.last().map(|(l, _)| l.clone()),
            Some((String::new(), String::new()))
        );
        assert!(st.lora_info.len() >= 3, "old label sets stay, as in vLLM");
    }

    #[test]
    fn max_num_seqs_limits_admission() {
        let mut st = EngineState::new(&cfg(1000, 1000, 2));
        let _rx: Vec<_> = (0..5)
            .map(|i| st.submit(req(i, 8, 3), Instant::now()))
            .collect();
        st.schedule();
        assert_eq!(st.load().running, 2);
        assert_eq!(st.load().waiting, 3);
    }

    #[test]
    fn out_of_kv_preempts_newest_and_everything_finishes() {
        // 12 blocks of 4 tokens; each request grows to 8 + 12 = 20 tokens = 5 blocks.
        let mut st = EngineState::new(&cfg(12, 1000, 8));
        let mut rxs: Vec<_> = (0..3)
            .map(|i| st.submit(req(i, 8, 12), Instant::now()))
            .collect();
        let mut passes = vec![];
        let mut max_usage: f64 = 0.0;
        let mut first_preempt_running = None;
        while let Some(p) = st.schedule() {
            max_usage = max_usage.max(p.usage);
            if p.preempted > 0 && first_preempt_running.is_none() {
                first_preempt_running = Some(st.running.len());
                // The newest (seed 2) went back to the head of the queue, computed state lost.
                let w = st.waiting.front().unwrap();
                assert_eq!(w.tokens[0], 200_000);
                assert_eq!((w.computed, w.blocks.len()), (0, 0));
            }
            st.commit(Instant::now());
            passes.push(p);
        }
        assert!(st.metrics.preemptions > 0);
        assert_eq!(first_preempt_running, Some(2));
        assert!(max_usage <= 1.0);
        for rx in &mut rxs {
            assert_eq!(done(rx).completion_tokens, 12);
        }
        assert_eq!(st.cache.free(), 12, "all blocks returned");
    }

    #[test]
    fn running_requests_blocks_survive_pressure() {
        let mut st = EngineState::new(&cfg(10, 1000, 8));
        let _a = st.submit(req(1, 16, 100), Instant::now()); // holds 4+ blocks, decoding long
        st.schedule();
        st.commit(Instant::now());
        let held: Vec<BlockId> = st.running[0].blocks.clone();
        let mut small: Vec<_> = (2..6)
            .map(|i| st.submit(req(i, 4, 1), Instant::now()))
            .collect();
        for _ in 0..20 {
            if st.schedule().is_some() {
                st.commit(Instant::now());
            }
        }
        assert_eq!(&st.running[0].blocks[..held.len()], &held[..]);
        for rx in &mut small {
            done(rx);
        }
        assert_eq!(st.cache.lookup(&st.running[0].hashes[..4]), 4);
    }

    #[test]
    fn transferred_kv_is_not_prefilled() {
        let mut st = EngineState::new(&cfg(100, 1000, 8));
        let mut r = req(1, 40, 3);
        r.transferred = 40;
        let mut rx = st.submit(r, Instant::now());
        let p = st.schedule().unwrap();
        assert_eq!(p.prefill_tokens, 1, "only the last token is computed");
        drain(&mut st);
        assert_eq!(done(&mut rx).cached_tokens, 39);
        assert_eq!(st.probe(&req(1, 40, 3).tokens, None).1, 36);
    }

    #[test]
    fn cancelled_requests_free_their_blocks() {
        let mut st = EngineState::new(&cfg(100, 1000, 8));
        let rx = st.submit(req(1, 40, 50), Instant::now());
        st.schedule();
        st.commit(Instant::now());
        assert!(st.cache.free() < 100);
        drop(rx);
        drain(&mut st);
        assert_eq!(st.cache.free(), 100);
        assert_eq!(st.metrics.aborted, 1);
    }
}
