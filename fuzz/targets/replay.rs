//! Replays a fuzz target's corpus (and any crash artifacts) as a stable test:
//! shared by `tests/fuzz_corpus.rs` and `gateway/tests/fuzz_corpus.rs`.

use std::panic::catch_unwind;
use std::path::{Path, PathBuf};

/// Every file of `<fuzz>/corpus/<target>/` and `<fuzz>/artifacts/<target>/`, sorted.
fn corpus(fuzz: &Path, target: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = ["corpus", "artifacts"]
        .iter()
        .filter_map(|d| std::fs::read_dir(fuzz.join(d).join(target)).ok())
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// The text of a caught panic.
pub fn panic_message(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "<non-string panic>".into())
}

/// Runs every corpus input of `target` (under the `fuzz` directory) through
/// `run`; fails naming each input that panics.
pub fn replay(fuzz: &Path, target: &str, run: fn(&[u8])) {
    let files = corpus(fuzz, target);
    assert!(!files.is_empty(), "no corpus for fuzz target {target}");
    let failures: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let data = std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            catch_unwind(|| run(&data))
                .err()
                .map(|e| format!("{}: {}", f.display(), panic_message(&*e)))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} inputs of fuzz target {target} fail:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
}
