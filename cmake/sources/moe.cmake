# Area: expert-parallel (MoE) operators: routing on the device, dispatch, combine (docs/MOE.md).
list(APPEND LOOM_CORE_SOURCES
  src/planner/moe_plan.cc)
list(APPEND LOOM_LIB_SOURCES
  src/ops/moe/moe.cu
  src/ops/moe/moe_names.cc)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/moe_plan_test.cc
  tests/cpu/kernel_lint_test.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/moe_ops_test.cu)
