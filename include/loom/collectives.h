// loom's own NVLink collectives: persistent copy kernels over the symmetric heap.
//
// Within one node (one NVLink domain) for any number of local ranks; bf16, fp16, fp32. Sums
// are computed in fp32 in rank order and rounded once, so every rank gets bit-identical
// results. Buffer rules (checked, invalid_argument otherwise):
//   all_gather      recv symmetric (world * count elements); send any device memory of this GPU
//   reduce_scatter  send symmetric (world * count elements); recv any device memory of this GPU
//   all_reduce      send and recv symmetric (count elements); send == recv allowed
// Launches are asynchronous on `stream`; errors inside the kernel surface through
// Communicator::synchronize().
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "loom/communicator.h"
#include "loom/status.h"
#include "loom/types.h"

namespace loom {

enum class CopyEngineChoice : uint8_t {
  kAuto,    // planner's choice
  kVector,  // all threads, 16-byte loads/stores
  kBulk,    // one thread per CTA drives the TMA bulk-copy engine (all_gather only)
};

struct CollectiveOptions {
  int num_ctas = 0;  // 0: planner (LOOM_COLL_CTAS overrides it)
  CopyEngineChoice engine = CopyEngineChoice::kAuto;
};

Status all_gather(Communicator& comm, const void* send, void* recv, size_t count, DType dtype,
                  cudaStream_t stream, const CollectiveOptions& options = {});
Status reduce_scatter(Communicator& comm, const void* send, void* recv, size_t recv_count, DType dtype,
                      cudaStream_t stream, const CollectiveOptions& options = {});
Status all_reduce(Communicator& comm, const void* send, void* recv, size_t count, DType dtype,
                  cudaStream_t stream, const CollectiveOptions& options = {});

// ---- plan and workspace, before a call (e.g. before CUDA-graph capture) ------------------------
enum class CollectiveOp : uint8_t { kAllGather, kReduceScatter, kAllReduce };

// What a call launches.
struct CollectivePlanInfo {
  int num_ctas = 0;          // 0: no kernel (count 0, or one rank)
  bool device_copy = false;  // one rank, send != recv: a device copy instead of a kernel
  CopyEngineChoice engine = CopyEngineChoice::kVector;  // resolved: kVector or kBulk
};
// Every check the call makes (the buffers included; `count` as the call takes it: recv_count for
// reduce_scatter) and its plan, without launching anything.
Result<CollectivePlanInfo> collective_plan(Communicator& comm, CollectiveOp op, const void* send, const void* recv,
                                           size_t count, DType dtype, const CollectiveOptions& options = {});
Status collective_can_implement(Communicator& comm, CollectiveOp op, const void* send, const void* recv, size_t count,
                                DType dtype, const CollectiveOptions& options = {});
// Scratch memory a call needs: none (the data moves between the callers' buffers; the arrival
// flags live in the communicator's control region).
constexpr size_t collective_workspace_bytes(CollectiveOp, size_t, DType) { return 0; }

}  // namespace loom
