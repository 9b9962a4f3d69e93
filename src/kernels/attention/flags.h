// The attention family's operator ids and flag kinds (family 2 of OpId and FlagKind,
// runtime/device_abi.h); their names are registered in src/ops/attention/attention_names.cc.
#pragma once

#include <cstdint>

#include "runtime/device_abi.h"

namespace loom::kernels::attention {

inline constexpr uint32_t kFamily = 2;
inline constexpr OpId kAttentionOp = family_op(kFamily, 0);
inline constexpr OpId kAttentionMergeOp = family_op(kFamily, 1);

}  // namespace loom::kernels::attention
