#!/usr/bin/env bash
# A/B of kernel-source variants on one GPU without a rebuild: one `dflash` binary, arms =
# its embedded kernels ("base") and each variant directory of .cu files, handed in through
# DFLASH_CUDA_KERNEL_DIR (the host still pastes its shared launch constants ahead of them,
# so a variant may change kernel code, not the parameter structs or constants).
#
#   bash tools/h200_kernel_ab.sh --pack DIR...   # here: builds dflash + synthetic_model of the
#                                                # working tree, copies each DIR's .cu files
#   run  carry [".gpu/kab"]  command "bash .gpu/kab/h200_kernel_ab.sh"
#
# A DIR starts as a copy of crates/runtime/kernels with one change (its name labels the arm).
# On the GPU machine: KAB_SHAPES ("smollm2-135m:q4_1 qwen3-4b:q4_0"), KAB_ROUNDS (3),
# KAB_TESTS (space-separated test binaries of the runtime, e.g. "cuda_ops cuda_fused": each
# runs once per variant with its kernels; needs `tools/gpu_check.sh --build` before --pack),
# KAB_TEST_VARIANTS (the variants KAB_TESTS runs with; default: every variant),
# KAB_MICRO (arguments of `cuda_microbench`, run for every arm before the benches, e.g.
# "--shapes qwen3-4b --formats q4_0 --only matmul --epi add --reps 20"; its table rows are
# printed). Other variables of the backend (DFLASH_CUDA_INT8_MMA=2, ...) apply to every arm.
# Each arm is `dflash bench --no-draft` (-p 512 -n 128 on the default shapes, -p 128 -n 64 on
# the 4B's; warm-up, median of 3), arms alternating within a round; one line per arm and round.
set -uo pipefail

if [ "${1:-}" = "--pack" ]; then
    set -e
    shift
    [ $# -gt 0 ] || { echo "usage: $0 --pack DIR..." >&2; exit 2; }
    cd "$(dirname "$0")/.."
    for d in "$@"; do
        ls "$d"/*.cu > /dev/null 2>&1 || { echo "$d: no .cu files" >&2; exit 2; }
    done
    cargo build --release -p dflash-cli --features cuda --bin dflash
    cargo build --release -p dflash-models --example synthetic_model
    cargo build --release -p dflash-runtime --features cuda --example cuda_microbench
    rm -rf .gpu/kab && mkdir -p .gpu/kab/bin
    cp target/release/dflash target/release/examples/synthetic_model \
        target/release/examples/cuda_microbench .gpu/kab/bin/
    for t in cuda_ops cuda_fused cuda_qwen35; do
        [ -x ".gpu/tests/$t" ] && cp ".gpu/tests/$t" .gpu/kab/bin/
    done
    strip .gpu/kab/bin/* 2> /dev/null || true
    tar -C .gpu/kab/bin -cJf .gpu/kab/bins.tar.xz . && rm -rf .gpu/kab/bin
    for d in "$@"; do
        mkdir -p ".gpu/kab/variants/$(basename "$d")"
        cp "$d"/*.cu ".gpu/kab/variants/$(basename "$d")/"
    done
    cp tools/h200_kernel_ab.sh tools/cuda_env.sh .gpu/kab/
    echo "binary $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + uncommitted changes'); variants: $*" \
        > .gpu/kab/builds.txt
    du -sh .gpu/kab
    exit 0
fi

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tools/cuda_env.sh
source "$here/cuda_env.sh"
W="$HOME/kab"
mkdir -p "$W"
cd "$W" || exit 1
tar -C "$W" -xJf "$here/bins.tar.xz"
export DFLASH_CACHE_DIR="$W/cache"
cat "$here/builds.txt"
variants=$(ls "$here/variants")
shapes="${KAB_SHAPES:-smollm2-135m:q4_1 qwen3-4b:q4_0}"
for s in $shapes; do
    [ -f "${s%%:*}.gguf" ] || ./synthetic_model --shape "${s%%:*}" --dtype "${s##*:}" \
        --out "${s%%:*}.gguf" > /dev/null 2>&1 || echo "synthetic_model ${s%%:*} failed"
done
for v in ${KAB_TEST_VARIANTS:-$variants}; do
    for t in ${KAB_TESTS:-}; do
        echo "== $t with $v's kernels"
        DFLASH_CUDA_KERNEL_DIR="$here/variants/$v" timeout 200 "./$t" --test-threads=1 2>&1 \
            | grep -E "^test .*FAILED|test result|panicked"
    done
done
if [ -n "${KAB_MICRO:-}" ]; then
    for a in base $variants; do
        dir=""
        [ "$a" = base ] || dir="$here/variants/$a"
        echo "== cuda_microbench $KAB_MICRO, $a"
        # shellcheck disable=SC2086
        DFLASH_CUDA_KERNEL_DIR="$dir" timeout 150 ./cuda_microbench $KAB_MICRO 2>&1 | grep -E "^\| [A-Z]|^#"
    done
fi
for s in $shapes; do
    m="${s%%:*}.gguf"
    case "$s" in qwen3-4b*) args="-p 128 -n 64" ;; *) args="-p 512 -n 128" ;; esac
    for r in $(seq "${KAB_ROUNDS:-3}"); do
        for a in base $variants; do
            dir=""
            [ "$a" = base ] || dir="$here/variants/$a"
            # shellcheck disable=SC2086
            DFLASH_CUDA_KERNEL_DIR="$dir" timeout 120 ./dflash bench -m "$m" --device cuda --no-draft \
                $args -r 3 > /dev/null 2> bench.err
            echo "${s%%:*} round $r $a: $(grep -E '\| tg|verify of|rror' bench.err | tr '\n' ' ')"
        done
    done
done
