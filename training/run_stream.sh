#!/usr/bin/env bash
# Generate-and-train driver for the GPU machine (streaming pipeline, see training/README.md).
#
#   bash run_stream.sh bench   # stage the carried model part(s); trainer step time by attention form
#                              # (bench_train; the fastest goes to $W/train_choice for later calls),
#                              # the CUDA flex test, generator benchmark (random-weight SmolLM2-shaped
#                              # target, bf16: HF generate vs fastgen's bucket and flex decode
#                              # attentions; summary in $OUT/bench_gen.json, the winner's --attn goes
#                              # to $W/gen_choice)
#   bash run_stream.sh run     # stage + assemble the target; once per machine: bf16/fp32 greedy
#                              # agreement beside the first shard (picks the dtype of later calls);
#                              # gen_data on GPU 0 and stream_train on the last GPU (both on GPU 0
#                              # with one GPU) until TOTAL_S; with AB_ARGS, or 2+ GPUs (or KD_AB=1) and
#                              # KD_ALPHA != 0, a second trainer shares GPU 0 (A/B; the best walk tau ships)
#   bash run_stream.sh eval    # dflash eval / bench of the best drafter (carried CUDA build)
#
# The script may live anywhere (the device call carries it); it finds dflash_train next to itself.
# Environment (defaults):
#   TOTAL_S=540         whole-call budget in seconds
#   IN=<dir>/..         where carried inputs live: */*.gguf[.xz].part-*, */*.sha256, */train_convs.jsonl.gz,
#                       */init_drafter.tar.xz (an exported drafter the trainer starts from),
#                       */eval/*.jsonl (evaluation prompts to keep out of the data), whl/*.whl (gguf),
#                       */dflash (a CUDA build, for mode eval) and */kcache.tar.xz (its kernels)
#   W=/root/dflash_work state kept between calls on a warm machine (stage, data, train)
#   GEN_DTYPE=          force the generator dtype (default: bf16 if its teacher-forced greedy
#                       agreement with fp32 is >= AGREE_MIN, else float32)
#   AGREE_MIN=0.99      (AGREE=0 skips the agreement check; then set GEN_DTYPE)
#   EVAL_SPECS / BENCH_BLOCKS  mode eval: "name file limit;..." prompt sets, blocks for dflash bench
#   EVAL_RUNS=          mode eval: the runs to evaluate ("train train_kd"; default: the best walk tau)
#   KD_AB=0             1: the distillation arm (KD_ALPHA) beside the plain trainer on a one-GPU machine
#   AB_ARGS=            a second trainer with these extra arguments beside the plain one, into
#                       train_ab (e.g. "--dflash2 --selector-rank 16": a DFlash2 drafter grown from
#                       the carried DFlash one); takes the place of the distillation arm
#   GEN_KV_GIB=         the generator's KV cache in GiB (default: from GPU 0's memory, see below)
#   GEN_ARGS= / TRAIN_ARGS=   extra arguments for gen_data / stream_train (after the bench call's
#                       choices; a carried */init_drafter.tar.xz export starts the trainer from it)
#   BENCH_ARGS= / TRAIN_BENCH_ARGS=   extra arguments for bench_gen throughput / bench_train (mode bench)
# Returned in $OUT: logs, summaries, the best export (bundle split in 15 MiB parts).
set -uo pipefail
T0=$(date +%s)
MODE="${1:-run}"
HERE="$(cd "$(dirname "$0")" && pwd)"
IN="${IN:-$(cd "$HERE/.." && pwd)}"
W="${W:-/root/dflash_work}"
OUTDIR="${OUT:-$W/out}"
TOTAL_S="${TOTAL_S:-540}"
AGREE_MIN="${AGREE_MIN:-0.99}"
mkdir -p "$W/stage" "$W/data" "$W/train" "$OUTDIR"
export PYTHONPATH="$HERE:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# wheels carried in $IN/whl (gguf: transformers needs it to read the target; not on the image)
if compgen -G "$IN/whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$IN"/whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[run_stream $(( $(date +%s) - T0 ))s] $*" | tee -a "$OUTDIR/driver.log"; }
left() { echo $(( TOTAL_S - ( $(date +%s) - T0 ) )); }

shopt -s nullglob
put() { [ -e "$2/$(basename "$1")" ] || cp "$1" "$2/"; }
for f in "$IN"/*/*.gguf.part-* "$IN"/*/*.gguf.xz.part-* "$IN"/*/*.sha256 "$IN"/*/train_convs.jsonl.gz; do put "$f" "$W/stage"; done
mkdir -p "$W/stage/eval"
for f in "$IN"/*/eval/*.jsonl; do put "$f" "$W/stage/eval"; done
for f in "$IN"/*/init_drafter.tar.xz; do [ -d "$W/init_drafter" ] || tar -C "$W" -xJf "$f"; done
for sha in "$W"/stage/*.sha256; do
  name="$(basename "$sha" .sha256)"
  [ -f "$W/stage/$name" ] && continue
  parts=("$W/stage/$name".part-*)
  cat "${parts[@]}" > "$W/stage/$name.tmp"
  if [ "$(sha256sum "$W/stage/$name.tmp" | awk '{print $1}')" = "$(cat "$sha")" ]; then
    mv "$W/stage/$name.tmp" "$W/stage/$name"; log "assembled $name"
    case "$name" in *.xz) xz -dk "$W/stage/$name" 2>/dev/null \
      || python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[1][:-3], 'wb'))" \
         "$W/stage/$name"; log "unpacked ${name%.xz}";; esac
  else
    rm -f "$W/stage/$name.tmp"; log "$name: parts incomplete (${#parts[@]} so far)"
  fi
done
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader | tee -a "$OUTDIR/driver.log"
log "mode $MODE, $NGPU GPU(s), torch $(python3 -c 'import torch; print(torch.__version__)')"

if [ "$MODE" = "eval" ]; then
  # engine measurements of the best drafter: `dflash eval` tau (MT-Bench, held-out prompts; T 0/1;
  # block 16/8) and `dflash bench` AR vs DFlash. Needs a CUDA build carried in $IN/*/dflash.
  BIN=("$IN"/*/dflash); BIN="${BIN[0]}"; chmod +x "$BIN"
  [ -f "$HERE/cuda_env.sh" ] && source "$HERE/cuda_env.sh"
  # Its kernels compiled at staging (tools/kernel_cache.sh), so the first eval does not wait
  # for NVRTC.
  export DFLASH_CACHE_DIR="${DFLASH_CACHE_DIR:-$W/cache}"
  KC=("$IN"/*/kcache.tar.xz)
  [ -f "${KC[0]}" ] && mkdir -p "$DFLASH_CACHE_DIR" && tar -C "$DFLASH_CACHE_DIR" -xJf "${KC[0]}"
  M=("$W"/stage/*.gguf); M="${M[0]}"
  for RUN in ${EVAL_RUNS:-$(cat "$W/best_run.txt" 2>/dev/null || echo train)}; do
  D="$W/$RUN/best"
  E="$W/engine_$RUN"; mkdir -p "$E"
  log "eval of $D with $BIN"
  IFS=';' read -ra SPECS <<< "${EVAL_SPECS:-mt-bench mt_bench_first_turns.jsonl 80;sharegpt-heldout sharegpt_heldout.jsonl 20}"
  for spec in "${SPECS[@]}"; do
    set -- $spec
    for T in ${EVAL_TEMPS:-0 1}; do for BS in ${EVAL_BLOCKS:-16 8}; do
      [ "$(left)" -lt 40 ] && { log "out of time"; break 3; }
      timeout $(( $(left) - 20 )) "$BIN" eval --prompts "$W/stage/eval/$2" --limit "$3" -m "$M" --device cuda \
        --draft "$D" --block-size "$BS" --temperature "$T" --seed 1 --max-tokens 256 --batch 4 \
        --output-format json > "$E/eval_$1_T${T}_B${BS}.json" 2> "$E/eval_$1_T${T}_B${BS}.err"
      log "eval $RUN $1 T=$T B=$BS rc $?: $(python3 -c "import json,sys; d=json.load(open('$E/eval_$1_T${T}_B${BS}.json')); print({k: d.get(k) for k in ('tau', 'tokens', 'rounds')})" 2>&1 | tail -1)"
    done; done
  done
  # AR vs DFlash (the command times both arms) for the new drafter and, when carried, the one it
  # started from (once), at each of BENCH_BLOCKS
  for DD in "$D" "$W/init_drafter"; do for BS in ${BENCH_BLOCKS:-16}; do
    [ -f "$DD/config.json" ] || continue
    [ -e "$W/engine_init_B$BS" ] && [ "$DD" = "$W/init_drafter" ] && continue
    [ "$(left)" -lt 30 ] && break 2
    echo "== $DD block $BS" >> "$E/bench.txt"
    timeout $(( $(left) - 10 )) "$BIN" bench -m "$M" --device cuda --draft "$DD" --block-size "$BS" -n 128 -r 3 \
      > "$E/bench_$(basename "$DD")_B$BS.txt" 2>&1
    [ "$DD" = "$W/init_drafter" ] && touch "$W/engine_init_B$BS"
    grep -E "^\| (AR|.*tg128)" "$E/bench_$(basename "$DD")_B$BS.txt" | tee -a "$E/bench.txt"
  done; done
  tar -czf "$OUTDIR/engine_$RUN.tgz" -C "$W" "engine_$RUN"
  done
  log "eval done"; exit 0
fi

if [ "$MODE" = "bench" ]; then
  # trainer: step time by attention form; the fastest form's arguments go to $W/train_choice
  # (read by later run calls on this machine); the flex == dense gradient test on CUDA
  timeout "${TRAIN_BENCH_S:-150}" python3 -m dflash_train.bench_train --json "$OUTDIR/bench_train.json" \
    --choice-file "$W/train_choice" --profile "$OUTDIR/bench_train_profile.txt" ${TRAIN_BENCH_ARGS:-} 2>&1 \
    | grep -v "it/s]" | tee "$OUTDIR/bench_train.log"
  log "trainer choice: $(cat "$W/train_choice" 2>/dev/null)"
  ( cd "$HERE" && timeout "${FLEX_TEST_S:-90}" python3 -m pytest -q -rs -p no:cacheprovider "$HERE/tests/test_flexattn_torch.py" ) \
    2>&1 | tail -n 5 | tee "$OUTDIR/flex_test.log"
  # generator: flex decode attention only where it is faster and its graphs replay == eager
  if [ "${GEN_BENCH:-1}" = 1 ]; then
    timeout $(( $(left) - 10 )) python3 -m dflash_train.bench_gen throughput --json "$OUTDIR/bench_gen.json" ${BENCH_ARGS:-} 2>&1 \
      | grep -v "it/s]" | tee "$OUTDIR/bench_gen.log"
    python3 - "$OUTDIR/bench_gen.json" > "$W/gen_choice" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["bfloat16"]
ok = r["checks"].get("flex_graphs_equal_eager", {}).get("all_identical") and not any("flex" in k for k in r["errors"])
print("--attn flex" if ok and r.get("steady_faster") == "flex" else "--attn bucket")
PY
    log "generator choice: $(cat "$W/gen_choice" 2>/dev/null)"
  fi
  log "bench done"; exit 0
fi

TARGET=("$W"/stage/*.gguf)
[ ${#TARGET[@]} -gt 0 ] || { log "no assembled target: carry both model parts"; exit 2; }
TARGET="${TARGET[0]}"
CONVS="$W/stage/train_convs.jsonl.gz"
EVALS=("$W"/stage/eval/*.jsonl)

# bf16/fp32 greedy agreement, once per machine, on the training GPU while the first shard is made
# (the first call generates in fp32; later calls use bf16 when the agreement is >= AGREE_MIN)
AGREE_PID=
if [ "${AGREE:-1}" = 1 ] && [ ! -f "$W/agree.json" ]; then
  ( CUDA_VISIBLE_DEVICES=$(( NGPU - 1 )) timeout 200 python3 -m dflash_train.bench_gen agree --target "$TARGET" \
      --convs "$CONVS" --n 100 --n-hf 8 2>&1 | grep -v "it/s]" > "$OUTDIR/agree.log"; \
    tail -1 "$OUTDIR/agree.log" | python3 -c "import json, sys; json.loads(sys.stdin.read())" 2>/dev/null \
      && tail -1 "$OUTDIR/agree.log" > "$W/agree.json" ) &
  AGREE_PID=$!
fi
if [ -z "${GEN_DTYPE:-}" ]; then
  GEN_DTYPE=$(python3 -c "
import json
try: a = json.load(open('$W/agree.json'))['bf16_teacher_forced_argmax_agreement']
except Exception: a = 0
print('bfloat16' if a >= $AGREE_MIN else 'float32')")
fi
log "generator dtype $GEN_DTYPE"

# measured choices of the bench call on this machine, and a carried drafter to start from
[ -f "$W/train_choice" ] && TRAIN_ARGS="$(cat "$W/train_choice") ${TRAIN_ARGS:-}"
[ -f "$W/gen_choice" ] && GEN_ARGS="$(cat "$W/gen_choice") ${GEN_ARGS:-}"
[ -f "$W/init_drafter/config.json" ] && TRAIN_ARGS="--init-drafter $W/init_drafter ${TRAIN_ARGS:-}"
log "trainer args: ${TRAIN_ARGS:-}; generator args: ${GEN_ARGS:-}"
TGPU=$(( NGPU > 1 ? NGPU - 1 : 0 ))
BUDGET=$(( $(left) - 45 ))
# A/B: a second trainer beside the plain one, sharing GPU 0 with the generator: the arms of AB_ARGS
# (into train_ab), else with two GPUs (or KD_AB=1) distillation (KD_ALPHA, into train_kd)
KD_ALPHA="${KD_ALPHA:-0.5}"
AB_PID=; AB_DIR=; AB_EXTRA=
if [ -n "${AB_ARGS:-}" ]; then
  AB_DIR=train_ab; AB_EXTRA="$AB_ARGS"
elif { [ "$NGPU" -gt 1 ] || [ "${KD_AB:-0}" = 1 ]; } && [ "$KD_ALPHA" != "0" ]; then
  AB_DIR=train_kd; AB_EXTRA="--kd-alpha $KD_ALPHA"
fi
# the generator's KV cache (GiB): GPU 0's memory less ~12 GiB for each trainer beside it (flex +
# compile at batch 8 peaks at 8-12) and 8 for the generator's weights, logits and buffers; at most
# 56 beside a trainer and 80 alone (an H200: 56 / 80; an 80 GB H100 with two trainers: 47)
BESIDE=$(( (NGPU > 1 ? 0 : 1) + (${#AB_DIR} > 0 ? 1 : 0) ))
GPU0_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | awk '{print int($1 / 1024)}')
KV=$(( GPU0_GIB - 12 * BESIDE - 8 )); CAP=$(( BESIDE > 0 ? 56 : 80 ))
[ "$KV" -gt "$CAP" ] && KV=$CAP
# --int8-act keeps a rounded copy of each projection's input: a prefill beside a trainer on an
# 80 GB H100 ran out of memory twice with the plain figure, so 4 GiB more stay free for it
case " ${GEN_ARGS:-} " in *" --int8-act "*) KV=$(( KV - 4 ));; esac
KV="${GEN_KV_GIB:-$KV}"
log "generator KV cache $KV GiB (GPU 0: $GPU0_GIB GiB, $BESIDE trainer(s) beside it)"
if [ -n "$AB_DIR" ]; then
  mkdir -p "$W/$AB_DIR"
  # shellcheck disable=SC2086
  ( python3 -m dflash_train.stream_train --target "$TARGET" --data-dir "$W/data" --work "$W/$AB_DIR" \
      --time-limit-s "$BUDGET" --device cuda:0 --log-every 50 ${TRAIN_ARGS:-} $AB_EXTRA 2>&1 \
      | grep -v "it/s]" > "$W/${AB_DIR}_stdout.log" ) &
  AB_PID=$!
fi
( python3 -m dflash_train.gen_data --target "$TARGET" --convs "$CONVS" --eval "${EVALS[@]}" \
    --out-dir "$W/data" --time-limit-s $(( BUDGET - 40 )) --dtype "$GEN_DTYPE" --device cuda:0 \
    --kv-gib "$KV" --slice-size 256 --max-inflight-slices 16 ${GEN_ARGS:-} 2>&1 | grep -v "it/s]" > "$W/gen_stdout.log" ) &
GEN_PID=$!
python3 -m dflash_train.stream_train --target "$TARGET" --data-dir "$W/data" --work "$W/train" \
    --time-limit-s "$BUDGET" --device "cuda:$TGPU" --log-every 50 ${TRAIN_ARGS:-} 2>&1 | grep -v "it/s]" > "$W/train_stdout.log"
log "trainer exit ${PIPESTATUS[0]}"
grep -v "^step " "$W/train_stdout.log" | tail -n 40; grep "^step " "$W/train_stdout.log" | awk 'NR % 10 == 0' | tail -n 30
wait $GEN_PID
log "generator exit $?"
[ -n "$AGREE_PID" ] && wait $AGREE_PID
cp -f "$W/agree.json" "$W/train/" 2>/dev/null
if [ -n "$AB_PID" ]; then
  wait $AB_PID
  log "second trainer ($AB_DIR: $AB_EXTRA): $(grep -h "end of call" "$W/$AB_DIR/train_log.txt" | tail -1)"
  grep -v "^step " "$W/${AB_DIR}_stdout.log" | tail -n 20
fi

# ---------------------------------------------------------------- results
cd "$W"
cp data/gen_log.txt "$OUTDIR/gen.log" 2>/dev/null
SAMPLE=$(ls -S data/conv_*.npz 2>/dev/null | grep -v _part | tail -n 2 | head -n 1)
# the best export over both runs (walk tau), both runs' logs
BEST=$(python3 -c "
import json, os
b = [(json.load(open(f'$W/{d}/best.json')).get('walk_tau', 0), d) for d in ('train', 'train_kd', 'train_ab')
     if os.path.exists(f'$W/{d}/best.json')]
print(max(b)[1] if b else 'train')")
log "best walk tau: $BEST"
echo "$BEST" > "$W/best_run.txt"
LOGS=(); for d in train train_kd train_ab; do for f in $d/train_log.txt $d/train_log.jsonl $d/summary_call*.json $d/best.json; do [ -e "$f" ] && LOGS+=("$f"); done; done
tar -czf "$W/bundle.tgz" "${LOGS[@]}" "$BEST/best" best_run.txt agree.json gen_stdout.log ${SAMPLE:+$SAMPLE} data/state.json 2>/dev/null
rm -f "$OUTDIR"/bundle.tgz.part-*
split -b 15M -a 2 "$W/bundle.tgz" "$OUTDIR/bundle.tgz.part-"
du -sh data; ls data | wc -l
log "packed $(du -h "$W/bundle.tgz" | cut -f1) (unpack: cat bundle.tgz.part-* | tar xz)"
