// loom-bench ag_gemm | gemm_rs | gemm_ar | tp | tune: the fused tensor-parallel operators beside
// their ceilings (see tp_bench.cu).
#pragma once

#include <nccl.h>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "loom/communicator.h"
#include "loom/tensor_parallel.h"
#include "loom/types.h"
#include "progress.h"
#include "report.h"
#include "runtime/device_abi.h"

namespace loom::bench {

struct TpBenchOptions {
  std::vector<OpId> ops;                                    // kAgGemm, kGemmRs, kGemmAr
  std::vector<int64_t> m = {1024, 2048, 4096, 8192, 16384, 32768};
  int64_t n = 0;  // 0: the N (ag_gemm 14336, gemm_rs / gemm_ar 8192)
  int64_t k = 0;  // 0: the K (ag_gemm 8192; gemm_rs / gemm_ar 14336, the global K split over ranks)
  DType dtype = DType::kBF16;
  BLayout b_layout = BLayout::kNK;
  TpGemmOptions loom;       // algorithm, comm_ctas, tile forced from the command line
  // A second configuration of loom checked and timed in the same alternating rounds (ms key
  // "loom_variant", described by row extra "variant"): a paired A/B, free of clock drift.
  std::optional<TpGemmOptions> variant;
  std::string variant_label;
  bool baselines = true;    // time cuBLAS, NCCL, NCCL + cuBLAS too
  std::string timeline_dir;  // non-empty: per-tile timelines (TileTimelineRecord) as CSV there
  int warmup = 5;
  int iters = 30;
  uint64_t seed = 1;
  // A row fails the run when loom's ||out - ref|| / ||ref|| exceeds this (bf16 rounding alone
  // gives ~2e-3; the GPU tests hold the tight element-wise bounds).
  double max_rel_err = 2e-2;
};

// Each shape: loom checked once against an fp32 reference on sampled rows (output pre-filled
// with NaN), then loom, cuBLAS on the local GEMM shape, the NCCL collective alone and NCCL +
// cuBLAS in sequence on one stream are timed (median of `iters` after `warmup`, max over
// ranks). Rows carry h = (T_nccl_cublas - T_loom) / (T_nccl_cublas - T_cublas), the plan and the
// cost model's estimate. Rank 0 prints one line per shape as it goes, and a progress step
// before it. On one rank (nothing to overlap) only the GEMM columns are timed, and the rows carry
// a "note" instead of h.
Status run_tp_bench(Communicator& comm, ncclComm_t nccl, const TpBenchOptions& options, Report& report, Progress& progress);

struct TpTuneOptions {
  TpBenchOptions bench;                                        // ops, shapes, layout, dtype, tile, timing
  std::vector<int> comm_ctas = {2, 4, 6, 8, 10, 12, 16, 20, 24, 32};
  bool try_decomposed = true;
  std::string cache_path;  // merged into (entries of other shapes are kept); rank 0 writes it
};

// Per shape: the model's plan, fused with each fused tile (128x256, 128x128; ag_gemm also with
// every comm_ctas value) and decomposed, each checked once and timed; the fastest correct one
// goes into the cache file. One progress step per shape.
Status run_tp_tune(Communicator& comm, const TpTuneOptions& options, Report& report, Progress& progress);

// Symmetric heap the benchmark needs for its largest shape (gemm_ar's output and the operators'
// workspaces, estimated generously).
uint64_t tp_heap_bytes(const TpBenchOptions& options, int world);

// The tensor-parallel rows of `report` as one table: times, ratios, h, plan (rank 0 calls it).
void print_tp_table(const Report& report, std::FILE* out);

}  // namespace loom::bench
