#include "planner/moe_plan.h"

#include "ops/launch/signature.h"

#include <algorithm>
#include <climits>
#include <string>

namespace loom::planner {
namespace {

using kernels::moe::MoeTunables;

static_assert(kMoeMaxTopK == MoeTunables::kMaxTopK, "loom/moe.h and kernels/moe/layout.h must agree on the top-k limit");
static_assert(kMoeMaxExperts == MoeTunables::kMaxExperts,
              "loom/moe.h and kernels/moe/layout.h must agree on the expert limit");
static_assert(kMoeMaxLocalWorld == MoeTunables::kMaxLocalWorld,
              "loom/moe.h and kernels/moe/layout.h must agree on the local-world limit");

std::string num(int64_t v) { return std::to_string(v); }

}  // namespace

MoeSizes MoeLayouts::sizes() const {
  MoeSizes s;
  s.capacity = capacity;
  s.local_experts = local_experts;
  s.plan_bytes = static_cast<size_t>(plan.bytes);
  s.recv_bytes = static_cast<size_t>(capacity) * static_cast<size_t>(row_bytes);
  s.workspace_bytes = static_cast<size_t>(workspace.bytes);
  return s;
}

Result<MoeLayouts> plan_moe(const MoeRequest& request) {
  const MoeConfig& c = request.config;
  const int world = request.world;
  if (request.num_nodes > 1) {
    return Status::unsupported("moe: the MoE operators run within one NVLink domain; this job spans " +
                               num(request.num_nodes) +
                               " nodes (dispatch across nodes is designed in docs/MOE.md, not built yet)");
  }
  if (world < 1 || world > MoeTunables::kMaxLocalWorld) {
    return Status::unsupported("moe: " + num(world) + " local ranks; the MoE kernels address 1 to " +
                               num(MoeTunables::kMaxLocalWorld) + " (destination sets are 32-bit masks)");
  }
  if (c.num_experts <= 0) return Status::invalid_argument("moe: num_experts must be positive, not " + num(c.num_experts));
  if (c.num_experts > MoeTunables::kMaxExperts) {
    return Status::unsupported("moe: " + num(c.num_experts) + " experts; at most " + num(MoeTunables::kMaxExperts) +
                               " (the routing keeps per-warp expert histograms in shared memory)");
  }
  if (c.num_experts % world != 0) {
    return Status::invalid_argument("moe: num_experts " + num(c.num_experts) + " is not a multiple of the " + num(world) +
                                    " ranks (experts are split contiguously, E/W per rank)");
  }
  if (c.top_k <= 0) return Status::invalid_argument("moe: top_k must be positive, not " + num(c.top_k));
  if (c.top_k > c.num_experts) {
    return Status::invalid_argument("moe: top_k " + num(c.top_k) + " is larger than the expert count " +
                                    num(c.num_experts));
  }
  if (c.top_k > MoeTunables::kMaxTopK) {
    return Status::unsupported("moe: top_k " + num(c.top_k) + "; at most " + num(MoeTunables::kMaxTopK) +
                               " (a token's slots are the lanes of one warp)");
  }
  if (c.hidden <= 0) return Status::invalid_argument("moe: hidden must be positive, not " + num(c.hidden));
  const uint64_t row_bytes = static_cast<uint64_t>(c.hidden) * dtype_size(c.dtype);
  if (row_bytes % 16 != 0) {
    return Status::invalid_argument("moe: a token row is " + num(static_cast<int64_t>(row_bytes)) +
                                    " bytes (hidden " + num(c.hidden) + " x " + std::string(dtype_name(c.dtype)) +
                                    "); rows move as 16-byte vectors, so it must be a multiple of 16");
  }
  if (c.max_tokens < 0) return Status::invalid_argument("moe: max_tokens is negative (" + num(c.max_tokens) + ")");
  if (c.capacity < 0) return Status::invalid_argument("moe: capacity is negative (" + num(c.capacity) + ")");
  const int64_t max_pairs = c.max_tokens * c.top_k;
  if (c.max_tokens > INT32_MAX / c.top_k) {
    return Status::unsupported("moe: max_tokens x top_k = " + num(c.max_tokens) + " x " + num(c.top_k) +
                               " exceeds the 32-bit slot indices (" + num(INT32_MAX) + ")");
  }
  // Default capacity: every token of every rank to this rank, k rows each (nothing can overflow).
  const int64_t capacity = c.capacity > 0 ? c.capacity : std::max<int64_t>(1, max_pairs * world);
  if (capacity > INT32_MAX / world) {
    return Status::unsupported("moe: capacity " + num(capacity) + " rows x " + num(world) +
                               " ranks exceeds the 32-bit receive-row indices (" + num(INT32_MAX) +
                               "); set MoeConfig::capacity lower");
  }
  MoeLayouts l;
  l.capacity = capacity;
  l.local_experts = c.num_experts / world;
  l.row_bytes = row_bytes;
  const uint32_t experts = static_cast<uint32_t>(c.num_experts);
  l.plan = kernels::moe::PlanLayout::make(static_cast<uint64_t>(c.max_tokens), static_cast<uint32_t>(c.top_k), experts);
  l.workspace = kernels::moe::WorkspaceLayout::make(static_cast<uint32_t>(world), experts,
                                                    static_cast<uint64_t>(c.max_tokens), static_cast<uint64_t>(capacity));
  return l;
}

Result<MoeDispatchGrid> plan_moe_dispatch(int sm_count, int num_ctas, int arrival_ctas) {
  if (sm_count < 2) {
    return Status::unsupported("moe_dispatch: the GPU has " + num(sm_count) +
                               " SMs; dispatch needs 2 (an arrival CTA and a pushing CTA, resident together)");
  }
  if (num_ctas < 0 || arrival_ctas < 0) {
    return Status::invalid_argument("moe_dispatch: num_ctas and arrival_ctas must not be negative");
  }
  MoeDispatchGrid g;
  g.grid = num_ctas == 0 ? sm_count : num_ctas;
  if (g.grid < 2 || g.grid > sm_count) {
    return Status::invalid_argument("moe_dispatch: num_ctas " + num(num_ctas) + " is outside [2, " + num(sm_count) +
                                    "] (every CTA must be resident: at most one per SM)");
  }
  g.arrival_ctas = arrival_ctas == 0 ? std::max(1, g.grid / MoeTunables::kArrivalShareDen) : arrival_ctas;
  if (g.arrival_ctas >= g.grid) {
    return Status::invalid_argument("moe_dispatch: arrival_ctas " + num(arrival_ctas) + " leaves no pushing CTA of " +
                                    num(g.grid));
  }
  return g;
}

int plan_moe_routing_grid(int64_t tokens, int sm_count) {
  const int64_t chunks = static_cast<int64_t>(kernels::moe::routing_chunks(static_cast<uint64_t>(std::max<int64_t>(tokens, 0))));
  const int64_t ctas = (chunks + MoeTunables::kWarps - 1) / MoeTunables::kWarps;
  return static_cast<int>(std::clamp<int64_t>(ctas, 1, std::max(1, sm_count)));
}

Result<int> plan_moe_combine_grid(int64_t tokens, int sm_count, int num_ctas) {
  const int most = std::max(1, std::min(sm_count, MoeTunables::kMaxCtas));
  if (num_ctas < 0 || num_ctas > most) {
    return Status::invalid_argument("moe_combine: num_ctas " + num(num_ctas) + " is outside [0, " + num(most) +
                                    "] (0: planner; at most one CTA per SM)");
  }
  if (num_ctas > 0) return num_ctas;
  const int64_t ctas = (std::max<int64_t>(tokens, 0) + MoeTunables::kWarps - 1) / MoeTunables::kWarps;
  return static_cast<int>(std::clamp<int64_t>(ctas, 1, most));
}

uint32_t moe_signature(OpId op, std::initializer_list<int64_t> values) { return ops::values_signature(op, values); }

}  // namespace loom::planner
