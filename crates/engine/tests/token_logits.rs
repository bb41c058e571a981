//! `SamplingParams::keep_logits`: the decoders hand back the target's logits behind every
//! token they emit for such a row (one vocabulary-wide row per token), and keeping them does
//! not change the tokens.

mod common;

use std::sync::Arc;

use common::sharp_tiny_path;
use dflash_engine::ar::ArDecoder;
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::sampling::argmax;
use dflash_engine::{Decoder, SamplingParams};
use dflash_models::load_model;
use dflash_models::synthetic::{drafter_config_for, random_drafter, special_id};
use dflash_models::{DflashDrafter, Target};
use dflash_runtime::cpu::CpuBackend;

const STEPS: usize = 6;
const BLOCK: usize = 4;

/// Runs a kept and a plain row side by side; checks that the kept row's logits explain its
/// greedy tokens and that both rows write the same tokens.
fn check(dec: &mut dyn Decoder, vocab: usize, prompt: &[u32], label: &str) {
    let kept = SamplingParams {
        keep_logits: true,
        ..SamplingParams::greedy()
    };
    let (a, first_a) = dec.start_row(prompt, 256, &kept).unwrap();
    let logits = dec.token_logits(a);
    assert_eq!(logits.len(), vocab, "{label}: the first token's logits");
    assert_eq!(argmax(logits), first_a, "{label}: first token");
    let (b, first_b) = dec
        .start_row(prompt, 256, &SamplingParams::greedy())
        .unwrap();
    assert!(
        dec.token_logits(b).is_empty(),
        "{label}: only kept rows keep logits"
    );
    assert_eq!(first_a, first_b);
    let mut out = Vec::new();
    let mut tokens = [vec![first_a], vec![first_b]];
    for _ in 0..STEPS {
        out.clear();
        dec.step(&mut out).unwrap();
        for (row, new) in &out {
            if *row == a {
                let logits = dec.token_logits(a);
                assert_eq!(
                    logits.len(),
                    new.len() * vocab,
                    "{label}: one row per token"
                );
                for (t, l) in new.iter().zip(logits.chunks_exact(vocab)) {
                    assert_eq!(argmax(l), *t, "{label}: a greedy token is its row's argmax");
                }
                tokens[0].extend_from_slice(new);
            } else {
                assert!(dec.token_logits(*row).is_empty());
                tokens[1].extend_from_slice(new);
            }
        }
    }
    let n = tokens[0].len().min(tokens[1].len());
    assert_eq!(
        tokens[0][..n],
        tokens[1][..n],
        "{label}: kept and plain rows agree"
    );
    dec.finish_row(a);
    dec.finish_row(b);
}

#[test]
fn kept_logits_explain_the_tokens() {
    let backend = Arc::new(CpuBackend::new(1));
    let m = load_model(backend.clone(), sharp_tiny_path()).unwrap();
    let prompt = m.tokenizer.encode("Once upon a", false).unwrap();
    let vocab = m.model.vocab();
    check(&mut ArDecoder::new(m.model), vocab, &prompt, "AR");

    let target = load_model(backend.clone(), sharp_tiny_path())
        .unwrap()
        .model;
    let cfg = drafter_config_for(64, 4, 2, 128, 4, 1, BLOCK, special_id("<|mask|>"));
    let drafter = DflashDrafter::load(backend, cfg.clone(), &random_drafter(&cfg, 3)).unwrap();
    let mut dec = DflashDecoder::new(target, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    check(&mut dec, vocab, &prompt, "DFlash");
}
