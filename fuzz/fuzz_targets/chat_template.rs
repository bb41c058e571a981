//! libFuzzer target: `dflash_fuzz::chat_template`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_fuzz::chat_template(data));
