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

// Times several ops side by side: each is warmed up, then `rounds` rounds (raised to a multiple
// of the op count when the iterations allow) each time every op in turn for iters / rounds
// iterations (at least one), so that a slow drift of the GPU's clock (power limit, temperature)
// falls on every op alike instead of on whichever ran last; round r starts with op r mod the
// count, so that no op always runs first after the round's barrier.
// `before_round` runs at the start of each round (a barrier keeps the ranks together). Returns
// one Timing per op, over all of its samples.
Result<std::vector<Timing>> time_interleaved(cudaStream_t stream, int warmup, int iters,
                                             const std::vector<std::function<Status()>>& ops,
                                             const std::function<Status()>& sync,
                                             const std::function<Status()>& before_round, int rounds = 5);

}  // namespace loom::bench
