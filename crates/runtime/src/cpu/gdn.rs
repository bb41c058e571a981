//! CPU recurrent state of Gated DeltaNet layers, per row, with rollback into the last step.
//!
//! Every row keeps two copies of each layer's conv window and recurrent state. A forward
//! step reads the checkpoint copy (the state before the step) and writes the other, then the
//! roles stay: after the step `cur` holds the new state and `1 - cur` the state before it.
//! No state is copied to take a checkpoint. The step's inputs (pre-conv qkv, post-conv qkv,
//! g, β) of its first `history` tokens are recorded, so [`CpuGdn::rollback`] can rebuild the
//! state after any prefix of the step from the checkpoint by replaying the recurrence with
//! the same arithmetic as the step itself.

use crate::backend::GdnShape;
use crate::error::RuntimeError;

/// One layer of one row.
#[derive(Clone, Debug, Default)]
pub struct GdnLayerState {
    /// Conv windows: `(conv_kernel - 1) x conv_dim` each, oldest input first.
    pub conv: [Vec<f32>; 2],
    /// Recurrent states: `v_heads x k_dim x v_dim` each.
    pub state: [Vec<f32>; 2],
    /// Pre-conv qkv of the last step's first tokens (`≤ history x conv_dim`).
    pub hist_x: Vec<f32>,
    /// Post-conv qkv of the same tokens.
    pub hist_qkv: Vec<f32>,
    /// g and β of the same tokens (`≤ history x v_heads` each).
    pub hist_g: Vec<f32>,
    pub hist_beta: Vec<f32>,
}

/// One row.
#[derive(Clone, Debug, Default)]
pub struct GdnRow {
    /// Which copy holds the current state.
    pub cur: usize,
    /// Tokens of the last step still applied (a rollback lowers it).
    pub last: usize,
    pub layers: Vec<GdnLayerState>,
}

impl GdnRow {
    /// The checkpoint copy (the state before the last step).
    pub fn prev(&self) -> usize {
        1 - self.cur
    }
}

/// The GDN state of all rows.
#[derive(Clone, Debug)]
pub struct CpuGdn {
    pub shape: GdnShape,
    pub layers: usize,
    /// Most tokens of a step that can be rolled back into.
    pub history: usize,
    pub rows: Vec<Option<GdnRow>>,
}

impl CpuGdn {
    pub fn new(layers: usize, shape: GdnShape, history: usize) -> Self {
        Self {
            shape,
            layers,
            history,
            rows: Vec::new(),
        }
    }

    pub fn open(&mut self, row: usize) {
        if self.rows.len() <= row {
            self.rows.resize_with(row + 1, || None);
        }
        let win = (self.shape.conv_kernel - 1) * self.shape.conv_dim();
        let st = self.shape.state_len();
        let layer = GdnLayerState {
            conv: [vec![0.0; win], vec![0.0; win]],
            state: [vec![0.0; st], vec![0.0; st]],
            ..Default::default()
        };
        self.rows[row] = Some(GdnRow {
            cur: 0,
            last: 0,
            layers: vec![layer; self.layers],
        });
    }

    pub fn release(&mut self, row: usize) {
        if let Some(r) = self.rows.get_mut(row) {
            *r = None;
        }
    }

    pub fn row(&self, row: usize) -> &GdnRow {
        self.rows
            .get(row)
            .and_then(Option::as_ref)
            .unwrap_or_else(|| panic!("GDN row {row} is not open"))
    }

    pub fn row_mut(&mut self, row: usize) -> &mut GdnRow {
        self.rows
            .get_mut(row)
            .and_then(Option::as_mut)
            .unwrap_or_else(|| panic!("GDN row {row} is not open"))
    }

    pub fn copy_row(&mut self, src: usize, dst: usize) {
        let s = self.row(src);
        let cur = s.cur;
        let layers: Vec<GdnLayerState> = s
            .layers
            .iter()
            .map(|l| GdnLayerState {
                conv: [l.conv[cur].clone(), l.conv[cur].clone()],
                state: [l.state[cur].clone(), l.state[cur].clone()],
                ..Default::default()
            })
            .collect();
        if self.rows.len() <= dst {
            self.rows.resize_with(dst + 1, || None);
        }
        self.rows[dst] = Some(GdnRow {
            cur: 0,
            last: 0,
            layers,
        });
    }

    /// Starts a step of `count` tokens for `row`.
    pub fn begin(&mut self, row: usize, count: usize) {
        let r = self.row_mut(row);
        r.cur ^= 1;
        r.last = count;
        for l in &mut r.layers {
            l.hist_x.clear();
            l.hist_qkv.clear();
            l.hist_g.clear();
            l.hist_beta.clear();
        }
    }

    /// Checks that `row` can keep `keep` tokens of its last step.
    pub fn check_rollback(&self, row: usize, keep: usize) -> Result<(), RuntimeError> {
        let r = self
            .rows
            .get(row)
            .and_then(Option::as_ref)
            .ok_or_else(|| RuntimeError::State(format!("row {row} is not open")))?;
        if keep > r.last {
            return Err(RuntimeError::State(format!(
                "row {row} cannot keep {keep} tokens of a last step of {}",
                r.last
            )));
        }
        if keep < r.last {
            let recorded = r
                .layers
                .first()
                .map_or(0, |l| l.hist_g.len() / self.shape.v_heads);
            if keep > recorded {
                return Err(RuntimeError::State(format!(
                    "row {row} can be rolled back only into the first {recorded} tokens of its \
                     last step, not to {keep}"
                )));
            }
        }
        Ok(())
    }
}
