// Fused AllGather + GEMM: out[M, N] = AllGather_rows(a_r[M/W, K]) @ b_r, one persistent kernel.
//
// Roles (TpRoleTable): CTAs [0, comm_ctas) communicate first, then compute; the rest compute.
//   communication  one thread per CTA pushes this rank's shard into every peer's gathered A with
//                  TMA bulk copies (ChunkPusher), row chunk by row chunk, and after each chunk sets
//                  rows[f] = e on that peer. Destinations in the order they need the rows: rank
//                  me-1 computes our rows right after its own, me-2 after that, ... Optionally the
//                  shard is also copied into this rank's own rows of a user-visible gathered A.
//                  When its chunks are done the CTA joins the compute role (run() once).
//   compute        the GEMM engine's ComputeRole; tiles come from the launch's queue in a raster
//                  rotated to start at this rank's rows, which are read straight from the shard
//                  (GemmOperands::a_local), so the first tiles wait for nothing. Every other tile
//                  waits (bounded, TileScheduler's gate) for the row-chunk flags it covers.
//                  Tail split (SchedulerParams): the last partial wave's tiles run as K pieces
//                  staged in this rank's piece slots (local; piece[slot] = e after each piece's
//                  epilogue) and folded by the tile's fold item (AgPieceFold), which stores out.
//
// Buffers (heap offsets equal on all ranks):
//   gathered A   [M, K] symmetric (user's gathered_a or the TP workspace): rank s's rows
//                [s*M/W, (s+1)*M/W) are written by rank s
//   rows flags   op_flags[W + f], f < M / rows_per_flag: "rows [f*rpf, (f+1)*rpf) have arrived",
//                written by the owner of those rows (f / (M/W/rpf)) into every peer
//   pieces       [split_tiles * (pieces - 1) * BM, BN] in the TP workspace (after the gathered A
//                when that lives there), local; flags piece[slot] after the rows flags (tail_pieces.cuh)
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "kernels/comm/copy.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/compute_role.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/params.h"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/tp/fused_frame.cuh"
#include "kernels/tp/tail_pieces.cuh"

namespace loom::kernels::tp {

struct AgGemmParams {
  sm90::TmaDescriptor a_gathered;  // [M, K] gathered A in this rank's heap, box {64, BLOCK_M}
  sm90::TmaDescriptor a_local;     // [M/W, K] this rank's shard, box {64, BLOCK_M}
  sm90::TmaDescriptor b;
  sm90::TmaDescriptor out;         // [M, N], box {64, 16}
  TailPieces pieces;               // this rank's piece slots (tail split)
  DeviceComm comm;
  LaunchState* state;
  uint32_t m, n, k;
  gemm::SchedulerParams sched;  // queue = &tp->tile_queue, gate on rows flags, rotation to our rows
  gemm::EpilogueParams epi;     // one destination (out), no signals
  const char* shard;            // this rank's rows (device memory of this GPU)
  uint64_t gathered_offset;     // heap offset of the gathered A
  uint64_t row_bytes;           // K * element size (a multiple of 16)
  uint32_t rows_per_rank;       // M / W, a multiple of BLOCK_M
  uint32_t rows_per_flag;       // divides rows_per_rank (planner::ag_rows_per_flag); a tile row may need several
  uint32_t comm_ctas;
  uint32_t copy_local;          // 1: also copy the shard into our own rows of the gathered A
  uint32_t signature;           // plan signature (fused_frame.cuh)
  TileTimelineRecord* timeline;  // optional (diagnostics), one record per tile
};
static_assert(sizeof(AgGemmParams) <= 4096, "ag_gemm's parameters must fit the classic 4 KiB limit");

// What one communication CTA copies: every comm_ctas-th position of the list
//   position i -> destination slot d = i / chunks, chunk f = i % chunks (chunks = M/W/rpf)
//   slot d < W-1: rank (me - 1 - d) mod W, with flag rows[me*chunks + f] on it
//   slot W-1 (only with copy_local): this rank's own gathered rows, no flag
struct AgPushList {
  const AgGemmParams* p;
  uint32_t comm_index;

  struct Item {
    const char* src;
    char* dst;
    uint64_t bytes;
    uint64_t* flag;  // null: no flag
    int rank;        // destination rank
  };

  __device__ uint32_t chunks() const { return p->rows_per_rank / p->rows_per_flag; }
  __device__ uint32_t positions() const {
    const uint32_t slots = static_cast<uint32_t>(p->comm.local_world - 1) + (p->copy_local != 0 ? 1u : 0u);
    return slots * chunks();
  }
  __device__ uint32_t count() const {
    const uint32_t n = positions();
    return comm_index < n ? (n - comm_index + p->comm_ctas - 1) / p->comm_ctas : 0;
  }
  __device__ Item item(uint32_t k) const {
    const DeviceComm& c = p->comm;
    const uint32_t per = chunks();
    const uint32_t i = comm_index + k * p->comm_ctas;
    const uint32_t slot = i / per;
    const uint32_t f = i - slot * per;
    const int world = c.local_world;
    const int me = c.local_rank;
    const int rank = slot < static_cast<uint32_t>(world - 1) ? (me - 1 - static_cast<int>(slot) + 2 * world) % world : me;
    const uint64_t chunk_bytes = static_cast<uint64_t>(p->rows_per_flag) * p->row_bytes;
    const uint64_t first_row = static_cast<uint64_t>(me) * p->rows_per_rank + static_cast<uint64_t>(f) * p->rows_per_flag;
    Item it;
    it.src = p->shard + f * chunk_bytes;
    it.dst = reinterpret_cast<char*>(c.peer_heap_bases[rank]) + p->gathered_offset + first_row * p->row_bytes;
    it.bytes = chunk_bytes;
    it.flag = rank != me ? op_flag(c, rank, static_cast<uint64_t>(world) + static_cast<uint64_t>(me) * per + f) : nullptr;
    it.rank = rank;
    return it;
  }
  __device__ uint32_t pieces(uint32_t k) const {
    const uint64_t bytes = static_cast<uint64_t>(p->rows_per_flag) * p->row_bytes;
    return static_cast<uint32_t>((bytes + TpTunables::kPushPieceBytes - 1) / TpTunables::kPushPieceBytes);
  }
};

// Pushes a list of (src, dst, bytes, flag) items with the TMA bulk engine, one thread.
//
// Shared memory (in the compute role's stage area, which is free until run()):
//   ring[kStages][kPieceBytes]   kStages * kPieceBytes bytes
//   full[kStages]                kStages * 8 bytes (mbarriers, invalidated before the area is reused)
// Pieces of all items form one stream: loads run kStages - 1 pieces ahead of the stores, the
// stores of piece i form bulk group i, and the stage of piece i - 1 is reloaded once group i - 1
// has been read (wait_group.read 1). Item k's flag is published (system fence, release store)
// once its last group has completed: when kFlagLag newer groups exist, wait_group<kFlagLag>
// guarantees it; at the end, wait_group 0.
template <int kStages, uint32_t kPieceBytes, int kFlagLag>
struct ChunkPusher {
  static_assert(kStages >= 2, "the pusher overlaps loads and stores: at least two stages");
  static_assert(kPieceBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  static_assert(kFlagLag >= 0 && kFlagLag <= 8, "wait_group takes a small immediate");
  static constexpr uint32_t kRingBytes = kStages * kPieceBytes;
  static constexpr uint32_t kSmemBytes = kRingBytes + kStages * 8;

  uint8_t* ring;
  uint64_t* full;

  __device__ explicit ChunkPusher(uint8_t* base) : ring(base), full(reinterpret_cast<uint64_t*>(base + kRingBytes)) {}

  __device__ void init() const {
    for (int s = 0; s < kStages; ++s) cuda::ptx::mbarrier_init(&full[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  __device__ void invalidate() const {
    for (int s = 0; s < kStages; ++s) sm90::mbarrier_inval(&full[s]);
  }

  // Returns false after a failed wait (recorded); every issued load has landed and every store
  // has completed when it returns, either way.
  template <class List, class EnterFn>
  __device__ bool run(const List& list, uint64_t epoch, const WaitContext& ctx, EnterFn&& enter) const {
    const uint32_t items = list.count();
    if (items == 0) return true;
    // Load cursor (next piece to load), store cursor (next piece to store), flag cursor (oldest
    // item whose flag is not yet published; its last group is flag_end - 1).
    uint32_t ld_item = 0;
    uint64_t ld_off = 0, ld_seq = 0;
    uint32_t st_item = 0;
    uint64_t st_off = 0, st_seq = 0;
    uint32_t fl_item = 0;
    uint64_t fl_end = list.pieces(0);
    int entered_rank = -1;
    bool ok = true;

    auto load_next = [&]() {
      const typename List::Item it = list.item(ld_item);
      const uint64_t left = it.bytes - ld_off;
      const uint32_t size = static_cast<uint32_t>(left < kPieceBytes ? left : kPieceBytes);
      const uint32_t s = static_cast<uint32_t>(ld_seq % kStages);
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                           &full[s], size);
      cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, ring + s * kPieceBytes,
                               it.src + ld_off, size, &full[s]);
      ld_off += size;
      if (ld_off == it.bytes) {
        ++ld_item;
        ld_off = 0;
      }
      ++ld_seq;
    };
    auto publish = [&](uint32_t k) {
      const typename List::Item it = list.item(k);
      if (it.flag != nullptr) {
        __threadfence_system();
        flag_store_release(it.flag, epoch);
      }
    };

    while (ld_item < items && ld_seq < static_cast<uint64_t>(kStages - 1)) load_next();
    while (st_item < items) {
      const typename List::Item it = list.item(st_item);
      if (st_off == 0 && it.rank != entered_rank) {
        // First write into this destination in this launch: it must have entered.
        if (!enter(it.rank)) {
          ok = false;
          break;
        }
        entered_rank = it.rank;
      }
      const uint32_t s = static_cast<uint32_t>(st_seq % kStages);
      if (!mbarrier_wait_bounded(&full[s], static_cast<uint32_t>((st_seq / kStages) & 1), ctx)) {
        ok = false;
        break;
      }
      const uint64_t left = it.bytes - st_off;
      const uint32_t size = static_cast<uint32_t>(left < kPieceBytes ? left : kPieceBytes);
      cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, it.dst + st_off, ring + s * kPieceBytes,
                               size);
      cuda::ptx::cp_async_bulk_commit_group();
      st_off += size;
      if (st_off == it.bytes) {
        ++st_item;
        st_off = 0;
      }
      ++st_seq;
      // Publish the flags of items whose last group has completed.
      if (fl_item < st_item && st_seq - fl_end >= static_cast<uint64_t>(kFlagLag)) {
        cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<kFlagLag>{});
        cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
        while (fl_item < st_item && st_seq - fl_end >= static_cast<uint64_t>(kFlagLag)) {
          publish(fl_item);
          if (++fl_item < items) fl_end += list.pieces(fl_item);
        }
      }
      if (ld_item < items) {
        // The next load reuses the stage of piece st_seq - 2, whose group must have been read.
        cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<1>{});
        load_next();
      }
    }
    // Loads issued but never stored (after a failure) must land before the ring goes away;
    // their source is local memory, so this is short. The abort is already raised, hence the
    // plain (time-bounded) wait instead of the abort-aware one.
    for (; st_seq < ld_seq; ++st_seq) {
      drain_wait(&full[st_seq % kStages], static_cast<uint32_t>((st_seq / kStages) & 1));
    }
    cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    if (ok) {
      for (; fl_item < items; ++fl_item) publish(fl_item);
    }
    return ok;
  }

 private:
  __device__ static void drain_wait(uint64_t* bar, uint32_t parity) {
    const uint64_t give_up = global_timer_ns() + 100'000'000ull;  // 100 ms: a local load that never lands is a bug
    while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity) && global_timer_ns() < give_up) {
    }
  }
};

// The compute role's epilogue: out through the GEMM engine's TileEpilogue, the pieces of split
// tiles into this rank's piece slots (and their flags, from the signaler).
template <int kBlockM, int kBlockN>
class AgEpilogue {
 public:
  __device__ AgEpilogue(const AgGemmParams& p, uint64_t epoch) : p_(p), out_(p.epi, &p.out), epoch_(epoch) {}

  __device__ uint32_t out_dtype() const { return out_.out_dtype(); }
  __device__ bool signals() const { return p_.sched.split_pieces >= 2; }  // only pieces signal
  __device__ void prefetch() const {
    out_.prefetch();
    if (signals()) sm90::prefetch_tensormap(&p_.pieces.store);
  }
  __device__ void issue(const void* box, const gemm::WorkItem& tile, uint32_t row, uint32_t col) const {
    if (tile.kind != static_cast<uint32_t>(gemm::WorkKind::kTilePiece)) {
      out_.issue(box, tile, row, col);
      return;
    }
    p_.pieces.store_box<kBlockM, kBlockN>(box, tile, row, col);
  }
  __device__ void signal(const gemm::WorkItem& tile, uint32_t /*m_blocks*/, uint32_t /*n_blocks*/) const {
    if (tile.kind == static_cast<uint32_t>(gemm::WorkKind::kTilePiece)) p_.pieces.signal(p_.comm, tile, epoch_);
  }

 private:
  const AgGemmParams& p_;
  gemm::TileEpilogue<kBlockM> out_;
  uint64_t epoch_;
};

// The compute role's Fold policy: only the pieces of split tiles (no other rank's partials).
struct AgPieceFold {
  static constexpr bool kEnabled = true;
  __device__ AgPieceFold(const AgGemmParams& p, uint64_t epoch) : p_(p), epoch_(epoch) {}
  __device__ uint32_t world() const { return 1; }  // no other rank's partial is folded
  __device__ uint32_t self() const { return 0; }
  __device__ const sm90::TmaDescriptor* map() const { return &p_.pieces.load; }
  __device__ const sm90::TmaDescriptor* piece_map() const { return &p_.pieces.load; }
  __device__ int32_t source_row(const gemm::WorkItem& /*tile*/, uint32_t /*source*/) const { return 0; }  // none
  // Producer thread: every piece of the split tile is staged (bounded waits).
  __device__ bool wait_sources(const gemm::WorkItem& tile, const WaitContext& ctx) const {
    if (!p_.pieces.wait(p_.comm, tile, epoch_, ctx)) return false;
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // TMA reads the pieces next
    return true;
  }

 private:
  const AgGemmParams& p_;
  uint64_t epoch_;
};

using AgPusher = ChunkPusher<TpTunables::kPushStages, TpTunables::kPushPieceBytes, TpTunables::kPushFlagLag>;

// The communication role of one CTA (all threads call; thread 0 works). Returns, on every
// thread, whether the CTA may go on to compute.
template <class Cfg>
__device__ bool ag_push_shard(uint8_t* smem_raw, const AgGemmParams& p, uint32_t comm_index, uint64_t epoch,
                              const WaitContext& ctx) {
  // The ring, its barriers and the result word live in the stage buffers (no static shared
  // memory: the dynamic area already takes all but a few hundred bytes of the SM's).
  static_assert(AgPusher::kSmemBytes + 16 <= Cfg::kEpiOffset,
                "the push ring must fit in the compute role's stage buffers, which are free until run()");
  uint8_t* base = aligned_smem(smem_raw);
  volatile int* ok_word = reinterpret_cast<volatile int*>(base + AgPusher::kSmemBytes);
  const AgPusher pusher(base);
  if (threadIdx.x == 0) pusher.init();
  __syncthreads();
  if (threadIdx.x == 0) {
    const AgPushList list{&p, comm_index};
    const DeviceComm& c = p.comm;
    auto enter = [&](int rank) { return rank == c.local_rank || wait_entry(c, rank, epoch, p.signature, ctx); };
    *ok_word = pusher.run(list, epoch, ctx, enter) ? 1 : 0;
    pusher.invalidate();
    // The compute role's TMA loads (async proxy) overwrite what this thread wrote here.
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  }
  __syncthreads();
  const bool ok = *ok_word != 0;
  __syncthreads();  // the compute role's loads may overwrite the word next
  return ok;
}

template <class Cfg, bool kBF16, bool kBNMajor>
__global__ void __launch_bounds__(Cfg::kThreads, 1) ag_gemm_kernel(const __grid_constant__ AgGemmParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Scheduler = gemm::TileScheduler<Cfg::kBlockM>;
  using Epilogue = AgEpilogue<Cfg::kBlockM, Cfg::kBlockN>;
  using Role = gemm::ComputeRole<Cfg, kBF16, kBNMajor, Scheduler, Epilogue, Cfg::kSetMaxNReg, AgPieceFold>;
  const DeviceComm& c = p.comm;
  const uint64_t epoch = launch_epoch(c.epoch_state);
  const WaitContext ctx = WaitContext::start(c.wait, OpId::kAgGemm, epoch);
  publish_entry(c, epoch, p.signature);
  Role::init(smem);

  const TpRoleTable roles{p.comm_ctas};
  bool compute = true;
  if (roles.role_of(blockIdx.x) == TpRole::kCommunication) {
    compute = ag_push_shard<Cfg>(smem, p, roles.comm_index(blockIdx.x), epoch, ctx);
  }
  if (compute) {
    Scheduler sched(p.sched, epoch);
    Epilogue epi(p, epoch);
    const AgPieceFold fold(p, epoch);
    const uint32_t own_begin = static_cast<uint32_t>(c.local_rank) * p.rows_per_rank;
    const gemm::GemmOperands ops{&p.a_gathered, &p.b,    p.m,       p.n,
                                 p.k,           &p.a_local, own_begin, own_begin + p.rows_per_rank,
                                 p.timeline};
    (void)Role::run(smem, ops, sched, epi, roles.compute_index(blockIdx.x), gridDim.x, ctx, fold);
  }
  __syncthreads();
  if (threadIdx.x == 0) finish_queued_launch(p.state, c.epoch_state, epoch);
}

}  // namespace loom::kernels::tp
