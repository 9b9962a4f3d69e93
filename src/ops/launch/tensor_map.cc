#include "ops/launch/tensor_map.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>
#include <string>

#include "runtime/cuda_check.h"

namespace loom::ops {

namespace {

using EncodeTiled = PFN_cuTensorMapEncodeTiled_v12000;

Result<EncodeTiled> encode_tiled() {
  static std::once_flag once;
  static EncodeTiled fn = nullptr;
  static Status status;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    if (err != cudaSuccess) {
      status = cuda_status(err, "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)", __FILE__, __LINE__);
    } else if (q != cudaDriverEntryPointSuccess || p == nullptr) {
      status = Status::unsupported("the CUDA driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12.0+)");
    } else {
      fn = reinterpret_cast<EncodeTiled>(p);
    }
  });
  if (fn == nullptr) return status;
  return fn;
}

CUtensorMapDataType tma_type(DType t) {
  switch (t) {
    case DType::kBF16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case DType::kF16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case DType::kF32: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  }
  return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}

}  // namespace

Status encode_tensor_map(const void* ptr, DType dtype, int rank, const uint64_t* dims, const uint64_t* strides_bytes,
                         const uint32_t* box, kernels::sm90::TmaDescriptor* out, const char* what) {
  if (rank < 1 || rank > 5) return Status::internal(std::string("encode_tensor_map: rank must be 1..5 for ") + what);
  LOOM_ASSIGN_OR_RETURN(EncodeTiled fn, encode_tiled());
  cuuint64_t d[5] = {}, s[4] = {};
  cuuint32_t b[5] = {}, elem_strides[5] = {1, 1, 1, 1, 1};
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    if (i > 0) s[i - 1] = strides_bytes[i - 1];
  }
  CUtensorMap map;
  const CUresult r = fn(&map, tma_type(dtype), static_cast<cuuint32_t>(rank), const_cast<void*>(ptr), d, s, b,
                        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::string shape;
    for (int i = 0; i < rank; ++i) {
      shape += (i ? " x " : "") + std::to_string(dims[i]);
      if (i > 0) shape += " (stride " + std::to_string(strides_bytes[i - 1]) + " B)";
    }
    return Status::internal(std::string("cuTensorMapEncodeTiled failed for ") + what + " (CUresult " +
                            std::to_string(static_cast<int>(r)) + ", dims " + shape + ")");
  }
  static_assert(sizeof(CUtensorMap) == sizeof(kernels::sm90::TmaDescriptor), "TmaDescriptor must mirror CUtensorMap");
  static_assert(alignof(kernels::sm90::TmaDescriptor) >= 64, "TMA needs 64-byte aligned tensor maps");
  std::memcpy(out, &map, sizeof map);
  return Status{};
}

}  // namespace loom::ops
