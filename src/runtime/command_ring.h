// Command ring: how producers (GPU CTAs, or CPU threads in tests and host-driven paths) hand
// network transfers to a proxy thread.
//
// This header has two parts. The first is the shared layout and the producer's state machine:
// plain structs and LOOM_HOST_DEVICE functions, included by device code (kernels/comm/
// command_ring.cuh) exactly like device_abi.h. The second is the host side: the consumer the
// proxy runs, a CPU producer, the host-side twin of the bounded wait, and host-memory rings.
//
// Memory (capacity C, a power of two):
//   shared block, host-pinned and mapped to the device:
//     RingControl  64 B   tail: consumer -> producers, "every slot below tail is free";
//                         completed: "every command below it has completed at the transport"
//     Command[C]   64 B each
//     bytes = ring_shared_bytes(C) = 64 + 64 * C
//   producer block, where producers claim slots (device memory for GPU producers, host memory
//   for CPU producers), never read by the consumer:
//     RingProducerState 128 B   head (next ticket), tail_cache (last tail a producer saw)
//
// Protocol (one consumer per ring, any number of producers):
//   producer  1. ticket = fetch_add(head, 1)                       (atomic, producer scope)
//             2. wait until tail + C > ticket: first against tail_cache, and only when the ring
//                looks full against the host tail (acquire, system scope) — a bounded wait with
//                the project's deadline, abort words and error record (FlagKind ring space)
//             3. write words 1..7 of slot[ticket % C]                  (plain stores)
//             4. store word 0, header = (ticket + 1) << 8 | type       (release, system scope)
//   consumer  1. at position p, load slot[p % C].header with acquire; it is published for p iff
//                its sequence is p + 1 (no slot is ever cleared: an older lap's header carries a
//                sequence C lower, so it cannot match)
//             2. copy the command out, p += 1; repeat up to a batch
//             3. retire: store tail = p (release), which frees those slots for producers
// A producer that claims a ticket and never publishes it (a kernel that aborted between steps 1
// and 4) stops the consumer at that slot; that only happens after a failure that leaves the
// communicator failed, so the ring is never reused afterwards.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "loom/status.h"
#include "runtime/device_abi.h"

// nvcc warns when a __host__ __device__ template calls a __device__-only member of its policy in
// a host instantiation that never happens; this pragma tells it the call is intended.
#if defined(__CUDACC__)
#define LOOM_HD_TEMPLATE _Pragma("nv_exec_check_disable")
#else
#define LOOM_HD_TEMPLATE
#endif

namespace loom::ring {

// ---- shared layout ----------------------------------------------------------------------------

enum class CommandType : uint8_t {
  kInvalid = 0,  // never published by a correct producer; rejected by the proxy
  kWrite = 1,    // copy [src_offset, +length) of the local source region to the destination's
                 // data window at dst_offset; then, if flag_index != kNoFlag, write flag_value
                 // into the destination's flag window at flag_index — never visible before the data
  kSignal = 2,   // write flag_value into the destination's flag window at flag_index, after every
                 // kWrite this ring carried earlier to any destination has landed (a fence + flag)
};
inline constexpr uint8_t kMaxCommandType = 2;

inline constexpr uint32_t kNoFlag = 0xffffffffu;

// The flag kind in the error record of a producer that found the ring full past its deadline
// (waited_on = -1: the proxy, not a peer; flag_index = the ring's index).
inline constexpr FlagKind kRingSpaceFlagKind = FlagKind::kRingSpace;

// One command: 64 bytes, one cache line, so a slot is never shared between two producers and the
// header store publishes a whole line the consumer reads at once.
struct alignas(64) Command {
  uint64_t header;       // word 0, published last: sequence (ticket + 1, 56 bits) << 8 | type
  uint32_t dst_rank;     // global rank of the destination
  uint32_t flag_index;   // index into the destination's flag window (uint64 flags); kNoFlag: none
  uint64_t epoch;        // launch epoch of the producer; must be current at the proxy
  uint64_t src_offset;   // byte offset in this rank's registered source region
  uint64_t dst_offset;   // byte offset in the destination's registered data window
  uint64_t length;       // bytes to copy (kWrite: >= 1)
  uint64_t flag_value;   // what the flag becomes: an epoch, like every loom flag
  uint32_t producer;     // diagnostic: CTA (GPU) or thread (CPU) that produced it
  uint32_t reserved;     // must be 0 (room for options without changing the size)
};
static_assert(sizeof(Command) == 64, "a command is one 64-byte cache line: header word + 7 body words");
static_assert(offsetof(Command, header) == 0, "the header is word 0, the word the producer publishes last");
static_assert(alignof(Command) == 64, "slots are line-aligned so two producers never share a line");

// The consumer's cursors, in one line of the shared block:
//   tail       commands taken (copied out); producers poll it when the ring looks full
//   completed  commands whose every operation (data pieces, flag) has completed at the transport,
//              counted in ring order (a command counts once it and all before it are complete);
//              producers that must not reuse a source buffer before the proxy has read it (a
//              kernel's end, runtime/network.h) wait for completed >= their last ticket + 1
struct alignas(64) RingControl {
  uint64_t tail;
  uint64_t completed;
  uint64_t reserved[6];
};
static_assert(sizeof(RingControl) == 64, "the control block is one line");
static_assert(offsetof(RingControl, tail) == 0, "a RingView's tail pointer addresses the whole control block");


// Where producers claim slots; head and tail_cache sit in different lines because every producer
// writes head and only a producer that found the ring full writes tail_cache.
struct RingProducerState {
  alignas(64) uint64_t head;
  alignas(64) uint64_t tail_cache;
};
static_assert(sizeof(RingProducerState) == 128, "head and tail_cache, one line each");

LOOM_HOST_DEVICE constexpr uint64_t ring_shared_bytes(uint32_t capacity) {
  return sizeof(RingControl) + uint64_t{sizeof(Command)} * capacity;
}

inline constexpr uint32_t kMinRingCapacity = 2;
inline constexpr uint32_t kMaxRingCapacity = 1u << 20;  // 64 MiB of pinned memory per ring

LOOM_HOST_DEVICE constexpr bool valid_ring_capacity(uint32_t capacity) {
  return capacity >= kMinRingCapacity && capacity <= kMaxRingCapacity && (capacity & (capacity - 1)) == 0;
}

// A ring as one side addresses it; passed by value to kernels and CPU producers. For a GPU
// ring the device view holds device aliases (slots, tail) and device memory (producer state);
// the proxy's view of the same ring has host addresses and no producer state.
struct RingView {
  Command* slots;                  // [capacity]
  uint64_t* tail;                  // RingControl::tail
  RingProducerState* producer;     // null in the consumer's view
  uint32_t capacity;               // power of two
  uint32_t ring_index;             // which ring of this rank (error records, messages)
};

// The `completed` word of a ring (RingView::tail points at its RingControl).
LOOM_HOST_DEVICE uint64_t* ring_completed(const RingView& view) {
  return &reinterpret_cast<RingControl*>(view.tail)->completed;
}

inline constexpr uint32_t kSequenceShift = 8;
inline constexpr uint64_t kSequenceMask = (uint64_t{1} << (64 - kSequenceShift)) - 1;

// The header that publishes `ticket`: its sequence is ticket + 1, so a zeroed slot (sequence 0)
// is never mistaken for a published one.
LOOM_HOST_DEVICE constexpr uint64_t make_header(uint64_t ticket, CommandType type) {
  return (((ticket + 1) & kSequenceMask) << kSequenceShift) | static_cast<uint8_t>(type);
}
LOOM_HOST_DEVICE constexpr uint64_t header_sequence(uint64_t header) { return header >> kSequenceShift; }
LOOM_HOST_DEVICE constexpr uint8_t header_type(uint64_t header) { return static_cast<uint8_t>(header & 0xff); }
// Whether `header`, read from the slot of `position`, publishes that position.
LOOM_HOST_DEVICE constexpr bool header_publishes(uint64_t header, uint64_t position) {
  return header_sequence(header) == ((position + 1) & kSequenceMask);
}

LOOM_HOST_DEVICE constexpr uint64_t slot_index(uint64_t ticket, uint32_t capacity) {
  return ticket & (capacity - 1);
}

// The tail value that frees the slot of `ticket`: tail + capacity > ticket, i.e. tail reaches
// ticket + 1 - capacity. Compared with epoch_reached (serial numbers), so the first lap, where
// this "target" is below zero, is free at once.
LOOM_HOST_DEVICE constexpr uint64_t space_target(uint64_t ticket, uint32_t capacity) {
  return ticket + 1 - capacity;
}

// The producer's state machine, shared by GPU and CPU producers: `Side` supplies the atomics
// and fences of its side (claim, tail reads, the bounded wait, body stores, the publishing
// release store); everything else — order of steps, slot choice, space test, header — is here.
// Returns false when the bounded wait gave up; the failure is then already recorded.
LOOM_HD_TEMPLATE
template <typename Side>
LOOM_HOST_DEVICE bool produce(Side& side, const RingView& ring, const Command& command) {
  const uint64_t ticket = side.claim(&ring.producer->head);
  const uint64_t target = space_target(ticket, ring.capacity);
  if (!epoch_reached(side.load_tail_cache(&ring.producer->tail_cache), target)) {
    uint64_t tail = 0;
    if (!side.wait_for_tail(ring.tail, target, ring.ring_index, &tail)) return false;
    side.raise_tail_cache(&ring.producer->tail_cache, tail);
  }
  Command* slot = ring.slots + slot_index(ticket, ring.capacity);
  side.store_body(slot, command);
  side.publish(&slot->header, make_header(ticket, static_cast<CommandType>(header_type(command.header))));
  return true;
}

// Producers pass the command's type in the low byte of `header`; produce() fills the sequence.
LOOM_HOST_DEVICE constexpr uint64_t type_only_header(CommandType type) { return static_cast<uint8_t>(type); }

}  // namespace loom::ring

// ---- host side -------------------------------------------------------------------------------
// Host-only functions and classes (nvcc parses them in both passes; kernels never call them).

namespace loom::ring {

// The host-side twin of kernels::WaitContext (wait.cuh): the same deadline, the same two abort
// words and the same error record, so a CPU producer on a stalled consumer fails exactly like a
// GPU one. `params.device_abort` and `params.error` are host memory here.
struct HostWaitContext {
  WaitParams params{};
  std::chrono::steady_clock::time_point deadline;
  uint64_t epoch = 0;
  OpId op = OpId::kNone;
  int32_t producer = -1;  // recorded as the error record's "cta"

  static HostWaitContext start(const WaitParams& params, OpId op, uint64_t epoch, int32_t producer = -1);
  bool aborted() const;
  // Records the failure (first caller wins) and raises the abort word, like WaitContext::fail.
  void fail(DeviceError code, int waited_on, FlagKind kind, uint32_t index, uint64_t observed,
            uint64_t waited_ns) const;
};

// The one bounded wait, host side: until epoch_reached(*flag, target) (acquire), or the deadline,
// or an abort word. Spins, then yields, then sleeps in short steps (a 2-core CI machine must not
// be starved by waiters). `observed` receives the last value read.
bool host_wait_flag(const uint64_t* flag, uint64_t target, const HostWaitContext& ctx, int waited_on, FlagKind kind,
                    uint32_t index, uint64_t* observed = nullptr);

// The proxy's end of one ring. Not thread-safe: one consumer per ring.
class RingConsumer {
 public:
  RingConsumer() = default;
  explicit RingConsumer(const RingView& host_view);

  // Copies up to out.size() published commands, in ring order, and returns how many. Stops at
  // the first slot not yet published (a later slot may already be: order is kept).
  size_t poll(std::span<Command> out);
  // Frees the slots of every command poll() returned so far (release store of the tail).
  void retire();
  uint64_t position() const { return position_; }  // commands consumed so far
  uint64_t retired() const { return retired_; }
  const RingView& view() const { return view_; }

 private:
  RingView view_{};
  uint64_t position_ = 0;
  uint64_t retired_ = 0;
};

// A CPU thread producing into a ring through the shared state machine (std::atomic_ref atomics).
// Several CpuProducers (threads) may share one ring.
class CpuProducer {
 public:
  CpuProducer(const RingView& view, const WaitParams& wait, std::chrono::nanoseconds timeout, OpId op = OpId::kSelfTest,
              int32_t producer_id = -1);
  // Pushes one command (its type in header's low byte, see type_only_header). False when the
  // bounded wait gave up; the error record says why.
  bool push(const Command& command);

 private:
  RingView view_;
  WaitParams wait_;
  std::chrono::nanoseconds timeout_;
  OpId op_;
  int32_t producer_id_;
};

// A ring entirely in host memory (CPU producers and consumer): tests, and host-driven transfers.
class HostRing {
 public:
  static Result<HostRing> create(uint32_t capacity, uint32_t ring_index = 0);
  RingView view() const;  // producers and the consumer use the same view

 private:
  struct Memory;
  std::shared_ptr<Memory> memory_;
  uint32_t capacity_ = 0;
  uint32_t ring_index_ = 0;
};

// invalid_argument unless `capacity` is a power of two in [kMinRingCapacity, kMaxRingCapacity].
Status check_ring_capacity(uint32_t capacity);

}  // namespace loom::ring
