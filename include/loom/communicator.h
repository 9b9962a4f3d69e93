// loom::Communicator: one per rank (process and GPU); owns the runtime every operator uses.
//
// Creating one is collective over all ranks: it runs the bootstrap, learns the topology, maps
// every local peer's symmetric heap and self-tests each peer mapping. Operators launched on a
// communicator must be issued in the same order on every rank and from one stream order at a
// time (like NCCL communicators). Launches are asynchronous; synchronize() waits with a
// deadline and turns any device-side failure (timeout, abort) into a Status. After a failure
// the communicator stays failed: later calls return `aborted` with the original reason.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "loom/status.h"

namespace loom {

struct CommunicatorAccess;

// Overrides of the LOOM_* environment; zero values keep the environment's (or default) setting.
struct CommOptions {
  uint64_t heap_bytes = 0;                      // LOOM_HEAP_BYTES
  std::chrono::milliseconds op_timeout{0};      // LOOM_TIMEOUT_MS
  std::chrono::milliseconds bootstrap_timeout{0};  // LOOM_BOOTSTRAP_TIMEOUT_MS
  int device = -1;                              // CUDA device; -1: LOCAL_RANK, else rank % device count
  // LOOM_RANKS_PER_GPU; 0 keeps the environment's. n > 1 is the shared-GPU mode: up to n ranks
  // share one GPU as time-sliced processes (device = LOCAL_RANK mod the visible GPUs), so every
  // multi-rank path can be tested on few GPUs. It is for correctness only: it measures no speed.
  int ranks_per_gpu = 0;
};

// Created by one rank, passed to the others by the application (bytes are opaque).
struct UniqueId {
  std::array<uint8_t, 128> bytes{};
};

// Rank 0 of a unique-id job calls this and shares the result; it listens on bind_addr.
Result<UniqueId> make_unique_id(std::string_view bind_addr = "127.0.0.1");
// The listener make_unique_id() keeps open until this process's from_unique_id(id, 0, ...) takes
// it: closed now, for an id that will not be used here (at most 64 wait at once).
void discard_unique_id(const UniqueId& id);

class Communicator {
 public:
  // torchrun / Slurm style: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
  // MASTER_PORT (and LOOM_SECRET when set).
  static Result<std::unique_ptr<Communicator>> from_env(const CommOptions& options = {});
  static Result<std::unique_ptr<Communicator>> from_unique_id(const UniqueId& id, int rank, int world_size,
                                                              const CommOptions& options = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int world_size() const;
  int local_rank() const;        // index within this node
  int local_world_size() const;  // ranks on this node (one NVLink domain)
  int node() const;
  int num_nodes() const;
  int device() const;
  int sm_count() const;          // of this rank's GPU
  int ranks_per_gpu() const;     // the shared-GPU setting (1: one rank per GPU)
  int ranks_on_gpu() const;      // ranks of this job on this rank's GPU, this one included

  // Symmetric allocation (collective: every rank calls it with the same sizes in the same
  // order, and gets the same offset in its heap). Peers can read and write it over NVLink.
  Result<void*> alloc(size_t bytes);
  Status free(void* ptr);
  bool is_symmetric(const void* ptr, size_t bytes) const;
  // This rank's mapping of local peer `local_rank`'s copy of a symmetric buffer.
  Result<void*> peer_pointer(const void* local_ptr, int local_rank) const;

  // Waits until the work queued on `stream` is done, at most the op timeout (+ 1 s for the
  // kernel to notice an abort), and reports device-side failures (timeout naming the rank
  // waited on, abort) as a Status. cuda_error if the stream itself failed.
  Status synchronize(cudaStream_t stream);
  // Host barrier over all ranks (bootstrap network), bounded by the bootstrap timeout.
  Status barrier();
  // Raises the abort word: running loom kernels of this communicator return within
  // about a millisecond (LOOM kernels read the host-mapped abort word at most every 0.5 ms per
  // wait); the communicator is failed afterwards.
  void abort(std::string_view reason);
  // ok while usable; else the failure that ended it.
  Status health() const;

  struct Impl;  // the runtime behind it (internal: src/runtime/communicator_impl.h)

 private:
  friend struct CommunicatorAccess;  // loom's own operators reach Impl through it
  explicit Communicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom
