#!/usr/bin/env bash
export OUT WORK=/tmp/loom-work
for dir in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; p = os.path.dirname(nvidia.__path__[0]); print(" ".join(os.path.join(p, "nvidia", d, "lib") for d in ("cublas", "nccl", "cu13", "cuda_runtime")))' 2>/dev/null); do
  [[ -d $dir ]] && LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH="$PWD/.device-carry/bin:$LD_LIBRARY_PATH"
B=.device-carry/bin/loom-bench
mkdir -p $WORK/t1 $WORK/t2 $WORK/t3
timeout 60 $B ag_gemm --spawn 2 --m 1024,2048 --iters 30 --timeline $WORK/t1 2>&1 | tail -5
timeout 60 $B ag_gemm --spawn 2 --m 1024 --tile 128x256 --comm-ctas 16 --iters 30 --timeline $WORK/t2 2>&1 | tail -3
timeout 60 $B ag_gemm --spawn 2 --m 1024 --tile 128x128 --comm-ctas 16 --iters 30 --timeline $WORK/t3 2>&1 | tail -3
for d in t1 t2 t3; do echo "== $d"; python3 bench/timeline_summary.py $WORK/$d 2>&1 | grep -v "^    period\|epilogue"; done
