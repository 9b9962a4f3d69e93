// The GPU tests' device check: kernels built for sm_90a run only on Hopper (compute capability
// 9.0); elsewhere a test skips itself with REQUIRE_HOPPER().
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

namespace loom::test {

inline bool is_hopper() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0;
}

}  // namespace loom::test

#define REQUIRE_HOPPER() \
  if (!::loom::test::is_hopper()) GTEST_SKIP() << "loom's kernels need an sm_90 GPU"
