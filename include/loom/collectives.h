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

}  // namespace loom
