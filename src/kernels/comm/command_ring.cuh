// GPU producer of the command ring (layout and state machine: runtime/command_ring.h).
//
// One thread pushes one command: it claims a ticket with an atomic on the device-memory head,
// waits for space only when the ring looks full (first against a device-memory copy of the
// tail, then against the host tail through the one bounded wait, wait_flag), writes the body
// into the host-pinned slot and publishes the header with a release store at system scope, so
// the proxy thread that acquires the header sees the whole body.
//
// The ring-space wait is wait_flag itself: "tail + capacity > ticket" is "the tail flag reached
// ticket + 1 - capacity" in serial-number terms, so a stalled proxy ends in the same error record
// (op, epoch, kind ring space, ring index, tail observed) as a missing peer flag, and the host
// reports it as a timeout.
#pragma once

#include <cstdint>

#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "runtime/command_ring.h"
#include "runtime/device_abi.h"

namespace loom::kernels {

// The device side of ring::produce(): PTX atomics and fences on the GPU.
struct GpuRingSide {
  const WaitContext* ctx;

  __device__ uint64_t claim(uint64_t* head) {
    return atomicAdd(reinterpret_cast<unsigned long long*>(head), 1ull);
  }
  // Acquire at GPU scope: another producer of this GPU raised the cache with release after it
  // acquired the host tail, so seeing its value also orders the proxy's reads of the old slot
  // before our stores (causality is transitive across the two scopes).
  __device__ uint64_t load_tail_cache(uint64_t* cache) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(cache) : "memory");
    return v;
  }
  __device__ bool wait_for_tail(uint64_t* tail, uint64_t target, uint32_t ring_index, uint64_t* seen) {
    // The proxy is this rank's own thread, not a peer: waited_on = -1, index = ring index.
    if (!wait_flag(tail, target, *ctx, /*waited_on=*/-1, ring::kRingSpaceFlagKind, ring_index)) {
      return false;
    }
    *seen = flag_load_acquire(tail);
    return true;
  }
  __device__ void raise_tail_cache(uint64_t* cache, uint64_t tail) {
    asm volatile("red.release.gpu.global.max.u64 [%0], %1;" ::"l"(cache), "l"(tail) : "memory");
  }
  __device__ void store_body(ring::Command* slot, const ring::Command& command) {
    // Words 1..7 as plain stores (one 8-byte and three 16-byte stores into the pinned line); the
    // release store of the header below orders them all before it.
    uint64_t* dst = reinterpret_cast<uint64_t*>(slot);
    const uint64_t* src = reinterpret_cast<const uint64_t*>(&command);
    dst[1] = src[1];
    reinterpret_cast<ulonglong2*>(dst)[1] = make_ulonglong2(src[2], src[3]);
    reinterpret_cast<ulonglong2*>(dst)[2] = make_ulonglong2(src[4], src[5]);
    reinterpret_cast<ulonglong2*>(dst)[3] = make_ulonglong2(src[6], src[7]);
  }
  __device__ void publish(uint64_t* header, uint64_t value) { flag_store_release(header, value); }
};

// Pushes one command from the calling thread. The command's type goes in header's low byte
// (ring::type_only_header); the sequence is filled in here. Returns false when the ring stayed
// full past the deadline or the launch was aborted: the error record is written, the device abort
// raised, and the caller should leave the kernel like after any failed wait.
__device__ __forceinline__ bool ring_push(const ring::RingView& ring, const ring::Command& command,
                                          const WaitContext& ctx) {
  GpuRingSide side{&ctx};
  return ring::produce(side, ring, command);
}

// A command of `type` from this CTA for flag `flag_index` of rank dst_rank; the data fields (zero
// here) are the caller's to fill in.
__device__ __forceinline__ ring::Command ring_command(ring::CommandType type, uint32_t dst_rank, uint32_t flag_index,
                                                      uint64_t flag_value, const WaitContext& ctx) {
  ring::Command c{};
  c.header = ring::type_only_header(type);
  c.dst_rank = dst_rank;
  c.flag_index = flag_index;
  c.epoch = ctx.epoch;
  c.flag_value = flag_value;
  c.producer = blockIdx.x;
  return c;
}

// Convenience: a kWrite (data, then the flag when flag_index != kNoFlag) from the calling thread.
__device__ __forceinline__ bool ring_push_write(const ring::RingView& ring, uint32_t dst_rank, uint64_t src_offset,
                                                uint64_t dst_offset, uint64_t length, uint32_t flag_index,
                                                uint64_t flag_value, const WaitContext& ctx) {
  ring::Command c = ring_command(ring::CommandType::kWrite, dst_rank, flag_index, flag_value, ctx);
  c.src_offset = src_offset;
  c.dst_offset = dst_offset;
  c.length = length;
  return ring_push(ring, c, ctx);
}

// Convenience: a kSignal (fence after this ring's earlier writes, then the flag).
__device__ __forceinline__ bool ring_push_signal(const ring::RingView& ring, uint32_t dst_rank, uint32_t flag_index,
                                                 uint64_t flag_value, const WaitContext& ctx) {
  return ring_push(ring, ring_command(ring::CommandType::kSignal, dst_rank, flag_index, flag_value, ctx), ctx);
}

}  // namespace loom::kernels
