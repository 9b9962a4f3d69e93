// What the reduce epilogues of the fused TP kernels (sm90_staged_reduce.cuh, one node;
// multinode/sm90_reduce.cuh, several) share: the local peers a thread has seen enter the launch,
// the state around them, and the TMA store of a staged box into a peer's (or this rank's) tensor.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/entry.cuh"
#include "kernels/common/tma_descriptor.h"

namespace loom::kernels::tp {

// The local peers one thread has seen enter this launch (a lane's own): the first ask for a peer
// waits for its entry word (comm/entry.cuh wait_entry); later asks are free.
struct EnteredPeers {
  uint32_t mask = 0;

  __device__ __forceinline__ bool check(const DeviceComm& c, EntryWords words, uint32_t peer, uint64_t epoch,
                                        uint32_t signature, const WaitContext& ctx) {
    const uint32_t bit = 1u << peer;
    if ((mask & bit) != 0) return true;
    if (!wait_entry(c, words, static_cast<int>(peer), epoch, signature, ctx)) return false;
    mask |= bit;
    return true;
  }
};

// What the reduce epilogues (the compute role's epilogue policies; TileEpilogue explains the
// interface) have in common: their kernel's parameters (Params: comm, signature, out_dtype), the
// launch's wait context and epoch, the local peers this thread has seen enter, and that they
// signal per tile. Which entry words the peers publish comes from entry_words_of(params),
// declared beside each Params.
template <class Params>
class ReduceEpilogueBase {
 public:
  __device__ ReduceEpilogueBase(const Params& p, uint64_t epoch, const WaitContext& ctx)
      : p_(p), ctx_(ctx), epoch_(epoch) {}

  __device__ uint32_t out_dtype() const { return p_.out_dtype; }
  __device__ bool signals() const { return true; }

 protected:
  // Has local peer `q` entered this launch (waiting the first time this thread asks)?
  __device__ bool entered(uint32_t q) const {
    return entered_.check(p_.comm, entry_words_of(p_), q, epoch_, p_.signature, ctx_);
  }

  const Params& p_;
  const WaitContext& ctx_;
  uint64_t epoch_;
  mutable EnteredPeers entered_;  // per thread: local peers known to have entered
};

// One TMA store of a shared-memory box into a 2-D tensor at (col, row).
__device__ __forceinline__ void tma_store_2d(const sm90::TmaDescriptor* map, uint32_t col, uint32_t row, const void* box) {
  const int32_t coords[2] = {static_cast<int32_t>(col), static_cast<int32_t>(row)};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, map, coords, box);
}

}  // namespace loom::kernels::tp
