//! Replays the committed corpus of the relay's fuzz targets (fuzz/corpus/relay_*/*) through
//! the targets' own bodies (fuzz/src/relay.rs), natively and without libFuzzer, so `make
//! test` keeps every seed and saved crash reproducer passing. `make fuzz` explores beyond.

#[path = "../../fuzz/src/relay.rs"]
mod targets;

mod replay {
    include!("../../fuzz/src/replay.rs");
}

use std::fs;
use std::path::PathBuf;

fn replay(target: &str) {
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    replay::replay(&corpus, target, targets::run);
}

#[test]
fn relay_zmtp_corpus() {
    replay("relay_zmtp");
}

#[test]
fn relay_msgpack_corpus() {
    replay("relay_msgpack");
}

#[test]
fn relay_vllm_corpus() {
    replay("relay_vllm");
}

#[test]
fn relay_watch_corpus() {
    replay("relay_watch");
}

#[test]
fn relay_nats_corpus() {
    replay("relay_nats");
}

#[test]
fn every_relay_target_is_replayed() {
    for t in targets::RELAY_TARGETS {
        assert!(targets::run(t, b""), "{t}");
    }
    assert!(!targets::run("relay_nothing", b""));
}

fn seed(target: &str, name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
        .join(name);
    fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The seeds are what engines, gateways and relays really send (not rejected at the first
/// byte), so fuzzing starts deep in the decoders.
#[tokio::test]
async fn seeds_decode_as_their_senders_meant() {
    use kvroute::precise::wire::WatchRequest;
    use kvroute_relay::share::ShareMsg;
    use prost::Message as _;

    let data = seed("relay_zmtp", "replay_two_batches");
    let io = tokio::io::BufStream::new(tokio::io::join(&data[..], tokio::io::sink()));
    let mut d = kvroute_relay::zmtp::Dealer::handshake(io).await.unwrap();
    let got = d.replay(0).await.unwrap();
    assert_eq!(got.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [0, 1]);
    let b = kvroute_relay::decode::decode_batch(&got[0].1).unwrap();
    assert_eq!(b.events.len(), 2);

    let b = seed("relay_vllm", "map_stored_removed");
    assert_eq!(
        kvroute_relay::decode::decode_batch(&b)
            .unwrap()
            .events
            .len(),
        2
    );

    let w = seed("relay_watch", "first_then_decisions");
    let len = u32::from_be_bytes(w[2..6].try_into().unwrap()) as usize;
    let first = WatchRequest::decode(&w[6..6 + len]).unwrap();
    assert_eq!((first.gateway.as_str(), first.block_size), ("gw-a", 16));

    let m = ShareMsg::decode(seed("relay_nats", "everything").as_slice()).unwrap();
    assert_eq!((m.peers.len(), m.alive.len(), m.gone.len()), (2, 1, 2));
}
