// Bootstrap: how N processes find each other and exchange small blobs before any GPU traffic.
//
// Star topology over TCP: rank 0 listens on one configured address (never 0.0.0.0), every
// other rank connects to it. Each connection is authenticated by a challenge-response over a
// per-job 128-bit secret (HMAC-SHA256; the secret itself never crosses the wire nor reaches a
// log). After that, the collectives below run through rank 0. Every step has a deadline: a
// rank that never arrives makes every other rank fail with a timeout Status naming it, and a
// rank that disconnects or reports a failure makes the others fail with peer_failure naming it.
// Between steps, watch() keeps reading the connections (the communicator's watchdog thread runs
// it): a failure reported by any rank, or a rank whose connection drops (its process died), reaches
// every other rank within moments, rank 0 forwarding it. A rank that cannot even start
// (announce_failure) still tells the others.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "loom/status.h"

namespace loom::runtime {

using Secret = std::array<uint8_t, 16>;

// Opaque handle one rank creates and the application hands to the others (Python broadcasts it
// through torch.distributed). Holds the root's address, port and the job secret.
struct UniqueId {
  static constexpr size_t kBytes = 128;
  std::array<uint8_t, kBytes> bytes{};
};

struct BootstrapConfig {
  int rank = -1;
  int world_size = 0;
  std::string root_addr;   // numeric IPv4/IPv6 address or host name of rank 0; rank 0 binds it
  uint16_t root_port = 0;  // 0 only on rank 0 of a unique-id job (ephemeral port)
  Secret secret{};
  std::chrono::milliseconds timeout{120'000};  // deadline of each step
};

// Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun/Slurm style; under torchrun rank 0
// listens on MASTER_PORT + 1, torch's store having MASTER_PORT; LOOM_BOOTSTRAP_PORT overrides; LOCAL_RANK and
// LOCAL_WORLD_SIZE are read by the topology) and LOOM_SECRET / LOOM_BOOTSTRAP_TIMEOUT_MS. Bad
// values fail with invalid_argument naming the variable. A job of several ranks without
// LOOM_SECRET is refused, saying how to set one: no secret is derived from public values
// (docs/SECURITY.md).
Result<BootstrapConfig> bootstrap_config_from_env();

class Bootstrap {
 public:
  // Rank 0 of a unique-id job: binds `bind_addr` on an ephemeral port, draws a random secret and
  // keeps the listener open for the later from_unique_id() call in this process.
  static Result<UniqueId> create_unique_id(std::string_view bind_addr = "127.0.0.1");
  // Any rank; rank 0 takes over the listener create_unique_id() left in this process (or binds
  // the id's address itself when another process created the id). A garbage id fails with
  // invalid_argument.
  static Result<std::unique_ptr<Bootstrap>> from_unique_id(const UniqueId& id, int rank, int world_size,
                                                           std::chrono::milliseconds timeout);
  // Closes the listener create_unique_id() keeps for `id` when this process will not be its
  // rank 0 (an abandoned job, or a parent that forked the ranks). No effect otherwise.
  static void discard_unique_id(const UniqueId& id);
  // Connects (rank != 0) or listens and accepts everyone (rank 0). Returns when all world_size
  // ranks are connected and authenticated, or fails within config.timeout (+ at most 1 s).
  static Result<std::unique_ptr<Bootstrap>> connect(const BootstrapConfig& config);
  // For a rank that cannot take part (a bad setting, no GPU), in place of connect(): it joins just
  // long enough to tell the others, who then fail with peer_failure naming it and `failure`
  // as soon as they have connected, instead of at their deadline. Rank 0 keeps accepting to tell
  // the late ones. Bounded by min(timeout, kAnnounceLimit); returns `failure` (with a note when
  // not every rank could be told).
  static constexpr std::chrono::milliseconds kAnnounceLimit{30'000};
  static Status announce_failure(const BootstrapConfig& config, const Status& failure);
  static Status announce_failure(const UniqueId& id, int rank, int world_size, std::chrono::milliseconds timeout,
                                 const Status& failure);

  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // all[r * bytes_per_rank ...] = rank r's `mine`. Every rank passes the same bytes_per_rank.
  virtual Status all_gather(const void* mine, void* all, size_t bytes_per_rank) = 0;
  // data (bytes long on every rank) = root's data.
  virtual Status broadcast(void* data, size_t bytes, int root) = 0;
  virtual Status barrier() = 0;
  // Best effort: tells every peer that this rank failed, so their current or next step returns
  // peer_failure("rank R: <message>") instead of waiting for the deadline. Any thread may call
  // it, also while a step runs on another (an abort): that step then returns at once.
  virtual void report_failure(std::string_view message) = 0;
  // The same, the peers' Status keeping `code` when it is timeout (a device wait gave up) or
  // invalid_argument (ranks called different operations); peer_failure for any other code.
  virtual void report_failure_as(StatusCode code, std::string_view message) {
    (void)code;
    report_failure(message);
  }

  // ---- after init: the watch (runtime/watchdog.h) -------------------------------------------
  // Between steps, reads the connections for failure notices and lost peers for at most
  // `max_wait` (0: only what has arrived); rank 0 forwards each to every other rank. While a step
  // runs it only waits (the step reads its connections itself). Returns ok while nothing has
  // failed, else this rank's first failure: a peer's notice ("rank R: <reason>", with the code the
  // notice carries), a lost peer ("rank R: disconnected ..."), or this rank's own report. Later
  // calls go on forwarding and collecting notices. One thread at a time, beside the steps.
  virtual Status watch(std::chrono::milliseconds max_wait) {
    (void)max_wait;
    return {};
  }
  // Ends a watch() in progress promptly (any thread).
  virtual void wake_watch() {}
  // The failures other ranks reported to this one, in the order they arrived (at most 64).
  virtual std::vector<Status> peer_notices() const { return {}; }
};
// Steps (all_gather, broadcast, barrier) are called by one thread at a time. After a step fails,
// or after report_failure(), every later step returns aborted with the first failure in its
// message.

// The wire format, exposed so tests can play a hostile client or a fake rank 0; only
// bootstrap.cc builds real messages. Each message is a 16-byte header (magic, version, type,
// payload length; little-endian) and a fixed-size body of its type; kStep and kResult append the
// caller's bytes, whose length the receiver knows before reading them. Nothing else is ever
// deserialized.
namespace bootstrap_wire {

inline constexpr uint32_t kMagic = 0x4d4f4f4c;  // "LOOM" in memory order
inline constexpr uint16_t kVersion = 2;
inline constexpr size_t kHeaderBytes = 16;
inline constexpr size_t kChallengeBodyBytes = 32;  // rank 0's nonce
inline constexpr size_t kHelloBodyBytes = 72;      // rank, world size, client nonce, client proof
inline constexpr size_t kWelcomeBodyBytes = 32;    // rank 0's proof over the client nonce

enum class MessageType : uint16_t {
  kChallenge = 1,  // rank 0 -> client, first message of a connection
  kHello = 2,      // client -> rank 0
  kWelcome = 3,    // rank 0 -> client: authenticated both ways
  kReady = 4,      // rank 0 -> client: every rank has joined
  kQuery = 5,      // client -> rank 0 when its init deadline passes: which ranks are missing?
  kMissing = 6,    // rank 0 -> client: the ranks still missing
  kStep = 7,       // client -> rank 0: a collective step and this rank's bytes
  kResult = 8,     // rank 0 -> client: the step's result
  kFailure = 9,    // either way: a rejection, a reported failure, a timeout verdict
};

std::array<uint8_t, kHeaderBytes> encode_header(MessageType type, uint64_t payload_bytes);
// The proof a client puts in its hello: HMAC-SHA256(secret, domain || challenge || rank || world).
Result<std::array<uint8_t, 32>> client_proof(const Secret& secret,
                                             std::span<const uint8_t, kChallengeBodyBytes> challenge, uint32_t rank,
                                             uint32_t world_size);

}  // namespace bootstrap_wire

}  // namespace loom::runtime
