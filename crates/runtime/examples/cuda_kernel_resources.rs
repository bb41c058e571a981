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

mod nvrtc_args;

use dflash_runtime::cuda::resources::module_resources;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let nvrtc_args::Args {
        arch,
        module,
        kernel,
    } = nvrtc_args::parse(true)?;
    let modules = nvrtc_args::modules(&module)?;
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
