// Instantiates the attention kernel for one configuration (bf16/fp16 x causal) and launches it.
// Included by exactly one attention_sm90_hd<D>.cu each.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/attention/sm90_flash_fwd.cuh"
#include "loom/status.h"
#include "ops/launch/kernel_launch.h"

namespace loom::ops::attention {

template <class Cfg>
Status launch_flash(const kernels::attention::FlashParams& p, bool bf16, bool causal, int grid, cudaStream_t stream) {
  namespace ka = kernels::attention;
  auto* kernel = bf16 ? (causal ? &ka::sm90_flash_fwd_kernel<Cfg, true, true> : &ka::sm90_flash_fwd_kernel<Cfg, true, false>)
                      : (causal ? &ka::sm90_flash_fwd_kernel<Cfg, false, true>
                                : &ka::sm90_flash_fwd_kernel<Cfg, false, false>);
  return launch_kernel(kernel, static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream, p);
}

}  // namespace loom::ops::attention
