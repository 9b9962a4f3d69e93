// Cross-rank consistency (docs/SECURITY.md "Cross-rank consistency"; reliability.md B1, B2, H9):
// the last rank makes a different call from the others — another collective, another count,
// dtype or CTA count, another fused operator or M, a decomposed ag_gemm with another K, a causal
// ring attention against a full one, MoE routing with another top-k — and every rank's
// synchronize returns invalid_argument within moments (not the 20 s op timeout), saying which
// rank called what; the buffers peers would have written into still hold their poison (nothing
// moved between the mismatched ranks; not checked for ring attention and MoE, whose receive
// buffers are loom's workspace). Each case uses a fresh communicator (a
// mismatch ends one). Runs in the single-node steps: loom-run -n N -- loom_gpu_tests
// --gtest_filter='Consistency*' (N >= 2; ranks may share a GPU).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/attention.h"
#include "loom/collectives.h"
#include "loom/communicator.h"
#include "loom/moe.h"
#include "loom/tensor_parallel.h"
#include "tests/gpu/harness.h"

namespace loom {
namespace {

using test::process;
using SteadyClock = std::chrono::steady_clock;

constexpr uint8_t kPoison = 0x7b;

enum class Case {
  kOtherCollective,
  kOtherCount,
  kOtherDtype,
  kOtherCtas,
  kOtherFusedOp,
  kOtherM,
  kDecomposedOtherK,
  kRingOtherCausal,
  kMoeOtherTopK,
};

const char* case_name(Case c) {
  switch (c) {
    case Case::kOtherCollective: return "AllReduceVsAllGather";
    case Case::kOtherCount: return "AllReduceOtherCount";
    case Case::kOtherDtype: return "AllReduceOtherDtype";
    case Case::kOtherCtas: return "AllReduceOtherCtas";
    case Case::kOtherFusedOp: return "GemmRsVsGemmAr";
    case Case::kOtherM: return "AgGemmOtherM";
    case Case::kDecomposedOtherK: return "DecomposedAgGemmOtherK";
    case Case::kRingOtherCausal: return "RingAttentionCausalVsFull";
    case Case::kMoeOtherTopK: return "MoeRoutingOtherTopK";
  }
  return "?";
}

// Symmetric buffers of one case, poisoned, freed with the communicator.
struct Buffers {
  Communicator& comm;
  std::vector<std::pair<void*, size_t>> all;
  explicit Buffers(Communicator& c) : comm(c) {}
  ~Buffers() {
    for (auto& [p, n] : all) (void)comm.free(p);
  }
  void* get(size_t bytes) {
    Result<void*> p = comm.alloc(bytes);
    if (!p.ok()) return nullptr;
    if (cudaMemset(*p, kPoison, bytes) != cudaSuccess) return nullptr;
    all.emplace_back(*p, bytes);
    return *p;
  }
};

// Whether bytes [from, from + bytes) of `p` still hold the poison.
bool poisoned(const void* p, size_t from, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  if (cudaMemcpy(host.data(), static_cast<const char*>(p) + from, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  for (uint8_t b : host) {
    if (b != kPoison) return false;
  }
  return true;
}

class Consistency : public ::testing::TestWithParam<Case> {};

TEST_P(Consistency, MismatchIsInvalidArgumentNamingWhoCalledWhatAndNothingMoves) {
  const int world = process().world_size;
  if (world < 2) GTEST_SKIP() << "needs at least two ranks";
  const Case c = GetParam();
  const int odd = world - 1;  // the rank that calls something else
  const bool mine_odd = process().rank == odd;
  CommOptions options;
  options.heap_bytes = uint64_t{256} << 20;
  options.op_timeout = std::chrono::milliseconds(20'000);
  std::unique_ptr<Communicator> comm = test::make_comm(options);
  ASSERT_NE(comm, nullptr);
  // Operators in which a rank checks only some peers' entry words (the others learn of the
  // mismatch from the watchdog, not naming the odd rank themselves).
  const bool fused_case = c != Case::kOtherCollective && c != Case::kOtherCount && c != Case::kOtherDtype &&
                          c != Case::kOtherCtas;
  std::string guarded = "recv";  // what peers would have written into, checked afterwards
  void* watched = nullptr;
  size_t watched_from = 0, watched_bytes = 0;
  std::function<Status()> call;  // this rank's call
  {
    Buffers buf(*comm);
    if (c == Case::kRingOtherCausal) {
      // 2 x 256 rows per rank, 4 heads of 128; the odd rank's call is causal, the others' not.
      RingAttentionArgs a;
      a.batch = 2;
      a.seqlen = 256;
      a.heads_q = a.heads_kv = 4;
      a.head_dim = 128;
      const size_t bytes = static_cast<size_t>(a.batch * a.seqlen * a.heads_q * a.head_dim) * 2;
      a.q = buf.get(bytes);
      a.k = buf.get(bytes);
      a.v = buf.get(bytes);
      a.out = buf.get(bytes);
      ASSERT_TRUE(test::all_ranks_agree(*comm, a.q && a.k && a.v && a.out));
      RingAttentionOptions o;
      o.causal = mine_odd;
      call = [&, a, o] { return ring_attention(*comm, a, nullptr, o); };
    } else if (c == Case::kMoeOtherTopK) {
      // 2 experts per rank, 64 tokens of 256 bf16 elements; top-2 on the odd rank, top-1 elsewhere.
      MoeConfig config;
      config.num_experts = 2 * world;
      config.top_k = mine_odd ? 2 : 1;
      config.hidden = 256;
      config.max_tokens = 64;
      // Symmetric allocations are collective and equal on every rank: sized for the larger top-k.
      MoeConfig largest = config;
      largest.top_k = 2;
      Result<MoeSizes> sizes = moe_sizes(*comm, largest);
      ASSERT_TRUE(sizes.ok()) << sizes.status().to_string();
      std::vector<int32_t> ids(static_cast<size_t>(config.max_tokens * config.top_k));
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % static_cast<size_t>(config.num_experts));
      MoeRoutingArgs r;
      void* topk_ids = buf.get(static_cast<size_t>(config.max_tokens * largest.top_k) * sizeof(int32_t));
      r.plan = buf.get(sizes->plan_bytes);
      r.expert_offsets = static_cast<int32_t*>(buf.get(static_cast<size_t>(sizes->local_experts + 1) * sizeof(int32_t)));
      ASSERT_TRUE(test::all_ranks_agree(*comm, topk_ids && r.plan && r.expert_offsets));
      ASSERT_EQ(cudaMemcpy(topk_ids, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
      r.topk_ids = static_cast<const int32_t*>(topk_ids);
      r.num_tokens = config.max_tokens;
      call = [&, config, r] { return moe_routing(*comm, config, r, nullptr).status(); };
    } else if (!fused_case) {
      constexpr size_t kCount = 1 << 16;
      void* send = buf.get(kCount * 4 * world);
      void* recv = buf.get(kCount * 4 * world);
      ASSERT_TRUE(test::all_ranks_agree(*comm, send != nullptr && recv != nullptr));
      if (cudaMemset(send, 0, kCount * 4 * world) != cudaSuccess) FAIL();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      watched = recv;
      watched_bytes = kCount * 2;
      if (c == Case::kOtherCollective && mine_odd) {
        call = [&, send, recv] { return all_gather(*comm, send, recv, kCount / world, DType::kBF16, nullptr); };
      } else {
        size_t count = kCount;
        DType dtype = DType::kBF16;
        CollectiveOptions opts;
        if (mine_odd && c == Case::kOtherCount) count = kCount / 2;
        if (mine_odd && c == Case::kOtherDtype) dtype = DType::kF16;
        if (c == Case::kOtherCtas) opts.num_ctas = mine_odd ? 4 : 2;
        call = [&, send, recv, count, dtype, opts] { return all_reduce(*comm, send, recv, count, dtype, nullptr, opts); };
      }
    } else {
      // Fused TP operators (kFused: a shape the fused kernels take) and a decomposed ag_gemm.
      const int64_t m = 1024 * world, n = 512, k = 1024;
      TpGemmArgs a;
      a.m = m;
      a.n = n;
      a.k = k;
      a.dtype = DType::kBF16;
      a.b_layout = BLayout::kKN;
      TpGemmOptions topts;
      topts.algorithm = c == Case::kDecomposedOtherK ? TpAlgorithm::kDecomposed : TpAlgorithm::kFused;
      const int64_t kk = c == Case::kDecomposedOtherK && mine_odd ? k / 2 : k;
      a.a = buf.get(static_cast<size_t>(m * k) * 2);
      a.b = buf.get(static_cast<size_t>(k * n) * 2);
      a.out = buf.get(static_cast<size_t>(m * n) * 2);
      void* gathered = buf.get(static_cast<size_t>(m * k) * 2);
      ASSERT_TRUE(test::all_ranks_agree(*comm, a.a && a.b && a.out && gathered));
      if (c == Case::kOtherFusedOp) {
        // gemm_ar writes peers' reduced tiles into out; gemm_rs stages partials: the odd rank's out
        // is written by nobody before the entry check.
        call = [&, a, topts] { return mine_odd ? gemm_ar(*comm, a, nullptr, topts) : gemm_rs(*comm, a, nullptr, topts); };
        watched = const_cast<void*>(a.out);
        watched_bytes = static_cast<size_t>(m / world * n) * 2;
        guarded = "out";
      } else {
        // ag_gemm: peers push their rows of A into gathered_a; another M (or K) on the odd rank.
        a.gathered_a = gathered;
        if (mine_odd && c == Case::kOtherM) a.m = m / 2;
        a.k = kk;
        call = [&, a, topts] { return ag_gemm(*comm, a, nullptr, topts); };
        watched = gathered;
        // Rank 0's rows (never the odd rank's own): m / world rows of K.
        watched_from = 0;
        watched_bytes = static_cast<size_t>(a.m / world * kk) * 2;
        guarded = "gathered_a (rank 0's rows)";
      }
    }
    const SteadyClock::time_point start = SteadyClock::now();
    const Status launched = call();
    ASSERT_TRUE(launched.ok()) << launched.to_string();
    const Status st = comm->synchronize(nullptr);
    const double took = std::chrono::duration<double>(SteadyClock::now() - start).count();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << case_name(c) << ": " << st.to_string();
    EXPECT_LT(took, 5.0) << "the mismatch took the op timeout: " << st.to_string();
    const std::string other = "rank " + std::to_string(mine_odd ? 0 : odd);
    EXPECT_NE(st.message().find("called"), std::string::npos) << st.to_string();
    if (mine_odd || world == 2 || !fused_case) {
      // A rank that checked the odd one (every rank in a collective; in a fused operator, the ranks
      // that write into it) names it.
      EXPECT_NE(st.message().find(mine_odd ? "rank " : other), std::string::npos) << st.to_string();
    }
    if (watched != nullptr && (mine_odd || !fused_case)) {
      EXPECT_TRUE(poisoned(watched, watched_from, watched_bytes)) << case_name(c) << ": data reached " << guarded;
    }
    // The communicator is failed now.
    EXPECT_FALSE(comm->health().ok());
  }
}

INSTANTIATE_TEST_SUITE_P(Consistency, Consistency,
                         ::testing::Values(Case::kOtherCollective, Case::kOtherCount, Case::kOtherDtype, Case::kOtherCtas,
                                           Case::kOtherFusedOp, Case::kOtherM, Case::kDecomposedOtherK,
                                           Case::kRingOtherCausal, Case::kMoeOtherTopK),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(case_name(info.param)); });

}  // namespace
}  // namespace loom
