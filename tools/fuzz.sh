#!/usr/bin/env bash
# Coverage-guided fuzzing of one harness of crates/fuzz with libFuzzer, on the stable
# toolchain: the targets in fuzz/ are built with the sanitizer-coverage flags cargo-fuzz
# passes, without AddressSanitizer (that needs nightly; the harnesses are safe Rust over
# parsers, so what we look for is panics, hangs and runaway memory).
#
#   tools/fuzz.sh TARGET [SECONDS]      e.g. tools/fuzz.sh gguf 600
#
# New corpus entries go to fuzz/corpus/TARGET (minimise with `-merge=1` before committing);
# crashes, hangs (-timeout) and out-of-memory inputs (-rss_limit_mb) go to fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: tools/fuzz.sh TARGET [SECONDS]}
seconds=${2:-600}
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cforce-frame-pointers=yes"
# An explicit --target keeps the flags off build scripts and proc macros (as cargo-fuzz does).
host=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --locked --manifest-path fuzz/Cargo.toml --bin "$target" \
  --target "$host" --target-dir target/fuzz
mkdir -p "fuzz/corpus/$target" "fuzz/artifacts/$target"
max_len=4096
case "$target" in gguf|safetensors) max_len=65536 ;; tokenizer) max_len=16384 ;; esac
exec "target/fuzz/$host/release/$target" "fuzz/corpus/$target" \
  -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len="$max_len" \
  -artifact_prefix="fuzz/artifacts/$target/" -print_final_stats=1
