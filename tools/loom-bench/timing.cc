#include "timing.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <random>
#include <string>
#include <thread>

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

namespace {

// Holds a stream until the host has enqueued a round (a host function that waits for `open`,
// bounded: 2 s, after which the round runs anyway and its times are just wrong). Without it
// the round's first op would start on an idle stream and its time would include the host's
// launch latency (visible for microsecond ops: loom's 1 MiB all_gather measured 0.027 instead
// of 0.019 ms).
struct StreamGate {
  std::atomic<int> open{0};
  static void CUDART_CB wait(void* self) {
    auto* gate = static_cast<StreamGate*>(self);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (gate->open.load(std::memory_order_acquire) == 0 && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::yield();
    }
  }
};

}  // namespace

Result<std::vector<Timing>> time_interleaved(cudaStream_t stream, int warmup, int iters,
                                             const std::vector<std::function<Status()>>& ops,
                                             const std::function<Status()>& sync,
                                             const std::function<Status()>& before_round) {
  const size_t n = ops.size();
  for (const auto& op : ops) {
    for (int i = 0; i < warmup; ++i) LOOM_TRY_CTX(op(), "warm-up");
  }
  LOOM_TRY(sync());
  std::vector<std::vector<double>> samples(n);
  std::vector<cudaEvent_t> events(2 * n);
  for (cudaEvent_t& e : events) LOOM_CUDA_TRY(cudaEventCreate(&e));
  std::vector<size_t> order(n);
  Status status;
  for (int r = 0; r < iters && status.ok(); ++r) {
    status = before_round();
    // The same order on every rank (a fixed seed per round: the ops may be collective).
    for (size_t k = 0; k < n; ++k) order[k] = k;
    std::mt19937 rng(0x6c6f6f6du + static_cast<uint32_t>(r));
    std::shuffle(order.begin(), order.end(), rng);
    // Process lifetime: a host function still pending after a failed sync must not read a dead
    // object (it finds the gate open and returns).
    static StreamGate gate;
    gate.open.store(0, std::memory_order_release);
    if (status.ok()) {
      if (cudaError_t e = cudaLaunchHostFunc(stream, &StreamGate::wait, &gate); e != cudaSuccess) {
        status = Status::cuda_error(std::string("cudaLaunchHostFunc: ") + cudaGetErrorString(e));
      }
    }
    for (size_t j = 0; j < n && status.ok(); ++j) {
      const size_t k = order[j];
      if (cudaError_t e = cudaEventRecord(events[2 * k], stream); e != cudaSuccess) {
        status = Status::cuda_error(std::string("cudaEventRecord: ") + cudaGetErrorString(e));
        break;
      }
      status = ops[k]();
      if (cudaError_t e = cudaEventRecord(events[2 * k + 1], stream); status.ok() && e != cudaSuccess) {
        status = Status::cuda_error(std::string("cudaEventRecord: ") + cudaGetErrorString(e));
      }
    }
    gate.open.store(1, std::memory_order_release);  // on every path, before anything waits on the stream
    if (const Status synced = sync(); status.ok()) status = synced;
    for (size_t k = 0; k < n && status.ok(); ++k) {
      float ms = 0;
      if (cudaError_t e = cudaEventElapsedTime(&ms, events[2 * k], events[2 * k + 1]); e != cudaSuccess) {
        status = Status::cuda_error(std::string("cudaEventElapsedTime: ") + cudaGetErrorString(e));
        break;
      }
      samples[k].push_back(ms);
    }
  }
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  LOOM_TRY(status);
  std::vector<Timing> out;
  for (auto& s : samples) out.push_back(summarize(std::move(s)));
  return out;
}

}  // namespace loom::bench
