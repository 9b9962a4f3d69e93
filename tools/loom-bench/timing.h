// Timing with CUDA events: warm-up, then one event pair per iteration; the median is reported.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <vector>

#include "loom/status.h"

namespace loom::bench {

struct Timing {
  double median_ms = 0;
  double min_ms = 0;
  double p90_ms = 0;
  int iters = 0;
};

Timing summarize(std::vector<double> samples_ms);

// Enqueues `op` warmup + iters times on `stream`, timing each of the last `iters` with events,
// then synchronizes with `sync` (which may be Communicator::synchronize, bounded).
Result<Timing> time_op(cudaStream_t stream, int warmup, int iters, const std::function<Status()>& op,
                       const std::function<Status()>& sync);

}  // namespace loom::bench
