// GPU test harness: every test binary process is one rank, started by loom-run (which sets
// RANK, WORLD_SIZE, LOCAL_RANK, ...). Tests run in the same order on every rank; a test that
// needs a collective must be entered by all ranks, and must decide to skip identically on all.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "loom/communicator.h"

namespace loom::test {

struct Process {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
};
const Process& process();

// One communicator shared by the tests that need no special options (created on first use,
// which must happen in the same test on every rank). Heap: LOOM_TEST_HEAP_BYTES, or 4 GiB per
// rank plus 1 GiB per rank of the world, at most 3/4 of the GPU's memory over the ranks sharing it.
Communicator& shared_comm();
// A fresh communicator (collective).
std::unique_ptr<Communicator> make_comm(const CommOptions& options);

// Whether the shared communicator exists and a call on it failed (it refuses every call since).
// After a failed synchronize the stream's work may still be running, possibly for good (a kernel
// that no abort word can end): then every CUDA call that waits for the device (cudaFree,
// cudaMemcpy, cudaDeviceSynchronize) blocks forever. Tests that use the shared communicator
// skip while it is failed and leak their device buffers instead of freeing them.
bool shared_comm_failed();
// Whether the shared communicator failed and its queued work has not finished within `limit`:
// main() then ends the process as soon as the results are written, without the teardown (which
// frees memory, so would wait for that work forever).
bool shared_comm_work_stuck(std::chrono::milliseconds limit);

// True on every rank iff `ok` is true on every rank (a host all-reduce over the bootstrap).
bool all_ranks_agree(Communicator& comm, bool ok);

// The rank a timeout message names ("... waiting for rank R's ..."), or -1.
int named_rank(const std::string& message);

}  // namespace loom::test

#define LOOM_ASSERT_OK(expr)                                  \
  do {                                                        \
    ::loom::Status loom_test_status_ = (expr);                \
    ASSERT_TRUE(loom_test_status_.ok()) << loom_test_status_.to_string(); \
  } while (0)

#define LOOM_ASSERT_CUDA(expr)                                        \
  do {                                                                \
    cudaError_t loom_test_err_ = (expr);                              \
    ASSERT_EQ(loom_test_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(loom_test_err_); \
  } while (0)
