//! CPU KV cache: for every layer and row, contiguous K and V storage, position-major.
//!
//! Each row owns its storage, so rows grow, shrink and get truncated independently and a
//! row's valid prefix is always contiguous (no compaction is ever needed).

/// K and V of one row of one layer: `capacity x kv_dim` each.
#[derive(Clone, Debug, Default)]
pub struct RowKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// The KV cache of a model on the CPU.
#[derive(Clone, Debug)]
pub struct CpuKv {
    pub kv_dim: usize,
    /// `layers[l][row]`.
    pub layers: Vec<Vec<RowKv>>,
}

impl CpuKv {
    pub fn new(layers: usize, kv_dim: usize) -> Self {
        Self {
            kv_dim,
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
        let dim = self.kv_dim;
        for layer in &mut self.layers {
            if layer.len() <= row {
                layer.resize_with(row + 1, RowKv::default);
            }
            let r = &mut layer[row];
            if r.k.len() < capacity * dim {
                let keep = keep.min(r.k.len() / dim.max(1)) * dim;
                let mut k = vec![0.0; capacity * dim];
                let mut v = vec![0.0; capacity * dim];
                k[..keep].copy_from_slice(&r.k[..keep]);
                v[..keep].copy_from_slice(&r.v[..keep]);
                r.k = k;
                r.v = v;
            }
        }
    }

    pub fn copy_row(&mut self, src: usize, dst: usize, len: usize) {
        let dim = self.kv_dim;
        let cap = self.capacity(src).max(len);
        self.reserve(dst, cap, 0);
        for layer in &mut self.layers {
            let (k, v) = (
                layer[src].k[..len * dim].to_vec(),
                layer[src].v[..len * dim].to_vec(),
            );
            layer[dst].k[..len * dim].copy_from_slice(&k);
            layer[dst].v[..len * dim].copy_from_slice(&v);
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
