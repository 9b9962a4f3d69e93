export OUT WORK=/tmp/loom-work
scripts/device/build_python_ext.sh $OUT/ext.log || exit 1
run() { PYTHONPATH=$WORK/pkg timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/torch_fused.py --ops ag_gemm,gemm_rs --m-values 1024,2048,4096,8192 --iters 30 "$@" 2>&1 | grep -E "^torch_fused|Error|error" ; }
echo "== torch alone"; run
echo "== paired"; run --loom
echo "== torch alone again"; run
