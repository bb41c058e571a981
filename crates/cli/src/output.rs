//! Writing results to stdout: a closed pipe (`dflash generate … | head`) ends the program
//! quietly with success; any other write failure (a full disk) is an error.

use std::io::{ErrorKind, Write};

/// The reader of stdout went away; `main` exits quietly with success.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed")]
pub struct ClosedPipe;

/// Writes `text` to stdout and flushes it.
pub fn write(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| match e.kind() {
            ErrorKind::BrokenPipe => anyhow::Error::new(ClosedPipe),
            _ => anyhow::Error::new(e).context("cannot write the output"),
        })
}

/// Writes `text` and a newline to stdout.
pub fn line(text: &str) -> anyhow::Result<()> {
    write(&format!("{text}\n"))
}
