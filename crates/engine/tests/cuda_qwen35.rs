//! A Qwen 3.5 hybrid end to end on the GPU against the CPU backend: a synthetic random model
//! with Qwen3.5-like Gated DeltaNet heads (k_dim = v_dim = 128, two v heads per k head), a
//! batched prefill of ragged rows (pieces of >= 64 tokens run the chunked form of the gated
//! delta rule on both backends, shorter ones token by token), then decode steps that read the
//! states the prefill left. Logits agree within 1e-3 of the logits' scale (the matrix
//! products sum in different orders on the two backends).
//!
//! Opens the GPU first and prints "skipped: no CUDA device (<reason>)" without one.
#![cfg(feature = "cuda")]

use std::path::Path;
use std::sync::Arc;

use dflash_models::synthetic::{synthetic_qwen35_gguf, Qwen35Spec};
use dflash_models::{load_model, LogitRows, RowStep, Target, TargetModel};
use dflash_runtime::cpu::{CpuBackend, Isa, MatmulMode};
use dflash_runtime::cuda::CudaBackend;
use dflash_runtime::{Backend, DType, GdnShape};

fn qwen35<B: Backend>(b: Arc<B>, path: &Path) -> TargetModel<B> {
    let m = load_model(b, path).unwrap().model;
    assert!(matches!(m, TargetModel::Qwen35(_)), "loads as Qwen 3.5");
    m
}

/// Runs one step of `rows` (row, tokens) asking for each row's last logits; returns them.
/// No row is marked a prompt piece: the products stay on the f32 kernels, so the logits
/// compare with the CPU's within f32 rounding (the tensor-core prompt path has its own
/// bound, tested in cuda_ops).
fn step<T: Target>(m: &mut T, rows: &[(usize, &[u32])]) -> Vec<f32> {
    let steps: Vec<RowStep<'_>> = rows
        .iter()
        .map(|&(row, tokens)| RowStep {
            row,
            tokens,
            logits: LogitRows::Last,
            prompt: false,
            argmax_only: false,
        })
        .collect();
    m.forward(&steps).unwrap();
    m.backend().to_host(m.logits())
}

fn assert_logits_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1f32, |a, x| a.max(x.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    println!("{what}: max |gpu - cpu| {worst:.3e} (logit scale {scale:.2})");
    assert!(
        worst <= 1e-3 * scale,
        "{what}: logits differ by {worst} (scale {scale})"
    );
}

#[test]
fn chunked_prefill_and_decode_logits_match_the_cpu() {
    let gpu = match CudaBackend::new() {
        Ok(b) => Arc::new(b),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            return;
        }
    };
    let spec = Qwen35Spec {
        hidden: 128,
        gdn: GdnShape {
            k_heads: 2,
            v_heads: 4,
            k_dim: 128,
            v_dim: 128,
            conv_kernel: 4,
            tiled_heads: true,
        },
        dtype: DType::F32,
        ..Qwen35Spec::tiny()
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q35.gguf");
    std::fs::write(&path, synthetic_qwen35_gguf(&spec)).unwrap();
    // The reference's KV cache holds what the GPU's holds.
    let cpu = Arc::new(
        CpuBackend::with_options(2, Isa::detect(), MatmulMode::Reference)
            .with_kv_type(gpu.kv_type()),
    );
    let mut mc = qwen35(cpu, &path);
    let mut mg = qwen35(gpu, &path);
    let vocab = mc.vocab() as u32;
    // Ordinary tokens only (the last three ids are the special tokens).
    let prompt = |n: usize, salt: usize| -> Vec<u32> {
        (0..n)
            .map(|i| ((i * 37 + salt * 101) % (vocab as usize - 3)) as u32)
            .collect()
    };
    let prompts = [prompt(150, 0), prompt(64, 1), prompt(100, 2), prompt(20, 3)];
    let rows: Vec<(usize, usize)> = prompts
        .iter()
        .map(|_| (mc.new_row(256).unwrap(), mg.new_row(256).unwrap()))
        .collect();
    let on_cpu: Vec<(usize, &[u32])> = rows
        .iter()
        .zip(&prompts)
        .map(|(r, p)| (r.0, &p[..]))
        .collect();
    let on_gpu: Vec<(usize, &[u32])> = rows
        .iter()
        .zip(&prompts)
        .map(|(r, p)| (r.1, &p[..]))
        .collect();
    assert_logits_close("prefill", &step(&mut mg, &on_gpu), &step(&mut mc, &on_cpu));
    for k in 0..3u32 {
        let tokens: Vec<[u32; 1]> = (0..rows.len() as u32)
            .map(|r| [(7 + 13 * k + 29 * r) % (vocab - 3)])
            .collect();
        let on_cpu: Vec<(usize, &[u32])> = rows
            .iter()
            .zip(&tokens)
            .map(|(r, t)| (r.0, &t[..]))
            .collect();
        let on_gpu: Vec<(usize, &[u32])> = rows
            .iter()
            .zip(&tokens)
            .map(|(r, t)| (r.1, &t[..]))
            .collect();
        assert_logits_close(
            &format!("decode step {k}"),
            &step(&mut mg, &on_gpu),
            &step(&mut mc, &on_cpu),
        );
    }
}
