//! Deterministic synthetic weights and activations (a fixed-seed generator, no `rand`), for
//! the start-up self-check, the fingerprints and the microbench.

use crate::dtype::DType;
use crate::weight::{HostWeight, WeightBytes};

/// SplitMix64: small, fast, and the same sequence everywhere.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`, on a 2⁻²³ grid.
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

/// A `rows x cols` weight in `dtype` (a block format or a float format): random codes and
/// f16 scales of magnitude about `scale` (Q4_1 minimums about `-8 · scale`, as real Q4_1
/// weights have).
pub fn weight(dtype: DType, rows: usize, cols: usize, scale: f32, seed: u64) -> HostWeight {
    let mut rng = SplitMix(seed);
    let row_bytes = dtype.row_bytes(cols).expect("whole blocks");
    let mut bytes = vec![0u8; rows * row_bytes];
    for b in bytes.iter_mut() {
        *b = rng.next_u64() as u8;
    }
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    match dtype {
        DType::Q4_0 | DType::Q8_0 | DType::Q4_1 => {
            for blk in bytes.chunks_exact_mut(dtype.block_bytes()) {
                let d = scale * (0.5 + 0.5 * rng.unit().abs());
                blk[0..2].copy_from_slice(&f16(d));
                if dtype == DType::Q4_1 {
                    blk[2..4].copy_from_slice(&f16(-8.0 * d * (1.0 + 0.1 * rng.unit())));
                }
            }
        }
        DType::Q4K | DType::Q6K => {
            // Random sub-block scales and codes; the f16 super-block scales kept moderate.
            let offs: &[usize] = if dtype == DType::Q4K { &[0, 2] } else { &[208] };
            for blk in bytes.chunks_exact_mut(dtype.block_bytes()) {
                for &o in offs {
                    blk[o..o + 2].copy_from_slice(&f16(scale * 0.1 * rng.unit()));
                }
            }
        }
        DType::F32 | DType::F16 | DType::BF16 => {
            let values: Vec<f32> = (0..rows * cols).map(|_| scale * rng.unit()).collect();
            let mut out = Vec::with_capacity(bytes.len());
            crate::quant::quantize_row(dtype, &values, &mut out);
            bytes = out;
        }
    }
    HostWeight::new("synthetic", dtype, rows, cols, WeightBytes::from_vec(bytes))
        .expect("consistent by construction")
}

/// `m x k` activations like a normalised hidden state: mostly moderate values and a few
/// large outliers (one in 64 values is 8 times larger).
pub fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix(seed);
    (0..m * k)
        .map(|_| {
            let v = rng.unit();
            if rng.next_u64().is_multiple_of(64) {
                8.0 * v
            } else {
                v
            }
        })
        .collect()
}
