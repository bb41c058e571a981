//! Registers, spills, stack and static shared memory of every CUDA kernel, from ptxas's report
//! as NVRTC compiles each module for one chip; no GPU needed (NVRTC only: the CUDA toolkit's
//! library, or the `nvidia-cuda-nvrtc` wheel on `LD_LIBRARY_PATH`).
//!
//! ```text
//! cargo build --release -p dflash-runtime --features cuda --example cuda_kernel_resources
//! cuda_kernel_resources [--arch 90] [--module attention] [--kernel split]
//! ```
//!
//! `--module` keeps the modules whose name contains the text (`attention`, `attention_f16`,
//! `matmul_q4_0`, ...), `--kernel` the kernels whose name does. With `DFLASH_CUDA_KERNEL_DIR`
//! set, a variant's sources are read instead of the embedded ones, so the two can be compared
//! before a GPU run (see `tools/h200_kernel_ab.sh`).

use dflash_runtime::cuda::compile::{self, Module};
use dflash_runtime::cuda::resources::module_resources;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut arch = 90u32;
    let mut module = String::new();
    let mut kernel = String::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--arch" => {
                let v = val()?;
                arch = v
                    .parse()
                    .map_err(|_| format!("--arch {v}: expected a number such as 90"))?
            }
            "--module" => module = val()?,
            "--kernel" => kernel = val()?,
            _ => return Err(format!("unknown argument {a} (--arch, --module, --kernel)").into()),
        }
    }
    if !compile::nvrtc_available() {
        return Err(compile::NVRTC_HINT.into());
    }
    let modules: Vec<Module> = Module::all()
        .into_iter()
        .filter(|m| m.name().contains(&module))
        .collect();
    if modules.is_empty() {
        return Err(format!("no module name contains {module:?}").into());
    }
    // Every module compiles before anything is printed, so an error leaves no half table.
    let mut rows = Vec::new();
    for m in modules {
        for k in module_resources(m, arch)? {
            if k.name.contains(&kernel) {
                rows.push((m.name(), k));
            }
        }
    }
    println!("| module | kernel | registers | spill stores / loads (B) | stack (B) | shared (B) |");
    println!("|---|---|---:|---:|---:|---:|");
    for (m, k) in rows {
        println!(
            "| {m} | {} | {} | {} / {} | {} | {} |",
            k.name, k.registers, k.spill_stores, k.spill_loads, k.stack, k.shared
        );
    }
    Ok(())
}
