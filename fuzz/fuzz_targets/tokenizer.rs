//! libFuzzer target: `dflash_fuzz::tokenizer`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_fuzz::tokenizer(data));
