// The skeleton of every persistent loom kernel, written once:
//
//   const frame::LaunchFrame f = frame::LaunchFrame::enter(c, OpId::kX, words, signature);
//   ... roles, from the family's RoleTable (kernels/frame/role_table.h); a data role runs
//       through run_data_role() and then joins the compute role ...
//   f.finish(state, c);
//
// begin()/enter(): the launch's epoch (read on the device, so CUDA-graph replays advance it
// without host work), the wait context every bounded wait of the launch uses (deadline, abort
// words, error record), and with enter() this rank's entry word published to every local peer
// (kernels/comm/entry.cuh). finish(): every CTA — also one that failed — counts itself out; the
// last CTA resets the family's tile queue (LaunchState) and advances the epoch. Data only moves
// by push and every write into a rank is followed by a flag that rank waits for before its
// launch ends, so no exit handshake is needed.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/entry.cuh"
#include "kernels/comm/epoch.cuh"
#include "kernels/comm/wait.cuh"
#include "runtime/device_abi.h"

namespace loom::kernels::frame {

struct LaunchFrame {
  uint64_t epoch;
  WaitContext ctx;
  bool marks;  // progress marks (LaunchPhase) kept: kernels whose grid covers the GPU's SMs

  // A kernel without an entry handshake of its own or one that runs its own (the collectives:
  // cta_enter_all), and keeps no progress marks.
  __device__ static LaunchFrame begin(const DeviceComm& c, OpId op) {
    LaunchFrame f;
    f.epoch = launch_epoch(c.epoch_state);
    f.ctx = WaitContext::start(c.wait, op, f.epoch);
    f.marks = false;
    return f;
  }
  // A fused kernel (one CTA per SM): entry published, progress marked from kEntered to
  // kFinished (the host's timeout diagnosis reads the marks).
  __device__ static LaunchFrame enter(const DeviceComm& c, OpId op, EntryWords words, uint32_t signature) {
    LaunchFrame f = begin(c, op);
    f.marks = true;
    publish_entry(c, words, f.epoch, signature);
    f.mark(LaunchPhase::kEntered);
    return f;
  }

  // Progress mark of this CTA (thread 0 stores it, a posted write to host memory).
  __device__ void mark(LaunchPhase phase) const {
    if (marks && threadIdx.x == 0) ctx.mark(phase);
  }

  // All threads, after all of the CTA's work, for a kernel whose CTAs take work from the
  // family's launch-wide queue.
  __device__ void finish(LaunchState* state, const DeviceComm& c) const {
    __syncthreads();
    if (threadIdx.x == 0) {
      finish_queued_launch(state, c.epoch_state, epoch);
      mark(LaunchPhase::kFinished);
    }
  }
  // The same for a kernel without a queue (the collectives).
  __device__ void finish(const DeviceComm& c) const {
    __syncthreads();
    if (threadIdx.x == 0) finish_launch(c.epoch_state, epoch);
  }
};

// The 1024-byte aligned base of the dynamic shared memory (TMA swizzled boxes need it), as the
// GEMM engine's compute role aligns it.
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
}

// A data role of one CTA: all threads call it, thread 0 runs `work(stream)` with a bulk-copy
// stream (kernels/comm/bulk_copy.cuh) in the first kFreeBytes of the aligned shared memory — the
// compute role's stage buffers, free until the CTA joins the compute role — and every thread
// gets work's answer. Afterwards the area is the compute role's again: the barriers are
// invalidated and thread 0's generic writes are fenced against the compute role's TMA loads.
template <class Stream, uint32_t kFreeBytes, class Work>
__device__ bool run_data_role(uint8_t* smem_raw, Work&& work) {
  static_assert(Stream::kSmemBytes + 16 <= kFreeBytes,
                "the bulk-copy stream's ring must fit in the compute role's stage buffers, which are free until it runs");
  uint8_t* base = aligned_smem(smem_raw);
  volatile int* ok_word = reinterpret_cast<volatile int*>(base + Stream::kSmemBytes);
  if (threadIdx.x == 0) {
    Stream stream(base);
    stream.init();
    const bool ok = work(stream);
    stream.invalidate();
    *ok_word = ok ? 1 : 0;
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  }
  __syncthreads();
  const bool ok = *ok_word != 0;
  __syncthreads();  // the compute role's loads may overwrite the word next
  return ok;
}

}  // namespace loom::kernels::frame
