#include "runtime/command_ring.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <thread>

namespace loom::ring {
namespace {

using SteadyClock = std::chrono::steady_clock;

// Same cadence as wait.cuh: abort words and the deadline are read every so many polls.
constexpr uint32_t kAbortCheckInterval = 64;
constexpr uint32_t kSpinPolls = 128;    // then yield the core
constexpr uint32_t kYieldPolls = 1024;  // then sleep in short steps
constexpr std::chrono::microseconds kSleepStep{20};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

uint64_t elapsed_ns(SteadyClock::time_point since) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now() - since).count());
}

// The CPU side of produce(): C++ atomics on host memory. The consumer is a host thread too, so
// "system scope" is the C++ memory model's.
struct CpuSide {
  const HostWaitContext* ctx;

  uint64_t claim(uint64_t* head) { return std::atomic_ref<uint64_t>(*head).fetch_add(1, std::memory_order_relaxed); }
  // Acquire, so a tail another producer saw (and raised the cache to, with release) carries the
  // consumer's release with it: the slot's old contents were read before we overwrite them.
  uint64_t load_tail_cache(uint64_t* cache) { return std::atomic_ref<uint64_t>(*cache).load(std::memory_order_acquire); }
  bool wait_for_tail(uint64_t* tail, uint64_t target, uint32_t ring_index, uint64_t* seen) {
    return host_wait_flag(tail, target, *ctx, /*waited_on=*/-1, kRingSpaceFlagKind, ring_index, seen);
  }
  void raise_tail_cache(uint64_t* cache, uint64_t tail) {
    std::atomic_ref<uint64_t> ref(*cache);
    uint64_t current = ref.load(std::memory_order_relaxed);
    while (current < tail && !ref.compare_exchange_weak(current, tail, std::memory_order_acq_rel)) {
    }
  }
  void store_body(Command* slot, const Command& command) {
    // Words 1..7; word 0 (the header) is published separately, last.
    std::memcpy(reinterpret_cast<char*>(slot) + sizeof(uint64_t), reinterpret_cast<const char*>(&command) + sizeof(uint64_t),
                sizeof(Command) - sizeof(uint64_t));
  }
  void publish(uint64_t* header, uint64_t value) { std::atomic_ref<uint64_t>(*header).store(value, std::memory_order_release); }
};

}  // namespace

// ---- bounded wait (host twin of wait.cuh) -----------------------------------------------------

HostWaitContext HostWaitContext::start(const WaitParams& params, OpId op, uint64_t epoch, int32_t producer) {
  HostWaitContext c;
  c.params = params;
  c.deadline = SteadyClock::now() + std::chrono::nanoseconds(params.timeout_ns);
  c.epoch = epoch;
  c.op = op;
  c.producer = producer;
  return c;
}

bool HostWaitContext::aborted() const {
  if (params.device_abort != nullptr &&
      std::atomic_ref<uint32_t>(*params.device_abort).load(std::memory_order_acquire) != 0) {
    return true;
  }
  // The host word is volatile for kernels; on the host, another thread raises it: an atomic load.
  return params.host_abort != nullptr &&
         std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(params.host_abort)).load(std::memory_order_acquire) != 0;
}

void HostWaitContext::fail(DeviceError code, int waited_on, FlagKind kind, uint32_t index, uint64_t observed,
                           uint64_t waited_ns) const {
  if (ErrorRecord* e = params.error) {
    uint32_t expected = 0;
    if (std::atomic_ref<uint32_t>(e->code).compare_exchange_strong(expected, static_cast<uint32_t>(code),
                                                                   std::memory_order_acq_rel)) {
      e->op = static_cast<uint32_t>(op);
      e->epoch = epoch;
      e->waited_on = waited_on;
      e->flag_kind = static_cast<uint32_t>(kind);
      e->flag_index = index;
      e->cta = producer;
      e->observed = observed;
      e->waited_ns = waited_ns;
      std::atomic_thread_fence(std::memory_order_release);
    }
  }
  if (params.device_abort != nullptr) {
    std::atomic_ref<uint32_t>(*params.device_abort).store(1, std::memory_order_release);
  }
}

bool host_wait_flag(const uint64_t* flag, uint64_t target, const HostWaitContext& ctx, int waited_on, FlagKind kind,
                    uint32_t index, uint64_t* observed) {
  // atomic_ref needs a non-const object; the wait only loads.
  std::atomic_ref<uint64_t> ref(*const_cast<uint64_t*>(flag));
  uint64_t seen = ref.load(std::memory_order_acquire);
  if (observed != nullptr) *observed = seen;
  if (epoch_reached(seen, target)) return true;
  const SteadyClock::time_point begin = SteadyClock::now();
  for (uint32_t polls = 1;; ++polls) {
    seen = ref.load(std::memory_order_acquire);
    if (observed != nullptr) *observed = seen;
    if (epoch_reached(seen, target)) return true;
    if (polls % kAbortCheckInterval == 0) {
      if (ctx.aborted()) {
        ctx.fail(DeviceError::kAborted, waited_on, kind, index, seen, elapsed_ns(begin));
        return false;
      }
      if (SteadyClock::now() > ctx.deadline) {
        ctx.fail(DeviceError::kTimeout, waited_on, kind, index, seen, elapsed_ns(begin));
        return false;
      }
    }
    if (polls < kSpinPolls) {
      cpu_relax();
    } else if (polls < kYieldPolls) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kSleepStep);
    }
  }
}

// ---- consumer ----------------------------------------------------------------------------------

RingConsumer::RingConsumer(const RingView& host_view) : view_(host_view) {
  position_ = std::atomic_ref<uint64_t>(*view_.tail).load(std::memory_order_acquire);
  retired_ = position_;
}

size_t RingConsumer::poll(std::span<Command> out) {
  size_t count = 0;
  while (count < out.size()) {
    Command* slot = view_.slots + slot_index(position_, view_.capacity);
    const uint64_t header = std::atomic_ref<uint64_t>(slot->header).load(std::memory_order_acquire);
    if (!header_publishes(header, position_)) break;
    Command& copy = out[count];
    copy.header = header;
    // The acquire above orders these reads after the producer's body stores; no producer writes
    // the slot again until retire() moves the tail past it.
    std::memcpy(reinterpret_cast<char*>(&copy) + sizeof(uint64_t), reinterpret_cast<const char*>(slot) + sizeof(uint64_t),
                sizeof(Command) - sizeof(uint64_t));
    ++position_;
    ++count;
  }
  return count;
}

void RingConsumer::retire() {
  if (retired_ == position_) return;
  // Release: our reads of the retired slots happen before any producer's rewrite of them.
  std::atomic_ref<uint64_t>(*view_.tail).store(position_, std::memory_order_release);
  retired_ = position_;
}

// ---- CPU producer ------------------------------------------------------------------------------

CpuProducer::CpuProducer(const RingView& view, const WaitParams& wait, std::chrono::nanoseconds timeout, OpId op,
                         int32_t producer_id)
    : view_(view), wait_(wait), timeout_(timeout), op_(op), producer_id_(producer_id) {}

bool CpuProducer::push(const Command& command) {
  WaitParams params = wait_;
  params.timeout_ns = static_cast<uint64_t>(timeout_.count());
  const HostWaitContext ctx = HostWaitContext::start(params, op_, command.epoch, producer_id_);
  CpuSide side{&ctx};
  return produce(side, view_, command);
}

// ---- host rings --------------------------------------------------------------------------------

struct HostRing::Memory {
  void* shared = nullptr;
  RingProducerState* producer = nullptr;
  ~Memory() {
    std::free(shared);
    if (producer != nullptr) {
      producer->~RingProducerState();
      std::free(producer);
    }
  }
};

Status check_ring_capacity(uint32_t capacity) {
  if (valid_ring_capacity(capacity)) return {};
  return Status::invalid_argument("command ring capacity " + std::to_string(capacity) + " must be a power of two in [" +
                                  std::to_string(kMinRingCapacity) + ", " + std::to_string(kMaxRingCapacity) + "]");
}

Result<HostRing> HostRing::create(uint32_t capacity, uint32_t ring_index) {
  LOOM_TRY(check_ring_capacity(capacity));
  auto memory = std::make_shared<Memory>();
  const size_t shared_bytes = ring_shared_bytes(capacity);
  memory->shared = std::aligned_alloc(64, shared_bytes);
  void* producer = std::aligned_alloc(64, sizeof(RingProducerState));
  if (memory->shared == nullptr || producer == nullptr) {
    std::free(producer);
    return Status::system_error("command ring: cannot allocate " + std::to_string(shared_bytes) + " bytes");
  }
  std::memset(memory->shared, 0, shared_bytes);
  memory->producer = new (producer) RingProducerState{};
  HostRing ring;
  ring.memory_ = std::move(memory);
  ring.capacity_ = capacity;
  ring.ring_index_ = ring_index;
  return ring;
}

RingView HostRing::view() const {
  RingView v{};
  auto* control = static_cast<RingControl*>(memory_->shared);
  v.tail = &control->tail;
  v.slots = reinterpret_cast<Command*>(static_cast<char*>(memory_->shared) + sizeof(RingControl));
  v.producer = memory_->producer;
  v.capacity = capacity_;
  v.ring_index = ring_index_;
  return v;
}

}  // namespace loom::ring
