//! Candidates and requests the selection tests share.

use super::{Candidate, Outcome, Pick, RequestShape};
use crate::load::WorkerView;

pub(super) fn cand(id: u16, overlap: u32, load: WorkerView) -> Candidate {
    Candidate {
        id,
        overlap_tokens: overlap * 16,
        kv_blocks: 1000,
        indexed_blocks: 0,
        load,
        confirmed_tokens: overlap * 16,
        placed_tokens: overlap * 16,
        placed_confirmed_tokens: overlap * 16,
        family_share: None,
        speed: 1.0,
        adapter_loads: 0.0,
    }
}

pub(super) fn idle() -> WorkerView {
    WorkerView {
        healthy: true,
        ..WorkerView::default()
    }
}

pub(super) fn shape(tokens: u32) -> RequestShape {
    RequestShape {
        prompt_tokens: tokens,
        total_blocks: tokens.div_ceil(16),
    }
}

pub(super) fn picked(o: Outcome) -> Pick {
    match o {
        Outcome::Picked(p) => p,
        other => panic!("expected a pick, got {other:?}"),
    }
}
