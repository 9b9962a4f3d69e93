#include "runtime/cuda_driver.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

namespace loom::runtime {
namespace {

// Looks up `symbol` at ABI version `cuda_version` and stores it into `*entry`.
template <typename Function>
Status load_entry(Function* entry, const char* symbol, unsigned int cuda_version) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &address, cuda_version, cudaEnableDefault, &found);
  if (err != cudaSuccess) {
    return Status::cuda_error(std::string("cudaGetDriverEntryPointByVersion(") + symbol + "): " +
                              cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")");
  }
  if (found != cudaDriverEntryPointSuccess || address == nullptr) {
    return Status::unsupported(std::string("the CUDA driver has no ") + symbol + " with the CUDA " +
                               std::to_string(cuda_version / 1000) + "." + std::to_string(cuda_version % 1000 / 10) +
                               " ABI loom calls; update the driver");
  }
  *entry = reinterpret_cast<Function>(address);
  return Status::ok_status();
}

Result<CudaDriver> load_cuda_driver() {
  CudaDriver d;
  LOOM_TRY(load_entry(&d.cuGetErrorName, "cuGetErrorName", 6000));
  LOOM_TRY(load_entry(&d.cuGetErrorString, "cuGetErrorString", 6000));
  LOOM_TRY(load_entry(&d.cuDeviceGet, "cuDeviceGet", 2000));
  LOOM_TRY(load_entry(&d.cuDeviceGetAttribute, "cuDeviceGetAttribute", 2000));
  LOOM_TRY(load_entry(&d.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", 10020));
  LOOM_TRY(load_entry(&d.cuMemCreate, "cuMemCreate", 10020));
  LOOM_TRY(load_entry(&d.cuMemRelease, "cuMemRelease", 10020));
  LOOM_TRY(load_entry(&d.cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 10020));
  LOOM_TRY(load_entry(&d.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", 10020));
  LOOM_TRY(load_entry(&d.cuMemAddressReserve, "cuMemAddressReserve", 10020));
  LOOM_TRY(load_entry(&d.cuMemAddressFree, "cuMemAddressFree", 10020));
  LOOM_TRY(load_entry(&d.cuMemMap, "cuMemMap", 10020));
  LOOM_TRY(load_entry(&d.cuMemUnmap, "cuMemUnmap", 10020));
  LOOM_TRY(load_entry(&d.cuMemSetAccess, "cuMemSetAccess", 10020));
  return d;
}

}  // namespace

Result<const CudaDriver*> cuda_driver() {
  // Loaded once; a failure is remembered, so every caller sees the same Status.
  static const Result<CudaDriver> table = load_cuda_driver();
  if (!table.ok()) return table.status();
  return &table.value();
}

Status cu_status(CUresult result, const char* expr, const char* file, int line) {
  const char* name = nullptr;
  const char* description = nullptr;
  // The table is loaded whenever a driver call produced `result`; the lookups are best effort.
  Result<const CudaDriver*> driver = cuda_driver();
  if (driver.ok()) {
    if ((*driver)->cuGetErrorName(result, &name) != CUDA_SUCCESS) name = nullptr;
    if ((*driver)->cuGetErrorString(result, &description) != CUDA_SUCCESS) description = nullptr;
  }
  const char* slash = std::strrchr(file, '/');
  std::string m(expr);
  m += ": ";
  m += description ? description : "unknown error";
  m += " (";
  m += name ? name : "CUresult " + std::to_string(static_cast<int>(result));
  m += ") at ";
  m += slash ? slash + 1 : file;
  m += ":";
  m += std::to_string(line);
  return Status::cuda_error(std::move(m));
}

Result<DeviceAllocation> device_allocation_of(const void* ptr) {
  static const auto get = optional_driver_entry<PFN_cuPointerGetAttributes_v7000>("cuPointerGetAttributes", 7000);
  if (get == nullptr) return Status::unsupported("the CUDA driver has no cuPointerGetAttributes");
  int legacy = 0;
  CUdeviceptr start = 0;
  size_t size = 0;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                      CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void* values[] = {&legacy, &start, &size};
  const CUresult rc = get(3, attributes, values, reinterpret_cast<CUdeviceptr>(ptr));
  if (rc != CUDA_SUCCESS || size == 0) {
    return Status::invalid_argument(std::to_string(reinterpret_cast<uint64_t>(ptr)) +
                                    " is not device memory the driver knows (cuPointerGetAttributes: CUresult " +
                                    std::to_string(static_cast<int>(rc)) + ")");
  }
  return DeviceAllocation{static_cast<uint64_t>(start), static_cast<uint64_t>(size), legacy != 0};
}

void* optional_driver_entry_address(const char* symbol, unsigned int cuda_version) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &address, cuda_version, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // clear the runtime's error, so the next CUDA call does not report it
    return nullptr;
  }
  return address;
}

}  // namespace loom::runtime
