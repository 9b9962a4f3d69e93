// The bulk-copy stream: every data-moving role's TMA copies go through it (the collectives'
// all_gather, ag_gemm's communication CTAs, the multi-node roles). One thread drives it: loads
// from global into a ring of shared-memory stages (cp.async.bulk, completing on an mbarrier),
// stores from each stage to one or several destinations (local or NVLink-mapped peer memory).
//
// Shared memory (the caller's, 128-byte aligned):
//   ring[kStages][kPieceBytes]   kStages * kPieceBytes bytes
//   full[kStages]                kStages * 8 bytes (mbarriers; invalidate() before the area is reused)
//
// Items (a source range, its destinations, an optional completion flag) are cut into pieces of
// at most kPieceBytes, and the pieces of every item a stream ever moves form one sequence: piece
// q lands in stage q % kStages, whose barrier completes phase q / kStages. Loads run kStages - 1
// pieces ahead of the stores; the stores of a piece to all its destinations form one bulk group,
// and the stage of piece q - 1 is reloaded once group q - 1 has been read (wait_group.read 1).
// An item's flag is set to the launch epoch (system fence, release store) once its last group
// has completed: when kFlagLag newer groups exist, wait_group<kFlagLag> guarantees it, so the
// pipeline never drains per item; at the end, wait_group 0. On return every store has
// completed and is ordered before the caller's later generic-proxy stores (its own flags), and
// after a failed wait every issued load has landed: the ring may be reused either way.
#pragma once

#include <cuda/ptx>

#include <cstdint>
#include <type_traits>

#include "kernels/comm/signals.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "runtime/device_abi.h"

namespace loom::kernels {

// One source range to one destination. `flag` (null: none) is set to the epoch once the bytes
// have landed; `rank` is the destination's local rank, whose entry the stream's enter hook
// awaits before the first write into it (-1: no wait).
struct BulkItem {
  static constexpr bool kWaitsReady = false;
  const char* src;
  char* dst;
  uint64_t bytes;
  uint64_t* flag;
  int rank;
  __device__ int destinations() const { return 1; }
  __device__ char* destination(int /*d*/) const { return dst; }
};

// One source range to `ndst` destinations (the same bytes to each).
struct BulkFanoutItem {
  static constexpr bool kWaitsReady = false;
  const char* src;
  char* const* dsts;
  int ndst;
  uint64_t bytes;
  uint64_t* flag;
  int rank;
  __device__ int destinations() const { return ndst; }
  __device__ char* destination(int d) const { return dsts[d]; }
};

// A BulkItem whose source is itself written by another rank (data forwarded along a ring): its
// loads start only once *ready reaches the launch epoch (a bounded wait naming `ready_rank`, the
// writer, and `ready_index` with FlagKind `ready_kind`).
struct BulkForwardItem {
  static constexpr bool kWaitsReady = true;
  const char* src;
  char* dst;
  uint64_t bytes;
  uint64_t* flag;
  int rank;
  const uint64_t* ready;  // null: the source is ready
  int ready_rank;
  FlagKind ready_kind;
  uint32_t ready_index;
  __device__ int destinations() const { return 1; }
  __device__ char* destination(int /*d*/) const { return dst; }
};

template <int kStages, uint32_t kPieceBytes>
class BulkCopyStream {
 public:
  static_assert(kStages >= 2, "a bulk-copy stream overlaps loads and stores: it needs at least two stages");
  static_assert(kPieceBytes % 16 == 0, "bulk copies move multiples of 16 bytes: the piece size must be one");
  static constexpr uint32_t kRingBytes = kStages * kPieceBytes;
  static constexpr uint32_t kSmemBytes = kRingBytes + kStages * sizeof(uint64_t);

  __device__ explicit BulkCopyStream(uint8_t* smem)
      : ring_(smem), full_(reinterpret_cast<uint64_t*>(smem + kRingBytes)) {}

  // The driving thread, before the first item.
  __device__ void init() const {
    for (int s = 0; s < kStages; ++s) cuda::ptx::mbarrier_init(&full_[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  // The driving thread, before the shared memory is used for anything else.
  __device__ void invalidate() const {
    for (int s = 0; s < kStages; ++s) sm90::mbarrier_inval(&full_[s]);
  }

  // Moves list.item(0 .. list.count()) in order (items: BulkItem, BulkFanoutItem or
  // BulkForwardItem, whose source is awaited before its first load; sources and destinations
  // 16-byte aligned, sizes multiples of 16). `enter(rank)` is called before the
  // first piece of an item whose rank differs from the previous item's (skipped for rank -1) and
  // must say whether the destination may be written. False after a failed wait (recorded).
  template <int kFlagLag, class List, class EnterFn>
  __device__ bool push(const List& list, uint64_t epoch, const WaitContext& ctx, EnterFn&& enter) {
    static_assert(kFlagLag >= 0 && kFlagLag <= 8, "wait_group takes a small immediate: kFlagLag must be in [0, 8]");
    const uint32_t items = list.count();
    if (items == 0) return true;
    // Load cursor (next piece to load), store cursor (next piece to store), flag cursor (oldest
    // item whose flag is not yet published; its last group is fl_end - 1). Sequence numbers
    // count from this call's first piece; base_ continues the barriers' phases across calls.
    uint32_t ld_item = 0;
    uint64_t ld_off = 0, ld_seq = 0;
    uint32_t st_item = 0;
    uint64_t st_off = 0, st_seq = 0;
    uint32_t fl_item = 0;
    uint64_t fl_end = pieces_of(list.item(0).bytes);
    int entered_rank = -1;
    bool ok = true;

    // Loads the next piece: 1 done, 0 deferred (a forwarded item's source has not arrived and
    // `block` is false), -1 a failed wait. A forwarded item waits only when nothing loaded is left
    // to store: blocking on it with earlier items' stores pending could make a ring of ranks wait
    // on each other (every rank's next piece behind a piece the next rank has not sent yet).
    auto load_next = [&](bool block) -> int {
      const auto it = list.item(ld_item);
      if constexpr (std::remove_cvref_t<decltype(it)>::kWaitsReady) {
        if (ld_off == 0 && it.ready != nullptr && !epoch_reached(flag_load_acquire(it.ready), epoch)) {
          if (!block) return 0;
          if (!wait_flag(it.ready, epoch, ctx, it.ready_rank, it.ready_kind, it.ready_index)) return -1;
        }
        if (ld_off == 0 && it.ready != nullptr) {
          cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // the bulk load reads what the peer wrote
        }
      }
      const uint32_t size = piece_size(it.bytes - ld_off);
      const uint32_t s = stage_of(ld_seq);
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                           &full_[s], size);
      cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, ring_ + s * kPieceBytes,
                               it.src + ld_off, size, &full_[s]);
      ld_off += size;
      if (ld_off == it.bytes) {
        ++ld_item;
        ld_off = 0;
      }
      ++ld_seq;
      return 1;
    };
    auto publish = [&](uint32_t k) {
      const auto it = list.item(k);
      if (it.flag != nullptr) {
        __threadfence_system();
        flag_store_release(it.flag, epoch);
      }
    };
    // Every item stored so far gets its flag now (its stores completed first), whatever kFlagLag:
    // called before blocking on a forwarded item's source, which a peer may send only once it has
    // seen one of these flags (with flags held back, a ring of ranks waited on each other).
    auto publish_stored = [&]() {
      if (fl_item >= st_item) return;
      cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
      cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
      while (fl_item < st_item) {
        publish(fl_item);
        if (++fl_item < items) fl_end += pieces_of(list.item(fl_item).bytes);
      }
    };

    // Loads run up to kStages - 1 pieces ahead of the stores (the stage of piece q is reused by
    // piece q + kStages once group q has been read: wait_group.read 1 before each load).
    auto load_ahead = [&]() -> bool {
      while (ld_item < items && ld_seq < st_seq + static_cast<uint64_t>(kStages - 1)) {
        const int r = load_next(false);
        if (r < 0) return false;
        if (r == 0) break;
      }
      return true;
    };
    ok = load_ahead();
    while (ok && st_item < items) {
      if (st_seq == ld_seq) {  // nothing loaded: the next piece's source must arrive first
        cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<1>{});
        int loaded = load_next(false);
        if (loaded == 0) {  // not arrived: publish what is stored, then wait for it
          publish_stored();
          loaded = load_next(true);
        }
        if (loaded < 0) {
          ok = false;
          break;
        }
      }
      const auto it = list.item(st_item);
      if (st_off == 0 && it.rank >= 0 && it.rank != entered_rank) {
        // First write into this destination in this launch: it must have entered.
        if (!enter(it.rank)) {
          ok = false;
          break;
        }
        entered_rank = it.rank;
      }
      const uint32_t s = stage_of(st_seq);
      if (!sm90::mbarrier_wait(&full_[s], phase_of(st_seq), ctx, sm90::barrier_what(BarrierWhat::kCopyLoad, s))) {
        ok = false;
        break;
      }
      const uint32_t size = piece_size(it.bytes - st_off);
      for (int d = 0; d < it.destinations(); ++d) {
        cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, it.destination(d) + st_off,
                                 ring_ + s * kPieceBytes, size);
      }
      cuda::ptx::cp_async_bulk_commit_group();
      st_off += size;
      if (st_off == it.bytes) {
        ++st_item;
        st_off = 0;
      }
      ++st_seq;
      // Publish the flags of items whose last group has completed.
      if (fl_item < st_item && st_seq >= fl_end + static_cast<uint64_t>(kFlagLag)) {
        cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<kFlagLag>{});
        cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
        while (fl_item < st_item && st_seq >= fl_end + static_cast<uint64_t>(kFlagLag)) {
          publish(fl_item);
          if (++fl_item < items) fl_end += pieces_of(list.item(fl_item).bytes);
        }
      }
      if (ld_item < items && ld_seq < st_seq + static_cast<uint64_t>(kStages - 1)) {
        // The next loads reuse the stages of pieces up to st_seq - 2, whose groups must have been read.
        cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<1>{});
        if (!load_ahead()) {
          ok = false;
          break;
        }
      }
    }
    // Loads issued but never stored (after a failure) must land before the ring goes away;
    // their source is this GPU's memory, so this is short. The abort is already raised, hence
    // the plain time-bounded wait instead of the abort-aware one.
    for (; st_seq < ld_seq; ++st_seq) drain_wait(&full_[stage_of(st_seq)], phase_of(st_seq));
    base_ += ld_seq;
    cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    if (ok) {
      for (; fl_item < items; ++fl_item) publish(fl_item);
    }
    return ok;
  }

  // [src, src + bytes) to each of dsts[0, ndst), no flag: the caller publishes its own after the
  // return (every store has then completed). False after a failed wait (recorded).
  __device__ bool copy(char* const* dsts, int ndst, const char* src, uint64_t bytes, const WaitContext& ctx) {
    const OneItem list{BulkFanoutItem{src, dsts, ndst, bytes, nullptr, -1}};
    return push<0>(list, 0, ctx, [](int) { return true; });
  }

 private:
  struct OneItem {
    BulkFanoutItem it;
    __device__ uint32_t count() const { return it.bytes == 0 ? 0u : 1u; }
    __device__ BulkFanoutItem item(uint32_t /*k*/) const { return it; }
  };

  __device__ uint32_t stage_of(uint64_t seq) const { return static_cast<uint32_t>((base_ + seq) % kStages); }
  __device__ uint32_t phase_of(uint64_t seq) const { return static_cast<uint32_t>(((base_ + seq) / kStages) & 1); }
  __device__ static uint32_t piece_size(uint64_t left) {
    return static_cast<uint32_t>(left < kPieceBytes ? left : kPieceBytes);
  }
  __device__ static uint64_t pieces_of(uint64_t bytes) { return (bytes + kPieceBytes - 1) / kPieceBytes; }
  __device__ static void drain_wait(uint64_t* bar, uint32_t parity) {
    const uint64_t give_up = global_timer_ns() + 100'000'000ull;  // 100 ms: a local load that never lands is a bug
    while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity) && global_timer_ns() < give_up) {
    }
  }

  uint8_t* ring_;
  uint64_t* full_;
  uint64_t base_ = 0;  // pieces moved by earlier calls
};

}  // namespace loom::kernels
