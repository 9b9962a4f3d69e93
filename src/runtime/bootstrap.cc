#include "runtime/bootstrap.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <dirent.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <type_traits>
#include <utility>

#include "core/env.h"
#include "core/log.h"
#include "runtime/rank_list.h"
#include "runtime/socket.h"

namespace loom::runtime {

namespace {

template <typename T>
void store_le(uint8_t* at, T value) {
  auto bits = static_cast<std::make_unsigned_t<T>>(value);
  for (size_t i = 0; i < sizeof(T); ++i) at[i] = static_cast<uint8_t>(bits >> (8 * i));
}

template <typename T>
T load_le(const uint8_t* at) {
  std::make_unsigned_t<T> bits = 0;
  for (size_t i = 0; i < sizeof(T); ++i) bits |= static_cast<std::make_unsigned_t<T>>(at[i]) << (8 * i);
  return static_cast<T>(bits);
}

}  // namespace

namespace bootstrap_wire {

std::array<uint8_t, kHeaderBytes> encode_header(MessageType type, uint64_t payload_bytes) {
  std::array<uint8_t, kHeaderBytes> header{};
  store_le(header.data(), kMagic);
  store_le(header.data() + 4, kVersion);
  store_le(header.data() + 6, static_cast<uint16_t>(type));
  store_le(header.data() + 8, payload_bytes);
  return header;
}

}  // namespace bootstrap_wire

namespace {

using std::chrono::milliseconds;
using bootstrap_wire::kHeaderBytes;
using bootstrap_wire::MessageType;

// ---- limits ------------------------------------------------------------------------------------

constexpr int kMaxWorldSize = 1 << 20;
// The bootstrap carries small blobs (descriptors, handles). The cap bounds what a peer can make
// a rank expect, and is checked before any byte of a step is received.
constexpr uint64_t kMaxStepBytes = uint64_t{1} << 30;
// An honest client answers the challenge within a round trip; this only bounds silent ones.
constexpr milliseconds kHandshakeTimeout{10'000};
// Unauthenticated connections held at once (fewer when the descriptor limit is low:
// handshake_cap); beyond it the oldest is dropped, so a flood cannot exhaust descriptors.
constexpr size_t kMaxHandshakes = 256;
// After accept() ran out of descriptors or buffers with no handshake to drop: how long rank 0
// stops accepting, doubling up to the maximum while it lasts.
constexpr milliseconds kAcceptPauseMin{5};
constexpr milliseconds kAcceptPauseMax{200};
// Warnings about refused connections: a burst, then one a second saying how many were held back.
constexpr int kWarningBurst = 16;
constexpr milliseconds kWarningInterval{1'000};
// How long a client whose init deadline passed waits for rank 0 to say who is missing.
constexpr milliseconds kQueryGrace{500};
// Bound on best-effort notices (failure reports) sent outside a step.
constexpr milliseconds kNoticeTimeout{1'000};
// Failure notices other ranks sent that a rank keeps (Bootstrap::peer_notices).
constexpr size_t kMaxKeptNotices = 64;

// ---- message bodies ----------------------------------------------------------------------------

constexpr size_t kTextBytes = 1024;
constexpr size_t kMissingBodyBytes = kTextBytes;       // the missing ranks, as text
constexpr size_t kStepBodyBytes = 24;                  // sequence u64, kind u32, root i32, bytes u64
constexpr size_t kResultBodyBytes = kStepBodyBytes;    // the step it answers, encoded the same way
constexpr size_t kFailureBodyBytes = 16 + kTextBytes;  // code u32, origin rank i32, kind u32, 0 u32, text
constexpr size_t kNonceBytes = bootstrap_wire::kChallengeBodyBytes;

using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, 32>;  // HMAC-SHA256

std::optional<size_t> body_bytes(MessageType type) {
  switch (type) {
    case MessageType::kChallenge: return bootstrap_wire::kChallengeBodyBytes;
    case MessageType::kHello: return bootstrap_wire::kHelloBodyBytes;
    case MessageType::kWelcome: return bootstrap_wire::kWelcomeBodyBytes;
    case MessageType::kReady: return 0;
    case MessageType::kQuery: return 0;
    case MessageType::kMissing: return kMissingBodyBytes;
    case MessageType::kStep: return kStepBodyBytes;
    case MessageType::kResult: return kResultBodyBytes;
    case MessageType::kFailure: return kFailureBodyBytes;
  }
  return std::nullopt;
}

bool carries_bulk(MessageType type) { return type == MessageType::kStep || type == MessageType::kResult; }

struct Header {
  MessageType type;
  uint64_t payload_bytes;
};

// Framing checks, before anything of the payload is read: magic, version, known type, and a
// payload length that fits the type. The message says what was wrong, for the reject reason.
Result<Header> decode_header(const uint8_t* bytes) {
  if (load_le<uint32_t>(bytes) != bootstrap_wire::kMagic) {
    return Status::invalid_argument("bad framing: wrong magic (not a loom bootstrap peer)");
  }
  auto version = load_le<uint16_t>(bytes + 4);
  if (version != bootstrap_wire::kVersion) {
    return Status::invalid_argument("protocol version " + std::to_string(version) + " (this build speaks " +
                                    std::to_string(bootstrap_wire::kVersion) + ")");
  }
  auto raw_type = load_le<uint16_t>(bytes + 6);
  auto type = static_cast<MessageType>(raw_type);
  auto payload = load_le<uint64_t>(bytes + 8);
  std::optional<size_t> body = body_bytes(type);
  if (!body) return Status::invalid_argument("bad framing: unknown message type " + std::to_string(raw_type));
  bool fits = carries_bulk(type) ? payload >= *body && payload - *body <= kMaxStepBytes : payload == *body;
  if (!fits) {
    return Status::invalid_argument("bad framing: message type " + std::to_string(raw_type) + " with a " +
                                    std::to_string(payload) + "-byte payload");
  }
  return Header{type, payload};
}

Result<Header> recv_header(Socket& socket, Deadline deadline, int cancel_fd = -1) {
  std::array<uint8_t, kHeaderBytes> bytes{};
  LOOM_TRY(socket.recv_all(bytes.data(), bytes.size(), deadline, cancel_fd));
  return decode_header(bytes.data());
}

Status send_message(Socket& socket, MessageType type, std::span<const uint8_t> body, Deadline deadline,
                    std::span<const uint8_t> bulk = {}) {
  std::array<uint8_t, kHeaderBytes + kFailureBodyBytes> head{};  // the largest fixed body
  auto header = bootstrap_wire::encode_header(type, body.size() + bulk.size());
  std::memcpy(head.data(), header.data(), kHeaderBytes);
  std::memcpy(head.data() + kHeaderBytes, body.data(), body.size());
  LOOM_TRY(socket.send_all(head.data(), kHeaderBytes + body.size(), deadline));
  return bulk.empty() ? Status{} : socket.send_all(bulk.data(), bulk.size(), deadline);
}

void store_text(uint8_t* at, std::string_view text) {
  size_t n = std::min(text.size(), kTextBytes - 1);
  std::memcpy(at, text.data(), n);
  std::memset(at + n, 0, kTextBytes - n);
}

// Text from a peer is printed, so anything but printable ASCII becomes '?'.
std::string load_text(const uint8_t* at) {
  std::string text;
  for (size_t i = 0; i < kTextBytes && at[i] != 0; ++i) {
    text += std::isprint(at[i]) ? static_cast<char>(at[i]) : '?';
  }
  return text;
}

// ---- authentication ----------------------------------------------------------------------------

// Distinct domains for the two directions, so a proof can never be reflected back as the other.
constexpr std::string_view kClientProofDomain = "loom bootstrap v1: client proof";
constexpr std::string_view kRootProofDomain = "loom bootstrap v1: rank 0 proof";
constexpr size_t kMaxDomainBytes = 64;
static_assert(kClientProofDomain.size() <= kMaxDomainBytes && kRootProofDomain.size() <= kMaxDomainBytes,
              "a proof domain must fit the HMAC input buffer");

Status fill_random(std::span<uint8_t> out) {
  if (RAND_bytes(out.data(), static_cast<int>(out.size())) != 1) {
    return Status::system_error("RAND_bytes failed: no randomness for bootstrap nonces and secrets");
  }
  return {};
}

// HMAC-SHA256(secret, domain || nonce || rank || world_size); domain is one of the two above.
Result<Proof> make_proof(const Secret& secret, std::string_view domain, const Nonce& nonce, uint32_t rank,
                         uint32_t world_size) {
  std::array<uint8_t, kMaxDomainBytes + kNonceBytes + 8> message{};
  std::memcpy(message.data(), domain.data(), domain.size());
  size_t length = domain.size();
  std::memcpy(message.data() + length, nonce.data(), nonce.size());
  length += nonce.size();
  store_le(message.data() + length, rank);
  store_le(message.data() + length + 4, world_size);
  length += 8;
  Proof proof{};
  unsigned int proof_length = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), message.data(), length, proof.data(),
           &proof_length) == nullptr ||
      proof_length != proof.size()) {
    return Status::internal("HMAC-SHA256 failed");
  }
  return proof;
}

bool same_proof(const Proof& a, const Proof& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

Result<std::array<uint8_t, 32>> sha256(std::string_view data) {
  std::array<uint8_t, 32> digest{};
  unsigned int length = 0;
  if (EVP_Digest(data.data(), data.size(), digest.data(), &length, EVP_sha256(), nullptr) != 1 ||
      length != digest.size()) {
    return Status::internal("SHA-256 failed");
  }
  return digest;
}

struct Hello {
  uint32_t rank = 0;
  uint32_t world_size = 0;
  Nonce nonce{};
  Proof proof{};
};

std::array<uint8_t, bootstrap_wire::kHelloBodyBytes> encode_hello(const Hello& hello) {
  std::array<uint8_t, bootstrap_wire::kHelloBodyBytes> body{};
  store_le(body.data(), hello.rank);
  store_le(body.data() + 4, hello.world_size);
  std::memcpy(body.data() + 8, hello.nonce.data(), kNonceBytes);
  std::memcpy(body.data() + 8 + kNonceBytes, hello.proof.data(), hello.proof.size());
  return body;
}

Hello decode_hello(const uint8_t* body) {
  Hello hello;
  hello.rank = load_le<uint32_t>(body);
  hello.world_size = load_le<uint32_t>(body + 4);
  std::memcpy(hello.nonce.data(), body + 8, kNonceBytes);
  std::memcpy(hello.proof.data(), body + 8 + kNonceBytes, hello.proof.size());
  return hello;
}

// ---- failures ----------------------------------------------------------------------------------

// What a failure notice says happened.
enum class NoticeKind : uint32_t {
  kVerdict = 0,      // rank 0's verdict on a step (a timeout, a rank that vanished, a mismatch)
  kReport = 1,       // the origin rank reported a failure of its own (report_failure_as)
  kStepTimeout = 2,  // a client's step deadline passed: it stopped waiting for rank 0
  kInitFailure = 3,  // the origin rank could not start (announce_failure)
};

// A failure as it travels: who failed (origin rank, or -1 for a verdict of rank 0's such as a
// timeout) and why. Every rank turns it into the same Status.
struct Notice {
  StatusCode code = StatusCode::kPeerFailure;
  int32_t origin = -1;
  std::string text;
  NoticeKind kind = NoticeKind::kVerdict;

  Status to_status() const {
    return Status(code, origin >= 0 ? "rank " + std::to_string(origin) + ": " + text : text);
  }
};

// The code the other ranks return for a failure this rank reports: a timeout and a cross-rank
// mismatch (invalid_argument) stay what they are; anything else is, for them, a peer's failure.
StatusCode reported_code(StatusCode code) {
  return code == StatusCode::kTimeout || code == StatusCode::kInvalidArgument ? code : StatusCode::kPeerFailure;
}

std::array<uint8_t, kFailureBodyBytes> encode_notice(const Notice& notice) {
  std::array<uint8_t, kFailureBodyBytes> body{};
  store_le(body.data(), static_cast<uint32_t>(notice.code));
  store_le(body.data() + 4, notice.origin);
  store_le(body.data() + 8, static_cast<uint32_t>(notice.kind));
  store_text(body.data() + 16, notice.text);
  return body;
}

Notice decode_notice(const uint8_t* body, int world_size) {
  Notice notice;
  auto code = load_le<uint32_t>(body);
  bool known_failure = code > static_cast<uint32_t>(StatusCode::kOk) &&
                       code <= static_cast<uint32_t>(StatusCode::kInternal);
  notice.code = known_failure ? static_cast<StatusCode>(code) : StatusCode::kPeerFailure;
  notice.origin = load_le<int32_t>(body + 4);
  if (notice.origin < -1 || notice.origin >= world_size) notice.origin = -1;
  auto kind = load_le<uint32_t>(body + 8);
  notice.kind = kind <= static_cast<uint32_t>(NoticeKind::kInitFailure) ? static_cast<NoticeKind>(kind)
                                                                         : NoticeKind::kVerdict;
  notice.text = load_text(body + 16);
  return notice;
}

// Long lists are cut with a count of the rest.
std::string format_ranks(const std::vector<int>& sorted_ranks) { return format_rank_list(sorted_ranks, 160); }

std::string ms_text(milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

// ---- collective steps --------------------------------------------------------------------------

enum class StepKind : uint32_t { kAllGather = 1, kBroadcast = 2, kBarrier = 3 };

struct Step {
  StepKind kind = StepKind::kBarrier;
  int32_t root = 0;     // broadcast source
  uint64_t bytes = 0;   // all_gather: per rank; broadcast: in total
  uint64_t sequence = 0;

  uint64_t contribution_bytes(int rank) const {
    if (kind == StepKind::kAllGather) return bytes;
    if (kind == StepKind::kBroadcast && rank == root) return bytes;
    return 0;
  }
  uint64_t result_bytes(int world_size) const {
    if (kind == StepKind::kAllGather) return bytes * static_cast<uint64_t>(world_size);
    return kind == StepKind::kBroadcast ? bytes : 0;
  }
  bool operator==(const Step&) const = default;

  std::string describe() const {
    std::string seq = " #" + std::to_string(sequence);
    if (kind == StepKind::kAllGather) return "all_gather" + seq + " (" + std::to_string(bytes) + " bytes per rank)";
    if (kind == StepKind::kBroadcast) {
      return "broadcast" + seq + " (" + std::to_string(bytes) + " bytes from rank " + std::to_string(root) + ")";
    }
    return "barrier" + seq;
  }
};

std::array<uint8_t, kStepBodyBytes> encode_step(const Step& step) {
  std::array<uint8_t, kStepBodyBytes> body{};
  store_le(body.data(), step.sequence);
  store_le(body.data() + 8, static_cast<uint32_t>(step.kind));
  store_le(body.data() + 12, step.root);
  store_le(body.data() + 16, step.bytes);
  return body;
}

Result<Step> decode_step(const uint8_t* body) {
  Step step;
  step.sequence = load_le<uint64_t>(body);
  auto kind = load_le<uint32_t>(body + 8);
  if (kind < static_cast<uint32_t>(StepKind::kAllGather) || kind > static_cast<uint32_t>(StepKind::kBarrier)) {
    return Status::invalid_argument("unknown step kind " + std::to_string(kind));
  }
  step.kind = static_cast<StepKind>(kind);
  step.root = load_le<int32_t>(body + 12);
  step.bytes = load_le<uint64_t>(body + 16);
  return step;
}

// Signalled by report_failure() to end the waits of a step running on another thread
// (Communicator::abort may report while a barrier is in progress).
Result<UniqueFd> make_cancel_event() {
  UniqueFd event(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!event.valid()) return Status::errno_error("bootstrap: eventfd", errno);
  return event;
}

// Shared by every Bootstrap: argument checks, step numbering, the sticky failure, what lets
// report_failure() run on another thread while a step is in progress, and the watch.
class StepBootstrap : public Bootstrap {
 public:
  StepBootstrap(int rank, int world_size, milliseconds timeout, UniqueFd cancel_event, UniqueFd wake_event)
      : rank_(rank), world_size_(world_size), timeout_(timeout), cancel_event_(std::move(cancel_event)),
        wake_event_(std::move(wake_event)) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  Status all_gather(const void* mine, void* all, size_t bytes_per_rank) override {
    if (bytes_per_rank > 0 && (mine == nullptr || all == nullptr)) {
      return Status::invalid_argument("bootstrap all_gather: null buffer for " + std::to_string(bytes_per_rank) +
                                      " bytes per rank");
    }
    if (bytes_per_rank > kMaxStepBytes / static_cast<uint64_t>(world_size_)) {
      return Status::invalid_argument("bootstrap all_gather: " + std::to_string(bytes_per_rank) + " bytes x " +
                                      std::to_string(world_size_) + " ranks exceeds the 1 GiB a step carries");
    }
    return step(Step{StepKind::kAllGather, 0, bytes_per_rank}, mine, all);
  }

  Status broadcast(void* data, size_t bytes, int root) override {
    if (root < 0 || root >= world_size_) {
      return Status::invalid_argument("bootstrap broadcast: root " + std::to_string(root) + " is outside [0, " +
                                      std::to_string(world_size_) + ")");
    }
    if (bytes > 0 && data == nullptr) return Status::invalid_argument("bootstrap broadcast: null buffer");
    if (bytes > kMaxStepBytes) {
      return Status::invalid_argument("bootstrap broadcast: " + std::to_string(bytes) +
                                      " bytes exceeds the 1 GiB a step carries");
    }
    return step(Step{StepKind::kBroadcast, root, bytes}, data, data);
  }

  Status barrier() override { return step(Step{StepKind::kBarrier, 0, 0}, nullptr, nullptr); }

  void report_failure(std::string_view message) override { report_failure_as(StatusCode::kPeerFailure, message); }

  Status watch(milliseconds max_wait) override {
    const Deadline deadline = Clock::now() + max_wait;
    std::vector<pollfd> fds;
    while (true) {
      {
        // Messages are read only under the receive lock, which a step holds while it runs.
        std::unique_lock<std::mutex> receiving(recv_mutex_, std::try_to_lock);
        if (receiving.owns_lock()) {
          watched_fds(fds);
          if (::poll(fds.data(), fds.size(), 0) > 0) {
            if (fds.back().revents != 0) return woken();
            read_watched(fds);
            return failure();
          }
        }
      }
      if (Clock::now() >= deadline) return failure();
      // Wait for something to read without the lock: a step may start meanwhile and take it.
      watched_fds(fds);
      const int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms(deadline));
      if (ready > 0 && fds.back().revents != 0) return woken();
      if (ready == 0) return failure();
      if (ready < 0 && errno != EINTR) return failure();
      // Something arrived: take the lock and read it, unless a step is reading it already.
      if (recv_mutex_.try_lock()) {
        recv_mutex_.unlock();
      } else {
        std::this_thread::sleep_for(std::min<Clock::duration>(milliseconds(2), deadline - Clock::now()));
      }
    }
  }

  void wake_watch() override {
    uint64_t one = 1;
    if (wake_event_.valid()) (void)!::write(wake_event_.get(), &one, sizeof(one));
  }

  std::vector<Status> peer_notices() const override {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    return notices_;
  }

 protected:
  // Runs one numbered step. `contribution` holds contribution_bytes(rank) bytes, `result`
  // receives result_bytes(world) bytes (for broadcast they are the same buffer).
  virtual Status run_step(const Step& step, const void* contribution, void* result) = 0;
  // The connections watch() polls, with their events; the wake-up event is appended after them.
  virtual void add_watched(std::vector<pollfd>& fds) = 0;
  // Reads what the last poll of add_watched()'s connections found (under the receive lock).
  virtual void read_watched(const std::vector<pollfd>& fds) = 0;

  // Keeps the first failure (later steps report it) and returns `failure`. Any thread.
  Status record(Status failure) {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (failure_.ok()) failure_ = failure;
    return failure;
  }
  // Keeps a failure another rank sent (peer_notices) and records it as this rank's failure.
  Status record_notice(const Status& notice) {
    {
      std::lock_guard<std::mutex> lock(failure_mutex_);
      if (notices_.size() < kMaxKeptNotices) notices_.push_back(notice);
    }
    return record(notice);
  }
  Status failure() const {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    return failure_;
  }

  // For report_failure(): records this rank's failure and ends the waits of a running step.
  void fail_locally(std::string_view message) {
    (void)record(Status::aborted("rank " + std::to_string(rank_) + " reported a failure: " + std::string(message)));
    uint64_t one = 1;
    if (cancel_event_.valid()) (void)!::write(cancel_event_.get(), &one, sizeof(one));
  }
  int cancel_fd() const { return cancel_event_.get(); }
  // What a step whose wait was cancelled returns: the failure this rank reported.
  Status cancelled(const std::string& context) {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    return Status(failure_).with_context(context);
  }
  // Steps completed so far (rank 0's watch leaves a client's early step message for the step).
  uint64_t steps_done() const { return steps_done_.load(std::memory_order_acquire); }

  const int rank_;
  const int world_size_;
  const milliseconds timeout_;
  // Held while one message is written, so a report from another thread never lands inside a
  // step's message. A report waits for it at most kNoticeTimeout.
  std::timed_mutex send_mutex_;

 private:
  Status step(Step step, const void* contribution, void* result) {
    std::lock_guard<std::mutex> receiving(recv_mutex_);
    step.sequence = ++sequence_;
    {
      std::lock_guard<std::mutex> lock(failure_mutex_);
      if (!failure_.ok()) {
        return Status::aborted("bootstrap " + step.describe() + ": an earlier bootstrap step failed (" +
                               failure_.to_string() + ")");
      }
    }
    Status status = run_step(step, contribution, result);
    steps_done_.fetch_add(1, std::memory_order_acq_rel);
    return status;
  }

  void watched_fds(std::vector<pollfd>& fds) {
    fds.clear();
    add_watched(fds);
    fds.push_back({wake_event_.get(), POLLIN, 0});
  }
  Status woken() {
    uint64_t value = 0;
    (void)!::read(wake_event_.get(), &value, sizeof(value));
    return failure();
  }

  uint64_t sequence_ = 0;
  std::atomic<uint64_t> steps_done_{0};
  std::mutex recv_mutex_;  // a running step, or watch() reading a message
  mutable std::mutex failure_mutex_;
  Status failure_;
  std::vector<Status> notices_;
  UniqueFd cancel_event_;
  UniqueFd wake_event_;
};

class SingleRankBootstrap final : public StepBootstrap {
 public:
  SingleRankBootstrap(milliseconds timeout, UniqueFd wake_event)
      : StepBootstrap(0, 1, timeout, UniqueFd(), std::move(wake_event)) {}
  void report_failure_as(StatusCode, std::string_view message) override { fail_locally(message); }

 protected:
  Status run_step(const Step& step, const void* contribution, void* result) override {
    if (step.kind == StepKind::kAllGather && step.bytes > 0) std::memmove(result, contribution, step.bytes);
    return {};
  }
  void add_watched(std::vector<pollfd>&) override {}
  void read_watched(const std::vector<pollfd>&) override {}
};

// ---- rank 0 ------------------------------------------------------------------------------------

// The unauthenticated connections rank 0 may hold: kMaxHandshakes, or fewer so that they, the
// joined ranks and a reserve for the rest of the process fit the soft descriptor limit.
size_t handshake_cap(int world_size) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return kMaxHandshakes;
  size_t open = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (::readdir(dir) != nullptr) ++open;
    ::closedir(dir);
  }
  constexpr size_t kReserve = 32;  // the process's own later files and sockets
  const size_t used = open + static_cast<size_t>(world_size) + kReserve;
  const size_t room = limit.rlim_cur > used ? static_cast<size_t>(limit.rlim_cur) - used : 0;
  return std::clamp<size_t>(room, 4, kMaxHandshakes);
}

// Warnings about connections rank 0 refuses or drops, at most kWarningBurst at once and then one
// per kWarningInterval: a flood must not flood the log too.
class WarningLimiter {
 public:
  // Whether to log now; `held_back` is how many were suppressed since the last one logged.
  bool allow(uint64_t& held_back) {
    const Deadline now = Clock::now();
    if (now >= window_end_) {
      window_end_ = now + kWarningInterval;
      left_ = kWarningBurst;
    }
    if (left_ == 0) {
      ++suppressed_;
      return false;
    }
    --left_;
    held_back = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  Deadline window_end_{};
  int left_ = 0;
  uint64_t suppressed_ = 0;
};

std::string held_back_text(uint64_t held_back) {
  return held_back == 0 ? std::string() : " (" + std::to_string(held_back) + " similar messages held back)";
}

// Rank 0's admission loop: accepts and authenticates connections until every rank has joined or
// the deadline passes. Handshakes run side by side on non-blocking sockets, so a silent or
// hostile client cannot hold up the real ranks.
//
// When a rank cannot start (announce_failure: rank 0 itself, or a client that joins only to say
// so), the job is over: admission goes on only to tell every other rank — the joined ones at
// once, each later one right after its handshake — until all know or min(deadline, failure +
// kAnnounceLimit) passes, and run() returns that failure.
class RootAdmission {
 public:
  RootAdmission(Listener& listener, const BootstrapConfig& config, Deadline deadline)
      : listener_(listener), config_(config), deadline_(deadline), joined_(config.world_size),
        max_handshakes_(handshake_cap(config.world_size)), informed_(config.world_size, false) {}

  // Rank 0 itself cannot start: every rank that connects is told `failure`.
  void fail_job(const Notice& failure);

  // The joined ranks' sockets, indexed by rank ([0] is empty).
  Result<std::vector<std::optional<Socket>>> run();

 private:
  struct Handshake {
    Socket socket;
    Nonce challenge{};
    Deadline deadline{};
    std::array<uint8_t, kHeaderBytes + bootstrap_wire::kHelloBodyBytes> received{};
    size_t received_bytes = 0;
    bool finished = false;
  };

  Status accept_pending();
  // accept() found no descriptor or buffer: drop the oldest handshake if there is one, else pause.
  void out_of_resources(int error);
  template <class... Args>
  void warn(const char* format, Args... args);
  void advance(Handshake& handshake);
  void reject(Handshake& handshake, const std::string& reason);
  void serve_joined(int rank);
  std::string missing_ranks() const;
  // The ranks not yet told about the failure (failure mode), as text; "" when all know.
  std::string uninformed_ranks() const;
  void inform(Socket& socket, int rank);

  Listener& listener_;
  const BootstrapConfig& config_;
  const Deadline deadline_;
  std::vector<Handshake> handshakes_;
  std::vector<std::optional<Socket>> joined_;
  int joined_count_ = 0;
  const size_t max_handshakes_;
  Deadline accept_paused_until_{};      // no accept() before this (see out_of_resources)
  milliseconds accept_pause_{0};
  WarningLimiter warnings_;
  // A joined rank asked who is missing: its own deadline passed and it is leaving, so the job
  // cannot complete and every rank should hear the verdict now.
  bool rank_gave_up_ = false;
  // Failure mode: the notice every rank is told, which ranks know it, and until when to go on.
  std::optional<Notice> failure_;
  std::vector<bool> informed_;
  Deadline linger_until_{};
};

void RootAdmission::fail_job(const Notice& failure) {
  if (failure_) return;
  failure_ = failure;
  linger_until_ = std::min(deadline_, Clock::now() + Bootstrap::kAnnounceLimit);
  informed_[0] = true;
  if (failure.origin > 0) informed_[failure.origin] = true;
  for (int r = 1; r < config_.world_size; ++r) {
    if (joined_[r]) {
      inform(*joined_[r], r);
      joined_[r].reset();
      --joined_count_;
    }
  }
}

void RootAdmission::inform(Socket& socket, int rank) {
  (void)send_message(socket, MessageType::kFailure, encode_notice(*failure_), Clock::now() + kNoticeTimeout);
  informed_[rank] = true;
}

std::string RootAdmission::uninformed_ranks() const {
  std::vector<int> left;
  for (int r = 1; r < config_.world_size; ++r) {
    if (!informed_[r]) left.push_back(r);
  }
  return format_ranks(left);
}

std::string RootAdmission::missing_ranks() const {
  std::vector<int> missing;
  for (int r = 1; r < config_.world_size; ++r) {
    if (!joined_[r]) missing.push_back(r);
  }
  return format_ranks(missing);
}

Result<std::vector<std::optional<Socket>>> RootAdmission::run() {
  std::vector<pollfd> fds;
  std::vector<int> polled_ranks;
  while (failure_ || joined_count_ < config_.world_size - 1) {
    Deadline now = Clock::now();
    if (failure_) {
      const std::string left = uninformed_ranks();
      if (left.empty() || now >= linger_until_) {
        Status failed = failure_->to_status().with_context("bootstrap");
        if (!left.empty()) failed.with_context("rank(s) " + left + " not told (they did not connect in time)");
        return failed;
      }
    } else if (now >= deadline_ || rank_gave_up_) {
      std::string missing = missing_ranks();
      std::array<uint8_t, kMissingBodyBytes> body{};
      store_text(body.data(), missing);
      for (std::optional<Socket>& peer : joined_) {
        if (peer) (void)send_message(*peer, MessageType::kMissing, body, now);
      }
      return Status::timeout("bootstrap: rank(s) " + missing + " did not connect to " + listener_.address() +
                             " within " + ms_text(config_.timeout));
    }
    Deadline wake = failure_ ? linger_until_ : deadline_;
    for (Handshake& h : handshakes_) {
      if (now >= h.deadline) {
        warn("bootstrap: %s did not complete the handshake within %lld ms; dropped", h.socket.peer().c_str(),
             static_cast<long long>(kHandshakeTimeout.count()));
        h.finished = true;
      }
      wake = std::min(wake, h.deadline);
    }
    const bool accepting = now >= accept_paused_until_;
    if (!accepting) wake = std::min(wake, accept_paused_until_);
    std::erase_if(handshakes_, [](const Handshake& h) { return h.finished; });

    fds.clear();
    polled_ranks.clear();
    fds.push_back({listener_.fd(), static_cast<short>(accepting ? POLLIN : 0), 0});
    for (int r = 1; r < config_.world_size; ++r) {
      if (joined_[r]) {
        fds.push_back({joined_[r]->fd(), POLLIN, 0});
        polled_ranks.push_back(r);
      }
    }
    for (Handshake& h : handshakes_) fds.push_back({h.socket.fd(), POLLIN, 0});
    int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms(wake));
    if (ready < 0 && errno != EINTR) return Status::errno_error("bootstrap: poll", errno);
    if (ready <= 0) continue;

    // Joined ranks first: a rank that left frees its slot before a hello claiming it is judged.
    size_t index = 1;
    for (int r : polled_ranks) {
      if (fds[index++].revents != 0) serve_joined(r);
    }
    for (Handshake& h : handshakes_) {
      if (fds[index++].revents != 0) advance(h);
    }
    std::erase_if(handshakes_, [](const Handshake& h) { return h.finished; });
    // Last: accepting appends to handshakes_, which the loops above index into.
    if (fds[0].revents != 0) LOOM_TRY_CTX(accept_pending(), "bootstrap");
  }
  return std::move(joined_);
}

template <class... Args>
void RootAdmission::warn(const char* format, Args... args) {
  uint64_t held_back = 0;
  if (!warnings_.allow(held_back)) return;
  char text[512];
  std::snprintf(text, sizeof(text), format, args...);
  LOOM_WARN("%s%s", text, held_back_text(held_back).c_str());
}

void RootAdmission::out_of_resources(int error) {
  if (!handshakes_.empty()) {
    // Unauthenticated connections are the ones to sacrifice: the real ranks retry until the deadline.
    warn("bootstrap: accept on %s: %s; dropping the oldest unauthenticated connection (%s)", listener_.address().c_str(),
         std::strerror(error), handshakes_.front().socket.peer().c_str());
    handshakes_.erase(handshakes_.begin());
    return;
  }
  accept_pause_ = std::clamp(accept_pause_ * 2, kAcceptPauseMin, kAcceptPauseMax);
  accept_paused_until_ = Clock::now() + accept_pause_;
  warn("bootstrap: accept on %s: %s; not accepting for %lld ms", listener_.address().c_str(), std::strerror(error),
       static_cast<long long>(accept_pause_.count()));
}

Status RootAdmission::accept_pending() {
  // Bounded per wake-up so a connection flood cannot starve the handshakes already running.
  for (int accepted = 0; accepted < 64; ++accepted) {
    int transient = 0;
    LOOM_ASSIGN_OR_RETURN(std::optional<Socket> socket, listener_.try_accept(&transient));
    if (!socket) {
      if (transient == EMFILE || transient == ENFILE || transient == ENOBUFS || transient == ENOMEM) {
        out_of_resources(transient);
        if (Clock::now() < accept_paused_until_) return {};
        continue;  // a descriptor was freed: the pending connection may fit now
      }
      if (transient != 0) continue;  // that connection's own error; the next one may be fine
      return {};
    }
    accept_pause_ = milliseconds{0};
    if (handshakes_.size() >= max_handshakes_) {
      warn("bootstrap: more than %zu unauthenticated connections; dropping the oldest (%s)", max_handshakes_,
           handshakes_.front().socket.peer().c_str());
      handshakes_.erase(handshakes_.begin());
    }
    Handshake handshake{std::move(*socket)};
    LOOM_TRY(fill_random(handshake.challenge));
    handshake.deadline = std::min(deadline_, Clock::now() + kHandshakeTimeout);
    // The challenge fits any fresh socket's send buffer: no waiting.
    Status sent = send_message(handshake.socket, MessageType::kChallenge, handshake.challenge, Clock::now());
    if (!sent.ok()) {
      LOOM_INFO("bootstrap: %s left before the challenge: %s", handshake.socket.peer().c_str(), sent.message().c_str());
      continue;
    }
    handshakes_.push_back(std::move(handshake));
  }
  return {};
}

void RootAdmission::reject(Handshake& handshake, const std::string& reason) {
  warn("bootstrap: rejected %s: %s", handshake.socket.peer().c_str(), reason.c_str());
  auto body = encode_notice(Notice{StatusCode::kInvalidArgument, 0, reason});
  (void)send_message(handshake.socket, MessageType::kFailure, body, Clock::now());
  handshake.finished = true;
}

void RootAdmission::advance(Handshake& h) {
  Result<size_t> received =
      h.socket.recv_some(h.received.data() + h.received_bytes, h.received.size() - h.received_bytes);
  if (!received.ok()) {
    // Port scanners and health checks connect and leave; that is not worth a warning.
    LOOM_INFO("bootstrap: %s left before authenticating: %s", h.socket.peer().c_str(),
              received.status().message().c_str());
    h.finished = true;
    return;
  }
  size_t before = h.received_bytes;
  h.received_bytes += *received;
  if (before < kHeaderBytes && h.received_bytes >= kHeaderBytes) {
    Result<Header> header = decode_header(h.received.data());
    if (!header.ok()) return reject(h, header.status().message());
    if (header->type != MessageType::kHello) {
      return reject(h, "bad framing: expected a hello, got message type " +
                           std::to_string(static_cast<unsigned>(header->type)));
    }
  }
  if (h.received_bytes < h.received.size()) return;

  Hello hello = decode_hello(h.received.data() + kHeaderBytes);
  Result<Proof> expected = make_proof(config_.secret, kClientProofDomain, h.challenge, hello.rank, hello.world_size);
  if (!expected.ok()) return reject(h, expected.status().message());
  if (!same_proof(hello.proof, *expected)) return reject(h, "authentication failed (wrong LOOM_SECRET?)");
  auto world_size = static_cast<uint32_t>(config_.world_size);
  if (hello.world_size != world_size) {
    return reject(h, "world size " + std::to_string(hello.world_size) + " does not match rank 0's " +
                         std::to_string(world_size));
  }
  if (hello.rank == 0 || hello.rank >= world_size) {
    return reject(h, "rank " + std::to_string(hello.rank) + " is outside [1, " + std::to_string(world_size - 1) + "]");
  }
  int rank = static_cast<int>(hello.rank);
  if (joined_[rank]) {
    return reject(h, "rank " + std::to_string(rank) + " is already connected from " + joined_[rank]->peer());
  }
  Result<Proof> answer = make_proof(config_.secret, kRootProofDomain, hello.nonce, hello.rank, hello.world_size);
  if (!answer.ok()) return reject(h, answer.status().message());
  Status sent = send_message(h.socket, MessageType::kWelcome, *answer, Clock::now());
  h.finished = true;
  if (!sent.ok()) {
    LOOM_INFO("bootstrap: rank %d (%s) left during the handshake", rank, h.socket.peer().c_str());
    return;
  }
  if (failure_) {  // the job cannot start: this rank only learns why
    inform(h.socket, rank);
    return;
  }
  LOOM_DEBUG("bootstrap: rank %d joined from %s", rank, h.socket.peer().c_str());
  joined_[rank] = std::move(h.socket);
  ++joined_count_;
}

void RootAdmission::serve_joined(int rank) {
  Socket& peer = *joined_[rank];
  const Deadline deadline = std::min(deadline_, Clock::now() + kNoticeTimeout);
  Result<Header> header = recv_header(peer, deadline);
  if (header.ok() && header->type == MessageType::kQuery) {
    rank_gave_up_ = true;  // run() answers it, and everyone else, with the missing ranks
    return;
  }
  if (header.ok() && header->type == MessageType::kFailure) {
    // A rank that cannot start joined to say so (announce_failure).
    std::array<uint8_t, kFailureBodyBytes> body{};
    if (peer.recv_all(body.data(), body.size(), deadline).ok()) {
      const Notice said = decode_notice(body.data(), config_.world_size);
      LOOM_WARN("bootstrap: rank %d cannot start: %s", rank, said.text.c_str());
      joined_[rank].reset();
      --joined_count_;
      fail_job(Notice{StatusCode::kPeerFailure, rank, said.text, NoticeKind::kInitFailure});
      return;
    }
  }
  // A rank that crashed frees its slot: a restarted process may take it again.
  if (!header.ok() && header.status().code() == StatusCode::kPeerFailure) {
    LOOM_INFO("bootstrap: rank %d (%s) left before every rank joined", rank, peer.peer().c_str());
  } else {
    LOOM_WARN("bootstrap: rank %d (%s) sent an unexpected message during init; dropped", rank, peer.peer().c_str());
  }
  joined_[rank].reset();
  --joined_count_;
}

class RootBootstrap final : public StepBootstrap {
 public:
  RootBootstrap(const BootstrapConfig& config, std::vector<std::optional<Socket>> peers, UniqueFd cancel_event,
                UniqueFd wake_event)
      : StepBootstrap(0, config.world_size, config.timeout, std::move(cancel_event), std::move(wake_event)),
        peers_(std::move(peers)), lost_(static_cast<size_t>(config.world_size)),
        step_pending_since_(config.world_size, ~uint64_t{0}) {}

  // Tells every rank that all have joined; a rank lost right now fails the job for everyone.
  Status announce_ready() {
    Deadline deadline = Clock::now() + std::min(timeout_, kNoticeTimeout);
    for (int r = 1; r < world_size_; ++r) {
      Status sent = send_message(*peers_[r], MessageType::kReady, {}, deadline);
      if (!sent.ok()) return fail_everyone(lost_peer(r), "bootstrap", deadline);
    }
    return {};
  }

  void report_failure_as(StatusCode code, std::string_view message) override {
    fail_locally(message);
    Deadline deadline = Clock::now() + std::min(timeout_, kNoticeTimeout);
    (void)fail_everyone(Notice{reported_code(code), 0, std::string(message), NoticeKind::kReport}, "bootstrap", deadline);
  }

 protected:
  Status run_step(const Step& step, const void* contribution, void* result) override;
  void add_watched(std::vector<pollfd>& fds) override;
  void read_watched(const std::vector<pollfd>& fds) override;

 private:
  static Notice lost_peer(int rank) {
    return Notice{StatusCode::kPeerFailure, rank, "disconnected (process exited or crashed?)"};
  }
  // Between steps: `rank`'s connection closed, or it sent what no step asked for.
  void peer_gone(int rank, const Notice& notice) {
    lost_[rank] = true;
    (void)fail_everyone(notice, "", Clock::now() + kNoticeTimeout);
  }
  // Reads one message from `rank` during a step: its contribution (returns true), a stale
  // query (false), or a failure, which ends the step for everyone.
  Result<bool> receive_from(int rank, const std::vector<bool>& arrived, const Step& step, uint8_t* result,
                            Deadline deadline, const std::string& context);
  std::string absent_ranks(const std::vector<bool>& arrived) const {
    std::vector<int> absent;
    for (int r = 1; r < world_size_; ++r) {
      if (!arrived[r]) absent.push_back(r);
    }
    return format_ranks(absent);
  }
  // What rank 0 makes of a failed receive from `rank`.
  Notice receive_failure(int rank, const Status& status) const;
  // Sends the notice to every rank but its origin, and fails this rank with it.
  Status fail_everyone(const Notice& notice, const std::string& context, Deadline deadline);
  // A receive in a step failed: a cancelled wait ends the step quietly (the report that
  // cancelled it has told everyone); anything else fails the job for everyone.
  Status receive_failed(int rank, const Status& status, const std::string& context, Deadline deadline) {
    if (status.code() == StatusCode::kAborted) return cancelled(context);
    return fail_everyone(receive_failure(rank, status), context, deadline);
  }

  std::vector<std::optional<Socket>> peers_;  // by rank; [0] is empty
  // Watch state (under the receive lock): connections that closed, and for each rank the step
  // count when its next step message arrived early (left in the socket for that step; ~0: none).
  std::vector<std::atomic<bool>> lost_;  // read by reports from any thread
  std::vector<uint64_t> step_pending_since_;
  std::vector<int> watched_ranks_;  // add_watched()'s order
};

Status RootBootstrap::fail_everyone(const Notice& notice, const std::string& context, Deadline deadline) {
  auto body = encode_notice(notice);
  std::unique_lock<std::timed_mutex> lock(send_mutex_, std::defer_lock);
  if (lock.try_lock_for(kNoticeTimeout)) {
    for (int r = 1; r < world_size_; ++r) {
      if (r != notice.origin && !lost_[r]) (void)send_message(*peers_[r], MessageType::kFailure, body, deadline);
    }
  }
  Status status = notice.to_status();
  if (!context.empty()) status.with_context(context);
  return notice.origin > 0 ? record_notice(status) : record(status);
}

void RootBootstrap::add_watched(std::vector<pollfd>& fds) {
  watched_ranks_.clear();
  const uint64_t steps = steps_done();
  for (int r = 1; r < world_size_; ++r) {
    if (lost_[r]) continue;
    // A step message that came early stays for its step; only the connection's end is watched.
    const bool step_pending = step_pending_since_[r] == steps;
    fds.push_back({peers_[r]->fd(), static_cast<short>(step_pending ? POLLRDHUP : POLLIN | POLLRDHUP), 0});
    watched_ranks_.push_back(r);
  }
}

void RootBootstrap::read_watched(const std::vector<pollfd>& fds) {
  for (size_t i = 0; i < watched_ranks_.size(); ++i) {
    const int r = watched_ranks_[i];
    const short events = fds[i].revents;
    if (events == 0 || lost_[r]) continue;
    const bool closed = (events & (POLLHUP | POLLERR | POLLRDHUP)) != 0;
    if ((events & POLLIN) == 0) {
      if (closed) peer_gone(r, lost_peer(r));
      continue;
    }
    Socket& peer = *peers_[r];
    std::array<uint8_t, kHeaderBytes> head{};
    Result<size_t> seen = peer.peek(head.data(), head.size());
    if (!seen.ok()) {
      peer_gone(r, lost_peer(r));
      continue;
    }
    if (*seen < head.size()) {
      if (closed) peer_gone(r, lost_peer(r));
      continue;  // the rest of the header is on its way
    }
    Result<Header> header = decode_header(head.data());
    if (!header.ok()) {
      peer_gone(r, Notice{StatusCode::kPeerFailure, r, "sent a malformed message: " + header.status().message()});
      continue;
    }
    if (header->type == MessageType::kStep) {
      step_pending_since_[r] = steps_done();  // its next step, which this rank has not entered yet
      if (closed) peer_gone(r, lost_peer(r));
      continue;
    }
    const Deadline deadline = Clock::now() + kNoticeTimeout;
    std::array<uint8_t, kFailureBodyBytes> body{};
    Status received = peer.recv_all(head.data(), head.size(), deadline);
    if (received.ok()) received = peer.recv_all(body.data(), *body_bytes(header->type), deadline);
    if (!received.ok()) {
      peer_gone(r, lost_peer(r));
    } else if (header->type == MessageType::kFailure) {
      const Notice reported = decode_notice(body.data(), world_size_);
      (void)fail_everyone(Notice{reported_code(reported.code), r, reported.text, NoticeKind::kReport}, "", deadline);
    } else if (header->type != MessageType::kQuery) {  // a query is stale: its sender's init is over
      peer_gone(r, Notice{StatusCode::kPeerFailure, r,
                          "sent message type " + std::to_string(static_cast<unsigned>(header->type)) + " between steps"});
    }
  }
}

Notice RootBootstrap::receive_failure(int rank, const Status& status) const {
  switch (status.code()) {
    case StatusCode::kTimeout:
      return Notice{StatusCode::kTimeout, -1,
                    "rank " + std::to_string(rank) + " did not finish its message within " + ms_text(timeout_)};
    case StatusCode::kPeerFailure: return lost_peer(rank);
    case StatusCode::kInvalidArgument:
      return Notice{StatusCode::kPeerFailure, rank, "sent a malformed message: " + status.message()};
    default: return Notice{status.code(), -1, "receiving from rank " + std::to_string(rank) + ": " + status.message()};
  }
}

Status RootBootstrap::run_step(const Step& step, const void* contribution, void* result) {
  std::string context = "bootstrap " + step.describe();
  Deadline deadline = Clock::now() + timeout_;
  auto* out = static_cast<uint8_t*>(result);
  if (step.kind == StepKind::kAllGather && step.bytes > 0) std::memmove(out, contribution, step.bytes);

  // Every peer is watched, not only those still due: one that already contributed may report a
  // failure or die while the others are awaited.
  std::vector<bool> arrived(world_size_, false);
  int missing = world_size_ - 1;
  std::vector<pollfd> fds;
  while (missing > 0) {
    fds.clear();
    for (int r = 1; r < world_size_; ++r) fds.push_back({peers_[r]->fd(), POLLIN, 0});
    fds.push_back({cancel_fd(), POLLIN, 0});
    int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms(deadline));
    if (ready > 0 && fds.back().revents != 0) return cancelled(context);
    if (ready < 0 && errno != EINTR) {
      int err = errno;
      return fail_everyone(Notice{StatusCode::kSystemError, -1, std::string("rank 0: poll: ") + std::strerror(err)},
                           context, deadline);
    }
    if (ready <= 0) {
      if (Clock::now() < deadline) continue;
      return fail_everyone(Notice{StatusCode::kTimeout, -1,
                                  "rank(s) " + absent_ranks(arrived) + " did not arrive within " + ms_text(timeout_)},
                           context, deadline);
    }
    for (int r = 1; r < world_size_; ++r) {
      if (fds[r - 1].revents == 0) continue;
      LOOM_ASSIGN_OR_RETURN(bool contributed, receive_from(r, arrived, step, out, deadline, context));
      if (contributed) {
        arrived[r] = true;
        --missing;
      }
    }
  }

  auto body = encode_step(step);
  std::span<const uint8_t> bulk(out, step.result_bytes(world_size_));
  for (int r = 1; r < world_size_; ++r) {
    Status sent;
    {
      std::lock_guard<std::timed_mutex> lock(send_mutex_);
      sent = send_message(*peers_[r], MessageType::kResult, body, deadline, bulk);
    }
    if (!sent.ok()) return fail_everyone(receive_failure(r, sent), context, deadline);
  }
  return {};
}

Result<bool> RootBootstrap::receive_from(int rank, const std::vector<bool>& arrived, const Step& step,
                                         uint8_t* result, Deadline deadline, const std::string& context) {
  Socket& peer = *peers_[rank];
  Result<Header> header = recv_header(peer, deadline, cancel_fd());
  if (!header.ok()) return receive_failed(rank, header.status(), context, deadline);
  std::array<uint8_t, kFailureBodyBytes> body{};
  Status received = peer.recv_all(body.data(), *body_bytes(header->type), deadline, cancel_fd());
  if (!received.ok()) return receive_failed(rank, received, context, deadline);
  switch (header->type) {
    case MessageType::kQuery:
      // From a rank whose init deadline passed just as the ready message came; the answer is moot.
      return false;
    case MessageType::kFailure: {
      Notice reported = decode_notice(body.data(), world_size_);
      if (reported.kind == NoticeKind::kStepTimeout) {
        // Its deadline passed before rank 0's (it entered the step earlier): the news for
        // everyone is who had not arrived.
        std::string absent = absent_ranks(arrived);
        std::string text = "rank " + std::to_string(rank) + " stopped waiting after " + ms_text(timeout_);
        if (!absent.empty()) text += "; rank(s) " + absent + " had not arrived";
        return fail_everyone(Notice{StatusCode::kTimeout, -1, text}, context, deadline);
      }
      return fail_everyone(Notice{reported_code(reported.code), rank, reported.text, NoticeKind::kReport}, context,
                           deadline);
    }
    case MessageType::kStep: {
      Result<Step> theirs = decode_step(body.data());
      if (!theirs.ok() || arrived[rank]) {
        Status bad = theirs.ok() ? Status::invalid_argument("a second message for one step") : theirs.status();
        return fail_everyone(receive_failure(rank, bad), context, deadline);
      }
      if (!(*theirs == step)) {
        return fail_everyone(Notice{StatusCode::kInvalidArgument, -1,
                                    "rank " + std::to_string(rank) + " called " + theirs->describe() +
                                        " while rank 0 called " + step.describe()},
                             context, deadline);
      }
      uint64_t bytes = step.contribution_bytes(rank);
      if (header->payload_bytes != kStepBodyBytes + bytes) {
        return fail_everyone(receive_failure(rank, Status::invalid_argument("step with a wrong payload length")),
                             context, deadline);
      }
      uint8_t* destination = step.kind == StepKind::kAllGather ? result + rank * step.bytes : result;
      received = peer.recv_all(destination, bytes, deadline, cancel_fd());
      if (!received.ok()) return receive_failed(rank, received, context, deadline);
      return true;
    }
    default:
      return fail_everyone(receive_failure(rank, Status::invalid_argument(
                                                     "unexpected message type " +
                                                     std::to_string(static_cast<unsigned>(header->type)))),
                           context, deadline);
  }
}

// ---- the other ranks ---------------------------------------------------------------------------

class ClientBootstrap final : public StepBootstrap {
 public:
  ClientBootstrap(const BootstrapConfig& config, std::string root_address, Socket root, UniqueFd cancel_event,
                  UniqueFd wake_event)
      : StepBootstrap(config.rank, config.world_size, config.timeout, std::move(cancel_event), std::move(wake_event)),
        root_address_(std::move(root_address)),
        root_(std::move(root)) {}

  void report_failure_as(StatusCode code, std::string_view message) override {
    fail_locally(message);
    auto body = encode_notice(Notice{reported_code(code), rank_, std::string(message), NoticeKind::kReport});
    // A step's message still being written (rank 0 not reading) keeps the stream; the report is
    // then dropped and the peers fail at their deadline instead.
    std::unique_lock<std::timed_mutex> lock(send_mutex_, std::defer_lock);
    if (lock.try_lock_for(kNoticeTimeout)) {
      (void)send_message(root_, MessageType::kFailure, body, Clock::now() + std::min(timeout_, kNoticeTimeout));
    }
  }

 protected:
  Status run_step(const Step& step, const void* contribution, void* result) override;
  void add_watched(std::vector<pollfd>& fds) override {
    if (!root_lost_) fds.push_back({root_.fd(), POLLIN | POLLRDHUP, 0});
  }
  void read_watched(const std::vector<pollfd>& fds) override;

 private:
  Status lost_root() {
    root_lost_ = true;
    return record_notice(Status::peer_failure("rank 0: lost the connection to it at " + root_address_ +
                                              " (process exited or crashed?)"));
  }
  // What a failed exchange with rank 0 means for this rank, in a step described by `context`.
  Status root_failure(const Status& status, const std::string& context);
  // The failure notice rank 0 sent before the connection broke, if it is already here (or, with
  // `wait`, arrives within it): rank 0 may forward a failure and exit before this rank's step
  // reaches it.
  std::optional<Status> buffered_notice(milliseconds wait = milliseconds(0));

  std::string root_address_;
  Socket root_;
  bool root_lost_ = false;  // watch: the connection closed, or rank 0 sent what no step asked for
};

void ClientBootstrap::read_watched(const std::vector<pollfd>& fds) {
  if (fds.size() < 2 || fds[0].revents == 0) return;
  // Between steps rank 0 sends nothing but failure notices.
  std::array<uint8_t, kHeaderBytes> head{};
  Result<size_t> seen = root_.peek(head.data(), head.size());
  if (!seen.ok()) {
    (void)lost_root();
    return;
  }
  if (*seen < head.size()) {
    if ((fds[0].revents & (POLLHUP | POLLERR | POLLRDHUP)) != 0) (void)lost_root();
    return;
  }
  std::optional<Status> notice = buffered_notice(kNoticeTimeout);
  if (notice) {
    (void)record_notice(*notice);
    return;
  }
  root_lost_ = true;
  (void)record_notice(Status::peer_failure("rank 0 at " + root_address_ + " sent what no step asked for"));
}

Status ClientBootstrap::root_failure(const Status& status, const std::string& context) {
  switch (status.code()) {
    case StatusCode::kTimeout:
      return Status::timeout("no answer from rank 0 at " + root_address_ + " within " + ms_text(timeout_))
          .with_context(context);
    case StatusCode::kPeerFailure:
      return Status::peer_failure("lost connection to rank 0 at " + root_address_).with_context(context);
    case StatusCode::kInvalidArgument:
      return Status::peer_failure("rank 0 at " + root_address_ + " sent a malformed message: " + status.message())
          .with_context(context);
    case StatusCode::kAborted: return cancelled(context);  // report_failure() ended the wait
    default: return Status(status).with_context(context);
  }
}

std::optional<Status> ClientBootstrap::buffered_notice(milliseconds wait) {
  Deadline deadline = Clock::now() + wait;
  Result<Header> header = recv_header(root_, deadline);
  if (!header.ok() || header->type != MessageType::kFailure) return std::nullopt;
  std::array<uint8_t, kFailureBodyBytes> body{};
  if (!root_.recv_all(body.data(), body.size(), deadline).ok()) return std::nullopt;
  return decode_notice(body.data(), world_size_).to_status();
}

Status ClientBootstrap::run_step(const Step& step, const void* contribution, void* result) {
  std::string context = "bootstrap " + step.describe();
  Deadline deadline = Clock::now() + timeout_;
  std::span<const uint8_t> mine(static_cast<const uint8_t*>(contribution), step.contribution_bytes(rank_));
  Status sent;
  {
    std::lock_guard<std::timed_mutex> lock(send_mutex_);
    sent = send_message(root_, MessageType::kStep, encode_step(step), deadline, mine);
  }
  if (!sent.ok()) {
    std::optional<Status> notice = buffered_notice();
    return notice ? record_notice(std::move(*notice).with_context(context)) : record(root_failure(sent, context));
  }

  Result<Header> header = recv_header(root_, deadline, cancel_fd());
  if (!header.ok() && header.status().code() == StatusCode::kTimeout) {
    // Tell rank 0 this rank stopped waiting, so it names the ranks that never arrived to all
    // instead of seeing this one vanish. Without waiting: the deadline has passed.
    std::unique_lock<std::timed_mutex> lock(send_mutex_, std::try_to_lock);
    if (lock.owns_lock()) {
      auto notice = encode_notice(Notice{StatusCode::kTimeout, rank_, "stopped waiting", NoticeKind::kStepTimeout});
      (void)send_message(root_, MessageType::kFailure, notice, Clock::now());
    }
  }
  if (!header.ok()) return record(root_failure(header.status(), context));
  std::array<uint8_t, kFailureBodyBytes> body{};
  Status received = root_.recv_all(body.data(), *body_bytes(header->type), deadline, cancel_fd());
  if (!received.ok()) return record(root_failure(received, context));
  if (header->type == MessageType::kFailure) {
    return record_notice(decode_notice(body.data(), world_size_).to_status().with_context(context));
  }
  uint64_t result_bytes = step.result_bytes(world_size_);
  Result<Step> answered = header->type == MessageType::kResult
                              ? decode_step(body.data())
                              : Result<Step>(Status::invalid_argument("unexpected message type"));
  if (!answered.ok() || !(*answered == step) || header->payload_bytes != kResultBodyBytes + result_bytes) {
    return record(root_failure(Status::invalid_argument("not the result of this step"), context));
  }
  received = root_.recv_all(result, result_bytes, deadline, cancel_fd());
  if (!received.ok()) return record(root_failure(received, context));
  return {};
}

// One connection attempt's handshake. Returns the authenticated socket; peer_failure means rank 0
// closed the connection before challenging it (it was dropped under load), which is worth a retry.
Result<Socket> authenticate(Socket socket, const BootstrapConfig& config, Deadline deadline,
                            const std::string& root_address) {
  Result<Header> header = recv_header(socket, deadline);
  if (!header.ok()) {
    if (header.status().code() == StatusCode::kInvalidArgument) {
      return Status::invalid_argument(root_address + " does not speak the loom bootstrap protocol: " +
                                      header.status().message());
    }
    return std::move(header).take_status();
  }
  if (header->type != MessageType::kChallenge) {
    return Status::invalid_argument(root_address + " did not start with a challenge");
  }
  Nonce challenge{};
  LOOM_TRY(socket.recv_all(challenge.data(), challenge.size(), deadline));

  Hello hello;
  hello.rank = static_cast<uint32_t>(config.rank);
  hello.world_size = static_cast<uint32_t>(config.world_size);
  LOOM_TRY(fill_random(hello.nonce));
  LOOM_ASSIGN_OR_RETURN(hello.proof,
                        make_proof(config.secret, kClientProofDomain, challenge, hello.rank, hello.world_size));
  LOOM_TRY(send_message(socket, MessageType::kHello, encode_hello(hello), deadline));

  LOOM_ASSIGN_OR_RETURN(Header answer, recv_header(socket, deadline));
  std::array<uint8_t, kFailureBodyBytes> body{};
  LOOM_TRY(socket.recv_all(body.data(), *body_bytes(answer.type), deadline));
  if (answer.type == MessageType::kFailure) {
    return Status::invalid_argument("rejected by rank 0 at " + root_address + ": " +
                                    decode_notice(body.data(), config.world_size).text);
  }
  if (answer.type != MessageType::kWelcome) {
    return Status::invalid_argument(root_address + " answered the hello with an unexpected message");
  }
  LOOM_ASSIGN_OR_RETURN(Proof expected,
                        make_proof(config.secret, kRootProofDomain, hello.nonce, hello.rank, hello.world_size));
  Proof proof{};
  std::memcpy(proof.data(), body.data(), proof.size());
  if (!same_proof(proof, expected)) {
    return Status::invalid_argument(root_address +
                                    " failed to prove it knows the job secret (not this job's rank 0, or a "
                                    "different LOOM_SECRET)");
  }
  return socket;
}

// Waits for rank 0 to say that every rank has joined.
Status wait_until_ready(Socket& root, const BootstrapConfig& config, Deadline deadline,
                        const std::string& root_address) {
  Result<Header> header = recv_header(root, deadline);
  if (!header.ok() && header.status().code() == StatusCode::kTimeout) {
    // Our deadline passed: ask rank 0 which ranks are missing, so the error can name them.
    Deadline grace = Clock::now() + kQueryGrace;
    if (send_message(root, MessageType::kQuery, {}, grace).ok()) header = recv_header(root, grace);
    if (!header.ok() && header.status().code() == StatusCode::kTimeout) {
      return Status::timeout("bootstrap: rank 0 at " + root_address + " did not report every rank joined within " +
                             ms_text(config.timeout));
    }
  }
  if (!header.ok()) {
    if (header.status().code() == StatusCode::kPeerFailure) {
      return Status::peer_failure("bootstrap: lost connection to rank 0 at " + root_address);
    }
    return std::move(header).take_status().with_context("bootstrap: waiting for rank 0 at " + root_address);
  }
  std::array<uint8_t, kFailureBodyBytes> body{};
  LOOM_TRY_CTX(root.recv_all(body.data(), *body_bytes(header->type), deadline + kQueryGrace), "bootstrap");
  switch (header->type) {
    case MessageType::kReady: return {};
    case MessageType::kMissing:
      return Status::timeout("bootstrap: rank(s) " + load_text(body.data()) + " did not connect to " + root_address +
                             " within " + ms_text(config.timeout));
    case MessageType::kFailure:
      return decode_notice(body.data(), config.world_size).to_status().with_context("bootstrap");
    default:
      return Status::peer_failure("bootstrap: rank 0 at " + root_address + " sent an unexpected message during init");
  }
}

// Connects to rank 0 and authenticates, retrying while rank 0 drops the connection before its
// challenge (a connection flood) until the deadline.
Result<Socket> join_root(const BootstrapConfig& config, Deadline deadline, const std::string& root_address) {
  auto backoff = milliseconds(10);
  while (true) {
    Result<Socket> socket = Socket::connect(config.root_addr, config.root_port, deadline);
    if (!socket.ok()) {
      if (socket.status().code() == StatusCode::kTimeout) {
        return Status::timeout("bootstrap: rank 0 did not accept rank " + std::to_string(config.rank) + " at " +
                               root_address + " within " + ms_text(config.timeout) + " (" +
                               socket.status().message() + ")");
      }
      return std::move(socket).take_status().with_context("bootstrap");
    }
    Result<Socket> authenticated = authenticate(std::move(*socket), config, deadline, root_address);
    if (authenticated.ok()) return authenticated;
    if (authenticated.status().code() == StatusCode::kTimeout) {
      return Status::timeout("bootstrap: no handshake with rank 0 at " + root_address + " within " +
                             ms_text(config.timeout));
    }
    if (authenticated.status().code() != StatusCode::kPeerFailure) {
      return std::move(authenticated).take_status().with_context("bootstrap");
    }
    auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      return Status::timeout("bootstrap: rank 0 at " + root_address + " kept closing the connection (" +
                             authenticated.status().message() + ")");
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, left));
    backoff = std::min(backoff * 2, milliseconds(200));
  }
}

Result<std::unique_ptr<Bootstrap>> connect_client(const BootstrapConfig& config, Deadline deadline) {
  std::string root_address = format_host_port(config.root_addr, config.root_port);
  LOOM_ASSIGN_OR_RETURN(Socket root, join_root(config, deadline, root_address));
  LOOM_TRY(wait_until_ready(root, config, deadline, root_address));
  LOOM_ASSIGN_OR_RETURN(UniqueFd cancel_event, make_cancel_event());
  LOOM_ASSIGN_OR_RETURN(UniqueFd wake_event, make_cancel_event());
  return std::unique_ptr<Bootstrap>(std::make_unique<ClientBootstrap>(config, root_address, std::move(root),
                                                                      std::move(cancel_event), std::move(wake_event)));
}

// Rank 0's admission, then the job's bootstrap; with `own_failure`, rank 0 cannot start and only
// tells the others (the result is then that failure).
Result<std::unique_ptr<Bootstrap>> run_root(Listener listener, const BootstrapConfig& config, Deadline deadline,
                                            const Notice* own_failure = nullptr) {
  LOOM_ASSIGN_OR_RETURN(UniqueFd cancel_event, make_cancel_event());
  LOOM_ASSIGN_OR_RETURN(UniqueFd wake_event, make_cancel_event());
  RootAdmission admission(listener, config, deadline);
  if (own_failure != nullptr) admission.fail_job(*own_failure);
  LOOM_ASSIGN_OR_RETURN(std::vector<std::optional<Socket>> peers, admission.run());
  auto root = std::make_unique<RootBootstrap>(config, std::move(peers), std::move(cancel_event), std::move(wake_event));
  LOOM_TRY(root->announce_ready());
  return std::unique_ptr<Bootstrap>(std::move(root));
}

Status validate_config(const BootstrapConfig& config) {
  if (config.world_size < 1 || config.world_size > kMaxWorldSize) {
    return Status::invalid_argument("bootstrap: world size " + std::to_string(config.world_size) +
                                    " is outside [1, " + std::to_string(kMaxWorldSize) + "]");
  }
  if (config.rank < 0 || config.rank >= config.world_size) {
    return Status::invalid_argument("bootstrap: rank " + std::to_string(config.rank) + " is outside [0, " +
                                    std::to_string(config.world_size) + ")");
  }
  if (config.timeout <= milliseconds::zero()) {
    return Status::invalid_argument("bootstrap: timeout must be positive, got " + ms_text(config.timeout));
  }
  if (config.world_size > 1 && config.root_addr.empty()) {
    return Status::invalid_argument("bootstrap: no address for rank 0");
  }
  return {};
}

Result<std::unique_ptr<Bootstrap>> connect_with(const BootstrapConfig& config, std::optional<Listener> listener) {
  Deadline deadline = Clock::now() + config.timeout;
  LOOM_TRY(validate_config(config));
  if (config.world_size == 1) {
    LOOM_ASSIGN_OR_RETURN(UniqueFd wake_event, make_cancel_event());
    return std::unique_ptr<Bootstrap>(std::make_unique<SingleRankBootstrap>(config.timeout, std::move(wake_event)));
  }
  if (config.rank != 0) return connect_client(config, deadline);
  if (!listener) {
    Result<Listener> bound = Listener::listen(config.root_addr, config.root_port);
    if (!bound.ok()) return std::move(bound).take_status().with_context("bootstrap: rank 0");
    listener = std::move(*bound);
  }
  return run_root(std::move(*listener), config, deadline);
}

// announce_failure(): joins the job only to tell the others why this rank cannot start.
Status announce_with(BootstrapConfig config, std::optional<Listener> listener, const Status& failure) {
  if (failure.ok()) return Status::internal("announce_failure without a failure");
  if (!validate_config(config).ok() || config.world_size == 1) return failure;  // nobody to tell
  config.timeout = std::min<milliseconds>(config.timeout, Bootstrap::kAnnounceLimit);
  const Deadline deadline = Clock::now() + config.timeout;
  // The text says "could not start" itself: rank 0 relays a client's as it came, and a client whose
  // notice arrives only after admission (the job's last rank to join) is read by the first
  // all_gather, which names the rank before this text.
  const Notice notice{StatusCode::kPeerFailure, config.rank, "could not start: " + failure.to_string(),
                      NoticeKind::kInitFailure};
  auto not_told = [&](const std::string& why) {
    return Status(failure.code(), failure.message() + " (the other ranks were not all told: " + why + ")");
  };
  if (config.rank != 0) {
    const std::string root_address = format_host_port(config.root_addr, config.root_port);
    Result<Socket> root = join_root(config, deadline, root_address);
    if (!root.ok()) return not_told(root.status().to_string());
    Status sent = send_message(*root, MessageType::kFailure, encode_notice(notice), Clock::now() + kNoticeTimeout);
    return sent.ok() ? failure : not_told(sent.to_string());
  }
  if (!listener) {
    Result<Listener> bound = Listener::listen(config.root_addr, config.root_port);
    if (!bound.ok()) return not_told(bound.status().to_string());
    listener = std::move(*bound);
  }
  Result<std::unique_ptr<Bootstrap>> told = run_root(std::move(*listener), config, deadline, &notice);
  const std::string& message = told.status().message();
  const size_t at = message.find("not told");
  return at == std::string::npos ? failure : not_told(message.substr(0, at + 8));
}

// ---- unique ids --------------------------------------------------------------------------------

// Layout: magic u32 | version u16 | port u16 | secret[16] | host length u8 | host[99] |
// checksum u32 (first bytes of SHA-256 over everything before it).
constexpr uint32_t kUniqueIdMagic = 0x44494d4c;  // "LMID" in memory order
constexpr uint16_t kUniqueIdVersion = 1;
constexpr size_t kIdSecretOffset = 8;
constexpr size_t kIdHostLengthOffset = kIdSecretOffset + sizeof(Secret);
constexpr size_t kIdHostOffset = kIdHostLengthOffset + 1;
constexpr size_t kIdChecksumOffset = UniqueId::kBytes - 4;
constexpr size_t kIdMaxHostBytes = kIdChecksumOffset - kIdHostOffset;

struct UniqueIdContents {
  std::string host;
  uint16_t port = 0;
  Secret secret{};
};

Result<uint32_t> id_checksum(const UniqueId& id) {
  LOOM_ASSIGN_OR_RETURN(auto digest, sha256(std::string_view(reinterpret_cast<const char*>(id.bytes.data()),
                                                             kIdChecksumOffset)));
  return load_le<uint32_t>(digest.data());
}

Result<UniqueId> encode_unique_id(const UniqueIdContents& contents) {
  if (contents.host.empty() || contents.host.size() > kIdMaxHostBytes) {
    return Status::invalid_argument("unique id: address '" + contents.host + "' must be 1 to " +
                                    std::to_string(kIdMaxHostBytes) + " characters");
  }
  UniqueId id;
  store_le(id.bytes.data(), kUniqueIdMagic);
  store_le(id.bytes.data() + 4, kUniqueIdVersion);
  store_le(id.bytes.data() + 6, contents.port);
  std::memcpy(id.bytes.data() + kIdSecretOffset, contents.secret.data(), contents.secret.size());
  id.bytes[kIdHostLengthOffset] = static_cast<uint8_t>(contents.host.size());
  std::memcpy(id.bytes.data() + kIdHostOffset, contents.host.data(), contents.host.size());
  LOOM_ASSIGN_OR_RETURN(uint32_t checksum, id_checksum(id));
  store_le(id.bytes.data() + kIdChecksumOffset, checksum);
  return id;
}

Result<UniqueIdContents> decode_unique_id(const UniqueId& id) {
  const uint8_t* bytes = id.bytes.data();
  if (load_le<uint32_t>(bytes) != kUniqueIdMagic) {
    return Status::invalid_argument("unique id: wrong magic (not made by Bootstrap::create_unique_id)");
  }
  if (load_le<uint16_t>(bytes + 4) != kUniqueIdVersion) {
    return Status::invalid_argument("unique id: version " + std::to_string(load_le<uint16_t>(bytes + 4)) +
                                    " (this build reads " + std::to_string(kUniqueIdVersion) + ")");
  }
  LOOM_ASSIGN_OR_RETURN(uint32_t checksum, id_checksum(id));
  if (load_le<uint32_t>(bytes + kIdChecksumOffset) != checksum) {
    return Status::invalid_argument("unique id: checksum mismatch (corrupted in transit?)");
  }
  UniqueIdContents contents;
  contents.port = load_le<uint16_t>(bytes + 6);
  std::memcpy(contents.secret.data(), bytes + kIdSecretOffset, contents.secret.size());
  size_t host_length = bytes[kIdHostLengthOffset];
  if (contents.port == 0 || host_length == 0 || host_length > kIdMaxHostBytes) {
    return Status::invalid_argument("unique id: no valid address");
  }
  contents.host.assign(reinterpret_cast<const char*>(bytes + kIdHostOffset), host_length);
  for (char c : contents.host) {
    if (!std::isprint(static_cast<unsigned char>(c))) return Status::invalid_argument("unique id: no valid address");
  }
  return contents;
}

// Listeners that create_unique_id() bound for a later from_unique_id() on rank 0 of this process:
// at most kMaxPreparedListeners (each holds a port and a descriptor until used or discarded).
constexpr size_t kMaxPreparedListeners = 64;
struct PreparedListener {
  std::string host;
  uint16_t port;
  Listener listener;
};
std::mutex g_prepared_mutex;
std::vector<PreparedListener> g_prepared;

std::optional<Listener> take_prepared_listener(const std::string& host, uint16_t port) {
  std::lock_guard<std::mutex> lock(g_prepared_mutex);
  auto it = std::find_if(g_prepared.begin(), g_prepared.end(),
                         [&](const PreparedListener& p) { return p.host == host && p.port == port; });
  if (it == g_prepared.end()) return std::nullopt;
  std::optional<Listener> listener(std::move(it->listener));
  g_prepared.erase(it);
  return listener;
}

// ---- environment -------------------------------------------------------------------------------

Result<int64_t> required_int(const char* name, int64_t min, int64_t max) {
  std::optional<std::string> raw = env::get_raw(name);
  if (!raw) {
    return Status::invalid_argument(std::string(name) + " is not set (torchrun, Slurm scripts and loom-run set it)");
  }
  return env::parse_int(name, *raw, min, max);
}

Result<Secret> parse_secret_hex(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  // The value is never echoed: it is the job secret.
  Status bad = Status::invalid_argument("LOOM_SECRET: expected 32 hexadecimal digits");
  if (text.size() != 2 * sizeof(Secret)) return bad;
  Secret secret{};
  for (size_t i = 0; i < text.size(); ++i) {
    char c = static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
    int nibble = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (nibble < 0) return bad;
    secret[i / 2] = static_cast<uint8_t>(secret[i / 2] << 4 | nibble);
  }
  return secret;
}

}  // namespace

Result<BootstrapConfig> bootstrap_config_from_env() {
  BootstrapConfig config;
  LOOM_ASSIGN_OR_RETURN(int64_t world_size, required_int("WORLD_SIZE", 1, kMaxWorldSize));
  LOOM_ASSIGN_OR_RETURN(int64_t rank, required_int("RANK", 0, kMaxWorldSize - 1));
  if (rank >= world_size) {
    return Status::invalid_argument("RANK=" + std::to_string(rank) + " is not below WORLD_SIZE=" +
                                    std::to_string(world_size));
  }
  config.rank = static_cast<int>(rank);
  config.world_size = static_cast<int>(world_size);

  // One rank needs no network; MASTER_* are still checked when set.
  std::optional<std::string> addr = env::get_raw("MASTER_ADDR");
  std::optional<std::string> port = env::get_raw("MASTER_PORT");
  if (world_size > 1 || addr) {
    if (!addr) return Status::invalid_argument("MASTER_ADDR is not set (the address of rank 0)");
    std::string_view text = *addr;
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
    if (text.empty()) return Status::invalid_argument("MASTER_ADDR is empty");
    config.root_addr = std::string(text);
  }
  if (world_size > 1 || port) {
    LOOM_ASSIGN_OR_RETURN(int64_t port_number, required_int("MASTER_PORT", 1, 65535));
    config.root_port = static_cast<uint16_t>(port_number);
    // Under torchrun (TORCHELASTIC_RUN_ID set) torch's own rendezvous store already listens on
    // MASTER_PORT, so rank 0 listens on the next port; LOOM_BOOTSTRAP_PORT overrides both.
    if (env::get_raw("LOOM_BOOTSTRAP_PORT")) {
      LOOM_ASSIGN_OR_RETURN(int64_t own, env::get_int("LOOM_BOOTSTRAP_PORT", 0, 1, 65535));
      config.root_port = static_cast<uint16_t>(own);
    } else if (env::get_raw("TORCHELASTIC_RUN_ID")) {
      if (port_number == 65535) {
        return Status::invalid_argument("MASTER_PORT=65535 under torchrun: loom's bootstrap listens on MASTER_PORT + 1 "
                                        "(torch's store has MASTER_PORT); set LOOM_BOOTSTRAP_PORT");
      }
      config.root_port = static_cast<uint16_t>(port_number + 1);
    }
  }

  constexpr int64_t kDayMs = 24LL * 3600 * 1000;
  LOOM_ASSIGN_OR_RETURN(int64_t timeout_ms, env::get_int("LOOM_BOOTSTRAP_TIMEOUT_MS", 120'000, 1, kDayMs));
  config.timeout = milliseconds(timeout_ms);

  if (std::optional<std::string> secret = env::get_raw("LOOM_SECRET")) {
    LOOM_ASSIGN_OR_RETURN(config.secret, parse_secret_hex(*secret));
    return config;
  }
  if (world_size == 1) return config;  // no peer to authenticate
  // Fail closed: a secret derived from public values (MASTER_ADDR:MASTER_PORT, TORCHELASTIC_RUN_ID)
  // lets anyone who can reach rank 0 join the job as one of its ranks.
  return Status::invalid_argument(
      "LOOM_SECRET is not set: a job of " + std::to_string(world_size) +
      " ranks needs a secret that every rank shares and nobody else knows (32 hexadecimal digits, e.g. "
      "export LOOM_SECRET=$(openssl rand -hex 16) where the job is launched), or a launch that makes one: "
      "loom-run, loom-bench --spawn, or a communicator from a unique id (loom::make_unique_id and "
      "Communicator::from_unique_id; in Python Communicator.from_process_group, and from_env under torchrun)");
}

Result<std::array<uint8_t, 32>> bootstrap_wire::client_proof(const Secret& secret,
                                                            std::span<const uint8_t, kChallengeBodyBytes> challenge,
                                                            uint32_t rank, uint32_t world_size) {
  Nonce nonce{};
  std::memcpy(nonce.data(), challenge.data(), nonce.size());
  return make_proof(secret, kClientProofDomain, nonce, rank, world_size);
}

Result<UniqueId> Bootstrap::create_unique_id(std::string_view bind_addr) {
  {
    std::lock_guard<std::mutex> lock(g_prepared_mutex);
    if (g_prepared.size() >= kMaxPreparedListeners) {
      return Status::invalid_argument("create_unique_id: " + std::to_string(g_prepared.size()) +
                                      " unique ids of this process are still listening, unused; discard the abandoned "
                                      "ones (discard_unique_id) or create the communicators that use them");
    }
  }
  Result<Listener> listener = Listener::listen(bind_addr, 0);
  if (!listener.ok()) return std::move(listener).take_status().with_context("create_unique_id");
  UniqueIdContents contents;
  contents.host = listener->host();
  contents.port = listener->port();
  LOOM_TRY(fill_random(contents.secret));
  LOOM_ASSIGN_OR_RETURN(UniqueId id, encode_unique_id(contents));
  std::lock_guard<std::mutex> lock(g_prepared_mutex);
  g_prepared.push_back(PreparedListener{contents.host, contents.port, std::move(*listener)});
  return id;
}

Result<std::unique_ptr<Bootstrap>> Bootstrap::from_unique_id(const UniqueId& id, int rank, int world_size,
                                                             std::chrono::milliseconds timeout) {
  LOOM_ASSIGN_OR_RETURN(UniqueIdContents contents, decode_unique_id(id));
  BootstrapConfig config;
  config.rank = rank;
  config.world_size = world_size;
  config.root_addr = contents.host;
  config.root_port = contents.port;
  config.secret = contents.secret;
  config.timeout = timeout;
  LOOM_TRY(validate_config(config));
  std::optional<Listener> listener;
  if (rank == 0) listener = take_prepared_listener(contents.host, contents.port);
  return connect_with(config, std::move(listener));
}

Status Bootstrap::announce_failure(const UniqueId& id, int rank, int world_size, std::chrono::milliseconds timeout,
                                   const Status& failure) {
  Result<UniqueIdContents> contents = decode_unique_id(id);
  if (!contents.ok()) return failure;
  BootstrapConfig config;
  config.rank = rank;
  config.world_size = world_size;
  config.root_addr = contents->host;
  config.root_port = contents->port;
  config.secret = contents->secret;
  config.timeout = timeout;
  std::optional<Listener> listener;
  if (rank == 0) listener = take_prepared_listener(contents->host, contents->port);
  return announce_with(config, std::move(listener), failure);
}

Status Bootstrap::announce_failure(const BootstrapConfig& config, const Status& failure) {
  return announce_with(config, std::nullopt, failure);
}

void Bootstrap::discard_unique_id(const UniqueId& id) {
  Result<UniqueIdContents> contents = decode_unique_id(id);
  if (contents.ok()) (void)take_prepared_listener(contents->host, contents->port);
}

Result<std::unique_ptr<Bootstrap>> Bootstrap::connect(const BootstrapConfig& config) {
  if (config.world_size > 1 && config.root_port == 0) {
    return Status::invalid_argument("bootstrap: port 0 for rank 0 (only a unique id carries an ephemeral port)");
  }
  return connect_with(config, std::nullopt);
}

}  // namespace loom::runtime
