#include "core/log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <sys/time.h>

namespace loom {
namespace {

std::atomic<int> g_level{-1};  // -1: not read from the environment yet
std::atomic<int> g_rank{-1};
std::mutex g_write_mutex;

int level_from_env() {
  const char* text = std::getenv("LOOM_LOG");
  if (text == nullptr || *text == '\0') return static_cast<int>(LogLevel::kWarn);
  Result<LogLevel> parsed = parse_log_level(text);
  if (!parsed.ok()) {
    std::fprintf(stderr, "[loom] %s; logging at warn\n", parsed.status().message().c_str());
    return static_cast<int>(LogLevel::kWarn);
  }
  return static_cast<int>(*parsed);
}

const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

}  // namespace

Result<LogLevel> parse_log_level(std::string_view text) {
  if (text == "error") return LogLevel::kError;
  if (text == "warn" || text == "warning") return LogLevel::kWarn;
  if (text == "info") return LogLevel::kInfo;
  if (text == "debug") return LogLevel::kDebug;
  if (text == "trace") return LogLevel::kTrace;
  return Status::invalid_argument("LOOM_LOG='" + std::string(text) +
                                  "': expected error, warn, info, debug or trace");
}

LogLevel log_level() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level < 0) {
    int expected = -1;
    g_level.compare_exchange_strong(expected, level_from_env());
    level = g_level.load(std::memory_order_relaxed);
  }
  return static_cast<LogLevel>(level);
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }
void set_log_rank(int rank) { g_rank.store(rank); }

void log_write(LogLevel level, const char* file, int line, const char* fmt, ...) {
  static constexpr char kLetters[] = {'E', 'W', 'I', 'D', 'T'};
  char message[2048];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(message, sizeof(message), fmt, args);
  va_end(args);

  timeval now{};
  gettimeofday(&now, nullptr);
  tm local{};
  localtime_r(&now.tv_sec, &local);
  char rank[16];
  int r = g_rank.load(std::memory_order_relaxed);
  if (r >= 0) std::snprintf(rank, sizeof(rank), "r%d", r); else std::snprintf(rank, sizeof(rank), "r?");

  std::lock_guard<std::mutex> lock(g_write_mutex);
  std::fprintf(stderr, "[loom %s %c %02d:%02d:%02d.%06ld %s:%d] %s\n", rank,
               kLetters[static_cast<int>(level)], local.tm_hour, local.tm_min, local.tm_sec,
               static_cast<long>(now.tv_usec), base_name(file), line, message);
}

}  // namespace loom
