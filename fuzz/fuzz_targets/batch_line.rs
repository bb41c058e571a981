//! libFuzzer target: `dflash_fuzz::batch_line`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_fuzz::batch_line(data));
