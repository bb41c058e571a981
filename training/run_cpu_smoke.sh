#!/usr/bin/env bash
# CPU smoke test of the whole pipeline with the real target (no GPU needed):
# tests, then regeneration of a few prompts (16 new tokens), a few training
# steps of a 1-layer drafter, export, and a load-back check of the export.
#
# usage: bash training/run_cpu_smoke.sh [TARGET_GGUF] [PROMPTS]
set -euo pipefail
TR="$(cd "$(dirname "$0")" && pwd)"
TARGET="${1:-/work/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
PROMPTS="${2:-/work/data/train_prompts.jsonl.gz}"
OUT="$TR/smoke_out"
cd "$TR"
python3 -m pytest -q tests
rm -rf "$OUT"
python3 -m dflash_train.pipeline --device cpu --dtype float32 \
  --target "$TARGET" --prompts "$PROMPTS" --out-dir "$OUT" --total-s 900 --regen-s 400 \
  --limit 12 --max-new-tokens 16 --max-batch 6 --chunk 12 \
  --draft-layers 1 --batch-size 2 --num-anchors 4 --max-steps 6 --val-seqs 4 --log-every 1 \
  2>&1 | grep -v -E "Converting and de-quantizing|Loading weights"
python3 -m dflash_train.export --check "$OUT/ckpt/drafter"
python3 - "$OUT/ckpt/drafter" <<'PY'
import json, sys
from safetensors import safe_open
d = sys.argv[1]
cfg = json.load(open(f"{d}/config.json"))
print({k: cfg[k] for k in ("architectures", "model_type", "block_size", "dflash_config",
                           "num_target_layers", "num_hidden_layers", "hidden_size")})
import glob
for f in sorted(glob.glob(f"{d}/*.safetensors")):
    with safe_open(f, "pt") as s:
        for k in s.keys():
            t = s.get_tensor(k)
            print(f"  {k:45s} {str(t.dtype):15s} {list(t.shape)}")
PY
echo "smoke OK"
