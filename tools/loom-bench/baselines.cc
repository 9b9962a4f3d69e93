#include "baselines.h"

#include <cuda_fp16.h>

#include <cstring>
#include <string>

namespace loom::bench {

Status cublas_status(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status{};
  return Status::cuda_error(std::string(what) + " failed: cuBLAS status " + std::to_string(static_cast<int>(s)));
}

cudaDataType_t cuda_type(DType t) {
  return t == DType::kBF16 ? CUDA_R_16BF : (t == DType::kF16 ? CUDA_R_16F : CUDA_R_32F);
}

ncclDataType_t nccl_type(DType t) {
  return t == DType::kBF16 ? ncclBfloat16 : (t == DType::kF16 ? ncclFloat16 : ncclFloat32);
}

Status cublas_gemm(cublasHandle_t h, const void* a, const void* b, void* d, int64_t m, int64_t n, int64_t k,
                   BLayout layout, DType in_dtype, DType out_dtype) {
  const float alpha = 1.0f, beta = 0.0f;
  const bool kn = layout == BLayout::kKN;
  return cublas_status(cublasGemmEx(h, kn ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                    static_cast<int>(m), static_cast<int>(k), &alpha, b, cuda_type(in_dtype),
                                    static_cast<int>(kn ? n : k), a, cuda_type(in_dtype), static_cast<int>(k), &beta, d,
                                    cuda_type(out_dtype), static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                       "cublasGemmEx");
}

float host_value(const void* data, size_t i, DType t) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  if (t == DType::kF32) {
    float v;
    std::memcpy(&v, bytes + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, bytes + 2 * i, 2);
  if (t == DType::kBF16) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}

}  // namespace loom::bench
