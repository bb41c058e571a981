//! Row slots: which sequence slots are live and how many cached positions each holds.

use crate::error::{ModelError, Result};

/// Lengths of live rows; freed slots are reused.
#[derive(Clone, Debug, Default)]
pub struct RowTable {
    lens: Vec<Option<usize>>,
}

impl RowTable {
    /// Takes a free slot (or a new one) with length 0.
    pub fn open(&mut self) -> usize {
        if let Some(i) = self.lens.iter().position(Option::is_none) {
            self.lens[i] = Some(0);
            i
        } else {
            self.lens.push(Some(0));
            self.lens.len() - 1
        }
    }

    pub fn close(&mut self, row: usize) {
        if let Some(slot) = self.lens.get_mut(row) {
            *slot = None;
        }
    }

    pub fn is_live(&self, row: usize) -> bool {
        matches!(self.lens.get(row), Some(Some(_)))
    }

    /// Length of a live row; an error for a slot that is not open.
    pub fn len_of(&self, row: usize) -> Result<usize> {
        self.lens
            .get(row)
            .copied()
            .flatten()
            .ok_or_else(|| ModelError::Config(format!("row {row} is not open")))
    }

    /// Length of row `row` (0 for slots that are not open).
    pub fn len(&self, row: usize) -> usize {
        self.len_of(row).unwrap_or(0)
    }

    pub fn set_len(&mut self, row: usize, len: usize) {
        if let Some(Some(l)) = self.lens.get_mut(row) {
            *l = len;
        }
    }

    /// `(row, length)` of every open row.
    pub fn open_rows(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.lens
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.map(|l| (i, l)))
    }

    /// Shortens row `row` to at most `len`.
    pub fn truncate(&mut self, row: usize, len: usize) {
        if let Some(Some(l)) = self.lens.get_mut(row) {
            *l = (*l).min(len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_and_lengths_tracked() {
        let mut t = RowTable::default();
        let a = t.open();
        let b = t.open();
        t.set_len(a, 10);
        t.truncate(a, 4);
        t.truncate(a, 8);
        assert_eq!(t.len(a), 4);
        assert_eq!(t.open_rows().collect::<Vec<_>>(), [(a, 4), (b, 0)]);
        t.close(a);
        assert!(!t.is_live(a) && t.is_live(b));
        assert!(t.len_of(a).is_err());
        assert_eq!(t.open(), a);
        assert_eq!(t.len(a), 0);
    }
}
