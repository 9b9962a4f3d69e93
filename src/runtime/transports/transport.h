// Transport: how a proxy thread moves bytes and arrival flags to another rank.
//
// One interface, three implementations:
//   copy_engine  same host: cudaMemcpyAsync into a peer's IPC-mapped buffer on a proxy-owned
//                stream, completion by event, optional NIC emulation (rate and latency shaping)
//   fabric       libfabric RMA (FI_EP_RDM): tcp/shm anywhere, efa/verbs providers on clusters
//   verbs        libibverbs: RC queue pairs (ConnectX), SRD through efadv (EFA)
// RDMA libraries are opened with dlopen, so loom builds and runs where they are absent; a missing
// library makes the transport's factory return `unsupported` with the reason.
//
// Life cycle (every rank, same order):
//   1. create (factory of the implementation) with the TransportConfig
//   2. register_memory() for the local source region and the receive windows (data, flags)
//   3. exchange_endpoints(): local_endpoint() blobs all-gathered over the bootstrap, connect()
//   4. exchange_windows(): every rank's window keys all-gathered, import_remote() for each peer
//   5. post_writes() / post_flag() / poll() from one proxy thread (not thread-safe)
//   6. close()
// Completions carry the id the poster chose; an error completion carries a Status naming the
// operation, the peer and the transport's own error string.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "loom/status.h"

namespace loom::runtime {
class Bootstrap;
struct Topology;
}  // namespace loom::runtime

namespace loom::runtime::net {

enum class TransportKind : uint8_t { kCopyEngine, kFabric, kVerbs };
const char* transport_kind_name(TransportKind kind);  // "copy_engine", "fabric", "verbs"

// What the proxy needs to know to post correctly.
struct TransportCaps {
  // A write to a peer never becomes visible there before an earlier write to the same peer (RC
  // queue pairs, one CUDA stream, a libfabric endpoint granting FI_ORDER_WAW). Without it the
  // proxy posts a flag only after its data's completion, which the transport must report only
  // once the data has landed (delivery complete).
  bool ordered_writes = false;
  uint64_t max_write_bytes = uint64_t{1} << 30;  // the proxy splits longer writes
  uint32_t max_outstanding = 256;                // posts beyond this are refused until poll()
};

enum class MemoryKind : uint8_t { kHost, kDevice };

struct MemoryRegion {
  void* base = nullptr;
  uint64_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // CUDA ordinal for kDevice
  // false: only this rank's own transport reads it (a source); the NIC refuses remote writes
  // into it even from a holder of its key (verbs and fabric register it without remote access).
  bool remote_write = true;
};

// A local registration: the transport's handle and what a peer needs to write into it.
struct LocalRegistration {
  uint32_t handle = 0;
  uint64_t bytes = 0;
  std::vector<uint8_t> remote_key;  // opaque: address + rkey (verbs), address + key (fabric), ...
};

// Handles name registrations: local ones from register_memory(), remote ones from import_remote().
struct WriteOp {
  uint64_t id = 0;             // echoed in the completion
  int rank = -1;               // destination
  uint32_t local = 0;          // local registration
  uint64_t local_offset = 0;
  uint32_t remote = 0;         // imported remote registration
  uint64_t remote_offset = 0;
  uint64_t bytes = 0;
};

struct FlagOp {
  uint64_t id = 0;
  int rank = -1;
  uint32_t remote = 0;         // the peer's flag window
  uint64_t remote_offset = 0;  // byte offset of the uint64 flag (8-byte aligned)
  uint64_t value = 0;
};

struct Completion {
  uint64_t id = 0;
  Status status;  // ok, or why the operation failed (naming the peer and the transport's error)
};

// Which ranks a transport connects to, known before endpoints are built (RC needs one queue pair
// per peer in its endpoint blob).
struct TransportConfig {
  int rank = 0;
  int world_size = 1;
  std::vector<bool> peers;  // [world_size]: ranks this transport talks to (never itself)
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportKind kind() const = 0;
  virtual const TransportCaps& caps() const = 0;
  // A one-line description for logs: provider, device, ordering.
  virtual std::string describe() const = 0;

  virtual Result<LocalRegistration> register_memory(const MemoryRegion& region) = 0;
  // This rank's endpoint, opaque; may be empty when no peer needs one.
  virtual Result<std::vector<uint8_t>> local_endpoint() = 0;
  // endpoints[r] = rank r's local_endpoint() (this rank's and non-peers' entries are ignored).
  virtual Status connect(std::span<const std::vector<uint8_t>> endpoints) = 0;
  // A peer's registration (its remote_key bytes) -> a handle for WriteOp::remote / FlagOp::remote.
  virtual Result<uint32_t> import_remote(int rank, std::span<const uint8_t> remote_key, uint64_t bytes) = 0;

  // Post a prefix of `ops`, in order; returns how many were taken. Fewer than ops.size() means
  // the transport is full: poll() and offer the rest again. A Status is a local failure.
  virtual Result<size_t> post_writes(std::span<const WriteOp> ops) = 0;
  // true: posted; false: full (poll first).
  virtual Result<bool> post_flag(const FlagOp& op) = 0;
  // Appends finished operations (successful or not) to `out`; never blocks.
  virtual Status poll(std::vector<Completion>& out) = 0;
  // Operations posted and not yet completed.
  virtual uint32_t outstanding() const = 0;
  // Releases every resource; idempotent; later calls fail.
  virtual Status close() = 0;
};

// Does [offset, offset + bytes) lie within [0, limit), without overflowing?
inline bool within(uint64_t offset, uint64_t bytes, uint64_t limit) {
  uint64_t end = 0;
  return !__builtin_add_overflow(offset, bytes, &end) && end <= limit;
}

// Does `op`'s flag word lie in the peer's registration remotes[op.remote], one of op.rank's?
// Remote: a transport's record of a peer registration, with its rank and bytes.
template <class Remote>
bool flag_in_window(const std::vector<Remote>& remotes, const FlagOp& op) {
  return op.remote < remotes.size() && remotes[op.remote].rank == op.rank &&
         within(op.remote_offset, sizeof(uint64_t), remotes[op.remote].bytes);
}

// What the transports share: the getters over their capabilities and description, and the checks
// their operations start with. `name` starts their messages ("fabric: transport closed").
class TransportBase : public Transport {
 public:
  TransportKind kind() const final { return kind_; }
  const TransportCaps& caps() const final { return caps_; }
  std::string describe() const final { return describe_; }

 protected:
  TransportBase(TransportKind kind, const char* name) : describe_(name), kind_(kind), name_(name) {}
  // aborted once close() has run.
  Status check_open() const;
  // check_open, then invalid_argument for a region without memory.
  Status check_registrable(const MemoryRegion& region) const;

  TransportCaps caps_;
  std::string describe_;  // the name until initialization says more
  bool closed_ = false;

 private:
  TransportKind kind_;
  const char* name_;
};

// ---- bootstrap exchanges ----------------------------------------------------------------------

// All-gathers every rank's local_endpoint() (lengths first, then equal-size slots) and calls
// connect(). Collective over the bootstrap world.
Status exchange_endpoints(Bootstrap& bootstrap, Transport& transport);

// Blobs of any length from every rank (the building block of the exchanges above).
Result<std::vector<std::vector<uint8_t>>> all_gather_blobs(Bootstrap& bootstrap, std::span<const uint8_t> mine);

// ---- NIC emulation ----------------------------------------------------------------------------

// Paces operations like a link of `gbps` GB/s (10^9 bytes/s) with a one-way latency. An op of B
// bytes offered at time t occupies the link from max(t, when the link frees up) for B / rate, and
// its data has fully arrived `latency` after that: schedule() returns that arrival time, and the
// copy engine issues the real (much faster) copy then, so the receiver sees the bytes when the
// emulated network would have delivered them. Disabled when both are zero.
class LinkShaper {
 public:
  using Clock = std::chrono::steady_clock;
  LinkShaper() = default;
  LinkShaper(double gbps, double latency_us);
  bool enabled() const { return enabled_; }
  // When the data of an op of `bytes` offered at `now` has arrived; advances the link's schedule.
  Clock::time_point schedule(uint64_t bytes, Clock::time_point now);

 private:
  bool enabled_ = false;
  double ns_per_byte_ = 0;  // 0: unlimited rate
  std::chrono::nanoseconds latency_{0};
  Clock::time_point link_free_{};
};

// ---- settings and choice ----------------------------------------------------------------------

enum class TransportChoice : uint8_t { kAuto, kCopyEngine, kFabric, kVerbs };
const char* transport_choice_name(TransportChoice choice);

// The network's LOOM_* variables (parsed here; listed in core/env.cc's variable table).
struct NetworkSettings {
  TransportChoice transport = TransportChoice::kAuto;  // LOOM_TRANSPORT
  int emulate_nodes = 1;                 // LOOM_EMULATE_NODES: virtual nodes per host
  double emulate_net_gbps = 0;           // LOOM_EMULATE_NET_GBPS: copy_engine rate cap, GB/s (0: none)
  double emulate_net_latency_us = 0;     // LOOM_EMULATE_NET_LAT_US: copy_engine added latency
  int proxy_threads = 1;                 // LOOM_PROXY_THREADS: proxy threads (and rings) per GPU
  std::string net_device;                // LOOM_NET_DEVICE: verbs device or libfabric domain ("": first usable)
  std::string fabric_provider;           // LOOM_FABRIC_PROVIDER ("": efa, verbs, then tcp)
  int ib_gid_index = 0;                  // LOOM_IB_GID_INDEX: RoCE GID table entry

  static Result<NetworkSettings> from_env();
};

// A decimal number in [min, max] ("12.5"); invalid_argument naming the variable otherwise.
Result<double> parse_decimal(std::string_view name, std::string_view text, double min, double max);

// What the machine offers, probed once (dlopen of the libraries, active devices).
struct NetworkProbe {
  bool verbs_usable = false;
  std::string verbs_reason;   // why not, or which device
  bool fabric_usable = false;
  std::string fabric_reason;  // why not, or which provider
};

// Probes verbs (a device with an active port) and libfabric (a provider with RMA) as
// `settings` configure them. Loads the libraries when present; opens no endpoint.
NetworkProbe probe_network(const NetworkSettings& settings);

struct TransportDecision {
  TransportChoice transport = TransportChoice::kCopyEngine;  // never kAuto
  std::string reason;
};

// Picks the transport for this rank's cross-node peers. auto: copy_engine when every cross-node
// peer runs on this physical host (emulated nodes), else verbs when usable, else fabric.
// An explicit choice that cannot work (copy_engine to another host, verbs or fabric unusable)
// fails with unsupported naming the reason. No cross-node peers: copy_engine (nothing to carry).
Result<TransportDecision> choose_transport(const NetworkSettings& settings, const Topology& topology,
                                           const NetworkProbe& probe);

}  // namespace loom::runtime::net
