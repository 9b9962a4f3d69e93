// What the single-node tensor-parallel operators (ag_gemm.cu, staged_reduce.cu) share on the
// host: the common checks, the decision (plain GEMM, fused kernel or decomposed), plan
// signatures and the tail split's piece slots.
//
// Rules every operator checks before anything is launched (the op adds its own):
//   unsupported       fp32; a forced fused kernel whose shape or tile it cannot run (the message
//                     names the rule)
//   invalid_argument  null or not 16-byte aligned a / b / out / gathered_a; M not a multiple of W;
//                     N or K not a multiple of 8 (planner); overlapping buffers
// Fused kernels additionally need (otherwise TpAlgorithm::kAuto runs decomposed and an explicit
// kFused is refused): planner::fused_refusal's rules (W <= 8, M/W a multiple of 128), a 128x256
// or 128x128 tile, and their flags within the control region's capacity.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>

#include "loom/gemm.h"
#include "loom/tensor_parallel.h"
#include "ops/tp/tp_operator.h"
#include "planner/tp_plan.h"
#include "runtime/communicator_impl.h"

namespace loom::kernels::gemm {
struct TailSplitParams;
}
namespace loom::kernels::tp {
struct TailPieces;
}

namespace loom::ops::tp {

// The single-node operators' family: its launch state and workspace (ops/launch/family_resources.h).
inline constexpr std::string_view kFamily = "tp";

std::string shape_text(const TpGemmArgs& a, int world);

// Checks shared by the three operators before the planner (which checks the shape rules).
Status check_common(Communicator::Impl& impl, OpId op, const TpGemmArgs& a);

// Buffers of ag_gemm over `world` ranks of which this one owns row block `own_block`: a this
// GPU's [M/W, K], b, out [M, N]; gathered_a, when given, symmetric [M, K] (a may be the own
// block's rows of it: in place, described by `in_place` in messages); no overlaps.
Status check_ag_buffers(Communicator::Impl& impl, const TpGemmArgs& a, int64_t world, int64_t own_block,
                        const char* in_place);
// Buffers of gemm_rs (out this GPU's [out_rows, N]) or gemm_ar (out symmetric [M, N]): a [M, K]
// and b on this GPU, out overlapping neither.
Status check_reduce_buffers(Communicator::Impl& impl, OpId op, const TpGemmArgs& a, int64_t out_rows);

// The planner's view of a call on `world` local ranks and `sm_count` SMs.
planner::TpRequest tp_request(OpId op, const TpGemmArgs& a, int world, int sm_count);

// The fused kernel's own rules for this call, beyond the common ones: "" when it can run, else
// the reason (shown when fused was forced, logged when the planner's choice falls back).
using FusedCheck = std::function<std::string(GemmTile tile, int grid)>;

// Plans the call (options, tuning cache, cost model: planner/tp_plan.h), then applies what the
// fused kernels can run: call.info's path, tile, CTAs and source, call.plan and call.timeline.
// Every rank reaches the same decision from the same arguments.
Result<TpCall> decide(Communicator::Impl& impl, OpId op, const TpGemmArgs& a, const TpGemmOptions& options,
                      const FusedCheck& fused_check);

// The 32-bit signature of what a fused launch does, compared between ranks at entry (a mismatch
// fails the launch with invalid_argument before any data moves): ops/launch/signature.h over the
// tile, the world and `values`, the op's fields that must be equal on every rank; `world` may
// carry more than the rank count (the multi-node operators add their grid).
uint32_t plan_signature(OpId op, GemmTile tile, int world, std::initializer_list<int64_t> values);

// Flags a fused launch needs beyond the W entry words must fit the control region: "" or why not.
std::string check_flag_capacity(const Communicator::Impl& impl, uint64_t launch_flags);

// The plain local GEMM of an operator (decomposed path, one-rank jobs, tensor maps).
GemmArgs local_gemm(const void* a, const void* b, void* d, int64_t m, const TpGemmArgs& args);
GemmOptions gemm_options_for(const TpCall& call);

// The tail split's piece slots: (pieces - 1) per split tile, each one BLOCK_M x BLOCK_N tile of
// the input type in the workspace.
int64_t piece_slots_of(const planner::TailSplit& split);
size_t piece_slot_bytes(int64_t piece_slots, GemmTile tile, DType dtype);
// Records a fused call's tail split in call.info.
void note_tail_split(TpCall& call);

// Fills a launch's tail split (kernels/gemm/tail_split.cuh) of a GEMM with `k` columns of A and,
// with pieces, the piece slots at `base` (kernels/tp/tail_pieces.cuh) and their flags from
// op_flags[flag_base].
Status set_tail_split(const planner::TailSplit& split, void* base, GemmTile tile, DType dtype, int64_t k,
                      uint64_t flag_base, kernels::gemm::TailSplitParams* params, kernels::tp::TailPieces* pieces);

}  // namespace loom::ops::tp
