# Area: fused tensor-parallel operators (ag_gemm, gemm_rs, gemm_ar): planner and tuning cache.
list(APPEND LOOM_CORE_SOURCES
  src/planner/tp_plan.cc)
