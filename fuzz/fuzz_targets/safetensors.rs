//! libFuzzer target: `dflash_fuzz::safetensors`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_fuzz::safetensors(data));
