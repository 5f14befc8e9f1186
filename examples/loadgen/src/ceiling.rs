//! The infinite-cache reuse ceiling of the requests a run sent: the share of prompt tokens
//! that a prefix cache with no capacity limit, shared by the whole fleet, would have served.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use mock_worker::{api, kv};

/// Per request index: (tokens an infinite cache would serve, prompt tokens). Replays the
/// bodies in the order they were sent with the mock worker's own prompt rendering and
/// tokenizer, chained `block`-token hashes as its prefix cache keys them, and its rule that
/// the last prompt token is always computed. Reply tokens are not cached here (a reply comes
/// back as text and is re-tokenized in the next turn), so the ceiling counts prompts only.
pub fn ideal_cached(sent: &mut [(f64, usize, Bytes)], block: usize) -> HashMap<usize, (u64, u64)> {
    sent.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let root = kv::chain_root(None);
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = HashMap::with_capacity(sent.len());
    let mut hashes = Vec::new();
    for (_, idx, body) in sent.iter() {
        let Ok(p) = api::parse(body, None) else {
            continue;
        };
        hashes.clear();
        kv::extend_hashes(&mut hashes, root, &p.tokens, block);
        let usable = (p.tokens.len().saturating_sub(1) / block).min(hashes.len());
        let hit = hashes[..usable]
            .iter()
            .take_while(|h| seen.contains(*h))
            .count();
        seen.extend(hashes.iter().copied());
        out.insert(*idx, ((hit * block) as u64, p.tokens.len() as u64));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::{push_words, seed_of};
    use serde_json::json;

    fn body(prompt: &str) -> Bytes {
        Bytes::from(serde_json::to_vec(&json!({"prompt": prompt, "max_tokens": 1})).unwrap())
    }

    fn words(seed: u64, n: usize) -> String {
        let mut s = String::new();
        push_words(&mut s, seed_of(&[seed]), n);
        s
    }

    #[test]
    fn counts_shared_full_blocks_in_send_order() {
        let (doc, q1, q2) = (words(1, 64), words(2, 10), words(3, 40));
        let a = format!("{doc}{q1}");
        let b = format!("{doc}{q2}");
        // Sent out of index order: b goes first, so a is the one that hits.
        let mut sent = vec![(2.0, 0, body(&a)), (1.0, 1, body(&b)), (3.0, 2, body(&doc))];
        let m = ideal_cached(&mut sent, 16);
        assert_eq!(m[&1], (0, 104));
        assert_eq!(m[&0], (64, 74));
        // The whole prompt is cached, but its last token is always computed: 3 blocks, not 4.
        assert_eq!(m[&2], (48, 64));
    }
}
