// TMA tensor maps for the GEMM engine's operands and outputs (ops/launch/tensor_map.h encodes).
#include <string>

#include "kernels/common/tma_descriptor.h"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/tensor_map.h"
#include "planner/gemm_heuristic.h"
#include "runtime/cuda_check.h"

namespace loom::ops {

namespace {

// A row-major tensor [outer, inner] (groups = 0) or [groups, outer, inner] with `ld` elements
// between rows and outer * ld between groups, boxes of [1,] box_outer, box_inner, 128-byte swizzle
// (box_inner * element size must be 128 bytes).
Status encode_tiled_map(const void* ptr, DType dtype, uint64_t inner, uint64_t outer, uint64_t ld, uint64_t groups,
                        uint32_t box_inner, uint32_t box_outer, kernels::sm90::TmaDescriptor* out, const char* what) {
  const uint64_t dims[3] = {inner, outer, groups};
  const uint64_t strides[2] = {ld * dtype_size(dtype), outer * ld * dtype_size(dtype)};
  const uint32_t box[3] = {box_inner, box_outer, 1};
  return encode_tensor_map(ptr, dtype, groups > 0 ? 3 : 2, dims, strides, box, out, what);
}

Status encode_2d(const void* ptr, DType dtype, uint64_t inner, uint64_t outer, uint64_t ld, uint32_t box_inner,
                 uint32_t box_outer, kernels::sm90::TmaDescriptor* out, const char* what) {
  return encode_tiled_map(ptr, dtype, inner, outer, ld, 0, box_inner, box_outer, out, what);
}

// B of `args` ([K, N] or [N, K]); with groups > 0, that many of them one after the other (3-D).
Status encode_b(const GemmArgs& args, int64_t groups, GemmTile tile, kernels::sm90::TmaDescriptor* b) {
  const GemmTileInfo info = gemm_tile_info(tile);
  const planner::GemmLeadingDims ld = planner::resolve_leading_dims(args);
  const uint64_t n = static_cast<uint64_t>(args.n), k = static_cast<uint64_t>(args.k), g = static_cast<uint64_t>(groups);
  if (args.b_layout == BLayout::kKN) return encode_tiled_map(args.b, args.in_dtype, n, k, ld.ldb, g, 64, 64, b, "B [K, N]");
  return encode_tiled_map(args.b, args.in_dtype, k, n, ld.ldb, g, 64, static_cast<uint32_t>(info.block_n), b, "B [N, K]");
}

}  // namespace

Status encode_gemm_operand_maps(const GemmArgs& args, GemmTile tile, kernels::sm90::TmaDescriptor* a,
                                kernels::sm90::TmaDescriptor* b) {
  const GemmTileInfo info = gemm_tile_info(tile);
  if (info.block_m == 0) return Status::invalid_argument("encode_gemm_operand_maps: tile must be resolved");
  const planner::GemmLeadingDims ld = planner::resolve_leading_dims(args);
  const uint64_t m = static_cast<uint64_t>(args.m), k = static_cast<uint64_t>(args.k);
  LOOM_TRY(encode_2d(args.a, args.in_dtype, k, m, ld.lda, 64, info.block_m, a, "A"));
  return encode_b(args, 0, tile, b);
}

Status encode_gemm_grouped_b_map(const GemmArgs& args, int64_t groups, GemmTile tile, kernels::sm90::TmaDescriptor* b) {
  if (gemm_tile_info(tile).block_m == 0) return Status::invalid_argument("encode_gemm_grouped_b_map: tile must be resolved");
  if (groups < 1) return Status::invalid_argument("encode_gemm_grouped_b_map: groups must be positive");
  return encode_b(args, groups, tile, b);
}

Status encode_gemm_rows_map(const void* ptr, int64_t rows, int64_t cols, int64_t ld, DType dtype, int box_rows,
                            kernels::sm90::TmaDescriptor* out) {
  if (dtype == DType::kF32) return Status::invalid_argument("encode_gemm_rows_map: 16-bit elements only (64 per 128-byte row)");
  if (box_rows <= 0 || box_rows > 256) return Status::invalid_argument("encode_gemm_rows_map: box rows must be in 1..256");
  return encode_2d(ptr, dtype, static_cast<uint64_t>(cols), static_cast<uint64_t>(rows), static_cast<uint64_t>(ld), 64,
                   static_cast<uint32_t>(box_rows), out, "rows");
}

Status encode_gemm_output_map(void* ptr, int64_t rows, int64_t n, int64_t ld, DType dtype,
                              kernels::sm90::TmaDescriptor* out) {
  const uint32_t box_inner = dtype == DType::kF32 ? 32 : 64;  // 128 bytes per staged row
  return encode_2d(ptr, dtype, static_cast<uint64_t>(n), static_cast<uint64_t>(rows), static_cast<uint64_t>(ld),
                   box_inner, 16, out, "D");
}

}  // namespace loom::ops
