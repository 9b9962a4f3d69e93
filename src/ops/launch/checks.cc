#include "ops/launch/checks.h"

#include <cuda_runtime_api.h>

#include <string>

#include "runtime/cuda_check.h"

namespace loom::ops {

ByteRange bytes_of(const void* p, int64_t rows, int64_t cols, size_t elem) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  return {lo, lo + static_cast<uintptr_t>(rows) * static_cast<uintptr_t>(cols) * elem};
}

Status check_optional_tma_pointer(std::string_view op, NamedPointer p) {
  if (reinterpret_cast<uintptr_t>(p.ptr) % 16 != 0) {
    return Status::invalid_argument(std::string(op) + ": " + p.what +
                                    " is not 16-byte aligned (TMA needs 16-byte aligned rows)");
  }
  return {};
}

Status check_tma_pointers(std::string_view op, std::initializer_list<NamedPointer> required) {
  for (const NamedPointer& p : required) {
    if (p.ptr == nullptr) return Status::invalid_argument(std::string(op) + ": " + p.what + " is null");
    LOOM_TRY(check_optional_tma_pointer(op, p));
  }
  return {};
}

Status check_disjoint(std::string_view op, const ByteRange& x, const char* x_name, const ByteRange& y, const char* y_name) {
  if (!x.overlaps(y)) return {};
  return Status::invalid_argument(std::string(op) + ": " + x_name + " overlaps " + y_name);
}

Result<HopperDevice> current_hopper_device(std::string_view op, std::string_view engine) {
  HopperDevice d;
  LOOM_CUDA_TRY(cudaGetDevice(&d.device));
  int major = 0, minor = 0;
  LOOM_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d.device));
  LOOM_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d.device));
  if (major != 9 || minor != 0) {
    return Status::unsupported(std::string(op) + ": " + std::string(engine) + " needs a Hopper GPU (sm_90); device " +
                               std::to_string(d.device) + " is sm_" + std::to_string(major * 10 + minor));
  }
  int value = 0;
  LOOM_CUDA_TRY(cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, d.device));
  LOOM_CUDA_TRY(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, d.device));
  d.smem_per_block_optin = value;
  LOOM_CUDA_TRY(cudaDeviceGetAttribute(&value, cudaDevAttrL2CacheSize, d.device));
  d.l2_bytes = value;
  return d;
}

}  // namespace loom::ops
