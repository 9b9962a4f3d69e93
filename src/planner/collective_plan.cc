#include "planner/collective_plan.h"

#include <algorithm>
#include <string>

namespace loom::planner {

Result<CollectivePlan> plan_collective(const CollectiveRequest& r, const CollectiveConfig& config) {
  if (r.sm_count <= 0) return Status::internal("plan_collective: unknown SM count");
  if (r.max_chunks == 0) return Status::internal("plan_collective: control region has no chunk flags");
  const int cap = std::min<int>(static_cast<int>(r.max_chunks), r.sm_count);
  CollectivePlan plan;
  if (r.override_ctas > 0) {
    if (r.override_ctas > cap) {
      return Status::invalid_argument("num_ctas " + std::to_string(r.override_ctas) + " exceeds the limit " +
                                      std::to_string(cap) + " (SM count / control-region chunk flags)");
    }
    plan.num_ctas = r.override_ctas;
  } else {
    const int fraction_cap =
        std::max(config.min_max_ctas, r.sm_count * config.max_ctas_fraction_num / config.max_ctas_fraction_den);
    const uint64_t wanted = (r.bytes + config.bytes_per_cta - 1) / config.bytes_per_cta;
    plan.num_ctas = static_cast<int>(std::clamp<uint64_t>(wanted, 1, static_cast<uint64_t>(std::min(cap, fraction_cap))));
  }
  if (r.want_bulk) {
    if (!r.bulk_eligible) {
      return Status::invalid_argument("the bulk (TMA) copy engine needs an all_gather with 16-byte aligned buffers "
                                      "and a shard size that is a multiple of 16 bytes");
    }
    plan.engine = CopyEngine::kBulk;
  }
  return plan;
}

}  // namespace loom::planner
