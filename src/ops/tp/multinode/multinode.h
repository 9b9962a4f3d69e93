// The multi-node operators on the host (jobs of N > 1 real or emulated nodes x L GPUs per node):
// what loom::ag_gemm / gemm_rs / gemm_ar run when the communicator spans several nodes
// (operators in ops/tp/tp_operator.h), and the raw network exchange the benchmark and the tests
// use. Kernels: src/kernels/tp/multinode/; plan and rules: planner/multinode_plan.h.
//
// Semantics are the public ones (loom/tensor_parallel.h) with W = world size = N x L: rank (n, l)
// owns row block d = n L + l (with the usual launchers RANK = n L + l, so block d is rank d's).
//   ag_gemm  a [M/W, K] = block d of the gathered A; out [M, N]; gathered_a optional symmetric [M, K]
//   gemm_rs  a [M, K_r]; out [M/W, N] = block d of the reduced result
//   gemm_ar  a [M, K_r]; out [M, N] symmetric
// Rules beyond the planner's (a Status before anything is launched or written): invalid_argument
// for null or not 16-byte aligned a / b / out / gathered_a, buffers not device memory of this GPU
// or too small, gemm_ar's out or ag_gemm's gathered_a not symmetric, overlapping buffers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "kernels/tp/multinode/layout.h"
#include "loom/communicator.h"
#include "loom/status.h"
#include "loom/tensor_parallel.h"
#include "ops/tp/tp_operator.h"
#include "planner/multinode_plan.h"
#include "runtime/device_abi.h"

namespace loom::ops {

// Raw network exchange through the proxy (one small persistent kernel): every rank writes
// `bytes` from its symmetric `src` to the same-index GPU of every other node, into that rank's
// symmetric `dst`, which holds (N - 1) slots of `bytes`: slot (s - n - 1) mod N receives node s's
// bytes. Chunks of `chunk_bytes` (0: 1 MiB), one command and one flag each; the launch ends when
// this rank has received every chunk. The loom-bench multinode baseline ("the same shaped
// transfer") and the GPU tests use it. invalid_argument for non-symmetric buffers, unsupported on
// one node.
Status net_exchange(Communicator& comm, const void* src, void* dst, size_t bytes, cudaStream_t stream,
                    size_t chunk_bytes = 0);

}  // namespace loom::ops

namespace loom::ops::tp::multinode {

// The multi-node operators' family: its launch state and workspace (family_resources.h).
inline constexpr std::string_view kFamily = "multinode";

// The job's grid of ranks as the kernels see it.
kernels::tp::multinode::Grid grid_of(const Communicator::Impl& impl);

// The plan of a call (the benchmark reports it): the communicator's and the pointers' checks,
// then planner::plan_multinode.
Result<planner::MultiNodePlan> plan(Communicator::Impl& impl, OpId op, const TpGemmArgs& args, const TpGemmOptions& options);
// The same as the operators' TpCall (TpPlanInfo for tp_plan()).
Result<TpCall> plan_call(Communicator::Impl& impl, OpId op, const TpGemmArgs& args, const TpGemmOptions& options);

// The plan signature (tp_common.h plan_signature) of what must agree between ranks; the world
// argument carries "MN", the node count and the GPUs per node, so it never equals a single-node
// plan's (whose world is at most TpTunables::kMaxLocalWorld).
uint32_t signature(OpId op, GemmTile tile, const kernels::tp::multinode::Grid& g, std::initializer_list<int64_t> values);

// CUDA's lazy loading (its default) loads a kernel at its first launch, and doing so may wait for
// the work already running on the device while holding a lock that the proxy thread's copies
// need: a multi-node kernel in flight then waits for a proxy that waits for the loader, until
// the kernel's deadline (seen on one H200 with ranks sharing it: the first gemm_rs launched behind
// a running ag_gemm). So the first multi-node call of a process loads every multi-node kernel,
// while none of them runs (load_kernels, once per process and device; transfer.cu). Each
// launcher file loads the kernels it instantiates.
Status load_kernels();
Status load_ag_gemm_kernels();  // ag_gemm.cu

}  // namespace loom::ops::tp::multinode
