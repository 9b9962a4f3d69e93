# Area: fused tensor-parallel operators (ag_gemm, gemm_rs, gemm_ar) in one NVLink domain: their
# host layer (plan, checks, launch) and the public entry points and queries of every TP operator.
# The kernels of each operator are instantiated in their own translation unit (8 each: 128x256 /
# 128x128 x bf16 / fp16 x B layout) so no file takes long on a 2-core CI machine.
list(APPEND LOOM_LIB_SOURCES
  src/ops/tp/tp_ops.cc
  src/ops/tp/tp_common.cu
  src/ops/tp/ag_gemm.cu
  src/ops/tp/staged_reduce.cu
  src/ops/tp/gemm_rs.cu
  src/ops/tp/gemm_ar.cu
  src/ops/tp/tp_names.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/tp_kernels_smoke_test.cu)
