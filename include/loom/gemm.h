// loom::gemm: D = A * B on one Hopper GPU with loom's GEMM engine (the engine the fused
// tensor-parallel operators are built from).
//
//   A  [M, K] row-major (lda >= K)                 bf16 or fp16
//   B  [K, N] row-major (ldb >= N), BLayout::kKN    same type as A
//      or an nn.Linear weight [N, K] row-major (ldb >= K), BLayout::kNK
//   D  [M, N] row-major (ldd >= N)                 bf16, fp16 or fp32; accumulation is fp32
//
// Rules, checked before anything is launched:
//   invalid_argument: null pointers, pointers not 16-byte aligned, leading dimensions smaller
//                     than the row or whose byte stride is not a multiple of 16, negative sizes,
//                     D overlapping A or B, an out-of-range option.
//   unsupported:      N or K not a positive multiple of 8, fp32 inputs, sizes of 2^31 or more,
//                     a forced tile that does not fit the device.
// M may be any value >= 0 (M == 0 launches nothing). Leading dimensions of 0 mean "packed".
// The call is asynchronous on `stream`. A device-side failure (only possible through a bug: the
// standalone GEMM waits on nothing outside its CTAs) is recorded and returned by the next call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "loom/diagnostics.h"
#include "loom/status.h"
#include "loom/types.h"

namespace loom {

enum class BLayout : uint8_t {
  kKN,  // B is [K, N] row-major
  kNK,  // B is [N, K] row-major (an nn.Linear weight): D = A * B^T in storage terms
};
std::string_view b_layout_name(BLayout layout);  // "kn", "nk"
Result<BLayout> parse_b_layout(std::string_view name);

// Tile configurations (BLOCK_M x BLOCK_N; BLOCK_K is 64 for all).
enum class GemmTile : uint8_t {
  kAuto = 0,  // the heuristic decides
  k128x256,   // 2 consumer warpgroups, 4 stages: large M and N
  k128x128,   // 2 consumer warpgroups, 6 stages
  k128x64,    // 2 consumer warpgroups, 8 stages: few rows, narrow N
  k64x128,    // 1 consumer warpgroup, 8 stages: M <= 64
};
std::string_view gemm_tile_name(GemmTile tile);  // "auto", "128x256", ...
Result<GemmTile> parse_gemm_tile(std::string_view name);

struct GemmTileInfo {
  int block_m = 0, block_n = 0, block_k = 0;
  int stages = 0;
  int threads = 0;          // per CTA
  size_t smem_bytes = 0;    // dynamic shared memory per CTA
};
GemmTileInfo gemm_tile_info(GemmTile tile);  // zeros for kAuto

struct GemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;  // elements between consecutive rows; 0: packed
  DType in_dtype = DType::kBF16;      // A and B
  DType out_dtype = DType::kBF16;     // D
  BLayout b_layout = BLayout::kKN;
};

struct GemmOptions {
  GemmTile tile = GemmTile::kAuto;  // force a configuration
  int num_ctas = 0;                 // persistent CTAs; 0: min(tiles, SM count)
  int group_m = 0;                  // L2 raster group height in tile rows; 0: planner
  TileTimelineRecord* timeline = nullptr;  // diagnostics (loom/diagnostics.h): device memory for
                                           // tile_timeline_capacity(M, N) records
};

// ---- plan and workspace, before a call (e.g. before CUDA-graph capture) ------------------------
// Checks everything that can be checked without a GPU (no CUDA call is made).
Status gemm_can_implement(const GemmArgs& args, const GemmOptions& options = {});

// What a call launches on the current device (a Hopper GPU): the resolved tile and grid.
struct GemmPlanInfo {
  GemmTile tile = GemmTile::kAuto;  // never kAuto in a returned plan
  GemmTileInfo tile_info;
  int grid = 0;                     // persistent CTAs
  int group_m = 0;                  // raster group height in tile rows
  int64_t tiles = 0;                // output tiles: ceil(M / block_m) * ceil(N / block_n)
};
// gemm_can_implement's checks, then the plan (unsupported when the device is not sm_90 or a
// forced tile does not fit it).
Result<GemmPlanInfo> gemm_plan(const GemmArgs& args, const GemmOptions& options = {});
// Scratch memory a call needs: none (the bounded-wait record is loom's, per stream).
constexpr size_t gemm_workspace_bytes(const GemmArgs&, const GemmOptions& = {}) { return 0; }

// The configuration the heuristic picks for a shape on a device with `sm_count` SMs.
GemmTile choose_gemm_tile(int64_t m, int64_t n, int64_t k, int sm_count);

Status gemm(const GemmArgs& args, cudaStream_t stream, const GemmOptions& options = {});

}  // namespace loom
