#!/usr/bin/env bash
# On the GPU machine, in one call: the GPU test suite and the benchmarks, with logs and JSON
# under $OUT (at most 8 files come back, so logs are combined).
#   scripts/device/gpu_suite.sh [tests] [coll] [coll-tune] [gemm]     (default: tests coll gemm)
# Uses the binaries staged in .device-carry/bin (scripts/device/stage.sh), else builds here.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LOOM_BOOTSTRAP_TIMEOUT_MS=${LOOM_BOOTSTRAP_TIMEOUT_MS:-60000}
OUT=${OUT:-/tmp/loom-out}
mkdir -p "$OUT"
steps=("$@")
((${#steps[@]})) || steps=(tests coll gemm)
summary="$OUT/summary.txt"
log() { echo "$*" | tee -a "$summary"; }

# Runtime libraries the staged binaries need (cuBLAS, NCCL) wherever this image keeps them.
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           $(python3 -c 'import nvidia, os; p = os.path.dirname(nvidia.__path__[0]); print(" ".join(os.path.join(p, "nvidia", d, "lib") for d in ("cublas", "nccl", "cu13", "cuda_runtime")))' 2>/dev/null); do
  [[ -d $dir ]] && LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
LD_LIBRARY_PATH="$PWD/.device-carry/bin:$PWD/build:${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH

BIN=.device-carry/bin
if [[ ! -x $BIN/loom-bench ]]; then
  log "no staged binaries; building here"
  cmake --preset default >/dev/null && cmake --build --preset default -j 16 > "$OUT/build.log" 2>&1 || { log "BUILD FAILED"; tail -50 "$OUT/build.log"; exit 1; }
  BIN=build
fi
log "git: $(cat .device-carry/GIT_SHA 2>/dev/null | tr '\n' ' ')"
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a "$summary"
nvidia-smi topo -m >> "$summary" 2>&1
ngpu=$(nvidia-smi -L | wc -l)
ldd $BIN/loom-bench | grep -E "not found|cublas|nccl|crypto" >> "$summary"

rc=0
for step in "${steps[@]}"; do
  start=$(date +%s)
  case $step in
    tests)
      # Multi-rank suites on every GPU, then the single-GPU GEMM suite on one rank (a GEMM bug
      # that poisons the context must not hide the other results).
      timeout 300 $BIN/loom-run -n "$ngpu" --timeout 280 -- $BIN/loom_gpu_tests --gtest_filter='-*Gemm*' \
        > "$OUT/gpu_tests.log" 2>&1
      r1=$?
      timeout 300 $BIN/loom-run -n 1 --timeout 280 -- $BIN/loom_gpu_tests --gtest_filter='*Gemm*' \
        >> "$OUT/gpu_tests.log" 2>&1
      r2=$?
      r=$(( r1 != 0 || r2 != 0 ))
      grep -E "PASSED|FAILED|Failure|error:|loom-run" "$OUT/gpu_tests.log" | head -60 | tee -a "$summary" ;;
    coll)
      timeout 150 $BIN/loom-bench collectives --spawn "$ngpu" --sizes 1M,64M,512M --iters 30 \
        --json "$OUT/bench_collectives.json" > "$OUT/bench.log" 2>&1
      r=$?; tail -15 "$OUT/bench.log" | tee -a "$summary" ;;
    coll-tune)
      timeout 200 $BIN/loom-bench collectives --spawn "$ngpu" --sizes 64M,512M --ctas 8,16,24,32,48,66 --iters 20 \
        --json "$OUT/bench_collectives_tune.json" >> "$OUT/bench.log" 2>&1
      r=$?; tail -40 "$OUT/bench.log" | tee -a "$summary" ;;
    gemm)
      timeout 400 $BIN/loom-bench gemm --spawn 1 --json "$OUT/bench_gemm.json" >> "$OUT/bench.log" 2>&1
      r=$?; tail -30 "$OUT/bench.log" | tee -a "$summary" ;;
    gemm-tune)
      # Small-M shapes with every tile forced, to check the heuristic's choice.
      for tile in 128x256 128x128 128x64 64x128; do
        timeout 100 $BIN/loom-bench gemm --spawn 1 --m 128,512,1024 --tile $tile --iters 20 \
          --json "$OUT/bench_gemm_tune_$tile.json" >> "$OUT/bench_tune.log" 2>&1
      done
      r=$?; grep -E "^gemm" "$OUT/bench_tune.log" | tee -a "$summary" ;;
    *) log "unknown step $step"; r=2 ;;
  esac
  log "step $step: exit $r in $(( $(date +%s) - start )) s"
  ((r != 0)) && rc=1
done
exit $rc
