// The MoE family's operator ids and flag kinds (family 3 of OpId / FlagKind, runtime/device_abi.h);
// their names are registered in src/ops/moe/moe_names.cc.
#pragma once

#include <cstdint>

#include "runtime/device_abi.h"

namespace loom::kernels::moe {

inline constexpr uint32_t kFamily = 3;

inline constexpr OpId kRoutingOp = family_op(kFamily, 1);
inline constexpr OpId kDispatchOp = family_op(kFamily, 2);
inline constexpr OpId kCombineOp = family_op(kFamily, 3);
inline constexpr OpId kDispatchGemmOp = family_op(kFamily, 4);
inline constexpr OpId kLayerOp = family_op(kFamily, 5);

// "my routing chunk `index` is counted" (local, written by another CTA of the launch)
inline constexpr FlagKind kChunkFlag = family_flag(kFamily, 0);
// "rank s's expert counts have arrived in my count table"
inline constexpr FlagKind kCountsFlag = family_flag(kFamily, 1);
// "my routing's layout (offsets, bases) is computed" (local, the coordinator CTA)
inline constexpr FlagKind kLayoutFlag = family_flag(kFamily, 2);
// "every row of my receive block `index` has landed" (a counter every sender adds to)
inline constexpr FlagKind kArrivalFlag = family_flag(kFamily, 3);
// "combine CTA `index` of mine has read all its rows" (local)
inline constexpr FlagKind kReadDoneFlag = family_flag(kFamily, 4);
// "rank s has read my expert outputs"
inline constexpr FlagKind kDoneFlag = family_flag(kFamily, 5);
// "my receive block `index` is complete, its repeated rows copied" (local; moe_dispatch_gemm's
// expert GEMM tiles wait for it)
inline constexpr FlagKind kReadyFlag = family_flag(kFamily, 6);
// "this rank has handed every chunk of its network windows to the proxy" (local counters)
inline constexpr FlagKind kSentFlag = family_flag(kFamily, 7);
// "the token entries this combine reduces are the ones its plan's dispatch staged" (a check:
// kMismatch when another plan's dispatch ran in between)
inline constexpr FlagKind kStagedFlag = family_flag(kFamily, 8);
// "every fc1 tile of my tile row `index` is stored" (local counter; moe_layer's fc2 tiles wait)
inline constexpr FlagKind kHiddenDoneFlag = family_flag(kFamily, 9);
// "my expert output row `index` is final" (moe_layer's combine reads it from any local rank)
inline constexpr FlagKind kOutReadyFlag = family_flag(kFamily, 10);
// "every push CTA of my launch is done" (local counter; moe_layer's reducers then read token_pos)
inline constexpr FlagKind kPushesDoneFlag = family_flag(kFamily, 11);

}  // namespace loom::kernels::moe
