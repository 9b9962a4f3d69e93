#include "ops/tp/tp_common.h"

#include <cstdio>

#include "core/log.h"
#include "kernels/gemm/params.h"
#include "kernels/tp/tail_pieces.cuh"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/checks.h"
#include "ops/launch/signature.h"

namespace loom::ops::tp {

std::string shape_text(const TpGemmArgs& a, int world) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "M=%lld N=%lld K=%lld W=%d %s", static_cast<long long>(a.m), static_cast<long long>(a.n),
                static_cast<long long>(a.k), world, std::string(dtype_name(a.dtype)).c_str());
  return buf;
}

Status check_common(Communicator::Impl& impl, OpId op, const TpGemmArgs& a) {
  const std::string name(planner::tp_op_name(op));
  LOOM_TRY(impl.check_usable());
  LOOM_TRY(check_tma_pointers(name, {{a.a, "a"}, {a.b, "b"}, {a.out, "out"}}));
  if (a.gathered_a != nullptr && op != OpId::kAgGemm) {
    return Status::invalid_argument(name + ": gathered_a belongs to ag_gemm; leave it null");
  }
  return check_optional_tma_pointer(name, {a.gathered_a, "gathered_a"});
}

Status check_ag_buffers(Communicator::Impl& impl, const TpGemmArgs& a, int64_t world, int64_t own_block,
                        const char* in_place) {
  const char* name = "ag_gemm";
  const size_t e = dtype_size(a.dtype);
  const int64_t rows = a.m / world;
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.a, static_cast<size_t>(rows * a.k) * e, "a ([M/W, K])"), name);
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.b, static_cast<size_t>(a.k * a.n) * e, "b"), name);
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.out, static_cast<size_t>(a.m * a.n) * e, "out ([M, N])"), name);
  const ByteRange out = bytes_of(a.out, a.m, a.n, e);
  const ByteRange in_a = bytes_of(a.a, rows, a.k, e);
  const ByteRange in_b = bytes_of(a.b, a.k, a.n, e);
  LOOM_TRY(check_disjoint(name, out, "out", in_a, "a"));
  LOOM_TRY(check_disjoint(name, out, "out", in_b, "b"));
  if (a.gathered_a == nullptr) return {};
  LOOM_TRY(impl.symmetric_offset(a.gathered_a, static_cast<size_t>(a.m * a.k) * e, "ag_gemm: gathered_a ([M, K])").status());
  const ByteRange gathered = bytes_of(a.gathered_a, a.m, a.k, e);
  LOOM_TRY(check_disjoint(name, out, "out", gathered, "gathered_a"));
  LOOM_TRY(check_disjoint(name, in_b, "b", gathered, "gathered_a"));
  const char* own_rows = static_cast<const char*>(a.gathered_a) + static_cast<size_t>(own_block * rows * a.k) * e;
  if (in_a.overlaps(gathered) && a.a != own_rows) {
    return Status::invalid_argument(std::string("ag_gemm: a overlaps gathered_a but is not this rank's rows of it (in place, a "
                                                "must be ") + in_place + ")");
  }
  return {};
}

Status check_reduce_buffers(Communicator::Impl& impl, OpId op, const TpGemmArgs& a, int64_t out_rows) {
  const std::string name(planner::tp_op_name(op));
  const size_t e = dtype_size(a.dtype);
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.a, static_cast<size_t>(a.m * a.k) * e, "a ([M, K])"), name);
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.b, static_cast<size_t>(a.k * a.n) * e, "b"), name);
  if (op == OpId::kGemmAr) {
    LOOM_TRY(impl.symmetric_offset(a.out, static_cast<size_t>(a.m * a.n) * e, "gemm_ar: out ([M, N])").status());
  } else {
    LOOM_TRY_CTX(impl.check_local_device_buffer(a.out, static_cast<size_t>(out_rows * a.n) * e, "out ([M/W, N])"), name);
  }
  const ByteRange out = bytes_of(a.out, out_rows, a.n, e);
  LOOM_TRY(check_disjoint(name, out, "out", bytes_of(a.a, a.m, a.k, e), "a"));
  return check_disjoint(name, out, "out", bytes_of(a.b, a.k, a.n, e), "b");
}

planner::TpRequest tp_request(OpId op, const TpGemmArgs& a, int world, int sm_count) {
  return planner::TpRequest{.op = op, .m = a.m, .n = a.n, .k = a.k, .local_world = world, .dtype = a.dtype,
                            .b_layout = a.b_layout, .sm_count = sm_count};
}

Result<TpCall> decide(Communicator::Impl& impl, OpId op, const TpGemmArgs& a, const TpGemmOptions& options,
                      const FusedCheck& fused_check) {
  const std::string name(planner::tp_op_name(op));
  const int world = impl.topology.local_world_size;
  // The node's smallest SM count, so that every rank plans alike.
  const planner::TpRequest request =
      tp_request(op, a, world, impl.topology.min_sm_count > 0 ? impl.topology.min_sm_count : impl.sm_count);
  LOOM_ASSIGN_OR_RETURN(const planner::TuningCache* cache, planner::tuning_cache_from_env());
  LOOM_ASSIGN_OR_RETURN(planner::TpPlan plan, planner::plan_tp(request, options, cache));

  TpCall call;
  call.plan = plan;
  call.timeline = options.timeline;
  call.info.tile = plan.tile;
  call.info.source = plan.source;
  if (world == 1) {
    call.info.path = TpPath::kPlainGemm;
    return call;
  }
  call.info.path = TpPath::kDecomposed;
  if (plan.algorithm != TpAlgorithm::kFused) return call;
  const bool forced = options.algorithm == TpAlgorithm::kFused;
  std::string why = planner::fused_refusal(request);
  if (why.empty() && !planner::is_fused_tile(call.info.tile)) {
    if (options.tile != GemmTile::kAuto) {
      why = "the fused kernels are built for the 128x256 and 128x128 tiles, not " + std::string(gemm_tile_name(call.info.tile));
    } else if (forced) {
      call.info.tile = GemmTile::k128x128;  // fused was asked for; the tile was only the planner's
    } else {
      why = "the planner's tile " + std::string(gemm_tile_name(call.info.tile)) + " has no fused kernel";
    }
  }
  if (why.empty()) why = fused_check(call.info.tile, impl.sm_count);
  if (why.empty()) {
    call.info.path = TpPath::kFused;
    call.info.ctas = impl.sm_count;
    return call;
  }
  if (forced) return Status::unsupported(name + ": " + shape_text(a, world) + ": the fused kernel cannot run: " + why);
  LOOM_DEBUG("%s %s: planned fused, running decomposed: %s", name.c_str(), shape_text(a, world).c_str(), why.c_str());
  return call;
}

uint32_t plan_signature(OpId op, GemmTile tile, int world, std::initializer_list<int64_t> values) {
  return fused_plan_signature(op, static_cast<int>(tile), world, values);
}

std::string check_flag_capacity(const Communicator::Impl& impl, uint64_t launch_flags) {
  const uint64_t need = static_cast<uint64_t>(impl.topology.local_world_size) + launch_flags;
  if (need <= impl.control.max_op_flags) return {};
  return "it needs " + std::to_string(need) + " flags and the control region holds " +
         std::to_string(impl.control.max_op_flags) + " (fewer, larger tiles or a smaller call would fit)";
}

GemmArgs local_gemm(const void* a, const void* b, void* d, int64_t m, const TpGemmArgs& args) {
  return GemmArgs{.a = a, .b = b, .d = d, .m = m, .n = args.n, .k = args.k, .in_dtype = args.dtype,
                  .out_dtype = args.dtype, .b_layout = args.b_layout};
}

GemmOptions gemm_options_for(const TpCall& call) {
  GemmOptions o;
  o.tile = call.info.tile;
  return o;
}

int64_t piece_slots_of(const planner::TailSplit& split) { return split.pieces >= 2 ? split.tiles * (split.pieces - 1) : 0; }

size_t piece_slot_bytes(int64_t piece_slots, GemmTile tile, DType dtype) {
  const GemmTileInfo info = gemm_tile_info(tile);
  return static_cast<size_t>(piece_slots) * static_cast<size_t>(info.block_m) * static_cast<size_t>(info.block_n) *
         dtype_size(dtype);
}

void note_tail_split(TpCall& call) {
  const bool split = piece_slots_of(call.split) > 0;
  call.info.tail_tiles = split ? call.split.tiles : 0;
  call.info.tail_pieces = split ? call.split.pieces : 0;
}

Status set_tail_split(const planner::TailSplit& split, void* base, GemmTile tile, DType dtype, int64_t k,
                      uint64_t flag_base, kernels::gemm::TailSplitParams* params, kernels::tp::TailPieces* pieces) {
  const GemmTileInfo info = gemm_tile_info(tile);
  params->k_blocks = static_cast<uint32_t>((k + info.block_k - 1) / info.block_k);
  pieces->flag_base = static_cast<uint32_t>(flag_base);
  const int64_t slots = piece_slots_of(split);
  if (slots == 0) return {};
  const int64_t rows = slots * info.block_m;
  LOOM_TRY(encode_gemm_output_map(base, rows, info.block_n, info.block_n, dtype, &pieces->store));
  LOOM_TRY(encode_gemm_rows_map(base, rows, info.block_n, info.block_n, dtype, info.block_m, &pieces->load));
  params->tiles = static_cast<uint32_t>(split.tiles);
  params->pieces = static_cast<uint32_t>(split.pieces);
  return {};
}

}  // namespace loom::ops::tp
