// Passing file descriptors between the ranks of one node over Unix-domain sockets (SCM_RIGHTS).
//
// The symmetric heap exports its cuMem allocation as a POSIX file descriptor; a descriptor only
// means something inside a process, so it travels to each local peer as ancillary data on a Unix
// socket, where the kernel installs a duplicate in the receiver.
//
// Naming: each endpoint listens on an abstract-namespace name (no file to clean up, gone when
// the socket closes) built from a per-job random tag, the node index and the local rank, so two
// jobs on one host (or two emulated nodes of one job) never collide, and a crashed job leaves
// nothing behind.
//
// Protocol: one SOCK_SEQPACKET connection per (sender, receiver) pair carrying exactly one
// message: a fixed-size FdMessageHeader (magic, version, tag, node, local rank, a 64-bit value)
// plus one descriptor. Both ends check with SO_PEERCRED that the other process runs under our
// uid, so a descriptor never reaches another user's process; the receiver also drops messages
// with a wrong magic, tag, node or sender (logged once each) and keeps accepting.
//
// Why there is no ordering deadlock: send() returns once the message sits in the receiver's
// socket buffer. A connection to a listening socket completes from the listen backlog without the
// receiver calling accept(), and a single small message always fits the socket buffer, so every
// endpoint can first send to all peers and only then receive from all of them, in any order,
// even within one thread. The listen backlog is sized for every peer plus slack.
//
// Every step has a deadline (poll); a peer that never connects makes receive() fail with a
// timeout naming its local rank.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "loom/status.h"
#include "runtime/socket.h"  // UniqueFd, Deadline

namespace loom::runtime {

using SocketTag = std::array<uint8_t, 16>;

// 128 random bits from the kernel (getrandom), for socket names and self-test nonces.
Result<SocketTag> random_socket_tag();

// "loom-<32 hex digits of tag>-n<node>-l<local rank>" (used with a leading NUL: abstract name).
std::string endpoint_socket_name(const SocketTag& tag, int node, int local_rank);

// A descriptor received from one peer, with the value the peer sent alongside it.
struct ReceivedFd {
  int local_rank = -1;
  uint64_t value = 0;
  UniqueFd fd;
};

// One endpoint of a descriptor exchange among the local ranks of one node.
class FdExchange {
 public:
  // Binds and listens on this endpoint's name. `max_peers` sizes the listen backlog. Every
  // endpoint should be listening before peers send (the heap puts a bootstrap collective in
  // between); send() also retries a missing listener until its deadline.
  static Result<FdExchange> listen(const SocketTag& tag, int node, int local_rank, int max_peers);

  // Connects to `peer_local_rank` and queues (fd, value) there. The connection stays open until
  // this FdExchange is destroyed. Fails with timeout if the peer is not listening by `deadline`,
  // or with system_error if the listener runs under another uid.
  Status send(int peer_local_rank, int fd, uint64_t value, Deadline deadline);

  // Accepts connections until every rank in `peer_local_ranks` has delivered its message;
  // returns them in the order of `peer_local_ranks`. Timeout: names the ranks still missing.
  Result<std::vector<ReceivedFd>> receive(std::span<const int> peer_local_ranks, Deadline deadline);

  const std::string& name() const { return name_; }

 private:
  FdExchange(const SocketTag& tag, int node, int local_rank, UniqueFd listener);

  SocketTag tag_{};
  int node_ = 0;
  int local_rank_ = 0;
  std::string name_;
  UniqueFd listener_;
  std::vector<UniqueFd> sent_;  // outgoing connections, kept open until the exchange ends
};

}  // namespace loom::runtime
