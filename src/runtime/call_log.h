// What this process called, by launch signature (ops/launch/signature.h), so that a cross-rank
// mismatch can say which call was which: the entry handshake only carries 32-bit signatures.
// Process-wide (a signature says the same whatever the communicator), the last kCalls distinct
// signatures. Thread-safe; the common case (the same call again) costs one atomic load.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "runtime/device_abi.h"

namespace loom {

struct CallField {
  const char* name;  // a string literal ("count", "dtype", ...; "dtype" values print as names), or
                     // null: the value prints alone
  int64_t value;
};

inline constexpr size_t kMaxCallFields = 10;  // fields beyond this are not kept (the hash has them)
inline constexpr size_t kCalls = 64;

void remember_call(uint32_t signature, OpId op, std::span<const CallField> fields);
// "all_reduce(count=4096, dtype=bf16, ctas=8, ...)", or "" when this process made no such call.
std::string describe_call(uint32_t signature);

}  // namespace loom
