// Init self-test of the NVLink/PCIe peer paths (the idea of NCCL's p2p_validate).
//
// Every rank writes a pattern through its mapping of each local peer's heap (its own included)
// into that owner's self-test area; after a barrier each owner reads its own area on its own GPU
// and checks every writer's words. A path that silently drops, misroutes or tears writes fails
// init instead of corrupting the first real operation.
//
// Layout (in the control region of every heap, at ControlLayout::self_test_offset):
//   self_test[writer][word]   local_world * kSelfTestWords * 8 B   (uint64)
// Only `writer` ever stores to row `writer`, so the rows need no synchronization between writers.
#pragma once

#include <cstdint>

#include "runtime/device_abi.h"

namespace loom::kernels {

constexpr uint32_t kSelfTestWords = ControlLayout::kSelfTestWords;

// The word `writer` stores at self_test[writer][word] of `owner`'s heap. A splitmix64 finalizer
// over all four inputs: a stale area from an earlier run (other nonce), a write that landed in
// the wrong heap (other owner) or the wrong row (other writer) all read back as a mismatch.
LOOM_HOST_DEVICE uint64_t self_test_word(uint32_t writer, uint32_t owner, uint32_t word, uint64_t nonce) {
  uint64_t x = nonce ^ ((uint64_t{writer} << 40) | (uint64_t{owner} << 20) | word);
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// One CTA; thread i handles (owner, word) = (i / kSelfTestWords, i % kSelfTestWords).
// peer_heap_bases: device array [local_world] of this rank's mappings of every local heap.
// flip_bits: XORed into every stored word; nonzero only when a test injects a broken path.
template <uint32_t kWords = kSelfTestWords>
__global__ void heap_self_test_write_kernel(const uint64_t* peer_heap_bases, uint32_t local_rank, uint32_t local_world,
                                            uint64_t self_test_offset, uint64_t nonce, uint64_t flip_bits) {
  for (uint32_t i = threadIdx.x; i < local_world * kWords; i += blockDim.x) {
    const uint32_t owner = i / kWords;
    const uint32_t word = i % kWords;
    auto* row = reinterpret_cast<volatile uint64_t*>(peer_heap_bases[owner] + self_test_offset) + local_rank * kWords;
    row[word] = self_test_word(local_rank, owner, word, nonce) ^ flip_bits;
  }
  // Make the peer stores visible system-wide before the kernel is seen as finished.
  __threadfence_system();
}

}  // namespace loom::kernels
