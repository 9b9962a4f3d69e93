// Entry point of loom_gpu_tests. Run as N ranks: `loom-run -n N -- loom_gpu_tests`; run alone
// it behaves as a world of one.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <cuda_runtime_api.h>
#include <unistd.h>

#include "tests/gpu/harness.h"

int main(int argc, char** argv) {
  // Alone (not under loom-run): a single-rank world on loopback.
  if (std::getenv("RANK") == nullptr) {
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    setenv("LOCAL_RANK", "0", 1);
    setenv("LOCAL_WORLD_SIZE", "1", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(20000 + (getpid() % 20000)).c_str(), 1);
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "loom_gpu_tests: no CUDA GPU visible; these tests need one\n");
    return 2;
  }
  cudaSetDevice(loom::test::process().local_rank % devices);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
