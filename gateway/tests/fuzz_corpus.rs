//! The gateway's fuzz targets on stable: every input in `fuzz/corpus/<target>/` (and
//! `fuzz/artifacts/<target>/`) of `gateway_request` (the `POST /v1/check` parser) and
//! `filter_to_gateway` (the filter's check bodies and the gateway's answers, each read by
//! the other end) goes through the code the fuzz target runs (`fuzz/targets/*.rs`), so a
//! crash once found and added to the corpus fails `make test` until it is fixed. The filter's
//! own targets replay in `tests/fuzz_corpus.rs`.

#[path = "../../fuzz/targets/filter_to_gateway.rs"]
mod filter_to_gateway;
#[path = "../../fuzz/targets/gateway_request.rs"]
mod gateway_request;
// Shared with the fuzz crate and `tests/fuzz_corpus.rs`; only part of them is used here
// (`filter_to_gateway` borrows the `key` target's configurations).
#[allow(dead_code)]
#[path = "../../fuzz/targets/input.rs"]
mod input;
#[allow(dead_code)]
#[path = "../../fuzz/targets/key.rs"]
mod key;
#[path = "../../fuzz/targets/request_gen.rs"]
mod request_gen;

use std::panic::catch_unwind;
use std::path::{Path, PathBuf};

/// Every file of `fuzz/corpus/<target>/` and `fuzz/artifacts/<target>/`, sorted.
fn corpus(target: &str) -> Vec<PathBuf> {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
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

fn panic_message(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "<non-string panic>".into())
}

/// Runs every corpus input of `target` through `run`; fails naming each input that panics.
fn replay(target: &str, run: fn(&[u8])) {
    let files = corpus(target);
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

#[test]
fn corpus_gateway_request() {
    replay("gateway_request", gateway_request::run);
}

#[test]
fn corpus_filter_to_gateway() {
    replay("filter_to_gateway", filter_to_gateway::run);
}
