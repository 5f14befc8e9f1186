//! Canonical prompt stream and chained block hashes (steps 3-4 of the data flow).
//!
//! A prompt becomes a byte stream, the stream is cut into fixed-size blocks, and block `i`
//! is identified by a hash chained over every block before it, so equal hashes mean equal
//! prefixes and the prefix index can stop at the first miss.
//!
//! * Token-id prompts are hashed exactly: `block_size` ids per block, each id as u32
//!   little-endian, as Dynamo's router hashes them (our seed differs: model and salt).
//! * Text has no tokenizer here: blocks are `round(block_size * chars_per_token)` bytes of
//!   the stream, and the token count is estimated from the byte count.
//! * Chat messages are rendered into the stream by the `canon` submodule, whose format
//!   makes the stream of a conversation a byte prefix of the stream of any continuation.

mod canon;

use canon::Sink;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config::Config;
use crate::ids::DEFAULT_CHARS_PER_TOKEN;
use crate::request::{InferenceRequest, Prompt};

/// Block sizes beyond these are configuration mistakes; clamping them keeps the
/// arithmetic and the block buffer bounded whatever the configuration says.
const MAX_BLOCK_TOKENS: u32 = 1 << 16;
const MAX_BLOCK_BYTES: usize = 1 << 20;

/// Seed of the seed: any fixed value works, it only has to never change.
const BASE_SEED: u64 = 1337;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HashParams {
    /// Tokens per block (the engines' KV block size). 0 is treated as 1.
    pub block_size: u32,
    /// Bytes of text per token, for text prompts. Non-finite or non-positive values fall
    /// back to the default.
    pub chars_per_token: f64,
}

/// The configuration's defaults.
impl Default for HashParams {
    fn default() -> Self {
        Self::from_config(&Config::default())
    }
}

impl HashParams {
    /// The configured block size and chars per token. Calibration never changes these: it
    /// would change every text block's hash.
    pub fn from_config(cfg: &Config) -> Self {
        Self {
            block_size: cfg.block_size,
            chars_per_token: cfg.chars_per_token,
        }
    }

    /// Tokens per block actually used, in `1..=65536`.
    pub fn tokens_per_block(&self) -> usize {
        // u32 always fits in usize on the targets we build for (32 and 64 bit).
        self.block_size.clamp(1, MAX_BLOCK_TOKENS) as usize
    }

    /// Bytes of text per token actually used.
    fn chars_per_token(&self) -> f64 {
        let c = self.chars_per_token;
        if c.is_finite() && c > 0.0 {
            c
        } else {
            DEFAULT_CHARS_PER_TOKEN
        }
    }

    /// Bytes of text per block: `block_size * chars_per_token`, rounded, at least 1.
    pub fn text_block_bytes(&self) -> usize {
        let bytes = (self.tokens_per_block() as f64 * self.chars_per_token()).round();
        if bytes < 1.0 {
            1
        } else if bytes >= MAX_BLOCK_BYTES as f64 {
            MAX_BLOCK_BYTES
        } else {
            // In range and integral, so the conversion is exact.
            bytes as usize
        }
    }

    /// Estimated tokens in `bytes` bytes of text, rounded up, saturating at `u32::MAX`.
    pub fn estimate_tokens(&self, bytes: usize) -> u32 {
        // Float-to-int `as` saturates, which is the behaviour wanted here.
        (bytes as f64 / self.chars_per_token()).ceil() as u32
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PromptHashes {
    /// Chained hashes of the full blocks of the routing prompt, in order.
    pub blocks: Vec<u64>,
    /// Tokens the worker will prefill: every token of every batch entry, including partial
    /// tails; exact for token-id prompts, estimated for text.
    pub est_tokens: u32,
    /// Whether the prompt was token ids, so blocks match the engine's blocks exactly.
    pub exact: bool,
}

/// The chain seed for a model and cache salt: requests for different models or with
/// different salts never share a block hash. `Some("")` differs from `None`.
fn seed(model: &str, salt: Option<&str>) -> u64 {
    let model_seed = xxh3_64_with_seed(model.as_bytes(), BASE_SEED);
    match salt {
        None => model_seed,
        // Hashing the salt under the model's seed keeps ("ab", None) apart from ("a", "b").
        Some(salt) => xxh3_64_with_seed(salt.as_bytes(), model_seed ^ 1),
    }
}

/// Keeps hint hashes apart from block hashes under the same seed.
const HINT_DOMAIN: u64 = 0x6b76_726f_7574_6568;

/// The virtual block a client hint (`prompt_cache_key`, a session header) stands for:
/// recorded on the worker a hinted request went to, so the next request with the same key
/// finds it there as one cached block. Seeded like the prompt's blocks, so a key is
/// separate per model and salt.
pub fn hint_hash(model: &str, salt: Option<&str>, key: &str) -> u64 {
    xxh3_64_with_seed(key.as_bytes(), seed(model, salt) ^ HINT_DOMAIN)
}

/// Block hashes and token estimate of a request's prompt.
///
/// For a batch, only the first entry (the routing prompt) is hashed; all entries count
/// towards `est_tokens`.
pub fn prompt_hashes(req: &InferenceRequest<'_>, p: &HashParams) -> PromptHashes {
    prompt_hashes_limited(req, p, usize::MAX)
}

/// `prompt_hashes` of at most the first `max_blocks` blocks: hashing stops there (the token
/// estimate still covers the whole prompt).
pub fn prompt_hashes_limited(
    req: &InferenceRequest<'_>,
    p: &HashParams,
    max_blocks: usize,
) -> PromptHashes {
    let seed = seed(&req.model, req.cache_salt.as_deref());
    match &req.prompt {
        Prompt::Tokens(lists) => {
            let first = lists.first().map_or(&[][..], Vec::as_slice);
            let est = lists.iter().map(Vec::len).fold(0u32, |sum, n| {
                sum.saturating_add(u32::try_from(n).unwrap_or(u32::MAX))
            });
            PromptHashes {
                blocks: token_blocks(first, p.tokens_per_block(), seed, max_blocks),
                est_tokens: est,
                exact: true,
            }
        }
        Prompt::Text(texts) => {
            let first = texts.first().map_or("", |t| t.as_ref()).as_bytes();
            let mut chain = Chain::new(seed, p.text_block_bytes(), first.len(), max_blocks);
            chain.put(first);
            let est = texts.iter().fold(0u32, |sum, t| {
                sum.saturating_add(p.estimate_tokens(t.len()))
            });
            PromptHashes {
                blocks: chain.into_blocks(),
                est_tokens: est,
                exact: false,
            }
        }
        Prompt::Chat { messages, tools } => {
            let mut chain = Chain::new(
                seed,
                p.text_block_bytes(),
                canon::size_hint(messages),
                max_blocks,
            );
            canon::write_chat(&mut chain, messages, tools);
            let est = p.estimate_tokens(chain.fed);
            PromptHashes {
                blocks: chain.into_blocks(),
                est_tokens: est,
                exact: false,
            }
        }
    }
}

/// `prompt_hashes` of a request whose text prompt the engine tokenized into `tokens`: the
/// blocks of those ids, exact (as if the request had sent them).
pub fn token_prompt_hashes(
    req: &InferenceRequest<'_>,
    tokens: &[u32],
    p: &HashParams,
    max_blocks: usize,
) -> PromptHashes {
    let seed = seed(&req.model, req.cache_salt.as_deref());
    PromptHashes {
        blocks: token_blocks(tokens, p.tokens_per_block(), seed, max_blocks),
        est_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
        exact: true,
    }
}

/// The chain seed of a model and cache salt, as `prompt_hashes` uses it: for kvroute-relay,
/// which re-keys engine KV events into the filter's hashes.
pub fn chain_seed(model: &str, salt: Option<&str>) -> u64 {
    seed(model, salt)
}

/// Chained hash of one full block of token ids following `parent` (`None` for a prompt's
/// first block): block i of `prompt_hashes` for a token-id prompt is
/// `token_block_hash(hash of block i-1, ids of block i, chain_seed(model, salt))`.
pub fn token_block_hash(parent: Option<u64>, tokens: &[u32], seed: u64) -> u64 {
    let mut bytes = Vec::with_capacity(tokens.len().saturating_mul(4));
    for token in tokens {
        bytes.extend_from_slice(&token.to_le_bytes());
    }
    let local = xxh3_64_with_seed(&bytes, seed);
    match parent {
        None => local,
        Some(parent) => xxh3_64_with_seed(&pair(parent, local), seed),
    }
}

fn token_blocks(tokens: &[u32], per_block: usize, seed: u64, max_blocks: usize) -> Vec<u64> {
    let mut chain = Chain::new(seed, per_block.saturating_mul(4), 0, max_blocks);
    chain
        .blocks
        .reserve_exact((tokens.len() / per_block).min(max_blocks));
    let mut bytes = Vec::with_capacity(per_block.saturating_mul(4));
    for block in tokens.chunks_exact(per_block).take(max_blocks) {
        bytes.clear();
        for token in block {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        chain.link(xxh3_64_with_seed(&bytes, seed));
    }
    chain.into_blocks()
}

/// Cuts a byte stream arriving in arbitrary pieces into blocks and chains their hashes.
/// Blocks that lie inside one piece are hashed in place; only blocks straddling pieces go
/// through the small `pending` buffer, so a long prompt is never copied.
struct Chain {
    seed: u64,
    block: usize,
    pending: Vec<u8>,
    parent: Option<u64>,
    fed: usize,
    blocks: Vec<u64>,
    /// Blocks beyond this many are not hashed (the bytes still count in `fed`).
    max_blocks: usize,
}

impl Chain {
    fn new(seed: u64, block: usize, expected_bytes: usize, max_blocks: usize) -> Self {
        let block = block.max(1);
        Self {
            seed,
            block,
            pending: Vec::new(),
            parent: None,
            fed: 0,
            blocks: Vec::with_capacity((expected_bytes / block).min(max_blocks)),
            max_blocks,
        }
    }

    /// The first block has no parent, so its chained hash is its own hash.
    fn link(&mut self, local: u64) {
        let hash = match self.parent {
            None => local,
            Some(parent) => xxh3_64_with_seed(&pair(parent, local), self.seed),
        };
        self.parent = Some(hash);
        self.blocks.push(hash);
    }

    fn into_blocks(self) -> Vec<u64> {
        self.blocks
    }
}

impl Sink for Chain {
    fn put(&mut self, mut data: &[u8]) {
        self.fed = self.fed.saturating_add(data.len());
        if self.blocks.len() >= self.max_blocks {
            return;
        }
        if !self.pending.is_empty() {
            let missing = self.block.saturating_sub(self.pending.len());
            let (head, rest) = data.split_at(missing.min(data.len()));
            self.pending.extend_from_slice(head);
            data = rest;
            if self.pending.len() < self.block {
                return;
            }
            let local = xxh3_64_with_seed(&self.pending, self.seed);
            self.link(local);
            self.pending.clear();
        }
        let mut blocks = data.chunks_exact(self.block);
        for block in &mut blocks {
            if self.blocks.len() >= self.max_blocks {
                return;
            }
            let local = xxh3_64_with_seed(block, self.seed);
            self.link(local);
        }
        self.pending.extend_from_slice(blocks.remainder());
    }
}

fn pair(parent: u64, local: u64) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.to_le_bytes());
    bytes[8..].copy_from_slice(&local.to_le_bytes());
    bytes
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// The exact bytes whose blocks [`prompt_hashes`] hashes: the routing prompt's text, its
/// token ids as u32 little-endian, or the canonical chat stream: the reference the hashes
/// are checked against (by the tests and the fuzz targets).
pub fn canonical_stream(req: &InferenceRequest<'_>) -> Vec<u8> {
    match &req.prompt {
        Prompt::Tokens(lists) => lists
            .first()
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect(),
        Prompt::Text(texts) => texts.first().map_or("", |t| t.as_ref()).as_bytes().to_vec(),
        Prompt::Chat { messages, tools } => {
            let mut out = Vec::with_capacity(canon::size_hint(messages));
            canon::write_chat(&mut out, messages, tools);
            out
        }
    }
}

#[cfg(test)]
mod tests;
