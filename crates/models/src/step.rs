//! Lays out one forward step: every row's tokens flattened into a batch, with per-token
//! metadata, per-row spans and the batch rows whose logits were asked for.

use dflash_runtime::{RowSpan, TokenMeta};

use crate::error::{ModelError, Result};
use crate::rows::RowTable;
use crate::target::{argmax_only, LogitRows, RowStep};

/// A step's batch layout (buffers reused across steps).
#[derive(Default)]
pub struct StepPlan {
    pub ids: Vec<u32>,
    pub meta: Vec<TokenMeta>,
    pub spans: Vec<RowSpan>,
    /// Batch rows whose logits are returned, in step order.
    pub sel_rows: Vec<u32>,
    /// Every row wanting logits reads them only for a greedy choice (`target::argmax_only`).
    pub argmax_only: bool,
}

impl StepPlan {
    /// Checks `steps` (open rows, each row at most once, ids inside `vocab`, lengths inside
    /// `context`) and lays them out; `chunked(step)` decides [`RowSpan::chunked`].
    pub fn build(
        &mut self,
        steps: &[RowStep<'_>],
        rows: &RowTable,
        vocab: usize,
        context: usize,
        chunked: impl Fn(&RowStep<'_>) -> bool,
    ) -> Result<()> {
        self.ids.clear();
        self.meta.clear();
        self.spans.clear();
        self.sel_rows.clear();
        self.argmax_only = argmax_only(steps);
        for (i, s) in steps.iter().enumerate() {
            let start = rows.len_of(s.row)?;
            if steps[..i].iter().any(|o| o.row == s.row) {
                return Err(ModelError::Config(format!(
                    "row {} appears twice in one step",
                    s.row
                )));
            }
            let end = start + s.tokens.len();
            if end > context {
                return Err(ModelError::Config(format!(
                    "row {} would reach {end} tokens, beyond the model's context of {context}",
                    s.row
                )));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::Config(format!(
                    "token id {bad} is outside the vocabulary of {vocab}"
                )));
            }
            let first = self.ids.len();
            if !s.tokens.is_empty() {
                self.spans.push(RowSpan {
                    row: s.row as u32,
                    first: first as u32,
                    count: s.tokens.len() as u32,
                    chunked: chunked(s),
                    prompt: s.prompt,
                });
            }
            for (j, &t) in s.tokens.iter().enumerate() {
                self.ids.push(t);
                self.meta
                    .push(TokenMeta::causal(s.row as u32, (start + j) as u32));
            }
            match s.logits {
                LogitRows::None => {}
                LogitRows::Last if !s.tokens.is_empty() => {
                    self.sel_rows.push((self.ids.len() - 1) as u32)
                }
                LogitRows::Last => {}
                LogitRows::All => self
                    .sel_rows
                    .extend((first..self.ids.len()).map(|i| i as u32)),
            }
        }
        Ok(())
    }
}
