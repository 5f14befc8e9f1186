//! The routing engine of one Envoy worker thread: its replica of the prefix index and load
//! table, and the request lifecycle (route, prefill done, finish, feedback) expressed as
//! events, so the same code applies local decisions and those replicated from other threads.

use crate::calibrate::Calibrator;
use crate::config::{Config, DisaggMode, Role, UnknownModel};
use crate::events::Event;
use crate::family::Families;
use crate::feedback::{OrcaLoad, Usage};
use crate::hashing::{hint_hash, prompt_hashes_limited, token_prompt_hashes, HashParams};
use crate::ids::{mix, RequestId, WorkerId, CHARS_PER_TOKEN_RANGE};
use crate::index::{Pending, PrefixIndex, Speculative};
use crate::ladder::{Ladder, Sketch};
use crate::load::{LoadParams, LoadTable, NewRequest, Report, WorkerView};
use crate::lora::{adapter_id, AdapterId, Adapters, LoraReport};
use crate::picks::{self, Pick};
use crate::request::{parse, ApiKind, ParseError, Prompt};
use crate::rng::Rng;
use crate::select::{self, Candidate, Outcome, RequestShape, SelectParams};
use crate::stall;
use crate::twins::Twins;
use std::collections::VecDeque;

/// Why a request was not cache-routed (it still goes to the least-loaded healthy worker).
#[derive(Debug, Clone, PartialEq)]
pub enum Fallback {
    Parse(String),
    UnknownModel(String),
    /// Scoring found no worker to pick (every cost was unusable).
    NoCandidates,
    /// The body is over `limits.max_route_bytes`: not parsed or hashed.
    TooLarge,
}

impl Fallback {
    /// Short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Fallback::Parse(_) => "parse_error",
            Fallback::UnknownModel(_) => "unknown_model",
            Fallback::NoCandidates => "no_candidates",
            Fallback::TooLarge => "too_large",
        }
    }
}

/// A routing decision, with what the HTTP context needs for the rest of the request.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub id: RequestId,
    /// Worker whose cluster / endpoint the steering header names.
    pub target: WorkerId,
    /// Worker that decodes (and holds the KV afterwards).
    pub decode: WorkerId,
    /// Prefill pool worker, when the request is disaggregated.
    pub prefill: Option<WorkerId>,
    /// Further workers in cost order, for endpoint-mode fallbacks.
    pub alternates: Vec<WorkerId>,
    /// Prompt tokens the serving (prefill-side) worker is predicted to hold.
    pub overlap_tokens: u32,
    /// Prompt tokens the decode worker is predicted to hold (differs when disaggregated).
    pub decode_overlap_tokens: u32,
    pub prompt_tokens: u32,
    pub exact_tokens: bool,
    pub fallback: Option<Fallback>,
    pub all_busy: bool,
    /// To replicate to the other threads (already applied here).
    pub event: Event,
    /// The request's client hint, now on its decode worker ([`Event::Hinted`]); replicated
    /// like `event`.
    pub hinted: Option<Event>,
    /// The prompt's text length, for calibrating chars per token from `usage`.
    pub prompt_bytes_est: f64,
    /// The decode candidates' costs, kept only for debug headers.
    pub considered: Vec<select::Considered>,
    /// A stream only read at its last chunk: its client asked no usage (OpenAI's
    /// `stream_options.include_usage`), so no chunk before the last carries it, or it was
    /// not sampled for usage (`limits.usage_read_every`).
    pub usage_at_end_only: bool,
    /// How long a try may wait for the worker's response headers (`crate::stall`).
    pub first_byte_timeout_ms: Option<u64>,
    /// The reuse ladder's rungs for this prompt (`crate::ladder`); zero for a fallback.
    pub ladder: Ladder,
}

impl Decision {
    /// The decision as other threads charge it before its event reaches them.
    pub fn pick(&self) -> Option<Pick> {
        let Event::Routed(r) = &self.event else {
            return None;
        };
        let hashed = u32::try_from(r.blocks.len()).unwrap_or(u32::MAX);
        Some(Pick {
            id: r.id,
            worker: r.worker,
            prefill_worker: r.prefill_worker,
            prefill_tokens: r.prefill_tokens,
            blocks: hashed.saturating_add(r.tail_blocks),
            at_ms: r.now_ms,
            ended: false,
        })
    }

    /// The prompt's block hashes: those its `Routed` event carries (one copy per request).
    pub fn hashes(&self) -> &[u64] {
        match &self.event {
            Event::Routed(r) => &r.blocks,
            _ => &[],
        }
    }

    /// Fraction of the prompt predicted to be served from cache.
    pub fn predicted_hit(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            f64::from(self.overlap_tokens.min(self.prompt_tokens)) / f64::from(self.prompt_tokens)
        }
    }
}

/// Returned once per request and matched at once: boxing the decision would only add an
/// allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum RouteResult {
    Routed(Decision),
    /// Every worker is busy and the config sheds load (answer 429).
    Rejected,
    /// No worker serves the request's model and `unknown_model` is `reject` (answer 404).
    UnknownModel(String),
}

/// What one finished request taught us.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct UsageOutcome {
    /// `cached_tokens / prompt_tokens` as the engine reported it.
    pub actual_hit: Option<f64>,
    /// The engine cached at least a block less than predicted.
    pub overpredicted: bool,
}

pub struct Router {
    cfg: Config,
    sel: SelectParams,
    decode_pool: Vec<WorkerId>,
    prefill_pool: Vec<WorkerId>,
    index: PrefixIndex,
    load: LoadTable,
    rng: Rng,
    /// Calibrated from usage; the hashing block length stays on the configured value so
    /// calibration never changes block hashes.
    chars_per_token: f64,
    /// Per-upstream calibration state behind `chars_per_token`.
    calib: Calibrator,
    origin: u64,
    seq: u64,
    /// Routed prompts not yet confirmed by a successful first byte: seen by lookups, kept out
    /// of the index (so a rejected request evicts nothing).
    speculative: Speculative,
    /// Local decisions not yet in `speculative`: (request, its blocks).
    pending: Vec<(RequestId, Pending)>,
    /// Per worker: kvroute-relay streams this engine's own KV events (precise mode), so the
    /// index follows the engine and confirmed picks stay speculative until it reports them.
    engine_fed: Vec<bool>,
    /// Confirmed requests on engine-fed workers, kept speculative until the engine's events
    /// have had time to arrive: (drop at ms, request).
    confirmed: VecDeque<(u64, RequestId)>,
    /// This VM's recent requests by prefix family and worker (the hot-spot term's focus).
    families: Families,
    /// Streams routed whose client asked for usage (which of them are read for it).
    usage_streams: u64,
    /// Some worker serves only listed models: pools are filtered by the request's model.
    model_lists: bool,
    /// Text blocks -> the engine blocks they end in (`tokenize` answers, see `twins`).
    twins: Twins,
    /// Block hashes of recent requests, this VM's and (replicated) every other's: the
    /// ladder's `workload` rung.
    sketch: Sketch,
    /// LoRA adapters each worker holds, as picks and metrics tell.
    adapters: Adapters,
}

/// Streams with usage a VM reads in full before sampling (`limits.usage_read_every`): the
/// calibration's per-worker averages start from these.
pub const USAGE_WARMUP: u64 = 64;

/// Output tokens assumed when a request does not say (vLLM would run to the context limit).
const DEFAULT_OUTPUT_TOKENS: u32 = 256;
/// Cap for the output estimate, so one huge `max_tokens` does not look like a full cache.
const MAX_OUTPUT_ESTIMATE: u32 = 4096;

impl Router {
    /// `origin` distinguishes this replica's request ids from other threads' (its low 32
    /// bits go into the top of every id: the replication member id, unique for 2^32 VM
    /// creations; the low 32 bits count this VM's requests, and wrap only after 2^32 of them,
    /// long after the earlier ones with the same id have ended or expired).
    /// The tables' hash key is derived from `seed`; see `with_hash_key`.
    pub fn new(cfg: Config, origin: u64, seed: u64) -> Self {
        Self::with_hash_key(cfg, origin, seed, mix(seed ^ 0x6a09_e667_f3bc_c908))
    }

    /// `hash_key`: per-process secret for the index and load tables' hashing (hash
    /// flooding); the filter takes it from the host's clock at configuration, apart from a
    /// configured `seed` (which may be known).
    pub fn with_hash_key(cfg: Config, origin: u64, seed: u64, hash_key: u64) -> Self {
        let sel = SelectParams::from_config(&cfg);
        let params = LoadParams {
            hash_key,
            ..LoadParams::from_config(&cfg)
        };
        let mut index = PrefixIndex::with_key(cfg.index.ttl_ms, hash_key);
        let mut decode_pool = Vec::new();
        let mut prefill_pool = Vec::new();
        for (i, w) in cfg.workers.iter().enumerate() {
            let Ok(id) = WorkerId::try_from(i) else { break };
            index.set_capacity(id, cfg.kv_blocks(w));
            match w.role {
                Role::Prefill => prefill_pool.push(id),
                Role::Both | Role::Decode => decode_pool.push(id),
            }
        }
        // Size the hash table up front: growing it rehashes every entry inside one request.
        let total: u64 = cfg
            .workers
            .iter()
            .map(|w| u64::from(cfg.kv_blocks(w)))
            .sum();
        index.reserve(usize::try_from(total.min(1 << 20)).unwrap_or(1 << 20));
        let mut load = LoadTable::new(cfg.workers.len(), params);
        for (i, w) in cfg.workers.iter().enumerate() {
            if let Ok(id) = WorkerId::try_from(i) {
                load.set_speed(id, w.speed);
            }
        }
        let sketch = Sketch::for_fleet(total, hash_key.rotate_left(7) ^ 0x5851_f42d_4c95_7f2d);
        let chars_per_token = cfg.chars_per_token;
        let cfg_model_lists = cfg.has_model_lists();
        let calib = Calibrator::new(cfg.workers.len());
        let adapters = Adapters::new(
            cfg.workers.len(),
            cfg.lora.max_loras,
            cfg.load.request_ttl_ms,
        );
        let families = Families::new(
            cfg.workers.len(),
            cfg.scoring.cache_balance_half_life_ms,
            hash_key,
        );
        Router {
            cfg,
            sel,
            decode_pool,
            prefill_pool,
            index,
            load,
            rng: Rng::new(seed),
            chars_per_token,
            calib,
            origin: (origin & 0xFFFF_FFFF) << 32,
            seq: 0,
            speculative: Speculative::new(hash_key),
            pending: Vec::new(),
            engine_fed: Vec::new(),
            confirmed: VecDeque::new(),
            adapters,
            families,
            usage_streams: 0,
            model_lists: cfg_model_lists,
            twins: Twins::new(hash_key ^ 0x7477_696e),
            sketch,
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    pub fn load(&self) -> &LoadTable {
        &self.load
    }

    /// Recent requests' blocks (the reuse ladder's `workload` rung).
    pub fn sketch(&self) -> &Sketch {
        &self.sketch
    }

    pub fn chars_per_token(&self) -> f64 {
        self.chars_per_token
    }

    pub fn worker_view(&self, w: WorkerId, now_ms: u64) -> WorkerView {
        self.load.view(w, now_ms, self.cfg.busy.report_max_age_ms)
    }

    /// Charges, provisionally, what other threads picked moments ago and this one has not
    /// heard of yet ([`crate::picks`]); call before routing. Returns how many were charged.
    pub fn note_peer_picks(&mut self, picks: &[Pick], now_ms: u64) -> usize {
        self.load.expire_provisional(now_ms);
        let mut charged = 0;
        for p in picks {
            if p.id & !0xFFFF_FFFF == self.origin || !picks::fresh(p, now_ms) {
                continue;
            }
            if p.ended {
                self.load.free_provisional(p.id);
                continue;
            }
            let r = NewRequest {
                id: p.id,
                worker: p.worker,
                prefill_worker: p.prefill_worker,
                blocks: Vec::new(),
                cached_blocks: 0,
                tail_blocks: p.blocks,
                prefill_tokens: p.prefill_tokens,
                now_ms: p.at_ms,
                adapter: 0,
            };
            // Released just after the pick leaves the window, so it is never charged twice.
            let until = p.at_ms.saturating_add(picks::WINDOW_MS + 1);
            if self.load.add_provisional(&r, until) {
                charged += 1;
            }
        }
        charged
    }

    /// Whether this stream, whose client asked for usage, is read chunk by chunk for it.
    fn read_usage(&mut self) -> bool {
        let n = self.usage_streams;
        self.usage_streams = n.saturating_add(1);
        n < USAGE_WARMUP || n.is_multiple_of(u64::from(self.cfg.limits.usage_read_every.max(1)))
    }

    fn next_id(&mut self) -> RequestId {
        self.seq = (self.seq + 1) & 0xFFFF_FFFF;
        self.origin | self.seq
    }

    /// Parses the body, scores every worker and records the decision (load and index).
    pub fn route(&mut self, kind: ApiKind, body: &[u8], now_ms: u64) -> RouteResult {
        self.route_tokens(kind, body, None, now_ms)
    }

    /// `route`, with the engine's token ids for a text prompt (`tokenize`): the prompt then
    /// hashes exactly. Ignored for a request that sent token ids itself.
    pub fn route_tokens(
        &mut self,
        kind: ApiKind,
        body: &[u8],
        tokens: Option<&[u32]>,
        now_ms: u64,
    ) -> RouteResult {
        self.route_hinted(kind, body, tokens, None, now_ms)
    }

    /// `route_tokens`, with the value of the request's session header
    /// (`hints.session_header`): a hint, when the body has no `prompt_cache_key`.
    pub fn route_hinted(
        &mut self,
        kind: ApiKind,
        body: &[u8],
        tokens: Option<&[u32]>,
        session: Option<&str>,
        now_ms: u64,
    ) -> RouteResult {
        self.flush();
        if body.len() > self.cfg.limits.max_route_bytes as usize {
            let pool = self.decode_pool.clone();
            return self.route_fallback(Fallback::TooLarge, &pool, now_ms);
        }
        let req = match parse(kind, body) {
            Ok(r) => r,
            Err(e) => {
                let pool = self.decode_pool.clone();
                return self.route_fallback(Fallback::Parse(describe(&e)), &pool, now_ms);
            }
        };
        let adapter = self.adapter_of(&req.model);
        let decode_pool = self.pool_for(&self.decode_pool, &req.model);
        if decode_pool.is_empty() {
            let model = req.model.to_string();
            return match self.cfg.unknown_model {
                UnknownModel::Reject => RouteResult::UnknownModel(model),
                UnknownModel::Pass => {
                    let pool = self.decode_pool.clone();
                    self.route_fallback(Fallback::UnknownModel(model), &pool, now_ms)
                }
            };
        }
        let prefill_pool = self.pool_for(&self.prefill_pool, &req.model);
        let params = HashParams::from_config(&self.cfg);
        let max_blocks = self.cfg.limits.max_blocks as usize;
        let ph = match tokens {
            Some(t) if !matches!(req.prompt, Prompt::Tokens(_)) => {
                token_prompt_hashes(&req, t, &params, max_blocks)
            }
            _ => prompt_hashes_limited(&req, &params, max_blocks),
        };
        let hint = req
            .cache_key
            .as_deref()
            .or(session)
            .filter(|k| !k.is_empty())
            .map(|k| hint_hash(&req.model, req.cache_salt.as_deref(), k));
        // The parsed prompt (a batch's every entry) is not needed past hashing.
        let max_tokens = req.max_tokens;
        let stream = req.stream;
        let usage_at_end_only = req.stream && !(req.include_usage && self.read_usage());
        drop(req);
        let bs = self.cfg.block_size.max(1);
        // Text blocks are `block_size * configured chars_per_token` bytes; how many tokens
        // that is follows the calibrated ratio.
        let (prompt_tokens, tokens_per_block, prompt_bytes) = if ph.exact {
            (ph.est_tokens, f64::from(bs), 0.0)
        } else {
            let bytes = f64::from(ph.est_tokens) * self.cfg.chars_per_token;
            let tokens = (bytes / self.chars_per_token)
                .ceil()
                .min(f64::from(u32::MAX)) as u32;
            (
                tokens,
                f64::from(bs) * self.cfg.chars_per_token / self.chars_per_token,
                bytes,
            )
        };
        let output = max_tokens
            .unwrap_or(DEFAULT_OUTPUT_TOKENS)
            .min(MAX_OUTPUT_ESTIMATE);
        let prompt_blocks = prompt_tokens.div_ceil(bs);
        let shape = RequestShape {
            prompt_tokens,
            total_blocks: prompt_blocks + output.div_ceil(bs),
        };

        // Confirmed: what the index says each worker holds, and the prompts of answered
        // requests still running (pinned in the engine, see `Speculative`); held adds the
        // routed requests not yet answered, which no cache holds until their prefill ran.
        self.end_continued_peer_requests(&ph.blocks, now_ms);
        let mut confirmed = vec![0u32; self.cfg.workers.len()];
        self.index.lookup(&ph.blocks, now_ms, &mut confirmed);
        if !ph.exact {
            self.engine_held_text(&ph.blocks, now_ms, &mut confirmed);
        }
        self.speculative
            .extend_confirmed(&ph.blocks, &mut confirmed);
        let mut held = confirmed.clone();
        self.speculative.extend(&ph.blocks, &mut held);
        let to_tokens = |blocks: &[u32], w: WorkerId| -> u32 {
            let b = blocks.get(usize::from(w)).copied().unwrap_or(0);
            ((f64::from(b) * tokens_per_block) as u32).min(prompt_tokens)
        };
        let overlap_tokens = |w: WorkerId| to_tokens(&held, w);
        let confirmed_tokens = |w: WorkerId| to_tokens(&confirmed, w);
        // Seen before (this VM's requests and those replicated from the others), then
        // remembered: the ladder's top rung.
        let seen = u32::try_from(self.sketch.observe(&ph.blocks)).unwrap_or(u32::MAX);

        // The request's family: the longest prefix some worker holds, named by its last block.
        let best = held.iter().copied().max().unwrap_or(0);
        let family = best
            .checked_sub(1)
            .and_then(|i| ph.blocks.get(i as usize))
            .copied();
        let family_share = |w: WorkerId| -> Option<f64> {
            let f = family?;
            (held.get(usize::from(w)).copied().unwrap_or(0) >= best)
                .then(|| self.families.share(f, w, now_ms))
        };
        let mut decode_cands =
            self.candidates(&decode_pool, &overlap_tokens, &confirmed_tokens, now_ms);
        for c in &mut decode_cands {
            c.family_share = family_share(c.id);
            c.adapter_loads = self.adapter_loads(c.id, adapter);
        }
        // A hint is one more block at the head of the prompt, cached (confirmed) where the
        // key went last: prefix affinity and its load trade-off, at the weight of one block.
        let decode_shape = match hint {
            Some(h) => {
                let mut holds = vec![0u32; self.cfg.workers.len()];
                self.index.lookup(&[h], now_ms, &mut holds);
                for c in &mut decode_cands {
                    if holds.get(usize::from(c.id)).is_some_and(|&b| b > 0) {
                        c.overlap_tokens = c.overlap_tokens.saturating_add(bs);
                        c.confirmed_tokens = c.confirmed_tokens.saturating_add(bs);
                    }
                }
                RequestShape {
                    prompt_tokens: prompt_tokens.saturating_add(bs),
                    ..shape
                }
            }
            None => shape,
        };
        let pick = match select::pick(&self.sel, &decode_cands, &decode_shape, &mut self.rng) {
            Outcome::Picked(p) => p,
            Outcome::Rejected => return RouteResult::Rejected,
            Outcome::NoCandidates => {
                return self.route_fallback(Fallback::NoCandidates, &decode_pool, now_ms);
            }
        };
        let alternates = self.alternates(&decode_cands, &decode_shape, pick.id);
        let considered = if self.cfg.debug_headers {
            select::explain(&self.sel, &decode_cands, &decode_shape)
        } else {
            Vec::new()
        };
        // The prompt's own cached tokens there (without a hint's virtual block).
        let decode_overlap = overlap_tokens(pick.id);

        let mut prefill = None;
        let mut serve_overlap = decode_overlap;
        let threshold = self.cfg.disaggregation.threshold_tokens;
        if threshold > 0 && !prefill_pool.is_empty() {
            let uncached = select::uncached_tokens(prompt_tokens, decode_overlap);
            if uncached > threshold {
                let mut cands =
                    self.candidates(&prefill_pool, &overlap_tokens, &confirmed_tokens, now_ms);
                for c in &mut cands {
                    c.adapter_loads = self.adapter_loads(c.id, adapter);
                }
                if let Outcome::Picked(pp) = select::pick(&self.sel, &cands, &shape, &mut self.rng)
                {
                    // The pool only pays when prefilling there costs no more than on the
                    // decode worker, by the terms that price a prefill wherever it runs: the
                    // wait for it, the delay it adds to whoever queues behind it, and the
                    // passes its streams sit out. Equal costs go to the pool.
                    let pool_pays = !self.cfg.disaggregation.compare_cost
                        || select::prefill_cost(&self.sel, &cands, pp.id, &shape)
                            <= select::prefill_cost(
                                &self.sel,
                                &decode_cands,
                                pick.id,
                                &decode_shape,
                            );
                    if pool_pays {
                        prefill = Some(pp.id);
                        serve_overlap = pp.overlap_tokens;
                    }
                }
            }
        }

        let eligible_prefill: &[WorkerId] = if threshold > 0 { &prefill_pool } else { &[] };
        let fleet = self.fleet_blocks(&held, [&decode_pool, eligible_prefill], now_ms);
        let serving = held
            .get(usize::from(prefill.unwrap_or(pick.id)))
            .copied()
            .unwrap_or(0);
        let ladder = Ladder::from_blocks(seen, fleet, serving, |b| {
            ((f64::from(b) * tokens_per_block) as u32).min(prompt_tokens)
        });
        self.families.record(family, pick.id, now_ms);
        let id = self.next_id();
        let hashed_blocks = u32::try_from(ph.blocks.len()).unwrap_or(u32::MAX);
        let cached_blocks = (f64::from(serve_overlap) / tokens_per_block).floor() as u32;
        let routed = NewRequest {
            id,
            worker: pick.id,
            prefill_worker: prefill,
            blocks: ph.blocks,
            cached_blocks,
            tail_blocks: prompt_blocks.saturating_sub(hashed_blocks) + output.div_ceil(bs),
            prefill_tokens: select::uncached_tokens(prompt_tokens, serve_overlap),
            now_ms,
            adapter,
        };
        // Load is charged now; the speculative entry waits in `pending` for `flush`.
        self.load.add(&routed);
        self.adapters.on_routed(id, pick.id, adapter, now_ms);
        if let Some(pw) = prefill {
            self.adapters.touch(pw, adapter, now_ms);
        }
        self.pending.push((
            id,
            Pending {
                worker: pick.id,
                prefill,
                hashes: routed.blocks.clone(),
                at_ms: now_ms,
                confirmed: false,
                cached: routed.cached_blocks,
            },
        ));
        let event = Event::Routed(routed);
        let hinted = hint.map(|hash| {
            let e = Event::Hinted {
                worker: pick.id,
                hash,
            };
            self.apply(&e, now_ms);
            e
        });
        let target = match (prefill, self.cfg.disaggregation.mode) {
            (Some(p), DisaggMode::Kvroute) => p,
            _ => pick.id,
        };
        let view = self.worker_view(target, now_ms);
        let first_byte_timeout_ms = stall::first_byte_timeout_ms(
            &self.cfg,
            &stall::Wait {
                prefill_tokens: view.prefill_tokens,
                prefilling: view.prefilling,
                stream,
                max_tokens,
                speed: self
                    .cfg
                    .workers
                    .get(usize::from(target))
                    .map_or(1.0, |c| c.speed),
            },
        );
        RouteResult::Routed(Decision {
            id,
            target,
            decode: pick.id,
            prefill,
            alternates,
            overlap_tokens: serve_overlap,
            decode_overlap_tokens: decode_overlap,
            prompt_tokens,
            exact_tokens: ph.exact,
            fallback: None,
            all_busy: pick.all_busy,
            event,
            hinted,
            prompt_bytes_est: prompt_bytes,
            considered,
            usage_at_end_only,
            first_byte_timeout_ms,
            ladder,
        })
    }

    /// The workers of `pool` that serve `model` (all of it when no worker lists models).
    fn pool_for(&self, pool: &[WorkerId], model: &str) -> Vec<WorkerId> {
        let serves = |w: &WorkerId| {
            !self.model_lists
                || self
                    .cfg
                    .workers
                    .get(usize::from(*w))
                    .is_some_and(|c| self.cfg.serves(c, model))
        };
        pool.iter().copied().filter(serves).collect()
    }

    /// The longest prefix (blocks, of `held`) a healthy worker of the eligible pools holds:
    /// the ladder's `fleet` rung.
    fn fleet_blocks(&self, held: &[u32], pools: [&[WorkerId]; 2], now_ms: u64) -> u32 {
        pools
            .iter()
            .flat_map(|p| p.iter())
            .filter(|&&w| self.worker_view(w, now_ms).healthy)
            .map(|&w| held.get(usize::from(w)).copied().unwrap_or(0))
            .max()
            .unwrap_or(0)
    }

    /// Least-loaded healthy worker of `pool` for a request we cannot cache-route.
    fn route_fallback(&mut self, why: Fallback, pool: &[WorkerId], now_ms: u64) -> RouteResult {
        let cands = self.candidates(pool, &|_| 0, &|_| 0, now_ms);
        let shape = RequestShape::default();
        let pick = match select::pick(&self.sel, &cands, &shape, &mut self.rng) {
            Outcome::Picked(p) => p,
            Outcome::Rejected => return RouteResult::Rejected,
            Outcome::NoCandidates => return RouteResult::Rejected,
        };
        let alternates = self.alternates(&cands, &shape, pick.id);
        let id = self.next_id();
        let event = Event::Routed(NewRequest {
            id,
            worker: pick.id,
            prefill_worker: None,
            blocks: Vec::new(),
            cached_blocks: 0,
            tail_blocks: 0,
            prefill_tokens: 0,
            now_ms,
            adapter: 0,
        });
        self.apply(&event, now_ms);
        RouteResult::Routed(Decision {
            id,
            target: pick.id,
            decode: pick.id,
            prefill: None,
            alternates,
            overlap_tokens: 0,
            decode_overlap_tokens: 0,
            prompt_tokens: 0,
            exact_tokens: false,
            fallback: Some(why),
            all_busy: pick.all_busy,
            event,
            hinted: None,
            prompt_bytes_est: 0.0,
            considered: Vec::new(),
            // The body was not read: every chunk might carry usage.
            usage_at_end_only: false,
            // Nothing says how long its answer may take.
            first_byte_timeout_ms: None,
            ladder: Ladder::default(),
        })
    }

    fn candidates(
        &self,
        pool: &[WorkerId],
        overlap: &dyn Fn(WorkerId) -> u32,
        confirmed: &dyn Fn(WorkerId) -> u32,
        now_ms: u64,
    ) -> Vec<Candidate> {
        pool.iter()
            .map(|&w| Candidate {
                id: w,
                overlap_tokens: overlap(w),
                kv_blocks: self
                    .cfg
                    .workers
                    .get(usize::from(w))
                    .map(|c| self.cfg.kv_blocks(c))
                    .unwrap_or(1),
                // What its KV holds: ended prompts, and the running requests' own blocks
                // that took their room.
                indexed_blocks: u32::try_from(self.index.entries(w))
                    .unwrap_or(u32::MAX)
                    .saturating_add(self.speculative.reserved(w)),
                load: self.worker_view(w, now_ms),
                confirmed_tokens: confirmed(w),
                family_share: None,
                speed: self
                    .cfg
                    .workers
                    .get(usize::from(w))
                    .map_or(1.0, |c| c.speed),
                adapter_loads: 0.0,
            })
            .collect()
    }

    fn alternates(
        &self,
        cands: &[Candidate],
        shape: &RequestShape,
        chosen: WorkerId,
    ) -> Vec<WorkerId> {
        let n = self.cfg.steering.fallbacks as usize;
        if n == 0 {
            return Vec::new();
        }
        let pool = select::Pool::of(cands);
        let mut rest: Vec<(f64, WorkerId)> = cands
            .iter()
            .filter(|c| c.id != chosen && c.load.healthy)
            .map(|c| (select::cost(&self.sel, c, shape, &pool), c.id))
            .collect();
        rest.sort_by(|a, b| a.0.total_cmp(&b.0));
        rest.into_iter().take(n).map(|(_, w)| w).collect()
    }

    /// Speculative entries of local decisions wait here so they are made after the request
    /// is on its way (the filter calls `flush` from a callback of its own); anything routed
    /// or confirmed before that flushes first, so no decision ever misses an earlier one.
    pub fn flush(&mut self) -> usize {
        let jobs = core::mem::take(&mut self.pending);
        let n = jobs.len();
        for (id, p) in jobs {
            self.speculative.add(id, p);
        }
        n
    }

    /// Leading blocks of `hashes` each worker holds or is about to hold (confirmed index
    /// entries, continued by those of requests still unanswered).
    pub fn held_blocks(&self, hashes: &[u64], now_ms: u64, out: &mut [u32]) {
        self.index.lookup(hashes, now_ms, out);
        self.speculative.extend(hashes, out);
    }

    /// Unconfirmed requests (speculative index entries).
    pub fn speculative_requests(&self) -> usize {
        self.speculative.unconfirmed() + self.pending.len()
    }

    /// Applies an event, local or replicated from another thread.
    pub fn apply(&mut self, e: &Event, now_ms: u64) {
        match e {
            Event::Routed(r) => {
                self.load.add(r);
                self.sketch.insert(&r.blocks);
                self.adapters.on_routed(r.id, r.worker, r.adapter, r.now_ms);
                if let Some(pw) = r.prefill_worker {
                    self.adapters.touch(pw, r.adapter, r.now_ms);
                }
                self.speculative.add(
                    r.id,
                    Pending {
                        worker: r.worker,
                        prefill: r.prefill_worker,
                        hashes: r.blocks.clone(),
                        at_ms: r.now_ms,
                        confirmed: false,
                        cached: r.cached_blocks,
                    },
                );
            }
            Event::PrefillDone { id } => {
                self.load.prefill_done(*id);
            }
            Event::Confirmed { id } => {
                self.flush();
                if self.speculative.get(*id).is_some_and(|p| self.fed(p)) {
                    // The engine's own events say what it cached. The pick counts until they
                    // have arrived (usually already: the engine reports blocks when it
                    // computes them, before the first token), and never beyond
                    // `relay.speculative_ms`: a lingering pick would hide evictions.
                    if !self.engine_reported(*id, now_ms) {
                        let until = now_ms.saturating_add(self.cfg.relay.speculative_ms);
                        self.confirmed.push_back((until, *id));
                    }
                } else if let Some(p) = self.speculative.confirm(*id) {
                    // Its worker holds the blocks pinned until the request ends (see
                    // `Speculative`), and they enter the index then. A prefill worker freed
                    // them when it handed the KV over, which came before this answer.
                    let worker = p.worker;
                    if let Some(pw) = p.prefill.filter(|&pw| pw != p.worker) {
                        self.index.insert(pw, &p.hashes, now_ms);
                    }
                    self.fit_lru(worker);
                }
            }
            Event::Free { id } => {
                self.load.free(*id);
                self.adapters.end(*id);
                // Ended without a successful first byte (rejected, aborted, failed): the
                // engine cached nothing we can count on. Requests confirmed on an engine-fed
                // worker leave on their own deadline (`confirmed`).
                self.flush();
                if !self.confirmed.iter().any(|&(_, c)| c == *id) {
                    // Ended after an answer: the engine freed its blocks just now, so they are
                    // its most recent evictable ones.
                    if let Some(p) = self.speculative.take(*id).filter(|p| p.confirmed) {
                        self.fit_lru(p.worker);
                        self.index.insert(p.worker, &p.hashes, now_ms);
                    }
                }
            }
            Event::Report { worker, report } => self.load.report(*worker, *report),
            Event::Failed { worker, at_ms } => {
                self.load
                    .mark_failed(*worker, *at_ms, self.cfg.health.cooldown_ms);
            }
            Event::Recovered { worker } => self.load.mark_ok(*worker),
            Event::Forget { worker, hashes } | Event::EngineRemoved { worker, hashes } => {
                self.index.truncate(*worker, hashes, 0)
            }
            Event::EngineStored { worker, hashes } => {
                self.index.insert(*worker, hashes, now_ms);
                self.settle_confirmed(*worker, now_ms, false);
            }
            Event::TextTokens { text, tokens } => self.twins.learn(text, tokens),
            Event::PeerGone { tag } => {
                self.purge_peer(*tag);
            }
            Event::Hinted { worker, hash } => {
                // The key moves with its requests: only its latest worker keeps it.
                let mut holds = [0u32; crate::ids::MAX_WORKERS];
                self.index.lookup(&[*hash], now_ms, &mut holds);
                for (w, &b) in holds.iter().enumerate() {
                    if b > 0 && w != usize::from(*worker) {
                        if let Ok(w) = WorkerId::try_from(w) {
                            self.index.truncate(w, &[*hash], 0);
                        }
                    }
                }
                if usize::from(*worker) < self.cfg.workers.len() {
                    self.index.insert(*worker, &[*hash], now_ms);
                }
            }
            Event::Lora { worker, report } => self.adapters.on_report(*worker, report, now_ms),
            Event::EngineCleared { worker } => {
                self.index.clear(*worker);
                self.settle_confirmed(*worker, now_ms, true);
            }
            Event::EngineFeed { worker, on } => {
                let w = usize::from(*worker);
                if w < self.cfg.workers.len() {
                    if self.engine_fed.len() <= w {
                        self.engine_fed.resize(w + 1, false);
                    }
                    if let Some(f) = self.engine_fed.get_mut(w) {
                        *f = *on;
                    }
                    // Fed, the engine's removals bound what the index holds; an LRU of the
                    // index's own would drop blocks the engine still has (its KV also holds
                    // running requests' blocks, which the index does not count).
                    if let Some(cfg) = self.cfg.workers.get(w) {
                        let kv = self.cfg.kv_blocks(cfg);
                        let cap = if *on {
                            kv.saturating_mul(2).saturating_add(1024)
                        } else {
                            kv
                        };
                        self.index.set_capacity(*worker, cap);
                    }
                }
            }
            Event::Calibrate { chars_per_token } => {
                if chars_per_token.is_finite() && CHARS_PER_TOKEN_RANGE.contains(chars_per_token) {
                    self.chars_per_token = *chars_per_token;
                }
            }
        }
    }

    /// Bounds worker `w`'s LRU by the room its KV has for ended prompts: its capacity less
    /// the blocks running requests pin there ([`Speculative::reserved`]). Engine-fed workers
    /// keep the wide bound their events need.
    fn fit_lru(&mut self, w: WorkerId) {
        if self.engine_fed(w) {
            return;
        }
        let Some(wc) = self.cfg.workers.get(usize::from(w)) else {
            return;
        };
        let kv = self.cfg.kv_blocks(wc);
        // An engine preempts before running requests fill its whole KV; the floor keeps a
        // miscount (estimated token counts, a lost end) from wiping what the worker caches.
        let cap = kv.saturating_sub(self.speculative.reserved(w)).max(kv / 4);
        self.index.set_capacity(w, cap);
    }

    /// Whether the engine's own KV events describe this worker's cache (precise mode).
    pub fn engine_fed(&self, w: WorkerId) -> bool {
        self.engine_fed
            .get(usize::from(w))
            .copied()
            .unwrap_or(false)
    }

    /// Drops a confirmed pick once the index (the engine's reports) holds its whole prompt
    /// on every worker it went to; true when dropped.
    fn engine_reported(&mut self, id: RequestId, now_ms: u64) -> bool {
        let Some(p) = self.speculative.get(id) else {
            return true;
        };
        // Chained hashes name a whole prefix and engines evict a chain from its end, so the
        // pick's last block stands for all of it: this runs for every pick on a worker at each
        // of its engine's event batches, and walking every block there (plus its text's map)
        // cost each Envoy thread a lookup per block per batch (issue 42).
        let Some(&last) = p.hashes.last() else {
            return true;
        };
        let mut held = [0u32; crate::ids::MAX_WORKERS];
        self.index.lookup(&[last], now_ms, &mut held);
        // A pick routed on text: the engine reports its last block under the token block the
        // text was learned to end in.
        let tr = self.twins.translate_one(last);
        if let Some(tok) = tr {
            let mut eng = [0u32; crate::ids::MAX_WORKERS];
            self.index.lookup(&[tok], now_ms, &mut eng);
            for (h, e) in held.iter_mut().zip(eng) {
                *h = (*h).max(e);
            }
        }
        let done = core::iter::once(p.worker)
            .chain(p.prefill)
            .all(|w| held.get(usize::from(w)).is_some_and(|&n| n >= 1));
        if done {
            self.speculative.take(id);
        }
        done
    }

    /// A confirmed pick the engine has not reported within `relay.speculative_ms` leaves
    /// the speculative entries. A pick on text that no tokenize answer mapped to engine blocks
    /// yet (see `twins`) cannot be checked against the engine: it goes into the index as a
    /// prediction, as in predicted mode, instead of vanishing (its document would look cold
    /// to the next request, which cost precise mode hit rate when tokenize answers were late).
    fn unreported(&mut self, id: RequestId, now_ms: u64) {
        let Some(p) = self.speculative.take(id) else {
            return;
        };
        if !self.twins.translate(&p.hashes).is_empty() {
            return;
        }
        let mut held = [0u32; crate::ids::MAX_WORKERS];
        self.index.lookup(&p.hashes, now_ms, &mut held);
        let full = u32::try_from(p.hashes.len()).unwrap_or(u32::MAX);
        for w in core::iter::once(p.worker).chain(p.prefill) {
            if held.get(usize::from(w)).is_some_and(|&n| n < full) {
                self.index.insert(w, &p.hashes, now_ms);
            }
        }
    }

    /// After engine events for `worker`: confirmed picks on it that the engine has now
    /// reported leave; after a reset (`cleared`) all of them do, whatever they expected.
    fn settle_confirmed(&mut self, worker: WorkerId, now_ms: u64, cleared: bool) {
        if self.confirmed.is_empty() {
            return;
        }
        let queue = core::mem::take(&mut self.confirmed);
        for (until, id) in queue {
            let on_worker = self
                .speculative
                .get(id)
                .is_some_and(|p| p.worker == worker || p.prefill == Some(worker));
            let gone = if !on_worker {
                self.speculative.get(id).is_none()
            } else if cleared {
                self.speculative.take(id);
                true
            } else {
                self.engine_reported(id, now_ms)
            };
            if !gone {
                self.confirmed.push_back((until, id));
            }
        }
    }

    /// Raises `out[w]` to the leading text blocks of `text` whose learned engine block worker
    /// `w`'s engine reports holding (precise mode for text prompts, see `twins`).
    fn engine_held_text(&self, text: &[u64], now_ms: u64, out: &mut [u32]) {
        if !self.engine_fed.iter().any(|&f| f) {
            return;
        }
        let tr = self.twins.translate(text);
        if tr.is_empty() {
            return;
        }
        let mut eng = vec![0u32; out.len()];
        self.index.lookup(&tr, now_ms, &mut eng);
        for (o, e) in out.iter_mut().zip(eng) {
            *o = (*o).max(e);
        }
    }

    /// Whether a tokenize answer for this text prompt would teach `twins` anything (and a
    /// worker is engine-fed, the only case where it is used).
    pub fn wants_tokens(&self, text: &[u64]) -> bool {
        !text.is_empty() && self.engine_fed.iter().any(|&f| f) && self.twins.wants(text)
    }

    /// What a tokenize answer teaches: the request's text block hashes (`text`, as routed)
    /// paired with the engine blocks they end in. `None` when the body no longer parses,
    /// the prompt was token ids, or nothing pairs.
    pub fn learn_tokens(
        &mut self,
        kind: ApiKind,
        body: &[u8],
        text: &[u64],
        tokens: &[u32],
        now_ms: u64,
    ) -> Option<Event> {
        let req = parse(kind, body).ok()?;
        if matches!(req.prompt, Prompt::Tokens(_)) {
            return None;
        }
        let params = HashParams::from_config(&self.cfg);
        let ph = token_prompt_hashes(&req, tokens, &params, self.cfg.limits.max_blocks as usize);
        let (t, k) = Twins::pairs(text, &ph.blocks);
        if t.is_empty() {
            return None;
        }
        let e = Event::TextTokens { text: t, tokens: k };
        self.apply(&e, now_ms);
        Some(e)
    }

    /// Text block mappings held (`kvroute_precise_text_blocks`).
    pub fn twins_len(&self) -> usize {
        self.twins.len()
    }

    /// A pick's blocks are the engine's to confirm: every worker it goes to is engine-fed.
    fn fed(&self, p: &Pending) -> bool {
        self.engine_fed(p.worker) && p.prefill.is_none_or(|w| self.engine_fed(w))
    }

    /// First response byte: the prompt has been computed. `success` (a 2xx answer) also
    /// confirms the request's index entries; any other answer leaves them speculative until
    /// the request ends and drops them.
    pub fn on_first_byte(&mut self, d: &Decision, success: bool, now_ms: u64) -> Vec<Event> {
        let mut out = vec![self.on_prefill_done(d, now_ms)];
        out.extend(self.on_confirmed(d, success, now_ms));
        out
    }

    /// The first half of [`Router::on_first_byte`]: the prompt's prefill left the worker's
    /// queue (cheap; the load it frees matters to the very next pick).
    pub fn on_prefill_done(&mut self, d: &Decision, now_ms: u64) -> Event {
        let e = Event::PrefillDone { id: d.id };
        self.apply(&e, now_ms);
        e
    }

    /// The second half: a 2xx answer confirms the request's blocks (computed, pinned on the
    /// worker until the request ends, when `on_finish` puts them into the index). It walks
    /// every block of the prompt, so the filter runs this after the first byte went on to
    /// the client (at the next chunk or when the request ends).
    pub fn on_confirmed(&mut self, d: &Decision, success: bool, now_ms: u64) -> Option<Event> {
        if !success || d.hashes().is_empty() {
            return None;
        }
        let e = Event::Confirmed { id: d.id };
        self.apply(&e, now_ms);
        Some(e)
    }

    /// The request is over (success or not): release its load; a confirmed prompt enters
    /// the index (inserting a cold prompt's blocks costs a few hundred microseconds: the
    /// filter calls this from its log callback, after the answer's last byte).
    pub fn on_finish(&mut self, d: &Decision, now_ms: u64) -> Event {
        let e = Event::Free { id: d.id };
        self.apply(&e, now_ms);
        e
    }

    /// A worker failed (its own 5xx, refused, reset, timeout): cool it down. The request's
    /// blocks were never confirmed, so they leave with its `Free`; nothing is forgotten from
    /// the index, where other requests' confirmed blocks on that worker live (`Forget` is
    /// still applied when a peer of an older build sends it).
    pub fn on_failure(&mut self, _d: &Decision, worker: WorkerId, now_ms: u64) -> Vec<Event> {
        let out = vec![Event::Failed {
            worker,
            at_ms: now_ms,
        }];
        for e in &out {
            self.apply(e, now_ms);
        }
        out
    }

    /// A worker answered well: end its cooldown early if it had one.
    pub fn on_success(&mut self, worker: WorkerId, now_ms: u64) -> Option<Event> {
        let healthy = self.worker_view(worker, now_ms).healthy;
        if healthy {
            return None;
        }
        let e = Event::Recovered { worker };
        self.apply(&e, now_ms);
        Some(e)
    }

    /// A worker's adapters from its metrics (`vllm:lora_requests_info`).
    pub fn on_lora(&mut self, worker: WorkerId, report: LoraReport, now_ms: u64) -> Event {
        let e = Event::Lora { worker, report };
        self.apply(&e, now_ms);
        e
    }

    /// The adapter a request's `model` names (`lora.adapters`), 0 for none.
    fn adapter_of(&self, model: &str) -> AdapterId {
        if self.cfg.lora.adapters.iter().any(|a| a == model) {
            adapter_id(model)
        } else {
            0
        }
    }

    fn adapter_loads(&self, w: WorkerId, adapter: AdapterId) -> f64 {
        if adapter == 0 {
            0.0
        } else {
            self.adapters.fit(w, adapter).loads()
        }
    }

    pub fn adapters(&self) -> &Adapters {
        &self.adapters
    }

    pub fn on_orca(&mut self, worker: WorkerId, o: &OrcaLoad, now_ms: u64) -> Event {
        // A report may carry only some metrics; keep the others from the last one.
        let prev = self.load.last_report(worker);
        let e = Event::Report {
            worker,
            report: Report {
                kv_usage: o.kv_usage.or(prev.map(|r| r.kv_usage)).unwrap_or(0.0),
                waiting: o.waiting.or(prev.map(|r| r.waiting)).unwrap_or(0),
                running: o.running,
                at_ms: now_ms,
            },
        };
        self.apply(&e, now_ms);
        e
    }

    /// Usage reported by the engine: calibrate chars per token (text prompts) and measure
    /// how good the prediction was.
    pub fn on_usage(
        &mut self,
        d: &Decision,
        u: &Usage,
        now_ms: u64,
    ) -> (UsageOutcome, Option<Event>) {
        let mut out = UsageOutcome::default();
        if u.prompt_tokens == 0 || d.fallback.is_some() {
            return (out, None);
        }
        if let Some(c) = u.cached_tokens {
            out.actual_hit = Some(f64::from(c.min(u.prompt_tokens)) / f64::from(u.prompt_tokens));
            // Compare fractions: the token estimate of a text prompt may be off while the
            // block prediction is right. One block of slack for the engine's partial block.
            let predicted = d.predicted_hit() * f64::from(u.prompt_tokens);
            out.overpredicted = f64::from(c) + f64::from(self.cfg.block_size) < predicted;
        }
        let mut ev = None;
        if !d.exact_tokens && d.prompt_bytes_est > 0.0 {
            let observed = d.prompt_bytes_est / f64::from(u.prompt_tokens);
            let upstream = usize::from(d.target);
            if let Some(next) = self.calib.observe(upstream, observed, self.chars_per_token) {
                if (next - self.chars_per_token).abs() > 0.01 {
                    let e = Event::Calibrate {
                        chars_per_token: next,
                    };
                    self.apply(&e, now_ms);
                    ev = Some(e);
                }
            }
        }
        (out, ev)
    }

    /// Periodic housekeeping: lost requests and stale index entries.
    pub fn tick(&mut self, now_ms: u64) -> (usize, usize) {
        self.flush();
        // Another thread's pick whose event came before the pick was read (the request
        // already ended) is charged until its window ends; releasing it is no lost request.
        self.load.expire_provisional(now_ms);
        let lost = self.load.expire(now_ms);
        // A confirmation or end that never arrived (lost with its VM).
        self.speculative
            .expire(now_ms.saturating_sub(self.cfg.load.request_ttl_ms));
        while let Some(&(until, id)) = self.confirmed.front() {
            if until > now_ms {
                break;
            }
            self.confirmed.pop_front();
            self.unreported(id, now_ms);
        }
        let stale = self.index.expire(now_ms, 4096);
        (lost, stale)
    }

    /// Releases the requests started by replica `origin`, declared dead by replication: it
    /// will never send their ends. Our own origin is never purged.
    pub fn purge_origin(&mut self, origin: u64) -> usize {
        // Ids carry their replica's origin in the high 32 bits (see `next_id`).
        let tag = (origin & 0xFFFF_FFFF) << 32;
        if tag == self.origin {
            return 0;
        }
        self.load.free_matching(|id| id >> 32 == tag >> 32)
    }

    /// Releases every request of the peer gateway with id prefix `tag` (it is gone: it will
    /// never send their ends) and drops the blocks they were expected to leave.
    /// A prompt that extends the whole prompt of another gateway's request still in flight
    /// here is that conversation's next turn: its client has read the answer, so that
    /// request was answered and has ended; its end events are only still on their way from
    /// the other gateway (a few ms at idle, tens under load). Applied now, so the next turn
    /// finds its prompt cached on its worker, not that worker busy prefilling it: charged as
    /// running, the first turn moved one in two second turns sent at once through the other
    /// gateway (issue 46). The late events then find nothing left to do. Only peers' requests:
    /// this gateway's own end before their client can send another turn.
    ///
    /// A prefix the worker already held when that request came (in the index) is a shared
    /// one, like a request in flight's last block that others expect too (see
    /// `Speculative::extended_by`): such a request may still run, and stays.
    fn end_continued_peer_requests(&mut self, hashes: &[u64], now_ms: u64) {
        let ids = self
            .speculative
            .extended_by(hashes, crate::precise::peers::is_peer_id);
        let mut run = vec![0u32; self.cfg.workers.len()];
        for id in ids {
            let Some(p) = self.speculative.get(id) else {
                continue;
            };
            self.index.lookup(&p.hashes, now_ms, &mut run);
            if run.get(usize::from(p.worker)).copied().unwrap_or(0) as usize >= p.hashes.len() {
                continue;
            }
            self.apply(&Event::Confirmed { id }, now_ms);
            self.apply(&Event::Free { id }, now_ms);
        }
    }

    pub fn purge_peer(&mut self, tag: u64) -> usize {
        let mine = |id: RequestId| crate::precise::peers::is_peer_request(id, tag);
        self.flush();
        self.speculative.drop_matching(mine);
        self.load.free_matching(mine)
    }

    pub fn worker_name(&self, w: WorkerId) -> &str {
        self.cfg
            .workers
            .get(usize::from(w))
            .map(|c| c.name.as_str())
            .unwrap_or("")
    }

    pub fn worker_cluster(&self, w: WorkerId) -> &str {
        self.cfg
            .workers
            .get(usize::from(w))
            .map(|c| c.cluster_name())
            .unwrap_or("")
    }

    pub fn worker_endpoint(&self, w: WorkerId) -> Option<&str> {
        self.cfg
            .workers
            .get(usize::from(w))
            .and_then(|c| c.endpoint.as_deref())
    }
}

fn describe(e: &ParseError) -> String {
    e.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cfg(extra: &str) -> Config {
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

    fn completion(prompt: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 16}))
            .unwrap()
    }

    fn routed(r: RouteResult) -> Decision {
        match r {
            RouteResult::Routed(d) => d,
            r => panic!("not routed: {r:?}"),
        }
    }

    /// Two models on disjoint pools: decode a0-a1 and prefill pa serve model A (and its
    /// adapter), b0-b1 and pb model B.
    fn two_models(extra: &str) -> Router {
        let json = format!(
            r#"{{"workers":[
                {{"name":"a0","endpoint":"127.0.0.1:8001","models":["A","A-lora"]}},
                {{"name":"a1","endpoint":"127.0.0.1:8002","models":["A","A-lora"]}},
                {{"name":"b0","endpoint":"127.0.0.1:8003","models":["B"]}},
                {{"name":"b1","endpoint":"127.0.0.1:8004","models":["B"]}},
                {{"name":"pa","endpoint":"127.0.0.1:8101","role":"prefill","models":["A","A-lora"]}},
                {{"name":"pb","endpoint":"127.0.0.1:8102","role":"prefill","models":["B"]}}
            ],"disaggregation":{{"threshold_tokens":1000,"compare_cost":false}}{extra}}}"#
        );
        Router::new(Config::from_json(json.as_bytes()).unwrap(), 1, 5)
    }

    fn model_request(model: &str, prompt: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 8}))
            .unwrap()
    }

    #[test]
    fn requests_stay_in_their_models_pools() {
        let mut r = two_models("");
        let name = |r: &Router, w: WorkerId| r.config().workers[usize::from(w)].name.clone();
        for i in 0..24u64 {
            let (model, pool) = match i % 3 {
                0 => ("A", 'a'),
                1 => ("A-lora", 'a'),
                _ => ("B", 'b'),
            };
            // Long cold prompts go through the prefill pool of their model only.
            let d = routed(r.route(
                ApiKind::Completions,
                &model_request(model, &doc(i, 40_000)),
                i,
            ));
            assert!(
                name(&r, d.decode).starts_with(pool),
                "{model} -> {}",
                name(&r, d.decode)
            );
            let p = d.prefill.expect("disaggregated");
            assert_eq!(name(&r, p), format!("p{pool}"));
            assert!(d.alternates.iter().all(|&w| name(&r, w).starts_with(pool)));
            let short = routed(r.route(ApiKind::Completions, &model_request(model, "hi"), i));
            assert!(name(&r, short.decode).starts_with(pool));
        }
        // No model: any worker, as before.
        let d = routed(r.route(ApiKind::Completions, br#"{"prompt":"x"}"#, 99));
        assert_eq!(d.fallback, None);
    }

    fn keyed(prompt: &str, key: &str) -> Vec<u8> {
        serde_json::to_vec(
            &serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 8,
            "prompt_cache_key": key}),
        )
        .unwrap()
    }

    /// Requests with one key and unrelated text keep to one worker while it is quiet, and
    /// leave it when its queue is long; the key then lives on the new worker only.
    #[test]
    fn a_cache_key_keeps_its_worker_while_load_allows() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 9);
        let first = routed(r.route(ApiKind::Completions, &keyed(&doc(1, 2000), "agent-7"), 0));
        assert!(first.hinted.is_some());
        r.on_first_byte(&first, true, 5);
        r.on_finish(&first, 10);
        for i in 0..8u64 {
            let d = routed(r.route(
                ApiKind::Completions,
                &keyed(&doc(10 + i, 2000), "agent-7"),
                20 + i,
            ));
            assert_eq!(d.decode, first.decode, "request {i}");
            assert_eq!(
                d.overlap_tokens, 0,
                "no text in common: the hint is not cache"
            );
            r.on_finish(&d, 30 + i);
        }
        // Without the key the same requests spread.
        let spread: std::collections::HashSet<_> = (0..8u64)
            .map(|i| {
                let d = routed(r.route(
                    ApiKind::Completions,
                    &completion(&doc(40 + i, 2000)),
                    50 + i,
                ));
                r.on_finish(&d, 60 + i);
                d.decode
            })
            .collect();
        assert!(spread.len() > 1, "{spread:?}");
        // Its worker's queue grows long: the key's next request goes elsewhere, and stays.
        let hot = first.decode;
        for i in 0..16u64 {
            r.apply(
                &Event::Routed(NewRequest {
                    id: 1 << 40 | i,
                    worker: hot,
                    prefill_worker: None,
                    blocks: Vec::new(),
                    cached_blocks: 0,
                    tail_blocks: 150,
                    prefill_tokens: 2000,
                    now_ms: 70,
                    adapter: 0,
                }),
                70,
            );
        }
        let moved = routed(r.route(ApiKind::Completions, &keyed(&doc(200, 2000), "agent-7"), 80));
        assert_ne!(moved.decode, hot);
        let mut holds = vec![0u32; 6];
        let Some(Event::Hinted { hash, .. }) = moved.hinted else {
            panic!("no hint")
        };
        r.index().lookup(&[hash], 80, &mut holds);
        assert_eq!(holds.iter().sum::<u32>(), 1);
        assert_eq!(holds[usize::from(moved.decode)], 1);
        // The session header is the same hint when the body has no key.
        let a =
            routed(r.route_hinted(ApiKind::Completions, &completion("x"), None, Some("s1"), 90));
        r.on_finish(&a, 91);
        let b =
            routed(r.route_hinted(ApiKind::Completions, &completion("y"), None, Some("s1"), 92));
        assert_eq!(a.decode, b.decode);
    }

    #[test]
    fn a_model_no_worker_serves_is_rejected_or_passed_on() {
        let mut r = two_models("");
        assert_eq!(
            r.route(ApiKind::Completions, &model_request("C", "x"), 0),
            RouteResult::UnknownModel("C".into())
        );
        assert_eq!(r.load().totals(), (0, 0, 0), "nothing charged");
        let mut r = two_models(r#","unknown_model":"pass""#);
        let d = routed(r.route(ApiKind::Completions, &model_request("C", "x"), 0));
        assert_eq!(d.fallback, Some(Fallback::UnknownModel("C".into())));
        // The top-level list is every worker's default.
        let json = r#"{"workers":[{"name":"a"},{"name":"b","models":["B"]}],"models":["A"]}"#;
        let mut r = Router::new(Config::from_json(json.as_bytes()).unwrap(), 1, 5);
        for (model, worker) in [("A", 0), ("B", 1)] {
            let d = routed(r.route(ApiKind::Completions, &model_request(model, "x"), 0));
            assert_eq!(d.decode, worker);
        }
        assert!(matches!(
            r.route(ApiKind::Completions, &model_request("C", "x"), 0),
            RouteResult::UnknownModel(_)
        ));
    }

    fn doc(seed: u64, bytes: usize) -> String {
        let mut r = Rng::new(seed);
        (0..bytes / 6)
            .map(|_| ["alpha ", "bravo ", "delta ", "gamma ", "kappa "][r.below(5)])
            .collect()
    }

    /// The next turn of a conversation another gateway routed arrives before that gateway's
    /// end events for the first turn: it still goes to the first turn's worker, whose load
    /// no longer counts the first turn. A prompt that only shares a prefix, or repeats the
    /// whole prompt, ends nothing.
    #[test]
    fn the_next_turn_ends_the_peer_request_it_continues() {
        let extra = r#","disaggregation":{"threshold_tokens":0}"#;
        let first = doc(70, 320);
        let mut a = Router::new(cfg(extra), 1, 7);
        let d = routed(a.route(ApiKind::Completions, &completion(&first), 10));
        let mut adopted = Vec::new();
        let mut peers = crate::precise::peers::Peers::new(&cfg(extra));
        let tag = crate::precise::peers::peer_tag("a");
        peers.adopt(vec![d.event.clone()], tag, 10, &mut adopted);
        // `as_peer: false` applies the decision as a local one, which this never ends: the
        // behaviour peers' requests had before.
        let moves = |seed: u64, as_peer: bool| {
            let mut b = Router::new(cfg(extra), 2, seed);
            for e in if as_peer {
                &adopted[..]
            } else {
                core::slice::from_ref(&d.event)
            } {
                b.apply(e, 10);
            }
            assert_eq!(b.worker_view(d.decode, 11).inflight, 1);
            // The same prompt again, or one sharing only its first block, ends nothing.
            let shared = first[..70].to_string() + &doc(71, 300);
            for p in [&first, &shared] {
                let x = routed(b.route(ApiKind::Completions, &completion(p), 11));
                b.apply(&Event::Free { id: x.id }, 11);
                assert_eq!(b.worker_view(d.decode, 11).inflight, 1);
            }
            let next = format!("{first} answer of turn one, and the user's next question");
            let n = routed(b.route(ApiKind::Completions, &completion(&next), 12));
            assert!(n.decode_overlap_tokens > 0 || n.decode != d.decode);
            if as_peer {
                let running = u32::from(n.decode == d.decode);
                assert_eq!(
                    b.worker_view(d.decode, 12).inflight,
                    running,
                    "turn one ended"
                );
            }
            n.decode != d.decode
        };
        let moved = |as_peer| (0..20).filter(|&s| moves(s, as_peer)).count();
        assert_eq!(moved(true), 0, "next turns moved");
        assert!(moved(false) >= 10, "{} of 20", moved(false));

        // A prefix that is not the peer's own: its worker held it already (an earlier request
        // ended there), or another request in flight expects it too. It stays charged.
        let longer = format!("{first} and a different question after the shared part");
        for shared_by in ["index", "in flight"] {
            let mut b = Router::new(cfg(extra), 2, 3);
            if shared_by == "index" {
                let mut earlier = d.event.clone();
                if let Event::Routed(r) = &mut earlier {
                    r.id = 77;
                }
                b.apply(&earlier, 5);
                b.apply(&Event::Confirmed { id: 77 }, 6);
                b.apply(&Event::Free { id: 77 }, 7);
            }
            for e in &adopted {
                b.apply(e, 10);
            }
            if shared_by == "in flight" {
                let mut other = Vec::new();
                peers.adopt(
                    vec![d.event.clone()],
                    crate::precise::peers::peer_tag("c"),
                    10,
                    &mut other,
                );
                for e in &other {
                    b.apply(e, 10);
                }
            }
            let before = b.worker_view(d.decode, 11).inflight;
            let n = routed(b.route(ApiKind::Completions, &completion(&longer), 12));
            let after = b.worker_view(d.decode, 12).inflight;
            assert_eq!(
                after,
                before + u32::from(n.decode == d.decode),
                "{shared_by}"
            );
        }
    }

    /// Two threads routing one burst: without the shared record each sees every worker
    /// idle and their cold prompts pile onto the same workers; with it each charges the
    /// other's picks and the burst spreads. The event that follows replaces the provisional
    /// charge, and a charge whose event never came is released after the window.
    #[test]
    fn peer_picks_spread_a_burst_routed_on_two_threads() {
        let extra = r#","disaggregation":{"threshold_tokens":0}"#;
        let burst: Vec<Vec<u8>> = (0..4).map(|i| completion(&doc(40 + i, 20_000))).collect();
        let workers_used = |share: bool| {
            let mut a = Router::new(cfg(extra), 1, 7);
            let mut b = Router::new(cfg(extra), 2, 7);
            let mut record = picks::encode(&[]);
            let mut used = Vec::new();
            for (i, body) in burst.iter().enumerate() {
                let r = if i % 2 == 0 { &mut a } else { &mut b };
                if share {
                    r.note_peer_picks(&picks::decode(&record), 10);
                }
                let d = routed(r.route(ApiKind::Completions, body, 10));
                if let Some(p) = d.pick() {
                    record = picks::merge(&record, p, 10);
                }
                used.push(d.decode);
            }
            used.sort_unstable();
            used.dedup();
            used.len()
        };
        assert_eq!(workers_used(true), 4);
        // Same seeds, no record: each thread repeats the other's choices.
        assert!(workers_used(false) < 4);

        let mut a = Router::new(cfg(extra), 1, 7);
        let mut b = Router::new(cfg(extra), 2, 9);
        let d = routed(a.route(ApiKind::Completions, &burst[0], 10));
        let pick = d.pick().expect("routed");
        assert_eq!(b.note_peer_picks(&[pick], 10), 1);
        assert_eq!(b.note_peer_picks(&[pick], 11), 0, "charged once");
        assert_eq!(a.note_peer_picks(&[pick], 11), 0, "its own pick");
        let provisional = b.load().totals();
        assert_eq!(provisional.1, u64::from(pick.prefill_tokens));
        b.apply(&d.event, 12);
        assert_eq!(
            b.load().totals(),
            a.load().totals(),
            "the event replaced it"
        );
        b.note_peer_picks(&[], 10 + picks::WINDOW_MS + 1);
        assert_eq!(
            b.load().totals(),
            a.load().totals(),
            "a real charge is not expired"
        );

        let mut c = Router::new(cfg(extra), 3, 9);
        c.note_peer_picks(&[pick], 10);
        assert_eq!(c.load().totals().0, 1);
        assert_eq!(c.note_peer_picks(&[pick], 10 + picks::WINDOW_MS), 0);
        assert_eq!(c.load().totals().0, 1, "still inside the window");
        c.note_peer_picks(&[], 10 + picks::WINDOW_MS + 1);
        assert_eq!(c.load().totals(), (0, 0, 0), "never replaced: released");
        // A pick read after its request's whole life reached this thread is not charged:
        // a phantom in flight would make a quiet worker look busy (e2e: a session's
        // sequential turns on two threads then left their worker).
        let mut e = Router::new(cfg(extra), 4, 9);
        let mut evs = vec![d.event.clone()];
        evs.extend(a.on_first_byte(&d, true, 15));
        evs.extend(a.on_confirmed(&d, true, 16));
        evs.push(a.on_finish(&d, 20));
        for ev in &evs {
            e.apply(ev, 21);
        }
        assert_eq!(e.load().totals(), (0, 0, 0));
        assert_eq!(e.note_peer_picks(&[pick], 30), 0);
        assert_eq!(e.load().totals(), (0, 0, 0));
        // With no request to route, housekeeping releases it, and not as a lost request.
        c.note_peer_picks(&[pick], 10);
        assert_eq!(c.tick(10 + picks::WINDOW_MS + 1).0, 0);
        assert_eq!(c.load().totals(), (0, 0, 0));
    }

    #[test]
    fn same_long_prefix_returns_to_its_worker() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 7);
        let base = doc(1, 8000);
        let first = routed(r.route(ApiKind::Completions, &completion(&base), 0));
        r.on_first_byte(&first, true, 5);
        r.on_finish(&first, 10);
        for i in 0..5 {
            let d = routed(r.route(
                ApiKind::Completions,
                &completion(&format!("{base} question {i}")),
                100 + i,
            ));
            assert_eq!(d.decode, first.decode);
            assert!(d.predicted_hit() > 0.9, "{}", d.predicted_hit());
            r.on_finish(&d, 200 + i);
        }
        assert_eq!(r.load().totals(), (0, 0, 0));
    }

    #[test]
    fn long_cold_prompt_goes_to_prefill_pool_and_repeat_stays_on_decode() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":1000}"#), 1, 3);
        let long = doc(2, 40_000); // ~10k tokens at 4 chars per token
        let d = routed(r.route(ApiKind::Completions, &completion(&long), 0));
        let p = d.prefill.expect("disaggregated");
        assert_eq!(d.target, p);
        assert!(r.config().workers[usize::from(p)].role == Role::Prefill);
        r.on_first_byte(&d, true, 4);
        r.on_finish(&d, 5);
        let again = routed(r.route(ApiKind::Completions, &completion(&long), 10));
        assert_eq!(again.prefill, None, "cached on the decode worker now");
        assert_eq!(again.decode, d.decode);
        assert_eq!(again.target, d.decode);
    }

    /// Long cold prompts arrive faster than anything finishes: the pool takes them while its
    /// queue is no deeper than the decode workers' would be, then they prefill locally.
    #[test]
    fn prefill_pool_only_while_its_queue_is_shorter() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":1000}"#), 1, 3);
        let (mut pool, mut local) = (0, 0);
        for i in 0..12 {
            let d = routed(r.route(ApiKind::Completions, &completion(&doc(100 + i, 40_000)), i));
            match d.prefill {
                Some(_) => pool += 1,
                None => local += 1,
            }
        }
        // Two pool workers against four decode workers: the pool takes its share, not all.
        assert!((2..=6).contains(&pool), "pool {pool}, local {local}");
        assert!(local >= 6, "pool {pool}, local {local}");
    }

    /// Without the cost comparison every prompt over the threshold goes to the pool, however
    /// deep its queue (llm-d's rule).
    #[test]
    fn prefill_pool_takes_every_long_prompt_without_the_cost_comparison() {
        let extra = r#","disaggregation":{"threshold_tokens":1000,"compare_cost":false}"#;
        let mut r = Router::new(cfg(extra), 1, 3);
        for i in 0..12 {
            let d = routed(r.route(ApiKind::Completions, &completion(&doc(100 + i, 40_000)), i));
            assert!(d.prefill.is_some(), "request {i} prefilled locally");
        }
    }

    #[test]
    fn llm_d_mode_steers_to_decode_and_names_prefill() {
        let mut r = Router::new(
            cfg(r#","disaggregation":{"threshold_tokens":1000,"mode":"llm-d"}"#),
            1,
            3,
        );
        let d = routed(r.route(ApiKind::Completions, &completion(&doc(3, 40_000)), 0));
        assert!(d.prefill.is_some());
        assert_eq!(d.target, d.decode);
    }

    #[test]
    fn unparseable_body_falls_back_and_is_counted_as_load() {
        let mut r = Router::new(cfg(""), 1, 3);
        let d = routed(r.route(ApiKind::Completions, b"{not json", 0));
        assert_eq!(d.fallback.as_ref().map(Fallback::kind), Some("parse_error"));
        assert_eq!(r.worker_view(d.target, 0).inflight, 1);
        r.on_finish(&d, 1);
        assert_eq!(r.load().totals(), (0, 0, 0));
    }

    #[test]
    fn unusable_costs_fall_back_as_no_candidates() {
        // Every cost overflows to infinity, so scoring cannot rank the workers.
        let mut r = Router::new(
            cfg(
                r#","scoring":{"prefill_load_scale":1e308},"disaggregation":{"threshold_tokens":0}"#,
            ),
            1,
            3,
        );
        let d = routed(r.route(ApiKind::Completions, &completion(&doc(7, 8000)), 0));
        assert_eq!(d.fallback, Some(Fallback::NoCandidates));
        assert_eq!(
            d.fallback.as_ref().map(Fallback::kind),
            Some("no_candidates")
        );
        assert_eq!(r.worker_view(d.target, 0).inflight, 1);
        r.on_finish(&d, 1);
        assert_eq!(r.load().totals(), (0, 0, 0));
    }

    #[test]
    fn failure_cools_down_and_forgets_uncomputed_blocks() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 3);
        let half = doc(4, 4000);
        let text = format!("{half}{}", doc(40, 4000));
        // An earlier request confirmed the first half on its worker.
        let first = routed(r.route(ApiKind::Completions, &completion(&half), 0));
        r.on_first_byte(&first, true, 0);
        r.on_finish(&first, 0);
        let d = routed(r.route(ApiKind::Completions, &completion(&text), 0));
        assert_eq!(d.decode, first.decode);
        let evs = r.on_failure(&d, d.decode, 1);
        assert_eq!(evs.len(), 1, "{evs:?}");
        assert!(matches!(evs[0], Event::Failed { .. }));
        r.on_finish(&d, 1);
        assert_eq!(r.speculative_requests(), 0);
        // The confirmed half stays, the failed request's own blocks are gone.
        let mut held = vec![0u32; 6];
        r.held_blocks(d.hashes(), 2, &mut held);
        assert_eq!(held[usize::from(d.decode)] as usize, first.hashes().len());
        assert!(!r.worker_view(d.decode, 2).healthy);
        let again = routed(r.route(ApiKind::Completions, &completion(&text), 3));
        assert_ne!(again.decode, d.decode, "avoids the failed worker");
        assert_eq!(again.overlap_tokens, 0);
    }

    #[test]
    fn engine_fed_workers_trust_engine_events_over_their_own_picks() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 3);
        for w in 0..4 {
            r.apply(
                &Event::EngineFeed {
                    worker: w,
                    on: true,
                },
                0,
            );
        }
        assert!(r.engine_fed(2) && !r.engine_fed(4));
        let text = doc(6, 8000);
        let d = routed(r.route(ApiKind::Completions, &completion(&text), 5));
        let w = usize::from(d.decode);
        let n = d.hashes().len() as u32;
        r.on_first_byte(&d, true, 10);
        r.on_finish(&d, 20);
        let mut held = vec![0u32; 6];
        // Confirmed on an engine-fed worker: still counted while the engine's event is due.
        r.held_blocks(d.hashes(), 30, &mut held);
        assert_eq!(held[w], n);
        // The engine never reported it and no tokenize answer mapped its text to engine
        // blocks: after `relay.speculative_ms` it stays as a prediction (predicted mode's).
        r.tick(10 + 2_000);
        r.held_blocks(d.hashes(), 2_010, &mut held);
        assert_eq!(held[w], n, "an unmapped text pick is kept as a prediction");
        assert_eq!(r.speculative_requests(), 0);
        r.apply(&Event::EngineCleared { worker: d.decode }, 2_020);
        r.held_blocks(d.hashes(), 2_020, &mut held);
        assert_eq!(held[w], 0, "a reset drops it");
        // What the engine reports is held, and a reset (restart) drops it at once.
        let other = (d.decode + 1) % 4;
        r.apply(
            &Event::EngineStored {
                worker: other,
                hashes: d.hashes().to_vec(),
            },
            2_100,
        );
        r.held_blocks(d.hashes(), 2_100, &mut held);
        assert_eq!(held[usize::from(other)], n);
        let again = routed(r.route(ApiKind::Completions, &completion(&text), 2_200));
        assert_eq!(again.decode, other);
        r.on_first_byte(&again, true, 2_210);
        r.on_finish(&again, 2_220);
        r.apply(&Event::EngineCleared { worker: other }, 2_300);
        r.tick(2_210 + 2_000);
        r.held_blocks(d.hashes(), 4_300, &mut held);
        assert_eq!(held[usize::from(other)], 0);
        // Without the feed, a confirmed pick goes into the index as before.
        r.apply(
            &Event::EngineFeed {
                worker: other,
                on: false,
            },
            4_400,
        );
        let third = routed(r.route(ApiKind::Completions, &completion(&text), 4_500));
        r.on_first_byte(&third, true, 4_510);
        r.on_finish(&third, 4_520);
        r.tick(9_000);
        r.held_blocks(d.hashes(), 9_000, &mut held);
        let kept = usize::from(third.decode);
        assert_eq!(held[kept], n);

        // Once the text maps to engine blocks the engine's word decides, on every worker: a
        // mapped pick it never reported is not held, and what it reports is held for text.
        for w in 0..4 {
            r.apply(&Event::EngineCleared { worker: w }, 9_100);
            r.apply(
                &Event::EngineFeed {
                    worker: w,
                    on: true,
                },
                9_100,
            );
        }
        let toks: Vec<u64> = (0..u64::from(n)).map(|i| 0xabc0_0000 + i).collect();
        let (t, k) = Twins::pairs(d.hashes(), &toks);
        r.apply(&Event::TextTokens { text: t, tokens: k }, 9_100);
        let fourth = routed(r.route(ApiKind::Completions, &completion(&text), 9_200));
        assert_eq!(fourth.overlap_tokens, 0);
        r.on_first_byte(&fourth, true, 9_210);
        r.on_finish(&fourth, 9_220);
        r.tick(9_210 + 2_000);
        r.held_blocks(d.hashes(), 11_300, &mut held);
        assert_eq!(
            held[usize::from(fourth.decode)],
            0,
            "a mapped pick the engine never reported"
        );
        let holder = (fourth.decode + 2) % 4;
        r.apply(
            &Event::EngineStored {
                worker: holder,
                hashes: toks.clone(),
            },
            11_400,
        );
        let fifth = routed(r.route(ApiKind::Completions, &completion(&text), 11_500));
        assert_eq!(fifth.decode, holder);
        assert!(fifth.overlap_tokens > 0);
    }

    #[test]
    fn replicas_converge_through_events() {
        let mut a = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 3);
        let mut b = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 2, 4);
        let text = doc(5, 8000);
        let d = routed(a.route(ApiKind::Completions, &completion(&text), 0));
        let mut evs = vec![d.event.clone()];
        evs.extend(a.on_first_byte(&d, true, 1));
        let msg = crate::events::encode(0, &evs);
        for e in crate::events::decode(&msg).unwrap().1 {
            b.apply(&e, 1);
        }
        assert_eq!(b.worker_view(d.decode, 2).inflight, 1);
        // b has never seen the prompt but routes it where a did, while a's request decodes.
        let db = routed(b.route(ApiKind::Completions, &completion(&text), 2));
        assert_eq!(db.decode, d.decode);
        assert_ne!(db.id, d.id);
        assert_eq!(b.worker_view(d.decode, 2).inflight, 2);
    }

    /// The ladder's rungs: a cold prompt has none; its repeat was seen, is held and routed
    /// to its holder; another VM sees it through the replicated event; a prompt a worker
    /// forgot is still workload reuse but no longer fleet-held.
    #[test]
    fn ladder_rungs_follow_the_workload_the_fleet_and_the_pick() {
        let extra = r#","disaggregation":{"threshold_tokens":0}"#;
        let mut a = Router::new(cfg(extra), 1, 3);
        let mut b = Router::new(cfg(extra), 2, 4);
        let text = doc(8, 8000);
        let d = routed(a.route(ApiKind::Completions, &completion(&text), 0));
        assert_eq!(d.ladder, Ladder::default());
        for e in [d.event.clone()]
            .iter()
            .chain(&a.on_first_byte(&d, true, 1))
        {
            b.apply(e, 1);
        }
        a.on_finish(&d, 2);
        let again = routed(a.route(
            ApiKind::Completions,
            &completion(&format!("{text} next")),
            3,
        ));
        let l = again.ladder;
        assert!(l.routed > again.prompt_tokens * 9 / 10, "{l:?}");
        assert_eq!((l.workload, l.fleet), (l.routed, l.routed), "{l:?}");
        assert_eq!(l.routed, again.overlap_tokens);
        // The other VM never routed it, yet saw it (and its worker holds it: in flight).
        let on_b = routed(b.route(ApiKind::Completions, &completion(&text), 3));
        assert!(
            on_b.ladder.workload > on_b.prompt_tokens * 9 / 10,
            "{:?}",
            on_b.ladder
        );
        assert_eq!(on_b.ladder.fleet, on_b.ladder.workload);
        // Every worker forgot it: seen, not held.
        a.on_finish(&again, 4);
        let hashes = again.hashes().to_vec();
        for w in 0..6 {
            a.apply(
                &Event::Forget {
                    worker: w,
                    hashes: hashes.clone(),
                },
                5,
            );
        }
        let forgot = routed(a.route(ApiKind::Completions, &completion(&text), 6));
        assert!(
            forgot.ladder.workload > forgot.prompt_tokens * 9 / 10,
            "{:?}",
            forgot.ladder
        );
        assert_eq!((forgot.ladder.fleet, forgot.ladder.routed), (0, 0));
        // A fallback has no ladder.
        let f = routed(a.route(ApiKind::Completions, b"{broken", 7));
        assert_eq!(f.ladder, Ladder::default());
    }

    /// Load beats cache: the holder is busy, the pick goes elsewhere, and `fleet - routed`
    /// is what that cost.
    #[test]
    fn ladder_shows_the_load_trade() {
        let extra = r#","disaggregation":{"threshold_tokens":0}"#;
        let mut r = Router::new(cfg(extra), 1, 3);
        let text = doc(9, 2000);
        let first = routed(r.route(ApiKind::Completions, &completion(&text), 0));
        r.on_first_byte(&first, true, 1);
        r.on_finish(&first, 2);
        // Pile long cold prompts onto the holder's queue by reporting it busy.
        r.on_orca(
            first.decode,
            &OrcaLoad {
                kv_usage: Some(0.5),
                waiting: Some(50),
                running: Some(8),
            },
            3,
        );
        let d = routed(r.route(ApiKind::Completions, &completion(&text), 4));
        assert_ne!(d.decode, first.decode);
        assert!(
            d.ladder.fleet > 0 && d.ladder.routed < d.ladder.fleet,
            "{:?}",
            d.ladder
        );
        assert_eq!(d.ladder.workload, d.ladder.fleet);
    }

    /// One decode worker with room for 64 blocks (1024 tokens).
    fn small_worker() -> Router {
        let json = r#"{"workers":[{"name":"d0","endpoint":"127.0.0.1:8001","kv_blocks":64}],
            "disaggregation":{"threshold_tokens":0}}"#;
        Router::new(Config::from_json(json.as_bytes()).unwrap(), 1, 3)
    }

    #[test]
    fn rejected_requests_do_not_evict_a_warm_prefix() {
        let mut r = small_worker();
        let warm = doc(8, 2000); // ~31 blocks
        let d = routed(r.route(ApiKind::Completions, &completion(&warm), 0));
        r.on_first_byte(&d, true, 1);
        r.on_finish(&d, 2);
        // Four prompts over the worker's whole capacity, each answered 400 by the engine.
        for i in 0..4u64 {
            let big = doc(100 + i, 8000);
            let b = routed(r.route(ApiKind::Completions, &completion(&big), 10 + i));
            r.on_first_byte(&b, false, 11 + i);
            r.on_finish(&b, 12 + i);
        }
        // A client that gave up before any answer leaves nothing either.
        let gone = routed(r.route(ApiKind::Completions, &completion(&doc(200, 8000)), 20));
        r.on_finish(&gone, 21);
        assert_eq!(r.speculative_requests(), 0);
        let again = routed(r.route(ApiKind::Completions, &completion(&warm), 30));
        assert!(again.predicted_hit() > 0.9, "{}", again.predicted_hit());
    }

    /// The engine pins a running request's blocks: a prompt still answering is held however
    /// much came after it, and when it ends its blocks are the worker's most recent.
    #[test]
    fn a_running_prompt_stays_held_and_is_most_recent_when_it_ends() {
        let mut r = small_worker();
        let long = doc(8, 2000); // ~31 of the worker's 64 blocks
        let d = routed(r.route(ApiKind::Completions, &completion(&long), 0));
        r.on_first_byte(&d, true, 1);
        let n = d.hashes().len() as u32;
        // While it streams, two other prompts fill the worker's capacity and finish: an LRU
        // ordered by routing or answer time would have dropped the first prompt by now.
        for i in 0..2u64 {
            let o = routed(r.route(
                ApiKind::Completions,
                &completion(&doc(100 + i, 2000)),
                10 + i,
            ));
            r.on_first_byte(&o, true, 11 + i);
            r.on_finish(&o, 12 + i);
        }
        let mut held = vec![0u32; 1];
        r.index().lookup(d.hashes(), 20, &mut held);
        assert!(held[0] < n, "not in the index yet ({} of {n})", held[0]);
        r.held_blocks(d.hashes(), 20, &mut held);
        assert_eq!(held[0], n, "but it is still running");
        assert_eq!(
            r.speculative_requests(),
            0,
            "confirmed requests are not speculative"
        );
        r.on_finish(&d, 30);
        r.index().lookup(d.hashes(), 31, &mut held);
        assert_eq!(held[0], n, "freed last: back in the index");
        // The last prompt routed before it ended is what the next one evicts first.
        let next = routed(r.route(ApiKind::Completions, &completion(&doc(300, 2000)), 40));
        r.on_first_byte(&next, true, 41);
        r.on_finish(&next, 42);
        r.index().lookup(d.hashes(), 43, &mut held);
        assert_eq!(held[0], n, "most recently freed, so kept");
        // A request that ends without an answer leaves nothing, confirmed or not.
        let failed = routed(r.route(ApiKind::Completions, &completion(&doc(400, 2000)), 50));
        r.on_first_byte(&failed, false, 51);
        r.on_finish(&failed, 52);
        r.index().lookup(failed.hashes(), 53, &mut held);
        assert_eq!(held[0], 0);
    }

    #[test]
    fn running_requests_take_room_from_ended_prompts() {
        let mut r = small_worker();
        let mut held = vec![0u32; 1];
        let old = routed(r.route(ApiKind::Completions, &completion(&doc(1, 2000)), 0));
        r.on_first_byte(&old, true, 1);
        r.on_finish(&old, 2);
        let n = old.hashes().len() as u32;
        r.index().lookup(old.hashes(), 3, &mut held);
        assert_eq!(held[0], n);
        // A second prompt of the same size runs while a third comes and goes: with ~31 of
        // the 64 blocks pinned, the engine has room for the third and little of the first.
        let running = routed(r.route(ApiKind::Completions, &completion(&doc(2, 2000)), 10));
        r.on_first_byte(&running, true, 11);
        let n_running = running.hashes().len() as u32;
        let third = routed(r.route(ApiKind::Completions, &completion(&doc(3, 2000)), 20));
        r.on_first_byte(&third, true, 21);
        r.on_finish(&third, 22);
        r.index().lookup(third.hashes(), 23, &mut held);
        assert_eq!(held[0], third.hashes().len() as u32);
        r.index().lookup(old.hashes(), 23, &mut held);
        assert!(
            held[0] <= 64 - n_running - n,
            "the first prompt's blocks made room: {} of {n} left",
            held[0]
        );
        // Ended, the running prompt frees its room and is the newest content.
        r.on_finish(&running, 30);
        r.index().lookup(running.hashes(), 31, &mut held);
        assert_eq!(held[0], n_running);
        r.index().lookup(third.hashes(), 31, &mut held);
        assert_eq!(held[0], third.hashes().len() as u32);
    }

    #[test]
    fn a_burst_sees_unconfirmed_picks_and_a_confirmed_prompt_stays() {
        let mut r = Router::new(cfg(r#","disaggregation":{"threshold_tokens":0}"#), 1, 3);
        let text = doc(9, 8000);
        let first = routed(r.route(ApiKind::Completions, &completion(&text), 0));
        // Not answered yet: the next identical request still sees the pick.
        let second = routed(r.route(ApiKind::Completions, &completion(&text), 1));
        assert_eq!(r.speculative_requests(), 2);
        let mut held = vec![0u32; 6];
        r.flush();
        r.held_blocks(first.hashes(), 1, &mut held);
        let n = first.hashes().len() as u32;
        assert_eq!(held[usize::from(first.decode)], n);
        assert_eq!(held[usize::from(second.decode)], n);
        r.index().lookup(first.hashes(), 1, &mut held);
        assert_eq!(held, vec![0; 6], "nothing confirmed yet");
        r.on_first_byte(&first, true, 2);
        r.on_finish(&first, 3);
        r.on_finish(&second, 3);
        assert_eq!(r.speculative_requests(), 0);
        let third = routed(r.route(ApiKind::Completions, &completion(&text), 4));
        assert_eq!(third.decode, first.decode);
        assert!(third.predicted_hit() > 0.9, "{}", third.predicted_hit());
    }

    #[test]
    fn replicas_confirm_or_drop_speculative_entries_by_event() {
        let cfg0 = r#","disaggregation":{"threshold_tokens":0}"#;
        let mut a = Router::new(cfg(cfg0), 1, 3);
        let mut b = Router::new(cfg(cfg0), 2, 4);
        let ok = doc(10, 8000);
        let bad = doc(11, 8000);
        let d_ok = routed(a.route(ApiKind::Completions, &completion(&ok), 0));
        let d_bad = routed(a.route(ApiKind::Completions, &completion(&bad), 0));
        let mut evs = vec![d_ok.event.clone(), d_bad.event.clone()];
        evs.extend(a.on_first_byte(&d_ok, true, 1));
        evs.extend(a.on_first_byte(&d_bad, false, 1));
        assert!(evs.contains(&Event::Confirmed { id: d_ok.id }));
        assert!(!evs.contains(&Event::Confirmed { id: d_bad.id }));
        evs.push(a.on_finish(&d_ok, 2));
        evs.push(a.on_finish(&d_bad, 2));
        let msg = crate::events::encode(0, &evs);
        for e in crate::events::decode(&msg).unwrap().1 {
            b.apply(&e, 2);
        }
        assert_eq!(b.speculative_requests(), 0);
        let mut held = vec![0u32; 6];
        for (text, want) in [(&ok, true), (&bad, false)] {
            let body = completion(text);
            let req = parse(ApiKind::Completions, &body).unwrap();
            let ph = crate::hashing::prompt_hashes(&req, &HashParams::from_config(b.config()));
            b.index().lookup(&ph.blocks, 3, &mut held);
            assert_eq!(held.iter().any(|&n| n > 0), want);
        }
    }

    #[test]
    fn request_ids_stay_distinct_past_65536_vm_creations() {
        let body = completion("hello");
        let ids: Vec<RequestId> = [1u64, 1 + (1 << 16), 1 + (1 << 20), u64::from(u32::MAX)]
            .iter()
            .map(|&origin| {
                let mut r = Router::new(cfg(""), origin, 3);
                routed(r.route(ApiKind::Completions, &body, 0)).id
            })
            .collect();
        let mut uniq = ids.clone();
        uniq.sort_unstable();
        uniq.dedup();
        assert_eq!(uniq.len(), ids.len(), "{ids:x?}");
    }

    #[test]
    fn limits_bound_what_one_request_costs() {
        let extra = r#","disaggregation":{"threshold_tokens":0},"limits":{"max_route_bytes":20000,"max_blocks":10}"#;
        let mut r = Router::new(cfg(extra), 1, 3);
        // Over max_route_bytes: not parsed, counted as its own fallback, still load.
        let d = routed(r.route(ApiKind::Completions, &completion(&doc(12, 30_000)), 0));
        assert_eq!(d.fallback, Some(Fallback::TooLarge));
        assert_eq!(d.fallback.as_ref().map(Fallback::kind), Some("too_large"));
        assert!(d.hashes().is_empty());
        assert_eq!(r.worker_view(d.target, 0).inflight, 1);
        r.on_finish(&d, 1);
        // Within it but over max_blocks: only the leading blocks are hashed and replicated,
        // the token estimate still covers the whole prompt, and the prefix keeps its affinity.
        let text = doc(13, 16_000); // ~250 blocks of 64 bytes
        let d = routed(r.route(ApiKind::Completions, &completion(&text), 2));
        assert_eq!(d.fallback, None);
        assert_eq!(d.hashes().len(), 10);
        assert!(d.prompt_tokens > 3000, "{}", d.prompt_tokens);
        let Event::Routed(ev) = &d.event else {
            panic!("not routed")
        };
        assert_eq!(ev.blocks.len(), 10);
        r.on_first_byte(&d, true, 3);
        r.on_finish(&d, 4);
        let again = routed(r.route(
            ApiKind::Completions,
            &completion(&format!("{text} and more")),
            5,
        ));
        assert_eq!(again.decode, d.decode);
        assert_eq!(again.overlap_tokens, 10 * 16);
        assert!(Config::from_json(br#"{"limits":{"max_blocks":0}}"#).is_err());
        assert_eq!(Config::default().limits.max_route_bytes, 8 << 20);
    }

    #[test]
    fn streams_asking_for_usage_are_read_for_it_after_a_warm_up_only_when_sampled() {
        fn stream(usage: bool) -> Vec<u8> {
            let mut b =
                serde_json::json!({"model": "m", "prompt": "q", "max_tokens": 4, "stream": true});
            if usage {
                b["stream_options"] = serde_json::json!({"include_usage": true});
            }
            serde_json::to_vec(&b).unwrap()
        }
        fn read_chunks(r: &mut Router, body: &[u8]) -> bool {
            let d = routed(r.route(ApiKind::Completions, body, 0));
            r.on_finish(&d, 0);
            !d.usage_at_end_only
        }
        let mut r = Router::new(cfg(r#","limits":{"usage_read_every":4}"#), 1, 3);
        let warm = usize::try_from(USAGE_WARMUP).unwrap();
        let read: Vec<bool> = (0..warm + 8)
            .map(|_| read_chunks(&mut r, &stream(true)))
            .collect();
        assert!(read[..warm].iter().all(|&x| x));
        assert_eq!(
            read[warm..],
            [true, false, false, false, true, false, false, false]
        );
        // A stream without usage asked is never read before its end, and does not count.
        assert!(!read_chunks(&mut r, &stream(false)));
        assert!(read_chunks(&mut r, &stream(true)));
        assert!(!read_chunks(&mut r, &stream(true)));
        // A response that is not a stream is one body: always read, and not counted.
        assert!(read_chunks(&mut r, &completion("q")));
        let mut every = Router::new(cfg(r#","limits":{"usage_read_every":1}"#), 1, 3);
        assert!((0..warm + 8).all(|_| read_chunks(&mut every, &stream(true))));
        assert_eq!(Config::default().limits.usage_read_every, 8);
        assert!(Config::from_json(br#"{"limits":{"usage_read_every":0}}"#).is_err());
    }

    #[test]
    fn partial_orca_report_keeps_the_other_metric() {
        let mut r = Router::new(cfg(""), 1, 3);
        let full = OrcaLoad {
            kv_usage: Some(0.5),
            waiting: Some(3),
            running: None,
        };
        r.on_orca(0, &full, 10);
        let partial = OrcaLoad {
            kv_usage: None,
            waiting: Some(7),
            running: None,
        };
        r.on_orca(0, &partial, 20);
        let rep = r.worker_view(0, 20).report.unwrap();
        assert_eq!((rep.kv_usage, rep.waiting), (0.5, 7));
    }

    #[test]
    fn usage_calibrates_chars_per_token() {
        let mut r = Router::new(cfg(""), 1, 3);
        let d = routed(r.route(ApiKind::Completions, &completion(&doc(6, 4000)), 0));
        let u = Usage {
            prompt_tokens: d.prompt_tokens / 2,
            completion_tokens: 1,
            cached_tokens: Some(0),
        };
        let before = r.chars_per_token();
        let (_, ev) = r.on_usage(&d, &u, 1);
        assert!(ev.is_some());
        assert!(r.chars_per_token() > before);
    }
}
