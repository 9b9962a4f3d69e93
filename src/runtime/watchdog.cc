#include "runtime/watchdog.h"

#include "core/log.h"
#include "runtime/bootstrap.h"

namespace loom::runtime {
namespace {

using SteadyClock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count();
}

}  // namespace

Result<std::unique_ptr<Watchdog>> Watchdog::start(Bootstrap& bootstrap, Hooks hooks, std::chrono::milliseconds tick) {
  if (!hooks.on_failure) return Status::internal("watchdog: no failure handler");
  if (tick <= std::chrono::milliseconds::zero()) return Status::internal("watchdog: the tick must be positive");
  std::unique_ptr<Watchdog> watchdog(new Watchdog(bootstrap, std::move(hooks), tick));
  Watchdog* self = watchdog.get();
  try {
    watchdog->thread_ = std::thread([self] { self->run(); });
  } catch (const std::system_error& e) {
    return Status::system_error(std::string("watchdog: cannot start its thread: ") + e.what());
  }
  return watchdog;
}

Watchdog::Watchdog(Bootstrap& bootstrap, Hooks hooks, std::chrono::milliseconds tick)
    : bootstrap_(bootstrap), hooks_(std::move(hooks)), tick_(tick) {
  last_turn_ns_.store(now_ns(), std::memory_order_release);
}

Watchdog::~Watchdog() { stop(); }

void Watchdog::stop() {
  std::lock_guard<std::mutex> lock(stop_mutex_);
  if (!thread_.joinable()) return;  // stopped before (the bootstrap may be gone since)
  stopping_.store(true, std::memory_order_release);
  bootstrap_.wake_watch();
  thread_.join();
}

void Watchdog::run() {
  const int64_t stale = std::chrono::duration_cast<std::chrono::nanoseconds>(kStale).count();
  while (!stopping_.load(std::memory_order_acquire)) {
    const int64_t started = now_ns();
    const bool gap = started - last_turn_ns_.load(std::memory_order_acquire) > stale;
    Status remote = bootstrap_.watch(tick_);
    if (stopping_.load(std::memory_order_acquire)) break;
    // Paused before or during the watch (the process was stopped, or starved).
    const bool resumed = gap || now_ns() - started > stale;
    if (!failed_ && !remote.ok()) {
      failed_ = true;
      LOOM_DEBUG("watchdog: %s", remote.to_string().c_str());
      // The bootstrap's first failure is a peer's unless this rank reported one of its own, in
      // which case the communicator is failed already and the handler changes nothing.
      hooks_.on_failure(remote, /*from_peer=*/true);
    }
    if (!failed_ && hooks_.local_failure) {
      Status local = hooks_.local_failure(resumed);
      if (!local.ok()) {
        failed_ = true;
        hooks_.on_failure(local, /*from_peer=*/false);
      }
    }
    finish_turn(!resumed && now_ns() - started <= stale);
  }
  finish_turn(true);
}

void Watchdog::finish_turn(bool clean) {
  {
    std::lock_guard<std::mutex> lock(turn_mutex_);
    last_turn_clean_.store(clean, std::memory_order_release);
    last_turn_ns_.store(now_ns(), std::memory_order_release);
    turns_.fetch_add(1, std::memory_order_acq_rel);
  }
  turned_.notify_all();
}

void Watchdog::catch_up() {
  const int64_t silent = now_ns() - last_turn_ns_.load(std::memory_order_acquire);
  if (silent <= std::chrono::duration_cast<std::chrono::nanoseconds>(kStale).count() &&
      last_turn_clean_.load(std::memory_order_acquire)) {
    return;
  }
  if (std::this_thread::get_id() == thread_.get_id() || stopping_.load(std::memory_order_acquire)) return;
  // A turn already under way may have polled before this process was stopped: wait for the one
  // after it.
  std::unique_lock<std::mutex> lock(turn_mutex_);
  const uint64_t target = turns_.load(std::memory_order_acquire) + 2;
  bootstrap_.wake_watch();
  turned_.wait_for(lock, std::chrono::seconds(1), [&] {
    return turns_.load(std::memory_order_acquire) >= target || stopping_.load(std::memory_order_acquire);
  });
}

}  // namespace loom::runtime
