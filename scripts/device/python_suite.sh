#!/usr/bin/env bash
# On the GPU machine (no network): the Python package's GPU suite, in one call of ~4 minutes.
#   1. builds only the extension loom._C against the carried .device-carry/bin/libloom.so
#      (scripts/device/build_python_ext.sh) into $WORK/pkg/loom (PYTHONPATH=$WORK/pkg)
#   2. the GPU pytest suite (tests/python, marker gpu) as every rank under torchrun, including the
#      CUDA-graph test and the per-call overhead measurement (-> $OUT/python_overhead.json)
#   3. examples/tp_mlp.py under torchrun (-> $OUT/tp_mlp.json)
# Everything printed goes to $OUT/python_suite.log (at most 4 files come back). Exit status 0
# only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/env.sh
LOG="$OUT/python_suite.log"
PY=${PYTHON:-python3}
start=$(date +%s)
log() { echo "[python_suite +$(( $(date +%s) - start ))s] $*" | tee -a "$LOG"; }
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
NPROC=${NPROC:-$(( ngpu < 2 ? ngpu : 2 ))}
log "git: $(cat .device-carry/GIT_SHA 2>/dev/null | tr '\n' ' ') gpus: $ngpu, ranks: $NPROC"
$PY -c 'import sys, torch, nanobind; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nanobind", nanobind.__version__)' 2>&1 | tee -a "$LOG"

rc=0
# 1. extension only
if WORK="$WORK" PYTHON="$PY" scripts/device/build_python_ext.sh "$LOG"; then
  log "extension built: $(ls "$WORK"/pkg/loom/*.so | tr '\n' ' ')"
else
  log "EXTENSION BUILD FAILED"; tail -40 "$LOG"; exit 1
fi
export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"
(cd /tmp && $PY -c 'import loom, loom.torch; print("import ok:", loom.__version__, loom.__file__)') 2>&1 | tee -a "$LOG"

torchrun() {  # per-rank output prefixed with [rank]: on the console (and so in the log)
  local limit=$1; shift
  TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[${rank}]:' timeout --kill-after=10 "$limit" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    --tee 3 --log-dir "$WORK/torchrun-$(date +%s%N)" "$@"
}

# 2. GPU pytest suite (every op vs torch, CUDA graph x100, overhead -> JSON)
log "GPU pytest under torchrun"
LOOM_TEST_PY_OVERHEAD_JSON="$OUT/python_overhead.json" torchrun 170 -m pytest tests/python/test_gpu.py -m gpu -p no:cacheprovider \
  -q -rfE --durations=5 >> "$LOG" 2>&1
r=$?; ((r != 0)) && rc=1
log "GPU pytest: exit $r"
grep -E "^\[0\]:.*(passed|failed|error)|^\[[0-9]+\]:(FAILED|ERROR)|per-call|^\[0\]:(op|all_reduce|gemm|ag_gemm) " "$LOG" | tail -40

# 3. the example: loom vs torch + NCCL, checked and timed
left=$(( 235 - ($(date +%s) - start) ))
if (( left > 40 )); then
  log "examples/tp_mlp.py"
  torchrun "$left" examples/tp_mlp.py --json "$OUT/tp_mlp.json" >> "$LOG" 2>&1
  r=$?; ((r != 0)) && rc=1
  log "tp_mlp: exit $r"
  grep -E "^\[0\]:(TP MLP|block|loom|torch)" "$LOG" | tail -6
else
  log "tp_mlp: skipped, only ${left}s left"; rc=1
fi
log "done: exit $rc"
exit $rc
