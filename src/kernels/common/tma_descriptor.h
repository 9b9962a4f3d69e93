// The opaque TMA descriptor type (plain C++, shared by host and device code; device code does
// not include driver headers). Host code static_asserts that it mirrors CUtensorMap.
#pragma once

#include <cstdint>

namespace loom::kernels::sm90 {

// An encoded CUtensorMap: 128 bytes, 64-byte aligned.
struct alignas(64) TmaDescriptor {
  uint64_t opaque[16];
};

}  // namespace loom::kernels::sm90
