// The attention engine: flash-attention forward on Hopper (sm_90a), one persistent kernel.
//
//   O[i] = sum_j softmax_j(scale * q_i . k_j) v_j   over the keys j visible to query i,
//   LSE[i] = log sum_j exp(scale * q_i . k_j)         (natural log, fp32)
//
// Grid: one CTA per SM (or fewer when there are fewer tiles); a tile is kBlockM = 64 * kConsumers
// query rows of one (batch, head). CTAs claim tiles from the launch's queue (an atomic counter) in
// the order of tile_at() (params.h), so the longest tiles go first and a CTA that finishes early
// takes the next one. Each CTA (FlashConfig::kThreads threads):
//   producer warpgroup   one thread claims a tile whenever a Q slot is free, hands it to the
//                        consumers with the slot (TileTask), loads Q once per tile and the tile's K
//                        and V blocks into a kStages-deep ring (TMA, 128B swizzle), K and V behind
//                        separate barriers so S = Q K^T can start before V lands; the other threads
//                        leave. Its last claim counts the CTA out; the last CTA resets the queue.
//   consumer warpgroup c rows [64c, 64c + 64): per K/V block, visited from the last one down (the
//                        masked blocks come first), S = Q K^T (wgmma, A and B in shared memory),
//                        the online softmax in fp32 registers (softmax.cuh), and O += P V with P
//                        in registers (register-sourced wgmma). The next block's Q K^T is issued
//                        before this block's softmax, O is rescaled while that Q K^T runs (before
//                        this block's P V is issued; with the lazy rescale only when a row's
//                        maximum moved by more than 2^8), and the consumers take turns issuing
//                        (named barriers kPingpongBarrier0 + c, in a cycle), so the others'
//                        softmax runs under one warpgroup's GEMMs. At the tile's end O / l and
//                        the LSE are stored straight from registers (rows past the sequence are
//                        not stored).
// Keys policy: what a tile attends to comes from `Keys` (SequenceKeys here: the tile's own
// sequence; ring attention's RingKeys: every rank's K/V as it arrives). It names the tile's query
// rows (view), the tile's key segments (KvSegment: a run of rows of some K/V tensor map with its
// positions), each query row's position, and, for keys that arrive from another rank, the wait
// before they are loaded. The loop below walks the segments' blocks in order, each segment from
// its last block down; causal masks compare positions.
// Synchronisation: q_full[t] (1 arrival + TMA bytes) / q_empty[t] (one arrival per consumer warp,
// after the tile's last Q K^T); k_full[s], v_full[s] (1 + TMA bytes) / k_empty[s], v_empty[s] (one
// arrival per consumer warp, after the wgmma that read the block). Every mbarrier wait is bounded
// (sm90::mbarrier_wait); a warpgroup whose wait failed keeps taking its pingpong turns (its wgmma
// then read stale shared memory, and nothing is stored), so the other warpgroup never waits for
// a turn that does not come. The wgmma are issued unconditionally: issuing them under a run-time
// condition makes ptxas serialize every wgmma of the kernel (C7515). Packed (varlen)
// offsets are checked by every CTA before anything is written: bad offsets write nothing and
// record DeviceError::kInvalidInput.
#pragma once

#include <cuda/ptx>

#include <cstdint>
#include <type_traits>

#include "kernels/attention/config.h"
#include "kernels/attention/flags.h"
#include "kernels/attention/params.h"
#include "kernels/attention/softmax.cuh"
#include "kernels/comm/epoch.cuh"
#include "kernels/comm/wait.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/gemm/pipeline.cuh"
#include "runtime/device_abi.h"

namespace loom::kernels::attention {

template <class Cfg>
struct FlashSmem {
  uint8_t* base;
  __device__ explicit FlashSmem(uint8_t* raw)
      : base(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023})) {}
  __device__ uint8_t* q(uint32_t t) const { return base + Cfg::kQOffset + t * Cfg::kQBytes; }
  __device__ uint8_t* k(uint32_t s) const { return base + Cfg::kKOffset + s * Cfg::kKVBytes; }
  __device__ uint8_t* v(uint32_t s) const { return base + Cfg::kVOffset + s * Cfg::kKVBytes; }
  __device__ uint64_t* bar(uint32_t i) const { return reinterpret_cast<uint64_t*>(base + Cfg::kBarrierOffset) + i; }
  __device__ uint64_t* q_full(uint32_t t) const { return bar(t); }
  __device__ uint64_t* q_empty(uint32_t t) const { return bar(Cfg::kQStages + t); }
  __device__ uint64_t* k_full(uint32_t s) const { return bar(2 * Cfg::kQStages + s); }
  __device__ uint64_t* k_empty(uint32_t s) const { return bar(2 * Cfg::kQStages + Cfg::kStages + s); }
  __device__ uint64_t* v_full(uint32_t s) const { return bar(2 * Cfg::kQStages + 2 * Cfg::kStages + s); }
  __device__ uint64_t* v_empty(uint32_t s) const { return bar(2 * Cfg::kQStages + 3 * Cfg::kStages + s); }
  __device__ uint32_t* scratch() const { return reinterpret_cast<uint32_t*>(base + Cfg::kScratchOffset); }
  __device__ TileTask* task(uint32_t t) const {
    return reinterpret_cast<TileTask*>(base + Cfg::kTaskOffset + t * Cfg::kTaskBytes);
  }
  __device__ SegmentInfo* segments(uint32_t t) const { return reinterpret_cast<SegmentInfo*>(task(t) + 1); }
};

// Where the tile's sequence lives (params.h SeqSpan).
__device__ __forceinline__ SeqSpan seq_span(const FlashParams& p, uint32_t batch) {
  if (p.cu_seqlens_q == nullptr) return SeqSpan{static_cast<int32_t>(batch), 0, 0, p.seqlen_q, p.seqlen_k};
  const int32_t q0 = p.cu_seqlens_q[batch], q1 = p.cu_seqlens_q[batch + 1];
  const int32_t k0 = p.cu_seqlens_k[batch], k1 = p.cu_seqlens_k[batch + 1];
  return SeqSpan{0, q0, k0, q1 - q0, k1 - k0};
}

// Every thread: whether the packed offsets are usable (each non-decreasing from >= 0, inside the
// tensors, no sequence longer than the planned maximum). Batched layouts pass at once.
__device__ __forceinline__ bool offsets_valid(const FlashParams& p, uint32_t* bad_index) {
  if (p.cu_seqlens_q == nullptr) return true;
  int bad = 0;
  for (int32_t b = static_cast<int32_t>(threadIdx.x); b < p.batch; b += static_cast<int32_t>(blockDim.x)) {
    const int32_t q0 = p.cu_seqlens_q[b], q1 = p.cu_seqlens_q[b + 1];
    const int32_t k0 = p.cu_seqlens_k[b], k1 = p.cu_seqlens_k[b + 1];
    const bool ok = q0 >= 0 && q1 >= q0 && q1 <= p.total_q && q1 - q0 <= p.seqlen_q && k0 >= 0 && k1 >= k0 &&
                    k1 <= p.total_k && k1 - k0 <= p.seqlen_k;
    if (!ok) {
      bad = 1;
      atomicMin(bad_index, static_cast<uint32_t>(b));
    }
  }
  return __syncthreads_or(bad) == 0;
}

// The query rows a tile covers: (batch, head, query block), where its sequence lives, first row.
struct TileView {
  TileCoord coord;
  SeqSpan span;
  int32_t m0;
};

// The standalone attention's keys: one segment, the tile's own sequence's K and V; query row i of
// a sequence sits at position i + len_k - len_q (causal masks aligned to the bottom right).
template <int kBlockM, int kBlockN, bool kCausal>
struct SequenceKeys {
  const FlashParams& p;
  uint32_t pairs;  // batch * heads_q

  __device__ explicit SequenceKeys(const FlashParams& params)
      : p(params), pairs(static_cast<uint32_t>(params.batch) * static_cast<uint32_t>(params.heads_q)) {}

  __device__ TileView view(uint32_t tile) const {
    TileView v;
    v.coord = tile_at(tile, p.m_blocks, p.heads_q, pairs, kCausal, p.section_heads);
    v.span = seq_span(p, v.coord.batch);
    v.m0 = static_cast<int32_t>(v.coord.m_block) * kBlockM;
    return v;
  }
  static constexpr SegmentWalk kWalk = SegmentWalk::kOne;
  __device__ int segments(const TileView&) const { return 1; }
  __device__ int32_t q_pos(const TileView& v, int32_t row) const { return row + v.span.len_k - v.span.len_q; }
  __device__ KvSegment segment(const TileView& v, int) const {
    int32_t visible = v.span.len_k;
    if constexpr (kCausal) visible = min(visible, q_pos(v, v.m0 + kBlockM - 1) + 1);
    const int32_t blocks = visible > 0 ? (visible + kBlockN - 1) / kBlockN : 0;
    return KvSegment{&p.k_map, &p.v_map, v.span.k_row0, v.span.batch_coord, v.span.len_k, 0, -1, blocks};
  }
  // Keys of another rank: none here.
  __device__ bool await_rows(const KvSegment&, int32_t, int32_t, const WaitContext&) const { return true; }
};

// Entry i of a tile's segment table. The general walk (SegmentWalk::kAny), which reads it at every
// segment change and masked block, holds the table's shared-memory address (one register, one
// ld.shared); the others read it once per tile through the generic pointer, with which their loops
// compiled best (the ring's non-causal loop re-read the shared window base and spilled with the
// address: ptxas, hd128).
template <SegmentWalk kWalk>
using SegmentTable = std::conditional_t<kWalk == SegmentWalk::kAny, uint32_t, const SegmentInfo*>;
__device__ __forceinline__ SegmentInfo load_segment(const SegmentInfo* table, int i) { return table[i]; }
__device__ __forceinline__ SegmentInfo load_segment(uint32_t table, int i) {
  SegmentInfo s;
  asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(s.len), "=r"(s.pos0), "=r"(s.blocks), "=r"(s.unused)
               : "r"(table + static_cast<uint32_t>(sizeof(SegmentInfo)) * static_cast<uint32_t>(i)));
  return s;
}

// A consumer's place in the tile's key blocks: segment `seg`, block `n` of it (segments in order,
// each from its last block down), and the keys of the segment this thread's two rows may see. It
// reads the segments from the tile task's table (shared memory), so the keys policy's arithmetic
// stays out of the consumers' registers. The general walk (SegmentWalk::kAny) keeps only seg, n
// and first_masked across blocks and recomputes the rows' visible keys for the few masked blocks
// (key_end stays dead there): two registers fewer in a loop that spilled with them.
template <int kBlockN, bool kCausal>
struct BlockCursor {
  int seg;
  int n;
  int blocks;        // the segment's blocks
  int key_end[2];    // keys [0, key_end[r]) of the segment are visible to row r
  int first_masked;  // blocks at or above this index need masking

  // Keys [0, end[r]) of segment `s` are visible to the row at position qpos[r].
  __device__ static void ends_of(const SegmentInfo& s, const int (&qpos)[2], int (&end)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) end[r] = kCausal ? max(0, min(s.len, qpos[r] - s.pos0 + 1)) : s.len;
  }
  // qpos: the positions of this thread's two rows; table: the segments (SegmentTable).
  template <class Table>
  __device__ void enter(Table table, const int (&qpos)[2], int i) {
    seg = i;
    const SegmentInfo s = load_segment(table, i);
    blocks = s.blocks;
    n = s.blocks - 1;
    ends_of(s, qpos, key_end);
    first_masked = min(key_end[0], key_end[1]) / kBlockN;
  }
  // The first block of the tile (the tile has at least one).
  template <class Table>
  __device__ void start(Table table, const int (&qpos)[2]) {
    enter(table, qpos, 0);
    while (n < 0) enter(table, qpos, seg + 1);
  }
  template <class Table>
  __device__ void next(Table table, const int (&qpos)[2]) {
    if (--n >= 0) return;
    do enter(table, qpos, seg + 1);
    while (n < 0);
  }
  // SegmentWalk::kEqual: every segment has this one's blocks and visible keys, so the walk wraps
  // to the next segment's last block (a countdown: no division, no table read in the loop).
  __device__ void next_equal() { n = (n > 0 ? n : blocks) - 1; }
  __device__ bool masked() const { return n >= first_masked; }
};

template <class Cfg, bool kBF16, bool kCausal, class Keys>
struct FlashForward {
  using Smem = FlashSmem<Cfg>;
  static constexpr int BM = Cfg::kBlockM;
  static constexpr int BN = Cfg::kBlockN;
  static constexpr int D = Cfg::kHeadDim;
  static constexpr int kSRegs = BN / 2;  // S accumulators per consumer thread
  static constexpr int kORegs = D / 2;   // O accumulators per consumer thread
  static constexpr int kPRegs = BN / 4;  // P as pairs of 16-bit values
  static constexpr uint32_t kPingpongThreads = 2 * 128;  // the warpgroup waiting and the one handing over
  static_assert(Cfg::kConsumers <= kMaxConsumers, "a pingpong barrier per consumer: at most kMaxConsumers");
  static constexpr uint32_t kEmptyArrivals = Cfg::kConsumers * 4;  // one per consumer warp
  using KvState = gemm::PipelineState<Cfg::kStages>;
  using QState = gemm::PipelineState<Cfg::kQStages>;
  using Softmax = OnlineSoftmax<BN, Cfg::kLazyRescale>;

  __device__ static void init(const Smem& sm) {
    if (threadIdx.x == 0) {
      const uint32_t empty_arrivals = kEmptyArrivals;  // by value: cuda::ptx takes references
      for (uint32_t t = 0; t < Cfg::kQStages; ++t) {
        cuda::ptx::mbarrier_init(sm.q_full(t), 1);
        cuda::ptx::mbarrier_init(sm.q_empty(t), empty_arrivals);
      }
      for (uint32_t s = 0; s < Cfg::kStages; ++s) {
        cuda::ptx::mbarrier_init(sm.k_full(s), 1);
        cuda::ptx::mbarrier_init(sm.k_empty(s), empty_arrivals);
        cuda::ptx::mbarrier_init(sm.v_full(s), 1);
        cuda::ptx::mbarrier_init(sm.v_empty(s), empty_arrivals);
      }
      cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
    }
    __syncthreads();
  }

  // ---- producer (one thread) --------------------------------------------------------------------

  __device__ static void load_boxes(const sm90::TmaDescriptor* map, uint8_t* dst, uint32_t box_bytes, int32_t head,
                                    int32_t row, int32_t batch, uint64_t* bar) {
#pragma unroll
    for (int c = 0; c < Cfg::kDChunks; ++c) {
      const int32_t coords[4] = {64 * c, head, row, batch};
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, dst + c * box_bytes, map,
                                      coords, bar);
    }
  }

  // The next tile of the queue that has query rows (tiles past a packed sequence's end have none),
  // or TileTask::kEnd.
  __device__ static uint32_t claim(const FlashParams& p, const Keys& keys) {
    for (;;) {
      const uint32_t t = atomicAdd(&p.queue->tile_queue, 1u);
      if (t >= p.num_tiles) return TileTask::kEnd;
      const TileView v = keys.view(t);
      if (v.m0 < v.span.len_q) return t;
    }
  }

  // Writes the task of Q slot `slot`: the tile and its segments' table; returns its key blocks.
  __device__ static int post_task(const Smem& sm, uint32_t slot, const Keys& keys, uint32_t tile) {
    TileTask* task = sm.task(slot);
    SegmentInfo* table = sm.segments(slot);
    int total = 0, count = 0;
    if (tile != TileTask::kEnd) {
      const TileView v = keys.view(tile);
      count = keys.segments(v);
      for (int i = 0; i < count; ++i) {
        const KvSegment seg = keys.segment(v, i);
        table[i] = SegmentInfo{seg.len, seg.pos0, seg.blocks, 0};
        total += seg.blocks;
      }
    }
    task->tile = tile;
    task->kv_blocks = total;
    task->segments = count;
    return total;
  }

  __device__ static void producer(const Smem& sm, const FlashParams& p, const Keys& keys, const WaitContext& ctx) {
    constexpr uint32_t kQBytes = Cfg::kQBytes;  // by value: cuda::ptx takes references
    constexpr uint32_t kKVBytes = Cfg::kKVBytes;
    sm90::prefetch_tensormap(&p.q_map);
    sm90::prefetch_tensormap(&p.k_map);
    sm90::prefetch_tensormap(&p.v_map);
    QState q{0, 0};
    KvState kv{0, 0};
    const uint32_t group = static_cast<uint32_t>(p.heads_q / p.heads_kv);
    for (;;) {
      // Claim only when a slot is free: the claimed tile starts at once (longest first holds).
      if (!q.wait_released(sm.q_empty(q.index), ctx, BarrierWhat::kTileEmpty)) break;
      const uint32_t tile = claim(p, keys);
      const int blocks = post_task(sm, q.index, keys, tile);
      if (tile == TileTask::kEnd || blocks == 0) {
        (void)cuda::ptx::mbarrier_arrive(sm.q_full(q.index));  // the task alone, no data
        q.advance();
        if (tile == TileTask::kEnd) break;
        continue;
      }
      const TileView v = keys.view(tile);
      const int32_t head_kv = static_cast<int32_t>(v.coord.head / group);
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                           sm.q_full(q.index), kQBytes);
      load_boxes(&p.q_map, sm.q(q.index), Cfg::kQBoxBytes, static_cast<int32_t>(v.coord.head), v.span.q_row0 + v.m0,
                 v.span.batch_coord, sm.q_full(q.index));
      q.advance();

      bool ok = true;
      for (int i = 0; i < keys.segments(v) && ok; ++i) {
        const KvSegment seg = keys.segment(v, i);
        for (int n = seg.blocks - 1; n >= 0; --n) {
          const int32_t row = seg.row0 + n * BN;
          if (seg.source >= 0) {
            ok = keys.await_rows(seg, n * BN, min(seg.len, (n + 1) * BN), ctx);
            if (!ok) break;
          }
          ok = kv.wait_released(sm.k_empty(kv.index), ctx, BarrierWhat::kStageEmpty);
          if (!ok) break;
          cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                               sm.k_full(kv.index), kKVBytes);
          load_boxes(seg.k_map, sm.k(kv.index), Cfg::kKVBoxBytes, head_kv, row, seg.batch_coord, sm.k_full(kv.index));
          ok = kv.wait_released(sm.v_empty(kv.index), ctx, BarrierWhat::kStageEmpty);
          if (!ok) break;
          cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                               sm.v_full(kv.index), kKVBytes);
          load_boxes(seg.v_map, sm.v(kv.index), Cfg::kKVBoxBytes, head_kv, row, seg.batch_coord, sm.v_full(kv.index));
          kv.advance();
        }
      }
      if (!ok) break;
    }
  }

  // ---- consumers ---------------------------------------------------------------------------------

  // S = Q K^T for this warpgroup's 64 rows of Q slot `q_slot` and the K block in stage `stage`.
  __device__ static void issue_qk(const Smem& sm, uint32_t consumer, uint32_t q_slot, uint32_t stage,
                                  float (&s)[kSRegs]) {
    const uint64_t dq = sm90::make_smem_desc_sw128(sm90::smem_u32(sm.q(q_slot)) + consumer * 64 * 128, 16, 1024);
    const uint64_t dk = sm90::make_smem_desc_sw128(sm90::smem_u32(sm.k(stage)), 16, 1024);
    sm90::fence_operands(s);
    sm90::wgmma_fence();
#pragma unroll
    for (int c = 0; c < Cfg::kDChunks; ++c) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {  // 16 columns of D (32 bytes of a 128-byte row) per step
        const uint64_t a = dq + static_cast<uint64_t>((c * Cfg::kQBoxBytes + kk * 32) >> 4);
        const uint64_t b = dk + static_cast<uint64_t>((c * Cfg::kKVBoxBytes + kk * 32) >> 4);
        sm90::wgmma_m64k16<BN, kBF16, 0>(s, a, b, (c > 0 || kk > 0) ? 1u : 0u);
      }
    }
    sm90::wgmma_commit();
    sm90::fence_operands(s);
  }

  // O += P V for the V block in stage `stage`: V is read N-major (D contiguous); the next 16 keys
  // are 16 rows = 2048 bytes further, the next 64 columns of D one box (kKVBoxBytes) further.
  __device__ static void issue_pv(const Smem& sm, uint32_t stage, uint32_t (&p)[kPRegs], float (&o)[kORegs]) {
    const uint64_t dv = sm90::make_smem_desc_sw128(sm90::smem_u32(sm.v(stage)), Cfg::kKVBoxBytes, 1024);
    sm90::fence_operands(o);
    sm90::fence_operands(p);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
      sm90::wgmma_m64k16_rs<D, kBF16, 1>(o, a, dv + static_cast<uint64_t>((kk * 16 * 128) >> 4), 1u);
    }
    sm90::wgmma_commit();
    sm90::fence_operands(o);
    sm90::fence_operands(p);
  }

  // A consumer warp is done with a stage's buffer: its lane 0 arrives on the empty barrier.
  __device__ static void release(uint64_t* empty) {
    if (threadIdx.x % 32 == 0) (void)cuda::ptx::mbarrier_arrive(empty);
  }

  // Masks the scores of block `n` of the segment that this thread's rows may not see: keys at or
  // past key_end[r] (the segment's end, or under causal masking the row's position).
  __device__ static void mask_block(float (&s)[kSRegs], int n, const int (&key_end)[2]) {
    const int col0 = n * BN + 2 * static_cast<int>(threadIdx.x % 4);
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) {
      const int col = col0 + 8 * (i / 4) + (i & 1);
      if (col >= key_end[(i >> 1) & 1]) s[i] = Softmax::kNegInf;
    }
  }

  // Masks the cursor's block: the general walk recomputes the rows' visible keys (see BlockCursor).
  __device__ static void mask_cursor_block(float (&s)[kSRegs], const BlockCursor<BN, kCausal>& cur,
                                           SegmentTable<Keys::kWalk> table, const int (&qpos)[2]) {
    if constexpr (Keys::kWalk == SegmentWalk::kAny) {
      int end[2];
      BlockCursor<BN, kCausal>::ends_of(load_segment(table, cur.seg), qpos, end);
      mask_block(s, cur.n, end);
    } else {
      mask_block(s, cur.n, cur.key_end);
    }
  }

  // Stores this thread's two rows of O (already divided by l) and their LSE; nothing when `write`
  // is false (a failed wait). Every thread of the warp calls it (the 16-bit path shuffles within
  // each quad), at the same point as the wgmma before it.
  __device__ static void store_rows(const FlashParams& p, const SeqSpan& span, uint32_t head, int row_in_seq0,
                                    const float (&o)[kORegs], const float (&inv_sum)[2], const float (&lse)[2],
                                    bool write) {
    const int quad_lane = static_cast<int>(threadIdx.x % 4);  // the thread's place in the quad sharing its rows
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_in_seq0 + 8 * r;
      const bool store = write && row < span.len_q;  // the quad shares the row
      const int64_t out_row = static_cast<int64_t>(span.q_row0 + row);
      const int64_t base = out_row * p.out_stride_row + static_cast<int64_t>(head) * p.out_stride_head +
                           static_cast<int64_t>(span.batch_coord) * p.out_stride_batch;
      if (p.out_f32) {
        if (!store) continue;
        float* out = static_cast<float*>(p.out) + base;
#pragma unroll
        for (int j = 0; j < kORegs / 4; ++j) {
          *reinterpret_cast<float2*>(out + 8 * j + 2 * quad_lane) =
              make_float2(o[4 * j + 2 * r] * inv_sum[r], o[4 * j + 2 * r + 1] * inv_sum[r]);
        }
      } else {
        // The quad's four threads hold columns 8j + 2q, 8j + 2q + 1 of every 8-column group j;
        // transposed across the quad in runs of four groups, each thread stores one group's 16
        // bytes: a quarter of the store instructions, each writing whole 32-byte sectors (the
        // planner requires 16-byte aligned out and strides that are multiples of 8 elements).
        static_assert(kORegs % 16 == 0, "the 16-bit store transposes runs of four 8-column groups");
        uint16_t* out = static_cast<uint16_t*>(p.out) + base;
#pragma unroll
        for (int g = 0; g < kORegs / 16; ++g) {
          uint32_t w[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int j = 4 * g + i;
            w[i] = pack_half2<kBF16>(o[4 * j + 2 * r] * inv_sum[r], o[4 * j + 2 * r + 1] * inv_sum[r]);
          }
          transpose_quad(w, quad_lane);
          if (store) *reinterpret_cast<uint4*>(out + 8 * (4 * g + quad_lane)) = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
      if (store && p.lse != nullptr && quad_lane == 0) {
        p.lse[static_cast<int64_t>(span.batch_coord) * p.lse_stride_batch +
              static_cast<int64_t>(head) * p.lse_stride_head + out_row] = lse[r];
      }
    }
  }

  // w[i] of quad lane L is element (L, i) of a 4 x 4 matrix held by the quad; afterwards it is element
  // (i, L). Two exchanges: the off-diagonal 2 x 2 blocks (lanes L, L ^ 2), then the off-diagonal
  // elements within each block (lanes L, L ^ 1); each lane sends and overwrites the same index.
  __device__ __forceinline__ static void transpose_quad(uint32_t (&w)[4], int lane) {
    const bool hi = (lane & 2) != 0;
#pragma unroll
    for (int i0 = 0; i0 < 2; ++i0) {
      const uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? w[i0] : w[2 + i0], 2);
      if (hi) w[i0] = got;
      else w[2 + i0] = got;
    }
    const bool odd = (lane & 1) != 0;
#pragma unroll
    for (int i1 = 0; i1 < 2; ++i1) {
      const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? w[2 * i1] : w[2 * i1 + 1], 1);
      if (odd) w[2 * i1] = got;
      else w[2 * i1 + 1] = got;
    }
  }

  __device__ static void consumer(const Smem& sm, const FlashParams& p, const Keys& keys, const WaitContext& ctx,
                                  uint32_t consumer) {
    // Turns go round the consumers: this one's, then the next one's.
    const uint32_t my_turn = kPingpongBarrier0 + consumer;
    const uint32_t their_turn = kPingpongBarrier0 + (consumer + 1) % Cfg::kConsumers;
    // This thread's first row within the tile (the second is 8 further).
    const int tile_row0 = static_cast<int>(64 * consumer + 16 * ((threadIdx.x % 128) / 32) + (threadIdx.x % 32) / 4);
    if (consumer == Cfg::kConsumers - 1) {
      sm90::named_barrier_arrive(kPingpongBarrier0, kPingpongThreads);  // consumer 0 issues first
    }

    QState q{0, 0};
    KvState k_stage{0, 0}, v_stage{0, 0};
    bool ok = true;
    float o[kORegs];
    float s[kSRegs];
    uint32_t pr[kPRegs];
    Softmax softmax;
    BlockCursor<BN, kCausal> cur;

    for (;;) {
      // Every consumer reads every task, so they all take the same number of pingpong turns. A
      // failed wait here ends them all at the same place (they wait on the same barrier).
      if (!q.wait_filled(sm.q_full(q.index), ctx, BarrierWhat::kTileFull)) break;
      const TileTask task = load_task(sm.task(q.index));
      if (task.tile == TileTask::kEnd) break;
      const TileView v = keys.view(task.tile);
      const int n_blocks = task.kv_blocks;
      const int row0 = v.m0 + tile_row0;  // this thread's first row in the sequence
      SegmentTable<Keys::kWalk> table;
      if constexpr (Keys::kWalk == SegmentWalk::kAny) table = sm90::smem_u32(sm.segments(q.index));
      else table = sm.segments(q.index);
      softmax.reset();
      if (n_blocks == 0) {  // no visible key: O = 0, LSE = -inf
        release(sm.q_empty(q.index));
        q.advance();
#pragma unroll
        for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
        const float inv[2] = {0.f, 0.f}, lse[2] = {Softmax::kNegInf, Softmax::kNegInf};
        store_rows(p, v.span, v.coord.head, row0, o, inv, lse, ok);
        continue;
      }
      const int qpos[2] = {keys.q_pos(v, row0), keys.q_pos(v, row0 + 8)};
      cur.start(table, qpos);
#pragma unroll
      for (int i = 0; i < kORegs; ++i) o[i] = 0.f;

      // The last K block first: S, then the softmax that starts the running max and sum.
      ok = ok && k_stage.wait_filled(sm.k_full(k_stage.index), ctx, BarrierWhat::kStageFull);
      sm90::named_barrier_sync(my_turn, kPingpongThreads);
      issue_qk(sm, consumer, q.index, k_stage.index, s);
      sm90::named_barrier_arrive(their_turn, kPingpongThreads);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(s);
      if (ok) release(sm.k_empty(k_stage.index));
      k_stage.advance();
      if (n_blocks == 1) {
        if (ok) release(sm.q_empty(q.index));
        q.advance();
      }
      float rescale[2];
      if (cur.masked()) mask_cursor_block(s, cur, table, qpos);
      bool rescale_o = softmax.update(s, p.scale_log2, rescale);
      convert_p<BN, kBF16>(s, pr);

      // Then per block: issue the next block's S, rescale O by the factor of the block whose P is
      // ready while that runs, issue its P V, run the next block's softmax while both run.
      for (int left = n_blocks - 1; left > 0; --left) {
        if constexpr (Keys::kWalk == SegmentWalk::kOne) cur.n = left - 1;
        else if constexpr (Keys::kWalk == SegmentWalk::kEqual) cur.next_equal();
        else cur.next(table, qpos);
        ok = ok && k_stage.wait_filled(sm.k_full(k_stage.index), ctx, BarrierWhat::kStageFull);
        ok = ok && v_stage.wait_filled(sm.v_full(v_stage.index), ctx, BarrierWhat::kStageFull);
        sm90::named_barrier_sync(my_turn, kPingpongThreads);
        issue_qk(sm, consumer, q.index, k_stage.index, s);
        rescale_rows(o, rescale, rescale_o);
        issue_pv(sm, v_stage.index, pr, o);
        sm90::named_barrier_arrive(their_turn, kPingpongThreads);
        sm90::wgmma_wait<1>();
        sm90::fence_operands(s);
        if (ok) release(sm.k_empty(k_stage.index));
        k_stage.advance();
        if (left == 1) {
          if (ok) release(sm.q_empty(q.index));
          q.advance();
        }
        if (cur.masked()) mask_cursor_block(s, cur, table, qpos);
        rescale_o = softmax.update(s, p.scale_log2, rescale);
        sm90::wgmma_wait<0>();
        sm90::fence_operands(o);
        if (ok) release(sm.v_empty(v_stage.index));
        v_stage.advance();
        convert_p<BN, kBF16>(s, pr);
      }

      // The first block's P V, then O / l.
      ok = ok && v_stage.wait_filled(sm.v_full(v_stage.index), ctx, BarrierWhat::kStageFull);
      sm90::named_barrier_sync(my_turn, kPingpongThreads);
      rescale_rows(o, rescale, rescale_o);
      issue_pv(sm, v_stage.index, pr, o);
      sm90::named_barrier_arrive(their_turn, kPingpongThreads);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      if (ok) release(sm.v_empty(v_stage.index));
      v_stage.advance();

      float inv_sum[2], lse[2];
      softmax.finish(inv_sum, lse);
      const TileView end = keys.view(task.tile);  // recomputed: not kept live through the loop
      store_rows(p, end.span, end.coord.head, row0, o, inv_sum, lse, ok);
    }
  }

  // O *= the rescale factor of its row; with the lazy rescale only when a row of the warp moved
  // its maximum (most blocks after a tile's first do not). The vote keeps the branch uniform
  // across the warp.
  __device__ __forceinline__ static void rescale_rows(float (&o)[kORegs], const float (&rescale)[2], bool moved) {
    if constexpr (Cfg::kLazyRescale) {
      if (!__any_sync(0xffffffffu, moved)) return;
    }
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[i] *= rescale[(i >> 1) & 1];
  }

  // A task the producer wrote before completing the slot's q_full phase.
  __device__ static TileTask load_task(const TileTask* slot) {
    const volatile TileTask* v = slot;
    return TileTask{v->tile, v->kv_blocks, v->segments, 0};
  }
};

// The compute role of any attention kernel: all threads of the CTA call it after init(); the
// producer warpgroup hands its registers to the consumers. Returns when the launch's queue is
// empty (or after a failed wait); the caller leaves the queue.
template <class Cfg, bool kBF16, bool kCausal, class Keys>
__device__ void run_attention(const typename FlashForward<Cfg, kBF16, kCausal, Keys>::Smem& sm, const FlashParams& p,
                              const Keys& keys, const WaitContext& ctx) {
  using Fwd = FlashForward<Cfg, kBF16, kCausal, Keys>;
  if (static_cast<WarpGroupRole>(threadIdx.x / 128) == WarpGroupRole::kProducer) {
    sm90::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) Fwd::producer(sm, p, keys, ctx);
  } else {
    sm90::setmaxnreg_inc<Cfg::kConsumerRegs>();
    Fwd::consumer(sm, p, keys, ctx, threadIdx.x / 128 - 1);
  }
}

template <class Cfg, bool kBF16, bool kCausal>
__global__ void __launch_bounds__(Cfg::kThreads, 1) sm90_flash_fwd_kernel(const __grid_constant__ FlashParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Keys = SequenceKeys<Cfg::kBlockM, Cfg::kBlockN, kCausal>;
  using Fwd = FlashForward<Cfg, kBF16, kCausal, Keys>;
  const WaitContext ctx = WaitContext::start(p.wait, kAttentionOp, p.epoch);
  const typename Fwd::Smem sm(smem);
  Fwd::init(sm);
  // Packed offsets: checked before anything is written (the first CTA records why).
  uint32_t* bad_batch = sm.scratch();
  if (threadIdx.x == 0) *bad_batch = ~0u;
  __syncthreads();
  if (!offsets_valid(p, bad_batch)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      ctx.fail(DeviceError::kInvalidInput, -1, FlagKind::kNone, *bad_batch, 0, 0);
    }
    return;  // nothing claimed from the queue
  }
  const Keys keys(p);
  run_attention<Cfg, kBF16, kCausal, Keys>(sm, p, keys, ctx);
  __syncthreads();
  if (threadIdx.x == 0) leave_queue(p.queue);
}

}  // namespace loom::kernels::attention
