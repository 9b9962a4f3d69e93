# Area: inter-node path — command ring, proxy, transports (issue 5). Owner: network.
# Host-only parts (the ring, the proxy, fabric and verbs through dlopen) go into loom_core so the
# CPU tests link them; only the copy engine and the CUDA-side memory helpers need the runtime.
list(APPEND LOOM_CORE_SOURCES
  src/runtime/command_ring.cc
  src/runtime/proxy.cc
  src/runtime/transports/transport.cc
  src/runtime/transports/fabric.cc
  src/runtime/transports/verbs.cc)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/command_ring_test.cc
  tests/cpu/proxy_test.cc
  tests/cpu/fabric_test.cc
  tests/cpu/verbs_fake_test.cc)
list(APPEND LOOM_LIB_SOURCES
  src/runtime/transports/copy_engine.cc
  src/runtime/transports/cuda_memory.cc
  src/runtime/network.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/proxy_copy_engine_test.cu)
