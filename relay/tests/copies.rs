//! Copies of one block: vLLM 0.32 caches a recomputed last block (a prompt cached up to its
//! last token, a multiple of the block size long) as a second physical copy with its own
//! `BlockStored` and, later, its own `BlockRemoved`; and two engine blocks can re-key to one
//! kvroute hash (a cache salt). The relay announces a hash removed only when the engine holds
//! no copy of any block with that hash.

mod common;

use common::{next, start_relay, watch, FakeEngine, Stream};
use kvroute::hashing::{chain_seed, token_block_hash};
use kvroute::precise::wire::Update;
use kvroute_relay::blocks::MAX_COPIES;
use kvroute_relay::decode::decode_batch;
use kvroute_relay::engine::{self, EngineOpts};
use kvroute_relay::hub::Hub;
use kvroute_relay::index::{Counts, Delta, DeltaBuilder, EngineIndex};
use kvroute_relay::vllm::{batch, chain, Ev, Hash};
use std::collections::HashSet;
use std::time::Duration;

const BS: u32 = 4;

fn apply(ix: &mut EngineIndex, evs: &[Ev], c: &mut Counts) -> Delta {
    let payload = batch(evs, true);
    let b = decode_batch(&payload).unwrap();
    let mut d = DeltaBuilder::default();
    for e in &b.events {
        ix.apply(e, &mut d, c);
    }
    d.finish()
}

/// The kvroute hash of one root block of tokens `first..first + BS`.
fn root_kv(first: u32) -> u64 {
    let tokens: Vec<u32> = (first..first + BS).collect();
    token_block_hash(None, &tokens, chain_seed("m", None))
}

fn removed(h: i64) -> Ev {
    Ev::Removed(vec![Hash::Int(h)])
}

/// Engine block `h` holding tokens `first..first + BS` at the root.
fn root(h: i64, first: u32) -> Ev {
    chain(None, h, 1, BS, first)
}

#[test]
fn a_block_stored_twice_goes_with_its_last_copy() {
    let mut ix = EngineIndex::new("m", BS);
    let mut c = Counts::default();
    let kv = root_kv(0);
    let d = apply(&mut ix, &[root(7, 0), root(7, 0)], &mut c);
    assert_eq!(d.stored, vec![kv]);
    assert_eq!((ix.blocks.len(), ix.blocks.copies(7)), (1, 2));

    let d = apply(&mut ix, &[removed(7)], &mut c);
    assert!(d.removed.is_empty(), "announced removed with a copy left");
    assert_eq!(ix.blocks.get(7), Some((kv, 0)));
    assert_eq!(ix.blocks.snapshot(), vec![kv]);

    let d = apply(&mut ix, &[removed(7)], &mut c);
    assert_eq!(d.removed, vec![kv]);
    assert_eq!(ix.blocks.get(7), None);
    assert!(ix.blocks.snapshot().is_empty());
    // A third BlockRemoved (none left): nothing.
    assert!(apply(&mut ix, &[removed(7)], &mut c).is_empty());
    assert_eq!((c.blocks_stored, c.blocks_removed), (2, 2));
}

#[test]
fn two_engine_blocks_with_one_kvroute_hash() {
    let mut ix = EngineIndex::new("m", BS);
    let mut c = Counts::default();
    let kv = root_kv(0);
    // Same tokens, other engine hashes (another cache salt), and a child under each.
    apply(&mut ix, &[root(1, 0), chain(Some(1), 2, 1, BS, 4)], &mut c);
    apply(
        &mut ix,
        &[root(11, 0), chain(Some(11), 12, 1, BS, 4)],
        &mut c,
    );
    assert_eq!(ix.blocks.len(), 4);
    assert_eq!(ix.blocks.holders(kv), 2);
    let child = ix.blocks.get(2).unwrap().0;
    assert_eq!(ix.blocks.get(12).unwrap().0, child);
    assert_eq!(ix.blocks.snapshot(), vec![kv, child], "each hash once");

    let d = apply(&mut ix, &[removed(2), removed(1)], &mut c);
    assert!(
        d.is_empty(),
        "announced {d:?} while blocks 11, 12 hold them"
    );
    let d = apply(&mut ix, &[removed(12), removed(11)], &mut c);
    assert_eq!(d.removed, vec![child, kv]);
    assert_eq!(ix.blocks.holders(kv), 0);
    assert!(ix.blocks.is_empty());
}

#[test]
fn a_block_stored_again_under_another_hash_keeps_a_twin_held() {
    let mut ix = EngineIndex::new("m", BS);
    let mut c = Counts::default();
    let (a, b) = (root_kv(0), root_kv(100));
    apply(&mut ix, &[root(1, 0), root(2, 0)], &mut c);
    // Engine hash 1 now names other tokens: its old hash stays held by block 2.
    let d = apply(&mut ix, &[root(1, 100)], &mut c);
    assert_eq!((d.stored.clone(), d.removed.clone()), (vec![b], vec![]));
    let d = apply(&mut ix, &[root(2, 100)], &mut c);
    assert_eq!(d.removed, vec![a]);
    assert_eq!((ix.blocks.holders(a), ix.blocks.holders(b)), (0, 2));
}

#[test]
fn all_blocks_cleared_resets_the_counts() {
    let mut ix = EngineIndex::new("m", BS);
    let mut c = Counts::default();
    let kv = root_kv(0);
    apply(&mut ix, &[root(7, 0), root(7, 0), root(8, 0)], &mut c);
    let d = apply(&mut ix, &[Ev::Cleared, root(7, 0)], &mut c);
    assert!(d.cleared);
    assert_eq!((ix.blocks.copies(7), ix.blocks.holders(kv)), (1, 1));
    let d = apply(&mut ix, &[removed(7)], &mut c);
    assert_eq!(d.removed, vec![kv]);
    assert!(ix.blocks.is_empty());
}

#[test]
fn copies_saturate() {
    let mut ix = EngineIndex::new("m", BS);
    let mut c = Counts::default();
    let n = MAX_COPIES as usize + 45;
    apply(&mut ix, &vec![root(7, 0); n], &mut c);
    assert_eq!(ix.blocks.copies(7), MAX_COPIES);
    for _ in 1..MAX_COPIES {
        assert!(apply(&mut ix, &[removed(7)], &mut c).is_empty());
    }
    assert_eq!(
        apply(&mut ix, &[removed(7)], &mut c).removed,
        vec![root_kv(0)]
    );
    assert!(ix.blocks.is_empty());
}

#[test]
fn eviction_drops_every_copy_and_keeps_twins_and_counts_consistent() {
    let max = 64;
    let mut ix = EngineIndex::with_max_blocks("m", BS, max);
    let mut c = Counts::default();
    let mut held: HashSet<u64> = HashSet::new();
    let follow = |held: &mut HashSet<u64>, d: &Delta| {
        if d.cleared {
            held.clear();
        }
        held.extend(&d.stored);
        for h in &d.removed {
            held.remove(h);
        }
    };
    // Block 7 in three copies, its twin 8 (same tokens), then a flood that evicts them.
    let d = apply(
        &mut ix,
        &[root(7, 0), root(7, 0), root(7, 0), root(8, 0)],
        &mut c,
    );
    follow(&mut held, &d);
    for i in 0..200i64 {
        let d = apply(
            &mut ix,
            &[chain(None, 1_000 + i * 4, 4, BS, 1_000 + i as u32 * 16)],
            &mut c,
        );
        follow(&mut held, &d);
        let now: HashSet<u64> = ix.blocks.snapshot().into_iter().collect();
        assert_eq!(held, now, "a gateway's view differs from the index");
        assert!(ix.blocks.len() <= max);
    }
    assert_eq!((ix.blocks.copies(7), ix.blocks.copies(8)), (0, 0));
    assert_eq!(ix.blocks.holders(root_kv(0)), 0);
    assert!(!held.contains(&root_kv(0)));
    // The copies' BlockRemoved events come later: nothing left to remove or announce.
    let d = apply(&mut ix, &[removed(7), removed(7), removed(8)], &mut c);
    assert!(d.is_empty());
    // Stored again: held once, gone with its one BlockRemoved.
    apply(&mut ix, &[root(7, 0)], &mut c);
    assert_eq!(
        apply(&mut ix, &[removed(7)], &mut c).removed,
        vec![root_kv(0)]
    );
}

/// Reads updates until one stores `marker`; returns every hash removed on the way.
async fn removed_until_stored(s: &mut Stream, marker: u64) -> Vec<u64> {
    let mut out = Vec::new();
    loop {
        let u: Update = next(s).await;
        let mut done = false;
        for w in &u.workers {
            out.extend(&w.removed);
            done |= w.stored.contains(&marker);
        }
        if done {
            return out;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watching_gateway_hears_of_a_removal_only_after_the_last_copy() {
    let mut eng = FakeEngine::start().await;
    let hub = Hub::new(BS, 1024);
    let o = EngineOpts {
        replay_timeout: Duration::from_secs(2),
        probe_after: Duration::from_secs(5),
        refresh_after: Duration::from_secs(3600),
        ..EngineOpts::default()
    };
    tokio::spawn(engine::run(hub.clone(), eng.spec(), o));
    common::wait_live(&hub).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let url = start_relay(hub.clone()).await;
    let mut s = watch(&url, BS).await.unwrap();
    next(&mut s).await; // the (empty) snapshot

    let (kv, salted) = (root_kv(0), root_kv(40));
    // H stored, then its recomputed copy (as vLLM 0.32 does); a twin of another block.
    eng.emit(0, &[root(7, 0)], false).await;
    eng.emit(1, &[root(7, 0), root(20, 40), root(21, 40)], false)
        .await;
    eng.emit(2, &[removed(7), removed(20)], false).await;
    eng.emit(3, &[root(90, 900)], false).await;
    let got = removed_until_stored(&mut s, root_kv(900)).await;
    assert!(got.is_empty(), "announced {got:?} removed with a copy left");
    let snap: Vec<u64> = hub.lock().workers[0].index.blocks.snapshot();
    assert!(snap.contains(&kv) && snap.contains(&salted));

    eng.emit(4, &[removed(7), removed(21)], false).await;
    eng.emit(5, &[root(91, 910)], false).await;
    let mut got = removed_until_stored(&mut s, root_kv(910)).await;
    got.sort_unstable();
    let mut want = vec![kv, salted];
    want.sort_unstable();
    assert_eq!(got, want);
}
