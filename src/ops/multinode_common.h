// Host side shared by the multi-node operators (multinode_ag_gemm.cu, multinode_gemm_rs.cu,
// multinode_gemm_ar.cu, multinode_transfer.cu): argument checks, the tile and role choice, the
// multi-node workspace, plan signatures and launch plumbing. The rules are listed in multinode.h.
//
// Kernel attribute setup, the configuration dispatch, the raster height, byte ranges and the
// signature hash are the single-node operators' (ops/tp_common.h).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "core/log.h"
#include "kernels/gemm/config.h"
#include "kernels/tp/multinode_frame.cuh"
#include "kernels/tp/multinode_layout.h"
#include "kernels/tp/multinode_reduce.cuh"
#include "loom/gemm.h"
#include "loom/tensor_parallel.h"
#include "ops/gemm_launch.h"
#include "ops/multinode.h"
#include "ops/tp_common.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"
#include "runtime/network_layout.h"

namespace loom::ops::mn {

namespace kmn = kernels::tp::mn;

inline std::string op_text(OpId op) { return op_name(op); }

// The job's grid of ranks as the kernels see it.
inline kmn::Grid grid_of(const Communicator::Impl& impl) {
  kmn::Grid g;
  g.nodes = static_cast<uint32_t>(impl.topology.num_nodes);
  g.local = static_cast<uint32_t>(impl.topology.local_world_size);
  g.node = static_cast<uint32_t>(impl.topology.node);
  g.me = static_cast<uint32_t>(impl.topology.local_rank);
  return g;
}

inline std::string shape_text(const TpGemmArgs& a, const kmn::Grid& g) {
  char buf[192];
  std::snprintf(buf, sizeof buf, "M=%lld N=%lld K=%lld on %u nodes x %u GPUs %s", static_cast<long long>(a.m),
                static_cast<long long>(a.n), static_cast<long long>(a.k), g.nodes, g.local,
                std::string(dtype_name(a.dtype)).c_str());
  return buf;
}

using tp::ByteRange;
using tp::bytes_of;

// Everything that does not depend on buffers: communicator, dtype, pointers' alignment, shape
// rules, options. Every rank reaches the same verdict from the same arguments.
inline Status check_call(const Communicator::Impl& impl, OpId op, const TpGemmArgs& a, const TpGemmOptions& options) {
  const std::string name = op_text(op);
  LOOM_TRY(impl.check_usable());
  if (!impl.network) return Status::unsupported(name + ": the multi-node path needs a communicator spanning several nodes");
  const kmn::Grid g = grid_of(impl);
  const int64_t world = g.world();
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) {
    return Status::unsupported(name + ": " + std::string(dtype_name(a.dtype)) + " is not supported (bf16 or fp16)");
  }
  const std::pair<const void*, const char*> pointers[] = {{a.a, "a"}, {a.b, "b"}, {a.out, "out"}};
  for (const auto& [ptr, what] : pointers) {
    if (ptr == nullptr) return Status::invalid_argument(name + ": " + what + " is null");
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
      return Status::invalid_argument(name + ": " + what + " is not 16-byte aligned (TMA needs 16-byte aligned rows)");
    }
  }
  if (a.gathered_a != nullptr) {
    if (op != OpId::kAgGemm) return Status::invalid_argument(name + ": gathered_a belongs to ag_gemm; leave it null");
    if (reinterpret_cast<uintptr_t>(a.gathered_a) % 16 != 0) {
      return Status::invalid_argument(name + ": gathered_a is not 16-byte aligned");
    }
  }
  if (a.m <= 0 || a.n <= 0 || a.k <= 0) {
    return Status::invalid_argument(name + ": M, N and K must be positive (" + shape_text(a, g) + ")");
  }
  if (a.m % world != 0) {
    return Status::invalid_argument(name + ": M = " + std::to_string(a.m) + " must be a multiple of the world size W = " +
                                    std::to_string(world) + " (" + std::to_string(g.nodes) + " nodes x " +
                                    std::to_string(g.local) + " GPUs): every rank owns M/W rows");
  }
  if ((a.m / world) % kmn::kBlockM != 0) {
    return Status::unsupported(name + ": each rank's M/W = " + std::to_string(a.m / world) + " rows must be a multiple of " +
                               std::to_string(kmn::kBlockM) + " (" + shape_text(a, g) +
                               "): the multi-node kernels never let a 128-row tile span two ranks' blocks");
  }
  if (a.n % 8 != 0 || a.k % 8 != 0) {
    return Status::unsupported(name + ": N and K must be multiples of 8 (16-byte rows for TMA); " + shape_text(a, g));
  }
  constexpr int64_t kLimit = int64_t{1} << 31;
  if (a.m >= kLimit || a.n >= kLimit || a.k >= kLimit) {
    return Status::unsupported(name + ": sizes of 2^31 or more are not supported (" + shape_text(a, g) + ")");
  }
  if (g.local > static_cast<uint32_t>(kmn::MnTunables::kMaxLocalWorld)) {
    return Status::unsupported(name + ": the multi-node kernels address at most " +
                               std::to_string(kmn::MnTunables::kMaxLocalWorld) + " GPUs per node (this node has " +
                               std::to_string(g.local) + ")");
  }
  if (options.algorithm == TpAlgorithm::kDecomposed) {
    return Status::unsupported(name + ": across nodes only the fused kernel exists (no decomposed path: loom's "
                               "collectives are single-node); use TpAlgorithm::kAuto or kFused");
  }
  if (options.tile != GemmTile::kAuto && options.tile != GemmTile::k128x256 && options.tile != GemmTile::k128x128) {
    return Status::unsupported(name + ": the multi-node kernels are built for the 128x256 and 128x128 tiles, not " +
                               std::string(gemm_tile_name(options.tile)));
  }
  if (options.comm_ctas >= impl.sm_count) {
    return Status::invalid_argument(name + ": comm_ctas = " + std::to_string(options.comm_ctas) +
                                    " leaves no compute CTA on a GPU of " + std::to_string(impl.sm_count) + " SMs");
  }
  return {};
}

// 128x256 where the GEMM heuristic picks it for the local shape, else 128x128 (the node's
// smallest SM count, so every rank decides alike).
inline GemmTile choose_tile(const Communicator::Impl& impl, OpId op, const TpGemmArgs& a, const TpGemmOptions& options) {
  if (options.tile != GemmTile::kAuto) return options.tile;
  const int sms = impl.topology.min_sm_count > 0 ? impl.topology.min_sm_count : impl.sm_count;
  const GemmTile t = choose_gemm_tile(a.m, a.n, a.k, sms);
  (void)op;
  return t == GemmTile::k128x256 ? GemmTile::k128x256 : GemmTile::k128x128;
}

inline kmn::MultiNodeRoleTable roles_for(OpId op, const kmn::Grid& g) {
  kmn::MultiNodeRoleTable r;
  r.set(kmn::MultiNodeRole::kNetSend, 1);
  const uint32_t peers = g.local - 1;
  if (g.local > 1 && op != OpId::kGemmRs) {
    r.set(kmn::MultiNodeRole::kNetRecv, std::min(peers, kmn::MnTunables::kMaxNetRecvCtas));
  }
  if (g.local > 1 && op == OpId::kAgGemm) r.set(kmn::MultiNodeRole::kNvlink, kmn::MnTunables::kNvlinkCtas);
  return r;
}

using tp::group_m_for;  // a raster group never spans two blocks

// The plan signature (tp::plan_signature) of what must agree between ranks; the world
// argument carries "MN", the node count and the GPUs per node, so it never equals a
// single-node plan's (whose world is at most TpTunables::kMaxLocalWorld).
inline uint32_t signature(OpId op, GemmTile tile, const kmn::Grid& g, std::initializer_list<int64_t> values) {
  const int world_code = static_cast<int>((0x4d4eu << 16) | ((static_cast<uint32_t>(g.nodes) & 0xFFu) << 8) |
                                          (static_cast<uint32_t>(g.local) & 0xFFu));
  return tp::plan_signature(op, tile, world_code, values);
}

inline std::string check_flags(const Communicator::Impl& impl, uint64_t flags) {
  const uint64_t capacity = impl.network->device_view().flag_count - impl.network->device_view().launch_flag_base;
  if (flags <= capacity) return {};
  return "it needs " + std::to_string(flags) + " network-window flags and the window holds " + std::to_string(capacity) +
         " (fewer, larger tiles or a smaller call would fit)";
}

// The multi-node operators' family: its launch state and its workspace, grown like the TP
// one (ops/launch/family_resources.h).
inline constexpr std::string_view kFamily = "multinode";

// Calls fn.template operator()<Cfg, kBF16, kBNMajor>() for the configuration of the call.
template <class Fn>
Status dispatch(GemmTile tile, DType dtype, BLayout layout, Fn&& fn) {
  return tp::dispatch_fused(tile, dtype, layout, std::forward<Fn>(fn));
}

// CUDA's lazy loading (its default) loads a kernel at its first launch, and doing so may wait for
// the work already running on the device while holding a lock that the proxy thread's copies
// need: a multi-node kernel in flight then waits for a proxy that waits for the loader, until
// the kernel's deadline (seen on one H200 with ranks sharing it: the first gemm_rs launched behind
// a running ag_gemm). So the first multi-node call of a process loads every multi-node kernel,
// while none of them runs (load_multinode_kernels, multinode_transfer.cu). Each launcher file
// loads the kernels it instantiates.
Status load_ag_gemm_kernels();
Status load_gemm_rs_kernels();
Status load_gemm_ar_kernels();
Status load_multinode_kernels();  // all of them, once per process and device

// Sets up (loads) kernel_of.template operator()<Cfg, kBF16, kBNMajor>() for every tile, dtype and
// B layout a multi-node call may dispatch to.
template <class KernelOf>
Status load_every_config(KernelOf&& kernel_of) {
  for (GemmTile tile : {GemmTile::k128x256, GemmTile::k128x128}) {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      for (BLayout layout : {BLayout::kKN, BLayout::kNK}) {
        LOOM_TRY(tp::dispatch_fused(tile, dtype, layout, [&]<class Cfg, bool kBF16, bool kBNMajor>() -> Status {
          return prepare_kernel(reinterpret_cast<const void*>(kernel_of.template operator()<Cfg, kBF16, kBNMajor>()),
                                Cfg::kSmemBytes);
        }));
      }
    }
  }
  return {};
}

inline GemmArgs gemm_args(const void* a, const void* b, void* d, int64_t m, const TpGemmArgs& args) {
  return tp::local_gemm(a, b, d, m, args);
}

// ---- gemm_rs / gemm_ar --------------------------------------------------------------------------

// Layout of a reduce call and where its buffers sit in the workspace.
struct ReducePlan {
  kmn::ReduceLayout layout;
  GemmTile tile = GemmTile::k128x128;
  size_t fold_bytes = 0;   // the fold source buffer, at workspace offset 0
  size_t send_offset = 0;  // the send buffer's offset in the workspace
  size_t workspace_bytes = 0;
};

inline ReducePlan plan_reduce(const Communicator::Impl& impl, OpId op, const TpGemmArgs& a, const TpGemmOptions& options) {
  ReducePlan r;
  r.tile = choose_tile(impl, op, a, options);
  const GemmTileInfo info = gemm_tile_info(r.tile);
  const kmn::Grid g = grid_of(impl);
  const uint64_t row_bytes = static_cast<uint64_t>(a.n) * dtype_size(a.dtype);
  r.layout.g = g;
  r.layout.rows_per_block = static_cast<uint32_t>(a.m / g.world());
  r.layout.n_blocks = static_cast<uint32_t>((a.n + info.block_n - 1) / info.block_n);
  r.layout.rows_per_chunk = kmn::rows_per_chunk_for(r.layout.rows_per_block, row_bytes, kmn::kTargetChunkBytes);
  r.layout.flag_base = impl.network->device_view().launch_flag_base;
  r.layout.all_reduce = op == OpId::kGemmAr ? 1u : 0u;
  r.fold_bytes = (static_cast<size_t>(r.layout.fold_rows()) * row_bytes + 1023) / 1024 * 1024;
  r.send_offset = r.fold_bytes;
  r.workspace_bytes = r.send_offset + static_cast<size_t>(r.layout.send_rows()) * row_bytes;
  return r;
}

inline Status check_reduce_buffers(Communicator::Impl& impl, OpId op, const TpGemmArgs& a) {
  const std::string name = op_text(op);
  const int64_t world = static_cast<int64_t>(impl.topology.world_size);
  const size_t e = dtype_size(a.dtype);
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.a, static_cast<size_t>(a.m * a.k) * e, "a ([M, K])"), name);
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.b, static_cast<size_t>(a.k * a.n) * e, "b"), name);
  const int64_t out_rows = op == OpId::kGemmAr ? a.m : a.m / world;
  if (op == OpId::kGemmAr) {
    LOOM_TRY(impl.symmetric_offset(a.out, static_cast<size_t>(a.m * a.n) * e, "gemm_ar: out ([M, N])").status());
  } else {
    LOOM_TRY_CTX(impl.check_local_device_buffer(a.out, static_cast<size_t>(out_rows * a.n) * e, "out ([M/W, N])"), name);
  }
  const ByteRange out = bytes_of(a.out, out_rows, a.n, e);
  if (out.overlaps(bytes_of(a.a, a.m, a.k, e))) return Status::invalid_argument(name + ": out overlaps a");
  if (out.overlaps(bytes_of(a.b, a.k, a.n, e))) return Status::invalid_argument(name + ": out overlaps b");
  return {};
}

inline Result<MultiNodePlan> plan_multinode_reduce(Communicator& comm, OpId op, const TpGemmArgs& a,
                                                   const TpGemmOptions& options) {
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY(check_call(impl, op, a, options));
  const ReducePlan r = plan_reduce(impl, op, a, options);
  const kmn::MultiNodeRoleTable roles = roles_for(op, r.layout.g);
  MultiNodePlan out;
  out.tile = r.tile;
  out.grid = impl.sm_count;
  out.net_send_ctas = static_cast<int>(roles.count(kmn::MultiNodeRole::kNetSend));
  out.net_recv_ctas = static_cast<int>(roles.count(kmn::MultiNodeRole::kNetRecv));
  out.nvlink_ctas = static_cast<int>(roles.count(kmn::MultiNodeRole::kNvlink));
  out.rows_per_chunk = r.layout.rows_per_chunk;
  out.flags = r.layout.flags();
  out.workspace_bytes = r.workspace_bytes;
  return out;
}

// Only the requested kernel is instantiated (a conditional expression would take both addresses).
template <bool kAllReduce, class Cfg, bool kBF16, bool kBNMajor>
auto reduce_kernel() {
  if constexpr (kAllReduce) {
    return &kmn::mn_gemm_ar_kernel<Cfg, kBF16, kBNMajor>;
  } else {
    return &kmn::mn_gemm_rs_kernel<Cfg, kBF16, kBNMajor>;
  }
}

// The multi-node gemm_rs (kAllReduce = false) or gemm_ar launch; each launcher file instantiates
// only its own kernels.
template <bool kAllReduce>
Status launch_reduce(Communicator& comm, const TpGemmArgs& a, cudaStream_t stream, const TpGemmOptions& options) {
  const OpId op = kAllReduce ? OpId::kGemmAr : OpId::kGemmRs;
  Communicator::Impl& impl = internal(comm);
  const std::string name = op_text(op);
  LOOM_TRY(check_call(impl, op, a, options));
  LOOM_TRY(load_multinode_kernels());
  const ReducePlan r = plan_reduce(impl, op, a, options);
  const kmn::ReduceLayout& layout = r.layout;
  const kmn::Grid g = layout.g;
  const kmn::MultiNodeRoleTable roles = roles_for(op, g);
  if (std::string why = check_flags(impl, layout.flags()); !why.empty()) {
    return Status::unsupported(name + ": " + shape_text(a, g) + ": " + why);
  }
  if (static_cast<uint32_t>(impl.sm_count) <= roles.rest_begin()) {
    return Status::unsupported(name + ": the GPU has too few SMs for the multi-node roles plus a compute CTA");
  }
  LOOM_TRY(check_reduce_buffers(impl, op, a));
  LOOM_ASSIGN_OR_RETURN(void* ws, family_workspace(impl, kFamily, r.workspace_bytes, stream, name.c_str()));
  const size_t e = dtype_size(a.dtype);
  const uint64_t row_bytes = static_cast<uint64_t>(a.n) * e;
  const GemmTileInfo info = gemm_tile_info(r.tile);
  char* fold = static_cast<char*>(ws);
  char* send = fold + r.send_offset;
  const uint64_t fold_offset = impl.heap->offset_of(fold);
  const bool all_reduce = op == OpId::kGemmAr;
  const uint64_t out_offset = all_reduce ? impl.heap->offset_of(a.out) : 0;

  kmn::MnReduceParams p{};
  LOOM_TRY(encode_gemm_operand_maps(gemm_args(a.a, a.b, a.out, a.m, a), r.tile, &p.a, &p.b));
  LOOM_TRY(encode_gemm_rows_map(fold, layout.fold_rows(), a.n, a.n, a.dtype, info.block_m, &p.fold_src));
  LOOM_TRY(encode_gemm_output_map(send, layout.send_rows(), a.n, a.n, a.dtype, &p.send));
  if (all_reduce) {
    for (uint32_t q = 0; q < g.local; ++q) {
      void* out_q = static_cast<char*>(impl.heap->peer_base(static_cast<int>(q))) + out_offset;
      LOOM_TRY(encode_gemm_output_map(out_q, a.m, a.n, a.n, a.dtype, &p.out[q]));
    }
  } else {
    LOOM_TRY(encode_gemm_output_map(a.out, layout.rows_per_block, a.n, a.n, a.dtype, &p.out[0]));
  }
  for (uint32_t q = 0; q < g.local; ++q) {
    if (q == g.me) continue;
    void* fold_q = static_cast<char*>(impl.heap->peer_base(static_cast<int>(q))) + fold_offset;
    LOOM_TRY(encode_gemm_output_map(fold_q, layout.fold_rows(), a.n, a.n, a.dtype, &p.stage_to[q]));
  }
  p.comm = impl.device_comm();
  LOOM_ASSIGN_OR_RETURN(p.state, family_launch_state(impl, kFamily));
  p.m = static_cast<uint32_t>(a.m);
  p.n = static_cast<uint32_t>(a.n);
  p.k = static_cast<uint32_t>(a.k);
  // Every block's rows cross the network chunk by chunk (sent once all of a chunk's tiles are
  // done, folded as its chunk arrives). Raster groups ramp up from one chunk to the GEMM's
  // L2-friendly height (raster_ramped): with 16-row groups from the start, the first chunk was
  // complete only after ~4 waves and the link idled meanwhile (h 0.58 at M = 8192, 2 emulated nodes
  // at 50 GB/s); one chunk per group throughout costs L2 reuse where the GEMM is the longer part.
  const uint32_t chunk_rows = layout.tile_rows_per_chunk();
  p.ramp_m = chunk_rows;
  p.group_m = std::max(chunk_rows, group_m_for(impl.sm_count, r.tile, layout.m_blocks_per_block()) / chunk_rows * chunk_rows);
  p.out_dtype = static_cast<uint32_t>(a.dtype);
  p.layout = layout;
  p.fold_offset = fold_offset;
  p.send_offset = impl.heap->offset_of(send);
  p.out_offset = out_offset;
  p.row_bytes = row_bytes;
  p.roles = roles;
  // Heap offsets are part of the plan: peers write into this rank's fold source (and gemm_ar's
  // out) by their own offsets. K_r may differ between ranks and is not included.
  p.signature = signature(op, r.tile, g,
                          {a.m, a.n, static_cast<int64_t>(a.dtype), static_cast<int64_t>(layout.rows_per_chunk),
                           static_cast<int64_t>(fold_offset), static_cast<int64_t>(out_offset)});
  // Zero rows (L > 1): the network sources of folds of other nodes' blocks. Stream-ordered
  // before the kernel; nobody else writes them (the workspace may have held other data before).
  if (g.local > 1) {
    LOOM_CUDA_TRY(cudaMemsetAsync(fold + static_cast<size_t>(layout.zero_row()) * row_bytes, 0, kmn::kBlockM * row_bytes, stream));
  }
  LOOM_DEBUG("%s multi-node %s: tile %s, %d CTAs (%u send, %u receive), %u rows per chunk, fold rows %u",
             name.c_str(), shape_text(a, g).c_str(), std::string(gemm_tile_name(r.tile)).c_str(), impl.sm_count,
             roles.count(kmn::MultiNodeRole::kNetSend), roles.count(kmn::MultiNodeRole::kNetRecv), layout.rows_per_chunk,
             layout.fold_rows());
  return dispatch(r.tile, a.dtype, a.b_layout, [&]<class Cfg, bool kBF16, bool kBNMajor>() -> Status {
    return launch_kernel(reduce_kernel<kAllReduce, Cfg, kBF16, kBNMajor>(), static_cast<unsigned>(impl.sm_count), Cfg::kThreads,
                         Cfg::kSmemBytes, stream, p);
  });
}

}  // namespace loom::ops::mn

namespace loom::ops {
// Defined in multinode_ag_gemm.cu.
Result<MultiNodePlan> plan_multinode_ag(Communicator& comm, const TpGemmArgs& args, const TpGemmOptions& options);
}  // namespace loom::ops
