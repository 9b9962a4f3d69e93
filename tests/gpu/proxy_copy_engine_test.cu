// The proxy over the copy_engine transport on real GPUs (>= 2 ranks under loom-run; rank r sends
// to rank r + 1 and receives from rank r - 1).
//
//   CpuProducerBitExactFromOneByteTo64MiB   a CPU producer pushes one write per size; a kernel on
//                                           the receiver waits for each flag (acquire, system
//                                           scope) and checks the message at that moment: any
//                                           byte missing means the flag came before the data
//   GpuProducersThroughAMappedRing          64 CTAs push 4096 commands through the device-side
//                                           producer (command_ring.cuh) into a 256-slot mapped
//                                           ring (it wraps and fills), same checks
//   StalledProxyEndsTheGpuProducersWait     paused proxy: a kernel pushing into the full ring ends
//                                           with the timeout error record; the context stays usable
//   ShapingHoldsTheEmulatedRateAndLatency   LOOM_EMULATE_NET_* style shaping within +-15%
//   SameGpuWriteLandsWhileAKernelHoldsEverySm  a write and its flag into another buffer of this
//                                           GPU land while a kernel of this process occupies
//                                           every SM and waits for them (ranks sharing a GPU:
//                                           a same-GPU cudaMemcpyAsync needs SMs and never ran)
//
// Every verdict is agreed over the bootstrap, so a failure on one rank fails the test everywhere.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/comm/command_ring.cuh"
#include "kernels/comm/signals.cuh"
#include "runtime/command_ring.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"
#include "runtime/device_abi.h"
#include "runtime/proxy.h"
#include "runtime/transports/copy_engine.h"
#include "runtime/transports/cuda_memory.h"
#include "runtime/transports/transport.h"
#include "tests/gpu/harness.h"

namespace loom::runtime::net {
namespace {

using namespace std::chrono_literals;

constexpr uint8_t kGuard = 0xA5;
constexpr uint64_t kGap = 256;
constexpr uint64_t kSourceSlack = 65536;

Communicator& comm() { return test::shared_comm(); }
Bootstrap& bootstrap() { return *internal(comm()).bootstrap; }
bool everyone(bool ok) { return test::all_ranks_agree(comm(), ok); }
int me() { return comm().rank(); }
int world() { return comm().world_size(); }
int next_rank() { return (me() + 1) % world(); }
int prev_rank() { return (me() + world() - 1) % world(); }

__host__ __device__ inline uint8_t payload_byte(int sender, uint64_t position) {
  uint64_t x = (position + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(sender + 1) << 56);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<uint8_t>(x);
}

__global__ void fill_pattern(uint8_t* data, uint64_t bytes, int sender) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < bytes; i += uint64_t{gridDim.x} * blockDim.x) {
    data[i] = payload_byte(sender, i);
  }
}

struct Message {
  uint64_t src_offset;
  uint64_t dst_offset;
  uint64_t length;
};

// One CTA per message (grid-stride over messages): thread 0 waits for the flag with acquire
// loads at system scope, then the CTA checks every byte of the message right away.
// `timeout_ns` bounds the whole kernel, not each message: a CTA walks several messages in turn,
// and a per-message deadline let a stalled sender keep the receiver here for (missing messages /
// grid) x timeout (270 s for 438 missing messages over 128 CTAs at 60 s each).
__global__ void check_on_flag(const uint64_t* flags, uint64_t epoch, const uint8_t* window, const Message* messages,
                              uint32_t count, int sender, uint64_t timeout_ns, unsigned* wrong_bytes, unsigned* missing) {
  __shared__ int arrived;
  const uint64_t deadline = kernels::global_timer_ns() + timeout_ns;
  for (uint32_t k = blockIdx.x; k < count; k += gridDim.x) {
    if (threadIdx.x == 0) {
      arrived = 0;
      while (true) {
        if (kernels::flag_load_acquire(&flags[k]) == epoch) {
          arrived = 1;
          break;
        }
        if (kernels::global_timer_ns() > deadline) break;
        __nanosleep(256);
      }
    }
    __syncthreads();
    if (!arrived) {
      if (threadIdx.x == 0) atomicAdd(missing, 1u);
    } else {
      const Message m = messages[k];
      unsigned wrong = 0;
      for (uint64_t i = threadIdx.x; i < m.length; i += blockDim.x) {
        wrong += window[m.dst_offset + i] != payload_byte(sender, m.src_offset + i) ? 1u : 0u;
      }
      if (wrong != 0) atomicAdd(wrong_bytes, wrong);
    }
    __syncthreads();
  }
}

// GPU producers: CTA c pushes commands c, c + gridDim.x, ... (thread 0 of each CTA).
__global__ void push_commands(ring::RingView ring, WaitParams wait, uint64_t epoch, const Message* messages,
                              uint32_t count, uint32_t dst_rank, unsigned* failed) {
  if (threadIdx.x != 0) return;
  const kernels::WaitContext ctx = kernels::WaitContext::start(wait, OpId::kSelfTest, epoch);
  for (uint32_t k = blockIdx.x; k < count; k += gridDim.x) {
    const Message m = messages[k];
    if (!kernels::ring_push_write(ring, dst_rank, m.src_offset, m.dst_offset, m.length, k, epoch, ctx)) {
      atomicAdd(failed, 1u);
      return;
    }
  }
}

// Host-mapped wait words for kernels that are not loom operators.
struct WaitWords {
  uint32_t* host_abort = nullptr;   // host-mapped
  uint32_t* device_abort = nullptr; // device
  ErrorRecord* error = nullptr;     // host-mapped
  WaitWords() {
    cudaHostAlloc(reinterpret_cast<void**>(&host_abort), sizeof(uint32_t), cudaHostAllocMapped);
    cudaHostAlloc(reinterpret_cast<void**>(&error), sizeof(ErrorRecord), cudaHostAllocMapped);
    cudaMalloc(reinterpret_cast<void**>(&device_abort), sizeof(uint32_t));
    *host_abort = 0;
    std::memset(error, 0, sizeof(ErrorRecord));
    cudaMemset(device_abort, 0, sizeof(uint32_t));
  }
  ~WaitWords() {
    cudaFreeHost(host_abort);
    cudaFreeHost(error);
    cudaFree(device_abort);
  }
  WaitParams params(uint64_t timeout_ns) const {
    WaitParams p{};
    p.timeout_ns = timeout_ns;
    uint32_t* host_abort_device = nullptr;
    ErrorRecord* error_device = nullptr;
    cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_abort_device), host_abort, 0);
    cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device), error, 0);
    p.host_abort = host_abort_device;
    p.device_abort = device_abort;
    p.error = error_device;
    return p;
  }
};

// Wait words of a CPU producer: plain host memory.
struct HostWaitWords {
  uint32_t host_abort = 0;
  uint32_t abort = 0;
  ErrorRecord error{};
  WaitParams params() { return WaitParams{0, &host_abort, &abort, &error}; }
};

// One rank's side of a transfer test: buffers, transport, windows, proxy.
struct Endpoint {
  uint8_t* source = nullptr;
  uint64_t source_bytes = 0;
  uint8_t* window = nullptr;
  uint64_t window_bytes = 0;
  uint64_t* flags = nullptr;
  uint32_t flag_count = 0;
  std::unique_ptr<Transport> transport;
  WindowTable table;
  std::unique_ptr<Proxy> proxy;

  // Collective. Legacy CUDA IPC forbids freeing an exported allocation while a peer still has it
  // open: every rank stops its proxy and closes its transport (its IPC mappings of the peers'
  // buffers), all meet, then each frees its own buffers.
  Status teardown() {
    const Status stopped = proxy ? proxy->stop() : Status{};
    const Status closed = transport ? transport->close() : Status{};
    const Status met = bootstrap().barrier();
    release();
    return !stopped.ok() ? stopped : !closed.ok() ? closed : met;
  }
  void release() {
    cudaFree(source);
    cudaFree(window);
    cudaFree(flags);
    source = window = nullptr;
    flags = nullptr;
  }
  ~Endpoint() {
    // Only reached without teardown() when a test failed early (every rank alike).
    if (proxy) (void)proxy->stop();
    if (transport) (void)transport->close();
    release();
  }
};

// Collective. Creates this rank's endpoint with a proxy serving `ring`.
Status make_endpoint(Endpoint& e, uint64_t source_bytes, uint64_t window_bytes, uint32_t flag_count,
                     const ring::RingView& ring, const CopyEngineOptions& shaping = {}) {
  LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&e.source), source_bytes));
  LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&e.window), window_bytes));
  LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&e.flags), flag_count * sizeof(uint64_t)));
  e.source_bytes = source_bytes;
  e.window_bytes = window_bytes;
  e.flag_count = flag_count;
  fill_pattern<<<256, 256>>>(e.source, source_bytes, me());
  LOOM_CUDA_TRY(cudaGetLastError());
  LOOM_CUDA_TRY(cudaMemset(e.window, kGuard, window_bytes));
  LOOM_CUDA_TRY(cudaMemset(e.flags, 0, flag_count * sizeof(uint64_t)));
  LOOM_CUDA_TRY(cudaDeviceSynchronize());

  TransportConfig config{me(), world(), std::vector<bool>(static_cast<size_t>(world()), false)};
  config.peers[next_rank()] = true;
  config.peers[prev_rank()] = true;
  CopyEngineOptions options = shaping;
  options.device = comm().device();
  LOOM_ASSIGN_OR_RETURN(e.transport, create_copy_engine_transport(config, options));
  LocalWindows mine;
  LOOM_ASSIGN_OR_RETURN(mine.source, e.transport->register_memory({e.source, source_bytes, MemoryKind::kDevice, comm().device()}));
  LOOM_ASSIGN_OR_RETURN(mine.data, e.transport->register_memory({e.window, window_bytes, MemoryKind::kDevice, comm().device()}));
  LOOM_ASSIGN_OR_RETURN(mine.flags, e.transport->register_memory({e.flags, flag_count * sizeof(uint64_t), MemoryKind::kDevice,
                                                                  comm().device()}));
  LOOM_TRY(exchange_endpoints(bootstrap(), *e.transport));
  LOOM_ASSIGN_OR_RETURN(e.table, exchange_windows(bootstrap(), *e.transport, config, mine));
  ProxyOptions proxy_options;
  proxy_options.epochs = EpochRange{1, 1 << 20};
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), comm().device()) == cudaSuccess) proxy_options.gpu_pci_bus_id = bus_id;
  LOOM_ASSIGN_OR_RETURN(e.proxy, Proxy::start({ProxyLane{ring, e.transport.get(), e.table}}, proxy_options));
  return {};
}

std::vector<uint64_t> size_sweep() {
  std::vector<uint64_t> sizes;
  for (uint64_t p = 1; p <= (uint64_t{64} << 20); p *= 4) {
    const bool neighbours = p < (uint64_t{1} << 20);
    if (p > 1 && neighbours) sizes.push_back(p - 1);
    sizes.push_back(p);
    if (neighbours) sizes.push_back(p + 1);
  }
  return sizes;
}

std::vector<Message> layout(const std::vector<uint64_t>& sizes, uint64_t* window_bytes) {
  std::vector<Message> messages;
  uint64_t at = kGap;
  for (size_t k = 0; k < sizes.size(); ++k) {
    messages.push_back(Message{(k * 977) % kSourceSlack, at, sizes[k]});
    at = (at + sizes[k] + kGap + 255) & ~uint64_t{255};
  }
  *window_bytes = at;
  return messages;
}

// The receiver's check, in three steps so that no CUDA call that may synchronize the device
// (cudaMalloc, cudaFree, synchronous cudaMemcpy) runs while a producer kernel of this GPU is live:
// such a call waits for that kernel and, while it waits, blocks the proxy thread's CUDA calls
// (cudaMemcpyAsync, cudaEventQuery) — the kernel then waits for ring space the proxy can never
// free until its own deadline (the known "cudaFree while NCCL kernels run" hang). Only run()
// executes concurrently with the producer; prepare() and finish() run when no kernel is live.
struct Receiver {
  Message* device_messages = nullptr;
  unsigned* counters = nullptr;  // [wrong bytes, missing messages]
  unsigned host_counters[2] = {0, 0};
  cudaError_t kernel_error = cudaSuccess;

  // Bounds the whole check kernel: longer than any producer's own bounded wait (30 s), so a
  // healthy but slow sender is not misreported, and short enough that a failed test ends well
  // within the bootstrap's 60 s timeout on every rank (the verdict all-gather must not time out).
  static constexpr uint64_t kTimeoutNs = 35'000'000'000ull;

  Status prepare(const std::vector<Message>& messages) {
    LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&device_messages), messages.size() * sizeof(Message)));
    LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&counters), 2 * sizeof(unsigned)));
    LOOM_CUDA_TRY(cudaMemcpy(device_messages, messages.data(), messages.size() * sizeof(Message), cudaMemcpyHostToDevice));
    LOOM_CUDA_TRY(cudaMemset(counters, 0, 2 * sizeof(unsigned)));
    LOOM_CUDA_TRY(cudaDeviceSynchronize());
    return {};
  }
  // The concurrent part: the kernel launch and a wait on its own stream, nothing else.
  void run(const Endpoint& e, uint32_t count, uint64_t epoch, cudaStream_t stream) {
    const uint32_t grid = std::min<uint32_t>(count, 128);
    check_on_flag<<<grid, 512, 0, stream>>>(e.flags, epoch, e.window, device_messages, count, prev_rank(), kTimeoutNs,
                                            counters, counters + 1);
    kernel_error = cudaGetLastError();
    const cudaError_t synced = cudaStreamSynchronize(stream);
    if (kernel_error == cudaSuccess) kernel_error = synced;
  }
  // After every kernel of this GPU has ended: the verdict ("" = ok), the guard bytes, the frees.
  std::string finish(const Endpoint& e, const std::vector<Message>& messages) {
    std::string verdict;
    cudaMemcpy(host_counters, counters, sizeof(host_counters), cudaMemcpyDeviceToHost);
    if (kernel_error != cudaSuccess) verdict = std::string("check kernel: ") + cudaGetErrorString(kernel_error) + "; ";
    if (host_counters[0] != 0) verdict += std::to_string(host_counters[0]) + " bytes wrong when their flag was seen; ";
    if (host_counters[1] != 0) verdict += std::to_string(host_counters[1]) + " messages never flagged; ";
    // Guards: everything outside the messages keeps its pattern.
    std::vector<uint8_t> window(e.window_bytes);
    cudaMemcpy(window.data(), e.window, e.window_bytes, cudaMemcpyDeviceToHost);
    std::vector<bool> written(window.size(), false);
    for (const Message& m : messages) std::fill(written.begin() + m.dst_offset, written.begin() + m.dst_offset + m.length, true);
    size_t bad_guards = 0;
    for (size_t i = 0; i < window.size(); ++i) bad_guards += (!written[i] && window[i] != kGuard) ? 1 : 0;
    if (bad_guards != 0) verdict += std::to_string(bad_guards) + " guard bytes overwritten; ";
    cudaFree(device_messages);
    cudaFree(counters);
    device_messages = nullptr;
    counters = nullptr;
    return verdict;
  }
};

TEST(ProxyCopyEngine, CpuProducerBitExactFromOneByteTo64MiB) {
  if (world() < 2) GTEST_SKIP() << "needs at least 2 ranks";
  const std::vector<uint64_t> sizes = size_sweep();
  uint64_t window_bytes = 0;
  const std::vector<Message> messages = layout(sizes, &window_bytes);
  Result<ring::HostRing> host_ring = ring::HostRing::create(256);
  ASSERT_TRUE(host_ring.ok());
  Endpoint e;
  Status made = make_endpoint(e, (uint64_t{64} << 20) + kSourceSlack, window_bytes, static_cast<uint32_t>(messages.size()),
                              host_ring->view());
  ASSERT_TRUE(everyone(made.ok())) << made.to_string();
  cudaStream_t stream;
  LOOM_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  LOOM_ASSERT_OK(bootstrap().barrier());

  // The receiver's check kernel runs while the peer's CPU producer pushes.
  Receiver check;
  LOOM_ASSERT_OK(check.prepare(messages));
  std::thread receiver([&] {
    cudaSetDevice(comm().device());
    check.run(e, static_cast<uint32_t>(messages.size()), /*epoch=*/3, stream);
  });
  HostWaitWords words;
  ring::CpuProducer producer(host_ring->view(), words.params(), 30s);
  bool pushed = true;
  for (size_t k = 0; k < messages.size() && pushed; ++k) {
    ring::Command c{};
    c.header = ring::type_only_header(ring::CommandType::kWrite);
    c.dst_rank = static_cast<uint32_t>(next_rank());
    c.flag_index = static_cast<uint32_t>(k);
    c.epoch = 3;
    c.flag_value = 3;
    c.src_offset = messages[k].src_offset;
    c.dst_offset = messages[k].dst_offset;
    c.length = messages[k].length;
    pushed = producer.push(c);
  }
  receiver.join();
  const std::string verdict = check.finish(e, messages);
  const Status drained = e.proxy->drain(30s);
  EXPECT_TRUE(pushed);
  EXPECT_TRUE(drained.ok()) << drained.to_string();
  EXPECT_EQ(verdict, "") << "rank " << me() << " receiving from rank " << prev_rank();
  EXPECT_TRUE(everyone(pushed && drained.ok() && verdict.empty()));
  LOOM_ASSERT_OK(e.teardown());  // after everyone received: nobody frees a window a peer still writes
  cudaStreamDestroy(stream);
}

TEST(ProxyCopyEngine, GpuProducersThroughAMappedRing) {
  if (world() < 2) GTEST_SKIP() << "needs at least 2 ranks";
  // Ranks sharing a GPU move each write through host memory, and a copy engine queue makes about
  // one copy per millisecond while a kernel of its process runs (H200, measured): fewer commands
  // there, still two or more laps of the 256-slot ring.
  const uint32_t commands = std::max(512u, 4096u / static_cast<uint32_t>(comm().ranks_on_gpu()));
  constexpr uint64_t kLength = 4096 + 13;  // not a multiple of anything convenient
  std::vector<Message> messages;
  uint64_t at = kGap;
  for (uint32_t k = 0; k < commands; ++k) {
    messages.push_back(Message{(k * 4099ull) % kSourceSlack, at, kLength - (k % 7)});
    at += kLength + kGap;
  }
  Result<MappedRing> mapped = MappedRing::create(256);
  ASSERT_TRUE(mapped.ok()) << mapped.status().to_string();
  Endpoint e;
  Status made = make_endpoint(e, 2 * kSourceSlack, at, commands, mapped->host_view());
  ASSERT_TRUE(everyone(made.ok())) << made.to_string();
  cudaStream_t producer_stream, check_stream;
  LOOM_ASSERT_CUDA(cudaStreamCreateWithFlags(&producer_stream, cudaStreamNonBlocking));
  LOOM_ASSERT_CUDA(cudaStreamCreateWithFlags(&check_stream, cudaStreamNonBlocking));
  LOOM_ASSERT_OK(bootstrap().barrier());

  // Everything allocated before the check kernel spins (allocation calls may synchronize).
  Message* device_messages = nullptr;
  unsigned* failed = nullptr;
  LOOM_ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&device_messages), messages.size() * sizeof(Message)));
  LOOM_ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&failed), sizeof(unsigned)));
  LOOM_ASSERT_CUDA(cudaMemcpy(device_messages, messages.data(), messages.size() * sizeof(Message), cudaMemcpyHostToDevice));
  LOOM_ASSERT_CUDA(cudaMemset(failed, 0, sizeof(unsigned)));
  WaitWords words;
  Receiver check;
  LOOM_ASSERT_OK(check.prepare(messages));
  LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
  // From the producer's launch until both kernels have ended, this process makes no CUDA call
  // that may synchronize the device (see Receiver): the proxy thread must keep its CUDA calls.
  std::thread receiver([&] {
    cudaSetDevice(comm().device());
    check.run(e, commands, /*epoch=*/7, check_stream);
  });
  push_commands<<<64, 32, 0, producer_stream>>>(mapped->device_view(), words.params(30'000'000'000ull), 7, device_messages,
                                                commands, static_cast<uint32_t>(next_rank()), failed);
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t produced = cudaStreamSynchronize(producer_stream);
  receiver.join();  // before any ASSERT: the thread must not outlive the test's objects
  LOOM_ASSERT_CUDA(launched);
  LOOM_ASSERT_CUDA(produced);
  unsigned host_failed = 0;
  LOOM_ASSERT_CUDA(cudaMemcpy(&host_failed, failed, sizeof(unsigned), cudaMemcpyDeviceToHost));
  const std::string verdict = check.finish(e, messages);
  const Status drained = e.proxy->drain(30s);
  const ErrorRecord& r = *words.error;
  EXPECT_EQ(host_failed, 0u) << "producer error record: code " << r.code << ", kind " << r.flag_kind << ", index "
                             << r.flag_index << ", CTA " << r.cta << ", observed " << r.observed << ", waited "
                             << r.waited_ns / 1'000'000 << " ms; proxy took " << e.proxy->stats().commands;
  EXPECT_TRUE(drained.ok()) << drained.to_string();
  EXPECT_EQ(e.proxy->stats().commands, commands);
  EXPECT_EQ(verdict, "");
  EXPECT_TRUE(everyone(host_failed == 0 && drained.ok() && verdict.empty()));
  LOOM_ASSERT_OK(e.teardown());
  cudaFree(device_messages);
  cudaFree(failed);
  cudaStreamDestroy(producer_stream);
  cudaStreamDestroy(check_stream);
}

// Local only (no peer traffic): a paused proxy, a kernel filling its ring, the bounded wait.
TEST(ProxyCopyEngine, StalledProxyEndsTheGpuProducersWait) {
  Result<MappedRing> mapped = MappedRing::create(16, /*ring_index=*/2);
  ASSERT_TRUE(mapped.ok()) << mapped.status().to_string();
  TransportConfig config{me(), world(), std::vector<bool>(static_cast<size_t>(world()), false)};
  CopyEngineOptions options;
  options.device = comm().device();
  Result<std::unique_ptr<Transport>> transport = create_copy_engine_transport(config, options);
  ASSERT_TRUE(transport.ok()) << transport.status().to_string();
  WindowTable table;
  table.rank = me();
  table.world_size = world();
  table.destinations.resize(static_cast<size_t>(world()));
  ProxyOptions proxy_options;
  proxy_options.stall_limit = 100ms;
  Result<std::unique_ptr<Proxy>> proxy = Proxy::start({ProxyLane{mapped->host_view(), transport->get(), table}}, proxy_options);
  ASSERT_TRUE(proxy.ok());
  (*proxy)->pause_for_test(true);

  std::vector<Message> messages(17, Message{0, 0, 8});  // one more than the ring holds
  Message* device_messages = nullptr;
  unsigned* failed = nullptr;
  LOOM_ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&device_messages), messages.size() * sizeof(Message)));
  LOOM_ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&failed), sizeof(unsigned)));
  LOOM_ASSERT_CUDA(cudaMemcpy(device_messages, messages.data(), messages.size() * sizeof(Message), cudaMemcpyHostToDevice));
  LOOM_ASSERT_CUDA(cudaMemset(failed, 0, sizeof(unsigned)));
  WaitWords words;
  const auto begin = std::chrono::steady_clock::now();
  push_commands<<<1, 32>>>(mapped->device_view(), words.params(200'000'000ull), 11, device_messages, 17, 0, failed);
  LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto waited = std::chrono::steady_clock::now() - begin;
  unsigned host_failed = 0;
  LOOM_ASSERT_CUDA(cudaMemcpy(&host_failed, failed, sizeof(unsigned), cudaMemcpyDeviceToHost));
  EXPECT_EQ(host_failed, 1u);
  EXPECT_LT(waited, 1200ms) << "T_op + 1 s";
  EXPECT_EQ(words.error->code, static_cast<uint32_t>(DeviceError::kTimeout));
  EXPECT_EQ(words.error->flag_kind, static_cast<uint32_t>(ring::kRingSpaceFlagKind));
  EXPECT_EQ(words.error->flag_index, 2u) << "the ring index";
  EXPECT_EQ(words.error->waited_on, -1);
  EXPECT_EQ(words.error->epoch, 11u);
  EXPECT_EQ(words.error->observed, 0u) << "the tail never moved";
  EXPECT_EQ((*proxy)->health().code(), StatusCode::kTimeout) << (*proxy)->health().to_string();
  // The context is still usable.
  LOOM_ASSERT_CUDA(cudaMemset(failed, 0, sizeof(unsigned)));
  LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
  // Resumed, the proxy takes the 16 published commands and rejects them (this test has no peers).
  (*proxy)->pause_for_test(false);
  EXPECT_TRUE((*proxy)->stop().ok());
  cudaFree(device_messages);
  cudaFree(failed);
  EXPECT_TRUE(everyone(host_failed == 1));
}

// Fills every thread slot of every SM (a grid of SMs x resident CTAs of 1024 threads), then thread
// 0 of each CTA waits, bounded, for the flag; CTA 0 checks the data it guards. results: [0] CTAs
// that saw the flag, [1] bytes wrong at that moment.
__global__ void __launch_bounds__(1024, 1) hold_every_sm_until_flag(const uint64_t* flag, uint64_t value, const uint8_t* data,
                                                                     uint64_t bytes, int sender, uint64_t timeout_ns,
                                                                     unsigned* results) {
  __shared__ int arrived;
  if (threadIdx.x == 0) {
    const uint64_t deadline = kernels::global_timer_ns() + timeout_ns;
    arrived = 0;
    while (kernels::global_timer_ns() < deadline) {
      if (kernels::flag_load_acquire(flag) == value) {
        arrived = 1;
        break;
      }
      __nanosleep(256);
    }
    if (arrived) atomicAdd(&results[0], 1u);
  }
  __syncthreads();
  if (arrived && blockIdx.x == 0) {
    unsigned wrong = 0;
    for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) wrong += data[i] != payload_byte(sender, i) ? 1u : 0u;
    if (wrong != 0) atomicAdd(&results[1], wrong);
  }
}

// The root cause of the multi-node hangs on a shared GPU (docs/NETWORK.md): the transport's write
// between two buffers of one GPU must land without the SMs. Local: the "peer" is this process.
TEST(ProxyCopyEngine, SameGpuWriteLandsWhileAKernelHoldsEverySm) {
  constexpr uint64_t kBytes = (uint64_t{9} << 20) + 5;  // three bounce pieces, the last one odd
  constexpr uint64_t kValue = 0x5a5a0001;
  uint8_t* source = nullptr;
  uint8_t* window = nullptr;
  uint64_t* flag = nullptr;
  unsigned* results = nullptr;
  LOOM_ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&source), kBytes));
  LOOM_ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&window), kBytes));
  LOOM_ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&flag), sizeof(uint64_t)));
  LOOM_ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&results), 2 * sizeof(unsigned)));
  fill_pattern<<<256, 256>>>(source, kBytes, 3);
  LOOM_ASSERT_CUDA(cudaMemset(window, 0, kBytes));
  LOOM_ASSERT_CUDA(cudaMemset(flag, 0, sizeof(uint64_t)));
  LOOM_ASSERT_CUDA(cudaMemset(results, 0, 2 * sizeof(unsigned)));
  LOOM_ASSERT_CUDA(cudaDeviceSynchronize());

  // Rank 0 of a world of 2 whose "rank 1" is this process: map_peer hands back the owner's address.
  TransportConfig config{0, 2, {false, true}};
  CopyEngineOptions options;
  options.device = comm().device();
  options.map_peer = [](int, uint64_t owner_address, uint64_t) { return reinterpret_cast<void*>(owner_address); };
  Result<std::unique_ptr<Transport>> made = create_copy_engine_transport(config, options);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  Transport& t = **made;
  Result<LocalRegistration> src = t.register_memory({source, kBytes, MemoryKind::kDevice, comm().device()});
  Result<LocalRegistration> win = t.register_memory({window, kBytes, MemoryKind::kDevice, comm().device()});
  Result<LocalRegistration> flg = t.register_memory({flag, sizeof(uint64_t), MemoryKind::kDevice, comm().device()});
  ASSERT_TRUE(src.ok() && win.ok() && flg.ok());
  Result<uint32_t> remote_window = t.import_remote(1, win->remote_key, kBytes);
  Result<uint32_t> remote_flag = t.import_remote(1, flg->remote_key, sizeof(uint64_t));
  ASSERT_TRUE(remote_window.ok() && remote_flag.ok()) << remote_window.status().to_string();

  int per_sm = 0;
  LOOM_ASSERT_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, hold_every_sm_until_flag, 1024, 0));
  cudaStream_t stream = nullptr;
  LOOM_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const uint32_t grid = static_cast<uint32_t>(comm().sm_count() * per_sm);
  hold_every_sm_until_flag<<<grid, 1024, 0, stream>>>(flag, kValue, window, kBytes, 3, 5'000'000'000ull, results);
  LOOM_ASSERT_CUDA(cudaGetLastError());
  std::this_thread::sleep_for(20ms);  // the grid is resident before the copy is posted

  const WriteOp write{1, 1, src->handle, 0, *remote_window, 0, kBytes};
  Result<size_t> posted = t.post_writes(std::span<const WriteOp>(&write, 1));
  ASSERT_TRUE(posted.ok() && *posted == 1) << posted.status().to_string();
  Result<bool> flagged = t.post_flag(FlagOp{2, 1, *remote_flag, 0, kValue});
  ASSERT_TRUE(flagged.ok() && *flagged);
  std::vector<Completion> done;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (done.size() < 2 && std::chrono::steady_clock::now() < deadline) {
    ASSERT_TRUE(t.poll(done).ok());
    std::this_thread::yield();
  }
  LOOM_ASSERT_CUDA(cudaStreamSynchronize(stream));
  unsigned host[2] = {0, 0};
  LOOM_ASSERT_CUDA(cudaMemcpy(host, results, sizeof(host), cudaMemcpyDeviceToHost));
  EXPECT_EQ(done.size(), 2u);
  for (const Completion& c : done) EXPECT_TRUE(c.status.ok()) << c.status.to_string();
  EXPECT_EQ(host[0], grid) << "CTAs that saw the flag while the grid held every SM";
  EXPECT_EQ(host[1], 0u) << "bytes wrong when the flag was seen";
  EXPECT_TRUE(t.close().ok());
  cudaStreamDestroy(stream);
  cudaFree(source);
  cudaFree(window);
  cudaFree(flag);
  cudaFree(results);
  EXPECT_TRUE(everyone(host[0] == grid && host[1] == 0));
}

TEST(ProxyCopyEngine, ShapingHoldsTheEmulatedRateAndLatency) {
  if (world() < 2) GTEST_SKIP() << "needs at least 2 ranks";
  if (comm().ranks_on_gpu() > 1) GTEST_SKIP() << "times the emulated link: ranks sharing a GPU measure no speed";
  constexpr double kGbps = 10.0;
  constexpr double kLatencyUs = 2000.0;
  constexpr uint64_t kChunk = uint64_t{64} << 20;
  constexpr int kChunks = 8;  // 512 MiB: ~54 ms at 10 GB/s
  Result<ring::HostRing> host_ring = ring::HostRing::create(64);
  ASSERT_TRUE(host_ring.ok());
  Endpoint e;
  CopyEngineOptions shaping;
  shaping.emulate_gbps = kGbps;
  shaping.emulate_latency_us = kLatencyUs;
  Status made = make_endpoint(e, kChunk, kChunk, 64, host_ring->view(), shaping);
  ASSERT_TRUE(everyone(made.ok())) << made.to_string();
  LOOM_ASSERT_OK(bootstrap().barrier());
  HostWaitWords words;
  ring::CpuProducer producer(host_ring->view(), words.params(), 30s);
  auto completions = [&] { return e.proxy->stats().completions; };
  auto wait_for = [&](uint64_t target) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (completions() < target && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20us);
  };
  auto write = [&](uint64_t bytes, uint32_t flag) {
    ring::Command c{};
    c.header = ring::type_only_header(ring::CommandType::kWrite);
    c.dst_rank = static_cast<uint32_t>(next_rank());
    c.flag_index = flag;
    c.epoch = 1;
    c.flag_value = 1;
    c.length = bytes;
    return producer.push(c);
  };

  // Latency: 10 lone 8-byte writes (no flag), each timed from push to completion.
  std::vector<double> latencies_us;
  for (int i = 0; i < 10; ++i) {
    const uint64_t before = completions();
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(write(8, ring::kNoFlag));
    wait_for(before + 1);
    latencies_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(latencies_us.begin(), latencies_us.end());
  const double median_latency = latencies_us[latencies_us.size() / 2];

  // Rate: 512 MiB in 64 MiB writes, timed from the first push to the last completion.
  const uint64_t before = completions();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kChunks; ++i) ASSERT_TRUE(write(kChunk, ring::kNoFlag));
  wait_for(before + kChunks);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double gbps = kChunks * static_cast<double>(kChunk) / seconds / 1e9;
  // The rate run includes one latency (the last write's); take it out.
  const double gbps_net = kChunks * static_cast<double>(kChunk) / (seconds - kLatencyUs * 1e-6) / 1e9;

  EXPECT_NEAR(median_latency, kLatencyUs, 0.15 * kLatencyUs) << "median push-to-completion latency, us";
  EXPECT_NEAR(gbps_net, kGbps, 0.15 * kGbps) << "measured " << gbps << " GB/s gross";
  RecordProperty("latency_us", std::to_string(median_latency));
  RecordProperty("gbps", std::to_string(gbps_net));
  EXPECT_TRUE(everyone(std::abs(median_latency - kLatencyUs) <= 0.15 * kLatencyUs &&
                       std::abs(gbps_net - kGbps) <= 0.15 * kGbps));
  LOOM_ASSERT_OK(e.teardown());
}

}  // namespace
}  // namespace loom::runtime::net
