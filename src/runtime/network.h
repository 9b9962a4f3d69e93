// The communicator's inter-node path: transports, command rings, the proxy and the network flag
// window, wired together for jobs of more than one (real or emulated) node.
//
// What Network::create() sets up, collectively over the bootstrap world (every rank, same order):
//   1. the network flag window: in the heap's reserved prefix after the control region (the
//      communicator made the prefix that large; zero-filled with it), its layout in
//      runtime/network_layout.h;
//   2. the transport for the network peers (the GPUs with this rank's local index on the other
//      nodes): choose_transport() on every rank, the decisions compared so that all ranks use the
//      same kind (LOOM_TRANSPORT overrides auto: copy_engine when every cross-node peer runs on
//      this host, i.e. emulated nodes; else verbs, else fabric);
//   3. copy_engine only: this process's mappings of the heaps of its same-host network peers
//      (PeerHeapMap: cuMem fds over a Unix socket for vmm heaps, CUDA IPC handles for ipc
//      heaps) — the heap itself maps only the ranks of this rank's own (virtual) node;
//   4. LOOM_PROXY_THREADS lanes, each a MappedRing (the GPU pushes commands into it), a transport
//      instance with three registrations — source = the whole heap (local access only, never
//      offered), data = the heap after its reserved prefix (what peers' writes may reach), flags =
//      the flag window — the last two exchanged with every rank (exchange_endpoints,
//      exchange_windows), with the flag words each peer may set (its own entry words and the
//      per-launch flags: NetWindowLayout::sender_entry);
//      with NIC emulation each lane's copy engine gets LOOM_EMULATE_NET_GBPS / lanes, so the lanes
//      together emulate one link of the configured rate;
//   5. the Proxy: one thread per lane, pinned near the GPU (its NUMA node's CPUs).
// A rank that fails a local step tells the others through the bootstrap, so they fail at their
// next collective step instead of at a deadline.
//
// Teardown (shutdown(), also from the destructor): drain the proxy (bounded) so peers receive what
// our finished kernels asked for, stop the lanes (bounded), close the transports, unmap the peer
// heaps, free the rings. The heap's own memory is freed later by the communicator, after a barrier
// that every rank reaches only once its proxy has stopped writing into the others.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/status.h"
#include "runtime/device_abi.h"
#include "runtime/network_layout.h"
#include "runtime/proxy.h"
#include "runtime/transports/transport.h"

namespace loom::runtime {
class Bootstrap;
class SymmetricHeap;
struct Topology;
}  // namespace loom::runtime

namespace loom::runtime::net {

// Command ring slots per lane (64 B each: 256 KiB of pinned memory per lane). A multi-node launch
// pushes about one command per MiB moved plus a few per peer, far below this; a full ring only
// makes the producer wait (bounded) for the proxy.
inline constexpr uint32_t kLaneRingCapacity = 4096;

struct NetworkOptions {
  int device = 0;                                 // this rank's CUDA device
  std::string gpu_pci_bus_id;                     // pin the proxy near it ("" : no pinning)
  NetworkSettings settings;                       // LOOM_TRANSPORT, LOOM_EMULATE_*, LOOM_PROXY_THREADS, ...
  std::chrono::milliseconds timeout{120'000};     // bootstrap-side steps (descriptor exchange)
  std::chrono::milliseconds stall_limit{5000};    // a proxy lane silent this long is reported stalled
  uint64_t window_offset = 0;                     // the flag window's heap offset (net_window_offset)
  uint32_t ring_capacity = kLaneRingCapacity;
};

class PeerHeapMap;

class Network {
 public:
  // Collective over the bootstrap world; only for topologies of more than one node.
  static Result<std::unique_ptr<Network>> create(Bootstrap& bootstrap, const Topology& topology, SymmetricHeap& heap,
                                                 const NetworkOptions& options);
  ~Network();
  Network(const Network&) = delete;
  Network& operator=(const Network&) = delete;

  // DeviceComm::net for kernels.
  NetComm device_view() const { return view_; }
  // ok while the proxy works; else its first error (completion or post failure, rejected
  // commands, a stalled lane).
  Status health() const;
  // One line for a stuck launch's report: per lane the ring's tail and completed count (host
  // words), the proxy's totals and its epoch floor. Makes no CUDA call (the GPU may be wedged).
  std::string describe_state() const;
  // After the stream work of this communicator completed (synchronize), with the last completed
  // launch epoch in `device_epoch` (device memory): when the work failed, or every ring has been
  // fully taken by its lane, the proxy's epoch floor moves past that epoch, so no command of it
  // or an older launch is posted any more (a late command of an aborted launch, reliability H3).
  // While commands are still queued the floor stays (they belong to finished launches whose
  // receivers may be waiting for them).
  void after_synchronize(const EpochState* device_epoch, bool failed);
  // Drain (bounded by `drain`), stop the proxy, close the transports, unmap peer heaps, free
  // rings. Idempotent; returns the first failure.
  Status shutdown(std::chrono::milliseconds drain);

  const TransportDecision& decision() const { return decision_; }
  uint64_t window_offset() const { return window_offset_; }
  Proxy* proxy() { return proxy_.get(); }  // tests (pause_for_test, stats)
  int lanes() const { return static_cast<int>(lanes_.size()); }

 private:
  struct Lane;
  Network();

  TransportDecision decision_;
  uint64_t window_offset_ = 0;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::unique_ptr<PeerHeapMap> peer_heaps_;
  std::unique_ptr<Proxy> proxy_;
  int device_ = 0;
  NetComm view_{};
  ring::RingView* device_rings_ = nullptr;  // device memory [lanes]
  int32_t* device_rank_at_ = nullptr;       // device memory [N * L]
  cudaStream_t query_stream_ = nullptr;     // after_synchronize's reads
  uint64_t floor_ = 1;
  bool shut_down_ = false;
};

// Rounds the per-lane emulated rate: `gbps` over `lanes` lanes (each lane's copy engine paces its
// own link; together they emulate one link of `gbps`). 0 stays 0 (unlimited).
double per_lane_gbps(double gbps, int lanes);

}  // namespace loom::runtime::net
