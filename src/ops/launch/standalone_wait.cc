#include "ops/launch/standalone_wait.h"

#include <array>
#include <chrono>
#include <thread>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "core/env.h"
#include "runtime/cuda_check.h"
#include "runtime/names.h"

namespace loom::ops {

namespace {

// Every device's queues come from one pool of kQueueSlots LaunchStates, allocated and zeroed at
// the device's first standalone call (no allocation later, so a first call on a new stream can be
// captured in a CUDA graph); streams get a slot on first use and keep it.
constexpr size_t kQueueSlots = 256;

struct QueuePool {
  LaunchState* states = nullptr;  // kQueueSlots, one 64-byte line each
  std::map<cudaStream_t, size_t> slot_of;
};

std::mutex& queues_mutex() {
  static std::mutex mu;
  return mu;
}
std::map<int, QueuePool>& pools() {
  static std::map<int, QueuePool> p;
  return p;
}

Status reset_queues(int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(queues_mutex());
  auto it = pools().find(device);
  if (it == pools().end() || it->second.states == nullptr) return Status{};
  LOOM_CUDA_TRY(cudaMemsetAsync(it->second.states, 0, kQueueSlots * sizeof(LaunchState), stream));
  return Status{};
}

Status create_pool(QueuePool& pool) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, kQueueSlots * sizeof(LaunchState));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::invalid_argument(
        "standalone operators: the device's work queues could not be allocated (" + std::string(cudaGetErrorString(e)) +
        "); if a CUDA graph is being captured, run one standalone operator (attention, gemm) eagerly first");
  }
  LOOM_CUDA_TRY(cudaMemset(p, 0, kQueueSlots * sizeof(LaunchState)));
  pool.states = static_cast<LaunchState*>(p);
  return Status{};
}

}  // namespace

Result<LaunchState*> standalone_queue(cudaStream_t stream) {
  int device = 0;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(queues_mutex());
  QueuePool& pool = pools()[device];
  if (pool.states == nullptr) LOOM_TRY(create_pool(pool));
  auto [it, inserted] = pool.slot_of.emplace(stream, pool.slot_of.size());
  if (it->second >= kQueueSlots) {
    pool.slot_of.erase(it);
    return Status::unsupported("standalone operators: more than " + std::to_string(kQueueSlots) +
                               " streams on one device used a tile queue");
  }
  return pool.states + it->second;
}

Result<StandaloneWait*> standalone_wait() {
  static std::mutex mu;
  static std::array<StandaloneWait, 64> per_device{};
  int device = 0;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  if (device < 0 || device >= static_cast<int>(per_device.size())) {
    return Status::unsupported("standalone operators: device ordinal above 63");
  }
  std::lock_guard<std::mutex> lock(mu);
  StandaloneWait& w = per_device[device];
  if (w.device_abort == nullptr) {
    LOOM_ASSIGN_OR_RETURN(int64_t timeout_ms, env::get_int("LOOM_TIMEOUT_MS", 30'000, 1, env::kMaxTimeoutMs));
    void* host = nullptr;
    LOOM_CUDA_TRY(cudaHostAlloc(&host, sizeof(ErrorRecord), cudaHostAllocMapped));
    std::memset(host, 0, sizeof(ErrorRecord));
    void* dev = nullptr;
    LOOM_CUDA_TRY(cudaMalloc(&dev, sizeof(uint32_t)));
    LOOM_CUDA_TRY(cudaMemset(dev, 0, sizeof(uint32_t)));
    w.error = static_cast<ErrorRecord*>(host);
    w.device_abort = static_cast<uint32_t*>(dev);
    w.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1'000'000ull;
  }
  return &w;
}

Status take_standalone_error(StandaloneWait& w, cudaStream_t stream) {
  volatile ErrorRecord* e = w.error;
  if (e->code == 0) return Status{};
  const OpId op = static_cast<OpId>(e->op);
  char buf[320];
  Status s;
  if (e->code == static_cast<uint32_t>(DeviceError::kInvalidInput)) {
    std::snprintf(buf, sizeof buf,
                  "%s: an earlier launch found invalid device-resident arguments (item %u: e.g. the packed "
                  "sequence offsets of sequence %u are decreasing, negative, past the tensor or longer than the "
                  "given maximum) and wrote nothing",
                  op_name(op), e->flag_index, e->flag_index);
    s = Status::invalid_argument(buf);
  } else {
    std::snprintf(buf, sizeof buf,
                  "%s: an earlier launch failed on the device (code %u, cta %d, flag_index 0x%x, waited %llu ns); "
                  "this is a loom bug",
                  op_name(op), e->code, e->cta, e->flag_index, static_cast<unsigned long long>(e->waited_ns));
    s = Status::internal(buf);
  }
  std::memset(const_cast<ErrorRecord*>(w.error), 0, sizeof(ErrorRecord));
  LOOM_CUDA_TRY(cudaMemsetAsync(w.device_abort, 0, sizeof(uint32_t), stream));
  int device = 0;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  LOOM_TRY(reset_queues(device, stream));  // a failed launch may have left its queue mid-way
  return s;
}

Status wait_stream_bounded(cudaStream_t stream, uint64_t timeout_ns, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return Status{};
    if (e != cudaErrorNotReady) return cuda_status(e, "cudaStreamQuery", __FILE__, __LINE__);
    if (std::chrono::steady_clock::now() > deadline) {
      return Status::timeout(std::string(what) + ": the stream's work did not finish within LOOM_TIMEOUT_MS");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace loom::ops
