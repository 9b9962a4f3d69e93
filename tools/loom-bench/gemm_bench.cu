#include "gemm_bench.h"

#include "baselines.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "kernels/gemm/reference.cuh"
#include "ops/gemm/gemm_launch.h"
#include "runtime/cuda_check.h"
#include "timing.h"

namespace loom::bench {

namespace {

namespace ref = kernels::gemm::reference;

struct Buffer {
  void* p = nullptr;
  ~Buffer() {
    if (p) cudaFree(p);
  }
};

// Relative error of D (rows `rows` of [M, N]) against the fp32 reference of the same rows.
Result<double> sampled_rel_err(const GemmArgs& a, const std::vector<int>& rows) {
  const int n_rows = static_cast<int>(rows.size());
  Buffer d_rows, c;
  LOOM_CUDA_TRY(cudaMalloc(&d_rows.p, rows.size() * 4));
  LOOM_CUDA_TRY(cudaMalloc(&c.p, rows.size() * a.n * 4));
  LOOM_CUDA_TRY(cudaMemcpy(d_rows.p, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
  const int64_t ldb = a.b_layout == BLayout::kKN ? a.n : a.k;
  const dim3 grid(static_cast<unsigned>((a.n + 31) / 32), static_cast<unsigned>((n_rows + 31) / 32));
  const bool kn = a.b_layout == BLayout::kKN;
  if (a.in_dtype == DType::kBF16) {
    ref::gemm_fp32<__nv_bfloat16><<<grid, 256>>>(static_cast<const __nv_bfloat16*>(a.a),
                                                  static_cast<const __nv_bfloat16*>(a.b), static_cast<float*>(c.p),
                                                  static_cast<const int*>(d_rows.p), n_rows, static_cast<int>(a.n),
                                                  static_cast<int>(a.k), a.k, ldb, kn);
  } else {
    ref::gemm_fp32<__half><<<grid, 256>>>(static_cast<const __half*>(a.a), static_cast<const __half*>(a.b),
                                          static_cast<float*>(c.p), static_cast<const int*>(d_rows.p), n_rows,
                                          static_cast<int>(a.n), static_cast<int>(a.k), a.k, ldb, kn);
  }
  LOOM_CUDA_TRY(cudaGetLastError());
  std::vector<float> want(rows.size() * a.n);
  LOOM_CUDA_TRY(cudaMemcpy(want.data(), c.p, want.size() * 4, cudaMemcpyDeviceToHost));
  const size_t es = dtype_size(a.out_dtype);
  std::vector<uint8_t> raw(static_cast<size_t>(a.n) * es);
  double num = 0, den = 0;
  for (int i = 0; i < n_rows; ++i) {
    LOOM_CUDA_TRY(cudaMemcpy(raw.data(), static_cast<const uint8_t*>(a.d) + static_cast<size_t>(rows[i]) * a.n * es,
                             raw.size(), cudaMemcpyDeviceToHost));
    for (int64_t j = 0; j < a.n; ++j) {
      const double g = host_value(raw.data(), static_cast<size_t>(j), a.out_dtype);
      const double w = want[static_cast<size_t>(i) * a.n + j];
      num += std::isnan(g) ? 1e30 : (g - w) * (g - w);
      den += w * w;
    }
  }
  return den > 0 ? std::sqrt(num / den) : 1e30;
}

}  // namespace

Result<std::vector<GemmBenchRow>> run_gemm_bench(const GemmBenchOptions& o, Progress& progress) {
  if (o.iters < 1 || o.warmup < 0) return Status::invalid_argument("gemm bench: iters must be >= 1, warmup >= 0");
  int device = 0, l2 = 0;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  LOOM_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  cudaStream_t stream = nullptr;
  LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::unique_ptr<CUstream_st, void (*)(cudaStream_t)> stream_guard(stream, [](cudaStream_t s) { cudaStreamDestroy(s); });
  cublasHandle_t handle = nullptr;
  LOOM_TRY(cublas_status(cublasCreate(&handle), "cublasCreate"));
  std::unique_ptr<cublasContext, void (*)(cublasHandle_t)> handle_guard(handle, [](cublasHandle_t h) { cublasDestroy(h); });
  Buffer workspace;
  const size_t workspace_bytes = size_t{32} << 20;
  LOOM_CUDA_TRY(cudaMalloc(&workspace.p, workspace_bytes));
  LOOM_TRY(cublas_status(cublasSetStream(handle, stream), "cublasSetStream"));
  LOOM_TRY(cublas_status(cublasSetWorkspace(handle, workspace.p, workspace_bytes), "cublasSetWorkspace"));

  std::vector<GemmBenchRow> rows;
  for (const auto& shape : o.shapes) {
    progress.step("gemm " + std::to_string(shape[0]) + "x" + std::to_string(shape[1]) + "x" + std::to_string(shape[2]));
    GemmBenchRow row;
    row.m = shape[0];
    row.n = shape[1];
    row.k = shape[2];
    row.in_dtype = o.in_dtype;
    row.out_dtype = o.out_dtype;
    row.b_layout = o.b_layout;
    GemmArgs args;
    args.m = row.m;
    args.n = row.n;
    args.k = row.k;
    args.in_dtype = o.in_dtype;
    args.out_dtype = o.out_dtype;
    args.b_layout = o.b_layout;
    GemmOptions gopt;
    gopt.tile = o.tile;
    gopt.num_ctas = o.num_ctas;
    gopt.group_m = o.group_m;

    // Several input copies when one set fits in L2 twice over, so each timed launch reads inputs
    // that the previous one did not leave in L2.
    const size_t a_bytes = static_cast<size_t>(row.m) * row.k * dtype_size(o.in_dtype);
    const size_t b_bytes = static_cast<size_t>(row.n) * row.k * dtype_size(o.in_dtype);
    const size_t set_bytes = a_bytes + b_bytes;
    int sets = 1;
    if (set_bytes < 2 * static_cast<size_t>(l2)) {
      sets = static_cast<int>(std::min<size_t>(8, (3 * static_cast<size_t>(l2) + set_bytes - 1) / set_bytes));
    }
    row.input_sets = sets;
    std::vector<Buffer> a(static_cast<size_t>(sets)), b(static_cast<size_t>(sets));
    Buffer d;
    for (int s = 0; s < sets; ++s) {
      LOOM_CUDA_TRY(cudaMalloc(&a[s].p, a_bytes));
      LOOM_CUDA_TRY(cudaMalloc(&b[s].p, b_bytes));
      ref::fill_uniform<<<1024, 256, 0, stream>>>(a[s].p, static_cast<int>(o.in_dtype), row.m, row.k, row.k,
                                                   o.seed * 1000 + 2 * s, 1.0f);
      const bool kn = o.b_layout == BLayout::kKN;
      ref::fill_uniform<<<1024, 256, 0, stream>>>(b[s].p, static_cast<int>(o.in_dtype), kn ? row.k : row.n,
                                                   kn ? row.n : row.k, kn ? row.n : row.k, o.seed * 1000 + 2 * s + 1,
                                                   1.0f);
    }
    const size_t d_bytes = static_cast<size_t>(row.m) * row.n * dtype_size(o.out_dtype);
    LOOM_CUDA_TRY(cudaMalloc(&d.p, d_bytes));
    args.a = a[0].p;
    args.b = b[0].p;
    args.d = d.p;
    LOOM_ASSIGN_OR_RETURN(ops::GemmLaunchPlan plan, ops::plan_gemm_launch(args, gopt));
    row.config = std::string(gemm_tile_name(plan.tile)) + "/" + std::to_string(plan.num_ctas) + "/g" +
                 std::to_string(plan.group_m);

    auto loom_op = [&](int i) -> Status {
      GemmArgs x = args;
      x.a = a[static_cast<size_t>(i % sets)].p;
      x.b = b[static_cast<size_t>(i % sets)].p;
      return gemm(x, stream, gopt);
    };
    auto cublas_op = [&](int i) -> Status {
      return cublas_gemm(handle, a[static_cast<size_t>(i % sets)].p, b[static_cast<size_t>(i % sets)].p, d.p, row.m, row.n,
                         row.k, o.b_layout, o.in_dtype, o.out_dtype);
    };

    if (o.check) {
      // Sampled rows: the first and last, and up to 254 spread over M (all rows if M is small).
      std::vector<int> sample;
      const int64_t want = std::min<int64_t>(row.m, 256);
      for (int64_t i = 0; i < want; ++i) sample.push_back(static_cast<int>(want == row.m ? i : i * (row.m - 1) / (want - 1)));
      GemmArgs x = args;
      x.a = a[0].p;
      x.b = b[0].p;
      LOOM_CUDA_TRY(cudaMemsetAsync(d.p, 0xFF, d_bytes, stream));
      LOOM_TRY(gemm(x, stream, gopt));
      LOOM_CUDA_TRY(cudaStreamSynchronize(stream));
      LOOM_ASSIGN_OR_RETURN(row.rel_err, sampled_rel_err(x, sample));
      LOOM_CUDA_TRY(cudaMemsetAsync(d.p, 0xFF, d_bytes, stream));
      LOOM_TRY(cublas_op(0));
      LOOM_CUDA_TRY(cudaStreamSynchronize(stream));
      LOOM_ASSIGN_OR_RETURN(row.rel_err_cublas, sampled_rel_err(x, sample));
    }
    // Side by side in shuffled rounds (timing.h); op(i) rotates the input buffers.
    int loom_i = 0, cublas_i = 0;
    LOOM_ASSIGN_OR_RETURN(
        std::vector<Timing> t,
        time_interleaved(
            stream, o.warmup, o.iters, {[&] { return loom_op(loom_i++); }, [&] { return cublas_op(cublas_i++); }},
            [&]() -> Status {
              LOOM_CUDA_TRY(cudaStreamSynchronize(stream));
              return {};
            },
            [] { return Status{}; }));
    row.loom = t[0];
    row.cublas = t[1];
    const double flop = 2.0 * static_cast<double>(row.m) * row.n * row.k;
    row.tflops_loom = flop / (row.loom.median_ms * 1e-3) / 1e12;
    row.tflops_cublas = flop / (row.cublas.median_ms * 1e-3) / 1e12;
    rows.push_back(row);
  }
  return rows;
}

}  // namespace loom::bench
