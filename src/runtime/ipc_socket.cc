#include "runtime/ipc_socket.h"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/log.h"

namespace loom::runtime {
namespace {

constexpr uint32_t kMessageMagic = 0x44464d4c;  // "LMFD" in memory order
constexpr uint32_t kMessageVersion = 1;
// Accepted connections that have not delivered their message yet. A process that connects and
// stays silent occupies one slot until the deadline; past this many, new ones are dropped.
constexpr size_t kMaxPendingConnections = 64;
// Pause between connection attempts while a peer's listener is not there yet.
constexpr auto kConnectRetryInterval = std::chrono::milliseconds(10);

// The one message of a connection (48 bytes; host byte order, both ends are on one machine):
//   magic u32 | version u32 | tag[16] | node i32 | local_rank i32 | value u64 | reserved u64
// The descriptor travels beside it as SCM_RIGHTS ancillary data.
struct FdMessageHeader {
  uint32_t magic;
  uint32_t version;
  uint8_t tag[16];
  int32_t node;
  int32_t local_rank;
  uint64_t value;
  uint64_t reserved;
};
static_assert(sizeof(FdMessageHeader) == 48, "FdMessageHeader is a fixed wire format");

// Room for the ancillary data of exactly one descriptor; more is truncated (MSG_CTRUNC).
union FdControlBuffer {
  char bytes[CMSG_SPACE(sizeof(int))];
  cmsghdr align;
};

// A header and room for one descriptor, with the msghdr that sendmsg and recvmsg take pointing at
// them. Not copyable: the msghdr points into the object itself.
struct FdMessage {
  FdMessageHeader header{};
  iovec payload{&header, sizeof(header)};
  msghdr message{};
  FdControlBuffer control{};  // last: its cmsghdr ends in a flexible array

  FdMessage() {
    message.msg_iov = &payload;
    message.msg_iovlen = 1;
    message.msg_control = control.bytes;
    message.msg_controllen = sizeof(control.bytes);
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};

socklen_t abstract_address(const std::string& name, sockaddr_un* address) {
  std::memset(address, 0, sizeof(*address));
  address->sun_family = AF_UNIX;
  // sun_path[0] stays NUL: the abstract namespace. The name is not NUL-terminated; its length
  // is part of the address.
  std::memcpy(address->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

// The uid of the process at the other end of a connected Unix socket.
Result<uid_t> peer_uid(int socket_fd) {
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  if (getsockopt(socket_fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    return Status::errno_error("getsockopt(SO_PEERCRED)", errno);
  }
  return credentials.uid;
}

// Closes every descriptor carried by a message we are dropping, so none leaks.
void close_received_fds(msghdr& message) {
  for (cmsghdr* c = CMSG_FIRSTHDR(&message); c != nullptr; c = CMSG_NXTHDR(&message, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      close(fd);
    }
  }
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (int rank : ranks) {
    if (!text.empty()) text += ", ";
    text += std::to_string(rank);
  }
  return text;
}

}  // namespace

Result<SocketTag> random_socket_tag() {
  SocketTag tag{};
  ssize_t got = -1;
  do {
    got = getrandom(tag.data(), tag.size(), 0);
  } while (got < 0 && errno == EINTR);
  if (got < 0) return Status::errno_error("getrandom", errno);
  if (static_cast<size_t>(got) != tag.size()) return Status::system_error("getrandom returned too few bytes");
  return tag;
}

std::string endpoint_socket_name(const SocketTag& tag, int node, int local_rank) {
  std::string name = "loom-";
  char hex[3];
  for (uint8_t byte : tag) {
    std::snprintf(hex, sizeof(hex), "%02x", byte);
    name += hex;
  }
  name += "-n" + std::to_string(node) + "-l" + std::to_string(local_rank);
  return name;
}

FdExchange::FdExchange(const SocketTag& tag, int node, int local_rank, UniqueFd listener)
    : tag_(tag),
      node_(node),
      local_rank_(local_rank),
      name_(endpoint_socket_name(tag, node, local_rank)),
      listener_(std::move(listener)) {}

Result<FdExchange> FdExchange::listen(const SocketTag& tag, int node, int local_rank, int max_peers) {
  const std::string name = endpoint_socket_name(tag, node, local_rank);
  UniqueFd listener(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listener.valid()) return Status::errno_error("socket(AF_UNIX, SOCK_SEQPACKET)", errno);
  sockaddr_un address{};
  const socklen_t length = abstract_address(name, &address);
  if (bind(listener.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) {
    return Status::errno_error("bind(@" + name + ")" +
                                   (errno == EADDRINUSE ? " (another process holds this job's socket name)" : ""),
                               errno);
  }
  // Every peer plus slack for stray connections, so a peer's connect never waits on our accept.
  const int backlog = std::max(max_peers, 0) + 16;
  if (::listen(listener.get(), backlog) != 0) return Status::errno_error("listen(@" + name + ")", errno);
  return FdExchange(tag, node, local_rank, std::move(listener));
}

Status FdExchange::send(int peer_local_rank, int fd, uint64_t value, Deadline deadline) {
  const std::string peer_name = endpoint_socket_name(tag_, node_, peer_local_rank);
  sockaddr_un address{};
  const socklen_t length = abstract_address(peer_name, &address);

  UniqueFd connection;
  while (true) {
    // A fresh socket per attempt: a socket whose connect failed is not reused.
    connection.reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!connection.valid()) return Status::errno_error("socket(AF_UNIX, SOCK_SEQPACKET)", errno);
    if (connect(connection.get(), reinterpret_cast<const sockaddr*>(&address), length) == 0) break;
    const int err = errno;
    // Not listening yet (ECONNREFUSED), or its backlog is full (EAGAIN): try again until the deadline.
    if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN && err != EINTR) {
      return Status::errno_error("connect to local rank " + std::to_string(peer_local_rank) + " (@" + peer_name + ")", err);
    }
    if (Clock::now() >= deadline) {
      return Status::timeout("local rank " + std::to_string(peer_local_rank) + " never listened on @" + peer_name +
                             " (last error: " + std::strerror(err) + ")");
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(
        kConnectRetryInterval, deadline - Clock::now()));
  }

  // The name is guessable once seen in /proc/net/unix: make sure it is one of ours that listens.
  LOOM_ASSIGN_OR_RETURN(const uid_t listener_uid, peer_uid(connection.get()));
  if (listener_uid != getuid()) {
    return Status::system_error("the socket of local rank " + std::to_string(peer_local_rank) + " (@" + peer_name +
                                ") belongs to uid " + std::to_string(listener_uid) + ", not ours (" +
                                std::to_string(getuid()) + "); refusing to send it a memory handle");
  }

  FdMessage out;
  FdMessageHeader& header = out.header;
  header.magic = kMessageMagic;
  header.version = kMessageVersion;
  std::memcpy(header.tag, tag_.data(), sizeof(header.tag));
  header.node = node_;
  header.local_rank = local_rank_;
  header.value = value;

  msghdr& message = out.message;
  cmsghdr* rights = CMSG_FIRSTHDR(&message);
  rights->cmsg_level = SOL_SOCKET;
  rights->cmsg_type = SCM_RIGHTS;
  rights->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(rights), &fd, sizeof(int));

  while (true) {
    const ssize_t sent = sendmsg(connection.get(), &message, MSG_NOSIGNAL);
    if (sent == static_cast<ssize_t>(sizeof(header))) break;
    if (sent >= 0) return Status::system_error("sendmsg to local rank " + std::to_string(peer_local_rank) + ": short write");
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EAGAIN && err != EWOULDBLOCK) {
      return Status::errno_error("sendmsg to local rank " + std::to_string(peer_local_rank), err);
    }
    pollfd writable{connection.get(), POLLOUT, 0};
    const int ready = poll(&writable, 1, poll_timeout_ms(deadline));
    if (ready < 0 && errno != EINTR) return Status::errno_error("poll", errno);
    if (ready == 0) {
      return Status::timeout("local rank " + std::to_string(peer_local_rank) + " never drained its socket @" + peer_name);
    }
  }
  sent_.push_back(std::move(connection));
  return Status::ok_status();
}

Result<std::vector<ReceivedFd>> FdExchange::receive(std::span<const int> peer_local_ranks, Deadline deadline) {
  const auto started = Clock::now();
  std::vector<ReceivedFd> received(peer_local_ranks.size());
  size_t still_missing = peer_local_ranks.size();
  std::vector<UniqueFd> pending;  // accepted, message not read yet

  // Reads the one message of an accepted connection. Returns true when the connection is done
  // with (message taken or dropped), false when it has not sent anything yet.
  auto read_message = [&](int connection) -> bool {
    FdMessage in;
    const FdMessageHeader& header = in.header;
    msghdr& message = in.message;
    const ssize_t got = recvmsg(connection, &message, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;

    const char* problem = nullptr;
    if (got < 0) {
      problem = "receive failed";
    } else if (got == 0) {
      problem = "closed without a message";
    } else if (got != static_cast<ssize_t>(sizeof(header)) || (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
      problem = "sent a message of the wrong size";
    } else if (header.magic != kMessageMagic || header.version != kMessageVersion) {
      problem = "sent a message with a wrong magic or version";
    } else if (std::memcmp(header.tag, tag_.data(), sizeof(header.tag)) != 0 || header.node != node_) {
      problem = "belongs to another job or node";
    }
    cmsghdr* rights = problem ? nullptr : CMSG_FIRSTHDR(&message);
    if (!problem && (rights == nullptr || rights->cmsg_level != SOL_SOCKET || rights->cmsg_type != SCM_RIGHTS ||
                     rights->cmsg_len != CMSG_LEN(sizeof(int)))) {
      problem = "sent no file descriptor";
    }
    const auto slot = std::find(peer_local_ranks.begin(), peer_local_ranks.end(), header.local_rank);
    const size_t index = static_cast<size_t>(slot - peer_local_ranks.begin());
    if (!problem && slot == peer_local_ranks.end()) problem = "claims a local rank we do not expect";
    if (!problem && received[index].fd.valid()) problem = "repeats a local rank that already sent";
    if (problem) {
      const bool header_readable = got == static_cast<ssize_t>(sizeof(header)) && header.magic == kMessageMagic;
      if (header_readable) {
        LOOM_WARN("fd exchange @%s: dropped a connection that %s (it claims local rank %d)", name_.c_str(), problem,
                  header.local_rank);
      } else {
        LOOM_WARN("fd exchange @%s: dropped a connection that %s", name_.c_str(), problem);
      }
      if (got > 0) close_received_fds(message);
      return true;
    }
    int fd = -1;
    std::memcpy(&fd, CMSG_DATA(rights), sizeof(int));
    received[index] = ReceivedFd{header.local_rank, header.value, UniqueFd(fd)};
    --still_missing;
    return true;
  };

  while (still_missing > 0) {
    if (Clock::now() >= deadline) {
      std::vector<int> missing;
      for (size_t i = 0; i < peer_local_ranks.size(); ++i) {
        if (!received[i].fd.valid()) missing.push_back(peer_local_ranks[i]);
      }
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started);
      return Status::timeout("local rank " + std::to_string(local_rank_) + " received no memory handle from local rank(s) " +
                             join_ranks(missing) + " within " + std::to_string(waited.count()) + " ms (listening on @" +
                             name_ + ")");
    }

    std::vector<pollfd> watched;
    watched.push_back({listener_.get(), POLLIN, 0});
    for (const UniqueFd& connection : pending) watched.push_back({connection.get(), POLLIN, 0});
    const int ready = poll(watched.data(), watched.size(), poll_timeout_ms(deadline));
    if (ready < 0) {
      if (errno == EINTR) continue;
      return Status::errno_error("poll on @" + name_, errno);
    }
    if (ready == 0) continue;  // the deadline check above reports it

    // Read before accepting, so `watched` indices still match `pending`.
    std::vector<UniqueFd> still_pending;
    for (size_t i = 0; i < pending.size(); ++i) {
      const bool done = watched[i + 1].revents != 0 && read_message(pending[i].get());
      if (!done) still_pending.push_back(std::move(pending[i]));
    }
    pending = std::move(still_pending);

    if (watched[0].revents & POLLIN) {
      while (true) {
        UniqueFd connection(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!connection.valid()) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) break;
          return Status::errno_error("accept on @" + name_, errno);
        }
        Result<uid_t> uid = peer_uid(connection.get());
        if (!uid.ok() || *uid != getuid()) {
          LOOM_WARN("fd exchange @%s: dropped a connection from uid %ld (ours is %ld)", name_.c_str(),
                    uid.ok() ? static_cast<long>(*uid) : -1L, static_cast<long>(getuid()));
          continue;
        }
        if (pending.size() >= kMaxPendingConnections) {
          LOOM_WARN("fd exchange @%s: %zu silent connections pending; dropped a new one", name_.c_str(), pending.size());
          continue;
        }
        // A connection usually carries its message already (the sender queued it before we
        // accepted); read it now rather than after another poll round.
        if (!read_message(connection.get())) pending.push_back(std::move(connection));
      }
    }
  }
  return received;
}

}  // namespace loom::runtime
