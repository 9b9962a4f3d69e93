// loom-bench --spawn N: re-runs this command as N local ranks under the launcher.
#pragma once

namespace loom::bench {

// Starts N copies of argv as ranks 0..N-1 (which see RANK set) and returns the exit code.
int spawn_self(int argc, char** argv, int ranks);

}  // namespace loom::bench
