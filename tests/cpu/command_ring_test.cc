// Command ring protocol with CPU producers: the same state machine (ring::produce) and consumer
// the GPU path uses, with host atomics. Layout, wrap-around, a full ring, a stalled consumer
// (bounded wait -> timeout record), host abort, a claimed-but-unpublished slot, and 10^6 commands
// from several threads with none lost, duplicated or reordered within a producer.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <thread>
#include <vector>

#include "runtime/command_ring.h"
#include "runtime/device_abi.h"

namespace loom::ring {
namespace {

using namespace std::chrono_literals;

// The host words a producer's bounded wait reports into.
struct WaitWords {
  uint32_t host_abort = 0;
  uint32_t device_abort = 0;
  ErrorRecord error{};
  WaitParams params() {
    WaitParams p{};
    p.timeout_ns = 0;  // CpuProducer sets it per push
    p.host_abort = &host_abort;
    p.device_abort = &device_abort;
    p.error = &error;
    return p;
  }
};

Command write_command(uint32_t producer, uint64_t sequence, uint64_t epoch = 7) {
  Command c{};
  c.header = type_only_header(CommandType::kWrite);
  c.dst_rank = producer % 5;
  c.flag_index = static_cast<uint32_t>(sequence % 1000);
  c.epoch = epoch;
  c.src_offset = sequence;
  c.dst_offset = sequence * 3 + producer;
  c.length = sequence + 1;
  c.flag_value = epoch;
  c.producer = producer;
  return c;
}

void expect_same_body(const Command& got, const Command& want) {
  EXPECT_EQ(header_type(got.header), header_type(want.header));
  EXPECT_EQ(got.dst_rank, want.dst_rank);
  EXPECT_EQ(got.flag_index, want.flag_index);
  EXPECT_EQ(got.epoch, want.epoch);
  EXPECT_EQ(got.src_offset, want.src_offset);
  EXPECT_EQ(got.dst_offset, want.dst_offset);
  EXPECT_EQ(got.length, want.length);
  EXPECT_EQ(got.flag_value, want.flag_value);
  EXPECT_EQ(got.producer, want.producer);
  EXPECT_EQ(got.reserved, 0u);
}

TEST(CommandRing, LayoutAndHeader) {
  EXPECT_EQ(sizeof(Command), 64u);
  EXPECT_EQ(ring_shared_bytes(1024), 64u + 64u * 1024);
  EXPECT_EQ(header_type(make_header(41, CommandType::kSignal)), static_cast<uint8_t>(CommandType::kSignal));
  EXPECT_EQ(header_sequence(make_header(41, CommandType::kWrite)), 42u);
  EXPECT_TRUE(header_publishes(make_header(41, CommandType::kWrite), 41));
  EXPECT_FALSE(header_publishes(make_header(41, CommandType::kWrite), 41 + 8));  // an older lap's header
  EXPECT_FALSE(header_publishes(0, 0));  // a zeroed slot publishes nothing
  // First lap: the space target is "negative" and the fresh tail 0 already reaches it.
  EXPECT_TRUE(epoch_reached(0, space_target(0, 4)));
  EXPECT_TRUE(epoch_reached(0, space_target(3, 4)));
  EXPECT_FALSE(epoch_reached(0, space_target(4, 4)));
  EXPECT_TRUE(epoch_reached(1, space_target(4, 4)));
  EXPECT_TRUE(check_ring_capacity(1024).ok());
  EXPECT_FALSE(check_ring_capacity(1000).ok());
  EXPECT_FALSE(check_ring_capacity(1).ok());
  EXPECT_FALSE(check_ring_capacity(kMaxRingCapacity * 2).ok());
  EXPECT_FALSE(HostRing::create(3).ok());
}

TEST(CommandRing, WrapsAroundManyLapsInOrder) {
  Result<HostRing> ring = HostRing::create(8);
  ASSERT_TRUE(ring.ok()) << ring.status().to_string();
  WaitWords words;
  CpuProducer producer(ring->view(), words.params(), 5s, OpId::kSelfTest, 0);
  RingConsumer consumer(ring->view());
  std::vector<Command> out(8);
  uint64_t pushed = 0, taken = 0;
  // Uneven batches so slot boundaries fall everywhere over 250 laps.
  for (int round = 0; round < 700; ++round) {
    const int burst = 1 + round % 5;
    for (int i = 0; i < burst; ++i) ASSERT_TRUE(producer.push(write_command(0, pushed++)));
    size_t n = consumer.poll(out);
    ASSERT_EQ(n, static_cast<size_t>(burst));
    for (size_t i = 0; i < n; ++i) {
      expect_same_body(out[i], write_command(0, taken));
      EXPECT_TRUE(header_publishes(out[i].header, taken));
      ++taken;
    }
    consumer.retire();
  }
  EXPECT_EQ(taken, pushed);
  EXPECT_GT(pushed / 8, 250u);
  EXPECT_EQ(words.error.code, 0u);
}

TEST(CommandRing, FullRingWaitsUntilTheConsumerRetires) {
  Result<HostRing> ring = HostRing::create(4);
  ASSERT_TRUE(ring.ok());
  WaitWords words;
  CpuProducer producer(ring->view(), words.params(), 10s, OpId::kSelfTest, 1);
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(producer.push(write_command(1, i)));
  std::future<bool> fifth = std::async(std::launch::async, [&] { return producer.push(write_command(1, 4)); });
  EXPECT_EQ(fifth.wait_for(100ms), std::future_status::timeout) << "a push into a full ring must wait";

  RingConsumer consumer(ring->view());
  std::vector<Command> out(1);
  ASSERT_EQ(consumer.poll(out), 1u);
  EXPECT_EQ(fifth.wait_for(100ms), std::future_status::timeout) << "polling alone frees nothing; retire does";
  consumer.retire();
  ASSERT_EQ(fifth.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(fifth.get());
  std::vector<Command> rest(8);
  ASSERT_EQ(consumer.poll(rest), 4u);
  for (uint64_t i = 0; i < 4; ++i) expect_same_body(rest[i], write_command(1, i + 1));
  EXPECT_EQ(words.error.code, 0u);
}

TEST(CommandRing, StalledConsumerEndsInTheTimeoutRecord) {
  Result<HostRing> ring = HostRing::create(4, /*ring_index=*/3);
  ASSERT_TRUE(ring.ok());
  WaitWords words;
  CpuProducer producer(ring->view(), words.params(), 150ms, OpId::kAllGather, 9);
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(producer.push(write_command(9, i, 42)));
  const auto begin = std::chrono::steady_clock::now();
  EXPECT_FALSE(producer.push(write_command(9, 4, 42)));
  const auto waited = std::chrono::steady_clock::now() - begin;
  EXPECT_GE(waited, 140ms);
  EXPECT_LT(waited, 2s) << "the wait is bounded by its deadline";

  const ErrorRecord& e = words.error;
  EXPECT_EQ(e.code, static_cast<uint32_t>(DeviceError::kTimeout));
  EXPECT_EQ(e.op, static_cast<uint32_t>(OpId::kAllGather));
  EXPECT_EQ(e.epoch, 42u);
  EXPECT_EQ(e.waited_on, -1) << "the proxy is this rank's own thread, not a peer";
  EXPECT_EQ(e.flag_kind, static_cast<uint32_t>(kRingSpaceFlagKind));
  EXPECT_EQ(e.flag_index, 3u) << "the ring index";
  EXPECT_EQ(e.cta, 9) << "the producer";
  EXPECT_EQ(e.observed, 0u) << "the tail never moved";
  EXPECT_GE(e.waited_ns, 100'000'000u);
  EXPECT_EQ(words.device_abort, 1u) << "the failing producer raises the abort word for the others";

  // Another producer of the same launch now gives up at once (abort word), keeping the first record.
  CpuProducer other(ring->view(), words.params(), 10s, OpId::kAllGather, 10);
  const auto again = std::chrono::steady_clock::now();
  EXPECT_FALSE(other.push(write_command(10, 0, 42)));
  EXPECT_LT(std::chrono::steady_clock::now() - again, 1s);
  EXPECT_EQ(e.cta, 9) << "the first failure wins the record";
}

TEST(CommandRing, HostAbortEndsAWaitingProducer) {
  Result<HostRing> ring = HostRing::create(2);
  ASSERT_TRUE(ring.ok());
  WaitWords words;
  CpuProducer producer(ring->view(), words.params(), 30s, OpId::kSelfTest, 0);
  ASSERT_TRUE(producer.push(write_command(0, 0)));
  ASSERT_TRUE(producer.push(write_command(0, 1)));
  std::thread aborter([&] {
    std::this_thread::sleep_for(50ms);
    std::atomic_ref<uint32_t>(words.host_abort).store(1);
  });
  const auto begin = std::chrono::steady_clock::now();
  EXPECT_FALSE(producer.push(write_command(0, 2)));
  aborter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 2s);
  EXPECT_EQ(words.error.code, static_cast<uint32_t>(DeviceError::kAborted));
}

TEST(CommandRing, UnpublishedSlotHoldsBackLaterCommands) {
  Result<HostRing> ring = HostRing::create(8);
  ASSERT_TRUE(ring.ok());
  RingView v = ring->view();
  WaitWords words;
  // A slow producer claims ticket 0 but has not published yet.
  const uint64_t slow_ticket = std::atomic_ref<uint64_t>(v.producer->head).fetch_add(1);
  ASSERT_EQ(slow_ticket, 0u);
  CpuProducer fast(v, words.params(), 5s, OpId::kSelfTest, 1);
  ASSERT_TRUE(fast.push(write_command(1, 100)));  // ticket 1

  RingConsumer consumer(v);
  std::vector<Command> out(8);
  EXPECT_EQ(consumer.poll(out), 0u) << "ticket 1 must not overtake the unpublished ticket 0";

  Command slow = write_command(0, 50);
  Command* slot = v.slots + slot_index(slow_ticket, v.capacity);
  slot->dst_rank = slow.dst_rank;
  slot->flag_index = slow.flag_index;
  slot->epoch = slow.epoch;
  slot->src_offset = slow.src_offset;
  slot->dst_offset = slow.dst_offset;
  slot->length = slow.length;
  slot->flag_value = slow.flag_value;
  slot->producer = slow.producer;
  std::atomic_ref<uint64_t>(slot->header).store(make_header(slow_ticket, CommandType::kWrite), std::memory_order_release);

  ASSERT_EQ(consumer.poll(out), 2u);
  expect_same_body(out[0], slow);
  expect_same_body(out[1], write_command(1, 100));
}

TEST(CommandRing, MillionCommandsFromFourThreadsNoneLostOrDuplicated) {
  constexpr uint32_t kProducers = 4;
  constexpr uint64_t kPerProducer = 250'000;  // 10^6 in all
  Result<HostRing> ring = HostRing::create(1024);
  ASSERT_TRUE(ring.ok());
  WaitWords words;

  std::atomic<bool> consumer_failed{false};
  std::vector<uint64_t> next_expected(kProducers, 0);
  uint64_t total = 0, bad_bodies = 0, out_of_order = 0;
  std::thread consumer_thread([&] {
    RingConsumer consumer(ring->view());
    std::vector<Command> out(32);
    const auto deadline = std::chrono::steady_clock::now() + 50s;
    while (total < kProducers * kPerProducer) {
      const size_t n = consumer.poll(out);
      if (n == 0) {
        if (std::chrono::steady_clock::now() > deadline) {
          consumer_failed = true;
          return;
        }
        std::this_thread::yield();
        continue;
      }
      for (size_t i = 0; i < n; ++i) {
        const Command& c = out[i];
        const uint32_t p = c.producer;
        if (p >= kProducers) {
          ++bad_bodies;
          continue;
        }
        const uint64_t seq = c.src_offset;
        if (seq != next_expected[p]) ++out_of_order;
        next_expected[p] = seq + 1;
        const Command want = write_command(p, seq);
        if (c.dst_offset != want.dst_offset || c.length != want.length || c.dst_rank != want.dst_rank ||
            c.flag_index != want.flag_index || c.epoch != want.epoch || !header_publishes(c.header, total + i)) {
          ++bad_bodies;
        }
      }
      total += n;
      consumer.retire();
    }
  });

  std::vector<std::thread> producers;
  std::atomic<uint32_t> failed_pushes{0};
  const auto begin = std::chrono::steady_clock::now();
  for (uint32_t p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      CpuProducer producer(ring->view(), words.params(), 50s, OpId::kSelfTest, static_cast<int32_t>(p));
      for (uint64_t s = 0; s < kPerProducer; ++s) {
        if (!producer.push(write_command(p, s))) {
          failed_pushes.fetch_add(1);
          return;
        }
      }
    });
  }
  for (std::thread& t : producers) t.join();
  consumer_thread.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();

  EXPECT_FALSE(consumer_failed.load());
  EXPECT_EQ(failed_pushes.load(), 0u);
  EXPECT_EQ(total, kProducers * kPerProducer) << "commands lost or duplicated";
  EXPECT_EQ(bad_bodies, 0u);
  EXPECT_EQ(out_of_order, 0u) << "a producer's commands arrive in its order, each exactly once";
  for (uint32_t p = 0; p < kProducers; ++p) EXPECT_EQ(next_expected[p], kPerProducer) << "producer " << p;
  EXPECT_EQ(words.error.code, 0u);
  RecordProperty("commands_per_second", std::to_string(static_cast<int64_t>(total / seconds)));
}

}  // namespace
}  // namespace loom::ring
