#!/usr/bin/env bash
# Stage the inputs of the streaming pipeline for device calls (run here, not there):
#   DEST/code/  dflash_train + tests + run_stream.sh   (every call)
#   DEST/a/     <model>.gguf.xz.part-aa                 (first call)
#   DEST/b/     the other part(s) + .sha256 + train_convs.jsonl.gz + eval/*.jsonl
#               + init_drafter.tar.xz when INIT (an exported drafter dir) is set (second call)
#   DEST/c/     dflash (a CUDA build, when BIN is set: run_stream.sh eval) + kcache.tar.xz (its kernels)
#   DEST/whl/   the gguf wheel (transformers reads the target with it; the device image lacks it)
# The model and the drafter travel xz-compressed (98 + 32 MB -> 90 + 22 MB), so both fit in two
# calls' 64 MiB. usage: [INIT=DIR] [BIN=dflash] bash training/stage_stream.sh DEST [MODEL_GGUF] [CONVS]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DEST="$1"
MODEL="${2:-$HOME/.cache/dflash/SmolLM2-135M-Instruct.Q4_1.gguf}"
CONVS="${3:-/work/data/train_convs.jsonl.gz}"
rm -rf "$DEST/code" "$DEST/a" "$DEST/b" "$DEST/c" "$DEST/whl"
mkdir -p "$DEST/code/tests" "$DEST/a" "$DEST/b/eval"
cp -r "$HERE/dflash_train" "$HERE/run_stream.sh" "$HERE/../tools/cuda_env.sh" "$DEST/code/"
cp "$HERE"/tests/conftest.py "$HERE"/tests/test_*torch.py "$DEST/code/tests/"
find "$DEST/code" -name __pycache__ -prune -exec rm -rf {} +
name="$(basename "$MODEL").xz"
XZ="${XZ_CACHE:-$HOME/.cache/dflash/xz}/$name"
mkdir -p "$(dirname "$XZ")"
[ "$XZ" -nt "$MODEL" ] || xz -T2 -6 -c "$MODEL" > "$XZ"
split -b 60M -a 2 "$XZ" "$DEST/a/$name.part-"
for p in "$DEST/a/$name".part-*; do
  [ "$(basename "$p")" = "$name.part-aa" ] || mv "$p" "$DEST/b/"
done
sha256sum "$XZ" | awk '{print $1}' > "$DEST/b/$name.sha256"
cp "$CONVS" "$DEST/b/train_convs.jsonl.gz"
cp "$HERE/../data/mt_bench_first_turns.jsonl" "$HERE/data/sharegpt_heldout.jsonl" "$DEST/b/eval/"
if [ -n "${INIT:-}" ]; then
  tar -C "$(dirname "$INIT")" -cf - --transform "s,^$(basename "$INIT"),init_drafter," "$(basename "$INIT")" \
    | xz -T2 -6 > "$DEST/b/init_drafter.tar.xz"
fi
mkdir -p "$DEST/whl"
python3 -m pip download -q --no-deps gguf==0.19.0 -d "$DEST/whl"
if [ -n "${BIN:-}" ]; then
  mkdir -p "$DEST/c"
  cp "$BIN" "$DEST/c/dflash"
  # Its kernels, compiled here (the working tree's sources: BIN should be a build of them).
  bash "$HERE/../tools/kernel_cache.sh" "$DEST/c/kcache.tar.xz"
fi
du -sh "$DEST"/*
