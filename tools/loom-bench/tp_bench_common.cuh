// Helpers shared by the tensor-parallel benches (tp_bench.cu, multinode_bench.cu): owned device,
// symmetric and stream handles, a cuBLAS handle with its workspace, the random matrices every
// rank can regenerate for its fp32 reference (tests/common/verifiable.cuh's values), and the one
// reference check of a call's output (check_sampled_rows).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "baselines.h"
#include "kernels/gemm/reference.cuh"
#include "loom/communicator.h"
#include "loom/status.h"
#include "loom/types.h"
#include "runtime/cuda_check.h"
#include "tests/common/verifiable.cuh"

namespace loom::bench {

// printf-formats one value ("%.3f" and the like).
inline std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof(b), f, v);
  return b;
}

// cudaMalloc'd bytes (at least 16, so a zero-size buffer still has an address), freed on
// destruction or re-allocation.
struct DeviceBuffer {
  void* p = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }
  Status alloc(size_t bytes) {
    release();
    LOOM_CUDA_TRY(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
    return {};
  }
  void release() {
    if (p) cudaFree(p);
    p = nullptr;
  }
};

// A symmetric allocation. Freed in reverse order of allocation on every rank (symmetric
// allocations are collective), which C++ destruction order gives.
struct SymmetricBuffer {
  Communicator* comm = nullptr;
  void* p = nullptr;
  SymmetricBuffer() = default;
  SymmetricBuffer(const SymmetricBuffer&) = delete;
  SymmetricBuffer& operator=(const SymmetricBuffer&) = delete;
  ~SymmetricBuffer() {
    if (p) (void)comm->free(p);
  }
  Status alloc(Communicator& c, size_t bytes) {
    comm = &c;
    LOOM_ASSIGN_OR_RETURN(p, c.alloc(bytes));
    return {};
  }
};

struct StreamHolder {
  cudaStream_t stream = nullptr;
  ~StreamHolder() {
    if (stream) cudaStreamDestroy(stream);
  }
};

// A cuBLAS handle on `stream` with its own 32 MiB workspace.
struct CublasContext {
  cublasHandle_t handle = nullptr;
  DeviceBuffer workspace;
  ~CublasContext() {
    if (handle) cublasDestroy(handle);
  }
  Status init(cudaStream_t stream) {
    LOOM_TRY(cublas_status(cublasCreate(&handle), "cublasCreate"));
    const size_t bytes = size_t{32} << 20;
    LOOM_TRY(workspace.alloc(bytes));
    LOOM_TRY(cublas_status(cublasSetStream(handle, stream), "cublasSetStream"));
    return cublas_status(cublasSetWorkspace(handle, workspace.p, bytes), "cublasSetWorkspace");
  }
};

// rows x cols at `out` (leading dimension ld), bf16 or fp16: element (r, c) is rank `rank`'s
// value r*cols + c of the seed's sequence.
inline Status fill_matrix(void* out, DType t, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, int rank,
                          cudaStream_t s) {
  const unsigned grid = verify::grid_for(static_cast<uint64_t>(rows * cols));
  if (t == DType::kBF16) {
    verify::fill_matrix_kernel<<<grid, 256, 0, s>>>(static_cast<__nv_bfloat16*>(out), rows, cols, ld, seed, rank);
  } else {
    verify::fill_matrix_kernel<<<grid, 256, 0, s>>>(static_cast<__half*>(out), rows, cols, ld, seed, rank);
  }
  LOOM_CUDA_TRY_LAUNCH();
  return {};
}

inline void* offset_elements(void* p, int64_t elements, DType t) {
  return static_cast<char*>(p) + elements * static_cast<int64_t>(dtype_size(t));
}

// One TP call (ag_gemm, gemm_rs or gemm_ar over `world` ranks) as its reference sees it. Rank r's
// operands are fill_matrix(seed * 16 + 1, r) for a and (seed * 16 + 2, r) for b.
struct ReferenceCall {
  OpId op = OpId::kAgGemm;
  int64_t m = 0, n = 0, k_rank = 0;  // k_rank: this rank's K (gemm_rs / gemm_ar: K / world)
  int world = 1;
  DType dtype = DType::kBF16;
  BLayout layout = BLayout::kKN;
  uint64_t seed = 0;
  int64_t block = 0;                 // this rank's row block (gemm_rs: its out rows are block * M/W + i)
  const void* b = nullptr;           // this rank's b (ag_gemm multiplies the gathered A by it)
  std::function<int(int)> owner;     // the rank whose a is row block d of the gathered A (ag_gemm)
  int64_t max_rows = 256;            // rows sampled evenly (plus every block boundary)
};

// The ReferenceCall of a bench case: its Shape (op, m, n, k_rank, world), its options (dtype,
// b_layout, seed), this rank's row block, its b and the owner of each row block.
template <class Shape, class Options>
ReferenceCall reference_call(const Shape& s, const Options& o, int64_t block, const void* b, std::function<int(int)> owner) {
  ReferenceCall c;
  c.op = s.op;
  c.m = s.m;
  c.n = s.n;
  c.k_rank = s.k_rank;
  c.world = s.world;
  c.dtype = o.dtype;
  c.layout = o.b_layout;
  c.seed = o.seed;
  c.block = block;
  c.b = b;
  c.owner = std::move(owner);
  return c;
}

struct SampledCheck {
  double rel_err = -1;          // over the sampled rows: ||out - ref|| / ||ref||
  int64_t nan_count = 0;
  std::string first_mismatch;   // the largest relative error: "row r col c: got g want w"
};

// Compares sampled rows of this rank's output `out` of `c` (first and last, block boundaries,
// spread in between) with an fp32 reference from every rank's regenerated operands.
inline Result<SampledCheck> check_sampled_rows(const ReferenceCall& c, const void* out, cudaStream_t stream) {
  const DType t = c.dtype;
  const bool kn = c.layout == BLayout::kKN;
  const bool ag = c.op == OpId::kAgGemm;
  const uint64_t seed_a = c.seed * 16 + 1, seed_b = c.seed * 16 + 2;
  const int64_t block_rows = c.m / c.world;
  // Reference operands: ag_gemm, the gathered A and this rank's b; gemm_rs / gemm_ar, A_full
  // [M, K] (rank r's columns r*K_r) and B_full (rank r's rows, or columns for [N, K]).
  const int64_t k_total = ag ? c.k_rank : c.k_rank * c.world;
  DeviceBuffer ref_a, ref_b;
  LOOM_TRY(ref_a.alloc(static_cast<size_t>(c.m * k_total) * dtype_size(t)));
  const void* b_ref = c.b;
  int64_t ldb = kn ? c.n : c.k_rank;
  if (ag) {
    for (int d = 0; d < c.world; ++d) {
      LOOM_TRY(fill_matrix(offset_elements(ref_a.p, d * block_rows * k_total, t), t, block_rows, k_total, k_total, seed_a,
                           c.owner(d), stream));
    }
  } else {
    LOOM_TRY(ref_b.alloc(static_cast<size_t>(c.n * k_total) * dtype_size(t)));
    for (int r = 0; r < c.world; ++r) {
      LOOM_TRY(fill_matrix(offset_elements(ref_a.p, r * c.k_rank, t), t, c.m, c.k_rank, k_total, seed_a, r, stream));
      if (kn) {
        LOOM_TRY(fill_matrix(offset_elements(ref_b.p, r * c.k_rank * c.n, t), t, c.k_rank, c.n, c.n, seed_b, r, stream));
      } else {
        LOOM_TRY(fill_matrix(offset_elements(ref_b.p, r * c.k_rank, t), t, c.n, c.k_rank, k_total, seed_b, r, stream));
      }
    }
    b_ref = ref_b.p;
    ldb = kn ? c.n : k_total;
  }
  const int64_t out_rows = c.op == OpId::kGemmRs ? block_rows : c.m;
  std::vector<int> rows;
  const int64_t want = std::min<int64_t>(out_rows, c.max_rows);
  for (int64_t i = 0; i < want; ++i) rows.push_back(static_cast<int>(want == out_rows ? i : i * (out_rows - 1) / (want - 1)));
  if (c.op != OpId::kGemmRs && want < out_rows) {
    for (int d = 1; d < c.world; ++d) {
      rows.push_back(static_cast<int>(d * block_rows - 1));
      rows.push_back(static_cast<int>(d * block_rows));
    }
  }
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  std::vector<int> a_rows = rows;  // rows of A the reference multiplies
  if (c.op == OpId::kGemmRs) {
    for (int& r : a_rows) r += static_cast<int>(c.block * block_rows);
  }
  DeviceBuffer d_rows, ref;
  LOOM_TRY(d_rows.alloc(a_rows.size() * sizeof(int)));
  LOOM_TRY(ref.alloc(a_rows.size() * static_cast<size_t>(c.n) * sizeof(float)));
  LOOM_CUDA_TRY(cudaMemcpyAsync(d_rows.p, a_rows.data(), a_rows.size() * sizeof(int), cudaMemcpyHostToDevice, stream));
  const int n_rows = static_cast<int>(a_rows.size());
  const dim3 grid(static_cast<unsigned>((c.n + 31) / 32), static_cast<unsigned>((n_rows + 31) / 32));
  if (t == DType::kBF16) {
    kernels::gemm::reference::gemm_fp32<__nv_bfloat16><<<grid, 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(ref_a.p), static_cast<const __nv_bfloat16*>(b_ref), static_cast<float*>(ref.p),
        static_cast<const int*>(d_rows.p), n_rows, static_cast<int>(c.n), static_cast<int>(k_total), k_total, ldb, kn);
  } else {
    kernels::gemm::reference::gemm_fp32<__half><<<grid, 256, 0, stream>>>(static_cast<const __half*>(ref_a.p), static_cast<const __half*>(b_ref),
                                                    static_cast<float*>(ref.p), static_cast<const int*>(d_rows.p), n_rows,
                                                    static_cast<int>(c.n), static_cast<int>(k_total), k_total, ldb, kn);
  }
  LOOM_CUDA_TRY_LAUNCH();
  std::vector<float> want_values(a_rows.size() * static_cast<size_t>(c.n));
  LOOM_CUDA_TRY(cudaMemcpyAsync(want_values.data(), ref.p, want_values.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
  std::vector<uint16_t> got(static_cast<size_t>(c.n));
  SampledCheck result;
  double num = 0, den = 0, worst = -1;
  for (size_t i = 0; i < rows.size(); ++i) {
    const void* row = static_cast<const char*>(out) + static_cast<size_t>(rows[i] * c.n) * dtype_size(t);
    LOOM_CUDA_TRY(cudaMemcpyAsync(got.data(), row, got.size() * 2, cudaMemcpyDeviceToHost, stream));
    LOOM_CUDA_TRY(cudaStreamSynchronize(stream));
    for (int64_t j = 0; j < c.n; ++j) {
      const double g = host_value(got.data(), static_cast<size_t>(j), t);
      const double w = want_values[i * static_cast<size_t>(c.n) + static_cast<size_t>(j)];
      const double err = std::isnan(g) ? 1e30 : (g - w) * (g - w);
      if (std::isnan(g)) ++result.nan_count;
      num += err;
      den += w * w;
      const double scaled = err / (w * w + 1.0);
      if (scaled > worst) {
        worst = scaled;
        result.first_mismatch = "row " + std::to_string(rows[i]) + " col " + std::to_string(j) + ": got " + fmt("%g", g) +
                                " want " + fmt("%g", w);
      }
    }
  }
  result.rel_err = den > 0 ? std::sqrt(num / den) : (num > 0 ? 1e30 : 0);
  return result;
}

}  // namespace loom::bench
