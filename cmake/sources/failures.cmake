# Area: security and failure handling (issue 23). The launch signatures ranks compare at entry
# (computed in ops/launch/signature.cc, host-only) and the call log their messages use; failure
# propagation between real communicators (the fault tests supervise jobs of their own) and
# cross-rank mismatches on the GPU. The CPU side of failure propagation is in bootstrap.cmake.
list(APPEND LOOM_CORE_SOURCES
  src/runtime/call_log.cc
  src/ops/launch/signature.cc)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/signature_test.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/fault_test.cu
  tests/gpu/consistency_test.cu)
