#include "launch.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/launcher.h"

namespace loom::bench {

int spawn_self(int argc, char** argv, int ranks) {
  // Same arguments minus "--spawn N" / "--spawn=N": the children read their rank from the env.
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--spawn") == 0) {
      ++i;
      continue;
    }
    if (std::strncmp(argv[i], "--spawn=", 8) == 0) continue;
    args.emplace_back(argv[i]);
  }
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
