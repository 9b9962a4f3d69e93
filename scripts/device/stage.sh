#!/usr/bin/env bash
# Here (no GPU): builds and copies what the GPU machine needs into .device-carry/ (git-ignored),
# which the device call names in `carry`. The binaries find libloom.so next to them.
#   scripts/device/stage.sh [--base DIR]
# --base DIR also stages an earlier build's loom-bench and libloom.so (DIR: its build folder in a
# git worktree) as .device-carry/base, xz-compressed, for scripts/device/gemm_ab.sh and
# attention_ab.sh (scripts/device/env.sh unpacks them on the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
base=""
if [[ ${1:-} == --base ]]; then
  base=$(realpath "${2:?--base needs the earlier build folder}")
  [[ -x $base/loom-bench && -f $base/libloom.so ]] || { echo "stage.sh: no loom-bench and libloom.so in $base" >&2; exit 2; }
fi
export PATH="/usr/local/cuda/bin:$PATH"
cmake --preset default >/dev/null
cmake --build --preset default
rm -rf .device-carry && mkdir -p .device-carry/bin
cp build/libloom.so build/loom-bench build/loom-run build/loom_gpu_tests .device-carry/bin/
strip --strip-unneeded .device-carry/bin/* 2>/dev/null || true
git rev-parse HEAD > .device-carry/GIT_SHA 2>/dev/null || echo unknown > .device-carry/GIT_SHA
git status --porcelain | grep -q . && echo dirty >> .device-carry/GIT_SHA || true
if [[ -n $base ]]; then
  mkdir -p .device-carry/base
  cp "$base/loom-bench" "$base/libloom.so" .device-carry/base/
  strip --strip-unneeded .device-carry/base/* 2>/dev/null || true
  # Two builds exceed the carry's 64 MiB; the fat binaries shrink about 15x (env.sh unpacks them).
  xz -T0 -6 .device-carry/base/loom-bench .device-carry/base/libloom.so
  git -C "$base" rev-parse HEAD > .device-carry/base/GIT_SHA
fi
du -sh .device-carry
