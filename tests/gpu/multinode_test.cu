// The inter-node path through the Communicator, and the multi-node operators, on a job of several
// (real or emulated) nodes. Run as:
//   LOOM_EMULATE_NODES=2 loom-run -n 2 -- loom_gpu_tests --gtest_filter='MultiNode*'
// (2 GPUs as 2 nodes of 1 GPU; traffic between them goes through the proxy and the copy engine).
// On a single-node job every test skips, identically on every rank.
//
//   MultiNodeNet.RawPutBitExactFromOneByteTo64MiB   a test kernel pushes one network write per size
//       (1 B .. 64 MiB, odd sizes and alignments) to every network peer through the communicator's
//       rings; receiver CTAs wait for each flag and check the message the moment they see it
//       (a byte missing = a flag before its data); guard bytes around every message stay intact
//   MultiNodeNet.ExchangeOperatorIsBitExact          ops::net_exchange (the benchmark's transfer)
//   MultiNodeOps.*                                   ag_gemm, gemm_rs, gemm_ar vs an fp32 reference
//       for M in {128, 1000, 4096, 16384} (refused shapes: their supported neighbour), both B
//       layouts, fp16; outputs NaN-filled first, inputs fresh per case; gathered_a bit-exact
//   MultiNodeStress.BackToBackLaunchesAreBitIdentical  50 launches of each operator without a host
//       sync (LOOM_TEST_STRESS_LAUNCHES overrides), every output the reference's bits
//   MultiNodeTraffic.EachGpuPostsItsShareOnce        bytes the proxy posts per GPU = its 1/L share:
//       (N - 1) blocks of M/W rows (gemm_ar twice) plus the entry words
//   MultiNodeFailure.SilentRankTimesOut              a rank that never launches: every other rank
//       times out within the deadline + 1 s naming the rank it waited for, and every rank the
//       silent one writes into says that it did not enter the launch
//   MultiNodeFailure.ProxyRejectionIsReportedBySynchronize, PausedProxyIsReportedAsStalled
//
// Tolerances (u = unit roundoff: bf16 2^-8, fp16 2^-11; W = world): element |out - ref| <=
// ((W + 1) u + K 2^-23) sum_k |a||b|; norm ||out - ref|| / ||ref|| <= 1e-2 (bf16), 2e-3 (fp16).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/env.h"
#include "kernels/comm/epoch.cuh"
#include "kernels/comm/net.cuh"
#include "kernels/tp/multinode/layout.h"
#include "loom/tensor_parallel.h"
#include "ops/tp/multinode/multinode.h"
#include "runtime/communicator_impl.h"
#include "runtime/network_layout.h"
#include "tests/common/verifiable.cuh"
#include "tests/gpu/common/tp_fixture.cuh"
#include "tests/gpu/harness.h"

namespace loom {
namespace {

using test::process;
using test::shared_comm;
using namespace test::tp;  // tests/gpu/common/tp_fixture.cuh
using namespace std::chrono_literals;

bool multi_node() { return shared_comm().num_nodes() > 1; }
bool agree(bool ok) { return test::all_ranks_agree(shared_comm(), ok); }

#define SKIP_UNLESS_MULTI_NODE()                                                                                  \
  if (!multi_node())                                                                                              \
  GTEST_SKIP() << "needs a job of several nodes (e.g. LOOM_EMULATE_NODES=2 loom-run -n 2 -- loom_gpu_tests)"

#define MN_CUDA(expr)                                                                  \
  do {                                                                                 \
    cudaError_t mn_err_ = (expr);                                                      \
    ASSERT_EQ(mn_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(mn_err_);   \
  } while (0)

// ---- raw network puts ------------------------------------------------------------------------------

__host__ __device__ inline uint8_t payload_byte(int sender, uint64_t position) {
  uint64_t x = (position + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(sender + 1) << 56);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<uint8_t>(x);
}

__global__ void fill_payload(uint8_t* data, uint64_t bytes, int sender) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < bytes; i += uint64_t{gridDim.x} * blockDim.x) {
    data[i] = payload_byte(sender, i);
  }
}

struct PutMessage {
  uint64_t src;     // offset in the source buffer
  uint64_t dst;     // offset in a receive slot
  uint64_t length;
};

struct PutParams {
  DeviceComm comm;
  uint64_t src_offset;  // heap offset of the source buffer
  uint64_t dst_offset;  // heap offset of the receive area: N - 1 slots of slot_bytes
  uint64_t slot_bytes;
  const PutMessage* messages;
  uint32_t count;
  uint32_t flag_base;
  unsigned* counters;  // [0] bytes wrong at flag time, [1] messages never flagged, [2] sender failures
};

constexpr uint32_t kPutSignature = 0x5157;

// CTA 0 thread 0 sends every message to every network peer (slot of this node at the peer, flag
// base + slot * count + message); CTAs 1.. wait for each incoming flag and check the message then.
__global__ void put_kernel(const __grid_constant__ PutParams p) {
  const DeviceComm& c = p.comm;
  const uint64_t epoch = kernels::launch_epoch(c.epoch_state);
  const kernels::WaitContext ctx = kernels::WaitContext::start(c.wait, OpId::kNetExchange, epoch);
  const uint32_t nodes = static_cast<uint32_t>(c.net.num_nodes);
  const uint32_t node = static_cast<uint32_t>(c.net.node);
  using kernels::tp::multinode::Grid;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      bool ok = kernels::announce_network_entry(c, kernels::EntryPeers::kAll, kPutSignature, ctx);
      for (uint32_t o = 1; ok && o < nodes; ++o) {
        const uint32_t dst_node = (node + o) % nodes;
        ok = kernels::wait_network_entry(c, static_cast<int>(dst_node), kPutSignature, ctx);
        const uint32_t k = Grid::slot(node, dst_node, nodes);
        for (uint32_t m = 0; ok && m < p.count; ++m) {
          const PutMessage msg = p.messages[m];
          ok = kernels::net_put(c, m, kernels::net_rank_of(c, static_cast<int>(dst_node), c.local_rank), p.src_offset + msg.src,
                                p.dst_offset + k * p.slot_bytes + msg.dst, msg.length, p.flag_base + k * p.count + m, ctx);
        }
      }
      if (ok) ok = kernels::net_wait_proxy_done(c, ctx);
      if (!ok) atomicAdd(&p.counters[2], 1u);
    }
  } else {
    __shared__ int arrived;
    const uint32_t items = (nodes - 1) * p.count;
    for (uint32_t i = blockIdx.x - 1; i < items; i += gridDim.x - 1) {
      const uint32_t src_node = (node + nodes - 1 - i / p.count) % nodes;
      const uint32_t m = i % p.count;
      const uint32_t k = Grid::slot(src_node, node, nodes);
      const int src_rank = kernels::net_rank_of(c, static_cast<int>(src_node), c.local_rank);
      if (threadIdx.x == 0) arrived = kernels::net_wait(c, p.flag_base + k * p.count + m, src_rank, ctx) ? 1 : 0;
      __syncthreads();
      if (!arrived) {
        if (threadIdx.x == 0) atomicAdd(&p.counters[1], 1u);
      } else {
        const PutMessage msg = p.messages[m];
        const uint8_t* got = reinterpret_cast<const uint8_t*>(c.local_heap_base + p.dst_offset + k * p.slot_bytes + msg.dst);
        unsigned wrong = 0;
        for (uint64_t b = threadIdx.x; b < msg.length; b += blockDim.x) {
          wrong += got[b] != payload_byte(src_rank, msg.src + b) ? 1u : 0u;
        }
        if (wrong != 0) atomicAdd(&p.counters[0], wrong);
      }
      __syncthreads();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) kernels::finish_launch(c.epoch_state, epoch);
}

TEST(MultiNodeNet, RawPutBitExactFromOneByteTo64MiB) {
  SKIP_UNLESS_MULTI_NODE();
  Communicator& comm = shared_comm();
  Communicator::Impl& impl = internal(comm);
  constexpr uint8_t kGuard = 0xA5;
  constexpr uint64_t kGap = 256;
  constexpr uint64_t kSourceSlack = 65536;
  std::vector<uint64_t> sizes;
  for (uint64_t p = 1; p <= (uint64_t{64} << 20); p *= 4) {
    if (p > 1 && p <= (uint64_t{1} << 20)) sizes.push_back(p - 1);
    sizes.push_back(p);
    if (p <= (uint64_t{4} << 20)) sizes.push_back(p + 1);
  }
  std::vector<PutMessage> messages;
  uint64_t at = kGap;
  for (size_t i = 0; i < sizes.size(); ++i) {
    messages.push_back(PutMessage{(i * 977) % kSourceSlack, at, sizes[i]});
    at = (at + sizes[i] + kGap + 255) & ~uint64_t{255};
  }
  const uint64_t slot_bytes = at;
  const uint32_t nodes = static_cast<uint32_t>(comm.num_nodes());
  SymmetricMem sym(comm);
  uint8_t* src = static_cast<uint8_t*>(sym.alloc((uint64_t{64} << 20) + kSourceSlack));
  uint8_t* dst = static_cast<uint8_t*>(sym.alloc(slot_bytes * (nodes - 1)));
  DeviceMem d_messages(messages.size() * sizeof(PutMessage)), counters(3 * sizeof(unsigned));
  bool ready = src && dst && d_messages.p && counters.p;
  if (ready) {
    fill_payload<<<256, 256>>>(src, (uint64_t{64} << 20) + kSourceSlack, comm.rank());
    ready = cudaMemset(dst, kGuard, slot_bytes * (nodes - 1)) == cudaSuccess &&
            cudaMemcpy(d_messages.p, messages.data(), d_messages.bytes, cudaMemcpyHostToDevice) == cudaSuccess &&
            cudaMemset(counters.p, 0, counters.bytes) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
  }
  ASSERT_TRUE(agree(ready)) << "setting up the buffers";
  LOOM_ASSERT_OK(comm.barrier());  // every receive area is guarded before anyone sends

  PutParams p{};
  p.comm = impl.device_comm();
  p.src_offset = impl.heap->offset_of(src);
  p.dst_offset = impl.heap->offset_of(dst);
  p.slot_bytes = slot_bytes;
  p.messages = static_cast<const PutMessage*>(d_messages.p);
  p.count = static_cast<uint32_t>(messages.size());
  p.flag_base = p.comm.net.launch_flag_base;
  p.counters = static_cast<unsigned*>(counters.p);
  put_kernel<<<1 + 64, 256>>>(p);
  MN_CUDA(cudaGetLastError());
  const Status synced = comm.synchronize(nullptr);
  unsigned host[3] = {0, 0, 0};
  MN_CUDA(cudaMemcpy(host, counters.p, sizeof(host), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(synced.ok()) << synced.to_string();
  EXPECT_EQ(host[0], 0u) << "bytes wrong when their flag was seen (a flag before its data)";
  EXPECT_EQ(host[1], 0u) << "messages never flagged";
  EXPECT_EQ(host[2], 0u) << "sender failed";
  // Guards: everything outside the messages keeps its pattern.
  std::vector<uint8_t> area(slot_bytes * (nodes - 1));
  MN_CUDA(cudaMemcpy(area.data(), dst, area.size(), cudaMemcpyDeviceToHost));
  std::vector<bool> written(slot_bytes, false);
  for (const PutMessage& m : messages) std::fill(written.begin() + m.dst, written.begin() + m.dst + m.length, true);
  size_t bad_guards = 0;
  for (size_t i = 0; i < area.size(); ++i) bad_guards += (!written[i % slot_bytes] && area[i] != kGuard) ? 1 : 0;
  EXPECT_EQ(bad_guards, 0u) << "guard bytes overwritten";
  const runtime::net::ProxyStats stats = impl.network->proxy()->stats();
  EXPECT_EQ(stats.rejected, 0u);
  RecordProperty("bytes_posted", std::to_string(stats.bytes_posted));
  EXPECT_TRUE(agree(!HasFailure()));
}

TEST(MultiNodeNet, ExchangeOperatorIsBitExact) {
  SKIP_UNLESS_MULTI_NODE();
  Communicator& comm = shared_comm();
  const uint32_t nodes = static_cast<uint32_t>(comm.num_nodes());
  const auto& topo = internal(comm).topology;
  for (uint64_t bytes : {uint64_t{16}, uint64_t{1000}, uint64_t{3} << 20, (uint64_t{32} << 20) + 48}) {
    SymmetricMem sym(comm);
    uint8_t* src = static_cast<uint8_t*>(sym.alloc(bytes));
    uint8_t* dst = static_cast<uint8_t*>(sym.alloc(bytes * (nodes - 1)));
    ASSERT_TRUE(agree(src && dst));
    fill_payload<<<256, 256>>>(src, bytes, comm.rank());
    MN_CUDA(cudaMemset(dst, 0, bytes * (nodes - 1)));
    MN_CUDA(cudaDeviceSynchronize());
    LOOM_ASSERT_OK(comm.barrier());
    LOOM_ASSERT_OK(ops::net_exchange(comm, src, dst, bytes, nullptr, uint64_t{1} << 20));
    const Status synced = comm.synchronize(nullptr);
    ASSERT_TRUE(agree(synced.ok())) << synced.to_string();
    std::vector<uint8_t> got(bytes * (nodes - 1));
    MN_CUDA(cudaMemcpy(got.data(), dst, got.size(), cudaMemcpyDeviceToHost));
    size_t wrong = 0;
    for (uint32_t s = 0; s < nodes; ++s) {
      if (s == static_cast<uint32_t>(comm.node())) continue;
      const uint32_t k = kernels::tp::multinode::Grid::slot(s, static_cast<uint32_t>(comm.node()), nodes);
      const int sender = topo.rank_of(static_cast<int>(s), comm.local_rank());
      for (uint64_t i = 0; i < bytes; ++i) wrong += got[k * bytes + i] != payload_byte(sender, i) ? 1 : 0;
    }
    EXPECT_EQ(wrong, 0u) << bytes << " bytes";
    ASSERT_TRUE(agree(!HasFailure()));
  }
}

// ---- operators vs an fp32 reference ---------------------------------------------------------------

struct Shape {
  OpId op = OpId::kAgGemm;
  int64_t m = 0, n = 0;
  int64_t k_global = 0;  // ag_gemm: K; gemm_rs / gemm_ar: the K split over the ranks
  BLayout layout = BLayout::kNK;
  DType dtype = DType::kBF16;
  int world = 1;
  int rank = 0;
  int block = 0;  // this rank's row block (node * L + local)

  int64_t k_rank() const { return op == OpId::kAgGemm ? k_global : k_global / world; }
  int64_t k_total() const { return op == OpId::kAgGemm ? k_global : k_rank() * world; }
  int64_t rows() const { return m / world; }
  int64_t a_rows() const { return op == OpId::kAgGemm ? rows() : m; }
  int64_t out_rows() const { return op == OpId::kGemmRs ? rows() : m; }
  int64_t out_row0() const { return op == OpId::kGemmRs ? block * rows() : 0; }
  int fill_rank() const { return rank; }  // whose values this rank's operands hold
  size_t elem() const { return dtype_size(dtype); }
  size_t a_bytes() const { return static_cast<size_t>(a_rows() * k_rank()) * elem(); }
  size_t b_bytes() const { return static_cast<size_t>(n * k_rank()) * elem(); }
  size_t out_bytes() const { return static_cast<size_t>(out_rows() * n) * elem(); }
  bool must_be_supported() const { return m % (world * 128) == 0 && n % 8 == 0 && k_rank() % 8 == 0; }
  // The nearest shape the multi-node rules accept: M / W a multiple of 128 and, where K is split
  // over the ranks, K / W a multiple of 8.
  Shape supported_neighbour() const {
    Shape s = *this;
    s.m = (m + world * 128 - 1) / (world * 128) * (world * 128);
    if (op != OpId::kAgGemm) s.k_global = (k_global + world * 8 - 1) / (world * 8) * (world * 8);
    return s;
  }
  std::string text() const {
    return std::string(op_name(op)) + " M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k_global) +
           (op == OpId::kAgGemm ? "" : " (K per rank " + std::to_string(k_rank()) + ")") + " W=" + std::to_string(world) +
           " B=" + std::string(b_layout_name(layout)) + " " + std::string(dtype_name(dtype));
  }
};

using Inputs = test::tp::Inputs<Shape>;

Shape make_shape(OpId op, int64_t m, int64_t n, int64_t k_global, BLayout layout, DType dtype = DType::kBF16) {
  Communicator& comm = shared_comm();
  Shape s;
  s.op = op;
  s.m = m;
  s.n = n;
  s.k_global = k_global;
  s.layout = layout;
  s.dtype = dtype;
  s.world = comm.world_size();
  s.rank = comm.rank();
  s.block = comm.node() * comm.local_world_size() + comm.local_rank();
  return s;
}

// Global rank owning row block d (d = node * L + local).
int rank_of_block(int d) {
  const auto& t = internal(shared_comm()).topology;
  return t.rank_of(d / t.local_world_size, d % t.local_world_size);
}

// The fp32 reference of this rank's output rows, from every rank's regenerated operands. Row
// block d of the gathered A (ag_gemm) is the shard of the rank that owns block d.
struct Reference {
  DeviceMem c, bound;
  bool ok = false;
  Reference(const Shape& s, uint64_t seed) : c(static_cast<size_t>(s.out_rows() * s.n) * 4), bound(c.bytes) {
    const DType t = s.dtype;
    const bool kn = s.layout == BLayout::kKN;
    const int64_t kt = s.k_total();
    DeviceMem a_full(static_cast<size_t>(s.m * kt) * s.elem());
    DeviceMem b_full(static_cast<size_t>(s.n * kt) * s.elem());
    if (!c.p || !bound.p || !a_full.p || !b_full.p) return;
    if (s.op == OpId::kAgGemm) {
      for (int d = 0; d < s.world; ++d) {
        fill_matrix(at(a_full.p, d * s.rows() * kt, t), t, s.rows(), kt, kt, seed_a(seed), rank_of_block(d));
      }
      fill_matrix(b_full.p, t, kn ? s.k_rank() : s.n, kn ? s.n : s.k_rank(), kn ? s.n : kt, seed_b(seed), s.rank);
    } else {
      for (int r = 0; r < s.world; ++r) {
        fill_matrix(at(a_full.p, r * s.k_rank(), t), t, s.m, s.k_rank(), kt, seed_a(seed), r);
        const int64_t b_off = kn ? r * s.k_rank() * s.n : r * s.k_rank();
        fill_matrix(at(b_full.p, b_off, t), t, kn ? s.k_rank() : s.n, kn ? s.n : s.k_rank(), kn ? s.n : kt, seed_b(seed), r);
      }
    }
    ok = run_reference(at(a_full.p, s.out_row0() * kt, t), b_full.p, kn, kn ? s.n : kt, s.out_rows(), s.n, kt, t, c.p, bound.p);
  }
};

struct CompareCounters {
  unsigned long long wrong;
  unsigned long long nan;
  double sq_err;
  double sq_ref;
  long long first_row, first_col;
  float first_got, first_want;
};

template <typename T>
__global__ void compare_kernel(const T* out, const float* ref, const float* bound, int64_t rows, int64_t n, float factor,
                               CompareCounters* counters) {
  double sq_err = 0, sq_ref = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * n; i += int64_t{gridDim.x} * blockDim.x) {
    const float g = verify::to_float(out[i]);
    const float w = ref[i];
    const bool is_nan = isnan(g);
    const float err = fabsf(g - w);
    sq_ref += static_cast<double>(w) * w;
    sq_err += is_nan ? 1e30 : static_cast<double>(err) * err;
    if (is_nan || !(err <= factor * bound[i] + 1e-6f)) {
      if (atomicAdd(&counters->wrong, 1ull) == 0) {
        counters->first_row = i / n;
        counters->first_col = i % n;
        counters->first_got = g;
        counters->first_want = w;
      }
      if (is_nan) atomicAdd(&counters->nan, 1ull);
    }
  }
  for (int off = 16; off > 0; off /= 2) {
    sq_err += __shfl_down_sync(0xffffffffu, sq_err, off);
    sq_ref += __shfl_down_sync(0xffffffffu, sq_ref, off);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&counters->sq_err, sq_err);
    atomicAdd(&counters->sq_ref, sq_ref);
  }
}

double unit_roundoff(DType t) { return t == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11); }
double norm_tolerance(DType t) { return t == DType::kBF16 ? 1e-2 : 2e-3; }

// "" when this rank's output of `s` matches the reference, else the report.
std::string compare_output(const Shape& s, const void* out, const Reference& ref) {
  if (!ref.ok) return "could not build the reference";
  DeviceMem counters(sizeof(CompareCounters));
  cudaMemset(counters.p, 0, counters.bytes);
  const float factor = static_cast<float>((s.world + 1) * unit_roundoff(s.dtype) + s.k_total() * std::ldexp(1.0, -23));
  const unsigned grid = verify::grid_for(static_cast<uint64_t>(s.out_rows() * s.n));
  auto* cc = static_cast<CompareCounters*>(counters.p);
  const float* c = static_cast<const float*>(ref.c.p);
  const float* bd = static_cast<const float*>(ref.bound.p);
  if (s.dtype == DType::kBF16) {
    compare_kernel<<<grid, 256>>>(static_cast<const __nv_bfloat16*>(out), c, bd, s.out_rows(), s.n, factor, cc);
  } else {
    compare_kernel<<<grid, 256>>>(static_cast<const __half*>(out), c, bd, s.out_rows(), s.n, factor, cc);
  }
  CompareCounters h{};
  if (cudaMemcpy(&h, counters.p, sizeof(h), cudaMemcpyDeviceToHost) != cudaSuccess) return "comparing failed (CUDA error)";
  const double rel = h.sq_ref > 0 ? std::sqrt(h.sq_err / h.sq_ref) : 1e30;
  if (h.wrong == 0 && rel <= norm_tolerance(s.dtype) && h.sq_ref > 0) return "";
  char text[320];
  std::snprintf(text, sizeof text,
                "rank %d: rel_err %.3g (limit %.1g), %llu of %lld elements outside the bound (%llu NaN); first: out row %lld "
                "(global %lld) col %lld got %.6g want %.6g",
                process().rank, rel, norm_tolerance(s.dtype), h.wrong, static_cast<long long>(s.out_rows() * s.n), h.nan,
                h.first_row, h.first_row + s.out_row0(), h.first_col, h.first_got, h.first_want);
  return text;
}

__global__ void count_different_words(const uint16_t* p, const uint16_t* q, uint64_t n, unsigned long long* count) {
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    local += p[i] != (q ? q[i] : uint16_t{0xFFFF});
  }
  if (local) atomicAdd(count, local);
}

unsigned long long different_words(const void* p, const void* q, size_t bytes) {
  DeviceMem count(sizeof(unsigned long long));
  cudaMemset(count.p, 0, sizeof(unsigned long long));
  const uint64_t n = bytes / 2;
  count_different_words<<<verify::grid_for(n), 256>>>(static_cast<const uint16_t*>(p), static_cast<const uint16_t*>(q), n,
                                                      static_cast<unsigned long long*>(count.p));
  unsigned long long h = ~0ull;
  if (cudaMemcpy(&h, count.p, sizeof(h), cudaMemcpyDeviceToHost) != cudaSuccess) return ~0ull;
  return h;
}

enum class Outcome { kCorrect, kRefused, kFailed };

// Runs `s` once on every rank and checks it (collective). kRefused: declined cleanly (checked).
Outcome run_and_check(const Shape& s, uint64_t seed, const TpGemmOptions& options = {}) {
  Communicator& comm = shared_comm();
  SymmetricMem sym(comm);
  Inputs in(s, seed);
  Output out(s, sym);
  const bool ready = in.ok() && out.p != nullptr && cudaMemset(out.p, 0xFF, s.out_bytes()) == cudaSuccess &&
                     cudaDeviceSynchronize() == cudaSuccess;
  if (!agree(ready)) {
    ADD_FAILURE() << s.text() << ": rank " << process().rank << " could not set up the case";
    return Outcome::kFailed;
  }
  const Status launched = launch(comm, s.op, args_for(s, in, out.p), nullptr, options);
  const bool all_launched = agree(launched.ok());
  const bool all_refused = agree(!launched.ok());
  if (!all_launched && !all_refused) {
    const Status synced = launched.ok() ? comm.synchronize(nullptr) : Status{};
    ADD_FAILURE() << s.text() << ": rank " << process().rank
                  << (launched.ok() ? " launched (" + synced.to_string() + ")" : " refused (" + launched.to_string() + ")")
                  << " while a peer did the opposite";
    return Outcome::kFailed;
  }
  if (all_refused) {
    const bool clean = launched.code() == StatusCode::kInvalidArgument || launched.code() == StatusCode::kUnsupported;
    const bool names_op = launched.message().find(op_name(s.op)) != std::string::npos;
    const bool untouched = different_words(out.p, nullptr, s.out_bytes()) == 0;
    EXPECT_TRUE(clean) << s.text() << ": refused with " << launched.to_string();
    EXPECT_FALSE(s.must_be_supported()) << s.text() << ": must be accepted, but: " << launched.to_string();
    EXPECT_TRUE(names_op) << s.text() << ": the message should name the operator: " << launched.to_string();
    EXPECT_TRUE(untouched) << s.text() << ": refused, but the output was written";
    return agree(clean && !s.must_be_supported() && names_op && untouched) ? Outcome::kRefused : Outcome::kFailed;
  }
  const Status synced = comm.synchronize(nullptr);
  if (!synced.ok()) {
    ADD_FAILURE() << s.text() << ": rank " << process().rank << ": synchronize: " << synced.to_string();
    return Outcome::kFailed;
  }
  const Reference ref(s, seed);
  const std::string report = compare_output(s, out.p, ref);
  EXPECT_EQ(report, "") << s.text();
  return report.empty() ? Outcome::kCorrect : Outcome::kFailed;
}

struct OpLayout {
  OpId op;
  BLayout layout;
};

class MultiNodeOps : public ::testing::TestWithParam<OpLayout> {};

TEST_P(MultiNodeOps, MatchesFp32ReferenceAcrossShapes) {
  SKIP_UNLESS_MULTI_NODE();
  const OpLayout p = GetParam();
  struct NK {
    int64_t n, k;
  };
  const NK pairs[] = {{512, 1024}, {1536, 2048}, {1000, 1040}};
  uint64_t seed = 3000 + static_cast<uint64_t>(p.op) * 100 + static_cast<uint64_t>(p.layout) * 50;
  std::vector<std::string> refused;
  for (int64_t m : {128, 1000, 4096, 16384}) {
    for (const NK& nk : pairs) {
      if (m == 16384 && nk.n != 512) continue;  // the large M once: the reference runs on CUDA cores
      const Shape s = make_shape(p.op, m, nk.n, nk.k, p.layout);
      const Outcome o = run_and_check(s, ++seed);
      if (o == Outcome::kRefused) {
        refused.push_back(s.text());
        const Shape n = s.supported_neighbour();
        EXPECT_EQ(run_and_check(n, ++seed), Outcome::kCorrect) << s.text() << " was refused; " << n.text() << " must run";
      }
      if (!agree(!HasFailure())) return;
    }
  }
  if (process().rank == 0 && !refused.empty()) {
    std::string list;
    for (const std::string& r : refused) list += "\n    " + r;
    std::printf("[ info     ] refused (clean, neighbour ran):%s\n", list.c_str());
  }
}

TEST_P(MultiNodeOps, Fp16And128x128TilesMatchReference) {
  SKIP_UNLESS_MULTI_NODE();
  const OpLayout p = GetParam();
  EXPECT_EQ(run_and_check(make_shape(p.op, 2048, 1024, 2048, p.layout, DType::kF16), 77), Outcome::kCorrect);
  TpGemmOptions forced;
  forced.tile = GemmTile::k128x128;
  EXPECT_EQ(run_and_check(make_shape(p.op, 2048, 2048, 2048, p.layout), 78, forced), Outcome::kCorrect);
  forced.tile = GemmTile::k128x256;
  EXPECT_EQ(run_and_check(make_shape(p.op, 2048, 2048, 2048, p.layout), 79, forced), Outcome::kCorrect);
}

INSTANTIATE_TEST_SUITE_P(MultiNode, MultiNodeOps,
                         ::testing::Values(OpLayout{OpId::kAgGemm, BLayout::kKN}, OpLayout{OpId::kAgGemm, BLayout::kNK},
                                           OpLayout{OpId::kGemmRs, BLayout::kKN}, OpLayout{OpId::kGemmRs, BLayout::kNK},
                                           OpLayout{OpId::kGemmAr, BLayout::kKN}, OpLayout{OpId::kGemmAr, BLayout::kNK}),
                         [](const ::testing::TestParamInfo<OpLayout>& info) {
                           return std::string(op_name(info.param.op)) + "_" + std::string(b_layout_name(info.param.layout));
                         });

TEST(MultiNodeGatheredA, AgReturnsTheGatheredABitExact) {
  SKIP_UNLESS_MULTI_NODE();
  Communicator& comm = shared_comm();
  const uint64_t seed = 4100;
  for (bool in_place : {false, true}) {
    const Shape s = make_shape(OpId::kAgGemm, 2048, 1024, 1536, BLayout::kNK);
    SymmetricMem sym(comm);
    Inputs in(s, seed);
    Output out(s, sym);
    const size_t gathered_bytes = static_cast<size_t>(s.m * s.k_global) * s.elem();
    void* gathered = sym.alloc(gathered_bytes);
    bool ready = in.ok() && out.p && gathered && cudaMemset(out.p, 0xFF, s.out_bytes()) == cudaSuccess &&
                 cudaMemset(gathered, 0xFF, gathered_bytes) == cudaSuccess;
    TpGemmArgs args = args_for(s, in, out.p);
    args.gathered_a = gathered;
    if (ready && in_place) {
      // a is this rank's rows of gathered_a.
      void* own = at(gathered, s.block * s.rows() * s.k_global, s.dtype);
      ready = cudaMemcpy(own, in.a.p, s.a_bytes(), cudaMemcpyDeviceToDevice) == cudaSuccess;
      args.a = own;
    }
    ready = ready && cudaDeviceSynchronize() == cudaSuccess;
    ASSERT_TRUE(agree(ready)) << "setting up " << s.text();
    const Status launched = ag_gemm(comm, args, nullptr);
    ASSERT_TRUE(agree(launched.ok())) << s.text() << (in_place ? " in place" : "") << ": " << launched.to_string();
    const Status synced = comm.synchronize(nullptr);
    ASSERT_TRUE(agree(synced.ok())) << synced.to_string();
    DeviceMem want(gathered_bytes);
    for (int d = 0; d < s.world; ++d) {
      fill_matrix(at(want.p, d * s.rows() * s.k_global, s.dtype), s.dtype, s.rows(), s.k_global, s.k_global, seed_a(seed),
                  rank_of_block(d));
    }
    MN_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(different_words(gathered, want.p, gathered_bytes), 0u) << s.text() << (in_place ? " in place" : "");
    const Reference ref(s, seed);
    EXPECT_EQ(compare_output(s, out.p, ref), "") << s.text() << " with gathered_a";
    ASSERT_TRUE(agree(!HasFailure()));
  }
}

// ---- repeatability ------------------------------------------------------------------------------

// LOOM_TEST_STRESS_LAUNCHES launches of each operator back to back (default 50), no host sync in
// between; outputs rotate through at most 50 buffers, which must all hold the same bits, the
// reference's.
int stress_launches() {
  const char* text = std::getenv("LOOM_TEST_STRESS_LAUNCHES");
  if (text == nullptr) return 50;
  const Result<int64_t> n = env::parse_int("LOOM_TEST_STRESS_LAUNCHES", text, 2, 100000);
  EXPECT_TRUE(n.ok()) << n.status().to_string();
  return n.ok() ? static_cast<int>(*n) : 50;
}

TEST(MultiNodeStress, BackToBackLaunchesAreBitIdentical) {
  SKIP_UNLESS_MULTI_NODE();
  Communicator& comm = shared_comm();
  const int launches = stress_launches();
  const int slots = std::min(launches, 50);
  const uint64_t seed = 4200;
  SymmetricMem sym(comm);
  struct Series {
    Shape shape;
    std::unique_ptr<Inputs> inputs;
    std::vector<std::unique_ptr<DeviceMem>> plain;
    std::vector<void*> outs;
  };
  std::vector<Series> series;
  bool ready = true;
  for (OpId op : {OpId::kAgGemm, OpId::kGemmRs, OpId::kGemmAr}) {
    Series s;
    s.shape = make_shape(op, 1024, 1024, 2048, BLayout::kNK);
    s.inputs = std::make_unique<Inputs>(s.shape, seed);
    for (int i = 0; i < slots; ++i) {
      if (op == OpId::kGemmAr) {
        s.outs.push_back(sym.alloc(s.shape.out_bytes()));
      } else {
        s.plain.push_back(std::make_unique<DeviceMem>(s.shape.out_bytes()));
        s.outs.push_back(s.plain.back()->p);
      }
      ready = ready && s.outs.back() != nullptr && cudaMemset(s.outs.back(), 0xFF, s.shape.out_bytes()) == cudaSuccess;
    }
    ready = ready && s.inputs->ok();
    series.push_back(std::move(s));
  }
  ready = ready && cudaDeviceSynchronize() == cudaSuccess;
  ASSERT_TRUE(agree(ready));
  cudaStream_t stream;
  MN_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Status launched;
  for (int i = 0; i < launches && launched.ok(); ++i) {
    for (Series& s : series) {
      const Status st = launch(comm, s.shape.op, args_for(s.shape, *s.inputs, s.outs[static_cast<size_t>(i % slots)]), stream);
      launched = st;
      if (!launched.ok()) break;
    }
  }
  const Status synced = comm.synchronize(stream);
  cudaStreamDestroy(stream);
  ASSERT_TRUE(agree(launched.ok() && synced.ok())) << launched.to_string() << " / " << synced.to_string();
  for (Series& s : series) {
    const Reference ref(s.shape, seed);
    EXPECT_EQ(compare_output(s.shape, s.outs[0], ref), "") << s.shape.text() << ", launch 0";
    int differing = 0;
    for (size_t i = 1; i < s.outs.size(); ++i) differing += different_words(s.outs[i], s.outs[0], s.shape.out_bytes()) != 0 ? 1 : 0;
    EXPECT_EQ(differing, 0) << s.shape.text() << ": of " << slots << " output buffers (" << launches
                            << " launches, no host sync), this many differ from the first";
  }
  if (process().rank == 0) std::printf("[ info     ] %d back-to-back launches of each operator\n", launches);
  EXPECT_TRUE(agree(!HasFailure()));
}

// ---- traffic --------------------------------------------------------------------------------------

// The hierarchical rule, counted at the proxy: data crosses the network once per remote node and
// only between same-index GPUs, so each of a node's L GPUs posts exactly its 1/L share: (N - 1)
// row blocks of M/W rows (ag_gemm: of A; gemm_rs: of the node-reduced partial; gemm_ar: that plus
// the all-gather's N - 1 blocks of the result), and one 8-byte entry word per network peer that
// writes to it (ag_gemm's ring: the predecessor; the reduce kernels: every other node).
TEST(MultiNodeTraffic, EachGpuPostsItsShareOnce) {
  SKIP_UNLESS_MULTI_NODE();
  Communicator& comm = shared_comm();
  runtime::net::Proxy* proxy = internal(comm).network->proxy();
  ASSERT_NE(proxy, nullptr);
  const uint64_t nodes = static_cast<uint64_t>(comm.num_nodes());
  const uint64_t world = static_cast<uint64_t>(comm.world_size());
  uint64_t seed = 4300;
  for (OpId op : {OpId::kAgGemm, OpId::kGemmRs, OpId::kGemmAr}) {
    const Shape s = make_shape(op, static_cast<int64_t>(256 * world), 768, 1024, BLayout::kNK);
    SymmetricMem sym(comm);
    Inputs in(s, ++seed);
    Output out(s, sym);
    ASSERT_TRUE(agree(in.ok() && out.p != nullptr && cudaDeviceSynchronize() == cudaSuccess));
    const uint64_t before = proxy->stats().bytes_posted;
    const Status launched = launch(comm, op, args_for(s, in, out.p), nullptr);
    const Status synced = launched.ok() ? comm.synchronize(nullptr) : launched;
    ASSERT_TRUE(agree(synced.ok())) << s.text() << ": " << synced.to_string();
    const uint64_t posted = proxy->stats().bytes_posted - before;
    const uint64_t block_rows = static_cast<uint64_t>(s.m) / world;
    const uint64_t row_bytes = static_cast<uint64_t>(op == OpId::kAgGemm ? s.k_global : s.n) * s.elem();
    const uint64_t blocks = op == OpId::kGemmAr ? 2 * (nodes - 1) : nodes - 1;
    const uint64_t entries = op == OpId::kAgGemm ? 1 : nodes - 1;
    const uint64_t expected = blocks * block_rows * row_bytes + 8 * entries;
    EXPECT_EQ(posted, expected) << s.text() << ": bytes this GPU posted to the network (" << blocks << " blocks of "
                                << block_rows << " rows x " << row_bytes << " B + " << entries << " entry words)";
    EXPECT_EQ(compare_output(s, out.p, Reference(s, seed)), "") << s.text();
    ASSERT_TRUE(agree(!HasFailure()));
  }
}

// ---- failures -------------------------------------------------------------------------------------

class MultiNodeFailure : public ::testing::TestWithParam<OpId> {};


TEST_P(MultiNodeFailure, SilentRankTimesOut) {
  SKIP_UNLESS_MULTI_NODE();
  const OpId op = GetParam();
  constexpr int kTimeoutMs = 2000;
  CommOptions options;
  options.heap_bytes = uint64_t{1} << 30;
  options.op_timeout = std::chrono::milliseconds(kTimeoutMs);
  std::unique_ptr<Communicator> comm = test::make_comm(options);
  ASSERT_NE(comm, nullptr);
  const int silent = process().world_size - 1;
  Shape s = make_shape(op, 1024, 512, 1024, BLayout::kNK);
  Inputs in(s, 31);
  SymmetricMem sym(*comm);
  Output out(s, sym);
  // One call everywhere first (workspace growth, as in a real job); then one rank goes silent.
  bool warmed = in.ok() && out.p != nullptr;
  if (warmed) {
    const Status first = launch(*comm, op, args_for(s, in, out.p), nullptr);
    const Status synced = first.ok() ? comm->synchronize(nullptr) : first;
    EXPECT_TRUE(synced.ok()) << s.text() << ": the call before the peer goes silent: " << synced.to_string();
    warmed = synced.ok();
  }
  warmed = test::all_ranks_agree(*comm, warmed);
  auto wait_for_the_silent_peer = [&] {
    const auto start = std::chrono::steady_clock::now();
    LOOM_ASSERT_OK(launch(*comm, op, args_for(s, in, out.p), nullptr));
    const Status st = comm->synchronize(nullptr);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
    EXPECT_GE(test::named_rank(st.message()), 0) << "should name the rank it waited for: " << st.to_string();
    // A rank the silent one writes into sees its missing entry and says so, whichever wait hit
    // the deadline first: its local peers, and the same-index GPUs it announces itself to (every
    // other node for gemm_rs / gemm_ar; for ag_gemm's ring, its predecessor).
    const int L = comm->local_world_size(), N = comm->num_nodes();
    const int me = process().rank, sn = silent / L, sl = silent % L;
    const bool local_peer = me / L == sn;
    const bool net_peer = me % L == sl && (op != OpId::kAgGemm || me / L == (sn + N - 1) % N);
    if (local_peer || net_peer) {
      EXPECT_NE(st.message().find("rank " + std::to_string(silent) + " did not enter this launch"), std::string::npos)
          << "should say the silent rank never entered: " << st.to_string();
    }
    EXPECT_NE(st.message().find(op_name(op)), std::string::npos) << "should name the operator: " << st.to_string();
    EXPECT_LE(elapsed, kTimeoutMs / 1000.0 + 1.0) << "timed out only after " << elapsed << " s";
    EXPECT_EQ(launch(*comm, op, args_for(s, in, out.p), nullptr).code(), StatusCode::kAborted);
    // The CUDA context is still usable.
    DeviceMem probe(64 * sizeof(float));
    ASSERT_NE(probe.p, nullptr);
    ASSERT_TRUE(verify::fill_values(static_cast<float*>(probe.p), 64, 3, 0, nullptr));
    std::vector<float> host(64, 0.0f);
    MN_CUDA(cudaMemcpy(host.data(), probe.p, 64 * sizeof(float), cudaMemcpyDeviceToHost));
    EXPECT_EQ(host[5], verify::element_value(3, 0, 5));
  };
  if (!warmed) {
    ADD_FAILURE() << "rank " << process().rank << ": setting up " << s.text();
  } else if (process().rank != silent) {
    wait_for_the_silent_peer();
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(kTimeoutMs + 2000));
  }
  (void)internal(*comm).bootstrap->barrier();
  if (process().rank == silent) comm->abort("test over");
}

INSTANTIATE_TEST_SUITE_P(MultiNode, MultiNodeFailure, ::testing::Values(OpId::kAgGemm, OpId::kGemmRs, OpId::kGemmAr),
                         [](const ::testing::TestParamInfo<OpId>& info) { return std::string(op_name(info.param)); });

// A command the proxy must reject (destination = the rank itself): the kernel waits for nothing,
// but synchronize reports the proxy's verdict and the communicator is failed. Every rank sends
// one, so a rank may hear of a peer's verdict (peer_failure, through the watchdog) before its own.
__global__ void bad_command_kernel(const __grid_constant__ DeviceComm c) {
  const uint64_t epoch = kernels::launch_epoch(c.epoch_state);
  const kernels::WaitContext ctx = kernels::WaitContext::start(c.wait, OpId::kNetExchange, epoch);
  if (threadIdx.x == 0) {
    (void)kernels::net_put(c, 0, c.net.rank, 0, 0, 64, ring::kNoFlag, ctx);
    (void)kernels::net_wait_proxy_done(c, ctx);  // a rejected command counts as done
    kernels::finish_launch(c.epoch_state, epoch);
  }
}

TEST(MultiNodeFailure, ProxyRejectionIsReportedBySynchronize) {
  SKIP_UNLESS_MULTI_NODE();
  CommOptions options;
  options.heap_bytes = uint64_t{256} << 20;
  options.op_timeout = std::chrono::milliseconds(2000);
  std::unique_ptr<Communicator> comm = test::make_comm(options);
  ASSERT_NE(comm, nullptr);
  bad_command_kernel<<<1, 32>>>(internal(*comm).device_comm());
  MN_CUDA(cudaGetLastError());
  const Status st = comm->synchronize(nullptr);
  EXPECT_TRUE(st.code() == StatusCode::kInternal || st.code() == StatusCode::kPeerFailure) << st.to_string();
  EXPECT_NE(st.message().find("not a peer"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("proxy"), std::string::npos) << st.to_string();
  EXPECT_FALSE(comm->health().ok());
  (void)internal(*comm).bootstrap->barrier();
}

TEST(MultiNodeFailure, PausedProxyIsReportedAsStalled) {
  SKIP_UNLESS_MULTI_NODE();
  CommOptions options;
  options.heap_bytes = uint64_t{256} << 20;
  options.op_timeout = std::chrono::milliseconds(3000);
  std::unique_ptr<Communicator> comm = test::make_comm(options);
  ASSERT_NE(comm, nullptr);
  SymmetricMem sym(*comm);
  const uint32_t nodes = static_cast<uint32_t>(comm->num_nodes());
  void* src = sym.alloc(1 << 20);
  void* dst = sym.alloc((1 << 20) * (nodes - 1));
  ASSERT_TRUE(test::all_ranks_agree(*comm, src && dst));
  internal(*comm).network->proxy()->pause_for_test(true);  // every rank: its own lanes stop turning
  const auto start = std::chrono::steady_clock::now();
  LOOM_ASSERT_OK(ops::net_exchange(*comm, src, dst, 1 << 20, nullptr));
  const Status st = comm->synchronize(nullptr);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("proxy"), std::string::npos) << st.to_string();
  EXPECT_LE(elapsed, 3.0 + 1.0) << "reported only after " << elapsed << " s";
  internal(*comm).network->proxy()->pause_for_test(false);
  (void)internal(*comm).bootstrap->barrier();
}

}  // namespace
}  // namespace loom
