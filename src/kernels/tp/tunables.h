// Every tunable of the tensor-parallel kernels, one node or several (DeepEP keeps its configs
// the same way): plain C++, so the host launchers and the planner read the same values.
#pragma once

#include <cstdint>

namespace loom::kernels::tp {

struct TpTunables {
  // Local ranks (GPUs of one NVLink domain, an HGX board) a kernel addresses: per-rank tensor
  // maps live in the kernel parameters. The world itself is a run-time value.
  static constexpr int kMaxLocalWorld = 8;
  // The data-moving roles (ag_gemm's communication CTAs; the multi-node network and NVLink
  // roles) copy through one TMA bulk-copy stream each (kernels/comm/bulk_copy.cuh), driven by one
  // thread: kCopyStages pieces of kCopyStageBytes in flight (128 KiB), in the compute role's
  // stage buffers, which are free until the CTA joins the compute role.
  static constexpr int kCopyStages = 8;
  static constexpr uint32_t kCopyStageBytes = 16 * 1024;
  // ag_gemm: a pushed chunk's flag is published once at most kPushFlagLag newer bulk groups are
  // still pending (so the pipeline never drains per chunk).
  static constexpr int kPushFlagLag = 4;
  // gemm_rs / gemm_ar rank-banded order: a band of one owner's rows holds at least this many
  // waves of tiles, so the partials a band owes are computed (and flown) a wave before the
  // owner needs them.
  static constexpr uint32_t kBandWaves = 2;
  // Multi-node: CTAs of the roles that exist only with L > 1 (the network rate is ~1/8 of
  // NVLink's, so a few CTAs replicate what arrives to the L - 1 local peers).
  static constexpr uint32_t kMaxNetRecvCtas = 4;
  static constexpr uint32_t kNvlinkCtas = 2;
};

}  // namespace loom::kernels::tp
