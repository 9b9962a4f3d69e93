# Area: communicator, NVLink collectives and their planner, loom-bench driver. Owner: lead.
list(APPEND LOOM_CORE_SOURCES
  src/planner/collective_plan.cc)
list(APPEND LOOM_LIB_SOURCES
  src/runtime/communicator.cc
  src/ops/collectives/collectives.cu
  src/ops/collectives/all_gather.cu
  src/ops/collectives/reduce_scatter.cu
  src/ops/collectives/all_reduce.cu)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/collective_plan_test.cc
  tests/cpu/epoch_test.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/main.cc
  tests/gpu/harness.cc
  tests/gpu/collectives_test.cu)
list(APPEND LOOM_BENCH_SOURCES
  tools/loom-bench/main.cc
  tools/loom-bench/launch.cc
  tools/loom-bench/report.cc
  tools/loom-bench/timing.cc
  tools/loom-bench/collectives_bench.cu
  tools/loom-bench/baselines.cc)
