// Failure propagation between real communicators (reliability.md H2, H3, H6, R2; docs/SECURITY.md
// "Failures"). Each test supervises a job of its own: it starts N ranks (this executable again,
// running only FaultChild.Run with LOOM_TEST_FAULT naming the scenario), all on one GPU when
// there are fewer GPUs than ranks (LOOM_RANKS_PER_GPU), then kills, stops or breaks one rank and
// checks what every other rank reported and when. Every job runs under a wall-clock limit
// (kJobLimit); ranks left at the end are killed. Run alone, not under loom-run:
//   loom_gpu_tests --gtest_filter='Fault*'
// (with WORLD_SIZE > 1 they skip: every rank would start jobs of its own).
//
//   FaultKill.*           kill -9 of one rank while the others are inside a fused operator (ag_gemm,
//                         gemm_rs, gemm_ar on one node and on two emulated nodes; ring_attention and
//                         MoE routing + dispatch + combine on one node): every other rank's call
//                         returns peer_failure naming it within 2 s (the op timeout is 60 s), and
//                         closing the communicator afterwards takes under 3 s
//   FaultStop.*           SIGSTOP of one rank past the op timeout, then SIGCONT: the others fail
//                         (timeout or peer_failure), and no call of the resumed rank succeeds any
//                         more: its first one after the resume fails within 2 s
//   FaultBeforeJoin.*     a rank with a bad LOOM_* value, or with no GPU: every other rank's creation
//                         fails within 2 s of its CUDA start, naming that rank and the reason
//   FaultTwoComms.*       two communicators per rank, one rank killed: both fail, both close in 3 s
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "loom/attention.h"
#include "loom/communicator.h"
#include "loom/moe.h"
#include "loom/tensor_parallel.h"
#include "runtime/device_abi.h"
#include "tests/gpu/harness.h"

namespace loom {
namespace {

using namespace std::chrono_literals;
using SteadyClock = std::chrono::steady_clock;

constexpr auto kJobLimit = 120s;   // a job's wall clock: then every rank is killed and the test fails
constexpr int kResultFd = 198;     // where a rank writes its lines (a pipe to the supervisor)

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count();
}

// ---- the rank side (FaultChild.Run) ------------------------------------------------------------

void say(const std::string& line) {
  const std::string text = line + "\n";
  (void)!::write(kResultFd, text.data(), text.size());
}

// What a rank tells the supervisor at the end: its first failure (code, when, message), its last
// success, and how long closing took.
struct RankReport {
  int code = -1;              // StatusCode of the first failure; -1: none
  int64_t fail_ns = 0;        // when that call returned
  int64_t last_ok_ns = 0;     // when the last successful call returned
  int64_t close_ms = -1;
  std::string message;
};

void say_report(int rank, const RankReport& r) {
  std::ostringstream out;
  out << "result " << rank << " " << r.code << " " << r.fail_ns << " " << r.last_ok_ns << " " << r.close_ms << " ";
  for (char c : r.message) out << (c == '\n' ? ' ' : c);
  say(out.str());
}

// One fused operator on the communicator (ag_gemm, gemm_rs, gemm_ar, ring_attention, moe: routing,
// dispatch and combine, moe_dispatch_gemm: routing and the fused dispatch + expert GEMM, moe_layer:
// routing and the whole layer in one kernel), with buffers allocated once from the heap (the same sizes on every rank),
// contents irrelevant (zeros; MoE token ids valid).
class Operator {
 public:
  Operator(Communicator& comm, std::string op) : comm_(comm), op_(std::move(op)) {}
  ~Operator() {
    for (void* p : buffers_) (void)comm_.free(p);
  }
  Status prepare() {
    if (op_ == "ring_attention") {
      LOOM_TRY(prepare_ring());
    } else if (op_ == "moe" || op_ == "moe_dispatch_gemm" || op_ == "moe_layer") {
      LOOM_TRY(prepare_moe());
    } else {
      LOOM_TRY(prepare_tp());
    }
    return cudaDeviceSynchronize() == cudaSuccess ? Status{} : Status::cuda_error("cudaDeviceSynchronize");
  }
  // One call and its synchronize.
  Status run() {
    LOOM_TRY(launch());
    return comm_.synchronize(nullptr);
  }

 private:
  Status launch() {
    if (op_ == "ring_attention") return ring_attention(comm_, ring_, nullptr);
    if (op_ == "moe") {
      LOOM_ASSIGN_OR_RETURN(const MoePlan plan, moe_routing(comm_, moe_config_, routing_, nullptr));
      LOOM_TRY(moe_dispatch(comm_, plan, moe_x_, moe_recv_, nullptr));
      return moe_combine(comm_, plan, combine_, nullptr);
    }
    if (op_ == "moe_dispatch_gemm") {
      LOOM_ASSIGN_OR_RETURN(const MoePlan plan, moe_routing(comm_, moe_config_, routing_, nullptr));
      return moe_dispatch_gemm(comm_, plan, moe_x_, moe_recv_, expert_gemm_, nullptr);
    }
    if (op_ == "moe_layer") {
      LOOM_ASSIGN_OR_RETURN(const MoePlan plan, moe_routing(comm_, moe_config_, routing_, nullptr));
      return moe_layer(comm_, plan, moe_x_, layer_weights_, layer_buffers_, combine_.out, nullptr);
    }
    TpGemmOptions options;
    options.algorithm = TpAlgorithm::kFused;
    return op_ == "ag_gemm"   ? ag_gemm(comm_, tp_, nullptr, options)
           : op_ == "gemm_rs" ? gemm_rs(comm_, tp_, nullptr, options)
                              : gemm_ar(comm_, tp_, nullptr, options);
  }
  // Zeroed heap memory, freed with the operator.
  Result<void*> buffer(size_t bytes) {
    Result<void*> p = comm_.alloc(bytes);
    if (!p.ok()) return p.status();
    buffers_.push_back(*p);
    if (cudaMemset(*p, 0, bytes) != cudaSuccess) return Status::cuda_error("cudaMemset");
    return *p;
  }
  Status prepare_tp() {
    const int64_t w = comm_.world_size();
    const int64_t m = 512 * w, n = 512, k = 1024;  // every rank owns M / W rows
    const size_t e = 2;  // bf16
    const int64_t a_rows = op_ == "ag_gemm" ? m / w : m;
    const int64_t out_rows = op_ == "gemm_rs" ? m / w : m;
    LOOM_ASSIGN_OR_RETURN(void* a, buffer(static_cast<size_t>(a_rows * k) * e));
    LOOM_ASSIGN_OR_RETURN(void* b, buffer(static_cast<size_t>(k * n) * e));
    LOOM_ASSIGN_OR_RETURN(tp_.out, buffer(static_cast<size_t>(out_rows * n) * e));
    tp_.a = a;
    tp_.b = b;
    tp_.m = m;
    tp_.n = n;
    tp_.k = k;
    tp_.dtype = DType::kBF16;
    tp_.b_layout = BLayout::kKN;
    return {};
  }
  // Ring attention over 4 x 512 rows per rank (non-causal, bf16, 8 heads of 128).
  Status prepare_ring() {
    ring_.batch = 4;
    ring_.seqlen = 512;
    ring_.heads_q = ring_.heads_kv = 8;
    ring_.head_dim = 128;
    ring_.dtype = DType::kBF16;
    const size_t bytes = static_cast<size_t>(ring_.batch * ring_.seqlen * ring_.heads_q * ring_.head_dim) * 2;
    LOOM_ASSIGN_OR_RETURN(void* q, buffer(bytes));
    LOOM_ASSIGN_OR_RETURN(void* k, buffer(bytes));
    LOOM_ASSIGN_OR_RETURN(void* v, buffer(bytes));
    LOOM_ASSIGN_OR_RETURN(ring_.out, buffer(bytes));
    ring_.q = q;
    ring_.k = k;
    ring_.v = v;
    return {};
  }
  // MoE: 2 experts per rank, top-2, 256 tokens of 1024 bf16 elements; token t goes to experts
  // t and t + 1 (mod E), so every rank sends to every other.
  Status prepare_moe() {
    const int64_t w = comm_.world_size();
    moe_config_.num_experts = 2 * w;
    moe_config_.top_k = 2;
    moe_config_.hidden = 1024;
    moe_config_.dtype = DType::kBF16;
    moe_config_.max_tokens = 256;
    LOOM_ASSIGN_OR_RETURN(MoeSizes sizes, moe_sizes(comm_, moe_config_));
    const int64_t tokens = moe_config_.max_tokens;
    std::vector<int32_t> ids(static_cast<size_t>(tokens * moe_config_.top_k));
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = static_cast<int32_t>((i / 2 + i % 2) % static_cast<size_t>(moe_config_.num_experts));
    }
    LOOM_ASSIGN_OR_RETURN(void* topk_ids, buffer(ids.size() * sizeof(int32_t)));
    if (cudaMemcpy(topk_ids, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice) != cudaSuccess) {
      return Status::cuda_error("cudaMemcpy");
    }
    LOOM_ASSIGN_OR_RETURN(routing_.plan, buffer(sizes.plan_bytes));
    LOOM_ASSIGN_OR_RETURN(void* offsets, buffer(static_cast<size_t>(sizes.local_experts + 1) * sizeof(int32_t)));
    const size_t rows_bytes = static_cast<size_t>(tokens * moe_config_.hidden) * 2;
    LOOM_ASSIGN_OR_RETURN(moe_x_, buffer(rows_bytes));
    LOOM_ASSIGN_OR_RETURN(moe_recv_, buffer(sizes.recv_bytes));
    LOOM_ASSIGN_OR_RETURN(combine_.out, buffer(rows_bytes));
    routing_.topk_ids = static_cast<const int32_t*>(topk_ids);
    routing_.num_tokens = tokens;
    routing_.expert_offsets = static_cast<int32_t*>(offsets);
    combine_.expert_out = moe_recv_;  // the expert outputs: the received rows as they are
    combine_.dtype = DType::kBF16;
    if (op_ == "moe_dispatch_gemm") {  // N = 256 outputs per row from zero weights
      expert_gemm_.n = 256;
      const size_t weight_bytes = static_cast<size_t>(sizes.local_experts * expert_gemm_.n * moe_config_.hidden) * 2;
      LOOM_ASSIGN_OR_RETURN(void* weights, buffer(weight_bytes));
      LOOM_ASSIGN_OR_RETURN(expert_gemm_.out, buffer(static_cast<size_t>(sizes.capacity * expert_gemm_.n) * 2));
      expert_gemm_.weights = weights;
    }
    if (op_ == "moe_layer") {  // I = 256 from zero weights
      layer_weights_.intermediate = 256;
      const size_t expert_bytes = static_cast<size_t>(sizes.local_experts * layer_weights_.intermediate * moe_config_.hidden) * 2;
      LOOM_ASSIGN_OR_RETURN(const void* gate_up, buffer(2 * expert_bytes));
      LOOM_ASSIGN_OR_RETURN(const void* down, buffer(expert_bytes));
      layer_weights_.gate_up = gate_up;
      layer_weights_.down = down;
      layer_buffers_.recv_x = moe_recv_;
      LOOM_ASSIGN_OR_RETURN(layer_buffers_.hidden, buffer(static_cast<size_t>(sizes.capacity * layer_weights_.intermediate) * 2));
      LOOM_ASSIGN_OR_RETURN(layer_buffers_.expert_out, buffer(sizes.recv_bytes));
    }
    return {};
  }

  Communicator& comm_;
  std::string op_;
  std::vector<void*> buffers_;
  TpGemmArgs tp_;
  RingAttentionArgs ring_;
  MoeConfig moe_config_;
  MoeRoutingArgs routing_;
  void* moe_x_ = nullptr;
  void* moe_recv_ = nullptr;
  MoeCombineArgs combine_;
  MoeExpertGemm expert_gemm_;
  MoeLayerWeights layer_weights_;
  MoeLayerBuffers layer_buffers_;
};

// Calls `step` until one fails (or `limit` passes); the report's first failure and last success.
RankReport run_until_failure(const std::function<Status()>& step, std::chrono::seconds limit) {
  RankReport r;
  const auto give_up = SteadyClock::now() + limit;
  while (SteadyClock::now() < give_up) {
    Status s = step();
    if (s.ok()) {
      r.last_ok_ns = now_ns();
      continue;
    }
    r.fail_ns = now_ns();
    r.code = static_cast<int>(s.code());
    r.message = s.to_string();
    return r;
  }
  r.message = "no failure within the limit";
  return r;
}

// A rank whose warm-up failed says so (the supervisor then sees no "ready" from it).
bool warm_up_failed(int rank, const Status& warm) {
  if (warm.ok()) return false;
  RankReport r;
  r.code = static_cast<int>(warm.code());
  r.message = "warm-up: " + warm.to_string();
  say_report(rank, r);
  return true;
}

int64_t close_ms(std::unique_ptr<Communicator>& comm) {
  const auto start = SteadyClock::now();
  comm.reset();
  return std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - start).count();
}

// kill / stop: every rank runs the operator until a call fails. The supervisor kills or stops
// the victim once every rank said "ready".
void child_operator_loop(const std::string& op_name, std::chrono::milliseconds op_timeout) {
  const int rank = test::process().rank;
  CommOptions options;
  options.heap_bytes = uint64_t{256} << 20;
  options.op_timeout = op_timeout;
  Result<std::unique_ptr<Communicator>> comm = Communicator::from_env(options);
  if (!comm.ok()) {
    RankReport r;
    r.code = static_cast<int>(comm.status().code());
    r.message = "creating the communicator: " + comm.status().to_string();
    say_report(rank, r);
    return;
  }
  RankReport r;
  {
    Operator op(**comm, op_name);
    const Status prepared = op.prepare();
    if (warm_up_failed(rank, prepared.ok() ? op.run() : prepared)) return;
    say("ready " + std::to_string(rank));
    r = run_until_failure([&] { return op.run(); }, 60s);
  }
  r.close_ms = close_ms(*comm);
  say_report(rank, r);
}

// before-join: rank `victim` cannot start (bad_env: an invalid LOOM_TIMEOUT_MS; no_gpu: no GPU
// visible); the others time their creation from after their own CUDA start.
void child_before_join(const std::string& how, int victim) {
  const int rank = test::process().rank;
  if (rank == victim && how == "bad_env") setenv("LOOM_TIMEOUT_MS", "abc", 1);
  if (rank != victim) cudaFree(nullptr);  // the CUDA start, not timed
  RankReport r;
  const int64_t start = now_ns();
  Result<std::unique_ptr<Communicator>> comm = Communicator::from_env();
  r.fail_ns = now_ns();
  r.last_ok_ns = start;  // here: when the creation began
  if (comm.ok()) {
    r.message = "created";
    r.close_ms = close_ms(*comm);
  } else {
    r.code = static_cast<int>(comm.status().code());
    r.message = comm.status().to_string();
  }
  say_report(rank, r);
}

// two communicators: each rank runs ag_gemm on A then on B until a call fails; the supervisor
// kills the victim; the report's close time covers both.
void child_two_comms() {
  const int rank = test::process().rank;
  CommOptions options;
  options.heap_bytes = uint64_t{256} << 20;
  options.op_timeout = std::chrono::milliseconds(60'000);
  Result<std::unique_ptr<Communicator>> a = Communicator::from_env(options);
  Result<std::unique_ptr<Communicator>> b = a.ok() ? Communicator::from_env(options) : a.status();
  RankReport r;
  if (!a.ok() || !b.ok()) {
    r.code = static_cast<int>((a.ok() ? b : a).status().code());
    r.message = "creating the communicators: " + (a.ok() ? b : a).status().to_string();
    say_report(rank, r);
    return;
  }
  std::string second;
  {
    Operator on_a(**a, "ag_gemm"), on_b(**b, "ag_gemm");
    auto warm_up = [&]() -> Status {
      LOOM_TRY(on_a.prepare());
      LOOM_TRY(on_b.prepare());
      LOOM_TRY(on_a.run());
      return on_b.run();
    };
    if (warm_up_failed(rank, warm_up())) return;
    say("ready " + std::to_string(rank));
    bool on_first = true;
    r = run_until_failure(
        [&] {
          on_first = !on_first;
          return on_first ? on_a.run() : on_b.run();
        },
        60s);
    // The other communicator is failed too (its own watchdog saw the death): one more call says so.
    const auto start = SteadyClock::now();
    Status other = Status::internal("no failure");
    while (SteadyClock::now() - start < 3s && (other = on_first ? on_b.run() : on_a.run()).ok()) {}
    second = " | other communicator: " + other.to_string() + " after " +
             std::to_string((SteadyClock::now() - start) / 1ms) + " ms";
  }
  const auto start = SteadyClock::now();
  a->reset();
  b->reset();
  r.close_ms = std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - start).count();
  r.message += second;
  say_report(rank, r);
}

// LOOM_TEST_FAULT = "kill:<op>" | "stop:<op>" | "before_join:<how>:<victim>" | "two_comms"
TEST(FaultChild, Run) {
  const char* scenario = std::getenv("LOOM_TEST_FAULT");
  if (scenario == nullptr) GTEST_SKIP() << "a rank of a fault test's job (started by the Fault* tests)";
  std::string s = scenario;
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t colon = s.find(':', at);
    parts.push_back(s.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  if (parts[0] == "kill" && parts.size() == 2) child_operator_loop(parts[1], 60'000ms);
  if (parts[0] == "stop" && parts.size() == 2) child_operator_loop(parts[1], 2'000ms);
  if (parts[0] == "before_join" && parts.size() == 3) child_before_join(parts[1], std::atoi(parts[2].c_str()));
  if (parts[0] == "two_comms") child_two_comms();
  std::fflush(nullptr);
  std::_Exit(0);  // a rank: no static destructors (the supervisor reads its report only)
}

// ---- the supervisor ------------------------------------------------------------------------------

struct Rank {
  pid_t pid = -1;
  int fd = -1;
  std::string buffer;
  bool ready = false;
  bool reported = false;
  RankReport report;
};

// A free loopback port for a job's rank 0.
uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  uint16_t port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

class Job {
 public:
  // Starts `ranks` ranks of this executable with LOOM_TEST_FAULT=`scenario`; extra_env[r] holds
  // NAME=VALUE settings for rank r only ("CUDA_VISIBLE_DEVICES=" hides every GPU from it).
  Job(int ranks, const std::string& scenario, int emulated_nodes = 1,
      const std::vector<std::vector<std::string>>& extra_env = {})
      : ranks_(ranks), deadline_(SteadyClock::now() + kJobLimit) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) cudaGetLastError();
    devices = std::max(devices, 1);
    const int per_gpu = (ranks + devices - 1) / devices;
    std::random_device random;
    char secret[33];
    for (int i = 0; i < 32; ++i) secret[i] = "0123456789abcdef"[random() % 16];
    secret[32] = 0;
    const std::string port = std::to_string(free_port());
    std::string exe(4096, '\0');
    const ssize_t n = ::readlink("/proc/self/exe", exe.data(), exe.size() - 1);
    exe.resize(n > 0 ? static_cast<size_t>(n) : 0);
    for (int r = 0; r < ranks; ++r) {
      // Everything the rank needs is built here: after fork() only exec-safe calls follow.
      std::vector<std::string> env;
      const std::vector<std::string> set = {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(ranks),
                                            "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(ranks),
                                            "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port, std::string("LOOM_SECRET=") + secret,
                                            "LOOM_RANKS_PER_GPU=" + std::to_string(per_gpu),
                                            "LOOM_EMULATE_NODES=" + std::to_string(emulated_nodes), "LOOM_TEST_FAULT=" + scenario};
      std::vector<std::string> overrides = set;
      if (static_cast<size_t>(r) < extra_env.size()) overrides.insert(overrides.end(), extra_env[r].begin(), extra_env[r].end());
      auto overridden = [&](const std::string& kv) {
        const std::string name = kv.substr(0, kv.find('=') + 1);
        if (name == "TORCHELASTIC_RUN_ID=" || name == "LOOM_BOOTSTRAP_PORT=") return true;
        for (const std::string& o : overrides) {
          if (o.compare(0, name.size(), name) == 0) return true;
        }
        return false;
      };
      for (char** e = environ; *e != nullptr; ++e) {
        if (!overridden(*e)) env.push_back(*e);
      }
      env.insert(env.end(), overrides.begin(), overrides.end());
      std::vector<char*> envp;
      for (std::string& kv : env) envp.push_back(kv.data());
      envp.push_back(nullptr);
      std::vector<std::string> args = {exe, "--gtest_filter=FaultChild.Run", "--gtest_brief=1"};
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      int ends[2];
      if (::pipe2(ends, O_CLOEXEC) != 0) {
        ADD_FAILURE() << "pipe";
        return;
      }
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::dup2(ends[1], kResultFd);  // dup2 clears close-on-exec on the copy
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        ::execve(argv[0], argv.data(), envp.data());
        ::_exit(127);
      }
      ::close(ends[1]);
      Rank rank;
      rank.pid = pid;
      rank.fd = ends[0];
      ranks_list_.push_back(rank);
    }
  }
  ~Job() { kill_all(); }

  pid_t pid(int rank) const { return ranks_list_[rank].pid; }

  // Reads until `done` holds or the job's limit passes (false then).
  bool read_until(const std::function<bool()>& done) {
    while (!done()) {
      std::vector<pollfd> fds;
      std::vector<Rank*> open;
      for (Rank& r : ranks_list_) {
        if (r.fd >= 0) {
          fds.push_back({r.fd, POLLIN, 0});
          open.push_back(&r);
        }
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - SteadyClock::now()).count();
      if (fds.empty() || left <= 0) return done();
      if (::poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(left, 1000))) <= 0) continue;
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        char chunk[4096];
        const ssize_t n = ::read(open[i]->fd, chunk, sizeof(chunk));
        if (n <= 0) {
          ::close(open[i]->fd);
          open[i]->fd = -1;
          continue;
        }
        open[i]->buffer.append(chunk, static_cast<size_t>(n));
        parse(*open[i]);
      }
    }
    return true;
  }
  bool all_ready() {
    return read_until([&] {
      for (const Rank& r : ranks_list_) {
        if (!r.ready) return false;
      }
      return true;
    });
  }
  // Reports of every rank but `except` (-1: all).
  bool reports(int except = -1) {
    return read_until([&] {
      for (int r = 0; r < ranks_; ++r) {
        if (r != except && !ranks_list_[r].reported) return false;
      }
      return true;
    });
  }
  const RankReport& report(int rank) const { return ranks_list_[rank].report; }
  bool reported(int rank) const { return ranks_list_[rank].reported; }

 private:
  static void parse(Rank& r) {
    for (size_t nl; (nl = r.buffer.find('\n')) != std::string::npos; r.buffer.erase(0, nl + 1)) {
      const std::string line = r.buffer.substr(0, nl);
      std::istringstream in(line);
      std::string word;
      int rank = 0;
      in >> word >> rank;
      if (word == "ready") r.ready = true;
      if (word == "result") {
        in >> r.report.code >> r.report.fail_ns >> r.report.last_ok_ns >> r.report.close_ms;
        std::getline(in, r.report.message);
        r.reported = true;
      }
    }
  }
  void kill_all() {
    for (Rank& r : ranks_list_) {
      if (r.fd >= 0) ::close(r.fd);
      if (r.pid > 0) {
        ::kill(r.pid, SIGCONT);
        ::kill(r.pid, SIGKILL);
        ::waitpid(r.pid, nullptr, 0);
      }
    }
    ranks_list_.clear();
  }

  int ranks_;
  SteadyClock::time_point deadline_;
  std::vector<Rank> ranks_list_;
};

#define SKIP_UNLESS_SUPERVISOR()                                                                        \
  if (test::process().world_size > 1) GTEST_SKIP() << "run alone: every rank would start jobs of its own"

std::string describe(const Job& job, int ranks) {
  std::string out;
  for (int r = 0; r < ranks; ++r) {
    const RankReport& p = job.report(r);
    out += "\n  rank " + std::to_string(r) + (job.reported(r) ? "" : " (no report)") + ": code " +
           std::to_string(p.code) + ", close " + std::to_string(p.close_ms) + " ms: " + p.message;
  }
  return out;
}

double seconds_between(int64_t from_ns, int64_t to_ns) { return static_cast<double>(to_ns - from_ns) / 1e9; }

// ---- kill -9 in the middle of a fused operator (H2) ----------------------------------------------

struct KillCase {
  const char* op;
  int ranks;
  int nodes;  // emulated
  int victim;
};

class FaultKill : public ::testing::TestWithParam<KillCase> {};

TEST_P(FaultKill, EveryOtherRankReturnsPeerFailureWithinTwoSeconds) {
  SKIP_UNLESS_SUPERVISOR();
  const KillCase c = GetParam();
  Job job(c.ranks, std::string("kill:") + c.op, c.nodes);
  ASSERT_TRUE(job.all_ready()) << "the ranks did not get going" << describe(job, c.ranks);
  std::this_thread::sleep_for(300ms);  // inside the operator loop: every call waits on the victim's flags
  const int64_t killed = now_ns();
  ASSERT_EQ(::kill(job.pid(c.victim), SIGKILL), 0);
  ASSERT_TRUE(job.reports(c.victim)) << describe(job, c.ranks);
  const std::string named = "rank " + std::to_string(c.victim);
  for (int r = 0; r < c.ranks; ++r) {
    if (r == c.victim) continue;
    const RankReport& p = job.report(r);
    EXPECT_EQ(p.code, static_cast<int>(StatusCode::kPeerFailure)) << "rank " << r << ": " << p.message;
    EXPECT_NE(p.message.find(named), std::string::npos) << "rank " << r << " should name the victim: " << p.message;
    EXPECT_LT(seconds_between(killed, p.fail_ns), 2.0) << "rank " << r << ": " << p.message;
    EXPECT_GE(p.close_ms, 0);
    EXPECT_LT(p.close_ms, 3000) << "rank " << r << ": closing after the death took " << p.close_ms << " ms";
  }
}

INSTANTIATE_TEST_SUITE_P(Fault, FaultKill,
                         ::testing::Values(KillCase{"ag_gemm", 2, 1, 1}, KillCase{"gemm_rs", 2, 1, 1},
                                           KillCase{"gemm_ar", 2, 1, 1}, KillCase{"ag_gemm", 3, 1, 0},
                                           KillCase{"gemm_ar", 3, 1, 2}, KillCase{"ag_gemm", 2, 2, 1},
                                           KillCase{"gemm_rs", 2, 2, 0}, KillCase{"gemm_ar", 2, 2, 1},
                                           KillCase{"ring_attention", 2, 1, 1}, KillCase{"ring_attention", 3, 1, 0},
                                           KillCase{"moe", 2, 1, 1}, KillCase{"moe", 3, 1, 2},
                                           KillCase{"moe_dispatch_gemm", 2, 1, 1}, KillCase{"moe", 2, 2, 1},
                                           KillCase{"moe_dispatch_gemm", 2, 2, 0}, KillCase{"ring_attention", 2, 2, 1},
                                           KillCase{"moe_layer", 2, 1, 1}, KillCase{"moe_layer", 3, 1, 0},
                                           KillCase{"moe_layer", 2, 2, 1}),
                         [](const ::testing::TestParamInfo<KillCase>& info) {
                           return std::string(info.param.op) + "_" + std::to_string(info.param.ranks) + "ranks_" +
                                  std::to_string(info.param.nodes) + "nodes_kill" + std::to_string(info.param.victim);
                         });

// ---- SIGSTOP past the deadline, then SIGCONT (H3) ------------------------------------------------

class FaultStop : public ::testing::TestWithParam<int> {};

TEST_P(FaultStop, ResumedRankIsFailedAndNoCallOfItSucceeds) {
  SKIP_UNLESS_SUPERVISOR();
  const int victim = GetParam();
  constexpr int kRanks = 3;
  constexpr double kOpTimeoutS = 2.0;
  Job job(kRanks, "stop:gemm_rs");
  ASSERT_TRUE(job.all_ready()) << describe(job, kRanks);
  std::this_thread::sleep_for(300ms);
  const int64_t stopped = now_ns();
  ASSERT_EQ(::kill(job.pid(victim), SIGSTOP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(kOpTimeoutS * 1000) + 2500));
  const int64_t resumed = now_ns();
  ASSERT_EQ(::kill(job.pid(victim), SIGCONT), 0);
  ASSERT_TRUE(job.reports()) << describe(job, kRanks);
  for (int r = 0; r < kRanks; ++r) {
    const RankReport& p = job.report(r);
    ASSERT_GE(p.code, 0) << "rank " << r << " never failed: " << p.message;
    if (r == victim) {
      EXPECT_LT(p.last_ok_ns, resumed) << "a call of the resumed rank succeeded: " << describe(job, kRanks);
      EXPECT_GT(p.fail_ns, resumed);
      EXPECT_LT(seconds_between(resumed, p.fail_ns), 2.0) << p.message;
    } else {
      EXPECT_TRUE(p.code == static_cast<int>(StatusCode::kTimeout) || p.code == static_cast<int>(StatusCode::kPeerFailure))
          << "rank " << r << ": " << p.message;
      EXPECT_LT(seconds_between(stopped, p.fail_ns), kOpTimeoutS + 3.0) << "rank " << r << ": " << p.message;
    }
    EXPECT_LT(p.close_ms, 3000) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Fault, FaultStop, ::testing::Values(1, 0),
                         [](const ::testing::TestParamInfo<int>& info) { return "stop_rank" + std::to_string(info.param); });

// ---- a rank that cannot start (H6) ------------------------------------------------------------

struct EarlyCase {
  const char* how;  // bad_env | no_gpu
  int victim;
};

class FaultBeforeJoin : public ::testing::TestWithParam<EarlyCase> {};

TEST_P(FaultBeforeJoin, TheOthersFailWithinTwoSecondsNamingIt) {
  SKIP_UNLESS_SUPERVISOR();
  const EarlyCase c = GetParam();
  constexpr int kRanks = 3;
  std::vector<std::vector<std::string>> env(kRanks);
  if (std::string(c.how) == "no_gpu") env[c.victim].push_back("CUDA_VISIBLE_DEVICES=");
  Job job(kRanks, "before_join:" + std::string(c.how) + ":" + std::to_string(c.victim), 1, env);
  ASSERT_TRUE(job.reports()) << describe(job, kRanks);
  const std::string named = "rank " + std::to_string(c.victim) + ": could not start";
  const std::string why = std::string(c.how) == "bad_env" ? "LOOM_TIMEOUT_MS" : "GPU";
  for (int r = 0; r < kRanks; ++r) {
    const RankReport& p = job.report(r);
    if (r == c.victim) {
      EXPECT_NE(p.code, -1) << "the rank that cannot start was created: " << p.message;
      EXPECT_NE(p.message.find(why), std::string::npos) << p.message;
      continue;
    }
    EXPECT_EQ(p.code, static_cast<int>(StatusCode::kPeerFailure)) << "rank " << r << ": " << p.message;
    EXPECT_NE(p.message.find(named), std::string::npos) << "rank " << r << ": " << p.message;
    EXPECT_NE(p.message.find(why), std::string::npos) << "rank " << r << ": " << p.message;
    EXPECT_LT(seconds_between(p.last_ok_ns, p.fail_ns), 2.0) << "rank " << r << ": " << p.message;
  }
}

INSTANTIATE_TEST_SUITE_P(Fault, FaultBeforeJoin,
                         ::testing::Values(EarlyCase{"bad_env", 1}, EarlyCase{"bad_env", 0}, EarlyCase{"no_gpu", 2},
                                           EarlyCase{"no_gpu", 0}),
                         [](const ::testing::TestParamInfo<EarlyCase>& info) {
                           return std::string(info.param.how) + "_rank" + std::to_string(info.param.victim);
                         });

// ---- two communicators, one rank killed (H5, R2) -------------------------------------------------

TEST(FaultTwoComms, BothFailAndBothCloseWithinThreeSeconds) {
  SKIP_UNLESS_SUPERVISOR();
  constexpr int kRanks = 2;
  Job job(kRanks, "two_comms");
  ASSERT_TRUE(job.all_ready()) << describe(job, kRanks);
  std::this_thread::sleep_for(300ms);
  const int64_t killed = now_ns();
  ASSERT_EQ(::kill(job.pid(1), SIGKILL), 0);
  ASSERT_TRUE(job.reports(1)) << describe(job, kRanks);
  const RankReport& p = job.report(0);
  EXPECT_EQ(p.code, static_cast<int>(StatusCode::kPeerFailure)) << p.message;
  EXPECT_NE(p.message.find("rank 1"), std::string::npos) << p.message;
  EXPECT_LT(seconds_between(killed, p.fail_ns), 2.0) << p.message;
  EXPECT_NE(p.message.find("other communicator: "), std::string::npos) << p.message;
  EXPECT_EQ(p.message.find("other communicator: ok"), std::string::npos) << p.message;
  EXPECT_EQ(p.message.find("no failure"), std::string::npos) << p.message;
  EXPECT_GE(p.close_ms, 0);
  EXPECT_LT(p.close_ms, 3000) << "closing both after the death took " << p.close_ms << " ms";
}

}  // namespace
}  // namespace loom
