#!/usr/bin/env bash
# On the GPU machine: bench/attention.py with two builds of libloom.so in the same shuffled rounds,
# so that a change to the attention kernels is measured against the build before it on the same
# GPU in one call. The Python extension is built once (against .device-carry/bin) and each round
# installs the side's libloom.so into the package before running; bench/compare.py then takes each
# shape's median loom time over the rounds and compares new with old.
#
#   scripts/device/attention_ab.sh [ROUNDS] [-- bench/attention.py arguments]
#     (default 4 rounds; the environment: AB_LIMIT_S, default 300)
#
# The builds: .device-carry/base (old, `scripts/device/stage.sh --base DIR`) and .device-carry/bin
# (new). Writes $OUT/attention_ab/{old,new}_<round>.json and .log, $OUT/attention_ab.txt (the
# comparison) and $OUT/attention_ab.json. Exit status 1 if a run failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/env.sh
ROUNDS=4
[[ ${1:-} =~ ^[0-9]+$ ]] && { ROUNDS=$1; shift; }
[[ ${1:-} == -- ]] && shift
LIMIT=${AB_LIMIT_S:-300}
start=$(date +%s)
dir="$OUT/attention_ab"
mkdir -p "$dir"
declare -A lib=([old]="$PWD/.device-carry/base/libloom.so" [new]="$PWD/.device-carry/bin/libloom.so")
for side in old new; do
  [[ -f ${lib[$side]} ]] || { echo "attention_ab: no ${lib[$side]} (stage it with scripts/device/stage.sh --base DIR)" >&2; exit 2; }
done
WORK="$WORK" scripts/device/build_python_ext.sh "$dir/ext_build.log" || { echo "attention_ab: extension build failed" >&2; exit 1; }
pkg_lib="$WORK/pkg/loom/libloom.so"
[[ -f $pkg_lib ]] || { echo "attention_ab: the package has no libloom.so at $pkg_lib" >&2; exit 1; }
old_files=() new_files=()
for (( r = 1; r <= ROUNDS; r++ )); do
  for side in $(printf 'old\nnew\n' | shuf); do
    left=$(( LIMIT - ($(date +%s) - start) ))
    if (( left < 10 )); then echo "attention_ab: out of time after $((r - 1)) rounds" >&2; break 2; fi
    cp "${lib[$side]}" "$pkg_lib"
    json="$dir/${side}_$r.json"
    if ! PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=5 "$left" \
        python3 bench/attention.py --json "$json" "$@" > "$dir/${side}_$r.log" 2>&1; then
      echo "attention_ab: round $r, $side failed (log: $dir/${side}_$r.log)" >&2
      tail -5 "$dir/${side}_$r.log" >&2
      exit 1
    fi
    if [[ $side == old ]]; then old_files+=("$json"); else new_files+=("$json"); fi
  done
done
cp "${lib[new]}" "$pkg_lib"
((${#old_files[@]})) || { echo "attention_ab: no complete round" >&2; exit 1; }
python3 bench/compare.py "$(IFS=,; echo "${old_files[*]}")" "$(IFS=,; echo "${new_files[*]}")" --json "$OUT/attention_ab.json" | tee "$OUT/attention_ab.txt"
