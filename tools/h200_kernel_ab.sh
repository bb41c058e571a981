#!/usr/bin/env bash
# A/B of kernel-source variants on one GPU without a rebuild: one `dflash` binary, arms =
# its embedded kernels ("base") and each variant directory of .cu files, handed in through
# DFLASH_CUDA_KERNEL_DIR (the host still pastes its shared launch constants ahead of them,
# so a variant may change kernel code, not the parameter structs or constants).
#
#   bash tools/h200_kernel_ab.sh --pack [DIR...]  # here: builds dflash + synthetic_model of the
#                                                 # working tree, copies each DIR's .cu files
#   run  carry [".gpu/kab"]  command "bash .gpu/kab/h200_kernel_ab.sh"
#
# A DIR starts as a copy of crates/runtime/kernels with one change (its name labels the arm).
# On the GPU machine: KAB_SHAPES ("smollm2-135m:q4_1 qwen3-4b:q4_0"; NAME:DTYPE[:HEAD_DTYPE]
# of synthetic_model), KAB_ROUNDS (3),
# KAB_TESTS (space-separated test binaries of the runtime, e.g. "cuda_ops cuda_fused": each
# runs once per variant with its kernels; needs `tools/gpu_check.sh --build` before --pack),
# KAB_TEST_VARIANTS (the arms KAB_TESTS and KAB_MEMCHECK run with, "base" naming the binary's
# own kernels; default: every variant),
# KAB_MICRO (arguments of `cuda_microbench`, run for every arm before the benches, e.g.
# "--shapes qwen3-4b --formats q4_0 --only matmul --epi add --reps 20"; its table rows are
# printed), KAB_MEMCHECK (test binaries run under compute-sanitizer memcheck with each
# variant's kernels, their long sweeps skipped), KAB_PARITY=1 (after the benches, per arm:
# `gpu_parity` on a synthetic target of the published default model's layout (Q4_1, Q8_0
# head) with a random drafter of the
# shipped one's shape, so every round verifies a full block: CPU vs GPU greedy, B = 4 vs
# B = 1, DFlash block 16 B = 1 and B = 4 vs plain; the lossless check of a kernel variant
# without carrying the real model). Other variables of the backend (DFLASH_CUDA_INT8_MMA=2,
# ...) apply to every arm.
# KAB_NCU ("NCU ARGS;MICROBENCH ARGS", e.g. "--kernel-name regex:attention_split_4_4 --launch-skip 10
# --launch-count 1;--shapes qwen3-4b --only attention": the verify block's kernel at 128 keys): per
# arm, after the microbench, ncu (speed of light, launch, occupancy, warp state and memory
# sections) on that launch of cuda_microbench; the report goes to $OUT/ncu_<arm>.txt and its
# duration, registers, occupancy, issue and stall lines are printed.
# KAB_ROUND_NCU ("4 16": draft blocks): per arm of the `dflash` binary, at the end, every kernel
# of `dflash generate` DFlash rounds (--speculation always, 32 tokens) on that synthetic target
# with the random drafter, timed alone by ncu and tabled by `ncu_kernel_table.py --rounds` (the
# draft part — context write, draft forward, choice — against the verify part), preceded by
# `dflash bench --draft` (host ms per round); where a round's GPU time goes without the model.
# KAB_ENV_ARMS ("NAME:VAR=VALUE[,VAR=VALUE...] ..."): arms that run the binary's own kernels with
# those environment variables (e.g. "nox2:DFLASH_CUDA_FLOAT_MMA=0"), in the microbench, the
# benches and the parity runs; KAB_TEST_VARIANTS may name them too.
# KAB_ARMS ("base off ..."): only these arms run the microbench, the benches, the parity runs and
# the round profile (default: every arm), so one pack can be measured over several calls.
# At --pack the build's and each variant's kernels are compiled here for sm_90 with NVRTC
# (tools/kernel_cache.sh) and carried as a kernel cache (kcache.tar.xz, ~2 MB), which the GPU
# machine unpacks before anything runs. Each variant's ptxas report
# (registers, spills, stack, shared memory per kernel; the cuda_kernel_resources example) is
# compared with the embedded kernels': the rows that differ are printed.
# KAB_BASELINE=PATH at --pack: a `dflash` binary of another build (e.g. main's, before a change
# of host code) joins the benches as arm "baseline" with its own embedded kernels;
# KAB_BASELINE_MICRO=PATH at --pack: that build's `cuda_microbench`, which then joins KAB_MICRO
# as arm "baseline" (a change of host constants, e.g. ATT_MAX_SPLITS, A/B'd in one call).
# Each arm is `dflash bench --no-draft` (-p 512 -n 128 on the default shapes, -p 128 -n 64 on
# the 4B's; KAB_DEPTHS ("128 512 4000") sets the prompt lengths for every shape instead, and
# KAB_BLOCKS ("16 4": the verify sizes, --block-size; 16 by default); warm-up, median of 3), arms
# alternating within a round (in order in odd rounds, reversed in even ones); one line per arm,
# prompt length, verify size and round. Before
# its first timed run on a model, each arm runs once untimed (`dflash bench -p 16 -n 4 -r 1`,
# limit 400 s), so that NVRTC's first compile of its kernels does not eat a timed run's limit.
# Everything printed also goes to $OUT/kab.log (the device tool returns only the output's end).
set -uo pipefail

if [ "${1:-}" = "--pack" ]; then
    set -e
    shift
    cd "$(dirname "$0")/.."
    for d in "$@"; do
        ls "$d"/*.cu > /dev/null 2>&1 || { echo "$d: no .cu files" >&2; exit 2; }
    done
    cargo build --release -p dflash-cli --features cuda --bin dflash
    cargo build --release -p dflash-models --example synthetic_model
    cargo build --release -p dflash-runtime --features cuda --example cuda_microbench
    cargo build --release -p dflash-cli --features cuda --example gpu_parity
    cargo build --release -p dflash-models --example random_drafter
    rm -rf .gpu/kab && mkdir -p .gpu/kab/bin .gpu/kab/parity .gpu/kab/variants
    cp target/release/dflash target/release/examples/synthetic_model \
        target/release/examples/cuda_microbench target/release/examples/gpu_parity \
        target/release/examples/random_drafter .gpu/kab/bin/
    cp models/drafters/smollm2-135m-instruct-dflash/config.json .gpu/kab/parity/
    cp data/mt_bench_first_turns.jsonl .gpu/kab/parity/prompts.jsonl
    for t in cuda_ops cuda_fused cuda_qwen35; do
        [ -x ".gpu/tests/$t" ] && cp ".gpu/tests/$t" .gpu/kab/bin/
    done
    if [ -n "${KAB_BASELINE:-}" ]; then
        mkdir -p .gpu/kab/bin/baseline && cp "$KAB_BASELINE" .gpu/kab/bin/baseline/dflash
    fi
    if [ -n "${KAB_BASELINE_MICRO:-}" ]; then
        mkdir -p .gpu/kab/bin/baseline && cp "$KAB_BASELINE_MICRO" .gpu/kab/bin/baseline/cuda_microbench
    fi
    strip .gpu/kab/bin/* .gpu/kab/bin/baseline/* 2> /dev/null || true
    tar -C .gpu/kab/bin -cJf .gpu/kab/bins.tar.xz . && rm -rf .gpu/kab/bin
    for d in "$@"; do
        mkdir -p ".gpu/kab/variants/$(basename "$d")"
        cp "$d"/*.cu ".gpu/kab/variants/$(basename "$d")/"
    done
    cp tools/h200_kernel_ab.sh tools/cuda_env.sh tools/ncu_kernel_table.py .gpu/kab/
    # The kernels of this build (and of each variant) compiled here for sm_90, so that the GPU
    # machine finds them in its cache instead of spending its first minutes in NVRTC.
    bash tools/kernel_cache.sh .gpu/kab/kcache.tar.xz "$@"
    # shellcheck source=tools/cuda_env.sh
    source tools/cuda_env.sh
    # Each variant's kernels against the embedded ones, as ptxas reports them (registers,
    # spills, stack, shared memory): the rows that differ, here, before any device time.
    cargo build --release -p dflash-runtime --features cuda --example cuda_kernel_resources
    for d in "$@"; do
        v=$(basename "$d")
        mods=$(for f in "$d"/*.cu; do
            case "$(basename "$f" .cu)" in
                attention) echo attention ;; gdn) echo gdn ;; ops) echo ops ;; sample) echo sample ;;
                matmul*) echo matmul ;; *) echo ALL ;;  # common.cu: every module
            esac
        done | sort -u)
        for m in $mods; do
            mf=$m && [ "$m" = ALL ] && mf=""
            target/release/examples/cuda_kernel_resources --module "$mf" > ".gpu/kab/res_base_$m.md" \
                && DFLASH_CUDA_KERNEL_DIR="$d" target/release/examples/cuda_kernel_resources --module "$mf" \
                    > ".gpu/kab/res_${v}_$m.md" 2> /dev/null \
                || { echo "$v: no resource report for $m (NVRTC missing or the variant does not compile)"; continue; }
            echo "$v against the embedded kernels ($m; registers | spills st / ld | stack | shared):"
            { diff ".gpu/kab/res_base_$m.md" ".gpu/kab/res_${v}_$m.md" || true; } | grep '^[<>]' \
                || echo "  no kernel changed"
        done
        rm -f .gpu/kab/res_*.md
    done
    echo "binary $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + uncommitted changes'); variants: $*${KAB_BASELINE:+; baseline binary: $KAB_BASELINE}${KAB_BASELINE_MICRO:+; baseline microbench: $KAB_BASELINE_MICRO}" \
        > .gpu/kab/builds.txt
    du -sh .gpu/kab
    exit 0
fi

here=$(cd "$(dirname "$0")" && pwd)
out="${OUT:-/tmp/kab_out}"
mkdir -p "$out"
exec > >(tee -a "$out/kab.log") 2>&1
# shellcheck source=tools/cuda_env.sh
source "$here/cuda_env.sh"
W="$HOME/kab"
mkdir -p "$W"
cd "$W" || exit 1
rm -rf "$W/baseline"  # a warm machine keeps the last pack's files
tar -C "$W" -xJf "$here/bins.tar.xz"
export DFLASH_CACHE_DIR="$W/cache"
# Kernels compiled at --pack (same NVRTC major.minor: the cache key holds it, so a mismatch is
# only a miss).
[ -f "$here/kcache.tar.xz" ] && mkdir -p "$W/cache" && tar -C "$W/cache" -xJf "$here/kcache.tar.xz"
cat "$here/builds.txt"
variants=$(ls "$here/variants")
shapes="${KAB_SHAPES:-smollm2-135m:q4_1 qwen3-4b:q4_0}"
# A shape is NAME:DTYPE[:HEAD_DTYPE] (smollm2-135m:q4_1:q8_0 is the published model's layout);
# its model file is named after all of it.
model_of() { echo "$(echo "$1" | tr : _).gguf"; }
for s in $shapes; do
    IFS=: read -r name dtype head <<< "$s"
    [ -f "$(model_of "$s")" ] || ./synthetic_model --shape "$name" --dtype "$dtype" \
        ${head:+--head-dtype "$head"} --out "$(model_of "$s")" > /dev/null 2>&1 \
        || echo "synthetic_model $s failed"
done
# The environment assignments of arm $1 when it is one of KAB_ENV_ARMS (none otherwise).
envof() {
    local e
    for e in ${KAB_ENV_ARMS:-}; do
        [ "${e%%:*}" = "$1" ] && echo "${e#*:}" | tr , ' '
    done
    return 0
}
envarms=""
for e in ${KAB_ENV_ARMS:-}; do envarms="$envarms ${e%%:*}"; done
# The kernel directory of arm $1 (empty for "base" and the environment arms: the binary's
# embedded kernels).
kdir() { [ "$1" = base ] || [ -n "$(envof "$1")" ] || echo "$here/variants/$1"; }
# The arms of list $1 that KAB_ARMS names (all of them when it is unset), in list order.
only() {
    local a keep=""
    for a in $1; do
        case " ${KAB_ARMS:-$1} " in *" $a "*) keep="$keep $a" ;; esac
    done
    echo "${keep# }"
}
# The arms that run program $1 (dflash, cuda_microbench): "baseline" first when its build
# was packed.
arms_of() {
    local a="base $variants $envarms"
    [ -x "baseline/$1" ] && a="baseline $a"
    only "$a"
}
# Sets `bin` (program $2 of arm $1's build) and `dir` (arm $1's kernel directory).
arm_bin() {
    dir="" bin="./$2"
    case "$1" in baseline) bin="baseline/$2" ;; *) dir="$(kdir "$1")" ;; esac
}
for v in ${KAB_TEST_VARIANTS:-$variants}; do
    for t in ${KAB_TESTS:-}; do
        echo "== $t with $v's kernels"
        # shellcheck disable=SC2046
        env $(envof "$v") DFLASH_CUDA_KERNEL_DIR="$(kdir "$v")" timeout 200 "./$t" --test-threads=1 2>&1 \
            | grep -E "^test .*FAILED|test result|panicked"
    done
done
if [ -n "${KAB_MICRO:-}" ]; then
    arms=$(arms_of cuda_microbench)
    for a in $arms; do
        arm_bin "$a" cuda_microbench
        echo "== cuda_microbench $KAB_MICRO, $a"
        # shellcheck disable=SC2086,SC2046
        env $(envof "$a") DFLASH_CUDA_KERNEL_DIR="$dir" timeout 150 "$bin" $KAB_MICRO 2>&1 \
            | grep -E "^\| [A-Za-z0-9]|^#"
    done
fi
if [ -n "${KAB_NCU:-}" ] && command -v ncu > /dev/null; then
    nargs="${KAB_NCU%%;*}" margs="${KAB_NCU#*;}"
    arms=$(arms_of cuda_microbench)
    for a in $arms; do
        arm_bin "$a" cuda_microbench
        echo "== ncu $nargs ($margs), $a"
        # shellcheck disable=SC2086,SC2046
        env $(envof "$a") DFLASH_CUDA_KERNEL_DIR="$dir" timeout 200 ncu --clock-control none \
            --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
            --section MemoryWorkloadAnalysis $nargs "$bin" $margs > "$out/ncu_$a.txt" 2>&1
        grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|L1/TEX Hit|Memory Throughput|Stall" \
            "$out/ncu_$a.txt" | head -24
    done
fi
# Runs arm $1's dflash once on model $2 (more `dflash bench` arguments after it), untimed and
# with a long limit: NVRTC compiles a build's kernels for a format at first use, up to ~140 s
# on a fresh machine, which is past the limits of the timed runs below.
warm() {
    local a="$1" m="$2"
    shift 2
    arm_bin "$a" dflash
    # shellcheck disable=SC2046
    env $(envof "$a") DFLASH_CUDA_KERNEL_DIR="$dir" timeout 400 "$bin" bench -m "$m" --device cuda \
        -p 16 -n 4 -r 1 "$@" > /dev/null 2>&1 || echo "warm-up of $a on $m failed"
}
for s in $shapes; do
    m="$(model_of "$s")"
    case "$s" in qwen3-4b*) n=64 depths="${KAB_DEPTHS:-128}" ;; *) n=128 depths="${KAB_DEPTHS:-512}" ;; esac
    arms=$(arms_of dflash)
    for a in $arms; do warm "$a" "$m" --no-draft; done
    for r in $(seq "${KAB_ROUNDS:-3}"); do
        for p in $depths; do
            for b in ${KAB_BLOCKS:-16}; do
                # Odd rounds run the arms in order, even rounds in reverse, so that neither arm
                # always runs first after the other's heat and cache state.
                order=$arms
                [ $((r % 2)) = 0 ] && order=$(echo "$arms" | tr ' ' '\n' | tac | tr '\n' ' ')
                for a in $order; do
                    arm_bin "$a" dflash
                    # shellcheck disable=SC2086,SC2046
                    env $(envof "$a") DFLASH_CUDA_KERNEL_DIR="$dir" timeout 120 "$bin" bench -m "$m" --device cuda \
                        --no-draft -p "$p" -n "$n" --block-size "$b" -r 3 > /dev/null 2> bench.err
                    echo "$s p$p b$b round $r $a: $(grep -E '\| tg|verify of|rror' bench.err | tr '\n' ' ' \
                        | sed -E 's/\| synthetic \| [^|]*\| //; s/\(forward \+ greedy choice\) //')"
                done
            done
        done
    done
done
for v in ${KAB_TEST_VARIANTS:-$variants}; do
    for t in ${KAB_MEMCHECK:-}; do
        echo "== memcheck: $t with $v's kernels"
        # shellcheck disable=SC2046
        env $(envof "$v") DFLASH_CUDA_KERNEL_DIR="$(kdir "$v")" timeout 200 compute-sanitizer --tool memcheck \
            --error-exitcode 99 --print-limit 10 "./$t" --test-threads=1 --skip attention_long_context \
            --skip matmul_every_dtype --skip every_m_from_1 --skip cublas \
            --skip tensor_core_prefill_matches 2>&1 | grep -E "ERROR SUMMARY|test result|Invalid" | head -5
    done
done
# The published default model's layout (Q4_1, Q8_0 head) and a random drafter of the shipped one's
# shape, for the parity runs and the round profile.
parity_pair() {
    pm="$(model_of smollm2-135m:q4_1:q8_0)"
    [ -f "$pm" ] || ./synthetic_model --shape smollm2-135m --dtype q4_1 --head-dtype q8_0 \
        --out "$pm" > /dev/null
    [ -d drafter ] || ./random_drafter "$here/parity" drafter 7 > /dev/null
}
if [ "${KAB_PARITY:-0}" = 1 ]; then
    parity_pair
    for a in $(only "base $variants $envarms"); do
        warm "$a" "$pm" --draft drafter
        dir="$(kdir "$a")"
        # shellcheck disable=SC2046
        env $(envof "$a") DFLASH_CUDA_KERNEL_DIR="$dir" timeout 200 ./gpu_parity --model "$pm" --draft drafter \
            --prompts "$here/parity/prompts.jsonl" --count 24 --max-tokens 64 > "parity_$a.log" 2>&1
        echo "== parity $a (exit $?): $(grep -vE '^prompt [0-9]+:' "parity_$a.log" | tail -n 7 | tr '\n' ' ')"
    done
fi
if [ -n "${KAB_ROUND_NCU:-}" ] && command -v ncu > /dev/null; then
    parity_pair
    for a in $(arms_of dflash); do
        warm "$a" "$pm" --draft drafter
        arm_bin "$a" dflash
        for bs in $KAB_ROUND_NCU; do
            # shellcheck disable=SC2046
            env $(envof "$a") DFLASH_CUDA_KERNEL_DIR="$dir" timeout 120 "$bin" bench -m "$pm" --device cuda \
                --draft drafter --block-size "$bs" -n 128 -r 3 > /dev/null 2> bench.err
            echo "== DFlash rounds at block $bs, $a: $(grep -E '^\| AR' bench.err)"
            # shellcheck disable=SC2046
            env $(envof "$a") DFLASH_CUDA_KERNEL_DIR="$dir" timeout 200 ncu --clock-control none \
                --metrics gpu__time_duration.sum --csv "$bin" generate -m "$pm" --device cuda --draft drafter \
                --block-size "$bs" --speculation always -n 32 "Explain how a rainbow forms, step by step." \
                2> "$out/ncu_rounds_${a}_b$bs.err" > "$out/ncu_rounds_${a}_b$bs.csv"
            python3 "$here/ncu_kernel_table.py" --rounds < "$out/ncu_rounds_${a}_b$bs.csv"
        done
    done
fi
