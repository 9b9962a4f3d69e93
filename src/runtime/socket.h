// TCP sockets with deadlines, for the bootstrap and the launcher.
//
// Every descriptor is close-on-exec and non-blocking; every call that can wait takes an
// absolute deadline and waits with poll(), so nothing here blocks past it. Listening sockets bind
// exactly the address they are given: the wildcard addresses (0.0.0.0, ::) are refused, so a
// job's port is never reachable from interfaces it did not name.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "loom/status.h"

struct sockaddr;

namespace loom::runtime {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// Milliseconds left until `deadline` for poll(): 0 once it has passed, rounded up otherwise so a
// wait never ends just before the deadline and spins.
int poll_timeout_ms(Deadline deadline);

// Owns one file descriptor; closes it on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// "127.0.0.1:29500" or "[::1]:29500".
std::string format_address(const sockaddr* address);
// The same for a host as configured: "node7:29500", "[fe80::1]:29500".
std::string format_host_port(std::string_view host, uint16_t port);

// A connected TCP stream (TCP_NODELAY: the bootstrap sends small messages and waits for answers).
class Socket {
 public:
  Socket(UniqueFd fd, std::string peer) : fd_(std::move(fd)), peer_(std::move(peer)) {}

  // Connects to host:port (numeric address or name), retrying refused or unreachable attempts
  // until the deadline because the listener may start later than this process.
  static Result<Socket> connect(std::string_view host, uint16_t port, Deadline deadline);

  // Sends / receives exactly `bytes`. A deadline in the past still allows whatever completes
  // without waiting. Failures: timeout (deadline passed), peer_failure (the peer closed or reset
  // the connection), system_error (anything else). A receive also ends, with aborted, once
  // `cancel_fd` (an eventfd another thread may signal; -1: none) becomes readable.
  Status send_all(const void* data, size_t bytes, Deadline deadline);
  Status recv_all(void* data, size_t bytes, Deadline deadline, int cancel_fd = -1);
  // Receives what is available now, up to `capacity` bytes; 0 when nothing is.
  Result<size_t> recv_some(void* data, size_t capacity);
  // Copies what is available now, up to `capacity` bytes, leaving it to be received; 0 when
  // nothing is; peer_failure once the peer has closed and nothing is left.
  Result<size_t> peek(void* data, size_t capacity);

  int fd() const { return fd_.get(); }
  const std::string& peer() const { return peer_; }

 private:
  Result<size_t> receive(void* data, size_t capacity, int flags);

  UniqueFd fd_;
  std::string peer_;  // the remote address, for messages
};

// A listening TCP socket bound to one configured address.
class Listener {
 public:
  // Binds host:port (port 0: an ephemeral port, see port()). Fails with invalid_argument for a
  // wildcard address or a host that does not resolve.
  static Result<Listener> listen(std::string_view host, uint16_t port);

  // A pending connection, or nullopt when none is waiting. With `transient_errno`, errors that do
  // not end the listener — a connection's own network error (ECONNABORTED, EPROTO, ENETDOWN, ...,
  // which accept(2) asks callers to treat as "try again") and a shortage of descriptors or
  // buffers (EMFILE, ENFILE, ENOBUFS, ENOMEM) — give nullopt and the errno there instead of a
  // Status; the caller decides how to back off.
  Result<std::optional<Socket>> try_accept(int* transient_errno = nullptr);

  int fd() const { return fd_.get(); }
  const std::string& host() const { return host_; }  // the bound numeric address, "::1" unbracketed
  uint16_t port() const { return port_; }
  const std::string& address() const { return address_; }  // "127.0.0.1:29500", "[::1]:29500"

 private:
  Listener(UniqueFd fd, std::string host, uint16_t port, std::string address)
      : fd_(std::move(fd)), host_(std::move(host)), port_(port), address_(std::move(address)) {}

  UniqueFd fd_;
  std::string host_;
  uint16_t port_ = 0;
  std::string address_;
};

}  // namespace loom::runtime
