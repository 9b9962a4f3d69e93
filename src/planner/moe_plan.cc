#include "planner/moe_plan.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/moe/grouped_gemm_params.h"

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
  const Span d = span_of(args.d, rows * args.n, out_size);
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

GemmTile choose_grouped_gemm_tile(const GroupedGemmArgs& args, int sm_count, const GemmCostModel& model) {
  // Ties (within 0.1%) go to the earlier entry.
  static constexpr GemmTile kOrder[] = {GemmTile::k128x256, GemmTile::k128x128, GemmTile::k64x128, GemmTile::k128x64};
  const int64_t rows = grouped_gemm_rows(args);
  GemmTile best = kOrder[0];
  double best_s = 0;
  for (GemmTile t : kOrder) {
    const int64_t block_m = gemm_tile_info(t).block_m;
    int64_t covered = rows;
    if (args.layout == GroupedLayout::kContiguous) covered += std::min(args.num_experts, rows) * block_m / 2;
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
  plan.group_m = static_cast<int>(std::clamp<double>(std::round(g), 1.0, 64.0));
  return plan;
}

}  // namespace planner
}  // namespace loom
