#!/usr/bin/env bash
# Here (no GPU): builds and copies what the GPU machine needs into .device-carry/ (git-ignored),
# which the device call names in `carry`. The binaries find libloom.so next to them.
#   scripts/device/stage.sh [--base DIR] [--variant NAME DIR]...
# --base DIR also stages an earlier build's loom-bench and libloom.so (DIR: its build folder) as
# .device-carry/base, xz-compressed, for scripts/device/gemm_ab.sh and attention_ab.sh
# (scripts/device/env.sh unpacks them on the GPU machine). Each --variant stages one more build's
# libloom.so as .device-carry/variants/NAME, which attention_ab.sh times as a further side. A
# build's sha: DIR/GIT_SHA if that file exists, else DIR's git checkout, else "unknown".
set -euo pipefail
cd "$(dirname "$0")/../.."
base=""
variant_names=() variant_dirs=()
while (($#)); do
  case $1 in
    --base) base=$(realpath "${2:?--base needs the earlier build folder}"); shift 2
            [[ -x $base/loom-bench && -f $base/libloom.so ]] || { echo "stage.sh: no loom-bench and libloom.so in $base" >&2; exit 2; } ;;
    --variant) [[ ${2:-} =~ ^[A-Za-z0-9_-]+$ ]] || { echo "stage.sh: --variant needs a NAME of letters, digits, - or _" >&2; exit 2; }
               [[ -f ${3:-}/libloom.so ]] || { echo "stage.sh: no libloom.so in '${3:-}' (--variant $2)" >&2; exit 2; }
               [[ $2 != old && $2 != new ]] || { echo "stage.sh: the variant names old and new are taken" >&2; exit 2; }
               variant_names+=("$2"); variant_dirs+=("$(realpath "$3")"); shift 3 ;;
    *) echo "stage.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
build_sha() { cat "$1/GIT_SHA" 2>/dev/null || git -C "$1" rev-parse HEAD 2>/dev/null || echo unknown; }
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
  build_sha "$base" > .device-carry/base/GIT_SHA
fi
for i in "${!variant_names[@]}"; do
  v=.device-carry/variants/${variant_names[$i]}
  mkdir -p "$v"
  cp "${variant_dirs[$i]}/libloom.so" "$v/"
  strip --strip-unneeded "$v/libloom.so" 2>/dev/null || true
  xz -T0 -6 "$v/libloom.so"
  build_sha "${variant_dirs[$i]}" > "$v/GIT_SHA"
done
du -sh .device-carry
