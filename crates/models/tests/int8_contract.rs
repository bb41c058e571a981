//! The int8 numeric contract on the default model's real weights (GGUF Q4_1 projections of
//! layers 0 and 29, the Q8_0 output head): for M = 1, 4, 8, 16 every output of the one-term
//! and two-term int8 paths stays within `contract::deviation_bound` (`deviation_bound_x2`) of
//! the f32 kernels, and the tuned kernel gives the reference's bits. Activations (K = 576) are real token embeddings through layer 0's
//! input RMSNorm, as layer 0's q/k/v see them (raw Q8_0 embedding rows would quantize
//! exactly); for the down projection (K = 1536), synthetic rows with outliers.

use dflash_models::default_model::{ensure_default_model, Silent};
use dflash_models::source::gguf::GgufFile;
use dflash_runtime::cpu::int8::pack::PackedWeight;
use dflash_runtime::cpu::int8::quantize::{QuantRows, Terms};
use dflash_runtime::cpu::int8::{self, contract, reference, synthetic, Int8Kernel};
use dflash_runtime::cpu::matmul;
use dflash_runtime::cpu::pool::CpuPool;
use dflash_runtime::cpu::Isa;
use dflash_runtime::HostWeight;

fn normed_embedding_rows(file: &GgufFile, ids: &[usize]) -> Vec<f32> {
    let table = file.weight("token_embd.weight", None).unwrap();
    let gain = file
        .weight("blk.0.attn_norm.weight", None)
        .unwrap()
        .to_f32();
    let k = table.cols;
    let mut x = vec![0f32; ids.len() * k];
    for (r, &id) in ids.iter().enumerate() {
        let row = &mut x[r * k..(r + 1) * k];
        table.dequantize_row(id, row);
        let rms = (row.iter().map(|v| v * v).sum::<f32>() / k as f32 + 1e-5).sqrt();
        for (v, g) in row.iter_mut().zip(&gain) {
            *v = *v / rms * g;
        }
    }
    x
}

#[test]
fn real_weights_stay_within_the_int8_rounding_bound() {
    let path = ensure_default_model(&Silent).expect("the default model must be obtainable");
    let file = GgufFile::open(&path).unwrap();
    let pool = CpuPool::new(2);
    let tokens = [
        1usize, 504, 2830, 9178, 28, 3211, 17, 49151, 600, 12, 4040, 33, 7, 1234, 88, 4,
    ];
    let small = normed_embedding_rows(&file, &tokens);
    let wide = synthetic::activations(16, 1536, 3);
    let mut names: Vec<String> = Vec::new();
    for layer in [0, 29] {
        for p in [
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            names.push(format!("blk.{layer}.{p}.weight"));
        }
    }
    names.push("token_embd.weight".into());
    for name in &names {
        let w: HostWeight = file.weight(name, None).unwrap();
        let packed = PackedWeight::pack(&w).expect("Q4_1 and Q8_0 pack");
        let (n, k) = (w.rows, w.cols);
        let dense = w.to_f32();
        let x_all = if k == 576 { &small } else { &wide };
        let mut worst = [0f64; 2];
        for (t, terms) in [Terms::One, Terms::Two].into_iter().enumerate() {
            for m in [1usize, 4, 8, 16] {
                let x = &x_all[..m * k];
                let mut q = QuantRows::default();
                q.quantize_terms(x, m, k, terms, &mut Vec::new());
                let mut got = vec![0f32; m * n];
                reference::matmul_terms(&w, &q, terms, &mut got);
                if let Some(kernel) = Int8Kernel::best() {
                    let mut tuned = vec![0f32; m * n];
                    int8::matmul_many(&pool, kernel, terms, x, m, &mut [(&packed, &mut tuned[..])]);
                    assert!(
                        tuned
                            .iter()
                            .zip(&got)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{kernel} differs from the reference on {name} {terms:?} m={m}"
                    );
                }
                let mut want = vec![0f32; m * n];
                matmul::matmul(&pool, Isa::detect(), x, m, &w, &mut want);
                for i in 0..m {
                    for j in 0..n {
                        let bound = contract::row_bound(
                            &dense[j * k..(j + 1) * k],
                            &x[i * k..(i + 1) * k],
                            &q,
                            terms,
                            i,
                        );
                        let dev = (got[i * n + j] as f64 - want[i * n + j] as f64).abs();
                        assert!(
                            dev <= bound,
                            "{name} {terms:?} m={m} ({i},{j}): {dev} > {bound}"
                        );
                        worst[t] = worst[t].max(dev / bound);
                    }
                }
            }
        }
        println!(
            "{name} ({} {n}x{k}): largest deviation {:.3} (int8), {:.3} (int8x2) of the bound",
            w.dtype, worst[0], worst[1]
        );
    }
}
