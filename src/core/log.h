// Levelled logging to stderr: LOOM_LOG=error|warn|info|debug|trace (default warn).
// Lines look like "[loom r3 W 12:04:05.123456 bootstrap.cc:88] message".
#pragma once

#include <string_view>

#include "loom/status.h"

namespace loom {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3, kTrace = 4 };

Result<LogLevel> parse_log_level(std::string_view text);
LogLevel log_level();                 // from LOOM_LOG, read once (bad value: warn, reported once)
void set_log_level(LogLevel level);   // overrides LOOM_LOG (tests, tools)
void set_log_rank(int rank);          // the "rN" in every line; -1 (default) prints "r?"
inline bool log_enabled(LogLevel level) { return static_cast<int>(level) <= static_cast<int>(log_level()); }
void log_write(LogLevel level, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

}  // namespace loom

#define LOOM_LOG(level, ...)                                                           \
  do {                                                                                 \
    if (::loom::log_enabled(level)) ::loom::log_write(level, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
#define LOOM_ERROR(...) LOOM_LOG(::loom::LogLevel::kError, __VA_ARGS__)
#define LOOM_WARN(...) LOOM_LOG(::loom::LogLevel::kWarn, __VA_ARGS__)
#define LOOM_INFO(...) LOOM_LOG(::loom::LogLevel::kInfo, __VA_ARGS__)
#define LOOM_DEBUG(...) LOOM_LOG(::loom::LogLevel::kDebug, __VA_ARGS__)
#define LOOM_TRACE(...) LOOM_LOG(::loom::LogLevel::kTrace, __VA_ARGS__)
