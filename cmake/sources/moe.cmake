# Area: mixture-of-experts operators (issue 21): the grouped GEMM. Owner: moe.
list(APPEND LOOM_CORE_SOURCES
  src/planner/moe_plan.cc)
# One tile configuration per instantiation file (2 kernels each), as for the GEMM engine.
list(APPEND LOOM_LIB_SOURCES
  src/ops/moe/grouped_gemm.cu
  src/ops/moe/grouped_gemm_sm90_128x256.cu
  src/ops/moe/grouped_gemm_sm90_128x128.cu
  src/ops/moe/grouped_gemm_sm90_128x64.cu
  src/ops/moe/grouped_gemm_sm90_64x128.cu)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/grouped_gemm_validation_test.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/grouped_gemm_test.cu)
