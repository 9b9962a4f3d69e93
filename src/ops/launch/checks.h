// Argument checks every operator launcher shares, written once: TMA operand pointers and buffers
// that must not overlap. Messages start with the operator's name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "loom/status.h"

namespace loom::ops {

// Byte range [lo, hi) of a packed row-major matrix.
struct ByteRange {
  uintptr_t lo = 0, hi = 0;
  bool overlaps(const ByteRange& o) const { return lo < o.hi && o.lo < hi; }
};
ByteRange bytes_of(const void* p, int64_t rows, int64_t cols, size_t elem);

// A pointer and the argument's name in messages.
struct NamedPointer {
  const void* ptr;
  const char* what;
};

// invalid_argument "op: what is null" or "op: what is not 16-byte aligned (TMA needs 16-byte
// aligned rows)" for the first pointer that is; an optional one (null allowed) is only checked
// for alignment.
Status check_tma_pointers(std::string_view op, std::initializer_list<NamedPointer> required);
Status check_optional_tma_pointer(std::string_view op, NamedPointer optional);

// invalid_argument "op: x overlaps y" when they do.
Status check_disjoint(std::string_view op, const ByteRange& x, const char* x_name, const ByteRange& y, const char* y_name);

// The current CUDA device and the limits the planners size kernels by.
struct HopperDevice {
  int device = 0;
  int sm_count = 0;
  int64_t smem_per_block_optin = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
  int64_t l2_bytes = 0;              // cudaDevAttrL2CacheSize
};

// The current device when it is a Hopper GPU (sm_90), which every wgmma/TMA engine needs; else
// unsupported "op: `engine` needs a Hopper GPU (sm_90); device N is sm_XY".
Result<HopperDevice> current_hopper_device(std::string_view op, std::string_view engine);

}  // namespace loom::ops
