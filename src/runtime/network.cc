#include "runtime/network.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

#include "core/log.h"
#include "runtime/bootstrap.h"
#include "runtime/command_ring.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_driver.h"
#include "runtime/ipc_socket.h"
#include "runtime/symmetric_heap.h"
#include "runtime/topology.h"
#include "runtime/transports/copy_engine.h"
#include "runtime/transports/cuda_memory.h"
#include "runtime/transports/fabric.h"
#include "runtime/transports/verbs.h"

namespace loom::runtime::net {
namespace {

// A rank's local failure: the others learn it at their next bootstrap step (peer_failure naming
// this rank) instead of waiting for a deadline.
Status tell_others(Bootstrap& bootstrap, Status status, const char* what) {
  if (!status.ok()) {
    status.with_context(what);
    bootstrap.report_failure(status.to_string());
  }
  return status;
}

// One value per rank, gathered; fails on every rank alike when some rank failed locally or the
// values differ. `name` labels the message.
struct Agreement {
  int32_t ok;
  int32_t pad;
  uint64_t value;
};
static_assert(sizeof(Agreement) == 16, "Agreement is exchanged raw");

Status agree(Bootstrap& bootstrap, const Status& mine, uint64_t value, const char* name,
             const std::function<std::string(uint64_t)>& text) {
  const Agreement a{mine.ok() ? 1 : 0, 0, value};
  std::vector<Agreement> all(static_cast<size_t>(bootstrap.world_size()));
  LOOM_TRY_CTX(bootstrap.all_gather(&a, all.data(), sizeof(Agreement)), name);
  if (!mine.ok()) return Status(mine).with_context(name);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].ok == 0) return Status::peer_failure(std::string(name) + ": rank " + std::to_string(r) + " failed (its log says why)");
  }
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].value != value) {
      return Status::unsupported(std::string(name) + " differs between ranks: rank " + std::to_string(r) + " has " +
                                 text(all[r].value) + ", rank " + std::to_string(bootstrap.rank()) + " has " + text(value) +
                                 "; every rank must use the same settings");
    }
  }
  return {};
}

// Picks the transport without probing RDMA libraries when the peers are emulated nodes of this
// host (auto then means copy_engine); probes only when the choice needs it.
Result<TransportDecision> decide_transport(const NetworkSettings& settings, const Topology& topology) {
  if (settings.transport == TransportChoice::kAuto || settings.transport == TransportChoice::kCopyEngine) {
    Result<TransportDecision> d = choose_transport(settings, topology, NetworkProbe{});
    if (d.ok() || settings.transport == TransportChoice::kCopyEngine) return d;
  }
  return choose_transport(settings, topology, probe_network(settings));
}

using RetainHandle = PFN_cuMemRetainAllocationHandle_v11000;

Result<RetainHandle> retain_handle_fn() {
  static const RetainHandle fn = optional_driver_entry<RetainHandle>("cuMemRetainAllocationHandle", 11000);
  if (fn == nullptr) return Status::unsupported("the CUDA driver has no cuMemRetainAllocationHandle");
  return fn;
}

}  // namespace

double per_lane_gbps(double gbps, int lanes) { return lanes > 0 ? gbps / lanes : gbps; }

namespace {

// The flag words of a destination's window (`flag_count` words) this rank, on node `sender`, may
// write through the proxy (NetWindowLayout::sender_entry and what follows).
std::vector<WordRange> network_flag_scope(const NetWindowLayout& layout, uint32_t sender, uint64_t flag_count) {
  std::vector<WordRange> scope{WordRange{layout.sender_entry(sender), 1}, WordRange{layout.sender_sig(sender), 1}};
  if (layout.launch_base() < flag_count) scope.push_back(WordRange{layout.launch_base(), flag_count - layout.launch_base()});
  return scope;
}

}  // namespace

// ---- peer heaps (copy_engine between emulated nodes of one host) -------------------------------
//
// The symmetric heap maps only the ranks of this rank's (virtual) node. The copy engine writes
// into network peers' heaps from this process, so it needs mappings of the heaps of the same-host
// ranks of other virtual nodes: a vmm heap arrives as a cuMem POSIX fd over a Unix socket
// (FdExchange, named by the physical host and the rank's index on it), an ipc heap by its CUDA
// IPC handle (all-gathered). Mappings of vmm heaps grant this rank's GPU read/write access.
class PeerHeapMap {
 public:
  static Result<std::unique_ptr<PeerHeapMap>> create(Bootstrap& bootstrap, const Topology& topology, SymmetricHeap& heap,
                                                     int device, std::chrono::milliseconds timeout);
  ~PeerHeapMap() { (void)release(); }
  void* translate(int rank, uint64_t owner_address, uint64_t bytes) const;
  Status release();

 private:
  struct Peer {
    int rank = -1;
    uint64_t owner_base = 0;
    uint64_t bytes = 0;
    void* mapped = nullptr;
    bool vmm = false;  // else opened with cudaIpcOpenMemHandle
  };
  std::vector<Peer> peers_;
  int device_ = 0;
};

namespace {

// What each rank tells the others about its heap (all-gathered raw; 96 bytes).
struct HeapRecord {
  uint64_t base;         // the heap's address in the owner's process
  uint64_t bytes;
  int32_t vmm;           // 1: a cuMem heap (fd over the socket); 0: cudaMalloc (IPC handle below)
  int32_t host;          // physical host index
  int32_t host_local;    // index among the host's ranks
  int32_t pad;
  cudaIpcMemHandle_t ipc;  // ipc heaps only
};
static_assert(sizeof(HeapRecord) == 96, "HeapRecord is exchanged raw: 32 bytes of fields, then the 64-byte IPC handle");

Status map_vmm_fd(int fd, uint64_t bytes, int device, void** out) {
  LOOM_ASSIGN_OR_RETURN(const CudaDriver* driver, cuda_driver());
  const CudaDriver& d = *driver;
  CUdevice cu_device = 0;
  LOOM_CU_TRY(d.cuDeviceGet(&cu_device, device));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = cu_device;
  size_t granularity = 0;
  LOOM_CU_TRY(d.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  granularity = std::max<size_t>(granularity, size_t{2} << 20);
  CUmemGenericAllocationHandle handle = 0;
  LOOM_CU_TRY(d.cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CUdeviceptr address = 0;
  CUresult r = d.cuMemAddressReserve(&address, bytes, granularity, 0, 0);
  if (r == CUDA_SUCCESS) {
    r = d.cuMemMap(address, bytes, 0, handle, 0);
    if (r == CUDA_SUCCESS) {
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = cu_device;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      r = d.cuMemSetAccess(address, bytes, &access, 1);
      if (r != CUDA_SUCCESS) d.cuMemUnmap(address, bytes);
    }
    if (r != CUDA_SUCCESS) d.cuMemAddressFree(address, bytes);
  }
  d.cuMemRelease(handle);  // the mapping keeps the memory alive
  if (r != CUDA_SUCCESS) return cu_status(r, "mapping a peer heap (cuMemAddressReserve/cuMemMap/cuMemSetAccess)", __FILE__, __LINE__);
  *out = reinterpret_cast<void*>(address);
  return {};
}

Result<UniqueFd> export_own_heap(const SymmetricHeap& heap) {
  LOOM_ASSIGN_OR_RETURN(RetainHandle retain, retain_handle_fn());
  LOOM_ASSIGN_OR_RETURN(const CudaDriver* driver, cuda_driver());
  CUmemGenericAllocationHandle handle = 0;
  LOOM_CU_TRY(retain(&handle, heap.local_base()));
  int fd = -1;
  const CUresult r = driver->cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  driver->cuMemRelease(handle);
  if (r != CUDA_SUCCESS) return cu_status(r, "cuMemExportToShareableHandle(own heap)", __FILE__, __LINE__);
  return UniqueFd(fd);
}

}  // namespace

Result<std::unique_ptr<PeerHeapMap>> PeerHeapMap::create(Bootstrap& bootstrap, const Topology& topology, SymmetricHeap& heap,
                                                         int device, std::chrono::milliseconds timeout) {
  auto map = std::unique_ptr<PeerHeapMap>(new PeerHeapMap());
  map->device_ = device;
  const bool vmm = heap.backend() == env::HeapBackend::kVmm;
  HeapRecord mine{};
  mine.base = reinterpret_cast<uint64_t>(heap.local_base());
  mine.bytes = heap.size();
  mine.vmm = vmm ? 1 : 0;
  mine.host = topology.host_of_node(topology.node);
  mine.host_local = topology.host_local_index();
  Status local;
  if (!vmm) local = cuda_status(cudaIpcGetMemHandle(&mine.ipc, heap.local_base()), "cudaIpcGetMemHandle(own heap)", __FILE__, __LINE__);
  if (!local.ok()) cudaGetLastError();
  std::vector<HeapRecord> all(static_cast<size_t>(bootstrap.world_size()));
  LOOM_TRY_CTX(bootstrap.all_gather(&mine, all.data(), sizeof(HeapRecord)), "exchanging heap records for the copy engine");
  std::memset(&mine.ipc, 0, sizeof(mine.ipc));  // a secret: keep no stray copy
  LOOM_TRY(tell_others(bootstrap, local, "copy_engine peer heaps"));

  // Same-host network peers; the copy engine reaches only those (choose_transport checked).
  std::vector<int> same_host;
  for (int r : topology.network_peers()) {
    if (all[static_cast<size_t>(r)].host == mine.host) same_host.push_back(r);
  }

  // Descriptor exchange among the host's ranks (every rank takes part in the collective steps).
  SocketTag tag{};
  if (bootstrap.rank() == 0) {
    Result<SocketTag> drawn = random_socket_tag();
    LOOM_TRY(tell_others(bootstrap, drawn.status(), "copy_engine peer heaps"));
    tag = *drawn;
  }
  LOOM_TRY_CTX(bootstrap.broadcast(&tag, sizeof(tag), 0), "broadcasting the peer-heap socket tag");
  Result<FdExchange> exchange = FdExchange::listen(tag, mine.host, mine.host_local, static_cast<int>(same_host.size()) + 1);
  LOOM_TRY(tell_others(bootstrap, exchange.status(), "copy_engine peer heaps: listening"));
  LOOM_TRY_CTX(bootstrap.barrier(), "peer-heap sockets listening");
  const Deadline deadline = Clock::now() + timeout;
  Status step = [&]() -> Status {
    if (vmm && !same_host.empty()) {
      LOOM_ASSIGN_OR_RETURN(UniqueFd fd, export_own_heap(heap));
      for (int r : same_host) {
        LOOM_TRY(exchange->send(all[static_cast<size_t>(r)].host_local, fd.get(), mine.bytes, deadline));
      }
    }
    std::vector<int> senders;
    for (int r : same_host) {
      if (all[static_cast<size_t>(r)].vmm != 0) senders.push_back(all[static_cast<size_t>(r)].host_local);
    }
    LOOM_ASSIGN_OR_RETURN(std::vector<ReceivedFd> received, exchange->receive(senders, deadline));
    for (int r : same_host) {
      const HeapRecord& rec = all[static_cast<size_t>(r)];
      Peer peer;
      peer.rank = r;
      peer.owner_base = rec.base;
      peer.bytes = rec.bytes;
      peer.vmm = rec.vmm != 0;
      if (peer.vmm) {
        auto it = std::find_if(received.begin(), received.end(), [&](const ReceivedFd& f) { return f.local_rank == rec.host_local; });
        if (it == received.end() || it->value != rec.bytes) {
          return Status::internal("copy_engine peer heaps: rank " + std::to_string(r) + " sent no heap or one of the wrong size");
        }
        LOOM_TRY(map_vmm_fd(it->fd.get(), rec.bytes, device, &peer.mapped));
        it->fd.reset();
      } else {
        LOOM_CUDA_TRY(cudaIpcOpenMemHandle(&peer.mapped, rec.ipc, cudaIpcMemLazyEnablePeerAccess));
      }
      map->peers_.push_back(peer);
      LOOM_DEBUG("copy_engine: mapped the heap of rank %d (%s) at %p", r, peer.vmm ? "cuMem fd" : "CUDA IPC", peer.mapped);
    }
    return {};
  }();
  for (HeapRecord& rec : all) std::memset(&rec.ipc, 0, sizeof(rec.ipc));
  LOOM_TRY(tell_others(bootstrap, step, "copy_engine peer heaps"));
  // Outgoing connections stay open until every receiver has its descriptors.
  LOOM_TRY_CTX(bootstrap.barrier(), "peer-heap descriptors received");
  return map;
}

void* PeerHeapMap::translate(int rank, uint64_t owner_address, uint64_t bytes) const {
  for (const Peer& p : peers_) {
    if (p.rank != rank) continue;
    if (owner_address < p.owner_base || owner_address - p.owner_base > p.bytes || bytes > p.bytes - (owner_address - p.owner_base)) {
      return nullptr;
    }
    return static_cast<char*>(p.mapped) + (owner_address - p.owner_base);
  }
  return nullptr;
}

Status PeerHeapMap::release() {
  Status first;
  if (peers_.empty()) return first;
  cudaSetDevice(device_);
  Result<const CudaDriver*> driver = cuda_driver();
  for (Peer& p : peers_) {
    if (p.mapped == nullptr) continue;
    if (p.vmm) {
      if (driver.ok()) {
        const auto address = reinterpret_cast<CUdeviceptr>(p.mapped);
        CUresult r = (*driver)->cuMemUnmap(address, p.bytes);
        if (r == CUDA_SUCCESS) r = (*driver)->cuMemAddressFree(address, p.bytes);
        if (r != CUDA_SUCCESS && first.ok()) first = cu_status(r, "unmapping a peer heap", __FILE__, __LINE__);
      }
    } else {
      const cudaError_t e = cudaIpcCloseMemHandle(p.mapped);
      if (e != cudaSuccess && first.ok()) first = cuda_status(e, "cudaIpcCloseMemHandle(peer heap)", __FILE__, __LINE__);
    }
    p.mapped = nullptr;
  }
  peers_.clear();
  return first;
}

// ---- network -----------------------------------------------------------------------------------

struct Network::Lane {
  MappedRing ring;
  std::unique_ptr<Transport> transport;
  WindowTable table;
};

Network::Network() = default;

Network::~Network() {
  Status s = shutdown(std::chrono::milliseconds(1000));
  if (!s.ok()) LOOM_WARN("network teardown: %s", s.to_string().c_str());
}

Result<std::unique_ptr<Network>> Network::create(Bootstrap& bootstrap, const Topology& topology, SymmetricHeap& heap,
                                                 const NetworkOptions& options) {
  if (topology.num_nodes < 2) return Status::internal("Network::create on a single-node topology");
  std::unique_ptr<Network> net(new Network());
  net->device_ = options.device;
  LOOM_CUDA_TRY(cudaSetDevice(options.device));

  // 1. The flag window: in the heap's reserved prefix (zero since the heap was created), below
  //    every allocation, so the data window (the allocatable heap) never covers it.
  const uint64_t window_bytes = net_window_bytes();
  const uint64_t data_offset = heap.allocator().begin();
  if (options.window_offset + window_bytes > data_offset || data_offset >= heap.size()) {
    return tell_others(bootstrap,
                       Status::internal("the flag window [" + std::to_string(options.window_offset) + ", +" +
                                        std::to_string(window_bytes) + ") is not in the heap's reserved prefix "
                                        "(allocations start at " + std::to_string(data_offset) + ")"),
                       "network");
  }
  net->window_offset_ = options.window_offset;

  // 2. One transport kind on every rank; equal lane counts.
  Result<TransportDecision> decision = decide_transport(options.settings, topology);
  const int lanes = std::max(1, options.settings.proxy_threads);
  const uint64_t key = decision.ok() ? (static_cast<uint64_t>(decision->transport) << 32) | static_cast<uint32_t>(lanes) : 0;
  LOOM_TRY(agree(bootstrap, decision.status(), key, "the network transport (LOOM_TRANSPORT) and LOOM_PROXY_THREADS",
                 [](uint64_t v) {
                   return std::string(transport_choice_name(static_cast<TransportChoice>(v >> 32))) + " with " +
                          std::to_string(v & 0xffffffffu) + " proxy lanes";
                 }));
  net->decision_ = *decision;
  LOOM_INFO("network: %s (%s), %d proxy lane(s), %d nodes x %d GPUs", transport_choice_name(net->decision_.transport),
            net->decision_.reason.c_str(), lanes, topology.num_nodes, topology.local_world_size);

  // 3. copy_engine: this process's mappings of the same-host peers' heaps.
  const bool copy_engine = net->decision_.transport == TransportChoice::kCopyEngine;
  if (copy_engine) {
    LOOM_ASSIGN_OR_RETURN(net->peer_heaps_, PeerHeapMap::create(bootstrap, topology, heap, options.device, options.timeout));
  }

  // 4. Lanes: ring, transport, registrations, endpoint and window exchange.
  TransportConfig config{topology.rank, topology.world_size, std::vector<bool>(static_cast<size_t>(topology.world_size), false)};
  for (int r : topology.network_peers()) config.peers[static_cast<size_t>(r)] = true;
  // Source: the whole heap, read by this rank's own transport only. Data: what peers may write.
  MemoryRegion heap_region{heap.local_base(), heap.size(), MemoryKind::kDevice, options.device};
  heap_region.remote_write = false;
  const MemoryRegion data_region{static_cast<char*>(heap.local_base()) + data_offset, heap.size() - data_offset,
                                 MemoryKind::kDevice, options.device};
  const MemoryRegion flag_region{static_cast<char*>(heap.local_base()) + net->window_offset_, uint64_t{8} * kNetFlagWords,
                                 MemoryKind::kDevice, options.device};
  const NetWindowLayout layout{static_cast<uint32_t>(topology.num_nodes), static_cast<uint32_t>(topology.local_world_size)};
  const FlagScope scope = [&](int rank, uint64_t flag_count) {
    (void)rank;  // every destination lays out its window alike; the sender decides what it may set
    return network_flag_scope(layout, static_cast<uint32_t>(topology.node), flag_count);
  };
  for (int p = 0; p < lanes; ++p) {
    auto lane = std::make_unique<Lane>();
    LocalWindows windows;
    Status local = [&]() -> Status {
      LOOM_ASSIGN_OR_RETURN(lane->ring, MappedRing::create(options.ring_capacity, static_cast<uint32_t>(p)));
      switch (net->decision_.transport) {
        case TransportChoice::kCopyEngine: {
          CopyEngineOptions o;
          o.device = options.device;
          o.emulate_gbps = per_lane_gbps(options.settings.emulate_net_gbps, lanes);
          o.emulate_latency_us = options.settings.emulate_net_latency_us;
          PeerHeapMap* map = net->peer_heaps_.get();
          o.map_peer = [map](int rank, uint64_t address, uint64_t bytes) { return map->translate(rank, address, bytes); };
          LOOM_ASSIGN_OR_RETURN(lane->transport, create_copy_engine_transport(config, o));
          break;
        }
        case TransportChoice::kFabric: {
          LOOM_ASSIGN_OR_RETURN(FabricOptions o, fabric_options_from_settings(options.settings));
          o.device_memory = true;  // the windows are GPU memory (FI_HMEM)
          LOOM_ASSIGN_OR_RETURN(lane->transport, create_fabric_transport(config, o));
          break;
        }
        case TransportChoice::kVerbs: {
          VerbsOptions o = verbs_options_from_settings(options.settings);
          o.export_dmabuf = [](void* base, uint64_t bytes) { return export_dmabuf_fd(base, bytes); };
          LOOM_ASSIGN_OR_RETURN(lane->transport, create_verbs_transport(config, o));
          break;
        }
        case TransportChoice::kAuto:
          return Status::internal("transport decision left at auto");
      }
      LOOM_ASSIGN_OR_RETURN(windows.source, lane->transport->register_memory(heap_region));
      LOOM_ASSIGN_OR_RETURN(windows.data, lane->transport->register_memory(data_region));
      LOOM_ASSIGN_OR_RETURN(windows.flags, lane->transport->register_memory(flag_region));
      windows.data_offset = data_offset;
      windows.flag_offset = net->window_offset_;
      return {};
    }();
    LOOM_TRY(tell_others(bootstrap, local, ("network lane " + std::to_string(p)).c_str()));
    LOOM_TRY_CTX(exchange_endpoints(bootstrap, *lane->transport), "network lane " + std::to_string(p) + ": endpoints");
    LOOM_ASSIGN_OR_RETURN(lane->table, exchange_windows(bootstrap, *lane->transport, config, windows, scope));
    LOOM_DEBUG("network lane %d: %s", p, lane->transport->describe().c_str());
    net->lanes_.push_back(std::move(lane));
  }

  // 5. What kernels see, and the proxy.
  Status started = [&]() -> Status {
    std::vector<ring::RingView> views;
    std::vector<ProxyLane> proxy_lanes;
    for (auto& lane : net->lanes_) {
      views.push_back(lane->ring.device_view());
      proxy_lanes.push_back(ProxyLane{lane->ring.host_view(), lane->transport.get(), lane->table});
    }
    LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&net->device_rings_), sizeof(ring::RingView) * views.size()));
    LOOM_CUDA_TRY(cudaMemcpy(net->device_rings_, views.data(), sizeof(ring::RingView) * views.size(), cudaMemcpyHostToDevice));
    std::vector<int32_t> rank_at(topology.rank_at.begin(), topology.rank_at.end());
    LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&net->device_rank_at_), sizeof(int32_t) * rank_at.size()));
    LOOM_CUDA_TRY(cudaMemcpy(net->device_rank_at_, rank_at.data(), sizeof(int32_t) * rank_at.size(), cudaMemcpyHostToDevice));
    ProxyOptions proxy_options;
    proxy_options.gpu_pci_bus_id = options.gpu_pci_bus_id;
    proxy_options.stall_limit = options.stall_limit;
    proxy_options.epochs.floor = net->floor_;
    LOOM_ASSIGN_OR_RETURN(net->proxy_, Proxy::start(std::move(proxy_lanes), proxy_options));
    return {};
  }();
  LOOM_TRY(tell_others(bootstrap, started, "starting the proxy"));

  net->view_.node = topology.node;
  net->view_.num_nodes = topology.num_nodes;
  net->view_.rank = topology.rank;
  net->view_.num_lanes = lanes;
  net->view_.rings = net->device_rings_;
  net->view_.rank_at = net->device_rank_at_;
  net->view_.flag_offset = net->window_offset_;
  net->view_.flag_count = kNetFlagWords;
  net->view_.launch_flag_base = layout.launch_base();
  return net;
}

Status Network::health() const {
  if (!proxy_) return {};
  return proxy_->health();
}

std::string Network::describe_state() const {
  std::string out = std::string("network (") + transport_choice_name(decision_.transport) + "):";
  for (size_t i = 0; i < lanes_.size(); ++i) {
    const ring::RingView v = lanes_[i]->ring.host_view();
    out += " lane " + std::to_string(i) + " tail " +
           std::to_string(*reinterpret_cast<const volatile uint64_t*>(v.tail)) + " completed " +
           std::to_string(*reinterpret_cast<const volatile uint64_t*>(ring::ring_completed(v))) + ";";
  }
  if (proxy_) {
    const ProxyStats st = proxy_->stats();
    out += " proxy: " + std::to_string(st.commands) + " commands, " + std::to_string(st.writes_posted) + " writes, " +
           std::to_string(st.flags_posted) + " flags, " + std::to_string(st.completions) + " completions, " +
           std::to_string(proxy_->outstanding()) + " outstanding, " + std::to_string(st.rejected) + " rejected, floor " +
           std::to_string(floor_);
    const Status h = proxy_->health();
    if (!h.ok()) out += ", health: " + h.to_string();
  }
  return out;
}

void Network::after_synchronize(const EpochState* device_epoch, bool failed) {
  if (!proxy_ || shut_down_) return;
  // Small reads of device memory on a private non-blocking stream (a legacy-stream copy would
  // wait for unrelated work on the application's blocking streams).
  auto read = [&](const uint64_t* p, uint64_t* out) {
    if (query_stream_ == nullptr && cudaStreamCreateWithFlags(&query_stream_, cudaStreamNonBlocking) != cudaSuccess) {
      query_stream_ = nullptr;
      cudaGetLastError();
      return false;
    }
    if (cudaMemcpyAsync(out, p, sizeof(uint64_t), cudaMemcpyDeviceToHost, query_stream_) != cudaSuccess ||
        cudaStreamSynchronize(query_stream_) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  };
  uint64_t completed = 0;
  if (!read(&device_epoch->epoch, &completed)) return;
  uint64_t target = floor_;
  if (failed) {
    target = completed + 1;
  } else {
    // Every command published so far has been taken by its lane: nothing older than the next
    // launch can be legitimately pending any more.
    bool consumed = true;
    for (const auto& lane : lanes_) {
      const ring::RingView host = lane->ring.host_view();
      const ring::RingView device = lane->ring.device_view();
      uint64_t head = 0;
      if (!read(&device.producer->head, &head)) {
        consumed = false;
        break;
      }
      const uint64_t tail = std::atomic_ref<uint64_t>(*host.tail).load(std::memory_order_acquire);
      consumed = consumed && tail == head;
    }
    if (consumed) target = completed + 1;
  }
  if (target > floor_) {
    floor_ = target;
    proxy_->set_epoch_floor(floor_);
  }
}

Status Network::shutdown(std::chrono::milliseconds drain) {
  if (shut_down_) return {};
  shut_down_ = true;
  Status first;
  auto keep = [&](Status s) {
    if (first.ok() && !s.ok()) first = std::move(s);
  };
  cudaSetDevice(device_);
  if (proxy_) {
    // Peers may still wait for what our finished kernels asked the proxy to send.
    Status drained = proxy_->drain(drain);
    if (!drained.ok()) LOOM_WARN("network teardown: proxy drain: %s", drained.to_string().c_str());
    keep(proxy_->stop(std::min<std::chrono::milliseconds>(drain, std::chrono::milliseconds(1000))));
    proxy_.reset();
  }
  for (auto& lane : lanes_) {
    if (lane->transport) keep(lane->transport->close());
  }
  if (peer_heaps_) keep(peer_heaps_->release());
  peer_heaps_.reset();
  if (query_stream_ != nullptr) cudaStreamDestroy(query_stream_);
  query_stream_ = nullptr;
  if (device_rings_ != nullptr) cudaFree(device_rings_);
  if (device_rank_at_ != nullptr) cudaFree(device_rank_at_);
  device_rings_ = nullptr;
  device_rank_at_ = nullptr;
  lanes_.clear();  // transports, then the rings (pinned memory)
  view_ = NetComm{};
  return first;
}

}  // namespace loom::runtime::net
