//! Per-row rollback of the Qwen 3.5 hybrid's recurrent state, as properties.
//!
//! Random batches of rows (random prompts, some longer than 64 tokens so the prefill runs the
//! chunked form) verify random blocks together in one step, then each row keeps a random
//! prefix of its block (truncate_row). A second model runs every row alone, fresh: the
//! prompt, then exactly the kept tokens. After every round, for every row and every GDN layer,
//! the conv window and the recurrent state equal the fresh run's bit for bit, and so do the
//! logits of the next step. Also: a row cannot be rolled back before its last step (an
//! error, not a corrupt state), and truncating to the full length is a no-op.

use std::path::PathBuf;
use std::sync::Arc;

use dflash_models::qwen35::Qwen35Model;
use dflash_models::{load_model, LogitRows, RowStep, Target, TargetModel};
use dflash_runtime::cpu::{CpuBackend, CpuGdn};
use dflash_runtime::Backend;
use proptest::prelude::*;

fn model(b: &Arc<CpuBackend>) -> Qwen35Model<CpuBackend> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_qwen35");
    match load_model(b.clone(), &dir).unwrap().model {
        TargetModel::Qwen35(m) => m,
        TargetModel::Llama(_) => panic!("tiny_qwen35 loads as Qwen 3.5"),
    }
}

/// The current conv windows and states of `row`, every layer.
fn state(st: &CpuGdn, row: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    let r = st.row(row);
    r.layers
        .iter()
        .map(|l| (l.conv[r.cur].clone(), l.state[r.cur].clone()))
        .collect()
}

#[derive(Clone, Debug)]
struct Case {
    prompts: Vec<Vec<u32>>,
    /// Per round, per row: the block and how many of its tokens to keep (1..=len).
    rounds: Vec<Vec<(Vec<u32>, usize)>>,
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..=4)
        .prop_flat_map(|rows| {
            let tok = 0u32..296;
            let prompt = prop_oneof![
                prop::collection::vec(tok.clone(), 1..12),
                prop::collection::vec(tok.clone(), 64..90),
            ];
            let step = (
                prop::collection::vec(tok, 1..=10),
                any::<prop::sample::Index>(),
            )
                .prop_map(|(b, i)| {
                    let keep = i.index(b.len()) + 1;
                    (b, keep)
                });
            (
                prop::collection::vec(prompt, rows),
                prop::collection::vec(prop::collection::vec(step, rows), 1..=4),
            )
        })
        .prop_map(|(prompts, rounds)| Case { prompts, rounds })
}

fn forward(
    m: &mut Qwen35Model<CpuBackend>,
    steps: &[(usize, &[u32])],
    which: LogitRows,
) -> Vec<f32> {
    let steps: Vec<RowStep<'_>> = steps
        .iter()
        .map(|&(row, tokens)| RowStep {
            row,
            tokens,
            logits: which,
            // On the CPU the flag changes no product; these checks are about the gated
            // delta rule's forms (`chunked`).
            prompt: false,
            argmax_only: false,
        })
        .collect();
    m.forward(&steps).unwrap();
    m.backend().to_host(m.logits())
}

/// Row `k` of `c` run alone: its prompt, then the kept tokens of the first `rounds` rounds,
/// one step per round (as they were committed).
fn fresh_row(fresh: &mut Qwen35Model<CpuBackend>, c: &Case, k: usize, rounds: usize) -> usize {
    let f = fresh.new_row(256).unwrap();
    forward(fresh, &[(f, &c.prompts[k])], LogitRows::Last);
    for round in &c.rounds[..rounds] {
        let (b, keep) = &round[k];
        forward(fresh, &[(f, &b[..*keep])], LogitRows::Last);
    }
    f
}

fn run(
    batched: &mut Qwen35Model<CpuBackend>,
    fresh: &mut Qwen35Model<CpuBackend>,
    c: &Case,
) -> Result<(), TestCaseError> {
    let rows: Vec<usize> = c
        .prompts
        .iter()
        .map(|_| batched.new_row(256).unwrap())
        .collect();
    let steps: Vec<(usize, &[u32])> = rows
        .iter()
        .zip(&c.prompts)
        .map(|(&r, p)| (r, p.as_slice()))
        .collect();
    forward(batched, &steps, LogitRows::Last);
    let mut kept: Vec<Vec<u32>> = c.prompts.clone();
    for (ri, round) in c.rounds.iter().enumerate() {
        let steps: Vec<(usize, &[u32])> = rows
            .iter()
            .zip(round)
            .map(|(&r, (b, _))| (r, b.as_slice()))
            .collect();
        forward(batched, &steps, LogitRows::All);
        for ((&r, (block, keep)), seq) in rows.iter().zip(round).zip(&mut kept) {
            let len = seq.len() + keep;
            batched.truncate_row(r, len).unwrap();
            prop_assert_eq!(batched.row_len(r), len);
            seq.extend_from_slice(&block[..*keep]);
        }
        for (k, (&r, seq)) in rows.iter().zip(&kept).enumerate() {
            let f = fresh_row(fresh, c, k, ri + 1);
            prop_assert_eq!(fresh.row_len(f), seq.len());
            let (got, want) = (state(batched.gdn_state(), r), state(fresh.gdn_state(), f));
            for (l, (g, w)) in got.iter().zip(&want).enumerate() {
                prop_assert!(
                    g.0 == w.0,
                    "round {} row {} layer {}: conv window differs",
                    ri,
                    k,
                    l
                );
                prop_assert!(
                    g.1 == w.1,
                    "round {} row {} layer {}: recurrent state differs",
                    ri,
                    k,
                    l
                );
            }
            fresh.release_row(f);
        }
    }
    // The next step after the last rollback: logits equal a fresh row's, bit for bit.
    for (k, &r) in rows.iter().enumerate() {
        let probe = [7u32];
        let got = forward(batched, &[(r, &probe)], LogitRows::Last);
        let f = fresh_row(fresh, c, k, c.rounds.len());
        let want = forward(fresh, &[(f, &probe)], LogitRows::Last);
        prop_assert!(got == want, "row {}: next-step logits differ", k);
        fresh.release_row(f);
        batched.release_row(r);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn rolled_back_rows_equal_fresh_runs(c in case()) {
        let b = Arc::new(CpuBackend::new(1));
        let (mut batched, mut fresh) = (model(&b), model(&b));
        run(&mut batched, &mut fresh, &c)?;
    }
}

#[test]
fn rollback_is_limited_to_the_last_step() {
    let b = Arc::new(CpuBackend::new(1));
    let mut m = model(&b);
    let row = m.new_row(64).unwrap();
    forward(&mut m, &[(row, &[1, 2, 3, 4])], LogitRows::Last);
    forward(&mut m, &[(row, &[5, 6, 7])], LogitRows::All);
    m.truncate_row(row, 7).unwrap();
    assert_eq!(
        m.row_len(row),
        7,
        "truncating to the full length keeps the row"
    );
    m.truncate_row(row, 5).unwrap();
    assert_eq!(m.row_len(row), 5);
    let err = m.truncate_row(row, 3).unwrap_err().to_string();
    assert!(err.contains("only into its last step"), "{err}");
    assert_eq!(
        m.row_len(row),
        5,
        "a refused rollback leaves the row as it was"
    );
    m.truncate_row(row, 4).unwrap();
    assert_eq!(m.row_len(row), 4);
}

/// A synthetic hybrid with Q8_0 matrices (GGUF `qwen35`): the logits of a verify block equal
/// the same tokens decoded one at a time, bit for bit (the lossless contract's premise).
#[test]
fn verify_block_logits_equal_decode_logits_bit_for_bit() {
    use dflash_models::synthetic::{synthetic_qwen35_gguf, Qwen35Spec};
    let spec = Qwen35Spec {
        dtype: dflash_runtime::DType::Q8_0,
        ..Qwen35Spec::tiny()
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q35.gguf");
    std::fs::write(&path, synthetic_qwen35_gguf(&spec)).unwrap();
    let b = Arc::new(CpuBackend::new(2));
    let mut m = match load_model(b, &path).unwrap().model {
        TargetModel::Qwen35(m) => m,
        TargetModel::Llama(_) => panic!("synthetic qwen35 loads as Qwen 3.5"),
    };
    let prompt: Vec<u32> = (0..70).map(|i| (i * 37 % 250) as u32).collect();
    let block = [5u32, 99, 17, 3, 250, 42];
    let (a, d) = (m.new_row(128).unwrap(), m.new_row(128).unwrap());
    forward(&mut m, &[(a, &prompt), (d, &prompt)], LogitRows::Last);
    let verify = forward(&mut m, &[(a, &block)], LogitRows::All);
    let vocab = m.vocab();
    for (j, &t) in block.iter().enumerate() {
        let one = forward(&mut m, &[(d, &[t])], LogitRows::Last);
        assert!(
            one[..] == verify[j * vocab..(j + 1) * vocab],
            "block position {j}"
        );
    }
}
