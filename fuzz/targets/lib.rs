//! The bodies of the fuzz targets, one module each. `fuzz_targets/*.rs` call them; the
//! stable replay tests include the same files with `#[path]`, so `make test` runs every
//! corpus input through exactly the code the fuzzer ran.

pub mod config;
pub mod decide;
pub mod filter_to_gateway;
pub mod gateway_answer;
pub mod gateway_request;
pub mod input;
pub mod key;
pub mod request_gen;
