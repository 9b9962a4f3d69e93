// The MoE family's tunables, its buffers (with their size formulas) and the words host and device
// share (plain data, no CUDA headers: the planner and the CPU tests use the same definitions).
//
// Symbols: W local ranks, E experts (El = E / W per rank), k top-k, T tokens of a rank (at most
// Tmax = MoeConfig::max_tokens), C receive rows per rank (capacity), R = kArrivalRows.
#pragma once

#include <cstdint>

#include "kernels/moe/grouped_gemm_params.h"
#include "runtime/device_abi.h"  // LOOM_HOST_DEVICE

namespace loom::kernels::moe {

// Every tunable of the MoE kernels (host launchers and the planner read them too).
struct MoeTunables {
  static constexpr int kThreads = 256;  // every MoE kernel's CTA
  static constexpr int kWarps = kThreads / 32;
  // Limits (data-structure sizes, not hardware): a token's slots are the lanes of one warp;
  // destination sets are 32-bit masks; the routing keeps one histogram per warp in shared memory.
  static constexpr int kMaxTopK = 32;
  static constexpr int kMaxLocalWorld = 32;
  static constexpr int kMaxExperts = 1024;
  // Routing: one warp ranks the (token, slot) pairs of kChunkTokens consecutive tokens in order.
  static constexpr int kChunkTokens = 256;
  // Dispatch: one arrival counter (and one ready flag) per kArrivalRows receive rows; the arrival
  // role gets 1 / kArrivalShareDen of the CTAs (at least one); kCopyUnroll 16-byte vectors in
  // flight per lane while a warp copies a row.
  static constexpr int kArrivalRows = 64;
  static constexpr int kArrivalShareDen = 4;
  // An arrival CTA takes its blocks kArrivalWindow at a time, each window's in completion order
  // (a bit mask of one thread).
  static constexpr uint32_t kArrivalWindow = 32;
  static constexpr int kCopyUnroll = 4;
  // moe_dispatch_gemm: the CTAs that push (1 / kFusedPushShareDen of the grid) and complete
  // receive blocks (1 / kFusedArrivalShareDen) before they join the expert GEMM.
  static constexpr int kFusedPushShareDen = 4;
  static constexpr int kFusedArrivalShareDen = 4;
  // Combine: the most CTAs (one "read done" flag each).
  static constexpr int kMaxCtas = 1024;
};
static_assert(MoeTunables::kThreads % 32 == 0 && MoeTunables::kThreads >= 64,
              "MoE kernels work in whole warps and need at least two of them");
static_assert(MoeTunables::kArrivalWindow <= 32, "an arrival window's pending blocks are one 32-bit mask");
static_assert(MoeTunables::kMaxTopK <= 32, "a token's slots are the lanes of one warp: top-k cannot exceed 32");
static_assert(MoeTunables::kMaxLocalWorld <= 32, "destination sets are 32-bit masks: at most 32 local ranks");
static_assert(MoeTunables::kMaxLocalWorld <= MoeTunables::kThreads,
              "the routing's coordinator gives each rank one thread: kThreads must cover kMaxLocalWorld");

// What the routing found wrong with its input (MoeStatusWords::code).
enum class MoeError : int32_t {
  kNone = 0,
  kBadExpert = 1,  // an expert id outside [0, E) and not -1 (rank, token, slot, value name the first)
  kCapacity = 2,   // MoeOverflow::kError and a rank's rows exceed C (rank names it, token holds its rows)
};

// The routing's report, at the start of the plan buffer (written by the routing's coordinator
// CTA every call; dispatch and combine read `code` and `kept_rows`; moe_report copies it out).
struct MoeStatusWords {
  int32_t code;           // MoeError
  int32_t rank;           // the rank the error is about: the source of a bad id, or the rank over capacity
  int64_t token;          // kBadExpert: the token; kCapacity: that rank's rows
  int32_t slot;           // kBadExpert: the slot
  int32_t value;          // kBadExpert: the id
  int64_t recv_rows;      // rows routed to this rank
  int64_t kept_rows;      // rows in this rank's receive buffer (0 after an error)
  int64_t dropped_rows;   // recv_rows - kept_rows (kDrop)
  int64_t dropped_slots;  // this rank's pairs that found no room (kDrop; added by every routing CTA)
  int64_t max_recv_rows;  // over all ranks
  int64_t num_tokens;     // T
  uint64_t epoch;         // launch epoch of the routing
  uint64_t pad[6];
};
static_assert(sizeof(MoeStatusWords) == 128, "the status words fill 128 bytes at the start of the plan");

// One receive row's origin, written by its sender beside the row (16 bytes, one vector store).
struct alignas(16) RecvRow {
  int32_t token;    // the token's index on its source rank
  int32_t source;   // source rank << 8 | slot
  float weight;     // the slot's router weight
  int32_t primary;  // the row that crossed NVLink for this token (== this row for the first one)
};
static_assert(sizeof(RecvRow) == 16, "a receive row's origin is one 16-byte store");

// A routed slot: slot_dest[t*k + j] = d * C + row (row < C on rank d), or -1 (unused, dropped, or
// the routing failed). d * C + row < W * C <= INT32_MAX (checked by the planner).
inline constexpr int32_t kNoSlot = -1;

LOOM_HOST_DEVICE constexpr uint64_t align_up(uint64_t bytes, uint64_t to) { return (bytes + to - 1) / to * to; }

// The routing's words in the count table: a header, then the E expert counts.
inline constexpr uint32_t kCountHeaderInts = 4;  // code, token, slot, value of the source's first bad id
LOOM_HOST_DEVICE constexpr uint32_t count_row_ints(uint32_t experts) {
  return static_cast<uint32_t>(align_up(kCountHeaderInts + experts, 4));
}
LOOM_HOST_DEVICE constexpr uint64_t routing_chunks(uint64_t tokens) {
  return (tokens + MoeTunables::kChunkTokens - 1) / MoeTunables::kChunkTokens;
}
LOOM_HOST_DEVICE constexpr uint64_t arrival_blocks(uint64_t capacity) {
  return (capacity + MoeTunables::kArrivalRows - 1) / MoeTunables::kArrivalRows;
}

// The plan buffer (device memory of this GPU, the caller's; offsets from its start, each region
// 256-byte aligned):
//   status        MoeStatusWords                          128 B
//   slot_dest     int32 [Tmax * k]                        (kNoSlot or d * C + row)
//   slot_weight   fp32  [Tmax * k]                        the router weights (1 when none given)
//   chunk_counts  int32 [ceil(Tmax / kChunkTokens)][E]    each chunk's histogram, then its exclusive prefix
//   send_base     int32 [E]                               where this rank's rows of expert e start on its rank
struct PlanLayout {
  uint64_t status, slot_dest, slot_weight, chunk_counts, send_base, bytes;

  LOOM_HOST_DEVICE static PlanLayout make(uint64_t max_tokens, uint32_t top_k, uint32_t experts) {
    PlanLayout l{};
    const uint64_t pairs = max_tokens * top_k;
    l.status = 0;
    l.slot_dest = align_up(sizeof(MoeStatusWords), 256);
    l.slot_weight = l.slot_dest + align_up(4 * pairs, 256);
    l.chunk_counts = l.slot_weight + align_up(4 * pairs, 256);
    l.send_base = l.chunk_counts + align_up(4 * routing_chunks(max_tokens) * experts, 256);
    l.bytes = l.send_base + align_up(4ull * experts, 256);
    return l;
  }
};

// moe_dispatch_gemm's tile table over C receive rows of El local experts: the grouped GEMM's
// workspace for a contiguous layout of C rows (header, then one GroupedTileRow per tile row, sized
// for the smallest BLOCK_M so that any tile the planner picks fits).
LOOM_HOST_DEVICE constexpr uint64_t tile_table_bytes(uint64_t capacity, uint64_t local_experts) {
  return kGroupedWorkspaceHeaderBytes +
         sizeof(GroupedTileRow) * grouped_max_tile_rows(GroupedRows::kContiguous, capacity, local_experts,
                                                        GroupedGemmTunables::kMinBlockM);
}

// The MoE family's symmetric workspace (ops::family_workspace "moe"; equal offsets on every rank;
// offsets from its start, each region 256-byte aligned). Who writes each region, and which call
// zeroes it in stream order just before its kernel (peers write into a rank only after its entry
// word of that launch, so after the zeroing; every region a kernel waits on is zeroed first, so
// no value left by another call or an earlier layout can pass a wait):
//   count_table  int32 [W][count_row_ints(E)]   row s written by rank s (routing)        routing
//   count_flags  u64   [W]                      epoch: "row s is complete" (rank s)       routing
//   chunk_flags  u64   [ceil(Tmax / kChunkTokens)]  epoch: chunk c counted (local)        routing
//   routing_words u64  [4]                      0: layout ready (epoch, local); 1: ~smallest bad pair  routing
//   arrival      u64   [ceil(C / R)]            counters: rows of block f landed (any rank adds 1 per row)  dispatch
//   ready        u64   [ceil(C / R)]            epoch: block f complete, repeats copied (local)  dispatch
//   read_done    u64   [kMaxCtas]               epoch: CTA i of combine has read (local)  combine
//   done         u64   [W]                      epoch: "rank s has read my expert outputs"  combine
//   rows         RecvRow [C]                    each receive row's origin (its sender)    never (written before read)
//   tiles        16 B x (1 + ceil(C / 64) + El) moe_dispatch_gemm's tile table (local, El = E / W):
//                                               the grouped GEMM's workspace over the receive rows
//                                               (kernels/moe/grouped_gemm_params.h)     never (its plan
//                                                                                       kernel rewrites it)
struct WorkspaceLayout {
  uint64_t count_table, count_flags, chunk_flags, routing_words, arrival, ready, read_done, done, rows, tiles, bytes;

  LOOM_HOST_DEVICE static WorkspaceLayout make(uint32_t world, uint32_t experts, uint64_t max_tokens,
                                               uint64_t capacity) {
    WorkspaceLayout l{};
    const uint64_t blocks = arrival_blocks(capacity);
    l.count_table = 0;
    l.count_flags = l.count_table + align_up(4ull * world * count_row_ints(experts), 256);
    l.chunk_flags = l.count_flags + align_up(8ull * world, 256);
    l.routing_words = l.chunk_flags + align_up(8 * routing_chunks(max_tokens), 256);
    l.arrival = l.routing_words + 256;
    l.ready = l.arrival + align_up(8 * blocks, 256);
    l.read_done = l.ready + align_up(8 * blocks, 256);
    l.done = l.read_done + align_up(8ull * MoeTunables::kMaxCtas, 256);
    l.rows = l.done + align_up(8ull * world, 256);
    l.tiles = l.rows + align_up(sizeof(RecvRow) * capacity, 256);
    l.bytes = l.tiles + align_up(tile_table_bytes(capacity, experts / world), 256);
    return l;
  }
  // The byte ranges each call zeroes before its kernel.
  LOOM_HOST_DEVICE uint64_t routing_zero_begin() const { return count_table; }
  LOOM_HOST_DEVICE uint64_t routing_zero_end() const { return arrival; }
  LOOM_HOST_DEVICE uint64_t dispatch_zero_begin() const { return arrival; }
  LOOM_HOST_DEVICE uint64_t dispatch_zero_end() const { return read_done; }
  LOOM_HOST_DEVICE uint64_t combine_zero_begin() const { return read_done; }
  LOOM_HOST_DEVICE uint64_t combine_zero_end() const { return rows; }
};

// Words of the routing_words region.
inline constexpr uint32_t kLayoutReadyWord = 0;
inline constexpr uint32_t kFirstBadWord = 1;

}  // namespace loom::kernels::moe
