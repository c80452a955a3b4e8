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
// Its configuration is `gateway_request`'s policy.
#[allow(dead_code)]
#[path = "../../fuzz/targets/gateway_answer.rs"]
mod gateway_answer;
// Shared with the fuzz crate and `tests/fuzz_corpus.rs`; only part of them is used here
// (`filter_to_gateway` borrows the `key` target's configurations).
#[allow(dead_code)]
#[path = "../../fuzz/targets/input.rs"]
mod input;
#[allow(dead_code)]
#[path = "../../fuzz/targets/key.rs"]
mod key;
#[allow(dead_code)]
#[path = "../../fuzz/targets/replay.rs"]
mod replay;
#[path = "../../fuzz/targets/request_gen.rs"]
mod request_gen;

use std::path::Path;

/// Replays one target's corpus through `run`.
fn replay(target: &str, run: fn(&[u8])) {
    replay::replay(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz"),
        target,
        run,
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
