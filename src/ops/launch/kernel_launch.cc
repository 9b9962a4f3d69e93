#include "ops/launch/kernel_launch.h"

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

namespace loom::ops {

struct LoadedDevices {
  std::mutex mu;
  std::set<int> devices;
};

LoadedDevices& loaded_devices_of(const char* family) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<LoadedDevices>> families;
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<LoadedDevices>& d = families[family];
  if (!d) d = std::make_unique<LoadedDevices>();
  return *d;
}

Status load_once_per_device(LoadedDevices& done, Status (*load)()) {
  int device = 0;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(done.mu);
  if (done.devices.count(device) != 0) return {};
  LOOM_TRY(load());
  done.devices.insert(device);
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
