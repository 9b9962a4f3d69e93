// Host launcher of the multi-node ag_gemm: validate -> plan -> workspace -> launch
// (kernel: kernels/tp/multinode/sm90_ag_gemm.cuh). Instantiates its 8 kernels (128x256 / 128x128 x
// bf16 / fp16 x B layout).
#include <cuda_runtime_api.h>

#include <string>

#include "kernels/tp/multinode/sm90_ag_gemm.cuh"
#include "ops/multinode.h"
#include "ops/multinode_common.h"

namespace loom::ops {
namespace {

namespace kmn = kernels::tp::multinode;
namespace kg = kernels::gemm;

Status check_buffers(Communicator::Impl& impl, const TpGemmArgs& a) {
  const int64_t world = static_cast<int64_t>(impl.topology.world_size);
  const size_t e = dtype_size(a.dtype);
  const int64_t rows = a.m / world;
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.a, static_cast<size_t>(rows * a.k) * e, "a ([M/W, K])"), "ag_gemm");
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.b, static_cast<size_t>(a.k * a.n) * e, "b"), "ag_gemm");
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.out, static_cast<size_t>(a.m * a.n) * e, "out ([M, N])"), "ag_gemm");
  const mn::ByteRange out = mn::bytes_of(a.out, a.m, a.n, e);
  const mn::ByteRange in_a = mn::bytes_of(a.a, rows, a.k, e);
  const mn::ByteRange in_b = mn::bytes_of(a.b, a.k, a.n, e);
  if (out.overlaps(in_a)) return Status::invalid_argument("ag_gemm: out overlaps a");
  if (out.overlaps(in_b)) return Status::invalid_argument("ag_gemm: out overlaps b");
  if (a.gathered_a != nullptr) {
    LOOM_TRY(impl.symmetric_offset(a.gathered_a, static_cast<size_t>(a.m * a.k) * e, "ag_gemm: gathered_a ([M, K])").status());
    const mn::ByteRange gathered = mn::bytes_of(a.gathered_a, a.m, a.k, e);
    if (out.overlaps(gathered)) return Status::invalid_argument("ag_gemm: out overlaps gathered_a");
    if (in_b.overlaps(gathered)) return Status::invalid_argument("ag_gemm: b overlaps gathered_a");
    const uint32_t own = mn::grid_of(impl).own_block();
    const char* own_rows = static_cast<const char*>(a.gathered_a) + static_cast<size_t>(own) * rows * a.k * e;
    if (in_a.overlaps(gathered) && a.a != own_rows) {
      return Status::invalid_argument("ag_gemm: a overlaps gathered_a but is not this rank's rows of it (in place, a must be "
                                      "gathered_a + (node * L + local_rank) * M/W * K)");
    }
  }
  return {};
}

struct AgPlan {
  kmn::AgLayout layout;
  GemmTile tile = GemmTile::k128x128;
  kmn::RoleTable roles;
  size_t workspace_bytes = 0;
};

AgPlan plan_ag(const Communicator::Impl& impl, const TpGemmArgs& a, const TpGemmOptions& options) {
  AgPlan p;
  p.tile = mn::choose_tile(impl, OpId::kAgGemm, a, options);
  const kmn::Grid g = mn::grid_of(impl);
  p.layout.g = g;
  p.layout.rows_per_block = static_cast<uint32_t>(a.m / g.world());
  p.layout.rows_per_chunk = kmn::rows_per_chunk_for(p.layout.rows_per_block, static_cast<uint64_t>(a.k) * dtype_size(a.dtype),
                                                    kmn::kTargetChunkBytes);
  p.layout.flag_base = impl.network->device_view().launch_flag_base;
  p.roles = mn::roles_for(OpId::kAgGemm, g);
  p.workspace_bytes = a.gathered_a != nullptr ? 0 : static_cast<size_t>(a.m * a.k) * dtype_size(a.dtype);
  return p;
}

}  // namespace

Result<MultiNodePlan> plan_multinode_ag(Communicator& comm, const TpGemmArgs& args, const TpGemmOptions& options) {
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY(mn::check_call(impl, OpId::kAgGemm, args, options));
  const AgPlan p = plan_ag(impl, args, options);
  MultiNodePlan out;
  out.tile = p.tile;
  out.grid = impl.sm_count;
  out.net_send_ctas = static_cast<int>(p.roles.count(kmn::CtaRole::kNetSend));
  out.net_recv_ctas = static_cast<int>(p.roles.count(kmn::CtaRole::kNetRecv));
  out.nvlink_ctas = static_cast<int>(p.roles.count(kmn::CtaRole::kNvlink));
  out.rows_per_chunk = p.layout.rows_per_chunk;
  out.flags = p.layout.flags();
  out.workspace_bytes = p.workspace_bytes;
  return out;
}

Status ag_gemm_multinode(Communicator& comm, const TpGemmArgs& a, cudaStream_t stream, const TpGemmOptions& options) {
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY(mn::check_call(impl, OpId::kAgGemm, a, options));
  LOOM_TRY(mn::load_multinode_kernels());
  const AgPlan plan = plan_ag(impl, a, options);
  const kmn::Grid g = plan.layout.g;
  if (std::string why = mn::check_flags(impl, plan.layout.flags()); !why.empty()) {
    return Status::unsupported("ag_gemm: " + mn::shape_text(a, g) + ": " + why);
  }
  if (static_cast<uint32_t>(impl.sm_count) <= plan.roles.rest_begin()) {
    return Status::unsupported("ag_gemm: the GPU has too few SMs for the multi-node roles plus a compute CTA");
  }
  LOOM_TRY(check_buffers(impl, a));
  void* gathered = a.gathered_a;
  if (gathered == nullptr) {
    LOOM_ASSIGN_OR_RETURN(gathered, family_workspace(impl, mn::kFamily, plan.workspace_bytes, stream, "ag_gemm"));
  }
  const size_t e = dtype_size(a.dtype);
  const GemmTileInfo info = gemm_tile_info(plan.tile);
  const int64_t rows = plan.layout.rows_per_block;
  const char* own_rows = static_cast<const char*>(gathered) + static_cast<size_t>(g.own_block()) * rows * a.k * e;

  kmn::AgParams p{};
  LOOM_TRY(encode_gemm_operand_maps(mn::gemm_args(gathered, a.b, a.out, a.m, a), plan.tile, &p.a_gathered, &p.b));
  LOOM_TRY(encode_gemm_rows_map(a.a, rows, a.k, a.k, a.dtype, info.block_m, &p.a_local));
  LOOM_TRY(encode_gemm_output_map(a.out, a.m, a.n, a.n, a.dtype, &p.out));
  p.comm = impl.device_comm();
  LOOM_ASSIGN_OR_RETURN(p.state, family_launch_state(impl, mn::kFamily));
  p.m = static_cast<uint32_t>(a.m);
  p.n = static_cast<uint32_t>(a.n);
  p.k = static_cast<uint32_t>(a.k);
  p.n_blocks = static_cast<uint32_t>((a.n + info.block_n - 1) / info.block_n);
  p.group_m = mn::group_m_for(impl.sm_count, plan.tile, rows / info.block_m);
  p.layout = plan.layout;
  p.epi.op = static_cast<uint32_t>(kg::EpilogueOp::kStore);
  p.epi.out_dtype = static_cast<uint32_t>(a.dtype);
  p.epi.num_dst = 1;
  p.shard = static_cast<const char*>(a.a);
  p.gathered_offset = impl.heap->offset_of(gathered);
  p.row_bytes = static_cast<uint64_t>(a.k) * e;
  p.copy_own = a.a != own_rows ? 1u : 0u;
  p.roles = plan.roles;
  // The gathered A's heap offset is part of the plan: peers write into it by their own offset.
  p.signature = mn::signature(OpId::kAgGemm, plan.tile, g,
                              {a.m, a.k, static_cast<int64_t>(a.dtype), static_cast<int64_t>(plan.layout.rows_per_chunk),
                               static_cast<int64_t>(p.gathered_offset)});
  LOOM_DEBUG("ag_gemm multi-node %s: tile %s, %d CTAs (%u send, %u receive, %u NVLink), %u rows per chunk",
             mn::shape_text(a, g).c_str(), std::string(gemm_tile_name(plan.tile)).c_str(), impl.sm_count,
             plan.roles.count(kmn::CtaRole::kNetSend), plan.roles.count(kmn::CtaRole::kNetRecv),
             plan.roles.count(kmn::CtaRole::kNvlink), plan.layout.rows_per_chunk);
  return mn::dispatch(plan.tile, a.dtype, a.b_layout, [&]<class Cfg, bool kBF16, bool kBNMajor>() -> Status {
    return launch_kernel(&kmn::ag_gemm_kernel<Cfg, kBF16, kBNMajor>, static_cast<unsigned>(impl.sm_count), Cfg::kThreads,
                         Cfg::kSmemBytes, stream, p);
  });
}

namespace mn {

Status load_ag_gemm_kernels() {
  // [&]: a lambda with a capture default has no conversion to a function pointer, whose template
  // parameters nvcc would warn cannot be deduced.
  return load_every_config([&]<class Cfg, bool kBF16, bool kBNMajor>() { return &kmn::ag_gemm_kernel<Cfg, kBF16, kBNMajor>; });
}

}  // namespace mn

}  // namespace loom::ops
