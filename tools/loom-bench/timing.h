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

// Times several ops side by side, one launch of each per round, `iters` rounds (after `warmup`
// launches of each): every round runs them back to back in a freshly shuffled order (the same
// seed on every rank: the ops may be collective), then synchronizes. The GPU's clock moves with
// its power and temperature, which depend on what ran just before: a fixed order (or batches of
// one op, even rotated) lets the op after the lightest one run on a cooler, faster GPU (measured
// on 2 x H200 at M = 32768: 8-9% between two identical configurations). `before_round` runs at
// the start of each round (a barrier keeps the ranks together). The stream is held (a host
// function) until the round is enqueued, so no op starts on an idle stream and pays the host's
// launch latency. The ops must not synchronize the stream themselves. One Timing per op.
Result<std::vector<Timing>> time_interleaved(cudaStream_t stream, int warmup, int iters,
                                             const std::vector<std::function<Status()>>& ops,
                                             const std::function<Status()>& sync,
                                             const std::function<Status()>& before_round);

}  // namespace loom::bench
