#include "runtime/launcher.h"

#include <fcntl.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string_view>

#include "core/log.h"
#include "runtime/rank_list.h"
#include "runtime/socket.h"

extern char** environ;

namespace loom::runtime {
namespace {

using std::chrono::milliseconds;

constexpr int kMaxRanks = 1024;
constexpr milliseconds kMaxKillGrace{5'000};
// Children are reaped by polling (no SIGCHLD handler to install or race with); this bounds how
// late an exit is noticed.
constexpr milliseconds kReapInterval{20};
// After SIGKILL only a process stuck in the kernel survives; waiting longer would hang the caller.
constexpr milliseconds kReapAfterKill{5'000};
// Output still buffered in pipes after the last rank exited (or held open by an escaped
// grandchild) is read for at most this long.
constexpr milliseconds kDrainAfterExit{2'000};
// A "line" without a newline is flushed at this size, so a rank cannot grow our memory.
constexpr size_t kMaxLineBytes = 64 * 1024;

constexpr const char* kLauncherVariables[] = {"RANK",        "WORLD_SIZE",  "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                               "MASTER_ADDR", "MASTER_PORT", "LOOM_SECRET"};

std::atomic<int> g_signal_count{0};
std::atomic<int> g_last_signal{0};
std::atomic<bool> g_launch_running{false};

extern "C" void remember_signal(int signal_number) {
  g_last_signal.store(signal_number);
  g_signal_count.fetch_add(1);
}

// Catches SIGINT and SIGTERM while a job runs (to pass them on) and restores the previous
// dispositions afterwards.
class SignalCapture {
 public:
  SignalCapture() {
    g_signal_count.store(0);
    struct sigaction action {};
    action.sa_handler = remember_signal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &previous_int_);
    sigaction(SIGTERM, &action, &previous_term_);
  }
  ~SignalCapture() {
    sigaction(SIGINT, &previous_int_, nullptr);
    sigaction(SIGTERM, &previous_term_, nullptr);
  }
  SignalCapture(const SignalCapture&) = delete;
  SignalCapture& operator=(const SignalCapture&) = delete;

 private:
  struct sigaction previous_int_ {};
  struct sigaction previous_term_ {};
};

// Writes everything, retrying short writes; gives up (returns false) when the sink is gone.
bool write_all(int fd, const char* data, size_t bytes) {
  while (bytes > 0) {
    ssize_t written = ::write(fd, data, bytes);
    if (written > 0) {
      data += written;
      bytes -= static_cast<size_t>(written);
    } else if (written < 0 && errno == EAGAIN) {
      pollfd entry{fd, POLLOUT, 0};
      ::poll(&entry, 1, 100);
    } else if (written < 0 && errno != EINTR) {
      return false;
    }
  }
  return true;
}

// Copies one rank's stdout or stderr to the launcher's, with "[rank N] " before each line.
class LineRelay {
 public:
  LineRelay(UniqueFd source, int sink, std::string prefix)
      : source_(std::move(source)), sink_(sink), prefix_(std::move(prefix)) {}

  int fd() const { return source_.get(); }
  bool open() const { return source_.valid(); }

  // Reads what the pipe holds; at end of stream flushes the last partial line and closes.
  void pump() {
    char buffer[16384];
    ssize_t received = ::read(source_.get(), buffer, sizeof(buffer));
    if (received < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (received <= 0) return close();
    partial_.append(buffer, static_cast<size_t>(received));
    std::string out;
    size_t start = 0;
    for (size_t newline; (newline = partial_.find('\n', start)) != std::string::npos; start = newline + 1) {
      out += prefix_;
      out.append(partial_, start, newline + 1 - start);
    }
    partial_.erase(0, start);
    if (partial_.size() >= kMaxLineBytes) flush_partial(out);
    emit(out);
  }

  void close() {
    if (!source_.valid()) return;
    std::string out;
    flush_partial(out);
    emit(out);
    source_.reset();
  }

 private:
  void flush_partial(std::string& out) {
    if (partial_.empty()) return;
    out += prefix_;
    out += partial_;
    out += '\n';
    partial_.clear();
  }
  void emit(const std::string& out) {
    // One write per batch of whole lines, so ranks' lines do not interleave mid-line.
    if (!out.empty() && sink_ >= 0 && !write_all(sink_, out.data(), out.size())) sink_ = -1;
  }

  UniqueFd source_;
  int sink_;
  std::string prefix_;
  std::string partial_;
};

struct Rank {
  pid_t pid = -1;  // also its process group
  bool running = false;
  RankExit exit;
};

Status make_pipe(UniqueFd& read_end, UniqueFd& write_end) {
  int ends[2];
  if (::pipe2(ends, O_CLOEXEC) != 0) return Status::errno_error("launch: pipe", errno);
  read_end.reset(ends[0]);
  write_end.reset(ends[1]);
  return {};
}

Result<std::string> find_program(const std::string& name) {
  auto executable = [](const std::string& path) {
    struct stat info {};
    return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) && ::access(path.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    if (!executable(name)) return Status::invalid_argument("cannot execute '" + name + "'");
    return name;
  }
  const char* path = std::getenv("PATH");
  std::string_view dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    size_t colon = dirs.find(':');
    std::string dir(dirs.substr(0, colon));
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (executable(candidate)) return candidate;
    if (colon == std::string_view::npos) break;
    dirs.remove_prefix(colon + 1);
  }
  return Status::invalid_argument("'" + name + "' not found in PATH");
}

bool launcher_owns(std::string_view name) {
  return std::find(std::begin(kLauncherVariables), std::end(kLauncherVariables), name) !=
         std::end(kLauncherVariables);
}

Status validate(const LaunchOptions& options) {
  if (options.num_ranks < 1 || options.num_ranks > kMaxRanks) {
    return Status::invalid_argument("launch: rank count " + std::to_string(options.num_ranks) + " is outside [1, " +
                                    std::to_string(kMaxRanks) + "]");
  }
  if (options.argv.empty() || options.argv[0].empty()) return Status::invalid_argument("launch: no command");
  if (options.timeout < milliseconds::zero()) return Status::invalid_argument("launch: negative timeout");
  if (options.kill_grace < milliseconds::zero() || options.kill_grace > kMaxKillGrace) {
    return Status::invalid_argument("launch: kill grace must be within [0, 5000] ms");
  }
  for (const auto& [name, value] : options.extra_env) {
    if (name.empty() || name.find('=') != std::string::npos) {
      return Status::invalid_argument("launch: bad environment variable name '" + name + "'");
    }
    if (launcher_owns(name)) return Status::invalid_argument("launch: " + name + " is set by the launcher");
  }
  return {};
}

Result<std::string> random_secret_hex() {
  unsigned char secret[16];
  if (RAND_bytes(secret, sizeof(secret)) != 1) return Status::system_error("launch: RAND_bytes failed");
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char byte : secret) {
    hex += kDigits[byte >> 4];
    hex += kDigits[byte & 15];
  }
  return hex;
}

std::string seconds_text(milliseconds ms) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", static_cast<double>(ms.count()) / 1000.0);
  return text;
}

// Starts the ranks and watches them: relays output, reaps, and escalates on failure, the wall
// clock and forwarded signals.
class Supervisor {
 public:
  Supervisor(const LaunchOptions& options, std::string program)
      : options_(options), program_(std::move(program)), ranks_(static_cast<size_t>(options.num_ranks)) {
    for (int r = 0; r < options.num_ranks; ++r) ranks_[r].exit.rank = r;
  }
  ~Supervisor() {
    // Live ranks remain only when starting failed part-way: take the started ones down.
    signal_running(SIGKILL);
    Clock::time_point give_up = Clock::now() + kReapAfterKill;
    while (any_running() && Clock::now() < give_up) {
      for (Rank& rank : ranks_) {
        if (rank.running && ::waitpid(rank.pid, nullptr, WNOHANG) == rank.pid) rank.running = false;
      }
      if (any_running()) ::poll(nullptr, 0, static_cast<int>(kReapInterval.count()));
    }
  }
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  Status start(uint16_t port, const std::string& secret);
  LaunchReport run();

 private:
  Status start_rank(int rank, const std::vector<std::string>& environment);
  void reap();
  void signal_running(int signal_number);
  void begin_shutdown(int signal_number);
  bool any_running() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
  }

  const LaunchOptions& options_;
  std::string program_;
  std::vector<Rank> ranks_;
  std::vector<LineRelay> relays_;
  LaunchReport report_;
  bool shutting_down_ = false;
  std::optional<Clock::time_point> kill_at_;     // SIGKILL after the grace period
  std::optional<Clock::time_point> give_up_at_;  // stop waiting for unkillable processes
};

Status Supervisor::start(uint16_t port, const std::string& secret) {
  std::vector<std::string> common;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    std::string_view name = text.substr(0, text.find('='));
    bool replaced = launcher_owns(name) || std::any_of(options_.extra_env.begin(), options_.extra_env.end(),
                                                       [&](const auto& e) { return e.first == name; });
    if (!replaced) common.emplace_back(text);
  }
  for (const auto& [name, value] : options_.extra_env) common.push_back(name + "=" + value);
  common.push_back("WORLD_SIZE=" + std::to_string(options_.num_ranks));
  common.push_back("LOCAL_WORLD_SIZE=" + std::to_string(options_.num_ranks));
  common.push_back("MASTER_ADDR=127.0.0.1");
  common.push_back("MASTER_PORT=" + std::to_string(port));
  common.push_back("LOOM_SECRET=" + secret);
  for (int r = 0; r < options_.num_ranks; ++r) {
    std::vector<std::string> environment = common;
    environment.push_back("RANK=" + std::to_string(r));
    environment.push_back("LOCAL_RANK=" + std::to_string(r));
    LOOM_TRY(start_rank(r, environment));
  }
  return {};
}

Status Supervisor::start_rank(int rank, const std::vector<std::string>& environment) {
  // Everything the child needs is built before fork(): after it only async-signal-safe calls.
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(program_.c_str()));
  for (size_t i = 1; i < options_.argv.size(); ++i) argv.push_back(const_cast<char*>(options_.argv[i].c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const std::string& entry : environment) envp.push_back(const_cast<char*>(entry.c_str()));
  envp.push_back(nullptr);

  UniqueFd out_read, out_write, err_read, err_write, exec_read, exec_write;
  if (options_.prefix_output) {
    LOOM_TRY(make_pipe(out_read, out_write));
    LOOM_TRY(make_pipe(err_read, err_write));
  }
  // Carries errno from a failed execve(); closed by a successful one (close-on-exec).
  LOOM_TRY(make_pipe(exec_read, exec_write));
  int child_stdout = options_.prefix_output ? out_write.get() : options_.stdout_fd;
  int child_stderr = options_.prefix_output ? err_write.get() : options_.stderr_fd;
  pid_t parent = ::getpid();

  pid_t pid = ::fork();
  if (pid < 0) return Status::errno_error("launch: fork", errno);
  if (pid == 0) {
    ::setpgid(0, 0);
    // Dies with the launcher even if the launcher is SIGKILLed; the check closes the race with
    // a launcher that died before prctl.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (child_stdout != STDOUT_FILENO) ::dup2(child_stdout, STDOUT_FILENO);
    if (child_stderr != STDERR_FILENO) ::dup2(child_stderr, STDERR_FILENO);
    // Descriptors the caller left inheritable (sockets, test files) stay out of the ranks.
    ::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
    ::execve(argv[0], argv.data(), envp.data());
    int err = errno;
    (void)!::write(exec_write.get(), &err, sizeof(err));
    ::_exit(127);
  }
  // Both sides set the group, so it exists before anyone signals it.
  ::setpgid(pid, pid);
  Rank& started = ranks_[rank];
  started.pid = pid;
  started.running = true;
  exec_write.reset();
  out_write.reset();
  err_write.reset();
  int exec_errno = 0;
  ssize_t got;
  do {
    got = ::read(exec_read.get(), &exec_errno, sizeof(exec_errno));
  } while (got < 0 && errno == EINTR);
  if (got == sizeof(exec_errno)) started.exit.start_error = program_ + ": " + std::strerror(exec_errno);
  if (options_.prefix_output) {
    std::string prefix = "[rank " + std::to_string(rank) + "] ";
    relays_.emplace_back(std::move(out_read), options_.stdout_fd, prefix);
    relays_.emplace_back(std::move(err_read), options_.stderr_fd, prefix);
  }
  return {};
}

void Supervisor::signal_running(int signal_number) {
  for (Rank& rank : ranks_) {
    if (!rank.running) continue;
    ::kill(-rank.pid, signal_number);
    rank.exit.stopped_by_launcher = true;
  }
}

void Supervisor::begin_shutdown(int signal_number) {
  if (shutting_down_) return;
  shutting_down_ = true;
  signal_running(signal_number);
  kill_at_ = Clock::now() + options_.kill_grace;
}

void Supervisor::reap() {
  for (Rank& rank : ranks_) {
    if (!rank.running) continue;
    // Peek without reaping: while the zombie exists its pid (and group id) cannot be reused, so
    // whatever it left behind in its group can be killed safely first.
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(rank.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) {
      continue;
    }
    ::kill(-rank.pid, SIGKILL);
    int status = 0;
    if (::waitpid(rank.pid, &status, WNOHANG) != rank.pid) continue;
    rank.running = false;
    rank.exit.reaped = true;
    if (WIFEXITED(status)) rank.exit.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) rank.exit.signal = WTERMSIG(status);
    if (!rank.exit.succeeded() && !shutting_down_) {
      report_.first_failed_rank = rank.exit.rank;
      begin_shutdown(SIGTERM);
    }
  }
}

LaunchReport Supervisor::run() {
  Clock::time_point start = Clock::now();
  std::optional<Clock::time_point> wall_limit;
  if (options_.timeout > milliseconds::zero()) wall_limit = start + options_.timeout;
  report_.wall_clock_limit = options_.timeout;
  std::optional<Clock::time_point> drain_until;
  int signals_seen = 0;
  std::vector<pollfd> fds;
  while (true) {
    reap();
    Clock::time_point now = Clock::now();
    if (!any_running()) {
      if (!drain_until) drain_until = now + kDrainAfterExit;
      bool draining = std::any_of(relays_.begin(), relays_.end(), [](const LineRelay& r) { return r.open(); });
      if (!draining || now >= *drain_until) break;
    }
    int signal_count = g_signal_count.load();
    if (signal_count != signals_seen) {
      // The first signal is passed on; a second one means "now": SIGKILL.
      report_.forwarded_signal = g_last_signal.load();
      if (signals_seen == 0) {
        shutting_down_ = true;
        signal_running(report_.forwarded_signal);
        kill_at_ = now + options_.kill_grace;
      } else {
        kill_at_ = now;
      }
      signals_seen = signal_count;
    }
    if (wall_limit && now >= *wall_limit && !report_.timed_out && any_running()) {
      report_.timed_out = true;
      begin_shutdown(SIGTERM);
    }
    if (kill_at_ && now >= *kill_at_ && !give_up_at_) {
      signal_running(SIGKILL);
      give_up_at_ = now + kReapAfterKill;
    }
    if (give_up_at_ && now >= *give_up_at_ && any_running()) {
      LOOM_ERROR("launch: rank(s) survived SIGKILL for %lld ms (stuck in the kernel?); not waiting for them",
                 static_cast<long long>(kReapAfterKill.count()));
      for (Rank& rank : ranks_) rank.running = false;  // reported with reaped = false
      break;
    }

    fds.clear();
    for (const LineRelay& relay : relays_) {
      if (relay.open()) fds.push_back({relay.fd(), POLLIN, 0});
    }
    int ready = ::poll(fds.data(), fds.size(), static_cast<int>(kReapInterval.count()));
    if (ready <= 0) continue;
    size_t index = 0;
    for (LineRelay& relay : relays_) {
      if (!relay.open()) continue;
      if (fds[index++].revents != 0) relay.pump();
    }
  }
  for (LineRelay& relay : relays_) relay.close();
  for (Rank& rank : ranks_) report_.ranks.push_back(rank.exit);
  report_.elapsed = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  return report_;
}

// Keeps the one-job-per-process rule for the lifetime of a call.
class LaunchSlot {
 public:
  LaunchSlot() : taken_(!g_launch_running.exchange(true)) {}
  ~LaunchSlot() {
    if (taken_) g_launch_running.store(false);
  }
  LaunchSlot(const LaunchSlot&) = delete;
  LaunchSlot& operator=(const LaunchSlot&) = delete;
  bool taken() const { return taken_; }

 private:
  bool taken_;
};

}  // namespace

std::string RankExit::describe() const {
  if (!start_error.empty()) return "could not start: " + start_error;
  if (!reaped) return "still running after SIGKILL";
  if (signal != 0) return "signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  return "exit code " + std::to_string(exit_code);
}

bool LaunchReport::all_succeeded() const {
  return !timed_out && forwarded_signal == 0 &&
         std::all_of(ranks.begin(), ranks.end(), [](const RankExit& r) { return r.succeeded(); });
}

std::string LaunchReport::summary() const {
  std::string took = " in " + seconds_text(elapsed);
  if (all_succeeded()) return "all " + std::to_string(ranks.size()) + " ranks exited 0" + took;
  std::vector<int> stopped;
  std::vector<int> failed;
  for (const RankExit& r : ranks) {
    if (r.stopped_by_launcher) {
      stopped.push_back(r.rank);
    } else if (!r.succeeded() && r.rank != first_failed_rank) {
      failed.push_back(r.rank);
    }
  }
  std::string text;
  if (first_failed_rank >= 0) {
    text = "rank " + std::to_string(first_failed_rank) + " failed first (" + ranks[first_failed_rank].describe() + ")";
  } else if (timed_out) {
    text = "wall-clock limit of " + seconds_text(wall_clock_limit) + " passed";
  } else if (forwarded_signal != 0) {
    text = std::string("interrupted by SIG") + sigabbrev_np(forwarded_signal) + " (passed on to the ranks)";
  } else {
    text = "job failed";
  }
  if (!failed.empty()) text += "; also failed: rank(s) " + format_rank_list(failed);
  if (!stopped.empty()) text += "; stopped rank(s) " + format_rank_list(stopped);
  return text + took;
}

Result<LaunchReport> launch_local_ranks(const LaunchOptions& options) {
  LOOM_TRY(validate(options));
  LaunchSlot slot;
  if (!slot.taken()) return Status::invalid_argument("launch: another launch_local_ranks() is running in this process");
  LOOM_ASSIGN_OR_RETURN(std::string program, find_program(options.argv[0]));
  // A free port now; rank 0 binds it moments later (SO_REUSEADDR covers our own TIME_WAIT).
  uint16_t port = 0;
  {
    Result<Listener> probe = Listener::listen("127.0.0.1", 0);
    if (!probe.ok()) return std::move(probe).take_status().with_context("launch: picking a port");
    port = probe->port();
  }
  LOOM_ASSIGN_OR_RETURN(std::string secret, random_secret_hex());

  SignalCapture signals;
  Supervisor supervisor(options, std::move(program));
  LOOM_TRY(supervisor.start(port, secret));
  return supervisor.run();
}

Result<std::vector<std::string>> self_command(const std::vector<std::string>& args) {
  char path[PATH_MAX];
  ssize_t length = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length <= 0) return Status::errno_error("readlink /proc/self/exe", errno);
  std::vector<std::string> argv{std::string(path, static_cast<size_t>(length))};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

}  // namespace loom::runtime
