// The relay role of the fused gemm_rs / gemm_ar kernels (staged_reduce.cuh): CTAs that move
// finished tiles from this GPU's memory into the peers, so that the compute CTAs' epilogues only
// ever store locally.
//
// Why: pushed from the epilogues, a tile's remote stores hold its consumer warps until TMA has
// read the staged boxes out, at NVLink's pace (+1 us per partial tile, +2 us per broadcast tile
// at 8192 x 8192 x 7168, W = 2), and the first wave's remote stores wait for the peers' entry and
// then leave all at once (stalls of 10-20 us per CTA). On a grid whose last wave has idle slots a
// few CTAs relay at no cost in waves, and the compute CTAs join them when their tiles run out.
//
// Work: positions of the launch's tile order (TileScheduler::tile_at), claimed one at a time
// from TpDeviceState::relay_queue (so a CTA's claims increase). Position -> tile (m, n):
//   owner d != me   partial item: the tile's rows of our outbox (slot(me, d), as in d's staging)
//                   -> d's staging; then partial[slot][t] = e on d
//   owner == me     gemm_ar: final item: our out's tile -> every peer's out; then final[tile] = e
//                   on every peer. gemm_rs: nothing to relay (the position is skipped)
// A tile may be relayed once ready[tile] = e (this rank's compute CTA stored it locally).
//
// Pipeline (one thread): an item is ceil(BLOCK_N / 64) pieces, a piece one 64-column x BLOCK_M
// box: one TMA load into a ring slot, then BLOCK_M / 16 TMA stores per destination (the peers'
// maps have 16-row boxes), committed as one bulk group. Loads run at most kRelayLoadAhead pieces
// ahead of the stores, so up to kRelaySlots - kRelayLoadAhead pieces' stores are in flight (a
// slot is reloaded once the group that stored it has been read). An item's flags are published
// once its last group has completed: when kRelayFlagLag newer groups exist, or before the relay
// waits for a tile that is not ready, or at the end.
//
// Progress: the launch's tile order puts every partial a rank owes for band b before that
// band's own rows, on every rank, so the item a relay waits for depends only on items at earlier
// positions; a relay publishes everything it has completed before it blocks, and loads wait only
// on local TMA, so the lowest blocked position always makes progress.
//
// Shared memory (from the 1024-aligned base; only relaying CTAs, so the compute role's stage
// buffers are free):
//   slot[kRelaySlots]     kRelaySlots * BLOCK_M * 128 bytes (128B-swizzled boxes)
//   full[kRelaySlots]     kRelaySlots * 8 bytes (mbarriers)
//   item[kRelayItems]     kRelayItems * sizeof(RelayItem): claimed items not yet published
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/copy.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/tp/fused_frame.cuh"
#include "kernels/tp/reduce_params.cuh"

namespace loom::kernels::tp {

struct RelayItem {
  uint32_t tile;       // m_block * n_blocks + n_block
  uint32_t m_block;
  uint32_t n_block;
  uint32_t owner;      // rank owning the tile's rows
  uint32_t pieces;     // 64-column boxes inside N
  uint32_t last_piece; // sequence number of its last piece in this CTA's stream
};

template <int kBlockM, int kBlockN, bool kBroadcast>
class TileRelay {
 public:
  static constexpr int kSlots = TpTunables::kRelaySlots;
  static constexpr int kLoadAhead = TpTunables::kRelayLoadAhead;
  static constexpr int kFlagLag = TpTunables::kRelayFlagLag;
  static constexpr int kItems = 32;
  static constexpr uint32_t kSlotBytes = kBlockM * 128;  // 64 16-bit columns x BLOCK_M rows
  static constexpr uint32_t kFullOffset = kSlots * kSlotBytes;
  static constexpr uint32_t kItemOffset = kFullOffset + kSlots * 8;
  static constexpr uint32_t kSmemBytes = kItemOffset + kItems * sizeof(RelayItem);
  static_assert(kLoadAhead >= 1 && kLoadAhead < kSlots, "loads run ahead of the stores by at least one slot and leave some in flight");
  static_assert(kSlots - kLoadAhead <= 8 && kFlagLag >= 0 && kFlagLag <= 8, "wait_group takes a small immediate");
  static_assert(kSlotBytes % 1024 == 0, "ring slots must keep the 128B swizzle's 1024-byte alignment");

  __device__ TileRelay(uint8_t* base, const ReduceGemmParams& p, uint64_t epoch, const WaitContext& ctx)
      : slot_(base),
        full_(reinterpret_cast<uint64_t*>(base + kFullOffset)),
        items_(reinterpret_cast<RelayItem*>(base + kItemOffset)),
        p_(p),
        epoch_(epoch),
        ctx_(ctx),
        sched_(p.sched, epoch) {}

  __device__ void init() const {
    for (int s = 0; s < kSlots; ++s) cuda::ptx::mbarrier_init(&full_[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }

  // One thread. False after a failed wait (recorded); every issued load has landed and every
  // store has completed when it returns, either way.
  __device__ bool run() {
    sm90::prefetch_tensormap(kBroadcast ? &p_.out_rows : &p_.outbox_rows);
    if constexpr (kBroadcast) sm90::prefetch_tensormap(&p_.outbox_rows);
    bool ok = true;
    for (;;) {
      // Load what may be loaded.
      while (ok && ld_ < st_ + kLoadAhead) {
        if (ld_item_ == claimed_) {
          if (claimed_ - published_ == static_cast<uint32_t>(kItems)) {
            if (st_ < ld_) break;  // store first; publishing frees the item ring
            publish_completed(/*all=*/true);
            continue;
          }
          if (!claim()) break;
        }
        const RelayItem& it = items_[ld_item_ % kItems];
        if (ld_chunk_ == 0 && !epoch_reached(flag_load_acquire(ready_flag(it.tile)), epoch_)) {
          if (st_ < ld_) break;  // store what is loaded, then come back
          // Nothing else to do: publish what has completed (a peer may be waiting on it), then wait.
          publish_completed(/*all=*/true);
          if (!wait_flag(ready_flag(it.tile), epoch_, ctx_, p_.comm.local_rank, FlagKind::kRelayTile, it.tile)) {
            ok = false;
            break;
          }
        }
        if (ld_chunk_ == 0) cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // TMA reads what TMA wrote
        load(it, ld_chunk_);
        if (++ld_chunk_ == it.pieces) {
          ld_chunk_ = 0;
          ++ld_item_;
        }
      }
      if (!ok || st_ == ld_) break;  // failed, or nothing loaded and nothing left to claim
      if (!store_next()) {
        ok = false;
        break;
      }
      publish_completed(/*all=*/false);
    }
    // Loads issued but never stored (after a failure) must land before the ring goes away.
    for (; st_ < ld_; ++st_) drain_wait(&full_[st_ % kSlots], static_cast<uint32_t>((st_ / kSlots) & 1));
    cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
    if (ok) publish_completed(/*all=*/true);
    return ok;
  }

 private:
  __device__ uint64_t* ready_flag(uint32_t tile) const {
    return op_flag(p_.comm, p_.comm.local_rank, ready_flag_index<kBroadcast>(p_, tile));
  }

  // Claims the next position that has something to relay; false when the order is exhausted.
  __device__ bool claim() {
    if (exhausted_) return false;
    const uint32_t me = static_cast<uint32_t>(p_.comm.local_rank);
    const uint32_t total = p_.sched.m_blocks * p_.n_blocks;
    for (;;) {
      const uint32_t position = atomicAdd(&p_.tp->relay_queue, 1u);
      if (position >= total) {
        exhausted_ = true;
        return false;
      }
      uint32_t m_block, n_block;
      sched_.tile_at(position, m_block, n_block);
      const uint32_t owner = m_block / p_.m_blocks_per_rank;
      if (!kBroadcast && owner == me) continue;  // gemm_rs: own tiles stay here
      RelayItem& it = items_[claimed_ % kItems];
      it.tile = m_block * p_.n_blocks + n_block;
      it.m_block = m_block;
      it.n_block = n_block;
      it.owner = owner;
      const uint32_t n0 = n_block * kBlockN;
      it.pieces = (min(p_.n, n0 + kBlockN) - n0 + 63) / 64;
      pieces_claimed_ += it.pieces;
      it.last_piece = static_cast<uint32_t>(pieces_claimed_ - 1);
      ++claimed_;
      return true;
    }
  }

  // Source map and row of an item (partials: the slot rows they take in the owner's staging).
  __device__ int32_t source_row(const RelayItem& it) const {
    const uint32_t me = static_cast<uint32_t>(p_.comm.local_rank);
    if (it.owner == me) return static_cast<int32_t>(it.m_block * kBlockM);
    const uint32_t row_in_owner = (it.m_block - it.owner * p_.m_blocks_per_rank) * kBlockM;
    return static_cast<int32_t>(staging_slot(me, it.owner, static_cast<uint32_t>(p_.comm.local_world)) * p_.rows_per_rank +
                                row_in_owner);
  }

  __device__ void load(const RelayItem& it, uint32_t chunk) {
    // The slot's previous piece (ld - kSlots) must have been read out: at most kSlots -
    // kLoadAhead newer groups can exist then, since ld < st + kLoadAhead.
    if (ld_ >= static_cast<uint64_t>(kSlots)) cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<kSlots - kLoadAhead>{});
    const uint32_t s = static_cast<uint32_t>(ld_ % kSlots);
    constexpr uint32_t kBytes = kSlotBytes;
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, &full_[s],
                                         kBytes);
    const bool own = it.owner == static_cast<uint32_t>(p_.comm.local_rank);
    const int32_t coords[2] = {static_cast<int32_t>(it.n_block * kBlockN + 64 * chunk), source_row(it)};
    cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, slot_ + s * kSlotBytes,
                                    own ? &p_.out_rows : &p_.outbox_rows, coords, &full_[s]);
    ++ld_;
  }

  // Stores piece st_ to its destinations (one bulk group). False after a failed wait.
  __device__ bool store_next() {
    const RelayItem& it = items_[st_item_ % kItems];
    const uint32_t s = static_cast<uint32_t>(st_ % kSlots);
    if (!mbarrier_wait_bounded(&full_[s], static_cast<uint32_t>((st_ / kSlots) & 1), ctx_)) return false;
    const uint32_t me = static_cast<uint32_t>(p_.comm.local_rank);
    const uint32_t world = static_cast<uint32_t>(p_.comm.local_world);
    const int32_t col = static_cast<int32_t>(it.n_block * kBlockN + 64 * st_chunk_);
    const uint8_t* box = slot_ + s * kSlotBytes;
    auto store_to = [&](const sm90::TmaDescriptor* map, int32_t row0) {
#pragma unroll
      for (int i = 0; i < kBlockM / 16; ++i) {
        const int32_t coords[2] = {col, row0 + 16 * i};
        cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, map, coords, box + i * 16 * 128);
      }
    };
    if (it.owner != me) {
      if (!entered(it.owner)) return false;
      store_to(&p_.stage_to[it.owner], source_row(it));
    } else {
      for (uint32_t i = 1; i < world; ++i) {
        const uint32_t d = (me + i) % world;
        if (!entered(d)) return false;
        store_to(&p_.out[d], static_cast<int32_t>(it.m_block * kBlockM));
      }
    }
    cuda::ptx::cp_async_bulk_commit_group();
    ++st_;
    if (++st_chunk_ == it.pieces) {
      st_chunk_ = 0;
      ++st_item_;
    }
    return true;
  }

  // Publishes the flags of items whose every group has completed: all stored items (all), or
  // those with at least kFlagLag newer groups (waiting only for what must be done by then).
  __device__ void publish_completed(bool all) {
    if (published_ == st_item_) return;
    if (all) {
      cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
    } else {
      if (st_ - 1 - items_[published_ % kItems].last_piece < static_cast<uint64_t>(kFlagLag)) return;
      cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<kFlagLag>{});
    }
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    __threadfence_system();
    while (published_ < st_item_) {
      const RelayItem& it = items_[published_ % kItems];
      if (!all && st_ - 1 - it.last_piece < static_cast<uint64_t>(kFlagLag)) break;
      publish(it);
      ++published_;
    }
  }

  __device__ void publish(const RelayItem& it) const {
    const DeviceComm& c = p_.comm;
    const uint32_t me = static_cast<uint32_t>(c.local_rank);
    const uint32_t world = static_cast<uint32_t>(c.local_world);
    if (it.owner != me) {
      const uint32_t local_tile = (it.m_block - it.owner * p_.m_blocks_per_rank) * p_.n_blocks + it.n_block;
      flag_store_release(op_flag(c, static_cast<int>(it.owner), partial_flag_index(p_, staging_slot(me, it.owner, world), local_tile)),
                         epoch_);
      return;
    }
    for (uint32_t d = 0; d < world; ++d) {
      if (d != me) flag_store_release(op_flag(c, static_cast<int>(d), final_flag_index(p_, it.tile)), epoch_);
    }
  }

  __device__ bool entered(uint32_t peer) {
    const uint32_t bit = 1u << peer;
    if ((entered_mask_ & bit) != 0) return true;
    if (!wait_entry(p_.comm, static_cast<int>(peer), epoch_, p_.signature, ctx_)) return false;
    entered_mask_ |= bit;
    return true;
  }

  __device__ static void drain_wait(uint64_t* bar, uint32_t parity) {
    const uint64_t give_up = global_timer_ns() + 100'000'000ull;  // 100 ms: a local load that never lands is a bug
    while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity) && global_timer_ns() < give_up) {
    }
  }

  uint8_t* slot_;
  uint64_t* full_;
  RelayItem* items_;
  const ReduceGemmParams& p_;
  uint64_t epoch_;
  const WaitContext& ctx_;
  gemm::TileScheduler<kBlockM> sched_;  // only its order (tile_at)
  uint64_t ld_ = 0, st_ = 0;            // next piece to load / to store
  uint64_t pieces_claimed_ = 0;
  uint32_t claimed_ = 0;                // items claimed; ring index = item % kItems
  uint32_t ld_item_ = 0, ld_chunk_ = 0;  // item and piece of ld_
  uint32_t st_item_ = 0, st_chunk_ = 0;  // item and piece of st_
  uint32_t published_ = 0;              // items whose flags are out
  uint32_t entered_mask_ = 0;
  bool exhausted_ = false;
};

// The relay role of one CTA (every thread calls; thread 0 works). Returns, on every thread,
// whether it succeeded.
template <class Cfg, bool kBroadcast>
__device__ bool relay_tiles(uint8_t* smem_raw, const ReduceGemmParams& p, uint64_t epoch, const WaitContext& ctx) {
  using Relay = TileRelay<Cfg::kBlockM, Cfg::kBlockN, kBroadcast>;
  static_assert(Relay::kSmemBytes + 16 <= Cfg::kControlOffset,
                "the relay ring must fit below the compute role's control area (barriers that stay live)");
  uint8_t* base = aligned_smem(smem_raw);
  volatile int* ok_word = reinterpret_cast<volatile int*>(base + Relay::kSmemBytes);
  Relay relay(base, p, epoch, ctx);
  if (threadIdx.x == 0) relay.init();
  __syncthreads();
  if (threadIdx.x == 0) *ok_word = relay.run() ? 1 : 0;
  __syncthreads();
  const bool ok = *ok_word != 0;
  __syncthreads();
  return ok;
}

}  // namespace loom::kernels::tp
