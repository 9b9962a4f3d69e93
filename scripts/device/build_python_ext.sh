#!/usr/bin/env bash
# On the GPU machine: builds only the extension loom._C against the carried
# .device-carry/bin/libloom.so (scripts/device/stage.sh builds it on the build machine) and the
# repo's include/ (python/CMakeLists.txt, no CUDA compiler needed), installing the package under
# $WORK/pkg/loom. Use it with PYTHONPATH=$WORK/pkg. Build output goes to $1 (default: stderr).
#   scripts/device/build_python_ext.sh [LOG]
set -uo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/loom-work}
PY=${PYTHON:-python3}
LOG=${1:-/dev/stderr}
LIB=.device-carry/bin/libloom.so
mkdir -p "$WORK"
if [[ ! -f $LIB ]]; then
  echo "no $LIB: run scripts/device/stage.sh on the build machine and carry .device-carry" | tee -a "$LOG"; exit 1
fi
include=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if [[ ! -f $include/Python.h ]]; then
  echo "no Python.h under $include: the extension cannot be compiled with this Python (needs python3-dev)" | tee -a "$LOG"
  exit 1
fi
rm -rf "$WORK/ext" "$WORK/pkg"
timeout 150 cmake -S python -B "$WORK/ext" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v "$PY")" -DLOOM_PREBUILT_LIBRARY="$PWD/$LIB" >> "$LOG" 2>&1 &&
  timeout 150 cmake --build "$WORK/ext" -j "$(nproc)" >> "$LOG" 2>&1 &&
  cmake --install "$WORK/ext" --prefix "$WORK/pkg" >> "$LOG" 2>&1
