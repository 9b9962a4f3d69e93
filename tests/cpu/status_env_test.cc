#include <gtest/gtest.h>

#include <cstdlib>

#include "core/env.h"
#include "core/log.h"
#include "loom/status.h"
#include "loom/types.h"

namespace loom {
namespace {

TEST(Status, OkByDefault) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.to_string(), "ok");
}

TEST(Status, CarriesCodeMessageAndContext) {
  Status s = Status::timeout("rank 3 never arrived");
  s.with_context("bootstrap").with_context("init");
  EXPECT_EQ(s.code(), StatusCode::kTimeout);
  EXPECT_EQ(s.message(), "init: bootstrap: rank 3 never arrived");
  EXPECT_EQ(s.to_string(), "timeout: init: bootstrap: rank 3 never arrived");
}

TEST(Status, EveryCodeHasAName) {
  for (StatusCode c : {StatusCode::kOk, StatusCode::kInvalidArgument, StatusCode::kUnsupported,
                       StatusCode::kTimeout, StatusCode::kPeerFailure, StatusCode::kCudaError,
                       StatusCode::kSystemError, StatusCode::kAborted, StatusCode::kInternal}) {
    EXPECT_NE(status_code_name(c), "unknown");
  }
}

Status fails_then_propagates() {
  LOOM_TRY_CTX(Status::invalid_argument("bad M"), "gemm");
  return Status::internal("not reached");
}

Result<int> half(int x) {
  if (x % 2 != 0) return Status::invalid_argument("odd");
  return x / 2;
}

Status uses_assign(int x, int* out) {
  LOOM_ASSIGN_OR_RETURN(int h, half(x));
  *out = h;
  return {};
}

TEST(Status, MacrosPropagate) {
  Status s = fails_then_propagates();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "gemm: bad M");
  int out = 0;
  EXPECT_TRUE(uses_assign(8, &out).ok());
  EXPECT_EQ(out, 4);
  EXPECT_EQ(uses_assign(7, &out).code(), StatusCode::kInvalidArgument);
}

TEST(Result, OkStatusIsAnInternalError) {
  Result<int> r = Status{};
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(DType, ParseAndSize) {
  EXPECT_EQ(*parse_dtype("bf16"), DType::kBF16);
  EXPECT_EQ(*parse_dtype("half"), DType::kF16);
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_FALSE(parse_dtype("int8").ok());
}

TEST(Env, ParseIntRejectsGarbage) {
  EXPECT_EQ(*env::parse_int("X", "42", 0, 100), 42);
  EXPECT_EQ(*env::parse_int("X", " 7 ", 0, 100), 7);
  for (const char* bad : {"abc", "", "12abc", "-1", "2147483648", "99999999999999999999999", "1.5"}) {
    Result<int64_t> r = env::parse_int("LOOM_X", bad, 0, 2147483647);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("LOOM_X"), std::string::npos) << r.status().message();
  }
}

TEST(Env, ParseBytesSuffixesAndOverflow) {
  EXPECT_EQ(*env::parse_bytes("X", "4096", 0, ~0ull), 4096u);
  EXPECT_EQ(*env::parse_bytes("X", "64K", 0, ~0ull), 65536u);
  EXPECT_EQ(*env::parse_bytes("X", "2G", 0, ~0ull), 2ull << 30);
  EXPECT_EQ(*env::parse_bytes("X", "1GiB", 0, ~0ull), 1ull << 30);
  EXPECT_EQ(*env::parse_bytes("X", "3m", 0, ~0ull), 3ull << 20);
  for (const char* bad : {"abc", "", "-1", "1Q", "1GX", "18446744073709551616", "20000000000T"}) {
    EXPECT_FALSE(env::parse_bytes("X", bad, 0, ~0ull).ok()) << bad;
  }
  EXPECT_FALSE(env::parse_bytes("X", "1K", 1 << 20, ~0ull).ok());
}

TEST(Env, ParseBoolAndChoice) {
  EXPECT_TRUE(*env::parse_bool("X", "yes"));
  EXPECT_FALSE(*env::parse_bool("X", "0"));
  EXPECT_FALSE(env::parse_bool("X", "maybe").ok());
  EXPECT_EQ(*env::parse_choice("X", "vmm", {"auto", "vmm", "ipc"}), "vmm");
  EXPECT_FALSE(env::parse_choice("X", "nvls", {"auto", "vmm", "ipc"}).ok());
}

class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~EnvVar() { unsetenv(name_); }

 private:
  const char* name_;
};

TEST(Env, SettingsFailFastOnBadValues) {
  {
    EnvVar v("LOOM_TIMEOUT_MS", "abc");
    Result<env::Settings> s = env::Settings::from_env();
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("LOOM_TIMEOUT_MS"), std::string::npos);
  }
  {
    EnvVar v("LOOM_TIMEOUT_MS", "-1");
    EXPECT_FALSE(env::Settings::from_env().ok());
  }
  {
    EnvVar v("LOOM_HEAP_BYTES", "99999999999999999999999");
    EXPECT_FALSE(env::Settings::from_env().ok());
  }
  {
    EnvVar v("LOOM_LOG", "loud");
    EXPECT_FALSE(env::Settings::from_env().ok());
  }
  {
    EnvVar a("LOOM_TIMEOUT_MS", "1500");
    EnvVar b("LOOM_HEAP_BYTES", "256M");
    EnvVar c("LOOM_HEAP_BACKEND", "ipc");
    Result<env::Settings> s = env::Settings::from_env();
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    EXPECT_EQ(s->op_timeout.count(), 1500);
    EXPECT_EQ(s->heap_bytes, 256ull << 20);
    EXPECT_EQ(s->heap_backend, env::HeapBackend::kIpc);
  }
}

TEST(Env, UnknownVariablesAreNamed) {
  EnvVar v("LOOM_TIMEOUTMS", "5");
  EXPECT_NE(env::unknown_loom_variables().find("LOOM_TIMEOUTMS"), std::string::npos);
}

TEST(Log, ParsesLevels) {
  EXPECT_EQ(*parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_FALSE(parse_log_level("verbose").ok());
  set_log_level(LogLevel::kError);
  EXPECT_FALSE(log_enabled(LogLevel::kInfo));
  EXPECT_TRUE(log_enabled(LogLevel::kError));
  set_log_level(LogLevel::kWarn);
}

}  // namespace
}  // namespace loom
