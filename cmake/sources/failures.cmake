# Area: security and failure handling (issue 23): failure propagation between real communicators.
# The fault tests supervise jobs of their own (tests/gpu/fault_test.cu); the CPU side of the
# protocol is in bootstrap.cmake (watchdog_test).
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/fault_test.cu)
