// Role split and algorithm for the fused tensor-parallel operators (host-only, unit-tested).
//
// Order of authority: explicit TpGemmOptions, then the tuning cache (JSON written by
// `loom-bench tune`, read from LOOM_TUNING_CACHE), then the cost model below.
//
// Cost model (per rank; all constants in TpCostModel, calibrated against `loom-bench ag_gemm |
// gemm_rs | gemm_ar`, which prints the model beside the measurement):
//   G        local GEMM time on all SMs (planner::gemm_model_seconds): ag_gemm multiplies all M
//            gathered rows, gemm_rs and gemm_ar their [M, K_r] slice; / fused_compute_efficiency
//            inside the fused kernel
//   bytes    what each rank sends (= receives) over NVLink: ag (W-1)/W*M*K, rs (W-1)/W*M*N,
//            ar 2(W-1)/W*M*N elements
//   C        the transfer: ag_gemm's comm CTAs push the shard, C(c) = bytes / min(nvlink, c * per
//            CTA rate); gemm_rs / gemm_ar push partial tiles from the compute CTAs' epilogues
//            (TMA stores), C = bytes / nvlink, and use no comm CTAs
//   fused    max(G + C*c/SMs, C + G/waves) + fused_overhead_s: comm CTAs are lost to the compute
//            while they move data (c = 0 for rs / ar); and when the transfer is the longer part, one
//            wave of tiles still runs after the last byte (ag) or before the first (rs, ar)
//   decomposed  bytes / nvlink + G + decomposed_overhead_s
// ag_gemm's comm CTAs: the fewest (>= min_comm_ctas) whose transfer ends within
// comm_finish_fraction of the window it hides behind (the (W-1)/W of the compute that does not
// depend on it), raised to as many as the last wave of tiles can spare without a wave more (at
// most enough to saturate NVLink); if none can, enough to saturate NVLink. The fused tile is
// the one with the smaller G, but 128x256 within fused_tile_tolerance of a faster 128x128 when
// its last wave has more idle slots (they absorb the comm CTAs' late start and the first remote
// tiles' waits). Fused is chosen when the fused kernels
// can run the shape (W <= fused_max_local_world, M/W a multiple of fused_block_m, a 128x256 or
// 128x128 tile) and it is modelled at least fused_min_gain faster than decomposed; one rank alone
// is always decomposed (a plain GEMM).
//
// Tuning cache file (versioned JSON; malformed files are an invalid_argument naming the file,
// the entry and the reason):
//   {"format": "loom-tuning-cache", "version": 1, "gpu": "NVIDIA H200",
//    "entries": [{"op": "ag_gemm", "m": 16384, "n": 14336, "k": 8192, "world": 2,
//                 "dtype": "bf16", "b_layout": "nk",
//                 "algorithm": "fused", "comm_ctas": 8, "tile": "128x256", "ms": 4.71}]}
// m, n, k are TpGemmArgs' fields (k is this rank's K); "ms", "gpu", "note" are informational.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <tuple>

#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/tensor_parallel.h"
#include "kernels/tp/tunables.h"
#include "loom/types.h"
#include "runtime/device_abi.h"

namespace loom::planner {

struct TpRequest {
  OpId op = OpId::kAgGemm;  // kAgGemm, kGemmRs or kGemmAr
  int64_t m = 0, n = 0, k = 0;  // as in TpGemmArgs
  int local_world = 1;
  int nodes = 1;            // the world is nodes x local_world (multi-node planning, multinode_plan.h)
  DType dtype = DType::kBF16;
  BLayout b_layout = BLayout::kKN;
  int sm_count = 0;
};

struct TpPlan {
  TpAlgorithm algorithm = TpAlgorithm::kFused;  // never kAuto
  int comm_ctas = 0;                            // CTAs starting in the communication role (ag_gemm;
                                                // gemm_rs / gemm_ar push from their epilogues: 0)
  GemmTile tile = GemmTile::kAuto;              // never kAuto
  std::string source;                           // "options", "cache" or "model": for logs and benches
};

// Every constant of the cost model (see the top of this file). Defaults: 2 x H200, Nov 2026.
struct TpCostModel {
  // NVLink per GPU and direction as copy kernels reach it: NCCL all_reduce 512 MiB busbw 305 GB/s,
  // loom all_gather 280 GB/s at 48 CTAs (bench/results, Nov 2026).
  double nvlink_bytes_per_s = 300e9;
  // What one communication CTA moves: loom all_gather reached 175 GB/s busbw with 8 CTAs.
  double comm_cta_bytes_per_s = 22e9;
  // The compute role's speed relative to the standalone GEMM engine (tile-arrival checks, tile
  // order constrained by data arrival). An estimate until the fused kernels are measured.
  double fused_compute_efficiency = 0.98;
  // Fixed costs per call: the fused kernel's entry handshake and the latency of its first
  // dependent chunk; the decomposed path's second launch and the collective's own fixed cost
  // (loom all_gather on 2 x H200: 15 us at 1 MiB, 240 us at 64 MiB per rank, i.e. ~11 us plus
  // the bytes at 294 GB/s; bench/results, Nov 2026).
  double fused_overhead_s = 10e-6;
  double decomposed_overhead_s = 12e-6;
  // The transfer should end within this fraction of the compute it hides behind, leaving slack
  // for arrival jitter and for the comm CTAs to join the compute early.
  double comm_finish_fraction = 0.5;
  // Fused must be modelled at least this much faster than decomposed (the model is rough, and
  // the fused op must never lose to collective + GEMM).
  double fused_min_gain = 0.02;
  // The fused kernels take 128x256 over a modelled-faster 128x128 within this margin when its
  // last wave has more idle slots to absorb the fused kernel's delays (tp_plan.cc).
  double fused_tile_tolerance = 0.05;
  int min_comm_ctas = 2;
  int max_comm_ctas_sm_divisor = 4;  // at most sm_count / 4 comm CTAs
  // What the fused kernels run (fused_refusal; the launchers fall back to decomposed): at most
  // this many local ranks, each owning whole BLOCK_M tile rows, with a 128x256 or 128x128 tile.
  int fused_max_local_world = kernels::tp::TpTunables::kMaxLocalWorld;
  int64_t fused_block_m = 128;
  // Whether the model may pick the fused kernels at all (false: always decomposed unless options
  // or the tuning cache say fused). On 2 x H200 (Nov 2026) the fused gemm_rs / gemm_ar beat
  // NCCL + cuBLAS by 1.06-1.26x at M = 1024..32768 once the waits stopped polling host memory.
  bool fused_by_default = true;
  // The fused kernels' tail split (plan_tail_split): the most K pieces a tile is cut into (the
  // fold item adds one staged box per piece and 64-column chunk), and the least share of a
  // tile's time it must save to be used.
  int max_tail_pieces = 4;
  double min_tail_gain = 0.2;
  // ag_gemm's arrival flags (ag_rows_per_flag): a push chunk (the rows of one flag) aims at this
  // many bytes, and is at least this many rows unless the shard is smaller.
  uint64_t ag_chunk_bytes = uint64_t{1} << 20;
  int64_t ag_min_rows_per_flag = 16;
};

// True for the tiles the fused kernels are built for (128x256, 128x128).
bool is_fused_tile(GemmTile tile);
// Why the fused kernels cannot run the request's shape (see TpCostModel), "" when they can.
std::string fused_refusal(const TpRequest& request, const TpCostModel& model = {});
// True when the fused kernels can run the request's shape.
bool fused_can_run(const TpRequest& request, const TpCostModel& model = {});

// The rules every tensor-parallel call's shape follows, one node or several (ops, bf16 or fp16, a
// known B layout, positive sizes, M a multiple of the nodes x local_world ranks, N and K multiples
// of 8, each below 2^31), and the range checks of its options against request.sm_count.
Status check_tp_shape(const TpRequest& request);
Status check_tp_options(const TpRequest& request, const TpGemmOptions& options);

// Raster group height (tile rows) for `grid` CTAs, as the GEMM planner picks it, limited to a
// divisor of `unit` tile rows (a band or a rank's rows) so that no group straddles two.
uint32_t tp_group_m(int grid, GemmTile tile, int64_t unit);

// The model's view of one configuration (seconds unless named otherwise).
struct TpEstimate {
  double gemm_s = 0;        // standalone local GEMM on all SMs
  double comm_bytes = 0;    // sent (= received) per rank over NVLink
  double comm_s = 0;        // the fused transfer with the given comm CTAs
  double fused_s = 0;
  double decomposed_s = 0;
};

// Estimates one configuration; for ag_gemm `comm_ctas` below 1 is modelled as 1 (gemm_rs and
// gemm_ar ignore it).
TpEstimate estimate_tp(const TpRequest& request, int comm_ctas, GemmTile tile, const TpCostModel& model = {});

// The fused kernels' tail split (kernels/gemm/tail_split.cuh): the last `tiles` of the
// order are each handed out as `pieces` K ranges. Whole tiles leave the last partial wave's
// idle SMs idle for a tile's time; the model takes the pieces count that ends the tail soonest,
// ceil(r * pieces / grid) / pieces tile times for r = min(tiles % grid + late_claims, grid)
// tiles (fewest pieces on a tie), if that saves at least min_tail_gain of a tile.
// late_claims: tiles the CTAs that start late (ag_gemm's pushing comm CTAs) do not claim before
// the last wave; they leave that many more tiles to it, and a whole tile left there ends a
// tile's time after the pieces (2 x H200, ag_gemm M = 1024: 4 such tiles ended at 356 us, the
// pieces by 341).
struct TailSplit {
  int64_t tiles = 0;  // 0: no split
  int pieces = 0;
};
// total_tiles on `grid` persistent CTAs; k_blocks per tile; `stages` of the tile's pipeline (a
// model-chosen piece keeps at least 2 * stages k-blocks); at most `splittable` tiles may be
// split (gemm_rs / gemm_ar: the order's last band, own tiles; ag_gemm: any); requested =
// TpGemmOptions::tail_pieces.
TailSplit plan_tail_split(int64_t total_tiles, int grid, int64_t k_blocks, int stages, int64_t splittable, int requested,
                          int64_t late_claims = 0, const TpCostModel& model = {});

// ag_gemm's arrival flags: rows of a rank's shard per flag, each flag's rows one push chunk
// (kernels/tp/sm90_ag_gemm.cuh). Whole tile rows (as many as keep a chunk within ag_chunk_bytes, at
// least one) when they cut the shard into enough chunks for every comm CTA to push one
// (destinations * chunks >= comm_ctas); else the largest divisor of rows_per_rank that does and
// fits, not below ag_min_rows_per_flag; else the finest allowed. Whole tile rows alone left most
// comm CTAs idle at small M (2 x H200, M = 1024: 4 chunks of 2 MiB for 14 comm CTAs, the other
// rank's rows arrived after ~100 us, a tile's time).
// destinations: where each chunk goes (W - 1 peers, + 1 when the rank's own rows are copied too).
int64_t ag_rows_per_flag(int64_t rows_per_rank, uint64_t row_bytes, int comm_ctas, int destinations,
                         const TpCostModel& model = {});

// ag_gemm's late claims (plan_tail_split): the pushing comm CTAs join the compute after their
// chunks, estimated at comm_cta_bytes_per_s; each misses ceil(push time / tile time) tiles
// (rounded up: an extra split tile costs a fold, a whole tile left for the last wave costs a tile).
int64_t ag_late_claims(const TpRequest& request, GemmTile tile, int comm_ctas, int64_t rows_per_flag, int destinations,
                       const TpCostModel& model = {});

// The key a tuning-cache entry is stored under: op, M, N, K, W, dtype, layout.
struct TpKey {
  OpId op;
  int64_t m, n, k;
  int local_world;
  DType dtype;
  BLayout b_layout;
  bool operator<(const TpKey& o) const {
    return std::tie(op, m, n, k, local_world, dtype, b_layout) < std::tie(o.op, o.m, o.n, o.k, o.local_world, o.dtype, o.b_layout);
  }
};
TpKey key_of(const TpRequest& request);

class TuningCache {
 public:
  static constexpr int kVersion = 1;
  static constexpr std::string_view kFormat = "loom-tuning-cache";

  // Reads a cache file; a missing file is an empty cache, a malformed one an invalid_argument
  // naming the file, the entry and what is wrong.
  static Result<TuningCache> load(const std::string& path);
  // Parses the text of a cache file; `origin` names it in messages.
  static Result<TuningCache> parse(std::string_view text, const std::string& origin);
  // Writes the file atomically (a temporary file renamed over it), entries in key order.
  Status save(const std::string& path) const;
  std::string to_json_text() const;
  const TpPlan* find(const TpKey& key) const;
  void put(const TpKey& key, const TpPlan& plan, double measured_ms = 0);
  size_t size() const { return entries_.size(); }
  // Recorded in the file ("gpu"); informational.
  void set_gpu(std::string gpu) { gpu_ = std::move(gpu); }
  const std::string& gpu() const { return gpu_; }

 private:
  struct Entry {
    TpPlan plan;
    double measured_ms = 0;  // 0: not recorded
  };
  std::map<TpKey, Entry> entries_;
  std::string gpu_;
};

// The cache named by LOOM_TUNING_CACHE, read once per process and path (later edits of the file
// are not seen): nullptr when the variable is unset, an empty cache when the file does not exist
// yet, invalid_argument when it is set but empty or the file is malformed (the same error on
// every call). Operators pass the result to plan_tp.
Result<const TuningCache*> tuning_cache_from_env();

// Validates the request's shape rules (divisibility by W, GEMM constraints) and picks a plan.
// Cache entries whose comm_ctas do not fit this device are ignored.
Result<TpPlan> plan_tp(const TpRequest& request, const TpGemmOptions& options, const TuningCache* cache,
                       const TpCostModel& model = {});

// "ag_gemm", "gemm_rs", "gemm_ar" and back (the names in cache files, benches and messages).
std::string_view tp_op_name(OpId op);
Result<OpId> parse_tp_op(std::string_view name);
// "auto", "fused", "decomposed" and back.
std::string_view tp_algorithm_name(TpAlgorithm algorithm);
Result<TpAlgorithm> parse_tp_algorithm(std::string_view name);

}  // namespace loom::planner
