use std::time::Instant;
use dflash_runtime::cpu::{matmul::{matmul, Isa}, pool::CpuPool};
use dflash_runtime::{DType, HostWeight, WeightBytes};
fn main() {
    let threads: usize = std::env::var("T").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let pool = CpuPool::new(threads);
    for (dt, n, k) in [(DType::Q4_1, 1536, 576), (DType::Q4_1, 576, 1536), (DType::Q8_0, 49152, 576)] {
        let rb = dt.row_bytes(k).unwrap();
        let mut bytes = vec![0x37u8; n * rb];
        for b in bytes.chunks_exact_mut(dt.block_bytes()) { b[0] = 0x00; b[1] = 0x2c; b[2]=0; b[3]=0x2c; }
        let w = HostWeight::new("w", dt, n, k, WeightBytes::from_vec(bytes)).unwrap();
        for m in [1usize, 16] {
            let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1).collect();
            let mut out = vec![0f32; m * n];
            pool.install(|| {
                for _ in 0..5 { matmul(&pool, Isa::detect(), &x, m, &w, &mut out); }
                let iters = if m == 1 { 2000 } else { 200 } / if n > 10000 { 20 } else { 1 };
                let t = Instant::now();
                for _ in 0..iters { matmul(&pool, Isa::detect(), &x, m, &w, &mut out); }
                let dt_s = t.elapsed().as_secs_f64() / iters as f64;
                println!("{dt} n={n} k={k} m={m}: {:.1} us, {:.2} GB/s weights, {:.1} GFLOP/s", dt_s * 1e6, (n * rb) as f64 / dt_s / 1e9, 2.0 * (m * n * k) as f64 / dt_s / 1e9);
            });
        }
    }
}
