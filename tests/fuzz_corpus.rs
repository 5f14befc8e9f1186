//! Replays the committed fuzz corpus (fuzz/corpus/<target>/*) through the fuzz targets'
//! own bodies, natively and without libFuzzer, so `make test` keeps every seed and every
//! saved crash reproducer passing. `make fuzz` explores beyond it.

#[path = "../fuzz/src/lib.rs"]
mod targets;

/// The relay's targets: replayed by relay/tests/fuzz_corpus.rs (this crate cannot link the
/// relay), named here so every corpus folder belongs to a target.
mod relay_targets {
    include!("../fuzz/src/relay_targets.rs");
}

mod replay {
    include!("../fuzz/src/replay.rs");
}

use std::fs;
use std::path::PathBuf;

fn replay(target: &str) {
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    replay::replay(&corpus, target, targets::run);
}

#[test]
fn request_corpus() {
    replay("request");
}

#[test]
fn hashing_corpus() {
    replay("hashing");
}

#[test]
fn events_corpus() {
    replay("events");
}

#[test]
fn feedback_corpus() {
    replay("feedback");
}

#[test]
fn config_corpus() {
    replay("config");
}

#[test]
fn every_target_has_a_corpus_and_only_those() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let mut dirs: Vec<String> = fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    let mut names = targets::TARGETS.map(String::from).to_vec();
    names.extend(relay_targets::RELAY_TARGETS.map(String::from));
    names.sort();
    assert_eq!(dirs, names);
    assert!(!targets::run("no-such-target", b""));
}
