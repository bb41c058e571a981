#!/usr/bin/env bash
# A/B of two builds of the CUDA backend on one GPU, in one device call, without the 98 MB default
# model: the candidate's CUDA tests (plain, then memcheck on the fast ones), then `dflash bench`
# of the baseline and the candidate alternating on random-weight targets of the default model's
# and Qwen3-4B's shapes, and the matmul microbench of both.
#
#   bash tools/h200_ab.sh --pack BASE_REV      # here: builds BASE_REV and the working tree
#   run  carry [".gpu/ab"]  command "bash .gpu/ab/h200_ab.sh"
#
# --pack builds `dflash`, `synthetic_model`, `cuda_microbench` and the runtime's CUDA tests of the
# working tree, and `dflash` + `cuda_microbench` of BASE_REV (in a temporary worktree), into
# .gpu/ab (about 10 MB). On the GPU machine: AB_ROUNDS (3) rounds per shape, AB_INT8 (the
# DFLASH_CUDA_INT8 of both arms; unset: each build's default), AB_SHAPES ("smollm2-135m:q4_1
# qwen3-4b:q4_0") and AB_TESTS (1; 0 skips the tests and the microbench: a second
# pass in the same call).
# Results go to $OUT.
set -uo pipefail

if [ "${1:-}" = "--pack" ]; then
    set -e
    base="${2:?usage: $0 --pack BASE_REV}"
    cd "$(dirname "$0")/.."
    cargo build --release -p dflash-cli --features cuda --bin dflash
    cargo build --release -p dflash-models --example synthetic_model
    cargo build --release -p dflash-runtime --features cuda --example cuda_microbench
    bash tools/gpu_check.sh --build
    rm -rf .gpu/ab && mkdir -p .gpu/ab/bin
    cp target/release/dflash target/release/examples/synthetic_model \
        target/release/examples/cuda_microbench .gpu/tests/cuda_ops .gpu/tests/cuda_fused \
        .gpu/tests/cuda_qwen35 .gpu/ab/bin/
    # The baseline in a temporary worktree, built into this checkout's target folder (its
    # dependencies are reused; target/release/dflash is the baseline's afterwards).
    wt=$(mktemp -d)
    tgt="$PWD/target"
    git worktree add -q --detach "$wt" "$base"
    (cd "$wt" && CARGO_TARGET_DIR="$tgt" cargo build --release -p dflash-cli --features cuda --bin dflash \
        && CARGO_TARGET_DIR="$tgt" cargo build --release -p dflash-runtime --features cuda --example cuda_microbench)
    cp target/release/dflash .gpu/ab/bin/dflash_base
    cp target/release/examples/cuda_microbench .gpu/ab/bin/cuda_microbench_base
    # Both builds' kernels compiled here (the baseline's sources as a kernel directory: cached
    # where its host constants match the candidate's, else compiled there).
    bash tools/kernel_cache.sh .gpu/ab/kcache.tar.xz "$wt/crates/runtime/kernels"
    git worktree remove --force "$wt"
    strip .gpu/ab/bin/* 2>/dev/null || true
    tar -C .gpu/ab/bin -cJf .gpu/ab/bins.tar.xz . && rm -rf .gpu/ab/bin
    cp tools/h200_ab.sh tools/cuda_env.sh .gpu/ab/
    echo "base $(git rev-parse --short "$base"), candidate $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + uncommitted changes')" \
        > .gpu/ab/builds.txt
    du -sh .gpu/ab
    exit 0
fi

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tools/cuda_env.sh
source "$here/cuda_env.sh"
out="${OUT:-/tmp/ab_out}"
mkdir -p "$out"
W="$HOME/ab"
mkdir -p "$W"
tar -C "$W" -xJf "$here/bins.tar.xz"
export DFLASH_CACHE_DIR="$W/cache"
[ -f "$here/kcache.tar.xz" ] && mkdir -p "$W/cache" && tar -C "$W/cache" -xJf "$here/kcache.tar.xz"
[ -n "${AB_INT8:-}" ] && export DFLASH_CUDA_INT8="$AB_INT8"
cd "$W" || exit 1
cat "$here/builds.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
shapes="${AB_SHAPES:-smollm2-135m:q4_1 qwen3-4b:q4_0}"
(for s in $shapes; do [ -f "${s%%:*}.gguf" ] || ./synthetic_model --shape "${s%%:*}" --dtype "${s##*:}" --out "${s%%:*}.gguf"; done \
    > "$out/synthetic.log" 2>&1) &
for t in $([ "${AB_TESTS:-1}" = 1 ] && echo cuda_ops cuda_fused cuda_qwen35); do
    echo "== $t"
    timeout 200 "./$t" --test-threads=1 2>&1 | tee "$out/$t.log" | grep -E "^test .*FAILED|test result|panicked"
done
if [ "${AB_TESTS:-1}" = 1 ]; then
    echo "== memcheck cuda_fused (M sweep skipped)"
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 ./cuda_fused \
        --test-threads=1 --skip every_m_from_1 2>&1 | grep -E "ERROR SUMMARY|test result" | head -3
fi
wait
for s in $shapes; do
    m="${s%%:*}.gguf"
    case "$s" in qwen3-4b*) args="-p 128 -n 64" ;; *) args="-p 512 -n 128" ;; esac
    for r in $(seq "${AB_ROUNDS:-3}"); do
        for b in dflash_base dflash; do
            # shellcheck disable=SC2086
            timeout 120 "./$b" bench -m "$m" --device cuda --no-draft $args -r 3 \
                > /dev/null 2> "$out/${s%%:*}_${r}_$b.err"
            echo "${s%%:*} round $r $b: $(grep -E '\| tg|verify of' "$out/${s%%:*}_${r}_$b.err" | tr '\n' ' ')"
        done
    done
done
for b in $([ "${AB_TESTS:-1}" = 1 ] && echo cuda_microbench_base cuda_microbench); do
    timeout 120 "./$b" --shapes qwen3-4b --formats q4_0,q4_1 --only matmul --reps 20 > "$out/mb_$b.md" 2>&1
    echo "== $b"; grep -E "^\| Q" "$out/mb_$b.md"
done
