//! CPU KV cache: for every layer and row, contiguous K and V storage, position-major.
//!
//! Each row owns its storage, so rows grow, shrink and get truncated independently and a
//! row's valid prefix is always contiguous (no compaction is ever needed). Values are held as
//! f32 or as f16 ([`KvType`]): f16 halves the bytes attention reads each step (llama.cpp's
//! default cache type). A value is rounded to f16 once, when it is written (round to nearest
//! even), and widened exactly when read, so every query that reads a position reads the same
//! bits — a verify block's rows see what decode steps see.

use half::f16;

pub use crate::kv_type::{KvType, ENV};

/// One layer's K (or V) storage of one row, in the cache's type.
#[derive(Clone, Debug)]
pub enum KvBuf {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

/// A read-only view of stored keys or values.
#[derive(Clone, Copy, Debug)]
pub enum KvData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl Default for KvBuf {
    fn default() -> Self {
        KvBuf::F32(Vec::new())
    }
}

impl KvBuf {
    fn zeros(ty: KvType, len: usize) -> Self {
        match ty {
            KvType::F32 => KvBuf::F32(vec![0.0; len]),
            KvType::F16 => KvBuf::F16(vec![f16::ZERO; len]),
        }
    }

    /// Stored values.
    pub fn len(&self) -> usize {
        match self {
            KvBuf::F32(v) => v.len(),
            KvBuf::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn data(&self) -> KvData<'_> {
        match self {
            KvBuf::F32(v) => KvData::F32(v),
            KvBuf::F16(v) => KvData::F16(v),
        }
    }

    /// Stores `src` at `at..at + src.len()`, rounding to the cache's type.
    pub fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            KvBuf::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            KvBuf::F16(v) => {
                for (d, &s) in v[at..at + src.len()].iter_mut().zip(src) {
                    *d = f16::from_f32(s);
                }
            }
        }
    }

    /// The values at `range`, widened to f32.
    pub fn read(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        match self {
            KvBuf::F32(v) => v[range].to_vec(),
            KvBuf::F16(v) => v[range].iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// A buffer of `len` values of `ty` starting with this one's first `keep` (zeros after).
    fn regrown(&self, ty: KvType, len: usize, keep: usize) -> Self {
        let mut out = KvBuf::zeros(ty, len);
        match (&mut out, self) {
            (KvBuf::F32(d), KvBuf::F32(s)) => d[..keep].copy_from_slice(&s[..keep]),
            (KvBuf::F16(d), KvBuf::F16(s)) => d[..keep].copy_from_slice(&s[..keep]),
            _ => assert_eq!(keep, 0, "a KV row cannot change type while it holds values"),
        }
        out
    }

    /// The first `len` values.
    fn prefix(&self, len: usize) -> KvBuf {
        match self {
            KvBuf::F32(v) => KvBuf::F32(v[..len].to_vec()),
            KvBuf::F16(v) => KvBuf::F16(v[..len].to_vec()),
        }
    }

    /// Copies `len` values from `src` (of the same type) to the start of this buffer.
    fn copy_prefix(&mut self, src: &KvBuf, len: usize) {
        match (self, src) {
            (KvBuf::F32(d), KvBuf::F32(s)) => d[..len].copy_from_slice(&s[..len]),
            (KvBuf::F16(d), KvBuf::F16(s)) => d[..len].copy_from_slice(&s[..len]),
            _ => unreachable!("one cache holds one type"),
        }
    }
}

/// K and V of one row of one layer: `capacity x kv_dim` each.
#[derive(Clone, Debug, Default)]
pub struct RowKv {
    pub k: KvBuf,
    pub v: KvBuf,
}

/// The KV cache of a model on the CPU.
#[derive(Clone, Debug)]
pub struct CpuKv {
    pub kv_dim: usize,
    pub ty: KvType,
    /// `layers[l][row]`.
    pub layers: Vec<Vec<RowKv>>,
}

impl CpuKv {
    pub fn new(layers: usize, kv_dim: usize, ty: KvType) -> Self {
        Self {
            kv_dim,
            ty,
            layers: vec![Vec::new(); layers],
        }
    }

    /// Positions row `row` can hold.
    pub fn capacity(&self, row: usize) -> usize {
        self.layers
            .first()
            .and_then(|l| l.get(row))
            .map_or(0, |r| r.k.len() / self.kv_dim.max(1))
    }

    /// Grows row `row` to `capacity` positions, keeping the first `keep`.
    pub fn reserve(&mut self, row: usize, capacity: usize, keep: usize) {
        let (dim, ty) = (self.kv_dim, self.ty);
        for layer in &mut self.layers {
            if layer.len() <= row {
                layer.resize_with(row + 1, RowKv::default);
            }
            let r = &mut layer[row];
            if r.k.len() < capacity * dim {
                let keep = keep.min(r.k.len() / dim.max(1)) * dim;
                r.k = r.k.regrown(ty, capacity * dim, keep);
                r.v = r.v.regrown(ty, capacity * dim, keep);
            }
        }
    }

    pub fn copy_row(&mut self, src: usize, dst: usize, len: usize) {
        let dim = self.kv_dim;
        let cap = self.capacity(src).max(len);
        self.reserve(dst, cap, 0);
        for layer in &mut self.layers {
            let (k, v) = (
                layer[src].k.prefix(len * dim),
                layer[src].v.prefix(len * dim),
            );
            layer[dst].k.copy_prefix(&k, len * dim);
            layer[dst].v.copy_prefix(&v, len * dim);
        }
    }

    pub fn release(&mut self, row: usize) {
        for layer in &mut self.layers {
            if let Some(r) = layer.get_mut(row) {
                *r = RowKv::default();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_parse_and_print() {
        for ty in [KvType::F16, KvType::F32] {
            assert_eq!(ty.to_string().parse::<KvType>().unwrap(), ty);
        }
        let e = "bf16".parse::<KvType>().unwrap_err().to_string();
        assert!(e.contains("expected f16 or f32"), "{e}");
        assert_eq!(KvType::F16.bytes() * 2, KvType::F32.bytes());
    }

    #[test]
    fn f16_rows_round_once_and_survive_growth_and_copies() {
        let dim = 4;
        let mut kv = CpuKv::new(2, dim, KvType::F16);
        kv.reserve(0, 2, 0);
        let vals = [1.0f32 / 3.0, -65504.0, 1e-8, 70000.0];
        for layer in &mut kv.layers {
            layer[0].k.write(dim, &vals);
            layer[0].v.write(0, &vals);
        }
        let want: Vec<f32> = vals.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        assert_eq!(want[3], f32::INFINITY, "beyond f16's range");
        kv.reserve(0, 8, 2);
        assert_eq!(kv.capacity(0), 8);
        kv.copy_row(0, 3, 2);
        for layer in &kv.layers {
            for row in [&layer[0], &layer[3]] {
                assert_eq!(row.k.read(dim..2 * dim), want);
                assert_eq!(row.v.read(0..dim), want);
                assert_eq!(row.k.read(0..dim), vec![0.0; dim]);
            }
        }
        kv.release(3);
        assert_eq!(kv.capacity(3), 0);
    }

    #[test]
    fn the_backend_makes_caches_of_its_type_and_counts_their_bytes() {
        use crate::cpu::{CpuBackend, Isa, MatmulMode};
        use crate::Backend;
        for ty in [KvType::F16, KvType::F32] {
            let b = CpuBackend::with_options(1, Isa::detect(), MatmulMode::Auto).with_kv_type(ty);
            let kv = b.kv_new(2, 8);
            assert_eq!(kv.ty, ty);
            assert_eq!(b.kv_value_bytes(&kv), ty.bytes());
        }
        let b = CpuBackend::with_options(1, Isa::detect(), MatmulMode::Auto);
        assert_eq!(b.kv_type(), KvType::F16, "the default");
    }

    #[test]
    fn f32_rows_keep_values_exactly() {
        let mut kv = CpuKv::new(1, 3, KvType::F32);
        kv.reserve(1, 1, 0);
        kv.layers[0][1].k.write(0, &[0.1, 1e-30, 7e30]);
        kv.reserve(1, 5, 1);
        assert_eq!(kv.layers[0][1].k.read(0..3), vec![0.1, 1e-30, 7e30]);
    }
}
