// Instantiates the attention kernel for one configuration (bf16/fp16 x causal) and launches the
// variant a call needs. Included by exactly one attention_sm90_hd<D>.cu each; launch_variant also
// serves the ring attention kernel's instances (ring_instance.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/attention/sm90_flash_fwd.cuh"
#include "loom/status.h"
#include "ops/launch/kernel_launch.h"

namespace loom::ops::attention {

// kernel_of.template operator()<kBF16, kCausal>() is the kernel of one variant of Cfg.
template <class Cfg, class Params, class KernelOf>
Status launch_variant(const KernelOf& kernel_of, const Params& p, bool bf16, bool causal, int grid, cudaStream_t stream) {
  auto* kernel = bf16 ? (causal ? kernel_of.template operator()<true, true>() : kernel_of.template operator()<true, false>())
                      : (causal ? kernel_of.template operator()<false, true>() : kernel_of.template operator()<false, false>());
  return launch_kernel(kernel, static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream, p);
}

// A struct, not a template lambda: nvcc warns that a template lambda's conversion to a function
// pointer does not use its template parameters.
template <class Cfg>
struct FlashKernelOf {
  template <bool kBF16, bool kCausal>
  auto operator()() const {
    return &kernels::attention::sm90_flash_fwd_kernel<Cfg, kBF16, kCausal>;
  }
};

template <class Cfg>
Status launch_flash(const kernels::attention::FlashParams& p, bool bf16, bool causal, int grid, cudaStream_t stream) {
  return launch_variant<Cfg>(FlashKernelOf<Cfg>{}, p, bf16, causal, grid, stream);
}

}  // namespace loom::ops::attention
