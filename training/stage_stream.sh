#!/usr/bin/env bash
# Stage the inputs of the streaming pipeline for device calls (run here, not there):
#   DEST/code/  dflash_train + run_stream.sh           (every call)
#   DEST/a/     <model>.gguf.part-aa                    (first call)
#   DEST/b/     part-ab + .sha256 + train_convs.jsonl.gz + eval/*.jsonl   (second call)
#   DEST/c/     dflash (a CUDA build, when BIN is set: run_stream.sh eval)
#   DEST/whl/   the gguf wheel (transformers reads the target with it; the device image lacks it)
# usage: bash training/stage_stream.sh DEST [MODEL_GGUF] [CONVS]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DEST="$1"
MODEL="${2:-$HOME/.cache/dflash/SmolLM2-135M-Instruct.Q4_1.gguf}"
CONVS="${3:-/work/data/train_convs.jsonl.gz}"
rm -rf "$DEST/code" "$DEST/a" "$DEST/b" "$DEST/c" "$DEST/whl"
mkdir -p "$DEST/code" "$DEST/a" "$DEST/b/eval"
cp -r "$HERE/dflash_train" "$HERE/run_stream.sh" "$HERE/../tools/cuda_env.sh" "$DEST/code/"
find "$DEST/code" -name __pycache__ -prune -exec rm -rf {} +
name="$(basename "$MODEL")"
split -b 54M -a 2 "$MODEL" "$DEST/a/$name.part-"
for p in "$DEST/a/$name".part-*; do
  [ "$(basename "$p")" = "$name.part-aa" ] || mv "$p" "$DEST/b/"
done
sha256sum "$MODEL" | awk '{print $1}' > "$DEST/b/$name.sha256"
cp "$CONVS" "$DEST/b/train_convs.jsonl.gz"
cp "$HERE/../data/mt_bench_first_turns.jsonl" "$HERE/data/sharegpt_heldout.jsonl" "$DEST/b/eval/"
mkdir -p "$DEST/whl"
python3 -m pip download -q --no-deps gguf==0.19.0 -d "$DEST/whl"
if [ -n "${BIN:-}" ]; then mkdir -p "$DEST/c"; cp "$BIN" "$DEST/c/dflash"; fi
du -sh "$DEST"/*
