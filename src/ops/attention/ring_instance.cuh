// Instantiates the ring attention kernel for one configuration (bf16/fp16 x causal) and launches
// the variant a call needs. Included by exactly one ring_attention_sm90_hd<D>.cu each.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/attention/sm90_ring_attention.cuh"
#include "loom/status.h"
#include "ops/attention/flash_instance.cuh"

namespace loom::ops::attention {

template <class Cfg>
struct RingKernelOf {
  template <bool kBF16, bool kCausal>
  auto operator()() const {
    return &kernels::attention::sm90_ring_attention_kernel<Cfg, kBF16, kCausal>;
  }
};

template <class Cfg>
Status launch_ring_instance(const kernels::attention::RingParams& p, bool bf16, bool causal, int grid, cudaStream_t stream) {
  return launch_variant<Cfg>(RingKernelOf<Cfg>{}, p, bf16, causal, grid, stream);
}

}  // namespace loom::ops::attention
