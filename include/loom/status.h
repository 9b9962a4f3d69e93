// loom::Status and loom::Result<T>: how every loom call reports success or failure.
//
// The library never throws, exits or aborts; each fallible call returns a Status (or a
// Result<T> carrying a value or a Status). Categories follow NCCL's: invalid_argument and
// unsupported mean "the call had no effect"; timeout, peer_failure, cuda_error, system_error,
// aborted and internal leave the communicator failed (later calls return aborted).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace loom {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,  // bad input: nothing was written, nothing was launched
  kUnsupported,      // valid input outside what this build or device implements
  kTimeout,          // a bounded wait (device or host) passed its deadline
  kPeerFailure,      // another rank reported an error or disappeared
  kCudaError,        // a CUDA runtime or driver call failed
  kSystemError,      // an OS call failed (sockets, files, memory)
  kAborted,          // the operation was aborted, or the communicator failed earlier
  kInternal,         // a loom invariant broke: a bug
};

// "ok", "invalid_argument", ...: stable names used in messages and by the Python layer.
std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return {}; }
  static Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
  static Status peer_failure(std::string m) { return {StatusCode::kPeerFailure, std::move(m)}; }
  static Status cuda_error(std::string m) { return {StatusCode::kCudaError, std::move(m)}; }
  static Status system_error(std::string m) { return {StatusCode::kSystemError, std::move(m)}; }
  static Status aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
  static Status internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  // system_error from errno, e.g. errno_error("connect 10.0.0.1:29500").
  static Status errno_error(std::string_view what, int err);

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // Prepends "context: " to the message; keeps the code. Returns *this for chaining.
  Status& with_context(std::string_view context) &;
  Status&& with_context(std::string_view context) &&;

  // "timeout: all_gather: rank 1 never signalled ..." ("ok" when ok).
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// A value or the Status explaining why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : state_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(state_).ok()) state_ = Status::internal("Result built from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(state_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(state_);
  }
  T& value() & { return std::get<T>(state_); }
  const T& value() const& { return std::get<T>(state_); }
  T&& value() && { return std::get<T>(std::move(state_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  Status take_status() && { return ok() ? Status{} : std::get<Status>(std::move(state_)); }

 private:
  std::variant<T, Status> state_;
};

}  // namespace loom

#define LOOM_CONCAT_INNER(a, b) a##b
#define LOOM_CONCAT(a, b) LOOM_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function if it is not ok.
#define LOOM_TRY(expr)                                   \
  do {                                                   \
    ::loom::Status loom_try_status_ = (expr);            \
    if (!loom_try_status_.ok()) return loom_try_status_; \
  } while (0)

// Like LOOM_TRY, prepending a context string to the message on failure.
#define LOOM_TRY_CTX(expr, context)                                       \
  do {                                                                    \
    ::loom::Status loom_try_status_ = (expr);                             \
    if (!loom_try_status_.ok()) return std::move(loom_try_status_).with_context(context); \
  } while (0)

// `LOOM_ASSIGN_OR_RETURN(auto x, make_x());` declares x from a Result or returns its Status.
#define LOOM_ASSIGN_OR_RETURN(lhs, expr) \
  LOOM_ASSIGN_OR_RETURN_IMPL(LOOM_CONCAT(loom_result_, __LINE__), lhs, expr)
#define LOOM_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr)       \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return std::move(tmp).take_status();    \
  lhs = std::move(tmp).value()
