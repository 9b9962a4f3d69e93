// loom::ring_attention's launcher: validate -> plan (the attention engine's plan for one rank's
// share) -> the attention family's workspace and launch state -> one persistent kernel
// (kernels/attention/sm90_ring_attention.cuh).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "core/log.h"
#include "kernels/attention/config.h"
#include "kernels/attention/flags.h"
#include "kernels/attention/params.h"
#include "loom/attention.h"
#include "ops/attention/flash_launch.h"
#include "ops/attention/flash_params.h"
#include "ops/launch/family_resources.h"
#include "ops/launch/kernel_launch.h"
#include "ops/launch/queued_work.h"
#include "ops/launch/signature.h"
#include "planner/attention_plan.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"
#include "runtime/network_layout.h"
#include "runtime/topology.h"

namespace loom {

namespace {

namespace ka = kernels::attention;

constexpr const char* kFamily = "attention";

// The launch's 32-bit signature (ops/launch/signature.h) over what every rank must agree on,
// compared by the entry handshake: ranks that call with other shapes or options fail with a
// mismatch (invalid_argument).
uint32_t ring_signature(const RingAttentionArgs& a, const RingAttentionOptions& o, int block_n, uint64_t workspace,
                        const runtime::Topology& t) {
  return ops::call_signature(ka::kRingAttentionOp, {{"nodes", t.num_nodes},
                                                    {"local", t.local_world_size},
                                                    {"batch", a.batch},
                                                    {"seqlen", a.seqlen},
                                                    {"heads_q", a.heads_q},
                                                    {"heads_kv", a.heads_kv},
                                                    {"head_dim", a.head_dim},
                                                    {"dtype", static_cast<int64_t>(a.dtype)},
                                                    {"causal", static_cast<int64_t>(o.causal)},
                                                    {"block_n", block_n},
                                                    {"workspace", static_cast<int64_t>(workspace)}});
}

// Everything a call decides before it touches memory: the checks that need no buffers, the
// engine's plan for one rank's share, the workspace layout and the CTA split.
struct RingCall {
  AttentionArgs core;
  AttentionOptions core_options;
  planner::AttentionPlan plan;
  planner::RingWorkspace layout;
  int world = 0;  // ranks of the job (N nodes x L)
  int grid = 0;
  int kv_ctas = 0;
};

// Loads every ring attention kernel (once per device): across nodes a kernel must not be loaded
// behind a running one, which waits on the proxy (ops/launch/kernel_launch.h).
Status load_ring_kernels() {
  return ops::load_once_per_device([] {
    LOOM_TRY(ops::attention::load_ring_64x128());
    LOOM_TRY(ops::attention::load_ring_64x192());
    LOOM_TRY(ops::attention::load_ring_128x176());
    return ops::attention::load_ring_256x80();
  });
}

Result<RingCall> plan_ring(Communicator::Impl& impl, const RingAttentionArgs& args, const RingAttentionOptions& options) {
  LOOM_TRY(impl.check_usable());
  RingCall call;
  // Across nodes the ring numbers the job's ranks node-major (position n * L + l; the sequence's
  // chunks follow it): the communicator's numbering must be that one.
  const runtime::Topology& t = impl.topology;
  for (int n = 0; n < t.num_nodes && t.num_nodes > 1; ++n) {
    for (int l = 0; l < t.local_world_size; ++l) {
      if (t.rank_of(n, l) != n * t.local_world_size + l) {
        return Status::unsupported("ring_attention: across nodes the ranks must be numbered node by node (rank " +
                                   std::to_string(t.rank_of(n, l)) + " is local index " + std::to_string(l) +
                                   " of node " + std::to_string(n) + ")");
      }
    }
  }
  call.world = t.world_size;
  LOOM_TRY(planner::validate_ring_attention(args, options, call.world));
  call.core = planner::ring_core_args(args);
  call.core_options = planner::ring_core_options(args, options);
  LOOM_ASSIGN_OR_RETURN(planner::AttentionDeviceLimits limits, ops::attention::device_limits("ring_attention"));
  LOOM_ASSIGN_OR_RETURN(call.plan, planner::plan_attention(call.core, call.core_options, limits));
  call.layout = planner::ring_workspace(args, call.world);
  call.grid = impl.sm_count;
  call.kv_ctas = planner::ring_kv_ctas(options, call.world, call.grid);
  if (t.num_nodes > 1) {
    // Two network flags per chunk of K/V and remote node; one CTA of the grid for the network.
    const runtime::net::NetWindowLayout window{static_cast<uint32_t>(t.num_nodes), static_cast<uint32_t>(t.local_world_size)};
    const uint64_t flags = 2ull * static_cast<uint64_t>(t.num_nodes - 1) * static_cast<uint64_t>(args.batch) * call.layout.chunks;
    if (flags > window.launch_capacity()) {
      return Status::unsupported("ring_attention: " + std::to_string(flags) + " network flags per call (2 per chunk of " +
                                 std::to_string(ka::RingTunables::kChunkRows) + " rows, batch and remote node); the " +
                                 "network flag window holds " + std::to_string(window.launch_capacity()));
    }
    if (call.kv_ctas + 2 > call.grid) {
      return Status::unsupported("ring_attention: " + std::to_string(call.grid) + " CTAs cannot hold " +
                                 std::to_string(call.kv_ctas) + " K/V push CTAs, a network CTA and a compute CTA");
    }
  }
  return call;
}

Status ring_launch(Communicator& comm, const RingAttentionArgs& args, cudaStream_t stream,
                   const RingAttentionOptions& options) {
  Communicator::Impl& impl = internal(comm);
  LOOM_ASSIGN_OR_RETURN(const RingCall call, plan_ring(impl, args, options));
  if (impl.topology.num_nodes > 1) LOOM_TRY_CTX(load_ring_kernels(), "ring_attention");
  const int world = call.world;
  const planner::AttentionPlan& plan = call.plan;
  const planner::RingWorkspace& layout = call.layout;
  const size_t elem = dtype_size(args.dtype);
  const size_t q_bytes = static_cast<size_t>(args.batch * args.seqlen * args.heads_q * args.head_dim) * elem;
  const size_t kv_bytes = static_cast<size_t>(args.batch * args.seqlen * args.heads_kv * args.head_dim) * elem;
  LOOM_TRY_CTX(impl.check_local_device_buffer(args.q, q_bytes, "q ([B, S_l, Hq, D])"), "ring_attention");
  LOOM_TRY_CTX(impl.check_local_device_buffer(args.k, kv_bytes, "k ([B, S_l, Hkv, D])"), "ring_attention");
  LOOM_TRY_CTX(impl.check_local_device_buffer(args.v, kv_bytes, "v ([B, S_l, Hkv, D])"), "ring_attention");
  LOOM_TRY_CTX(impl.check_local_device_buffer(args.out, q_bytes, "out ([B, S_l, Hq, D])"), "ring_attention");
  LOOM_ASSIGN_OR_RETURN(void* workspace,
                        ops::family_workspace(impl, kFamily, static_cast<size_t>(layout.bytes), stream, "ring_attention"));

  ka::RingParams p{};
  LOOM_ASSIGN_OR_RETURN(p.core, ops::attention::make_flash_params(call.core, call.core_options, plan));
  LOOM_ASSIGN_OR_RETURN(p.core.queue, ops::family_launch_state(impl, kFamily));
  const uint64_t base = workspace != nullptr ? impl.heap->offset_of(workspace) : 0;  // none at W = 1
  if (layout.bytes > 0) {  // none for a ring of one: no receive slots, no flags (planner::ring_workspace)
    // The arrival flags start at zero for every call: a grown workspace holds stale bytes, which a
    // flag wait could take for a later epoch. Every chunk of the previous call arrived before it
    // ended (ring_drain), so nothing writes into them meanwhile.
    const size_t flag_bytes = static_cast<size_t>(world) * static_cast<size_t>(args.batch) * layout.chunks * 8;
    LOOM_CUDA_TRY(cudaMemsetAsync(static_cast<char*>(workspace) + layout.arrived, 0, flag_bytes, stream));
    const char* ws = static_cast<const char*>(workspace);
    const AttentionStrides recv_strides{args.heads_kv * args.head_dim, args.head_dim,
                                        args.seqlen * args.heads_kv * args.head_dim};
    const int64_t recv_batches = static_cast<int64_t>(world) * args.batch;
    LOOM_TRY(ops::attention::encode_qkv_map(ws + layout.recv_k, args.dtype, args.head_dim, args.heads_kv, args.seqlen,
                                            recv_batches, recv_strides, plan.info.block_n, args.q, &p.recv_k_map,
                                            "ring_attention received k"));
    LOOM_TRY(ops::attention::encode_qkv_map(ws + layout.recv_v, args.dtype, args.head_dim, args.heads_kv, args.seqlen,
                                            recv_batches, recv_strides, plan.info.block_n, args.q, &p.recv_v_map,
                                            "ring_attention received v"));
  }
  p.comm = impl.device_comm();
  p.k_local = static_cast<const char*>(args.k);
  p.v_local = static_cast<const char*>(args.v);
  p.recv_k_offset = base + layout.recv_k;
  p.recv_v_offset = base + layout.recv_v;
  p.arrived_offset = base + layout.arrived;
  p.row_bytes = static_cast<uint64_t>(args.heads_kv * args.head_dim) * elem;
  p.chunks = layout.chunks;
  const int grid = call.grid;
  p.kv_ctas = static_cast<uint32_t>(call.kv_ctas);
  p.net_flag_base = impl.device_comm().net.launch_flag_base;
  p.signature = ring_signature(args, options, plan.info.block_n, base, impl.topology);
  LOOM_DEBUG("ring_attention: W %d, B %lld, S_l %lld, H %lld/%lld, D %lld, %s, BLOCK_N %d, %d CTAs (%u push K/V first)",
             world, static_cast<long long>(args.batch), static_cast<long long>(args.seqlen),
             static_cast<long long>(args.heads_q), static_cast<long long>(args.heads_kv),
             static_cast<long long>(args.head_dim), options.causal ? "causal (zigzag)" : "full", plan.info.block_n, grid,
             p.kv_ctas);
  return ops::attention::launch_ring(p, static_cast<int>(args.head_dim), plan.info.block_n, args.dtype == DType::kBF16,
                                     options.causal, grid, stream);
}

}  // namespace

Result<RingAttentionPlanInfo> ring_attention_plan(Communicator& comm, const RingAttentionArgs& args,
                                                  const RingAttentionOptions& options) {
  LOOM_ASSIGN_OR_RETURN(const RingCall call, plan_ring(internal(comm), args, options));
  RingAttentionPlanInfo info;
  info.engine = call.plan.info;
  info.grid = call.grid;
  info.kv_ctas = call.kv_ctas;
  info.workspace_bytes = static_cast<size_t>(call.layout.bytes);
  return info;
}

Status ring_attention_reserve_workspace(Communicator& comm, const RingAttentionArgs& args, cudaStream_t stream,
                                        const RingAttentionOptions& options) {
  Communicator::Impl& impl = internal(comm);
  LOOM_ASSIGN_OR_RETURN(const RingCall call, plan_ring(impl, args, options));
  return ops::family_workspace(impl, kFamily, static_cast<size_t>(call.layout.bytes), stream, "ring_attention").status();
}

Status ring_attention(Communicator& comm, const RingAttentionArgs& args, cudaStream_t stream,
                      const RingAttentionOptions& options) {
  return ops::noted(comm, ring_launch(comm, args, stream, options), stream);
}

}  // namespace loom
