// The tensor-parallel family's flag kinds (family 1 of FlagKind, runtime/device_abi.h), used by the
// single-node and the multi-node kernels; their names are registered in src/ops/tp/tp_names.cc.
#pragma once

#include <cstdint>

#include "runtime/device_abi.h"

namespace loom::kernels::tp {

inline constexpr uint32_t kFlagFamily = 1;
// "rank s has staged its partial of my tile" (gemm_rs / gemm_ar)
inline constexpr FlagKind kPartialFlag = family_flag(kFlagFamily, 0);
// "rank s has stored its reduced tile into my output" (gemm_ar)
inline constexpr FlagKind kFinalFlag = family_flag(kFlagFamily, 1);
// "another CTA of mine has staged piece slot `index` of a split tile" (the tail split)
inline constexpr FlagKind kPieceFlag = family_flag(kFlagFamily, 2);

}  // namespace loom::kernels::tp
