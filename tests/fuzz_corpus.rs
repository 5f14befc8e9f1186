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

use std::fs;
use std::path::PathBuf;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let data = fs::read(&p).unwrap();
            (p, data)
        })
        .collect()
}

fn replay(target: &str) {
    let files = corpus(target);
    assert!(files.len() >= 3, "{target}: only {} seeds", files.len());
    for (path, data) in files {
        let ran = std::panic::catch_unwind(|| targets::run(target, &data));
        match ran {
            Ok(known) => assert!(known, "no target named {target}"),
            Err(_) => panic!("{target}: {} fails", path.display()),
        }
    }
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
