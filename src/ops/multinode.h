// The multi-node operators (jobs of N > 1 real or emulated nodes x L GPUs per node): what
// loom::ag_gemm / gemm_rs / gemm_ar run when the communicator spans several nodes, and the raw
// network exchange the benchmark and the tests use. Kernels: src/kernels/tp/multinode_*.cuh.
//
// Semantics are the public ones (loom/tensor_parallel.h) with W = world size = N x L: rank (n, l)
// owns row block d = n L + l (with the usual launchers RANK = n L + l, so block d is rank d's).
//   ag_gemm  a [M/W, K] = block d of the gathered A; out [M, N]; gathered_a optional symmetric [M, K]
//   gemm_rs  a [M, K_r]; out [M/W, N] = block d of the reduced result
//   gemm_ar  a [M, K_r]; out [M, N] symmetric
// Rules (a Status before anything is launched or written; messages name the operator and the rule):
//   invalid_argument  null or not 16-byte aligned a / b / out / gathered_a; buffers not device
//                     memory of this GPU or too small; gemm_ar's out or ag_gemm's gathered_a not
//                     symmetric; overlapping buffers; M not a multiple of W; comm_ctas that leave
//                     no compute CTA
//   unsupported       fp32; M / W not a multiple of 128 (a tile row never spans two blocks); N or K
//                     not a multiple of 8 or not positive, or 2^31 or more; L > 8; the decomposed
//                     algorithm (there is no decomposed path across nodes); a forced tile other
//                     than 128x256 / 128x128; a call whose flags exceed the network window
// The role split is fixed: one network-send CTA, with L > 1 up to four network-receive CTAs
// (ag_gemm, gemm_ar) and two NVLink CTAs (ag_gemm); TpGemmOptions::comm_ctas is only checked.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "loom/communicator.h"
#include "loom/status.h"
#include "loom/tensor_parallel.h"
#include "runtime/device_abi.h"

namespace loom::ops {

Status ag_gemm_multinode(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options);
Status gemm_rs_multinode(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options);
Status gemm_ar_multinode(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options);

// What a multi-node operator call runs (for the benchmark and tests; the same rules as the call).
struct MultiNodePlan {
  GemmTile tile = GemmTile::k128x128;
  int grid = 0;                 // persistent CTAs (the SM count)
  int net_send_ctas = 0;
  int net_recv_ctas = 0;
  int nvlink_ctas = 0;
  uint32_t rows_per_chunk = 0;  // rows per network chunk (one command and flag each)
  uint32_t flags = 0;           // network-window words per launch
  size_t workspace_bytes = 0;   // multi-node workspace the call needs
};
Result<MultiNodePlan> plan_multinode(Communicator& comm, OpId op, const TpGemmArgs& args, const TpGemmOptions& options);

// Raw network exchange through the proxy (one small persistent kernel): every rank writes
// `bytes` from its symmetric `src` to the same-index GPU of every other node, into that rank's
// symmetric `dst`, which holds (N - 1) slots of `bytes`: slot (s - n - 1) mod N receives node s's
// bytes. Chunks of `chunk_bytes` (0: 1 MiB), one command and one flag each; the launch ends when
// this rank has received every chunk. The loom-bench multinode baseline ("the same shaped
// transfer") and the GPU tests use it. Same rules as the operators where they apply
// (invalid_argument for non-symmetric buffers, unsupported on one node).
Status net_exchange(Communicator& comm, const void* src, void* dst, size_t bytes, cudaStream_t stream,
                    size_t chunk_bytes = 0);

}  // namespace loom::ops
