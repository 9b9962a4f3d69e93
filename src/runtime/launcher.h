// Local launcher: starts N ranks of one command on this machine (as torchrun does for one node)
// and supervises them until every one has exited.
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free
// loopback MASTER_PORT and a fresh random LOOM_SECRET. When a rank exits non-zero or is killed by
// a signal, the others get SIGTERM and, after a grace period, SIGKILL; the wall-clock limit does
// the same to all. SIGINT and SIGTERM sent to the launcher are passed on to the ranks. Each rank
// runs in its own process group, which is killed when the rank ends, and dies with the launcher
// (PR_SET_PDEATHSIG), so nothing is left behind. Used by loom-run and by `loom-bench --spawn N`.
#pragma once

#include <unistd.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "loom/status.h"

namespace loom::runtime {

struct LaunchOptions {
  int num_ranks = 1;
  // The program (looked up in PATH when it has no '/') and its arguments; see self_command().
  std::vector<std::string> argv;
  std::chrono::milliseconds timeout{0};  // wall-clock limit of the whole job; 0: none
  bool prefix_output = true;             // "[rank N] " before every line the ranks print
  // Set in every rank after the launcher's environment; may not name a variable listed above.
  std::vector<std::pair<std::string, std::string>> extra_env;
  std::chrono::milliseconds kill_grace{3'000};  // SIGTERM to SIGKILL, at most 5 s
  int stdout_fd = STDOUT_FILENO;                // where the ranks' output goes
  int stderr_fd = STDERR_FILENO;
};

struct RankExit {
  int rank = 0;
  bool reaped = false;  // false only for a process that outlived SIGKILL (stuck in the kernel)
  int exit_code = -1;   // when it exited
  int signal = 0;       // when a signal ended it
  bool stopped_by_launcher = false;  // the launcher signalled it (failure elsewhere, limit, Ctrl-C)
  std::string start_error;           // why exec failed, when it did

  bool succeeded() const { return reaped && signal == 0 && exit_code == 0; }
  std::string describe() const;  // "exit code 3", "signal 9 (Killed)", "could not start: ..."
};

struct LaunchReport {
  std::vector<RankExit> ranks;  // by rank
  bool timed_out = false;
  int first_failed_rank = -1;  // the first rank that failed on its own; -1 when none did
  int forwarded_signal = 0;    // SIGINT or SIGTERM the launcher received and passed on
  std::chrono::milliseconds wall_clock_limit{0};
  std::chrono::milliseconds elapsed{0};

  bool all_succeeded() const;
  // One line: "all 4 ranks exited 0 in 1.2 s", "rank 2 failed first (exit code 3); stopped
  // ranks 0, 1, 3 in 0.3 s", "wall-clock limit of 30 s passed; stopped ranks 0-3 in 33.0 s".
  std::string summary() const;
};

// Runs the job to completion. Fails without starting anything on invalid options or a program
// that cannot be found; otherwise every outcome is in the report. One call at a time per process
// (it owns SIGINT/SIGTERM while it runs), from the thread that stays alive until it returns.
Result<LaunchReport> launch_local_ranks(const LaunchOptions& options);

// argv that runs this executable again with `args`, for a tool that launches copies of itself.
Result<std::vector<std::string>> self_command(const std::vector<std::string>& args);

}  // namespace loom::runtime
