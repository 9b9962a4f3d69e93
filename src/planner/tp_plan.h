// Role split and algorithm for the fused tensor-parallel operators (host-only, unit-tested).
//
// Order of authority: explicit TpGemmOptions, then the tuning cache (JSON written by
// `loom-bench tune`, read from LOOM_TUNING_CACHE), then the cost model below.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/tensor_parallel.h"
#include "loom/types.h"
#include "runtime/device_abi.h"

namespace loom::planner {

struct TpRequest {
  OpId op = OpId::kAgGemm;  // kAgGemm, kGemmRs or kGemmAr
  int64_t m = 0, n = 0, k = 0;  // as in TpGemmArgs
  int local_world = 1;
  DType dtype = DType::kBF16;
  BLayout b_layout = BLayout::kKN;
  int sm_count = 0;
};

struct TpPlan {
  TpAlgorithm algorithm = TpAlgorithm::kFused;  // never kAuto
  int comm_ctas = 0;                            // CTAs starting in the communication role
  GemmTile tile = GemmTile::kAuto;              // never kAuto
  std::string source;                           // "options", "cache" or "model": for logs and benches
};

// The key a tuning-cache entry is stored under: op, M, N, K, W, dtype, layout.
struct TpKey {
  OpId op;
  int64_t m, n, k;
  int local_world;
  DType dtype;
  BLayout b_layout;
  bool operator<(const TpKey& o) const {
    return std::tie(op, m, n, k, local_world, dtype, b_layout) < std::tie(o.op, o.m, o.n, o.k, o.local_world, o.dtype, o.b_layout);
  }
};

class TuningCache {
 public:
  // Reads a cache file; a missing file is an empty cache, a malformed one an invalid_argument.
  static Result<TuningCache> load(const std::string& path);
  Status save(const std::string& path) const;
  const TpPlan* find(const TpKey& key) const;
  void put(const TpKey& key, const TpPlan& plan);
  size_t size() const { return entries_.size(); }

 private:
  std::map<TpKey, TpPlan> entries_;
};

// Validates the request's shape rules (divisibility by W, GEMM constraints) and picks a plan.
Result<TpPlan> plan_tp(const TpRequest& request, const TpGemmOptions& options, const TuningCache* cache);

}  // namespace loom::planner
