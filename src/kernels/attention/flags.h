// The attention family's operator ids and flag kinds (family 2 of OpId and FlagKind,
// runtime/device_abi.h); their names are registered in src/ops/attention/attention.cc.
#pragma once

#include <cstdint>

#include "runtime/device_abi.h"

namespace loom::kernels::attention {

inline constexpr uint32_t kFamily = 2;
inline constexpr OpId kAttentionOp = family_op(kFamily, 0);
inline constexpr OpId kAttentionMergeOp = family_op(kFamily, 1);
inline constexpr OpId kRingAttentionOp = family_op(kFamily, 2);
// "chunk `index` of rank src's K and V has arrived here" (ring attention)
inline constexpr FlagKind kRingChunkFlag = family_flag(kFamily, 0);
// "chunk `index` of this rank's own K and V is staged in its receive slot" (ring attention across
// nodes: the network's source; local)
inline constexpr FlagKind kRingStagedFlag = family_flag(kFamily, 1);

}  // namespace loom::kernels::attention
