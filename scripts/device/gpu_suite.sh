#!/usr/bin/env bash
# On the GPU machine, in one call: the GPU test suite and the benchmarks, with logs and JSON
# under $OUT (at most 8 files come back, so logs are combined).
#   scripts/device/gpu_suite.sh [tests] [tp-tests] [coll] [coll-tune] [gemm] [gemm-tune] [gemm-raster]
#                               [tp] [torch] [tp-tune] [tail-ab] [timeline] [merge]  (default: tests coll gemm)
#   tp        loom-bench tp (ag_gemm, gemm_rs, gemm_ar at issue 4's shapes) vs cuBLAS, NCCL + cuBLAS
#   torch     bench/torch_fused.py under torchrun (PyTorch's fused ag_gemm / gemm_rs), with loom's op
#             timed beside it in the same process when its Python extension builds here
#   merge     joins both into $OUT/bench_tp_merged.json and prints the table; it also runs by itself,
#             last, whenever tp or torch ran
#   tp-tune   loom-bench tune (TUNE_OPS, TUNE_M: default every op and M; TUNE_CTAS, TUNE_TILE and
#             TUNE_NO_DECOMPOSED=1 narrow the candidates), writes
#             $OUT/tuning_cache.json; a later tp step in the same call plans from it
#   tail-ab   the fused operators with and without the tail split, paired in one process (TAIL_OPS, TAIL_M,
#             TAIL_ROUNDS, TAIL_PIECES, TAIL_VARIANT)
#   timeline  per-tile timelines of the fused operators and loom's GEMM at TIMELINE_M (default
#             4096,8192): $OUT/timeline_summary.txt, the CSVs in $OUT/timelines.tar.gz
#   net       the inter-node path with the GPUs split into 2 emulated nodes (LOOM_EMULATE_NODES=2):
#             the multi-node GPU tests (copy_engine transport), then loom-bench multinode with the
#             NIC emulated at 50 GB/s (issue 4's shapes, then gemm_rs / gemm_ar at 4x K); log in
#             $OUT/net.log, JSON in $OUT/bench_multinode.json and $OUT/bench_multinode_long_k.json
#   net-stress  the multi-node operators' tests repeated NET_STRESS_REPEAT times (default 6), with a
#             5 s device deadline; log in $OUT/net_stress.log
#   net-fabric  the multi-node tests once more over libfabric (LOOM_TRANSPORT=fabric), where a
#             provider with GPU memory (FI_HMEM) is installed; informational (never fails the suite)
# The whole call stays within SUITE_BUDGET_S (default 570 s, under the 10-minute call limit): each
# step's timeout is cut to the time left, and a step that cannot get its minimum is skipped.
# Uses the binaries staged in .device-carry/bin (scripts/device/stage.sh), else builds here.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LOOM_BOOTSTRAP_TIMEOUT_MS=${LOOM_BOOTSTRAP_TIMEOUT_MS:-60000}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/loom-out}
WORK=${WORK:-/tmp/loom-work}  # intermediate files that need not come back
mkdir -p "$OUT" "$WORK"
suite_start=$(date +%s)
SUITE_BUDGET_S=${SUITE_BUDGET_S:-570}
steps=("$@")
((${#steps[@]})) || steps=(tests coll gemm)
summary="$OUT/summary.txt"
log() { echo "$*" | tee -a "$summary"; }
# budget MAX MIN: prints the seconds a step may run (at most MAX, leaving 10 s for the merge and
# the summary), or nothing when fewer than MIN are left.
budget() {
  local left=$(( SUITE_BUDGET_S - ($(date +%s) - suite_start) - 10 ))
  (( left < $2 )) && return 1
  echo $(( left < $1 ? left : $1 ))
}
ORIG_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}  # PyTorch gets its own libraries, not the ones below

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

# The final table: loom-bench's tensor-parallel rows with PyTorch's fused times joined in.
merge_tp() {
  [[ -f $WORK/bench_tp.json ]] || { log "merge: no loom-bench tp results (run the tp step)"; return 1; }
  if python3 bench/merge_results.py --loom "$WORK/bench_tp.json" --torch "$WORK/torch_fused.json" --allow-missing-torch \
       --out "$OUT/bench_tp_merged.json" > "$WORK/tp_table.txt" 2>> "$OUT/bench.log"; then
    return 0
  fi
  # The raw files come back instead, so nothing measured is lost.
  cp "$WORK/bench_tp.json" "$OUT/" 2>/dev/null
  cp "$WORK/torch_fused.json" "$OUT/" 2>/dev/null
  log "merge: bench/merge_results.py failed (see bench.log); raw JSON copied to \$OUT"
  return 1
}

rc=0
merge_wanted=0
for step in "${steps[@]}"; do
  start=$(date +%s)
  r=0
  case $step in
    tests)
      # Multi-rank suites on every GPU, then the single-GPU GEMM suite on one rank (a GEMM bug
      # that poisons the context must not hide the other results).
      if t=$(budget 300 60); then
        timeout $t $BIN/loom-run -n "$ngpu" --timeout $((t - 20)) -- $BIN/loom_gpu_tests --gtest_filter='-*Gemm*' \
          > "$OUT/gpu_tests.log" 2>&1
        r1=$?
      else r1=124; log "tests: skipped, not enough time left"; fi
      if t=$(budget 300 60); then
        timeout $t $BIN/loom-run -n 1 --timeout $((t - 20)) -- $BIN/loom_gpu_tests --gtest_filter='*Gemm*' \
          >> "$OUT/gpu_tests.log" 2>&1
        r2=$?
      else r2=124; log "tests (GEMM, one rank): skipped, not enough time left"; fi
      r=$(( r1 != 0 || r2 != 0 ))
      grep -E "PASSED|FAILED|Failure|error:|loom-run" "$OUT/gpu_tests.log" | head -60 | tee -a "$summary" ;;
    tp-tests)
      # Only the fused tensor-parallel operators' tests (also part of `tests`).
      if t=$(budget 300 60); then
        timeout $t $BIN/loom-run -n "$ngpu" --timeout $((t - 20)) -- $BIN/loom_gpu_tests --gtest_filter='TpOps*' \
          >> "$OUT/gpu_tests.log" 2>&1
        r=$?
        grep -E "PASSED|FAILED|Failure|refused|error:|loom-run" "$OUT/gpu_tests.log" | tail -60 | tee -a "$summary"
      else r=124; log "tp-tests: skipped, not enough time left"; fi ;;
    coll)
      if t=$(budget 150 60); then
        timeout $t $BIN/loom-bench collectives --spawn "$ngpu" --sizes 1M,64M,512M --iters 30 \
          --json "$OUT/bench_collectives.json" >> "$OUT/bench.log" 2>&1
        r=$?; tail -15 "$OUT/bench.log" | tee -a "$summary"
      else r=124; log "coll: skipped, not enough time left"; fi ;;
    coll-tune)
      if t=$(budget 200 60); then
        timeout $t $BIN/loom-bench collectives --spawn "$ngpu" --sizes 64M,512M --ctas 8,16,24,32,48,66 --iters 20 \
          --json "$OUT/bench_collectives_tune.json" >> "$OUT/bench.log" 2>&1
        r=$?; tail -40 "$OUT/bench.log" | tee -a "$summary"
      else r=124; log "coll-tune: skipped, not enough time left"; fi ;;
    gemm)
      if t=$(budget 400 60); then
        timeout $t $BIN/loom-bench gemm --spawn 1 --json "$OUT/bench_gemm.json" >> "$OUT/bench.log" 2>&1
        r=$?; tail -30 "$OUT/bench.log" | tee -a "$summary"
      else r=124; log "gemm: skipped, not enough time left"; fi ;;
    gemm-raster)
      # loom's GEMM at ag_gemm's per-rank shape with the raster group height swept (both GPUs
      # busy, as in the tp step): $OUT/bench_gemm_raster.log, one JSON per group height.
      for g in ${RASTER_GROUPS:-0 1 2 4 8 16 32}; do
        if t=$(budget 60 20); then
          timeout $t $BIN/loom-bench gemm --spawn 2 --m ${RASTER_M:-2048,4096} --nk ${RASTER_NK:-14336x8192} \
            --group-m $g --iters 40 --json "$OUT/bench_gemm_raster_g$g.json" >> "$OUT/bench_gemm_raster.log" 2>&1 || r=$?
        else r=124; log "gemm-raster g=$g: skipped, not enough time left"; fi
      done
      tail -150 "$OUT/bench_gemm_raster.log" | tee -a "$summary" ;;
    gemm-tune)
      # Small-M shapes with every tile forced, to check the heuristic's choice.
      for tile in 128x256 128x128 128x64 64x128; do
        if t=$(budget 100 30); then
          timeout $t $BIN/loom-bench gemm --spawn 1 --m 128,512,1024 --tile $tile --iters 20 \
            --json "$OUT/bench_gemm_tune_$tile.json" >> "$OUT/bench_tune.log" 2>&1 || r=$?
        else r=124; log "gemm-tune $tile: skipped, not enough time left"; fi
      done
      grep -E "^gemm" "$OUT/bench_tune.log" | tee -a "$summary" ;;
    tp)
      # ag_gemm, gemm_rs, gemm_ar at issue 4's shapes (M 1024..32768) beside cuBLAS and NCCL + cuBLAS.
      merge_wanted=1
      if t=$(budget 300 90); then
        # After tp-tune in the same call, the operators plan from its cache (the plan column says so).
        [[ -f $OUT/tuning_cache.json ]] && export LOOM_TUNING_CACHE="$OUT/tuning_cache.json"
        timeout $t $BIN/loom-bench tp --spawn "$ngpu" --iters 30 --json "$WORK/bench_tp.json" >> "$OUT/bench.log" 2>&1
        r=$?; grep -E "^(ag_gemm|gemm_rs|gemm_ar) " "$OUT/bench.log" | tail -20 | tee -a "$summary"
      else r=124; log "tp: skipped, not enough time left"; fi ;;
    tail-ab)
      # The fused operators (TAIL_OPS, default all three) with the planner's tail split (or
      # --tail-pieces TAIL_PIECES), and with
      # --tail-pieces TAIL_VARIANT (default 1: none) in the same alternating rounds, at TAIL_M
      # (default 8192,16384,32768), TAIL_ROUNDS invocations (default 2): $OUT/tail_ab.log, the
      # JSONs in $OUT/tail_ab_json.tar.gz.
      mkdir -p "$WORK/tail_ab"  # kept across calls on one machine: every run of the step comes back
      for round in $(seq 1 "${TAIL_ROUNDS:-2}"); do
        for op in ${TAIL_OPS:-ag_gemm gemm_rs gemm_ar}; do
          if t=$(budget 90 30); then
            timeout $t $BIN/loom-bench $op --spawn "$ngpu" --m "${TAIL_M:-8192,16384,32768}" --iters 30 \
              --tail-pieces "${TAIL_PIECES:--1}" --variant-tail-pieces "${TAIL_VARIANT:-1}" \
              --json "$WORK/tail_ab/${op}_p${TAIL_PIECES:--1}_v${TAIL_VARIANT:-1}_round$round.json" >> "$OUT/tail_ab.log" 2>&1 || r=$?
          else r=124; log "tail-ab $op round $round: skipped, not enough time left"; fi
        done
      done
      tar -C "$WORK" -czf "$OUT/tail_ab_json.tar.gz" tail_ab
      grep -E "variant / loom|^(ag_gemm|gemm_rs|gemm_ar) +[0-9]" "$OUT/tail_ab.log" | tee -a "$summary" ;;
    timeline)
      # Per-tile timelines of the fused operators and of loom's GEMM alone (loom-bench --timeline),
      # summarised by bench/timeline_summary.py; the CSVs come back as one archive.
      if t=$(budget 200 60); then
        rm -rf "$WORK/timeline" && mkdir -p "$WORK/timeline"
        timeout $t $BIN/loom-bench tp --spawn "$ngpu" --m ${TIMELINE_M:-4096,8192} --iters 20 \
          --timeline "$WORK/timeline" --json "$OUT/bench_tp_timeline.json" >> "$OUT/bench.log" 2>&1
        r=$?
        python3 bench/timeline_summary.py "$WORK/timeline" > "$OUT/timeline_summary.txt" 2>&1
        tar -C "$WORK" -czf "$OUT/timelines.tar.gz" timeline
        cat "$OUT/timeline_summary.txt" | tee -a "$summary"
      else r=124; log "timeline: skipped, not enough time left"; fi ;;
    torch)
      # PyTorch's fused ag_gemm / gemm_rs at the same shapes, with PyTorch's own libraries.
      # With loom's Python extension built here, loom's op is timed beside torch's in the same
      # process (alternating rounds, same inputs): the `paired` column of the merged table.
      merge_wanted=1
      paired=()
      if WORK="$WORK" scripts/device/build_python_ext.sh "$OUT/bench.log"; then
        paired=(--loom)
      else log "torch: loom's Python extension did not build (bench.log); torch timed alone"; fi
      if t=$(budget 150 90); then
        LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}" \
          timeout $t python3 -m torch.distributed.run --standalone \
          --nproc-per-node "$ngpu" bench/torch_fused.py --json "$WORK/torch_fused.json" --iters 60 "${paired[@]}" \
          --deadline-s $((t - 15)) --timeout-s 120 >> "$OUT/bench.log" 2>&1
        r=$?; grep -E "^torch_fused|torch_fused.py:" "$OUT/bench.log" | tail -14 | tee -a "$summary"
      else r=124; log "torch: skipped, not enough time left"; fi ;;
    tp-tune)
      if t=$(budget 400 120); then
        timeout $t $BIN/loom-bench tune --spawn "$ngpu" --iters 20 --cache "$OUT/tuning_cache.json" \
          --ops "${TUNE_OPS:-ag_gemm,gemm_rs,gemm_ar}" --m "${TUNE_M:-1024,2048,4096,8192,16384,32768}" \
          ${TUNE_CTAS:+--comm-ctas "$TUNE_CTAS"} ${TUNE_TILE:+--tile "$TUNE_TILE"} ${TUNE_NO_DECOMPOSED:+--no-decomposed} \
          >> "$OUT/bench.log" 2>&1
        r=$?; grep -E "^tune .* -> |^tune: " "$OUT/bench.log" | tail -20 | tee -a "$summary"
      else r=124; log "tp-tune: skipped, not enough time left"; fi ;;
    net)
      # 2 emulated nodes of ngpu/2 GPUs; traffic between them goes through the proxy and the
      # copy engine exactly as between real nodes. Tests without shaping (fast), bench shaped.
      # The operators' tests and the standalone proxy tests in separate jobs, so that a failure
      # in one (which can leave its bootstrap unusable) does not take the other down with it.
      r1=0
      for filter in 'MultiNode*' 'ProxyCopyEngine*'; do
        if t=$(budget 150 40); then
          LOOM_EMULATE_NODES=2 timeout $t $BIN/loom-run -n "$ngpu" --timeout $((t - 10)) -- $BIN/loom_gpu_tests \
            --gtest_filter="$filter" >> "$OUT/net.log" 2>&1 || r1=1
        else r1=124; log "net (tests $filter): skipped, not enough time left"; fi
      done
      grep -E "PASSED|FAILED|Failure|error:|loom-run|Skipped|SKIPPED" "$OUT/net.log" | head -60 | tee -a "$summary"
      if t=$(budget 270 90); then
        LOOM_EMULATE_NODES=2 LOOM_EMULATE_NET_GBPS=50 timeout $t $BIN/loom-bench multinode --spawn "$ngpu" --iters 20 \
          --json "$OUT/bench_multinode.json" >> "$OUT/net.log" 2>&1
        r2=$?
        # The closing table (printed last by loom-bench).
        awk '/^op +M x N x K +loom ms +gemm/{p=1} p' "$OUT/net.log" | tee -a "$summary"
        grep -E "loom-bench:|ERROR" "$OUT/net.log" | tail -10 | tee -a "$summary"
      else r2=124; log "net (bench): skipped, not enough time left"; fi
      # The reduce operators where the GEMM outlasts the transfer (4x the K): with one GPU per
      # node gemm_ar moves twice gemm_rs's bytes, so at the shapes above its h cannot pass h_max.
      if t=$(budget 150 60); then
        LOOM_EMULATE_NODES=2 LOOM_EMULATE_NET_GBPS=50 timeout $t $BIN/loom-bench multinode --spawn "$ngpu" --iters 20 \
          --ops gemm_rs,gemm_ar --m 8192,16384 --k 57344 --json "$OUT/bench_multinode_long_k.json" > "$WORK/net_long_k.log" 2>&1
        r2=$(( r2 != 0 || $? != 0 ))
        awk '/^op +M x N x K +loom ms +gemm/{p=1} p' "$WORK/net_long_k.log" | tee -a "$summary" "$OUT/net.log" >/dev/null
        grep -E "loom-bench:|ERROR" "$WORK/net_long_k.log" | tail -5 | tee -a "$summary"
      fi
      r=$(( r1 != 0 || r2 != 0 )) ;;
    net-stress)
      # The multi-node operators' tests, repeated (NET_STRESS_REPEAT, default 6) with a short
      # device deadline: an intermittent stall shows up as a timeout whose message names the CTAs
      # still waiting and the proxy lanes' state (Communicator::synchronize).
      if t=$(budget 200 60); then
        LOOM_EMULATE_NODES=2 LOOM_TIMEOUT_MS=5000 timeout $t $BIN/loom-run -n "$ngpu" --timeout $((t - 10)) -- \
          $BIN/loom_gpu_tests --gtest_filter='MultiNode/MultiNodeOps.*' --gtest_repeat="${NET_STRESS_REPEAT:-6}" \
          --gtest_brief=1 >> "$OUT/net_stress.log" 2>&1
        r=$?
        grep -E "PASSED|FAILED|Failure|timeout|stuck|waiting|loom-run" "$OUT/net_stress.log" | head -40 | tee -a "$summary"
      else r=124; log "net-stress: skipped, not enough time left"; fi ;;
    net-fabric)
      # Informational: libfabric with GPU memory is rarely installed on the GPU machine.
      if ! ldconfig -p 2>/dev/null | grep -q "libfabric.so.1"; then
        log "net-fabric: libfabric.so.1 not installed here; fabric not run"
      elif t=$(budget 200 60); then
        LOOM_EMULATE_NODES=2 LOOM_TRANSPORT=fabric timeout $t $BIN/loom-run -n "$ngpu" --timeout $((t - 20)) -- \
          $BIN/loom_gpu_tests --gtest_filter='MultiNodeNet*:MultiNodeOps*ag_gemm_nk*:MultiNodeStress*' \
          >> "$OUT/net.log" 2>&1
        log "net-fabric: exit $? (informational)"
        grep -E "PASSED|FAILED|unsupported|fabric" "$OUT/net.log" | tail -15 | tee -a "$summary"
      fi ;;
    merge) merge_wanted=1 ;;
    *) log "unknown step $step"; r=2 ;;
  esac
  log "step $step: exit $r in $(( $(date +%s) - start )) s"
  ((r != 0)) && rc=1
done
if ((merge_wanted)); then
  merge_tp || rc=1
  [[ -f $WORK/tp_table.txt ]] && tee -a "$summary" < "$WORK/tp_table.txt"  # printed last
fi
exit $rc
