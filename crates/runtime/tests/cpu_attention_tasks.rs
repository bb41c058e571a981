//! The CPU backend's attention splits its work per query head for short contexts and per KV
//! head and piece of a row's tokens once a token sees 256 keys or more, and splits those
//! tasks by key chunk when they are too few for the threads; whichever way, every (token,
//! head) output must be the bits of that head computed alone, so a token gets the same result
//! whatever it is batched with and however many threads there are (decode steps and verify
//! blocks agree), for both KV cache types.

use dflash_runtime::backend::{AttnShape, TokenMeta};
use dflash_runtime::cpu::ops::attention::{attend, KvSlice, Scratch};
use dflash_runtime::cpu::{CpuBackend, CpuTensor, Isa, KvType, MatmulMode};
use dflash_runtime::Backend;
use rand::{Rng, SeedableRng};

const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HD: usize = 64;
const LEN: usize = 1300;

fn outputs(
    b: &CpuBackend,
    kv: &dflash_runtime::cpu::CpuKv,
    q: &[Vec<f32>],
    meta: &[TokenMeta],
) -> Vec<Vec<f32>> {
    let shape = AttnShape {
        n_heads: HEADS,
        n_kv_heads: KV_HEADS,
        head_dim: HD,
        scale: 0.125,
    };
    let mut qt = CpuTensor::zeros(q.len(), HEADS * HD);
    for (t, row) in q.iter().enumerate() {
        qt.row_mut(t).copy_from_slice(row);
    }
    let meta = b.upload_meta(meta);
    let mut out = CpuTensor::default();
    b.run(|| b.attention(&qt, kv, 0, &meta, shape, &mut out));
    (0..q.len()).map(|t| out.row(t).to_vec()).collect()
}

#[test]
fn every_task_split_gives_each_head_its_own_bits() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    // A lone token past 256 keys makes 3 KV-head tasks, split by key chunk on 2 threads and on
    // 5; below 256 keys it makes 9 query-head tasks over one chunk.
    for (ty, threads) in [(KvType::F16, 2), (KvType::F32, 2), (KvType::F16, 5)] {
        let b = CpuBackend::with_options(threads, Isa::detect(), MatmulMode::Auto).with_kv_type(ty);
        let kv_dim = KV_HEADS * HD;
        let mut kv = b.kv_new(1, KV_HEADS, HD);
        b.kv_reserve(&mut kv, 0, LEN, 0);
        let k: Vec<f32> = (0..LEN * kv_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let v: Vec<f32> = (0..LEN * kv_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let meta: Vec<TokenMeta> = (0..LEN as u32).map(|p| TokenMeta::causal(0, p)).collect();
        let (kt, vt) = (b.upload(&k, LEN, kv_dim), b.upload(&v, LEN, kv_dim));
        let m = b.upload_meta(&meta);
        b.run(|| b.kv_write(&mut kv, 0, &kt, &vt, &m));

        // Tokens seeing 1, 40 keys, then (a step with them takes a task per KV head) 256 (one
        // key chunk), 257 (a second chunk of one key), 700, 1,023, 1,024, 1,300, then a verify
        // block's 10 consecutive tokens near the end.
        let positions: Vec<u32> = [0u32, 39, 255, 256, 699, 1022, 1023, 1299]
            .into_iter()
            .chain(1280..1290)
            .collect();
        let q: Vec<Vec<f32>> = positions
            .iter()
            .map(|_| {
                (0..HEADS * HD)
                    .map(|_| rng.random_range(-2.0..2.0))
                    .collect()
            })
            .collect();
        let metas: Vec<TokenMeta> = positions.iter().map(|&p| TokenMeta::causal(0, p)).collect();
        let together = outputs(&b, &kv, &q, &metas);
        for (t, &p) in positions.iter().enumerate() {
            let alone = outputs(&b, &kv, &q[t..t + 1], &metas[t..t + 1]);
            let row = &kv.layers[0][0];
            for h in 0..HEADS {
                let slice = KvSlice {
                    k: row.k.data(),
                    v: row.v.data(),
                    stride: HD,
                    head_off: kv.head_offset(0, h / (HEADS / KV_HEADS)),
                    start: 0,
                    end: p as usize + 1,
                };
                let mut want = vec![0f32; HD];
                let qh = &q[t][h * HD..(h + 1) * HD];
                attend(
                    b.isa(),
                    qh,
                    slice,
                    0.125,
                    &mut Scratch::default(),
                    &mut want,
                );
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let got = &together[t][h * HD..(h + 1) * HD];
                assert_eq!(
                    bits(got),
                    bits(&want),
                    "{ty}, {threads} threads: token at {p}, head {h}, batched"
                );
                let got = &alone[0][h * HD..(h + 1) * HD];
                assert_eq!(
                    bits(got),
                    bits(&want),
                    "{ty}, {threads} threads: token at {p}, head {h}, alone"
                );
            }
        }
    }
}
