// loom-run: starts N local ranks of a command and supervises them.
//
//   loom-run -n N [--ranks-per-gpu K] [--timeout SEC] [--no-prefix] -- command args...
//
// --ranks-per-gpu K sets LOOM_RANKS_PER_GPU=K in every rank: the shared-GPU mode, where up to K
// ranks take turns on one GPU (for correctness runs on few GPUs; it measures no speed).
//
// Exit status: 0 iff every rank exited 0; otherwise the first failed rank's exit code (128 + its
// signal number when a signal ended it), 124 when the wall-clock limit passed, 128 + the signal
// number when loom-run was interrupted, 1 for anything else. The last line on stderr says what
// happened and names the failed ranks.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "core/env.h"
#include "runtime/launcher.h"

namespace {

constexpr int kTimedOutExit = 124;  // as timeout(1)

int exit_status(const loom::runtime::LaunchReport& report) {
  if (report.all_succeeded()) return 0;
  if (report.first_failed_rank >= 0) {
    const loom::runtime::RankExit& failed = report.ranks[report.first_failed_rank];
    if (failed.signal != 0) return 128 + failed.signal;
    if (failed.exit_code > 0) return failed.exit_code;
    return 1;
  }
  if (report.timed_out) return kTimedOutExit;
  if (report.forwarded_signal != 0) return 128 + report.forwarded_signal;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Start N local ranks of a command (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOOM_SECRET set)"};
  loom::runtime::LaunchOptions options;
  double timeout_seconds = 0;
  bool no_prefix = false;
  int ranks_per_gpu = 0;
  app.add_option("-n,--nproc", options.num_ranks, "number of ranks")->required()->check(CLI::Range(1, 1024));
  app.add_option("--timeout", timeout_seconds, "wall-clock limit in seconds; every rank is killed after it (0: none)")
      ->check(CLI::NonNegativeNumber)
      ->check(CLI::Validator(
          [](std::string& text) {
            const double v = std::stod(text);
            return v == 0 || (v >= 0.001 && v <= 1e9) ? std::string() : std::string("0 (none) or 0.001 .. 1e9 seconds");
          },
          "0 or 0.001..1e9"));
  app.add_option("--ranks-per-gpu", ranks_per_gpu,
                 "let up to K ranks share one GPU (sets LOOM_RANKS_PER_GPU=K; correctness only, measures no speed)")
      ->check(CLI::Range(1, loom::env::kMaxRanksPerGpu));
  app.add_flag("--no-prefix", no_prefix, "do not prefix output lines with [rank N]");
  app.add_option("command", options.argv, "the command each rank runs (after --)")->required();
  CLI11_PARSE(app, argc, argv);

  options.prefix_output = !no_prefix;
  if (ranks_per_gpu > 0) options.extra_env.emplace_back("LOOM_RANKS_PER_GPU", std::to_string(ranks_per_gpu));
  options.timeout = std::chrono::milliseconds(static_cast<long long>(timeout_seconds * 1000.0));
  loom::Result<loom::runtime::LaunchReport> report = loom::runtime::launch_local_ranks(options);
  if (!report.ok()) {
    std::fprintf(stderr, "loom-run: %s\n", report.status().to_string().c_str());
    return 1;
  }
  std::fprintf(stderr, "loom-run: %s\n", report->summary().c_str());
  return exit_status(*report);
}
