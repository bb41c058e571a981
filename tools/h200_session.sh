#!/usr/bin/env bash
# One H200 session of the CUDA backend in three back-to-back device calls (the device tool
# carries at most 64 MiB per call and keeps $HOME only while the machine stays warm, so the
# 98 MB default model travels in two parts). Built and packed here, run there:
#
#   bash tools/h200_session.sh --pack      # here: builds, then fills .gpu/{common,A,B,C}
#   bash tools/device_checkout.sh empty    # the tracked tree (~45 MiB) would not fit beside a stage
#   run  carry [".gpu/common", ".gpu/A"]  command "bash .gpu/common/h200_session.sh A"
#   run  carry [".gpu/common", ".gpu/B"]  command "bash .gpu/common/h200_session.sh B"
#   run  carry [".gpu/common", ".gpu/C"]  command "bash .gpu/common/h200_session.sh C"
#   bash .gpu/device_checkout.sh restore
#
# A: unpacks the binaries, starts a llama.cpp CUDA build (Feb-2025 source, sm_90) in the
#    background (H200_LLAMA_AT=B: at the start of stage B instead, when stage A's timings
#    matter), runs the CUDA op tests (H200_TESTS, default: every CUDA test binary), then
#    (unless H200_PROFILE=0) ncu on three kernels, the kernel microbench and memcheck.
# B: assembles and checks the default model; the GPU golden test (every numeric path against
#    transformers); CPU-vs-GPU greedy parity on 24 MT-Bench prompts (int8, the default;
#    two-term int8, `x2`, with the CPU on `int8x2`; and f32); `dflash bench` plain decoding (kernel split by class) at prompts 128 and 512;
#    (unless H200_PROFILE=0) every kernel of two decode steps timed alone by ncu
#    (ncu_kernel_table.py).
# C: the shipped drafter: DFlash parity on the GPU (B = 1 and B = 4); dflash bench AR vs
#    DFlash and B = 4 (blocks 16 and 4); llama-bench beside dflash bench, alternating; the
#    Qwen3-4B-shaped synthetic target (H200_Q4B_ROUNDS rounds, default 2); (unless
#    H200_PROFILE=0) its matmul microbench, and where a DFlash round's GPU time goes: every
#    kernel of `dflash generate` rounds at blocks 4 and 16 timed alone by ncu, tabled by
#    `ncu_kernel_table.py --rounds` (the draft part against the verify part).
# A stage's logs and results go to one folder, packed at its end into
# $OUT/h200-stage-<stage>.tar.xz (the device tool brings back at most 8 files a call).
set -uo pipefail

pack() {
    set -e
    cd "$(dirname "$0")/.."
    local model="${DFLASH_MODEL_FILE:-$HOME/.cache/dflash/SmolLM2-135M-Instruct.Q4_1.gguf}"
    [ -f "$model" ] || { echo "pack: the default model is not at $model (set DFLASH_MODEL_FILE)" >&2; exit 2; }
    cargo build --release -p dflash-cli --features cuda --bin dflash --example gpu_parity
    cargo build --release -p dflash-runtime --features cuda --example cuda_microbench
    cargo build --release -p dflash-models --example synthetic_model
    bash tools/gpu_check.sh --build
    rm -rf .gpu/common .gpu/A .gpu/B .gpu/C
    mkdir -p .gpu/common .gpu/A .gpu/B .gpu/C .gpu/bin
    cp tools/h200_session.sh tools/cuda_env.sh tools/ncu_kernel_table.py .gpu/common/
    bash tools/kernel_cache.sh .gpu/common/kcache.tar.xz
    cp data/mt_bench_first_turns.jsonl .gpu/common/prompts.jsonl
    for b in dflash examples/gpu_parity examples/cuda_microbench examples/synthetic_model; do
        cp "target/release/$b" .gpu/bin/
    done
    cp .gpu/tests/* .gpu/bin/
    strip .gpu/bin/* 2>/dev/null || true
    tar -C .gpu/bin -cJf .gpu/A/bins.tar.xz .
    # llama.cpp's source for the side-by-side build: LLAMA_GIT names a git checkout (or a bare
    # mirror) of llama.cpp; only the parts the two benchmark tools need are archived.
    if [ -n "${LLAMA_GIT:-}" ]; then
        git -C "$LLAMA_GIT" archive --format=tar HEAD CMakeLists.txt cmake ggml src include common \
            examples/llama-bench examples/batched-bench | gzip -9 > .gpu/llama_src.tgz
        tar -tzf .gpu/llama_src.tgz CMakeLists.txt > /dev/null
    fi
    [ -f .gpu/llama_src.tgz ] && cp .gpu/llama_src.tgz .gpu/A/
    local room=$(( 60 * 1024 * 1024 - $(du -cb .gpu/A .gpu/common | tail -n 1 | cut -f1) ))
    head -c "$room" "$model" > .gpu/A/model.part1
    tail -c +"$(( room + 1 ))" "$model" > .gpu/B/model.part2
    cp -r models/drafters/smollm2-135m-instruct-dflash .gpu/C/drafter
    du -sh .gpu/common .gpu/A .gpu/B .gpu/C
}

if [ "${1:-}" = "--pack" ]; then
    pack
    exit 0
fi

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
W="$HOME/dflash-h200"
mkdir -p "$W"
# Everything a stage writes goes to one folder, packed into $OUT when the stage ends.
out="$W/out-${1:-none}"
rm -rf "$out" && mkdir -p "$out"
log="$out/session-${1:-none}.log"
pack_out() {
    local dest="${OUT:-/tmp/h200_out}"
    mkdir -p "$dest" && tar -C "$out" -cJf "$dest/h200-stage-${1}.tar.xz" .
}
exec > >(tee -a "$log") 2>&1
# shellcheck source=tools/cuda_env.sh
source "$here/cuda_env.sh"
export DFLASH_CACHE_DIR="$W/cache" RUST_BACKTRACE=1
# The kernels compiled at --pack (tools/kernel_cache.sh; a miss where this NVRTC differs).
[ -f "$here/kcache.tar.xz" ] && mkdir -p "$W/cache" && tar -C "$W/cache" -xJf "$here/kcache.tar.xz"
MODEL="$W/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
say() { echo "== $(date +%T) $*"; }
# The result lines of a `dflash bench` log (its weight table comes last).
results() { grep -E '\| (tg|AR |B=1)|verify of|kernel time' "$1" | grep -vE '^\| (target|draft) ' | tr '\n' ' '; echo; }

# Starts the llama.cpp CUDA build in the background (once), from the source stage A copied.
llama_start() {
    [ -f "$W/llama_src.tgz" ] && [ ! -d "$W/llama" ] || return 0
    say "llama.cpp build (background)"
    mkdir -p "$W/llama" && tar -C "$W/llama" -xzf "$W/llama_src.tgz"
    # Only the benchmark tools are archived: the top-level CMakeLists still adds pocs/.
    [ -d "$W/llama/pocs" ] || { mkdir -p "$W/llama/pocs" && : > "$W/llama/pocs/CMakeLists.txt"; }
    cat > "$W/llama/examples/CMakeLists.txt" <<'EOF'
find_package(Threads REQUIRED)
llama_add_compile_flags()
include_directories(${CMAKE_CURRENT_SOURCE_DIR})
add_subdirectory(llama-bench)
add_subdirectory(batched-bench)
EOF
    setsid nohup bash -c "cd '$W/llama' && cmake -B build -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release \
        > build.log 2>&1 && cmake --build build -j 14 --target llama-bench llama-batched-bench \
        >> build.log 2>&1; echo \$? > build.done" > /dev/null 2>&1 < /dev/null &
}

stage_a() {
    say "machine"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.sm,clocks.mem --format=csv
    tar -C "$W" -xJf "$root/.gpu/A/bins.tar.xz"
    cp "$root/.gpu/A/model.part1" "$W/"
    [ -f "$root/.gpu/A/llama_src.tgz" ] && cp "$root/.gpu/A/llama_src.tgz" "$W/"
    # H200_LLAMA_AT=B: the build starts with stage B (when stage A's timings matter)
    [ "${H200_LLAMA_AT:-A}" = B ] || llama_start
    for t in ${H200_TESTS:-cuda_ops cuda_fused cuda_token_choice cuda_gdn_ops cuda_qwen35}; do
        say "$t"
        timeout 300 "$W/$t" --test-threads=1 2>&1 | tee "$out/$t.log" | grep -E "^test |test result|panicked|skipped|error" | head -60
    done
    [ "${H200_PROFILE:-1}" = 1 ] || return 0
    if command -v ncu > /dev/null; then
        say "ncu: a 576-output product on int8 tensor cores (M = 5..16), the 4B gate/up product at M=1, attention at context 128"
        for spec in "smollm2 q4_1 matmul regex:mmqt_q4_1_store" "qwen3-4b q4_0 matmul regex:mmq_q4_0_1_" \
            "smollm2 q4_1 attention regex:attention_split"; do
            set -- $spec
            DFLASH_CUDA_INT8=1 timeout 120 ncu --clock-control none --kernel-name "$4" --launch-skip 40 --launch-count 1 \
                --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
                "$W/cuda_microbench" --shapes "$1" --formats "$2" --only "$3" --reps 4 2>&1 \
                | grep -E "^  [a-z_]+.*\(|Duration|Throughput|Registers|Achieved Occupancy|Block Size|Grid Size|Waves|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth" \
                | head -30 | tee -a "$out/ncu.txt"
        done
    fi
    for int8 in 1 x2 0; do
        say "microbench (smollm2 shapes), DFLASH_CUDA_INT8=$int8"
        DFLASH_CUDA_INT8=$int8 timeout 240 "$W/cuda_microbench" --shapes smollm2 --only matmul --reps 30 \
            | tee "$out/microbench_smollm2_int8_$int8.md"
    done
    for t in cuda_ops cuda_fused cuda_token_choice; do
        say "compute-sanitizer memcheck: $t (the long sweeps skipped)"
        timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
            "$W/$t" --test-threads=1 --skip attention_long_context --skip matmul_every_dtype \
            --skip every_m_from_1 --skip cublas --skip tensor_core_prefill_matches 2>&1 | grep -E "ERROR SUMMARY|test result|Invalid" | head
    done
}

stage_b() {
    llama_start
    cp "$root/.gpu/B/model.part2" "$W/"
    cat "$W/model.part1" "$W/model.part2" > "$MODEL"
    echo "$SHA  $MODEL" | sha256sum -c - || { say "model checksum FAILED"; return 1; }
    # The golden test finds the model in the cache (ensure_default_model: no network here).
    mkdir -p "$DFLASH_CACHE_DIR" && cp "$MODEL" "$DFLASH_CACHE_DIR/"
    say "golden: the GPU's int8 (default), two-term int8 and f32 paths against transformers"
    timeout 300 "$W/cuda_golden_smollm2" --test-threads=1 --nocapture 2>&1 | tee "$out/cuda_golden_smollm2.log" \
        | grep -E "^test |test result|panicked|largest|skipped"
    for int8 in 1 x2 0; do
        say "parity: CPU vs GPU greedy, batched vs single, DFLASH_CUDA_INT8=$int8"
        DFLASH_CUDA_INT8=$int8 timeout 300 "$W/gpu_parity" --model "$MODEL" \
            --prompts "$root/.gpu/common/prompts.jsonl" --count 24 --max-tokens 64 | tee "$out/parity_plain_int8_$int8.log"
    done
    for p in 128 512; do
        for int8 in 1 0; do
            say "dflash bench plain, prompt $p, DFLASH_CUDA_INT8=$int8"
            DFLASH_CUDA_INT8=$int8 timeout 200 "$W/dflash" bench -m "$MODEL" --device cuda --no-draft \
                -p $p -n 128 -r 5 > "$out/bench_plain_p${p}_int8_$int8.json" 2> "$out/bench_plain_p${p}_int8_$int8.err"
            results "$out/bench_plain_p${p}_int8_$int8.err"
        done
    done
    if [ "${H200_PROFILE:-1}" = 1 ] && command -v ncu > /dev/null; then
        say "ncu: every kernel of two decode steps at context ~512, timed alone"
        timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --launch-skip 4000 \
            --launch-count 500 --csv "$W/dflash" bench -m "$MODEL" --device cuda --no-draft -p 512 -n 64 \
            -r 1 2> /dev/null | python3 "$here/ncu_kernel_table.py" --steps 2 | tee "$out/ncu_step.md"
    fi
    say "llama.cpp build: $(cat "$W/llama/build.done" 2>/dev/null || echo running)"
    tail -n 3 "$W/llama/build.log" 2>/dev/null
}

stage_c() {
    cp -r "$root/.gpu/C/drafter" "$W/drafter"
    say "parity with the drafter (DFlash block 16, B = 1 and 4, on the GPU)"
    timeout 300 "$W/gpu_parity" --model "$MODEL" --draft "$W/drafter" \
        --prompts "$root/.gpu/common/prompts.jsonl" --count 24 --max-tokens 64 \
        | tee "$out/parity_dflash.log" | tail -n 8
    say "dflash bench: AR vs DFlash B=1 (blocks 16 and 4), then B=4 per-row/clamp/B=1 (blocks 16 and 4)"
    for bs in 16 4; do
        timeout 200 "$W/dflash" bench -m "$MODEL" --device cuda --draft "$W/drafter" --block-size $bs \
            -n 128 -r 3 > "$out/bench_dflash_b$bs.json" 2> "$out/bench_dflash_b$bs.err"
        results "$out/bench_dflash_b$bs.err"
    done
    for bs in 16 4; do
        timeout 200 "$W/dflash" bench -m "$MODEL" --device cuda --draft "$W/drafter" --block-size $bs \
            -n 128 -r 3 --batch 4 > "$out/bench_batch4_b$bs.json" 2> "$out/bench_batch4_b$bs.err"
        results "$out/bench_batch4_b$bs.err"
    done
    if [ "$(cat "$W/llama/build.done" 2>/dev/null)" = "0" ]; then
        for r in 1 2 3; do
            say "round $r: llama-bench, then dflash bench (prompt 512, 128 new tokens)"
            "$W/llama/build/bin/llama-bench" -m "$MODEL" -ngl 99 -p 512 -n 128 -r 3 -o md 2>&1 \
                | grep -E "^\|" | tee -a "$out/llama_bench.md"
            for int8 in 1 0; do
                DFLASH_CUDA_INT8=$int8 "$W/dflash" bench -m "$MODEL" --device cuda --no-draft -p 512 -n 128 \
                    -r 3 > "$out/bench_alt_${r}_int8_$int8.json" 2> "$out/bench_alt_${r}_int8_$int8.err"
                echo "DFLASH_CUDA_INT8=$int8: $(results "$out/bench_alt_${r}_int8_$int8.err")"
            done
        done
    else
        say "llama.cpp build did not finish: $(tail -n 5 "$W/llama/build.log" 2>/dev/null)"
    fi
    say "Qwen3-4B-shaped synthetic target (Q4_0)"
    "$W/synthetic_model" --shape qwen3-4b --dtype q4_0 --out "$W/q4b.gguf"
    for r in $(seq "${H200_Q4B_ROUNDS:-2}"); do
        for int8 in 1 0; do
            DFLASH_CUDA_INT8=$int8 timeout 200 "$W/dflash" bench -m "$W/q4b.gguf" --device cuda --no-draft \
                -p 128 -n 64 -r 3 > "$out/bench_q4b_${r}_int8_$int8.json" 2> "$out/bench_q4b_${r}_int8_$int8.err"
            echo "round $r DFLASH_CUDA_INT8=$int8: $(results "$out/bench_q4b_${r}_int8_$int8.err")"
        done
    done
    [ "${H200_PROFILE:-1}" = 1 ] || return 0
    for int8 in 1 0; do
        DFLASH_CUDA_INT8=$int8 timeout 200 "$W/cuda_microbench" --shapes qwen3-4b --formats q4_0 --only matmul \
            --reps 20 | tee "$out/microbench_q4b_int8_$int8.md"
    done
    if command -v ncu > /dev/null; then
        for bs in 4 16; do
            say "ncu: every kernel of DFlash rounds at block $bs, timed alone (draft part / verify part)"
            timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$W/dflash" generate \
                -m "$MODEL" --device cuda --draft "$W/drafter" --block-size $bs --speculation always -n 96 \
                "Explain how a rainbow forms, step by step." 2> "$out/ncu_rounds_b$bs.err" \
                | tee "$out/ncu_rounds_b$bs.csv" | python3 "$here/ncu_kernel_table.py" --rounds \
                | tee "$out/ncu_rounds_b$bs.md"
        done
    fi
}

# D (needs no model): the CUDA tests of every crate (.gpu/D/tests.tar.xz: cuda_ops with the
# DFlash2 grouped convolution, cuda_fused, cuda_gdn_ops, cuda_token_choice), plain and under
# memcheck, and the Qwen 3.5 benchmark on 0.8B- and 4B-shaped random targets.
stage_d() {
    mkdir -p "$W/d" && tar -C "$W/d" -xJf "$root/.gpu/D/tests.tar.xz"
    for t in "$W"/d/cuda_*; do
        say "$(basename "$t")"
        timeout 300 "$t" --test-threads=1 2>&1 | tee "$out/$(basename "$t").log" \
            | grep -E "^test |test result|panicked|skipped" | head -40
        timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 "$t" \
            --test-threads=1 --skip attention_long_context --skip matmul_every_dtype \
            --skip every_m_from_1 --skip cublas --skip tensor_core_prefill_matches 2>&1 | grep -E "ERROR SUMMARY|test result" | head -3
    done
    for shape in "0.8b q4_0" "4b q4_0"; do
        set -- $shape
        say "qwen35_bench $1 $2"
        timeout 200 "$W/d/qwen35_bench" --shape "$1" --dtype "$2" --device cuda --prompt 512 --gen 64 \
            --reps 3 --batch 4 --block 16 --tau 2.9 2>&1 | tail -n 12 | tee -a "$out/qwen35_bench.txt"
    done
}

case "${1:-}" in
    A) stage_a ;;
    D) stage_d ;;
    B) stage_b ;;
    C) stage_c ;;
    *) echo "usage: $0 --pack | A | B | C | D" >&2; exit 2 ;;
esac
pack_out "$1"
