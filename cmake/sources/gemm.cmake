# Area: GEMM engine (issue 3). Owner: gemm.
list(APPEND LOOM_CORE_SOURCES
  src/planner/gemm_heuristic.cc)
# The kernel instantiations are split one tile configuration per file (4 kernels each) so that
# no translation unit takes long on a 2-core CI machine.
list(APPEND LOOM_LIB_SOURCES
  src/ops/gemm/gemm.cu
  src/ops/gemm/gemm_tensor_map.cc
  src/ops/gemm/gemm_sm90_128x256.cu
  src/ops/gemm/gemm_sm90_128x128.cu
  src/ops/gemm/gemm_sm90_128x64.cu
  src/ops/gemm/gemm_sm90_64x128.cu)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/gemm_validation_test.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/gemm_test.cu)
list(APPEND LOOM_BENCH_SOURCES
  tools/loom-bench/gemm_bench.cu)
