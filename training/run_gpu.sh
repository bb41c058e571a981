#!/usr/bin/env bash
# End-to-end driver for the GPU machine (also runs on CPU for a smoke test).
#
#   bash training/run_gpu.sh stage   # park carried model parts/prompts in $STAGE
#   bash training/run_gpu.sh all     # regenerate (REGEN_S) then train until TOTAL_S, export, pack
#   bash training/run_gpu.sh regen   # regeneration only (whole budget)
#   bash training/run_gpu.sh train   # training only (resumes WORK/ckpt or a carried ckpt)
#
# Environment (defaults):
#   TOTAL_S=540        whole-script budget in seconds (keep < the 600 s call limit)
#   REGEN_S=240        regeneration share in mode 'all'
#   WORK=training/runs/gpu       work dir (git-ignored: kept between calls on a warm machine)
#   STAGE=training/gpu_in/_stage where carried model parts are parked and assembled
#   OUT=$OUT or $WORK/out  where the returned files go
#   TARGET=            target .gguf or HF dir (default: assembled from carried parts)
#   PROMPTS=           prompt file (default: first train_prompts.jsonl.gz found)
#   EXTRA_ARGS=        extra arguments for python -m dflash_train.pipeline
#   PACK_MAX_MIB=60    cap on what is packed into $OUT (files back: <= 8, 16 MiB each, 64 MiB total)
#   DEVICE=            cuda (default when available) or cpu
#
# Inputs looked up under training/gpu_in/*/ (carried, git-ignored) and $STAGE:
#   <model>.gguf.part-a?  + <model>.gguf.sha256   split target (see stage_inputs.sh)
#   train_prompts.jsonl.gz
#   regen/regen_*.npz     regenerated data returned by earlier calls (used and skipped)
#   ckpt/                 a checkpoint returned by an earlier call (resumed if WORK has none)
#
# Returned in $OUT: summary.json, pipeline_log.txt and bundle.tgz.part-?? (<= 15 MiB each):
#   cat bundle.tgz.part-* | tar xz   ->  ckpt/drafter (the export), ckpt/optim,
#   ckpt/trainer_state.json, train_log.txt, train_log.jsonl, regen/ (new shards only)
set -uo pipefail
T0=$(date +%s)
MODE="${1:-all}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
TR="$REPO/training"
# both live in git-ignored paths of the checkout, which the device keeps between
# calls on a warm machine
STAGE="${STAGE:-$TR/gpu_in/_stage}"
WORK="${WORK:-$TR/runs/gpu}"
OUTDIR="${OUT:-$WORK/out}"
TOTAL_S="${TOTAL_S:-540}"
REGEN_S="${REGEN_S:-240}"
PACK_MAX_MIB="${PACK_MAX_MIB:-60}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
mkdir -p "$STAGE/parts" "$WORK" "$OUTDIR"
log() { echo "[run_gpu $(( $(date +%s) - T0 ))s] $*"; }

# ---------------------------------------------------------------- stage carried inputs
shopt -s nullglob
for d in "$TR"/gpu_in/*/; do
  [ "$(basename "$d")" = "_stage" ] && continue
  for f in "$d"*.part-* "$d"*.sha256; do cp -n "$f" "$STAGE/parts/"; done
  [ -f "$d/train_prompts.jsonl.gz" ] && cp -n "$d/train_prompts.jsonl.gz" "$STAGE/"
done
assemble() {
  for sha in "$STAGE"/parts/*.sha256; do
    name="$(basename "$sha" .sha256)"
    [ -f "$STAGE/$name" ] && continue
    parts=("$STAGE/parts/$name".part-*)
    [ ${#parts[@]} -gt 0 ] || continue
    cat "${parts[@]}" > "$STAGE/$name.tmp"
    if [ "$(sha256sum "$STAGE/$name.tmp" | awk '{print $1}')" = "$(cat "$sha")" ]; then
      mv "$STAGE/$name.tmp" "$STAGE/$name"; log "assembled $STAGE/$name"
    else
      rm -f "$STAGE/$name.tmp"; log "parts of $name incomplete (checksum differs) - carry the other half"
    fi
  done
}
assemble
if [ "$MODE" = "stage" ]; then
  ls -la "$STAGE" "$STAGE/parts"; log "staged"; exit 0
fi

# ---------------------------------------------------------------- wheels (gguf)
if compgen -G "$REPO/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$REPO"/.whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$TR:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- resolve inputs
if [ -z "${TARGET:-}" ]; then
  for f in "$STAGE"/*.gguf; do TARGET="$f"; break; done
fi
if [ -z "${TARGET:-}" ] || [ ! -e "$TARGET" ]; then log "no target model (carry the parts, see stage_inputs.sh)"; exit 2; fi
PROMPTS="${PROMPTS:-$STAGE/train_prompts.jsonl.gz}"
DATA_DIRS=()
for d in "$TR"/gpu_in/[!_]*/regen; do DATA_DIRS+=("$d"); done
if [ ! -f "$WORK/ckpt/drafter/config.json" ]; then
  for d in "$TR"/gpu_in/[!_]*/ckpt; do
    [ -f "$d/drafter/config.json" ] && { cp -r "$d" "$WORK/ckpt"; log "resuming carried checkpoint $d"; break; }
  done
fi
touch "$WORK/.call_start"
sleep 1

case "$MODE" in
  all)   R="$REGEN_S"; NT="" ;;
  regen) R=100000; NT="--no-train" ;;
  train) R=0; NT="" ;;
  *) log "unknown mode $MODE"; exit 2 ;;
esac
PACK_RESERVE=25
BUDGET=$(( TOTAL_S - ( $(date +%s) - T0 ) - PACK_RESERVE ))
DEV_ARGS=()
[ -n "${DEVICE:-}" ] && DEV_ARGS=(--device "$DEVICE")
DD_ARGS=()
[ ${#DATA_DIRS[@]} -gt 0 ] && DD_ARGS=(--data-dirs "${DATA_DIRS[@]}")
log "mode=$MODE target=$TARGET budget=${BUDGET}s regen=${R}s work=$WORK"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# the guard kills python a little after its own deadline so packing always happens
( cd "$TR" && timeout -s INT -k 10 $(( BUDGET + 15 )) python3 -m dflash_train.pipeline \
    --target "$TARGET" --prompts "$PROMPTS" --out-dir "$WORK" --total-s "$BUDGET" --regen-s "$R" \
    $NT "${DD_ARGS[@]}" "${DEV_ARGS[@]}" $EXTRA_ARGS ) 2>&1 | grep -v -E "Converting and de-quantizing|Loading weights"
RC=${PIPESTATUS[0]}
log "pipeline exit code $RC"

# ---------------------------------------------------------------- pack results
cd "$WORK"
cp -f summary.json pipeline_log.txt "$OUTDIR"/ 2>/dev/null
ITEMS=()
for p in ckpt/drafter train_log.txt train_log.jsonl summary.json pipeline_log.txt; do [ -e "$p" ] && ITEMS+=("$p"); done
OPT=(); for p in ckpt/optim ckpt/trainer_state.json; do [ -e "$p" ] && OPT+=("$p"); done
NEW_REGEN=(); for f in regen/regen_*.npz; do [ "$f" -nt .call_start ] && NEW_REGEN+=("$f"); done
size_mib() { [ $# -eq 0 ] && { echo 0; return; }; du -cm "$@" 2>/dev/null | tail -1 | cut -f1; }
log "sizes before compression (MiB): export+logs $(size_mib "${ITEMS[@]}"), optimizer state $(size_mib "${OPT[@]}"), new regen shards $(size_mib "${NEW_REGEN[@]}") (${#NEW_REGEN[@]} files)"
TGZ="$WORK/.bundle.tgz"
pack() { tar -czf "$TGZ" "$@"; echo $(( $(stat -c %s "$TGZ") / 1048576 )); }
S=$(pack "${ITEMS[@]}" "${OPT[@]}" "${NEW_REGEN[@]}")
if [ "$S" -ge "$PACK_MAX_MIB" ]; then
  log "bundle ${S} MiB >= PACK_MAX_MIB=$PACK_MAX_MIB: leaving the optimizer moments out (weights-only resume)"
  OPT=(); [ -e ckpt/trainer_state.json ] && OPT=(ckpt/trainer_state.json)
  S=$(pack "${ITEMS[@]}" "${OPT[@]}" "${NEW_REGEN[@]}")
  if [ "$S" -ge "$PACK_MAX_MIB" ]; then
    log "still ${S} MiB: leaving the regenerated data out (it stays in $WORK on this machine)"
    NEW_REGEN=(); S=$(pack "${ITEMS[@]}" "${OPT[@]}")
  fi
fi
rm -f "$OUTDIR"/bundle.tgz.part-*
split -b 15M -a 2 "$TGZ" "$OUTDIR/bundle.tgz.part-" && rm -f "$TGZ"
log "bundle: ${S} MiB compressed (optimizer state: $([ ${#OPT[@]} -gt 1 ] && echo yes || echo no), new regen shards: ${#NEW_REGEN[@]})"
ls -la "$OUTDIR"
log "done (unpack: cat bundle.tgz.part-* | tar xz)"
exit $RC
