// What the MoE family's host launchers share (ops/moe/moe.cu, ops/moe/dispatch_gemm.cu): the
// checks of pointers and plans, the frame fields of a launch and the dispatch's parameters.
//
// Rules (invalid_argument, before anything is launched or written): a failed communicator
// (aborted); pointers that are not device memory of this GPU or not aligned as each call says; a
// symmetric buffer that is not inside one symmetric allocation; an output overlapping an input; a
// MoePlan that does not match its config.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "kernels/moe/combine.cuh"
#include "kernels/moe/dispatch.cuh"
#include "loom/moe.h"
#include "ops/launch/family_resources.h"
#include "planner/moe_plan.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"

namespace loom::ops::moe {

namespace km = kernels::moe;

// The MoE family's launch state and workspace (ops/launch/family_resources.h).
inline constexpr std::string_view kFamily = "moe";

inline std::string num(int64_t v) { return std::to_string(v); }

inline Result<planner::MoeLayouts> layouts_for(const Communicator::Impl& impl, const MoeConfig& config) {
  planner::MoeRequest r;
  r.config = config;
  r.world = impl.topology.world_size;
  r.num_nodes = impl.topology.num_nodes;
  return planner::plan_moe(r);
}

inline bool aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

// A device buffer of this GPU, `bytes` long (skipped when 0), aligned to `align`.
inline Status check_device(const Communicator::Impl& impl, const void* p, size_t bytes, uintptr_t align, const char* what) {
  if (bytes == 0) return {};
  LOOM_TRY(impl.check_local_device_buffer(p, bytes, what));
  if (!aligned(p, align)) return Status::invalid_argument(std::string(what) + " is not " + num(align) + "-byte aligned");
  return {};
}

// A symmetric buffer of `bytes`, 16-byte aligned: its heap offset.
inline Result<uint64_t> check_symmetric(const Communicator::Impl& impl, const void* p, size_t bytes, const char* what) {
  LOOM_ASSIGN_OR_RETURN(uint64_t offset, impl.symmetric_offset(p, bytes, what));
  if (offset % 16 != 0) return Status::invalid_argument(std::string(what) + " is not 16-byte aligned");
  return offset;
}

struct Range {
  const void* p;
  size_t bytes;
  const char* what;
  bool output;  // the kernel writes it
};
// invalid_argument when a range the kernel writes overlaps any other range.
inline Status check_disjoint(std::initializer_list<Range> ranges) {
  for (auto a = ranges.begin(); a != ranges.end(); ++a) {
    for (auto b = a + 1; b != ranges.end(); ++b) {
      if (!a->output && !b->output) continue;
      const uintptr_t alo = reinterpret_cast<uintptr_t>(a->p), blo = reinterpret_cast<uintptr_t>(b->p);
      if (a->bytes != 0 && b->bytes != 0 && alo < blo + b->bytes && blo < alo + a->bytes) {
        return Status::invalid_argument(std::string(a->output ? a->what : b->what) + " overlaps " +
                                        (a->output ? b->what : a->what));
      }
    }
  }
  return {};
}

// The frame fields every MoE launch has (communicator, launch state, workspace), the workspace's
// [begin, end) zeroed on `stream` first (before the kernel queued next).
template <class Params>
Status prepare_launch(Communicator::Impl& impl, const km::WorkspaceLayout& l, uint64_t begin, uint64_t end,
                      cudaStream_t stream, const char* op, Params& p) {
  LOOM_ASSIGN_OR_RETURN(void* ws, ops::family_workspace(impl, kFamily, static_cast<size_t>(l.bytes), stream, op));
  if (end > begin) LOOM_CUDA_TRY(cudaMemsetAsync(static_cast<char*>(ws) + begin, 0, static_cast<size_t>(end - begin), stream));
  p.comm = impl.device_comm();
  LOOM_ASSIGN_OR_RETURN(p.state, ops::family_launch_state(impl, kFamily));
  p.ws = {impl.heap->offset_of(ws), l};
  return {};
}

// CUDA's lazy loading (its default) loads a kernel at its first launch, and doing so may wait for
// the work already running on the device while holding a lock the proxy thread's copies need: an
// MoE kernel waiting for another node (through the proxy) then waits for a loader that waits for
// it, until its deadline (ops/tp/multinode/multinode.h tells the same of the TP kernels). So on a
// job of several nodes every MoE call first loads every kernel of the family, once per process
// and device, while none of them runs: routing, dispatch and combine (load_moe_comm_kernels,
// moe.cu), moe_dispatch_gemm's and moe_layer's variants and the grouped GEMM's plan and tile kernels (which run
// between the communication calls). load_moe_kernels is in dispatch_gemm.cu.
Status load_moe_comm_kernels();
Status load_moe_kernels();
// load_moe_kernels when the job spans several nodes.
inline Status load_for_nodes(const planner::MoeLayouts& l) { return l.num_nodes > 1 ? load_moe_kernels() : Status{}; }

// Across nodes, moe_combine sums on each node the token entries that the dispatch of its plan left
// in the workspace there (the slots, weights and window positions of the other nodes' tokens): the
// host notes which plan the last dispatch staged (OperatorFamily::staged; every rank makes the
// same calls, so every rank notes the same), and combine refuses a plan that is not that one
// before anything is launched. (The kernels check it too, against the routing epoch the
// forwarders' dispatch recorded: a CUDA graph replays no host code.)
inline Status note_staged(Communicator::Impl& impl, const MoePlan& plan) {
  LOOM_ASSIGN_OR_RETURN(Communicator::Impl::OperatorFamily * family, impl.family(kFamily));
  family->staged = plan.handle;
  return {};
}
inline Status check_staged(Communicator::Impl& impl, const MoePlan& plan, const planner::MoeLayouts& l, const char* op) {
  if (l.num_nodes == 1) return {};
  LOOM_ASSIGN_OR_RETURN(Communicator::Impl::OperatorFamily * family, impl.family(kFamily));
  if (plan.handle != 0 && family->staged == plan.handle) return {};
  return Status::invalid_argument(std::string(op) +
                                  ": across nodes, combine sums on each node the tokens that its plan's dispatch left "
                                  "there; call moe_dispatch or moe_dispatch_gemm with this MoePlan first, with no other "
                                  "MoE dispatch (and no larger MoE config) in between");
}

// The network flag window's first per-launch word (0 on one node).
inline uint32_t net_flag_base(const Communicator::Impl& impl) { return impl.device_comm().net.launch_flag_base; }

// The plan's per-token node masks (several nodes), or null.
inline const uint64_t* token_nodes(const void* plan, const planner::MoeLayouts& l) {
  return l.num_nodes > 1 ? reinterpret_cast<const uint64_t*>(static_cast<const char*>(plan) + l.plan.token_nodes) : nullptr;
}

// The job's shape (nodes, ranks per node), one value of every MoE launch's signature.
inline int64_t job_shape(const Communicator::Impl& impl) {
  return static_cast<int64_t>(impl.topology.num_nodes) << 16 | impl.topology.local_world_size;
}

// The routing's regions of a plan buffer, as dispatch and combine read them.
inline km::PlanView plan_view(const void* plan, const km::PlanLayout& l) {
  const char* base = static_cast<const char*>(plan);
  return {reinterpret_cast<const km::MoeStatusWords*>(base + l.status), reinterpret_cast<const int32_t*>(base + l.slot_dest),
          reinterpret_cast<const float*>(base + l.slot_weight)};
}

// The checks every call on a MoePlan makes: usable communicator, its config, the handle.
inline Result<planner::MoeLayouts> check_plan(Communicator::Impl& impl, const MoePlan& plan, const char* op) {
  LOOM_TRY(impl.check_usable());
  Result<planner::MoeLayouts> l = layouts_for(impl, plan.config);
  if (!l.ok()) return std::move(l).take_status().with_context(op);
  if (plan.plan == nullptr) return Status::invalid_argument(std::string(op) + ": the MoePlan holds no plan buffer (use the one moe_routing returned)");
  if (plan.capacity != l->capacity || plan.num_tokens < 0 || plan.num_tokens > plan.config.max_tokens) {
    return Status::invalid_argument(std::string(op) + ": the MoePlan does not match its config (use the one moe_routing returned)");
  }
  return l;
}

// Bytes of x ([T, H]) and of recv_x ([C, H]).
inline size_t token_bytes(const MoePlan& plan, const planner::MoeLayouts& l) {
  return static_cast<size_t>(plan.num_tokens) * static_cast<size_t>(l.row_bytes);
}
inline size_t receive_bytes(const planner::MoeLayouts& l) {
  return static_cast<size_t>(l.capacity) * static_cast<size_t>(l.row_bytes);
}

// The checks moe_dispatch and moe_dispatch_gemm make on x ([T, H], this GPU) and recv_x
// ([C, H], symmetric), and recv_x's heap offset.
inline Result<uint64_t> check_dispatch_buffers(const Communicator::Impl& impl, const MoePlan& plan,
                                               const planner::MoeLayouts& l, const void* x, void* recv_x, const char* op) {
  const size_t x_bytes = token_bytes(plan, l);
  const size_t recv_bytes = receive_bytes(l);
  if (plan.num_tokens > 0 && x == nullptr) return Status::invalid_argument(std::string(op) + ": x is null");
  LOOM_TRY_CTX(check_device(impl, x, x_bytes, 16, "x ([T, H])"), op);
  LOOM_ASSIGN_OR_RETURN(const uint64_t recv_offset,
                        check_symmetric(impl, recv_x, recv_bytes, (std::string(op) + ": recv_x ([capacity, H], symmetric)").c_str()));
  LOOM_TRY_CTX(check_disjoint({{recv_x, recv_bytes, "recv_x", true},
                              {x, x_bytes, "x", false},
                              {plan.plan, static_cast<size_t>(l.plan.bytes), "the plan", false}}),
               op);
  return recv_offset;
}

// The dispatch fields of a launch whose frame fields prepare_launch filled; `op` names the
// kernel in the signature (every rank must agree on the values in it).
inline void fill_dispatch(const Communicator::Impl& impl, const MoePlan& plan, const planner::MoeLayouts& l,
                          const void* x, uint64_t recv_offset, OpId op, km::DispatchParams& p) {
  p.plan = plan_view(plan.plan, l.plan);
  p.token_nodes = token_nodes(plan.plan, l);
  p.x = static_cast<const char*>(x);
  p.recv_offset = recv_offset;
  p.row_bytes = l.row_bytes;
  p.num_tokens = static_cast<uint32_t>(plan.num_tokens);
  p.top_k = static_cast<uint32_t>(plan.config.top_k);
  p.capacity = static_cast<uint32_t>(l.capacity);
  p.max_tokens = static_cast<uint32_t>(plan.config.max_tokens);
  p.num_experts = static_cast<uint32_t>(plan.config.num_experts);
  p.net_flag_base = net_flag_base(impl);
  p.signature = planner::moe_signature(op, {plan.config.num_experts, plan.config.top_k, l.capacity,
                                            static_cast<int64_t>(l.row_bytes), plan.config.max_tokens, job_shape(impl),
                                            static_cast<int64_t>(p.ws.offset), static_cast<int64_t>(recv_offset)});
}

// The combine fields of a launch whose frame fields prepare_launch filled (moe_combine; moe_layer
// copies them from its dispatch): the expert outputs at heap offset `y_offset`, rows of
// `row_bytes`, into `out`, weighted by `weights`; the signature is the caller's.
inline void fill_combine(const Communicator::Impl& impl, const MoePlan& plan, const planner::MoeLayouts& l,
                         const float* weights, uint64_t y_offset, uint64_t row_bytes, void* out, km::CombineParams& p) {
  p.plan = plan_view(plan.plan, l.plan);
  p.token_nodes = token_nodes(plan.plan, l);
  p.weights = weights != nullptr ? weights : p.plan.slot_weight;
  p.y_offset = y_offset;
  p.row_bytes = row_bytes;
  p.out = static_cast<char*>(out);
  p.addend = nullptr;
  p.num_tokens = static_cast<uint32_t>(plan.num_tokens);
  p.top_k = static_cast<uint32_t>(plan.config.top_k);
  p.capacity = static_cast<uint32_t>(l.capacity);
  p.max_tokens = static_cast<uint32_t>(plan.config.max_tokens);
  p.num_experts = static_cast<uint32_t>(plan.config.num_experts);
  p.net_flag_base = net_flag_base(impl);
}

}  // namespace loom::ops::moe
