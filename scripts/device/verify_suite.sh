#!/usr/bin/env bash
# On the GPU machine, in one call of at most CALL_BUDGET_S seconds (default 450): the suites that
# verify everything since the last GPU run, the most important first, each cut to the time left
# (a step that cannot get its minimum is skipped and says so). Uses the binaries staged in
# .device-carry (scripts/device/stage.sh). Logs and JSON under $OUT:
#   1. one rank:     GroupedGemm*, Sm90Gemm*, GemmShapes*, Attention* (attention_suite.sh tests)
#   2. shared GPU:   ring-2 ring-3 moe-2 moe-4 single-2 multi-2x2 consistency-2 ring-4 ring-8
#                    (shared_gpu_suite.sh; suites.jsonl)
#   3. failures:     a subset of Fault* (kill -9 inside ag_gemm, a multi-node gemm_ar, ring
#                    attention and MoE; SIGSTOP; two communicators)
#   4. benchmarks:   bench/grouped_gemm.py, bench/attention.py, bench/ring_attention.py (W = 1),
#                    loom-bench gemm (one GPU, against cuBLAS)
#   gemm-ab (only when named): scripts/device/gemm_ab.sh, the GEMM sweep of the build staged in
#                    .device-carry/base against this one in the same shuffled rounds (AB_ROUNDS, 6)
# VERIFY_STEPS narrows it (e.g. "tests shared"); SHARED_STEPS replaces the shared-GPU steps (each
# limited to SHARED_STEP_LIMIT_S, default 70) and
# FAULT_FILTER the failure subset (e.g. 'Fault*' for all). Exit status 0 only if every step that
# ran passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/env.sh
start=$(date +%s)
BUDGET=${CALL_BUDGET_S:-450}
LOG="$OUT/verify_suite.log"
log() { echo "[verify_suite +$(( $(date +%s) - start ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
steps=(${VERIFY_STEPS:-tests shared faults benches})
rc=0
for step in "${steps[@]}"; do
  case $step in
    tests)
      TEST_FILTER='GroupedGemm*:Sm90Gemm*:GemmShapes*:Attention*' TEST_LIMIT_S=120 \
        scripts/device/attention_suite.sh tests || rc=1 ;;
    shared)
      budget=$(( $(left) - 150 ))  # leave room for the failure subset and the benchmarks
      if (( budget < 60 )); then log "shared: skipped, $(left) s left"; rc=1; continue; fi
      STEP_LIMIT_S=${SHARED_STEP_LIMIT_S:-70} SUITE_BUDGET_S=$budget MOE_TIMEOUT_MS=5000 \
        scripts/device/shared_gpu_suite.sh ${SHARED_STEPS:-ring-2 ring-3 moe-2 moe-4 single-2 multi-2x2 consistency-2 ring-4 ring-8} \
        || rc=1 ;;
    faults)
      budget=$(( $(left) - 100 ))
      if (( budget < 40 )); then log "faults: skipped, $(left) s left"; rc=1; continue; fi
      FAULT_FILTER=${FAULT_FILTER:-'Fault/FaultKill.*/ag_gemm_2ranks_1nodes_kill1:Fault/FaultKill.*/gemm_ar_2ranks_2nodes_kill1:Fault/FaultKill.*/ring_attention_2ranks_1nodes_kill1:Fault/FaultKill.*/moe_2ranks_1nodes_kill1:Fault/FaultStop.*/0:FaultTwoComms.*'} \
        STEP_LIMIT_S=$budget SUITE_BUDGET_S=$(( budget + 10 )) scripts/device/shared_gpu_suite.sh faults || rc=1 ;;
    benches)
      # The extension is built once, by the first attention_suite.sh step that needs it.
      if (( $(left) < 60 )); then log "benches: skipped, $(left) s left"; rc=1; continue; fi
      BENCH_LIMIT_S=$(( $(left) / 3 )) RING_BENCH_LIMIT_S=$(( $(left) / 4 )) GROUPED_BENCH_LIMIT_S=$(( $(left) / 3 )) \
        scripts/device/attention_suite.sh grouped-bench bench ring-bench || rc=1
      if (( $(left) > 20 )); then
        log "loom-bench gemm (one GPU)"
        LD_LIBRARY_PATH="$PWD/.device-carry/bin:${LD_LIBRARY_PATH:-}" timeout --kill-after=5 $(( $(left) - 5 )) \
          .device-carry/bin/loom-bench gemm --spawn 1 --json "$OUT/gemm_1xH200.json" >> "$LOG" 2>&1 || rc=1
        tail -32 "$LOG"
      fi ;;
    gemm-ab)
      if (( $(left) < 60 )); then log "gemm-ab: skipped, $(left) s left"; rc=1; continue; fi
      log "gemm-ab: $(head -1 .device-carry/base/GIT_SHA 2>/dev/null) against $(head -1 .device-carry/GIT_SHA)"
      AB_LIMIT_S=$(( $(left) - 20 )) scripts/device/gemm_ab.sh "${AB_ROUNDS:-6}" >> "$LOG" 2>&1 || rc=1
      tail -40 "$OUT/gemm_ab.txt" 2>/dev/null ;;
    *) log "unknown step $step"; rc=1 ;;
  esac
done
log "done: exit $rc"
exit $rc
