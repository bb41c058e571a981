//! libFuzzer target: `dflash_fuzz::gguf`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_fuzz::gguf(data));
