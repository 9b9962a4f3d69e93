// Fused tensor-parallel operators within one NVLink domain: each is ONE persistent kernel whose
// CTAs take roles (compute on the GEMM engine, NVLink communication), overlapping the traffic
// with tensor-core work at tile granularity.
//
// Per rank r of W local ranks (W = comm.local_world_size()):
//   ag_gemm  out[M, N]     = AllGather_rows(a_r[M/W, K]) @ b_r     (b_r: [K, N] or [N, K])
//   gemm_rs  out[M/W, N]   = ReduceScatter_rows(a_r[M, K] @ b_r)   (K is this rank's K_r)
//   gemm_ar  out[M, N]     = AllReduce(a_r[M, K] @ b_r)
// Sums over ranks are deterministic: fp32, rank order 0..W-1, one rounding (repeated launches
// give bit-identical results). Shapes that do not divide by W (or by what the kernels need) are
// refused with a Status that says why; nothing is launched then.
//
// Buffers: a, b and out are device memory of this rank's GPU. gemm_ar's out must be symmetric
// (Communicator::alloc): peers write their reduced rows into it. ag_gemm can also return the
// gathered A in a symmetric [M, K] buffer (gathered_a); otherwise loom gathers into its own
// workspace in the symmetric heap. Calls are collective and asynchronous on `stream`; device-side
// failures (a peer that never arrives) surface through Communicator::synchronize().
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "loom/communicator.h"
#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/types.h"

namespace loom {

struct TpGemmArgs {
  const void* a = nullptr;  // ag_gemm: this rank's shard [M/W, K]; gemm_rs, gemm_ar: [M, K]
  const void* b = nullptr;  // [K, N] (BLayout::kKN) or an nn.Linear weight [N, K] (kNK)
  void* out = nullptr;      // ag_gemm [M, N]; gemm_rs [M/W, N]; gemm_ar [M, N] (symmetric)
  int64_t m = 0;            // global M (all ranks' rows)
  int64_t n = 0;            // N of this rank's b
  int64_t k = 0;            // K of this rank's a and b
  DType dtype = DType::kBF16;  // a, b and out (bf16 or fp16)
  BLayout b_layout = BLayout::kKN;
  void* gathered_a = nullptr;  // ag_gemm only: optional symmetric [M, K] that receives AllGather(a)
};

enum class TpAlgorithm : uint8_t {
  kAuto,        // planner (tuning cache, then cost model)
  kFused,       // one persistent kernel
  kDecomposed,  // loom collective, then loom GEMM (for shapes too small for overlap to pay)
};

struct TpGemmOptions {
  TpAlgorithm algorithm = TpAlgorithm::kAuto;
  int comm_ctas = -1;               // CTAs that start in the communication role; -1: planner
  GemmTile tile = GemmTile::kAuto;  // the compute role's tile; kAuto: planner
  // Fused kernels: K pieces each tile of the last partial wave is cut into, so that every SM
  // takes a share of it (-1: planner, when a pieces count up to 4 ends the tail sooner; 0 or 1:
  // none; 2..kMaxTailPieces).
  int tail_pieces = -1;
  static constexpr int kMaxTailPieces = 16;
  // Diagnostics (loom/diagnostics.h): device memory for tile_timeline_capacity(M, N) records (M x
  // N of this rank's GEMM); ignored by the decomposed and plain paths.
  TileTimelineRecord* timeline = nullptr;
};

Status ag_gemm(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options = {});
Status gemm_rs(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options = {});
Status gemm_ar(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options = {});

// ---- plans and workspace, before a call (e.g. before CUDA-graph capture) ---------------------
//
// The calls above plan on every call and grow loom's symmetric workspace when a shape needs more
// (collectively, no host round trip); growing is impossible during CUDA-graph capture. These
// queries answer what a call would do, from the same arguments and with the same checks, without
// launching anything. tp_reserve_workspace grows the workspace now, so that a captured call
// allocates nothing (collective: every rank calls it alike, in the same order as its calls).

enum class TpOp : uint8_t { kAgGemm, kGemmRs, kGemmAr };

enum class TpPath : uint8_t {
  kPlainGemm,   // one rank in the NVLink domain: the plain GEMM (nothing to move)
  kFused,       // the fused persistent kernel (one NVLink domain)
  kDecomposed,  // loom's collective, then loom's GEMM
  kMultiNode,   // the multi-node persistent kernel (several nodes)
};

struct TpPlanInfo {
  TpPath path = TpPath::kDecomposed;
  GemmTile tile = GemmTile::kAuto;  // the GEMM's (or the persistent kernel's compute) tile
  int ctas = 0;                     // fused / multi-node: persistent CTAs (this GPU's SMs)
  int comm_ctas = 0;                // CTAs that start moving data (ag_gemm fused; multi-node roles)
  int64_t tail_tiles = 0;           // fused: tiles of the last wave split into tail_pieces K pieces
  int tail_pieces = 0;
  size_t workspace_bytes = 0;       // loom's workspace the call needs (tp_reserve_workspace)
  std::string source;               // "options", "cache", "model", or "fixed" (multi-node roles)
};

// What the call would run: every check of the call except those of the buffers.
Result<TpPlanInfo> tp_plan(Communicator& comm, TpOp op, const TpGemmArgs& args, const TpGemmOptions& options = {});
// ok when the call would launch: every check of the call, the buffers included.
Status tp_can_implement(Communicator& comm, TpOp op, const TpGemmArgs& args, const TpGemmOptions& options = {});
// tp_plan(...).workspace_bytes.
Result<size_t> tp_workspace_bytes(Communicator& comm, TpOp op, const TpGemmArgs& args, const TpGemmOptions& options = {});
// Grows loom's workspace to what the call needs (stream: where the growth waits for earlier work).
Status tp_reserve_workspace(Communicator& comm, TpOp op, const TpGemmArgs& args, cudaStream_t stream,
                            const TpGemmOptions& options = {});

}  // namespace loom
