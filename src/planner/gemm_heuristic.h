// The GEMM engine's host-side decisions (host-only, no CUDA calls: linked by the CPU tests):
// argument validation, the tile-configuration heuristic and the launch plan.
#pragma once

#include <cstdint>

#include "loom/gemm.h"
#include "loom/status.h"

namespace loom::planner {

// What the planner needs to know about the device (read by the caller from cudaDeviceProp).
struct GemmDeviceLimits {
  int sm_count = 0;
  int64_t smem_per_block_optin = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
};

// A rough roofline per configuration (Hopper constants; the bench is the judge): time =
// waves * per-tile time, bounded below by the per-SM streaming rate and by device memory.
struct GemmCostModel {
  double sm_peak_flops = 989.4e12 / 132;  // dense bf16 per SM
  double sm_stream_bytes_per_s = 200e9;   // L2 -> one SM through TMA
  double dram_bytes_per_s = 4.0e12;
  double tile_overhead_s = 1.5e-6;        // pipeline fill + epilogue per tile
  // HBM saturates only when at least this fraction of the SMs stream; fewer CTAs get a
  // proportional share of dram_bytes_per_s.
  double dram_saturating_sm_fraction = 0.75;
  // Fraction of peak each configuration's mainloop reaches. 64x128 (one warpgroup issuing
  // m64n128) beats 128x64 (two issuing m64n64) on 2 x H200, Nov 2026: M=128, N=8192, K=7168 ran
  // at 0.95 x cuBLAS against 0.89 (bench/results, gemm-tune).
  double eff_128x256 = 0.82, eff_128x128 = 0.74, eff_128x64 = 0.62, eff_64x128 = 0.66;
};

// Modelled time of one configuration (seconds); tests and the bench print it.
double gemm_model_seconds(GemmTile tile, int64_t m, int64_t n, int64_t k, int sm_count,
                          const GemmCostModel& model = {});

struct GemmPlan {
  GemmTile tile = GemmTile::k128x256;
  int num_ctas = 0;
  int group_m = 1;
  int64_t m_blocks = 0;
  int64_t n_blocks = 0;
};

// Validates (as gemm_can_implement), resolves kAuto, checks the tile fits the device, sizes the grid.
Result<GemmPlan> plan_gemm(const GemmArgs& args, const GemmOptions& options, const GemmDeviceLimits& device);

// Leading dimensions with 0 ("packed") resolved.
struct GemmLeadingDims {
  int64_t lda, ldb, ldd;
};
GemmLeadingDims resolve_leading_dims(const GemmArgs& args);

}  // namespace loom::planner
