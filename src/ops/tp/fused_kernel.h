// The configurations the tensor-parallel kernels are built for (128x256 and 128x128 tiles x bf16 /
// fp16 x B layout) and the dispatch from a call's to its kernel. For the .cu files that
// instantiate kernels (each operator's own, so no translation unit takes long on 2 cores).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/gemm/config.h"
#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/types.h"

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

}  // namespace loom::ops::tp
