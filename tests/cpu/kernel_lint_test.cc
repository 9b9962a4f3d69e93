// Source checks on the device code (src/kernels/**/*.cuh) for hangs no bounded wait can catch.
//
// A warp collective (__shfl_sync, __ballot_sync, __match_*_sync, __reduce_*_sync, __any/__all_sync,
// __syncwarp) with the full mask, or a CTA barrier (__syncthreads*, cta_all), must be reached by
// every thread it names. Inside a loop whose start depends on the lane or thread (for (v = lane;
// v < n; v += 32)), the threads' trip counts differ whenever n is not a multiple of the stride:
// a thread that takes one more pass waits in the collective for threads that already left the
// loop, and the warp (or CTA) hangs for good, outside every loom wait and deaf to the abort words.
// That is what hung moe_combine in its first GPU run (rows of 33 vectors). Such loops must run in
// uniform passes instead (for (base = 0; base < n; base += 32) { v = base + lane; ... }).
//
// The check is textual: a `for` whose init statement names lane / threadIdx / tid, and whose
// body (brace-matched) contains a collective, fails. A loop that is uniform all the same can say
// so with a comment `// lint: uniform` on its line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#ifndef LOOM_SOURCE_DIR
#error "LOOM_SOURCE_DIR must name the source tree (CMakeLists.txt sets it for loom_cpu_tests)"
#endif

namespace {

namespace fs = std::filesystem;

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The source with comments blanked (newlines kept), so commented-out code does not count.
std::string strip_comments(const std::string& s) {
  std::string out = s;
  for (size_t i = 0; i + 1 < out.size(); ++i) {
    if (out[i] == '/' && out[i + 1] == '/') {
      while (i < out.size() && out[i] != '\n') out[i++] = ' ';
    } else if (out[i] == '/' && out[i + 1] == '*') {
      while (i + 1 < out.size() && !(out[i] == '*' && out[i + 1] == '/')) {
        if (out[i] != '\n') out[i] = ' ';
        ++i;
      }
      if (i + 1 < out.size()) out[i] = out[i + 1] = ' ';
    }
  }
  return out;
}

int line_of(const std::string& s, size_t pos) {
  return 1 + static_cast<int>(std::count(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(pos), '\n'));
}

std::string line_text(const std::string& s, size_t pos) {
  const size_t b = s.rfind('\n', pos);
  const size_t e = s.find('\n', pos);
  return s.substr(b == std::string::npos ? 0 : b + 1, e == std::string::npos ? std::string::npos : e - (b == std::string::npos ? 0 : b + 1));
}

// Every lane-strided loop with a collective inside: "file:line: text".
std::vector<std::string> lane_strided_collectives(const fs::path& file) {
  const std::string raw = read(file);
  const std::string src = strip_comments(raw);
  static const std::regex loop(R"(\bfor\s*\(([^;{}]*);)");
  static const std::regex thread_dependent(R"(\blane\w*\b|\bthreadIdx\b|\btid\b)");
  static const std::regex collective(
      R"(\b__(shfl\w*|ballot|any|all|match_\w+|reduce_\w+)_sync\s*\(|\b__syncwarp\s*\(|\b__syncthreads\w*\s*\(|\bcta_all\s*\()");
  std::vector<std::string> found;
  for (auto it = std::sregex_iterator(src.begin(), src.end(), loop); it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    if (!std::regex_search(m[1].first, m[1].second, thread_dependent)) continue;
    // The loop's header ends at the matching ')'; its body is the following braced block.
    size_t i = static_cast<size_t>(m.position(0)) + static_cast<size_t>(m.length(0));
    int paren = 1;
    while (i < src.size() && paren > 0) {
      if (src[i] == '(') ++paren;
      if (src[i] == ')') --paren;
      ++i;
    }
    while (i < src.size() && (src[i] == ' ' || src[i] == '\n')) ++i;
    const size_t begin = i;
    if (i < src.size() && src[i] == '{') {  // a block
      int depth = 0;
      do {
        if (src[i] == '{') ++depth;
        if (src[i] == '}') --depth;
        ++i;
      } while (i < src.size() && depth > 0);
    } else {  // one statement
      i = std::min(src.find(';', i), src.size());
    }
    const std::string body = src.substr(begin, i - begin);
    if (!std::regex_search(body, collective)) continue;
    const size_t at = static_cast<size_t>(m.position(0));
    if (line_text(raw, at).find("lint: uniform") != std::string::npos) continue;
    found.push_back(file.string() + ":" + std::to_string(line_of(src, at)) + ": " + line_text(raw, at));
  }
  return found;
}

TEST(KernelLint, NoWarpCollectiveInsideALaneStridedLoop) {
  const fs::path kernels = fs::path(LOOM_SOURCE_DIR) / "src" / "kernels";
  ASSERT_TRUE(fs::is_directory(kernels)) << kernels;
  int files = 0;
  std::vector<std::string> found;
  for (const auto& entry : fs::recursive_directory_iterator(kernels)) {
    const std::string ext = entry.path().extension().string();
    if (!entry.is_regular_file() || (ext != ".cuh" && ext != ".cu" && ext != ".h")) continue;
    ++files;
    for (std::string& f : lane_strided_collectives(entry.path())) found.push_back(std::move(f));
  }
  EXPECT_GT(files, 10) << "no kernel sources under " << kernels;
  std::string list;
  for (const std::string& f : found) list += "\n  " + f;
  EXPECT_TRUE(found.empty()) << "warp collectives or barriers inside loops whose trip count differs per thread (the "
                                "threads with one more pass wait for good; run the loop in uniform passes):"
                             << list;
}

// The check itself, on the loop that hung moe_combine and on its fix.
TEST(KernelLint, FindsTheLoopThatHungMoeCombine) {
  const fs::path dir = fs::temp_directory_path() / ("loom_kernel_lint_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path bad = dir / "bad.cuh", good = dir / "good.cuh";
  std::ofstream(bad) << "void f() {\n  for (uint64_t v = lane; v < vectors; v += 32) {\n"
                        "    const uint64_t a = __shfl_sync(0xffffffffu, addr, j);\n    out[v] = a;\n  }\n}\n";
  std::ofstream(good) << "void f() {\n  for (uint64_t base = 0; base < vectors; base += 32) {\n"
                         "    const uint64_t v = base + lane;\n    const uint64_t a = __shfl_sync(0xffffffffu, addr, j);\n"
                         "    if (v < vectors) out[v] = a;\n  }\n  for (uint32_t e = lane; e < n; e += 32) hist[e] = 0;\n"
                         "  // for (v = lane; v < n; v += 32) { __syncwarp(); }\n}\n";
  const std::vector<std::string> b = lane_strided_collectives(bad);
  const std::vector<std::string> g = lane_strided_collectives(good);
  fs::remove_all(dir);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_NE(b[0].find("bad.cuh:2:"), std::string::npos) << b[0];
  EXPECT_TRUE(g.empty()) << g[0];
}

}  // namespace
