// The entry handshake every persistent kernel starts with.
//
// A launch with epoch e on local rank `me` of L:
//   1. publish: every CTA stores entry_word(e, signature) (runtime/device_abi.h) into word `me`
//      of the family's entry words in every local peer (the same value from every CTA, so no CTA
//      depends on another being scheduled);
//   2. wait: before its first write into a peer, a CTA waits (bounded) until that peer's word
//      reaches epoch e (entry_reached, runtime/device_abi.h). The peer's earlier stream work is
//      then done, so its buffers are free. A peer that entered e with another 32-bit signature
//      (ops/launch/signature.h) made another call (operation, shapes, dtype, options, plan): the
//      launch fails with DeviceError::kMismatch before any data moves, instead of corrupting
//      memory or hanging. A word of a later epoch means the peer is past this launch (it no
//      longer needs us): no check.
// Families keep their entry words in their own place (EntryWords): the collectives in the
// control region's entered[], the fused TP operators at the start of the op-flag region, the
// multi-node operators at the start of the network window.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "runtime/device_abi.h"

namespace loom::kernels {

// Where a family's entry words live: L words at heap offset `offset` of every local rank, word
// src written by local rank src.
struct EntryWords {
  uint64_t offset;

  __device__ uint64_t* at(const DeviceComm& c, int owner, int src) const {
    return reinterpret_cast<uint64_t*>(c.peer_heap_bases[owner] + offset + 8ull * static_cast<uint64_t>(src));
  }
};

// Step 1: threads [0, L) of the CTA each tell one local peer.
__device__ __forceinline__ void publish_entry(const DeviceComm& c, EntryWords words, uint64_t epoch,
                                              uint32_t signature) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < c.local_world && peer != c.local_rank) {
    flag_store_release(words.at(c, peer, c.local_rank), entry_word(epoch, signature));
  }
}

// Fails the launch with kMismatch (this rank's signature in the error's flag index, the peer's
// word in its observed value) when `seen` carries this epoch with another signature.
__device__ __forceinline__ bool entry_signature_ok(uint64_t seen, uint64_t epoch, uint32_t signature, int waited_on,
                                                   FlagKind kind, const WaitContext& ctx) {
  if (entry_in(seen, epoch) && entry_signature(seen) != signature) {
    ctx.fail(DeviceError::kMismatch, waited_on, kind, signature, seen, 0);
    return false;
  }
  return true;
}

// Step 2 (one thread): has local peer `peer` entered this launch with the same plan? Bounded;
// false after a recorded failure. Writes into the peer that follow may be TMA (async proxy):
// they are ordered after the acquire.
__device__ __forceinline__ bool wait_entry(const DeviceComm& c, EntryWords words, int peer, uint64_t epoch,
                                           uint32_t signature, const WaitContext& ctx) {
  const uint64_t* word = words.at(c, c.local_rank, peer);
  if (!wait_until(word, [epoch](uint64_t seen) { return entry_reached(seen, epoch); }, ctx, peer, FlagKind::kEntered,
                  static_cast<uint32_t>(peer))) {
    return false;
  }
  if (!entry_signature_ok(flag_load_acquire(word), epoch, signature, peer, FlagKind::kEntered, ctx)) return false;
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  return true;
}

// Both steps for a kernel whose every CTA writes into every local peer (the collectives): all
// threads call it and get the same answer.
__device__ __forceinline__ bool cta_enter_all(const DeviceComm& c, EntryWords words, uint64_t epoch, uint32_t signature,
                                              const WaitContext& ctx) {
  publish_entry(c, words, epoch, signature);
  __shared__ int ok_shared;
  if (threadIdx.x == 0) {
    bool ok = true;
    for (int s = 0; s < c.local_world && ok; ++s) {
      if (s != c.local_rank) ok = wait_entry(c, words, s, epoch, signature, ctx);
    }
    ok_shared = ok ? 1 : 0;
  }
  __syncthreads();
  const bool ok = ok_shared != 0;
  __syncthreads();
  return ok;
}

}  // namespace loom::kernels
