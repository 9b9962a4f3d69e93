#!/usr/bin/env bash
# On the GPU machine, in one call: the attention engine's GPU tests (one rank), then
# bench/attention.py through the Python package (loom beside torch SDPA's cuDNN and flash
# backends in one process). Uses the binaries staged in .device-carry/bin (scripts/device/stage.sh).
#
#   scripts/device/attention_suite.sh [tests] [pytest] [bench] [ring-bench] [grouped-bench]
#                                     [-- bench/attention.py arguments]
#     tests       loom_gpu_tests --gtest_filter="$TEST_FILTER" (one rank; default 'Attention*')
#     pytest      tests/python/test_gpu_attention.py through the Python package
#     bench       bench/attention.py (JSON in $OUT/attention_1xH200.json)
#     ring-bench  bench/ring_attention.py at W = 1 (JSON in $OUT/ring_attention_1xH200.json)
#     ring-probe  bench/probes/ring_w1.py (the ring at W = 1 beside the engine, with and without the
#                 LSE, and at hd64 BLOCK_N 128) in RING_PROBE_ROUNDS (default 1) separate runs: JSON in
#                 $OUT/ring_w1_probe_round<n>.json
#     ring-probe-ab  the same probe with the earlier build (.device-carry/base, stage.sh --base: old) and
#                 this one (new) in RING_AB_ROUNDS (default 2) shuffled rounds within RING_PROBE_LIMIT_S
#                 (ab_rounds.sh): $OUT/ring_probe_ab/{old,new}_<round>.{json,log}
#     ring-ncu    Nsight Compute on the engine's and the ring's kernel at W = 1 (RING_NCU_SHAPE, default
#                 1x8192x32x32x128; RING_NCU_CAUSAL=1 for the causal mask; one launch each):
#                 $OUT/ring_ncu_{engine,ring}.txt
#     attention-ncu  Nsight Compute on the engine's and cuDNN's kernel for one shape (ATTN_NCU_SHAPE,
#                 default 4x8192x16x16x128; ATTN_NCU_CAUSAL=1 for the causal mask): $OUT/attention_ncu.txt
#     grouped-bench  bench/grouped_gemm.py (JSON in $OUT/grouped_gemm_1xH200.json)
#   (default: tests pytest bench; logs in $OUT/attention_suite.log)
# Each step runs under a wall-clock limit; exit status 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/env.sh
LOG="$OUT/attention_suite.log"
start=$(date +%s)
log() { echo "[attention_suite +$(( $(date +%s) - start ))s] $*" | tee -a "$LOG"; }
steps=()
while (($#)) && [[ $1 != -- ]]; do steps+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
((${#steps[@]})) || steps=(tests pytest bench)
BIN=.device-carry/bin
if [[ ! -x $BIN/loom_gpu_tests ]]; then echo "no $BIN: run scripts/device/stage.sh here first and carry .device-carry"; exit 1; fi
export LD_LIBRARY_PATH="$PWD/$BIN:${LD_LIBRARY_PATH:-}"
log "git $(head -1 .device-carry/GIT_SHA | cut -c1-7); $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | head -1)"
# The extension, built once per call against the carried libloom.so.
ext_built=0
ext() {
  ((ext_built)) && return 0
  WORK="$WORK" scripts/device/build_python_ext.sh "$LOG" || { log "extension build failed"; return 1; }
  ext_built=1
}
rc=0
# What both Nsight Compute steps collect (unlocked clocks: the kernels run as in the benchmarks).
ncu_sections=(--clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy
              --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis
              --section MemoryWorkloadAnalysis)
# py_bench STEP LIMIT_S TAIL_LINES SCRIPT ARGS...: a benchmark script through the extension under a
# wall-clock limit; its table (the last TAIL_LINES lines) goes to the console, everything to $LOG.
py_bench() {
  local step=$1 limit=$2 lines=$3
  shift 3
  if ! ext; then rc=1; return; fi
  log "$*"
  PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 "$limit" python3 "$@" 2>&1 | tee -a "$LOG" | tail -"$lines"
  local r=${PIPESTATUS[0]}
  ((r != 0)) && rc=1
  log "$step: exit $r"
}
for step in "${steps[@]}"; do
  case $step in
    tests)
      log "GPU tests: ${TEST_FILTER:-Attention*}"
      timeout --kill-after=10 ${TEST_LIMIT_S:-240} $BIN/loom_gpu_tests --gtest_filter="${TEST_FILTER:-Attention*}" \
        --gtest_output=json:$OUT/attention_tests.json >> "$LOG" 2>&1
      r=$?; ((r != 0)) && rc=1
      log "GPU tests: exit $r"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|Failure|rel|error" "$LOG" | tail -30 ;;
    pytest)
      if ! ext; then rc=1; continue; fi
      log "pytest tests/python/test_gpu_attention.py"
      # A job of one (WORLD_SIZE=1): conftest.py skips every GPU test outside a job, and a step
      # whose tests were all skipped fails.
      (cd tests/python && WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}" \
        timeout --kill-after=10 ${PYTEST_LIMIT_S:-240} \
        python3 -m pytest test_gpu_attention.py -m gpu -p no:cacheprovider -q -rfEs) > "$WORK/pytest_attention.log" 2>&1
      r=$?
      cat "$WORK/pytest_attention.log" >> "$LOG"
      if ((r == 0)) && ! grep -Eq "[0-9]+ passed" "$WORK/pytest_attention.log"; then
        log "pytest: no test ran"; r=1
      fi
      ((r != 0)) && rc=1
      log "pytest: exit $r"; grep -E "passed|failed|Error|assert" "$LOG" | tail -12 ;;
    bench) py_bench bench "${BENCH_LIMIT_S:-420}" 48 bench/attention.py --json "$OUT/attention_1xH200.json" "$@" ;;
    ring-bench)
      py_bench ring-bench "${RING_BENCH_LIMIT_S:-240}" 14 bench/ring_attention.py --json "$OUT/ring_attention_1xH200.json" ;;
    ring-probe)
      for ((round = 1; round <= ${RING_PROBE_ROUNDS:-1}; round++)); do
        py_bench ring-probe "${RING_PROBE_LIMIT_S:-150}" 8 bench/probes/ring_w1.py --json "$OUT/ring_w1_probe_round$round.json"
      done ;;
    ring-probe-ab)
      # The two builds in ab_rounds' shuffled rounds (scripts/device/ab_rounds.sh), as attention_ab.sh.
      if ! ext; then rc=1; continue; fi
      pkg_lib="$WORK/pkg/loom/libloom.so"
      probe_side() {  # SIDE JSON LEFT_S: old = .device-carry/base, new = .device-carry/bin
        local dir=bin; [[ $1 == old ]] && dir=base
        cp ".device-carry/$dir/libloom.so" "$pkg_lib" &&
          PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 "$3" python3 bench/probes/ring_w1.py --json "$2"
      }
      source scripts/device/ab_rounds.sh
      mkdir -p "$OUT/ring_probe_ab"
      ab_rounds ring-probe-ab "${RING_AB_ROUNDS:-2}" "${RING_PROBE_LIMIT_S:-150}" "$OUT/ring_probe_ab" probe_side || rc=1
      for f in "$OUT"/ring_probe_ab/{old,new}_*.log; do [[ -f $f ]] && { log "$(basename "$f")"; tail -5 "$f" | tee -a "$LOG"; }; done
      cp .device-carry/bin/libloom.so "$pkg_lib" ;;
    ring-ncu)
      if ! ext; then rc=1; continue; fi
      for which in engine:flash_fwd ring:ring_attention; do
        log "ncu ${which%%:*}"
        PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 ${RING_NCU_LIMIT_S:-120} \
          ncu "${ncu_sections[@]}" --kernel-name "regex:sm90_${which#*:}_kernel" --launch-count 1 \
          --section SourceCounters --metrics sm__inst_executed.sum,smsp__inst_executed_op_local_ld.sum,smsp__inst_executed_op_local_st.sum,lts__t_sector_hit_rate.pct \
          python3 bench/probes/ring_w1.py --shapes "${RING_NCU_SHAPE:-1x8192x32x32x128}" --causal "${RING_NCU_CAUSAL:-0}" --warmup 0 --iters 1 \
          > "$OUT/ring_ncu_${which%%:*}.txt" 2>&1
        r=$?; ((r != 0)) && rc=1
        log "ncu ${which%%:*}: exit $r"; grep -E "Duration|Executed Ipc A|Registers Per|Local|Hit Rate|sm__inst_executed.sum" "$OUT/ring_ncu_${which%%:*}.txt" | head -12
      done ;;
    attention-ncu)
      # loom's engine kernel beside cuDNN's (launch configuration, occupancy, pipes, stalls).
      if ! ext; then rc=1; continue; fi
      log "ncu engine and cuDNN: ${ATTN_NCU_SHAPE:-4x8192x16x16x128}, causal ${ATTN_NCU_CAUSAL:-0}"
      PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 ${ATTN_NCU_LIMIT_S:-150} \
        ncu "${ncu_sections[@]}" --kernel-name "regex:sm90_flash_fwd|sdpa|fprop|fmha" --launch-count 3 \
        python3 bench/probes/attention_launch.py --shape "${ATTN_NCU_SHAPE:-4x8192x16x16x128}" \
        --causal "${ATTN_NCU_CAUSAL:-0}" > "$OUT/attention_ncu.txt" 2>&1
      r=$?; ((r != 0)) && rc=1
      log "attention-ncu: exit $r"
      grep -E "^  [a-zA-Z_].*\(|Duration|Registers Per|Block Size|Grid Size|Dynamic Shared|Executed Ipc A|Issue Slots Busy|Achieved Occupancy" \
        "$OUT/attention_ncu.txt" | head -40 ;;
    grouped-bench)
      py_bench grouped-bench "${GROUPED_BENCH_LIMIT_S:-240}" 34 bench/grouped_gemm.py --json "$OUT/grouped_gemm_1xH200.json" ;;
    *) log "unknown step $step"; rc=1 ;;
  esac
done
log "done: exit $rc"
exit $rc
