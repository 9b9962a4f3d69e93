// Local launcher and loom-run, with /bin/sh ranks. Every wait on a process is bounded.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/launcher.h"

namespace loom::runtime {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// An anonymous file the ranks' output goes to.
class CapturedOutput {
 public:
  CapturedOutput() : file_(std::tmpfile()) {}
  ~CapturedOutput() {
    if (file_) std::fclose(file_);
  }
  CapturedOutput(const CapturedOutput&) = delete;
  CapturedOutput& operator=(const CapturedOutput&) = delete;

  int fd() const { return fileno(file_); }
  std::string text() const {
    std::string all;
    char buffer[4096];
    for (off_t offset = 0;;) {
      ssize_t n = ::pread(fd(), buffer, sizeof(buffer), offset);
      if (n <= 0) break;
      all.append(buffer, static_cast<size_t>(n));
      offset += n;
    }
    return all;
  }
  std::vector<std::string> lines() const {
    std::vector<std::string> result;
    std::istringstream in(text());
    for (std::string line; std::getline(in, line);) result.push_back(line);
    return result;
  }

 private:
  FILE* file_;
};

// A scratch directory, removed with its files afterwards.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/loom-launcher-test-XXXXXX";
    path_ = ::mkdtemp(pattern) ? pattern : "";
  }
  ~TempDir() {
    if (!path_.empty()) std::system(("rm -rf '" + path_ + "'").c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

LaunchOptions sh_ranks(int count, const std::string& script, const CapturedOutput& out, const CapturedOutput& err) {
  LaunchOptions options;
  options.num_ranks = count;
  options.argv = {"/bin/sh", "-c", script};
  options.stdout_fd = out.fd();
  options.stderr_fd = err.fd();
  return options;
}

std::optional<pid_t> read_pid(const std::string& path) {
  std::ifstream in(path);
  long pid = 0;
  if (in >> pid && pid > 0) return static_cast<pid_t>(pid);
  return std::nullopt;
}

// Gone or a zombie waiting for init: either way no longer running.
bool process_ended(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  if (!std::getline(stat, content)) return true;
  size_t paren = content.rfind(')');
  return paren != std::string::npos && paren + 2 < content.size() && content[paren + 2] == 'Z';
}

bool ends_within(pid_t pid, std::chrono::milliseconds limit) {
  for (auto deadline = Clock::now() + limit; Clock::now() < deadline; std::this_thread::sleep_for(20ms)) {
    if (process_ended(pid)) return true;
  }
  return process_ended(pid);
}

TEST(Launcher, AllRanksSucceedWithTheirEnvironment) {
  CapturedOutput out, err;
  LaunchOptions options = sh_ranks(4, R"(
    test "$WORLD_SIZE" = 4 && test "$LOCAL_WORLD_SIZE" = 4 && test "$LOCAL_RANK" = "$RANK" &&
    test "$MASTER_ADDR" = 127.0.0.1 && test "$MASTER_PORT" -gt 0 && test ${#LOOM_SECRET} -eq 32 &&
    test "$LAUNCH_TEST_EXTRA" = yes || exit 9
    echo "$RANK $MASTER_PORT $LOOM_SECRET")",
                                   out, err);
  options.extra_env = {{"LAUNCH_TEST_EXTRA", "yes"}};
  Result<LaunchReport> report = launch_local_ranks(options);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_TRUE(report->all_succeeded()) << report->summary() << "\n" << err.text();
  EXPECT_EQ(report->first_failed_rank, -1);
  EXPECT_NE(report->summary().find("all 4 ranks exited 0"), std::string::npos) << report->summary();
  // Each rank saw its own rank and the job's one port and secret.
  std::set<std::string> job;
  std::vector<std::string> lines = out.lines();
  ASSERT_EQ(lines.size(), 4u) << out.text();
  for (const std::string& line : lines) {
    int prefix_rank = -1;
    int rank = -1;
    char rest[128] = {0};
    ASSERT_EQ(std::sscanf(line.c_str(), "[rank %d] %d %127[^\n]", &prefix_rank, &rank, rest), 3) << line;
    EXPECT_EQ(prefix_rank, rank) << line;
    job.insert(rest);
  }
  EXPECT_EQ(job.size(), 1u) << out.text();
}

TEST(Launcher, FailingRankStopsTheOthersQuickly) {
  CapturedOutput out, err;
  LaunchOptions options = sh_ranks(4, R"(if [ "$RANK" = 2 ]; then exit 3; fi; sleep 60)", out, err);
  auto begin = Clock::now();
  Result<LaunchReport> report = launch_local_ranks(options);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_LT(Clock::now() - begin, 10s);
  EXPECT_FALSE(report->all_succeeded());
  EXPECT_EQ(report->first_failed_rank, 2);
  EXPECT_EQ(report->ranks[2].exit_code, 3);
  EXPECT_FALSE(report->ranks[2].stopped_by_launcher);
  for (int r : {0, 1, 3}) {
    EXPECT_TRUE(report->ranks[r].stopped_by_launcher) << r;
    EXPECT_EQ(report->ranks[r].signal, SIGTERM) << r;
  }
  EXPECT_NE(report->summary().find("rank 2 failed first (exit code 3); stopped rank(s) 0-1, 3"), std::string::npos)
      << report->summary();
}

TEST(Launcher, WallClockLimitStopsEveryRank) {
  CapturedOutput out, err;
  // Rank 0 ignores SIGTERM, so only SIGKILL after the grace period ends it.
  LaunchOptions options = sh_ranks(2, R"(if [ "$RANK" = 0 ]; then trap "" TERM; fi; sleep 60)", out, err);
  options.timeout = 1000ms;
  options.kill_grace = 500ms;
  auto begin = Clock::now();
  Result<LaunchReport> report = launch_local_ranks(options);
  auto elapsed = Clock::now() - begin;
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_TRUE(report->timed_out);
  EXPECT_EQ(report->first_failed_rank, -1);
  EXPECT_GE(elapsed, 1000ms);
  EXPECT_LT(elapsed, 4s);
  EXPECT_EQ(report->ranks[0].signal, SIGKILL);
  EXPECT_EQ(report->ranks[1].signal, SIGTERM);
  EXPECT_NE(report->summary().find("wall-clock limit of 1.0 s passed; stopped rank(s) 0-1"), std::string::npos)
      << report->summary();
}

TEST(Launcher, OutputLinesArePrefixed) {
  CapturedOutput out, err;
  LaunchOptions options =
      sh_ranks(2, R"(echo "line one"; echo "line two"; printf "no newline"; echo "to stderr" >&2)", out, err);
  Result<LaunchReport> report = launch_local_ranks(options);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  ASSERT_TRUE(report->all_succeeded()) << report->summary();
  std::vector<std::string> lines = out.lines();
  std::multiset<std::string> expected;
  for (int r = 0; r < 2; ++r) {
    std::string prefix = "[rank " + std::to_string(r) + "] ";
    expected.insert({prefix + "line one", prefix + "line two", prefix + "no newline"});
  }
  EXPECT_EQ(std::multiset<std::string>(lines.begin(), lines.end()), expected) << out.text();
  std::vector<std::string> err_lines = err.lines();
  EXPECT_EQ(std::multiset<std::string>(err_lines.begin(), err_lines.end()),
            (std::multiset<std::string>{"[rank 0] to stderr", "[rank 1] to stderr"}))
      << err.text();
}

TEST(Launcher, OutputPassesThroughWithoutPrefix) {
  CapturedOutput out, err;
  LaunchOptions options = sh_ranks(1, R"(echo "plain"; printf "tail"; echo "err" >&2)", out, err);
  options.prefix_output = false;
  Result<LaunchReport> report = launch_local_ranks(options);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_TRUE(report->all_succeeded());
  EXPECT_EQ(out.text(), "plain\ntail");
  EXPECT_EQ(err.text(), "err\n");
}

TEST(Launcher, LeavesNoProcessBehind) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  CapturedOutput out, err;
  // Every rank starts a background sleep (a grandchild of the launcher) and publishes its pid;
  // once all three are published, rank 1 fails.
  LaunchOptions options = sh_ranks(3, R"(
    sleep 60 & echo $! > "$SCRATCH/tmp-$RANK" && mv "$SCRATCH/tmp-$RANK" "$SCRATCH/background-$RANK"
    if [ "$RANK" = 1 ]; then
      for r in 0 2; do while [ ! -e "$SCRATCH/background-$r" ]; do sleep 0.02; done; done
      exit 1
    fi
    sleep 60)",
                                   out, err);
  options.timeout = 20s;
  options.extra_env = {{"SCRATCH", dir.path()}};
  Result<LaunchReport> report = launch_local_ranks(options);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_EQ(report->first_failed_rank, 1);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(report->ranks[r].reaped) << r;
    std::optional<pid_t> background = read_pid(dir.path() + "/background-" + std::to_string(r));
    ASSERT_TRUE(background.has_value()) << r;
    EXPECT_TRUE(ends_within(*background, 2s)) << "rank " << r << "'s background process survived";
  }
  // And no child of this process is left to reap.
  EXPECT_EQ(::waitpid(-1, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
}

TEST(Launcher, RejectsBadOptions) {
  CapturedOutput out, err;
  LaunchOptions options = sh_ranks(0, "true", out, err);
  EXPECT_EQ(launch_local_ranks(options).status().code(), StatusCode::kInvalidArgument);
  options = sh_ranks(2, "true", out, err);
  options.argv.clear();
  EXPECT_EQ(launch_local_ranks(options).status().code(), StatusCode::kInvalidArgument);
  options = sh_ranks(2, "true", out, err);
  options.argv = {"loom-no-such-program"};
  Result<LaunchReport> missing = launch_local_ranks(options);
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("not found in PATH"), std::string::npos);
  options = sh_ranks(2, "true", out, err);
  options.extra_env = {{"RANK", "7"}};
  EXPECT_EQ(launch_local_ranks(options).status().code(), StatusCode::kInvalidArgument);
  options = sh_ranks(2, "true", out, err);
  options.kill_grace = 6s;
  EXPECT_EQ(launch_local_ranks(options).status().code(), StatusCode::kInvalidArgument);
}

TEST(Launcher, SelfCommandRerunsThisExecutable) {
  Result<std::vector<std::string>> argv = self_command({"--gtest_list_tests"});
  ASSERT_TRUE(argv.ok()) << argv.status().to_string();
  ASSERT_EQ(argv->size(), 2u);
  EXPECT_EQ(::access((*argv)[0].c_str(), X_OK), 0) << (*argv)[0];
  EXPECT_EQ((*argv)[1], "--gtest_list_tests");
}

// ---- loom-run ----------------------------------------------------------------------------------

// Starts loom-run with `args`, its stdout and stderr going to `output`.
pid_t start_loom_run(const std::vector<std::string>& args, const CapturedOutput& output) {
  std::vector<std::string> argv = {LOOM_RUN_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> raw;
  for (std::string& a : argv) raw.push_back(a.data());
  raw.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(output.fd(), STDOUT_FILENO);
    ::dup2(output.fd(), STDERR_FILENO);
    ::execv(raw[0], raw.data());
    ::_exit(127);
  }
  return pid;
}

// The wait status, or nullopt if it ran past `limit` (it is killed then).
std::optional<int> wait_bounded(pid_t pid, std::chrono::milliseconds limit) {
  for (auto deadline = Clock::now() + limit; Clock::now() < deadline; std::this_thread::sleep_for(10ms)) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return std::nullopt;
}

// Kills and reaps a child when a failed assertion leaves the test early.
class ReapGuard {
 public:
  explicit ReapGuard(pid_t pid) : pid_(pid) {}
  ~ReapGuard() {
    if (pid_ > 0) wait_bounded(pid_, 0ms);
  }
  ReapGuard(const ReapGuard&) = delete;
  ReapGuard& operator=(const ReapGuard&) = delete;
  pid_t release() { return std::exchange(pid_, -1); }

 private:
  pid_t pid_;
};

std::optional<int> run_loom_run(const std::vector<std::string>& args, const CapturedOutput& output) {
  pid_t pid = start_loom_run(args, output);
  if (pid < 0) return std::nullopt;
  return wait_bounded(pid, 20s);
}

TEST(LauncherLoomRun, ExitStatusAndSummary) {
  {
    CapturedOutput output;
    std::optional<int> status = run_loom_run({"-n", "3", "--", "/bin/sh", "-c", "exit 0"}, output);
    ASSERT_TRUE(status.has_value());
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << output.text();
    EXPECT_NE(output.text().find("loom-run: all 3 ranks exited 0"), std::string::npos) << output.text();
  }
  {
    CapturedOutput output;
    auto begin = Clock::now();
    std::optional<int> status = run_loom_run(
        {"-n", "3", "--", "/bin/sh", "-c", R"(if [ "$RANK" = 1 ]; then exit 5; fi; sleep 60)"}, output);
    ASSERT_TRUE(status.has_value());
    EXPECT_LT(Clock::now() - begin, 10s);
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 5) << output.text();
    EXPECT_NE(output.text().find("loom-run: rank 1 failed first (exit code 5)"), std::string::npos) << output.text();
  }
  {
    CapturedOutput output;
    std::optional<int> status = run_loom_run({"-n", "2", "--timeout", "0.5", "--", "sleep", "60"}, output);
    ASSERT_TRUE(status.has_value());
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 124) << output.text();
  }
  {
    CapturedOutput output;
    std::optional<int> status = run_loom_run({"-n", "0", "--", "true"}, output);
    ASSERT_TRUE(status.has_value());
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0) << output.text();
  }
}

TEST(LauncherLoomRun, PassesSignalsOnToTheRanks) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  CapturedOutput output;
  // Each rank publishes its pid atomically (write, then rename), then becomes `sleep`.
  std::string script = R"(echo $$ > "$SCRATCH/rank-$RANK.tmp" && mv "$SCRATCH/rank-$RANK.tmp" "$SCRATCH/rank-$RANK" &&
                          exec sleep 60)";
  ::setenv("SCRATCH", dir.path().c_str(), 1);
  pid_t loom_run = start_loom_run({"-n", "2", "--", "/bin/sh", "-c", script}, output);
  ::unsetenv("SCRATCH");
  ASSERT_GT(loom_run, 0);
  ReapGuard guard(loom_run);
  std::vector<pid_t> ranks;
  for (auto deadline = Clock::now() + 10s; ranks.size() < 2 && Clock::now() < deadline;) {
    ranks.clear();
    for (int r = 0; r < 2; ++r) {
      if (std::optional<pid_t> pid = read_pid(dir.path() + "/rank-" + std::to_string(r))) ranks.push_back(*pid);
    }
    if (ranks.size() < 2) std::this_thread::sleep_for(20ms);
  }
  ASSERT_EQ(ranks.size(), 2u) << output.text();
  ::kill(loom_run, SIGTERM);
  std::optional<int> status = wait_bounded(guard.release(), 8s);
  ASSERT_TRUE(status.has_value()) << "loom-run did not stop";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 128 + SIGTERM) << output.text();
  EXPECT_NE(output.text().find("interrupted by SIGTERM"), std::string::npos) << output.text();
  for (pid_t pid : ranks) EXPECT_TRUE(ends_within(pid, 2s)) << "rank process " << pid << " survived";
}

}  // namespace
}  // namespace loom::runtime
