// loom::attention's launcher: validate -> plan -> tensor maps -> one persistent kernel.
#include <cuda_runtime_api.h>

#include <string>

#include "kernels/attention/flags.h"
#include "kernels/attention/params.h"
#include "loom/attention.h"
#include "ops/attention/flash_launch.h"
#include "ops/attention/flash_params.h"
#include "ops/launch/standalone_wait.h"
#include "planner/attention_plan.h"
#include "runtime/cuda_check.h"
#include "runtime/names.h"

namespace loom {

namespace {

namespace ka = kernels::attention;

const NameRegistration kNames{{{ka::kRingChunkFlag, "ring K/V chunk"}, {ka::kRingStagedFlag, "ring own K/V chunk staged"}},
                               {{ka::kAttentionOp, "attention"},
                                {ka::kAttentionMergeOp, "attention_merge"},
                                {ka::kRingAttentionOp, "ring_attention"}}};

}  // namespace

Result<AttentionPlanInfo> attention_plan(const AttentionArgs& args, const AttentionOptions& options) {
  LOOM_ASSIGN_OR_RETURN(planner::AttentionDeviceLimits limits, ops::attention::device_limits("attention"));
  LOOM_ASSIGN_OR_RETURN(planner::AttentionPlan plan, planner::plan_attention(args, options, limits));
  return plan.info;
}

Status attention(const AttentionArgs& args, cudaStream_t stream, const AttentionOptions& options) {
  LOOM_TRY(planner::validate_attention(args, options));
  LOOM_ASSIGN_OR_RETURN(planner::AttentionDeviceLimits limits, ops::attention::device_limits("attention"));
  LOOM_ASSIGN_OR_RETURN(planner::AttentionPlan plan, planner::plan_attention(args, options, limits));
  if (plan.empty) return Status{};
  LOOM_ASSIGN_OR_RETURN(ops::StandaloneWait * w, ops::standalone_wait());
  LOOM_TRY(ops::take_standalone_error(*w, stream));
  LOOM_ASSIGN_OR_RETURN(ka::FlashParams p, ops::attention::make_flash_params(args, options, plan));
  LOOM_ASSIGN_OR_RETURN(p.queue, ops::standalone_queue(stream));
  p.wait = w->params();
  p.epoch = 0;
  return ops::attention::launch_flash(p, static_cast<int>(args.head_dim), plan.info.block_m, plan.info.block_n,
                                      args.dtype == DType::kBF16, options.causal, plan.info.grid, stream);
}

Status synchronize_standalone(cudaStream_t stream) {
  LOOM_ASSIGN_OR_RETURN(ops::StandaloneWait * w, ops::standalone_wait());
  LOOM_TRY(ops::wait_stream_bounded(stream, w->timeout_ns, "synchronize_standalone"));
  return ops::take_standalone_error(*w, stream);
}

}  // namespace loom
