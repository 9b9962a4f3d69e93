// Bootstrap over loopback: ranks are forked processes; each reports its Status to the test
// process through a pipe and leaves with _exit, and the test process bounds every wait.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/log.h"
#include "loom/status.h"
#include "runtime/bootstrap.h"
#include "runtime/socket.h"
#include "cpu/forked_ranks.h"

namespace loom::runtime {
namespace {

using namespace std::chrono_literals;
using namespace test_support;
namespace wire = bootstrap_wire;

// Deterministic bytes for rank r, round k.
uint8_t pattern(int rank, size_t index, int round) {
  return static_cast<uint8_t>(rank * 31 + index * 7 + round * 13 + 1);
}

Status exchange_and_check(Bootstrap& boot, int round) {
  int world = boot.world_size();
  int rank = boot.rank();
  const size_t sizes[] = {8, 1, 100'000, 0};
  size_t bytes = sizes[round % 4];
  std::vector<uint8_t> mine(bytes);
  for (size_t i = 0; i < bytes; ++i) mine[i] = pattern(rank, i, round);
  std::vector<uint8_t> all(bytes * world, 0xEE);
  LOOM_TRY(boot.all_gather(mine.data(), all.data(), bytes));
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < bytes; ++i) {
      if (all[r * bytes + i] != pattern(r, i, round)) {
        return Status::internal("all_gather round " + std::to_string(round) + ": byte " + std::to_string(i) +
                                " of rank " + std::to_string(r) + " is wrong");
      }
    }
  }
  int root = (round + 1) % world;
  std::vector<uint8_t> data(1000, 0xEE);
  if (rank == root) {
    for (size_t i = 0; i < data.size(); ++i) data[i] = pattern(root, i, round + 100);
  }
  LOOM_TRY(boot.broadcast(data.data(), data.size(), root));
  for (size_t i = 0; i < data.size(); ++i) {
    if (data[i] != pattern(root, i, round + 100)) {
      return Status::internal("broadcast from rank " + std::to_string(root) + ": byte " + std::to_string(i) +
                              " is wrong");
    }
  }
  return boot.barrier();
}

// ---- raw protocol client (plays hostile clients and fake peers) ---------------------------------

Result<Socket> raw_connect(uint16_t port) {
  return Socket::connect("127.0.0.1", port, Clock::now() + 5s);
}

// Reads one message (header and payload up to 4 KiB); nullopt when the peer closed instead.
std::optional<std::pair<wire::MessageType, std::vector<uint8_t>>> raw_read(Socket& socket) {
  std::array<uint8_t, wire::kHeaderBytes> header{};
  if (!socket.recv_all(header.data(), header.size(), Clock::now() + 5s).ok()) return std::nullopt;
  uint16_t type = 0;
  uint64_t length = 0;
  std::memcpy(&type, header.data() + 6, sizeof(type));
  std::memcpy(&length, header.data() + 8, sizeof(length));
  if (length > 4096) return std::nullopt;
  std::vector<uint8_t> payload(length);
  if (!socket.recv_all(payload.data(), payload.size(), Clock::now() + 5s).ok()) return std::nullopt;
  return std::make_pair(static_cast<wire::MessageType>(type), payload);
}

bool payload_mentions(const std::vector<uint8_t>& payload, std::string_view text) {
  return std::string(payload.begin(), payload.end()).find(text) != std::string::npos;
}

// Sends a hello with a correct proof for (rank, world) after the challenge; returns the answer.
Result<std::pair<wire::MessageType, std::vector<uint8_t>>> raw_hello(Socket& socket, const Secret& secret,
                                                                     uint32_t rank, uint32_t world) {
  auto challenge = raw_read(socket);
  if (!challenge || challenge->first != wire::MessageType::kChallenge ||
      challenge->second.size() != wire::kChallengeBodyBytes) {
    return Status::internal("no challenge");
  }
  std::span<const uint8_t, wire::kChallengeBodyBytes> nonce(challenge->second.data(), wire::kChallengeBodyBytes);
  LOOM_ASSIGN_OR_RETURN(auto proof, wire::client_proof(secret, nonce, rank, world));
  std::vector<uint8_t> message(wire::kHeaderBytes + wire::kHelloBodyBytes);
  auto header = wire::encode_header(wire::MessageType::kHello, wire::kHelloBodyBytes);
  std::memcpy(message.data(), header.data(), header.size());
  std::memcpy(message.data() + 16, &rank, 4);
  std::memcpy(message.data() + 20, &world, 4);
  std::memcpy(message.data() + 24 + 32, proof.data(), proof.size());  // client nonce left zero
  LOOM_TRY(socket.send_all(message.data(), message.size(), Clock::now() + 5s));
  auto answer = raw_read(socket);
  if (!answer) return Status::internal("no answer to the hello");
  return *answer;
}

// The secret inside a unique id (bytes 8..24; the id layout is private to bootstrap.cc, but the
// tests need the secret to play an authenticated peer).
Secret secret_of(const UniqueId& id) {
  Secret secret{};
  std::memcpy(secret.data(), id.bytes.data() + 8, secret.size());
  return secret;
}

uint16_t port_of(const UniqueId& id) {
  uint16_t port = 0;
  std::memcpy(&port, id.bytes.data() + 6, sizeof(port));
  return port;
}

BootstrapConfig loopback_config(int rank, int world, uint16_t port, const Secret& secret,
                                std::chrono::milliseconds timeout) {
  BootstrapConfig config;
  config.rank = rank;
  config.world_size = world;
  config.root_addr = "127.0.0.1";
  config.root_port = port;
  config.secret = secret;
  config.timeout = timeout;
  return config;
}

// A free loopback port (for the env-configured tests that need a fixed MASTER_PORT).
uint16_t free_port() {
  Result<Listener> probe = Listener::listen("127.0.0.1", 0);
  EXPECT_TRUE(probe.ok());
  return probe.ok() ? probe->port() : 0;
}

// LISTEN entries of /proc/net/tcp{,6} for `port`: the local address column, hex as the kernel prints it.
std::vector<std::string> listening_addresses(uint16_t port) {
  std::vector<std::string> found;
  char port_hex[8];
  std::snprintf(port_hex, sizeof(port_hex), "%04X", port);
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // column titles
    while (std::getline(in, line)) {
      char local[64] = {0};
      char remote[64] = {0};
      char state[8] = {0};
      if (std::sscanf(line.c_str(), " %*d: %63s %63s %7s", local, remote, state) != 3) continue;
      std::string address(local);
      size_t colon = address.rfind(':');
      if (colon == std::string::npos || address.substr(colon + 1) != port_hex) continue;
      if (std::string(state) == "0A") found.push_back(address.substr(0, colon));
    }
  }
  return found;
}

// ---- sockets -----------------------------------------------------------------------------------

TEST(BootstrapSocket, ListenerBindsOnlyTheConfiguredAddress) {
  Result<Listener> listener = Listener::listen("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status().to_string();
  EXPECT_NE(listener->port(), 0);
  EXPECT_EQ(listener->host(), "127.0.0.1");
  sockaddr_in bound{};
  socklen_t length = sizeof(bound);
  ASSERT_EQ(getsockname(listener->fd(), reinterpret_cast<sockaddr*>(&bound), &length), 0);
  EXPECT_EQ(bound.sin_addr.s_addr, htonl(INADDR_LOOPBACK));
  EXPECT_EQ(listening_addresses(listener->port()), std::vector<std::string>{"0100007F"});

  for (const char* wildcard : {"0.0.0.0", "::"}) {
    Result<Listener> refused = Listener::listen(wildcard, 0);
    ASSERT_FALSE(refused.ok()) << wildcard;
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("wildcard"), std::string::npos);
  }
  EXPECT_EQ(Listener::listen("no-such-host.invalid", 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(BootstrapSocket, ConnectGivesUpAtTheDeadline) {
  uint16_t port = free_port();
  auto begin = Clock::now();
  Result<Socket> socket = Socket::connect("127.0.0.1", port, begin + 300ms);
  auto elapsed = Clock::now() - begin;
  ASSERT_FALSE(socket.ok());
  EXPECT_EQ(socket.status().code(), StatusCode::kTimeout);
  EXPECT_NE(socket.status().message().find("refused"), std::string::npos) << socket.status().message();
  EXPECT_GE(elapsed, 250ms);
  EXPECT_LE(elapsed, 1300ms);
}

TEST(BootstrapSocket, ReceiveHonoursTheDeadlineAndSeesTheClose) {
  Result<Listener> listener = Listener::listen("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok());
  Result<Socket> client = Socket::connect("127.0.0.1", listener->port(), Clock::now() + 5s);
  ASSERT_TRUE(client.ok());
  std::optional<Socket> server;
  for (int i = 0; i < 500 && !server; ++i) {
    Result<std::optional<Socket>> accepted = listener->try_accept();
    ASSERT_TRUE(accepted.ok());
    if (*accepted) server = std::move(**accepted);
    else std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(server.has_value());
  char byte = 0;
  auto begin = Clock::now();
  Status waited = client->recv_all(&byte, 1, begin + 200ms);
  EXPECT_EQ(waited.code(), StatusCode::kTimeout);
  EXPECT_LE(Clock::now() - begin, 1s);
  server.reset();
  EXPECT_EQ(client->recv_all(&byte, 1, Clock::now() + 2s).code(), StatusCode::kPeerFailure);
}

// ---- configuration -----------------------------------------------------------------------------

// Sets variables for one test and restores the previous values.
class ScopedEnv {
 public:
  ScopedEnv() {
    for (const char* name : kNames) {
      const char* value = std::getenv(name);
      saved_.emplace_back(name, value ? std::optional<std::string>(value) : std::nullopt);
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      if (value) ::setenv(name, value->c_str(), 1);
      else ::unsetenv(name);
    }
  }
  void set(const char* name, const char* value) { ::setenv(name, value, 1); }
  void unset(const char* name) { ::unsetenv(name); }

  static constexpr const char* kNames[] = {"RANK",        "WORLD_SIZE",  "MASTER_ADDR",
                                           "MASTER_PORT", "LOOM_SECRET", "LOOM_BOOTSTRAP_TIMEOUT_MS",
                                           "TORCHELASTIC_RUN_ID", "LOOM_BOOTSTRAP_PORT"};

 private:
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

void set_valid_job(ScopedEnv& env) {
  env.set("RANK", "1");
  env.set("WORLD_SIZE", "4");
  env.set("MASTER_ADDR", "10.1.2.3");
  env.set("MASTER_PORT", "29500");
  env.set("LOOM_SECRET", "00112233445566778899aabbccddeeff");
}

TEST(BootstrapConfig, ReadsTheLauncherEnvironment) {
  ScopedEnv env;
  set_valid_job(env);
  env.set("LOOM_BOOTSTRAP_TIMEOUT_MS", "5000");
  Result<BootstrapConfig> config = bootstrap_config_from_env();
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->rank, 1);
  EXPECT_EQ(config->world_size, 4);
  EXPECT_EQ(config->root_addr, "10.1.2.3");
  EXPECT_EQ(config->root_port, 29500);
  EXPECT_EQ(config->timeout, 5000ms);
  Secret expected = {0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77,
                     0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff};
  EXPECT_EQ(config->secret, expected);

  env.unset("LOOM_BOOTSTRAP_TIMEOUT_MS");
  EXPECT_EQ(bootstrap_config_from_env()->timeout, 120'000ms);
}

TEST(BootstrapConfig, ListensBesideTorchrunsStore) {
  ScopedEnv env;
  set_valid_job(env);
  env.set("TORCHELASTIC_RUN_ID", "job");
  EXPECT_EQ(bootstrap_config_from_env()->root_port, 29501) << "torchrun's store holds MASTER_PORT";
  env.set("LOOM_BOOTSTRAP_PORT", "31000");
  EXPECT_EQ(bootstrap_config_from_env()->root_port, 31000);
  env.unset("TORCHELASTIC_RUN_ID");
  EXPECT_EQ(bootstrap_config_from_env()->root_port, 31000);
  env.set("LOOM_BOOTSTRAP_PORT", "0");
  Result<BootstrapConfig> bad = bootstrap_config_from_env();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("LOOM_BOOTSTRAP_PORT"), std::string::npos) << bad.status().message();
  env.unset("LOOM_BOOTSTRAP_PORT");
  env.set("TORCHELASTIC_RUN_ID", "job");
  env.set("MASTER_PORT", "65535");
  EXPECT_FALSE(bootstrap_config_from_env().ok());
}

TEST(BootstrapConfig, RejectsBadValuesNamingTheVariable) {
  struct Case {
    const char* name;
    const char* value;  // nullptr: unset
  };
  const Case cases[] = {
      {"RANK", "abc"},          {"RANK", "-1"},         {"RANK", "4"},  {"RANK", nullptr},
      {"WORLD_SIZE", "0"},      {"WORLD_SIZE", "x"},    {"MASTER_PORT", "70000"},
      {"MASTER_PORT", "0"},     {"MASTER_PORT", "abc"}, {"MASTER_PORT", nullptr},
      {"MASTER_ADDR", nullptr}, {"MASTER_ADDR", " "},   {"LOOM_SECRET", "xyz"},
      {"LOOM_SECRET", "00112233445566778899aabbccddeefg"},  {"LOOM_BOOTSTRAP_TIMEOUT_MS", "-5"},
  };
  for (const Case& c : cases) {
    ScopedEnv env;
    set_valid_job(env);
    if (c.value) env.set(c.name, c.value);
    else env.unset(c.name);
    Result<BootstrapConfig> config = bootstrap_config_from_env();
    std::string label = std::string(c.name) + "=" + (c.value ? c.value : "(unset)");
    ASSERT_FALSE(config.ok()) << label;
    EXPECT_EQ(config.status().code(), StatusCode::kInvalidArgument) << label;
    EXPECT_NE(config.status().message().find(c.name), std::string::npos) << label << ": " << config.status().message();
    if (std::string(c.name) == "LOOM_SECRET") {
      EXPECT_EQ(config.status().message().find(c.value), std::string::npos) << "the secret was echoed";
    }
  }
}

// Fail closed: without LOOM_SECRET a job of several ranks is refused, under torchrun too (its
// run id and MASTER_ADDR:MASTER_PORT are public, and a secret derived from them let a client that
// computed it join as rank 1).
TEST(BootstrapConfig, RefusesAJobWithoutASecret) {
  ScopedEnv env;
  set_valid_job(env);
  env.unset("LOOM_SECRET");
  for (const char* run_id : {static_cast<const char*>(nullptr), "job-a"}) {
    if (run_id) env.set("TORCHELASTIC_RUN_ID", run_id);
    Result<BootstrapConfig> config = bootstrap_config_from_env();
    ASSERT_FALSE(config.ok()) << (run_id ? run_id : "no run id");
    EXPECT_EQ(config.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(config.status().message().find("LOOM_SECRET is not set"), std::string::npos) << config.status().message();
    EXPECT_NE(config.status().message().find("openssl rand -hex 16"), std::string::npos) << "says how to make one";
  }
  // One rank has nobody to authenticate.
  env.set("RANK", "0");
  env.set("WORLD_SIZE", "1");
  EXPECT_TRUE(bootstrap_config_from_env().ok());
}

TEST(BootstrapConfig, OneRankNeedsNoMaster) {
  ScopedEnv env;
  env.set("RANK", "0");
  env.set("WORLD_SIZE", "1");
  Result<BootstrapConfig> config = bootstrap_config_from_env();
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  Result<std::unique_ptr<Bootstrap>> boot = Bootstrap::connect(*config);
  ASSERT_TRUE(boot.ok()) << boot.status().to_string();
  uint64_t mine = 42;
  uint64_t all = 0;
  EXPECT_TRUE((*boot)->all_gather(&mine, &all, sizeof(mine)).ok());
  EXPECT_EQ(all, 42u);
  EXPECT_TRUE((*boot)->broadcast(&mine, sizeof(mine), 0).ok());
  EXPECT_TRUE((*boot)->barrier().ok());
  EXPECT_EQ((*boot)->broadcast(&mine, sizeof(mine), 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*boot)->all_gather(nullptr, &all, 8).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE((*boot)->barrier().ok()) << "a rejected call must leave the bootstrap usable";
}

// ---- unique ids --------------------------------------------------------------------------------

TEST(BootstrapUniqueId, GarbageIsRejected) {
  UniqueId zeros;
  EXPECT_EQ(Bootstrap::from_unique_id(zeros, 1, 2, 1s).status().code(), StatusCode::kInvalidArgument);
  UniqueId random;
  std::mt19937 generator(7);
  for (uint8_t& b : random.bytes) b = static_cast<uint8_t>(generator());
  EXPECT_EQ(Bootstrap::from_unique_id(random, 1, 2, 1s).status().code(), StatusCode::kInvalidArgument);

  UniqueId id = make_id();
  for (size_t byte = 0; byte < UniqueId::kBytes; ++byte) {
    UniqueId flipped = id;
    flipped.bytes[byte] ^= 0x10;
    Result<std::unique_ptr<Bootstrap>> boot = Bootstrap::from_unique_id(flipped, 1, 2, 1s);
    ASSERT_FALSE(boot.ok()) << "byte " << byte;
    EXPECT_EQ(boot.status().code(), StatusCode::kInvalidArgument) << "byte " << byte;
  }
  EXPECT_EQ(Bootstrap::from_unique_id(id, 2, 2, 1s).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Bootstrap::from_unique_id(id, 0, 0, 1s).status().code(), StatusCode::kInvalidArgument);
  Bootstrap::discard_unique_id(id);
}

TEST(BootstrapUniqueId, ListenerIsOnTheRequestedAddress) {
  UniqueId id = make_id();
  EXPECT_EQ(listening_addresses(port_of(id)), std::vector<std::string>{"0100007F"});
  Bootstrap::discard_unique_id(id);
  EXPECT_TRUE(listening_addresses(port_of(id)).empty()) << "discard_unique_id must close the listener";
}

// The listener make_unique_id() opens belongs to the job it was made for: rank 0's bootstrap takes
// it and closes it once every rank has joined (while the job goes on), so a created communicator
// leaves no port open; the test process drops its own copy (the fork's) with discard_unique_id.
TEST(BootstrapUniqueId, ListenerClosesOnceEveryRankHasJoined) {
  UniqueId id = make_id();
  const uint16_t port = port_of(id);
  auto outcomes = run_ranks(
      2,
      [&](int rank) -> Status {
        if (rank != 0) Bootstrap::discard_unique_id(id);  // a forked rank's copy of the listener
        LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, 2, 20s));
        LOOM_TRY(boot->barrier());
        std::this_thread::sleep_for(300ms);  // the test process has discarded its copy by now
        if (rank == 0 && !listening_addresses(port).empty()) {
          return Status::internal("rank 0 still listens on the unique id's port while the job runs");
        }
        return boot->barrier();
      },
      [&] { Bootstrap::discard_unique_id(id); });
  EXPECT_RANK_OK(outcomes, 0);
  EXPECT_RANK_OK(outcomes, 1);
}

// ---- jobs --------------------------------------------------------------------------------------

TEST(Bootstrap, FourRanksAllGatherBroadcastAndBarrier) {
  UniqueId id = make_id();
  auto outcomes = run_ranks(
      4,
      [&](int rank) -> Status {
        LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, 4, 20s));
        for (int round = 0; round < 8; ++round) LOOM_TRY(exchange_and_check(*boot, round));
        return {};
      },
      [&] { Bootstrap::discard_unique_id(id); });
  for (int r = 0; r < 4; ++r) EXPECT_RANK_OK(outcomes, r);
}

TEST(Bootstrap, EnvironmentJobWhoseRankZeroStartsLast) {
  uint16_t port = free_port();
  std::string port_text = std::to_string(port);
  auto outcomes = run_ranks(4, [&](int rank) -> Status {
    // Rank 0 comes up late: the others must keep retrying the refused connection.
    if (rank == 0) std::this_thread::sleep_for(300ms);
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", "4", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", port_text.c_str(), 1);
    ::setenv("LOOM_SECRET", "0123456789abcdef0123456789ABCDEF", 1);
    ::setenv("LOOM_BOOTSTRAP_TIMEOUT_MS", "20000", 1);
    LOOM_ASSIGN_OR_RETURN(BootstrapConfig config, bootstrap_config_from_env());
    LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::connect(config));
    return exchange_and_check(*boot, 0);
  });
  for (int r = 0; r < 4; ++r) EXPECT_RANK_OK(outcomes, r);
}

TEST(Bootstrap, RejectsImpostorsWhileTheJobCompletes) {
  UniqueId id = make_id();
  Secret secret = secret_of(id);
  uint16_t port = port_of(id);
  // Rank 2 joins only after rank 1's impostors are done, so init is still open for all of them.
  int impostors_done[2];
  ASSERT_EQ(::pipe(impostors_done), 0);
  auto outcomes = run_ranks(
      3,
      [&](int rank) -> Status {
        if (rank == 2) {
          ::close(impostors_done[1]);
          pollfd wait_for{impostors_done[0], POLLIN, 0};
          if (::poll(&wait_for, 1, 15'000) != 1) return Status::internal("rank 1 never finished its impostors");
        }
        if (rank == 1) {
          // Every wrong-secret attempt is rejected, with the reason, while the job waits.
          Secret wrong = secret;
          wrong[5] ^= 1;
          for (int attempt = 0; attempt < 20; ++attempt) {
            Result<std::unique_ptr<Bootstrap>> impostor = Bootstrap::connect(loopback_config(1, 3, port, wrong, 5s));
            if (impostor.ok() || impostor.status().code() != StatusCode::kInvalidArgument ||
                impostor.status().message().find("rejected by rank 0 at 127.0.0.1:" + std::to_string(port) +
                                                 ": authentication failed (wrong LOOM_SECRET?)") == std::string::npos) {
              return Status::internal("impostor " + std::to_string(attempt) + ": " + impostor.status().to_string());
            }
          }
          Result<std::unique_ptr<Bootstrap>> mismatch = Bootstrap::connect(loopback_config(1, 5, port, secret, 5s));
          if (mismatch.ok() || mismatch.status().message().find("world size 5") == std::string::npos) {
            return Status::internal("world-size mismatch: " + mismatch.status().to_string());
          }
          for (uint32_t bad_rank : {0u, 3u, 7u}) {
            LOOM_ASSIGN_OR_RETURN(Socket raw, raw_connect(port));
            LOOM_ASSIGN_OR_RETURN(auto answer, raw_hello(raw, secret, bad_rank, 3));
            if (answer.first != wire::MessageType::kFailure || !payload_mentions(answer.second, "outside")) {
              return Status::internal("rank " + std::to_string(bad_rank) + " was not rejected as out of range");
            }
          }
          {
            // An authenticated holder of rank 1 makes a second rank 1 a duplicate; leaving frees it.
            LOOM_ASSIGN_OR_RETURN(Socket holder, raw_connect(port));
            LOOM_ASSIGN_OR_RETURN(auto welcome, raw_hello(holder, secret, 1, 3));
            if (welcome.first != wire::MessageType::kWelcome) return Status::internal("holder not admitted");
            Result<std::unique_ptr<Bootstrap>> duplicate = Bootstrap::connect(loopback_config(1, 3, port, secret, 5s));
            if (duplicate.ok() || duplicate.status().message().find("already connected") == std::string::npos) {
              return Status::internal("duplicate rank: " + duplicate.status().to_string());
            }
          }
          (void)!::write(impostors_done[1], "x", 1);
        }
        LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, 3, 20s));
        return exchange_and_check(*boot, 1);
      },
      [&] {
        Bootstrap::discard_unique_id(id);
        ::close(impostors_done[0]);
        ::close(impostors_done[1]);
      });
  for (int r = 0; r < 3; ++r) EXPECT_RANK_OK(outcomes, r);
}

TEST(Bootstrap, FakeRankZeroIsDetected) {
  Result<Listener> fake = Listener::listen("127.0.0.1", 0);
  ASSERT_TRUE(fake.ok());
  Secret secret{};
  secret[0] = 9;
  ForkedRanks ranks;
  uint16_t port = fake->port();
  ranks.start([&] { return Bootstrap::connect(loopback_config(1, 2, port, secret, 5s)).status(); });

  std::optional<Socket> client;
  for (int i = 0; i < 500 && !client; ++i) {
    Result<std::optional<Socket>> accepted = fake->try_accept();
    ASSERT_TRUE(accepted.ok());
    if (*accepted) client = std::move(**accepted);
    else std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(client.has_value());
  // A challenge, then a welcome whose proof was made without the secret.
  std::vector<uint8_t> challenge(wire::kHeaderBytes + wire::kChallengeBodyBytes, 0x5A);
  auto header = wire::encode_header(wire::MessageType::kChallenge, wire::kChallengeBodyBytes);
  std::memcpy(challenge.data(), header.data(), header.size());
  ASSERT_TRUE(client->send_all(challenge.data(), challenge.size(), Clock::now() + 5s).ok());
  std::vector<uint8_t> hello(wire::kHeaderBytes + wire::kHelloBodyBytes);
  ASSERT_TRUE(client->recv_all(hello.data(), hello.size(), Clock::now() + 5s).ok());
  std::vector<uint8_t> welcome(wire::kHeaderBytes + wire::kWelcomeBodyBytes, 0x33);
  header = wire::encode_header(wire::MessageType::kWelcome, wire::kWelcomeBodyBytes);
  std::memcpy(welcome.data(), header.data(), header.size());
  ASSERT_TRUE(client->send_all(welcome.data(), welcome.size(), Clock::now() + 5s).ok());

  std::vector<RankOutcome> outcomes = ranks.wait();
  EXPECT_EQ(outcomes[0].code, StatusCode::kInvalidArgument) << outcomes[0].message;
  EXPECT_NE(outcomes[0].message.find("failed to prove it knows the job secret"), std::string::npos)
      << outcomes[0].message;
}

TEST(Bootstrap, HostileClientsDoNotStopInit) {
  UniqueId id = make_id();
  uint16_t port = port_of(id);
  auto outcomes = run_ranks(
      3,
      [&](int rank) -> Status {
        std::vector<Socket> held_open;
        if (rank == 2) {
          auto send_raw = [&](const std::vector<uint8_t>& bytes) -> Status {
            LOOM_ASSIGN_OR_RETURN(Socket raw, raw_connect(port));
            // Rank 0 may reset the connection part-way through: that is the point.
            (void)raw.send_all(bytes.data(), bytes.size(), Clock::now() + 2s);
            raw_read(raw);
            return {};
          };
          std::mt19937 generator(11);
          std::vector<uint8_t> noise(1024);
          for (uint8_t& b : noise) b = static_cast<uint8_t>(generator());
          LOOM_TRY(send_raw(noise));
          std::vector<uint8_t> garbage(64 * 1024);
          for (uint8_t& b : garbage) b = static_cast<uint8_t>(generator());
          LOOM_TRY(send_raw(garbage));
          std::vector<uint8_t> wrong_magic(wire::kHeaderBytes + wire::kHelloBodyBytes, 0);
          LOOM_TRY(send_raw(wrong_magic));
          auto huge = wire::encode_header(wire::MessageType::kHello, uint64_t{1} << 40);
          LOOM_TRY(send_raw(std::vector<uint8_t>(huge.begin(), huge.end())));
          auto huge_step = wire::encode_header(wire::MessageType::kStep, ~uint64_t{0});
          LOOM_TRY(send_raw(std::vector<uint8_t>(huge_step.begin(), huge_step.end())));
          auto old_version = wire::encode_header(wire::MessageType::kHello, wire::kHelloBodyBytes);
          old_version[4] = 99;
          LOOM_TRY(send_raw(std::vector<uint8_t>(old_version.begin(), old_version.end())));
          // Half-open connections: one silent, one that stops half-way through its hello.
          LOOM_ASSIGN_OR_RETURN(Socket silent, raw_connect(port));
          held_open.push_back(std::move(silent));
          LOOM_ASSIGN_OR_RETURN(Socket stalled, raw_connect(port));
          auto hello_header = wire::encode_header(wire::MessageType::kHello, wire::kHelloBodyBytes);
          LOOM_TRY(stalled.send_all(hello_header.data(), hello_header.size(), Clock::now() + 2s));
          held_open.push_back(std::move(stalled));
          // A burst of connect-and-close.
          for (int i = 0; i < 200; ++i) {
            LOOM_ASSIGN_OR_RETURN(Socket burst, raw_connect(port));
          }
        }
        LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, 3, 20s));
        return exchange_and_check(*boot, 2);
      },
      [&] { Bootstrap::discard_unique_id(id); });
  for (int r = 0; r < 3; ++r) EXPECT_RANK_OK(outcomes, r);
}

// Rank 0 under a low descriptor limit (ulimit -n 200) and a flood of 300 connections held open:
// accept() must never end init (it used to fail with "Too many open files", taking the real rank
// 1 down with it): the handshakes rank 0 holds fit the limit, and a shortage drops the oldest
// unauthenticated connection or pauses accepting.
TEST(Bootstrap, ConnectionFloodUnderALowDescriptorLimitDoesNotEndInit) {
  UniqueId id = make_id();
  const uint16_t port = port_of(id);
  auto outcomes = run_ranks(
      3,
      [&](int who) -> Status {
        if (who == 2) {  // the flood, from its own process: 300 connections held for 4 s
          std::vector<Socket> held;
          for (int i = 0; i < 300; ++i) {
            Result<Socket> s = raw_connect(port);
            if (s.ok()) held.push_back(std::move(*s));
          }
          std::this_thread::sleep_for(4s);
          return {};
        }
        if (who == 0) {
          rlimit limit{};
          if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return Status::errno_error("getrlimit", errno);
          limit.rlim_cur = std::min<rlim_t>(limit.rlim_max, 200);
          if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) return Status::errno_error("setrlimit", errno);
        } else {
          std::this_thread::sleep_for(500ms);  // behind the flood
        }
        LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, who, 2, 20s));
        return exchange_and_check(*boot, 1);
      },
      [&] { Bootstrap::discard_unique_id(id); });
  EXPECT_RANK_OK(outcomes, 0);
  EXPECT_RANK_OK(outcomes, 1);
}

TEST(Bootstrap, MissingRankTimesOutOnEveryRankNamingIt) {
  constexpr auto kTimeout = 2000ms;
  UniqueId id = make_id();
  // Rank 3 of 4 never starts.
  auto outcomes = run_ranks(
      3, [&](int rank) { return Bootstrap::from_unique_id(id, rank, 4, kTimeout).status(); },
      [&] { Bootstrap::discard_unique_id(id); });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(outcomes[r].code, StatusCode::kTimeout) << "rank " << r << ": " << outcomes[r].message;
    EXPECT_NE(outcomes[r].message.find("rank(s) 3 did not connect to 127.0.0.1:"), std::string::npos)
        << "rank " << r << ": " << outcomes[r].message;
    EXPECT_NE(outcomes[r].message.find("within 2000 ms"), std::string::npos) << outcomes[r].message;
    EXPECT_LE(outcomes[r].elapsed_ms, (kTimeout + 1s).count()) << "rank " << r;
  }
}

TEST(Bootstrap, StepTimesOutNamingTheRankThatNeverArrived) {
  constexpr auto kTimeout = 1500ms;
  UniqueId id = make_id();
  auto outcomes = run_ranks(
      3,
      [&](int rank) -> Status {
        LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, 3, kTimeout));
        if (rank == 2) {
          std::this_thread::sleep_for(kTimeout + 500ms);  // never enters the step
          return Status::aborted("stayed away");
        }
        auto begin = Clock::now();
        uint32_t mine = 1;
        uint32_t all[3];
        Status status = boot->all_gather(&mine, all, sizeof(mine));
        if (Clock::now() - begin > kTimeout + 1s) return Status::internal("blocked past the deadline: " + status.to_string());
        return status;
      },
      [&] { Bootstrap::discard_unique_id(id); });
  EXPECT_EQ(outcomes[0].code, StatusCode::kTimeout) << outcomes[0].message;
  // Rank 0's own deadline passed first ("did not arrive"), or rank 1's did and it said so.
  EXPECT_NE(outcomes[0].message.find("rank(s) 2 "), std::string::npos) << outcomes[0].message;
  // Rank 1 hears rank 0's verdict, or its own deadline passes first (they start a step apart).
  EXPECT_EQ(outcomes[1].code, StatusCode::kTimeout) << outcomes[1].message;
}

TEST(Bootstrap, RankExitingMidJobFailsTheOthersNamingIt) {
  UniqueId id = make_id();
  auto outcomes = run_ranks(
      4,
      [&](int rank) -> Status {
        LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, 4, 20s));
        LOOM_TRY(exchange_and_check(*boot, 0));
        if (rank == 2) ::_exit(1);  // dies without a word
        auto begin = Clock::now();
        uint64_t mine = 7;
        uint64_t all[4];
        Status status = boot->all_gather(&mine, all, sizeof(mine));
        if (Clock::now() - begin > 5s) return Status::internal("took too long: " + status.to_string());
        if (boot->barrier().code() != StatusCode::kAborted) return Status::internal("the failure did not stick");
        return status;
      },
      [&] { Bootstrap::discard_unique_id(id); });
  EXPECT_FALSE(outcomes[2].reported);
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(outcomes[r].code, StatusCode::kPeerFailure) << "rank " << r << ": " << outcomes[r].message;
    EXPECT_NE(outcomes[r].message.find("rank 2: disconnected"), std::string::npos)
        << "rank " << r << ": " << outcomes[r].message;
  }
}

TEST(Bootstrap, ReportedFailureReachesEveryRank) {
  UniqueId id = make_id();
  auto outcomes = run_ranks(
      4,
      [&](int rank) -> Status {
        LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, 4, 20s));
        if (rank == 1) {
          boot->report_failure("device 1 ran out of memory");
          if (boot->barrier().code() != StatusCode::kAborted) return Status::internal("reporter stayed usable");
          return Status::peer_failure("reported");
        }
        return boot->barrier();
      },
      [&] { Bootstrap::discard_unique_id(id); });
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(outcomes[r].code, StatusCode::kPeerFailure) << "rank " << r << ": " << outcomes[r].message;
    EXPECT_NE(outcomes[r].message.find("rank 1: device 1 ran out of memory"), std::string::npos)
        << "rank " << r << ": " << outcomes[r].message;
  }
  EXPECT_EQ(outcomes[1].message, "reported");
}

// Communicator::abort() reports from another thread while a step may be blocked: the reporter's
// own step ends at once, and the others fail promptly, including a rank that arrives later.
TEST(Bootstrap, ReportFromAnotherThreadEndsTheRunningStep) {
  for (int reporter : {1, 0}) {
    UniqueId id = make_id();
    auto outcomes = run_ranks(
        3,
        [&](int rank) -> Status {
          LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, 3, 20s));
          if (rank == 2) std::this_thread::sleep_for(2s);  // keeps the barrier open meanwhile
          std::thread watchdog;
          if (rank == reporter) {
            watchdog = std::thread([&] {
              std::this_thread::sleep_for(300ms);
              boot->report_failure("watchdog gave up");
            });
          }
          auto begin = Clock::now();
          Status status = boot->barrier();
          auto took = Clock::now() - begin;
          if (watchdog.joinable()) watchdog.join();
          if (rank != 2 && took > 1500ms) return Status::internal("not prompt: " + status.to_string());
          return status;
        },
        [&] { Bootstrap::discard_unique_id(id); });
    std::string reported = "rank " + std::to_string(reporter) + ": watchdog gave up";
    EXPECT_EQ(outcomes[reporter].code, StatusCode::kAborted) << outcomes[reporter].message;
    EXPECT_NE(outcomes[reporter].message.find("rank " + std::to_string(reporter) +
                                              " reported a failure: watchdog gave up"),
              std::string::npos)
        << outcomes[reporter].message;
    for (int r = 0; r < 3; ++r) {
      if (r == reporter) continue;
      EXPECT_EQ(outcomes[r].code, StatusCode::kPeerFailure) << "rank " << r << ": " << outcomes[r].message;
      EXPECT_NE(outcomes[r].message.find(reported), std::string::npos) << "rank " << r << ": " << outcomes[r].message;
    }
  }
}

TEST(Bootstrap, LosingRankZeroFailsTheOthers) {
  UniqueId id = make_id();
  auto outcomes = run_ranks(
      3,
      [&](int rank) -> Status {
        LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, 3, 20s));
        if (rank == 0) ::_exit(1);
        auto begin = Clock::now();
        Status status = boot->barrier();
        if (Clock::now() - begin > 5s) return Status::internal("took too long: " + status.to_string());
        return status;
      },
      [&] { Bootstrap::discard_unique_id(id); });
  for (int r : {1, 2}) {
    EXPECT_EQ(outcomes[r].code, StatusCode::kPeerFailure) << "rank " << r << ": " << outcomes[r].message;
    EXPECT_NE(outcomes[r].message.find("lost connection to rank 0"), std::string::npos) << outcomes[r].message;
  }
}

TEST(Bootstrap, MissingRankZeroTimesOutNamingIt) {
  constexpr auto kTimeout = 1500ms;
  uint16_t port = free_port();
  Secret secret{};
  auto outcomes = run_ranks(2, [&](int index) {
    return Bootstrap::connect(loopback_config(index + 1, 3, port, secret, kTimeout)).status();
  });
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(outcomes[i].code, StatusCode::kTimeout) << outcomes[i].message;
    EXPECT_NE(outcomes[i].message.find("rank 0 did not accept rank " + std::to_string(i + 1)), std::string::npos)
        << outcomes[i].message;
    EXPECT_LE(outcomes[i].elapsed_ms, (kTimeout + 1s).count());
  }
}

TEST(Bootstrap, WorksOverIpv6AndHostNames) {
  for (const char* host : {"::1", "localhost"}) {
    if (!Listener::listen(host, 0).ok()) {
      std::cout << "skipping " << host << ": cannot listen there on this machine\n";
      continue;
    }
    UniqueId id = make_id_on(host);
    auto outcomes = run_ranks(
        3,
        [&](int rank) -> Status {
          LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::from_unique_id(id, rank, 3, 20s));
          return exchange_and_check(*boot, 0);
        },
        [&] { Bootstrap::discard_unique_id(id); });
    for (int r = 0; r < 3; ++r) EXPECT_RANK_OK(outcomes, r) << " on " << host;
  }
}

TEST(Bootstrap, SecretNeverReachesTheLog) {
  constexpr const char* kSecretHex = "5ec2e75ec2e75ec2e75ec2e75ec2e7a1";
  uint16_t port = free_port();
  std::string port_text = std::to_string(port);
  FILE* log = std::tmpfile();
  ASSERT_NE(log, nullptr);
  auto outcomes = run_ranks(3, [&](int rank) -> Status {
    ::dup2(fileno(log), STDERR_FILENO);
    set_log_level(LogLevel::kTrace);
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", "3", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", port_text.c_str(), 1);
    ::setenv("LOOM_SECRET", kSecretHex, 1);
    LOOM_ASSIGN_OR_RETURN(BootstrapConfig config, bootstrap_config_from_env());
    if (rank == 2) {
      // A rejection and a failure report make rank 0 log as much as it ever does.
      Secret wrong = config.secret;
      wrong[0] ^= 1;
      BootstrapConfig impostor = config;
      impostor.secret = wrong;
      (void)Bootstrap::connect(impostor);
    }
    LOOM_ASSIGN_OR_RETURN(auto boot, Bootstrap::connect(config));
    LOOM_TRY(exchange_and_check(*boot, 1));
    if (rank == 1) boot->report_failure("giving up");
    return {};
  });
  for (int r = 0; r < 3; ++r) EXPECT_RANK_OK(outcomes, r);
  std::string text;
  char buffer[4096];
  for (off_t offset = 0;;) {
    ssize_t n = ::pread(fileno(log), buffer, sizeof(buffer), offset);
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
    offset += n;
  }
  std::fclose(log);
  EXPECT_NE(text.find("authentication failed"), std::string::npos) << "the log was not captured:\n" << text;
  std::string upper = kSecretHex;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_EQ(text.find(kSecretHex), std::string::npos);
  EXPECT_EQ(text.find(upper), std::string::npos);
  EXPECT_EQ(text.find("5ec2e7"), std::string::npos);
}

TEST(Bootstrap, RankZeroListensOnlyOnTheConfiguredAddress) {
  uint16_t port = free_port();
  Secret secret{};
  secret[3] = 1;
  ForkedRanks ranks;
  ranks.start([&] {
    Result<std::unique_ptr<Bootstrap>> boot = Bootstrap::connect(loopback_config(0, 2, port, secret, 20s));
    return boot.ok() ? (*boot)->barrier() : boot.status();
  });
  // While rank 0 waits for rank 1, its one listening socket is on 127.0.0.1.
  std::vector<std::string> listening;
  for (int i = 0; i < 500 && listening.empty(); ++i) {
    listening = listening_addresses(port);
    if (listening.empty()) std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(listening, std::vector<std::string>{"0100007F"});
  ranks.start([&] {
    Result<std::unique_ptr<Bootstrap>> boot = Bootstrap::connect(loopback_config(1, 2, port, secret, 20s));
    return boot.ok() ? (*boot)->barrier() : boot.status();
  });
  std::vector<RankOutcome> outcomes = ranks.wait();
  for (int r = 0; r < 2; ++r) EXPECT_RANK_OK(outcomes, r);
}

}  // namespace
}  // namespace loom::runtime
