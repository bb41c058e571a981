//! CPU KV cache: for every layer and row, K and V storage in head-major planes.
//!
//! A row's K (and V) of one layer is `kv_heads` planes, one per KV head, each `capacity`
//! positions of `head_dim` values: attention over one head reads one contiguous stream, which
//! the hardware prefetchers follow (position-major rows, where a head's values are a third or
//! less of each row, read at a third of the bandwidth at long contexts). Each row owns its
//! storage, so rows grow, shrink and get truncated independently and a row's valid prefix is
//! always contiguous within each plane (no compaction is ever needed). Values are held as f32
//! or as f16 ([`KvType`]): f16 halves the bytes attention reads each step (llama.cpp's default
//! cache type). A value is rounded to f16 once, when it is written (round to nearest even),
//! and widened exactly when read, so every query that reads a position reads the same bits —
//! a verify block's rows see what decode steps see.

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
    fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            KvBuf::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            KvBuf::F16(v) => {
                for (d, &s) in v[at..at + src.len()].iter_mut().zip(src) {
                    *d = f16::from_f32(s);
                }
            }
        }
    }

    /// Appends the values at `range`, widened to f32, to `out`.
    fn read_into(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        match self {
            KvBuf::F32(v) => out.extend_from_slice(&v[range]),
            KvBuf::F16(v) => out.extend(v[range].iter().map(|x| x.to_f32())),
        }
    }

    /// Copies `len` values of `src` (of the same type) from `from` to this buffer at `to`.
    fn copy_from(&mut self, src: &KvBuf, from: usize, to: usize, len: usize) {
        match (self, src) {
            (KvBuf::F32(d), KvBuf::F32(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
            (KvBuf::F16(d), KvBuf::F16(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
            _ => assert_eq!(len, 0, "a KV row cannot change type while it holds values"),
        }
    }
}

/// K and V of one row of one layer: `kv_heads` planes of `capacity x head_dim` values each.
#[derive(Clone, Debug, Default)]
pub struct RowKv {
    pub k: KvBuf,
    pub v: KvBuf,
}

/// The KV cache of a model on the CPU.
#[derive(Clone, Debug)]
pub struct CpuKv {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ty: KvType,
    /// `layers[l][row]`.
    pub layers: Vec<Vec<RowKv>>,
}

impl CpuKv {
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, ty: KvType) -> Self {
        Self {
            kv_heads,
            head_dim,
            ty,
            layers: vec![Vec::new(); layers],
        }
    }

    /// Values one position holds across the heads (K or V).
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Positions row `row` can hold.
    pub fn capacity(&self, row: usize) -> usize {
        self.layers
            .first()
            .and_then(|l| l.get(row))
            .map_or(0, |r| r.k.len() / self.kv_dim().max(1))
    }

    /// Where KV head `head`'s plane of row `row` starts (in values); position `p` of the plane
    /// is `head_dim` values at `head_offset + p · head_dim`.
    pub fn head_offset(&self, row: usize, head: usize) -> usize {
        head * self.capacity(row) * self.head_dim
    }

    /// Grows row `row` to `capacity` positions, keeping the first `keep`.
    pub fn reserve(&mut self, row: usize, capacity: usize, keep: usize) {
        let (dim, hd, ty) = (self.kv_dim(), self.head_dim, self.ty);
        for layer in &mut self.layers {
            if layer.len() <= row {
                layer.resize_with(row + 1, RowKv::default);
            }
            let r = &mut layer[row];
            if r.k.len() < capacity * dim {
                let old = r.k.len() / dim.max(1);
                let keep = keep.min(old) * hd;
                let (mut k, mut v) = (
                    KvBuf::zeros(ty, capacity * dim),
                    KvBuf::zeros(ty, capacity * dim),
                );
                for h in 0..self.kv_heads {
                    k.copy_from(&r.k, h * old * hd, h * capacity * hd, keep);
                    v.copy_from(&r.v, h * old * hd, h * capacity * hd, keep);
                }
                *r = RowKv { k, v };
            }
        }
    }

    /// Copies positions `0..len` of row `src` into row `dst` (all layers).
    pub fn copy_row(&mut self, src: usize, dst: usize, len: usize) {
        if src == dst {
            return;
        }
        let hd = self.head_dim;
        let src_cap = self.capacity(src);
        assert!(
            len <= src_cap,
            "copying {len} positions of a row of {src_cap}"
        );
        self.reserve(dst, src_cap, 0);
        let dst_cap = self.capacity(dst);
        for layer in &mut self.layers {
            let s = std::mem::take(&mut layer[src]);
            for h in 0..self.kv_heads {
                let (from, to) = (h * src_cap * hd, h * dst_cap * hd);
                layer[dst].k.copy_from(&s.k, from, to, len * hd);
                layer[dst].v.copy_from(&s.v, from, to, len * hd);
            }
            layer[src] = s;
        }
    }

    pub fn release(&mut self, row: usize) {
        for layer in &mut self.layers {
            if let Some(r) = layer.get_mut(row) {
                *r = RowKv::default();
            }
        }
    }

    /// Stores one position's keys `k` and values `v` (`kv_dim` values each, head after head)
    /// at position `pos` of row `row` of layer `layer`, rounding to the cache's type.
    pub fn write(&mut self, layer: usize, row: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (dim, hd) = (self.kv_dim(), self.head_dim);
        assert!(k.len() == dim && v.len() == dim);
        let cap = self.capacity(row);
        assert!(pos < cap, "KV write past the row's reserved capacity");
        let r = &mut self.layers[layer][row];
        for h in 0..self.kv_heads {
            let at = (h * cap + pos) * hd;
            r.k.write(at, &k[h * hd..(h + 1) * hd]);
            r.v.write(at, &v[h * hd..(h + 1) * hd]);
        }
    }

    /// Keys and values of positions `range` of row `row` of layer `layer`, widened to f32 and
    /// laid out as they were written (position after position, each `kv_dim` values).
    pub fn read(
        &self,
        layer: usize,
        row: usize,
        range: std::ops::Range<usize>,
    ) -> (Vec<f32>, Vec<f32>) {
        let (cap, hd) = (self.capacity(row), self.head_dim);
        assert!(range.end <= cap, "reading past the row's capacity");
        let r = &self.layers[layer][row];
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for p in range {
            for h in 0..self.kv_heads {
                let at = (h * cap + p) * hd;
                r.k.read_into(at..at + hd, &mut k);
                r.v.read_into(at..at + hd, &mut v);
            }
        }
        (k, v)
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
        let mut kv = CpuKv::new(2, 2, 2, KvType::F16);
        kv.reserve(0, 2, 0);
        let vals = [1.0f32 / 3.0, -65504.0, 1e-8, 70000.0];
        let zeros = [0.0f32; 4];
        for l in 0..2 {
            kv.write(l, 0, 1, &vals, &zeros);
            kv.write(l, 0, 0, &zeros, &vals);
        }
        let want: Vec<f32> = vals.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        assert_eq!(want[3], f32::INFINITY, "beyond f16's range");
        kv.reserve(0, 8, 2);
        assert_eq!(kv.capacity(0), 8);
        kv.copy_row(0, 3, 2);
        for l in 0..2 {
            for row in [0, 3] {
                let (k, v) = kv.read(l, row, 0..2);
                assert_eq!(k, [&zeros[..], &want[..]].concat());
                assert_eq!(v, [&want[..], &zeros[..]].concat());
            }
        }
        kv.release(3);
        assert_eq!(kv.capacity(3), 0);
    }

    #[test]
    fn each_head_is_one_contiguous_plane_through_growth_and_copies() {
        let (heads, hd) = (3, 4);
        let mut kv = CpuKv::new(1, heads, hd, KvType::F32);
        // Position p, head h, value d holds 100 p + 10 h + d.
        let row = |p: usize| -> Vec<f32> {
            (0..heads * hd)
                .map(|i| (100 * p + 10 * (i / hd) + i % hd) as f32)
                .collect()
        };
        kv.reserve(2, 3, 0);
        for p in 0..3 {
            kv.write(0, 2, p, &row(p), &row(p));
        }
        // Grown twice, keeping 3 then 2 positions (the third cut back, as a rejected draft is).
        kv.reserve(2, 5, 3);
        kv.reserve(2, 9, 2);
        kv.write(0, 2, 2, &row(7), &row(7));
        kv.copy_row(2, 0, 3);
        for r in [0, 2] {
            assert_eq!(kv.capacity(r), 9);
            let KvBuf::F32(k) = &kv.layers[0][r].k else {
                panic!("f32 cache")
            };
            for h in 0..heads {
                let at = kv.head_offset(r, h);
                assert_eq!(at, h * 9 * hd);
                for (p, src) in [0, 1, 7].into_iter().enumerate() {
                    let want: Vec<f32> = (0..hd).map(|d| (100 * src + 10 * h + d) as f32).collect();
                    assert_eq!(
                        &k[at + p * hd..at + (p + 1) * hd],
                        &want[..],
                        "row {r} head {h} position {p}"
                    );
                }
            }
            let (k, v) = kv.read(0, r, 0..3);
            assert_eq!(k, [row(0), row(1), row(7)].concat());
            assert_eq!(k, v);
        }
    }

    #[test]
    fn the_backend_makes_caches_of_its_type_and_counts_their_bytes() {
        use crate::cpu::{CpuBackend, Isa, MatmulMode};
        use crate::Backend;
        for ty in [KvType::F16, KvType::F32] {
            let b = CpuBackend::with_options(1, Isa::detect(), MatmulMode::Auto).with_kv_type(ty);
            let kv = b.kv_new(2, 2, 4);
            assert_eq!(kv.ty, ty);
            assert_eq!(b.kv_value_bytes(&kv), ty.bytes());
        }
        let b = CpuBackend::with_options(1, Isa::detect(), MatmulMode::Auto);
        assert_eq!(b.kv_type(), KvType::F16, "the default");
    }

    #[test]
    fn f32_rows_keep_values_exactly() {
        let mut kv = CpuKv::new(1, 1, 3, KvType::F32);
        kv.reserve(1, 1, 0);
        kv.write(0, 1, 0, &[0.1, 1e-30, 7e30], &[0.0; 3]);
        kv.reserve(1, 5, 1);
        assert_eq!(kv.read(0, 1, 0..1).0, vec![0.1, 1e-30, 7e30]);
    }
}
