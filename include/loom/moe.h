// Mixture-of-experts operators on one Hopper GPU.
//
// ---- grouped GEMM ------------------------------------------------------------------------------
// loom::grouped_gemm: for every expert e, D_e = A_e * B_e^T (B_e an nn.Linear weight), all experts
// in one persistent kernel of loom's GEMM engine; fp32 accumulation.
//
//   layout kContiguous (rows grouped by expert, e.g. after a MoE dispatch):
//     A        [M_total, K] row-major                      bf16 or fp16
//     offsets  int32 [E + 1], device memory: expert e's rows are [offsets[e], offsets[e+1]);
//              any count per expert, 0 included; no padding between experts
//     D        [M_total, N] row-major                      bf16, fp16 or fp32
//     Rows outside every expert's range are not written.
//   layout kMasked (a fixed capacity per expert):
//     A        [E, capacity, K]
//     counts   int32 [E], device memory: rows [0, counts[e]) of expert e are valid
//     D        [E, capacity, N]; rows >= counts[e] are not written
//   B          [E, N, K] row-major (one [N, K] weight per expert), same type as A
//
// The per-expert row counts stay on the device: a small plan kernel turns them into the tile list
// in `workspace`, the GEMM kernel reads it (no host synchronization; the call is asynchronous on
// `stream` and can be captured in a CUDA graph).
// Workspace: device memory, 16-byte aligned, at least grouped_gemm_workspace_bytes(args) bytes:
//     16 * (1 + T_max),  T_max = ceil(M_total / 64) + E         (contiguous)
//                        T_max = E * ceil(capacity / 64)         (masked)
// (kernels/moe/grouped_gemm_params.h has the layout). One workspace per stream at a time: a call
// rewrites it. Its second 32-bit word holds, after the call, the number of experts whose offsets
// or count were out of range (see below).
//
// Rules, checked by grouped_gemm_can_implement before anything is launched:
//   invalid_argument: null a, b or d; null offsets (contiguous) or counts (masked); pointers not
//                     16-byte aligned (offsets / counts: 4-byte); E < 1; negative M_total or
//                     capacity; a missing, small or misaligned workspace; D overlapping A or B;
//                     an unknown layout, dtype or option.
//   unsupported:      N or K not a positive multiple of 8 (TMA needs 16-byte row strides), fp32
//                     inputs, rows of A (M_total or E * capacity), N, K or E of 2^31 or more,
//                     a forced tile that does not fit the device.
// Device-side values cannot be checked before the launch. Offsets must be non-decreasing within
// [0, M_total] and counts within [0, capacity]; an expert outside that is clamped into it (its
// range cut to [0, M_total], its count to [0, capacity]) and counted in the workspace's second
// word, so nothing outside A and D is ever read or written (overlapping ranges from
// non-monotonic offsets leave the overlap's values unspecified).
// M_total == 0 or capacity == 0 launches nothing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/types.h"

namespace loom {

enum class GroupedLayout : uint8_t {
  kContiguous = 0,  // A [M_total, K] grouped by expert, offsets [E + 1]
  kMasked = 1,      // A [E, capacity, K], counts [E]
};
std::string_view grouped_layout_name(GroupedLayout layout);  // "contiguous", "masked"
Result<GroupedLayout> parse_grouped_layout(std::string_view name);

struct GroupedGemmArgs {
  GroupedLayout layout = GroupedLayout::kContiguous;
  const void* a = nullptr;
  const void* b = nullptr;  // [E, N, K]
  void* d = nullptr;
  const int32_t* offsets = nullptr;  // kContiguous: [E + 1], device memory
  const int32_t* counts = nullptr;   // kMasked: [E], device memory
  int64_t m_total = 0;               // kContiguous: rows of A and D
  int64_t capacity = 0;              // kMasked: rows per expert in A and D
  int64_t n = 0, k = 0;
  int64_t num_experts = 0;           // E
  DType in_dtype = DType::kBF16;     // A and B: bf16 or fp16
  DType out_dtype = DType::kBF16;    // D: bf16, fp16 or fp32
  void* workspace = nullptr;         // device memory, grouped_gemm_workspace_bytes(args)
  size_t workspace_bytes = 0;
};

struct GroupedGemmOptions {
  GemmTile tile = GemmTile::kAuto;  // force a configuration
  int num_ctas = 0;                 // persistent CTAs; 0: the SM count (or fewer when there are
                                    // fewer tiles, whatever the counts turn out to be)
};

// Bytes of workspace `args` needs (the formula above; 0 for a negative size or E < 1).
size_t grouped_gemm_workspace_bytes(const GroupedGemmArgs& args);

// Checks everything that can be checked without a GPU (no CUDA call is made).
Status grouped_gemm_can_implement(const GroupedGemmArgs& args, const GroupedGemmOptions& options = {});

Status grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream, const GroupedGemmOptions& options = {});

}  // namespace loom
