// Watchdog: the host thread of one communicator that carries failures between ranks after init
// (reliability.md H2, H3, H6, H7; docs/SECURITY.md "Failures").
//
// Every turn (at most `tick` apart, at once when a connection has news) it
//   - runs the bootstrap's watch(): failure notices of other ranks, and ranks whose connection
//     dropped (their process died; the kernel closes its sockets), rank 0 forwarding each to
//     every other rank;
//   - asks `local_failure` for a failure of this rank's own that nobody reported yet (a device
//     wait that gave up while the application is not in synchronize(), a failed proxy).
// The first failure, remote or local, goes to `on_failure` once: the communicator raises its abort
// word (its running kernels end within about a millisecond) and marks itself failed, telling the
// other ranks when the failure is its own. The thread goes on forwarding and collecting notices
// until stop().
//
// A process stopped past its peers' deadlines (SIGSTOP) is failed by them while it sleeps; their
// notices wait in its sockets. catch_up(), called where an operation starts, notices that the
// thread has not run for a while and waits (bounded) for one fresh turn, so the resumed rank's
// next call fails instead of launching into peers that gave up on it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "loom/status.h"

namespace loom::runtime {

class Bootstrap;

class Watchdog {
 public:
  struct Hooks {
    // This rank's own failure not yet reported, or ok; `resumed`: the previous turn was long ago
    // (the process was stopped or starved), so time-based checks (a stalled proxy lane) would
    // misjudge this turn. Not called after the first failure.
    std::function<Status(bool resumed)> local_failure;
    // Once, with the first failure: a peer's (`from_peer`) or this rank's own.
    std::function<void(const Status& failure, bool from_peer)> on_failure;
  };

  static constexpr std::chrono::milliseconds kTick{20};
  // A thread silent for longer than this was not running: catch_up() waits for a fresh turn.
  static constexpr std::chrono::milliseconds kStale{300};

  // Starts the thread. `bootstrap` must outlive the watchdog (stop() or the destructor).
  static Result<std::unique_ptr<Watchdog>> start(Bootstrap& bootstrap, Hooks hooks,
                                                 std::chrono::milliseconds tick = kTick);
  ~Watchdog();  // stop()
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Wakes the thread and joins it: returns within one turn (a turn reads at most one notice per
  // connection, each bounded). Idempotent.
  void stop();
  // When the thread has not turned for kStale, or its last turn spanned such a pause: waits for one
  // full turn that starts now (at most 1 s), so what arrived while this process was stopped is
  // known. Cheap otherwise (a clock read).
  void catch_up();
  // Turns taken so far (tests).
  uint64_t turns() const { return turns_.load(std::memory_order_acquire); }

 private:
  Watchdog(Bootstrap& bootstrap, Hooks hooks, std::chrono::milliseconds tick);
  void run();
  // `clean`: this process ran all through the turn.
  void finish_turn(bool clean);

  Bootstrap& bootstrap_;
  Hooks hooks_;
  const std::chrono::milliseconds tick_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> last_turn_ns_{0};  // steady clock: when the last turn ended
  // Whether the last turn ran without a pause (see catch_up): a turn that spanned a stop may have
  // polled before the news arrived.
  std::atomic<bool> last_turn_clean_{true};
  std::atomic<uint64_t> turns_{0};
  bool failed_ = false;  // the watchdog thread's own: on_failure ran
  std::mutex turn_mutex_;
  std::condition_variable turned_;
  std::thread thread_;
  std::mutex stop_mutex_;
};

}  // namespace loom::runtime
