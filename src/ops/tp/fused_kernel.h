// The configurations the tensor-parallel kernels are built for (128x256 and 128x128 tiles x bf16 /
// fp16 x B layout) and the dispatch from a call's to its kernel, and the parameters every
// ag_gemm kernel (one node or several) fills alike. For the .cu files that instantiate kernels
// (each operator's own, so no translation unit takes long on 2 cores).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/gemm/config.h"
#include "kernels/gemm/params.h"
#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/types.h"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/family_resources.h"
#include "ops/tp/tp_common.h"

namespace loom::ops::tp {

// A persistent kernel with its launch shape.
template <class Params>
struct FusedKernel {
  void (*fn)(Params) = nullptr;
  unsigned threads = 0;
  uint32_t smem_bytes = 0;
};

// kernel_of.template operator()<Cfg, kBF16, kBNMajor>() for the configuration of (tile, dtype,
// layout): a kernel function of that configuration. kernel_of: an object whose operator() is a
// template over <class Cfg, bool kBF16, bool kBNMajor> returning &kernel<Cfg, kBF16, kBNMajor>.
template <class Params, class KernelOf>
Result<FusedKernel<Params>> fused_kernel(GemmTile tile, DType dtype, BLayout layout, KernelOf&& kernel_of) {
  namespace kg = kernels::gemm;
  auto with = [&]<class Cfg>() -> FusedKernel<Params> {
    FusedKernel<Params> k;
    const bool n_major = layout == BLayout::kKN;
    if (dtype == DType::kBF16) {
      k.fn = n_major ? kernel_of.template operator()<Cfg, true, true>() : kernel_of.template operator()<Cfg, true, false>();
    } else {
      k.fn = n_major ? kernel_of.template operator()<Cfg, false, true>() : kernel_of.template operator()<Cfg, false, false>();
    }
    k.threads = Cfg::kThreads;
    k.smem_bytes = Cfg::kSmemBytes;
    return k;
  };
  switch (tile) {
    case GemmTile::k128x256: return with.template operator()<kg::Tile128x256>();
    case GemmTile::k128x128: return with.template operator()<kg::Tile128x128>();
    default: break;
  }
  return Status::internal("tensor-parallel dispatch: no fused kernel for tile " + std::string(gemm_tile_name(tile)));
}

// fn(kernel) for every configuration's kernel (kernel_of as above): loading them all at once.
template <class Params, class KernelOf, class Fn>
Status for_each_fused_kernel(KernelOf&& kernel_of, Fn&& fn) {
  for (GemmTile tile : {GemmTile::k128x256, GemmTile::k128x128}) {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      for (BLayout layout : {BLayout::kKN, BLayout::kNK}) {
        LOOM_ASSIGN_OR_RETURN(const FusedKernel<Params> k, fused_kernel<Params>(tile, dtype, layout, kernel_of));
        LOOM_TRY(fn(k));
      }
    }
  }
  return {};
}

// What every ag_gemm kernel's parameters p (kernels::tp::AgGemmParams,
// kernels::tp::multinode::AgParams) hold alike: the tensor maps of the gathered A and B (tile),
// of this rank's shard a [rows, K] and of out [M, N]; the communicator, the family's launch state,
// the shape, the epilogue's plain store of out, and the shard and gathered A the copies move
// between (the gathered A's heap offset: peers push into it by their own offset).
template <class Params>
Status set_ag_operands(Communicator::Impl& impl, std::string_view family, const TpGemmArgs& a, void* gathered, int64_t rows,
                       GemmTile tile, Params* p) {
  LOOM_TRY(encode_gemm_operand_maps(local_gemm(gathered, a.b, a.out, a.m, a), tile, &p->a_gathered, &p->b));
  LOOM_TRY(encode_gemm_rows_map(a.a, rows, a.k, a.k, a.dtype, gemm_tile_info(tile).block_m, &p->a_local));
  LOOM_TRY(encode_gemm_output_map(a.out, a.m, a.n, a.n, a.dtype, &p->out));
  p->comm = impl.device_comm();
  LOOM_ASSIGN_OR_RETURN(p->state, family_launch_state(impl, family));
  p->m = static_cast<uint32_t>(a.m);
  p->n = static_cast<uint32_t>(a.n);
  p->k = static_cast<uint32_t>(a.k);
  p->epi.op = static_cast<uint32_t>(kernels::gemm::EpilogueOp::kStore);
  p->epi.out_dtype = static_cast<uint32_t>(a.dtype);
  p->epi.num_dst = 1;
  p->shard = static_cast<const char*>(a.a);
  p->gathered_offset = impl.heap->offset_of(gathered);
  p->row_bytes = static_cast<uint64_t>(a.k) * dtype_size(a.dtype);
  return {};
}

}  // namespace loom::ops::tp
