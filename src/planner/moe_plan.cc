#include "planner/moe_plan.h"

#include "kernels/moe/grouped_gemm_params.h"
#include "ops/launch/signature.h"
#include "runtime/network_layout.h"

#include <algorithm>
#include <cmath>
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
  const int nodes = request.num_nodes;
  if (nodes < 1 || world < 1 || world % nodes != 0) {
    return Status::invalid_argument("moe: " + num(world) + " ranks do not split evenly over " + num(nodes) + " nodes");
  }
  const int local = world / nodes;
  if (local > MoeTunables::kMaxLocalWorld) {
    return Status::unsupported("moe: " + num(local) + " ranks per node; the MoE kernels address 1 to " +
                               num(MoeTunables::kMaxLocalWorld) + " (destination sets are 32-bit masks)");
  }
  if (world > MoeTunables::kMaxWorld || nodes > MoeTunables::kMaxNodes) {
    return Status::unsupported("moe: " + num(world) + " ranks on " + num(nodes) + " nodes; the MoE kernels address at most " +
                               num(MoeTunables::kMaxWorld) + " ranks (the routing gives each one thread) and " +
                               num(MoeTunables::kMaxNodes) + " nodes (combine gives each node one lane of a warp)");
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
  l.world = world;
  l.num_nodes = nodes;
  kernels::moe::MoeShape shape;
  shape.world = static_cast<uint32_t>(world);
  shape.nodes = static_cast<uint32_t>(nodes);
  shape.experts = static_cast<uint32_t>(c.num_experts);
  shape.top_k = static_cast<uint32_t>(c.top_k);
  shape.max_tokens = static_cast<uint64_t>(c.max_tokens);
  shape.capacity = static_cast<uint64_t>(capacity);
  shape.row_bytes = row_bytes;
  shape.hidden = static_cast<uint64_t>(c.hidden);
  l.plan = kernels::moe::PlanLayout::make(shape.max_tokens, shape.top_k, shape.experts, shape.nodes);
  l.workspace = kernels::moe::WorkspaceLayout::make(shape);
  l.net_flag_words = kernels::moe::WorkspaceLayout::net_flag_words(shape);
  const runtime::net::NetWindowLayout window{shape.nodes, static_cast<uint32_t>(local)};
  if (l.net_flag_words > window.launch_capacity()) {
    return Status::unsupported("moe: max_tokens " + num(c.max_tokens) + " on " + num(nodes) + " nodes needs " +
                               num(static_cast<int64_t>(l.net_flag_words)) +
                               " network flags per call (one per chunk of " + num(MoeTunables::kNetChunkTokens) +
                               " tokens and remote node); the network flag window holds " +
                               num(window.launch_capacity()) + " (lower max_tokens)");
  }
  return l;
}

Result<MoeDispatchGrid> plan_moe_dispatch(int sm_count, int num_ctas, int arrival_ctas, int num_nodes) {
  const bool net = num_nodes > 1;
  const int least = net ? 3 : 2;
  if (sm_count < least) {
    return Status::unsupported("moe_dispatch: the GPU has " + num(sm_count) + " SMs; dispatch needs " + num(least) +
                               " (an arrival CTA, a pushing CTA" + (net ? std::string(", a forwarding CTA") : "") +
                               ", resident together)");
  }
  if (num_ctas < 0 || arrival_ctas < 0) {
    return Status::invalid_argument("moe_dispatch: num_ctas and arrival_ctas must not be negative");
  }
  MoeDispatchGrid g;
  g.grid = num_ctas == 0 ? sm_count : num_ctas;
  if (g.grid < least || g.grid > sm_count) {
    return Status::invalid_argument("moe_dispatch: num_ctas " + num(num_ctas) + " is outside [" + num(least) + ", " +
                                    num(sm_count) + "] (every CTA must be resident: at most one per SM)");
  }
  g.forward_ctas = net ? std::max(1, g.grid / MoeTunables::kForwardShareDen) : 0;
  g.arrival_ctas = arrival_ctas == 0 ? std::max(1, g.grid / MoeTunables::kArrivalShareDen) : arrival_ctas;
  if (g.arrival_ctas + g.forward_ctas >= g.grid) {
    return Status::invalid_argument("moe_dispatch: arrival_ctas " + num(arrival_ctas) + " leaves no pushing CTA of " +
                                    num(g.grid) + (net ? " (" + num(g.forward_ctas) + " forward)" : std::string()));
  }
  return g;
}

int plan_moe_routing_grid(int64_t tokens, int sm_count) {
  const int64_t chunks = static_cast<int64_t>(kernels::moe::routing_chunks(static_cast<uint64_t>(std::max<int64_t>(tokens, 0))));
  const int64_t ctas = (chunks + MoeTunables::kWarps - 1) / MoeTunables::kWarps;
  return static_cast<int>(std::clamp<int64_t>(ctas, 1, std::max(1, sm_count)));
}

Result<MoeCombineGrid> plan_moe_combine_grid(int64_t tokens, int sm_count, int num_ctas, int num_nodes) {
  const bool net = num_nodes > 1;
  const int most = std::max(1, std::min(sm_count, MoeTunables::kMaxCtas));
  const int least = net ? 2 : 1;
  if (num_ctas < 0 || num_ctas > most || (num_ctas > 0 && num_ctas < least) || most < least) {
    return Status::invalid_argument("moe_combine: num_ctas " + num(num_ctas) + " is outside [" + num(least) + ", " +
                                    num(most) + "] (0: planner; at most one CTA per SM" +
                                    (net ? std::string("; a reducing and a forwarding CTA across nodes") : "") + ")");
  }
  MoeCombineGrid g;
  if (num_ctas > 0) {
    g.grid = num_ctas;
  } else if (net) {
    g.grid = most;  // the partial sums of other nodes' tokens are work too, whatever this rank's T
  } else {
    const int64_t ctas = (std::max<int64_t>(tokens, 0) + MoeTunables::kWarps - 1) / MoeTunables::kWarps;
    g.grid = static_cast<int>(std::clamp<int64_t>(ctas, 1, most));
  }
  g.forward_ctas = net ? std::max(1, g.grid / MoeTunables::kForwardShareDen) : 0;
  return g;
}

uint32_t moe_signature(OpId op, std::initializer_list<int64_t> values) { return ops::values_signature(op, values); }

}  // namespace loom::planner

// ---- grouped GEMM ------------------------------------------------------------------------------

namespace loom {

namespace {

namespace km = kernels::moe;

constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;

km::GroupedRows rows_layout(GroupedLayout layout) {
  return layout == GroupedLayout::kMasked ? km::GroupedRows::kMasked : km::GroupedRows::kContiguous;
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Byte range [lo, hi) of a packed tensor.
struct Span {
  uintptr_t lo, hi;
};
Span span_of(const void* p, int64_t elements, size_t elem) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  return {lo, lo + static_cast<uintptr_t>(std::max<int64_t>(elements, 0)) * elem};
}
bool overlap(Span x, Span y) { return x.lo < y.hi && y.lo < x.hi; }

std::string num(int64_t v) { return std::to_string(v); }

}  // namespace

std::string_view grouped_layout_name(GroupedLayout layout) {
  return layout == GroupedLayout::kMasked ? "masked" : "contiguous";
}

Result<GroupedLayout> parse_grouped_layout(std::string_view name) {
  if (name == "contiguous") return GroupedLayout::kContiguous;
  if (name == "masked") return GroupedLayout::kMasked;
  return Status::invalid_argument("unknown grouped GEMM layout '" + std::string(name) +
                                  "' (expected contiguous or masked)");
}

size_t grouped_gemm_workspace_bytes(const GroupedGemmArgs& args) {
  const int64_t rows = args.layout == GroupedLayout::kMasked ? args.capacity : args.m_total;
  if (args.num_experts < 1 || rows < 0 || args.num_experts > kMaxDim || rows > kMaxDim) return 0;
  const uint64_t t_max = km::grouped_max_tile_rows(rows_layout(args.layout), static_cast<uint64_t>(rows),
                                                   static_cast<uint64_t>(args.num_experts),
                                                   km::GroupedGemmTunables::kMinBlockM);
  return static_cast<size_t>(km::kGroupedWorkspaceHeaderBytes + sizeof(km::GroupedTileRow) * t_max);
}

Status grouped_gemm_can_implement(const GroupedGemmArgs& args, const GroupedGemmOptions& options) {
  const bool masked = args.layout == GroupedLayout::kMasked;
  if (args.layout != GroupedLayout::kContiguous && !masked) {
    return Status::invalid_argument("grouped_gemm: unknown layout");
  }
  if (args.b_layout != BLayout::kNK && args.b_layout != BLayout::kKN) {
    return Status::invalid_argument("grouped_gemm: unknown b_layout");
  }
  const bool swiglu = args.activation == GroupedActivation::kSwiGLU;
  if (args.activation != GroupedActivation::kNone && !swiglu) {
    return Status::invalid_argument("grouped_gemm: unknown activation");
  }
  if (args.a == nullptr) return Status::invalid_argument("grouped_gemm: a is null");
  if (args.b == nullptr) return Status::invalid_argument("grouped_gemm: b is null");
  if (args.d == nullptr) return Status::invalid_argument("grouped_gemm: d is null");
  if (!masked && args.offsets == nullptr) {
    return Status::invalid_argument("grouped_gemm: the contiguous layout needs offsets (int32 [E + 1])");
  }
  if (masked && args.counts == nullptr) {
    return Status::invalid_argument("grouped_gemm: the masked layout needs counts (int32 [E])");
  }
  if (args.num_experts < 1) {
    return Status::invalid_argument("grouped_gemm: num_experts = " + num(args.num_experts) + ": need at least one expert");
  }
  if (args.n < 0 || args.k < 0 || args.m_total < 0 || args.capacity < 0) {
    return Status::invalid_argument("grouped_gemm: negative size (M_total = " + num(args.m_total) + ", capacity = " +
                                    num(args.capacity) + ", N = " + num(args.n) + ", K = " + num(args.k) + ")");
  }
  if (args.in_dtype != DType::kBF16 && args.in_dtype != DType::kF16 && args.in_dtype != DType::kF32) {
    return Status::invalid_argument("grouped_gemm: unknown in_dtype");
  }
  if (args.out_dtype != DType::kBF16 && args.out_dtype != DType::kF16 && args.out_dtype != DType::kF32) {
    return Status::invalid_argument("grouped_gemm: unknown out_dtype");
  }
  if (static_cast<int>(options.tile) > static_cast<int>(GemmTile::k64x128)) {
    return Status::invalid_argument("grouped_gemm: unknown GemmTile value");
  }
  if (options.num_ctas < 0) return Status::invalid_argument("grouped_gemm: num_ctas must be >= 0 (0: planner)");
  if (options.group_m < 0 || options.group_m > planner::kMaxGroupedGroupM) {
    return Status::invalid_argument("grouped_gemm: group_m " + std::to_string(options.group_m) + " is outside [0, " +
                                    std::to_string(planner::kMaxGroupedGroupM) + "] (0: planner)");
  }
  if (!aligned(args.a, 16)) return Status::invalid_argument("grouped_gemm: a is not 16-byte aligned");
  if (!aligned(args.b, 16)) return Status::invalid_argument("grouped_gemm: b is not 16-byte aligned");
  if (!aligned(args.d, 16)) return Status::invalid_argument("grouped_gemm: d is not 16-byte aligned");
  if (!masked && !aligned(args.offsets, 4)) return Status::invalid_argument("grouped_gemm: offsets is not 4-byte aligned");
  if (masked && !aligned(args.counts, 4)) return Status::invalid_argument("grouped_gemm: counts is not 4-byte aligned");

  if (args.in_dtype == DType::kF32) {
    return Status::unsupported("grouped_gemm: in_dtype fp32 is not supported (A and B must be bf16 or fp16)");
  }
  if (args.n == 0 || args.n % 8 != 0) {
    return Status::unsupported("grouped_gemm: N = " + num(args.n) +
                               ": N must be a positive multiple of 8 (D's rows must be a multiple of 16 bytes for TMA)");
  }
  if (swiglu && args.n % 16 != 0) {
    return Status::unsupported("grouped_gemm: N = " + num(args.n) +
                               ": the SwiGLU epilogue needs N (gate and up interleaved by 8) to be a multiple of 16");
  }
  if (swiglu && options.tile != GemmTile::kAuto && gemm_tile_info(options.tile).block_n < planner::kSwiGluMinBlockN) {
    return Status::unsupported("grouped_gemm: tile " + std::string(gemm_tile_name(options.tile)) +
                               ": the SwiGLU epilogue needs BLOCK_N >= " + std::to_string(planner::kSwiGluMinBlockN) +
                               " (a tile's BLOCK_N / 2 outputs fill whole 128-byte staged rows)");
  }
  if (args.k == 0 || args.k % 8 != 0) {
    return Status::unsupported("grouped_gemm: K = " + num(args.k) +
                               ": K must be a positive multiple of 8 (A's and B's rows must be a multiple of 16 bytes "
                               "for TMA)");
  }
  if (args.n > kMaxDim || args.k > kMaxDim || args.num_experts > kMaxDim || args.m_total > kMaxDim ||
      args.capacity > kMaxDim) {
    return Status::unsupported("grouped_gemm: M_total, capacity, N, K and E must each be below 2^31");
  }
  const int64_t rows = planner::grouped_gemm_rows(args);
  if (masked && args.capacity > 0 && args.num_experts > kMaxDim / args.capacity) {
    return Status::unsupported("grouped_gemm: E * capacity = " + num(args.num_experts) + " * " + num(args.capacity) +
                               " rows: must be below 2^31");
  }
  // TMA strides are below 2^40 bytes: B's expert stride is N * K elements.
  if (args.n * args.k >= (int64_t{1} << 39)) {
    return Status::unsupported("grouped_gemm: N * K must be below 2^39 elements (B's stride between experts)");
  }

  if (rows > 0) {
    const size_t need = grouped_gemm_workspace_bytes(args);
    if (args.workspace == nullptr) {
      return Status::invalid_argument("grouped_gemm: workspace is null (it needs " + std::to_string(need) +
                                      " bytes: grouped_gemm_workspace_bytes)");
    }
    if (!aligned(args.workspace, 16)) return Status::invalid_argument("grouped_gemm: workspace is not 16-byte aligned");
    if (args.workspace_bytes < need) {
      return Status::invalid_argument("grouped_gemm: workspace_bytes = " + std::to_string(args.workspace_bytes) +
                                      " is too small: " + std::to_string(need) + " bytes needed");
    }
  }

  const size_t in_size = dtype_size(args.in_dtype), out_size = dtype_size(args.out_dtype);
  const Span a = span_of(args.a, rows * args.k, in_size);
  const Span b = span_of(args.b, args.num_experts * args.n * args.k, in_size);
  const Span d = span_of(args.d, rows * planner::grouped_gemm_out_cols(args), out_size);
  if (overlap(d, a)) return Status::invalid_argument("grouped_gemm: d overlaps a");
  if (overlap(d, b)) return Status::invalid_argument("grouped_gemm: d overlaps b");
  if (rows > 0) {
    const Span w = span_of(args.workspace, static_cast<int64_t>(args.workspace_bytes), 1);
    if (overlap(w, a) || overlap(w, b) || overlap(w, d)) {
      return Status::invalid_argument("grouped_gemm: workspace overlaps a, b or d");
    }
  }
  return Status{};
}

namespace planner {

int64_t grouped_gemm_rows(const GroupedGemmArgs& args) {
  return args.layout == GroupedLayout::kMasked ? args.num_experts * args.capacity : args.m_total;
}

int64_t grouped_gemm_out_cols(const GroupedGemmArgs& args) {
  return args.activation == GroupedActivation::kSwiGLU ? args.n / 2 : args.n;
}

GemmTile choose_grouped_gemm_tile(const GroupedGemmArgs& args, int sm_count, const GemmCostModel& model) {
  // Ties (within 0.1%) go to the earlier entry.
  static constexpr GemmTile kOrder[] = {GemmTile::k128x256, GemmTile::k128x128, GemmTile::k64x128, GemmTile::k128x64};
  const int64_t rows = grouped_gemm_rows(args);
  GemmTile best = kOrder[0];
  double best_s = 0;
  for (GemmTile t : kOrder) {
    if (args.activation == GroupedActivation::kSwiGLU && gemm_tile_info(t).block_n < kSwiGluMinBlockN) continue;
    const int64_t block_m = gemm_tile_info(t).block_m;
    // Contiguous experts each end in a partial tile row, half a tile row on average; one expert's
    // rows are known (at most M_total), so its tail is exact. Counting half a row there put
    // Mixtral's fc2 (2048 x 4096 x 14336) at 17 tile rows, a third wave of 128 x 256 tiles.
    int64_t covered = rows;
    if (args.layout == GroupedLayout::kContiguous) {
      covered = args.num_experts == 1 ? (rows + block_m - 1) / block_m * block_m
                                      : rows + std::min(args.num_experts, rows) * block_m / 2;
    }
    const double s = gemm_model_seconds(t, std::max<int64_t>(covered, 1), args.n, args.k, sm_count, model);
    if (t == kOrder[0] || s < best_s * 0.999) {
      best = t;
      best_s = s;
    }
  }
  return best;
}

Result<GroupedGemmPlan> plan_grouped_gemm(const GroupedGemmArgs& args, const GroupedGemmOptions& options,
                                          const GemmDeviceLimits& device) {
  LOOM_TRY(grouped_gemm_can_implement(args, options));
  if (device.sm_count <= 0) return Status::invalid_argument("grouped_gemm: device reports no SMs");
  GroupedGemmPlan plan;
  plan.tile = options.tile == GemmTile::kAuto ? choose_grouped_gemm_tile(args, device.sm_count) : options.tile;
  const GemmTileInfo info = gemm_tile_info(plan.tile);
  if (device.smem_per_block_optin > 0 && static_cast<int64_t>(info.smem_bytes) > device.smem_per_block_optin) {
    return Status::unsupported("grouped_gemm: tile " + std::string(gemm_tile_name(plan.tile)) + " needs " +
                               std::to_string(info.smem_bytes) + " bytes of shared memory; the device allows " +
                               std::to_string(device.smem_per_block_optin));
  }
  plan.rows = grouped_gemm_rows(args);
  const int64_t per_expert_rows = args.layout == GroupedLayout::kMasked ? args.capacity : args.m_total;
  plan.max_tile_rows = static_cast<int64_t>(kernels::moe::grouped_max_tile_rows(
      args.layout == GroupedLayout::kMasked ? kernels::moe::GroupedRows::kMasked : kernels::moe::GroupedRows::kContiguous,
      static_cast<uint64_t>(per_expert_rows), static_cast<uint64_t>(args.num_experts),
      static_cast<uint64_t>(info.block_m)));
  plan.n_blocks = (args.n + info.block_n - 1) / info.block_n;
  const int64_t max_tiles = plan.max_tile_rows * plan.n_blocks;
  plan.num_ctas = options.num_ctas > 0 ? options.num_ctas
                                       : static_cast<int>(std::clamp<int64_t>(max_tiles, 1, device.sm_count));
  // As plan_gemm: a wave of num_ctas tiles loads the fewest bytes near g = sqrt(num_ctas * BN / BM)
  // tile rows (the rows of a few experts; each expert's B is shared by its tile rows).
  const double g = std::sqrt(static_cast<double>(plan.num_ctas) * info.block_n / info.block_m);
  plan.group_m = options.group_m > 0 ? options.group_m
                                     : static_cast<int>(std::clamp<double>(std::round(g), 1.0, kMaxGroupedGroupM));
  return plan;
}

GroupedGemmArgs dispatch_gemm_grouped_args(const MoePlan& plan, const MoeLayouts& layouts, const void* recv_x,
                                           const MoeExpertGemm& gemm, void* tile_table) {
  GroupedGemmArgs a;
  a.layout = GroupedLayout::kContiguous;
  a.a = recv_x;
  a.b = gemm.weights;
  a.d = gemm.out;
  a.offsets = plan.expert_offsets;
  a.m_total = layouts.capacity;
  a.n = gemm.n;
  a.k = plan.config.hidden;
  a.num_experts = layouts.local_experts;
  a.in_dtype = plan.config.dtype;
  a.out_dtype = gemm.out_dtype;
  a.b_layout = gemm.b_layout;
  a.activation = gemm.activation;
  a.workspace = tile_table;
  a.workspace_bytes = static_cast<size_t>(kernels::moe::tile_table_bytes(static_cast<uint64_t>(layouts.capacity),
                                                                          static_cast<uint64_t>(layouts.local_experts)));
  return a;
}

Result<MoeDispatchGemmPlan> plan_moe_dispatch_gemm(const GroupedGemmArgs& args, const MoeDispatchGemmOptions& options,
                                                   const GemmDeviceLimits& device, MoeJob job) {
  constexpr const char* kOp = "moe_dispatch_gemm";
  const int num_nodes = job.num_nodes;
  const bool one_rank = job.world == 1;
  const int sms = device.sm_count;
  if (sms < 2) {
    return Status::unsupported(std::string(kOp) + ": the GPU has " + num(sms) +
                               " SMs; the kernel needs 2 (a pushing and an arrival CTA, resident together)");
  }
  if (options.num_ctas < 0 || options.push_ctas < 0 || options.arrival_ctas < 0) {
    return Status::invalid_argument(std::string(kOp) + ": num_ctas, push_ctas and arrival_ctas must not be negative");
  }
  const bool built = options.tile == GemmTile::kAuto ||
                     std::find(std::begin(kDispatchGemmTiles), std::end(kDispatchGemmTiles), options.tile) !=
                         std::end(kDispatchGemmTiles);
  if (!built) {
    return Status::unsupported(std::string(kOp) + ": tile " + std::string(gemm_tile_name(options.tile)) +
                               " is not built for the fused kernel (k128x256 and k128x128 are)");
  }
  GroupedGemmOptions grouped;
  grouped.tile = options.tile;
  if (grouped.tile == GemmTile::kAuto) {
    LOOM_TRY_CTX(grouped_gemm_can_implement(args, grouped), kOp);
    const GemmTile t = choose_grouped_gemm_tile(args, sms);
    grouped.tile = t == GemmTile::k128x256 ? t : GemmTile::k128x128;
  }
  MoeDispatchGemmPlan plan;
  plan.grid = options.num_ctas == 0 ? sms : options.num_ctas;
  if (plan.grid < 2 || plan.grid > sms) {
    return Status::invalid_argument(std::string(kOp) + ": num_ctas " + num(options.num_ctas) + " is outside [2, " +
                                    num(sms) + "] (every CTA must be resident: one per SM)");
  }
  grouped.num_ctas = plan.grid;
  Result<GroupedGemmPlan> gemm = plan_grouped_gemm(args, grouped, device);
  if (!gemm.ok()) return std::move(gemm).take_status().with_context(kOp);
  plan.gemm = *gemm;
  const int push_share = one_rank ? MoeTunables::kFusedPushShareDenOneRank : MoeTunables::kFusedPushShareDen;
  plan.push_ctas = options.push_ctas != 0 ? options.push_ctas : std::max(1, plan.grid / push_share);
  plan.arrival_ctas = options.arrival_ctas != 0 ? options.arrival_ctas
                      : one_rank               ? 0
                                               : std::max(1, plan.grid / MoeTunables::kFusedArrivalShareDen);
  plan.forward_ctas = num_nodes > 1 ? std::max(1, plan.grid / MoeTunables::kFusedForwardShareDen) : 0;
  if (plan.push_ctas + plan.arrival_ctas + plan.forward_ctas > plan.grid) {
    return Status::invalid_argument(std::string(kOp) + ": push_ctas " + num(plan.push_ctas) + " and arrival_ctas " +
                                    num(plan.arrival_ctas) + (num_nodes > 1 ? " (and " + num(plan.forward_ctas) + " forward)" : std::string()) +
                                    " exceed the grid of " + num(plan.grid) + " CTAs");
  }
  return plan;
}

}  // namespace planner

int64_t moe_layer_rows(int64_t capacity, int64_t max_tokens, bool shared_expert) {
  if (capacity < 0 || max_tokens < 0) return 0;
  return static_cast<int64_t>(kernels::moe::layer_rows(static_cast<uint64_t>(capacity),
                                                       static_cast<uint64_t>(max_tokens), shared_expert));
}

Status moe_topk_can_implement(const MoeTopkArgs& a) {
  const std::string op = "moe_topk: ";
  if (a.num_tokens < 0 || a.num_tokens > INT32_MAX) {
    return Status::invalid_argument(op + "num_tokens " + planner::num(a.num_tokens) + " is outside [0, 2^31)");
  }
  if (a.num_experts < 1 || a.num_experts > kMoeMaxExperts) {
    return Status::invalid_argument(op + "num_experts " + planner::num(a.num_experts) + " is outside [1, " +
                                    planner::num(kMoeMaxExperts) + "] (a token's logits are staged in shared memory)");
  }
  if (a.top_k < 1 || a.top_k > kMoeMaxTopK || a.top_k > a.num_experts) {
    return Status::invalid_argument(op + "top_k " + planner::num(a.top_k) + " is outside [1, min(E, " +
                                    planner::num(kMoeMaxTopK) + ")] (E = " + planner::num(a.num_experts) + ")");
  }
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16 && a.dtype != DType::kF32) {
    return Status::invalid_argument(op + "unknown logits dtype");
  }
  if (a.scoring != MoeScoring::kSoftmax && a.scoring != MoeScoring::kSigmoid) {
    return Status::invalid_argument(op + "unknown scoring");
  }
  if (a.num_tokens == 0) return {};
  if (a.logits == nullptr || a.topk_ids == nullptr || a.topk_weights == nullptr) {
    return Status::invalid_argument(op + "logits, topk_ids and topk_weights must not be null");
  }
  const auto addr = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  if (addr(a.logits) % dtype_size(a.dtype) != 0 || addr(a.topk_ids) % 4 != 0 || addr(a.topk_weights) % 4 != 0) {
    return Status::invalid_argument(op + "logits must be aligned to their element type, topk_ids and topk_weights to 4 bytes");
  }
  const uint64_t logit_bytes = static_cast<uint64_t>(a.num_tokens) * static_cast<uint64_t>(a.num_experts) * dtype_size(a.dtype);
  const uint64_t pair_bytes = static_cast<uint64_t>(a.num_tokens) * static_cast<uint64_t>(a.top_k) * 4;
  const auto overlap = [&](const void* x, uint64_t xb, const void* y, uint64_t yb) {
    return addr(x) < addr(y) + yb && addr(y) < addr(x) + xb;
  };
  if (overlap(a.logits, logit_bytes, a.topk_ids, pair_bytes) || overlap(a.logits, logit_bytes, a.topk_weights, pair_bytes) ||
      overlap(a.topk_ids, pair_bytes, a.topk_weights, pair_bytes)) {
    return Status::invalid_argument(op + "logits, topk_ids and topk_weights must not overlap");
  }
  return {};
}

namespace planner {

GroupedGemmArgs layer_up_args(const MoePlan& plan, const MoeLayouts& layouts, const MoeLayerWeights& weights,
                              const MoeLayerBuffers& buffers, void* tile_table) {
  MoeExpertGemm gemm;
  gemm.weights = weights.gate_up;
  gemm.n = 2 * weights.intermediate;
  gemm.activation = GroupedActivation::kSwiGLU;
  gemm.out = buffers.hidden;
  gemm.out_dtype = plan.config.dtype;
  return dispatch_gemm_grouped_args(plan, layouts, buffers.recv_x, gemm, tile_table);
}

GroupedGemmArgs layer_down_args(const MoePlan& plan, const MoeLayouts& layouts, const MoeLayerWeights& weights,
                                const MoeLayerBuffers& buffers, void* tile_table) {
  MoeExpertGemm gemm;
  gemm.weights = weights.down;
  gemm.n = plan.config.hidden;
  gemm.out = buffers.expert_out;
  gemm.out_dtype = plan.config.dtype;
  GroupedGemmArgs a = dispatch_gemm_grouped_args(plan, layouts, buffers.hidden, gemm, tile_table);
  a.k = weights.intermediate;
  return a;
}

Result<MoeLayerPlan> plan_moe_layer(const GroupedGemmArgs& up, const GroupedGemmArgs& down, const MoeLayerOptions& options,
                                    const GemmDeviceLimits& device, MoeJob job) {
  MoeDispatchGemmOptions fused;
  fused.tile = options.tile;
  fused.num_ctas = options.num_ctas;
  fused.push_ctas = options.push_ctas;
  fused.arrival_ctas = options.arrival_ctas;
  Result<MoeDispatchGemmPlan> first = plan_moe_dispatch_gemm(up, fused, device, job);
  if (!first.ok()) return std::move(first).take_status().with_context("moe_layer (gate/up GEMM)");
  MoeLayerPlan plan;
  plan.up = first->gemm;
  plan.grid = first->grid;
  plan.push_ctas = first->push_ctas;
  plan.arrival_ctas = first->arrival_ctas;
  plan.forward_ctas = first->forward_ctas;
  GroupedGemmOptions second;
  second.tile = plan.up.tile;  // one tile table for both GEMMs: the same BLOCK_M
  second.num_ctas = plan.grid;
  Result<GroupedGemmPlan> down_plan = plan_grouped_gemm(down, second, device);
  if (!down_plan.ok()) return std::move(down_plan).take_status().with_context("moe_layer (down GEMM)");
  plan.down = *down_plan;
  return plan;
}

}  // namespace planner
}  // namespace loom
