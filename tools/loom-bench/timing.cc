#include "timing.h"

#include <algorithm>

#include "runtime/cuda_check.h"

namespace loom::bench {

Timing summarize(std::vector<double> samples) {
  Timing t;
  if (samples.empty()) return t;
  std::sort(samples.begin(), samples.end());
  t.iters = static_cast<int>(samples.size());
  t.min_ms = samples.front();
  t.median_ms = samples.size() % 2 ? samples[samples.size() / 2]
                                   : 0.5 * (samples[samples.size() / 2 - 1] + samples[samples.size() / 2]);
  t.p90_ms = samples[std::min(samples.size() - 1, samples.size() * 9 / 10)];
  return t;
}

Result<Timing> time_op(cudaStream_t stream, int warmup, int iters, const std::function<Status()>& op,
                       const std::function<Status()>& sync) {
  for (int i = 0; i < warmup; ++i) LOOM_TRY_CTX(op(), "warm-up");
  LOOM_TRY(sync());
  std::vector<cudaEvent_t> events(2 * static_cast<size_t>(iters));
  for (cudaEvent_t& e : events) LOOM_CUDA_TRY(cudaEventCreate(&e));
  Status status;
  for (int i = 0; i < iters && status.ok(); ++i) {
    LOOM_CUDA_TRY(cudaEventRecord(events[2 * i], stream));
    status = op();
    LOOM_CUDA_TRY(cudaEventRecord(events[2 * i + 1], stream));
  }
  if (status.ok()) status = sync();
  std::vector<double> samples;
  for (int i = 0; i < iters && status.ok(); ++i) {
    float ms = 0;
    LOOM_CUDA_TRY(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]));
    samples.push_back(ms);
  }
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  LOOM_TRY(status);
  return summarize(std::move(samples));
}

}  // namespace loom::bench
