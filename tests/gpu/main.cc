// Entry point of loom_gpu_tests. Run as N ranks: `loom-run -n N -- loom_gpu_tests`; run alone
// it behaves as a world of one.
#include <gtest/gtest.h>

#include <chrono>
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
  // Listing the tests needs no GPU (the order they run in, on a machine without one).
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--gtest_list_tests") {
      ::testing::InitGoogleTest(&argc, argv);
      return RUN_ALL_TESTS();
    }
  }
  int devices = 0;
  // A rank of a fault test's job may have no GPU on purpose (tests/gpu/fault_test.cu).
  const bool fault_rank = std::getenv("LOOM_TEST_FAULT") != nullptr;
  if ((cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) && !fault_rank) {
    std::fprintf(stderr, "loom_gpu_tests: no CUDA GPU visible; these tests need one\n");
    return 2;
  }
  if (devices > 0) cudaSetDevice(loom::test::process().local_rank % devices);
  ::testing::InitGoogleTest(&argc, argv);
  const int result = RUN_ALL_TESTS();  // the result files are written
  // A failed shared communicator whose work still runs (a kernel no abort can end): the teardown
  // (static destructors, the CUDA runtime's) would wait for it forever, so end here.
  if (loom::test::shared_comm_work_stuck(std::chrono::seconds(2))) {
    std::fprintf(stderr,
                 "rank %d: the shared communicator failed and its GPU work is still running; ending the process "
                 "without teardown (freeing memory would wait for that work forever)\n",
                 loom::test::process().rank);
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(result != 0 ? result : 1);
  }
  return result;
}
