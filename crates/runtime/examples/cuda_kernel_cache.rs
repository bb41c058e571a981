//! Fills the kernel cache for a GPU architecture on a machine without a GPU, so that a program
//! of the same build finds its kernels compiled when it first runs on such a GPU (NVRTC takes
//! up to ~140 s for the modules a model uses on a fresh device machine: device time that a
//! carried cache saves).
//!
//! cargo build --release -p dflash-runtime --features cuda --example cuda_kernel_cache
//! DFLASH_CACHE_DIR=DIR cuda_kernel_cache [--arch 90] [--module NAME]
//!
//! Every module whose name contains NAME (all by default) is compiled as the backend compiles
//! it for that architecture (`target_for`: a CUBIN when this NVRTC targets the chip, else
//! PTX), one thread per module, and stored under the cache root (`DFLASH_CACHE_DIR`, else the
//! default; `DFLASH_CUDA_KERNEL_DIR` applies as it does at run time). The cache key holds the
//! source, the target, NVRTC's major.minor version and the options, so the files serve a GPU
//! machine whose NVRTC has the same major.minor version, and a file that does not match is
//! never read there.

use std::time::Instant;

mod nvrtc_args;

use dflash_runtime::cuda::compile;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = nvrtc_args::parse(false)?;
    let (arch, modules) = (args.arch, nvrtc_args::modules(&args.module)?);
    // The backend's own choice for a device of this compute capability.
    let target = compile::target_for(arch)?;
    let (major, minor) = compile::nvrtc_version()?;
    println!("NVRTC {major}.{minor}");
    let started = Instant::now();
    // One thread per module, each stored as it is compiled (as the backend does at run time).
    compile::compile_many(&modules, target, true)?;
    for m in modules {
        let path = compile::cache_path(m, target)?
            .ok_or("the kernel cache is off (DFLASH_CUDA_NO_CACHE) or has no root")?;
        if !path.is_file() {
            return Err(format!("{} was not written", path.display()).into());
        }
        println!(
            "{} for {}: {}",
            m.name(),
            target.arch_flag(),
            path.display()
        );
    }
    println!("{:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
