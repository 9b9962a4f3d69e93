// The multi-node operators' plan (host-only, CPU-tested): the rules of a call's shape and
// options, the tile, the CTA roles, the index layout and the workspace of ag_gemm, gemm_rs and
// gemm_ar over N nodes x L GPUs (kernels: src/kernels/tp/multinode/; layout: layout.h there).
//
// Rules (a Status before anything is launched; messages name the operator and the rule), beyond
// every TP call's (check_tp_shape / check_tp_options, tp_plan.h, with W = N x L):
//   unsupported  M / W not a multiple of 128 (a tile row never spans two blocks); L above
//                TpTunables::kMaxLocalWorld; the decomposed algorithm (there is no decomposed path
//                across nodes); a forced tile other than 128x256 / 128x128; comm_ctas other than -1
//                (the role split is fixed: one network-send CTA, with L > 1 up to kMaxNetRecvCtas
//                network-receive CTAs for ag_gemm and gemm_ar and kNvlinkCtas NVLink CTAs for
//                ag_gemm); tail_pieces of 2 or more (the multi-node kernels have no tail split);
//                flags beyond the network window; a GPU without an SM left for the compute role
// The tile: 128x256 where the GEMM heuristic picks it for the local shape, else 128x128 (on the
// node's smallest SM count, so every rank decides alike).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/tp/multinode/layout.h"
#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/tensor_parallel.h"
#include "loom/types.h"
#include "runtime/device_abi.h"

namespace loom::planner {

struct MultiNodeRequest {
  OpId op = OpId::kAgGemm;              // kAgGemm, kGemmRs or kGemmAr
  int64_t m = 0, n = 0, k = 0;          // as in TpGemmArgs (M over all W ranks, K this rank's)
  DType dtype = DType::kBF16;
  BLayout b_layout = BLayout::kKN;
  kernels::tp::multinode::Grid grid;    // N nodes x L GPUs and this rank
  int sm_count = 0;                     // this GPU's SMs: the persistent grid
  int plan_sm_count = 0;                // the node's smallest SM count: the tile (every rank alike)
  uint32_t flag_base = 0;               // the network window's first per-launch word ...
  uint32_t flag_capacity = 0;           // ... and how many there are
  bool gathered_a = false;              // ag_gemm: the caller's gathered A (no workspace for it)
};

struct MultiNodePlan {
  GemmTile tile = GemmTile::k128x128;
  int grid = 0;                                  // persistent CTAs (sm_count)
  kernels::tp::multinode::RoleTable roles;
  kernels::tp::multinode::AgLayout ag;           // ag_gemm
  kernels::tp::multinode::ReduceLayout reduce;   // gemm_rs, gemm_ar
  uint32_t group_m = 1;         // raster group height in tile rows
  uint32_t ramp_m = 0;          // gemm_rs / gemm_ar: the first raster groups' height (one chunk)
  uint32_t rows_per_chunk = 0;  // rows per network chunk (one command and flag each)
  uint32_t flags = 0;           // network-window words per launch
  size_t fold_bytes = 0;        // gemm_rs / gemm_ar: the fold source at workspace offset 0; the
                                // send buffer follows
  size_t workspace_bytes = 0;   // the multi-node family's workspace the call needs
};

Result<MultiNodePlan> plan_multinode(const MultiNodeRequest& request, const TpGemmOptions& options);

}  // namespace loom::planner
