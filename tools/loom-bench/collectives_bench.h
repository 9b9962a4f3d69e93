// loom's NVLink collectives vs NCCL (see collectives_bench.cu).
#pragma once

#include <nccl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "loom/collectives.h"
#include "loom/communicator.h"
#include "progress.h"
#include "report.h"
#include "timing.h"

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

// One progress step per op, size and CTA count.
Status run_collective_bench(Communicator& comm, ncclComm_t nccl, const CollectiveBenchOptions& options, Report& report,
                            Progress& progress);

// Helpers shared by the benchmark drivers.
Result<double> max_over_ranks(Communicator& comm, double value);
// Each of min, median and p90 maximised over the ranks (the slowest rank sets a collective's time).
Result<Timing> max_over_ranks(Communicator& comm, const Timing& t);
Result<ncclComm_t> make_nccl_comm(Communicator& comm);

}  // namespace loom::bench
