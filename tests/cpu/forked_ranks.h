// Test helpers for multi-rank CPU tests over loopback: ranks are forked processes; each reports
// its Status to the test process through a pipe and leaves with _exit, and the test process
// bounds every wait. Used by the bootstrap and watchdog tests.
#pragma once

#include <gtest/gtest.h>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "loom/status.h"
#include "runtime/bootstrap.h"

namespace loom::runtime::test_support {

using namespace std::chrono_literals;

struct RankOutcome {
  bool reported = false;  // the child wrote a result before it exited
  StatusCode code = StatusCode::kInternal;
  std::string message;
  int64_t elapsed_ms = 0;  // how long its body ran
};

// Children that run a body each and send back its Status: code (1 byte), elapsed ms (8 bytes),
// then the message.
class ForkedRanks {
 public:
  ForkedRanks() = default;
  ForkedRanks(const ForkedRanks&) = delete;
  ForkedRanks& operator=(const ForkedRanks&) = delete;
  ~ForkedRanks() { kill_and_reap(); }

  void start(const std::function<Status()>& body) {
    int ends[2];
    ASSERT_EQ(::pipe(ends), 0);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(ends[0]);
      auto begin = std::chrono::steady_clock::now();
      Status status = body();
      int64_t elapsed =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - begin).count();
      std::string record(1, static_cast<char>(status.code()));
      record.append(reinterpret_cast<const char*>(&elapsed), sizeof(elapsed));
      record += status.message();
      (void)!::write(ends[1], record.data(), record.size());
      ::_exit(0);
    }
    ::close(ends[1]);
    children_.push_back(Child{pid, ends[0], {}, false});
  }

  // Waits until every child has reported or exited, at most `limit`; the rest are killed.
  std::vector<RankOutcome> wait(std::chrono::seconds limit = 30s) {
    auto deadline = std::chrono::steady_clock::now() + limit;
    while (true) {
      std::vector<pollfd> fds;
      std::vector<Child*> open;
      for (Child& c : children_) {
        if (!c.closed) {
          fds.push_back({c.fd, POLLIN, 0});
          open.push_back(&c);
        }
      }
      if (fds.empty()) break;
      int left_ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                         deadline - std::chrono::steady_clock::now())
                                         .count());
      if (left_ms <= 0) {
        ADD_FAILURE() << "ranks did not finish within " << limit.count() << " s";
        break;
      }
      if (::poll(fds.data(), fds.size(), left_ms) <= 0) continue;
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        char buffer[4096];
        ssize_t n = ::read(open[i]->fd, buffer, sizeof(buffer));
        if (n > 0) {
          open[i]->record.append(buffer, static_cast<size_t>(n));
        } else {
          ::close(open[i]->fd);
          open[i]->closed = true;
        }
      }
    }
    kill_and_reap();
    std::vector<RankOutcome> outcomes;
    for (const Child& c : children_) {
      RankOutcome outcome;
      if (c.record.size() >= 1 + sizeof(int64_t)) {
        outcome.reported = true;
        outcome.code = static_cast<StatusCode>(c.record[0]);
        std::memcpy(&outcome.elapsed_ms, c.record.data() + 1, sizeof(int64_t));
        outcome.message = c.record.substr(1 + sizeof(int64_t));
      }
      outcomes.push_back(outcome);
    }
    return outcomes;
  }

 private:
  struct Child {
    pid_t pid;
    int fd;
    std::string record;
    bool closed;
  };

  void kill_and_reap() {
    for (Child& c : children_) {
      if (!c.closed) {
        ::close(c.fd);
        c.closed = true;
      }
      if (c.pid <= 0) continue;
      // Bounded: a child that does not exit within 5 s of reporting is killed.
      for (int i = 0; i < 500 && ::waitpid(c.pid, nullptr, WNOHANG) == 0; ++i) std::this_thread::sleep_for(10ms);
      if (::waitpid(c.pid, nullptr, WNOHANG) == 0) {
        ::kill(c.pid, SIGKILL);
        ::waitpid(c.pid, nullptr, 0);
      }
      c.pid = -1;
    }
  }

  std::vector<Child> children_;
};

// Runs body(rank) in `count` processes. `after_fork` runs in the test process once all started.
inline std::vector<RankOutcome> run_ranks(int count, const std::function<Status(int)>& body,
                                   const std::function<void()>& after_fork = {}) {
  ForkedRanks ranks;
  for (int r = 0; r < count; ++r) ranks.start([&body, r] { return body(r); });
  if (after_fork) after_fork();
  return ranks.wait();
}

#define EXPECT_RANK_OK(outcomes, r) \
  EXPECT_EQ((outcomes)[r].code, StatusCode::kOk) << "rank " << (r) << ": " << (outcomes)[r].message

// A unique id for a job whose ranks are forked: rank 0's child inherits the prepared listener,
// the test process drops its own copy after forking.
inline UniqueId make_id_on(const char* host) {
  Result<UniqueId> id = Bootstrap::create_unique_id(host);
  EXPECT_TRUE(id.ok()) << id.status().to_string();
  return id.ok() ? *id : UniqueId{};
}
inline UniqueId make_id() { return make_id_on("127.0.0.1"); }

}  // namespace loom::runtime::test_support
