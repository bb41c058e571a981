//! The DFlash2 candidate selector's output: per row and block slot, the top-k candidates of
//! the slot's (transformed) logits and, for every candidate the previous slot could have
//! chosen, the path score of each candidate here.
//!
//! The score of candidate `c` after predecessor `p` at slot `s` is
//! `unary(c) + Σ_r P[p][r] · h_s[r] · S[c][r]`, with `P`, `S` the predecessor and successor
//! codebooks and `h_s = W_h · hidden_s` (the reference `CandidateSelector`). The predecessor
//! of slot 1 is the block's anchor token (slot 0); later slots follow the candidate chosen at
//! the slot before. The engine walks the lattice (argmax, or sampling `softmax(score / T)`);
//! the lattice holds every score the walk can ask for (`K x K` per slot, as SGLang builds it).

/// Candidates and path scores for a batch of rows (see the module docs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CandidateLattice {
    top_k: usize,
    slots: usize,
    rows: usize,
    /// `[row][slot][k]` candidate ids.
    ids: Vec<u32>,
    /// `[row][slot][prev][k]` scores; slot 0 fills `prev = 0` only (the anchor).
    scores: Vec<f32>,
}

impl CandidateLattice {
    /// An empty lattice for blocks of `slots` proposals with `top_k` candidates each.
    pub fn new(top_k: usize, slots: usize) -> Self {
        Self {
            top_k,
            slots,
            ..Self::default()
        }
    }

    /// Clears every row, keeping the allocation, for a new shape.
    pub fn reset(&mut self, top_k: usize, slots: usize) {
        self.top_k = top_k;
        self.slots = slots;
        self.rows = 0;
        self.ids.clear();
        self.scores.clear();
    }

    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Proposals per row (block size minus one).
    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Appends a row: `ids[slot][k]` and `scores[slot][prev][k]` (for slot 0 only `prev = 0`
    /// is read; the others may hold anything).
    ///
    /// # Panics
    /// When the lengths do not match the lattice's shape.
    pub fn push_row(&mut self, ids: &[u32], scores: &[f32]) {
        let (k, s) = (self.top_k, self.slots);
        assert_eq!(ids.len(), s * k, "candidate ids of one row");
        assert_eq!(scores.len(), s * k * k, "scores of one row");
        self.ids.extend_from_slice(ids);
        self.scores.extend_from_slice(scores);
        self.rows += 1;
    }

    /// Adds a row whose storage the caller fills: returns `(ids, scores)` of the new row.
    pub fn push_row_mut(&mut self) -> (&mut [u32], &mut [f32]) {
        let (k, s) = (self.top_k, self.slots);
        let (i0, s0) = (self.ids.len(), self.scores.len());
        self.ids.resize(i0 + s * k, 0);
        self.scores.resize(s0 + s * k * k, 0.0);
        self.rows += 1;
        (&mut self.ids[i0..], &mut self.scores[s0..])
    }

    /// Candidate ids of `slot` (0-based proposal index) of `row`.
    pub fn candidates(&self, row: usize, slot: usize) -> &[u32] {
        let k = self.top_k;
        let at = (row * self.slots + slot) * k;
        &self.ids[at..at + k]
    }

    /// Scores of `slot`'s candidates when the previous slot chose its candidate `prev`
    /// (slot 0: `prev` is ignored, the predecessor is the anchor).
    pub fn scores(&self, row: usize, slot: usize, prev: usize) -> &[f32] {
        let k = self.top_k;
        let prev = if slot == 0 { 0 } else { prev };
        let at = ((row * self.slots + slot) * k + prev) * k;
        &self.scores[at..at + k]
    }

    /// The greedy walk of `row`: at each slot the first highest-scoring candidate.
    pub fn greedy_path(&self, row: usize) -> Vec<u32> {
        let mut prev = 0;
        (0..self.slots)
            .map(|slot| {
                let s = self.scores(row, slot, prev);
                prev = first_max(s);
                self.candidates(row, slot)[prev]
            })
            .collect()
    }
}

/// Index of the first largest value (NaNs never win over numbers).
pub fn first_max(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best
}

/// Indices of the `k` largest values of `x`, largest first, ties to the lower index.
pub fn top_k_indices(x: &[f32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    out.extend(0..x.len() as u32);
    let key = |&i: &u32| {
        let v = x[i as usize];
        (if v.is_nan() { f32::NEG_INFINITY } else { v }, i)
    };
    let cmp = |a: &u32, b: &u32| {
        let (va, ia) = key(a);
        let (vb, ib) = key(b);
        vb.total_cmp(&va).then(ia.cmp(&ib))
    };
    let k = k.min(out.len());
    if k < out.len() {
        out.select_nth_unstable_by(k, cmp);
        out.truncate(k);
    }
    out.sort_unstable_by(cmp);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_by_value_then_id() {
        let mut out = Vec::new();
        top_k_indices(&[0.5, 2.0, f32::NAN, 2.0, -1.0, 3.0], 3, &mut out);
        assert_eq!(out, vec![5, 1, 3]);
        top_k_indices(&[1.0, 0.0], 5, &mut out);
        assert_eq!(out, vec![0, 1]);
    }

    #[test]
    fn walk_follows_the_chosen_predecessor() {
        // Two slots, two candidates; slot 1's scores depend on slot 0's choice.
        let mut l = CandidateLattice::new(2, 2);
        let ids = [10, 11, 20, 21];
        let scores = [
            0.0, 1.0, /* slot 0 (prev 0) */ 9.0, 9.0, /* unused */
            5.0, 0.0, /* slot 1 after 10 */ 0.0, 5.0, /* slot 1 after 11 */
        ];
        l.push_row(&ids, &scores);
        assert_eq!(l.greedy_path(0), vec![11, 21]);
        assert_eq!(l.scores(0, 0, 1), &[0.0, 1.0]);
        assert_eq!(l.candidates(0, 1), &[20, 21]);
    }
}
