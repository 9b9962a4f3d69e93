// An operator family's resources on a communicator (Communicator::Impl::family): the launch state
// its kernels' entry handshake uses, and its symmetric workspace. Each family names itself once
// (ops/tp/tp_common.h kFamily = "tp", ops/tp/multinode/multinode.h kFamily = "multinode", ...) and asks here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string_view>

#include "loom/status.h"
#include "runtime/communicator_impl.h"

namespace loom::ops {

// The family's launch state (device memory, zero at creation).
Result<LaunchState*> family_launch_state(Communicator::Impl& impl, std::string_view family);

// The family's symmetric workspace, at least `bytes` long: grown when a call needs more than it
// has, without any host round trip (an operator call never waits for the other ranks on the host,
// so a rank that never arrives shows up as a device-side timeout naming it). Every rank computes
// the same size from the same shape at the same call, and the heap allocator hands out equal
// offsets to equal sequences of calls, so the new workspace lands at the same offset everywhere;
// the fused kernels put that offset in their entry signature, so a rank whose heap diverged fails
// the launch with a mismatch instead of writing into the wrong place. Only this GPU's queued work
// can still use the old workspace (peers write into it only inside launches this GPU also runs,
// and each of those waits for all of their writes before it ends), hence the wait for the work
// noted by note_queued_work (polled, so the proxy keeps serving queued kernels). Growing cannot
// happen during CUDA graph capture, nor after a capture that used the workspace (the graph holds
// its address): run the largest shape once before capturing. `op` names the call in messages.
Result<void*> family_workspace(Communicator::Impl& impl, std::string_view family, size_t bytes, cudaStream_t stream,
                               const char* op);

}  // namespace loom::ops
