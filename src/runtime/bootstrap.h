// Bootstrap: how N processes find each other and exchange small blobs before any GPU traffic.
//
// Star topology over TCP: rank 0 listens on one configured address (never 0.0.0.0), every
// other rank connects to it. Each connection is authenticated by a challenge-response over a
// per-job 128-bit secret (HMAC-SHA256; the secret itself never crosses the wire nor reaches a
// log). After that, the collectives below run through rank 0. Every step has a deadline: a
// rank that never arrives makes every other rank fail with a timeout Status naming it, and a
// rank that disconnects or reports a failure makes the others fail with peer_failure naming it.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
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

// Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun/Slurm style; LOCAL_RANK and
// LOCAL_WORLD_SIZE are read by the topology) and LOOM_SECRET / LOOM_BOOTSTRAP_TIMEOUT_MS. Bad
// values fail with invalid_argument naming the variable. Without LOOM_SECRET the secret is
// derived from TORCHELASTIC_RUN_ID (or MASTER_ADDR:MASTER_PORT) and a warning says the job is
// then only as private as that value.
Result<BootstrapConfig> bootstrap_config_from_env();

class Bootstrap {
 public:
  // Rank 0 of a unique-id job: binds `bind_addr` on an ephemeral port, draws a random secret and
  // keeps the listener open for the later from_unique_id() call in this process.
  static Result<UniqueId> create_unique_id(std::string_view bind_addr = "127.0.0.1");
  static Result<std::unique_ptr<Bootstrap>> from_unique_id(const UniqueId& id, int rank, int world_size,
                                                           std::chrono::milliseconds timeout);
  // Connects (rank != 0) or listens and accepts everyone (rank 0). Returns when all world_size
  // ranks are connected and authenticated, or fails within config.timeout (+ at most 1 s).
  static Result<std::unique_ptr<Bootstrap>> connect(const BootstrapConfig& config);

  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // all[r * bytes_per_rank ...] = rank r's `mine`. Every rank passes the same bytes_per_rank.
  virtual Status all_gather(const void* mine, void* all, size_t bytes_per_rank) = 0;
  // data (bytes long on every rank) = root's data.
  virtual Status broadcast(void* data, size_t bytes, int root) = 0;
  virtual Status barrier() = 0;
  // Best effort: tells every peer that this rank failed, so their current or next step returns
  // peer_failure("rank R: <message>") instead of waiting for the deadline.
  virtual void report_failure(std::string_view message) = 0;
};

}  // namespace loom::runtime
