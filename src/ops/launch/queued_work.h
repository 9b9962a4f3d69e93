// The last step of every public operator call: a call that queued work on `stream` says so to the
// communicator (Communicator::Impl::note_queued_work), whose workspace growth and teardown wait
// for that work without a device-wide synchronize.
#pragma once

#include <cuda_runtime_api.h>

#include "loom/communicator.h"
#include "loom/status.h"
#include "runtime/communicator_impl.h"

namespace loom::ops {

inline Status noted(Communicator& comm, const Status& queued, cudaStream_t stream) {
  if (!queued.ok()) return queued;
  return internal(comm).note_queued_work(stream);
}

}  // namespace loom::ops
