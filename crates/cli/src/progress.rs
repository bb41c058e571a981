//! Progress bars on stderr for long steps (downloads, checksums).

use std::sync::Mutex;

use dflash_models::default_model::Progress;
use indicatif::{ProgressBar, ProgressStyle};

/// Draws one indicatif bar (or spinner) per step.
#[derive(Default)]
pub struct Bars {
    bar: Mutex<Option<ProgressBar>>,
}

impl Progress for Bars {
    fn begin(&self, what: &str, total: Option<u64>) {
        let bar = match total {
            Some(n) => {
                let b = ProgressBar::new(n);
                b.set_style(
                    ProgressStyle::with_template(
                        "{msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec})",
                    )
                    .expect("static template")
                    .progress_chars("=> "),
                );
                b
            }
            None => {
                let b = ProgressBar::new_spinner();
                b.enable_steady_tick(std::time::Duration::from_millis(120));
                b
            }
        };
        bar.set_message(what.to_string());
        *self.bar.lock().unwrap_or_else(|e| e.into_inner()) = Some(bar);
    }

    fn advance(&self, units: u64) {
        if let Some(b) = &*self.bar.lock().unwrap_or_else(|e| e.into_inner()) {
            b.inc(units);
        }
    }

    fn end(&self) {
        if let Some(b) = self.bar.lock().unwrap_or_else(|e| e.into_inner()).take() {
            b.finish_and_clear();
        }
    }
}
