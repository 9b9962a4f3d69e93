# Area: core (Status, env, logging) and topology. Owner: core.
list(APPEND LOOM_CORE_SOURCES
  src/core/status.cc
  src/core/env.cc
  src/core/log.cc
  src/runtime/topology.cc
  src/runtime/names.cc
  src/core/version.cc)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/status_env_test.cc
  tests/cpu/topology_test.cc
  tests/cpu/names_test.cc
  tests/cpu/public_api_test.cc)
list(APPEND LOOM_LIB_SOURCES
  src/runtime/cuda_check.cc)
