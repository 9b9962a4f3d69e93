#!/usr/bin/env bash
# On the GPU machine, in one call: every multi-rank path with several ranks on each GPU (the
# shared-GPU mode, LOOM_RANKS_PER_GPU; docs/ARCHITECTURE.md "Ranks sharing a GPU"). It proves
# correctness on a machine with fewer GPUs than ranks (one H200, say) and measures no speed.
#
#   scripts/device/shared_gpu_suite.sh [step ...]      (default: every step below, in this order)
#     single-2 single-4 single-8    Collectives*, TpOps*, ProxyCopyEngine*, Consistency* at 2, 4, 8 ranks
#     consistency-2 consistency-3 consistency-8
#                                   Consistency* alone (issue 23: the last rank calls something else, every
#                                   rank returns invalid_argument within 5 s naming who called what) at
#                                   2, 3, 8 ranks on one node
#     moe-2 moe-4 moe-8             Moe* (routing, dispatch, combine; MoeSmoke first) at 2, 4, 8 ranks
#                                   on one node; MOE_FILTER (default Moe*; parameterized suites are
#                                   named Moe/<Suite>.<test>/<case>: '*MoeLayer*', not 'MoeLayer*') narrows them, and every
#                                   wait gives up after MOE_TIMEOUT_MS (default 5000)
#     moe-2x1 moe-2x2 moe-2x4 moe-4x2
#                                   the same on N emulated nodes x L ranks (across nodes: the proxy)
#     ring-2 ring-3 ring-4 ring-8   RingAttention* at 2, 3, 4, 8 ranks on one node
#     ring-2x1 ring-2x2 ring-2x4    the same on N emulated nodes x L ranks (across nodes: the proxy)
#     multi-2x1 multi-2x2 multi-2x4 multi-4x2
#                                   MultiNode*, ProxyCopyEngine* on N emulated nodes x L ranks
#     stress-2x2                    MultiNodeStress at 2 x 2 with STRESS_LAUNCHES (default 500)
#                                   back-to-back launches of each operator, STRESS_RUNS (default 3)
#                                   jobs in a row
#     python-2 python-2x2           the Python GPU suite (tests/python -m gpu) under torchrun;
#                                   PYTHON_TESTS (default tests/python) narrows it to some files
#     faults                        Fault* (tests/gpu/fault_test.cu), one supervising process that starts
#                                   jobs of 2-3 ranks sharing the GPU: kill -9 of a rank inside each fused
#                                   operator (TP: one node and 2 emulated nodes; ring attention, MoE: one
#                                   node), SIGSTOP past the op timeout then SIGCONT, a rank that cannot
#                                   start (bad LOOM_* value, no GPU), two communicators with a rank killed;
#                                   FAULT_FILTER (default Fault*) narrows them (e.g. 'Fault/FaultKill.*')
#     bench-1                       loom-bench's one-GPU rows (one rank, no sharing: timings are
#                                   real): the GEMM sweep vs cuBLAS, the world-1 collectives vs a device
#                                   copy and the world-1 TP rows (what the main job prints on one GPU),
#                                   JSON in $OUT/<date>_<sha>_{gemm,collectives_world1,tp_world1}_1x<GPU>.json
#
# GTEST_BRIEF=0 prints every test's start and end (which test a stuck job was in).
# Each step is its own job under a wall-clock limit (STEP_LIMIT_S, default 240, cut to what the
# call has left of SUITE_BUDGET_S, default 570) and leaves one summary line in $OUT/suites.jsonl
# (bench/suite_summary.py: passed / failed / skipped over every rank). Everything the steps print
# goes to $OUT/shared_suite.log. Exit status 0 only if every step passed. Back here:
#   bench/suite_summary.py split <files_at>/suites.jsonl bench/results
# Uses the binaries staged in .device-carry/bin (scripts/device/stage.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/env.sh
LOG="$OUT/shared_suite.log"
SUMMARIES="$OUT/suites.jsonl"
suite_start=$(date +%s)
SUITE_BUDGET_S=${SUITE_BUDGET_S:-570}
STEP_LIMIT_S=${STEP_LIMIT_S:-240}
log() { echo "[shared_suite +$(( $(date +%s) - suite_start ))s] $*" | tee -a "$LOG"; }
steps=("$@")
((${#steps[@]})) || steps=(single-2 moe-2 multi-2x2 stress-2x2 multi-2x1 multi-4x2 multi-2x4 single-4 single-8 faults python-2 python-2x2)

BIN=.device-carry/bin
if [[ ! -x $BIN/loom_gpu_tests ]]; then echo "no $BIN: run scripts/device/stage.sh here first and carry .device-carry"; exit 1; fi
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           $(python3 -c 'import nvidia, os; p = os.path.dirname(nvidia.__path__[0]); print(" ".join(os.path.join(p, "nvidia", d, "lib") for d in ("cublas", "nccl", "cu13", "cuda_runtime")))' 2>/dev/null); do
  [[ -d $dir ]] && LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
ORIG_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
export LD_LIBRARY_PATH="$PWD/$BIN:${LD_LIBRARY_PATH:-}"
GIT_SHA=$(head -1 .device-carry/GIT_SHA 2>/dev/null | cut -c1-7)
grep -q dirty .device-carry/GIT_SHA 2>/dev/null && GIT_SHA="$GIT_SHA+"
ngpu=$(nvidia-smi -L | wc -l)
log "git $GIT_SHA; $ngpu GPU(s): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"

# limit: seconds this step may run, or nothing when under 30 are left.
limit() {
  local left=$(( SUITE_BUDGET_S - ($(date +%s) - suite_start) - 10 ))
  (( left < 30 )) && return 1
  echo $(( left < STEP_LIMIT_S ? left : STEP_LIMIT_S ))
}

# gtest_job SUITE RANKS NODES FILTER [VAR=VALUE ...]: one loom-run job of loom_gpu_tests, every rank
# writing its GoogleTest JSON, then the step's summary.
gtest_job() {
  local suite=$1 ranks=$2 nodes=$3 filter=$4; shift 4
  local per_gpu=$(( (ranks + ngpu - 1) / ngpu ))
  local dir="$WORK/$suite" t start r
  rm -rf "$dir" && mkdir -p "$dir"
  if ! t=$(limit); then log "$suite: skipped, not enough time left"; return 1; fi
  log "$suite: $ranks ranks ($per_gpu per GPU), $nodes emulated node(s), filter $filter, limit ${t}s"
  start=$(date +%s)
  env LOOM_EMULATE_NODES="$nodes" "$@" timeout --kill-after=10 "$t" $BIN/loom-run -n "$ranks" --ranks-per-gpu "$per_gpu" \
    --timeout $(( t - 5 )) -- bash -c "exec $BIN/loom_gpu_tests --gtest_filter='$filter' --gtest_brief=${GTEST_BRIEF:-1} \
    --gtest_output=json:$dir/rank\$RANK.json" >> "$LOG" 2>&1
  r=$?
  summarize "$suite" "$ranks" "$per_gpu" "$nodes" "$(( $(date +%s) - start ))" "$r" "$dir"/rank*.json
  return $r
}

summarize() {  # SUITE RANKS PER_GPU NODES WALL EXIT FILES...
  local suite=$1 ranks=$2 per_gpu=$3 nodes=$4 wall=$5 r=$6; shift 6
  local files=()
  for f in "$@"; do [[ -f $f ]] && files+=("$f"); done
  python3 bench/suite_summary.py --suite "$suite" --ranks "$ranks" --ranks-per-gpu "$per_gpu" \
    --emulated-nodes "$(( nodes > 1 ? nodes : 0 ))" --gpus "$ngpu" --wall-s "$wall" --exit-code "$r" \
    --git-sha "$GIT_SHA" "${files[@]}" 2>&1 >> "$SUMMARIES" | tee -a "$LOG"
}

python_ready=0
python_job() {  # SUITE RANKS NODES
  local suite=$1 ranks=$2 nodes=$3
  local per_gpu=$(( (ranks + ngpu - 1) / ngpu ))
  local dir="$WORK/$suite" t start r
  rm -rf "$dir" && mkdir -p "$dir"
  if (( python_ready == 0 )); then
    if WORK="$WORK" scripts/device/build_python_ext.sh "$LOG"; then python_ready=1; else python_ready=2; fi
  fi
  if (( python_ready != 1 )); then
    log "$suite: the extension did not build (see the log)"
    summarize "$suite" "$ranks" "$per_gpu" "$nodes" 0 1
    return 1
  fi
  if ! t=$(limit); then log "$suite: skipped, not enough time left"; return 1; fi
  log "$suite: $ranks ranks ($per_gpu per GPU), $nodes emulated node(s), limit ${t}s"
  start=$(date +%s)
  # PyTorch brings its own CUDA libraries.
  LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}" \
    LOOM_EMULATE_NODES="$nodes" LOOM_RANKS_PER_GPU="$per_gpu" LOOM_TEST_JUNIT_DIR="$dir" \
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[${rank}]:' timeout --kill-after=10 "$t" python3 -m torch.distributed.run \
    --standalone --nproc-per-node "$ranks" --tee 3 --log-dir "$WORK/torchrun-$suite" \
    -m pytest ${PYTHON_TESTS:-tests/python} -m gpu -p no:cacheprovider -q -rfE >> "$LOG" 2>&1
  r=$?
  # Each rank wrote $dir/rank<RANK>.xml (tests/python/conftest.py, LOOM_TEST_JUNIT_DIR).
  summarize "$suite" "$ranks" "$per_gpu" "$nodes" "$(( $(date +%s) - start ))" "$r" "$dir"/rank*.xml
  return $r
}

# The fault tests start their own jobs (each under a wall-clock limit of its own), so they run as
# one process, not under loom-run.
fault_job() {
  local suite=faults dir="$WORK/faults" t start r
  rm -rf "$dir" && mkdir -p "$dir"
  if ! t=$(limit); then log "$suite: skipped, not enough time left"; return 1; fi
  log "$suite: kill -9, SIGSTOP/SIGCONT, failure before joining, two communicators (jobs of 2-3 ranks on the GPUs), limit ${t}s"
  start=$(date +%s)
  env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE timeout --kill-after=10 "$t" $BIN/loom_gpu_tests \
    --gtest_filter="${FAULT_FILTER:-Fault*}" --gtest_brief=1 --gtest_output=json:"$dir"/rank0.json >> "$LOG" 2>&1
  r=$?
  # One supervising process (it starts the ranks of each case itself): one result file.
  summarize "$suite" 1 1 1 "$(( $(date +%s) - start ))" "$r" "$dir"/rank0.json
  return $r
}

bench_one_gpu() {
  local t r=0 gpu tag
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print $NF}')
  tag="$(date -u +%Y-%m-%d)_${GIT_SHA}"
  if ! t=$(limit); then log "bench-1: skipped, not enough time left"; return 1; fi
  log "bench-1: loom-bench gemm and world-1 collectives on one $gpu, limit ${t}s"
  timeout --kill-after=10 "$t" $BIN/loom-bench gemm --spawn 1 --json "$OUT/${tag}_gemm_1x${gpu}.json" >> "$LOG" 2>&1 || r=1
  if ! t=$(limit); then log "bench-1: no time left for the collectives"; return 1; fi
  timeout --kill-after=10 "$t" $BIN/loom-bench collectives --spawn 1 --sizes 1M,64M \
    --json "$OUT/${tag}_collectives_world1_1x${gpu}.json" >> "$LOG" 2>&1 || r=1
  if ! t=$(limit); then log "bench-1: no time left for the TP rows"; return 1; fi
  timeout --kill-after=10 "$t" $BIN/loom-bench tp --spawn 1 --m 1024,8192 \
    --json "$OUT/${tag}_tp_world1_1x${gpu}.json" >> "$LOG" 2>&1 || r=1
  log "bench-1: exit $r"
  return $r
}

rc=0
for step in "${steps[@]}"; do
  case $step in
    single-[0-9]*) gtest_job "single-node_${step#single-}ranks" "${step#single-}" 1 'Collectives*:TpOps*:ProxyCopyEngine*:Consistency*' ;;
    # Every MoE call takes milliseconds: a 5 s wait limit (MOE_TIMEOUT_MS) shows a stuck one in seconds.
    moe-[0-9]*x[0-9]*)
      layout=${step#moe-}; n=${layout%x*}; l=${layout#*x}
      gtest_job "moe_${layout}" $(( n * l )) "$n" "${MOE_FILTER:-Moe*}" LOOM_TIMEOUT_MS="${MOE_TIMEOUT_MS:-5000}" ;;
    moe-[0-9]*) gtest_job "moe_${step#moe-}ranks" "${step#moe-}" 1 "${MOE_FILTER:-Moe*}" LOOM_TIMEOUT_MS="${MOE_TIMEOUT_MS:-5000}" ;;
    consistency-[0-9]*) gtest_job "consistency_${step#consistency-}ranks" "${step#consistency-}" 1 'Consistency*' ;;
    ring-[0-9]*x[0-9]*)
      layout=${step#ring-}; n=${layout%x*}; l=${layout#*x}
      gtest_job "ring_attention_${layout}" $(( n * l )) "$n" 'RingAttention*' ;;
    ring-[0-9]*) gtest_job "ring_attention_${step#ring-}ranks" "${step#ring-}" 1 'RingAttention*' ;;
    multi-[0-9]*x[0-9]*)
      layout=${step#multi-}; n=${layout%x*}; l=${layout#*x}
      gtest_job "multi-node_${layout}" $(( n * l )) "$n" 'MultiNode*:ProxyCopyEngine*' ;;
    stress-[0-9]*x[0-9]*)
      layout=${step#stress-}; n=${layout%x*}; l=${layout#*x}
      r=0
      for run in $(seq 1 "${STRESS_RUNS:-3}"); do
        gtest_job "multi-node-stress_${layout}_run${run}" $(( n * l )) "$n" 'MultiNodeStress*' \
          LOOM_TEST_STRESS_LAUNCHES="${STRESS_LAUNCHES:-500}" || r=1
      done
      (( r == 0 )) ;;
    python-[0-9]*x[0-9]*)
      layout=${step#python-}; n=${layout%x*}; l=${layout#*x}
      python_job "python_${layout}" $(( n * l )) "$n" ;;
    python-[0-9]*) python_job "python_${step#python-}ranks" "${step#python-}" 1 ;;
    bench-1) bench_one_gpu ;;
    faults) fault_job ;;
    *) log "unknown step $step"; false ;;
  esac
  (( $? != 0 )) && rc=1
done
log "done: exit $rc"
python3 - "$SUMMARIES" <<'PY'
import json, os, sys
if not os.path.exists(sys.argv[1]):
    sys.exit(0)  # only steps without a suite summary ran (bench-1)
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"{'suite':<34}{'ranks':>6}{'per GPU':>8}{'nodes':>6}{'passed':>8}{'failed':>8}{'skipped':>8}{'wall s':>8}")
for s in rows:
    print(f"{s['suite']:<34}{s['ranks']:>6}{s['ranks_per_gpu']:>8}{s['emulated_nodes']:>6}{s['passed']:>8}"
          f"{s['failed']:>8}{s['skipped']:>8}{s['wall_s']:>8}")
PY
exit $rc
