//! The original GGML block formats: Q4_0, Q4_1 and Q8_0 (32 values per block).
//!
//! Q4_0: f16 scale d, 16 bytes of nibbles; value i is d·(q_i − 8).
//! Q4_1: f16 scale d, f16 minimum m, 16 bytes of nibbles; value i is fma(q_i, d, m).
//! Q8_0: f16 scale d, 32 signed bytes; value i is q_i·d.
//! Nibbles: byte j holds value j in its low half and value j+16 in its high half.

use super::{f16_at, GROUP};

pub(super) fn decode_q4_0(row: &[u8], g: usize, out: &mut [f32; GROUP]) {
    let b = &row[g * 18..g * 18 + 18];
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        out[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        out[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

pub(super) fn decode_q4_1(row: &[u8], g: usize, out: &mut [f32; GROUP]) {
    let b = &row[g * 20..g * 20 + 20];
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for j in 0..16 {
        let q = b[4 + j];
        out[j] = ((q & 0x0F) as f32).mul_add(d, m);
        out[j + 16] = ((q >> 4) as f32).mul_add(d, m);
    }
}

pub(super) fn decode_q8_0(row: &[u8], g: usize, out: &mut [f32; GROUP]) {
    let b = &row[g * 34..g * 34 + 34];
    let d = f16_at(b, 0);
    for (j, o) in out.iter_mut().enumerate() {
        *o = (b[2 + j] as i8) as f32 * d;
    }
}
