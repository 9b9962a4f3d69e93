// Communicator::Impl: the runtime state behind a loom::Communicator, shared by the operators.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/env.h"
#include "loom/communicator.h"
#include "runtime/bootstrap.h"
#include "runtime/device_abi.h"
#include "runtime/network.h"
#include "runtime/symmetric_heap.h"
#include "runtime/topology.h"
#include "runtime/transports/transport.h"
#include "runtime/watchdog.h"

namespace loom {

struct Communicator::Impl {
  env::Settings settings;
  std::unique_ptr<runtime::Bootstrap> bootstrap;
  runtime::Topology topology;
  int device = -1;
  int sm_count = 0;
  std::unique_ptr<runtime::SymmetricHeap> heap;
  ControlLayout control{};

  // Device-side state (see device_abi.h for the meaning of each word).
  EpochState* epoch_state = nullptr;  // device memory
  uint32_t* device_abort = nullptr;   // device memory
  ErrorRecord* error_host = nullptr;  // host-mapped pinned memory ...
  ErrorRecord* error_device = nullptr;  // ... and its device alias
  uint32_t* host_abort_host = nullptr;  // host-mapped pinned memory ...
  uint32_t* host_abort_device = nullptr;  // ... and its device alias
  CtaProgress* progress_host = nullptr;    // host-mapped pinned memory [kProgressSlots] ...
  CtaProgress* progress_device = nullptr;  // ... and its device alias
  cudaEvent_t sync_event = nullptr;
  // Reads of a few device words after a failure (describe_missing_entries), on a private
  // non-blocking stream into pinned memory, so they wait for no other work.
  static constexpr size_t kProbeWords = 64;
  cudaStream_t probe_stream = nullptr;
  uint64_t* probe_words = nullptr;  // pinned [kProbeWords]

  // Jobs of more than one (real or emulated) node: the network settings (LOOM_TRANSPORT,
  // LOOM_EMULATE_*, LOOM_PROXY_THREADS, ...) and the inter-node path (rings, transports, proxy,
  // flag window: runtime/network.h; null on one node). Declared after `heap`: destroyed first, so
  // the proxy stops before the heap goes.
  runtime::net::NetworkSettings net_settings;
  std::unique_ptr<runtime::net::Network> network;

  // What an operator family ("tp", "multinode", ...) keeps between its calls: the device counters
  // of its launches and one symmetric workspace, which the family's operators grow when a larger
  // call comes (every rank at the same call: same offsets; ops::family_workspace). Made on a
  // family's first call by family(), with no CUDA call: the launch states are lines of one device
  // allocation made at creation.
  struct OperatorFamily {
    LaunchState* launch_state = nullptr;  // device memory, zero at creation
    void* workspace = nullptr;            // symmetric heap
    size_t workspace_bytes = 0;
    // Host notes a family keeps between its calls (MoE: `handles` counts the plans moe_routing
    // made, `staged` names the plan whose dispatch left its tokens in the workspace; 0: none,
    // and 0 again whenever the workspace moves).
    uint64_t handles = 0;
    uint64_t staged = 0;
  };
  static constexpr size_t kMaxFamilies = 16;
  LaunchState* launch_states = nullptr;  // device memory [kMaxFamilies]
  std::map<std::string, OperatorFamily, std::less<>> families;
  Result<OperatorFamily*> family(std::string_view name);

  // Streams with operator work of this communicator queued: an event per stream, recorded after
  // each operator call (note_queued_work). A workspace that must grow is released once they have
  // completed, and teardown waits for them — polled and bounded, never a device-wide synchronize,
  // which blocks the proxy thread's CUDA calls while a queued multi-node kernel waits for that very
  // proxy (the launch then hangs until its timeout), and waits for other communicators' work too.
  std::vector<std::pair<cudaStream_t, cudaEvent_t>> queued_work;
  bool workspace_captured = false;  // a CUDA graph holds the current workspaces: they must not move

  mutable std::mutex failure_mutex;
  Status failure;  // sticky: the first failure that ended the communicator
  bool failure_from_peer = false;  // it came from another rank (under failure_mutex)
  // The application has been given a peer's failure as such once (check_usable); later calls
  // get `aborted` with it, like every sticky failure.
  mutable std::atomic<bool> peer_failure_returned{false};
  // Serializes reads of the error record between synchronize() and the watchdog.
  mutable std::mutex record_mutex;
  // When the watchdog first saw the error record it has not reported (0: none).
  int64_t unconsumed_record_since_ns = 0;

  // The thread that carries failures between ranks (runtime/watchdog.h); started once the
  // communicator is ready, stopped first at teardown. Declared after `bootstrap` and `network`,
  // whose state its hooks read: destroyed before them.
  std::unique_ptr<runtime::Watchdog> watchdog;

  ~Impl();

  // The communicator as kernels see it.
  DeviceComm device_comm() const;
  // ok, or `aborted` carrying the failure that ended the communicator — a peer's failure the first
  // time as itself (peer_failure naming the rank, or the code it reported). First lets the
  // watchdog catch up when this process was not running for a while (SIGSTOP).
  Status check_usable() const;
  // Keeps the first failure (true when `status` is it) and raises the host abort word, so kernels
  // of this communicator still running end: none of them can succeed any more.
  bool set_failure(const Status& status, bool from_peer = false);
  // This rank's own failure: set_failure, and when it is the first, every other rank is told
  // (their calls then fail within moments instead of at their deadline).
  void fail(const Status& status);
  bool failed_by_peer() const;
  // The watchdog's local check: a device failure (timeout, mismatch) recorded and not consumed by
  // synchronize() within a second (the application is not waiting on this communicator), or a
  // failed proxy; ok otherwise.
  Status unreported_local_failure(bool resumed);
  // Starts the watchdog (the communicator is ready).
  Status start_watchdog();
  // Turns a filled error record into a Status (naming global ranks) and clears it.
  // The device's first failure (ErrorRecord) in words, "" when none; consume_error_record()
  // turns it into a Status and clears the record.
  std::string error_record_text() const;
  // `mismatch` with what the peers reported of it (their side of the call), waiting at most 0.5 s.
  Status with_peer_reports(const Status& mismatch) const;
  // A cross-rank mismatch (DeviceError::kMismatch): which rank called what (runtime/call_log.h).
  std::string mismatch_text(OpId op, uint64_t epoch, int peer, uint32_t ours, uint32_t theirs) const;
  Status consume_error_record();
  // For a launch that outlived its deadline and the abort: the error record if one was written,
  // how far the CTAs got (LaunchPhase marks) and the network lanes' state.
  std::string describe_stuck_work() const;
  // After a device timeout of operator `op` in launch `epoch` (its kernels have ended): the direct
  // peers whose entry words say they never entered that launch, as "; rank R did not enter ...",
  // or "" (collectives and the TP operators, on one node or several). The first failed wait names
  // whichever flag's wait hit the shared deadline first, often a peer that waits for the silent
  // rank in turn; this names the silent rank itself.
  std::string describe_missing_entries(OpId op, uint64_t epoch) const;
  // Where CTA `cta` was in launch `epoch` (thread 0's phase mark, and the wait a thread of it gave
  // up in), or "" when the CTA marked nothing in that launch (not a fused kernel).
  std::string describe_thread0(int cta, uint64_t epoch) const;
  // After a device timeout in launch `epoch`: the other CTAs where a thread gave up in a wait
  // (which wait, grouped), beside the recorded CTA `recorded`, or "". The shared deadline makes
  // every stuck wait give up at once and the first record is often a bystander's (a finisher
  // waiting for a CTA that waited for something else): this names the something else.
  std::string describe_other_waits(uint64_t epoch, int recorded) const;
  // Heap offset of a symmetric pointer range, or invalid_argument naming `what`.
  Result<uint64_t> symmetric_offset(const void* ptr, size_t bytes, const char* what) const;
  // After an operator call was queued on `stream` (during capture: marks the workspaces as held
  // by a graph).
  Status note_queued_work(cudaStream_t stream);
  // Bounded by `limit`: until the work noted on every stream has completed; `what` names the
  // caller in messages. A failed communicator ends the wait at once unless `even_if_failed`.
  Status wait_for_queued_work(const char* what, std::chrono::milliseconds limit, bool even_if_failed = false);
  // ok when [ptr, ptr+bytes) is device memory of this rank's GPU.
  Status check_local_device_buffer(const void* ptr, size_t bytes, const char* what) const;
};

// The runtime behind a communicator, for loom's operators, tools and tests (not in the public
// headers).
struct CommunicatorAccess {
  static Communicator::Impl& impl(Communicator& c) { return *c.impl_; }
  static const Communicator::Impl& impl(const Communicator& c) { return *c.impl_; }
};
inline Communicator::Impl& internal(Communicator& c) { return CommunicatorAccess::impl(c); }
inline const Communicator::Impl& internal(const Communicator& c) { return CommunicatorAccess::impl(c); }

}  // namespace loom
