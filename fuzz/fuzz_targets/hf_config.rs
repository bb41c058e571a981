//! libFuzzer target: `dflash_fuzz::hf_config`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_fuzz::hf_config(data));
