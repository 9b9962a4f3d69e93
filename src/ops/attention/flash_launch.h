// The attention engine's kernel instances, one translation unit per configuration
// (attention_sm90_hd<D>x<BLOCK_N>[_m<BLOCK_M>].cu: bf16/fp16 x causal/non-causal each), so that no
// file takes long to compile on a 2-core machine. launch_flash() picks the one for (head dim,
// BLOCK_M, BLOCK_N).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <iterator>
#include <string>

#include "kernels/attention/params.h"
#include "loom/status.h"
#include "planner/attention_plan.h"

namespace loom::ops::attention {

#define LOOM_FLASH_INSTANCE(cfg)                                                                     \
  Status launch_flash_##cfg(const kernels::attention::FlashParams& p, bool bf16, bool causal, int grid, \
                            cudaStream_t stream);
LOOM_FLASH_INSTANCE(64x128)
LOOM_FLASH_INSTANCE(64x128_m192)
LOOM_FLASH_INSTANCE(64x192)
LOOM_FLASH_INSTANCE(128x128)
LOOM_FLASH_INSTANCE(128x176)
LOOM_FLASH_INSTANCE(256x64)
LOOM_FLASH_INSTANCE(256x80)
#undef LOOM_FLASH_INSTANCE

// Ring attention (sm90_ring_attention.cuh): the planner's default configuration per head dim only.
#define LOOM_RING_INSTANCE(cfg)                                                                     \
  Status launch_ring_##cfg(const kernels::attention::RingParams& p, bool bf16, bool causal, int grid, \
                           cudaStream_t stream);                                                      \
  Status load_ring_##cfg();
LOOM_RING_INSTANCE(64x128)
LOOM_RING_INSTANCE(64x192)
LOOM_RING_INSTANCE(128x176)
LOOM_RING_INSTANCE(256x80)
#undef LOOM_RING_INSTANCE

// A built kernel configuration: its head dim, BLOCK_M, BLOCK_N and launcher.
template <class Params>
struct KernelInstance {
  int head_dim;
  int block_m;
  int block_n;
  Status (*launch)(const Params& p, bool bf16, bool causal, int grid, cudaStream_t stream);
};

// The launcher `instances` has for (head_dim, block_m, block_n); null when that configuration is
// not built.
template <class Params, size_t N>
auto find_instance(const KernelInstance<Params> (&instances)[N], int head_dim, int block_m, int block_n) {
  for (const KernelInstance<Params>& instance : instances) {
    if (instance.head_dim == head_dim && instance.block_m == block_m && instance.block_n == block_n) {
      return instance.launch;
    }
  }
  return decltype(instances[0].launch){nullptr};
}

inline constexpr KernelInstance<kernels::attention::RingParams> kRingInstances[] = {
    {64, 128, 128, launch_ring_64x128}, {64, 128, 192, launch_ring_64x192},
    {128, 128, 176, launch_ring_128x176}, {256, 128, 80, launch_ring_256x80}};

constexpr bool ring_instances_match_planner() {
  if (std::size(kRingInstances) != std::size(planner::kRingTiles)) return false;
  for (size_t i = 0; i < std::size(kRingInstances); ++i) {
    if (kRingInstances[i].head_dim != planner::kRingTiles[i].head_dim ||
        kRingInstances[i].block_m != 128 || kRingInstances[i].block_n != planner::kRingTiles[i].block_n) {
      return false;
    }
  }
  return true;
}
static_assert(ring_instances_match_planner(),
              "kRingInstances must list exactly planner::kRingTiles, in order: validation refuses what is not built");

inline constexpr KernelInstance<kernels::attention::FlashParams> kFlashInstances[] = {
    {64, 128, 128, launch_flash_64x128},   {64, 192, 128, launch_flash_64x128_m192},
    {64, 128, 192, launch_flash_64x192},   {128, 128, 128, launch_flash_128x128},
    {128, 128, 176, launch_flash_128x176}, {256, 128, 64, launch_flash_256x64},
    {256, 128, 80, launch_flash_256x80}};

inline Status launch_ring(const kernels::attention::RingParams& p, int head_dim, int block_n, bool bf16, bool causal,
                          int grid, cudaStream_t stream) {
  if (const auto launch = find_instance(kRingInstances, head_dim, 128, block_n)) {
    return launch(p, bf16, causal, grid, stream);
  }
  // validate_ring_attention refuses every other pair first (planner::kRingTiles).
  return Status::internal("ring_attention: no kernel for head dim " + std::to_string(head_dim) + " and BLOCK_N " +
                          std::to_string(block_n));
}

inline Status launch_flash(const kernels::attention::FlashParams& p, int head_dim, int block_m, int block_n, bool bf16,
                           bool causal, int grid, cudaStream_t stream) {
  if (const auto launch = find_instance(kFlashInstances, head_dim, block_m, block_n)) {
    return launch(p, bf16, causal, grid, stream);
  }
  return Status::internal("attention: no kernel for head dim " + std::to_string(head_dim) + ", BLOCK_M " +
                          std::to_string(block_m) + " and BLOCK_N " + std::to_string(block_n));
}

}  // namespace loom::ops::attention
