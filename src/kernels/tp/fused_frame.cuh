// The frame every fused tensor-parallel kernel (ag_gemm, gemm_rs, gemm_ar) is built in: the role
// table, the tunables, the layout of the operators' flags in the control region, the entry
// handshake (with a plan signature) and the end of a launch.
//
// One launch, on every local rank `me` of W, with launch epoch e (read on the device):
//   1. every CTA stores entry[me] = (e << 16) | signature into every peer's op-flag region;
//   2. before its first write into a peer's memory, a CTA waits (bounded) until that peer's
//      entry[peer] reaches e: the peer's earlier stream work is done, so its buffers are free.
//      A peer that entered e with another signature ran a different operation or plan: the
//      launch fails with DeviceError::kMismatch instead of corrupting memory or hanging;
//   3. roles work (ag_gemm.cuh, staged_reduce.cuh); every wait is bounded (comm/wait.cuh);
//   4. every CTA (also one that failed) counts itself out: the last one of the launch zeroes
//      the tile queue, then finish_launch advances the epoch.
// Data only ever moves by push (a rank writes into its peers' memory, never reads from it), and
// every write into a rank's memory is followed by a flag that rank waits for before its launch
// ends, so no exit handshake is needed.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/epoch.cuh"
#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "runtime/device_abi.h"

namespace loom::kernels::tp {

// Every tunable of the fused kernels (host launchers read them too).
struct TpTunables {
  // Local ranks a fused kernel addresses: per-destination tensor maps live in the kernel
  // parameters (one NVLink domain of an HGX board; W itself is a run-time value).
  static constexpr int kMaxLocalWorld = 8;
  // ag_gemm communication CTAs push the shard through a ring of TMA bulk copies (one thread):
  // kPushStages pieces of kPushPieceBytes in flight; a chunk's flag is published once at most
  // kPushFlagLag newer bulk groups are still pending (so the pipeline never drains per chunk).
  static constexpr int kPushStages = 8;
  static constexpr uint32_t kPushPieceBytes = 16 * 1024;
  static constexpr int kPushFlagLag = 4;
  // gemm_rs / gemm_ar rank-banded order: a band of one owner's rows holds at least this many
  // waves of tiles, so the partials a band owes are computed (and flown) a wave before the
  // owner needs them.
  static constexpr uint32_t kBandWaves = 2;
};

// Roles a CTA takes in a fused kernel, from the role table (never from bare index arithmetic).
enum class TpRole : uint32_t {
  kCommunication = 0,  // moves data over NVLink, then joins the compute role
  kCompute = 1,        // runs the GEMM engine's compute role on tiles from the launch's queue
};

// CTAs [0, comm_ctas) start as communication CTAs (dispatched first, so a GPU shared with other
// work still moves data), the others compute.
struct TpRoleTable {
  uint32_t comm_ctas;
  __device__ TpRole role_of(uint32_t cta) const { return cta < comm_ctas ? TpRole::kCommunication : TpRole::kCompute; }
  __device__ uint32_t comm_index(uint32_t cta) const { return cta; }
  // Index among the CTAs that compute from the start; communication CTAs that join later get
  // the indices after them (the queue hands out tiles, so the index is informational).
  __device__ uint32_t compute_index(uint32_t cta) const { return cta < comm_ctas ? gridDim.x - comm_ctas + cta : cta - comm_ctas; }
};

// ---- op-flag region (ControlLayout::op_flag_offset of every rank's heap) ----------------------
//
//   entry[src]                 W words   (e << kSignatureBits) | signature, written by src
//   launch flags, from word W, per operator (index formulas in ag_gemm.cuh / staged_reduce.cuh):
//     ag_gemm   rows[f]              M / rows_per_flag
//     gemm_rs   partial[slot][t]     (W - 1) * own_tiles
//     gemm_ar   partial[slot][t], then final[tile]   (W - 1) * own_tiles + M/BM * N/BN
// All words are epochs (or epoch-tagged), never reset.
constexpr uint32_t kSignatureBits = 16;
constexpr uint64_t kSignatureMask = (uint64_t{1} << kSignatureBits) - 1;

__device__ __forceinline__ uint64_t* op_flag(const DeviceComm& c, int owner, uint64_t index) {
  return reinterpret_cast<uint64_t*>(c.peer_heap_bases[owner] + c.control.op_flag_offset + 8 * index);
}

__device__ __forceinline__ uint64_t entry_word(uint64_t epoch, uint32_t signature) {
  return (epoch << kSignatureBits) | (signature & kSignatureMask);
}

// Step 1: threads [0, W) of the CTA each tell one peer. Every CTA does it (the same value), so
// no CTA depends on another being scheduled.
__device__ __forceinline__ void publish_entry(const DeviceComm& c, uint64_t epoch, uint32_t signature) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < c.local_world && peer != c.local_rank) {
    flag_store_release(op_flag(c, peer, static_cast<uint64_t>(c.local_rank)), entry_word(epoch, signature));
  }
}

// Step 2 (one thread): has `peer` entered this launch with the same plan? Bounded; on failure
// the error is recorded (timeout naming the peer, or kMismatch with both signatures in
// flag_index) and false returned. A peer can only be past epoch e once this launch no longer
// needs it, so a later epoch skips the signature check.
__device__ __forceinline__ bool wait_entry(const DeviceComm& c, int peer, uint64_t epoch, uint32_t signature,
                                           const WaitContext& ctx) {
  const uint64_t* word = op_flag(c, c.local_rank, static_cast<uint64_t>(peer));
  if (!wait_flag(word, entry_word(epoch, 0), ctx, peer, FlagKind::kEntered, static_cast<uint32_t>(peer))) return false;
  const uint64_t seen = flag_load_acquire(word);
  const uint32_t theirs = static_cast<uint32_t>(seen & kSignatureMask);
  const uint32_t ours = signature & static_cast<uint32_t>(kSignatureMask);
  if ((seen >> kSignatureBits) == epoch && theirs != ours) {
    ctx.fail(DeviceError::kMismatch, peer, FlagKind::kEntered, (theirs << kSignatureBits) | ours, seen, 0);
    return false;
  }
  // Writes to the peer that follow may be TMA (async proxy): order them after the acquire.
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  return true;
}

// The 1024-byte aligned base of the dynamic shared memory, as the compute role aligns it.
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
}

}  // namespace loom::kernels::tp
