//! How much KV cache memory a model holds: rows, cached positions, reserved positions, bytes.

use dflash_runtime::Backend;
use serde::Serialize;

use crate::rows::RowTable;

/// KV cache memory of one model (or the sum over several).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KvUsage {
    /// Open rows.
    pub rows: usize,
    /// Positions cached, summed over rows.
    pub positions: usize,
    /// Positions the rows' storage can hold (grown on demand, never a row's maximum up front).
    pub reserved_positions: usize,
    /// Bytes of K and V storage allocated for the open rows.
    pub bytes: usize,
}

impl KvUsage {
    /// The usage of the open rows of `rows` in `kv` (`layers` cached layers of `kv_dim`).
    pub fn of<B: Backend>(
        b: &B,
        kv: &B::Kv,
        rows: &RowTable,
        layers: usize,
        kv_dim: usize,
    ) -> Self {
        let mut u = Self::default();
        let value_bytes = b.kv_value_bytes(kv);
        for (row, len) in rows.open_rows() {
            let cap = b.kv_capacity(kv, row);
            u.rows += 1;
            u.positions += len;
            u.reserved_positions += cap;
            u.bytes += 2 * layers * cap * kv_dim * value_bytes;
        }
        u
    }

    /// Both usages together (a target and its drafter).
    pub fn plus(self, o: Self) -> Self {
        Self {
            rows: self.rows + o.rows,
            positions: self.positions + o.positions,
            reserved_positions: self.reserved_positions + o.reserved_positions,
            bytes: self.bytes + o.bytes,
        }
    }
}
