#include "planner/tp_plan.h"

#include <algorithm>
#include <string>

namespace loom::planner {
namespace {

std::string shape_text(const TpRequest& r) {
  return "M=" + std::to_string(r.m) + " N=" + std::to_string(r.n) + " K=" + std::to_string(r.k) + " W=" +
         std::to_string(r.local_world);
}

Status check_shape(const TpRequest& r) {
  const char* op = op_name(r.op);
  if (r.op != OpId::kAgGemm && r.op != OpId::kGemmRs && r.op != OpId::kGemmAr) {
    return Status::internal("plan_tp: not a tensor-parallel operator");
  }
  if (r.local_world < 1) return Status::internal("plan_tp: local world below 1");
  if (r.dtype == DType::kF32) return Status::unsupported(std::string(op) + ": fp32 inputs are not supported (bf16 or fp16)");
  if (r.m <= 0 || r.n <= 0 || r.k <= 0) {
    return Status::invalid_argument(std::string(op) + ": " + shape_text(r) + ": M, N and K must be positive");
  }
  if (r.m % r.local_world != 0) {
    return Status::invalid_argument(std::string(op) + ": " + shape_text(r) + ": M must be a multiple of the " +
                                    std::to_string(r.local_world) + " local ranks (each owns M/W rows)");
  }
  if (r.n % 8 != 0 || r.k % 8 != 0) {
    return Status::unsupported(std::string(op) + ": " + shape_text(r) + ": N and K must be multiples of 8");
  }
  return {};
}

}  // namespace

const TpPlan* TuningCache::find(const TpKey& key) const {
  auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : &it->second;
}

void TuningCache::put(const TpKey& key, const TpPlan& plan) { entries_[key] = plan; }

Result<TpPlan> plan_tp(const TpRequest& r, const TpGemmOptions& options, const TuningCache* cache) {
  LOOM_TRY(check_shape(r));
  if (r.sm_count <= 0) return Status::internal("plan_tp: unknown SM count");
  TpPlan plan;
  plan.source = "model";
  const TpKey key{r.op, r.m, r.n, r.k, r.local_world, r.dtype, r.b_layout};
  if (const TpPlan* hit = cache != nullptr ? cache->find(key) : nullptr) {
    plan = *hit;
    plan.source = "cache";
  } else {
    // The GEMM each rank runs: ag_gemm multiplies all M rows; gemm_rs and gemm_ar too.
    plan.tile = choose_gemm_tile(r.m, r.n, r.k, r.sm_count);
    // A few CTAs move data while the rest compute; they join the compute role when done.
    plan.comm_ctas = std::clamp(r.sm_count / 16, 2, 16);
    plan.algorithm = r.local_world == 1 ? TpAlgorithm::kDecomposed : TpAlgorithm::kFused;
  }
  if (options.algorithm != TpAlgorithm::kAuto) {
    plan.algorithm = options.algorithm;
    plan.source = "options";
  }
  if (options.comm_ctas >= 0) {
    if (options.comm_ctas >= r.sm_count) {
      return Status::invalid_argument(std::string(op_name(r.op)) + ": comm_ctas " + std::to_string(options.comm_ctas) +
                                      " leaves no compute CTA on " + std::to_string(r.sm_count) + " SMs");
    }
    plan.comm_ctas = options.comm_ctas;
    plan.source = "options";
  }
  if (options.tile != GemmTile::kAuto) {
    plan.tile = options.tile;
    plan.source = "options";
  }
  return plan;
}

}  // namespace loom::planner
