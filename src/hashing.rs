//! STUB (replaced by the hash branch): prompt block hashes.
use crate::request::InferenceRequest;
pub struct HashParams { pub block_size: u32, pub chars_per_token: f64 }
pub struct PromptHashes { pub blocks: Vec<u64>, pub est_tokens: u32, pub exact: bool }
pub fn prompt_hashes(req: &InferenceRequest, p: &HashParams) -> PromptHashes {
    let bb = ((p.block_size as f64) * p.chars_per_token) as usize;
    let b = req.text.as_bytes();
    PromptHashes { blocks: b.chunks_exact(bb.max(1)).map(|c| xxhash_rust::xxh3::xxh3_64(c)).collect(), est_tokens: (b.len() as f64 / p.chars_per_token).ceil() as u32, exact: false }
}
