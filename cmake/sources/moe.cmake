# Area: expert-parallel (MoE) operators: routing on the device, dispatch, combine, the grouped GEMM (docs/MOE.md).
list(APPEND LOOM_CORE_SOURCES
  src/planner/moe_plan.cc)
list(APPEND LOOM_LIB_SOURCES
  src/ops/moe/moe.cu
  src/ops/moe/moe_names.cc
  # The grouped GEMM and moe_dispatch_gemm: one tile configuration per instantiation file (8
  # kernels each), as for the GEMM engine.
  src/ops/moe/grouped_gemm.cu
  src/ops/moe/grouped_gemm_sm90_128x256.cu
  src/ops/moe/grouped_gemm_sm90_128x128.cu
  src/ops/moe/grouped_gemm_sm90_128x64.cu
  src/ops/moe/grouped_gemm_sm90_64x128.cu
  src/ops/moe/dispatch_gemm.cu
  src/ops/moe/dispatch_gemm_sm90_128x256.cu
  src/ops/moe/dispatch_gemm_sm90_128x128.cu
  src/ops/moe/layer.cu
  src/ops/moe/layer_sm90_128x256.cu
  src/ops/moe/layer_sm90_128x128.cu
  src/ops/moe/topk.cu)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/moe_plan_test.cc
  tests/cpu/kernel_lint_test.cc
  tests/cpu/grouped_gemm_validation_test.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/moe_ops_test.cu
  tests/gpu/grouped_gemm_test.cu)
list(APPEND LOOM_BENCH_SOURCES
  tools/loom-bench/moe_bench.cu)
