#include "runtime/transports/copy_engine.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/log.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_driver.h"

namespace loom::runtime::net {
namespace {

// remote_key bytes of a copy-engine registration.
struct WireKey {
  uint32_t magic;          // "LCEK"
  uint32_t has_ipc;        // 1: `ipc` opens the allocation in another process
  int32_t device;
  int32_t pid;
  uint64_t owner_address;  // the registration's address in the owner's process
  uint64_t bytes;
  uint64_t offset_in_allocation;  // owner_address - the allocation's base
  cudaIpcMemHandle_t ipc;
};
static_assert(sizeof(cudaIpcMemHandle_t) == 64, "CUDA IPC handles are 64 bytes");
static_assert(sizeof(WireKey) == 104, "fixed key: 40 bytes of fields, then the 64-byte IPC handle");
constexpr uint32_t kKeyMagic = 0x4b45434c;  // "LCEK" in memory order

constexpr std::chrono::milliseconds kCloseDrain{5000};

// Writes between two buffers of one GPU (ranks sharing a GPU, LOOM_RANKS_PER_GPU) go through
// pinned host memory in pieces of this size: the driver runs a same-GPU cudaMemcpyAsync as a
// kernel on the SMs, which cannot start while a persistent loom kernel of this process holds
// every SM and waits for that very copy (measured on H200: a same-GPU copy of 8 B or 1 MiB did
// not land in 1 s under such a kernel; device-to-host and host-to-device copies landed in
// 0.6-2.4 ms). The copy engines move D2H and H2D copies whatever the SMs run.
constexpr uint64_t kBounceBytes = uint64_t{4} << 20;

// The GPU (ordinal in this process) whose memory `ptr` is, or -1 for host or unknown memory.
int device_of(const void* ptr) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return attributes.type == cudaMemoryTypeDevice ? attributes.device : -1;
}

class CopyEngineTransport final : public TransportBase {
 public:
  CopyEngineTransport(TransportConfig config, CopyEngineOptions options)
      : TransportBase(TransportKind::kCopyEngine, "copy_engine"),
        config_(std::move(config)), options_(std::move(options)),
        shaper_(options_.emulate_gbps, options_.emulate_latency_us) {}
  ~CopyEngineTransport() override { (void)close(); }

  Status init() {
    LOOM_CUDA_TRY(cudaSetDevice(options_.device));
    LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    slots_.resize(options_.queue_depth);
    for (uint32_t i = 0; i < options_.queue_depth; ++i) {
      LOOM_CUDA_TRY(cudaEventCreateWithFlags(&slots_[i].done, cudaEventDisableTiming));
      free_slots_.push_back(options_.queue_depth - 1 - i);
    }
    LOOM_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&staging_), options_.queue_depth * sizeof(uint64_t), cudaHostAllocPortable));
    caps_.ordered_writes = true;  // one stream: every copy starts after the previous one ended
    caps_.max_write_bytes = uint64_t{1} << 30;
    caps_.max_outstanding = options_.queue_depth;
    describe_ = "copy_engine on device " + std::to_string(options_.device);
    if (shaper_.enabled()) {
      describe_ += " emulating " + (options_.emulate_gbps > 0 ? std::to_string(options_.emulate_gbps) + " GB/s" : std::string("unlimited rate")) +
                   " and " + std::to_string(options_.emulate_latency_us) + " us";
    }
    LOOM_INFO("%s", describe_.c_str());
    return {};
  }

  Result<LocalRegistration> register_memory(const MemoryRegion& region) override {
    LOOM_TRY(check_registrable(region));
    if (region.kind == MemoryKind::kDevice && region.device < 0) {
      return Status::invalid_argument("copy_engine: a device memory region needs its CUDA device ordinal");
    }
    WireKey key{};
    key.magic = kKeyMagic;
    key.device = region.device;
    key.pid = static_cast<int32_t>(::getpid());
    key.owner_address = reinterpret_cast<uint64_t>(region.base);
    key.bytes = region.bytes;
    if (region.kind == MemoryKind::kDevice) {
      LOOM_CUDA_TRY(cudaSetDevice(options_.device));
      // Legacy IPC works for cudaMalloc memory; cuMem (VMM) memory reaches peers via map_peer, so
      // a range the driver cannot describe (or export) is registered without an IPC handle and
      // the importer must have a mapping of it. A legacy IPC handle names a whole allocation.
      Result<DeviceAllocation> range = device_allocation_of(region.base);
      if (range.ok()) {
        if (key.owner_address + region.bytes > range->base + range->bytes) {
          return Status::invalid_argument("copy_engine: region runs past the end of its allocation");
        }
        key.offset_in_allocation = key.owner_address - range->base;
        if (cudaIpcGetMemHandle(&key.ipc, reinterpret_cast<void*>(range->base)) == cudaSuccess) {
          key.has_ipc = 1;
        } else {
          cudaGetLastError();
        }
      } else {
        LOOM_DEBUG("copy_engine: registering %p without an IPC handle (%s)", region.base, range.status().to_string().c_str());
      }
    }
    locals_.push_back(Local{static_cast<char*>(region.base), region.bytes,
                            region.kind == MemoryKind::kDevice ? region.device : -1});
    LocalRegistration out;
    out.handle = static_cast<uint32_t>(locals_.size() - 1);
    out.bytes = region.bytes;
    out.remote_key.resize(sizeof(key));
    std::memcpy(out.remote_key.data(), &key, sizeof(key));
    return out;
  }

  // Nothing to exchange: peers are reached through their registrations' keys.
  Result<std::vector<uint8_t>> local_endpoint() override { return std::vector<uint8_t>{}; }
  Status connect(std::span<const std::vector<uint8_t>>) override { return {}; }

  Result<uint32_t> import_remote(int rank, std::span<const uint8_t> remote_key, uint64_t bytes) override {
    WireKey key{};
    if (remote_key.size() != sizeof(key)) return Status::internal("copy_engine: malformed window key of rank " + std::to_string(rank));
    std::memcpy(&key, remote_key.data(), sizeof(key));
    if (key.magic != kKeyMagic || key.bytes != bytes) {
      return Status::internal("copy_engine: window key of rank " + std::to_string(rank) + " does not match");
    }
    void* mapped = options_.map_peer ? options_.map_peer(rank, key.owner_address, key.bytes) : nullptr;
    if (mapped == nullptr) {
      if (!key.has_ipc) {
        return Status::unsupported("copy_engine: rank " + std::to_string(rank) +
                                   "'s window is not cudaMalloc memory (no IPC handle) and this process has no mapping of it");
      }
      LOOM_CUDA_TRY(cudaSetDevice(options_.device));
      const std::string handle_bytes(reinterpret_cast<const char*>(&key.ipc), sizeof(key.ipc));
      auto it = opened_.find({rank, handle_bytes});
      if (it == opened_.end()) {
        void* base = nullptr;
        LOOM_CUDA_TRY(cudaIpcOpenMemHandle(&base, key.ipc, cudaIpcMemLazyEnablePeerAccess));
        it = opened_.emplace(std::make_pair(rank, handle_bytes), base).first;
      }
      mapped = static_cast<char*>(it->second) + key.offset_in_allocation;
    }
    const int device = device_of(mapped);
    if (device >= 0 && device == options_.device && bounce_ == nullptr) {
      LOOM_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&bounce_), kBounceBytes, cudaHostAllocPortable));
      LOOM_INFO("copy_engine: rank %d's memory is on this GPU (shared-GPU mode): writes to it go through pinned host "
                "memory, since a same-GPU copy would need the SMs a loom kernel holds", rank);
    }
    remotes_.push_back(Remote{rank, static_cast<char*>(mapped), key.bytes, device});
    return static_cast<uint32_t>(remotes_.size() - 1);
  }

  Result<size_t> post_writes(std::span<const WriteOp> ops) override {
    LOOM_TRY(check_open());
    LOOM_CUDA_TRY(cudaSetDevice(options_.device));
    size_t taken = 0;
    for (const WriteOp& op : ops) {
      if (free_slots_.empty()) break;
      if (op.local >= locals_.size() || op.remote >= remotes_.size() || remotes_[op.remote].rank != op.rank ||
          !within(op.local_offset, op.bytes, locals_[op.local].bytes) ||
          !within(op.remote_offset, op.bytes, remotes_[op.remote].bytes)) {
        return Status::internal("copy_engine: write " + std::to_string(op.id) + " outside its registrations");
      }
      const uint32_t s = take_slot(op.id, op.rank, false, op.bytes);
      slots_[s].destination = remotes_[op.remote].base + op.remote_offset;
      slots_[s].source = locals_[op.local].base + op.local_offset;
      slots_[s].through_host = locals_[op.local].device >= 0 && locals_[op.local].device == remotes_[op.remote].device;
      LOOM_TRY(submit(s));
      ++taken;
    }
    return taken;
  }

  Result<bool> post_flag(const FlagOp& op) override {
    LOOM_TRY(check_open());
    if (free_slots_.empty()) return false;
    if (!flag_in_window(remotes_, op)) {
      return Status::internal("copy_engine: flag outside its window");
    }
    LOOM_CUDA_TRY(cudaSetDevice(options_.device));
    const uint32_t s = take_slot(op.id, op.rank, true, sizeof(uint64_t));
    staging_[s] = op.value;  // the slot's staging word stays untouched until its event completes
    slots_[s].destination = remotes_[op.remote].base + op.remote_offset;
    slots_[s].source = reinterpret_cast<char*>(&staging_[s]);
    slots_[s].through_host = false;  // host to device already
    LOOM_TRY(submit(s));
    return true;
  }

  Status poll(std::vector<Completion>& out) override {
    if (closed_) return {};
    LOOM_CUDA_TRY(cudaSetDevice(options_.device));
    LOOM_TRY(issue_due());
    while (!issued_.empty()) {
      const uint32_t s = issued_.front();
      const cudaError_t state = cudaEventQuery(slots_[s].done);
      if (state == cudaErrorNotReady) break;
      Completion c;
      c.id = slots_[s].id;
      if (state != cudaSuccess) {
        cudaGetLastError();
        c.status = Status::cuda_error("copy_engine: " + std::string(slots_[s].is_flag ? "flag" : "copy") + " of " +
                                      std::to_string(slots_[s].bytes) + " bytes to rank " + std::to_string(slots_[s].rank) +
                                      " failed: " + cudaGetErrorString(state) + " (" + cudaGetErrorName(state) + ")");
      }
      out.push_back(std::move(c));
      issued_.pop_front();
      free_slots_.push_back(s);
    }
    return {};
  }

  uint32_t outstanding() const override { return options_.queue_depth - static_cast<uint32_t>(free_slots_.size()); }

  Status close() override {
    if (closed_) return {};
    closed_ = true;
    Status first;
    auto note = [&](cudaError_t err, const char* what) {
      if (err != cudaSuccess && first.ok()) first = cuda_status(err, what, __FILE__, __LINE__);
    };
    cudaSetDevice(options_.device);
    // Bounded: copies still queued get kCloseDrain to finish (the proxy drained before this).
    if (stream_ != nullptr) {
      const auto deadline = std::chrono::steady_clock::now() + kCloseDrain;
      cudaError_t state = cudaStreamQuery(stream_);
      while (state == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        state = cudaStreamQuery(stream_);
      }
      if (state == cudaErrorNotReady) {
        LOOM_WARN("copy_engine: copies still running %lld ms after close; releasing anyway",
                  static_cast<long long>(kCloseDrain.count()));
      } else {
        note(state, "cudaStreamQuery");
      }
    }
    for (auto& [key, base] : opened_) note(cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle");
    opened_.clear();
    for (Slot& s : slots_) {
      if (s.done != nullptr) note(cudaEventDestroy(s.done), "cudaEventDestroy");
    }
    slots_.clear();
    if (staging_ != nullptr) note(cudaFreeHost(staging_), "cudaFreeHost");
    staging_ = nullptr;
    if (bounce_ != nullptr) note(cudaFreeHost(bounce_), "cudaFreeHost");
    bounce_ = nullptr;
    if (stream_ != nullptr) note(cudaStreamDestroy(stream_), "cudaStreamDestroy");
    stream_ = nullptr;
    return first;
  }

 private:
  struct Local {
    char* base;
    uint64_t bytes;
    int device;  // GPU ordinal of device memory, -1 for host memory
  };
  struct Remote {
    int rank;
    char* base;  // mapped in this process
    uint64_t bytes;
    int device;  // GPU ordinal the memory lives on (-1: unknown)
  };
  struct Slot {
    cudaEvent_t done = nullptr;
    uint64_t id = 0;
    int rank = -1;
    bool is_flag = false;
    uint64_t bytes = 0;
    char* destination = nullptr;
    const char* source = nullptr;
    bool through_host = false;  // same-GPU write: bounced through `bounce_` (kBounceBytes)
    LinkShaper::Clock::time_point not_before{};
  };

  uint32_t take_slot(uint64_t id, int rank, bool is_flag, uint64_t bytes) {
    const uint32_t s = free_slots_.back();
    free_slots_.pop_back();
    Slot& slot = slots_[s];
    slot.id = id;
    slot.rank = rank;
    slot.is_flag = is_flag;
    slot.bytes = bytes;
    return s;
  }

  // Issues now, or queues behind the emulated link.
  Status submit(uint32_t s) {
    if (shaper_.enabled()) {
      slots_[s].not_before = shaper_.schedule(slots_[s].bytes, LinkShaper::Clock::now());
      deferred_.push_back(s);
      return issue_due();
    }
    return issue(s);
  }

  Status issue_due() {
    const auto now = LinkShaper::Clock::now();
    while (!deferred_.empty() && slots_[deferred_.front()].not_before <= now) {
      const uint32_t s = deferred_.front();
      deferred_.pop_front();
      LOOM_TRY(issue(s));
    }
    return {};
  }

  Status issue(uint32_t s) {
    Slot& slot = slots_[s];
    if (slot.through_host) {
      // One bounce buffer serves every piece: the stream runs each copy after the previous one
      // ended, so a piece's device-to-host copy starts only once the last piece left the buffer.
      for (uint64_t done = 0; done < slot.bytes; done += kBounceBytes) {
        const uint64_t piece = std::min(kBounceBytes, slot.bytes - done);
        LOOM_CUDA_TRY(cudaMemcpyAsync(bounce_, slot.source + done, piece, cudaMemcpyDeviceToHost, stream_));
        LOOM_CUDA_TRY(cudaMemcpyAsync(slot.destination + done, bounce_, piece, cudaMemcpyHostToDevice, stream_));
      }
    } else {
      LOOM_CUDA_TRY(cudaMemcpyAsync(slot.destination, slot.source, slot.bytes, cudaMemcpyDefault, stream_));
    }
    LOOM_CUDA_TRY(cudaEventRecord(slot.done, stream_));
    issued_.push_back(s);
    return {};
  }

  TransportConfig config_;
  CopyEngineOptions options_;
  LinkShaper shaper_;
  cudaStream_t stream_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  std::deque<uint32_t> deferred_;  // waiting for the emulated link, in order
  std::deque<uint32_t> issued_;    // on the stream, in order
  uint64_t* staging_ = nullptr;    // pinned: one flag word per slot
  char* bounce_ = nullptr;         // pinned, kBounceBytes: same-GPU writes (allocated on first need)
  std::vector<Local> locals_;
  std::vector<Remote> remotes_;
  std::map<std::pair<int, std::string>, void*> opened_;  // (rank, IPC handle) -> opened base
};

}  // namespace

Result<std::unique_ptr<Transport>> create_copy_engine_transport(const TransportConfig& config,
                                                                const CopyEngineOptions& options) {
  if (config.world_size < 1 || config.rank < 0 || config.rank >= config.world_size ||
      config.peers.size() != static_cast<size_t>(config.world_size)) {
    return Status::invalid_argument("copy_engine: inconsistent transport config");
  }
  if (options.queue_depth == 0) return Status::invalid_argument("copy_engine: queue depth 0");
  if (options.emulate_gbps < 0 || options.emulate_latency_us < 0) {
    return Status::invalid_argument("copy_engine: negative emulated rate or latency");
  }
  auto transport = std::make_unique<CopyEngineTransport>(config, options);
  LOOM_TRY(transport->init());
  return std::unique_ptr<Transport>(std::move(transport));
}

}  // namespace loom::runtime::net
