//! ratelimit-wasm: placeholder while the crate is being written.
