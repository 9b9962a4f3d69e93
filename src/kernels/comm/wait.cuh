// The one bounded wait every loom spin goes through.
//
// Each wait has a deadline (launch start + LOOM_TIMEOUT_MS, read from %globaltimer) and polls
// two abort words: the device-wide one that the first failing CTA raises, and the host-mapped
// one the host raises (comm abort, host-side deadline). The device word is cheap (device memory)
// and read often. The host word crosses PCIe, and when thousands of waiting warps read it the
// GPU's PCIe read queue saturates, every such read takes ~100 us, and the waits that hit one
// stall the whole kernel (the fused operators ran 50-100x slower that way). So a flag wait reads
// it at most once every kHostAbortCheckNs, and a barrier wait inside a CTA only once it has
// lasted kBarrierHostAbortCheckNs, then at that interval: what a barrier waits for is normally a
// flag wait of its own CTA, which sees the host abort and raises the device word; the rare read
// covers a CTA stuck otherwise. On timeout the CTA writes one error
// record (code, op, epoch, rank waited on, flag) into host-mapped memory, raises the device
// abort and returns false; the caller returns from the kernel. No trap: the CUDA context stays
// usable and the host reports a Status.
#pragma once

#include <cstdint>

#include "kernels/comm/signals.cuh"
#include "runtime/device_abi.h"

namespace loom::kernels {

// Abort words are read every kAbortCheckInterval polls (they live in host memory or are
// shared by all CTAs, so reading them every spin would cost bandwidth).
constexpr uint32_t kAbortCheckInterval = 64;
constexpr uint32_t kSleepAfterPolls = 256;  // then back off with nanosleep to spare the flag's line
// A flag wait reads the host-mapped abort word at most this often (so the host's abort reaches
// a spinning kernel within about this time).
constexpr uint64_t kHostAbortCheckNs = 500'000;
// The same for barrier waits (many more of them wait at once: every consumer warp of every CTA).
constexpr uint64_t kBarrierHostAbortCheckNs = 10'000'000;

struct WaitContext {
  WaitParams params;
  uint64_t deadline_ns;
  uint64_t epoch;
  OpId op;

  __device__ static WaitContext start(const WaitParams& p, OpId op, uint64_t epoch) {
    WaitContext c;
    c.params = p;
    c.deadline_ns = global_timer_ns() + p.timeout_ns;
    c.epoch = epoch;
    c.op = op;
    return c;
  }

  // The device-wide word: device memory, cheap to poll.
  __device__ bool device_aborted() const { return *reinterpret_cast<const volatile uint32_t*>(params.device_abort) != 0; }
  // The host's word: host-mapped memory, a PCIe round trip (see the header comment for how often).
  __device__ bool host_aborted() const { return params.host_abort != nullptr && *params.host_abort != 0; }

  // Thread 0: the CTA reached `phase` of this launch (LaunchPhase; a posted store to host memory).
  __device__ void mark(LaunchPhase phase) const {
    if (params.progress == nullptr || blockIdx.x >= kProgressSlots) return;
    volatile CtaProgress* slot = params.progress + blockIdx.x;
    if (phase == LaunchPhase::kEntered) {
      slot->failure = 0;
      slot->other_failure = 0;
    }
    slot->phase = static_cast<uint32_t>((epoch & 0xffffffu) << 8) | static_cast<uint32_t>(phase);
  }

  // Records the failure (first CTA wins; every failing thread also names its wait in its CTA's
  // progress slot: thread 0's word, or the other threads' word), raises the device abort.
  __device__ void fail(DeviceError code, int waited_on, FlagKind kind, uint32_t index, uint64_t observed,
                       uint64_t waited_ns) const {
    ErrorRecord* e = params.error;
    if (e != nullptr && atomicCAS(reinterpret_cast<unsigned int*>(&e->code), 0u, static_cast<unsigned>(code)) == 0u) {
      e->op = static_cast<uint32_t>(op);
      e->epoch = epoch;
      e->waited_on = waited_on;
      e->flag_kind = static_cast<uint32_t>(kind);
      e->flag_index = index;
      e->cta = static_cast<int32_t>(blockIdx.x);
      e->observed = observed;
      e->waited_ns = waited_ns;
      __threadfence_system();
    }
    if (params.progress != nullptr && blockIdx.x < kProgressSlots) {
      CtaProgress& slot = params.progress[blockIdx.x];
      *(threadIdx.x == 0 ? &slot.failure : &slot.other_failure) =
          (1u << 31) | (static_cast<uint32_t>(kind) << 24) | (index & 0xffffffu);
    }
    atomicExch(params.device_abort, 1u);
    __threadfence_system();
  }
};

// The checks every bounded wait makes between its polls — flag waits here, mbarrier waits
// (kernels/common/sm90.cuh) and bulk-copy waits (kernels/comm/copy.cuh): the device-wide abort
// word at every check, the host's at most once per kHostCheckNs (the header says why), then the
// deadline. keep_waiting() records the failure and says false when the wait must give up.
template <uint64_t kHostCheckNs>
class WaitGuard {
 public:
  __device__ explicit WaitGuard(uint64_t deadline_ns)
      : begin_(global_timer_ns()), deadline_(deadline_ns), next_host_check_(begin_ + kHostCheckNs) {}

  // The failure (waited_on, kind, index, observed) goes into the error record. The codes are
  // passed as constants: a variable code costs the fused kernels' mainloops spills (ptxas).
  __device__ bool keep_waiting(const WaitContext& ctx, int waited_on, FlagKind kind, uint32_t index, uint64_t observed) {
    const uint64_t now = global_timer_ns();
    bool aborted = ctx.device_aborted();
    if (!aborted && now >= next_host_check_) {
      aborted = ctx.host_aborted();
      next_host_check_ = now + kHostCheckNs;
    }
    if (aborted) {
      ctx.fail(DeviceError::kAborted, waited_on, kind, index, observed, now - begin_);
      return false;
    }
    if (now > deadline_) {
      ctx.fail(DeviceError::kTimeout, waited_on, kind, index, observed, now - begin_);
      return false;
    }
    return true;
  }

 private:
  uint64_t begin_;
  uint64_t deadline_;
  uint64_t next_host_check_;
};

// Spins (one thread) until `done(*flag)` (acquire loads). Returns false on timeout or abort; the
// failure is then already recorded.
template <class Done>
__device__ __forceinline__ bool wait_until(const uint64_t* flag, Done done, const WaitContext& ctx, int waited_on,
                                           FlagKind kind, uint32_t index) {
  uint64_t seen = flag_load_acquire(flag);
  if (done(seen)) return true;
  WaitGuard<kHostAbortCheckNs> guard(ctx.deadline_ns);
  for (uint32_t polls = 1;; ++polls) {
    seen = flag_load_acquire(flag);
    if (done(seen)) return true;
    if (polls % kAbortCheckInterval == 0 && !guard.keep_waiting(ctx, waited_on, kind, index, seen)) return false;
    if (polls > kSleepAfterPolls) __nanosleep(64);
  }
}

// Spins (one thread) until *flag reaches `target`.
__device__ __forceinline__ bool wait_flag(const uint64_t* flag, uint64_t target, const WaitContext& ctx,
                                              int waited_on, FlagKind kind, uint32_t index) {
  return wait_until(flag, [target](uint64_t seen) { return epoch_reached(seen, target); }, ctx, waited_on, kind, index);
}

}  // namespace loom::kernels
