#!/usr/bin/env bash
# GPU check of the CUDA backend, in one call on a machine with an NVIDIA GPU.
#
# The GPU machine (the H200 device machine) has no Rust toolchain, so the test binaries are
# built here, on a machine without a GPU, and carried there:
#
#   bash tools/gpu_check.sh --build
#
# builds the runtime's CUDA tests (`cargo test -p dflash-runtime --features cuda --no-run`)
# and the engine's token-choice, Qwen 3.5 and golden tests (`-p dflash-engine --features cuda --test
# cuda_token_choice --test cuda_qwen35 --test cuda_golden_smollm2`), copies the executables
# (cuda_ops, cuda_fused, cuda_gdn_ops, cuda_token_choice, cuda_qwen35, cuda_golden_smollm2;
# stripped) to .gpu/tests/ and makes sure
# .git/info/exclude ignores /.gpu/. Any other prebuilt test executable put in .gpu/tests/ is
# run too (e.g. an engine test built with the cuda feature).
# Then, with the device tool:
#
#   run  command: "bash tools/gpu_check.sh"   carry: [".gpu"]
#
# On the GPU machine this script sets CUDA_HOME (if unset) and LD_LIBRARY_PATH (the toolkit's
# and the pip wheels' lib folders, for libnvrtc / libcublas), runs every executable in .gpu/
# one test at a time (first the plain run, which also compiles the kernels with NVRTC into
# the cache unless --build packed them, .gpu/kcache.tar.xz from tools/kernel_cache.sh; then,
# when compute-sanitizer is there, a memcheck pass), and prints a summary.
# Tests that print "skipped: no CUDA device" count as failures here: this script exists to
# run them on a GPU. Logs go to $OUT (the device tool brings them back) or /tmp/gpu_check.
#
# Environment: GPU_CHECK_SANITIZER=0 skips the memcheck pass; GPU_CHECK_X2=0 skips the second
# plain pass of cuda_ops and cuda_fused with two-term int8 activations; GPU_CHECK_FILTER=<name> runs
# only tests whose name contains it; GPU_CHECK_TIMEOUT=<s> limits each plain run (400);
# GPU_CHECK_MODEL=<file> puts a carried copy of the default model (SmolLM2-135M-Instruct
# Q4_1) into the cache for cuda_golden_smollm2, which otherwise downloads it (the GPU machine
# has no network: without the model that test fails).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--build" ]; then
    set -e
    mkdir -p .gpu/tests
    # the runtime's CUDA tests, and the engine's token-choice test
    for args in "-p dflash-runtime --features cuda" \
                "-p dflash-engine --features cuda --test cuda_token_choice --test cuda_qwen35 --test cuda_golden_smollm2"; do
        # shellcheck disable=SC2086
        cargo test --release $args --no-run --message-format=json \
            | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    name = m.get("target", {}).get("name", "")
    if m.get("reason") == "compiler-artifact" and name.startswith("cuda_") \
            and m.get("profile", {}).get("test") and m.get("executable"):
        shutil.copy(m["executable"], ".gpu/tests/" + name)
        print("built", name)
'
    done
    strip .gpu/tests/* 2>/dev/null || true
    bash tools/kernel_cache.sh .gpu/kcache.tar.xz
    exclude=$(git rev-parse --git-path info/exclude)  # (a worktree's .git is a file)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
    ls -la .gpu/tests
    echo "built: carry [\".gpu\"] and run: bash tools/gpu_check.sh"
    exit 0
fi

out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
log="$out/gpu_check.log"
: > "$log"
say() { echo "$@" | tee -a "$log"; }

# shellcheck source=tools/cuda_env.sh
source "$(dirname "$0")/cuda_env.sh"
export DFLASH_CACHE_DIR="${DFLASH_CACHE_DIR:-/tmp/dflash-cache}"
# The kernels compiled at --build (tools/kernel_cache.sh; a miss where this NVRTC differs).
[ -f .gpu/kcache.tar.xz ] && mkdir -p "$DFLASH_CACHE_DIR" && tar -C "$DFLASH_CACHE_DIR" -xJf .gpu/kcache.tar.xz
export RUST_BACKTRACE=1
if [ -n "${GPU_CHECK_MODEL:-}" ]; then
    [ -f "$GPU_CHECK_MODEL" ] || { echo "GPU_CHECK_MODEL=$GPU_CHECK_MODEL is not a file" >&2; exit 2; }
    mkdir -p "$DFLASH_CACHE_DIR" && cp "$GPU_CHECK_MODEL" "$DFLASH_CACHE_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
fi

say "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 | tee -a "$log"
say "CUDA_HOME=${CUDA_HOME:-unset}"
say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
for lib in libcuda.so.1 libnvrtc.so.13 libcublas.so.13; do
    if have_lib "$lib"; then say "$lib: on the loader path"; else
        found=""
        IFS=: read -ra ds <<< "${LD_LIBRARY_PATH:-}"
        for d in "${ds[@]}"; do [ -e "$d/$lib" ] && found="$d"; done
        say "$lib: ${found:-NOT FOUND}"
    fi
done

bins=()
for f in .gpu/tests/*; do
    [ -f "$f" ] || continue
    case "$f" in *.d|*.json|*.txt|*.gguf|*.safetensors) continue ;; esac
    chmod +x "$f" 2>/dev/null
    [ -x "$f" ] && bins+=("$f")
done
if [ ${#bins[@]} -eq 0 ]; then
    say "no test executables in .gpu/tests/: build them with 'bash tools/gpu_check.sh --build' and carry .gpu"
    exit 2
fi

filter=()
[ -n "${GPU_CHECK_FILTER:-}" ] && filter=("$GPU_CHECK_FILTER")
status=0
summary=()
for b in "${bins[@]}"; do
    name=$(basename "$b")
    say ""
    say "== $name (plain run)"
    start=$(date +%s)
    timeout "${GPU_CHECK_TIMEOUT:-400}" "$b" --test-threads=1 --nocapture "${filter[@]}" > "$out/$name.log" 2>&1
    rc=$?
    cat "$out/$name.log" >> "$log"
    grep -E "^test |test result|max \|error\||CUDA device:|panicked|skipped" "$out/$name.log" | head -150
    secs=$(( $(date +%s) - start ))
    skipped=$(grep -c "skipped: no CUDA device" "$out/$name.log")
    result=$(grep "test result" "$out/$name.log" | tail -n 1)
    if [ $rc -ne 0 ] || [ "$skipped" -gt 0 ]; then status=1; fi
    summary+=("$name: exit $rc in ${secs}s; ${result:-no result line}; no-GPU skips: $skipped")
done

# The runtime's op tests again with two-term int8 activations (the shared test GPU of
# tests/common takes DFLASH_CUDA_INT8=x2 from the environment), unless GPU_CHECK_X2=0.
if [ "${GPU_CHECK_X2:-1}" != "0" ]; then
    for b in "${bins[@]}"; do
        name=$(basename "$b")
        case "$name" in cuda_ops|cuda_fused) ;; *) continue ;; esac
        say ""
        say "== $name (plain run, DFLASH_CUDA_INT8=x2)"
        start=$(date +%s)
        DFLASH_CUDA_INT8=x2 timeout "${GPU_CHECK_TIMEOUT:-400}" "$b" --test-threads=1 --nocapture "${filter[@]}" \
            > "$out/$name.x2.log" 2>&1
        rc=$?
        cat "$out/$name.x2.log" >> "$log"
        grep -E "^test |test result|panicked|skipped" "$out/$name.x2.log" | head -60
        secs=$(( $(date +%s) - start ))
        skipped=$(grep -c "skipped: no CUDA device" "$out/$name.x2.log")
        if [ $rc -ne 0 ] || [ "$skipped" -gt 0 ]; then status=1; fi
        summary+=("$name (x2): exit $rc in ${secs}s; $(grep "test result" "$out/$name.x2.log" | tail -n 1); no-GPU skips: $skipped")
    done
fi

if [ "${GPU_CHECK_SANITIZER:-1}" != "0" ] && command -v compute-sanitizer > /dev/null; then
    for b in "${bins[@]}"; do
        name=$(basename "$b")
        say ""
        say "== $name (compute-sanitizer memcheck)"
        start=$(date +%s)
        # The long-context and matmul-sweep tests are slow under the sanitizer; the others
        # touch every kernel.
        timeout 300 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
            "$b" --test-threads=1 --skip attention_long_context --skip matmul_every_dtype \
            --skip tensor_core_prefill_matches "${filter[@]}" \
            > "$out/$name.memcheck.log" 2>&1
        rc=$?
        grep -E "ERROR SUMMARY|test result|Invalid|out of bounds|========= " "$out/$name.memcheck.log" | head -40 | tee -a "$log"
        secs=$(( $(date +%s) - start ))
        [ $rc -ne 0 ] && [ $rc -ne 124 ] && status=1
        [ $rc -eq 124 ] && rc="timeout"
        summary+=("$name memcheck: exit $rc in ${secs}s; $(grep 'ERROR SUMMARY' "$out/$name.memcheck.log" | tail -n 1)")
    done
fi

say ""
say "== summary"
for s in "${summary[@]}"; do say "$s"; done
if [ $status -eq 0 ]; then say "GPU CHECK PASSED"; else say "GPU CHECK FAILED (logs in $out)"; fi
exit $status
