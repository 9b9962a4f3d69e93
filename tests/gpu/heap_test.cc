// Symmetric heap on real GPUs, for each backend (vmm, ipc): init self-test, bit-exact reads and
// writes through every peer mapping, equal offsets on every rank, no leak over create/destroy.
//
// The heaps under test join the job through the harness's shared communicator (its bootstrap
// and topology), so the binary never runs a second bootstrap on MASTER_PORT. Every rank runs
// every collective step even when a check fails, and verdicts are agreed over the bootstrap, so
// a failure on one rank fails the test everywhere instead of hanging the others.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "runtime/communicator_impl.h"
#include "runtime/device_abi.h"
#include "runtime/symmetric_heap.h"
#include "tests/gpu/harness.h"

namespace loom::runtime {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kHeapBytes = 64 * kMiB;
constexpr uint32_t kMaxChunksPerSource = 16;  // any value: the heap only needs the layout's prefix

Communicator& comm() { return test::shared_comm(); }
Bootstrap& bootstrap() { return *internal(comm()).bootstrap; }
const Topology& topology() { return internal(comm()).topology; }
bool everyone(bool ok) { return test::all_ranks_agree(comm(), ok); }

ControlLayout control_layout() {
  return make_control_layout(static_cast<uint32_t>(topology().local_world_size), kMaxChunksPerSource);
}

HeapOptions heap_options(env::HeapBackend backend) {
  HeapOptions options;
  options.bytes = kHeapBytes;
  options.backend = backend;
  options.device = comm().device();
  options.reserved_prefix_bytes = control_layout().bytes;
  options.self_test_offset = control_layout().self_test_offset;
  options.timeout = std::chrono::milliseconds(30'000);
  return options;
}

// Word i of the pattern rank `owner` writes: distinct per rank and per word, never all zero.
uint32_t pattern_word(int owner, size_t i) {
  return static_cast<uint32_t>((static_cast<uint64_t>(owner) + 1) * 0x9e3779b1u ^ (i * 2654435761u + 0x5bd1e995u));
}

std::vector<uint32_t> pattern(int owner, size_t words) {
  std::vector<uint32_t> v(words);
  for (size_t i = 0; i < words; ++i) v[i] = pattern_word(owner, i);
  return v;
}

// The teardown order the ipc backend needs (see SymmetricHeap::close): every rank unmaps its
// peers' heaps, all meet, then each frees its own.
Status close_everywhere(SymmetricHeap& heap) {
  Status first = heap.release_peer_mappings();
  Status met = bootstrap().barrier();
  Status closed = heap.close();
  if (!first.ok()) return first;
  return met.ok() ? closed : met;
}

size_t open_fd_count() {
  size_t count = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++count;
  return count;
}

std::string backend_test_name(const ::testing::TestParamInfo<env::HeapBackend>& info) {
  return info.param == env::HeapBackend::kVmm ? "Vmm" : "Ipc";
}

class SymmetricHeapTest : public ::testing::TestWithParam<env::HeapBackend> {};

// Creates a heap of the test's backend; a backend the node cannot provide fails the same way on
// every rank (create() decides it collectively), so skipping on `unsupported` stays in step.
#define LOOM_CREATE_HEAP_OR_SKIP(heap, options)                                               \
  Result<std::unique_ptr<SymmetricHeap>> heap##_result = SymmetricHeap::create(bootstrap(), topology(), options); \
  if (heap##_result.status().code() == StatusCode::kUnsupported) {                          \
    GTEST_SKIP() << heap##_result.status().to_string();                                      \
  }                                                                                         \
  ASSERT_TRUE(heap##_result.ok()) << heap##_result.status().to_string();                    \
  std::unique_ptr<SymmetricHeap> heap = std::move(heap##_result).value()

TEST_P(SymmetricHeapTest, CreatePassesSelfTestAndZeroesTheControlRegion) {
  const HeapOptions options = heap_options(GetParam());
  LOOM_CREATE_HEAP_OR_SKIP(heap, options);
  const int local_rank = topology().local_rank;
  const int local_world = topology().local_world_size;

  EXPECT_EQ(heap->backend(), GetParam());
  EXPECT_GE(heap->size(), kHeapBytes);
  EXPECT_EQ(heap->size() % (2 * kMiB), 0u);
  EXPECT_EQ(heap->peer_base(local_rank), heap->local_base());
  EXPECT_EQ(heap->peer_base(local_world), nullptr);

  std::vector<uint64_t> device_bases(static_cast<size_t>(local_world));
  LOOM_ASSERT_CUDA(cudaMemcpy(device_bases.data(), heap->device_peer_bases(), sizeof(uint64_t) * device_bases.size(),
                              cudaMemcpyDeviceToHost));
  for (int q = 0; q < local_world; ++q) {
    EXPECT_NE(heap->peer_base(q), nullptr);
    EXPECT_EQ(device_bases[static_cast<size_t>(q)], reinterpret_cast<uint64_t>(heap->peer_base(q))) << "local rank " << q;
  }

  // The self-test wrote into the control region; create() must have cleared it again.
  std::vector<uint8_t> prefix(options.reserved_prefix_bytes, 0xff);
  LOOM_ASSERT_CUDA(cudaMemcpy(prefix.data(), heap->local_base(), prefix.size(), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(std::all_of(prefix.begin(), prefix.end(), [](uint8_t b) { return b == 0; }));

  const char* base = static_cast<const char*>(heap->local_base());
  EXPECT_TRUE(heap->contains(base, heap->size()));
  EXPECT_FALSE(heap->contains(base, heap->size() + 1));
  EXPECT_FALSE(heap->contains(base + heap->size(), 1));
  EXPECT_FALSE(heap->contains(base - 1, 1));
  EXPECT_EQ(heap->offset_of(base + 4096), 4096u);
  EXPECT_GE(heap->allocator().begin(), options.reserved_prefix_bytes);

  LOOM_ASSERT_OK(close_everywhere(*heap));
}

// Every rank fills its own buffer, then reads every peer's copy through peer_base (copy engine
// over the mapping) and writes a slot into every peer's buffer; owners check both bit-exactly.
TEST_P(SymmetricHeapTest, EveryRankSeesEveryPeersBytesExactly) {
  if (test::process().world_size < 2) GTEST_SKIP() << "needs at least 2 ranks";
  LOOM_CREATE_HEAP_OR_SKIP(heap, heap_options(GetParam()));
  const int local_rank = topology().local_rank;
  const int local_world = topology().local_world_size;
  const std::vector<int>& peers = topology().local_peers;

  // Layout of the test's two buffers (equal offsets on every rank):
  //   owned    kOwnedWords * 4 B          written by the owner, read by everyone
  //   inbox    local_world * kSlotWords * 4 B   slot[w] written by local rank w
  constexpr size_t kOwnedWords = (8 * kMiB + 4100) / 4;  // not a round size on purpose
  constexpr size_t kSlotWords = 64 * 1024 / 4;
  Result<void*> owned = heap->allocate(kOwnedWords * 4);
  Result<void*> inbox = heap->allocate(local_world * kSlotWords * 4, 4096);
  Result<void*> outbox = heap->allocate(kSlotWords * 4);  // staging for our writes to peers
  ASSERT_TRUE(owned.ok() && inbox.ok() && outbox.ok());
  const uint64_t owned_offset = heap->offset_of(*owned);
  const uint64_t inbox_offset = heap->offset_of(*inbox);

  bool ok = true;
  const std::vector<uint32_t> mine = pattern(topology().rank, kOwnedWords);
  ok &= cudaMemcpy(*owned, mine.data(), kOwnedWords * 4, cudaMemcpyHostToDevice) == cudaSuccess;
  const std::vector<uint32_t> slot = pattern(1000 + topology().rank, kSlotWords);
  ok &= cudaMemcpy(*outbox, slot.data(), kSlotWords * 4, cudaMemcpyHostToDevice) == cudaSuccess;
  ok &= cudaMemset(*inbox, 0, local_world * kSlotWords * 4) == cudaSuccess;
  ok &= cudaDeviceSynchronize() == cudaSuccess;
  LOOM_ASSERT_OK(bootstrap().barrier());

  // Read every peer's owned buffer; write our slot into every peer's inbox.
  std::vector<uint32_t> got(kOwnedWords);
  for (int q = 0; q < local_world; ++q) {
    char* peer = static_cast<char*>(heap->peer_base(q));
    std::fill(got.begin(), got.end(), 0u);
    ok &= cudaMemcpy(got.data(), peer + owned_offset, kOwnedWords * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
    const std::vector<uint32_t> expected = pattern(peers[static_cast<size_t>(q)], kOwnedWords);
    const auto wrong = std::mismatch(got.begin(), got.end(), expected.begin());
    EXPECT_TRUE(wrong.first == got.end()) << "local rank " << q << "'s buffer differs at word "
                                          << (wrong.first - got.begin()) << " read through its "
                                          << heap->backend_name() << " mapping";
    ok &= wrong.first == got.end();
    ok &= cudaMemcpy(peer + inbox_offset + static_cast<uint64_t>(local_rank) * kSlotWords * 4, *outbox, kSlotWords * 4,
                     cudaMemcpyDeviceToDevice) == cudaSuccess;
  }
  ok &= cudaDeviceSynchronize() == cudaSuccess;
  LOOM_ASSERT_OK(bootstrap().barrier());

  std::vector<uint32_t> inbox_host(local_world * kSlotWords);
  ok &= cudaMemcpy(inbox_host.data(), *inbox, inbox_host.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
  for (int w = 0; w < local_world; ++w) {
    const std::vector<uint32_t> expected = pattern(1000 + peers[static_cast<size_t>(w)], kSlotWords);
    const bool slot_ok = std::equal(expected.begin(), expected.end(), inbox_host.begin() + w * kSlotWords);
    EXPECT_TRUE(slot_ok) << "the slot written by local rank " << w << " through its mapping of our heap is wrong";
    ok &= slot_ok;
  }
  EXPECT_TRUE(everyone(ok)) << "some rank saw wrong bytes (see that rank's output)";
  LOOM_ASSERT_OK(close_everywhere(*heap));
}

TEST_P(SymmetricHeapTest, AllocationOffsetsAreEqualOnEveryRank) {
  LOOM_CREATE_HEAP_OR_SKIP(heap, heap_options(GetParam()));
  std::vector<uint64_t> offsets;
  bool ok = true;
  auto take = [&](uint64_t bytes, uint64_t align) {
    Result<uint64_t> offset = heap->allocate_offset(bytes, align);
    ok &= offset.ok();
    offsets.push_back(offset.ok() ? *offset : UINT64_MAX);
  };
  take(kMiB, 256);
  take(3000, 4096);
  take(7 * kMiB, 2 * kMiB);
  ok &= heap->release_offset(offsets[1]).ok();
  take(100, 256);  // first fit: reuses the released block
  take(5 * kMiB + 1, 65536);
  EXPECT_TRUE(ok);
  EXPECT_EQ(offsets[3], offsets[1]);

  const int world = test::process().world_size;
  std::vector<uint64_t> all(offsets.size() * static_cast<size_t>(world));
  LOOM_ASSERT_OK(bootstrap().all_gather(offsets.data(), all.data(), offsets.size() * sizeof(uint64_t)));
  for (int r = 0; r < world; ++r) {
    const std::vector<uint64_t> theirs(all.begin() + r * offsets.size(), all.begin() + (r + 1) * offsets.size());
    EXPECT_EQ(theirs, offsets) << "rank " << r << " got other offsets for the same allocation sequence";
  }
  LOOM_ASSERT_OK(close_everywhere(*heap));
}

// Reliability R1: repeated create/destroy returns device memory and descriptors to baseline.
TEST_P(SymmetricHeapTest, CreateAndDestroyTwentyTimesWithoutGrowth) {
  const HeapOptions options = heap_options(GetParam());
  {
    // Warm-up: lazy runtime and driver state (module load, IPC bookkeeping) is not a leak.
    LOOM_CREATE_HEAP_OR_SKIP(warm_up, options);
    LOOM_ASSERT_OK(close_everywhere(*warm_up));
  }
  LOOM_ASSERT_OK(bootstrap().barrier());
  LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
  size_t free_before = 0;
  size_t total = 0;
  LOOM_ASSERT_CUDA(cudaMemGetInfo(&free_before, &total));
  const size_t fds_before = open_fd_count();

  for (int i = 0; i < 20; ++i) {
    Result<std::unique_ptr<SymmetricHeap>> heap = SymmetricHeap::create(bootstrap(), topology(), options);
    ASSERT_TRUE(heap.ok()) << "iteration " << i << ": " << heap.status().to_string();
    LOOM_ASSERT_OK(close_everywhere(**heap));
    LOOM_ASSERT_OK((*heap)->close());  // idempotent
  }
  LOOM_ASSERT_OK(bootstrap().barrier());
  LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
  size_t free_after = 0;
  LOOM_ASSERT_CUDA(cudaMemGetInfo(&free_after, &total));
  const int64_t growth = static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after);
  EXPECT_LT(growth, static_cast<int64_t>(kMiB)) << "device memory grew by " << growth << " bytes over 20 heaps";
  EXPECT_EQ(open_fd_count(), fds_before) << "file descriptors leaked";
}

// Reliability D6: a rank whose peer writes are corrupted makes init fail on every rank, naming
// it, and leaves the bootstrap usable (the failure is agreed, not reported as a crash).
TEST_P(SymmetricHeapTest, InjectedSelfTestFaultFailsInitEverywhere) {
  const int faulty = topology().local_world_size - 1;
  HeapOptions options = heap_options(GetParam());
  if (topology().local_rank == faulty) options.self_test_flip_bits = 1;
  Result<std::unique_ptr<SymmetricHeap>> heap = SymmetricHeap::create(bootstrap(), topology(), options);
  if (heap.status().code() == StatusCode::kUnsupported) GTEST_SKIP() << heap.status().to_string();
  ASSERT_FALSE(heap.ok());
  EXPECT_EQ(heap.status().code(), StatusCode::kInternal);
  const std::string expected = "peer writes from local rank " + std::to_string(faulty) + " through the " +
                               (GetParam() == env::HeapBackend::kVmm ? "VMM" : "CUDA IPC") + " mapping";
  EXPECT_NE(heap.status().message().find(expected), std::string::npos) << heap.status().message();
  LOOM_ASSERT_OK(bootstrap().barrier());
}

TEST_P(SymmetricHeapTest, CloseIsIdempotentAndEndsUse) {
  LOOM_CREATE_HEAP_OR_SKIP(heap, heap_options(GetParam()));
  Result<void*> buffer = heap->allocate(4096);
  ASSERT_TRUE(buffer.ok());
  EXPECT_TRUE(heap->contains(*buffer, 4096));
  EXPECT_EQ(heap->release(*buffer).code(), StatusCode::kOk);
  EXPECT_EQ(heap->release(*buffer).code(), StatusCode::kInvalidArgument);  // double free
  LOOM_ASSERT_OK(heap->release_peer_mappings());
  for (int q = 0; q < topology().local_world_size; ++q) {
    EXPECT_EQ(heap->peer_base(q) != nullptr, q == topology().local_rank) << "local rank " << q;
  }
  LOOM_ASSERT_OK(heap->release_peer_mappings());  // nothing left to release
  LOOM_ASSERT_OK(bootstrap().barrier());
  LOOM_ASSERT_OK(heap->close());
  LOOM_ASSERT_OK(heap->close());
  EXPECT_EQ(heap->local_base(), nullptr);
  EXPECT_EQ(heap->device_peer_bases(), nullptr);
  EXPECT_FALSE(heap->contains(*buffer, 1));
  EXPECT_EQ(heap->allocate(4096).status().code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Backends, SymmetricHeapTest,
                         ::testing::Values(env::HeapBackend::kVmm, env::HeapBackend::kIpc), backend_test_name);

}  // namespace
}  // namespace loom::runtime
