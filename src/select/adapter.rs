//! `adapter`: a LoRA adapter load stalls the engine's step (vLLM loads adapters inside it),
//! so everyone there waits for it as for prefill. Its tests run through the router
//! (`router/pool.rs`), where a request's adapter and the workers' slots are known.
//!   adapter = s * adapter loads (0 held, 1 free slot or an idle adapter replaced, 2 when
//!               the replaced adapter is held nowhere else or every slot is busy: see
//!               `crate::lora::Fit`) * lora.load_ms * prefill_tokens_per_s / block_size

use super::inputs::{Basis, Candidate, SelectParams};

/// Adapter loads, as the prefill they delay, scaled.
pub(super) fn adapter(p: &SelectParams, c: &Candidate, b: &Basis) -> f64 {
    p.prefill_load_scale * (c.adapter_loads * p.adapter_load_tokens / b.bs)
}
