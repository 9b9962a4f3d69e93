// loom::moe_topk: the host checks (planner/moe_plan.cc, moe_topk_can_implement), then
// kernels/moe/topk.cuh on `stream`: one warp per token, a grid of at most ceil(T / warps) CTAs
// (tokens strided over the grid beyond a few waves).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "kernels/moe/topk.cuh"
#include "loom/moe.h"
#include "ops/launch/kernel_launch.h"

namespace loom {

namespace km = kernels::moe;
static_assert(km::TopkTunables::kMaxExperts == kMoeMaxExperts,
              "moe_topk stages every logit of a token: its shared memory must hold kMoeMaxExperts of them");

Status moe_topk(const MoeTopkArgs& args, cudaStream_t stream) {
  LOOM_TRY(moe_topk_can_implement(args));
  if (args.num_tokens == 0) return {};
  km::TopkParams p;
  p.logits = args.logits;
  p.ids = args.topk_ids;
  p.weights = args.topk_weights;
  p.num_tokens = static_cast<uint32_t>(args.num_tokens);
  p.experts = static_cast<uint32_t>(args.num_experts);
  p.top_k = static_cast<uint32_t>(args.top_k);
  p.dtype = static_cast<uint32_t>(args.dtype);
  p.sigmoid = args.scoring == MoeScoring::kSigmoid ? 1u : 0u;
  p.renormalize = args.renormalize ? 1u : 0u;
  constexpr int64_t kWarps = km::TopkTunables::kThreads / 32;
  const int64_t grid = std::min<int64_t>((args.num_tokens + kWarps - 1) / kWarps, 4096);
  return ops::launch_kernel(&km::moe_topk_kernel, static_cast<unsigned>(grid), km::TopkTunables::kThreads, 0, stream, p);
}

}  // namespace loom
