# Area: multi-node operators (issue 5): kernels over N nodes x L GPUs and their launchers.
# Each operator's launcher instantiates its 8 kernels in its own translation unit (128x256 /
# 128x128 x bf16 / fp16 x B layout) so no file takes long on a 2-core CI machine.
list(APPEND LOOM_LIB_SOURCES
  src/ops/multinode_ag_gemm.cu
  src/ops/multinode_gemm_rs.cu
  src/ops/multinode_gemm_ar.cu
  src/ops/multinode_transfer.cu)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/multinode_layout_test.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/multinode_test.cu)
list(APPEND LOOM_BENCH_SOURCES
  tools/loom-bench/multinode_bench.cu)
