#!/usr/bin/env bash
# On the GPU machine: the GEMM sweep of two builds in the same shuffled rounds, so that a change
# to the GEMM engine can be held to "speed unchanged" (issue 18: geomean within 1 %, no shape more
# than 2 % slower). Each round runs `loom-bench gemm --spawn 1` of both builds, in a random order;
# bench/compare.py then takes each shape's median over the rounds and compares new with old.
#
#   scripts/device/gemm_ab.sh [ROUNDS]      (default 8; the environment: AB_LIMIT_S, default 300)
#
# The builds: .device-carry/base (old: loom-bench + libloom.so, `scripts/device/stage.sh --base
# DIR`) and .device-carry/bin (new). Each binary finds its own libloom.so through LD_LIBRARY_PATH.
# Writes $OUT/gemm_ab.json (compare.py --json), $OUT/gemm_ab.txt (the table) and
# $OUT/gemm_ab_rounds.tar.gz (each round's {old,new}_<round>.json and log). Exit status:
# compare.py's (1: over a limit), or 1 if a run failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/env.sh
ROUNDS=${1:-8}
LIMIT=${AB_LIMIT_S:-300}
dir="$WORK/gemm_ab"
rm -rf "$dir"
mkdir -p "$dir"
declare -A bin_dir=([old]="$PWD/.device-carry/base" [new]="$PWD/.device-carry/bin")
for side in old new; do
  if [[ ! -x ${bin_dir[$side]}/loom-bench ]]; then
    echo "gemm_ab: no ${bin_dir[$side]}/loom-bench (stage it with scripts/device/stage.sh)" >&2
    exit 2
  fi
done
# One side once: its loom-bench with its own libloom.so.
run_side() {
  LD_LIBRARY_PATH="${bin_dir[$1]}:${LD_LIBRARY_PATH:-}" timeout --kill-after=5 "$3" \
    "${bin_dir[$1]}/loom-bench" gemm --spawn 1 --json "$2"
}
source scripts/device/ab_rounds.sh
ab_rounds gemm_ab "$ROUNDS" "$LIMIT" "$dir" run_side || exit 1
echo "gemm_ab: ${#new_files[@]} rounds of $(cat .device-carry/base/GIT_SHA 2>/dev/null | head -1) (old) and $(head -1 .device-carry/GIT_SHA 2>/dev/null) (new)" \
  | tee "$OUT/gemm_ab.txt"
python3 bench/compare.py "$(ab_join "${old_files[@]}")" "$(ab_join "${new_files[@]}")" --worst 5 \
  --fail-over 2 --fail-geomean-over 1 --json "$OUT/gemm_ab.json" 2>&1 | tee -a "$OUT/gemm_ab.txt"
rc=${PIPESTATUS[0]}
tar -czf "$OUT/gemm_ab_rounds.tar.gz" -C "$WORK" gemm_ab
echo "cuBLAS-relative (loom / cuBLAS timed in the same run):" | tee -a "$OUT/gemm_ab.txt"
python3 bench/compare.py "$(ab_join "${old_files[@]}")" "$(ab_join "${new_files[@]}")" --baseline cublas --worst 3 \
  2>&1 | tail -3 | tee -a "$OUT/gemm_ab.txt"
exit "$rc"
