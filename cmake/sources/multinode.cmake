# Area: multi-node operators (issue 5): kernels over N nodes x L GPUs, their planner and their
# host layer. Each operator's kernels are instantiated in their own translation unit (8 each:
# 128x256 / 128x128 x bf16 / fp16 x B layout) so no file takes long on a 2-core CI machine.
list(APPEND LOOM_CORE_SOURCES
  src/planner/multinode_plan.cc)
list(APPEND LOOM_LIB_SOURCES
  src/ops/tp/multinode/multinode.cc
  src/ops/tp/multinode/ag_gemm.cu
  src/ops/tp/multinode/reduce.cu
  src/ops/tp/multinode/gemm_rs.cu
  src/ops/tp/multinode/gemm_ar.cu
  src/ops/tp/multinode/transfer.cu)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/multinode_layout_test.cc
  tests/cpu/multinode_plan_test.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/multinode_test.cu)
list(APPEND LOOM_BENCH_SOURCES
  tools/loom-bench/multinode_bench.cu)
