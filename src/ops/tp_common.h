// Host side shared by the fused tensor-parallel operators (ag_gemm.cu, gemm_rs.cu, gemm_ar.cu):
// argument checks, the decision (plain GEMM, fused kernel or decomposed collective + GEMM), the
// TP workspace in the symmetric heap, plan signatures and kernel-launch plumbing.
//
// Rules every operator checks before anything is launched (the op adds its own):
//   unsupported       communicator spanning several nodes; fp32; a forced fused kernel whose
//                     shape or tile it cannot run (the message names the rule)
//   invalid_argument  null or not 16-byte aligned a / b / out (/ gathered_a); M not a multiple
//                     of W; N or K not a multiple of 8 (plan_tp); overlapping buffers
// Fused kernels additionally need (otherwise TpAlgorithm::kAuto runs decomposed and an explicit
// kFused is refused): W <= 8, a 128x256 or 128x128 tile, M/W a multiple of 128 (BLOCK_M), and
// their flags within the control region's capacity.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>

#include "core/log.h"
#include "kernels/gemm/config.h"
#include "ops/launch/signature.h"
#include "kernels/tp/fused_frame.cuh"
#include "kernels/tp/staged_reduce.cuh"
#include "loom/tensor_parallel.h"
#include "ops/gemm_launch.h"
#include "ops/launch/family_resources.h"
#include "ops/launch/kernel_launch.h"
#include "planner/tp_plan.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"

namespace loom::ops::tp {

using kernels::tp::TpTunables;

// BLOCK_M of every fused configuration: the rows each rank owns must be whole tile rows.
constexpr int64_t kFusedBlockM = 128;

inline bool fused_tile(GemmTile tile) { return tile == GemmTile::k128x256 || tile == GemmTile::k128x128; }

inline std::string shape_text(const TpGemmArgs& a, int world) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "M=%lld N=%lld K=%lld W=%d %s", static_cast<long long>(a.m),
                static_cast<long long>(a.n), static_cast<long long>(a.k), world, std::string(dtype_name(a.dtype)).c_str());
  return buf;
}

// Byte range [lo, hi) of a packed row-major matrix.
struct ByteRange {
  uintptr_t lo = 0, hi = 0;
  bool overlaps(const ByteRange& o) const { return lo < o.hi && o.lo < hi; }
};
inline ByteRange bytes_of(const void* p, int64_t rows, int64_t cols, size_t elem) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  return {lo, lo + static_cast<uintptr_t>(rows) * static_cast<uintptr_t>(cols) * elem};
}

// Checks shared by the three operators (before the planner, which checks the shape rules).
inline Status check_common(Communicator::Impl& impl, OpId op, const TpGemmArgs& a) {
  const std::string name(planner::tp_op_name(op));
  LOOM_TRY(impl.check_usable());
  if (impl.topology.num_nodes > 1) {
    return Status::unsupported(name + ": the fused tensor-parallel operators run within one NVLink domain; this job spans " +
                               std::to_string(impl.topology.num_nodes) + " nodes");
  }
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) {
    return Status::unsupported(name + ": " + std::string(dtype_name(a.dtype)) + " is not supported (bf16 or fp16)");
  }
  const std::pair<const void*, const char*> pointers[] = {{a.a, "a"}, {a.b, "b"}, {a.out, "out"}};
  for (const auto& [ptr, what] : pointers) {
    if (ptr == nullptr) return Status::invalid_argument(name + ": " + what + " is null");
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
      return Status::invalid_argument(name + ": " + what + " is not 16-byte aligned (TMA needs 16-byte aligned rows)");
    }
  }
  if (a.gathered_a != nullptr && op != OpId::kAgGemm) {
    return Status::invalid_argument(name + ": gathered_a belongs to ag_gemm; leave it null");
  }
  return {};
}

// What an operator call runs.
enum class TpPath : uint8_t {
  kPlainGemm,   // one local rank: the plain GEMM (nothing to move)
  kFused,       // the fused persistent kernel
  kDecomposed,  // loom collective + loom GEMM on the same stream
};

struct TpDecision {
  TpPath path = TpPath::kDecomposed;
  GemmTile tile = GemmTile::k128x128;
  int comm_ctas = 0;  // ag_gemm fused: CTAs that start in the communication role
  int grid = 0;       // fused: persistent CTAs (the SM count of this GPU)
  planner::TpPlan plan;
  TileTimelineRecord* timeline = nullptr;  // fused: TpGemmOptions::timeline (diagnostics)
  int tail_pieces = -1;                    // fused: TpGemmOptions::tail_pieces
};

// The fused kernel's own rules for this call, beyond the common ones: "" when it can run, else
// the reason (shown when fused was forced, logged when the planner's choice falls back).
using FusedCheck = std::function<std::string(GemmTile tile, int grid)>;

// The planner's view of a call on `world` local ranks and `sm_count` SMs.
inline planner::TpRequest tp_request(OpId op, const TpGemmArgs& a, int world, int sm_count) {
  planner::TpRequest r;
  r.op = op;
  r.m = a.m;
  r.n = a.n;
  r.k = a.k;
  r.local_world = world;
  r.dtype = a.dtype;
  r.b_layout = a.b_layout;
  r.sm_count = sm_count;
  return r;
}

// Plans the call (options, tuning cache, cost model: planner/tp_plan.h), then applies what the
// fused kernels can run. Every rank reaches the same decision from the same arguments.
inline Result<TpDecision> decide(Communicator::Impl& impl, OpId op, const TpGemmArgs& a, const TpGemmOptions& options,
                                 const FusedCheck& fused_check) {
  const std::string name(planner::tp_op_name(op));
  const int world = impl.topology.local_world_size;
  // The node's smallest SM count, so that every rank plans alike.
  const planner::TpRequest request =
      tp_request(op, a, world, impl.topology.min_sm_count > 0 ? impl.topology.min_sm_count : impl.sm_count);
  LOOM_ASSIGN_OR_RETURN(const planner::TuningCache* cache, planner::tuning_cache_from_env());
  LOOM_ASSIGN_OR_RETURN(planner::TpPlan plan, planner::plan_tp(request, options, cache));

  TpDecision d;
  d.plan = plan;
  d.tile = plan.tile;
  d.grid = impl.sm_count;
  d.timeline = options.timeline;
  d.tail_pieces = options.tail_pieces;
  if (world == 1) {
    d.path = TpPath::kPlainGemm;
    return d;
  }
  if (plan.algorithm != TpAlgorithm::kFused) {
    d.path = TpPath::kDecomposed;
    return d;
  }
  const bool forced = options.algorithm == TpAlgorithm::kFused;
  std::string why;
  if (world > TpTunables::kMaxLocalWorld) {
    why = "the fused kernels address at most " + std::to_string(TpTunables::kMaxLocalWorld) + " local ranks";
  } else if (!fused_tile(d.tile)) {
    if (options.tile != GemmTile::kAuto) {
      why = "the fused kernels are built for the 128x256 and 128x128 tiles, not " + std::string(gemm_tile_name(d.tile));
    } else if (forced) {
      d.tile = GemmTile::k128x128;  // fused was asked for; the tile was only the planner's
    } else {
      why = "the planner's tile " + std::string(gemm_tile_name(d.tile)) + " has no fused kernel";
    }
  }
  if (why.empty() && (a.m / world) % kFusedBlockM != 0) {
    why = "each rank's M/W = " + std::to_string(a.m / world) + " rows must be a multiple of " +
          std::to_string(kFusedBlockM) + " (BLOCK_M: a tile row never spans two ranks)";
  }
  if (why.empty()) why = fused_check(d.tile, d.grid);
  if (why.empty()) {
    d.path = TpPath::kFused;
    return d;
  }
  if (forced) return Status::unsupported(name + ": " + shape_text(a, world) + ": the fused kernel cannot run: " + why);
  LOOM_DEBUG("%s %s: planned fused, running decomposed: %s", name.c_str(), shape_text(a, world).c_str(), why.c_str());
  d.path = TpPath::kDecomposed;
  return d;
}

// The 32-bit signature of what a fused launch does, compared between ranks at entry (a mismatch
// fails the launch with invalid_argument before any data moves): ops/launch/signature.h over the
// tile, the world and `values`, the op's fields that must be equal on every rank.
inline uint32_t plan_signature(OpId op, GemmTile tile, int world, std::initializer_list<int64_t> values) {
  return fused_plan_signature(op, static_cast<int>(tile), world, values);
}

// Flags a fused launch needs beyond the W entry words must fit the control region.
inline std::string check_flag_capacity(const Communicator::Impl& impl, uint64_t launch_flags) {
  const uint64_t need = static_cast<uint64_t>(impl.topology.local_world_size) + launch_flags;
  if (need <= impl.control.max_op_flags) return {};
  return "it needs " + std::to_string(need) + " flags and the control region holds " +
         std::to_string(impl.control.max_op_flags) + " (fewer, larger tiles or a smaller call would fit)";
}

// The fused single-node TP operators' family: its launch state and workspace
// (ops/launch/family_resources.h).
inline constexpr std::string_view kFamily = "tp";

// Raster group height (tile rows) for `grid` CTAs, as the GEMM planner picks it, limited to a
// divisor of `unit` tile rows (a band or a rank's rows) so that no group straddles two.
inline uint32_t group_m_for(int grid, GemmTile tile, int64_t unit) {
  const GemmTileInfo info = gemm_tile_info(tile);
  const double g = std::sqrt(static_cast<double>(grid) * info.block_n / info.block_m);
  int64_t best = 1;
  for (int64_t d = 1; d <= unit && d <= 64; ++d) {
    if (unit % d == 0 && d <= std::max<int64_t>(1, std::llround(g))) best = d;
  }
  return static_cast<uint32_t>(best);
}

// Calls fn.template operator()<Cfg, kBF16, kBNMajor>() for the fused configuration of the call.
template <class Fn>
Status dispatch_fused(GemmTile tile, DType dtype, BLayout layout, Fn&& fn) {
  namespace kg = kernels::gemm;
  const bool bf16 = dtype == DType::kBF16;
  const bool n_major = layout == BLayout::kKN;
  auto by_layout = [&]<class Cfg, bool kBF16>() -> Status {
    return n_major ? fn.template operator()<Cfg, kBF16, true>() : fn.template operator()<Cfg, kBF16, false>();
  };
  auto by_dtype = [&]<class Cfg>() -> Status {
    return bf16 ? by_layout.template operator()<Cfg, true>() : by_layout.template operator()<Cfg, false>();
  };
  switch (tile) {
    case GemmTile::k128x256: return by_dtype.template operator()<kg::Tile128x256>();
    case GemmTile::k128x128: return by_dtype.template operator()<kg::Tile128x128>();
    default: break;
  }
  return Status::internal("tensor-parallel dispatch: no fused kernel for tile " + std::string(gemm_tile_name(tile)));
}

// The plain local GEMM of an operator (decomposed path and one-rank jobs).
inline GemmArgs local_gemm(const void* a, const void* b, void* d, int64_t m, const TpGemmArgs& args) {
  GemmArgs g;
  g.a = a;
  g.b = b;
  g.d = d;
  g.m = m;
  g.n = args.n;
  g.k = args.k;
  g.in_dtype = args.dtype;
  g.out_dtype = args.dtype;
  g.b_layout = args.b_layout;
  return g;
}

inline GemmOptions gemm_options_for(const TpDecision& d) {
  GemmOptions o;
  o.tile = d.tile;
  return o;
}

// ---- gemm_rs / gemm_ar (kernels/tp/staged_reduce.cuh) -----------------------------------------

// Rows of one owner per band of the rank-banded order: the fewest tile rows dividing the
// owner's rows whose tiles fill kBandWaves waves of the grid (all of them if none does).
inline int64_t band_m_blocks_for(int64_t rank_blocks, int64_t n_blocks, int grid) {
  for (int64_t q = 1; q <= rank_blocks; ++q) {
    if (rank_blocks % q == 0 && q * n_blocks >= static_cast<int64_t>(TpTunables::kBandWaves) * grid) return q;
  }
  return rank_blocks;
}

// The tail split of a fused gemm_rs / gemm_ar launch (planner::plan_tail_split): the order's
// last band (own tiles) may be split.
inline planner::TailSplit reduce_tail_split(const TpGemmArgs& a, GemmTile tile, int grid, int world, int requested) {
  const GemmTileInfo info = gemm_tile_info(tile);
  const int64_t n_blocks = (a.n + info.block_n - 1) / info.block_n;
  const int64_t m_blocks = a.m / info.block_m;
  const int64_t band = band_m_blocks_for(m_blocks / world, n_blocks, grid);
  const int64_t k_blocks = (a.k + info.block_k - 1) / info.block_k;
  return planner::plan_tail_split(m_blocks * n_blocks, grid, k_blocks, info.stages, band * n_blocks, requested);
}

// Staged piece slots of a tail split: (pieces - 1) per split tile.
inline int64_t piece_slots_of(const planner::TailSplit& split) {
  return split.pieces >= 2 ? split.tiles * (split.pieces - 1) : 0;
}

// Workspace bytes of `piece_slots` slots (one BLOCK_M x BLOCK_N tile of the input type each).
inline size_t piece_slot_bytes(int64_t piece_slots, GemmTile tile, DType dtype) {
  const GemmTileInfo info = gemm_tile_info(tile);
  return static_cast<size_t>(piece_slots) * static_cast<size_t>(info.block_m) * static_cast<size_t>(info.block_n) *
         dtype_size(dtype);
}

// Fills a launch's tail split: the scheduler's split and, with pieces, the piece slots at `base`
// (kernels/tp/tail_pieces.cuh) and their flags from op_flags[flag_base].
inline Status set_tail_split(const planner::TailSplit& split, void* base, GemmTile tile, DType dtype, uint64_t flag_base,
                             kernels::gemm::SchedulerParams* sched, kernels::tp::TailPieces* pieces) {
  pieces->flag_base = static_cast<uint32_t>(flag_base);
  const int64_t slots = piece_slots_of(split);
  if (slots == 0) return {};
  const GemmTileInfo info = gemm_tile_info(tile);
  const int64_t rows = slots * info.block_m;
  LOOM_TRY(encode_gemm_output_map(base, rows, info.block_n, info.block_n, dtype, &pieces->store));
  LOOM_TRY(encode_gemm_rows_map(base, rows, info.block_n, info.block_n, dtype, info.block_m, &pieces->load));
  sched->split_tiles = static_cast<uint32_t>(split.tiles);
  sched->split_pieces = static_cast<uint32_t>(split.pieces);
  return {};
}

// Flags a fused gemm_rs (broadcast = false) or gemm_ar launch uses after the entry words.
inline uint64_t reduce_flags_for(int64_t m, int64_t n, int world, GemmTile tile, bool broadcast, int64_t piece_slots) {
  const GemmTileInfo info = gemm_tile_info(tile);
  const uint64_t n_blocks = static_cast<uint64_t>((n + info.block_n - 1) / info.block_n);
  const uint64_t m_blocks = static_cast<uint64_t>(m / info.block_m);
  const uint64_t own_tiles = m_blocks / static_cast<uint64_t>(world) * n_blocks;
  return static_cast<uint64_t>(world - 1) * own_tiles + (broadcast ? m_blocks * n_blocks : 0) +
         static_cast<uint64_t>(piece_slots);
}

// Bytes of staged partials a fused gemm_rs / gemm_ar needs in every rank's workspace: the other
// ranks' partials of this rank's rows, then (1 KiB aligned) the piece slots of a tail split.
inline size_t reduce_peer_staging_bytes(const TpGemmArgs& a, int world) {
  const size_t bytes = static_cast<size_t>(world - 1) * static_cast<size_t>(a.m / world) * static_cast<size_t>(a.n) *
                       dtype_size(a.dtype);
  return (bytes + 1023) / 1024 * 1024;
}
inline size_t reduce_staging_bytes(const TpGemmArgs& a, int world, GemmTile tile, int64_t piece_slots) {
  return reduce_peer_staging_bytes(a, world) + piece_slot_bytes(piece_slots, tile, a.dtype);
}

// Fills the kernel parameters of a fused gemm_rs / gemm_ar launch. `staging` is this rank's TP
// workspace (equal offset on every rank); gemm_ar's out is symmetric.
inline Status build_reduce_params(Communicator::Impl& impl, const TpGemmArgs& a, const TpDecision& d, void* staging,
                                  const planner::TailSplit& split, bool broadcast,
                                  kernels::tp::ReduceGemmParams* out_params) {
  namespace kg = kernels::gemm;
  kernels::tp::ReduceGemmParams& p = *out_params;
  const int world = impl.topology.local_world_size;
  const int me = impl.topology.local_rank;
  const GemmTileInfo info = gemm_tile_info(d.tile);
  const int64_t rows = a.m / world;
  const int64_t staging_rows = static_cast<int64_t>(world - 1) * rows;
  const uint64_t staging_offset = impl.heap->offset_of(staging);

  LOOM_TRY(encode_gemm_operand_maps(local_gemm(a.a, a.b, a.out, a.m, a), d.tile, &p.a, &p.b));
  LOOM_TRY(encode_gemm_rows_map(staging, staging_rows, a.n, a.n, a.dtype, info.block_m, &p.staged));
  if (broadcast) {
    const uint64_t out_offset = impl.heap->offset_of(a.out);
    for (int r = 0; r < world; ++r) {
      void* out_r = static_cast<char*>(impl.heap->peer_base(r)) + out_offset;
      LOOM_TRY(encode_gemm_output_map(out_r, a.m, a.n, a.n, a.dtype, &p.out[r]));
    }
  } else {
    LOOM_TRY(encode_gemm_output_map(a.out, rows, a.n, a.n, a.dtype, &p.out[0]));
  }
  for (int r = 0; r < world; ++r) {
    if (r == me) continue;
    void* staging_r = static_cast<char*>(impl.heap->peer_base(r)) + staging_offset;
    LOOM_TRY(encode_gemm_output_map(staging_r, staging_rows, a.n, a.n, a.dtype, &p.stage_to[r]));
  }
  p.comm = impl.device_comm();
  LOOM_ASSIGN_OR_RETURN(p.state, family_launch_state(impl, kFamily));
  p.m = static_cast<uint32_t>(a.m);
  p.n = static_cast<uint32_t>(a.n);
  p.k = static_cast<uint32_t>(a.k);

  const int64_t m_blocks = a.m / info.block_m;
  const int64_t n_blocks = (a.n + info.block_n - 1) / info.block_n;
  const int64_t rank_blocks = rows / info.block_m;
  const int64_t band = band_m_blocks_for(rank_blocks, n_blocks, d.grid);
  kg::SchedulerParams& s = p.sched;
  s.m_rows = p.m;
  s.m_blocks = static_cast<uint32_t>(m_blocks);
  s.n_blocks = static_cast<uint32_t>(n_blocks);
  s.group_m = group_m_for(d.grid, d.tile, band);  // a raster group never spans two owners
  s.queue = &p.state->tile_queue;
  s.order_world = static_cast<uint32_t>(world);
  s.order_self = static_cast<uint32_t>(me);
  s.order_owner_offset = 1;  // the next rank's rows first, our own last in every band
  s.order_m_blocks_per_rank = static_cast<uint32_t>(rank_blocks);
  s.order_band_m_blocks = static_cast<uint32_t>(band);
  s.fold_m_begin = static_cast<uint32_t>(me * rank_blocks);
  s.fold_m_end = static_cast<uint32_t>((me + 1) * rank_blocks);
  s.k_blocks = static_cast<uint32_t>((a.k + info.block_k - 1) / info.block_k);
  const int64_t piece_slots = piece_slots_of(split);
  // Local only: pieces are staged and folded by this rank (peers never address them).
  LOOM_TRY(set_tail_split(split, static_cast<char*>(staging) + reduce_peer_staging_bytes(a, world), d.tile, a.dtype,
                          world + reduce_flags_for(a.m, a.n, world, d.tile, broadcast, 0), &s, &p.pieces));

  p.rows_per_rank = static_cast<uint32_t>(rows);
  p.m_blocks_per_rank = static_cast<uint32_t>(rank_blocks);
  p.n_blocks = static_cast<uint32_t>(n_blocks);
  p.out_dtype = static_cast<uint32_t>(a.dtype);
  p.timeline = d.timeline;
  // Heap offsets are part of the plan: peers address this rank's staging (and gemm_ar's out) by
  // their own offsets.
  const int64_t out_offset = broadcast ? static_cast<int64_t>(impl.heap->offset_of(a.out)) : 0;
  p.signature = plan_signature(broadcast ? OpId::kGemmAr : OpId::kGemmRs, d.tile, world,
                               {a.m, a.n, static_cast<int64_t>(a.dtype), static_cast<int64_t>(staging_offset), out_offset});
  LOOM_DEBUG("%s fused %s: tile %s, %d CTAs, bands of %lld tile rows, last %lld tiles in %d K pieces, plan from %s",
             broadcast ? "gemm_ar" : "gemm_rs", shape_text(a, world).c_str(), std::string(gemm_tile_name(d.tile)).c_str(),
             d.grid, static_cast<long long>(band), static_cast<long long>(piece_slots > 0 ? split.tiles : 0),
             piece_slots > 0 ? split.pieces : 1, d.plan.source.c_str());
  return {};
}

// The fused gemm_rs / gemm_ar launch: staging workspace, kernel parameters, one persistent kernel.
// `kernel_of` is a lambda template `[&]<class Cfg, bool kBF16, bool kBNMajor>() { return &kernel<...>; }`
// ([&]: see ops/multinode_gemm_rs.cu).
template <class KernelOf>
Status launch_reduce_fused(Communicator& comm, const TpGemmArgs& a, const TpDecision& d, cudaStream_t stream,
                           bool broadcast, const char* op, KernelOf kernel_of) {
  Communicator::Impl& impl = internal(comm);
  const int world = impl.topology.local_world_size;
  const planner::TailSplit split = reduce_tail_split(a, d.tile, d.grid, world, d.tail_pieces);
  LOOM_ASSIGN_OR_RETURN(void* staging,
                        family_workspace(impl, kFamily, reduce_staging_bytes(a, world, d.tile, piece_slots_of(split)), stream, op));
  kernels::tp::ReduceGemmParams p{};
  LOOM_TRY(build_reduce_params(impl, a, d, staging, split, broadcast, &p));
  return dispatch_fused(d.tile, a.dtype, a.b_layout, [&]<class Cfg, bool kBF16, bool kBNMajor>() -> Status {
    auto* kernel = kernel_of.template operator()<Cfg, kBF16, kBNMajor>();
    return launch_kernel(kernel, static_cast<unsigned>(d.grid), Cfg::kThreads, Cfg::kSmemBytes, stream, p);
  });
}

}  // namespace loom::ops::tp
