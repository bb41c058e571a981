#!/usr/bin/env bash
# Prepare the inputs that travel to the GPU machine (run here, not there).
#
# The device call's working tree is capped at 64 MiB, and the SmolLM2 Q4_1 GGUF
# alone is 94 MiB, so the target travels in two pieces over two calls on the
# same (warm) machine:
#   training/gpu_in/a/  <model>.gguf.part-aa                       (~54 MiB)
#   training/gpu_in/b/  <model>.gguf.part-ab + .sha256 + prompts   (~54 MiB)
# Call 1 carries gpu_in/a and runs `bash training/run_gpu.sh stage`; call 2
# (within the machine's 30 s warm window) carries gpu_in/b and .whl and runs
# `bash training/run_gpu.sh all`.  See training/README.md.
#
# usage: bash training/stage_inputs.sh [MODEL_GGUF] [PROMPTS] [PART_MIB]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${1:-/work/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
PROMPTS="${2:-/work/data/train_prompts.jsonl.gz}"
PART_MIB="${3:-54}"
IN="$HERE/gpu_in"
rm -rf "$IN/a" "$IN/b"
mkdir -p "$IN/a" "$IN/b"
name="$(basename "$MODEL")"
split -b "${PART_MIB}M" -a 2 "$MODEL" "$IN/a/$name.part-"
# every part after the first goes to b
for p in "$IN/a/$name".part-*; do
  [ "$(basename "$p")" = "$name.part-aa" ] || mv "$p" "$IN/b/"
done
sha256sum "$MODEL" | awk '{print $1}' > "$IN/b/$name.sha256"
cp "$PROMPTS" "$IN/b/train_prompts.jsonl.gz"
du -sh "$IN/a" "$IN/b"
ls -la "$IN/a" "$IN/b"
