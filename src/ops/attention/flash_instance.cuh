// Instantiates the attention kernel for one configuration (bf16/fp16 x causal) and launches the
// variant a call needs. Included by exactly one attention_sm90_hd<D>.cu each; launch_variant also
// serves the ring attention kernel's instances (ring_instance.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <array>

#include "kernels/attention/sm90_flash_fwd.cuh"
#include "loom/status.h"
#include "ops/launch/kernel_launch.h"

namespace loom::ops::attention {

// Launches the variant of one configuration's kernel a call needs. `Kernels::of<Cfg, kBF16,
// kCausal>` is the kernel of a variant (a struct per kernel family: a function template cannot be
// a template argument).
template <class Cfg, class Kernels, class Params>
Status launch_variant(const Params& p, bool bf16, bool causal, int grid, cudaStream_t stream) {
  constexpr std::array<void (*)(Params), 4> kVariants{
      Kernels::template of<Cfg, true, true>, Kernels::template of<Cfg, true, false>,
      Kernels::template of<Cfg, false, true>, Kernels::template of<Cfg, false, false>};
  const size_t variant = (bf16 ? 0 : 2) + (causal ? 0 : 1);
  return launch_kernel(kVariants[variant], static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream, p);
}

// Loads every variant of one configuration now (the ring across nodes must not load a kernel
// behind a running one: ops/launch/kernel_launch.h, load_once_per_device).
template <class Cfg, class Kernels>
Status load_variants() {
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(Kernels::template of<Cfg, true, true>), Cfg::kSmemBytes));
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(Kernels::template of<Cfg, true, false>), Cfg::kSmemBytes));
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(Kernels::template of<Cfg, false, true>), Cfg::kSmemBytes));
  return prepare_kernel(reinterpret_cast<const void*>(Kernels::template of<Cfg, false, false>), Cfg::kSmemBytes);
}

struct FlashKernels {
  template <class Cfg, bool kBF16, bool kCausal>
  static constexpr auto of = &kernels::attention::sm90_flash_fwd_kernel<Cfg, kBF16, kCausal>;
};

}  // namespace loom::ops::attention
