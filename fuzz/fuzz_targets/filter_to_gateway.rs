#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ratelimit_wasm_fuzz::filter_to_gateway::run(data));
