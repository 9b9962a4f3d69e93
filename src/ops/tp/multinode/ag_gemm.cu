// The multi-node ag_gemm (kernel: kernels/tp/multinode/sm90_ag_gemm.cuh): buffer checks and
// launch; instantiates its 8 kernels.
#include <cuda_runtime_api.h>

#include <string>

#include "core/log.h"
#include "kernels/tp/multinode/sm90_ag_gemm.cuh"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/family_resources.h"
#include "ops/launch/kernel_launch.h"
#include "ops/tp/fused_kernel.h"
#include "ops/tp/multinode/multinode.h"
#include "ops/tp/tp_common.h"

namespace loom::ops::tp::multinode {
namespace {

namespace kmn = kernels::tp::multinode;
constexpr OpId kOp = OpId::kAgGemm;

struct KernelOf {
  template <class Cfg, bool kBF16, bool kBNMajor>
  auto operator()() const {
    return &kmn::ag_gemm_kernel<Cfg, kBF16, kBNMajor>;
  }
};

Result<TpCall> plan_ag(Communicator::Impl& impl, const TpGemmArgs& args, const TpGemmOptions& options) {
  return plan_call(impl, kOp, args, options);
}

Status check_buffers(Communicator::Impl& impl, const TpGemmArgs& a) {
  return check_ag_buffers(impl, a, impl.topology.world_size, grid_of(impl).own_block(),
                          "gathered_a + (node * L + local_rank) * M/W * K");
}

Status launch(Communicator& comm, const TpCall& call, const TpGemmArgs& a, cudaStream_t stream) {
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY(load_kernels());
  const planner::MultiNodePlan& plan = call.multinode;
  const kmn::AgLayout& layout = plan.ag;
  const kmn::Grid g = layout.g;
  void* gathered = a.gathered_a;
  if (gathered == nullptr) {
    LOOM_ASSIGN_OR_RETURN(gathered, family_workspace(impl, kFamily, plan.workspace_bytes, stream, "ag_gemm"));
  }
  const size_t e = dtype_size(a.dtype);
  const GemmTileInfo info = gemm_tile_info(plan.tile);
  const int64_t rows = layout.rows_per_block;
  const char* own_rows = static_cast<const char*>(gathered) + static_cast<size_t>(g.own_block()) * rows * a.k * e;

  kmn::AgParams p{};
  LOOM_TRY(set_ag_operands(impl, kFamily, a, gathered, rows, plan.tile, &p));
  p.n_blocks = static_cast<uint32_t>((a.n + info.block_n - 1) / info.block_n);
  p.group_m = plan.group_m;
  p.layout = layout;
  p.copy_own = a.a != own_rows ? 1u : 0u;
  p.roles = plan.roles;
  // The gathered A's heap offset is part of the plan: peers write into it by their own offset.
  p.signature = signature(kOp, plan.tile, g,
                          {a.m, a.k, static_cast<int64_t>(a.dtype), static_cast<int64_t>(layout.rows_per_chunk),
                           static_cast<int64_t>(p.gathered_offset)});
  LOOM_DEBUG("ag_gemm multi-node M=%lld N=%lld K=%lld on %u x %u: tile %s, %d CTAs (%u send, %u receive, %u NVLink), %u rows "
             "per chunk",
             static_cast<long long>(a.m), static_cast<long long>(a.n), static_cast<long long>(a.k), g.nodes, g.local,
             std::string(gemm_tile_name(plan.tile)).c_str(), plan.grid, plan.roles.count(kmn::CtaRole::kNetSend),
             plan.roles.count(kmn::CtaRole::kNetRecv), plan.roles.count(kmn::CtaRole::kNvlink), layout.rows_per_chunk);
  LOOM_ASSIGN_OR_RETURN(const FusedKernel<kmn::AgParams> kernel,
                        fused_kernel<kmn::AgParams>(plan.tile, a.dtype, a.b_layout, KernelOf{}));
  return launch_kernel(kernel.fn, static_cast<unsigned>(plan.grid), kernel.threads, kernel.smem_bytes, stream, p);
}

constexpr TpOperator kOperator{kOp, kFamily, plan_ag, check_buffers, launch};

}  // namespace

const TpOperator& ag_gemm_operator() { return kOperator; }

Status load_ag_gemm_kernels() {
  return for_each_fused_kernel<kmn::AgParams>(KernelOf{}, [](const FusedKernel<kmn::AgParams>& k) {
    return prepare_kernel(reinterpret_cast<const void*>(k.fn), k.smem_bytes);
  });
}

}  // namespace loom::ops::tp::multinode
