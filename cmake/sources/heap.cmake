# Area: symmetric heap (allocator, fd passing, cuMem/IPC mappings, init self-test). Owner: heap.
list(APPEND LOOM_CORE_SOURCES
  src/runtime/heap_allocator.cc
  src/runtime/ipc_socket.cc)
list(APPEND LOOM_LIB_SOURCES
  src/runtime/cuda_driver.cc
  src/runtime/symmetric_heap.cc
  src/runtime/heap_self_test.cu)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/heap_allocator_test.cc
  tests/cpu/ipc_socket_test.cc)
list(APPEND LOOM_GPU_TEST_SOURCES
  tests/gpu/heap_test.cc)
