# Area: fused tensor-parallel kernels (ag_gemm, gemm_rs, gemm_ar): device code and launchers.
# Each launcher instantiates its 8 kernels (128x256 / 128x128 x bf16 / fp16 x B layout).
list(APPEND LOOM_LIB_SOURCES
  src/ops/ag_gemm.cu
  src/ops/gemm_rs.cu
  src/ops/gemm_ar.cu
  src/ops/tp_names.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/tp_kernels_smoke_test.cu)
