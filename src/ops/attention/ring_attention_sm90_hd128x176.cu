// The ring attention kernels of configuration Flash128x176 (ops/attention/flash_launch.h).
#include "kernels/attention/sm90_ring_attention.cuh"
#include "ops/attention/flash_launch.h"
#include "ops/launch/kernel_launch.h"

namespace loom::ops::attention {

Status launch_ring_128x176(const kernels::attention::RingParams& p, bool bf16, bool causal, int grid, cudaStream_t stream) {
  namespace ka = kernels::attention;
  using Cfg = ka::Flash128x176;
  auto* kernel = bf16 ? (causal ? &ka::sm90_ring_attention_kernel<Cfg, true, true> : &ka::sm90_ring_attention_kernel<Cfg, true, false>)
                      : (causal ? &ka::sm90_ring_attention_kernel<Cfg, false, true>
                                : &ka::sm90_ring_attention_kernel<Cfg, false, false>);
  return launch_kernel(kernel, static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream, p);
}

}  // namespace loom::ops::attention
