// Instantiates the grouped GEMM kernel for one tile configuration (bf16 / fp16 x B [E, N, K] /
// [E, K, N] x plain / SwiGLU epilogue) and launches the variant a call needs; moe_dispatch_gemm's
// kernels (ops/moe/dispatch_gemm_launch.cuh) go through the same variant table.
// Included by exactly one grouped_gemm_sm90_<tile>.cu each, so the heavy instantiations are
// spread over several translation units (CI compiles on 2 cores).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <string>

#include "kernels/moe/grouped_gemm.cuh"
#include "loom/status.h"
#include "ops/launch/kernel_launch.h"
#include "planner/moe_plan.h"

namespace loom::ops {

// A grouped GEMM call's launch, up to its GEMM kernel (ops/moe/grouped_gemm.cu): the tensor maps
// and the rest of the kernel's parameters but `wait` filled in from args and plan, and the plan
// kernel (counts or offsets -> the tile table in args.workspace) queued on `stream`.
Status prepare_grouped_gemm(const GroupedGemmArgs& args, const planner::GroupedGemmPlan& plan, cudaStream_t stream,
                            kernels::moe::GroupedGemmKernelParams& p);
// The same parameters without the plan kernel (a second GEMM on a tile table already planned).
Status encode_grouped_gemm(const GroupedGemmArgs& args, const planner::GroupedGemmPlan& plan,
                           kernels::moe::GroupedGemmKernelParams& p);
// Loads the grouped GEMM's kernels (its plan kernel and every tile's variants) now: see
// ops/moe/moe_launch.h, load_moe_kernels.
Status load_grouped_gemm_kernels();

}  // namespace loom::ops

namespace loom::ops::detail {

// Which kernel of a configuration a call needs.
struct GroupedVariant {
  bool bf16;     // A and B bf16 (else fp16)
  bool n_major;  // B is [E, K, N] (BLayout::kKN) rather than [E, N, K]
  bool swiglu;   // the SwiGLU epilogue (GroupedActivation::kSwiGLU)
};

// The eight kernels of one configuration (bf16 / fp16 x B layout x plain / SwiGLU) of a kernel
// template over them, `Kernel<Cfg, kBF16, kBNMajor, kGated>::value`, and the launch of the one a
// call needs. The SwiGLU epilogue needs BLOCK_N >= 128 (planner::kSwiGluMinBlockN): no such
// kernels below it.
template <class Cfg, template <class, bool, bool, bool> class Kernel, class Params>
Status launch_grouped_variant(const Params& params, const GroupedVariant& v, int grid, cudaStream_t stream,
                              const char* op) {
  using Fn = void (*)(Params);
  constexpr bool kGated = Cfg::kBlockN >= 128;
  constexpr std::array<Fn, 4> kPlain{Kernel<Cfg, true, false, false>::value, Kernel<Cfg, true, true, false>::value,
                                     Kernel<Cfg, false, false, false>::value, Kernel<Cfg, false, true, false>::value};
  const size_t index = (v.bf16 ? 0 : 2) + (v.n_major ? 1 : 0);
  Fn kernel = kPlain[index];
  if (v.swiglu) {
    if constexpr (kGated) {
      constexpr std::array<Fn, 4> kSwiGlu{Kernel<Cfg, true, false, true>::value, Kernel<Cfg, true, true, true>::value,
                                          Kernel<Cfg, false, false, true>::value, Kernel<Cfg, false, true, true>::value};
      kernel = kSwiGlu[index];
    } else {
      return Status::internal(std::string(op) + ": no SwiGLU kernel for BLOCK_N " + std::to_string(Cfg::kBlockN));
    }
  }
  return launch_kernel(kernel, static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream, params);
}

// Loads every variant of one configuration now (ops/moe/moe_launch.h, load_moe_kernels, says why).
template <class Cfg, template <class, bool, bool, bool> class Kernel>
Status load_grouped_variants() {
  constexpr bool kGated = Cfg::kBlockN >= 128;
  const void* kernels[] = {
      reinterpret_cast<const void*>(Kernel<Cfg, true, false, false>::value),
      reinterpret_cast<const void*>(Kernel<Cfg, true, true, false>::value),
      reinterpret_cast<const void*>(Kernel<Cfg, false, false, false>::value),
      reinterpret_cast<const void*>(Kernel<Cfg, false, true, false>::value),
      kGated ? reinterpret_cast<const void*>(Kernel<Cfg, true, false, kGated>::value) : nullptr,
      kGated ? reinterpret_cast<const void*>(Kernel<Cfg, true, true, kGated>::value) : nullptr,
      kGated ? reinterpret_cast<const void*>(Kernel<Cfg, false, false, kGated>::value) : nullptr,
      kGated ? reinterpret_cast<const void*>(Kernel<Cfg, false, true, kGated>::value) : nullptr};
  for (const void* k : kernels) {
    if (k != nullptr) LOOM_TRY(prepare_kernel(k, Cfg::kSmemBytes));
  }
  return {};
}

template <class Cfg, bool kBF16, bool kBNMajor, bool kGated>
struct GroupedGemmKernel {
  static constexpr auto value = &kernels::moe::sm90_grouped_gemm_kernel<Cfg, kBF16, kBNMajor, kGated>;
};

template <class Cfg>
Status launch_grouped_config(const kernels::moe::GroupedGemmKernelParams& params, const GroupedVariant& v, int grid,
                             cudaStream_t stream) {
  return launch_grouped_variant<Cfg, GroupedGemmKernel>(params, v, grid, stream, "grouped_gemm");
}

// Defined in grouped_gemm_sm90_<tile>.cu, with a loader of that tile's variants each.
Status load_sm90_grouped_gemm_128x256();
Status load_sm90_grouped_gemm_128x128();
Status load_sm90_grouped_gemm_128x64();
Status load_sm90_grouped_gemm_64x128();
Status launch_sm90_grouped_gemm_128x256(const kernels::moe::GroupedGemmKernelParams&, const GroupedVariant&, int, cudaStream_t);
Status launch_sm90_grouped_gemm_128x128(const kernels::moe::GroupedGemmKernelParams&, const GroupedVariant&, int, cudaStream_t);
Status launch_sm90_grouped_gemm_128x64(const kernels::moe::GroupedGemmKernelParams&, const GroupedVariant&, int, cudaStream_t);
Status launch_sm90_grouped_gemm_64x128(const kernels::moe::GroupedGemmKernelParams&, const GroupedVariant&, int, cudaStream_t);

}  // namespace loom::ops::detail
