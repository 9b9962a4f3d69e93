# Area: fused tensor-parallel operators (ag_gemm, gemm_rs, gemm_ar): planner and tuning cache.
list(APPEND LOOM_CORE_SOURCES
  src/planner/tp_plan.cc)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/tp_plan_test.cc)
list(APPEND LOOM_BENCH_SOURCES
  tools/loom-bench/tp_bench.cu)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/tp_ops_test.cu)
