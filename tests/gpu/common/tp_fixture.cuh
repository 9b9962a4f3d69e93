// What the GPU suites of the tensor-parallel operators share, one node (tp_ops_test.cu) or
// several (multinode_test.cu): device and symmetric buffers, the deterministic operands, the
// arguments and output of a call, and the fp32 reference GEMM.
//
// A suite's Shape provides: op, m, n, layout, dtype, k_rank(), a_rows(), a_bytes(), b_bytes(),
// out_bytes() and fill_rank() (the rank whose values this rank's operands hold).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/communicator.h"
#include "loom/tensor_parallel.h"
#include "tests/common/verifiable.cuh"
#include "tests/gpu/harness.h"

namespace loom::test::tp {

// ---- device memory ------------------------------------------------------------------------------

struct DeviceMem {
  void* p = nullptr;
  size_t bytes = 0;
  DeviceMem() = default;
  explicit DeviceMem(size_t n) : bytes(n) {
    if (cudaMalloc(&p, std::max<size_t>(n, 16)) != cudaSuccess) p = nullptr;
  }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  ~DeviceMem() {
    if (p) cudaFree(p);
  }
};

// Symmetric buffers, freed in reverse order of allocation (collective, same order on every rank).
struct SymmetricMem {
  Communicator& comm;
  std::vector<void*> owned;
  explicit SymmetricMem(Communicator& c) : comm(c) {}
  SymmetricMem(const SymmetricMem&) = delete;
  SymmetricMem& operator=(const SymmetricMem&) = delete;
  ~SymmetricMem() {
    for (auto it = owned.rbegin(); it != owned.rend(); ++it) (void)comm.free(*it);
  }
  void* alloc(size_t bytes) {
    Result<void*> p = comm.alloc(bytes);
    EXPECT_TRUE(p.ok()) << "rank " << process().rank << ": symmetric alloc of " << bytes << " B: " << p.status().to_string();
    if (!p.ok()) return nullptr;
    owned.push_back(*p);
    return *p;
  }
};

// ---- operands -----------------------------------------------------------------------------------

// rows x cols at `out` (leading dimension ld): element (r, c) is rank `rank`'s value r*cols + c, so
// a rank's packed operand and the same block inside a larger reference matrix hold equal values.
inline void fill_matrix(void* out, DType t, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, int rank,
                        cudaStream_t s = nullptr) {
  const unsigned grid = verify::grid_for(static_cast<uint64_t>(rows * cols));
  if (t == DType::kBF16) {
    verify::fill_matrix_kernel<<<grid, 256, 0, s>>>(static_cast<__nv_bfloat16*>(out), rows, cols, ld, seed, rank);
  } else {
    verify::fill_matrix_kernel<<<grid, 256, 0, s>>>(static_cast<__half*>(out), rows, cols, ld, seed, rank);
  }
}

inline void* at(void* p, int64_t elements, DType t) {
  return static_cast<char*>(p) + elements * static_cast<int64_t>(dtype_size(t));
}
inline uint64_t seed_a(uint64_t seed) { return seed * 16 + 1; }
inline uint64_t seed_b(uint64_t seed) { return seed * 16 + 2; }

// This rank's operands of `s`.
template <class Shape>
struct Inputs {
  DeviceMem a, b;
  Inputs(const Shape& s, uint64_t seed) : a(s.a_bytes()), b(s.b_bytes()) {
    const bool kn = s.layout == BLayout::kKN;
    if (a.p) fill_matrix(a.p, s.dtype, s.a_rows(), s.k_rank(), s.k_rank(), seed_a(seed), s.fill_rank());
    if (b.p) {
      fill_matrix(b.p, s.dtype, kn ? s.k_rank() : s.n, kn ? s.n : s.k_rank(), kn ? s.n : s.k_rank(), seed_b(seed), s.fill_rank());
    }
  }
  bool ok() const { return a.p != nullptr && b.p != nullptr; }
};

template <class Shape, class In>
TpGemmArgs args_for(const Shape& s, const In& in, void* out) {
  TpGemmArgs args;
  args.a = in.a.p;
  args.b = in.b.p;
  args.out = out;
  args.m = s.m;
  args.n = s.n;
  args.k = s.k_rank();
  args.dtype = s.dtype;
  args.b_layout = s.layout;
  return args;
}

// Output buffer of `s`: symmetric for gemm_ar (peers write their reduced rows into it).
struct Output {
  std::unique_ptr<DeviceMem> plain;
  void* p = nullptr;
  template <class Shape>
  Output(const Shape& s, SymmetricMem& sym) {
    if (s.op == OpId::kGemmAr) {
      p = sym.alloc(s.out_bytes());
    } else {
      plain = std::make_unique<DeviceMem>(s.out_bytes());
      p = plain->p;
    }
  }
};

inline Status launch(Communicator& comm, OpId op, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options = {}) {
  switch (op) {
    case OpId::kAgGemm: return ag_gemm(comm, args, stream, options);
    case OpId::kGemmRs: return gemm_rs(comm, args, stream, options);
    default: return gemm_ar(comm, args, stream, options);
  }
}

// ---- reference ----------------------------------------------------------------------------------

// C[i, j] = sum_k A[i, k] B(k, j) and bound[i, j] = sum_k |A[i, k]| |B(k, j)| in fp32, i < rows.
// B(k, j) is B[k * ldb + j] ([K, N]) or B[j * ldb + k] ([N, K]). 256 threads per 32 x 32 block.
template <typename T>
__global__ void __launch_bounds__(256) reference_kernel(const T* A, int64_t lda, const T* B, int64_t ldb, bool b_kn, int64_t rows,
                                                        int64_t N, int64_t K, float* C, float* bound) {
  __shared__ float as[32][33];
  __shared__ float bs[32][33];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int64_t row0 = blockIdx.y * int64_t{32}, col0 = blockIdx.x * int64_t{32};
  float acc[4] = {0, 0, 0, 0}, mag[4] = {0, 0, 0, 0};
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = ty + 8 * i;
      as[r][tx] = (row0 + r < rows && k0 + tx < K) ? verify::to_float(A[(row0 + r) * lda + k0 + tx]) : 0.f;
      if (b_kn) {
        bs[r][tx] = (k0 + r < K && col0 + tx < N) ? verify::to_float(B[(k0 + r) * ldb + col0 + tx]) : 0.f;
      } else {
        bs[tx][r] = (k0 + tx < K && col0 + r < N) ? verify::to_float(B[(col0 + r) * ldb + k0 + tx]) : 0.f;
      }
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < 32; ++kk) {
      const float b = bs[kk][tx];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float a = as[ty + 8 * i][kk];
        acc[i] = fmaf(a, b, acc[i]);
        mag[i] = fmaf(fabsf(a), fabsf(b), mag[i]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = row0 + ty + 8 * i;
    if (r < rows && col0 + tx < N) {
      C[r * N + col0 + tx] = acc[i];
      bound[r * N + col0 + tx] = mag[i];
    }
  }
}

// reference_kernel over `rows` rows of A (lda = K) and B, into c and bound ([rows, n] fp32);
// true when it ran (cudaDeviceSynchronize).
inline bool run_reference(const void* a_rows, const void* b, bool b_kn, int64_t ldb, int64_t rows, int64_t n, int64_t k,
                          DType t, void* c, void* bound) {
  const dim3 grid(static_cast<unsigned>((n + 31) / 32), static_cast<unsigned>((rows + 31) / 32));
  if (t == DType::kBF16) {
    reference_kernel<<<grid, 256>>>(static_cast<const __nv_bfloat16*>(a_rows), k, static_cast<const __nv_bfloat16*>(b), ldb, b_kn,
                                    rows, n, k, static_cast<float*>(c), static_cast<float*>(bound));
  } else {
    reference_kernel<<<grid, 256>>>(static_cast<const __half*>(a_rows), k, static_cast<const __half*>(b), ldb, b_kn, rows, n, k,
                                    static_cast<float*>(c), static_cast<float*>(bound));
  }
  return cudaDeviceSynchronize() == cudaSuccess;
}

}  // namespace loom::test::tp
