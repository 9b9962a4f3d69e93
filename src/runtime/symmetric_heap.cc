#include "runtime/symmetric_heap.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/log.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_driver.h"
#include "runtime/device_abi.h"
#include "runtime/heap_self_test.h"
#include "runtime/ipc_socket.h"

namespace loom::runtime {

static_assert(std::is_same_v<CUmemGenericAllocationHandle, unsigned long long> &&
                  sizeof(CUmemGenericAllocationHandle) == sizeof(uint64_t),
              "map_vmm() passes a CUmemGenericAllocationHandle as uint64_t");
static_assert(std::is_same_v<CUdevice, int>, "cu_device_ stores a CUdevice as int");

namespace {

// Heap size granule where cuMem is not used (ipc backend, or the device cannot export): the
// cuMem granularity of current GPUs, so a job's heap size does not depend on the backend.
constexpr uint64_t kFallbackGranularity = uint64_t{2} << 20;

// Non-returning forms of LOOM_CUDA_TRY / LOOM_CU_TRY, for cleanup that must run every step.
#define LOOM_CUDA_STATUS(expr) cuda_result((expr), #expr, __FILE__, __LINE__)
#define LOOM_CU_STATUS(expr) cu_result((expr), #expr, __FILE__, __LINE__)
Status cuda_result(cudaError_t err, const char* expr, const char* file, int line) {
  return err == cudaSuccess ? Status::ok_status() : cuda_status(err, expr, file, line);
}
Status cu_result(CUresult result, const char* expr, const char* file, int line) {
  return result == CUDA_SUCCESS ? Status::ok_status() : cu_status(result, expr, file, line);
}

void keep_first_failure(Status& first, Status next) {
  if (first.ok() && !next.ok()) first = std::move(next);
}

// Makes `device` current for the guard's scope and restores the caller's device afterwards
// (frameworks keep their own current device; the heap must not change it behind their back).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = LOOM_CUDA_STATUS(cudaSetDevice(device));
    if (previous_ == device) previous_ = -1;
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

// Releases a cuMem allocation handle at scope exit. Mappings keep the memory alive, so the
// handle is only needed until every mapping of it exists.
class AllocationHandle {
 public:
  explicit AllocationHandle(const CudaDriver& driver) : driver_(driver) {}
  ~AllocationHandle() {
    if (!valid_) return;
    Status s = LOOM_CU_STATUS(driver_.cuMemRelease(handle_));
    if (!s.ok()) LOOM_WARN("symmetric heap: %s", s.to_string().c_str());
  }
  AllocationHandle(const AllocationHandle&) = delete;
  AllocationHandle& operator=(const AllocationHandle&) = delete;
  // For the create/import call; the handle counts as owned once that call returned success.
  CUmemGenericAllocationHandle* receive() { return &handle_; }
  void mark_owned() { valid_ = true; }
  CUmemGenericAllocationHandle get() const { return handle_; }

 private:
  const CudaDriver& driver_;
  CUmemGenericAllocationHandle handle_ = 0;
  bool valid_ = false;
};

CUmemAllocationProp exportable_allocation(CUdevice device, bool gpu_direct_rdma) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  // Lets the later dma-buf registration hand this memory to a NIC.
  prop.allocFlags.gpuDirectRDMACapable = gpu_direct_rdma ? 1 : 0;
  return prop;
}

// Creates one `bytes` allocation and exports it as a POSIX fd.
Result<UniqueFd> create_and_export(const CudaDriver& driver, const CUmemAllocationProp& prop, uint64_t bytes,
                                   AllocationHandle& handle) {
  LOOM_CU_TRY(driver.cuMemCreate(handle.receive(), bytes, &prop, 0));
  handle.mark_owned();
  int fd = -1;
  LOOM_CU_TRY(driver.cuMemExportToShareableHandle(&fd, handle.get(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  return UniqueFd(fd);
}

// Whether this GPU can back a vmm heap: what the driver and device report, then a real export of
// one granule (in some containers the attribute says yes and only the export fails).
struct VmmSupport {
  bool usable = false;
  std::string why_not;
  const CudaDriver* driver = nullptr;
  CUdevice device = 0;
  bool gpu_direct_rdma = false;
  uint64_t granularity = kFallbackGranularity;
};

VmmSupport probe_vmm(int device) {
  VmmSupport support;
  Result<const CudaDriver*> driver = cuda_driver();
  if (!driver.ok()) {
    support.why_not = driver.status().to_string();
    return support;
  }
  const CudaDriver& d = **driver;
  support.driver = &d;
  auto attribute = [&](CUdevice_attribute which, const char* name) -> Result<int> {
    int value = 0;
    const CUresult r = d.cuDeviceGetAttribute(&value, which, support.device);
    if (r != CUDA_SUCCESS) return cu_status(r, name, __FILE__, __LINE__);
    return value;
  };
  Status probed = [&]() -> Status {
    LOOM_CU_TRY(d.cuDeviceGet(&support.device, device));
    LOOM_ASSIGN_OR_RETURN(const int vmm, attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                                   "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"));
    if (vmm == 0) return Status::unsupported("the device does not support cuMem virtual memory management");
    LOOM_ASSIGN_OR_RETURN(const int fd_export, attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                                         "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"));
    if (fd_export == 0) return Status::unsupported("the device cannot export cuMem allocations as POSIX file descriptors");
    LOOM_ASSIGN_OR_RETURN(const int rdma, attribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                                    "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"));
    support.gpu_direct_rdma = rdma != 0;
    const CUmemAllocationProp prop = exportable_allocation(support.device, support.gpu_direct_rdma);
    size_t granularity = 0;
    LOOM_CU_TRY(d.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    if (granularity == 0 || (granularity & (granularity - 1)) != 0) {
      return Status::unsupported("the driver reports a cuMem granularity of " + std::to_string(granularity) +
                                 " B, not a power of two");
    }
    support.granularity = granularity;
    AllocationHandle probe(d);
    return create_and_export(d, prop, granularity, probe).status();
  }();
  support.usable = probed.ok();
  if (!probed.ok()) {
    support.why_not = probed.to_string();
    support.granularity = kFallbackGranularity;
  }
  return support;
}

// Drawn by rank 0 and broadcast (C1): names this heap's sockets and keys its self-test pattern,
// so two heaps (of one job or two) never mix. 32 bytes.
struct HeapRunIds {
  SocketTag socket_tag;
  uint64_t self_test_nonce;
  uint64_t reserved;
};
static_assert(sizeof(HeapRunIds) == 32, "HeapRunIds is exchanged raw");

// What each rank says about itself before any memory is shared (C2, all_gather'd raw; 72 bytes).
struct HeapProposal {
  uint64_t requested_bytes;
  uint64_t reserved_prefix_bytes;
  uint64_t self_test_offset;
  uint64_t granularity;        // cuMem recommended granularity, or kFallbackGranularity
  uint8_t requested_backend;   // env::HeapBackend
  uint8_t vmm_usable;          // probe_vmm() passed
  uint8_t reserved[6];
  char pci_bus_id[32];         // of this rank's GPU
};
static_assert(sizeof(HeapProposal) == 72, "HeapProposal is exchanged raw");

// C3 (all_gather'd raw; 72 bytes): the ipc backend's handle of this rank's heap. Zero on vmm
// ranks, whose descriptors travel over the Unix socket instead. The gather doubles as the
// barrier after which every vmm rank's socket is listening.
struct HeapShareRecord {
  cudaIpcMemHandle_t ipc_handle;
  uint64_t bytes;
};
static_assert(sizeof(HeapShareRecord) == 72, "HeapShareRecord is exchanged raw");

// C5 (all_gather'd raw; 32 bytes): what each owner found in its self-test area.
struct SelfTestReport {
  int32_t bad_writer;  // local rank, -1: all words right
  uint32_t word;
  uint64_t expected;
  uint64_t observed;
  int32_t local_rank;
  int32_t backend;     // env::HeapBackend
};
static_assert(sizeof(SelfTestReport) == 32, "SelfTestReport is exchanged raw");

std::string bus_id_text(const char (&pci_bus_id)[32]) {
  return std::string(pci_bus_id, strnlen(pci_bus_id, sizeof(pci_bus_id)));
}

std::string bytes_text(uint64_t bytes) {
  char text[64];
  std::snprintf(text, sizeof(text), "%" PRIu64 " B (%.1f MiB)", bytes, static_cast<double>(bytes) / (1 << 20));
  return text;
}

}  // namespace

const char* heap_backend_name(env::HeapBackend backend) {
  switch (backend) {
    case env::HeapBackend::kAuto: return "auto";
    case env::HeapBackend::kVmm: return "vmm";
    case env::HeapBackend::kIpc: return "ipc";
  }
  return "unknown";
}

struct SymmetricHeap::InitState {
  VmmSupport vmm;
  char pci_bus_id[32] = {};
  HeapRunIds run{};
  std::vector<HeapProposal> proposals;  // [world]
  UniqueFd exported_fd;                 // vmm: our heap, for the local peers
  cudaIpcMemHandle_t ipc_handle{};      // ipc: our heap, for the local peers
  std::optional<FdExchange> exchange;   // vmm: outgoing connections stay open until init ends
  bool every_rank_returns_this_failure = false;  // no need to report_failure
};

Result<std::unique_ptr<SymmetricHeap>> SymmetricHeap::create(Bootstrap& bootstrap, const Topology& topology,
                                                             const HeapOptions& options) {
  std::unique_ptr<SymmetricHeap> heap(new SymmetricHeap());
  InitState state;
  Status status = heap->init(bootstrap, topology, options, state);
  if (status.ok()) return heap;
  status.with_context("symmetric heap");
  Status cleanup;
  if (state.every_rank_returns_this_failure) {
    // Every rank is on this path: unmap the peers' heaps, wait for all, then free ours (the
    // order legacy IPC requires; see close()).
    cleanup = heap->release_peer_mappings();
    keep_first_failure(cleanup, bootstrap.barrier());
  } else {
    bootstrap.report_failure(status.to_string());
  }
  keep_first_failure(cleanup, heap->close());
  if (!cleanup.ok()) LOOM_WARN("cleaning up after a failed heap init: %s", cleanup.to_string().c_str());
  return status;
}

SymmetricHeap::~SymmetricHeap() {
  Status s = close();
  if (!s.ok()) LOOM_WARN("closing the symmetric heap: %s", s.to_string().c_str());
}

Status SymmetricHeap::init(Bootstrap& bootstrap, const Topology& topology, const HeapOptions& options,
                           InitState& state) {
  device_ = options.device;
  local_rank_ = topology.local_rank;
  local_world_ = topology.local_world_size;
  if (local_world_ < 1 || local_rank_ < 0 || local_rank_ >= local_world_ ||
      static_cast<int>(topology.local_peers.size()) != local_world_) {
    return Status::invalid_argument("topology has local rank " + std::to_string(local_rank_) + " of " +
                                    std::to_string(local_world_) + " with " +
                                    std::to_string(topology.local_peers.size()) + " local peers");
  }
  const uint64_t self_test_bytes = uint64_t{8} * ControlLayout::kSelfTestWords * static_cast<uint64_t>(local_world_);
  if (options.self_test_offset % 8 != 0 || options.self_test_offset > options.reserved_prefix_bytes ||
      options.reserved_prefix_bytes - options.self_test_offset < self_test_bytes) {
    return Status::invalid_argument("the self-test area (" + std::to_string(self_test_bytes) + " B at offset " +
                                    std::to_string(options.self_test_offset) +
                                    ", 8-byte aligned) must lie inside the reserved prefix of " +
                                    std::to_string(options.reserved_prefix_bytes) + " B");
  }
  if (options.bytes <= options.reserved_prefix_bytes) {
    return Status::invalid_argument("heap of " + bytes_text(options.bytes) + " leaves no room after the " +
                                    bytes_text(options.reserved_prefix_bytes) + " control region; raise LOOM_HEAP_BYTES");
  }

  ScopedDevice on_device(device_);
  LOOM_TRY(on_device.status());
  LOOM_CUDA_TRY(cudaDeviceGetPCIBusId(state.pci_bus_id, sizeof(state.pci_bus_id), device_));
  if (options.backend != env::HeapBackend::kIpc) {
    state.vmm = probe_vmm(device_);
    if (!state.vmm.usable) LOOM_DEBUG("symmetric heap: cuMem fd export unusable: %s", state.vmm.why_not.c_str());
  }

  // C1: the run's socket tag and self-test nonce, drawn by rank 0.
  if (bootstrap.rank() == 0) {
    LOOM_ASSIGN_OR_RETURN(const SocketTag tag, random_socket_tag());
    LOOM_ASSIGN_OR_RETURN(const SocketTag nonce, random_socket_tag());
    state.run.socket_tag = tag;
    std::memcpy(&state.run.self_test_nonce, nonce.data(), sizeof(state.run.self_test_nonce));
  }
  LOOM_TRY_CTX(bootstrap.broadcast(&state.run, sizeof(state.run), 0), "broadcasting the heap's run ids");

  // C2: every rank's request and capabilities.
  HeapProposal mine{};
  mine.requested_bytes = options.bytes;
  mine.reserved_prefix_bytes = options.reserved_prefix_bytes;
  mine.self_test_offset = options.self_test_offset;
  mine.granularity = state.vmm.granularity;
  mine.requested_backend = static_cast<uint8_t>(options.backend);
  mine.vmm_usable = state.vmm.usable ? 1 : 0;
  std::memcpy(mine.pci_bus_id, state.pci_bus_id, sizeof(mine.pci_bus_id));
  state.proposals.resize(static_cast<size_t>(bootstrap.world_size()));
  LOOM_TRY_CTX(bootstrap.all_gather(&mine, state.proposals.data(), sizeof(HeapProposal)), "exchanging heap proposals");

  Status decided = decide_layout(topology, options, state);
  if (!decided.ok()) {
    state.every_rank_returns_this_failure = true;
    return decided;
  }
  LOOM_TRY(check_peer_reachability(topology, state));
  LOOM_TRY(create_local_heap(state));
  LOOM_TRY(map_peer_heaps(bootstrap, topology, options, state));

  LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&device_peer_bases_), sizeof(uint64_t) * peer_bases_.size()));
  std::vector<uint64_t> bases(peer_bases_.size());
  for (size_t i = 0; i < bases.size(); ++i) bases[i] = reinterpret_cast<uint64_t>(peer_bases_[i]);
  LOOM_CUDA_TRY(cudaMemcpy(device_peer_bases_, bases.data(), sizeof(uint64_t) * bases.size(), cudaMemcpyHostToDevice));

  LOOM_TRY(run_self_test(bootstrap, topology, options, state));
  LOOM_ASSIGN_OR_RETURN(HeapAllocator allocator, HeapAllocator::create(options.reserved_prefix_bytes, size_));
  allocator_.emplace(std::move(allocator));
  LOOM_INFO("symmetric heap ready: %s backend, %s per GPU, local rank %d of %d", backend_name(), bytes_text(size_).c_str(),
            local_rank_, local_world_);
  return Status::ok_status();
}

// Every rank computes this from the same gathered proposals, for every node, so a bad request
// fails on all ranks alike (no rank is left waiting in a later step) and all agree on the size.
Status SymmetricHeap::decide_layout(const Topology& topology, const HeapOptions& options, InitState& state) {
  const std::vector<HeapProposal>& all = state.proposals;
  uint64_t granularity = kFallbackGranularity;
  for (size_t r = 0; r < all.size(); ++r) {
    auto differs = [&](const char* what, const std::string& theirs, const std::string& ours) {
      return Status::invalid_argument(std::string(what) + " differs between ranks: rank " + std::to_string(r) + " has " +
                                      theirs + ", rank " + std::to_string(topology.rank) + " has " + ours +
                                      "; every rank must use the same value");
    };
    if (all[r].requested_bytes != options.bytes) {
      return differs("LOOM_HEAP_BYTES", std::to_string(all[r].requested_bytes), std::to_string(options.bytes));
    }
    if (all[r].requested_backend != static_cast<uint8_t>(options.backend)) {
      return differs("LOOM_HEAP_BACKEND", heap_backend_name(static_cast<env::HeapBackend>(all[r].requested_backend)),
                     heap_backend_name(options.backend));
    }
    if (all[r].reserved_prefix_bytes != options.reserved_prefix_bytes) {
      return differs("the heap's reserved prefix", std::to_string(all[r].reserved_prefix_bytes),
                     std::to_string(options.reserved_prefix_bytes));
    }
    if (all[r].self_test_offset != options.self_test_offset) {
      return differs("the heap's self-test offset", std::to_string(all[r].self_test_offset),
                     std::to_string(options.self_test_offset));
    }
    if (all[r].granularity == 0 || (all[r].granularity & (all[r].granularity - 1)) != 0) {
      return Status::internal("rank " + std::to_string(r) + " reports granularity " + std::to_string(all[r].granularity));
    }
    granularity = std::max(granularity, all[r].granularity);
  }
  if (options.bytes > UINT64_MAX - (granularity - 1)) {
    return Status::invalid_argument("LOOM_HEAP_BYTES=" + std::to_string(options.bytes) + " overflows");
  }
  size_ = (options.bytes + granularity - 1) & ~(granularity - 1);
  granularity_ = granularity;

  // Backend: one per node; vmm only where every GPU of the node can export.
  for (int node = 0; node < topology.num_nodes; ++node) {
    int first_unable = -1;  // global rank
    for (size_t r = 0; r < all.size(); ++r) {
      if (topology.node_of_rank[r] != node || all[r].vmm_usable != 0) continue;
      if (first_unable < 0 || topology.local_rank_of_rank[r] < topology.local_rank_of_rank[first_unable]) {
        first_unable = static_cast<int>(r);
      }
    }
    std::string unable;
    if (first_unable >= 0) {
      unable = "local rank " + std::to_string(topology.local_rank_of_rank[first_unable]) + " of node " +
               std::to_string(node) + " (GPU " + bus_id_text(all[first_unable].pci_bus_id) +
               ") cannot export cuMem allocations as POSIX file descriptors" +
               (first_unable == topology.rank ? ": " + state.vmm.why_not : std::string(" (its log says why at debug level)"));
    }
    env::HeapBackend chosen = env::HeapBackend::kIpc;
    if (options.backend == env::HeapBackend::kVmm) {
      if (first_unable >= 0) {
        return Status::unsupported("LOOM_HEAP_BACKEND=vmm, but " + unable + "; use LOOM_HEAP_BACKEND=ipc or auto");
      }
      chosen = env::HeapBackend::kVmm;
    } else if (options.backend == env::HeapBackend::kAuto) {
      chosen = first_unable < 0 ? env::HeapBackend::kVmm : env::HeapBackend::kIpc;
    }
    if (node != topology.node) continue;
    backend_ = chosen;
    if (options.backend == env::HeapBackend::kAuto) {
      LOOM_INFO("symmetric heap: %s backend (%s)", backend_name(),
                first_unable < 0 ? "every local GPU exports cuMem allocations as file descriptors" : unable.c_str());
    }
  }
  if (backend_ == env::HeapBackend::kVmm) cu_device_ = state.vmm.device;
  return Status::ok_status();
}

// Where a peer's GPU is also visible in this process, ask the runtime whether ours can reach it
// (a peer on our own GPU can: shared-GPU mode); a pair without a peer path fails here, by name,
// rather than as a fault in the first kernel.
// (Peers outside this process's CUDA_VISIBLE_DEVICES are covered by the self-test.)
Status SymmetricHeap::check_peer_reachability(const Topology& topology, const InitState& state) const {
  for (int local = 0; local < local_world_; ++local) {
    if (local == local_rank_) continue;
    const int peer_rank = topology.local_peers[local];
    const std::string peer_bus = bus_id_text(state.proposals[static_cast<size_t>(peer_rank)].pci_bus_id);
    int peer_device = -1;
    if (cudaDeviceGetByPCIBusId(&peer_device, peer_bus.c_str()) != cudaSuccess) {
      cudaGetLastError();  // not visible here; clear the (non-sticky) error
      continue;
    }
    // A peer on this very GPU (the shared-GPU mode; the topology refuses it otherwise) reaches
    // our heap through its own mapping of the allocation: no peer path is needed.
    if (peer_device == device_) continue;
    int reachable = 0;
    LOOM_CUDA_TRY(cudaDeviceCanAccessPeer(&reachable, device_, peer_device));
    if (reachable == 0) {
      return Status::unsupported("GPU " + bus_id_text(state.pci_bus_id) + " (rank " + std::to_string(topology.rank) +
                                 ", local rank " + std::to_string(local_rank_) + ") cannot access GPU " + peer_bus +
                                 " (rank " + std::to_string(peer_rank) + ", local rank " + std::to_string(local) +
                                 ") peer to peer; every GPU of a node must reach every other over NVLink or PCIe");
    }
  }
  return Status::ok_status();
}

Status SymmetricHeap::create_local_heap(InitState& state) {
  peer_bases_.assign(static_cast<size_t>(local_world_), nullptr);
  if (backend_ == env::HeapBackend::kIpc) {
    void* base = nullptr;
    LOOM_CUDA_TRY(cudaMalloc(&base, size_));
    mappings_.push_back({Mapping::Kind::kCudaMalloc, /*own=*/true, base, size_, false});
    LOOM_CUDA_TRY(cudaIpcGetMemHandle(&state.ipc_handle, base));
    local_base_ = base;
  } else {
    const CudaDriver& d = *state.vmm.driver;
    AllocationHandle handle(d);
    const CUmemAllocationProp prop = exportable_allocation(cu_device_, state.vmm.gpu_direct_rdma);
    LOOM_ASSIGN_OR_RETURN(state.exported_fd, create_and_export(d, prop, size_, handle));
    LOOM_TRY(map_vmm(handle.get(), /*own=*/true, &local_base_));
  }
  peer_bases_[static_cast<size_t>(local_rank_)] = local_base_;
  return Status::ok_status();
}

// Reserves an address range, maps the allocation over it and grants our GPU read/write access.
// The range is recorded before the map, so close() undoes a half-done mapping.
Status SymmetricHeap::map_vmm(uint64_t handle, bool own, void** base) {
  LOOM_ASSIGN_OR_RETURN(const CudaDriver* driver, cuda_driver());
  const CudaDriver& d = *driver;
  CUdeviceptr address = 0;
  LOOM_CU_TRY(d.cuMemAddressReserve(&address, size_, granularity_, 0, 0));
  mappings_.push_back({Mapping::Kind::kVmmRange, own, reinterpret_cast<void*>(address), size_, false});
  LOOM_CU_TRY(d.cuMemMap(address, size_, 0, handle, 0));
  mappings_.back().mapped = true;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = cu_device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  LOOM_CU_TRY(d.cuMemSetAccess(address, size_, &access, 1));
  *base = reinterpret_cast<void*>(address);
  return Status::ok_status();
}

Status SymmetricHeap::map_peer_heaps(Bootstrap& bootstrap, const Topology& topology, const HeapOptions& options,
                                     InitState& state) {
  const bool vmm = backend_ == env::HeapBackend::kVmm;
  if (vmm) {
    LOOM_ASSIGN_OR_RETURN(FdExchange exchange, FdExchange::listen(state.run.socket_tag, topology.node, local_rank_,
                                                                  local_world_ - 1));
    state.exchange.emplace(std::move(exchange));
  }

  // C3: ipc handles; on vmm ranks, also "everyone is listening".
  HeapShareRecord mine{};
  if (!vmm) mine.ipc_handle = state.ipc_handle;
  mine.bytes = size_;
  std::vector<HeapShareRecord> all(static_cast<size_t>(bootstrap.world_size()));
  LOOM_TRY_CTX(bootstrap.all_gather(&mine, all.data(), sizeof(HeapShareRecord)), "exchanging heap handles");
  // The handle is a secret: keep no stray copy of ours.
  std::memset(&mine, 0, sizeof(mine));
  std::memset(&state.ipc_handle, 0, sizeof(state.ipc_handle));

  if (!vmm) {
    Status opened = [&]() -> Status {
      for (int local = 0; local < local_world_; ++local) {
        if (local == local_rank_) continue;
        void* base = nullptr;
        LOOM_CUDA_TRY(cudaIpcOpenMemHandle(&base, all[static_cast<size_t>(topology.local_peers[local])].ipc_handle,
                                           cudaIpcMemLazyEnablePeerAccess));
        mappings_.push_back({Mapping::Kind::kIpcOpened, /*own=*/false, base, size_, false});
        peer_bases_[static_cast<size_t>(local)] = base;
      }
      return Status::ok_status();
    }();
    std::memset(all.data(), 0, sizeof(HeapShareRecord) * all.size());
    return opened;
  }

  // vmm: send our descriptor to every local peer, then collect theirs (see ipc_socket.h for why
  // this order cannot deadlock).
  const Deadline deadline = Clock::now() + options.timeout;
  std::vector<int> peers;
  for (int local = 0; local < local_world_; ++local) {
    if (local == local_rank_) continue;
    peers.push_back(local);
    LOOM_TRY_CTX(state.exchange->send(local, state.exported_fd.get(), size_, deadline), "sending the heap descriptor");
  }
  state.exported_fd.reset();
  LOOM_ASSIGN_OR_RETURN(std::vector<ReceivedFd> received, state.exchange->receive(peers, deadline));
  const CudaDriver& d = *state.vmm.driver;
  for (ReceivedFd& peer : received) {
    if (peer.value != size_) {
      return Status::internal("local rank " + std::to_string(peer.local_rank) + " sent a heap of " +
                              std::to_string(peer.value) + " B, expected " + std::to_string(size_));
    }
    AllocationHandle handle(d);
    LOOM_CU_TRY(d.cuMemImportFromShareableHandle(handle.receive(),
                                                 reinterpret_cast<void*>(static_cast<uintptr_t>(peer.fd.get())),
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    handle.mark_owned();
    peer.fd.reset();  // the imported handle holds the memory now
    LOOM_TRY(map_vmm(handle.get(), /*own=*/false, &peer_bases_[static_cast<size_t>(peer.local_rank)]));
  }
  return Status::ok_status();
}

Status SymmetricHeap::run_self_test(Bootstrap& bootstrap, const Topology& topology, const HeapOptions& options,
                                    InitState& state) {
  HeapSelfTestParams params;
  params.device_peer_bases = device_peer_bases_;
  params.local_base = local_base_;
  params.local_rank = local_rank_;
  params.local_world = local_world_;
  params.self_test_offset = options.self_test_offset;
  params.nonce = state.run.self_test_nonce;
  params.flip_bits = options.self_test_flip_bits;

  cudaStream_t stream = nullptr;
  LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Status wrote = [&]() -> Status {
    LOOM_TRY(launch_heap_self_test_writes(params, stream));
    LOOM_CUDA_TRY(cudaStreamSynchronize(stream));
    return Status::ok_status();
  }();
  keep_first_failure(wrote, LOOM_CUDA_STATUS(cudaStreamDestroy(stream)));
  LOOM_TRY_CTX(wrote, "self-test writes");

  // C4: every rank's writes have completed before any owner reads.
  LOOM_TRY_CTX(bootstrap.barrier(), "heap self-test barrier");
  LOOM_ASSIGN_OR_RETURN(const HeapSelfTestFinding finding, check_heap_self_test(params));
  // The control region starts at zero on every rank; nobody writes into our heap after C4.
  LOOM_CUDA_TRY(cudaMemset(local_base_, 0, options.reserved_prefix_bytes));
  LOOM_CUDA_TRY(cudaDeviceSynchronize());
  state.exchange.reset();

  // C5: everyone learns every owner's finding, so all ranks fail (or pass) together.
  SelfTestReport mine{finding.bad_writer, finding.word, finding.expected, finding.observed, local_rank_,
                      static_cast<int32_t>(backend_)};
  std::vector<SelfTestReport> all(static_cast<size_t>(bootstrap.world_size()));
  LOOM_TRY_CTX(bootstrap.all_gather(&mine, all.data(), sizeof(SelfTestReport)), "exchanging self-test results");
  for (size_t r = 0; r < all.size(); ++r) {
    const SelfTestReport& report = all[r];
    if (report.bad_writer < 0) continue;
    state.every_rank_returns_this_failure = true;
    char detail[160];
    std::snprintf(detail, sizeof(detail), " (rank %zu, node %d: word %u reads 0x%016" PRIx64 ", expected 0x%016" PRIx64 ")",
                  r, topology.node_of_rank[r], report.word, report.observed, report.expected);
    const bool vmm = static_cast<env::HeapBackend>(report.backend) == env::HeapBackend::kVmm;
    return Status::internal("self-test: peer writes from local rank " + std::to_string(report.bad_writer) + " through the " +
                            (vmm ? "VMM" : "CUDA IPC") + " mapping are not visible on local rank " +
                            std::to_string(report.local_rank) + detail);
  }
  return Status::ok_status();
}

void* SymmetricHeap::peer_base(int local_rank) const {
  if (local_rank < 0 || local_rank >= static_cast<int>(peer_bases_.size())) return nullptr;
  return peer_bases_[static_cast<size_t>(local_rank)];
}

Result<uint64_t> SymmetricHeap::allocate_offset(uint64_t bytes, uint64_t align) {
  if (closed_ || !allocator_) return Status::invalid_argument("heap allocate: the symmetric heap is closed");
  return allocator_->allocate(bytes, align);
}

Status SymmetricHeap::release_offset(uint64_t offset) {
  if (closed_ || !allocator_) return Status::invalid_argument("heap release: the symmetric heap is closed");
  return allocator_->release(offset);
}

Result<void*> SymmetricHeap::allocate(uint64_t bytes, uint64_t align) {
  LOOM_ASSIGN_OR_RETURN(const uint64_t offset, allocate_offset(bytes, align));
  return static_cast<void*>(static_cast<char*>(local_base_) + offset);
}

Status SymmetricHeap::release(void* ptr) {
  if (!contains(ptr, 1)) return Status::invalid_argument("heap release: pointer is not inside the symmetric heap");
  return release_offset(offset_of(ptr));
}

bool SymmetricHeap::contains(const void* ptr, uint64_t bytes) const {
  if (closed_ || local_base_ == nullptr || ptr == nullptr) return false;
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  const auto base = reinterpret_cast<uintptr_t>(local_base_);
  if (address < base || address - base >= size_) return false;
  return bytes <= size_ - (address - base);
}

Status SymmetricHeap::release_mapping(const Mapping& mapping) {
  switch (mapping.kind) {
    case Mapping::Kind::kCudaMalloc:
      return LOOM_CUDA_STATUS(cudaFree(mapping.base));
    case Mapping::Kind::kIpcOpened:
      return LOOM_CUDA_STATUS(cudaIpcCloseMemHandle(mapping.base));
    case Mapping::Kind::kVmmRange: {
      LOOM_ASSIGN_OR_RETURN(const CudaDriver* driver, cuda_driver());
      const auto address = reinterpret_cast<CUdeviceptr>(mapping.base);
      Status first;
      if (mapping.mapped) first = LOOM_CU_STATUS(driver->cuMemUnmap(address, mapping.bytes));
      keep_first_failure(first, LOOM_CU_STATUS(driver->cuMemAddressFree(address, mapping.bytes)));
      return first;
    }
  }
  return Status::internal("unknown heap mapping kind");
}

Status SymmetricHeap::release_peer_mappings() {
  if (closed_) return Status::ok_status();
  if (std::none_of(mappings_.begin(), mappings_.end(), [](const Mapping& m) { return !m.own; })) {
    return Status::ok_status();
  }
  ScopedDevice on_device(device_);
  Status first = on_device.status();
  std::vector<Mapping> ours;
  for (auto it = mappings_.rbegin(); it != mappings_.rend(); ++it) {
    if (it->own) {
      ours.push_back(*it);
    } else {
      keep_first_failure(first, release_mapping(*it));
    }
  }
  mappings_.assign(ours.rbegin(), ours.rend());
  for (size_t q = 0; q < peer_bases_.size(); ++q) {
    if (static_cast<int>(q) != local_rank_) peer_bases_[q] = nullptr;
  }
  return first;
}

Status SymmetricHeap::close() {
  if (closed_) return Status::ok_status();
  Status first = release_peer_mappings();
  closed_ = true;
  if (mappings_.empty() && device_peer_bases_ == nullptr) return first;
  ScopedDevice on_device(device_);
  keep_first_failure(first, on_device.status());
  if (device_peer_bases_ != nullptr) keep_first_failure(first, LOOM_CUDA_STATUS(cudaFree(device_peer_bases_)));
  device_peer_bases_ = nullptr;
  for (auto it = mappings_.rbegin(); it != mappings_.rend(); ++it) keep_first_failure(first, release_mapping(*it));
  mappings_.clear();
  peer_bases_.clear();
  local_base_ = nullptr;
  return first;
}

#undef LOOM_CUDA_STATUS
#undef LOOM_CU_STATUS

}  // namespace loom::runtime
