#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ratelimit_wasm_fuzz::decide::run(data));
