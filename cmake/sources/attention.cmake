# Area: the attention engine (flash-attention forward, attention_merge) and its planner.
# The kernel instances are split one configuration per file (4 kernels each: bf16/fp16 x causal)
# so no translation unit takes long on a 2-core CI machine.
list(APPEND LOOM_CORE_SOURCES
  src/planner/attention_plan.cc)
list(APPEND LOOM_LIB_SOURCES
  src/ops/attention/attention.cc
  src/ops/attention/flash_params.cc
  src/ops/attention/ring_attention.cc
  src/ops/attention/attention_merge.cu
  src/ops/attention/attention_sm90_hd64x128.cu
  src/ops/attention/attention_sm90_hd64x128_m192.cu
  src/ops/attention/attention_sm90_hd64x192.cu
  src/ops/attention/attention_sm90_hd128x128.cu
  src/ops/attention/attention_sm90_hd128x176.cu
  src/ops/attention/attention_sm90_hd256x64.cu
  src/ops/attention/attention_sm90_hd256x80.cu
  src/ops/attention/ring_attention_sm90_hd64x128.cu
  src/ops/attention/ring_attention_sm90_hd64x192.cu
  src/ops/attention/ring_attention_sm90_hd128x176.cu
  src/ops/attention/ring_attention_sm90_hd256x80.cu)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/attention_plan_test.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/attention_test.cu
  tests/gpu/ring_attention_test.cu)
