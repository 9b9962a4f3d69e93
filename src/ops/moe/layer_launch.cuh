// Instantiates moe_layer's kernel (kernels/moe/layer.cuh) for one tile configuration, bf16 and
// fp16. Included by exactly one layer_sm90_<tile>.cu each (the instantiations are heavy).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/moe/layer.cuh"
#include "loom/status.h"
#include "ops/launch/kernel_launch.h"

namespace loom::ops::detail {

template <class Cfg>
Status launch_layer_config(const kernels::moe::LayerParams& params, bool bf16, int grid, cudaStream_t stream) {
  const auto kernel = bf16 ? &kernels::moe::moe_layer_kernel<Cfg, true> : &kernels::moe::moe_layer_kernel<Cfg, false>;
  return launch_kernel(kernel, static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream, params);
}

template <class Cfg>
Status load_layer_config() {
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(&kernels::moe::moe_layer_kernel<Cfg, true>), Cfg::kSmemBytes));
  return prepare_kernel(reinterpret_cast<const void*>(&kernels::moe::moe_layer_kernel<Cfg, false>), Cfg::kSmemBytes);
}

// Defined in layer_sm90_<tile>.cu (the tiles of planner::kDispatchGemmTiles).
Status load_sm90_moe_layer_128x256();
Status load_sm90_moe_layer_128x128();
Status launch_sm90_moe_layer_128x256(const kernels::moe::LayerParams&, bool bf16, int grid, cudaStream_t);
Status launch_sm90_moe_layer_128x128(const kernels::moe::LayerParams&, bool bf16, int grid, cudaStream_t);

}  // namespace loom::ops::detail
