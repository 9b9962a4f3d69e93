// Element types and small value types shared by the public API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "loom/status.h"

namespace loom {

enum class DType : uint8_t { kBF16, kF16, kF32 };

constexpr size_t dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }
std::string_view dtype_name(DType t);             // "bf16", "fp16", "fp32"
Result<DType> parse_dtype(std::string_view name);  // accepts bf16|fp16|f16|half|fp32|f32|float

}  // namespace loom
