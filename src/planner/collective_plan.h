// How many copy CTAs a collective uses, and which copy engine (host-only, unit-tested).
//
// NVLink saturates long before the SMs do: a few dozen CTAs with 16-byte vectors in flight
// reach the link's bandwidth, and more only add contention. Small messages use fewer CTAs so
// each slice stays large enough to amortise the handshake.
#pragma once

#include <cstdint>

#include "loom/status.h"
#include "runtime/device_abi.h"

namespace loom::planner {

enum class CopyEngine : uint8_t { kVector, kBulk };

// Tuned on 2 x H200 (bench/results, Nov 2026): at 64 MiB per rank all three collectives keep
// gaining up to ~half the SMs (all_gather 175 -> 280 GB/s busbw from 8 to 48 CTAs); one CTA
// pass moves 512 threads x 4 x 16 B = 32 KiB, so small payloads spread over more CTAs to cut
// the number of dependent NVLink round trips per CTA.
struct CollectiveConfig {
  uint64_t bytes_per_cta = 32 * 1024;  // aim for at least this much per CTA slice
  int max_ctas_fraction_num = 1;       // at most sm_count * num / den CTAs
  int max_ctas_fraction_den = 2;
  int min_max_ctas = 8;                // ... but never cap below this
};

struct CollectivePlan {
  int num_ctas = 1;
  CopyEngine engine = CopyEngine::kVector;
};

struct CollectiveRequest {
  OpId op = OpId::kAllGather;
  uint64_t bytes = 0;          // the data one CTA set moves in total (per-rank payload)
  int local_world = 1;
  int sm_count = 0;            // smallest over the node's GPUs
  uint32_t max_chunks = 0;     // control-region flags per source: an upper bound on CTAs
  int override_ctas = 0;       // CollectiveOptions::num_ctas or LOOM_COLL_CTAS (0: none)
  bool want_bulk = false;      // caller asked for the TMA engine
  bool bulk_eligible = false;  // buffers allow it (16-byte aligned, all_gather)
};

Result<CollectivePlan> plan_collective(const CollectiveRequest& request, const CollectiveConfig& config = {});

}  // namespace loom::planner
