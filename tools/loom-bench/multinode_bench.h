// loom-bench multinode: the multi-node operators (ag_gemm, gemm_rs, gemm_ar over N nodes, real or
// emulated with LOOM_EMULATE_NODES) beside their own ceilings (see multinode_bench.cu).
#pragma once

#include <cstdint>
#include <cstdio>
#include <vector>

#include "loom/communicator.h"
#include "loom/tensor_parallel.h"
#include "loom/types.h"
#include "progress.h"
#include "report.h"
#include "runtime/device_abi.h"

namespace loom::bench {

struct MultiNodeBenchOptions {
  std::vector<OpId> ops = {OpId::kAgGemm, OpId::kGemmRs, OpId::kGemmAr};
  std::vector<int64_t> m = {1024, 2048, 4096, 8192, 16384, 32768};
  int64_t n = 0;  // 0: issue 4's N (ag_gemm 14336, gemm_rs / gemm_ar 8192)
  int64_t k = 0;  // 0: issue 4's K (ag_gemm 8192; gemm_rs / gemm_ar 14336, the global K split over ranks)
  DType dtype = DType::kBF16;
  BLayout b_layout = BLayout::kNK;
  TpGemmOptions loom;     // tile forced from the command line
  bool baselines = true;  // time the GEMM alone, the transfer alone, the sequence, cuBLAS
  int warmup = 5;
  int iters = 20;
  uint64_t seed = 1;
  double max_rel_err = 2e-2;  // a row fails the run beyond this (bf16 rounding alone gives ~2e-3)
};

// Per shape: loom checked once against an fp32 reference on sampled rows (NaN-filled output),
// then timed; the same local GEMM alone (loom's engine, and cuBLAS for reference), the same
// shaped network transfer alone (ops::net_exchange through the proxy and transport), and the
// GEMM followed by that transfer on one stream ("sequential", the baseline). Medians of `iters`
// after `warmup`, max over ranks. Rows carry h = (T_seq - T_loom) / (T_seq - T_gemm). One
// progress step per shape.
Status run_multinode_bench(Communicator& comm, const MultiNodeBenchOptions& options, Report& report, Progress& progress);

// Symmetric heap the benchmark needs for its largest shape.
uint64_t multinode_heap_bytes(const MultiNodeBenchOptions& options, int world, int nodes);

// The multi-node rows of `report` as one table (rank 0): times, h, plan.
void print_multinode_table(const Report& report, std::FILE* out);

}  // namespace loom::bench
