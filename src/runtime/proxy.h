// Proxy: the host threads that turn ring commands into network operations.
//
// One lane = one command ring + one transport instance + the window table for that transport,
// served by one thread pinned to the GPU's NUMA node (sysfs; failure to pin is a warning). A
// GPU can have several lanes (LOOM_PROXY_THREADS); kernels pick a lane per command stream, and
// ordering guarantees hold within a lane.
//
// Every command is validated before anything is posted (reliability S5):
//   known type; reserved word zero; destination rank < world and a peer of this transport;
//   epoch and flag value inside the accepted epoch range [floor, floor + window); for kWrite a
//   length >= 1, a source range inside the local registered region, and a destination range
//   (checked arithmetic: offset + length never wraps) inside one of the destination's scopes:
//   its data window, or — whole 8-byte words — flag words this rank may write there; a range
//   reaching below the data window otherwise (the control region, other senders' flag words) is
//   refused as protected; a flag index inside the destination's flag window and among the words
//   this rank may set (kSignal must have one).
// Scopes (docs/SECURITY.md "RDMA keys"): a destination offers keys for its data window (every
// heap byte above its control region and network flag window) and its flag window only; the
// proxy also knows which flag words of a destination belong to this sender (its entry words and
// the per-launch flags, never another node's entry words nor the local ones).
// A rejected command is retired without effect, counted by reason, and the first one is kept for
// the health report. Valid commands become: data writes (split at the transport's limit), then
// the arrival flag — right behind the data on ordered transports, only after every piece of the
// data has completed on unordered ones — so a receiver never sees the flag before the data.
//
// Errors never hang anything: completion errors, post failures and rejections are kept and
// returned by health(); a lane whose loop stops turning (a stalled thread, the pause hook) shows
// there as "not progressing". stop() wakes every thread through its eventfd and returns within
// the drain limit plus one loop turn.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "loom/status.h"
#include "runtime/command_ring.h"
#include "runtime/transports/transport.h"

namespace loom::runtime {
class Bootstrap;
}

namespace loom::runtime::net {

// ---- windows -----------------------------------------------------------------------------------

// What this rank registered with one transport and offers to the others. Commands address a
// destination by heap offset (equal on every rank): `data_offset` / `flag_offset` say where in
// the heap the registrations start. The source registration is never offered (local access).
struct LocalWindows {
  static constexpr uint64_t kNoOffset = ~uint64_t{0};
  LocalRegistration source;  // where src_offset points (the local heap)
  LocalRegistration data;    // where peers' data writes land: the data window
  LocalRegistration flags;   // uint64 arrival flags; bytes / 8 of them
  uint64_t data_offset = 0;           // heap offset of data's first byte
  uint64_t flag_offset = kNoOffset;   // heap offset of flag word 0 (kNoOffset: outside the heap,
                                      // so no data write can address it)
};

// A run of flag words [first, first + count).
struct WordRange {
  uint64_t first = 0;
  uint64_t count = 0;
  bool contains(uint64_t word) const { return word >= first && word - first < count; }
};

// A destination as the proxy validates and addresses it.
struct DestinationWindow {
  bool present = false;   // a peer of this transport with registered windows
  uint32_t data_handle = 0;
  uint64_t data_offset = 0;   // heap offset where the data window starts
  uint64_t data_bytes = 0;
  uint32_t flag_handle = 0;
  uint64_t flag_offset = LocalWindows::kNoOffset;  // heap offset of flag word 0
  uint64_t flag_count = 0;
  // The flag words this rank may set there (flag_index of a command, or the data of an 8-byte
  // aligned write into the flag window). Every other word belongs to another sender.
  std::vector<WordRange> writable_flags;
  bool may_write_flag(uint64_t word) const {
    for (const WordRange& r : writable_flags) {
      if (r.contains(word)) return true;
    }
    return false;
  }
};

struct WindowTable {
  int rank = 0;
  int world_size = 0;
  uint32_t source_handle = 0;
  uint64_t source_bytes = 0;
  std::vector<DestinationWindow> destinations;  // [world_size]
};

// Which flag words of destination `rank`'s window (flag_count words) this rank may write.
using FlagScope = std::function<std::vector<WordRange>(int rank, uint64_t flag_count)>;

// Gathers every rank's window keys (bootstrap all-gather), imports the peers' ones into
// `transport` and returns this rank's table. Collective over the bootstrap world.
// `scope` says which flag words this rank may write at each destination; without one, all of them.
Result<WindowTable> exchange_windows(Bootstrap& bootstrap, Transport& transport, const TransportConfig& config,
                                     const LocalWindows& mine, const FlagScope& scope = {});

// ---- validation --------------------------------------------------------------------------------

enum class Rejection : uint8_t {
  kNone = 0,
  kUnknownType,
  kReservedNonZero,
  kRankOutOfRange,
  kNotAPeer,             // self, or a rank this transport has no windows for
  kEpochOutOfRange,      // stale (below the floor) or too far ahead
  kFlagValueOutOfRange,
  kEmptyWrite,
  kSourceOutOfRange,
  kDestinationOutOfRange,
  kFlagOutOfRange,       // flag index outside the flag window, or kSignal without a flag
  kProtectedDestination, // a write reaching below the data window: the control region, or flag
                         // words this rank may not write
  kFlagNotWritable,      // a flag word of another sender (another node's entry words, the
                         // destination's local ones)
  kCount,
};
const char* rejection_name(Rejection reason);
inline constexpr size_t kRejectionReasons = static_cast<size_t>(Rejection::kCount);

// The accepted epochs: [floor, floor + window) in serial-number arithmetic.
struct EpochRange {
  uint64_t floor = 1;
  uint64_t window = uint64_t{1} << 32;
  bool contains(uint64_t epoch) const { return epoch - floor < window; }
};

// Where a valid kWrite lands: which of the destination's registrations, at what offset in it.
struct WriteTarget {
  uint32_t handle = 0;
  uint64_t offset = 0;
};

// The proxy's verdict on one command (exposed for tests); for a valid kWrite also its target.
Rejection validate_command(const ring::Command& command, const WindowTable& table, const EpochRange& epochs,
                           WriteTarget* target = nullptr);

// ---- NUMA pinning ------------------------------------------------------------------------------

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}; invalid_argument on anything else.
Result<std::vector<int>> parse_cpu_list(std::string_view text);
// CPUs of the NUMA node of PCI device `bus_id` ("0000:18:00.0"; CUDA's upper-case and 8-digit
// domain forms are accepted), read under `sysfs_root` (normally "/sys"). Empty when the device
// reports no node (-1).
Result<std::vector<int>> numa_cpus_of_pci_device(const std::string& sysfs_root, const std::string& bus_id);

// ---- proxy -------------------------------------------------------------------------------------

struct ProxyLane {
  ring::RingView ring;          // the consumer's (host) view
  Transport* transport = nullptr;  // owned by the caller; used only by this lane's thread
  WindowTable windows;
};

struct ProxyOptions {
  uint32_t batch = 32;                                   // commands taken from the ring per turn
  std::string gpu_pci_bus_id;                            // pin near this GPU; empty: no pinning
  std::string sysfs_root = "/sys";
  EpochRange epochs;                                     // initial accepted range (set_epoch_floor moves it)
  std::chrono::milliseconds stall_limit{2000};           // health: a lane silent this long is stalled
  std::chrono::microseconds idle_sleep{50};              // sleep of an idle lane between ring polls
};

struct ProxyStats {
  uint64_t commands = 0;          // taken from the rings
  uint64_t writes_posted = 0;     // data pieces
  uint64_t bytes_posted = 0;
  uint64_t flags_posted = 0;
  uint64_t completions = 0;
  uint64_t completion_errors = 0;
  uint64_t rejected = 0;
  std::array<uint64_t, kRejectionReasons> rejected_by_reason{};
};

class Proxy {
 public:
  // Starts one thread per lane. invalid_argument for a lane without transport or ring.
  static Result<std::unique_ptr<Proxy>> start(std::vector<ProxyLane> lanes, const ProxyOptions& options);
  ~Proxy();  // stop() with a short drain
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  // Commands with an epoch below `floor` are stale from now on (an aborted or finished launch).
  void set_epoch_floor(uint64_t floor);
  // ok while every lane works; else the first error: a completion or post failure, a rejected
  // command (internal: a producer bug), or a lane not progressing (timeout).
  Status health() const;
  ProxyStats stats() const;
  // Operations posted and not yet completed, over all lanes (drain checks).
  uint64_t outstanding() const;
  // Waits (bounded) until every lane has taken all published commands and seen every completion,
  // then returns health(); timeout when `limit` passes first.
  Status drain(std::chrono::milliseconds limit);
  // Stops every lane: each drains outstanding operations for at most `drain` and exits. Bounded;
  // idempotent. Returns health() as of the stop.
  Status stop(std::chrono::milliseconds drain = std::chrono::milliseconds(1000));

  // Test hook (reliability H7): a paused lane neither consumes nor progresses, as if its thread
  // were stuck; producers then meet their bounded wait and health() reports the stall.
  void pause_for_test(bool paused);
  // Whether the lane threads were pinned (false also when no bus id was given).
  bool pinned() const { return pinned_.load(); }

 private:
  struct Lane;
  Proxy() = default;
  void record_error(const Status& status);

  ProxyOptions options_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::atomic<uint64_t> epoch_floor_{1};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> paused_{false};
  std::atomic<bool> pinned_{false};
  std::chrono::milliseconds stop_drain_{1000};  // set before stopping_ is raised
  bool stopped_ = false;
  std::mutex stop_mutex_;
  mutable std::mutex error_mutex_;
  Status first_error_;
  std::string first_rejection_;
  friend struct LaneRunner;
};

}  // namespace loom::runtime::net
