// Host side of the heap's init self-test (kernel: kernels/comm/self_test.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "loom/status.h"

namespace loom::runtime {

struct HeapSelfTestParams {
  const uint64_t* device_peer_bases = nullptr;  // device array [local_world] of heap mappings
  const void* local_base = nullptr;             // this rank's own heap
  int local_rank = 0;
  int local_world = 1;
  uint64_t self_test_offset = 0;  // self_test[writer][word] starts here in every heap
  uint64_t nonce = 0;             // equal on all ranks, new for every heap
  // Test hook: XORed into every word this rank writes, so its path looks broken to every owner.
  uint64_t flip_bits = 0;
};

// Queues this rank's pattern writes into every local heap (its own included) on `stream`.
Status launch_heap_self_test_writes(const HeapSelfTestParams& params, cudaStream_t stream);

// What an owner found in its own self-test area.
struct HeapSelfTestFinding {
  int32_t bad_writer = -1;  // lowest local rank whose words are wrong; -1: all correct
  uint32_t word = 0;        // first wrong word of that writer
  uint64_t expected = 0;
  uint64_t observed = 0;
};

// Reads this rank's self-test area from its own GPU (synchronous copy) and compares every
// writer's words with the pattern. Call after every rank's writes completed (a barrier).
Result<HeapSelfTestFinding> check_heap_self_test(const HeapSelfTestParams& params);

}  // namespace loom::runtime
