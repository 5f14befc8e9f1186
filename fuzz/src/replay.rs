/// Runs every file of `corpus/<target>/` through `run` (a fuzz target's body), natively;
/// shared by the corpus replays of the filter (tests/fuzz_corpus.rs) and of the relay
/// (relay/tests/fuzz_corpus.rs), which include this file.
pub fn replay(corpus: &std::path::Path, target: &str, run: fn(&str, &[u8]) -> bool) {
    let dir = corpus.join(target);
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{target}: only {} seeds", files.len());
    for path in files {
        let data = std::fs::read(&path).unwrap();
        match std::panic::catch_unwind(|| run(target, &data)) {
            Ok(known) => assert!(known, "no target named {target}"),
            Err(_) => panic!("{target}: {} fails", path.display()),
        }
    }
}
