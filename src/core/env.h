// Validated environment variables.
//
// Every LOOM_* variable loom reads is listed in kLoomVariables with its meaning and parsed by
// Settings::from_env(), which fails with invalid_argument on the first bad value ("abc", "-1",
// out of range, overflow, set but empty). Unknown LOOM_* names are reported as likely typos.
#pragma once

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "core/log.h"
#include "loom/status.h"

namespace loom::env {

// Parsers (exposed for tests). `name` only labels the error message.
Result<int64_t> parse_int(std::string_view name, std::string_view text, int64_t min, int64_t max);
// Byte counts: plain integers or with a K/M/G/T suffix (powers of 1024; "KiB", "MB" accepted).
Result<uint64_t> parse_bytes(std::string_view name, std::string_view text, uint64_t min, uint64_t max);
Result<bool> parse_bool(std::string_view name, std::string_view text);  // 1/0/true/false/yes/no/on/off
Result<std::string> parse_choice(std::string_view name, std::string_view text,
                                 std::initializer_list<std::string_view> choices);

// The raw value, or nullopt when unset.
std::optional<std::string> get_raw(const char* name);
// Readers: the default when unset; an error when set to a bad or empty value.
Result<int64_t> get_int(const char* name, int64_t fallback, int64_t min, int64_t max);
Result<uint64_t> get_bytes(const char* name, uint64_t fallback, uint64_t min, uint64_t max);
Result<bool> get_bool(const char* name, bool fallback);
Result<std::string> get_choice(const char* name, std::string_view fallback,
                               std::initializer_list<std::string_view> choices);

struct VariableDoc {
  std::string_view name;
  std::string_view meaning;
};
// Every LOOM_* variable loom reads (docs/ENVIRONMENT.md is generated from the same text).
std::span<const VariableDoc> loom_variables();

enum class HeapBackend : uint8_t { kAuto, kVmm, kIpc };

// Longest LOOM_TIMEOUT_MS / LOOM_BOOTSTRAP_TIMEOUT_MS (and CommOptions timeouts): one day.
inline constexpr int64_t kMaxTimeoutMs = 24LL * 3600 * 1000;
// The most ranks LOOM_RANKS_PER_GPU lets share one GPU.
inline constexpr int kMaxRanksPerGpu = 64;

// All LOOM_* settings, parsed once per communicator.
struct Settings {
  LogLevel log_level = LogLevel::kWarn;
  std::chrono::milliseconds op_timeout{30'000};          // LOOM_TIMEOUT_MS
  std::chrono::milliseconds bootstrap_timeout{120'000};  // LOOM_BOOTSTRAP_TIMEOUT_MS
  uint64_t heap_bytes = uint64_t{1} << 30;               // LOOM_HEAP_BYTES
  HeapBackend heap_backend = HeapBackend::kAuto;         // LOOM_HEAP_BACKEND
  int collective_ctas = 0;                               // LOOM_COLL_CTAS (0: planner decides)
  // LOOM_RANKS_PER_GPU: 1 refuses two ranks on one GPU; n > 1 is the shared-GPU mode (up to n
  // ranks per GPU, devices assigned round-robin), a correctness mode that measures no speed.
  int ranks_per_gpu = 1;

  static Result<Settings> from_env();
};

// Names of set LOOM_* variables that loom does not know (likely typos).
std::string unknown_loom_variables();

}  // namespace loom::env
