use std::time::Instant;
use dflash_runtime::cpu::{matmul::{matmul, Isa}, pool::CpuPool};
use dflash_runtime::{DType, HostWeight, WeightBytes};
fn mk(dt: DType, n: usize, k: usize, seed: u8) -> HostWeight {
    let rb = dt.row_bytes(k).unwrap();
    let mut bytes: Vec<u8> = (0..n * rb).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    for b in bytes.chunks_exact_mut(dt.block_bytes()) { b[0] = 0x00; b[1] = 0x2c; b[2]=0; b[3]=0x2c; }
    HostWeight::new("w", dt, n, k, WeightBytes::from_vec(bytes)).unwrap()
}
fn main() {
    let threads: usize = std::env::var("T").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let pool = CpuPool::new(threads);
    let mut ws = Vec::new();
    for l in 0..30u8 {
        ws.push(mk(DType::Q4_1, 576, 576, l)); ws.push(mk(DType::Q4_1, 192, 576, l)); ws.push(mk(DType::Q4_1, 192, 576, l));
        ws.push(mk(DType::Q4_1, 576, 576, l)); ws.push(mk(DType::Q4_1, 1536, 576, l)); ws.push(mk(DType::Q4_1, 1536, 576, l)); ws.push(mk(DType::Q4_1, 576, 1536, l));
    }
    let head = mk(DType::Q8_0, 49152, 576, 9);
    let x: Vec<f32> = (0..1536).map(|i| (i % 13) as f32 * 0.1).collect();
    let mut out = vec![0f32; 49152];
    for _ in 0..5 {
        let t = Instant::now();
        for w in &ws { matmul(&pool, Isa::detect(), &x[..w.cols], 1, w, &mut out); }
        let a = t.elapsed().as_secs_f64();
        let t = Instant::now();
        matmul(&pool, Isa::detect(), &x[..576], 1, &head, &mut out);
        let b = t.elapsed().as_secs_f64();
        println!("layers {:.2} ms ({:.1} GB/s), lm_head {:.2} ms ({:.1} GB/s)", a*1e3, 66.4e6/a/1e9, b*1e3, 30.1e6/b/1e9);
    }
}
