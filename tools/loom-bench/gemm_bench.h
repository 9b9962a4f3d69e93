// loom::gemm vs cuBLAS on the same inputs, one GPU (loom-bench gemm).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/types.h"
#include "progress.h"
#include "timing.h"

namespace loom::bench {

struct GemmBenchOptions {
  std::vector<std::array<int64_t, 3>> shapes;  // {M, N, K}
  DType in_dtype = DType::kBF16;
  DType out_dtype = DType::kBF16;
  BLayout b_layout = BLayout::kNK;
  GemmTile tile = GemmTile::kAuto;  // force a loom configuration
  int num_ctas = 0;                 // loom's persistent grid (0: planner)
  int group_m = 0;                  // loom's raster group height in tile rows (0: planner)
  int warmup = 10;
  int iters = 30;                   // timed iterations (median reported); at least 20 is sensible
  bool check = true;                // compare loom with an fp32 reference once per shape
  uint64_t seed = 1;
};

struct GemmBenchRow {
  int64_t m = 0, n = 0, k = 0;
  DType in_dtype = DType::kBF16;
  DType out_dtype = DType::kBF16;
  BLayout b_layout = BLayout::kNK;
  std::string config;      // loom's tile, e.g. "128x256", grid and raster group, e.g. "128x256/132/g16"
  double rel_err = -1;     // ||loom - ref|| / ||ref|| over sampled rows (-1: not checked)
  double rel_err_cublas = -1;
  Timing loom;            // `iters` event-timed launches (min, median, p90)
  Timing cublas;
  double tflops_loom = 0;  // from the medians
  double tflops_cublas = 0;
  int input_sets = 1;      // A/B copies rotated through (more than one when they fit in L2)
};

// Allocates random inputs per shape (rotating several copies when A and B fit in L2), checks
// loom once against an fp32 reference on sampled rows, then times loom and cuBLAS
// (cublasGemmEx, fp32 compute, same buffers, same rotation) with CUDA events. One progress step
// per shape.
Result<std::vector<GemmBenchRow>> run_gemm_bench(const GemmBenchOptions& options, Progress& progress);

}  // namespace loom::bench
