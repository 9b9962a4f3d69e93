#include "runtime/socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>
#include <thread>

namespace loom::runtime {
namespace {

using std::chrono::milliseconds;

struct AddrInfoDeleter {
  void operator()(addrinfo* list) const { freeaddrinfo(list); }
};
using AddrInfoList = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// Resolves host:port to stream addresses. A temporary resolver failure (EAI_AGAIN) is reported as
// timeout so callers with a deadline retry it; every other failure is the caller's input.
Result<AddrInfoList> resolve(std::string_view host, uint16_t port) {
  if (host.empty()) return Status::invalid_argument("empty host name");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* list = nullptr;
  std::string host_text(host);
  int rc = getaddrinfo(host_text.c_str(), std::to_string(port).c_str(), &hints, &list);
  if (rc == EAI_AGAIN) {
    return Status::timeout("resolving '" + host_text + "': " + gai_strerror(rc));
  }
  if (rc == EAI_SYSTEM) return Status::errno_error("resolving '" + host_text + "'", errno);
  if (rc != 0) return Status::invalid_argument("cannot resolve host '" + host_text + "': " + gai_strerror(rc));
  return AddrInfoList(list);
}

bool is_wildcard(const sockaddr* address) {
  if (address->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(address)->sin_addr.s_addr == htonl(INADDR_ANY);
  }
  if (address->sa_family == AF_INET6) {
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr);
  }
  return false;
}

uint16_t port_of(const sockaddr* address) {
  if (address->sa_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(address)->sin_port);
  if (address->sa_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(address)->sin6_port);
  return 0;
}

std::string numeric_host(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (address->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(address)->sin_addr, text, sizeof(text));
  } else if (address->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr, text, sizeof(text));
  }
  return text;
}

// Waits until `fd` is ready for `events` (or has an error or hang-up, which the following call
// reports). Returns timeout once the deadline passes, aborted once `cancel_fd` is readable.
Status wait_ready(int fd, short events, Deadline deadline, const std::string& what, int cancel_fd = -1) {
  while (true) {
    pollfd entries[2] = {{fd, events, 0}, {cancel_fd, POLLIN, 0}};
    int rc = ::poll(entries, cancel_fd >= 0 ? 2 : 1, poll_timeout_ms(deadline));
    if (rc > 0 && entries[1].revents != 0) return Status::aborted(what + ": cancelled");
    if (rc > 0) return {};
    if (rc == 0) {
      if (Clock::now() >= deadline) return Status::timeout(what + ": deadline passed");
      continue;
    }
    if (errno != EINTR) return Status::errno_error("poll (" + what + ")", errno);
  }
}

bool is_connection_lost(int err) { return err == ECONNRESET || err == EPIPE || err == ENOTCONN; }

// One non-blocking connect attempt to one resolved address; the error text is kept for the
// final message when every attempt until the deadline fails.
Result<Socket> connect_once(const addrinfo& address, Deadline deadline) {
  std::string peer = format_address(address.ai_addr);
  UniqueFd fd(::socket(address.ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Status::errno_error("socket for " + peer, errno);
  int rc = ::connect(fd.get(), address.ai_addr, address.ai_addrlen);
  // A non-blocking connect interrupted by a signal keeps going in the background, like EINPROGRESS.
  if (rc != 0 && errno != EINPROGRESS && errno != EINTR) {
    return Status::errno_error("connect " + peer, errno);
  }
  if (rc != 0) {
    LOOM_TRY(wait_ready(fd.get(), POLLOUT, deadline, "connect " + peer));
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) return Status::errno_error("connect " + peer, err);
  }
  // Retrying a loopback port inside the ephemeral range can connect the socket to itself (TCP
  // simultaneous open) while nobody listens; that is a refused attempt, not a peer.
  sockaddr_storage local{};
  sockaddr_storage remote{};
  socklen_t local_len = sizeof(local);
  socklen_t remote_len = sizeof(remote);
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &local_len) == 0 &&
      getpeername(fd.get(), reinterpret_cast<sockaddr*>(&remote), &remote_len) == 0 &&
      local_len == remote_len && std::memcmp(&local, &remote, local_len) == 0) {
    return Status::errno_error("connect " + peer, ECONNREFUSED);
  }
  int one = 1;
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return Socket(std::move(fd), std::move(peer));
}

}  // namespace

int poll_timeout_ms(Deadline deadline) {
  auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  auto ms = std::chrono::ceil<milliseconds>(left).count();
  return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

int UniqueFd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void UniqueFd::reset(int fd) {
  // close() is not retried on EINTR: on Linux the descriptor is released either way.
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string format_address(const sockaddr* address) {
  return format_host_port(numeric_host(address), port_of(address));
}

std::string format_host_port(std::string_view host, uint16_t port) {
  bool ipv6 = host.find(':') != std::string_view::npos;
  std::string text;
  if (ipv6) text += '[';
  text += host;
  if (ipv6) text += ']';
  text += ':';
  text += std::to_string(port);
  return text;
}

Result<Socket> Socket::connect(std::string_view host, uint16_t port, Deadline deadline) {
  std::string target = std::string(host) + ":" + std::to_string(port);
  std::string last_error = "no attempt before the deadline";
  auto backoff = milliseconds(10);
  while (true) {
    Result<AddrInfoList> addresses = resolve(host, port);
    if (addresses.ok()) {
      for (const addrinfo* a = addresses->get(); a != nullptr; a = a->ai_next) {
        Result<Socket> socket = connect_once(*a, deadline);
        if (socket.ok()) return socket;
        last_error = socket.status().message();
      }
    } else if (addresses.status().code() == StatusCode::kTimeout) {
      last_error = addresses.status().message();
    } else {
      return std::move(addresses).take_status();
    }
    auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      return Status::timeout("could not connect to " + target + " before the deadline (last error: " +
                             last_error + ")");
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, left));
    backoff = std::min(backoff * 2, milliseconds(200));
  }
}

Status Socket::send_all(const void* data, size_t bytes, Deadline deadline) {
  const auto* cursor = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    ssize_t sent = ::send(fd(), cursor, bytes, MSG_NOSIGNAL);
    if (sent > 0) {
      cursor += sent;
      bytes -= static_cast<size_t>(sent);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      LOOM_TRY(wait_ready(fd(), POLLOUT, deadline, "sending to " + peer_));
      continue;
    }
    if (is_connection_lost(errno)) return Status::peer_failure("connection to " + peer_ + " was reset");
    return Status::errno_error("send to " + peer_, errno);
  }
  return {};
}

Status Socket::recv_all(void* data, size_t bytes, Deadline deadline, int cancel_fd) {
  auto* cursor = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    LOOM_ASSIGN_OR_RETURN(size_t received, recv_some(cursor, bytes));
    if (received == 0) {
      LOOM_TRY(wait_ready(fd(), POLLIN, deadline, "receiving from " + peer_, cancel_fd));
      continue;
    }
    cursor += received;
    bytes -= received;
  }
  return {};
}

Result<size_t> Socket::recv_some(void* data, size_t capacity) { return receive(data, capacity, 0); }

Result<size_t> Socket::peek(void* data, size_t capacity) { return receive(data, capacity, MSG_PEEK); }

Result<size_t> Socket::receive(void* data, size_t capacity, int flags) {
  while (true) {
    ssize_t received = ::recv(fd(), data, capacity, flags);
    if (received > 0) return static_cast<size_t>(received);
    if (received == 0) return Status::peer_failure(peer_ + " closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return size_t{0};
    if (is_connection_lost(errno)) return Status::peer_failure("connection to " + peer_ + " was reset");
    return Status::errno_error("recv from " + peer_, errno);
  }
}

Result<Listener> Listener::listen(std::string_view host, uint16_t port) {
  LOOM_ASSIGN_OR_RETURN(AddrInfoList addresses, resolve(host, port));
  Status last = Status::invalid_argument(std::string(host) + " resolved to no address");
  for (const addrinfo* a = addresses.get(); a != nullptr; a = a->ai_next) {
    std::string address = format_address(a->ai_addr);
    if (is_wildcard(a->ai_addr)) {
      return Status::invalid_argument("refusing to listen on the wildcard address " + address +
                                      ": name the interface address the other ranks connect to");
    }
    UniqueFd fd(::socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) {
      last = Status::errno_error("socket for " + address, errno);
      continue;
    }
    // A fixed MASTER_PORT is reused by consecutive jobs; connections of the last one may still be
    // in TIME_WAIT. (Linux never lets two sockets listen on one address and port this way.)
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      last = Status::errno_error("bind " + address, errno);
      continue;
    }
    if (::listen(fd.get(), SOMAXCONN) != 0) {
      last = Status::errno_error("listen on " + address, errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t bound_len = sizeof(bound);
    if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &bound_len) != 0) {
      return Status::errno_error("getsockname for " + address, errno);
    }
    const auto* bound_address = reinterpret_cast<const sockaddr*>(&bound);
    return Listener(std::move(fd), numeric_host(bound_address), port_of(bound_address),
                    format_address(bound_address));
  }
  return last;
}

namespace {

bool transient_accept_error(int error) {
  switch (error) {
    case EMFILE: case ENFILE: case ENOBUFS: case ENOMEM:                   // a shortage: back off, free some
    case EPROTO: case ENETDOWN: case ENOPROTOOPT: case EHOSTDOWN: case ENONET:
    case EHOSTUNREACH: case EOPNOTSUPP: case ENETUNREACH: case EPERM:      // that connection's own error
      return true;
    default:
      return false;
  }
}

}  // namespace

Result<std::optional<Socket>> Listener::try_accept(int* transient_errno) {
  if (transient_errno != nullptr) *transient_errno = 0;
  while (true) {
    sockaddr_storage remote{};
    socklen_t remote_len = sizeof(remote);
    int fd = ::accept4(fd_.get(), reinterpret_cast<sockaddr*>(&remote), &remote_len,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return std::optional<Socket>(Socket(UniqueFd(fd), format_address(reinterpret_cast<sockaddr*>(&remote))));
    }
    // A connection reset while queued is the client's problem, not the listener's.
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return std::optional<Socket>();
    if (transient_errno != nullptr && transient_accept_error(errno)) {
      *transient_errno = errno;
      return std::optional<Socket>();
    }
    return Status::errno_error("accept on " + address_, errno);
  }
}

}  // namespace loom::runtime
