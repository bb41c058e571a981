//! libFuzzer target: `dflash_fuzz::drafter_config`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_fuzz::drafter_config(data));
