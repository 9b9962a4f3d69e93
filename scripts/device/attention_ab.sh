#!/usr/bin/env bash
# On the GPU machine: bench/attention.py with two builds of libloom.so in the same shuffled rounds,
# so that a change to the attention kernels is measured against the build before it on the same
# GPU in one call. The Python extension is built once (against .device-carry/bin) and each round
# installs the side's libloom.so into the package before running; bench/compare.py then takes each
# shape's median loom time over the rounds and compares new with old.
#
#   scripts/device/attention_ab.sh [ROUNDS] [-- bench/attention.py arguments]
#     (default 4 rounds; the environment: AB_LIMIT_S, default 300; AB_BENCH, default
#     bench/attention.py: another benchmark of the package whose rows bench/compare.py matches,
#     e.g. bench/grouped_gemm.py, run the same way with its own arguments)
#
# The builds: .device-carry/base (old, `scripts/device/stage.sh --base DIR`), .device-carry/bin
# (new) and any .device-carry/variants/NAME (`stage.sh --variant NAME DIR`), each a further side of
# the same rounds. Writes $OUT/attention_ab/<side>_<round>.json and .log, $OUT/attention_ab.txt and
# .json (new against old) and $OUT/attention_ab_NAME.txt and .json (each variant against old).
# Exit status 1 if a run failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/env.sh
ROUNDS=4
[[ ${1:-} =~ ^[0-9]+$ ]] && { ROUNDS=$1; shift; }
[[ ${1:-} == -- ]] && shift
LIMIT=${AB_LIMIT_S:-300}
dir="$OUT/attention_ab"
mkdir -p "$dir"
declare -A lib=([old]="$PWD/.device-carry/base/libloom.so" [new]="$PWD/.device-carry/bin/libloom.so")
sides=(old new)
for variant in .device-carry/variants/*/; do
  [[ -d $variant ]] || continue
  name=$(basename "$variant")
  lib[$name]="$PWD/${variant}libloom.so"
  sides+=("$name")
done
for side in "${sides[@]}"; do
  [[ -f ${lib[$side]} ]] || { echo "attention_ab: no ${lib[$side]} (stage it with scripts/device/stage.sh --base DIR)" >&2; exit 2; }
done
WORK="$WORK" scripts/device/build_python_ext.sh "$dir/ext_build.log" || { echo "attention_ab: extension build failed" >&2; exit 1; }
pkg_lib="$WORK/pkg/loom/libloom.so"
[[ -f $pkg_lib ]] || { echo "attention_ab: the package has no libloom.so at $pkg_lib" >&2; exit 1; }
# Each run draws its own row order (--shuffle-shapes): with one fixed order the rows after a side's
# faster or slower ones ran warmer or cooler every round (hd128 rows with identical kernels moved by
# up to 6 % after faster hd256 ones).
BENCH=${AB_BENCH:-bench/attention.py}
bench_args=("$@")
[[ $BENCH == bench/attention.py ]] && bench_args=(--shuffle-shapes "$@")
# One side once: its libloom.so installed into the package, then the benchmark ($BENCH).
run_side() {
  cp "${lib[$1]}" "$pkg_lib" &&
    PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=5 "$3" \
      python3 "$BENCH" --json "$2" "${bench_args[@]}"
}
source scripts/device/ab_rounds.sh
ab_rounds attention_ab "$ROUNDS" "$LIMIT" "$dir" run_side "${sides[@]}"
rc=$?
cp "${lib[new]}" "$pkg_lib"
((rc == 0)) || exit 1
python3 bench/compare.py "${ab_files[old]}" "${ab_files[new]}" --json "$OUT/attention_ab.json" \
  | tee "$OUT/attention_ab.txt"
for side in "${sides[@]:2}"; do
  echo "== variant $side ($(head -1 ".device-carry/variants/$side/GIT_SHA" 2>/dev/null)) against old"
  python3 bench/compare.py "${ab_files[old]}" "${ab_files[$side]}" --json "$OUT/attention_ab_$side.json" \
    | tee "$OUT/attention_ab_$side.txt"
done
