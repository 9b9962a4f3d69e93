// The compute role's shared memory as typed accessors over config.h's layout (stage buffers,
// epilogue boxes, the mbarriers of the three rings, the ring items and the persisted role
// state), and the ring item load. Separate so that the role's pieces (fold, signaler, epilogue
// staging) address the same layout without being members of ComputeRole.
#pragma once

#include <cstdint>

#include "kernels/gemm/config.h"
#include "kernels/gemm/params.h"
#include "kernels/gemm/pipeline.cuh"

namespace loom::kernels::gemm {

// Per-call pipeline state kept in shared memory between run() calls: where each side of each
// ring is (PipelineState, pipeline.cuh).
struct RoleState {
  RingPosition producer_stage, producer_tile;  // stage ring, tile ring: the producer's side
  RingPosition consumer_stage, consumer_tile;  // ... the consumers' side
  RingPosition signal_post, signal_take;       // signal ring: the consumers', the signaler's
  WorkItem exit;
  uint32_t epi_parity;
};
static_assert(sizeof(RoleState) <= kRoleStateBytes, "RoleState must fit its kRoleStateBytes slot");

// A ring item written by another thread of the CTA (the ring's mbarrier ordered it).
__device__ __forceinline__ WorkItem load_item(const WorkItem* slot) {
  const volatile WorkItem* v = slot;
  WorkItem w;
  w.kind = v->kind;
  w.m_block = v->m_block;
  w.n_block = v->n_block;
  w.tile = v->tile;
  w.k_begin = v->k_begin;
  w.k_end = v->k_end;
  w.split_slot = v->split_slot;
  w.split_count = v->split_count;
  w.group = v->group;
  w.row_first = v->row_first;
  w.row_limit = v->row_limit;
  return w;
}

// Offsets from the 1024-byte aligned base (Cfg: a TileConfig; sizes in config.h):
//   a[s] kStages * BM*64*2, b[s] kStages * BN*64*2, epi[w][2] consumers*4*2 * 2048,
//   full[s], empty[s], tile_full[t], tile_empty[t] (8 B each), ring[t] (kWorkItemBytes each),
//   signal_full[t], signal_empty[t] (8 B each), signal_ring[t] (kWorkItemBytes each), state (128 B).
template <class Cfg>
struct RoleSmem {
  uint8_t* base;
  __device__ explicit RoleSmem(uint8_t* raw)
      : base(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023})) {}
  __device__ uint8_t* a(int s) const { return base + Cfg::kAOffset + s * Cfg::kABytes; }
  __device__ uint8_t* b(int s) const { return base + Cfg::kBOffset + s * Cfg::kBBytes; }
  __device__ uint8_t* epi(int g, int w, uint32_t parity) const {
    return base + Cfg::kEpiOffset + ((g * 4 + w) * 2 + parity) * kEpiBoxBytes;
  }
  __device__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + Cfg::kFullOffset) + s; }
  __device__ uint64_t* empty(int s) const { return reinterpret_cast<uint64_t*>(base + Cfg::kEmptyOffset) + s; }
  __device__ uint64_t* tile_full(int t) const {
    return reinterpret_cast<uint64_t*>(base + Cfg::kTileFullOffset) + t;
  }
  __device__ uint64_t* tile_empty(int t) const {
    return reinterpret_cast<uint64_t*>(base + Cfg::kTileEmptyOffset) + t;
  }
  __device__ WorkItem* ring(int t) const { return reinterpret_cast<WorkItem*>(base + Cfg::kTileRingOffset) + t; }
  __device__ uint64_t* signal_full(int t) const {
    return reinterpret_cast<uint64_t*>(base + Cfg::kSignalFullOffset) + t;
  }
  __device__ uint64_t* signal_empty(int t) const {
    return reinterpret_cast<uint64_t*>(base + Cfg::kSignalEmptyOffset) + t;
  }
  __device__ WorkItem* signal_ring(int t) const {
    return reinterpret_cast<WorkItem*>(base + Cfg::kSignalRingOffset) + t;
  }
  __device__ RoleState* state() const { return reinterpret_cast<RoleState*>(base + Cfg::kStateOffset); }
};

}  // namespace loom::kernels::gemm
