# Area: the operators' shared host layer (argument checks, kernel launches, family resources).
# Owner: lead.
list(APPEND LOOM_LIB_SOURCES
  src/ops/launch/checks.cc
  src/ops/launch/family_resources.cc
  src/ops/launch/kernel_launch.cc
  src/ops/launch/standalone_wait.cc
  src/ops/launch/tensor_map.cc)
