//! The command line shared by the NVRTC examples (`cuda_kernel_resources`,
//! `cuda_kernel_cache`): `--arch N` (compute capability as major*10 + minor, 90 by default),
//! `--module TEXT` and, for a program that takes it, `--kernel TEXT`; and the modules a
//! `--module` text names, once NVRTC is known to load.

use dflash_runtime::cuda::compile::{self, Module};

pub struct Args {
    pub arch: u32,
    pub module: String,
    pub kernel: String,
}

/// The program's arguments; `--kernel` is an error unless `with_kernel`.
pub fn parse(with_kernel: bool) -> Result<Args, String> {
    let mut out = Args {
        arch: 90,
        module: String::new(),
        kernel: String::new(),
    };
    let known = if with_kernel {
        "--arch, --module, --kernel"
    } else {
        "--arch, --module"
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--arch" => {
                let v = val()?;
                out.arch = v
                    .parse()
                    .map_err(|_| format!("--arch {v}: expected a number such as 90"))?
            }
            "--module" => out.module = val()?,
            "--kernel" if with_kernel => out.kernel = val()?,
            _ => return Err(format!("unknown argument {a} ({known})")),
        }
    }
    Ok(out)
}

/// The modules whose name contains `text` (all for an empty one); an error when NVRTC cannot be
/// loaded or no module matches.
pub fn modules(text: &str) -> Result<Vec<Module>, String> {
    if !compile::nvrtc_available() {
        return Err(compile::NVRTC_HINT.into());
    }
    let modules: Vec<Module> = Module::all()
        .into_iter()
        .filter(|m| m.name().contains(text))
        .collect();
    if modules.is_empty() {
        return Err(format!("no module name contains {text:?}"));
    }
    Ok(modules)
}
