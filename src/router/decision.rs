//! What routing returns: the decision the HTTP context carries through the request, and
//! why a request was not cache-routed.

use crate::events::Event;
use crate::ids::{RequestId, WorkerId};
use crate::ladder::Ladder;
use crate::picks::Pick;
use crate::select;

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
