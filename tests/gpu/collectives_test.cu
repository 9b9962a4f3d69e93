// loom's NVLink collectives against a bit-exact reference, on every rank of the job.
//
// Inputs are verifiable (tests/common/verifiable.cuh): each rank recomputes what every peer
// sent. Outputs are pre-filled with NaN bytes so an element nobody wrote fails the check.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "loom/collectives.h"
#include "runtime/communicator_impl.h"
#include "tests/common/verifiable.cuh"
#include "tests/gpu/harness.h"

namespace loom {
namespace {

using test::process;
using test::shared_comm;

// Per-rank payload sizes in bytes: tiny and odd ones (tails, misaligned shards), then large.
std::vector<uint64_t> payload_sizes() {
  return {2,        4,          6,          14,          16,           18,          62,
          254,      1000,       4098,       65538,       (1u << 20) + 6, 3u << 20, 64ull << 20,
          1ull << 30};
}

struct Buffers {
  Communicator& comm;
  std::vector<void*> owned;
  ~Buffers() {
    for (void* p : owned) (void)comm.free(p);
  }
  void* symmetric(size_t bytes) {
    Result<void*> p = comm.alloc(bytes);
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    if (!p.ok()) return nullptr;
    owned.push_back(*p);
    return *p;
  }
};

std::string describe(const verify::Mismatch& m) {
  return std::to_string(m.wrong) + " wrong; first at " + std::to_string(m.first) + " got 0x" + [&] {
    char b[32];
    std::snprintf(b, sizeof(b), "%x want 0x%x", m.got, m.want);
    return std::string(b);
  }();
}

template <typename T>
void run_all_gather(uint64_t bytes, bool in_place, CopyEngineChoice engine, uint64_t seed) {
  Communicator& comm = shared_comm();
  const int world = comm.local_world_size();
  const uint64_t count = bytes / sizeof(T);
  Buffers buffers{comm};
  T* recv = static_cast<T*>(buffers.symmetric(count * world * sizeof(T)));
  ASSERT_NE(recv, nullptr);
  T* send = recv + count * comm.local_rank();
  if (!in_place) {
    LOOM_ASSERT_CUDA(cudaMalloc(&send, count * sizeof(T)));
  }
  LOOM_ASSERT_CUDA(cudaMemset(recv, 0xFF, count * world * sizeof(T)));
  ASSERT_TRUE(verify::fill_bits(send, count, seed, comm.local_rank(), nullptr));
  CollectiveOptions options;
  options.engine = engine;
  LOOM_ASSERT_OK(all_gather(comm, send, recv, count, dtype_of<T>(), nullptr, options));
  LOOM_ASSERT_OK(comm.synchronize(nullptr));
  const verify::Mismatch m = verify::check_all_gather(recv, count, world, seed, nullptr);
  EXPECT_EQ(m.wrong, 0u) << "all_gather " << bytes << " B/rank: " << describe(m);
  if (!in_place) cudaFree(send);
}

template <typename T>
void run_reduce_scatter(uint64_t bytes, uint64_t seed) {
  Communicator& comm = shared_comm();
  const int world = comm.local_world_size();
  const uint64_t count = bytes / sizeof(T);
  Buffers buffers{comm};
  T* send = static_cast<T*>(buffers.symmetric(count * world * sizeof(T)));
  ASSERT_NE(send, nullptr);
  T* recv = nullptr;
  LOOM_ASSERT_CUDA(cudaMalloc(&recv, count * sizeof(T)));
  LOOM_ASSERT_CUDA(cudaMemset(recv, 0xFF, count * sizeof(T)));
  ASSERT_TRUE(verify::fill_values(send, count * world, seed, comm.local_rank(), nullptr));
  LOOM_ASSERT_OK(reduce_scatter(comm, send, recv, count, dtype_of<T>(), nullptr));
  LOOM_ASSERT_OK(comm.synchronize(nullptr));
  const verify::Mismatch m = verify::check_sum(recv, count, count * comm.local_rank(), world, seed, nullptr);
  EXPECT_EQ(m.wrong, 0u) << "reduce_scatter " << bytes << " B/rank: " << describe(m);
  cudaFree(recv);
}

template <typename T>
void run_all_reduce(uint64_t bytes, bool in_place, uint64_t seed) {
  Communicator& comm = shared_comm();
  const uint64_t count = bytes / sizeof(T);
  Buffers buffers{comm};
  T* send = static_cast<T*>(buffers.symmetric(count * sizeof(T)));
  ASSERT_NE(send, nullptr);
  T* recv = in_place ? send : static_cast<T*>(buffers.symmetric(count * sizeof(T)));
  ASSERT_NE(recv, nullptr);
  if (!in_place) LOOM_ASSERT_CUDA(cudaMemset(recv, 0xFF, count * sizeof(T)));
  ASSERT_TRUE(verify::fill_values(send, count, seed, comm.local_rank(), nullptr));
  LOOM_ASSERT_OK(all_reduce(comm, send, recv, count, dtype_of<T>(), nullptr));
  LOOM_ASSERT_OK(comm.synchronize(nullptr));
  const verify::Mismatch m = verify::check_sum(recv, count, 0, comm.local_world_size(), seed, nullptr);
  EXPECT_EQ(m.wrong, 0u) << "all_reduce " << bytes << " B/rank: " << describe(m);
}

template <typename T>
class Collectives : public ::testing::Test {};
using ElementTypes = ::testing::Types<__nv_bfloat16, __half, float>;
TYPED_TEST_SUITE(Collectives, ElementTypes);

TYPED_TEST(Collectives, AllGatherBitExactAcrossSizes) {
  uint64_t seed = 11;
  for (uint64_t bytes : payload_sizes()) {
    if (bytes % sizeof(TypeParam) != 0) continue;
    if (bytes > (64ull << 20) && !std::is_same_v<TypeParam, __nv_bfloat16>) continue;  // 1 GiB once
    run_all_gather<TypeParam>(bytes, /*in_place=*/false, CopyEngineChoice::kVector, ++seed);
    if (::testing::Test::HasFailure()) return;
  }
}

TYPED_TEST(Collectives, AllGatherInPlaceAndBulkEngine) {
  uint64_t seed = 101;
  for (uint64_t bytes : {uint64_t{16}, uint64_t{4096}, uint64_t{(1 << 20) + 16}, uint64_t{64} << 20}) {
    run_all_gather<TypeParam>(bytes, /*in_place=*/true, CopyEngineChoice::kVector, ++seed);
    run_all_gather<TypeParam>(bytes, /*in_place=*/false, CopyEngineChoice::kBulk, ++seed);
    if (::testing::Test::HasFailure()) return;
  }
}

TYPED_TEST(Collectives, ReduceScatterBitExactAcrossSizes) {
  uint64_t seed = 201;
  for (uint64_t bytes : payload_sizes()) {
    if (bytes % sizeof(TypeParam) != 0) continue;
    if (bytes > (64ull << 20) && !std::is_same_v<TypeParam, __nv_bfloat16>) continue;
    run_reduce_scatter<TypeParam>(bytes, ++seed);
    if (::testing::Test::HasFailure()) return;
  }
}

TYPED_TEST(Collectives, AllReduceBitExactAcrossSizes) {
  uint64_t seed = 301;
  for (uint64_t bytes : payload_sizes()) {
    if (bytes % sizeof(TypeParam) != 0) continue;
    if (bytes > (64ull << 20) && !std::is_same_v<TypeParam, __nv_bfloat16>) continue;
    run_all_reduce<TypeParam>(bytes, /*in_place=*/false, ++seed);
    run_all_reduce<TypeParam>(bytes, /*in_place=*/true, ++seed);
    if (::testing::Test::HasFailure()) return;
  }
}

// 100 launches of all three collectives queued without a host sync: epochs, flags and buffer
// reuse must keep every result exact.
TEST(CollectivesStress, HundredBackToBackLaunchesWithoutHostSync) {
  Communicator& comm = shared_comm();
  const int world = comm.local_world_size();
  const int me = comm.local_rank();
  const uint64_t count = (1 << 20) + 8;  // per-rank elements
  Buffers buffers{comm};
  using T = __nv_bfloat16;
  T* ag_recv = static_cast<T*>(buffers.symmetric(count * world * sizeof(T)));
  T* rs_send = static_cast<T*>(buffers.symmetric(count * world * sizeof(T)));
  T* ar_send = static_cast<T*>(buffers.symmetric(count * sizeof(T)));
  T* ar_recv[2] = {static_cast<T*>(buffers.symmetric(count * sizeof(T))), static_cast<T*>(buffers.symmetric(count * sizeof(T)))};
  T *ag_send = nullptr, *rs_recv = nullptr;
  LOOM_ASSERT_CUDA(cudaMalloc(&ag_send, count * sizeof(T)));
  LOOM_ASSERT_CUDA(cudaMalloc(&rs_recv, count * sizeof(T)));
  cudaStream_t stream;
  LOOM_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ASSERT_TRUE(verify::fill_bits(ag_send, count, 7, me, stream));
  ASSERT_TRUE(verify::fill_values(rs_send, count * world, 8, me, stream));
  ASSERT_TRUE(verify::fill_values(ar_send, count, 9, me, stream));
  for (int i = 0; i < 100; ++i) {
    LOOM_ASSERT_OK(all_gather(comm, ag_send, ag_recv, count, DType::kBF16, stream));
    LOOM_ASSERT_OK(reduce_scatter(comm, rs_send, rs_recv, count, DType::kBF16, stream));
    LOOM_ASSERT_OK(all_reduce(comm, ar_send, ar_recv[i % 2], count, DType::kBF16, stream));
  }
  LOOM_ASSERT_OK(comm.synchronize(stream));
  EXPECT_EQ(verify::check_all_gather(ag_recv, count, world, 7, stream).wrong, 0u);
  EXPECT_EQ(verify::check_sum(rs_recv, count, count * me, world, 8, stream).wrong, 0u);
  EXPECT_EQ(verify::check_sum(ar_recv[0], count, 0, world, 9, stream).wrong, 0u);
  EXPECT_EQ(verify::check_sum(ar_recv[1], count, 0, world, 9, stream).wrong, 0u);
  cudaFree(ag_send);
  cudaFree(rs_recv);
  cudaStreamDestroy(stream);
}

TEST(CollectivesValidation, BadBuffersAreRejectedBeforeLaunch) {
  Communicator& comm = shared_comm();
  const int world = comm.local_world_size();
  void* plain = nullptr;
  LOOM_ASSERT_CUDA(cudaMalloc(&plain, 4096 * world));
  Buffers buffers{comm};
  void* sym = buffers.symmetric(4096 * world);
  // all_gather needs a symmetric recv.
  EXPECT_EQ(all_gather(comm, plain, plain, 1024, DType::kF32, nullptr).code(), StatusCode::kInvalidArgument);
  // reduce_scatter needs a symmetric send.
  EXPECT_EQ(reduce_scatter(comm, plain, plain, 1024, DType::kF32, nullptr).code(), StatusCode::kInvalidArgument);
  // Host memory is not device memory.
  std::vector<float> host(1024);
  EXPECT_EQ(all_gather(comm, host.data(), sym, 1024, DType::kF32, nullptr).code(), StatusCode::kInvalidArgument);
  // Larger than the symmetric buffer.
  EXPECT_EQ(all_reduce(comm, sym, sym, 4096 * world, DType::kF32, nullptr).code(), StatusCode::kInvalidArgument);
  // The bulk engine only moves all_gather data.
  CollectiveOptions bulk;
  bulk.engine = CopyEngineChoice::kBulk;
  EXPECT_EQ(all_reduce(comm, sym, sym, 16, DType::kF32, nullptr, bulk).code(), StatusCode::kInvalidArgument);
  // Too many CTAs.
  CollectiveOptions many;
  many.num_ctas = 1 << 20;
  EXPECT_EQ(all_reduce(comm, sym, sym, 16, DType::kF32, nullptr, many).code(), StatusCode::kInvalidArgument);
  // Zero elements: a no-op.
  EXPECT_TRUE(all_reduce(comm, sym, sym, 0, DType::kF32, nullptr).ok());
  LOOM_ASSERT_OK(comm.synchronize(nullptr));

  // collective_plan makes the same checks as the calls, and launches nothing.
  EXPECT_EQ(collective_plan(comm, CollectiveOp::kAllGather, plain, plain, 1024, DType::kF32).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(collective_can_implement(comm, CollectiveOp::kReduceScatter, plain, plain, 1024, DType::kF32).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(collective_plan(comm, CollectiveOp::kAllReduce, sym, sym, 16, DType::kF32, bulk).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(collective_plan(comm, CollectiveOp::kAllReduce, sym, sym, 16, static_cast<DType>(9)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(collective_plan(comm, static_cast<CollectiveOp>(7), sym, sym, 16, DType::kF32).status().code(),
            StatusCode::kInvalidArgument);
  for (CollectiveOp op : {CollectiveOp::kAllGather, CollectiveOp::kReduceScatter, CollectiveOp::kAllReduce}) {
    const void* send = op == CollectiveOp::kAllGather ? static_cast<const void*>(static_cast<char*>(sym) + 0) : sym;
    const Result<CollectivePlanInfo> plan = collective_plan(comm, op, send, sym, 1024, DType::kF32);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    if (world > 1) {
      EXPECT_GT(plan->num_ctas, 0);
      EXPECT_FALSE(plan->device_copy);
    } else {
      EXPECT_EQ(plan->num_ctas, 0) << "one rank: no kernel";
    }
    EXPECT_EQ(collective_workspace_bytes(op, 1024, DType::kF32), 0u);
  }
  CollectiveOptions eight;
  eight.num_ctas = 8;
  if (world > 1) {
    EXPECT_EQ(collective_plan(comm, CollectiveOp::kAllReduce, sym, sym, 1024, DType::kF32, eight)->num_ctas, 8);
  }
  cudaFree(plain);
}

// A rank that never takes part: the others time out within the deadline + 1 s, the error names
// it, and the GPU still runs kernels afterwards.
TEST(CollectivesFailure, MissingPeerTimesOutAndContextStaysUsable) {
  if (process().world_size < 2) GTEST_SKIP() << "needs at least two ranks";
  CommOptions options;
  options.heap_bytes = 64ull << 20;
  options.op_timeout = std::chrono::milliseconds(2000);
  std::unique_ptr<Communicator> comm = test::make_comm(options);
  ASSERT_NE(comm, nullptr);
  const int silent_rank = process().world_size - 1;
  Result<void*> buf = comm->alloc(1 << 20);
  ASSERT_TRUE(buf.ok()) << buf.status().to_string();
  if (process().rank != silent_rank) {
    const auto start = std::chrono::steady_clock::now();
    LOOM_ASSERT_OK(all_reduce(*comm, *buf, *buf, (1 << 20) / 4, DType::kF32, nullptr));
    Status s = comm->synchronize(nullptr);
    const double elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
    EXPECT_NE(s.message().find("rank " + std::to_string(silent_rank)), std::string::npos) << s.to_string();
    EXPECT_LE(elapsed_s, 2.0 + 1.0);
    // The communicator is failed now ...
    EXPECT_EQ(all_reduce(*comm, *buf, *buf, 16, DType::kF32, nullptr).code(), StatusCode::kAborted);
    // ... but the CUDA context is not: a plain kernel and a copy still run.
    std::vector<float> host(16, 1.0f);
    float* d = nullptr;
    LOOM_ASSERT_CUDA(cudaMalloc(&d, 64));
    ASSERT_TRUE(verify::fill_values(d, 16, 1, 0, nullptr));
    LOOM_ASSERT_CUDA(cudaMemcpy(host.data(), d, 64, cudaMemcpyDeviceToHost));
    LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
    cudaFree(d);
  } else {
    // Stay alive (and never launch) until the others are done waiting.
    std::this_thread::sleep_for(std::chrono::milliseconds(4000));
  }
  // Both sides rendezvous on the host; the silent rank then fails its communicator as well, so
  // neither destructor waits for the other.
  (void)internal(*comm).bootstrap->barrier();
  if (process().rank == silent_rank) comm->abort("test over");
}

}  // namespace
}  // namespace loom
