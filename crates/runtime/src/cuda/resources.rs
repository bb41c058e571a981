//! What each kernel costs the chip, without a GPU: registers, spills, stack and static shared
//! memory per thread block, as ptxas reports them when NVRTC compiles a module to machine code
//! with `--ptxas-options=-v`.
//!
//! A kernel change that adds registers or spills can lose occupancy or add local-memory round
//! trips on every call; this reads both on any machine with NVRTC (the CI's wheel included), so
//! a candidate can be checked before device time is spent on it. `DFLASH_CUDA_KERNEL_DIR`
//! applies, as for every compilation (see [`compile`](super::compile)).

use super::compile::{compile_logged, nvrtc_version, Module, Target};

/// NVRTC from 12.9 on keeps its own cache of compiles, and a compile it answers from that cache
/// carries no ptxas report in its log (on the H100/H200 machines, a module compiled earlier in
/// the same process came back without one); `--no-cache` makes it run ptxas again.
const NO_CACHE_FROM: (i32, i32) = (12, 9);

/// One kernel's resources, from ptxas's report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The entry function's name.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores and loads per thread (local memory).
    pub spill_stores: u32,
    pub spill_loads: u32,
    /// Bytes of stack frame per thread.
    pub stack: u32,
    /// Bytes of static shared memory per block.
    pub shared: u32,
}

/// The resources of every kernel of `module` compiled for `sm_<arch>`, in ptxas's order.
pub fn module_resources(module: Module, arch: u32) -> Result<Vec<KernelResources>, String> {
    let target = Target { arch, cubin: true };
    let mut options = vec!["--ptxas-options=-v"];
    if nvrtc_version()? >= NO_CACHE_FROM {
        options.push("--no-cache");
    }
    let (_, log) = compile_logged(module, target, &options)?;
    let kernels = parse_ptxas_log(&log);
    if kernels.is_empty() {
        return Err(format!(
            "{}.cu: the compile log for sm_{arch} names no kernel (ptxas report missing)",
            module.name()
        ));
    }
    Ok(kernels)
}

/// The number written just before `unit` in `line` (`"12 bytes spill stores"` -> 12).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let head = &line[..line.find(unit)?];
    head.split(|c: char| !c.is_ascii_digit())
        .rfind(|w| !w.is_empty())?
        .parse()
        .ok()
}

/// The kernels of a ptxas `-v` report: a `Compiling entry function 'NAME'` line opens each,
/// followed by its stack / spill line and its `Used N registers` line.
pub fn parse_ptxas_log(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            out.push(KernelResources {
                name: name.to_string(),
                ..Default::default()
            });
            continue;
        }
        let Some(k) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            k.stack = number_before(line, "bytes stack frame").unwrap_or(0);
            k.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            k.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains(" registers") {
            k.registers = number_before(line, " registers").unwrap_or(0);
            k.shared = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'attention_merge' for 'sm_90'
ptxas info    : Function properties for attention_merge
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
ptxas info    : Compile time = 20.809 ms
ptxas info    : Compiling entry function 'attention_split_early_4_4' for 'sm_90'
ptxas info    : Function properties for attention_split_early_4_4
ptxas         .     16 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 20612 bytes smem
ptxas info    : Compile time = 354.883 ms
";

    #[test]
    fn reads_every_kernel_of_a_report() {
        let k = parse_ptxas_log(LOG);
        assert_eq!(k.len(), 2);
        assert_eq!(
            k[0],
            KernelResources {
                name: "attention_merge".into(),
                registers: 32,
                ..Default::default()
            }
        );
        assert_eq!(
            k[1],
            KernelResources {
                name: "attention_split_early_4_4".into(),
                registers: 168,
                spill_stores: 12,
                spill_loads: 16,
                stack: 16,
                shared: 20612,
            }
        );
    }

    #[test]
    fn a_log_without_kernels_reads_as_none() {
        assert!(parse_ptxas_log("").is_empty());
        assert!(parse_ptxas_log("ptxas info    : 0 bytes gmem\n").is_empty());
    }
}
