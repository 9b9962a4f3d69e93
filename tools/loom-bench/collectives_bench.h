// loom's NVLink collectives vs NCCL (see collectives_bench.cu).
#pragma once

#include <nccl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "loom/collectives.h"
#include "loom/communicator.h"
#include "report.h"

namespace loom::bench {

struct CollectiveBenchOptions {
  std::vector<std::string> ops;   // all_gather, reduce_scatter, all_reduce
  std::vector<uint64_t> sizes;    // per-rank payload bytes
  std::vector<int> ctas = {0};    // 0: planner's choice
  DType dtype = DType::kBF16;
  CopyEngineChoice engine = CopyEngineChoice::kAuto;
  int warmup = 5;
  int iters = 20;
};

Status run_collective_bench(Communicator& comm, ncclComm_t nccl, const CollectiveBenchOptions& options, Report& report);

// Helpers shared by the benchmark drivers.
Result<double> max_over_ranks(Communicator& comm, double value);
Result<ncclComm_t> make_nccl_comm(Communicator& comm);

}  // namespace loom::bench
