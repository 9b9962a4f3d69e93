#!/usr/bin/env bash
# On the GPU machine, in one call: the MoE family's checks and its one-GPU benchmark. Uses the
# binaries staged in .device-carry/bin (scripts/device/stage.sh).
#
#   scripts/device/moe_suite.sh [bench] [layer-bench] [tests] [shared] [-- bench/moe_layer.py arguments]
#     bench   loom-bench moe --spawn 1 (W = 1: moe_dispatch_gemm vs its grouped GEMM alone vs
#             moe_dispatch + grouped_gemm), JSON in $OUT/moe_w1.json, table in $OUT/moe_w1.txt
#     layer-bench  bench/moe_layer.py through the Python package (built here against the carried
#             libloom.so; W = 1: moe_layer vs its compute-only bound, the composed loom calls and
#             torch), JSON in $OUT/moe_layer_w1.json
#     grouped-bench  bench/grouped_gemm.py $GROUPED_ARGS (loom.grouped_gemm, its round-robin claims
#             and torch._grouped_mm; the issue 21 slices), JSON in $OUT/grouped_gemm.json
#     skew-probe  bench/probes/grouped_skew.py $PROBE_ARGS (the grouped GEMM under count patterns that separate
#             tails, alignment, order and padding), JSON in $OUT/grouped_skew.json
#     placement-probe  bench/probes/grouped_placement.py $PROBE_ARGS (the same counts on fresh copies of
#             the operands: does the time follow where they lie?), JSON in $OUT/grouped_placement.json
#     tests   loom_gpu_tests 'Moe*:GroupedGemm*' on one rank, log in $OUT/one_rank_moe.log
#     shared  scripts/device/shared_gpu_suite.sh $MOE_STEPS (default: moe-2 moe-8 moe-2x2 moe-4x2),
#             ranks sharing the GPU, emulated nodes included; summaries in $OUT/suites.jsonl; each
#             step limited to STEP_LIMIT_S (default 200: on one H100 the 8-rank suite took 109 s,
#             4 x 2 137 s; the four need about 6 minutes)
#     b2b     moe_layer's back-to-back test (100 launches) in B2B_RUNS (default 3) jobs in a row at
#             each of B2B_STEPS (default: moe-2 moe-8), logs in $OUT/b2b_<i>/, summaries appended to
#             $OUT/suites.jsonl (the compute role's race fixed in 6f34ecd failed 6 jobs of 6)
#   (default: bench tests shared). Exit status 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/env.sh
LOG="$OUT/moe_suite.log"
start=$(date +%s)
log() { echo "[moe_suite +$(( $(date +%s) - start ))s] $*" | tee -a "$LOG"; }
steps=()
while (($#)) && [[ $1 != -- ]]; do steps+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
((${#steps[@]})) || steps=(bench tests shared)
BIN=.device-carry/bin
if [[ ! -x $BIN/loom_gpu_tests ]]; then echo "no $BIN: run scripts/device/stage.sh here first and carry .device-carry"; exit 1; fi
log "git $(head -1 .device-carry/GIT_SHA | cut -c1-7); $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
rc=0
# python_step LIMIT_S OUTPUT SCRIPT [ARGS...]: the Python package's extension built here against
# the carried libloom.so, then SCRIPT under a wall-clock limit (output to OUTPUT); rc=1 on failure.
python_step() {
  local limit=$1 output=$2; shift 2
  if WORK="$WORK" scripts/device/build_python_ext.sh "$LOG"; then
    LD_LIBRARY_PATH="$PWD/$BIN:${LD_LIBRARY_PATH:-}" PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}" \
      timeout --kill-after=10 "$limit" python3 "$@" > "$output" 2>&1 || rc=1
  else
    log "extension build failed"; rc=1
  fi
}
for step in "${steps[@]}"; do
  case $step in
    bench)
      LD_LIBRARY_PATH="$PWD/$BIN:${LD_LIBRARY_PATH:-}" timeout --kill-after=10 "${BENCH_LIMIT_S:-240}" \
        $BIN/loom-bench moe --spawn 1 --json "$OUT/moe_w1.json" > "$OUT/moe_w1.txt" 2>&1 || rc=1
      log "bench: exit $rc"; tail -n 14 "$OUT/moe_w1.txt" ;;
    layer-bench)
      python_step "${LAYER_BENCH_LIMIT_S:-420}" "$OUT/moe_layer_w1.txt" bench/moe_layer.py --json "$OUT/moe_layer_w1.json" "$@"
      log "layer-bench: exit $rc"; tail -n 16 "$OUT/moe_layer_w1.txt" ;;
    grouped-bench)
      # shellcheck disable=SC2086
      python_step "${GROUPED_BENCH_LIMIT_S:-200}" "$OUT/grouped_gemm.txt" bench/grouped_gemm.py ${GROUPED_ARGS:-} \
        --json "$OUT/grouped_gemm.json"
      log "grouped-bench: exit $rc"; tail -n 48 "$OUT/grouped_gemm.txt" ;;
    skew-probe)
      # shellcheck disable=SC2086
      python_step "${PROBE_LIMIT_S:-150}" "$OUT/grouped_skew.txt" bench/probes/grouped_skew.py ${PROBE_ARGS:-} \
        --json "$OUT/grouped_skew.json"
      log "skew-probe: exit $rc"; tail -n 20 "$OUT/grouped_skew.txt" ;;
    placement-probe)
      # shellcheck disable=SC2086
      python_step "${PROBE_LIMIT_S:-150}" "$OUT/grouped_placement.txt" bench/probes/grouped_placement.py ${PROBE_ARGS:-} \
        --json "$OUT/grouped_placement.json"
      log "placement-probe: exit $rc"; tail -n 8 "$OUT/grouped_placement.txt" ;;
    tests)
      LD_LIBRARY_PATH="$PWD/$BIN:${LD_LIBRARY_PATH:-}" timeout --kill-after=10 "${TESTS_LIMIT_S:-180}" \
        $BIN/loom-run -n 1 -- $BIN/loom_gpu_tests --gtest_filter='Moe*:GroupedGemm*' --gtest_brief=1 \
        > "$OUT/one_rank_moe.log" 2>&1 || rc=1
      log "tests: $(grep -E '\[ *(PASSED|FAILED) *\]' "$OUT/one_rank_moe.log" | tr '\n' ' ')" ;;
    shared)
      # shellcheck disable=SC2086
      STEP_LIMIT_S=${STEP_LIMIT_S:-200} MOE_TIMEOUT_MS=${MOE_TIMEOUT_MS:-5000} \
        scripts/device/shared_gpu_suite.sh ${MOE_STEPS:-moe-2 moe-8 moe-2x2 moe-4x2} || rc=1 ;;
    b2b)
      for i in $(seq "${B2B_RUNS:-3}"); do
        mkdir -p "$OUT/b2b_$i"
        # shellcheck disable=SC2086
        OUT="$OUT/b2b_$i" GTEST_BRIEF=0 MOE_FILTER='MoeLayerChecks.BackToBack*' STEP_LIMIT_S=${STEP_LIMIT_S:-70} \
          SUITE_BUDGET_S=${B2B_BUDGET_S:-150} MOE_TIMEOUT_MS=${MOE_TIMEOUT_MS:-5000} \
          scripts/device/shared_gpu_suite.sh ${B2B_STEPS:-moe-2 moe-8} > /dev/null 2>&1 || rc=1
        cat "$OUT/b2b_$i/suites.jsonl" >> "$OUT/suites.jsonl" 2>/dev/null
        log "b2b run $i: $(grep -h -o '"passed": [0-9]*, "failed": [0-9]*' "$OUT/b2b_$i/suites.jsonl" 2>/dev/null | tr '\n' ' ')"
      done ;;
    *) log "unknown step $step"; rc=1 ;;
  esac
done
log "done: exit $rc"
exit $rc
