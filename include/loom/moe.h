// Expert-parallel (MoE) operators, part 1: routing on the device, dispatch and combine, within one
// NVLink domain (docs/MOE.md has the design: receive layout, buffers, flags, capacity policy).
//
// Experts are split contiguously over the W ranks: rank r holds experts [r*E/W, (r+1)*E/W) (its
// "local experts" 0 .. E/W-1). Per rank, one MoE step is four calls, each collective (every rank
// calls it, in the same order) and asynchronous on `stream`:
//
//   MoePlan plan = moe_routing(comm, config, {ids, weights, T, plan_buffer, expert_offsets}, stream);
//   moe_dispatch(comm, plan, x, recv_x, stream);          // recv_x: symmetric [capacity, H]
//   ... the expert FFN on recv_x rows, local expert i owning rows [expert_offsets[i], expert_offsets[i+1])
//       and writing its outputs into the same rows of a symmetric expert_out ...
//   moe_combine(comm, plan, expert_out, out, stream);     // out[t] = sum_j w[t,j] * expert_out[row(t,j)]
//
// Routing reads each token's top-k expert ids (int32 [T, k]; -1 marks an unused slot) and weights
// (fp32 [T, k]) on the device and computes everything else there: no host loop, no host
// synchronization. The receive layout on every rank is "contiguous": rows grouped by local expert
// (expert i's rows at [expert_offsets[i], expert_offsets[i+1]), possibly empty), inside an expert
// by source rank, then token, then slot; no padding. A token needed by several experts of one rank
// crosses NVLink once (into its first row there) and is copied to its other rows on that rank.
//
// Input whose values the host cannot see (expert ids out of range, a receive buffer over its
// capacity) is found on the device. Then no rank moves any data (recv_x and out are not written,
// expert_offsets are all 0) and moe_report() returns invalid_argument naming the rank, token, slot
// and id (or the rank over capacity and its rows). With MoeOverflow::kDrop, rows past a rank's
// capacity are dropped instead (counted in the report; their slots add nothing in combine).
// Everything the host can check (shapes, pointers, k > E, E not a multiple of W) is refused with a
// Status before anything is launched or written. Multi-node jobs are refused (unsupported) for now.
//
// Not built yet (docs/MOE.md, "Plan"): the grouped GEMM (contiguous and masked layouts) and the
// fused moe_dispatch_gemm kernel; they are not declared here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "loom/communicator.h"
#include "loom/status.h"
#include "loom/types.h"

namespace loom {

// Limits of this build (the host checks them; docs/MOE.md says why each exists).
inline constexpr int kMoeMaxTopK = 32;          // a token's slots are the lanes of one warp
inline constexpr int64_t kMoeMaxExperts = 1024;  // per-warp expert histograms in shared memory
inline constexpr int kMoeMaxLocalWorld = 32;    // destination sets are 32-bit masks

// What happens when the rows routed to a rank exceed its capacity.
enum class MoeOverflow : uint8_t {
  kError,  // nothing moves on any rank; moe_report() names the rank and its rows
  kDrop,   // rows past the capacity in the receive order are dropped and counted
};

// The shape of an MoE step; every rank passes the same config (checked at launch: a rank with
// another config fails the launch with a mismatch instead of corrupting memory).
struct MoeConfig {
  int64_t num_experts = 0;      // E over all ranks; a multiple of the world size
  int top_k = 0;                // k: 1 .. min(E, kMoeMaxTopK)
  int64_t hidden = 0;           // H: elements per token row; H * element size a multiple of 16 bytes
  DType dtype = DType::kBF16;   // of the token rows (bf16, fp16, fp32; dispatch moves bits)
  int64_t max_tokens = 0;       // most tokens one rank routes per call (sizes the plan buffer)
  int64_t capacity = 0;         // receive rows per rank; 0: max_tokens * world * top_k (never overflows)
  MoeOverflow overflow = MoeOverflow::kError;
};

// Sizes a config needs on this communicator.
struct MoeSizes {
  int64_t capacity = 0;         // receive rows per rank (config.capacity or its default)
  int64_t local_experts = 0;    // E / W
  size_t plan_bytes = 0;        // MoeRoutingArgs::plan (device memory of this GPU)
  size_t recv_bytes = 0;        // recv_x: capacity * H * element size (symmetric)
  size_t workspace_bytes = 0;   // what loom takes from the symmetric heap for the MoE family
};

// ok when the config can run on this communicator (host checks only; nothing is allocated).
Status moe_can_implement(const Communicator& comm, const MoeConfig& config);
// The sizes of a config that moe_can_implement accepts, or its refusal.
Result<MoeSizes> moe_sizes(const Communicator& comm, const MoeConfig& config);

struct MoeRoutingArgs {
  const int32_t* topk_ids = nullptr;    // [T, k] device; -1: unused slot; others must be in [0, E)
  const float* topk_weights = nullptr;  // [T, k] device; null: every weight 1
  int64_t num_tokens = 0;               // T of this rank, 0 .. config.max_tokens (may differ per rank)
  void* plan = nullptr;                 // out: MoeSizes::plan_bytes of device memory, 16-byte aligned
  int32_t* expert_offsets = nullptr;    // out: [E/W + 1] device; local expert i owns receive rows
                                        // [expert_offsets[i], expert_offsets[i+1])
};

// What moe_routing hands to dispatch and combine: a host-side handle (plain values); the routing
// itself lives on the device in `plan`, which must stay untouched until the last call using it.
struct MoePlan {
  MoeConfig config;
  int64_t capacity = 0;        // effective receive rows per rank
  int64_t num_tokens = 0;      // T of this rank
  void* plan = nullptr;        // MoeRoutingArgs::plan
  const int32_t* expert_offsets = nullptr;
};

Result<MoePlan> moe_routing(Communicator& comm, const MoeConfig& config, const MoeRoutingArgs& args,
                            cudaStream_t stream);

struct MoeDispatchOptions {
  int num_ctas = 0;      // 0: every SM of the GPU
  int arrival_ctas = 0;  // CTAs that receive (wait for rows, copy repeated tokens); 0: planner
};
// x: [T, H] device memory of this GPU (16-byte aligned). recv_x: symmetric [capacity, H] (the
// same Communicator::alloc on every rank); rows past expert_offsets[E/W] are not written.
Status moe_dispatch(Communicator& comm, const MoePlan& plan, const void* x, void* recv_x, cudaStream_t stream,
                    const MoeDispatchOptions& options = {});

struct MoeCombineArgs {
  const void* expert_out = nullptr;     // symmetric [capacity, hidden], rows in the receive layout
  void* out = nullptr;                  // [T, hidden] device memory of this GPU
  const float* topk_weights = nullptr;  // [T, k]; null: the weights given to moe_routing
  int64_t hidden = 0;                   // 0: config.hidden
  DType dtype = DType::kBF16;           // of expert_out and out
};
struct MoeCombineOptions {
  int num_ctas = 0;  // 0: planner
};
// out[t] = sum over t's routed slots j, in slot order, of w[t,j] * expert_out[row of (t, j)],
// accumulated in fp32 (fused multiply-add) and rounded once: bit-identical across runs. A token
// with no routed slot gets zeros.
Status moe_combine(Communicator& comm, const MoePlan& plan, const MoeCombineArgs& args, cudaStream_t stream,
                   const MoeCombineOptions& options = {});

// What the device found while routing, read after the stream's work (this call synchronizes
// `stream` with Communicator::synchronize, bounded). `status` is invalid_argument when the routing
// refused its input (nothing moved); the counts are this rank's.
struct MoeReport {
  Status status;
  int64_t recv_rows = 0;      // rows routed to this rank (before the capacity)
  int64_t kept_rows = 0;      // rows in its receive buffer (expert_offsets[E/W])
  int64_t dropped_rows = 0;   // recv_rows - kept_rows (MoeOverflow::kDrop)
  int64_t dropped_slots = 0;  // this rank's (token, slot) pairs that found no room at their expert
  int64_t max_recv_rows = 0;  // the largest recv_rows over all ranks (what capacity would fit)
};
Result<MoeReport> moe_report(Communicator& comm, const MoePlan& plan, cudaStream_t stream);

}  // namespace loom
