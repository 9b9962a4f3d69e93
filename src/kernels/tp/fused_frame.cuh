// What the fused tensor-parallel kernels (ag_gemm, gemm_rs, gemm_ar) add to the persistent-kernel
// frame (kernels/frame/): their roles and the layout of their flags in the
// control region, whose first words are the entry handshake's.
//
// One launch, on every local rank `me` of W, with launch epoch e (read on the device):
//   1-2. the entry handshake (kernels/comm/entry.cuh) over the op-flag region's entry words:
//      every CTA publishes, and before its first write into a peer a CTA waits (bounded) for
//      that peer's entry of epoch e with the same plan signature;
//   3. roles work (sm90_ag_gemm.cuh, sm90_staged_reduce.cuh); every wait is bounded (comm/wait.cuh);
//   4. every CTA (also one that failed) counts itself out (frame::LaunchFrame::finish).
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/entry.cuh"
#include "kernels/comm/epoch.cuh"
#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/frame/persistent.cuh"
#include "kernels/frame/role_table.h"
#include "kernels/tp/tunables.h"
#include "runtime/device_abi.h"

namespace loom::kernels::tp {

// Roles a CTA takes in a fused kernel, from the role table (never from bare index arithmetic).
enum class TpRole : uint32_t {
  kCommunication = 0,  // moves data over NVLink, then joins the compute role
  kCompute = 1,        // runs the GEMM engine's compute role on tiles from the launch's queue
};

// CTAs [0, comm_ctas) start as communication CTAs (dispatched first, so a GPU shared with other
// work still moves data), the others compute; communication CTAs join the compute role when
// their items are done (RoleTable::rest_index orders them after the compute CTAs).
using TpRoleTable = frame::RoleTable<TpRole, TpRole::kCompute>;

// ---- op-flag region (ControlLayout::op_flag_offset of every rank's heap) ----------------------
//
//   entry[src]                 W words   entry_word(e, signature) (device_abi.h), written by src
//   launch flags, from word W, per operator (index formulas in sm90_ag_gemm.cuh / sm90_staged_reduce.cuh):
//     ag_gemm   rows[f]              M / rows_per_flag
//     gemm_rs   partial[slot][t]     (W - 1) * own_tiles
//     gemm_ar   partial[slot][t], then final[tile]   (W - 1) * own_tiles + M/BM * N/BN
// All words are epochs (or epoch-tagged), never reset.
__device__ __forceinline__ uint64_t* op_flag(const DeviceComm& c, int owner, uint64_t index) {
  return reinterpret_cast<uint64_t*>(c.peer_heap_bases[owner] + c.control.op_flag_offset + 8 * index);
}

// The fused operators' entry words (kernels/comm/entry.cuh): the op-flag region's first W words.
__device__ __forceinline__ EntryWords tp_entry(const DeviceComm& c) { return {c.control.op_flag_offset}; }

}  // namespace loom::kernels::tp
