//! libFuzzer target: `dflash_fuzz::http_body`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_fuzz::http_body(data));
