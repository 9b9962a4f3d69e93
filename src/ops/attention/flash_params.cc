#include "ops/attention/flash_params.h"

#include <cuda_runtime_api.h>

#include <string>

#include "ops/launch/checks.h"
#include "ops/launch/tensor_map.h"
#include "runtime/cuda_check.h"

namespace loom::ops::attention {

namespace ka = kernels::attention;

Result<planner::AttentionDeviceLimits> device_limits(const char* op) {
  LOOM_ASSIGN_OR_RETURN(const HopperDevice device, current_hopper_device(op, "the attention engine"));
  return planner::AttentionDeviceLimits{device.sm_count, device.smem_per_block_optin, device.l2_bytes};
}

Status encode_qkv_map(const void* ptr, DType dtype, int64_t head_dim, int64_t heads, int64_t rows, int64_t batch,
                      const AttentionStrides& s, int box_rows, const void* fallback, kernels::sm90::TmaDescriptor* out,
                      const char* what) {
  if (rows == 0 || batch == 0) {
    ptr = fallback;
    rows = 1;
    batch = 1;
  }
  const size_t e = dtype_size(dtype);
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(heads), static_cast<uint64_t>(rows),
                            static_cast<uint64_t>(batch)};
  const uint64_t strides[3] = {static_cast<uint64_t>(s.head) * e, static_cast<uint64_t>(s.row) * e,
                               static_cast<uint64_t>(s.batch) * e};
  const uint32_t box[4] = {64, 1, static_cast<uint32_t>(box_rows), 1};
  return encode_tensor_map(ptr, dtype, 4, dims, strides, box, out, what);
}

Result<ka::FlashParams> make_flash_params(const AttentionArgs& args, const AttentionOptions& options,
                                         const planner::AttentionPlan& plan) {
  const bool packed = args.layout == AttentionLayout::kPacked;
  const int64_t q_rows = packed ? args.total_q : args.seqlen_q;
  const int64_t k_rows = packed ? args.total_k : args.seqlen_k;
  const int64_t batch = packed ? 1 : args.batch;
  const int block_n = plan.info.block_n;
  ka::FlashParams p{};
  LOOM_TRY(encode_qkv_map(args.q, args.dtype, args.head_dim, args.heads_q, q_rows, batch, plan.strides.q,
                          plan.info.block_m, args.q, &p.q_map, "attention q"));
  LOOM_TRY(encode_qkv_map(args.k, args.dtype, args.head_dim, args.heads_kv, k_rows, batch, plan.strides.k, block_n,
                          args.q, &p.k_map, "attention k"));
  LOOM_TRY(encode_qkv_map(args.v, args.dtype, args.head_dim, args.heads_kv, k_rows, batch, plan.strides.v, block_n,
                          args.q, &p.v_map, "attention v"));
  p.out = args.out;
  p.lse = args.lse;
  p.out_stride_row = plan.strides.out.row;
  p.out_stride_head = plan.strides.out.head;
  p.out_stride_batch = plan.strides.out.batch;
  p.lse_stride_head = plan.strides.lse_head;
  p.lse_stride_batch = plan.strides.lse_batch;
  p.cu_seqlens_q = packed ? args.cu_seqlens_q : nullptr;
  p.cu_seqlens_k = packed ? args.cu_seqlens_k : nullptr;
  p.total_q = static_cast<int32_t>(args.total_q);
  p.total_k = static_cast<int32_t>(args.total_k);
  p.batch = static_cast<int32_t>(args.batch);
  p.heads_q = static_cast<int32_t>(args.heads_q);
  p.heads_kv = static_cast<int32_t>(args.heads_kv);
  p.seqlen_q = static_cast<int32_t>(args.seqlen_q);
  p.seqlen_k = static_cast<int32_t>(args.seqlen_k);
  p.m_blocks = static_cast<uint32_t>(plan.m_blocks);
  p.num_tiles = static_cast<uint32_t>(plan.info.tiles);
  p.section_heads = plan.section_heads;
  p.scale_log2 = plan.scale * 1.4426950408889634f;
  p.causal = options.causal ? 1u : 0u;
  p.out_f32 = options.partial ? 1u : 0u;
  return p;
}

}  // namespace loom::ops::attention
