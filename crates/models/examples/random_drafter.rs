//! Writes a randomly initialised DFlash drafter with the shape of an existing drafter
//! directory: the "no useful drafts" arm of the overhead benchmark.
//!
//! `cargo run --release -p dflash-models --example random_drafter -- SHAPE_DIR OUT_DIR [SEED]`

use std::path::PathBuf;

use dflash_models::dflash::DrafterConfig;
use dflash_models::synthetic::write_drafter_dir;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(shape), Some(out)) = (args.first(), args.get(1)) else {
        return Err("usage: random_drafter SHAPE_DIR OUT_DIR [SEED]".into());
    };
    let seed: u64 = args.get(2).map_or(Ok(7), |s| s.parse())?;
    let cfg = DrafterConfig::read(&PathBuf::from(shape))?;
    write_drafter_dir(&cfg, seed, &PathBuf::from(out))?;
    println!("random drafter (seed {seed}) shaped like {shape} written to {out}");
    Ok(())
}
