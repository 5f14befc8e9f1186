/// The relay's fuzz targets (`relay.rs`); separate from `lib.rs`'s `TARGETS` because the
/// root crate's corpus replay cannot link the relay: `relay/tests/fuzz_corpus.rs` replays them.
pub const RELAY_TARGETS: [&str; 5] = [
    "relay_zmtp",
    "relay_msgpack",
    "relay_vllm",
    "relay_watch",
    "relay_nats",
];
