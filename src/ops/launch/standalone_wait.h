// The bounded-wait plumbing of loom's standalone operators (gemm, attention, attention_merge):
// they have no communicator, so their kernels report into one host-mapped error record per device,
// which the next standalone call on that device (or synchronize_standalone) turns into a Status.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "loom/status.h"
#include "runtime/device_abi.h"

namespace loom::ops {

struct StandaloneWait {
  uint32_t* device_abort = nullptr;  // device memory
  ErrorRecord* error = nullptr;      // host-mapped
  uint64_t timeout_ns = 0;           // LOOM_TIMEOUT_MS

  WaitParams params() const {
    WaitParams p{};
    p.timeout_ns = timeout_ns;
    p.host_abort = nullptr;
    p.device_abort = device_abort;
    p.error = error;
    return p;
  }
};

// The current device's record (created on first use).
Result<StandaloneWait*> standalone_wait();

// A failure an earlier launch on this device recorded, as a Status (then cleared; the device
// abort word is reset on `stream`): bad device-resident input (kInvalidInput) is invalid_argument,
// anything else internal (a loom bug: standalone kernels wait on nothing outside their CTAs).
Status take_standalone_error(StandaloneWait& w, cudaStream_t stream);

// A launch-wide work queue for a standalone kernel whose CTAs claim tiles with an atomic counter
// (LaunchState: tile_queue, ctas_done; the last CTA of a launch resets both, kernels/comm/epoch.cuh
// leave_queue). One per (device, stream), from a pool allocated and zeroed at the device's first call:
// launches on one stream run in order, so each starts from 0, and no call after the first
// allocates (a first call on a new stream can be captured in a CUDA graph). Graph replays of one
// queue must not run concurrently. After a failed launch take_standalone_error() resets every
// queue of the device.
Result<LaunchState*> standalone_queue(cudaStream_t stream);

// Polls `stream` until its work is done or `timeout_ns` passed (Status::timeout naming `what`).
Status wait_stream_bounded(cudaStream_t stream, uint64_t timeout_ns, const char* what);

}  // namespace loom::ops
