// loom::attention_merge: validate -> one grid-stride kernel (kernels/attention/merge.cuh).
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/attention/merge.cuh"
#include "loom/attention.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/standalone_wait.h"
#include "planner/attention_plan.h"

namespace loom {

Status attention_merge(const AttentionMergeArgs& args, cudaStream_t stream) {
  LOOM_TRY(planner::validate_attention_merge(args));
  const int64_t rows = args.batch * args.seqlen * args.heads;
  if (rows == 0 || args.head_dim == 0) return Status{};
  LOOM_ASSIGN_OR_RETURN(ops::StandaloneWait * w, ops::standalone_wait());
  LOOM_TRY(ops::take_standalone_error(*w, stream));
  namespace ka = kernels::attention;
  ka::MergeParams p{args.partial_out, args.partial_lse, args.out, args.lse, args.num_partials, args.batch, args.seqlen,
                    args.heads, args.head_dim, static_cast<uint32_t>(args.out_dtype)};
  int device = 0, sms = 0;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  LOOM_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  constexpr unsigned kThreads = 256;
  const int64_t work = rows * (args.head_dim / 4);
  const unsigned grid = static_cast<unsigned>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, 8LL * sms));
  switch (args.out_dtype) {
    case DType::kBF16: return ops::launch_kernel(&ka::attention_merge_kernel<0>, grid, kThreads, 0, stream, p);
    case DType::kF16: return ops::launch_kernel(&ka::attention_merge_kernel<1>, grid, kThreads, 0, stream, p);
    case DType::kF32: return ops::launch_kernel(&ka::attention_merge_kernel<2>, grid, kThreads, 0, stream, p);
  }
  return Status::invalid_argument("attention_merge: unknown out_dtype");
}

}  // namespace loom
