//! What rolling a Gated DeltaNet row back costs, two ways, on the CPU (one thread, the
//! recurrent kernel of the CPU backend, Qwen3.5-0.8B's GDN shapes: 18 layers x 16 heads of
//! 128 x 128 f32 state):
//!
//! - **replay** (what dflash-rs does): the verify step reads the checkpoint and writes only
//!   the final state; a rollback to `keep` tokens copies the checkpoint and replays `keep`
//!   tokens of the recurrence.
//! - **snapshots** (vLLM/SGLang's default): the verify step writes the state after every token;
//!   a rollback picks the snapshot at `keep` (copied into place here).
//!
//! `cargo run --release -p dflash-runtime --example gdn_rollback_cost [-- BLOCK REPS]`
//! prints the median time of verify + rollback per row for keep = 0, 2, 8 and BLOCK - 1.

use std::time::Instant;

use dflash_runtime::cpu::ops::gdn::{delta_step, l2_normalize};

const LAYERS: usize = 18;
const HEADS: usize = 16;
const DK: usize = 128;
const DV: usize = 128;

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

fn inputs(block: usize) -> Inputs {
    let mut x = 0x2545f491u32;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x as f32 / u32::MAX as f32) * 2.0 - 1.0
    };
    let mut q: Vec<f32> = (0..block * DK).map(|_| next()).collect();
    let mut k: Vec<f32> = (0..block * DK).map(|_| next()).collect();
    for t in 0..block {
        l2_normalize(&mut q[t * DK..(t + 1) * DK]);
        l2_normalize(&mut k[t * DK..(t + 1) * DK]);
    }
    Inputs {
        q,
        k,
        v: (0..block * DV).map(|_| next()).collect(),
        g: (0..block).map(|_| -0.1 - next().abs()).collect(),
        beta: (0..block).map(|_| 0.5 + 0.4 * next()).collect(),
    }
}

/// Runs `n` tokens from `s` in place; with `snaps`, stores the state after each token.
fn steps(s: &mut [f32], inp: &Inputs, n: usize, out: &mut [f32], snaps: Option<&mut [f32]>) {
    let mut kv = vec![0f32; DV];
    let sl = DK * DV;
    let mut snaps = snaps;
    for t in 0..n {
        delta_step(
            s,
            &inp.q[t * DK..(t + 1) * DK],
            &inp.k[t * DK..(t + 1) * DK],
            &inp.v[t * DV..(t + 1) * DV],
            inp.g[t],
            inp.beta[t],
            &mut kv,
            Some(&mut out[t * DV..(t + 1) * DV]),
        );
        if let Some(sn) = snaps.as_deref_mut() {
            sn[t * sl..(t + 1) * sl].copy_from_slice(s);
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let block = args.first().copied().unwrap_or(16);
    let reps = args.get(1).copied().unwrap_or(7);
    let inp = inputs(block);
    let sl = DK * DV;
    let units = LAYERS * HEADS;
    let mut ckpt = vec![0.01f32; units * sl];
    let mut cur = vec![0f32; units * sl];
    let mut snaps = vec![0f32; units * block * sl];
    let mut out = vec![0f32; block * DV];
    println!("block {block}, {LAYERS} layers x {HEADS} heads of {DK}x{DV} f32, one thread, median of {reps}");
    println!("| keep | replay ms | snapshots ms | snapshots / replay |");
    println!("|---|---|---|---|");
    for keep in [0, 2.min(block - 1), 8.min(block - 1), block - 1] {
        let (mut rt, mut st) = (Vec::new(), Vec::new());
        for _ in 0..=reps {
            // Replay: verify from the checkpoint into cur, then rebuild cur from the checkpoint.
            let t = Instant::now();
            for u in 0..units {
                let (c0, c1) = (&ckpt[u * sl..(u + 1) * sl], &mut cur[u * sl..(u + 1) * sl]);
                c1.copy_from_slice(c0);
                steps(c1, &inp, block, &mut out, None);
                c1.copy_from_slice(c0);
                steps(c1, &inp, keep, &mut out, None);
            }
            rt.push(t.elapsed().as_secs_f64() * 1e3);
            // Snapshots: verify writing every token's state, then take the one at keep.
            let t = Instant::now();
            for u in 0..units {
                let (c0, c1) = (&ckpt[u * sl..(u + 1) * sl], &mut cur[u * sl..(u + 1) * sl]);
                c1.copy_from_slice(c0);
                let sn = &mut snaps[u * block * sl..(u + 1) * block * sl];
                steps(c1, &inp, block, &mut out, Some(sn));
                if keep > 0 {
                    c1.copy_from_slice(&sn[(keep - 1) * sl..keep * sl]);
                } else {
                    c1.copy_from_slice(c0);
                }
            }
            st.push(t.elapsed().as_secs_f64() * 1e3);
        }
        rt.remove(0);
        st.remove(0);
        let (r, s) = (median(rt), median(st));
        println!("| {keep} | {r:.2} | {s:.2} | {:.2} |", s / r);
        ckpt[0] += 1e-7; // keep the optimiser honest across iterations
    }
}
