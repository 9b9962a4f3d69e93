#include "launch.h"

#include <cstdio>
#include <string>
#include <vector>

#include "runtime/launcher.h"

namespace loom::bench {

int spawn_self(int argc, char** argv, int ranks) {
  // The same arguments, --spawn included: the children find RANK set and do not spawn again, and
  // rank 0's JSON records the command as it was typed.
  const std::vector<std::string> args(argv + 1, argv + argc);
  Result<std::vector<std::string>> command = runtime::self_command(args);
  if (!command.ok()) {
    std::fprintf(stderr, "loom-bench: %s\n", command.status().to_string().c_str());
    return 1;
  }
  runtime::LaunchOptions options;
  options.num_ranks = ranks;
  options.argv = std::move(command).value();
  options.prefix_output = false;  // rank 0 prints the table; the other ranks only print errors
  Result<runtime::LaunchReport> report = runtime::launch_local_ranks(options);
  if (!report.ok()) {
    std::fprintf(stderr, "loom-bench: %s\n", report.status().to_string().c_str());
    return 1;
  }
  if (!report->all_succeeded()) {
    std::fprintf(stderr, "loom-bench: %s\n", report->summary().c_str());
    return 1;
  }
  return 0;
}

}  // namespace loom::bench
