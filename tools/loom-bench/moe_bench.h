// loom-bench moe: moe_dispatch_gemm (the dispatch and the local experts' fc1 in one persistent
// kernel) beside its own grouped GEMM alone and beside moe_dispatch then grouped_gemm (see
// moe_bench.cu).
#pragma once

#include <cstdint>
#include <cstdio>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "loom/communicator.h"
#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/types.h"
#include "progress.h"
#include "report.h"

namespace loom::bench {

// The per-GPU slice of an expert-parallel MoE layer (bench/grouped_gemm.py's models). Over W
// ranks the layer has experts_per_gpu * W experts, and each token picks min(top_k, experts) of
// them.
struct MoeModel {
  std::string_view name;
  int64_t hidden = 0;           // H: K of fc1
  int64_t intermediate = 0;     // I: fc1's N is 2I (gate and up, SwiGLU)
  int64_t experts_per_gpu = 0;  // E / W
  int top_k = 0;
};
inline constexpr MoeModel kMoeModels[] = {
    {"deepseek-v3", 7168, 2048, 32, 8},
    {"qwen3-235b", 4096, 1536, 16, 8},
    {"mixtral", 4096, 14336, 1, 2},
};
Result<MoeModel> find_moe_model(std::string_view name);

// How tokens pick their experts: k distinct experts each, drawn from a Categorical over the E
// experts with equal weights (uniform) or with weights U(0, 1) drawn once for all ranks (skewed).
enum class MoeRouting : uint8_t { kUniform, kSkewed };
std::string_view moe_routing_name(MoeRouting routing);  // "uniform", "skewed"
Result<MoeRouting> parse_moe_routing(std::string_view name);

struct MoeBenchOptions {
  std::vector<MoeModel> models = {std::begin(kMoeModels), std::end(kMoeModels)};
  std::vector<int64_t> tokens = {1024, 4096};  // per GPU
  std::vector<MoeRouting> routings = {MoeRouting::kUniform, MoeRouting::kSkewed};
  DType dtype = DType::kBF16;                  // token rows, weights and outputs: bf16 or fp16
  GemmTile tile = GemmTile::k128x256;          // for the fused kernel and the grouped GEMM alike
  int push_ctas = 0;                           // MoeDispatchGemmOptions (0: planner)
  int arrival_ctas = 0;
  int warmup = 5;
  int iters = 30;  // timed rounds (median reported); at least 20 is sensible
  uint64_t seed = 1;
};

// One measured case on a job of `world` ranks.
struct MoeShape {
  MoeModel model;
  int64_t tokens = 0;  // per GPU
  MoeRouting routing = MoeRouting::kUniform;
  int64_t experts = 0;  // E over all ranks
  int top_k = 0;
  std::string text() const;  // e.g. "moe deepseek-v3 T4096 skewed"
};
// models x tokens x routings, in that order; skewed routing is left out where E is 1 (one expert
// takes every token whatever the weights: the uniform case again).
std::vector<MoeShape> moe_shapes(const MoeBenchOptions& options, int world);

// Per shape: random token rows and expert weights, host-drawn top-k ids routed once
// (moe_routing; the plan serves every call), then fused (moe_dispatch_gemm), grouped (grouped_gemm
// alone on the dispatched rows), sequential (moe_dispatch, then grouped_gemm) and dispatch
// (moe_dispatch alone, its bandwidth in true bytes), each with the
// same tile, timed side by side in shuffled rounds (median of `iters` after `warmup`, max over
// ranks). Checked once per shape: the fused output's kept rows must be bit-identical to the
// sequential one's (a row that is not fails the run; its times are still reported). One progress
// step per shape. Refused (unsupported) when ranks share a GPU.
Status run_moe_bench(Communicator& comm, const MoeBenchOptions& options, Report& report, Progress& progress);

// Symmetric heap the benchmark needs on `world` ranks: its largest receive buffer and MoE
// workspace, and a margin.
uint64_t moe_heap_bytes(const MoeBenchOptions& options, int world);

// The moe_dispatch_gemm rows of `report` as one table (rank 0 calls it).
void print_moe_table(const Report& report, std::FILE* out);

}  // namespace loom::bench
