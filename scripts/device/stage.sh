#!/usr/bin/env bash
# Here (no GPU): builds and copies what the GPU machine needs into .device-carry/ (git-ignored),
# which the device call names in `carry`. The binaries find libloom.so next to them.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="/usr/local/cuda/bin:$PATH"
cmake --preset default >/dev/null
cmake --build --preset default
rm -rf .device-carry && mkdir -p .device-carry/bin
cp build/libloom.so build/loom-bench build/loom-run build/loom_gpu_tests .device-carry/bin/
strip --strip-unneeded .device-carry/bin/* 2>/dev/null || true
git rev-parse HEAD > .device-carry/GIT_SHA 2>/dev/null || echo unknown > .device-carry/GIT_SHA
git status --porcelain | grep -q . && echo dirty >> .device-carry/GIT_SHA || true
du -sh .device-carry
