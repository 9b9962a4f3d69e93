// Structures shared by host code and device code (plain data, no CUDA headers).
//
// These cross the host/device boundary by value (kernel parameters) or live in memory both
// sides read: the error record and the abort word are host-mapped pinned memory, the epoch
// state is device memory, the control region is at the start of the symmetric heap.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LOOM_HOST_DEVICE inline
#endif

namespace loom {

// Which operation a kernel runs: recorded in error records and logs. The ids below are loom's
// shared set (family 0); an operator family adds its own as family_op(family, n) and registers
// their names (runtime/names.h), so a new operator edits no central list.
enum class OpId : uint32_t {
  kNone = 0,
  kSelfTest,
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kGemm,
  kAgGemm,
  kGemmRs,
  kGemmAr,
  kNetExchange,  // the raw inter-node exchange (multi-node benchmark baseline, tests)
};
LOOM_HOST_DEVICE constexpr OpId family_op(uint32_t family, uint32_t n) {
  return static_cast<OpId>((family << 8) | (n & 0xffu));
}
const char* op_name(OpId op);

// Which kind of flag a failed wait was waiting for. The kinds below are shared (family 0, codes
// 0..15); an operator family f (1..7) adds up to 16 of its own as family_flag(f, n) and registers
// their names (runtime/names.h). Codes stay below 128: CtaProgress keeps them in 7 bits.
enum class FlagKind : uint32_t {
  kNone = 0,
  kEntered,  // "rank s has entered epoch e: its inputs are ready and its receive buffers free"
  kChunk,    // "rank s has written chunk c of epoch e into my buffer"
  kDone,     // "rank s has finished reading my buffers in epoch e"
  kTile,     // a GEMM tile's input rows have arrived
  // Inter-node kinds. Their error records name a GLOBAL rank in waited_on (the network reaches
  // ranks of other nodes, which have no local index here), or -1 for the proxy itself.
  kRingSpace,  // "the proxy has retired enough commands of ring `index` for mine to fit" (waited_on -1)
  kNetEntry,   // "rank s (another node) has entered epoch e: my network writes into it may start"
  kNetChunk,   // "chunk `index` that rank s sends over the network has landed in my memory"
  kProxyDone,  // "the proxy has completed every command I pushed into ring `index`" (waited_on -1)
};
LOOM_HOST_DEVICE constexpr FlagKind family_flag(uint32_t family, uint32_t n) {
  return static_cast<FlagKind>(16u * (family & 7u) + (n & 15u));
}
// Whether an error record's waited_on is a global rank (network kinds) rather than a local one.
LOOM_HOST_DEVICE constexpr bool flag_kind_names_global_rank(FlagKind kind) {
  return kind == FlagKind::kRingSpace || kind == FlagKind::kNetEntry || kind == FlagKind::kNetChunk ||
         kind == FlagKind::kProxyDone;
}
const char* flag_kind_name(FlagKind kind);

// kMismatch: a peer entered the same launch epoch with a different call (operation, shapes, dtype,
// options, plan): every rank must issue the same loom calls in the same order. Its record holds
// this rank's signature in flag_index and the peer's entry word in observed. kInvalidInput:
// arguments that live on the device (sequence offsets) failed the kernel's check before anything
// was written; flag_index names the item (e.g. the sequence).
enum class DeviceError : uint32_t { kNone = 0, kTimeout = 1, kAborted = 2, kMismatch = 3, kInvalidInput = 4 };

// Written once, by the first CTA that fails, into host-mapped memory; the host turns it into a
// Status after the stream's work completes (or after the host deadline).
struct ErrorRecord {
  uint32_t code;         // DeviceError
  uint32_t op;           // OpId
  uint64_t epoch;        // epoch of the failed launch
  int32_t waited_on;     // local rank whose flag never came (-1: not a flag wait)
  uint32_t flag_kind;    // FlagKind
  uint32_t flag_index;   // chunk/tile index within that kind
  int32_t cta;           // blockIdx.x of the CTA that gave up
  uint64_t observed;     // the flag value last seen
  uint64_t waited_ns;    // how long it waited
};

// What an intra-CTA barrier wait was for, in ErrorRecord::flag_index (flag_kind kNone) as
// what << 16 | index (stage or tile slot). kCopyLoad: a bulk copy's load into shared memory.
enum class BarrierWhat : uint32_t {
  kCopyLoad = 0,
  kStageFull = 1,
  kStageEmpty = 2,
  kTileFull = 3,
  kTileEmpty = 4,
  kSignalFull = 5,   // the compute role's signaler waiting for a finished tile
  kSignalEmpty = 6,  // a consumer warp waiting for a free signal slot
};

// Where a launch that never ends is stuck. Every loom wait is bounded and, when it gives up,
// names itself in the ErrorRecord; a launch that outlives its deadline even after the abort is
// therefore stuck outside them (a hardware wait, a barrier). To say where, thread 0 of each CTA
// of the multi-node kernels marks coarse phases in its slot (blockIdx.x < kProgressSlots) of a
// host-mapped array the host reads while the GPU is busy, a handful of posted stores per CTA and
// launch; and when a thread of a CTA gives up a wait it says which there (thread 0 in `failure`,
// the last other thread in `other_failure`), so a launch whose first recorded failure is another
// CTA's (a bystander: every wait gives up at the launch's one deadline) still shows what each CTA
// waited for: thread 0 is the producer of the compute role (its gates) and the data-moving roles.
enum class LaunchPhase : uint32_t { kEntered = 1, kRolesDone = 2, kComputeDone = 3, kProxyDone = 4, kFinished = 5 };
struct CtaProgress {
  uint32_t phase;          // (epoch & 0xffffff) << 8 | LaunchPhase
  uint32_t failure;        // thread 0's: 0, or 1 << 31 | FlagKind << 24 | index (24 bits; a barrier's
                           // BarrierWhat << 16 | slot)
  uint32_t other_failure;  // the same for the last other thread of the CTA that gave up
  uint32_t reserved;       // 0: the slot stays 16 bytes
};
inline constexpr uint32_t kProgressSlots = 1024;

// Everything a bounded wait needs; passed by value in every kernel's parameters.
struct WaitParams {
  uint64_t timeout_ns;             // per launch, from LOOM_TIMEOUT_MS
  const volatile uint32_t* host_abort;  // host-mapped: the host sets it to abort running kernels
  uint32_t* device_abort;          // device memory: the first failing CTA sets it for the others
  ErrorRecord* error;              // host-mapped
  CtaProgress* progress = nullptr; // host-mapped [kProgressSlots]; null: not kept
};

// Per-communicator launch counter in device memory. Each launch uses epoch + 1 and its last CTA
// to finish stores that value back, so epochs advance inside CUDA graphs without host work.
struct EpochState {
  uint64_t epoch;          // last completed epoch (0 before the first launch)
  uint32_t ctas_finished;  // CTAs of the running launch that are done
  uint32_t pad;
};

// Serial-number comparison: has `flag` reached `target`? Correct across 2^64 wrap-around as
// long as the two are within 2^63 of each other (which no run reaches).
LOOM_HOST_DEVICE bool epoch_reached(uint64_t flag, uint64_t target) {
  return static_cast<int64_t>(flag - target) >= 0;
}

// Entry words (kernels/comm/entry.cuh): a rank entering launch `epoch` of a call stores
// (epoch << kEntrySignatureBits) | signature into each peer, which checks both before its first
// write into (or read from) that rank. The signature is 32 bits (ops/launch/signature.h), so the
// word keeps the epoch's low 32 bits: entry_reached() compares them as serial numbers, a peer
// counting as entered when it is in this launch or at most kEntryAhead launches past it (peers of
// one communicator are never further apart: each launch waits for every peer it depends on). A
// word from an earlier launch does not pass — unless its family sat unused for a whole multiple of
// 2^32 launches, give or take 256 — nor does a zero word (never written; a signature is never 0).
// The host's diagnosis decodes the same format.
inline constexpr uint32_t kEntrySignatureBits = 32;
inline constexpr uint64_t kEntrySignatureMask = (uint64_t{1} << kEntrySignatureBits) - 1;
inline constexpr uint32_t kEntryAhead = 256;
LOOM_HOST_DEVICE constexpr uint64_t entry_word(uint64_t epoch, uint32_t signature) {
  return (epoch << kEntrySignatureBits) | (signature & kEntrySignatureMask);
}
LOOM_HOST_DEVICE constexpr uint32_t entry_epoch(uint64_t word) { return static_cast<uint32_t>(word >> kEntrySignatureBits); }
LOOM_HOST_DEVICE constexpr uint32_t entry_signature(uint64_t word) { return static_cast<uint32_t>(word & kEntrySignatureMask); }
// Has the word's writer entered launch `epoch` (or a later one)?
LOOM_HOST_DEVICE constexpr bool entry_reached(uint64_t word, uint64_t epoch) {
  return word != 0 && static_cast<uint32_t>(entry_epoch(word) - static_cast<uint32_t>(epoch)) < kEntryAhead;
}
// Is the word's writer in launch `epoch` itself (its signature is then this launch's)?
LOOM_HOST_DEVICE constexpr bool entry_in(uint64_t word, uint64_t epoch) {
  return word != 0 && entry_epoch(word) == static_cast<uint32_t>(epoch);
}

// Layout of the control region at offset 0 of every rank's symmetric heap (equal on all ranks).
// All flags are uint64_t epochs written by peers over NVLink and polled by the owner.
//   entered[src]            local_world              * 8 B   (entry words of the collectives)
//   done[src]               local_world              * 8 B
//   chunk[src][chunk]       local_world * max_chunks * 8 B
//   self_test[src][word]    local_world * kSelfTestWords * 8 B
//   op_flags[i]             max_op_flags             * 8 B   (64-byte aligned)
// op_flags belong to the fused tensor-parallel operators: entry words, then per-launch row-chunk
// or tile flags whose layout each operator derives from its shape (docs/TP_OPS.md). They are
// epoch-tagged like every flag, so operators of different shapes share the region safely.
struct ControlLayout {
  static constexpr uint32_t kSelfTestWords = 8;
  uint64_t entered_offset;
  uint64_t done_offset;
  uint64_t chunk_offset;
  uint64_t self_test_offset;
  uint64_t op_flag_offset;
  uint64_t bytes;        // total, rounded up to 4 KiB
  uint32_t local_world;
  uint32_t max_chunks;   // per source rank
  uint32_t max_op_flags;
  uint32_t pad;
};

LOOM_HOST_DEVICE ControlLayout make_control_layout(uint32_t local_world, uint32_t max_chunks,
                                                   uint32_t max_op_flags = 0) {
  ControlLayout c{};
  c.local_world = local_world;
  c.max_chunks = max_chunks;
  c.max_op_flags = max_op_flags;
  c.entered_offset = 0;
  c.done_offset = c.entered_offset + 8ull * local_world;
  c.chunk_offset = c.done_offset + 8ull * local_world;
  c.self_test_offset = c.chunk_offset + 8ull * local_world * max_chunks;
  const uint64_t self_test_end = c.self_test_offset + 8ull * local_world * ControlLayout::kSelfTestWords;
  c.op_flag_offset = (self_test_end + 63) & ~uint64_t{63};
  const uint64_t end = c.op_flag_offset + 8ull * max_op_flags;
  c.bytes = (end + 4095) & ~uint64_t{4095};
  return c;
}

// Per-communicator device state of one operator family's launches (device memory, zero at
// creation; Communicator::Impl::family hands one line to each family, so two families never share
// counters). The tile queue is claimed with atomicAdd by the compute CTAs of one launch; the last
// CTA to leave a launch zeroes both words (finish_queued_launch, kernels/comm/epoch.cuh), so every
// launch (also inside a CUDA graph) starts at 0 without a memset. Its own 64-byte line keeps it
// away from other hot words.
struct LaunchState {
  uint32_t tile_queue;  // next position in the launch's tile order
  uint32_t ctas_done;   // CTAs of the running launch that no longer touch tile_queue
  uint32_t pad[14];
};
static_assert(sizeof(LaunchState) == 64, "LaunchState fills one 64-byte line");

}  // namespace loom

namespace loom::ring {
struct RingView;  // runtime/command_ring.h: a command ring as its producers address it
}  // namespace loom::ring

namespace loom {

// The inter-node network as a kernel sees it (DeviceComm::net; all zero on a single node).
//
// Ranks are numbered globally; the GPU with local index l on node n is rank_at[n * L + l] (L =
// DeviceComm::local_world). A kernel hands a transfer to the host proxy by pushing a command into
// one of the `num_lanes` rings (kernels/comm/command_ring.cuh); the proxy writes the bytes into
// the destination's symmetric heap at the same offset scheme, then the destination's flag.
//
// Network flag window: `flag_count` uint64 words at heap offset `flag_offset` of every rank
// (equal offsets; a dedicated allocation made at communicator creation, zero-filled). It is the
// window the transports register for arrival flags; the words are epochs like every loom flag.
// Its layout: runtime/network_layout.h (entry words, then per-launch flags from launch_flag_base).
struct NetComm {
  int32_t node;                    // this rank's node
  int32_t num_nodes;               // N (1: no network; every other field is zero)
  int32_t rank;                    // this rank's global rank (commands name global ranks)
  int32_t num_lanes;               // proxy lanes = command rings
  const ring::RingView* rings;     // device memory [num_lanes]: the producers' views
  const int32_t* rank_at;          // device memory [num_nodes * local_world]
  uint64_t flag_offset;            // heap offset of the network flag window
  uint32_t flag_count;             // uint64 words in the window
  uint32_t launch_flag_base;       // first per-launch flag (NetWindowLayout::launch_base)
};

// The local node as a kernel sees it: this rank's index, the peers' heap bases (device array of
// local_world pointers, entry local_rank is our own heap) and the control region's layout; and,
// on jobs of several nodes, the network (`net`).
struct DeviceComm {
  int32_t local_rank;
  int32_t local_world;
  const uint64_t* peer_heap_bases;  // device memory, [local_world]
  uint64_t local_heap_base;
  ControlLayout control;
  EpochState* epoch_state;  // device memory
  WaitParams wait;
  NetComm net;
};

}  // namespace loom
