//! The relay's re-keying reproduces the hashes kvroute computes for a token-id prompt.

use kvroute::hashing::{chain_seed, prompt_hashes, HashParams};
use kvroute::request::{parse, ApiKind};
use kvroute_relay::decode::decode_batch;
use kvroute_relay::index::{Counts, DeltaBuilder, EngineIndex};
use kvroute_relay::vllm::{batch, Ev, Hash};

fn kvroute_hashes(model: &str, ids: &[u32], block_size: u32) -> Vec<u64> {
    let body = format!(r#"{{"model":"{model}","prompt":{ids:?}}}"#);
    let p = HashParams {
        block_size,
        chars_per_token: 4.0,
    };
    prompt_hashes(&parse(ApiKind::Completions, body.as_bytes()).unwrap(), &p).blocks
}

fn apply(ix: &mut EngineIndex, evs: &[Ev], c: &mut Counts) -> kvroute_relay::index::Delta {
    let payload = batch(evs, false);
    let b = decode_batch(&payload).unwrap();
    let mut d = DeltaBuilder::default();
    for e in &b.events {
        ix.apply(e, &mut d, c);
    }
    d.finish()
}

#[test]
fn stored_chain_equals_token_prompt_hashes() {
    let bs = 4u32;
    let ids: Vec<u32> = (0..22).map(|i| i * 7919 + 3).collect();
    let want = kvroute_hashes("llama", &ids, bs);
    assert_eq!(want.len(), 5);
    let mut ix = EngineIndex::new("llama", bs);
    let mut c = Counts::default();
    // The engine stores the prompt in two events: blocks 0-1, then 2-4 under parent 1.
    let full = &ids[..20];
    let d1 = apply(
        &mut ix,
        &[Ev::Stored {
            hashes: vec![Hash::Int(100), Hash::Int(101)],
            parent: None,
            tokens: full[..8].to_vec(),
            block_size: bs,
            lora_name: None,
        }],
        &mut c,
    );
    let d2 = apply(
        &mut ix,
        &[Ev::Stored {
            hashes: vec![Hash::Bytes(vec![1; 32]), Hash::Int(103), Hash::Int(104)],
            parent: Some(Hash::Int(101)),
            tokens: full[8..].to_vec(),
            block_size: bs,
            lora_name: None,
        }],
        &mut c,
    );
    let got: Vec<u64> = d1.stored.iter().chain(&d2.stored).copied().collect();
    assert_eq!(got, want);
    assert_eq!(c.blocks_stored, 5);
    assert_eq!(ix.blocks.snapshot(), want, "snapshot lists parents first");

    // Removal translates engine hashes back to kvroute hashes.
    let d3 = apply(
        &mut ix,
        &[Ev::Removed(vec![Hash::Int(104), Hash::Int(999)])],
        &mut c,
    );
    assert_eq!(d3.removed, vec![want[4]]);
    assert_eq!(ix.blocks.len(), 4);

    // Another model's seed gives other hashes.
    let mut other = EngineIndex::new("other", bs);
    let d = apply(
        &mut other,
        &[Ev::Stored {
            hashes: vec![Hash::Int(1)],
            parent: None,
            tokens: ids[..4].to_vec(),
            block_size: bs,
            lora_name: None,
        }],
        &mut c,
    );
    assert_ne!(d.stored[0], want[0]);
}

#[test]
fn lora_name_seeds_like_a_request_naming_the_adapter() {
    let ids: Vec<u32> = (0..8).collect();
    let want = kvroute_hashes("my-adapter", &ids, 4);
    let mut ix = EngineIndex::new("base", 4);
    let mut c = Counts::default();
    let d = apply(
        &mut ix,
        &[Ev::Stored {
            hashes: vec![Hash::Int(1), Hash::Int(2)],
            parent: None,
            tokens: ids,
            block_size: 4,
            lora_name: Some("my-adapter".into()),
        }],
        &mut c,
    );
    assert_eq!(d.stored, want);
    assert_ne!(chain_seed("my-adapter", None), chain_seed("base", None));
}

#[test]
fn orphans_size_mismatch_and_clear() {
    let mut ix = EngineIndex::new("m", 4);
    let mut c = Counts::default();
    let tokens: Vec<u32> = (0..8).collect();
    let d = apply(
        &mut ix,
        &[
            Ev::Stored {
                hashes: vec![Hash::Int(1), Hash::Int(2)],
                parent: Some(Hash::Int(77)),
                tokens: tokens.clone(),
                block_size: 4,
                lora_name: None,
            },
            Ev::Stored {
                hashes: vec![Hash::Int(3)],
                parent: None,
                tokens: tokens.clone(),
                block_size: 8,
                lora_name: None,
            },
            Ev::Stored {
                hashes: vec![Hash::Int(4)],
                parent: None,
                tokens: tokens[..3].to_vec(),
                block_size: 4,
                lora_name: None,
            },
        ],
        &mut c,
    );
    assert!(d.stored.is_empty());
    assert_eq!((c.orphans, c.size_mismatch, c.bad_events), (2, 1, 1));
    assert!(ix.blocks.is_empty());

    let d = apply(
        &mut ix,
        &[
            Ev::Stored {
                hashes: vec![Hash::Int(1)],
                parent: None,
                tokens: tokens[..4].to_vec(),
                block_size: 4,
                lora_name: None,
            },
            Ev::Cleared,
            Ev::Stored {
                hashes: vec![Hash::Int(2)],
                parent: None,
                tokens: tokens[4..].to_vec(),
                block_size: 4,
                lora_name: None,
            },
        ],
        &mut c,
    );
    assert!(d.cleared);
    assert_eq!(
        d.stored.len(),
        1,
        "blocks stored before the clear are not announced"
    );
    assert_eq!(ix.blocks.len(), 1);
}

#[test]
fn delta_builder_nets_out_store_then_remove() {
    let mut b = DeltaBuilder::default();
    b.store(1);
    b.store(2);
    b.remove(1);
    b.remove(3);
    b.store(3);
    b.store(2);
    let d = b.finish();
    assert_eq!(d.stored, vec![2, 3]);
    assert_eq!(d.removed, vec![1]);
}

/// Bytes per indexed block stay within budget (the index is the snapshot set too).
#[test]
fn index_stays_compact() {
    let mut ix = EngineIndex::new("m", 1);
    let mut d = DeltaBuilder::default();
    let mut c = Counts::default();
    let n = 100_000u32;
    for i in 0..n {
        let e = kvroute_relay::decode::Event::Stored(kvroute_relay::decode::Stored {
            block_hashes: vec![u64::from(i) * 0x9e37_79b9],
            parent: None,
            token_ids: vec![i],
            block_size: Some(1),
            lora_name: None,
        });
        ix.apply(&e, &mut d, &mut c);
    }
    let per = ix.blocks.bytes() as f64 / f64::from(n);
    assert!(per <= 64.0, "{per} bytes per block");
}
