# Area: bootstrap network, local-rank launcher, loom-run. Owner: bootstrap.
list(APPEND LOOM_CORE_SOURCES
  src/runtime/socket.cc
  src/runtime/bootstrap.cc
  src/runtime/watchdog.cc
  src/runtime/launcher.cc)
list(APPEND LOOM_CPU_TEST_SOURCES
  tests/cpu/bootstrap_test.cc
  tests/cpu/watchdog_test.cc
  tests/cpu/launcher_test.cc)
