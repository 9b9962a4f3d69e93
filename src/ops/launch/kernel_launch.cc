#include "ops/launch/kernel_launch.h"

#include <mutex>
#include <set>
#include <tuple>
#include <utility>

namespace loom::ops {

Status load_once_per_device(Status (*load)()) {
  static std::mutex mu;
  static std::set<std::pair<Status (*)(), int>> done;  // (load, device) already run
  int device = 0;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({load, device}) != 0) return {};
  LOOM_TRY(load());
  done.insert({load, device});
  return {};
}

Status prepare_kernel(const void* kernel, size_t smem_bytes) {
  static std::mutex mu;
  static std::set<std::tuple<const void*, int, size_t>> done;  // (kernel, device, bytes) already set
  int device = 0;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({kernel, device, smem_bytes}) != 0) return {};
  // Up to 48 KiB of dynamic shared memory needs no opt-in; the query still loads the kernel.
  constexpr size_t kWithoutOptIn = size_t{48} << 10;
  if (smem_bytes > kWithoutOptIn) {
    LOOM_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  } else {
    cudaFuncAttributes attributes{};
    LOOM_CUDA_TRY(cudaFuncGetAttributes(&attributes, kernel));
  }
  done.insert({kernel, device, smem_bytes});
  return {};
}

}  // namespace loom::ops
