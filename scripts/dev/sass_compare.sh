#!/usr/bin/env bash
# Compares the machine code (SASS) of loom's kernels between two builds, per object file, with
# addresses stripped: a refactor meant to leave kernels unchanged should print "same" for all of
# them, which a machine without a GPU can check. Needs cuobjdump (the CUDA toolkit's, or the one
# in Triton's wheel: CUOBJDUMP=.../triton/backends/nvidia/bin/cuobjdump).
#   scripts/dev/sass_compare.sh save DIR      copies build/'s CUDA objects to DIR (the baseline)
#   scripts/dev/sass_compare.sh DIR           compares build/'s CUDA objects with DIR's
set -euo pipefail
cd "$(dirname "$0")/../.."
OBJ=${CUOBJDUMP:-$(command -v cuobjdump || true)}
[[ -x $OBJ ]] || { echo "no cuobjdump: set CUOBJDUMP"; exit 2; }
objects() { find build/CMakeFiles -name '*.cu.o' | sort; }
if [[ ${1:-} == save ]]; then
  dir=$2; rm -rf "$dir"; mkdir -p "$dir"
  objects | while read -r o; do mkdir -p "$dir/$(dirname "$o")"; cp "$o" "$dir/$o"; done
  echo "saved $(objects | wc -l) objects to $dir"; exit 0
fi
base=$1
sass() { "$OBJ" -sass "$1" 2>/dev/null | grep -E '^\s+/\*[0-9a-f]{4}\*/' | sed -E 's|/\*[0-9a-f]*\*/||g; s|;.*||; s|\.L_x_[0-9]+|L|g'; }
status=0
objects | while read -r o; do
  if [[ ! -f $base/$o ]]; then echo "new      $o"; continue; fi
  if cmp -s <(sass "$base/$o") <(sass "$o"); then echo "same     $o"; else
    echo "DIFFERS  $o ($(diff <(sass "$base/$o") <(sass "$o") | grep -c '^[<>]') lines)"; fi
done
