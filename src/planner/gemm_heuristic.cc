#include "planner/gemm_heuristic.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "core/enum_names.h"
#include "kernels/gemm/config.h"

namespace loom {

namespace {

namespace kg = kernels::gemm;

template <class Cfg>
GemmTileInfo info_of() {
  return GemmTileInfo{Cfg::kBlockM, Cfg::kBlockN, Cfg::kBlockK, Cfg::kStages, Cfg::kThreads, Cfg::kSmemBytes};
}

std::string fmt(const char* f, long long a) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a);
  return buf;
}

bool valid_dtype(DType t) { return t == DType::kBF16 || t == DType::kF16 || t == DType::kF32; }

// Byte range [lo, hi) a row-major matrix occupies.
struct Span {
  uintptr_t lo, hi;
};
Span span_of(const void* p, int64_t rows, int64_t cols, int64_t ld, size_t elem) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  if (rows <= 0 || cols <= 0) return {lo, lo};
  return {lo, lo + static_cast<uintptr_t>(((rows - 1) * ld + cols) * static_cast<int64_t>(elem))};
}
bool overlap(Span x, Span y) { return x.lo < y.hi && y.lo < x.hi; }

constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;

}  // namespace

std::string_view b_layout_name(BLayout layout) { return layout == BLayout::kKN ? "kn" : "nk"; }

Result<BLayout> parse_b_layout(std::string_view name) {
  if (name == "kn" || name == "KN" || name == "row") return BLayout::kKN;
  if (name == "nk" || name == "NK" || name == "linear") return BLayout::kNK;
  return Status::invalid_argument("unknown B layout '" + std::string(name) + "' (expected kn or nk)");
}

constexpr EnumName<GemmTile> kGemmTileNames[] = {{GemmTile::kAuto, "auto"},
                                                  {GemmTile::k128x256, "128x256"},
                                                  {GemmTile::k128x128, "128x128"},
                                                  {GemmTile::k128x64, "128x64"},
                                                  {GemmTile::k64x128, "64x128"}};

std::string_view gemm_tile_name(GemmTile tile) { return name_in(kGemmTileNames, tile); }

Result<GemmTile> parse_gemm_tile(std::string_view name) { return parse_name_in(kGemmTileNames, name, "GEMM tile"); }

GemmTileInfo gemm_tile_info(GemmTile tile) {
  switch (tile) {
    case GemmTile::k128x256: return info_of<kg::Tile128x256>();
    case GemmTile::k128x128: return info_of<kg::Tile128x128>();
    case GemmTile::k128x64: return info_of<kg::Tile128x64>();
    case GemmTile::k64x128: return info_of<kg::Tile64x128>();
    case GemmTile::kAuto: break;
  }
  return GemmTileInfo{};
}

Status gemm_can_implement(const GemmArgs& args, const GemmOptions& options) {
  if (args.a == nullptr) return Status::invalid_argument("gemm: a is null");
  if (args.b == nullptr) return Status::invalid_argument("gemm: b is null");
  if (args.d == nullptr) return Status::invalid_argument("gemm: d is null");
  if (args.m < 0 || args.n < 0 || args.k < 0) {
    return Status::invalid_argument("gemm: negative size (M = " + std::to_string(args.m) + ", N = " +
                                    std::to_string(args.n) + ", K = " + std::to_string(args.k) + ")");
  }
  if (args.lda < 0 || args.ldb < 0 || args.ldd < 0) return Status::invalid_argument("gemm: negative leading dimension");
  if (!valid_dtype(args.in_dtype) || !valid_dtype(args.out_dtype)) return Status::invalid_argument("gemm: unknown dtype");
  if (args.b_layout != BLayout::kKN && args.b_layout != BLayout::kNK) {
    return Status::invalid_argument("gemm: unknown B layout");
  }
  if (static_cast<int>(options.tile) > static_cast<int>(GemmTile::k64x128)) {
    return Status::invalid_argument("gemm: unknown GemmTile value");
  }
  if (options.num_ctas < 0) return Status::invalid_argument("gemm: num_ctas must be >= 0 (0: planner)");
  if (options.group_m < 0) return Status::invalid_argument("gemm: group_m must be >= 0 (0: planner)");

  if (args.in_dtype == DType::kF32) {
    return Status::unsupported("gemm: in_dtype fp32 is not supported (A and B must be bf16 or fp16)");
  }
  if (args.n == 0 || args.n % 8 != 0) {
    return Status::unsupported(fmt("gemm: N = %lld: N must be a positive multiple of 8", args.n));
  }
  if (args.k == 0 || args.k % 8 != 0) {
    return Status::unsupported(fmt("gemm: K = %lld: K must be a positive multiple of 8", args.k));
  }
  if (args.m > kMaxDim || args.n > kMaxDim || args.k > kMaxDim) {
    return Status::unsupported("gemm: M, N and K must each be below 2^31");
  }

  const planner::GemmLeadingDims ld = planner::resolve_leading_dims(args);
  const int64_t b_row = args.b_layout == BLayout::kKN ? args.n : args.k;
  if (ld.lda < args.k) return Status::invalid_argument(fmt("gemm: lda = %lld is smaller than K", ld.lda));
  if (ld.ldb < b_row) {
    return Status::invalid_argument(fmt(args.b_layout == BLayout::kKN ? "gemm: ldb = %lld is smaller than N (B is [K, N])"
                                                                      : "gemm: ldb = %lld is smaller than K (B is [N, K])",
                                        ld.ldb));
  }
  if (ld.ldd < args.n) return Status::invalid_argument(fmt("gemm: ldd = %lld is smaller than N", ld.ldd));
  if (ld.lda > kMaxDim || ld.ldb > kMaxDim || ld.ldd > kMaxDim) {
    return Status::unsupported("gemm: leading dimensions must be below 2^31");
  }

  const size_t in_size = dtype_size(args.in_dtype);
  const size_t out_size = dtype_size(args.out_dtype);
  if (reinterpret_cast<uintptr_t>(args.a) % 16 != 0) return Status::invalid_argument("gemm: a is not 16-byte aligned");
  if (reinterpret_cast<uintptr_t>(args.b) % 16 != 0) return Status::invalid_argument("gemm: b is not 16-byte aligned");
  if (reinterpret_cast<uintptr_t>(args.d) % 16 != 0) return Status::invalid_argument("gemm: d is not 16-byte aligned");
  if ((ld.lda * static_cast<int64_t>(in_size)) % 16 != 0) {
    return Status::invalid_argument(fmt("gemm: lda = %lld: a row stride must be a multiple of 16 bytes", ld.lda));
  }
  if ((ld.ldb * static_cast<int64_t>(in_size)) % 16 != 0) {
    return Status::invalid_argument(fmt("gemm: ldb = %lld: a row stride must be a multiple of 16 bytes", ld.ldb));
  }
  if ((ld.ldd * static_cast<int64_t>(out_size)) % 16 != 0) {
    return Status::invalid_argument(fmt("gemm: ldd = %lld: a row stride must be a multiple of 16 bytes", ld.ldd));
  }

  const Span a = span_of(args.a, args.m, args.k, ld.lda, in_size);
  const Span b = args.b_layout == BLayout::kKN ? span_of(args.b, args.k, args.n, ld.ldb, in_size)
                                               : span_of(args.b, args.n, args.k, ld.ldb, in_size);
  const Span d = span_of(args.d, args.m, args.n, ld.ldd, out_size);
  if (overlap(d, a)) return Status::invalid_argument("gemm: d overlaps a");
  if (overlap(d, b)) return Status::invalid_argument("gemm: d overlaps b");
  return Status{};
}

GemmTile choose_gemm_tile(int64_t m, int64_t n, int64_t k, int sm_count) {
  // Ties (within 0.1%) go to the earlier entry.
  static constexpr GemmTile kOrder[] = {GemmTile::k128x256, GemmTile::k128x128, GemmTile::k64x128, GemmTile::k128x64};
  GemmTile best = GemmTile::k128x256;
  double best_s = 0;
  for (GemmTile t : kOrder) {
    const double s = planner::gemm_model_seconds(t, std::max<int64_t>(m, 1), n, k, sm_count);
    if (t == kOrder[0] || s < best_s * 0.999) {
      best = t;
      best_s = s;
    }
  }
  return best;
}

namespace planner {

GemmLeadingDims resolve_leading_dims(const GemmArgs& args) {
  GemmLeadingDims ld{args.lda, args.ldb, args.ldd};
  if (ld.lda == 0) ld.lda = args.k;
  if (ld.ldb == 0) ld.ldb = args.b_layout == BLayout::kKN ? args.n : args.k;
  if (ld.ldd == 0) ld.ldd = args.n;
  return ld;
}

double gemm_model_seconds(GemmTile tile, int64_t m, int64_t n, int64_t k, int sm_count, const GemmCostModel& model) {
  const GemmTileInfo info = gemm_tile_info(tile);
  if (info.block_m == 0 || sm_count <= 0) return 1e30;
  double eff = model.eff_128x256;
  if (tile == GemmTile::k128x128) eff = model.eff_128x128;
  if (tile == GemmTile::k128x64) eff = model.eff_128x64;
  if (tile == GemmTile::k64x128) eff = model.eff_64x128;
  const double bm = info.block_m, bn = info.block_n;
  const int64_t tiles = ((m + info.block_m - 1) / info.block_m) * ((n + info.block_n - 1) / info.block_n);
  const double waves = static_cast<double>((tiles + sm_count - 1) / sm_count);
  const double k_pad = static_cast<double>((k + 63) / 64 * 64);
  const double compute = waves * 2.0 * bm * bn * k_pad / (model.sm_peak_flops * eff);
  const double stream = waves * (bm + bn) * k_pad * 2.0 / model.sm_stream_bytes_per_s;
  const double busy_sms = static_cast<double>(std::min<int64_t>(tiles, sm_count));
  const double dram_share = std::min(1.0, busy_sms / (model.dram_saturating_sm_fraction * sm_count));
  const double dram =
      (static_cast<double>(m) * k + static_cast<double>(n) * k) * 2.0 / (model.dram_bytes_per_s * dram_share);
  // The small compute term breaks ties between memory-bound candidates towards less padding.
  return std::max({compute, stream, dram}) + 0.02 * compute + waves * model.tile_overhead_s;
}

Result<GemmPlan> plan_gemm(const GemmArgs& args, const GemmOptions& options, const GemmDeviceLimits& device) {
  LOOM_TRY(gemm_can_implement(args, options));
  if (device.sm_count <= 0) return Status::invalid_argument("gemm: device reports no SMs");
  GemmPlan plan;
  plan.tile = options.tile == GemmTile::kAuto ? choose_gemm_tile(args.m, args.n, args.k, device.sm_count) : options.tile;
  const GemmTileInfo info = gemm_tile_info(plan.tile);
  if (device.smem_per_block_optin > 0 && static_cast<int64_t>(info.smem_bytes) > device.smem_per_block_optin) {
    return Status::unsupported("gemm: tile " + std::string(gemm_tile_name(plan.tile)) + " needs " +
                               std::to_string(info.smem_bytes) + " bytes of shared memory; the device allows " +
                               std::to_string(device.smem_per_block_optin));
  }
  plan.m_blocks = (args.m + info.block_m - 1) / info.block_m;
  plan.n_blocks = (args.n + info.block_n - 1) / info.block_n;
  const int64_t tiles = plan.m_blocks * plan.n_blocks;
  if (options.num_ctas > 0) {
    plan.num_ctas = options.num_ctas;
  } else {
    plan.num_ctas = static_cast<int>(std::clamp<int64_t>(tiles, 1, device.sm_count));
  }
  if (options.group_m > 0) {
    plan.group_m = options.group_m;
  } else {
    // A wave of num_ctas tiles covers about g tile rows x num_ctas/g tile columns; the loaded
    // bytes (g*BM + num_ctas/g*BN) are smallest near g = sqrt(num_ctas * BN / BM).
    const double g = std::sqrt(static_cast<double>(plan.num_ctas) * info.block_n / info.block_m);
    plan.group_m = static_cast<int>(std::clamp<double>(std::round(g), 1.0, 64.0));
  }
  plan.group_m = static_cast<int>(std::clamp<int64_t>(plan.group_m, 1, std::max<int64_t>(plan.m_blocks, 1)));
  return plan;
}

}  // namespace planner
}  // namespace loom
