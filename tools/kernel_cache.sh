#!/usr/bin/env bash
# The CUDA kernels of this build compiled here (NVRTC only, no GPU) into a kernel cache that
# travels to the GPU machine, so that a device call does not spend its first minutes in NVRTC
# (up to ~140 s on a fresh H100 or H200 for the modules a model uses).
#
#   bash tools/kernel_cache.sh OUT.tar.xz [KERNEL_DIR...]
#
# Builds `cuda_kernel_cache` (crates/runtime/examples) and compiles every module for sm_90
# (KC_ARCH), then again with each KERNEL_DIR's sources (DFLASH_CUDA_KERNEL_DIR variants: only
# the modules they change are new), into OUT.tar.xz (~2 MB; `cuda-kernels/` of a cache root).
# Modules stay compiled in KC_DIR (~/.cache/dflash/kernel-pack) between packs: ~4 minutes on
# 2 cores the first time, seconds while the kernels do not change. On the GPU machine:
# `tar -C "$DFLASH_CACHE_DIR" -xJf OUT.tar.xz` before the first run. The cache key holds the sources, the target, NVRTC's major.minor version and the
# options, so a file made for another build or NVRTC is never read there: a miss, not an error.
# Exits 0 without writing OUT when NVRTC cannot be loaded here (the GPU machine then compiles).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash tools/kernel_cache.sh OUT.tar.xz [KERNEL_DIR...]" >&2; exit 2; }
out=$(realpath -m "$1")
shift
cd "$(dirname "$0")/.."
cargo build --release -p dflash-runtime --features cuda --example cuda_kernel_cache
# The device machines' NVRTC (CUDA 13.0; KC_NVRTC): the cache key holds NVRTC's major.minor,
# so the kernels are compiled with that version whatever this environment holds (installing
# PyTorch here brought NVRTC 13.2, whose files the devices' 13.0 would never read).
nv="${KC_NVRTC:-13.0}"
nvdir="$HOME/.cache/dflash/nvrtc-$nv"
[ -e "$nvdir/nvidia/cu13/lib/libnvrtc.so.13" ] || python3 -m pip install --quiet \
    --disable-pip-version-check --root-user-action=ignore --no-deps --target "$nvdir" "nvidia-cuda-nvrtc==$nv.*" \
    || echo "could not install NVRTC $nv here; using whatever NVRTC is found" >&2
export LD_LIBRARY_PATH="$nvdir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Compiled modules are kept here between packs (a pack of unchanged kernels is then instant);
# only the files of this build go into OUT.
kc="${KC_DIR:-$HOME/.cache/dflash/kernel-pack}"
arch="${KC_ARCH:-90}"
list=$(mktemp)
trap 'rm -f "$list"' EXIT
# Prints "<module> for sm_XY: <path>" per module.
if ! DFLASH_CACHE_DIR="$kc" target/release/examples/cuda_kernel_cache --arch "$arch" > "$list"; then
    echo "kernel cache not made (NVRTC missing here?): the GPU machine compiles the kernels" >&2
    exit 0
fi
for d in "$@"; do
    DFLASH_CUDA_KERNEL_DIR="$d" DFLASH_CACHE_DIR="$kc" target/release/examples/cuda_kernel_cache \
        --arch "$arch" >> "$list" 2> /dev/null || echo "$d: its kernels do not compile here, not cached" >&2
done
grep -E ': /' "$list" | sed -E 's/^.*: //' | sort -u | xargs -n1 basename \
    | tar -cJf "$out" --transform 's,^,cuda-kernels/,' -C "$kc/cuda-kernels" -T -
echo "kernel cache for sm_$arch, $(grep -m1 '^NVRTC' "$list"): $out ($(du -h "$out" | cut -f1))"
