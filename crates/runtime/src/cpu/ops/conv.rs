//! The grouped dynamic causal convolution of DFlash2 drafters (see `Backend::grouped_conv`).

use crate::backend::TokenMeta;

/// Shape of one convolution call.
#[derive(Clone, Copy, Debug)]
pub struct ConvShape {
    /// Channels per token.
    pub cols: usize,
    /// Taps (rows of the base kernel).
    pub taps: usize,
    /// Channels sharing one dynamic coefficient.
    pub group: usize,
    /// Columns of a `dynamic` row.
    pub dyn_cols: usize,
    /// First column of this side's coefficients in a `dynamic` row.
    pub col: usize,
}

/// Computes token `t`'s output row: taps in order, base term then dynamic term, each product
/// and sum rounded to f32. Tap o reads token `t - o` only when it is the same row's position
/// `pos - o`.
pub fn conv_token(
    t: usize,
    x: &[f32],
    base: &[f32],
    dynamic: &[f32],
    meta: &[TokenMeta],
    s: ConvShape,
    out: &mut [f32],
) {
    let groups = s.cols / s.group;
    out.fill(0.0);
    let m = meta[t];
    for o in 0..s.taps {
        if o > t {
            break;
        }
        let src = meta[t - o];
        if src.row != m.row || src.pos as usize + o != m.pos as usize {
            continue;
        }
        let xs = &x[(t - o) * s.cols..(t - o + 1) * s.cols];
        let b = &base[o * s.cols..(o + 1) * s.cols];
        let d = &dynamic[t * s.dyn_cols + s.col + o * groups..][..groups];
        for (c, acc) in out.iter_mut().enumerate() {
            let v = xs[c];
            let a = *acc + b[c] * v;
            *acc = a + d[c / s.group] * v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taps_stop_at_the_block_start_and_at_other_rows() {
        // Two rows: row 0 at positions 5, 6; row 1 at position 9. One group of two channels.
        let meta = [
            TokenMeta::causal(0, 5),
            TokenMeta::causal(0, 6),
            TokenMeta::causal(1, 9),
        ];
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let base = [1.0, 1.0, 0.5, 0.5];
        // Per token: [side0 tap0, side0 tap1].
        let dynamic = [0.0, 10.0, 1.0, 2.0, 0.0, 7.0];
        let s = ConvShape {
            cols: 2,
            taps: 2,
            group: 2,
            dyn_cols: 2,
            col: 0,
        };
        let mut out = [0.0; 2];
        conv_token(0, &x, &base, &dynamic, &meta, s, &mut out);
        assert_eq!(out, [1.0, 2.0]);
        conv_token(1, &x, &base, &dynamic, &meta, s, &mut out);
        // (1 + 1)·[3, 4] + (0.5 + 2)·[1, 2]
        assert_eq!(out, [8.5, 13.0]);
        conv_token(2, &x, &base, &dynamic, &meta, s, &mut out);
        assert_eq!(out, [5.0, 6.0]);
    }
}
