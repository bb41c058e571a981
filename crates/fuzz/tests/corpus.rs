//! The short fuzz run of every `cargo test`: each target's committed corpus
//! (`fuzz/corpus/<target>/`, seeds and what libFuzzer kept) is replayed, then a bounded
//! number of seeded random mutations of it (bit flips, byte changes, cuts, insertions,
//! splices) go through the same harness. Any panic fails the test. The coverage-guided runs
//! are `tools/fuzz.sh` (docs/fuzzing.md).

use std::path::Path;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

/// Mutated inputs per target (and at most this long per target).
const MUTATIONS: usize = 400;
const BUDGET: Duration = Duration::from_secs(20);

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn mutate(rng: &mut rand::rngs::StdRng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut d = seeds[rng.random_range(0..seeds.len())].clone();
    for _ in 0..rng.random_range(1..=4) {
        let n = d.len();
        match rng.random_range(0..6) {
            0 if n > 0 => {
                let i = rng.random_range(0..n);
                d[i] ^= 1 << rng.random_range(0..8);
            }
            1 if n > 0 => {
                let i = rng.random_range(0..n);
                d[i] = [0u8, 0xff, 0x7f, 0x80, b'"', b'{', b'9'][rng.random_range(0..7)];
            }
            2 if n > 0 => d.truncate(rng.random_range(0..n)),
            3 => {
                let i = rng.random_range(0..=n);
                let b: u8 = rng.random();
                d.insert(i, b);
            }
            4 if n > 8 => {
                // Overwrite 4 bytes with a boundary integer (lengths, counts, offsets).
                let i = rng.random_range(0..n - 4);
                let v = [0u32, 1, u32::MAX, 0x7fff_ffff, 1 << 20][rng.random_range(0..5)];
                d[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                let other = &seeds[rng.random_range(0..seeds.len())];
                if !other.is_empty() {
                    let at = rng.random_range(0..other.len());
                    let cut = rng.random_range(0..=d.len());
                    d.truncate(cut);
                    d.extend_from_slice(&other[at..]);
                }
            }
        }
    }
    d
}

#[test]
fn every_target_survives_its_corpus_and_mutations() {
    for (name, harness) in dflash_fuzz::TARGETS {
        let seeds = corpus(name);
        assert!(!seeds.is_empty(), "{name}: empty corpus");
        for s in &seeds {
            harness(s);
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
        let t0 = Instant::now();
        for _ in 0..MUTATIONS {
            if t0.elapsed() > BUDGET {
                break;
            }
            harness(&mutate(&mut rng, &seeds));
        }
    }
}
