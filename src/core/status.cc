#include "loom/status.h"

#include <cstring>

#include "loom/types.h"

namespace loom {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kTimeout: return "timeout";
    case StatusCode::kPeerFailure: return "peer_failure";
    case StatusCode::kCudaError: return "cuda_error";
    case StatusCode::kSystemError: return "system_error";
    case StatusCode::kAborted: return "aborted";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

Status Status::errno_error(std::string_view what, int err) {
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  return {StatusCode::kSystemError, std::move(m)};
}

Status& Status::with_context(std::string_view context) & {
  if (!ok()) {
    std::string m(context);
    m += ": ";
    m += message_;
    message_ = std::move(m);
  }
  return *this;
}

Status&& Status::with_context(std::string_view context) && {
  with_context(context);
  return std::move(*this);
}

std::string Status::to_string() const {
  std::string s(status_code_name(code_));
  if (!message_.empty()) {
    s += ": ";
    s += message_;
  }
  return s;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bf16";
    case DType::kF16: return "fp16";
    case DType::kF32: return "fp32";
  }
  return "?";
}

Result<DType> parse_dtype(std::string_view name) {
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp16" || name == "f16" || name == "half" || name == "float16") return DType::kF16;
  if (name == "fp32" || name == "f32" || name == "float" || name == "float32") return DType::kF32;
  return Status::invalid_argument("unknown dtype '" + std::string(name) + "' (expected bf16, fp16 or fp32)");
}

}  // namespace loom
