// TMA tensor maps for the GEMM engine's operands and outputs (ops/launch/tensor_map.h encodes).
#include <string>

#include "kernels/common/tma_descriptor.h"
#include "ops/gemm_launch.h"
#include "ops/launch/tensor_map.h"
#include "planner/gemm_heuristic.h"
#include "runtime/cuda_check.h"

namespace loom::ops {

namespace {

// A 2-D row-major tensor [outer, inner] with `ld` elements between rows, boxes of
// [box_outer, box_inner], 128-byte swizzle (box_inner * element size must be 128 bytes).
Status encode_2d(const void* ptr, DType dtype, uint64_t inner, uint64_t outer, uint64_t ld, uint32_t box_inner,
                 uint32_t box_outer, kernels::sm90::TmaDescriptor* out, const char* what) {
  const uint64_t dims[2] = {inner, outer};
  const uint64_t strides[1] = {ld * dtype_size(dtype)};
  const uint32_t box[2] = {box_inner, box_outer};
  return encode_tensor_map(ptr, dtype, 2, dims, strides, box, out, what);
}

}  // namespace

Status encode_gemm_operand_maps(const GemmArgs& args, GemmTile tile, kernels::sm90::TmaDescriptor* a,
                                kernels::sm90::TmaDescriptor* b) {
  const GemmTileInfo info = gemm_tile_info(tile);
  if (info.block_m == 0) return Status::invalid_argument("encode_gemm_operand_maps: tile must be resolved");
  const planner::GemmLeadingDims ld = planner::resolve_leading_dims(args);
  const uint64_t m = static_cast<uint64_t>(args.m), n = static_cast<uint64_t>(args.n), k = static_cast<uint64_t>(args.k);
  LOOM_TRY(encode_2d(args.a, args.in_dtype, k, m, ld.lda, 64, info.block_m, a, "A"));
  if (args.b_layout == BLayout::kKN) {
    LOOM_TRY(encode_2d(args.b, args.in_dtype, n, k, ld.ldb, 64, 64, b, "B [K, N]"));
  } else {
    LOOM_TRY(encode_2d(args.b, args.in_dtype, k, n, ld.ldb, 64, info.block_n, b, "B [N, K]"));
  }
  return Status{};
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
