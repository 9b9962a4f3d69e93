// CUDA driver API entry points, fetched at run time.
//
// libloom links only the CUDA runtime; the driver functions it needs (cuMem* virtual memory
// management and a few queries) come from cudaGetDriverEntryPointByVersion, so the library loads
// on machines without libcuda and reports "no driver" as a Status instead of failing to load.
// Each entry is requested at the CUDA version whose ABI its PFN typedef names (the _vNNNNN
// suffix), so the signature we call through stays right on every newer driver.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "loom/status.h"

namespace loom::runtime {

// Member names are the driver functions' names, so call sites read like driver code.
struct CudaDriver {
  PFN_cuGetErrorName_v6000 cuGetErrorName = nullptr;
  PFN_cuGetErrorString_v6000 cuGetErrorString = nullptr;
  PFN_cuDeviceGet_v2000 cuDeviceGet = nullptr;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity = nullptr;
  PFN_cuMemCreate_v10020 cuMemCreate = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle = nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;
};

// The table, loaded on first use (thread-safe). Without a driver, or with one that lacks an
// entry, every call returns the same error: cuda_error from the runtime (e.g. no driver
// installed) or unsupported naming the missing function.
Result<const CudaDriver*> cuda_driver();

// "cuMemCreate(&handle, bytes, &prop, 0): out of memory (CUDA_ERROR_OUT_OF_MEMORY) at
// symmetric_heap.cc:42": the failed call, the CUresult's string and name, and where.
Status cu_status(CUresult result, const char* expr, const char* file, int line);

// The driver allocation that holds a device pointer: its range, and whether it is one cudaMalloc
// allocation (legacy IPC capable) rather than a virtual memory mapping (cuMem*, PyTorch's
// expandable segments) or a stream-ordered pool, whose buffers may span several driver ranges.
struct DeviceAllocation {
  uint64_t base = 0;
  uint64_t bytes = 0;
  bool legacy = false;
};
// invalid_argument when `ptr` is not device memory the driver knows; unsupported without
// cuPointerGetAttributes.
Result<DeviceAllocation> device_allocation_of(const void* ptr);

// An entry point outside the table, for a feature loom can do without: looked up once by the
// caller at the ABI version `cuda_version` its PFN typedef names; null when the driver lacks it.
void* optional_driver_entry_address(const char* symbol, unsigned int cuda_version);
template <typename Function>
Function optional_driver_entry(const char* symbol, unsigned int cuda_version) {
  return reinterpret_cast<Function>(optional_driver_entry_address(symbol, cuda_version));
}

}  // namespace loom::runtime

// Evaluates a driver call made through the CudaDriver table; on failure returns a cuda_error
// Status naming the call and the CUresult.
#define LOOM_CU_TRY(expr)                                                                         \
  do {                                                                                            \
    const CUresult loom_cu_result_ = (expr);                                                      \
    if (loom_cu_result_ != CUDA_SUCCESS) {                                                        \
      return ::loom::runtime::cu_status(loom_cu_result_, #expr, __FILE__, __LINE__);             \
    }                                                                                             \
  } while (0)
