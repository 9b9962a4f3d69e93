// Epoch-tagged flags: the only way loom kernels tell each other (and peers) that data is there.
//
// A writer stores data (plain or bulk-async stores, local or over NVLink), makes it visible at
// system scope, then stores the epoch into the flag with release semantics. A reader acquires
// the flag and compares with epoch_reached(): flags never need resetting, and a stale flag from
// an earlier launch can never satisfy a wait of a later one.
#pragma once

#include <cstdint>

#include "runtime/device_abi.h"

namespace loom::kernels {

__device__ __forceinline__ uint64_t flag_load_acquire(const uint64_t* flag) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
  return v;
}

// Release store at system scope: every write this thread made (or observed through a barrier
// it took part in, with a fence before) is visible to a reader that acquires the flag.
__device__ __forceinline__ void flag_store_release(uint64_t* flag, uint64_t epoch) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(epoch) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace loom::kernels
