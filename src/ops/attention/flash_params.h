// What every attention launcher (attention, ring_attention) fills the same way: the device limits
// the planner needs, the TMA maps over q, k, v, and the kernel's core parameters.
#pragma once

#include <cstdint>

#include "kernels/attention/params.h"
#include "loom/attention.h"
#include "loom/status.h"
#include "planner/attention_plan.h"

namespace loom::ops::attention {

// The current device's limits; unsupported (naming `op`) unless it is a Hopper GPU (sm_90).
Result<planner::AttentionDeviceLimits> device_limits(const char* op);

// A 4-D map {D, heads, rows, batch} (element strides s) with boxes of `box_rows` rows of one head
// and 64 columns. A tensor without rows is never loaded: the map then covers one row of
// `fallback` (any valid tensor of the call) so that it can be encoded.
Status encode_qkv_map(const void* ptr, DType dtype, int64_t head_dim, int64_t heads, int64_t rows, int64_t batch,
                      const AttentionStrides& s, int box_rows, const void* fallback, kernels::sm90::TmaDescriptor* out,
                      const char* what);

// The kernel parameters of a planned call, all but the queue, the wait parameters and the epoch.
Result<kernels::attention::FlashParams> make_flash_params(const AttentionArgs& args, const AttentionOptions& options,
                                                          const planner::AttentionPlan& plan);

}  // namespace loom::ops::attention
