// SymmetricHeap: one device-memory heap per GPU, of equal size on every rank, mapped by every
// local peer, with buffers carved at equal offsets.
//
// A kernel addresses a peer's copy of a buffer as peer_base(peer) + offset_of(buffer). Two
// backends provide the mappings:
//   vmm  one cuMemCreate allocation per GPU, exported as a POSIX file descriptor, passed to each
//        local peer over a Unix socket (ipc_socket.h) and mapped there with cuMemMap. Supports
//        dma-buf RDMA registration later; the default.
//   ipc  cudaMalloc + legacy CUDA IPC handles (exchanged through the bootstrap), for systems
//        where fd export fails (some containers, drivers). Handles are secrets: never logged.
// `auto` picks vmm when every local GPU can export, else ipc; all ranks of a node use one.
//
// Layout of every heap (equal on all ranks):
//   [0, reserved_prefix_bytes)   control region (flags, self_test[local_world][kSelfTestWords]),
//                                zero on every rank when create() returns
//   [reserved_prefix rounded up to 256 B, size)   allocate() / release()
// size = bytes rounded up to the largest cuMem granularity of any rank (2 MiB on Hopper).
//
// create() is collective over the whole bootstrap world (every rank calls it with equal
// options, in the same order relative to other collectives). Its bootstrap steps are the same on
// every rank whatever the node's backend: broadcast (socket tag, self-test nonce), all_gather
// (requests, capabilities), all_gather (ipc handles; the point after which every vmm socket
// listens), barrier (self-test writes done), all_gather (self-test findings). It checks peer
// reachability and runs a self-test that writes through every mapping and verifies on the owner.
// Mismatched options, an unavailable backend and a failed self-test are decided from gathered
// data, so every rank returns the same error; a rank that fails on its own tells the others
// (Bootstrap::report_failure) so they fail with peer_failure instead of waiting for a deadline.
//
// NVLink multicast (cuMulticast*) is never used. Not thread-safe: the owner serializes calls.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "core/env.h"
#include "loom/status.h"
#include "runtime/bootstrap.h"
#include "runtime/heap_allocator.h"
#include "runtime/topology.h"

namespace loom::runtime {

struct HeapOptions {
  uint64_t bytes = uint64_t{1} << 30;  // LOOM_HEAP_BYTES; rounded up to the mapping granularity
  env::HeapBackend backend = env::HeapBackend::kAuto;
  int device = 0;                      // CUDA ordinal of this rank's GPU
  uint64_t reserved_prefix_bytes = 0;  // control region at offset 0; must hold the self-test area
  uint64_t self_test_offset = 0;       // self_test[local_world][kSelfTestWords] of uint64, in the prefix
  std::chrono::milliseconds timeout{120'000};  // deadline of the descriptor exchange
  // Test hook (reliability D6): XORed into the self-test words this rank writes, so its
  // mappings look broken and create() must fail on every rank.
  uint64_t self_test_flip_bits = 0;
};

// "auto", "vmm", "ipc".
const char* heap_backend_name(env::HeapBackend backend);

class SymmetricHeap {
 public:
  static constexpr uint64_t kDefaultAlignment = HeapAllocator::kMinAlignment;

  static Result<std::unique_ptr<SymmetricHeap>> create(Bootstrap& bootstrap, const Topology& topology,
                                                       const HeapOptions& options);
  ~SymmetricHeap();  // close(), logging a failure
  SymmetricHeap(const SymmetricHeap&) = delete;
  SymmetricHeap& operator=(const SymmetricHeap&) = delete;

  // Teardown, in two local (non-collective) steps. No kernel may use the heap any more.
  //   release_peer_mappings()  unmaps our mappings of every peer's heap
  //   close()                  does that if not yet done, then frees our heap and the device
  //                            array of bases
  // Legacy CUDA IPC forbids freeing an exported allocation while an importer still has it open
  // (undefined behaviour), so with the ipc backend every rank calls release_peer_mappings(),
  // then a barrier, then close(). cuMem memory lives until its last mapping goes, so with vmm
  // close() alone is safe. Both run every step even after one fails and return the first
  // failure; calls after close() return ok and do nothing.
  Status release_peer_mappings();
  Status close();

  void* local_base() const { return local_base_; }
  uint64_t size() const { return size_; }
  // This process's mapping of local rank `local_rank`'s heap; peer_base(local_rank()) == local_base().
  void* peer_base(int local_rank) const;
  // Device array [local_world] of the same mappings as uint64_t, for kernels (DeviceComm).
  const uint64_t* device_peer_bases() const { return device_peer_bases_; }
  env::HeapBackend backend() const { return backend_; }  // kVmm or kIpc once created
  const char* backend_name() const { return heap_backend_name(backend_); }
  int local_rank() const { return local_rank_; }
  int local_world() const { return local_world_; }
  int device() const { return device_; }

  // Offsets are equal on every rank that makes the same sequence of calls.
  Result<uint64_t> allocate_offset(uint64_t bytes, uint64_t align = kDefaultAlignment);
  Status release_offset(uint64_t offset);
  Result<void*> allocate(uint64_t bytes, uint64_t align = kDefaultAlignment);
  Status release(void* ptr);  // ptr from allocate()

  // Whether [ptr, ptr + bytes) lies inside the local heap.
  bool contains(const void* ptr, uint64_t bytes) const;
  // Whether [ptr, ptr + bytes) lies inside one live allocation of the local heap.
  bool allocated(const void* ptr, uint64_t bytes) const {
    return contains(ptr, bytes) && allocator_->range_allocated(offset_of(ptr), bytes);
  }
  // ptr - local_base(); only meaningful when contains(ptr, 1).
  uint64_t offset_of(const void* ptr) const {
    return static_cast<uint64_t>(static_cast<const char*>(ptr) - static_cast<const char*>(local_base_));
  }
  const HeapAllocator& allocator() const { return *allocator_; }

 private:
  // One heap as this process addresses it: our own or a peer's.
  struct Mapping {
    enum class Kind : uint8_t {
      kVmmRange,    // reserved address range (with our or a peer's cuMem allocation mapped over it)
      kCudaMalloc,  // our own ipc-backend heap
      kIpcOpened,   // a peer's heap opened with cudaIpcOpenMemHandle
    };
    Kind kind;
    bool own;  // our heap (else a peer's)
    void* base = nullptr;
    uint64_t bytes = 0;
    bool mapped = false;  // kVmmRange: an allocation is mapped over the range
  };
  struct InitState;  // what create() learned along the way (symmetric_heap.cc)

  SymmetricHeap() = default;
  Status init(Bootstrap& bootstrap, const Topology& topology, const HeapOptions& options, InitState& state);
  Status decide_layout(const Topology& topology, const HeapOptions& options, InitState& state);
  Status check_peer_reachability(const Topology& topology, const InitState& state) const;
  Status create_local_heap(InitState& state);
  Status map_peer_heaps(Bootstrap& bootstrap, const Topology& topology, const HeapOptions& options, InitState& state);
  Status map_vmm(uint64_t handle, bool own, void** base);
  Status run_self_test(Bootstrap& bootstrap, const Topology& topology, const HeapOptions& options, InitState& state);
  Status release_mapping(const Mapping& mapping);

  env::HeapBackend backend_ = env::HeapBackend::kAuto;
  int device_ = -1;
  int cu_device_ = -1;  // CUdevice of device_ (vmm backend)
  int local_rank_ = 0;
  int local_world_ = 1;
  uint64_t size_ = 0;
  uint64_t granularity_ = 0;
  void* local_base_ = nullptr;
  std::vector<void*> peer_bases_;            // [local_world]
  uint64_t* device_peer_bases_ = nullptr;    // device memory, [local_world]
  std::vector<Mapping> mappings_;            // in creation order; released in reverse
  std::optional<HeapAllocator> allocator_;
  bool closed_ = false;
};

}  // namespace loom::runtime
