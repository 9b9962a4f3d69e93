#include "core/env.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <limits>

extern char** environ;

namespace loom::env {
namespace {

constexpr VariableDoc kVariables[] = {
    {"LOOM_LOG", "log level: error, warn (default), info, debug, trace"},
    {"LOOM_TIMEOUT_MS", "deadline of every device and host wait of one operation, ms (default 30000)"},
    {"LOOM_BOOTSTRAP_TIMEOUT_MS", "deadline of each bootstrap step, ms (default 120000)"},
    {"LOOM_HEAP_BYTES", "symmetric heap size per GPU, bytes with optional K/M/G suffix (default 1G)"},
    {"LOOM_HEAP_BACKEND", "symmetric heap backend: auto (default), vmm (cuMem + POSIX fd), ipc (legacy CUDA IPC)"},
    {"LOOM_COLL_CTAS", "CTAs used by loom's NVLink collectives; 0 (default) lets the planner decide"},
    {"LOOM_RANKS_PER_GPU", "shared-GPU mode: up to n ranks may share one GPU, time-sliced (default 1: one rank per GPU); "
                           "for correctness runs on few GPUs, it measures no speed"},
    {"LOOM_BOOTSTRAP_PORT", "port rank 0's bootstrap listens on (default MASTER_PORT; MASTER_PORT + 1 under torchrun)"},
    {"LOOM_SECRET", "per-job bootstrap secret, 32 hex digits, the same on every rank: required for jobs of several "
                    "ranks started from the environment (loom-run and unique ids make one)"},
    {"LOOM_TUNING_CACHE", "JSON tuning cache of the fused operators' role split (written by loom-bench tune)"},
    {"LOOM_TRANSPORT", "transport to peers on other (real or emulated) nodes: auto (default), copy_engine, fabric, verbs"},
    {"LOOM_EMULATE_NODES", "split each host's ranks into n virtual nodes joined by the proxy and a transport (default 1)"},
    {"LOOM_EMULATE_NET_GBPS", "copy_engine NIC emulation: link rate in GB/s, decimal (default 0: unlimited)"},
    {"LOOM_EMULATE_NET_LAT_US", "copy_engine NIC emulation: one-way latency in microseconds, decimal (default 0)"},
    {"LOOM_PROXY_THREADS", "proxy threads (one command ring each) per GPU (default 1)"},
    {"LOOM_NET_DEVICE", "verbs device (e.g. mlx5_0) or libfabric domain; unset: the first usable"},
    {"LOOM_FABRIC_PROVIDER", "libfabric provider; unset: the first of efa, verbs, tcp that offers RMA"},
    {"LOOM_IB_GID_INDEX", "GID table index for RoCE and EFA addresses (default 0)"},
};

Status bad(std::string_view name, std::string_view text, std::string_view why) {
  return Status::invalid_argument(std::string(name) + "='" + std::string(text) + "': " + std::string(why));
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

Result<int64_t> parse_int(std::string_view name, std::string_view text, int64_t min, int64_t max) {
  std::string_view t = trim(text);
  if (t.empty()) return bad(name, text, "empty; expected an integer");
  std::string owned(t);
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(owned.c_str(), &end, 10);
  if (end == owned.c_str() || *end != '\0') return bad(name, text, "not an integer");
  if (errno == ERANGE) return bad(name, text, "out of the 64-bit range");
  if (v < min || v > max) {
    return bad(name, text, "outside [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return static_cast<int64_t>(v);
}

Result<uint64_t> parse_bytes(std::string_view name, std::string_view text, uint64_t min, uint64_t max) {
  std::string_view t = trim(text);
  if (t.empty()) return bad(name, text, "empty; expected a byte count");
  size_t digits = 0;
  while (digits < t.size() && std::isdigit(static_cast<unsigned char>(t[digits]))) ++digits;
  if (digits == 0) return bad(name, text, "not a byte count (expected e.g. 4096, 64K, 2G)");
  std::string_view suffix = t.substr(digits);
  unsigned shift = 0;
  if (!suffix.empty()) {
    char c = static_cast<char>(std::toupper(static_cast<unsigned char>(suffix[0])));
    std::string_view rest = suffix.substr(1);
    if (c == 'K') shift = 10;
    else if (c == 'M') shift = 20;
    else if (c == 'G') shift = 30;
    else if (c == 'T') shift = 40;
    else return bad(name, text, "unknown size suffix (expected K, M, G or T)");
    if (!(rest.empty() || rest == "B" || rest == "iB" || rest == "b")) {
      return bad(name, text, "unknown size suffix (expected K, M, G or T)");
    }
  }
  uint64_t value = 0;
  for (size_t i = 0; i < digits; ++i) {
    uint64_t d = static_cast<uint64_t>(t[i] - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - d) / 10) return bad(name, text, "overflows 64 bits");
    value = value * 10 + d;
  }
  if (shift != 0 && value > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return bad(name, text, "overflows 64 bits");
  }
  value <<= shift;
  if (value < min || value > max) {
    return bad(name, text, "outside [" + std::to_string(min) + ", " + std::to_string(max) + "] bytes");
  }
  return value;
}

Result<bool> parse_bool(std::string_view name, std::string_view text) {
  std::string t(trim(text));
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  return bad(name, text, "expected 1/0, true/false, yes/no or on/off");
}

Result<std::string> parse_choice(std::string_view name, std::string_view text,
                                 std::initializer_list<std::string_view> choices) {
  std::string_view t = trim(text);
  for (std::string_view c : choices) {
    if (t == c) return std::string(c);
  }
  std::string expected;
  for (std::string_view c : choices) {
    if (!expected.empty()) expected += ", ";
    expected += c;
  }
  return bad(name, text, "expected one of: " + expected);
}

std::optional<std::string> get_raw(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

Result<int64_t> get_int(const char* name, int64_t fallback, int64_t min, int64_t max) {
  std::optional<std::string> raw = get_raw(name);
  if (!raw) return fallback;
  return parse_int(name, *raw, min, max);
}

Result<uint64_t> get_bytes(const char* name, uint64_t fallback, uint64_t min, uint64_t max) {
  std::optional<std::string> raw = get_raw(name);
  if (!raw) return fallback;
  return parse_bytes(name, *raw, min, max);
}

Result<bool> get_bool(const char* name, bool fallback) {
  std::optional<std::string> raw = get_raw(name);
  if (!raw) return fallback;
  return parse_bool(name, *raw);
}

Result<std::string> get_choice(const char* name, std::string_view fallback,
                               std::initializer_list<std::string_view> choices) {
  std::optional<std::string> raw = get_raw(name);
  if (!raw) return std::string(fallback);
  return parse_choice(name, *raw, choices);
}

std::span<const VariableDoc> loom_variables() { return kVariables; }

Result<Settings> Settings::from_env() {
  Settings s;
  if (std::optional<std::string> raw = get_raw("LOOM_LOG")) {
    LOOM_ASSIGN_OR_RETURN(s.log_level, parse_log_level(*raw));
  }
  LOOM_ASSIGN_OR_RETURN(int64_t op_ms, get_int("LOOM_TIMEOUT_MS", 30'000, 1, kMaxTimeoutMs));
  s.op_timeout = std::chrono::milliseconds(op_ms);
  LOOM_ASSIGN_OR_RETURN(int64_t boot_ms, get_int("LOOM_BOOTSTRAP_TIMEOUT_MS", 120'000, 1, kMaxTimeoutMs));
  s.bootstrap_timeout = std::chrono::milliseconds(boot_ms);
  LOOM_ASSIGN_OR_RETURN(s.heap_bytes, get_bytes("LOOM_HEAP_BYTES", uint64_t{1} << 30, uint64_t{1} << 20,
                                                uint64_t{1} << 40));
  LOOM_ASSIGN_OR_RETURN(std::string backend, get_choice("LOOM_HEAP_BACKEND", "auto", {"auto", "vmm", "ipc"}));
  s.heap_backend = backend == "vmm" ? HeapBackend::kVmm : backend == "ipc" ? HeapBackend::kIpc : HeapBackend::kAuto;
  LOOM_ASSIGN_OR_RETURN(int64_t ctas, get_int("LOOM_COLL_CTAS", 0, 0, 4096));
  s.collective_ctas = static_cast<int>(ctas);
  LOOM_ASSIGN_OR_RETURN(int64_t per_gpu, get_int("LOOM_RANKS_PER_GPU", 1, 1, kMaxRanksPerGpu));
  s.ranks_per_gpu = static_cast<int>(per_gpu);
  // LOOM_SECRET is parsed (and validated) by the bootstrap, which needs its bytes.
  return s;
}

std::string unknown_loom_variables() {
  std::string unknown;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view entry(*e);
    if (entry.substr(0, 5) != "LOOM_") continue;
    std::string_view name = entry.substr(0, entry.find('='));
    bool known = name.substr(0, 10) == "LOOM_TEST_";  // test hooks are documented beside the tests
    for (const VariableDoc& v : kVariables) known = known || v.name == name;
    if (!known) {
      if (!unknown.empty()) unknown += ", ";
      unknown += name;
    }
  }
  return unknown;
}

}  // namespace loom::env
