// The MoE family's host-side plan (host-only, unit-tested): which configs run, the sizes of the
// plan buffer and the symmetric workspace (kernels/moe/layout.h has the formulas), each kernel's
// grid and role split, and the launch signatures ranks compare at entry.
//
// Rules (a refusal names the rule; nothing is launched):
//   unsupported       a job of several nodes (designed in docs/MOE.md, not built); more than
//                     kMaxLocalWorld local ranks; E > kMaxExperts; k > kMaxTopK; max_tokens * k
//                     or W * capacity past INT32_MAX (32-bit slot indices); fewer than 2 SMs
//   invalid_argument  E, k or H not positive; E not a multiple of W; k > E; H * element size not
//                     a multiple of 16 bytes; negative max_tokens or capacity
#pragma once

#include <cstdint>
#include <initializer_list>

#include "kernels/moe/layout.h"
#include "loom/moe.h"
#include "loom/status.h"
#include "runtime/device_abi.h"

namespace loom::planner {

struct MoeRequest {
  MoeConfig config;
  int world = 1;      // ranks of the NVLink domain (the job's local world)
  int num_nodes = 1;  // nodes of the job
};

// A config that can run, with its buffers laid out.
struct MoeLayouts {
  int64_t capacity = 0;       // C
  int64_t local_experts = 0;  // E / W
  uint64_t row_bytes = 0;     // H * element size
  kernels::moe::PlanLayout plan{};
  kernels::moe::WorkspaceLayout workspace{};

  MoeSizes sizes() const;
};

Result<MoeLayouts> plan_moe(const MoeRequest& request);

// The dispatch kernel's grid and its arrival CTAs (the rest push): `num_ctas` CTAs (0: sm_count),
// at most sm_count (every CTA must be resident: arrival CTAs wait for rows the push CTAs of the
// same launch send), at least 2; arrival_ctas (0: 1 / kArrivalShareDen of the grid, at least one)
// leaves at least one pushing CTA.
struct MoeDispatchGrid {
  int grid = 0;
  int arrival_ctas = 0;
};
Result<MoeDispatchGrid> plan_moe_dispatch(int sm_count, int num_ctas, int arrival_ctas);

// The routing kernel's grid: enough CTAs for one warp per chunk of kChunkTokens tokens, at least
// one (the coordinator), at most sm_count (CTAs wait for each other within the launch).
int plan_moe_routing_grid(int64_t tokens, int sm_count);

// The combine kernel's grid: `num_ctas` (0: one warp per token up to every SM), at most sm_count
// and kMaxCtas, at least one.
Result<int> plan_moe_combine_grid(int64_t tokens, int sm_count, int num_ctas);

// The 32-bit signature of a launch (entry words carry it; a rank that entered the same launch with
// another signature fails it with a mismatch, invalid_argument): ops/launch/signature.h over the op
// and the values every rank must agree on.
uint32_t moe_signature(OpId op, std::initializer_list<int64_t> values);

}  // namespace loom::planner
