//! Writes a random-weight model of a real model's shapes as GGUF, for benchmarks:
//!
//! ```text
//! cargo run --release -p dflash-models --example synthetic_model -- \
//!     --shape qwen3-4b --dtype q4_0 --out /tmp/qwen3-4b-q4_0.gguf
//! dflash bench -m /tmp/qwen3-4b-q4_0.gguf --no-draft
//! ```
//!
//! Shapes: `qwen3-4b` (36 layers, hidden 2560, 32/8 heads of 128, FFN 9728, vocabulary
//! 151936) and `smollm2-135m` (30 layers, hidden 576, 9/3 heads of 64, FFN 1536, vocabulary
//! 49152). Formats: any the runtime reads (`q4_0`, `q4_1`, `q8_0`, `q4k`, `q6k`, `bf16`,
//! `f16`, `f32`); `--head-dtype F` stores the embedding and output head as F instead (the
//! published SmolLM2 GGUF: `--dtype q4_1 --head-dtype q8_0`).

use dflash_models::synthetic::{write_synthetic, SyntheticSpec};
use dflash_runtime::DType;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut shape, mut dtype, mut out) = (String::from("qwen3-4b"), DType::Q4_0, None);
    let mut head_dtype = None;
    let format = |v: String| {
        DType::ALL
            .into_iter()
            .find(|d| d.info().kernel_name == v || d.info().name == v)
            .ok_or(format!("unknown format {v}"))
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--shape" => shape = val()?,
            "--dtype" => dtype = format(val()?)?,
            "--head-dtype" => head_dtype = Some(format(val()?)?),
            "--out" => out = Some(std::path::PathBuf::from(val()?)),
            _ => return Err(format!("unknown flag {a}").into()),
        }
    }
    let mut spec = match shape.as_str() {
        "qwen3-4b" => SyntheticSpec::qwen3_4b(dtype),
        "smollm2-135m" => SyntheticSpec::smollm2_135m(dtype),
        _ => return Err(format!("unknown shape {shape} (known: qwen3-4b, smollm2-135m)").into()),
    };
    spec.head_dtype = head_dtype;
    let out = out.ok_or("--out FILE is required")?;
    let t = std::time::Instant::now();
    write_synthetic(&spec, &out)?;
    println!(
        "wrote {} ({shape}, {dtype}) in {:.1} s",
        out.display(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
