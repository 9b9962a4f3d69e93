// Progress of a long run: "[i/n] <what>  elapsed 12.3 s" on stderr as each shape starts (rank 0
// only), so a run of many minutes says where it is, and where it stopped if it stops.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace loom::bench {

class Progress {
 public:
  // `total` shapes will be stepped through; only a Progress made with `print` writes anything.
  Progress(int total, bool print, std::chrono::steady_clock::time_point start)
      : total_(total), print_(print), start_(start) {}

  void step(const std::string& what) {
    ++done_;
    if (!print_) return;
    const double elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::fprintf(stderr, "[%d/%d] %s  elapsed %.1f s\n", done_, total_, what.c_str(), elapsed_s);
    std::fflush(stderr);
  }

 private:
  int total_ = 0;
  int done_ = 0;
  bool print_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace loom::bench
