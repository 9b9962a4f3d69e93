// The ring attention kernel's variants (bf16/fp16 x causal) for launch_variant (flash_instance.cuh).
// Included by exactly one ring_attention_sm90_hd<D>.cu each, which instantiates one configuration.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/attention/sm90_ring_attention.cuh"
#include "loom/status.h"
#include "ops/attention/flash_instance.cuh"

namespace loom::ops::attention {

struct RingKernels {
  template <class Cfg, bool kBF16, bool kCausal>
  static constexpr auto of = &kernels::attention::sm90_ring_attention_kernel<Cfg, kBF16, kCausal>;
};

}  // namespace loom::ops::attention
