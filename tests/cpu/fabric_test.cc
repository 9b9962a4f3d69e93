// fabric transport end to end on loopback: 2-4 forked processes, bootstrap over 127.0.0.1 to
// exchange endpoints and windows, a proxy per rank fed by a CPU producer, libfabric's tcp
// provider underneath. Proves bit-exact payloads from 1 B to 64 MiB, that a receiver never sees
// a flag before its data (checked the moment each flag is seen), that nothing outside the written
// ranges changes (guard bytes), both posting paths (ordered: flag right behind the data;
// unordered: flag after delivery-complete), kSignal as a fence, and the failure paths (library
// missing, unknown provider, a write with a wrong key reported as an error completion).
//
// libfabric is only ever loaded in forked children (providers may start threads, which a fork
// would not carry). When the provider cannot run here, the tests skip and say why.
#include <gtest/gtest.h>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/bootstrap.h"
#include "runtime/command_ring.h"
#include "runtime/proxy.h"
#include "runtime/transports/fabric.h"
#include "runtime/transports/transport.h"

namespace loom::runtime::net {
namespace {

using namespace std::chrono_literals;

// ---- forked ranks: each child sends back (status code, message) through a pipe ------------------

struct Outcome {
  bool reported = false;
  StatusCode code = StatusCode::kInternal;
  std::string message;
};

std::vector<Outcome> run_forked(int count, const std::function<Status(int)>& body,
                                const std::function<void()>& after_fork = {}, std::chrono::seconds limit = 50s) {
  struct Child {
    pid_t pid;
    int fd;
    std::string record;
    bool open = true;
  };
  std::vector<Child> children;
  for (int r = 0; r < count; ++r) {
    int ends[2];
    if (::pipe(ends) != 0) return {};
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(ends[0]);
      const Status status = body(r);
      std::string record(1, static_cast<char>(status.code()));
      record += status.message();
      (void)!::write(ends[1], record.data(), record.size());
      ::_exit(0);
    }
    ::close(ends[1]);
    children.push_back(Child{pid, ends[0], {}});
  }
  if (after_fork) after_fork();
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (true) {
    std::vector<pollfd> fds;
    std::vector<Child*> open;
    for (Child& c : children) {
      if (c.open) {
        fds.push_back({c.fd, POLLIN, 0});
        open.push_back(&c);
      }
    }
    if (fds.empty()) break;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      ADD_FAILURE() << "ranks did not finish within " << limit.count() << " s";
      break;
    }
    if (::poll(fds.data(), fds.size(), static_cast<int>(left.count())) <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      char buffer[4096];
      const ssize_t n = ::read(open[i]->fd, buffer, sizeof(buffer));
      if (n > 0) {
        open[i]->record.append(buffer, static_cast<size_t>(n));
      } else {
        ::close(open[i]->fd);
        open[i]->open = false;
      }
    }
  }
  std::vector<Outcome> outcomes;
  for (Child& c : children) {
    if (c.open) ::close(c.fd);
    for (int i = 0; i < 500 && ::waitpid(c.pid, nullptr, WNOHANG) == 0; ++i) std::this_thread::sleep_for(10ms);
    if (::waitpid(c.pid, nullptr, WNOHANG) == 0) {
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, nullptr, 0);
    }
    Outcome o;
    if (!c.record.empty()) {
      o.reported = true;
      o.code = static_cast<StatusCode>(c.record[0]);
      o.message = c.record.substr(1);
    }
    outcomes.push_back(o);
  }
  return outcomes;
}

// Runs `probe` in a child; returns its verdict (ok, or why the provider cannot run here).
Status probe_in_child(const FabricOptions& options) {
  std::vector<Outcome> o = run_forked(1, [&](int) -> Status { return probe_fabric(options).status(); });
  if (o.empty() || !o[0].reported) return Status::internal("the probe child died");
  return o[0].code == StatusCode::kOk ? Status{} : Status(o[0].code, o[0].message);
}

#define SKIP_UNLESS_PROVIDER_RUNS(options)                                                               \
  do {                                                                                                   \
    const Status loom_probe_ = probe_in_child(options);                                                  \
    if (loom_probe_.code() == StatusCode::kUnsupported) {                                                \
      GTEST_SKIP() << "libfabric provider '" << (options).provider << "' cannot run here: " << loom_probe_.message(); \
    }                                                                                                    \
    ASSERT_TRUE(loom_probe_.ok()) << loom_probe_.to_string();                                            \
  } while (0)

// ---- one rank of a transfer job -----------------------------------------------------------------

constexpr uint8_t kGuard = 0xA5;
constexpr uint64_t kGap = 64;            // guard bytes between messages in a receive window
constexpr uint64_t kSourceSlack = 65536; // messages start at varying source offsets below this

uint8_t payload_byte(int sender, uint64_t source_position) {
  uint64_t x = (source_position + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(sender + 1) << 56);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<uint8_t>(x);
}

uint64_t source_offset(size_t message) { return (message * 977) % kSourceSlack; }

struct Job {
  int world = 2;
  std::vector<uint64_t> sizes;     // message sizes each sender sends to each destination
  bool all_to_all = false;         // else: rank r sends to r + 1
  bool with_fence = false;         // a kSignal per destination after the data
  FabricOptions fabric;
};

// Where sender s's message k lands in a receiver's window, and the window size.
struct Layout {
  std::vector<std::vector<uint64_t>> offset;  // [sender][message]
  uint64_t bytes = 0;
};

Layout layout_for(const Job& job) {
  Layout l;
  l.offset.assign(static_cast<size_t>(job.world), {});
  uint64_t at = kGap;
  for (int s = 0; s < job.world; ++s) {
    for (uint64_t size : job.sizes) {
      l.offset[s].push_back(at);
      at += size + kGap;
      at = (at + 7) & ~uint64_t{7};
    }
  }
  l.bytes = at;
  return l;
}

bool sends_to(const Job& job, int from, int to) {
  if (from == to) return false;
  return job.all_to_all || to == (from + 1) % job.world;
}

constexpr uint64_t kEpoch = 5;

Status run_rank(const Job& job, const UniqueId& id, int rank) {
  const int world = job.world;
  const size_t messages = job.sizes.size();
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Bootstrap> boot, Bootstrap::from_unique_id(id, rank, world, 30s));
  TransportConfig config{rank, world, std::vector<bool>(static_cast<size_t>(world), true)};
  config.peers[rank] = false;
  Result<std::unique_ptr<Transport>> made = create_fabric_transport(config, job.fabric);
  if (!made.ok()) {
    boot->report_failure(made.status().to_string());
    return made.status();
  }
  Transport& transport = **made;

  uint64_t largest = 0;
  for (uint64_t s : job.sizes) largest = std::max(largest, s);
  std::vector<uint8_t> source(largest + kSourceSlack);
  for (uint64_t i = 0; i < source.size(); ++i) source[i] = payload_byte(rank, i);
  const Layout layout = layout_for(job);
  std::vector<uint8_t> window(layout.bytes, kGuard);
  // Flags: [sender * messages + k] data flags, then [world * messages + sender] fences.
  std::vector<uint64_t> flags(static_cast<size_t>(world) * messages + world, 0);

  LocalWindows mine;
  LOOM_ASSIGN_OR_RETURN(mine.source, transport.register_memory({source.data(), source.size(), MemoryKind::kHost, -1}));
  LOOM_ASSIGN_OR_RETURN(mine.data, transport.register_memory({window.data(), window.size(), MemoryKind::kHost, -1}));
  LOOM_ASSIGN_OR_RETURN(mine.flags,
                        transport.register_memory({flags.data(), flags.size() * sizeof(uint64_t), MemoryKind::kHost, -1}));
  LOOM_TRY_CTX(exchange_endpoints(*boot, transport), "exchanging endpoints");
  LOOM_ASSIGN_OR_RETURN(WindowTable table, exchange_windows(*boot, transport, config, mine));

  LOOM_ASSIGN_OR_RETURN(ring::HostRing host_ring, ring::HostRing::create(256));
  ProxyOptions proxy_options;
  proxy_options.epochs = EpochRange{kEpoch, 4};
  proxy_options.stall_limit = 20s;
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Proxy> proxy, Proxy::start({ProxyLane{host_ring.view(), &transport, table}}, proxy_options));
  LOOM_TRY_CTX(boot->barrier(), "barrier before the transfers");

  // Receiver: watches every expected flag; the moment one is seen, its data must be complete.
  std::atomic<bool> receiver_ok{true};
  std::string receiver_error;
  std::thread receiver([&] {
    std::vector<std::pair<int, size_t>> expected;  // (sender, message) still to arrive
    std::vector<int> fences;
    for (int s = 0; s < world; ++s) {
      if (!sends_to(job, s, rank)) continue;
      for (size_t k = 0; k < messages; ++k) expected.push_back({s, k});
      if (job.with_fence) fences.push_back(s);
    }
    auto check_data = [&](int s, size_t k) -> bool {
      const uint8_t* got = window.data() + layout.offset[s][k];
      for (uint64_t i = 0; i < job.sizes[k]; ++i) {
        if (got[i] != payload_byte(s, source_offset(k) + i)) {
          receiver_error = "message " + std::to_string(k) + " (" + std::to_string(job.sizes[k]) + " B) from rank " +
                           std::to_string(s) + ": byte " + std::to_string(i) + " wrong when its flag was seen";
          return false;
        }
      }
      return true;
    };
    const auto deadline = std::chrono::steady_clock::now() + 40s;
    while (!expected.empty() || !fences.empty()) {
      bool moved = false;
      for (size_t i = 0; i < expected.size();) {
        const auto [s, k] = expected[i];
        const uint64_t v = std::atomic_ref<uint64_t>(flags[s * messages + k]).load(std::memory_order_acquire);
        if (v == 0) {
          ++i;
          continue;
        }
        if (v != kEpoch) {
          receiver_error = "flag of message " + std::to_string(k) + " from rank " + std::to_string(s) + " is " + std::to_string(v);
          receiver_ok = false;
          return;
        }
        if (!check_data(s, k)) {
          receiver_ok = false;
          return;
        }
        expected.erase(expected.begin() + static_cast<std::ptrdiff_t>(i));
        moved = true;
      }
      for (size_t i = 0; i < fences.size();) {
        const int s = fences[i];
        if (std::atomic_ref<uint64_t>(flags[world * messages + s]).load(std::memory_order_acquire) == 0) {
          ++i;
          continue;
        }
        // The fence follows every write of that sender: all its data is here, flags or not.
        for (size_t k = 0; k < messages; ++k) {
          if (!check_data(s, k)) {
            receiver_error = "after the fence: " + receiver_error;
            receiver_ok = false;
            return;
          }
        }
        fences.erase(fences.begin() + static_cast<std::ptrdiff_t>(i));
        moved = true;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        receiver_error = std::to_string(expected.size()) + " messages and " + std::to_string(fences.size()) +
                         " fences never arrived";
        receiver_ok = false;
        return;
      }
      if (!moved) std::this_thread::sleep_for(20us);
    }
  });

  // Sender: every message to every destination, through the ring.
  uint32_t host_abort = 0, device_abort = 0;
  ErrorRecord error{};
  ring::CpuProducer producer(host_ring.view(), WaitParams{0, &host_abort, &device_abort, &error}, 30s);
  bool pushed = true;
  for (int d = 0; d < world && pushed; ++d) {
    if (!sends_to(job, rank, d)) continue;
    for (size_t k = 0; k < messages && pushed; ++k) {
      ring::Command c{};
      c.header = ring::type_only_header(ring::CommandType::kWrite);
      c.dst_rank = static_cast<uint32_t>(d);
      c.flag_index = static_cast<uint32_t>(rank * messages + k);
      c.epoch = kEpoch;
      c.flag_value = kEpoch;
      c.src_offset = source_offset(k);
      c.dst_offset = layout.offset[rank][k];
      c.length = job.sizes[k];
      c.producer = static_cast<uint32_t>(rank);
      pushed = producer.push(c);
    }
    if (job.with_fence && pushed) {
      ring::Command f{};
      f.header = ring::type_only_header(ring::CommandType::kSignal);
      f.dst_rank = static_cast<uint32_t>(d);
      f.flag_index = static_cast<uint32_t>(world * messages + rank);
      f.epoch = kEpoch;
      f.flag_value = kEpoch;
      pushed = producer.push(f);
    }
  }
  receiver.join();
  Status drained = proxy->drain(20s);
  // Everyone has received everything before anyone tears down (a peer's proxy must keep
  // progressing until the last write to it has landed).
  Status met = boot->barrier();
  Status stopped = proxy->stop();
  Status closed = transport.close();
  if (!pushed) return Status::timeout("producer gave up: ring stayed full (error code " + std::to_string(error.code) + ")");
  if (!receiver_ok) return Status::internal("rank " + std::to_string(rank) + ": " + receiver_error);
  LOOM_TRY_CTX(drained, "proxy drain");
  LOOM_TRY_CTX(met, "final barrier");
  LOOM_TRY_CTX(stopped, "proxy stop");
  LOOM_TRY_CTX(closed, "transport close");

  // Nothing but the messages changed: every gap byte keeps the guard pattern.
  std::vector<bool> written(window.size(), false);
  for (int s = 0; s < world; ++s) {
    if (!sends_to(job, s, rank)) continue;
    for (size_t k = 0; k < messages; ++k) {
      std::fill(written.begin() + static_cast<std::ptrdiff_t>(layout.offset[s][k]),
                written.begin() + static_cast<std::ptrdiff_t>(layout.offset[s][k] + job.sizes[k]), true);
    }
  }
  for (uint64_t i = 0; i < window.size(); ++i) {
    if (!written[i] && window[i] != kGuard) {
      return Status::internal("rank " + std::to_string(rank) + ": guard byte " + std::to_string(i) + " overwritten");
    }
  }
  const ProxyStats stats = proxy->stats();
  if (stats.rejected != 0) return Status::internal("the proxy rejected valid commands");
  return {};
}

void run_job(const Job& job) {
  Result<UniqueId> id = Bootstrap::create_unique_id("127.0.0.1");
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  const auto begin = std::chrono::steady_clock::now();
  std::vector<Outcome> outcomes =
      run_forked(job.world, [&](int rank) { return run_rank(job, *id, rank); }, [&] { Bootstrap::discard_unique_id(*id); });
  ASSERT_EQ(outcomes.size(), static_cast<size_t>(job.world));
  for (int r = 0; r < job.world; ++r) {
    EXPECT_TRUE(outcomes[r].reported) << "rank " << r << " died without a report";
    EXPECT_EQ(outcomes[r].code, StatusCode::kOk) << "rank " << r << ": " << outcomes[r].message;
  }
  ::testing::Test::RecordProperty("seconds", std::to_string(std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count()));
}

// Powers of four from 1 B, with their neighbours (p - 1, p + 1) below 1 MiB, up to `largest`.
std::vector<uint64_t> sweep_up_to(uint64_t largest) {
  std::vector<uint64_t> sizes;
  for (uint64_t p = 1; p <= largest; p *= 4) {
    const bool neighbours = p < (uint64_t{1} << 20);
    if (p > 1 && neighbours) sizes.push_back(p - 1);
    sizes.push_back(p);
    if (neighbours && p + 1 <= largest) sizes.push_back(p + 1);
  }
  if (sizes.back() != largest) sizes.push_back(largest);
  return sizes;
}

FabricOptions tcp_options() {
  FabricOptions o;
  o.provider = "tcp";
  o.domain = "lo";
  o.queue_depth = 64;
  return o;
}

// ---- tests ---------------------------------------------------------------------------------------

TEST(FabricTcp, TwoRanksBitExactFromOneByteTo64MiB) {
  SKIP_UNLESS_PROVIDER_RUNS(tcp_options());
  Job job;
  job.world = 2;
  job.sizes = sweep_up_to(uint64_t{64} << 20);
  job.fabric = tcp_options();
  run_job(job);
}

TEST(FabricTcp, FourRanksAllToAllWithFlagsAfterDeliveryAndFences) {
  FabricOptions options = tcp_options();
  options.use_ordering = false;  // the proxy's completion-gated path, over a real provider
  SKIP_UNLESS_PROVIDER_RUNS(options);
  Job job;
  job.world = 4;
  job.sizes = sweep_up_to(uint64_t{1} << 20);
  job.all_to_all = true;
  job.with_fence = true;
  job.fabric = options;
  run_job(job);
}

TEST(FabricTcp, ThreeRanksOrderedAllToAllWithFences) {
  SKIP_UNLESS_PROVIDER_RUNS(tcp_options());
  Job job;
  job.world = 3;
  job.sizes = sweep_up_to(uint64_t{256} << 10);
  job.all_to_all = true;
  job.with_fence = true;
  job.fabric = tcp_options();
  run_job(job);
}

// shm where the sandbox lets it run, on the completion-gated path (flags after delivery, like efa).
TEST(FabricShm, TwoRanksBitExactUpTo4MiB) {
  FabricOptions options;
  options.provider = "shm";
  options.queue_depth = 64;
  options.use_ordering = false;
  SKIP_UNLESS_PROVIDER_RUNS(options);
  Job job;
  job.world = 2;
  job.sizes = sweep_up_to(uint64_t{4} << 20);
  job.all_to_all = true;
  job.with_fence = true;
  job.fabric = options;
  run_job(job);
}

// Without LOOM_FABRIC_PROVIDER the hardware providers (efa, verbs) are tried first; on a machine
// without them the choice falls through to tcp, and probe_network() reports fabric usable.
TEST(FabricSettings, DefaultProviderFallsBackToTcpWithoutHardware) {
  SKIP_UNLESS_PROVIDER_RUNS(tcp_options());
  std::vector<Outcome> o = run_forked(1, [](int) -> Status {
    NetworkSettings settings;
    LOOM_ASSIGN_OR_RETURN(FabricOptions options, fabric_options_from_settings(settings));
    if (options.provider != "tcp" && options.provider != "efa" && options.provider != "verbs") {
      return Status::internal("chose provider " + options.provider);
    }
    FabricOptions chosen;
    chosen.provider = options.provider;
    if (options.provider != "tcp" && probe_fabric(chosen).ok()) {
      return {};  // a machine with RDMA hardware: a hardware provider rightly came first
    }
    settings.fabric_provider = "no-such-provider";
    if (fabric_options_from_settings(settings).ok()) return Status::internal("accepted a provider that does not exist");
    const NetworkProbe probe = probe_network(NetworkSettings{});
    if (!probe.fabric_usable) return Status::internal("probe_network: " + probe.fabric_reason);
    if (probe.fabric_reason != "provider " + options.provider) return Status::internal("probe says " + probe.fabric_reason);
    return {};
  });
  ASSERT_EQ(o.size(), 1u);
  EXPECT_EQ(o[0].code, StatusCode::kOk) << o[0].message;
}

TEST(FabricErrors, MissingLibraryIsUnsupported) {
  std::vector<Outcome> o = run_forked(1, [](int) -> Status {
    FabricOptions options;
    options.library = "libfabric-that-does-not-exist.so.1";
    Result<std::unique_ptr<Transport>> t = create_fabric_transport(TransportConfig{0, 1, {false}}, options);
    if (t.ok()) return Status::internal("created a transport without the library");
    return t.status();
  });
  ASSERT_EQ(o.size(), 1u);
  EXPECT_EQ(o[0].code, StatusCode::kUnsupported) << o[0].message;
  EXPECT_NE(o[0].message.find("cannot load libfabric-that-does-not-exist.so.1"), std::string::npos) << o[0].message;
}

TEST(FabricErrors, UnknownProviderIsUnsupported) {
  std::vector<Outcome> o = run_forked(1, [](int) -> Status {
    FabricOptions options;
    options.provider = "no-such-provider";
    Result<std::unique_ptr<Transport>> t = create_fabric_transport(TransportConfig{0, 1, {false}}, options);
    if (t.ok()) return Status::internal("created a transport for a provider that does not exist");
    return t.status();
  });
  ASSERT_EQ(o.size(), 1u);
  if (o[0].code == StatusCode::kUnsupported && o[0].message.find("cannot load") != std::string::npos) {
    GTEST_SKIP() << "libfabric is not installed here: " << o[0].message;
  }
  EXPECT_EQ(o[0].code, StatusCode::kUnsupported) << o[0].message;
  EXPECT_NE(o[0].message.find("no-such-provider"), std::string::npos) << o[0].message;
}

// A write posted straight to the transport (no proxy validation) with a key the target never
// issued: the provider must report an error completion, which becomes a Status naming the rank.
TEST(FabricErrors, WriteWithAForeignKeyIsAnErrorCompletion) {
  SKIP_UNLESS_PROVIDER_RUNS(tcp_options());
  Result<UniqueId> id = Bootstrap::create_unique_id("127.0.0.1");
  ASSERT_TRUE(id.ok());
  std::vector<Outcome> outcomes = run_forked(
      2,
      [&](int rank) -> Status {
        LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Bootstrap> boot, Bootstrap::from_unique_id(*id, rank, 2, 30s));
        TransportConfig config{rank, 2, {rank != 0, rank != 1}};
        LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, create_fabric_transport(config, tcp_options()));
        std::vector<uint8_t> buffer(4096, 1);
        LOOM_ASSIGN_OR_RETURN(LocalRegistration reg, t->register_memory({buffer.data(), buffer.size(), MemoryKind::kHost, -1}));
        LOOM_TRY(exchange_endpoints(*boot, *t));
        LOOM_ASSIGN_OR_RETURN(std::vector<std::vector<uint8_t>> keys, all_gather_blobs(*boot, reg.remote_key));
        Status verdict;
        const auto deadline = std::chrono::steady_clock::now() + 10s;
        if (rank == 0) {
          std::vector<uint8_t> forged = keys[1];
          forged[8] ^= 0x5a;  // the key word: a registration rank 1 never made
          LOOM_ASSIGN_OR_RETURN(uint32_t remote, t->import_remote(1, forged, buffer.size()));
          WriteOp w{77, 1, reg.handle, 0, remote, 0, 64};
          std::vector<Completion> done;
          // The first post may find the connection still being set up (EAGAIN): progress, retry.
          size_t taken = 0;
          while (taken == 0 && std::chrono::steady_clock::now() < deadline) {
            LOOM_ASSIGN_OR_RETURN(taken, t->post_writes(std::span<const WriteOp>(&w, 1)));
            if (taken == 0) LOOM_TRY(t->poll(done));
          }
          if (taken != 1) return Status::internal("write not taken within 10 s");
          while (done.empty() && std::chrono::steady_clock::now() < deadline) {
            LOOM_TRY(t->poll(done));
            std::this_thread::sleep_for(100us);
          }
          if (done.empty()) verdict = Status::timeout("no completion for the forged write within 10 s");
          else if (done[0].id != 77) verdict = Status::internal("completion for the wrong op");
          else if (done[0].status.ok()) verdict = Status::internal("a write with a forged key completed successfully");
          else verdict = Status::peer_failure(done[0].status.message());  // expected: report it
        }
        // Rank 1 keeps progressing (manual progress) until rank 0 is done.
        std::atomic<bool> stop{false};
        std::thread progress([&] {
          std::vector<Completion> ignored;
          while (!stop) {
            (void)t->poll(ignored);
            std::this_thread::sleep_for(50us);
          }
        });
        Status met = boot->barrier();
        stop = true;
        progress.join();
        LOOM_TRY(met);
        (void)t->close();
        return verdict;
      },
      [&] { Bootstrap::discard_unique_id(*id); });
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_EQ(outcomes[1].code, StatusCode::kOk) << outcomes[1].message;
  EXPECT_EQ(outcomes[0].code, StatusCode::kPeerFailure) << outcomes[0].message;
  EXPECT_NE(outcomes[0].message.find("rank 1"), std::string::npos) << outcomes[0].message;
}

}  // namespace
}  // namespace loom::runtime::net
