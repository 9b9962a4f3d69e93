// Failure propagation after init over loopback (runtime/watchdog.h, Bootstrap::watch,
// Bootstrap::announce_failure): ranks are forked processes, each running a bootstrap and the
// watchdog a communicator runs. What reliability.md H2, H3 and H6 ask of it, at the host level:
// a reported failure, a killed process (rank 0 or another), a rank stopped past its peers'
// deadline and resumed, and a rank that cannot start all reach every other rank within moments,
// naming the rank and the reason; a clean teardown reports nothing; a client's early step message
// is left for its step.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "loom/status.h"
#include "runtime/bootstrap.h"
#include "runtime/socket.h"
#include "runtime/watchdog.h"
#include "cpu/forked_ranks.h"

namespace loom::runtime {
namespace {

using namespace std::chrono_literals;
using namespace test_support;

// What a rank's watchdog handed to the communicator: the first failure and when.
class Failures {
 public:
  void on_failure(const Status& status, bool from_peer) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!first_.ok()) return;
    first_ = status;
    from_peer_ = from_peer;
    at_ = Clock::now();
    ++calls_;
    changed_.notify_all();
  }
  // The first failure, waiting at most `limit` for one; ok when none came.
  Status wait(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait_for(lock, limit, [&] { return !first_.ok(); });
    return first_;
  }
  Deadline at() {
    std::lock_guard<std::mutex> lock(mutex_);
    return at_;
  }
  bool from_peer() {
    std::lock_guard<std::mutex> lock(mutex_);
    return from_peer_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  Status first_;
  bool from_peer_ = false;
  Deadline at_{};
  int calls_ = 0;
};

Result<std::unique_ptr<Watchdog>> watch_with(Bootstrap& boot, Failures& failures) {
  Watchdog::Hooks hooks;
  hooks.on_failure = [&failures](const Status& s, bool from_peer) { failures.on_failure(s, from_peer); };
  return Watchdog::start(boot, std::move(hooks));
}

// A failure that must reach this rank within `limit` of `since`, keeping `code` and naming `text`.
Status expect_failure(Failures& failures, Deadline since, std::chrono::milliseconds limit, StatusCode code,
                      const std::string& text) {
  Status got = failures.wait(limit + 2s);
  if (got.ok()) return Status::internal("no failure arrived");
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(failures.at() - since);
  if (took > limit) return Status::internal("the failure took " + std::to_string(took.count()) + " ms: " + got.to_string());
  if (got.code() != code || got.message().find(text) == std::string::npos) {
    return Status::internal("unexpected failure: " + got.to_string());
  }
  if (!failures.from_peer()) return Status::internal("not marked as a peer's: " + got.to_string());
  return {};
}

// Process ids shared by the forked ranks (anonymous shared memory), so one can signal another.
struct SharedPids {
  SharedPids() {
    void* at = ::mmap(nullptr, sizeof(std::atomic<int>) * 16, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    pids = static_cast<std::atomic<int>*>(at);
    for (int i = 0; i < 16; ++i) new (&pids[i]) std::atomic<int>(0);
  }
  ~SharedPids() { ::munmap(pids, sizeof(std::atomic<int>) * 16); }
  std::atomic<int>* pids;
};

// Runs `body` on `count` forked ranks of a job, each with its bootstrap up and its watchdog
// running, after a barrier and `settle` (every watchdog is between steps by then).
using WatchedBody = std::function<Status(int rank, Bootstrap& boot, Failures& failures, Watchdog& watchdog)>;
std::vector<RankOutcome> run_watched(int count, const WatchedBody& body, std::chrono::milliseconds settle = 200ms) {
  UniqueId id = make_id();
  return run_ranks(
      count,
      [&](int rank) -> Status {
        LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, count, 20s));
        Failures failures;
        LOOM_ASSIGN_OR_RETURN(auto watchdog, watch_with(*boot, failures));
        LOOM_TRY(boot->barrier());
        std::this_thread::sleep_for(settle);
        return body(rank, *boot, failures, *watchdog);
      },
      [&] { Bootstrap::discard_unique_id(id); });
}

void expect_all_ok(const std::vector<RankOutcome>& outcomes, int except = -1) {
  for (int r = 0; r < static_cast<int>(outcomes.size()); ++r) {
    if (r != except) {
      EXPECT_RANK_OK(outcomes, r);
    }
  }
}

// ---- a failure reported by one rank --------------------------------------------------------------

TEST(WatchdogProtocol, ReportedFailureReachesEveryRankWithinASecond) {
  for (int reporter : {2, 0}) {
    expect_all_ok(run_watched(4, [&](int rank, Bootstrap& boot, Failures& failures, Watchdog&) -> Status {
      const Deadline reported = Clock::now();
      if (rank == reporter) {
        boot.report_failure("device " + std::to_string(rank) + " ran out of memory");
        return {};
      }
      return expect_failure(failures, reported, 1000ms, StatusCode::kPeerFailure,
                            "rank " + std::to_string(reporter) + ": device " + std::to_string(reporter) +
                                " ran out of memory");
    }));
  }
}

// A device timeout and a cross-rank mismatch keep their code at the other ranks.
TEST(WatchdogProtocol, TimeoutAndMismatchKeepTheirCode) {
  for (StatusCode code : {StatusCode::kTimeout, StatusCode::kInvalidArgument}) {
    expect_all_ok(run_watched(3, [&](int rank, Bootstrap& boot, Failures& failures, Watchdog&) -> Status {
      const Deadline reported = Clock::now();
      if (rank == 1) {
        boot.report_failure_as(code, "ag_gemm (epoch 4): waiting for rank 2's 'entered' flag");
        return {};
      }
      return expect_failure(failures, reported, 1000ms, code, "rank 1: ag_gemm (epoch 4): waiting for rank 2's");
    }));
  }
}

// ---- a rank whose process dies (kill -9) ---------------------------------------------------------

TEST(WatchdogProtocol, KilledRankIsNamedByEveryOtherRankWithinASecond) {
  for (int victim : {2, 0}) {
    auto outcomes = run_watched(4, [&](int rank, Bootstrap&, Failures& failures, Watchdog&) -> Status {
      const Deadline killed = Clock::now();
      if (rank == victim) ::raise(SIGKILL);
      const std::string named = victim == 0 ? "rank 0: lost the connection" : "rank 2: disconnected";
      return expect_failure(failures, killed, 1000ms, StatusCode::kPeerFailure, named);
    });
    EXPECT_FALSE(outcomes[victim].reported);
    expect_all_ok(outcomes, victim);
  }
}

// ---- a rank stopped past its peers' deadline, then resumed (SIGSTOP, SIGCONT) ---------------------

// The stopped rank's peers give up on it (here: rank 2 reports a timeout naming it) while it
// sleeps; once resumed, its first look (catch_up, where an operation starts) finds it failed.
// Rank 0 stopped is the harder case: it relays, so rank 1 hears only after rank 0 resumes.
TEST(WatchdogProtocol, StoppedRankLearnsItWasFailedWhenResumed) {
  for (int stopped : {1, 0}) {
    SharedPids shared;
    const std::string reason = "gemm_rs (epoch 9): timed out after 1000 ms waiting for rank " + std::to_string(stopped) +
                               "'s 'tile' flag";
    auto told = [&](const Status& got) {
      return got.code() == StatusCode::kTimeout && got.message().find("rank 2: " + reason) != std::string::npos;
    };
    expect_all_ok(run_watched(
        3,
        [&](int rank, Bootstrap& boot, Failures& failures, Watchdog& watchdog) -> Status {
          shared.pids[rank] = static_cast<int>(::getpid());
          if (rank == stopped) {
            ::raise(SIGSTOP);  // rank 2 resumes it
            const Deadline resumed = Clock::now();
            watchdog.catch_up();
            Status got = failures.wait(0ms);
            if (!told(got)) return Status::internal("after the resume: " + got.to_string());
            if (Clock::now() - resumed > 500ms) return Status::internal("catch_up took too long");
            return {};
          }
          if (rank == 2) {
            std::this_thread::sleep_for(300ms);  // the stopped rank is asleep by now
            boot.report_failure_as(StatusCode::kTimeout, reason);
            std::this_thread::sleep_for(700ms);  // "past the deadline"
            ::kill(shared.pids[stopped], SIGCONT);
            return {};
          }
          // The remaining rank: told directly by rank 0, or once rank 0 resumes and relays.
          Status got = failures.wait(5s);
          return told(got) ? Status{} : Status::internal("unexpected: " + got.to_string());
        },
        0ms));
  }
}

// ---- a rank that cannot start (bad setting, no GPU) ----------------------------------------------

// Every other rank fails within 2 s of connecting, naming it and its reason, instead of waiting for
// its 20 s deadline; also one that connects a second late (rank 0 keeps telling), and when rank 0
// itself cannot start. The failing rank returns its own error once all know.
TEST(WatchdogProtocol, RankThatCannotStartIsNamedByTheOthersWithinTwoSeconds) {
  for (int failing : {2, 0}) {
    UniqueId id = make_id();
    const Status bad = Status::invalid_argument("LOOM_TIMEOUT_MS='abc': not an integer");
    auto outcomes = run_ranks(
        4,
        [&](int rank) -> Status {
          if (rank == failing) {
            Status said = Bootstrap::announce_failure(id, rank, 4, 20s, bad);
            return said.message() == bad.message() ? Status{} : Status::internal("announce: " + said.to_string());
          }
          if (rank == 3) std::this_thread::sleep_for(1s);  // a late rank
          const Deadline start = Clock::now();
          Result<std::unique_ptr<Bootstrap>> boot = Bootstrap::from_unique_id(id, rank, 4, 20s);
          const auto took = Clock::now() - start;
          if (boot.ok()) return Status::internal("joined a job whose rank " + std::to_string(failing) + " failed");
          const std::string named = "rank " + std::to_string(failing) + ": could not start: invalid_argument: LOOM_TIMEOUT_MS";
          if (boot.status().code() != StatusCode::kPeerFailure || boot.status().message().find(named) == std::string::npos) {
            return Status::internal("unexpected: " + boot.status().to_string());
          }
          if (took > 2s) return Status::internal("took " + std::to_string(took / 1ms) + " ms");
          return {};
        },
        [&] { Bootstrap::discard_unique_id(id); });
    for (int r = 0; r < 4; ++r) EXPECT_RANK_OK(outcomes, r);
  }
}

// ---- what must not happen -----------------------------------------------------------------------

// A client that enters a step while rank 0 is not in one yet: rank 0's watch leaves the step
// message for the step (and reports no failure); a teardown that stops the watchdogs first, then
// leaves, reports nothing either.
TEST(WatchdogProtocol, EarlyStepsAndCleanTeardownAreNoFailures) {
  expect_all_ok(run_watched(
      3,
      [&](int rank, Bootstrap& boot, Failures& failures, Watchdog& watchdog) -> Status {
        for (int round = 0; round < 5; ++round) {
          if (rank == 0) std::this_thread::sleep_for(100ms);  // the clients' messages come first
          uint64_t mine = static_cast<uint64_t>(rank * 10 + round);
          uint64_t all[3] = {};
          LOOM_TRY(boot.all_gather(&mine, all, sizeof(mine)));
          for (int r = 0; r < 3; ++r) {
            if (all[r] != static_cast<uint64_t>(r * 10 + round)) return Status::internal("all_gather: wrong bytes");
          }
        }
        watchdog.stop();
        LOOM_TRY(boot.barrier());
        // Rank 0 leaves at once (its connections close while the others may still be reading the
        // barrier's last message): no failure for them.
        if (rank == 0) return {};
        std::this_thread::sleep_for(200ms);
        Status seen = failures.wait(0ms);
        return seen.ok() ? Status{} : Status::internal("a failure without one: " + seen.to_string());
      },
      0ms));
}

size_t thread_count() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// stop() is prompt and leaves no thread; catch_up() on a running watchdog costs nothing.
TEST(WatchdogProtocol, StopIsPromptAndCatchUpIsCheapWhileRunning) {
  Result<std::unique_ptr<Bootstrap>> boot = Bootstrap::connect(BootstrapConfig{0, 1, "", 0, {}, 5s});
  ASSERT_TRUE(boot.ok()) << boot.status().to_string();
  const size_t before = thread_count();
  Failures failures;
  Result<std::unique_ptr<Watchdog>> watchdog = watch_with(**boot, failures);
  ASSERT_TRUE(watchdog.ok()) << watchdog.status().to_string();
  std::this_thread::sleep_for(100ms);
  EXPECT_GE((*watchdog)->turns(), 2u);
  Deadline start = Clock::now();
  for (int i = 0; i < 1000; ++i) (*watchdog)->catch_up();
  EXPECT_LT(Clock::now() - start, 50ms);
  start = Clock::now();
  (*watchdog)->stop();
  EXPECT_LT(Clock::now() - start, 200ms);
  EXPECT_EQ(thread_count(), before);
  EXPECT_TRUE(failures.wait(0ms).ok());
}

}  // namespace
}  // namespace loom::runtime
