// TMA tensor maps for every loom kernel: cuTensorMapEncodeTiled is a driver function and libloom
// does not link libcuda, so the entry point is fetched once through the runtime.
#pragma once

#include <cstdint>

#include "kernels/common/tma_descriptor.h"
#include "loom/status.h"
#include "loom/types.h"

namespace loom::ops {

// A tensor of `rank` (1..5) dimensions, innermost first: dims[i] elements, strides_bytes[i - 1]
// bytes between consecutive indices of dimension i (the innermost is contiguous), boxes of box[i]
// elements, 128-byte swizzle (box[0] * element size must be 128 bytes). `what` names the tensor
// in the error.
Status encode_tensor_map(const void* ptr, DType dtype, int rank, const uint64_t* dims, const uint64_t* strides_bytes,
                         const uint32_t* box, kernels::sm90::TmaDescriptor* out, const char* what);

}  // namespace loom::ops
