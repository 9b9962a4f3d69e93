// Proxy: validation (unit cases and a 10^5-command fuzz against random windows, counted by a
// recording fake transport: zero writes outside a window, every rejection counted by reason),
// posting order (flag right behind the data on ordered transports, only after every piece
// completed on unordered ones, kSignal as a fence), error completions reported through health()
// without hanging, a bounded stop, the stall hook (H7), NUMA pinning from a fake sysfs, the
// network settings and the transport choice, and the NIC-emulation shaper.
#include <gtest/gtest.h>

#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "runtime/bootstrap.h"
#include "runtime/command_ring.h"
#include "runtime/proxy.h"
#include "runtime/topology.h"
#include "runtime/transports/transport.h"

namespace loom::runtime::net {
namespace {

using namespace std::chrono_literals;
using ring::Command;
using ring::CommandType;

// ---- a transport that records what it is asked to do ------------------------------------------

// Handles: local registrations are 1..; remote imports are 1000 + index. Every op is checked
// against the sizes the fake itself knows (not the proxy's table), so a proxy bug that lets a
// bad range through shows up as an out-of-window write.
class RecordingTransport final : public Transport {
 public:
  struct Event {
    enum Kind { kPostWrite, kPostFlag, kComplete } kind;
    uint64_t id;
    int rank;
    uint64_t offset;
    uint64_t bytes;  // writes
    uint64_t value;  // flags
  };

  RecordingTransport(bool ordered, uint64_t max_write_bytes, uint32_t max_outstanding)
      : ordered_(ordered) {
    caps_.ordered_writes = ordered;
    caps_.max_write_bytes = max_write_bytes;
    caps_.max_outstanding = max_outstanding;
  }

  // The destination memory the fake pretends to own: rank -> sizes.
  void set_remote(int rank, uint64_t data_bytes, uint64_t flag_count) { remote_sizes_[rank] = {data_bytes, flag_count}; }
  // The flag words of `rank` this sender may write (flags, or 8-byte data writes into the flag
  // window); without a call, all of them. A post outside them counts as out of scope.
  void set_flag_scope(int rank, std::vector<WordRange> scope) { flag_scopes_[rank] = std::move(scope); }
  void set_source_bytes(uint64_t bytes) { source_bytes_ = bytes; }
  // Unordered fakes complete ops in random order, `delay_turns` polls after posting at the earliest.
  void set_random_completion(uint32_t seed, int delay_turns) {
    rng_.seed(seed);
    delay_turns_ = delay_turns;
  }
  // The write with this id fails with a remote-access-style error.
  void fail_write(uint64_t id) { failing_write_ = id; }

  TransportKind kind() const override { return TransportKind::kFabric; }
  const TransportCaps& caps() const override { return caps_; }
  std::string describe() const override { return "recording fake"; }
  Result<LocalRegistration> register_memory(const MemoryRegion& region) override {
    return LocalRegistration{1, region.bytes, {}};
  }
  Result<std::vector<uint8_t>> local_endpoint() override { return std::vector<uint8_t>{}; }
  Status connect(std::span<const std::vector<uint8_t>>) override { return {}; }
  Result<uint32_t> import_remote(int rank, std::span<const uint8_t>, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    imports_.push_back({rank, bytes});
    return static_cast<uint32_t>(1000 + imports_.size() - 1);
  }

  Result<size_t> post_writes(std::span<const WriteOp> ops) override {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t taken = 0;
    for (const WriteOp& op : ops) {
      if (in_flight_.size() >= caps_.max_outstanding) break;
      auto it = remote_sizes_.find(op.rank);
      const bool into_flags = op.remote == flag_handle(op.rank);
      const uint64_t window = it == remote_sizes_.end() ? 0 : into_flags ? 8 * it->second.second : it->second.first;
      if ((!into_flags && op.remote != data_handle(op.rank)) || op.local != 1) ++wrong_handles_;
      if (op.bytes == 0 || op.bytes > caps_.max_write_bytes) ++bad_pieces_;
      if (static_cast<unsigned __int128>(op.remote_offset) + op.bytes > window) ++out_of_window_;
      if (into_flags) {
        if (op.remote_offset % 8 != 0 || op.bytes % 8 != 0) ++out_of_scope_;
        for (uint64_t w = op.remote_offset / 8; w < (op.remote_offset + op.bytes) / 8; ++w) {
          if (!in_scope(op.rank, w)) ++out_of_scope_;
        }
      }
      if (static_cast<unsigned __int128>(op.local_offset) + op.bytes > source_bytes_) ++out_of_source_;
      events_.push_back({Event::kPostWrite, op.id, op.rank, op.remote_offset, op.bytes, 0});
      in_flight_.push_back({op.id, turn_});
      ++writes_;
      bytes_ += op.bytes;
      ++taken;
    }
    return taken;
  }
  Result<bool> post_flag(const FlagOp& op) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (in_flight_.size() >= caps_.max_outstanding) return false;
    auto it = remote_sizes_.find(op.rank);
    const uint64_t flags = it == remote_sizes_.end() ? 0 : it->second.second;
    if (op.remote != flag_handle(op.rank)) ++wrong_handles_;
    if (op.remote_offset % 8 != 0 || op.remote_offset / 8 >= flags) ++out_of_window_;
    if (!in_scope(op.rank, op.remote_offset / 8)) ++out_of_scope_;
    events_.push_back({Event::kPostFlag, op.id, op.rank, op.remote_offset, 0, op.value});
    in_flight_.push_back({op.id, turn_});
    ++flags_;
    return true;
  }
  Status poll(std::vector<Completion>& out) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++turn_;
    if (delay_turns_ == 0) {
      for (const auto& [id, turn] : in_flight_) complete(id, out);
      in_flight_.clear();
      return {};
    }
    // Random subset of the ops old enough, in random order.
    std::shuffle(in_flight_.begin(), in_flight_.end(), rng_);
    for (size_t i = 0; i < in_flight_.size();) {
      if (turn_ - in_flight_[i].second >= static_cast<uint64_t>(delay_turns_) && rng_() % 2 == 0) {
        complete(in_flight_[i].first, out);
        in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    return {};
  }
  uint32_t outstanding() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<uint32_t>(in_flight_.size());
  }
  Status close() override { return {}; }

  // Handles the proxy must use for a rank: the order of import_remote() calls (data, then flags).
  uint32_t data_handle(int rank) const { return handle_of(rank, 0); }
  uint32_t flag_handle(int rank) const { return handle_of(rank, 1); }

  std::vector<Event> events() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return events_;
  }
  uint64_t out_of_window() const { std::lock_guard<std::mutex> l(mutex_); return out_of_window_; }
  uint64_t out_of_scope() const { std::lock_guard<std::mutex> l(mutex_); return out_of_scope_; }
  uint64_t out_of_source() const { std::lock_guard<std::mutex> l(mutex_); return out_of_source_; }
  uint64_t wrong_handles() const { std::lock_guard<std::mutex> l(mutex_); return wrong_handles_; }
  uint64_t bad_pieces() const { std::lock_guard<std::mutex> l(mutex_); return bad_pieces_; }
  uint64_t writes() const { std::lock_guard<std::mutex> l(mutex_); return writes_; }
  uint64_t polls() const { std::lock_guard<std::mutex> l(mutex_); return turn_; }
  uint64_t bytes() const { std::lock_guard<std::mutex> l(mutex_); return bytes_; }
  uint64_t flags() const { std::lock_guard<std::mutex> l(mutex_); return flags_; }

  // Handles of a table built by hand (tests that skip exchange_windows) follow the same scheme.
  static constexpr uint32_t kManualDataBase = 5000;
  static constexpr uint32_t kManualFlagBase = 6000;
  bool manual_handles = false;

 private:
  uint32_t handle_of(int rank, int which) const {
    if (manual_handles) return (which == 0 ? kManualDataBase : kManualFlagBase) + static_cast<uint32_t>(rank);
    int seen = 0;
    for (size_t i = 0; i < imports_.size(); ++i) {
      if (imports_[i].first != rank) continue;
      if (seen++ == which) return static_cast<uint32_t>(1000 + i);
    }
    return 0xffffffff;
  }
  bool in_scope(int rank, uint64_t word) const {
    auto it = flag_scopes_.find(rank);
    if (it == flag_scopes_.end()) return true;
    for (const WordRange& r : it->second) {
      if (word >= r.first && word - r.first < r.count) return true;
    }
    return false;
  }
  void complete(uint64_t id, std::vector<Completion>& out) {
    Completion c;
    c.id = id;
    if (id == failing_write_) c.status = Status::peer_failure("fake: RDMA write to rank 1 failed: remote access error");
    events_.push_back({Event::kComplete, id, -1, 0, 0, 0});
    out.push_back(std::move(c));
  }

  bool ordered_;
  TransportCaps caps_;
  mutable std::mutex mutex_;
  std::map<int, std::pair<uint64_t, uint64_t>> remote_sizes_;
  std::map<int, std::vector<WordRange>> flag_scopes_;
  uint64_t source_bytes_ = 0;
  std::vector<std::pair<int, uint64_t>> imports_;
  std::vector<std::pair<uint64_t, uint64_t>> in_flight_;  // id, turn posted
  std::vector<Event> events_;
  std::mt19937_64 rng_{1};
  int delay_turns_ = 0;
  uint64_t turn_ = 0;
  uint64_t failing_write_ = 0;
  uint64_t out_of_window_ = 0, out_of_scope_ = 0, out_of_source_ = 0, wrong_handles_ = 0, bad_pieces_ = 0;
  uint64_t writes_ = 0, bytes_ = 0, flags_ = 0;
};

// A window table built by hand, with the fake's manual handles.
WindowTable manual_table(int rank, int world, uint64_t source_bytes,
                         const std::vector<std::pair<uint64_t, uint64_t>>& sizes /* data, flags per rank */,
                         const std::vector<bool>& present) {
  WindowTable t;
  t.rank = rank;
  t.world_size = world;
  t.source_handle = 1;
  t.source_bytes = source_bytes;
  t.destinations.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    if (!present[r] || r == rank) continue;
    DestinationWindow& d = t.destinations[r];
    d.present = true;
    d.data_handle = RecordingTransport::kManualDataBase + static_cast<uint32_t>(r);
    d.data_bytes = sizes[r].first;
    d.flag_handle = RecordingTransport::kManualFlagBase + static_cast<uint32_t>(r);
    d.flag_count = sizes[r].second;
    d.writable_flags = {WordRange{0, d.flag_count}};
  }
  return t;
}

// The heap layout of a multi-node destination, in miniature: a control region [0, control), the
// flag window right after it, then the data window; the sender may set only `scope`'s flag words.
struct ScopedWindow {
  uint64_t control = 0;     // bytes of the control region (offset 0)
  uint64_t flag_count = 0;  // the flag window's words, at offset `control`
  uint64_t data_bytes = 0;  // the data window's bytes, at data_offset()
  std::vector<WordRange> scope;

  uint64_t flag_offset() const { return control; }
  uint64_t data_offset() const { return control + 8 * flag_count; }
  void apply(DestinationWindow& d) const {
    d.data_offset = data_offset();
    d.data_bytes = data_bytes;
    d.flag_offset = flag_offset();
    d.flag_count = flag_count;
    d.writable_flags = scope;
  }
};

struct WaitWords {
  uint32_t host_abort = 0;
  uint32_t device_abort = 0;
  ErrorRecord error{};
  WaitParams params() { return WaitParams{0, &host_abort, &device_abort, &error}; }
};

Command make_write(uint32_t rank, uint64_t src, uint64_t dst, uint64_t length, uint32_t flag, uint64_t epoch) {
  Command c{};
  c.header = ring::type_only_header(CommandType::kWrite);
  c.dst_rank = rank;
  c.flag_index = flag;
  c.epoch = epoch;
  c.src_offset = src;
  c.dst_offset = dst;
  c.length = length;
  c.flag_value = epoch;
  return c;
}

Command make_signal(uint32_t rank, uint32_t flag, uint64_t epoch) {
  Command c{};
  c.header = ring::type_only_header(CommandType::kSignal);
  c.dst_rank = rank;
  c.flag_index = flag;
  c.epoch = epoch;
  c.flag_value = epoch;
  return c;
}

size_t thread_count() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// ---- validation: one case per rule ------------------------------------------------------------

// A proxy nobody stopped (an application that never closed its communicator) is stopped at
// exit before the exit handlers registered earlier run — the CUDA runtime's among them, which a
// lane thread still polling CUDA would crash into. The child registers its handler first, then
// leaks a running proxy and exits: by the time the handler runs, the lane must poll no more.
RecordingTransport* g_exit_transport = nullptr;

TEST(ProxyShutdown, AProxyLeftRunningStopsBeforeEarlierExitHandlers) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        std::atexit([] {
          const uint64_t before = g_exit_transport->polls();
          std::this_thread::sleep_for(50ms);
          std::_Exit(g_exit_transport->polls() == before ? 0 : 3);
        });
        g_exit_transport = new RecordingTransport(true, 1 << 20, 8);
        g_exit_transport->set_remote(1, 4096, 8);
        g_exit_transport->set_source_bytes(4096);
        Result<ring::HostRing> host_ring = ring::HostRing::create(4);
        if (!host_ring.ok()) std::_Exit(4);
        const WindowTable table = manual_table(0, 2, 4096, {{0, 0}, {4096, 8}}, {true, true});
        auto* ring_storage = new ring::HostRing(std::move(host_ring).value());
        Result<std::unique_ptr<Proxy>> proxy =
            Proxy::start({ProxyLane{ring_storage->view(), g_exit_transport, table}}, ProxyOptions{});
        if (!proxy.ok()) std::_Exit(5);
        (void)proxy->release();  // never stopped, never destroyed
        const uint64_t started = g_exit_transport->polls();
        std::this_thread::sleep_for(20ms);
        if (g_exit_transport->polls() == started) std::_Exit(6);  // the lane must be polling
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(ProxyValidation, EachRuleRejectsWithItsReason) {
  // rank 1 of 4; rank 2 has windows (100 data bytes, 4 flags); rank 3 is no peer of this transport.
  const WindowTable t = manual_table(1, 4, 64, {{0, 0}, {0, 0}, {100, 4}, {0, 0}}, {true, true, true, false});
  const EpochRange epochs{10, 5};  // epochs 10..14
  auto verdict = [&](const Command& c) { return validate_command(c, t, epochs); };

  EXPECT_EQ(verdict(make_write(2, 0, 0, 64, 3, 10)), Rejection::kNone);
  EXPECT_EQ(verdict(make_write(2, 0, 36, 64, ring::kNoFlag, 14)), Rejection::kNone) << "ends exactly at the window";
  EXPECT_EQ(verdict(make_signal(2, 0, 12)), Rejection::kNone);

  Command bad_type = make_write(2, 0, 0, 1, 0, 10);
  bad_type.header = 0;
  EXPECT_EQ(verdict(bad_type), Rejection::kUnknownType);
  bad_type.header = 3;
  EXPECT_EQ(verdict(bad_type), Rejection::kUnknownType);
  Command reserved = make_write(2, 0, 0, 1, 0, 10);
  reserved.reserved = 1;
  EXPECT_EQ(verdict(reserved), Rejection::kReservedNonZero);
  EXPECT_EQ(verdict(make_write(4, 0, 0, 1, 0, 10)), Rejection::kRankOutOfRange);
  EXPECT_EQ(verdict(make_write(0xffffffff, 0, 0, 1, 0, 10)), Rejection::kRankOutOfRange);
  EXPECT_EQ(verdict(make_write(1, 0, 0, 1, 0, 10)), Rejection::kNotAPeer) << "self";
  EXPECT_EQ(verdict(make_write(3, 0, 0, 1, 0, 10)), Rejection::kNotAPeer) << "no windows";
  EXPECT_EQ(verdict(make_write(2, 0, 0, 1, 0, 9)), Rejection::kEpochOutOfRange) << "stale";
  EXPECT_EQ(verdict(make_write(2, 0, 0, 1, 0, 15)), Rejection::kEpochOutOfRange) << "too far ahead";
  EXPECT_EQ(verdict(make_write(2, 0, 0, 1, 0, 0)), Rejection::kEpochOutOfRange);
  Command stale_flag = make_write(2, 0, 0, 1, 0, 10);
  stale_flag.flag_value = 3;
  EXPECT_EQ(verdict(stale_flag), Rejection::kFlagValueOutOfRange);
  EXPECT_EQ(verdict(make_write(2, 0, 0, 0, 0, 10)), Rejection::kEmptyWrite);
  EXPECT_EQ(verdict(make_write(2, 1, 0, 64, 0, 10)), Rejection::kSourceOutOfRange);
  EXPECT_EQ(verdict(make_write(2, UINT64_MAX - 5, 0, 10, 0, 10)), Rejection::kSourceOutOfRange) << "wraps";
  EXPECT_EQ(verdict(make_write(2, 0, 37, 64, 0, 10)), Rejection::kDestinationOutOfRange);
  EXPECT_EQ(verdict(make_write(2, 0, UINT64_MAX - 10, 20, 0, 10)), Rejection::kDestinationOutOfRange) << "wraps";
  EXPECT_EQ(verdict(make_write(2, 0, 100, 1, 0, 10)), Rejection::kDestinationOutOfRange);
  EXPECT_EQ(verdict(make_write(2, 0, 0, 1, 4, 10)), Rejection::kFlagOutOfRange);
  EXPECT_EQ(verdict(make_signal(2, ring::kNoFlag, 10)), Rejection::kFlagOutOfRange) << "a signal needs a flag";
  EXPECT_EQ(verdict(make_signal(2, 4, 10)), Rejection::kFlagOutOfRange);
}

// Scoped windows (docs/SECURITY.md "RDMA keys"): writes aimed at the destination's control region
// or at flag words of another sender are refused; data writes land in the data window's own
// registration, a permitted flag word's data in the flag window's.
TEST(ProxyValidation, ScopedWindowsRefuseTheControlRegionAndOtherSendersFlags) {
  // rank 0 of 2; rank 1: a 4096-byte control region, 16 flag words at 4096, data at 4224. Rank 0
  // may set words 2 (its entry word), 5 (its signature word) and 8..15 (per-launch flags).
  const ScopedWindow w{4096, 16, 1000, {{2, 1}, {5, 1}, {8, 8}}};
  WindowTable t = manual_table(0, 2, 8192, {{0, 0}, {0, 0}}, {true, true});
  w.apply(t.destinations[1]);
  const EpochRange epochs{10, 5};
  WriteTarget target;
  auto verdict = [&](const Command& c) { return validate_command(c, t, epochs, &target); };

  EXPECT_EQ(verdict(make_write(1, 0, w.data_offset(), 1000, 9, 10)), Rejection::kNone) << "the whole data window";
  EXPECT_EQ(target.handle, t.destinations[1].data_handle);
  EXPECT_EQ(target.offset, 0u) << "offsets into the data window's own registration";
  EXPECT_EQ(verdict(make_write(1, 0, w.data_offset() + 100, 8, ring::kNoFlag, 10)), Rejection::kNone);
  EXPECT_EQ(target.offset, 100u);
  EXPECT_EQ(verdict(make_write(1, 0, w.flag_offset() + 8 * 5, 8, 2, 10)), Rejection::kNone) << "entry: signature word, then flag";
  EXPECT_EQ(target.handle, t.destinations[1].flag_handle);
  EXPECT_EQ(target.offset, 40u);
  EXPECT_EQ(verdict(make_signal(1, 15, 10)), Rejection::kNone);

  // The control region, wholly or in part, and the words just below the data window.
  EXPECT_EQ(verdict(make_write(1, 0, 0, 64, ring::kNoFlag, 10)), Rejection::kProtectedDestination);
  EXPECT_EQ(verdict(make_write(1, 0, 4000, 200, 9, 10)), Rejection::kProtectedDestination) << "control + flags";
  EXPECT_EQ(verdict(make_write(1, 0, w.data_offset() - 8, 16, 9, 10)), Rejection::kProtectedDestination) << "straddles";
  // Flag words of another sender, as data or as the flag, and unaligned pieces of one's own.
  EXPECT_EQ(verdict(make_write(1, 0, w.flag_offset() + 8 * 3, 8, 9, 10)), Rejection::kProtectedDestination);
  EXPECT_EQ(verdict(make_write(1, 0, w.flag_offset() + 8 * 5, 16, 9, 10)), Rejection::kProtectedDestination) << "5 and 6";
  EXPECT_EQ(verdict(make_write(1, 0, w.flag_offset() + 8 * 5 + 1, 4, 9, 10)), Rejection::kProtectedDestination);
  EXPECT_EQ(verdict(make_write(1, 0, w.data_offset(), 8, 3, 10)), Rejection::kFlagNotWritable) << "another node's entry";
  EXPECT_EQ(verdict(make_write(1, 0, w.data_offset(), 8, 0, 10)), Rejection::kFlagNotWritable) << "a local entry word";
  EXPECT_EQ(verdict(make_signal(1, 7, 10)), Rejection::kFlagNotWritable);
  EXPECT_EQ(verdict(make_signal(1, 16, 10)), Rejection::kFlagOutOfRange);
  // Past the data window's end: out of range, as before.
  EXPECT_EQ(verdict(make_write(1, 0, w.data_offset() + 993, 8, 9, 10)), Rejection::kDestinationOutOfRange);
}

TEST(ProxyValidation, EpochRangeWrapsLikeSerialNumbers) {
  const EpochRange r{UINT64_MAX - 1, 4};  // MAX-1, MAX, 0, 1
  EXPECT_TRUE(r.contains(UINT64_MAX - 1));
  EXPECT_TRUE(r.contains(UINT64_MAX));
  EXPECT_TRUE(r.contains(0));
  EXPECT_TRUE(r.contains(1));
  EXPECT_FALSE(r.contains(2));
  EXPECT_FALSE(r.contains(UINT64_MAX - 2));
}

// ---- the fuzz ----------------------------------------------------------------------------------

// An independent statement of the rules (128-bit arithmetic instead of overflow checks), in the
// documented order of precedence.
Rejection reference_verdict(const Command& c, const WindowTable& t, uint64_t floor, uint64_t window) {
  using U128 = unsigned __int128;
  const unsigned type = c.header & 0xff;
  if (type != 1 && type != 2) return Rejection::kUnknownType;
  if (c.reserved != 0) return Rejection::kReservedNonZero;
  if (static_cast<int64_t>(c.dst_rank) >= t.world_size) return Rejection::kRankOutOfRange;
  if (static_cast<int>(c.dst_rank) == t.rank || !t.destinations[c.dst_rank].present) return Rejection::kNotAPeer;
  auto in_range = [&](uint64_t e) { return static_cast<U128>(static_cast<uint64_t>(e - floor)) < window; };
  if (!in_range(c.epoch)) return Rejection::kEpochOutOfRange;
  const bool flag = c.flag_index != 0xffffffffu;
  if (flag && !in_range(c.flag_value)) return Rejection::kFlagValueOutOfRange;
  const DestinationWindow& d = t.destinations[c.dst_rank];
  auto owned = [&](U128 word) {
    for (const WordRange& r : d.writable_flags) {
      if (word >= r.first && word < static_cast<U128>(r.first) + r.count) return true;
    }
    return false;
  };
  if (type == 1) {
    if (c.length == 0) return Rejection::kEmptyWrite;
    if (static_cast<U128>(c.src_offset) + c.length > t.source_bytes) return Rejection::kSourceOutOfRange;
    const U128 begin = c.dst_offset, end = static_cast<U128>(c.dst_offset) + c.length;
    if (end > ~uint64_t{0}) return Rejection::kDestinationOutOfRange;
    const U128 flags_begin = d.flag_offset, flags_end = static_cast<U128>(d.flag_offset) + 8 * static_cast<U128>(d.flag_count);
    if (begin >= d.data_offset && end <= static_cast<U128>(d.data_offset) + d.data_bytes) {
      // the data window
    } else if (d.flag_offset != LocalWindows::kNoOffset && begin >= flags_begin && end <= flags_end) {
      if ((begin - flags_begin) % 8 != 0 || c.length % 8 != 0) return Rejection::kProtectedDestination;
      for (U128 w = (begin - flags_begin) / 8; w < (end - flags_begin) / 8; ++w) {
        if (!owned(w)) return Rejection::kProtectedDestination;
      }
    } else if (begin < d.data_offset) {
      return Rejection::kProtectedDestination;
    } else {
      return Rejection::kDestinationOutOfRange;
    }
  } else if (!flag) {
    return Rejection::kFlagOutOfRange;
  }
  if (!flag) return Rejection::kNone;
  if (c.flag_index >= d.flag_count) return Rejection::kFlagOutOfRange;
  return owned(c.flag_index) ? Rejection::kNone : Rejection::kFlagNotWritable;
}

TEST(ProxyFuzz, HundredThousandRandomCommandsNeverWriteOutsideAWindow) {
  constexpr int kCommands = 100'000;
  // LOOM_TEST_FUZZ_SEED replays or widens the fuzz; CI uses the fixed seed.
  const char* seed_text = std::getenv("LOOM_TEST_FUZZ_SEED");
  const uint64_t seed = seed_text != nullptr ? std::strtoull(seed_text, nullptr, 10) : 20261107;
  RecordProperty("seed", std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto pick = [&](uint64_t n) { return n == 0 ? 0 : rng() % n; };

  // Random world and scoped windows (a control region, the flag window, the data window, and
  // which flag words this rank may set), and random epochs.
  const int world = 2 + static_cast<int>(pick(7));
  const int me = static_cast<int>(pick(world));
  std::vector<ScopedWindow> windows(world);
  std::vector<bool> present(world);
  RecordingTransport fake(/*ordered=*/true, /*max_write_bytes=*/4096, /*max_outstanding=*/64);
  fake.manual_handles = true;
  auto random_window = [&](bool usable) {
    ScopedWindow w;
    w.control = 8 * pick(600);
    w.flag_count = usable || pick(6) != 0 ? 1 + pick(64) : 0;
    w.data_bytes = usable || pick(6) != 0 ? 1 + pick(1 << 16) : 0;
    // This sender's flag words: one or two single words (its entry words) and a run at the top.
    for (int k = 0; k < 2; ++k) {
      if (w.flag_count > 0 && pick(2) == 0) w.scope.push_back({pick(w.flag_count), 1});
    }
    const uint64_t run = w.flag_count / 2;
    w.scope.push_back({run, w.flag_count - run});
    return w;
  };
  for (int r = 0; r < world; ++r) {
    present[r] = r != me && pick(5) != 0;
    windows[r] = random_window(false);
  }
  // At least one peer with room for data and flags, or nothing valid could be produced.
  const int peer = (me + 1) % world;
  present[peer] = true;
  windows[peer] = random_window(true);
  std::vector<std::pair<uint64_t, uint64_t>> sizes(world);
  for (int r = 0; r < world; ++r) {
    sizes[r] = {windows[r].data_bytes, windows[r].flag_count};
    fake.set_remote(r, present[r] ? sizes[r].first : 0, present[r] ? sizes[r].second : 0);
    fake.set_flag_scope(r, windows[r].scope);
  }
  std::vector<int> peers;
  for (int r = 0; r < world; ++r) {
    if (present[r] && sizes[r].first > 0 && sizes[r].second > 0) peers.push_back(r);
  }
  const uint64_t source_bytes = 1 + pick(1 << 16);
  fake.set_source_bytes(source_bytes);
  WindowTable table = manual_table(me, world, source_bytes, sizes, present);
  for (int r = 0; r < world; ++r) {
    if (table.destinations[r].present) windows[r].apply(table.destinations[r]);
  }
  const uint64_t floor = rng();  // anywhere, also close to the wrap
  const uint64_t window = 1 + pick(1000);

  // A value at, just below or just above a boundary, or anywhere.
  auto near = [&](uint64_t edge) -> uint64_t {
    switch (pick(6)) {
      case 0: return rng();
      case 1: return edge;
      case 2: return edge - 1 - pick(3);
      case 3: return edge + pick(3);
      case 4: return UINT64_MAX - pick(4);
      default: return pick(edge + 1);
    }
  };

  Result<ring::HostRing> host_ring = ring::HostRing::create(256);
  ASSERT_TRUE(host_ring.ok());
  ProxyOptions options;
  options.epochs = EpochRange{floor, window};
  options.stall_limit = 30s;
  Result<std::unique_ptr<Proxy>> proxy = Proxy::start({ProxyLane{host_ring->view(), &fake, table}}, options);
  ASSERT_TRUE(proxy.ok()) << proxy.status().to_string();

  std::array<uint64_t, kRejectionReasons> expected{};
  uint64_t expected_pieces = 0, expected_bytes = 0, expected_flags = 0;
  uint64_t aimed_at_control = 0, aimed_at_other_flags = 0;
  WaitWords words;
  ring::CpuProducer producer(host_ring->view(), words.params(), 30s);
  for (int i = 0; i < kCommands; ++i) {
    // A valid command to a random peer, then (two times in three) one to four fields replaced by
    // boundary or random values, or aimed at the destination's control region or at flag words
    // this rank may not write.
    Command c{};
    const int to = peers[pick(peers.size())];
    const ScopedWindow& w = windows[to];
    const uint64_t dst_window = w.data_bytes;
    const uint64_t dst_flags = w.flag_count;
    const WordRange& run = w.scope.back();
    c.header = pick(4) == 0 ? 2 : 1;
    c.dst_rank = static_cast<uint32_t>(to);
    c.epoch = floor + pick(window);
    c.flag_value = floor + pick(window);
    c.flag_index = pick(3) == 0 && c.header == 1 ? ring::kNoFlag : static_cast<uint32_t>(run.first + pick(run.count));
    c.length = 1 + pick(std::min(dst_window, source_bytes));
    c.src_offset = pick(source_bytes - c.length + 1);
    c.dst_offset = w.data_offset() + pick(dst_window - c.length + 1);
    c.producer = static_cast<uint32_t>(i);
    const int corruptions = pick(3) == 0 ? 0 : 1 + static_cast<int>(pick(4));
    for (int k = 0; k < corruptions; ++k) {
      switch (pick(12)) {
        case 0: c.header = pick(8) == 0 ? rng() : pick(4); break;
        case 1: c.reserved = static_cast<uint32_t>(1 + pick(UINT32_MAX)); break;
        case 2: c.dst_rank = pick(2) == 0 ? static_cast<uint32_t>(near(world)) : static_cast<uint32_t>(pick(world)); break;
        case 3: c.epoch = floor + near(window); break;
        case 4: c.flag_value = pick(2) == 0 ? rng() : floor + near(window); break;
        case 5: c.flag_index = pick(4) == 0 ? ring::kNoFlag : static_cast<uint32_t>(near(dst_flags)); break;
        case 6: c.length = pick(4) == 0 ? 0 : near(dst_window); break;
        case 7: c.src_offset = near(source_bytes); break;
        case 8: c.dst_offset = w.data_offset() + near(dst_window); break;
        case 9:  // into the control region (or across its end)
          c.dst_offset = pick(w.control + 8);
          c.length = pick(3) == 0 ? near(w.control) : 1 + pick(64);
          ++aimed_at_control;
          break;
        case 10:  // a word of the flag window as data, often another sender's; 8 bytes, or not
          c.dst_offset = w.flag_offset() + 8 * pick(dst_flags + 1) + (pick(8) == 0 ? 1 + pick(7) : 0);
          c.length = pick(4) == 0 ? 1 + pick(24) : 8 * (1 + pick(2));
          ++aimed_at_other_flags;
          break;
        default:  // a flag index outside this rank's words
          c.flag_index = static_cast<uint32_t>(pick(dst_flags));
          ++aimed_at_other_flags;
          break;
      }
    }

    const Rejection want = reference_verdict(c, table, floor, window);
    ++expected[static_cast<size_t>(want)];
    if (want == Rejection::kNone) {
      if ((c.header & 0xff) == 1) {
        expected_pieces += (c.length + 4095) / 4096;
        expected_bytes += c.length;
      }
      if (c.flag_index != ring::kNoFlag) ++expected_flags;
    }
    ASSERT_TRUE(producer.push(c)) << "push " << i;
  }
  ASSERT_NE((*proxy)->drain(30s).code(), StatusCode::kTimeout);
  Status stopped = (*proxy)->stop();
  EXPECT_TRUE(stopped.ok()) << stopped.to_string();

  const ProxyStats s = (*proxy)->stats();
  EXPECT_EQ(fake.out_of_window(), 0u) << "a write or flag landed outside its window";
  EXPECT_EQ(fake.out_of_scope(), 0u) << "a flag word of another sender was written";
  EXPECT_EQ(fake.out_of_source(), 0u);
  EXPECT_EQ(fake.wrong_handles(), 0u);
  EXPECT_EQ(fake.bad_pieces(), 0u);
  EXPECT_EQ(s.commands, static_cast<uint64_t>(kCommands));
  uint64_t rejected = 0;
  for (size_t r = 1; r < kRejectionReasons; ++r) {
    EXPECT_EQ(s.rejected_by_reason[r], expected[r]) << rejection_name(static_cast<Rejection>(r));
    rejected += expected[r];
  }
  EXPECT_EQ(s.rejected, rejected);
  EXPECT_EQ(fake.writes(), expected_pieces);
  EXPECT_EQ(fake.bytes(), expected_bytes);
  EXPECT_EQ(fake.flags(), expected_flags);
  // Every reason was exercised, or the fuzz would prove less than it claims.
  for (size_t r = 1; r < kRejectionReasons; ++r) {
    EXPECT_GT(expected[r], 0u) << "no command hit " << rejection_name(static_cast<Rejection>(r));
  }
  EXPECT_GT(expected[static_cast<size_t>(Rejection::kProtectedDestination)], 1000u) << aimed_at_control;
  EXPECT_GT(expected[static_cast<size_t>(Rejection::kFlagNotWritable)], 1000u) << aimed_at_other_flags;
  EXPECT_GT(expected[0], 20'000u) << "too few valid commands";
  // Rejections make the proxy unhealthy (a producer bug), with counts by reason.
  const Status health = (*proxy)->health();
  EXPECT_EQ(health.code(), StatusCode::kInternal);
  EXPECT_NE(health.message().find("destination out of range: "), std::string::npos) << health.to_string();
  EXPECT_NE(health.message().find("protected destination: "), std::string::npos) << health.to_string();
  EXPECT_NE(health.message().find("flag of another sender: "), std::string::npos) << health.to_string();
  RecordProperty("valid_commands", std::to_string(expected[0]));
}

// ---- ordering ----------------------------------------------------------------------------------

struct OrderingRun {
  std::vector<RecordingTransport::Event> events;
  Status health;
};

// Pushes `commands` through a proxy over `fake`, then drains.
OrderingRun run_commands(RecordingTransport& fake, const std::vector<Command>& commands, uint64_t data_bytes,
                         uint64_t flags) {
  fake.manual_handles = true;
  fake.set_remote(1, data_bytes, flags);
  fake.set_source_bytes(data_bytes);
  const WindowTable table = manual_table(0, 2, data_bytes, {{0, 0}, {data_bytes, flags}}, {true, true});
  Result<ring::HostRing> host_ring = ring::HostRing::create(64);
  EXPECT_TRUE(host_ring.ok());
  ProxyOptions options;
  options.epochs = EpochRange{1, 100};
  Result<std::unique_ptr<Proxy>> proxy = Proxy::start({ProxyLane{host_ring->view(), &fake, table}}, options);
  EXPECT_TRUE(proxy.ok());
  WaitWords words;
  ring::CpuProducer producer(host_ring->view(), words.params(), 10s);
  for (const Command& c : commands) EXPECT_TRUE(producer.push(c));
  OrderingRun run;
  run.health = (*proxy)->drain(10s);
  EXPECT_TRUE((*proxy)->stop().ok() || !run.health.ok());
  run.events = fake.events();
  return run;
}

// For command i: data at [i * 1000, + length), flag i. Checks that each flag was posted after
// every piece covering its data was posted (ordered) or completed (unordered).
void check_flag_after_data(const std::vector<RecordingTransport::Event>& events, const std::vector<Command>& commands,
                           bool need_completion) {
  std::map<uint64_t, std::pair<uint64_t, uint64_t>> write_range;  // id -> [begin, end)
  std::set<uint64_t> posted, completed;
  size_t flags_seen = 0;
  for (const auto& e : events) {
    if (e.kind == RecordingTransport::Event::kPostWrite) {
      write_range[e.id] = {e.offset, e.offset + e.bytes};
      posted.insert(e.id);
    } else if (e.kind == RecordingTransport::Event::kComplete) {
      completed.insert(e.id);
    } else {
      ++flags_seen;
      const size_t i = e.offset / 8;
      ASSERT_LT(i, commands.size());
      const Command& c = commands[i];
      // Bytes of command i's data covered by writes posted/completed so far.
      uint64_t covered = 0;
      for (const auto& [id, range] : write_range) {
        if (range.first < c.dst_offset || range.second > c.dst_offset + c.length) continue;
        if (need_completion && !completed.count(id)) continue;
        covered += range.second - range.first;
      }
      EXPECT_EQ(covered, c.length) << "flag " << i << " posted before its data " << (need_completion ? "completed" : "was posted");
      EXPECT_EQ(e.value, c.flag_value);
    }
  }
  EXPECT_EQ(flags_seen, commands.size());
}

std::vector<Command> flagged_writes(int count, uint64_t max_length, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Command> commands;
  for (int i = 0; i < count; ++i) {
    commands.push_back(make_write(1, 0, static_cast<uint64_t>(i) * 1000, 1 + rng() % max_length,
                                  static_cast<uint32_t>(i), 1 + static_cast<uint64_t>(i) % 50));
  }
  return commands;
}

TEST(ProxyOrdering, OrderedTransportPostsTheFlagRightBehindItsData) {
  RecordingTransport fake(/*ordered=*/true, /*max_write_bytes=*/100, /*max_outstanding=*/8);
  const std::vector<Command> commands = flagged_writes(200, 999, 1);
  OrderingRun run = run_commands(fake, commands, 200 * 1000, 200);
  EXPECT_TRUE(run.health.ok()) << run.health.to_string();
  check_flag_after_data(run.events, commands, /*need_completion=*/false);
  // "Right behind": on an ordered transport no flag waits for a completion.
  size_t flags_right_behind_a_write = 0;
  for (size_t i = 0; i + 1 < run.events.size(); ++i) {
    if (run.events[i].kind == RecordingTransport::Event::kPostWrite &&
        run.events[i + 1].kind == RecordingTransport::Event::kPostFlag) {
      ++flags_right_behind_a_write;
    }
  }
  EXPECT_GT(flags_right_behind_a_write, 0u);
}

TEST(ProxyOrdering, UnorderedTransportPostsTheFlagOnlyAfterEveryPieceCompleted) {
  RecordingTransport fake(/*ordered=*/false, /*max_write_bytes=*/64, /*max_outstanding=*/16);
  fake.set_random_completion(/*seed=*/7, /*delay_turns=*/2);
  const std::vector<Command> commands = flagged_writes(300, 999, 2);
  OrderingRun run = run_commands(fake, commands, 300 * 1000, 300);
  EXPECT_TRUE(run.health.ok()) << run.health.to_string();
  check_flag_after_data(run.events, commands, /*need_completion=*/true);
}

TEST(ProxyOrdering, SignalWaitsForEveryEarlierWrite) {
  for (bool ordered : {true, false}) {
    RecordingTransport fake(ordered, /*max_write_bytes=*/50, /*max_outstanding=*/32);
    fake.set_random_completion(/*seed=*/3, /*delay_turns=*/3);
    std::vector<Command> commands;
    for (int i = 0; i < 20; ++i) commands.push_back(make_write(1, 0, static_cast<uint64_t>(i) * 1000, 500, ring::kNoFlag, 5));
    commands.push_back(make_signal(1, 0, 5));
    OrderingRun run = run_commands(fake, commands, 20 * 1000, 1);
    EXPECT_TRUE(run.health.ok()) << run.health.to_string();
    std::set<uint64_t> posted, completed;
    bool signal_seen = false;
    for (const auto& e : run.events) {
      if (e.kind == RecordingTransport::Event::kPostWrite) posted.insert(e.id);
      if (e.kind == RecordingTransport::Event::kComplete) completed.insert(e.id);
      if (e.kind == RecordingTransport::Event::kPostFlag) {
        signal_seen = true;
        EXPECT_EQ(posted.size(), 20u * 10) << "ordered=" << ordered;
        for (uint64_t id : posted) EXPECT_TRUE(completed.count(id)) << "write " << id << " not complete at the signal";
      }
    }
    EXPECT_TRUE(signal_seen);
  }
}

// ---- errors, stop, stall ------------------------------------------------------------------------

TEST(ProxyErrors, ErrorCompletionIsReportedAndItsFlagNeverPosted) {
  RecordingTransport fake(/*ordered=*/false, /*max_write_bytes=*/1000, /*max_outstanding=*/4);
  fake.set_random_completion(5, 1);
  fake.fail_write(3);  // the third data write (ids count from 1)
  const std::vector<Command> commands = flagged_writes(10, 999, 4);
  const auto begin = std::chrono::steady_clock::now();
  OrderingRun run = run_commands(fake, commands, 10 * 1000, 10);
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 5s) << "an error must not hang the proxy";
  EXPECT_EQ(run.health.code(), StatusCode::kPeerFailure) << run.health.to_string();
  EXPECT_NE(run.health.message().find("remote access error"), std::string::npos) << run.health.to_string();
  EXPECT_NE(run.health.message().find("proxy lane 0"), std::string::npos) << run.health.to_string();
  for (const auto& e : run.events) {
    if (e.kind == RecordingTransport::Event::kPostFlag) {
      EXPECT_NE(e.offset / 8, 2u) << "flag of the failed write posted";
    }
  }
}

TEST(ProxyLifecycle, StopIsBoundedAndLeavesNoThread) {
  const size_t threads_before = thread_count();
  RecordingTransport fake(true, 1 << 20, 64);
  fake.manual_handles = true;
  const WindowTable table = manual_table(0, 2, 4096, {{0, 0}, {4096, 8}}, {true, true});
  std::vector<ring::HostRing> rings;
  std::vector<ProxyLane> lanes;
  for (uint32_t i = 0; i < 3; ++i) {
    rings.push_back(*ring::HostRing::create(16, i));
    lanes.push_back(ProxyLane{rings.back().view(), &fake, table});
  }
  ProxyOptions options;
  options.idle_sleep = std::chrono::microseconds(100'000);  // long idle sleeps: stop must cut them short
  Result<std::unique_ptr<Proxy>> proxy = Proxy::start(lanes, options);
  ASSERT_TRUE(proxy.ok()) << proxy.status().to_string();
  EXPECT_EQ(thread_count(), threads_before + 3);
  std::this_thread::sleep_for(300ms);  // let the lanes fall into their idle sleep
  EXPECT_TRUE((*proxy)->health().ok());
  const auto begin = std::chrono::steady_clock::now();
  EXPECT_TRUE((*proxy)->stop().ok());
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 50ms) << "stop waits for a sleeping lane";
  EXPECT_EQ(thread_count(), threads_before);
  EXPECT_TRUE((*proxy)->stop().ok()) << "idempotent";
}

TEST(ProxyLifecycle, StalledProxyTimesOutProducersAndReportsItself) {
  RecordingTransport fake(true, 1 << 20, 64);
  fake.manual_handles = true;
  fake.set_remote(1, 4096, 8);
  fake.set_source_bytes(4096);
  const WindowTable table = manual_table(0, 2, 4096, {{0, 0}, {4096, 8}}, {true, true});
  Result<ring::HostRing> host_ring = ring::HostRing::create(4);
  ASSERT_TRUE(host_ring.ok());
  ProxyOptions options;
  options.stall_limit = 150ms;
  Result<std::unique_ptr<Proxy>> proxy = Proxy::start({ProxyLane{host_ring->view(), &fake, table}}, options);
  ASSERT_TRUE(proxy.ok());
  (*proxy)->pause_for_test(true);
  std::this_thread::sleep_for(20ms);

  WaitWords words;
  ring::CpuProducer producer(host_ring->view(), words.params(), 300ms, OpId::kAgGemm, 0);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(producer.push(make_write(1, 0, 0, 8, 0, 1)));
  const auto begin = std::chrono::steady_clock::now();
  EXPECT_FALSE(producer.push(make_write(1, 0, 0, 8, 0, 1))) << "the ring is full and nobody consumes";
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 1300ms) << "T_op + 1 s";
  EXPECT_EQ(words.error.code, static_cast<uint32_t>(DeviceError::kTimeout));
  EXPECT_EQ(words.error.flag_kind, static_cast<uint32_t>(ring::kRingSpaceFlagKind));
  EXPECT_EQ(words.error.op, static_cast<uint32_t>(OpId::kAgGemm));

  const Status stalled = (*proxy)->health();
  EXPECT_EQ(stalled.code(), StatusCode::kTimeout) << stalled.to_string();
  EXPECT_NE(stalled.message().find("not progressing"), std::string::npos) << stalled.to_string();

  (*proxy)->pause_for_test(false);
  EXPECT_TRUE((*proxy)->drain(5s).ok());
  EXPECT_EQ((*proxy)->stats().commands, 4u);
  EXPECT_EQ(fake.writes(), 4u);
  EXPECT_TRUE((*proxy)->health().ok());
}

TEST(ProxyLifecycle, RejectsLanesItCannotServe) {
  RecordingTransport fake(true, 1, 1);
  Result<ring::HostRing> host_ring = ring::HostRing::create(4);
  ASSERT_TRUE(host_ring.ok());
  EXPECT_EQ(Proxy::start({}, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Proxy::start({ProxyLane{host_ring->view(), nullptr, manual_table(0, 1, 0, {{0, 0}}, {false})}}, {})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  WindowTable short_table = manual_table(0, 2, 0, {{0, 0}, {0, 0}}, {false, false});
  short_table.destinations.pop_back();
  EXPECT_EQ(Proxy::start({ProxyLane{host_ring->view(), &fake, short_table}}, {}).status().code(),
            StatusCode::kInvalidArgument);
}

// ---- epoch floor --------------------------------------------------------------------------------

TEST(ProxyEpochs, RaisingTheFloorRejectsStaleCommands) {
  RecordingTransport fake(true, 1 << 20, 64);
  fake.manual_handles = true;
  fake.set_remote(1, 4096, 8);
  fake.set_source_bytes(4096);
  const WindowTable table = manual_table(0, 2, 4096, {{0, 0}, {4096, 8}}, {true, true});
  Result<ring::HostRing> host_ring = ring::HostRing::create(8);
  ASSERT_TRUE(host_ring.ok());
  ProxyOptions options;
  options.epochs = EpochRange{1, 16};
  Result<std::unique_ptr<Proxy>> proxy = Proxy::start({ProxyLane{host_ring->view(), &fake, table}}, options);
  ASSERT_TRUE(proxy.ok());
  WaitWords words;
  ring::CpuProducer producer(host_ring->view(), words.params(), 5s);
  ASSERT_TRUE(producer.push(make_write(1, 0, 0, 8, 0, 3)));
  ASSERT_TRUE((*proxy)->drain(5s).ok());
  (*proxy)->set_epoch_floor(4);  // launch 3 is over (or was aborted)
  ASSERT_TRUE(producer.push(make_write(1, 0, 0, 8, 0, 3)));   // a late command of launch 3
  ASSERT_TRUE(producer.push(make_write(1, 0, 8, 8, 1, 4)));
  (void)(*proxy)->drain(5s);
  (void)(*proxy)->stop();
  const ProxyStats s = (*proxy)->stats();
  EXPECT_EQ(s.rejected_by_reason[static_cast<size_t>(Rejection::kEpochOutOfRange)], 1u);
  EXPECT_EQ(fake.writes(), 2u);
}

// ---- window exchange over a fake bootstrap ---------------------------------------------------------

// Answers all_gather with canned blobs for the other ranks (this rank's own comes from the call).
class CannedBootstrap final : public Bootstrap {
 public:
  CannedBootstrap(int rank, std::vector<std::vector<uint8_t>> blobs) : rank_(rank), blobs_(std::move(blobs)) {}
  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(blobs_.size()); }
  Status all_gather(const void* mine, void* all, size_t bytes) override {
    if (step_++ == 0) {  // lengths
      for (size_t r = 0; r < blobs_.size(); ++r) {
        uint64_t n = static_cast<int>(r) == rank_ ? *static_cast<const uint64_t*>(mine) : blobs_[r].size();
        std::memcpy(static_cast<char*>(all) + r * bytes, &n, sizeof(n));
      }
      return {};
    }
    for (size_t r = 0; r < blobs_.size(); ++r) {
      char* slot = static_cast<char*>(all) + r * bytes;
      std::memset(slot, 0, bytes);
      if (static_cast<int>(r) == rank_) {
        std::memcpy(slot, mine, bytes);
      } else {
        std::memcpy(slot, blobs_[r].data(), std::min(bytes, blobs_[r].size()));
      }
    }
    return {};
  }
  Status broadcast(void*, size_t, int) override { return {}; }
  Status barrier() override { return {}; }
  void report_failure(std::string_view) override {}

 private:
  int rank_;
  std::vector<std::vector<uint8_t>> blobs_;
  int step_ = 0;
};

std::vector<uint8_t> window_blob(uint64_t data_bytes, uint64_t flag_bytes, std::vector<uint8_t> dkey, std::vector<uint8_t> fkey,
                                 uint64_t data_offset = 0, uint64_t flag_offset = LocalWindows::kNoOffset) {
  std::vector<uint8_t> out;
  auto u64 = [&](uint64_t v) { for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i))); };
  auto u32 = [&](uint32_t v) { for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i))); };
  u64(data_offset);
  u64(data_bytes);
  u64(flag_offset);
  u64(flag_bytes);
  u32(static_cast<uint32_t>(dkey.size()));
  out.insert(out.end(), dkey.begin(), dkey.end());
  u32(static_cast<uint32_t>(fkey.size()));
  out.insert(out.end(), fkey.begin(), fkey.end());
  return out;
}

TEST(ProxyWindows, ExchangeImportsPeersAndSkipsTheRest) {
  RecordingTransport fake(true, 1 << 20, 8);
  CannedBootstrap boot(1, {window_blob(1000, 64, {1, 2}, {3}), {}, window_blob(5000, 16, {}, {}), window_blob(7, 8, {}, {})});
  TransportConfig config{1, 4, {true, false, true, false}};
  LocalWindows mine;
  mine.source = {1, 777, {}};
  mine.data = {1, 2048, {9}};
  mine.flags = {2, 80, {8}};
  Result<WindowTable> table = exchange_windows(boot, fake, config, mine);
  ASSERT_TRUE(table.ok()) << table.status().to_string();
  EXPECT_EQ(table->source_bytes, 777u);
  EXPECT_TRUE(table->destinations[0].present);
  EXPECT_EQ(table->destinations[0].data_bytes, 1000u);
  EXPECT_EQ(table->destinations[0].flag_count, 8u);
  EXPECT_EQ(table->destinations[0].data_handle, fake.data_handle(0));
  EXPECT_EQ(table->destinations[0].flag_handle, fake.flag_handle(0));
  EXPECT_FALSE(table->destinations[1].present) << "self";
  EXPECT_TRUE(table->destinations[2].present);
  EXPECT_EQ(table->destinations[2].flag_count, 2u);
  EXPECT_FALSE(table->destinations[3].present) << "not a peer of this transport";

  CannedBootstrap broken(0, {{}, {1, 2, 3}});
  EXPECT_EQ(exchange_windows(broken, fake, TransportConfig{0, 2, {false, true}}, mine).status().code(),
            StatusCode::kInternal);
  CannedBootstrap odd_flags(0, {{}, window_blob(10, 12, {}, {})});
  EXPECT_FALSE(exchange_windows(odd_flags, fake, TransportConfig{0, 2, {false, true}}, mine).ok());
  // A peer whose flag window overlaps its data window could be reached through either key.
  CannedBootstrap overlapping(0, {{}, window_blob(4096, 64, {}, {}, 1000, 1024)});
  EXPECT_FALSE(exchange_windows(overlapping, fake, TransportConfig{0, 2, {false, true}}, mine).ok());
}

// The scopes a multi-node rank takes from the exchange: the peer's heap offsets from its blob, the
// flag words from the sender's FlagScope (here network_flag_scope's).
TEST(ProxyWindows, ExchangeKeepsThePeersOffsetsAndTheSendersFlagScope) {
  RecordingTransport fake(true, 1 << 20, 8);
  CannedBootstrap boot(0, {{}, window_blob(1 << 20, 8 * 64, {1}, {2}, 1 << 17, 1 << 16)});
  LocalWindows mine;
  mine.data = {1, 2048, {9}};
  mine.flags = {2, 80, {8}};
  const FlagScope scope = [](int, uint64_t count) { return std::vector<WordRange>{{3, 1}, {40, count - 40}}; };
  Result<WindowTable> table = exchange_windows(boot, fake, TransportConfig{0, 2, {false, true}}, mine, scope);
  ASSERT_TRUE(table.ok()) << table.status().to_string();
  const DestinationWindow& d = table->destinations[1];
  EXPECT_EQ(d.data_offset, 1u << 17);
  EXPECT_EQ(d.flag_offset, 1u << 16);
  EXPECT_EQ(d.flag_count, 64u);
  EXPECT_TRUE(d.may_write_flag(3));
  EXPECT_FALSE(d.may_write_flag(4));
  EXPECT_TRUE(d.may_write_flag(63));
  EXPECT_FALSE(d.may_write_flag(64));
}

// ---- NUMA -----------------------------------------------------------------------------------------

TEST(ProxyNuma, ParsesCpuLists) {
  EXPECT_EQ(*parse_cpu_list("0-3,8,10-11\n"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(*parse_cpu_list("5"), (std::vector<int>{5}));
  EXPECT_TRUE(parse_cpu_list("")->empty());
  for (const char* bad : {"a", "1-", "3-1", "1,,2", "-1", "1 2"}) EXPECT_FALSE(parse_cpu_list(bad).ok()) << bad;
}

class FakeSysfs {
 public:
  FakeSysfs(const std::string& bus_id, const std::string& numa_node, const std::string& cpulist) {
    root_ = std::filesystem::temp_directory_path() / ("loom-sysfs-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++));
    std::filesystem::create_directories(root_ / "bus/pci/devices" / bus_id);
    std::ofstream(root_ / "bus/pci/devices" / bus_id / "numa_node") << numa_node << "\n";
    std::filesystem::create_directories(root_ / "devices/system/node/node0");
    std::ofstream(root_ / "devices/system/node/node0/cpulist") << cpulist << "\n";
  }
  ~FakeSysfs() { std::filesystem::remove_all(root_); }
  std::string root() const { return root_.string(); }

 private:
  std::filesystem::path root_;
  static inline int counter_ = 0;
};

int first_allowed_cpu() {
  cpu_set_t set;
  CPU_ZERO(&set);
  sched_getaffinity(0, sizeof(set), &set);
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) return c;
  }
  return 0;
}

TEST(ProxyNuma, FindsTheGpusNodeAndPinsTheLanes) {
  const int cpu = first_allowed_cpu();
  FakeSysfs sysfs("0000:18:00.0", "0", std::to_string(cpu));
  Result<std::vector<int>> cpus = numa_cpus_of_pci_device(sysfs.root(), "00000000:18:00.0");  // CUDA's spelling
  ASSERT_TRUE(cpus.ok()) << cpus.status().to_string();
  EXPECT_EQ(*cpus, std::vector<int>{cpu});

  RecordingTransport fake(true, 1, 4);
  Result<ring::HostRing> host_ring = ring::HostRing::create(4);
  ASSERT_TRUE(host_ring.ok());
  ProxyOptions options;
  options.gpu_pci_bus_id = "0000:18:00.0";
  options.sysfs_root = sysfs.root();
  Result<std::unique_ptr<Proxy>> proxy =
      Proxy::start({ProxyLane{host_ring->view(), &fake, manual_table(0, 1, 0, {{0, 0}}, {false})}}, options);
  ASSERT_TRUE(proxy.ok());
  for (int i = 0; i < 200 && !(*proxy)->pinned(); ++i) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE((*proxy)->pinned());
  EXPECT_TRUE((*proxy)->stop().ok());
}

TEST(ProxyNuma, PinningFailuresAreWarningsNotErrors) {
  RecordingTransport fake(true, 1, 4);
  Result<ring::HostRing> host_ring = ring::HostRing::create(4);
  ASSERT_TRUE(host_ring.ok());
  const WindowTable table = manual_table(0, 1, 0, {{0, 0}}, {false});
  {
    FakeSysfs no_node("0000:18:00.0", "-1", "0");
    EXPECT_TRUE(numa_cpus_of_pci_device(no_node.root(), "0000:18:00.0")->empty());
  }
  for (const char* bus : {"0000:99:00.0", "garbage"}) {  // missing device, malformed id
    ProxyOptions options;
    options.gpu_pci_bus_id = bus;
    options.sysfs_root = "/nonexistent-sysfs";
    Result<std::unique_ptr<Proxy>> proxy = Proxy::start({ProxyLane{host_ring->view(), &fake, table}}, options);
    ASSERT_TRUE(proxy.ok()) << bus;
    EXPECT_FALSE((*proxy)->pinned());
    EXPECT_TRUE((*proxy)->health().ok());
    EXPECT_TRUE((*proxy)->stop().ok());
  }
  // A node listing CPUs this process may not use: setaffinity fails, the lane still runs.
  FakeSysfs unusable("0000:18:00.0", "0", "4000");
  ProxyOptions options;
  options.gpu_pci_bus_id = "0000:18:00.0";
  options.sysfs_root = unusable.root();
  Result<std::unique_ptr<Proxy>> proxy = Proxy::start({ProxyLane{host_ring->view(), &fake, table}}, options);
  ASSERT_TRUE(proxy.ok());
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE((*proxy)->pinned());
  EXPECT_TRUE((*proxy)->health().ok());
}

// ---- settings, transport choice, shaping ---------------------------------------------------------

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value, 1); else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1); else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(NetworkSettings, DefaultsAndValues) {
  {
    ScopedEnv a("LOOM_TRANSPORT", nullptr), b("LOOM_EMULATE_NODES", nullptr), c("LOOM_EMULATE_NET_GBPS", nullptr),
        d("LOOM_EMULATE_NET_LAT_US", nullptr), e("LOOM_PROXY_THREADS", nullptr);
    Result<NetworkSettings> s = NetworkSettings::from_env();
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->transport, TransportChoice::kAuto);
    EXPECT_EQ(s->emulate_nodes, 1);
    EXPECT_EQ(s->emulate_net_gbps, 0.0);
    EXPECT_EQ(s->proxy_threads, 1);
  }
  ScopedEnv a("LOOM_TRANSPORT", "fabric"), b("LOOM_EMULATE_NODES", "2"), c("LOOM_EMULATE_NET_GBPS", "12.5"),
      d("LOOM_EMULATE_NET_LAT_US", "3"), e("LOOM_PROXY_THREADS", "4"), f("LOOM_NET_DEVICE", "mlx5_0"),
      g("LOOM_IB_GID_INDEX", "3");
  Result<NetworkSettings> s = NetworkSettings::from_env();
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->transport, TransportChoice::kFabric);
  EXPECT_EQ(s->emulate_nodes, 2);
  EXPECT_DOUBLE_EQ(s->emulate_net_gbps, 12.5);
  EXPECT_DOUBLE_EQ(s->emulate_net_latency_us, 3.0);
  EXPECT_EQ(s->proxy_threads, 4);
  EXPECT_EQ(s->net_device, "mlx5_0");
  EXPECT_EQ(s->ib_gid_index, 3);
}

TEST(NetworkSettings, BadValuesNameTheVariable) {
  const std::pair<const char*, const char*> cases[] = {
      {"LOOM_TRANSPORT", "rdma"},        {"LOOM_TRANSPORT", ""},          {"LOOM_EMULATE_NODES", "0"},
      {"LOOM_EMULATE_NODES", "abc"},     {"LOOM_EMULATE_NET_GBPS", "-1"}, {"LOOM_EMULATE_NET_GBPS", "1e3"},
      {"LOOM_EMULATE_NET_GBPS", "nan"},  {"LOOM_EMULATE_NET_GBPS", "."},  {"LOOM_EMULATE_NET_LAT_US", "1.2.3"},
      {"LOOM_PROXY_THREADS", "2147483647"}, {"LOOM_NET_DEVICE", ""},      {"LOOM_IB_GID_INDEX", "-1"},
  };
  for (const auto& [name, value] : cases) {
    ScopedEnv v(name, value);
    Result<NetworkSettings> s = NetworkSettings::from_env();
    ASSERT_FALSE(s.ok()) << name << "=" << value;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(name), std::string::npos) << s.status().to_string();
  }
}

Topology topology_of(int hosts, int ranks_per_host, int emulate_nodes, int me) {
  std::vector<RankDescriptor> ranks(static_cast<size_t>(hosts * ranks_per_host));
  for (size_t r = 0; r < ranks.size(); ++r) {
    std::snprintf(ranks[r].host_id, sizeof(ranks[r].host_id), "host%zu", r / ranks_per_host);
    std::snprintf(ranks[r].pci_bus_id, sizeof(ranks[r].pci_bus_id), "0000:%02zx:00.0", r % ranks_per_host + 1);
    ranks[r].local_rank_hint = static_cast<int32_t>(r % ranks_per_host);
  }
  return *build_topology(ranks, me, emulate_nodes);
}

TEST(TransportChoice, AutoFollowsTheTopologyAndTheProbe) {
  NetworkSettings s;
  NetworkProbe none{false, "libibverbs.so.1 not found", false, "libfabric.so.1 not found"};
  NetworkProbe verbs{true, "mlx5_0 port 1 active", true, "tcp"};
  NetworkProbe fabric_only{false, "no active device", true, "efa"};

  // One host, no emulation: nothing crosses nodes.
  EXPECT_EQ(choose_transport(s, topology_of(1, 4, 1, 0), none)->transport, TransportChoice::kCopyEngine);
  // Emulated nodes on one host: copy_engine, whatever NICs exist.
  s.emulate_nodes = 2;
  Result<TransportDecision> d = choose_transport(s, topology_of(1, 4, 2, 0), verbs);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->transport, TransportChoice::kCopyEngine);
  EXPECT_NE(d->reason.find("emulated"), std::string::npos);
  // Two real hosts: verbs first, then fabric, else unsupported naming both reasons.
  s.emulate_nodes = 1;
  EXPECT_EQ(choose_transport(s, topology_of(2, 2, 1, 0), verbs)->transport, TransportChoice::kVerbs);
  EXPECT_EQ(choose_transport(s, topology_of(2, 2, 1, 0), fabric_only)->transport, TransportChoice::kFabric);
  Result<TransportDecision> nothing = choose_transport(s, topology_of(2, 2, 1, 0), none);
  ASSERT_FALSE(nothing.ok());
  EXPECT_EQ(nothing.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(nothing.status().message().find("libibverbs.so.1 not found"), std::string::npos);
  // Two hosts each split in two: some cross-node peers are remote, so not copy_engine.
  s.emulate_nodes = 2;
  EXPECT_EQ(choose_transport(s, topology_of(2, 4, 2, 0), verbs)->transport, TransportChoice::kVerbs);
}

TEST(TransportChoice, ExplicitChoicesAreCheckedNotOverridden) {
  NetworkSettings s;
  NetworkProbe none{false, "libibverbs.so.1 not found", false, "no provider"};
  s.transport = TransportChoice::kCopyEngine;
  EXPECT_EQ(choose_transport(s, topology_of(2, 2, 1, 0), none).status().code(), StatusCode::kUnsupported);
  s.emulate_nodes = 2;
  EXPECT_EQ(choose_transport(s, topology_of(1, 4, 2, 1), none)->transport, TransportChoice::kCopyEngine);
  s.transport = TransportChoice::kVerbs;
  Result<TransportDecision> v = choose_transport(s, topology_of(1, 4, 2, 1), none);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("LOOM_TRANSPORT=verbs"), std::string::npos);
  s.transport = TransportChoice::kFabric;
  EXPECT_EQ(choose_transport(s, topology_of(1, 4, 2, 1), NetworkProbe{false, "", true, "tcp"})->transport,
            TransportChoice::kFabric);
}

TEST(LinkShaper, PacesRateAndAddsLatency) {
  using Clock = LinkShaper::Clock;
  const Clock::time_point t0{};
  LinkShaper off;
  EXPECT_FALSE(off.enabled());
  EXPECT_EQ(off.schedule(1 << 20, t0), t0);

  LinkShaper link(/*gbps=*/2.0, /*latency_us=*/10.0);  // 2 bytes per ns
  EXPECT_EQ(link.schedule(1000, t0), t0 + 500ns + 10us);              // serialization, then latency
  EXPECT_EQ(link.schedule(1000, t0), t0 + 1000ns + 10us);             // queued behind the first
  EXPECT_EQ(link.schedule(2000, t0 + 1ms), t0 + 1ms + 1000ns + 10us); // the link went idle meanwhile
  // Sustained: 1 GB offered at once arrives 0.5 s later, whatever the op size.
  LinkShaper bulk(2.0, 0.0);
  Clock::time_point last{};
  for (int i = 0; i < 1000; ++i) last = bulk.schedule(1'000'000, t0);
  EXPECT_EQ(last, t0 + 500ms);
  // Latency only: every op arrives `latency` after it was offered (pipelined, not serialized).
  LinkShaper delay(0.0, 50.0);
  EXPECT_EQ(delay.schedule(1 << 30, t0), t0 + 50us);
  EXPECT_EQ(delay.schedule(8, t0 + 1us), t0 + 51us);
}

// ---- completion in ring order (RingControl::completed) -------------------------------------------

// A kernel waits for `completed` before its source buffers may be reused (runtime/network.h): it
// must count a command only once every operation of it, and of every command before it, has
// completed, and rejected commands must not hold it back.
TEST(ProxyCompletion, CompletedCountsCommandsInRingOrder) {
  for (bool ordered : {true, false}) {
    RecordingTransport fake(ordered, /*max_write_bytes=*/64, /*max_outstanding=*/16);
    fake.set_random_completion(/*seed=*/11, /*delay_turns=*/2);
    std::vector<Command> commands = flagged_writes(300, 999, 9);
    for (size_t i = 0; i < commands.size(); i += 7) commands[i].reserved = 1;  // rejected ones in between
    commands.push_back(make_signal(1, 0, 5));
    fake.manual_handles = true;
    fake.set_remote(1, 300 * 1000, 300);
    fake.set_source_bytes(300 * 1000);
    const WindowTable table = manual_table(0, 2, 300 * 1000, {{0, 0}, {300 * 1000, 300}}, {true, true});
    Result<ring::HostRing> host_ring = ring::HostRing::create(64);
    ASSERT_TRUE(host_ring.ok());
    uint64_t* completed = ring::ring_completed(host_ring->view());
    ProxyOptions options;
    options.epochs = EpochRange{1, 100};
    Result<std::unique_ptr<Proxy>> proxy = Proxy::start({ProxyLane{host_ring->view(), &fake, table}}, options);
    ASSERT_TRUE(proxy.ok());
    WaitWords words;
    ring::CpuProducer producer(host_ring->view(), words.params(), 10s);
    uint64_t last = 0;
    bool monotonic = true;
    for (const Command& c : commands) {
      ASSERT_TRUE(producer.push(c));
      const uint64_t now = std::atomic_ref<uint64_t>(*completed).load(std::memory_order_acquire);
      monotonic = monotonic && now >= last;
      last = now;
    }
    (void)(*proxy)->drain(10s);
    EXPECT_TRUE(monotonic) << "ordered=" << ordered;
    EXPECT_EQ(std::atomic_ref<uint64_t>(*completed).load(), commands.size()) << "ordered=" << ordered;
    (void)(*proxy)->stop();
  }
}

// Operations that never complete hold `completed` at the command before them, however many
// commands follow; a rejected command at the front counts at once.
TEST(ProxyCompletion, IncompleteOperationsHoldTheCountBack) {
  RecordingTransport fake(/*ordered=*/true, /*max_write_bytes=*/1000, /*max_outstanding=*/64);
  fake.set_random_completion(/*seed=*/1, /*delay_turns=*/1 << 30);  // nothing ever completes
  fake.manual_handles = true;
  fake.set_remote(1, 10000, 10);
  fake.set_source_bytes(10000);
  const WindowTable table = manual_table(0, 2, 10000, {{0, 0}, {10000, 10}}, {true, true});
  Result<ring::HostRing> host_ring = ring::HostRing::create(16);
  ASSERT_TRUE(host_ring.ok());
  uint64_t* completed = ring::ring_completed(host_ring->view());
  ProxyOptions options;
  options.epochs = EpochRange{1, 100};
  Result<std::unique_ptr<Proxy>> proxy = Proxy::start({ProxyLane{host_ring->view(), &fake, table}}, options);
  ASSERT_TRUE(proxy.ok());
  WaitWords words;
  ring::CpuProducer producer(host_ring->view(), words.params(), 10s);
  Command rejected = make_write(1, 0, 0, 10, 0, 5);
  rejected.reserved = 1;
  ASSERT_TRUE(producer.push(rejected));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(producer.push(make_write(1, 0, 100 * i, 10, static_cast<uint32_t>(i), 5)));
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while ((*proxy)->stats().commands < 5 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ((*proxy)->stats().commands, 5u);
  EXPECT_EQ(std::atomic_ref<uint64_t>(*completed).load(), 1u) << "only the rejected command is complete";
  (void)(*proxy)->stop(std::chrono::milliseconds(10));
}

}  // namespace
}  // namespace loom::runtime::net
