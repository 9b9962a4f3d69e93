#include "planner/tp_plan.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>

#include "core/enum_names.h"
#include "core/env.h"
#include "core/log.h"
#include "planner/gemm_heuristic.h"

namespace loom::planner {
namespace {

using nlohmann::json;

constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;

int world_of(const TpRequest& r) { return r.nodes * r.local_world; }

std::string shape_text(const TpRequest& r) {
  std::string world = "W=" + std::to_string(world_of(r));
  if (r.nodes > 1) world += " (" + std::to_string(r.nodes) + " nodes x " + std::to_string(r.local_world) + " GPUs)";
  return "M=" + std::to_string(r.m) + " N=" + std::to_string(r.n) + " K=" + std::to_string(r.k) + " " + world;
}

bool is_tp_op(OpId op) { return op == OpId::kAgGemm || op == OpId::kGemmRs || op == OpId::kGemmAr; }

}  // namespace

Status check_tp_shape(const TpRequest& r) {
  if (!is_tp_op(r.op)) return Status::internal("plan_tp: not a tensor-parallel operator");
  const std::string op(tp_op_name(r.op));
  if (r.local_world < 1 || r.nodes < 1) return Status::internal("plan_tp: local world or nodes below 1");
  if (r.dtype != DType::kBF16 && r.dtype != DType::kF16) {
    return Status::unsupported(op + ": " + std::string(dtype_name(r.dtype)) +
                               " inputs are not supported (bf16 or fp16)");
  }
  if (r.b_layout != BLayout::kKN && r.b_layout != BLayout::kNK) return Status::invalid_argument(op + ": unknown B layout");
  if (r.m <= 0 || r.n <= 0 || r.k <= 0) {
    return Status::invalid_argument(op + ": " + shape_text(r) + ": M, N and K must be positive");
  }
  if (r.m % world_of(r) != 0) {
    return Status::invalid_argument(op + ": " + shape_text(r) + ": M must be a multiple of the " +
                                    std::to_string(world_of(r)) + (r.nodes > 1 ? " ranks" : " local ranks") +
                                    " (each owns M/W rows)");
  }
  if (r.n % 8 != 0 || r.k % 8 != 0) {
    return Status::unsupported(op + ": " + shape_text(r) + ": N and K must be multiples of 8 (16-byte rows for TMA)");
  }
  if (r.m > kMaxDim || r.n > kMaxDim || r.k > kMaxDim) {
    return Status::unsupported(op + ": " + shape_text(r) + ": M, N and K must each be below 2^31");
  }
  return {};
}

Status check_tp_options(const TpRequest& r, const TpGemmOptions& options) {
  const std::string op(tp_op_name(r.op));
  if (options.algorithm != TpAlgorithm::kAuto && options.algorithm != TpAlgorithm::kFused &&
      options.algorithm != TpAlgorithm::kDecomposed) {
    return Status::invalid_argument(op + ": unknown TpAlgorithm value " + std::to_string(static_cast<int>(options.algorithm)));
  }
  if (options.comm_ctas < -1) {
    return Status::invalid_argument(op + ": comm_ctas " + std::to_string(options.comm_ctas) +
                                    " is negative (-1 lets the planner decide)");
  }
  if (options.comm_ctas >= r.sm_count) {
    return Status::invalid_argument(op + ": comm_ctas " + std::to_string(options.comm_ctas) +
                                    " leaves no compute CTA on " + std::to_string(r.sm_count) + " SMs");
  }
  if (options.tail_pieces < -1 || options.tail_pieces > TpGemmOptions::kMaxTailPieces) {
    return Status::invalid_argument(op + ": tail_pieces " + std::to_string(options.tail_pieces) + " is outside -1.." +
                                    std::to_string(TpGemmOptions::kMaxTailPieces) + " (-1: planner, 0 or 1: none)");
  }
  if (static_cast<int>(options.tile) > static_cast<int>(GemmTile::k64x128)) {
    return Status::invalid_argument(op + ": unknown GemmTile value " + std::to_string(static_cast<int>(options.tile)));
  }
  return {};
}

namespace {

double comm_bytes_of(const TpRequest& r) {
  const double w = r.local_world;
  const double share = (w - 1) / w;  // of the rows that live on (or belong to) other ranks
  const double e = static_cast<double>(dtype_size(r.dtype));
  const double m = static_cast<double>(r.m), n = static_cast<double>(r.n), k = static_cast<double>(r.k);
  switch (r.op) {
    case OpId::kAgGemm: return share * m * k * e;       // every peer's A shard comes in
    case OpId::kGemmRs: return share * m * n * e;       // partial rows of every peer go out
    case OpId::kGemmAr: return 2 * share * m * n * e;   // reduce-scatter, then all-gather of the sums
    default: return 0;
  }
}

// Tiles of `tile` over the output and the waves `ctas` CTAs take for them (at least one; no
// tiles for a tile without a shape, e.g. kAuto).
struct TileWaves {
  int64_t tiles = 0, waves = 1;
};
TileWaves tile_waves(const TpRequest& r, GemmTile tile, int ctas) {
  const GemmTileInfo info = gemm_tile_info(tile);
  TileWaves w;
  if (info.block_m <= 0 || info.block_n <= 0) return w;
  w.tiles = ((r.m + info.block_m - 1) / info.block_m) * ((r.n + info.block_n - 1) / info.block_n);
  w.waves = std::max<int64_t>(1, (w.tiles + std::max(1, ctas) - 1) / std::max(1, ctas));
  return w;
}

// Share of the last wave's tile slots left idle: ag_gemm's comm CTAs join the compute late and
// the first tiles on other ranks' rows wait for them; a partly empty last wave absorbs such
// delays, a full one grows by them.
double last_wave_idle(const TpRequest& r, GemmTile tile) {
  const TileWaves w = tile_waves(r, tile, r.sm_count);
  return static_cast<double>(w.waves * r.sm_count - w.tiles) / r.sm_count;
}

// The fused tile: the smaller modelled GEMM time (ties to 128x256), except that 128x256 also
// wins within fused_tile_tolerance when its last wave has more idle slots (2 x H200, ag_gemm
// M = 1024: 128x256 with 14-16 comm CTAs 0.351-0.365 ms, 128x128 0.371-0.374 ms, while the
// plain GEMM is 3% faster with 128x128).
GemmTile fused_tile_for(const TpRequest& r, const TpCostModel& model) {
  const double wide = gemm_model_seconds(GemmTile::k128x256, r.m, r.n, r.k, r.sm_count);
  const double narrow = gemm_model_seconds(GemmTile::k128x128, r.m, r.n, r.k, r.sm_count);
  if (narrow >= wide * 0.999) return GemmTile::k128x256;
  const bool absorbs_more = last_wave_idle(r, GemmTile::k128x256) > last_wave_idle(r, GemmTile::k128x128);
  return absorbs_more && wide <= narrow * (1 + model.fused_tile_tolerance) ? GemmTile::k128x256 : GemmTile::k128x128;
}

// ag_gemm: the fewest comm CTAs whose transfer ends early enough in the window it hides behind;
// if none can, enough to saturate NVLink (more only take SMs from the compute). When the last
// wave has room, up to as many as it can spare without a wave more (at most a saturating
// number): the transfer ends sooner at no compute cost.
int ag_comm_ctas(const TpRequest& r, GemmTile tile, const TpCostModel& model) {
  const int min_c = std::clamp(model.min_comm_ctas, 1, std::max(1, r.sm_count - 1));
  const int max_c = std::clamp(r.sm_count / std::max(1, model.max_comm_ctas_sm_divisor), min_c, std::max(min_c, r.sm_count - 1));
  const int saturating = std::clamp(static_cast<int>(std::ceil(model.nvlink_bytes_per_s / model.comm_cta_bytes_per_s)), min_c, max_c);
  const TileWaves w = tile_waves(r, tile, r.sm_count);
  const int64_t needed = (w.tiles + w.waves - 1) / w.waves;  // fewest CTAs that keep w.waves
  const int spare = static_cast<int>(std::min<int64_t>(r.sm_count - needed, saturating));
  for (int c = min_c; c <= max_c; ++c) {
    const TpEstimate e = estimate_tp(r, c, tile, model);
    const double window = e.gemm_s / model.fused_compute_efficiency * (r.local_world - 1) / r.local_world;
    if (e.comm_s <= model.comm_finish_fraction * window) return std::max(c, spare);
  }
  return saturating;
}

// The model's plan for each algorithm; `choose` picks between them.
struct ModelPlans {
  TpPlan fused, decomposed;
  TpPlan choose(const TpRequest& r, const TpCostModel& model) const {
    if (r.local_world == 1 || !fused_can_run(r, model)) return decomposed;  // one rank: a plain GEMM
    if (!model.fused_by_default) return decomposed;
    const double fused_s = estimate_tp(r, fused.comm_ctas, fused.tile, model).fused_s;
    const double decomposed_s = estimate_tp(r, fused.comm_ctas, decomposed.tile, model).decomposed_s;
    return fused_s <= decomposed_s * (1 - model.fused_min_gain) ? fused : decomposed;
  }
};

ModelPlans model_plans(const TpRequest& r, const TpCostModel& model) {
  ModelPlans p;
  p.decomposed.algorithm = TpAlgorithm::kDecomposed;
  p.decomposed.tile = choose_gemm_tile(r.m, r.n, r.k, r.sm_count);  // the plain GEMM's own choice
  p.decomposed.comm_ctas = 0;
  p.decomposed.source = "model";
  p.fused.algorithm = TpAlgorithm::kFused;
  p.fused.tile = fused_tile_for(r, model);
  p.fused.comm_ctas = r.op == OpId::kAgGemm ? ag_comm_ctas(r, p.fused.tile, model) : 0;
  p.fused.source = "model";
  return p;
}

// ---- tuning-cache file ---------------------------------------------------------------------

Status bad_file(const std::string& origin, const std::string& why) {
  return Status::invalid_argument("tuning cache " + origin + ": " + why);
}

std::string entry_label(size_t index) { return "entry " + std::to_string(index); }

Result<int64_t> get_int_field(const json& e, const char* name, int64_t min, int64_t max, const std::string& where) {
  auto it = e.find(name);
  if (it == e.end()) return Status::invalid_argument(where + ": '" + name + "' is missing");
  if (!it->is_number_integer()) {
    return Status::invalid_argument(where + ": '" + name + "' must be an integer, not " + it->dump());
  }
  const int64_t v = it->get<int64_t>();
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(max)) {
    return Status::invalid_argument(where + ": '" + name + "' = " + it->dump() + " is above " + std::to_string(max));
  }
  if (v < min || v > max) {
    return Status::invalid_argument(where + ": '" + name + "' = " + std::to_string(v) + " is outside [" +
                                    std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return v;
}

Result<std::string> get_string_field(const json& e, const char* name, const std::string& where) {
  auto it = e.find(name);
  if (it == e.end()) return Status::invalid_argument(where + ": '" + name + "' is missing");
  if (!it->is_string()) return Status::invalid_argument(where + ": '" + name + "' must be a string, not " + it->dump());
  return it->get<std::string>();
}

// Parsers of the enum names give their own message; prefix where the value came from.
template <typename T>
Result<T> with_where(Result<T> r, const std::string& where) {
  if (r.ok()) return r;
  return std::move(r).take_status().with_context(where);
}

struct ParsedEntry {
  TpKey key;
  TpPlan plan;
  double ms = 0;
};

Result<ParsedEntry> parse_entry(const json& e, const std::string& where) {
  if (!e.is_object()) return Status::invalid_argument(where + ": must be an object, not " + e.dump());
  static constexpr std::string_view kKnown[] = {"op",        "m",         "n",    "k",  "world", "dtype", "b_layout",
                                                "algorithm", "comm_ctas", "tile", "ms", "gpu",   "note"};
  for (auto it = e.begin(); it != e.end(); ++it) {
    if (std::find(std::begin(kKnown), std::end(kKnown), it.key()) == std::end(kKnown)) {
      return Status::invalid_argument(where + ": unknown field '" + it.key() +
                                      "' (known: op, m, n, k, world, dtype, b_layout, algorithm, comm_ctas, tile, ms, gpu, note)");
    }
  }
  ParsedEntry p{};
  LOOM_ASSIGN_OR_RETURN(std::string op, get_string_field(e, "op", where));
  LOOM_ASSIGN_OR_RETURN(p.key.op, with_where(parse_tp_op(op), where));
  LOOM_ASSIGN_OR_RETURN(p.key.m, get_int_field(e, "m", 1, kMaxDim, where));
  LOOM_ASSIGN_OR_RETURN(p.key.n, get_int_field(e, "n", 1, kMaxDim, where));
  LOOM_ASSIGN_OR_RETURN(p.key.k, get_int_field(e, "k", 1, kMaxDim, where));
  LOOM_ASSIGN_OR_RETURN(int64_t world, get_int_field(e, "world", 1, 1 << 16, where));
  p.key.local_world = static_cast<int>(world);
  LOOM_ASSIGN_OR_RETURN(std::string dtype, get_string_field(e, "dtype", where));
  LOOM_ASSIGN_OR_RETURN(p.key.dtype, with_where(parse_dtype(dtype), where));
  if (p.key.dtype == DType::kF32) return Status::invalid_argument(where + ": dtype fp32 is not supported by these operators");
  LOOM_ASSIGN_OR_RETURN(std::string layout, get_string_field(e, "b_layout", where));
  LOOM_ASSIGN_OR_RETURN(p.key.b_layout, with_where(parse_b_layout(layout), where));
  LOOM_ASSIGN_OR_RETURN(std::string algorithm, get_string_field(e, "algorithm", where));
  LOOM_ASSIGN_OR_RETURN(p.plan.algorithm, with_where(parse_tp_algorithm(algorithm), where));
  if (p.plan.algorithm == TpAlgorithm::kAuto) {
    return Status::invalid_argument(where + ": 'algorithm' must be fused or decomposed (a cache records a decision)");
  }
  LOOM_ASSIGN_OR_RETURN(int64_t ctas, get_int_field(e, "comm_ctas", 0, 1 << 16, where));
  p.plan.comm_ctas = static_cast<int>(ctas);
  LOOM_ASSIGN_OR_RETURN(std::string tile, get_string_field(e, "tile", where));
  LOOM_ASSIGN_OR_RETURN(p.plan.tile, with_where(parse_gemm_tile(tile), where));
  if (p.plan.tile == GemmTile::kAuto) {
    return Status::invalid_argument(where + ": 'tile' must name a configuration (128x256, 128x128, 128x64, 64x128), not auto");
  }
  if (auto it = e.find("ms"); it != e.end()) {
    if (!it->is_number() || it->get<double>() < 0) {
      return Status::invalid_argument(where + ": 'ms' must be a non-negative number, not " + it->dump());
    }
    p.ms = it->get<double>();
  }
  return p;
}

std::string key_text(const TpKey& k) {
  return std::string(tp_op_name(k.op)) + " m=" + std::to_string(k.m) + " n=" + std::to_string(k.n) + " k=" +
         std::to_string(k.k) + " world=" + std::to_string(k.local_world) + " " + std::string(dtype_name(k.dtype)) + " " +
         std::string(b_layout_name(k.b_layout));
}

}  // namespace

// ---- names -----------------------------------------------------------------------------------

constexpr EnumName<OpId> kTpOpNames[] = {{OpId::kAgGemm, "ag_gemm"}, {OpId::kGemmRs, "gemm_rs"}, {OpId::kGemmAr, "gemm_ar"}};

std::string_view tp_op_name(OpId op) { return name_in(kTpOpNames, op, "not_a_tp_op"); }

Result<OpId> parse_tp_op(std::string_view name) { return parse_name_in(kTpOpNames, name, "operator"); }

constexpr EnumName<TpAlgorithm> kTpAlgorithmNames[] = {
    {TpAlgorithm::kAuto, "auto"}, {TpAlgorithm::kFused, "fused"}, {TpAlgorithm::kDecomposed, "decomposed"}};

std::string_view tp_algorithm_name(TpAlgorithm algorithm) { return name_in(kTpAlgorithmNames, algorithm); }

Result<TpAlgorithm> parse_tp_algorithm(std::string_view name) {
  return parse_name_in(kTpAlgorithmNames, name, "algorithm");
}

TpKey key_of(const TpRequest& r) { return TpKey{r.op, r.m, r.n, r.k, r.local_world, r.dtype, r.b_layout}; }

// ---- cost model ------------------------------------------------------------------------------

bool is_fused_tile(GemmTile tile) { return tile == GemmTile::k128x256 || tile == GemmTile::k128x128; }

std::string fused_refusal(const TpRequest& r, const TpCostModel& model) {
  if (r.local_world < 2) return "one local rank has nothing to fuse (it runs the plain GEMM)";
  if (r.local_world > model.fused_max_local_world) {
    return "the fused kernels address at most " + std::to_string(model.fused_max_local_world) + " local ranks";
  }
  if (model.fused_block_m <= 0 || (r.m / r.local_world) % model.fused_block_m != 0) {
    return "each rank's M/W = " + std::to_string(r.m / r.local_world) + " rows must be a multiple of " +
           std::to_string(model.fused_block_m) + " (BLOCK_M: a tile row never spans two ranks)";
  }
  return {};
}

bool fused_can_run(const TpRequest& r, const TpCostModel& model) { return fused_refusal(r, model).empty(); }

uint32_t tp_group_m(int grid, GemmTile tile, int64_t unit) {
  const GemmTileInfo info = gemm_tile_info(tile);
  const double g = std::sqrt(static_cast<double>(grid) * info.block_n / info.block_m);
  int64_t best = 1;
  for (int64_t d = 1; d <= unit && d <= 64; ++d) {
    if (unit % d == 0 && d <= std::max<int64_t>(1, std::llround(g))) best = d;
  }
  return static_cast<uint32_t>(best);
}

TpEstimate estimate_tp(const TpRequest& r, int comm_ctas, GemmTile tile, const TpCostModel& model) {
  TpEstimate e;
  const int sm = std::max(1, r.sm_count);
  e.gemm_s = gemm_model_seconds(tile, std::max<int64_t>(r.m, 1), std::max<int64_t>(r.n, 1), std::max<int64_t>(r.k, 1), sm);
  const double fused_gemm_s = e.gemm_s / model.fused_compute_efficiency;
  e.comm_bytes = r.local_world > 1 ? comm_bytes_of(r) : 0;
  // ag_gemm's comm CTAs push the shard; gemm_rs / gemm_ar push from the compute CTAs' epilogues.
  const bool comm_ctas_move_data = r.op == OpId::kAgGemm;
  const int c = comm_ctas_move_data ? std::max(1, comm_ctas) : 0;
  const double bandwidth =
      comm_ctas_move_data ? std::min(model.nvlink_bytes_per_s, c * model.comm_cta_bytes_per_s) : model.nvlink_bytes_per_s;
  e.comm_s = e.comm_bytes / bandwidth;
  const double waves = static_cast<double>(tile_waves(r, tile, sm).waves);
  if (r.local_world == 1) {
    e.fused_s = fused_gemm_s + model.fused_overhead_s;
    e.decomposed_s = e.gemm_s;
    return e;
  }
  const double sm_bound = fused_gemm_s + e.comm_s * c / sm;     // comm CTAs do not compute meanwhile
  const double transfer_bound = e.comm_s + fused_gemm_s / waves;  // one wave cannot overlap the transfer
  e.fused_s = std::max(sm_bound, transfer_bound) + model.fused_overhead_s;
  e.decomposed_s = e.comm_bytes / model.nvlink_bytes_per_s + e.gemm_s + model.decomposed_overhead_s;
  return e;
}

TailSplit plan_tail_split(int64_t total_tiles, int grid, int64_t k_blocks, int stages, int64_t splittable, int requested,
                          int64_t late_claims, const TpCostModel& model) {
  if (grid <= 0 || total_tiles <= 0 || requested == 0 || requested == 1) return {};
  const int64_t r = std::min({total_tiles % grid + std::max<int64_t>(late_claims, 0), static_cast<int64_t>(grid), total_tiles});
  if (r == 0 || r > splittable) return {};
  if (requested >= 2) {
    if (requested > k_blocks) return {};  // every piece needs a k-block
    return TailSplit{r, requested};
  }
  // Tail length in tile times with p pieces per tile, all CTAs starting it together.
  auto tail = [&](int64_t p) { return static_cast<double>((r * p + grid - 1) / grid) / static_cast<double>(p); };
  TailSplit best;
  double best_tail = 1.0;
  for (int p = 2; p <= model.max_tail_pieces; ++p) {
    if (k_blocks / p < 2 * static_cast<int64_t>(stages)) break;
    if (tail(p) < best_tail - 1e-9) {
      best_tail = tail(p);
      best = TailSplit{r, p};
    }
  }
  if (1.0 - best_tail < model.min_tail_gain) return {};
  return best;
}

int64_t ag_rows_per_flag(int64_t rows_per_rank, uint64_t row_bytes, int comm_ctas, int destinations,
                         const TpCostModel& model) {
  if (rows_per_rank <= 1) return std::max<int64_t>(rows_per_rank, 1);
  const int64_t wanted = (std::max(comm_ctas, 1) + std::max(destinations, 1) - 1) / std::max(destinations, 1);
  const int64_t fit_rows = row_bytes == 0 ? rows_per_rank : static_cast<int64_t>(model.ag_chunk_bytes / row_bytes);
  const int64_t block = model.fused_block_m;
  // Whole tile rows, as many as fit the chunk size (at least one), when that makes enough chunks.
  if (block > 0 && rows_per_rank % block == 0) {
    int64_t whole = block;
    for (int64_t d = block; d <= std::min(rows_per_rank, fit_rows); d += block) {
      if (rows_per_rank % d == 0) whole = d;
    }
    if (rows_per_rank / whole >= wanted) return whole;
  }
  // Finer: the largest divisor with enough chunks that fits, else the finest allowed.
  const int64_t floor_rows = std::clamp<int64_t>(model.ag_min_rows_per_flag, 1, rows_per_rank);
  for (int64_t d = std::min(rows_per_rank / wanted, fit_rows); d >= floor_rows; --d) {
    if (rows_per_rank % d == 0) return d;
  }
  for (int64_t d = floor_rows; d < rows_per_rank; ++d) {
    if (rows_per_rank % d == 0) return d;
  }
  return rows_per_rank;
}

int64_t ag_late_claims(const TpRequest& r, GemmTile tile, int comm_ctas, int64_t rows_per_flag, int destinations,
                       const TpCostModel& model) {
  if (r.local_world <= 1 || comm_ctas <= 0 || rows_per_flag <= 0 || destinations <= 0 || r.sm_count <= 0) return 0;
  const int64_t positions = static_cast<int64_t>(destinations) * (r.m / r.local_world / rows_per_flag);
  const int64_t pushing = std::min<int64_t>(comm_ctas, positions);
  if (pushing <= 0) return 0;
  const int64_t busiest = (positions + comm_ctas - 1) / comm_ctas;  // chunks of the busiest comm CTA
  const double rate = std::min(model.comm_cta_bytes_per_s, model.nvlink_bytes_per_s / static_cast<double>(pushing));
  const double push_s = static_cast<double>(busiest * rows_per_flag * r.k) * static_cast<double>(dtype_size(r.dtype)) / rate;
  const TileWaves w = tile_waves(r, tile, r.sm_count);
  const double tile_s = gemm_model_seconds(tile, r.m, r.n, r.k, r.sm_count) / model.fused_compute_efficiency /
                        static_cast<double>(w.waves);
  if (!(tile_s > 0)) return 0;
  return pushing * static_cast<int64_t>(std::ceil(push_s / tile_s));
}

// ---- planner ---------------------------------------------------------------------------------

Result<TpPlan> plan_tp(const TpRequest& r, const TpGemmOptions& options, const TuningCache* cache,
                       const TpCostModel& model) {
  LOOM_TRY(check_tp_shape(r));
  if (r.sm_count <= 0) return Status::internal("plan_tp: unknown SM count");
  LOOM_TRY(check_tp_options(r, options));
  const ModelPlans models = model_plans(r, model);
  TpPlan plan;
  const TpPlan* hit = cache != nullptr ? cache->find(key_of(r)) : nullptr;
  if (hit != nullptr && hit->comm_ctas >= r.sm_count) {
    // Tuned on a larger device: the model is a better guess than a clamped entry.
    LOOM_WARN("tuning cache entry for %s has comm_ctas %d, not below this device's %d SMs; using the cost model",
              key_text(key_of(r)).c_str(), hit->comm_ctas, r.sm_count);
    hit = nullptr;
  }
  if (hit != nullptr) {
    plan = *hit;
    plan.source = "cache";
  } else {
    plan = models.choose(r, model);
  }
  if (options.algorithm != TpAlgorithm::kAuto) {
    // A forced algorithm gets the model's split for it (not the other algorithm's tile and CTAs).
    if (plan.algorithm != options.algorithm) plan = options.algorithm == TpAlgorithm::kFused ? models.fused : models.decomposed;
    plan.source = "options";
  }
  if (options.comm_ctas >= 0) {
    plan.comm_ctas = options.comm_ctas;
    plan.source = "options";
  }
  if (options.tile != GemmTile::kAuto) {
    plan.tile = options.tile;
    plan.source = "options";
  }
  return plan;
}

// ---- tuning cache ----------------------------------------------------------------------------

const TpPlan* TuningCache::find(const TpKey& key) const {
  auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : &it->second.plan;
}

void TuningCache::put(const TpKey& key, const TpPlan& plan, double measured_ms) {
  Entry entry{plan, measured_ms};
  entry.plan.source = "cache";
  entries_[key] = std::move(entry);
}

Result<TuningCache> TuningCache::parse(std::string_view text, const std::string& origin) {
  json doc;
  try {
    doc = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return bad_file(origin, std::string("not valid JSON: ") + e.what());
  }
  if (!doc.is_object()) return bad_file(origin, "the top level must be an object with \"format\", \"version\" and \"entries\"");
  auto format = doc.find("format");
  if (format == doc.end() || !format->is_string() || format->get<std::string>() != kFormat) {
    return bad_file(origin, "\"format\" must be \"" + std::string(kFormat) + "\" (is this a loom tuning cache?)");
  }
  auto version = doc.find("version");
  if (version == doc.end() || !version->is_number_integer()) return bad_file(origin, "\"version\" is missing or not an integer");
  if (version->get<int64_t>() != kVersion) {
    return bad_file(origin, "version " + version->dump() + " is not supported (this build reads version " +
                                std::to_string(kVersion) + "; re-run loom-bench tune)");
  }
  TuningCache cache;
  if (auto gpu = doc.find("gpu"); gpu != doc.end()) {
    if (!gpu->is_string()) return bad_file(origin, "\"gpu\" must be a string");
    cache.gpu_ = gpu->get<std::string>();
  }
  auto entries = doc.find("entries");
  if (entries == doc.end() || !entries->is_array()) return bad_file(origin, "\"entries\" is missing or not an array");
  std::map<TpKey, size_t> first_index;
  for (size_t i = 0; i < entries->size(); ++i) {
    Result<ParsedEntry> p = parse_entry((*entries)[i], entry_label(i));
    if (!p.ok()) return bad_file(origin, p.status().message());
    auto [it, inserted] = first_index.emplace(p->key, i);
    if (!inserted) {
      return bad_file(origin, entry_label(i) + " repeats the key of entry " + std::to_string(it->second) + " (" +
                                  key_text(p->key) + ")");
    }
    cache.put(p->key, p->plan, p->ms);
  }
  return cache;
}

Result<TuningCache> TuningCache::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    if (err == ENOENT) return TuningCache{};
    return Status::errno_error("tuning cache " + path + ": cannot open", err);
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::system_error("tuning cache " + path + ": read failed");
  return parse(text.str(), path);
}

std::string TuningCache::to_json_text() const {
  json doc;
  doc["format"] = std::string(kFormat);
  doc["version"] = kVersion;
  if (!gpu_.empty()) doc["gpu"] = gpu_;
  json entries = json::array();
  for (const auto& [key, entry] : entries_) {
    json e;
    e["op"] = std::string(tp_op_name(key.op));
    e["m"] = key.m;
    e["n"] = key.n;
    e["k"] = key.k;
    e["world"] = key.local_world;
    e["dtype"] = std::string(dtype_name(key.dtype));
    e["b_layout"] = std::string(b_layout_name(key.b_layout));
    e["algorithm"] = std::string(tp_algorithm_name(entry.plan.algorithm));
    e["comm_ctas"] = entry.plan.comm_ctas;
    e["tile"] = std::string(gemm_tile_name(entry.plan.tile));
    if (entry.measured_ms > 0) e["ms"] = entry.measured_ms;
    entries.push_back(std::move(e));
  }
  doc["entries"] = std::move(entries);
  return doc.dump(2) + "\n";
}

Status TuningCache::save(const std::string& path) const {
  // Readers (other ranks, other jobs) must never see half a file: write beside it, then rename.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status::errno_error("tuning cache " + path + ": cannot create " + tmp, errno);
    out << to_json_text();
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return Status::system_error("tuning cache " + path + ": writing " + tmp + " failed");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return Status::errno_error("tuning cache " + path + ": rename from " + tmp, err);
  }
  return {};
}

Result<const TuningCache*> tuning_cache_from_env() {
  std::optional<std::string> path = env::get_raw("LOOM_TUNING_CACHE");
  if (!path) return static_cast<const TuningCache*>(nullptr);
  if (path->empty()) {
    return Status::invalid_argument("LOOM_TUNING_CACHE is set but empty; unset it or name a file written by loom-bench tune");
  }
  // Read once per path and process (ops call this on every launch); failures are remembered too,
  // so every call reports the same error instead of re-reading a broken file.
  struct Loaded {
    Status status;
    std::unique_ptr<TuningCache> cache;
  };
  static std::mutex mutex;
  static std::map<std::string, Loaded> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(*path);
  if (it == loaded.end()) {
    Loaded entry;
    Result<TuningCache> cache = TuningCache::load(*path);
    if (cache.ok()) {
      entry.cache = std::make_unique<TuningCache>(std::move(cache).value());
      if (entry.cache->size() == 0) LOOM_WARN("LOOM_TUNING_CACHE=%s: no entries (or no such file); the cost model decides", path->c_str());
    } else {
      entry.status = std::move(cache).take_status().with_context("LOOM_TUNING_CACHE");
    }
    it = loaded.emplace(*path, std::move(entry)).first;
  }
  if (!it->second.status.ok()) return it->second.status;
  return static_cast<const TuningCache*>(it->second.cache.get());
}

}  // namespace loom::planner
