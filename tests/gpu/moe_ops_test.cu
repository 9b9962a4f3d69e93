// The MoE operators (moe_routing, moe_dispatch, moe_combine, moe_dispatch_gemm, moe_layer) on every rank of the job, under
// loom-run at any world size (one rank included: every path is then local). The shared-GPU suite
// runs them at W = 2, 4 and 8 with the ranks sharing one GPU (scripts/device/shared_gpu_suite.sh,
// steps moe-2 moe-4 moe-8).
//
// Every rank builds every rank's routing (a pure function of seed, rank and the case), so each
// computes the reference of the whole call (tests/common/moe_reference.h) and checks its own part:
//   routing   expert_offsets, every slot's destination (the plan's slot_dest) and the report's
//             counts equal the reference's;
//   dispatch  recv_x rows [0, kept) equal the source token rows bit for bit; rows past them keep
//             their NaN fill (recv_x is filled with 0xFF bytes before the call);
//   combine   the expert outputs are a pure function of (source rank, token, expert), written into
//             every rank's expert_out rows by the reference's row origins; out must equal, bit for
//             bit, the fp32 sum in slot order of w * y with fused multiply-adds, rounded once (the
//             kernel's documented order). Tolerance against the exact (fp64) sum, as a sanity
//             check of that reference: |out - exact| <= u |exact| + k 2^-23 sum_j |w_j y_j|, u the
//             output type's unit roundoff (bf16 2^-8, fp16 2^-11, fp32 2^-24).
// Routings: uniform (k distinct experts), skewed (one Categorical over the experts with U(0,1)
// weights, about 2x max/mean, as mKernel's benchmark), all-to-one (slot 0 of every token on one
// expert), one empty expert with unused (-1) slots, a token naming one expert twice, and a rank
// with zero tokens. Bad input (an id out of range, over the capacity) must be reported by
// moe_report on every rank with nothing moved; kDrop must drop exactly the reference's rows. 100
// back-to-back launches (LOOM_TEST_MOE_LAUNCHES) of the three calls without host synchronization
// must give the same bits every time. MoeSmoke (first) runs each kernel alone on a tiny case.
//
// A failed call fails its test fast (every wait is bounded: LOOM_TIMEOUT_MS plus two seconds at
// most) and leaves the shared communicator failed: every later MoE test then skips on every rank,
// device buffers are leaked rather than freed (cudaFree would wait for work that may never end),
// and main() ends the process once the results are written (tests/gpu/harness.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loom/moe.h"
#include "planner/moe_plan.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"
#include "tests/common/moe_reference.h"
#include "tests/common/verifiable.cuh"
#include "tests/gpu/harness.h"

namespace loom {
namespace {

using test::process;
using test::shared_comm;
namespace ref = test::moe;

bool agree(bool ok) { return test::all_ranks_agree(shared_comm(), ok); }

// Every MoE test: skipped on every rank once the shared communicator has failed on any (after a
// failed call it refuses every call, and the call's work may still hold the GPU), so that one
// failure ends the job in seconds instead of every later case failing (or blocking) in turn.
class MoeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!agree(!test::shared_comm_failed())) {
      GTEST_SKIP() << "the shared communicator failed in an earlier test (see its first failure)";
    }
  }
};

// ---- element values -----------------------------------------------------------------------------

// Bits of x rounded to `t` (low bytes of the result), and back.
uint32_t to_bits(DType t, float x) {
  if (t == DType::kBF16) return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(x)).x;
  if (t == DType::kF16) return static_cast<__half_raw>(__float2half_rn(x)).x;
  uint32_t b = 0;
  std::memcpy(&b, &x, 4);
  return b;
}
float from_bits(DType t, uint32_t b) {
  if (t == DType::kBF16) {
    __nv_bfloat16_raw r;
    r.x = static_cast<unsigned short>(b);
    return __bfloat162float(__nv_bfloat16(r));
  }
  if (t == DType::kF16) {
    __half_raw r;
    r.x = static_cast<unsigned short>(b);
    return __half2float(__half(r));
  }
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
double unit_roundoff(DType t) { return t == DType::kBF16 ? 0x1p-8 : t == DType::kF16 ? 0x1p-11 : 0x1p-24; }

// Token row element (t, h) of rank s; and the expert output element h of (source, token, expert).
constexpr uint64_t kXSalt = 0x5EED0001, kYSalt = 0x5EED0002;
float x_value(uint64_t seed, int s, int64_t t, int64_t h, int64_t hidden) {
  return verify::element_value(seed ^ kXSalt, s, static_cast<uint64_t>(t * hidden + h));
}
float y_value(uint64_t seed, int s, int64_t t, int32_t e, int64_t h, int64_t hidden, int64_t experts) {
  return verify::element_value(seed ^ kYSalt, s, static_cast<uint64_t>((t * experts + e) * hidden + h));
}

// Packs `n` values of type t.
std::vector<uint8_t> pack(DType t, const std::vector<float>& v) {
  const size_t e = dtype_size(t);
  std::vector<uint8_t> out(v.size() * e);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t b = to_bits(t, v[i]);
    std::memcpy(out.data() + i * e, &b, e);
  }
  return out;
}
uint32_t element_bits(DType t, const uint8_t* p, size_t i) {
  uint32_t b = 0;
  std::memcpy(&b, p + i * dtype_size(t), dtype_size(t));
  return b;
}
uint32_t fill_bits(DType t) { return t == DType::kF32 ? 0xFFFFFFFFu : 0xFFFFu; }  // a 0xFF byte fill

// ---- routings ------------------------------------------------------------------------------------

enum class Routing { kUniform, kSkewed, kAllToOne, kEmptyExpert, kRepeated };
const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kAllToOne: return "all-to-one";
    case Routing::kEmptyExpert: return "empty-expert";
    case Routing::kRepeated: return "repeated";
  }
  return "?";
}

struct Case {
  Routing routing = Routing::kUniform;
  int64_t experts_per_rank = 4;
  int top_k = 4;
  int64_t hidden = 512;
  DType dtype = DType::kBF16;
  int64_t tokens = 200;          // per rank; rank r has tokens + 37 * r (mod 3 variety)
  bool rank0_empty = false;      // rank 0 routes no token
  int64_t capacity = 0;          // 0: the default (nothing overflows)
  MoeOverflow overflow = MoeOverflow::kError;
  uint64_t seed = 1;

  int64_t tokens_of(int rank) const {
    if (rank0_empty && rank == 0) return 0;
    return tokens + 37 * (rank % 3);
  }
  std::string text(int world) const {
    return std::string(routing_name(routing)) + " W=" + std::to_string(world) + " E=" +
           std::to_string(experts_per_rank * world) + " k=" + std::to_string(top_k) + " H=" + std::to_string(hidden) +
           " " + std::string(dtype_name(dtype)) + " T=" + std::to_string(tokens) + (rank0_empty ? " (rank 0: none)" : "") +
           " C=" + std::to_string(capacity) + (overflow == MoeOverflow::kDrop ? " drop" : "");
  }
};

// Rank s's top-k ids ([T, k]) for the case; every rank computes every rank's.
std::vector<int32_t> make_ids(const Case& c, int world, int s) {
  const int64_t experts = c.experts_per_rank * world;
  const int64_t t_count = c.tokens_of(s);
  std::mt19937_64 rng(c.seed * 1000003ull + static_cast<uint64_t>(s));
  // Skewed: one Categorical over the experts, weights U(0, 1), shared by all ranks.
  std::vector<double> probs(static_cast<size_t>(experts), 1.0);
  if (c.routing == Routing::kSkewed) {
    std::mt19937_64 shared(c.seed * 7919ull);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (double& p : probs) p = u(shared);
  }
  if (c.routing == Routing::kEmptyExpert) probs[1] = 0.0;  // expert 1 never chosen
  const int32_t hot = static_cast<int32_t>(experts - 1);
  if (c.routing == Routing::kAllToOne) probs[static_cast<size_t>(hot)] = 0.0;  // slot 0 takes it, once
  std::vector<int32_t> ids(static_cast<size_t>(t_count * c.top_k));
  for (int64_t t = 0; t < t_count; ++t) {
    int32_t* row = ids.data() + t * c.top_k;
    std::vector<double> left = probs;  // k distinct experts: a chosen one leaves the draw
    for (int j = 0; j < c.top_k; ++j) {
      const bool unused = c.routing == Routing::kEmptyExpert && (t + j) % 5 == 0;
      if (c.routing == Routing::kAllToOne && j == 0) {
        row[j] = hot;
      } else if (c.routing == Routing::kRepeated && j == 1 && t % 2 == 0) {
        row[j] = row[0];  // the same expert twice: two rows of it, one crossing NVLink
        continue;
      } else if (unused || std::none_of(left.begin(), left.end(), [](double p) { return p > 0.0; })) {
        row[j] = -1;  // an unused slot
      } else {
        row[j] = std::discrete_distribution<int32_t>(left.begin(), left.end())(rng);
      }
      if (row[j] >= 0) left[static_cast<size_t>(row[j])] = 0.0;
    }
  }
  return ids;
}

std::vector<float> make_weights(const Case& c, int s) {
  std::mt19937_64 rng(c.seed * 31337ull + static_cast<uint64_t>(s));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(c.tokens_of(s) * c.top_k));
  for (float& v : w) v = u(rng);
  return w;
}

// ---- buffers --------------------------------------------------------------------------------------

// Device memory of this GPU, freed at the end of its scope (null when cudaMalloc failed). Once the
// shared communicator has failed it is leaked instead: the failed call's work may still be running
// (for good, if no abort can end it), and cudaFree would wait for it (test::shared_comm_failed).
struct CudaFree {
  void operator()(void* p) const {
    if (!test::shared_comm_failed()) cudaFree(p);
  }
};
using DeviceBuffer = std::unique_ptr<void, CudaFree>;
DeviceBuffer device_buffer(size_t bytes) {
  void* p = nullptr;
  return DeviceBuffer(cudaMalloc(&p, std::max<size_t>(bytes, 256)) == cudaSuccess ? p : nullptr);
}

template <class T>
bool upload(void* dst, const std::vector<T>& v) {
  return v.empty() || cudaMemcpy(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess;
}
template <class T>
std::vector<T> download(const void* src, size_t n) {
  std::vector<T> v(n);
  if (n != 0 && cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) v.clear();
  return v;
}

// Everything one case needs on this rank: the config, every rank's routing and its reference,
// this rank's device buffers (recv_x and expert_out symmetric, filled with 0xFF bytes).
struct CaseBuffers {
  Case c;
  int world = 1, nodes = 1, local = 1, me = 0;  // me: position node * L + local index
  MoeConfig config;
  planner::MoeLayouts layouts;
  std::vector<std::vector<int32_t>> ids;   // every rank's
  std::vector<std::vector<float>> weights;  // every rank's
  std::vector<ref::RefRank> expected;
  int64_t tokens = 0;  // this rank's
  DeviceBuffer d_ids, d_weights, d_plan, d_offsets, d_x, d_out;
  void* recv = nullptr;  // symmetric, [C, H]
  void* y = nullptr;     // symmetric, [C, H]: the expert outputs
  bool ok = false;
  std::string setup_error;  // why not ok

  size_t row_bytes() const { return static_cast<size_t>(c.hidden) * dtype_size(c.dtype); }
  size_t recv_bytes() const { return static_cast<size_t>(layouts.capacity) * row_bytes(); }
  size_t out_bytes() const { return static_cast<size_t>(tokens) * row_bytes(); }

  // Collective (symmetric allocations): every rank builds the same case at the same point.
  explicit CaseBuffers(const Case& kase) : c(kase) {
    Communicator& comm = shared_comm();
    world = comm.world_size();
    nodes = comm.num_nodes();
    local = comm.local_world_size();
    me = comm.node() * local + comm.local_rank();  // the MoE position (rank_at[me] names its rank)
    config.num_experts = c.experts_per_rank * world;
    config.top_k = c.top_k;
    config.hidden = c.hidden;
    config.dtype = c.dtype;
    for (int s = 0; s < world; ++s) config.max_tokens = std::max(config.max_tokens, c.tokens_of(s));
    config.capacity = c.capacity;
    config.overflow = c.overflow;
    planner::MoeRequest request;
    request.config = config;
    request.world = world;
    request.num_nodes = nodes;
    Result<planner::MoeLayouts> l = planner::plan_moe(request);
    EXPECT_TRUE(l.ok()) << c.text(world) << ": " << l.status().to_string();
    if (!l.ok()) return;
    layouts = *l;
    ref::RefInput in;
    in.world = world;
    in.experts = config.num_experts;
    in.top_k = c.top_k;
    in.capacity = layouts.capacity;
    in.drop = c.overflow == MoeOverflow::kDrop;
    for (int s = 0; s < world; ++s) {
      ids.push_back(make_ids(c, world, s));
      weights.push_back(make_weights(c, s));
    }
    in.ids = ids;
    expected = ref::reference_routing(in);
    tokens = c.tokens_of(me);
    const size_t pairs = static_cast<size_t>(tokens * c.top_k);
    d_ids = device_buffer(pairs * 4);
    d_weights = device_buffer(pairs * 4);
    d_plan = device_buffer(static_cast<size_t>(layouts.plan.bytes));
    d_offsets = device_buffer(static_cast<size_t>(layouts.local_experts + 1) * 4);
    d_x = device_buffer(out_bytes());
    d_out = device_buffer(out_bytes());
    Result<void*> r = comm.alloc(recv_bytes());
    Result<void*> e = comm.alloc(recv_bytes());
    recv = r.ok() ? *r : nullptr;
    y = e.ok() ? *e : nullptr;
    std::vector<float> x(static_cast<size_t>(tokens * c.hidden));
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < c.hidden; ++h) x[static_cast<size_t>(t * c.hidden + h)] = x_value(c.seed, me, t, h, c.hidden);
    }
    if (!r.ok() || !e.ok()) {
      setup_error = "symmetric alloc of " + std::to_string(recv_bytes()) + " bytes: " + (r.ok() ? e : r).status().to_string();
    } else if (!(d_ids && d_weights && d_plan && d_offsets && d_x && d_out)) {
      setup_error = "cudaMalloc";
    }
    ok = d_ids && d_weights && d_plan && d_offsets && d_x && d_out && recv && y && upload(d_ids.get(), ids[me]) &&
         upload(d_weights.get(), weights[me]) && upload(d_x.get(), pack(c.dtype, x)) &&
         cudaMemset(d_plan.get(), 0xAB, static_cast<size_t>(layouts.plan.bytes)) == cudaSuccess && poison() &&
         cudaDeviceSynchronize() == cudaSuccess;
    if (!ok && setup_error.empty()) setup_error = std::string("CUDA: ") + cudaGetErrorString(cudaGetLastError());
    if (!ok) ADD_FAILURE() << c.text(world) << ": rank " << me << " could not set up: " << setup_error;
  }
  // Frees the symmetric buffers in reverse order (collective, like the allocation).
  ~CaseBuffers() {
    Communicator& comm = shared_comm();
    if (y != nullptr) (void)comm.free(y);
    if (recv != nullptr) (void)comm.free(recv);
  }
  CaseBuffers(const CaseBuffers&) = delete;
  CaseBuffers& operator=(const CaseBuffers&) = delete;

  // recv_x, expert_out and out back to 0xFF bytes (NaN in every type), expert_offsets to garbage.
  bool poison() {
    return cudaMemset(recv, 0xFF, recv_bytes()) == cudaSuccess && cudaMemset(y, 0xFF, recv_bytes()) == cudaSuccess &&
           cudaMemset(d_out.get(), 0xFF, out_bytes()) == cudaSuccess &&
           cudaMemset(d_offsets.get(), 0x7F, static_cast<size_t>(layouts.local_experts + 1) * 4) == cudaSuccess;
  }

  MoeRoutingArgs routing_args() const {
    MoeRoutingArgs a;
    a.topk_ids = static_cast<const int32_t*>(d_ids.get());
    a.topk_weights = static_cast<const float*>(d_weights.get());
    a.num_tokens = tokens;
    a.plan = d_plan.get();
    a.expert_offsets = static_cast<int32_t*>(d_offsets.get());
    return a;
  }
  MoeCombineArgs combine_args() const {
    MoeCombineArgs a;
    a.expert_out = y;
    a.out = d_out.get();
    a.dtype = c.dtype;
    return a;
  }

  // What combine gives token t of this rank when slot q's expert output is y_of(q): the
  // documented order, per node its routed slots' fp32 FMA sum in slot order, then the node sums
  // added in node order (on one node, the slot-order sum itself).
  template <class Y>
  float combined(int64_t t, Y y_of) const {
    const ref::RefRank& want = expected[me];
    std::vector<float> node_sum(static_cast<size_t>(nodes), 0.0f);
    for (int j = 0; j < c.top_k; ++j) {
      const size_t q = static_cast<size_t>(t * c.top_k + j);
      if (want.slot_dest[q] < 0) continue;
      const size_t node = static_cast<size_t>(want.slot_dest[q] / layouts.capacity / local);
      node_sum[node] = std::fma(weights[me][q], y_of(q), node_sum[node]);
    }
    float acc = node_sum[0];
    for (size_t n = 1; n < node_sum.size(); ++n) acc += node_sum[n];
    return acc;
  }

  // This rank's expert outputs: row r (< kept) holds y(source, token, expert) of its origin.
  bool fill_expert_outputs() const {
    const ref::RefRank& mine = expected[me];
    std::vector<float> v(mine.rows.size() * static_cast<size_t>(c.hidden));
    for (size_t r = 0; r < mine.rows.size(); ++r) {
      const ref::RefRow& o = mine.rows[r];
      const int32_t e = ids[o.source][static_cast<size_t>(o.token * c.top_k + o.slot)];
      for (int64_t h = 0; h < c.hidden; ++h) v[r * c.hidden + h] = y_value(c.seed, o.source, o.token, e, h, c.hidden, config.num_experts);
    }
    return upload(y, pack(c.dtype, v)) && cudaDeviceSynchronize() == cudaSuccess;
  }
};

// ---- checks --------------------------------------------------------------------------------------

// Routing: expert_offsets, the plan's slot destinations, the report.
void check_routing(const CaseBuffers& s, const MoePlan& plan, const MoeReport& report, const std::string& what) {
  const ref::RefRank& want = s.expected[s.me];
  EXPECT_EQ(download<int32_t>(s.d_offsets.get(), want.expert_offsets.size()), want.expert_offsets)
      << what << ": rank " << s.me << ": expert_offsets";
  const std::vector<int32_t> dest = download<int32_t>(static_cast<const char*>(plan.plan) + s.layouts.plan.slot_dest,
                                                      want.slot_dest.size());
  size_t wrong = 0, first = dest.size();
  for (size_t q = 0; q < dest.size() && q < want.slot_dest.size(); ++q) {
    if (dest[q] != want.slot_dest[q] && wrong++ == 0) first = q;
  }
  EXPECT_EQ(dest.size(), want.slot_dest.size()) << what;
  EXPECT_EQ(wrong, 0u) << what << ": rank " << s.me << ": " << wrong << " slot destinations differ; first (token "
                       << first / s.c.top_k << ", slot " << first % s.c.top_k << "): "
                       << (first < dest.size() ? std::to_string(dest[first]) + " instead of " + std::to_string(want.slot_dest[first]) : "");
  EXPECT_EQ(report.recv_rows, want.recv_rows) << what << ": rank " << s.me;
  EXPECT_EQ(report.kept_rows, want.kept_rows) << what << ": rank " << s.me;
  EXPECT_EQ(report.dropped_rows, want.dropped_rows) << what << ": rank " << s.me;
  EXPECT_EQ(report.dropped_slots, want.dropped_slots) << what << ": rank " << s.me;
  EXPECT_EQ(report.max_recv_rows, want.max_recv_rows) << what << ": rank " << s.me;
}

// Dispatch: recv_x rows [0, kept) are their tokens' rows bit for bit, the rest untouched.
void check_dispatch(const CaseBuffers& s, const std::string& what) {
  const ref::RefRank& want = s.expected[s.me];
  const std::vector<uint8_t> got = download<uint8_t>(s.recv, s.recv_bytes());
  ASSERT_EQ(got.size(), s.recv_bytes()) << what << ": reading recv_x back";
  const int64_t h_count = s.c.hidden;
  int64_t wrong_rows = 0, first_row = -1;
  std::string first_text;
  for (int64_t r = 0; r < s.layouts.capacity; ++r) {
    const uint8_t* row = got.data() + static_cast<size_t>(r) * s.row_bytes();
    const bool kept = r < static_cast<int64_t>(want.rows.size());
    for (int64_t h = 0; h < h_count; ++h) {
      const uint32_t bits = element_bits(s.c.dtype, row, static_cast<size_t>(h));
      const uint32_t expect = kept ? to_bits(s.c.dtype, x_value(s.c.seed, want.rows[r].source, want.rows[r].token, h, h_count))
                                   : fill_bits(s.c.dtype);
      if (bits != expect) {
        if (wrong_rows++ == 0) {
          first_row = r;
          first_text = kept ? "token " + std::to_string(want.rows[r].token) + " of rank " + std::to_string(want.rows[r].source) +
                                  ", element " + std::to_string(h)
                            : "a row past the kept ones was written, element " + std::to_string(h);
        }
        break;
      }
    }
  }
  EXPECT_EQ(wrong_rows, 0) << what << ": rank " << s.me << ": " << wrong_rows << " of " << s.layouts.capacity
                           << " receive rows wrong (kept " << want.rows.size() << "); first row " << first_row << " ("
                           << first_text << ")";
}

// Combine: out equals the slot-order fp32 FMA sum bit for bit (and the exact sum within u). Across
// nodes the order is the documented one: per node, its slots' FMA sum in slot order; then the
// node sums added in node order.
void check_combine(const CaseBuffers& s, const std::string& what) {
  const ref::RefRank& want = s.expected[s.me];
  const std::vector<uint8_t> got = download<uint8_t>(s.d_out.get(), s.out_bytes());
  ASSERT_EQ(got.size(), s.out_bytes()) << what << ": reading out back";
  const int k = s.c.top_k;
  const int64_t h_count = s.c.hidden;
  const double u = unit_roundoff(s.c.dtype);
  int64_t wrong = 0, loose = 0;
  std::string first;
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t h = 0; h < h_count; ++h) {
      auto y_of = [&](size_t q) {
        const int32_t e = s.ids[s.me][q];
        return from_bits(s.c.dtype, to_bits(s.c.dtype, y_value(s.c.seed, s.me, t, e, h, h_count, s.config.num_experts)));
      };
      const float acc = s.combined(t, y_of);
      double exact = 0.0, magnitude = 0.0;
      for (int j = 0; j < k; ++j) {
        const size_t q = static_cast<size_t>(t * k + j);
        if (want.slot_dest[q] < 0) continue;
        const double wy = static_cast<double>(s.weights[s.me][q]) * y_of(q);
        exact += wy;
        magnitude += std::fabs(wy);
      }
      const uint32_t bits = element_bits(s.c.dtype, got.data(), static_cast<size_t>(t * h_count + h));
      const uint32_t expect = to_bits(s.c.dtype, acc);
      const float value = from_bits(s.c.dtype, bits);
      const bool zeros = value == 0.0f && acc == 0.0f;  // +0 and -0 alike
      if (bits != expect && !zeros) {
        if (wrong++ == 0) {
          first = "token " + std::to_string(t) + " element " + std::to_string(h) + ": " + std::to_string(value) +
                  " instead of " + std::to_string(from_bits(s.c.dtype, expect));
        }
      }
      if (!(std::fabs(value - exact) <= u * std::fabs(exact) + k * 0x1p-23 * magnitude)) ++loose;
    }
  }
  EXPECT_EQ(wrong, 0) << what << ": rank " << s.me << ": " << wrong << " of " << s.tokens * h_count
                      << " outputs differ from the slot-order fp32 sum; first: " << first;
  EXPECT_EQ(loose, 0) << what << ": rank " << s.me << ": " << loose << " outputs outside the tolerance of the exact sum";
}

bool all_bytes(const void* p, size_t bytes, uint8_t value) {
  const std::vector<uint8_t> v = download<uint8_t>(p, bytes);
  return v.size() == bytes && std::all_of(v.begin(), v.end(), [&](uint8_t b) { return b == value; });
}

// moe_routing, moe_dispatch and moe_combine (with `combine`), each call's acceptance agreed on by
// every rank (so a refusal on one rank stops them all): the plan, or why not.
Result<MoePlan> launch_all(const CaseBuffers& s, const MoeCombineArgs& combine) {
  Communicator& comm = shared_comm();
  Result<MoePlan> plan = moe_routing(comm, s.config, s.routing_args(), nullptr);
  if (!agree(plan.ok())) return plan.ok() ? Status::aborted("a peer's moe_routing was refused") : plan.status();
  const Status dispatched = moe_dispatch(comm, *plan, s.d_x.get(), s.recv, nullptr);
  if (!agree(dispatched.ok())) return dispatched.ok() ? Status::aborted("a peer's moe_dispatch was refused") : dispatched;
  const Status combined = moe_combine(comm, *plan, combine, nullptr);
  if (!agree(combined.ok())) return combined.ok() ? Status::aborted("a peer's moe_combine was refused") : combined;
  return plan;
}

// ---- one case --------------------------------------------------------------------------------------

// Routing, dispatch and combine of one case, each checked against the reference on every rank.
void run_case(const Case& c) {
  Communicator& comm = shared_comm();
  const std::string what = c.text(comm.world_size());
  CaseBuffers s(c);
  ASSERT_TRUE(agree(s.ok && s.fill_expert_outputs())) << what << ": rank " << process().rank << " or a peer could not set up";
  Result<MoePlan> plan = launch_all(s, s.combine_args());
  ASSERT_TRUE(plan.ok()) << what << ": rank " << process().rank << ": " << plan.status().to_string();
  Result<MoeReport> report = moe_report(comm, *plan, nullptr);  // synchronizes the stream
  ASSERT_TRUE(agree(report.ok())) << what << ": rank " << process().rank << ": " << report.status().to_string();
  EXPECT_TRUE(report->status.ok()) << what << ": " << report->status.to_string();
  check_routing(s, *plan, *report, what);
  check_dispatch(s, what);
  check_combine(s, what);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

class MoeOps : public MoeTest, public ::testing::WithParamInterface<Case> {};

TEST_P(MoeOps, RoutingDispatchCombineMatchTheReference) { run_case(GetParam()); }

Case make_case(Routing r, uint64_t seed) {
  Case c;
  c.routing = r;
  c.seed = seed;
  return c;
}

// ---- smoke ----------------------------------------------------------------------------------------

// The calls one kernel at a time on a tiny case: E = 2W, k = 2, T = 16 (+ 37 (r mod 3)), H = 40
// bf16 (80-byte rows: 5 vectors, fewer than a warp has lanes). MoeSmoke is registered before every
// other MoE suite, so under --gtest_filter='Moe*' it runs first, and each test runs alone too
// (--gtest_filter=MoeSmoke.Routing, .Dispatch, .Combine): a failure names its kernel.
//   Routing   moe_routing, then the report: expert_offsets, slot destinations, counts
//   Dispatch  moe_routing + moe_dispatch: the routing's checks and recv_x
//   Combine   moe_routing + moe_combine over expert outputs the test writes (no dispatch; across
//             nodes after moe_dispatch, which combine needs there): out
enum class SmokeStage { kRouting, kDispatch, kCombine };

void run_smoke(SmokeStage stage, uint64_t seed) {
  Communicator& comm = shared_comm();
  Case c = make_case(Routing::kUniform, seed);
  c.experts_per_rank = 2;
  c.top_k = 2;
  c.hidden = 40;
  c.tokens = 16;
  const char* name = stage == SmokeStage::kRouting ? "routing" : stage == SmokeStage::kDispatch ? "dispatch" : "combine";
  const std::string what = std::string("smoke ") + name + ": " + c.text(comm.world_size());
  CaseBuffers s(c);
  ASSERT_TRUE(agree(s.ok && (stage != SmokeStage::kCombine || s.fill_expert_outputs())))
      << what << ": rank " << process().rank << " or a peer could not set up";
  Result<MoePlan> plan = moe_routing(comm, s.config, s.routing_args(), nullptr);
  ASSERT_TRUE(agree(plan.ok())) << what << ": rank " << process().rank << ": moe_routing: " << plan.status().to_string();
  // Across nodes combine needs its plan's dispatch first (it leaves the other nodes' tokens there).
  if (stage == SmokeStage::kDispatch || (stage == SmokeStage::kCombine && comm.num_nodes() > 1)) {
    const Status dispatched = moe_dispatch(comm, *plan, s.d_x.get(), s.recv, nullptr);
    ASSERT_TRUE(agree(dispatched.ok())) << what << ": rank " << process().rank << ": moe_dispatch: " << dispatched.to_string();
  }
  if (stage == SmokeStage::kCombine) {
    const Status combined = moe_combine(comm, *plan, s.combine_args(), nullptr);
    ASSERT_TRUE(agree(combined.ok())) << what << ": rank " << process().rank << ": moe_combine: " << combined.to_string();
  }
  Result<MoeReport> report = moe_report(comm, *plan, nullptr);  // synchronizes the stream
  ASSERT_TRUE(agree(report.ok())) << what << ": rank " << process().rank << ": " << report.status().to_string();
  EXPECT_TRUE(report->status.ok()) << what << ": " << report->status.to_string();
  check_routing(s, *plan, *report, what);
  if (stage == SmokeStage::kDispatch) check_dispatch(s, what);
  if (stage == SmokeStage::kCombine) check_combine(s, what);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

class MoeSmoke : public MoeTest {};

TEST_F(MoeSmoke, Routing) { run_smoke(SmokeStage::kRouting, 81); }
TEST_F(MoeSmoke, Dispatch) { run_smoke(SmokeStage::kDispatch, 82); }
TEST_F(MoeSmoke, Combine) { run_smoke(SmokeStage::kCombine, 83); }

// ---- every routing -----------------------------------------------------------------------------------

std::vector<Case> cases() {
  std::vector<Case> v;
  v.push_back(make_case(Routing::kUniform, 11));
  v.push_back(make_case(Routing::kSkewed, 12));
  v.push_back(make_case(Routing::kAllToOne, 13));
  Case empty = make_case(Routing::kEmptyExpert, 14);  // expert 1 never chosen, some slots unused
  empty.experts_per_rank = 6;
  v.push_back(empty);
  Case zero = make_case(Routing::kUniform, 15);  // rank 0 routes nothing, the others do
  zero.rank0_empty = true;
  v.push_back(zero);
  Case one = make_case(Routing::kAllToOne, 16);  // top-1, every token on one expert
  one.top_k = 1;
  v.push_back(one);
  Case wide = make_case(Routing::kSkewed, 17);  // top-8 of 8 experts per rank, odd-sized rows
  wide.experts_per_rank = 8;
  wide.top_k = 8;
  wide.hidden = 264;
  wide.tokens = 300;
  v.push_back(wide);
  Case half = make_case(Routing::kUniform, 18);
  half.dtype = DType::kF16;
  half.hidden = 136;
  v.push_back(half);
  Case single = make_case(Routing::kSkewed, 19);
  single.dtype = DType::kF32;
  single.hidden = 100;
  v.push_back(single);
  v.push_back(make_case(Routing::kRepeated, 21));
  Case many = make_case(Routing::kUniform, 20);  // several routing CTAs
  many.tokens = 3000;
  many.hidden = 64;
  v.push_back(many);
  return v;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string n = std::to_string(info.index) + "_" + routing_name(info.param.routing);
  for (char& ch : n) ch = ch == '-' ? '_' : ch;
  return n;
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeOps, ::testing::ValuesIn(cases()), case_name);

// ---- moe_dispatch_gemm ----------------------------------------------------------------------------
//
// The fused dispatch + expert GEMM against (a) moe_dispatch's bits for recv_x, (b) an fp64
// reference of every kept row's GEMM (relative L2 error within the output type's unit roundoff
// plus 1e-4: the inputs are exact in their type, fp32 accumulation over K <= 512 adds far less),
// (c) rows past the kept ones left untouched (0xFF fill), and (d) moe_dispatch followed by
// grouped_gemm on the same tile: bit-identical rows (the fused kernel only changes when a tile
// starts, not what it computes).

constexpr uint64_t kWSalt = 0x5EED0003;

struct GemmCase {
  Case moe;
  int64_t n = 256;
  BLayout b_layout = BLayout::kNK;
  GroupedActivation activation = GroupedActivation::kNone;
  DType out_dtype = DType::kBF16;
  GemmTile tile = GemmTile::k128x128;
  int push_ctas = 0;  // moe_dispatch_gemm's (0: the planner's)

  int64_t out_cols() const { return activation == GroupedActivation::kSwiGLU ? n / 2 : n; }
  std::string text(int world) const {
    return moe.text(world) + " N=" + std::to_string(n) + (b_layout == BLayout::kKN ? " B[E,K,N]" : " B[E,N,K]") +
           (activation == GroupedActivation::kSwiGLU ? " swiglu" : "") + " out " + std::string(dtype_name(out_dtype)) +
           " " + std::string(gemm_tile_name(tile)) + (push_ctas != 0 ? " push_ctas=" + std::to_string(push_ctas) : "");
  }
};

// Weight (e, n, k) of rank s, as a value of the input type.
float w_value(const GemmCase& g, int s, int64_t e, int64_t n, int64_t k) {
  const float v = 0.125f * verify::element_value(g.moe.seed ^ kWSalt, s, static_cast<uint64_t>((e * g.n + n) * g.moe.hidden + k));
  return from_bits(g.moe.dtype, to_bits(g.moe.dtype, v));
}

struct GemmBuffers {
  DeviceBuffer weights, out, composed;
  size_t out_bytes = 0;
  bool ok = false;

  GemmBuffers(const GemmCase& g, const CaseBuffers& s) {
    const int64_t el = s.layouts.local_experts, k = g.moe.hidden;
    std::vector<float> w(static_cast<size_t>(el * g.n * k));
    for (int64_t e = 0; e < el; ++e) {
      for (int64_t n = 0; n < g.n; ++n) {
        for (int64_t kk = 0; kk < k; ++kk) {
          const size_t at = g.b_layout == BLayout::kNK ? static_cast<size_t>((e * g.n + n) * k + kk)
                                                       : static_cast<size_t>((e * k + kk) * g.n + n);
          w[at] = w_value(g, s.me, e, n, kk);
        }
      }
    }
    out_bytes = static_cast<size_t>(s.layouts.capacity * g.out_cols()) * dtype_size(g.out_dtype);
    weights = device_buffer(w.size() * dtype_size(g.moe.dtype));
    out = device_buffer(out_bytes);
    composed = device_buffer(out_bytes);
    ok = weights && out && composed && upload(weights.get(), pack(g.moe.dtype, w)) &&
         cudaMemset(out.get(), 0xFF, out_bytes) == cudaSuccess && cudaMemset(composed.get(), 0xFF, out_bytes) == cudaSuccess &&
         cudaDeviceSynchronize() == cudaSuccess;
  }

  MoeExpertGemm args(const GemmCase& g, void* dst) const {
    MoeExpertGemm a;
    a.weights = weights.get();
    a.n = g.n;
    a.b_layout = g.b_layout;
    a.activation = g.activation;
    a.out = dst;
    a.out_dtype = g.out_dtype;
    return a;
  }
};

// out against the fp64 reference of every kept row; rows past them still hold the fill.
void check_expert_gemm(const GemmCase& g, const CaseBuffers& s, const GemmBuffers& b, const std::string& what) {
  const ref::RefRank& want = s.expected[s.me];
  const std::vector<uint8_t> got = download<uint8_t>(b.out.get(), b.out_bytes);
  ASSERT_EQ(got.size(), b.out_bytes) << what << ": reading out back";
  const int64_t cols = g.out_cols(), k = g.moe.hidden;
  const int64_t kept = static_cast<int64_t>(want.rows.size());
  double err2 = 0.0, ref2 = 0.0;
  int64_t not_finite = 0, written_past = 0;
  std::vector<double> acc(static_cast<size_t>(g.n));
  std::vector<float> x(static_cast<size_t>(k));
  std::vector<float> w(static_cast<size_t>(s.layouts.local_experts * g.n * k));  // [El, N, K]
  for (int64_t e = 0; e < s.layouts.local_experts; ++e) {
    for (int64_t n = 0; n < g.n; ++n) {
      for (int64_t kk = 0; kk < k; ++kk) w[static_cast<size_t>((e * g.n + n) * k + kk)] = w_value(g, s.me, e, n, kk);
    }
  }
  for (int64_t r = 0; r < s.layouts.capacity; ++r) {
    if (r >= kept) {
      for (int64_t j = 0; j < cols; ++j) {
        written_past += element_bits(g.out_dtype, got.data(), static_cast<size_t>(r * cols + j)) != fill_bits(g.out_dtype);
      }
      continue;
    }
    const ref::RefRow& o = want.rows[static_cast<size_t>(r)];
    int64_t e = 0;
    while (e + 1 < static_cast<int64_t>(want.expert_offsets.size()) - 1 && want.expert_offsets[e + 1] <= r) ++e;
    for (int64_t kk = 0; kk < k; ++kk) x[kk] = from_bits(g.moe.dtype, to_bits(g.moe.dtype, x_value(g.moe.seed, o.source, o.token, kk, k)));
    for (int64_t n = 0; n < g.n; ++n) {
      double a = 0.0;
      const float* wn = w.data() + (e * g.n + n) * k;
      for (int64_t kk = 0; kk < k; ++kk) a += static_cast<double>(x[kk]) * wn[kk];
      acc[n] = a;
    }
    for (int64_t j = 0; j < cols; ++j) {
      double expect = acc[j];
      if (g.activation == GroupedActivation::kSwiGLU) {
        const double gate = acc[16 * (j / 8) + j % 8], up = acc[16 * (j / 8) + 8 + j % 8];
        expect = gate / (1.0 + std::exp(-gate)) * up;
      }
      const double v = from_bits(g.out_dtype, element_bits(g.out_dtype, got.data(), static_cast<size_t>(r * cols + j)));
      if (!std::isfinite(v)) ++not_finite;
      err2 += (v - expect) * (v - expect);
      ref2 += expect * expect;
    }
  }
  const double rel = std::sqrt(err2 / std::max(ref2, 1e-300));
  const double tol = unit_roundoff(g.out_dtype) + 1e-4;
  EXPECT_EQ(not_finite, 0) << what << ": rank " << s.me << ": " << not_finite << " kept outputs are not finite (unwritten?)";
  EXPECT_EQ(written_past, 0) << what << ": rank " << s.me << ": " << written_past << " outputs past the kept rows were written";
  if (kept > 0) {
    EXPECT_LE(rel, tol) << what << ": rank " << s.me << ": ||out - ref|| / ||ref|| = " << rel << " over " << kept << " rows";
  }
}

class MoeDispatchGemm : public MoeTest, public ::testing::WithParamInterface<GemmCase> {};

TEST_P(MoeDispatchGemm, MatchesTheReferenceAndDispatchThenGroupedGemm) {
  const GemmCase& g = GetParam();
  Communicator& comm = shared_comm();
  const std::string what = g.text(comm.world_size());
  CaseBuffers s(g.moe);
  ASSERT_TRUE(agree(s.ok)) << what << ": setting up";
  GemmBuffers b(g, s);
  ASSERT_TRUE(agree(b.ok)) << what << ": setting up the GEMM";
  Result<MoePlan> plan = moe_routing(comm, s.config, s.routing_args(), nullptr);
  ASSERT_TRUE(agree(plan.ok())) << what << ": moe_routing: " << plan.status().to_string();
  MoeDispatchGemmOptions options;
  options.tile = g.tile;
  options.push_ctas = g.push_ctas;
  const Status fused = moe_dispatch_gemm(comm, *plan, s.d_x.get(), s.recv, b.args(g, b.out.get()), nullptr, options);
  ASSERT_TRUE(agree(fused.ok())) << what << ": rank " << process().rank << ": moe_dispatch_gemm: " << fused.to_string();
  Result<MoeReport> report = moe_report(comm, *plan, nullptr);  // synchronizes the stream
  ASSERT_TRUE(agree(report.ok())) << what << ": " << report.status().to_string();
  EXPECT_TRUE(report->status.ok()) << what << ": " << report->status.to_string();
  check_routing(s, *plan, *report, what);
  check_dispatch(s, what);

  // The unfused composition on the same tile: the same bits in every kept row. (Every collective
  // call comes before the slow host reference below: a rank still computing it would keep its
  // peers waiting past their limit.)
  ASSERT_EQ(cudaMemset(s.recv, 0xFF, s.recv_bytes()), cudaSuccess);
  const Status dispatched = moe_dispatch(comm, *plan, s.d_x.get(), s.recv, nullptr);
  ASSERT_TRUE(agree(dispatched.ok())) << what << ": moe_dispatch: " << dispatched.to_string();
  const DeviceBuffer table = device_buffer(grouped_gemm_workspace_bytes(
      planner::dispatch_gemm_grouped_args(*plan, s.layouts, s.recv, b.args(g, b.composed.get()), nullptr)));
  GroupedGemmArgs ga = planner::dispatch_gemm_grouped_args(*plan, s.layouts, s.recv, b.args(g, b.composed.get()), table.get());
  ga.workspace_bytes = grouped_gemm_workspace_bytes(ga);
  GroupedGemmOptions go;
  go.tile = g.tile;
  const Status grouped = grouped_gemm(ga, nullptr, go);
  ASSERT_TRUE(grouped.ok()) << what << ": grouped_gemm: " << grouped.to_string();
  const Status synced = comm.synchronize(nullptr);
  ASSERT_TRUE(agree(synced.ok())) << what << ": " << synced.to_string();
  const size_t kept_bytes = s.expected[s.me].rows.size() * static_cast<size_t>(g.out_cols()) * dtype_size(g.out_dtype);
  const std::vector<uint8_t> fused_bits = download<uint8_t>(b.out.get(), kept_bytes);
  const std::vector<uint8_t> composed_bits = download<uint8_t>(b.composed.get(), kept_bytes);
  EXPECT_TRUE(fused_bits == composed_bits) << what << ": rank " << s.me
                                           << ": the fused rows differ from moe_dispatch + grouped_gemm's";
  check_expert_gemm(g, s, b, what);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

std::vector<GemmCase> gemm_cases() {
  std::vector<GemmCase> v;
  GemmCase uniform;
  uniform.moe = make_case(Routing::kUniform, 31);
  v.push_back(uniform);
  GemmCase skewed;  // gate/up with SwiGLU, B [E, K, N], the wide tile
  skewed.moe = make_case(Routing::kSkewed, 32);
  skewed.b_layout = BLayout::kKN;
  skewed.activation = GroupedActivation::kSwiGLU;
  skewed.tile = GemmTile::k128x256;
  v.push_back(skewed);
  GemmCase all_to_one;  // fp16 in, fp32 out
  all_to_one.moe = make_case(Routing::kAllToOne, 33);
  all_to_one.moe.dtype = DType::kF16;
  all_to_one.out_dtype = DType::kF32;
  v.push_back(all_to_one);
  GemmCase empty;  // an expert without rows, unused slots
  empty.moe = make_case(Routing::kEmptyExpert, 34);
  empty.moe.experts_per_rank = 6;
  empty.activation = GroupedActivation::kSwiGLU;
  v.push_back(empty);
  GemmCase zero;  // rank 0 routes nothing
  zero.moe = make_case(Routing::kUniform, 35);
  zero.moe.rank0_empty = true;
  zero.n = 136;  // N not a multiple of the tile
  v.push_back(zero);
  GemmCase many;  // many tiles per expert, top-8 of 8 experts per rank
  many.moe = make_case(Routing::kSkewed, 36);
  many.moe.experts_per_rank = 8;
  many.moe.top_k = 8;
  many.moe.tokens = 1500;
  many.moe.hidden = 128;
  many.tile = GemmTile::k128x256;
  v.push_back(many);
  GemmCase repeated;
  repeated.moe = make_case(Routing::kRepeated, 37);
  repeated.b_layout = BLayout::kKN;
  v.push_back(repeated);
  GemmCase batches;  // one pushing CTA sorts its tokens in three batches (kPushSortTokens each)
  batches.moe = make_case(Routing::kSkewed, 38);
  batches.moe.tokens = 2 * static_cast<int64_t>(kernels::moe::MoeTunables::kPushSortTokens) + 500;
  batches.moe.hidden = 128;
  batches.n = 128;
  batches.push_ctas = 1;
  v.push_back(batches);
  return v;
}

// A case's test name: its index and routing (GemmCase, LayerCase).
template <class C>
std::string routing_case_name(const ::testing::TestParamInfo<C>& info) {
  std::string n = std::to_string(info.index) + "_" + routing_name(info.param.moe.routing);
  if constexpr (requires { info.param.shared; }) {
    if (info.param.shared) n += "_shared_expert";
  }
  if constexpr (requires { info.param.expert_groups; }) {
    if (!info.param.expert_groups) n += "_plain_groups";
  }
  for (char& ch : n) ch = ch == '-' ? '_' : ch;
  return n;
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeDispatchGemm, ::testing::ValuesIn(gemm_cases()), routing_case_name<GemmCase>);

// ---- capacity ---------------------------------------------------------------------------------------

class MoeCapacity : public MoeTest {};

// kDrop: rows past a rank's capacity are dropped exactly as the reference drops them; combine
// adds nothing for their slots.
TEST_F(MoeCapacity, DropKeepsTheReceiveOrderAndCountsTheRest) {
  Case c = make_case(Routing::kSkewed, 31);
  c.overflow = MoeOverflow::kDrop;
  // About 60% of the mean rank's rows: the hot ranks drop, possibly all of them.
  c.capacity = std::max<int64_t>(1, c.tokens * c.top_k * 6 / 10);
  run_case(c);
}

// kError: any rank over capacity fails the call on every rank; nothing is written anywhere.
TEST_F(MoeCapacity, OverCapacityIsReportedAndNothingMoves) {
  Communicator& comm = shared_comm();
  Case c = make_case(Routing::kAllToOne, 32);
  c.capacity = 8;
  const std::string what = c.text(comm.world_size());
  CaseBuffers s(c);
  ASSERT_TRUE(agree(s.ok)) << what << ": setting up";
  Result<MoePlan> plan = launch_all(s, s.combine_args());
  ASSERT_TRUE(plan.ok()) << what << ": " << plan.status().to_string();
  Result<MoeReport> report = moe_report(comm, *plan, nullptr);
  ASSERT_TRUE(agree(report.ok())) << what << ": " << report.status().to_string();
  const ref::RefRank& want = s.expected[s.me];
  ASSERT_EQ(want.code, ref::kRefCapacity) << what << ": the case must overflow";
  EXPECT_EQ(report->status.code(), StatusCode::kInvalidArgument) << what << ": " << report->status.to_string();
  const std::string rank_text = "rank " + std::to_string(internal(comm).topology.rank_at[want.bad_rank]) + " would receive " +
                                std::to_string(want.bad_token) + " rows";
  EXPECT_NE(report->status.message().find(rank_text), std::string::npos) << report->status.message();
  EXPECT_TRUE(all_bytes(s.recv, s.recv_bytes(), 0xFF)) << what << ": recv_x was written";
  EXPECT_TRUE(all_bytes(s.d_out.get(), s.out_bytes(), 0xFF)) << what << ": out was written";
  EXPECT_EQ(download<int32_t>(s.d_offsets.get(), want.expert_offsets.size()), want.expert_offsets) << what;
  EXPECT_EQ(report->kept_rows, 0);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

// ---- bad input ----------------------------------------------------------------------------------------

class MoeBadInput : public MoeTest {};

// An expert id out of range on the last rank: every rank's report names it; nothing moves.
TEST_F(MoeBadInput, ExpertIdOutOfRangeIsReportedEverywhere) {
  Communicator& comm = shared_comm();
  Case c = make_case(Routing::kUniform, 41);
  CaseBuffers s(c);
  const int last = s.world - 1;
  const int32_t bad = static_cast<int32_t>(s.config.num_experts + 5);
  s.ids[last][3 * c.top_k + 1] = bad;  // token 3, slot 1 of the last rank
  s.ids[0][0] = -1;                     // an unused slot is fine
  bool ready = s.ok && upload(s.d_ids.get(), s.ids[s.me]);
  const std::string what = "bad id: " + c.text(s.world);
  ASSERT_TRUE(agree(ready)) << what << ": setting up";
  Result<MoePlan> plan = launch_all(s, s.combine_args());
  ASSERT_TRUE(plan.ok()) << what << ": the host cannot see ids, so the calls must launch: " << plan.status().to_string();
  Result<MoeReport> report = moe_report(comm, *plan, nullptr);
  ASSERT_TRUE(agree(report.ok())) << what << ": the communicator must stay usable: " << report.status().to_string();
  EXPECT_EQ(report->status.code(), StatusCode::kInvalidArgument) << what << ": " << report->status.to_string();
  const std::string named = "rank " + std::to_string(internal(comm).topology.rank_at[last]) + " token 3 slot 1: expert id " +
                            std::to_string(bad);
  EXPECT_NE(report->status.message().find(named), std::string::npos) << report->status.message();
  EXPECT_TRUE(all_bytes(s.recv, s.recv_bytes(), 0xFF)) << what << ": recv_x was written";
  EXPECT_TRUE(all_bytes(s.d_out.get(), s.out_bytes(), 0xFF)) << what << ": out was written";
  const std::vector<int32_t> offsets = download<int32_t>(s.d_offsets.get(), static_cast<size_t>(s.layouts.local_experts + 1));
  EXPECT_TRUE(std::all_of(offsets.begin(), offsets.end(), [](int32_t v) { return v == 0; })) << what << ": expert_offsets";
  EXPECT_TRUE(comm.health().ok()) << comm.health().to_string();
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
  // And the next call on the same communicator works.
  run_case(make_case(Routing::kUniform, 42));
}

// What the host can check is refused before anything is launched, identically on every rank.
TEST_F(MoeBadInput, HostCheckableInputIsRefusedBeforeLaunch) {
  Communicator& comm = shared_comm();
  const int world = comm.world_size();
  MoeConfig config;
  config.num_experts = 4 * world;
  config.top_k = 4 * world + 1;  // k > E
  config.hidden = 256;
  config.max_tokens = 64;
  Status s = moe_can_implement(comm, config);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("larger than the expert count"), std::string::npos) << s.message();
  config.top_k = 2;
  if (world > 1) {
    config.num_experts = 2 * world + 1;  // not a multiple of W
    EXPECT_EQ(moe_can_implement(comm, config).code(), StatusCode::kInvalidArgument);
    config.num_experts = 4 * world;
  }
  ASSERT_TRUE(moe_can_implement(comm, config).ok());
  // Reserving refuses what moe_can_implement refuses, and grows the workspace to moe_sizes' bytes.
  MoeConfig refused = config;
  refused.top_k = 0;
  EXPECT_EQ(moe_reserve_workspace(comm, refused, nullptr).code(), StatusCode::kInvalidArgument);
  const Status reserved = moe_reserve_workspace(comm, config, nullptr);
  ASSERT_TRUE(agree(reserved.ok())) << reserved.to_string();
  ASSERT_TRUE(moe_sizes(comm, config).ok());
  EXPECT_GT(moe_sizes(comm, config)->workspace_bytes, 0u);

  Case c = make_case(Routing::kUniform, 51);
  CaseBuffers setup(c);
  ASSERT_TRUE(agree(setup.ok)) << "setting up";
  MoeRoutingArgs args = setup.routing_args();
  args.num_tokens = setup.config.max_tokens + 1;
  EXPECT_EQ(moe_routing(comm, setup.config, args, nullptr).status().code(), StatusCode::kInvalidArgument);
  args = setup.routing_args();
  args.plan = static_cast<char*>(args.plan) + 4;  // misaligned
  EXPECT_EQ(moe_routing(comm, setup.config, args, nullptr).status().code(), StatusCode::kInvalidArgument);
  Result<MoePlan> plan = moe_routing(comm, setup.config, setup.routing_args(), nullptr);
  ASSERT_TRUE(agree(plan.ok())) << plan.status().to_string();
  // recv_x not symmetric (plain device memory): refused, nothing launched.
  const DeviceBuffer plain = device_buffer(setup.recv_bytes());
  Status d = moe_dispatch(comm, *plan, setup.d_x.get(), plain.get(), nullptr);
  EXPECT_EQ(d.code(), StatusCode::kInvalidArgument) << d.to_string();
  EXPECT_NE(d.message().find("symmetric"), std::string::npos) << d.message();
  // out overlapping expert_out: refused.
  MoeCombineArgs a = setup.combine_args();
  a.out = setup.y;
  EXPECT_EQ(moe_combine(comm, *plan, a, nullptr).code(), StatusCode::kInvalidArgument);
  // The accepted calls still run to completion on every rank.
  ASSERT_TRUE(agree(moe_dispatch(comm, *plan, setup.d_x.get(), setup.recv, nullptr).ok()));
  ASSERT_TRUE(agree(moe_combine(comm, *plan, setup.combine_args(), nullptr).ok()));
  const Status synced = comm.synchronize(nullptr);
  ASSERT_TRUE(agree(synced.ok())) << synced.to_string();
}

// What the host can check is refused on every rank before anything is launched.
// Across nodes: combine refuses (before launching anything) a plan whose dispatch did not run
// last, and weights other than the routing's; after the dispatch the same call works.
TEST_F(MoeBadInput, AcrossNodesCombineNeedsItsDispatchAndTheRoutingWeights) {
  Communicator& comm = shared_comm();
  if (comm.num_nodes() == 1) GTEST_SKIP() << "one node: combine needs no dispatch";
  Case c = make_case(Routing::kUniform, 95);
  c.tokens = 64;
  const std::string what = "combine without dispatch: " + c.text(comm.world_size());
  CaseBuffers s(c);
  ASSERT_TRUE(agree(s.ok && s.fill_expert_outputs())) << what << ": setting up";
  Result<MoePlan> plan = moe_routing(comm, s.config, s.routing_args(), nullptr);
  ASSERT_TRUE(agree(plan.ok())) << what << ": " << plan.status().to_string();
  const Status early = moe_combine(comm, *plan, s.combine_args(), nullptr);
  EXPECT_EQ(early.code(), StatusCode::kInvalidArgument) << what << ": " << early.to_string();
  EXPECT_NE(early.message().find("call moe_dispatch or moe_dispatch_gemm with this MoePlan first"), std::string::npos)
      << early.message();
  ASSERT_TRUE(agree(moe_dispatch(comm, *plan, s.d_x.get(), s.recv, nullptr).ok())) << what;
  MoeCombineArgs other = s.combine_args();
  other.topk_weights = static_cast<const float*>(s.d_weights.get());
  EXPECT_EQ(moe_combine(comm, *plan, other, nullptr).code(), StatusCode::kUnsupported) << what;
  ASSERT_TRUE(agree(moe_combine(comm, *plan, s.combine_args(), nullptr).ok())) << what << ": after the dispatch";
  Result<MoeReport> report = moe_report(comm, *plan, nullptr);
  ASSERT_TRUE(agree(report.ok())) << what << ": " << report.status().to_string();
  check_combine(s, what);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

TEST_F(MoeBadInput, DispatchGemmRefusesBadGemmArguments) {
  Communicator& comm = shared_comm();
  GemmCase g;
  g.moe = make_case(Routing::kUniform, 52);
  CaseBuffers s(g.moe);
  ASSERT_TRUE(agree(s.ok)) << "setting up";
  GemmBuffers b(g, s);
  ASSERT_TRUE(agree(b.ok)) << "setting up the GEMM";
  Result<MoePlan> plan = moe_routing(comm, s.config, s.routing_args(), nullptr);
  ASSERT_TRUE(agree(plan.ok())) << plan.status().to_string();
  // The host checks below copy synchronously, which across emulated nodes must not start while the
  // routing kernel waits for this process's proxy (docs/NETWORK.md, "A hazard for applications").
  const Status routed = comm.synchronize(nullptr);
  ASSERT_TRUE(agree(routed.ok())) << "moe_dispatch_gemm bad input: " << routed.to_string();
  auto refused = [&](MoeExpertGemm a, MoeDispatchGemmOptions o, StatusCode code, const char* words) {
    const Status st = moe_dispatch_gemm(comm, *plan, s.d_x.get(), s.recv, a, nullptr, o);
    EXPECT_EQ(st.code(), code) << st.to_string();
    EXPECT_NE(st.message().find(words), std::string::npos) << st.message();
  };
  MoeExpertGemm a = b.args(g, b.out.get());
  a.weights = nullptr;
  refused(a, {}, StatusCode::kInvalidArgument, "weights is null");
  a = b.args(g, s.recv);  // out over recv_x
  refused(a, {}, StatusCode::kInvalidArgument, "overlaps");
  a = b.args(g, b.out.get());
  a.n = 100;  // not a multiple of 8
  refused(a, {}, StatusCode::kUnsupported, "multiple of 8");
  MoeDispatchGemmOptions narrow;
  narrow.tile = GemmTile::k64x128;
  refused(b.args(g, b.out.get()), narrow, StatusCode::kUnsupported, "not built for the fused kernel");
  MoeDispatchGemmOptions crowded;
  crowded.num_ctas = 4;
  crowded.push_ctas = 3;
  crowded.arrival_ctas = 2;
  refused(b.args(g, b.out.get()), crowded, StatusCode::kInvalidArgument, "exceed the grid");
  // The accepted call still runs on every rank.
  ASSERT_TRUE(agree(moe_dispatch_gemm(comm, *plan, s.d_x.get(), s.recv, b.args(g, b.out.get()), nullptr).ok()));
  const Status synced = comm.synchronize(nullptr);
  ASSERT_TRUE(agree(synced.ok())) << synced.to_string();
}

// ---- repetition ----------------------------------------------------------------------------------------

class MoeStress : public MoeTest {};
class MoeCompose : public MoeTest {};
// Value-parameterized only to run after every other MoE test (gtest runs the TEST_F suites first,
// then the parameterized ones in the order of their first TEST_P): a captured graph pins the MoE
// workspace, which then can no longer grow for a larger config.
class MoeGraph : public MoeTest, public ::testing::WithParamInterface<int> {};

__global__ void checksum_kernel(const uint64_t* p, uint64_t words, unsigned long long* out) {
  unsigned long long sum = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < words; i += uint64_t{gridDim.x} * blockDim.x) {
    sum += verify::mix64(p[i] ^ verify::mix64(i));
  }
  atomicAdd(out, sum);
}

// LOOM_TEST_MOE_LAUNCHES (default 100) launches on a stream of their own, without host
// synchronization: each poisons recv_x and `out` (0xFF bytes), queues calls(stream) (returning the
// plan), then checksums of recv_x and out and an event. Every launch is queued before the host
// waits for any. comm.synchronize bounds ALL the work queued before it by one call's limit
// (LOOM_TIMEOUT_MS + 1 s, then it aborts), which 300 calls taking turns with the peers' on a shared
// GPU may exceed with nothing stuck. So the host first watches the launches finish one by one
// (the event after each), each within that limit of the one before, and synchronizes only then
// (for the device's verdict). "" or what failed; `differ`: launches whose checksums differ from
// launch 0's; `plan`: the last launch's.
template <class Calls>
std::string run_back_to_back(Communicator& comm, const CaseBuffers& s, void* out, size_t out_bytes, Calls&& calls,
                             MoePlan& plan, int& differ) {
  const char* env = std::getenv("LOOM_TEST_MOE_LAUNCHES");
  const int launches = env != nullptr ? std::max(1, std::atoi(env)) : 100;
  const DeviceBuffer sums = device_buffer(static_cast<size_t>(launches) * 2 * sizeof(unsigned long long));
  if (!sums || cudaMemset(sums.get(), 0, static_cast<size_t>(launches) * 16) != cudaSuccess) return "setting up the sums";
  auto* d_sums = static_cast<unsigned long long*>(sums.get());
  // Loaded now, not at its first launch behind running MoE kernels: across nodes CUDA's lazy
  // loading would wait for them while they wait for the proxy (docs/NETWORK.md, "A hazard").
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, checksum_kernel) != cudaSuccess) return "loading checksum_kernel";
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return "cudaStreamCreate";
  std::vector<cudaEvent_t> finished(static_cast<size_t>(launches), nullptr);
  auto launch = [&](int i) -> Status {
    LOOM_CUDA_TRY(cudaMemsetAsync(s.recv, 0xFF, s.recv_bytes(), stream));
    LOOM_CUDA_TRY(cudaMemsetAsync(out, 0xFF, out_bytes, stream));
    LOOM_ASSIGN_OR_RETURN(plan, calls(stream));
    checksum_kernel<<<64, 256, 0, stream>>>(static_cast<const uint64_t*>(s.recv), s.recv_bytes() / 8, d_sums + 2 * i);
    checksum_kernel<<<64, 256, 0, stream>>>(static_cast<const uint64_t*>(out), out_bytes / 8, d_sums + 2 * i + 1);
    LOOM_CUDA_TRY(cudaGetLastError());
    LOOM_CUDA_TRY(cudaEventCreateWithFlags(&finished[i], cudaEventDisableTiming));
    LOOM_CUDA_TRY(cudaEventRecord(finished[i], stream));
    return {};
  };
  std::string failure;
  int queued = 0;
  for (int i = 0; i < launches && failure.empty(); ++i) {
    const Status st = launch(i);
    if (!st.ok()) failure = "launch " + std::to_string(i) + ": " + st.to_string();
    if (st.ok()) ++queued;
  }
  const auto per_launch = internal(comm).settings.op_timeout + std::chrono::seconds(1);
  for (int i = 0; i < queued && failure.empty(); ++i) {
    const auto deadline = std::chrono::steady_clock::now() + per_launch;
    for (;;) {
      const cudaError_t q = cudaEventQuery(finished[i]);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) {
        failure = "launch " + std::to_string(i) + ": " + cudaGetErrorString(q);
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        failure = "launch " + std::to_string(i) + " of " + std::to_string(queued) + " did not finish within " +
                  std::to_string(per_launch.count()) + " ms of the one before";
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  const Status synced = comm.synchronize(stream);  // immediate when the watch saw every launch finish
  for (cudaEvent_t e : finished) {
    if (e != nullptr) cudaEventDestroy(e);  // returns at once, finished or not
  }
  cudaStreamDestroy(stream);
  if (failure.empty() && !synced.ok()) failure = synced.to_string();
  if (!failure.empty()) return failure;
  const std::vector<unsigned long long> got = download<unsigned long long>(sums.get(), static_cast<size_t>(launches) * 2);
  if (got.size() != static_cast<size_t>(launches) * 2) return "reading the sums back";
  differ = 0;
  for (int i = 1; i < launches; ++i) differ += got[2 * i] != got[0] || got[2 * i + 1] != got[1];
  return "";
}

// The three calls back to back (run_back_to_back): every launch leaves the same bits, the
// reference's.
TEST_F(MoeStress, BackToBackLaunchesAreBitIdentical) {
  Communicator& comm = shared_comm();
  Case c = make_case(Routing::kSkewed, 61);
  const std::string what = c.text(comm.world_size()) + ", back-to-back launches";
  CaseBuffers s(c);
  ASSERT_TRUE(agree(s.ok && s.fill_expert_outputs())) << what << ": setting up";
  MoePlan plan;
  int differ = -1;
  const std::string failure = run_back_to_back(
      comm, s, s.d_out.get(), s.out_bytes(),
      [&](cudaStream_t stream) -> Result<MoePlan> {
        LOOM_ASSIGN_OR_RETURN(MoePlan p, moe_routing(comm, s.config, s.routing_args(), stream));
        LOOM_TRY(moe_dispatch(comm, p, s.d_x.get(), s.recv, stream));
        LOOM_TRY(moe_combine(comm, p, s.combine_args(), stream));
        return p;
      },
      plan, differ);
  ASSERT_TRUE(agree(failure.empty())) << what << ": rank " << process().rank << ": " << failure;
  EXPECT_EQ(differ, 0) << what << ": rank " << process().rank << ": " << differ << " launches differ from launch 0";
  // The last launch's bits are the reference's (all launches are equal).
  Result<MoeReport> report = moe_report(comm, plan, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_TRUE(report->status.ok()) << report->status.to_string();
  check_routing(s, plan, *report, what);
  check_dispatch(s, what);
  check_combine(s, what);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

// moe_routing + moe_dispatch_gemm (SwiGLU), back to back (run_back_to_back): every launch leaves
// the same bits, the reference's.
TEST_F(MoeStress, DispatchGemmBackToBackIsBitIdentical) {
  Communicator& comm = shared_comm();
  GemmCase g;
  g.moe = make_case(Routing::kSkewed, 62);
  g.activation = GroupedActivation::kSwiGLU;
  const std::string what = g.text(comm.world_size()) + ", back-to-back launches";
  CaseBuffers s(g.moe);
  ASSERT_TRUE(agree(s.ok)) << what << ": setting up";
  GemmBuffers b(g, s);
  ASSERT_TRUE(agree(b.ok)) << what << ": setting up the GEMM";
  MoePlan plan;
  int differ = -1;
  const std::string failure = run_back_to_back(
      comm, s, b.out.get(), b.out_bytes,
      [&](cudaStream_t stream) -> Result<MoePlan> {
        LOOM_ASSIGN_OR_RETURN(MoePlan p, moe_routing(comm, s.config, s.routing_args(), stream));
        LOOM_TRY(moe_dispatch_gemm(comm, p, s.d_x.get(), s.recv, b.args(g, b.out.get()), stream));
        return p;
      },
      plan, differ);
  ASSERT_TRUE(agree(failure.empty())) << what << ": rank " << process().rank << ": " << failure;
  EXPECT_EQ(differ, 0) << what << ": rank " << process().rank << ": " << differ << " launches differ from launch 0";
  check_dispatch(s, what);
  check_expert_gemm(g, s, b, what);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

// ---- moe_topk ---------------------------------------------------------------------------------------
//
// The router's top-k against a host reference on the same (type-rounded) logits: ids exactly
// (largest first, equal logits by the lower id; bf16 logits tie often), weights within 1e-5
// relative of the fp64 softmax or sigmoid (fp32 math with __expf in the kernel); tokens whose
// logits are mostly -inf get -1 ids and weight 0 past their finite ones. Outputs NaN-filled first.

class MoeTopk : public MoeTest {};

TEST_F(MoeTopk, MatchesTheReference) {
  struct TopkCase {
    DType dtype;
    int64_t tokens, experts;
    int k;
    MoeScoring scoring;
    bool renormalize;
  };
  const TopkCase cases[] = {{DType::kF32, 300, 64, 8, MoeScoring::kSoftmax, false},
                            {DType::kBF16, 300, 64, 8, MoeScoring::kSoftmax, true},
                            {DType::kF16, 257, 256, 8, MoeScoring::kSigmoid, true},
                            {DType::kBF16, 64, 1000, 32, MoeScoring::kSigmoid, false},
                            {DType::kF32, 33, 7, 7, MoeScoring::kSoftmax, false}};
  for (const TopkCase& c : cases) {
    const std::string what = "moe_topk " + std::string(dtype_name(c.dtype)) + " T=" + std::to_string(c.tokens) +
                             " E=" + std::to_string(c.experts) + " k=" + std::to_string(c.k) +
                             (c.scoring == MoeScoring::kSigmoid ? " sigmoid" : " softmax") +
                             (c.renormalize ? " renormalized" : "");
    std::mt19937_64 rng(static_cast<uint64_t>(c.tokens * 131 + c.experts));
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> logits(static_cast<size_t>(c.tokens * c.experts));
    for (float& v : logits) v = from_bits(c.dtype, to_bits(c.dtype, normal(rng)));
    for (int64_t e = 0; e + 3 < c.experts; ++e) logits[static_cast<size_t>(e)] = -INFINITY;  // token 0: 3 finite
    const size_t pairs = static_cast<size_t>(c.tokens * c.k);
    const DeviceBuffer d_logits = device_buffer(logits.size() * dtype_size(c.dtype));
    const DeviceBuffer d_ids = device_buffer(pairs * 4), d_weights = device_buffer(pairs * 4);
    ASSERT_TRUE(d_logits && d_ids && d_weights && upload(d_logits.get(), pack(c.dtype, logits)) &&
                cudaMemset(d_ids.get(), 0xFF, pairs * 4) == cudaSuccess && cudaMemset(d_weights.get(), 0xFF, pairs * 4) == cudaSuccess)
        << what;
    MoeTopkArgs a;
    a.logits = d_logits.get();
    a.dtype = c.dtype;
    a.num_tokens = c.tokens;
    a.num_experts = c.experts;
    a.top_k = c.k;
    a.scoring = c.scoring;
    a.renormalize = c.renormalize;
    a.topk_ids = static_cast<int32_t*>(d_ids.get());
    a.topk_weights = static_cast<float*>(d_weights.get());
    const Status st = moe_topk(a, nullptr);
    ASSERT_TRUE(st.ok()) << what << ": " << st.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    const std::vector<int32_t> ids = download<int32_t>(d_ids.get(), pairs);
    const std::vector<float> weights = download<float>(d_weights.get(), pairs);
    int64_t wrong_ids = 0, wrong_weights = 0;
    std::string first;
    for (int64_t t = 0; t < c.tokens; ++t) {
      const float* row = logits.data() + t * c.experts;
      std::vector<int32_t> order(static_cast<size_t>(c.experts));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return row[x] > row[y]; });
      double top = -INFINITY, denom = 0.0;
      for (int64_t e = 0; e < c.experts; ++e) top = std::max(top, static_cast<double>(row[e]));
      for (int64_t e = 0; e < c.experts; ++e) denom += std::exp(row[e] - top);
      std::vector<double> w(static_cast<size_t>(c.k), 0.0);
      std::vector<int32_t> want(static_cast<size_t>(c.k), -1);
      double sum = 0.0;
      for (int j = 0; j < c.k; ++j) {
        const int32_t e = order[static_cast<size_t>(j)];
        if (std::isinf(row[e])) continue;
        want[j] = e;
        w[j] = c.scoring == MoeScoring::kSigmoid ? 1.0 / (1.0 + std::exp(-static_cast<double>(row[e])))
                                                 : std::exp(row[e] - top) / denom;
        sum += w[j];
      }
      for (int j = 0; j < c.k; ++j) {
        const size_t q = static_cast<size_t>(t * c.k + j);
        const double expect = c.renormalize && sum > 0 ? w[j] / sum : w[j];
        if (ids[q] != want[j] && wrong_ids++ == 0) {
          first = "token " + std::to_string(t) + " slot " + std::to_string(j) + ": id " + std::to_string(ids[q]) +
                  " instead of " + std::to_string(want[j]);
        }
        if (!(std::fabs(weights[q] - expect) <= 1e-5 * std::fabs(expect) + 1e-30)) ++wrong_weights;
      }
    }
    EXPECT_EQ(wrong_ids, 0) << what << ": " << wrong_ids << " ids differ; first: " << first;
    EXPECT_EQ(wrong_weights, 0) << what << ": " << wrong_weights << " weights outside 1e-5 relative";
  }
  MoeTopkArgs bad;
  bad.num_tokens = 4;
  bad.num_experts = 8;
  bad.top_k = 9;
  EXPECT_EQ(moe_topk(bad, nullptr).code(), StatusCode::kInvalidArgument);
}

// ---- moe_layer ------------------------------------------------------------------------------------
//
// The whole layer in one kernel against (a) an fp64 reference of every token: for each kept slot,
// the gate/up GEMM, SwiGLU, rounded to the input type (the kernel's hidden buffer), the down GEMM,
// rounded again (expert_out), then sum_j w_j y_j in fp64; ||out - ref|| / ||ref|| must stay within
// 2u + 1e-4 (u the type's unit roundoff: the output's rounding plus the rare one-ulp flips of
// rounded intermediates whose fp32 and fp64 sums straddle a rounding boundary; a wrong expert,
// weight or slot costs O(1/k)); every output finite (out is NaN-filled first); (b) the composed
// calls on the same tile, moe_dispatch_gemm (SwiGLU) -> grouped_gemm -> moe_combine: the same bits
// in hidden, expert_out and out (across nodes too: both sum each node's slots in slot order, then
// the node sums in node order); (c) recv_x as moe_dispatch writes it.

constexpr uint64_t kGateSalt = 0x5EED0011, kUpSalt = 0x5EED0012, kDownSalt = 0x5EED0013;
constexpr int64_t kSharedExpert = -1;  // the shared expert's weights, as an expert id of their own

struct LayerCase {
  Case moe;
  int64_t inter = 192;  // I
  GemmTile tile = GemmTile::k128x256;
  bool shared = false;  // a shared expert (MoeLayerWeights::shared_gate_up, shared_down)
  bool swap_tails = true;  // MoeLayerOptions::swap_tails
  bool expert_groups = true;  // MoeLayerOptions::expert_groups (the composed calls' as well)

  std::string text(int world) const {
    return moe.text(world) + " I=" + std::to_string(inter) + " " + std::string(gemm_tile_name(tile)) +
           (shared ? " shared" : "") + (swap_tails ? "" : " padded tails") + (expert_groups ? "" : " plain groups");
  }
  MoeLayerOptions options() const {
    MoeLayerOptions o;
    o.tile = tile;
    o.swap_tails = swap_tails;
    o.expert_groups = expert_groups;
    return o;
  }
};

// Weights of global expert e, as values of the input type: gate and up rows i < I, down row h < H.
float gate_value(const LayerCase& g, int64_t e, int64_t i, int64_t h) {
  const float v = 0.125f * verify::element_value(g.moe.seed ^ kGateSalt, static_cast<int>(e), static_cast<uint64_t>(i * g.moe.hidden + h));
  return from_bits(g.moe.dtype, to_bits(g.moe.dtype, v));
}
float up_value(const LayerCase& g, int64_t e, int64_t i, int64_t h) {
  const float v = 0.125f * verify::element_value(g.moe.seed ^ kUpSalt, static_cast<int>(e), static_cast<uint64_t>(i * g.moe.hidden + h));
  return from_bits(g.moe.dtype, to_bits(g.moe.dtype, v));
}
float down_value(const LayerCase& g, int64_t e, int64_t h, int64_t i) {
  const float v = 0.125f * verify::element_value(g.moe.seed ^ kDownSalt, static_cast<int>(e), static_cast<uint64_t>(h * g.inter + i));
  return from_bits(g.moe.dtype, to_bits(g.moe.dtype, v));
}

// The layer's buffers and weights, and the composed calls' (with a shared expert also its FFN on
// this rank's tokens through grouped_gemm: one group of T rows).
struct LayerBuffers {
  DeviceBuffer gate_up, down, hidden, composed_hidden, composed_out, table;
  DeviceBuffer shared_gate_up, shared_down, shared_offsets, shared_table, composed_shared_hidden, composed_shared_y;
  void* composed_y = nullptr;  // symmetric [C, H]
  void* layer_y = nullptr;     // symmetric [rows, H] with a shared expert (else the case's y)
  int64_t rows = 0;            // moe_layer_rows: hidden's and expert_out's
  int64_t shared_row = 0;      // token 0's shared rows
  size_t hidden_bytes = 0;
  size_t composed_hidden_bytes = 0;  // [C, I]
  size_t y_bytes = 0;
  bool ok = false;

  // B rows of one expert (the gate/up interleave by 8) and the down rows, of global expert e.
  static void expert_weights(const LayerCase& g, int64_t e, float* gu, float* dn) {
    const int64_t hd = g.moe.hidden, in = g.inter;
    for (int64_t r = 0; r < 2 * in; ++r) {  // B row 16j + i: gate row 8j + i; 16j + 8 + i: up row 8j + i
      const int64_t i = r / 16 * 8 + r % 8;
      const bool up = r % 16 >= 8;
      for (int64_t h = 0; h < hd; ++h) gu[r * hd + h] = up ? up_value(g, e, i, h) : gate_value(g, e, i, h);
    }
    for (int64_t h = 0; h < hd; ++h) {
      for (int64_t i = 0; i < in; ++i) dn[h * in + i] = down_value(g, e, h, i);
    }
  }

  // Collective (a symmetric allocation).
  LayerBuffers(const LayerCase& g, const CaseBuffers& s) {
    const int64_t el = s.layouts.local_experts, hd = g.moe.hidden, in = g.inter;
    std::vector<float> gu(static_cast<size_t>(el * 2 * in * hd)), dn(static_cast<size_t>(el * hd * in));
    for (int64_t l = 0; l < el; ++l) {  // this rank's experts are [me El, (me + 1) El)
      expert_weights(g, s.me * el + l, gu.data() + l * 2 * in * hd, dn.data() + l * hd * in);
    }
    const size_t elem = dtype_size(g.moe.dtype);
    rows = moe_layer_rows(s.layouts.capacity, s.config.max_tokens, g.shared);
    shared_row = static_cast<int64_t>(kernels::moe::layer_shared_row_begin(static_cast<uint64_t>(s.layouts.capacity)));
    hidden_bytes = static_cast<size_t>(rows * in) * elem;
    y_bytes = static_cast<size_t>(rows) * s.row_bytes();
    gate_up = device_buffer(gu.size() * elem);
    down = device_buffer(dn.size() * elem);
    hidden = device_buffer(hidden_bytes);
    composed_hidden_bytes = static_cast<size_t>(s.layouts.capacity * in) * elem;
    composed_hidden = device_buffer(composed_hidden_bytes);
    bool shared_ok = true;
    if (g.shared) {
      std::vector<float> sgu(static_cast<size_t>(2 * in * hd)), sdn(static_cast<size_t>(hd * in));
      expert_weights(g, kSharedExpert, sgu.data(), sdn.data());
      const size_t t = static_cast<size_t>(std::max<int64_t>(s.tokens, 1));
      shared_gate_up = device_buffer(sgu.size() * elem);
      shared_down = device_buffer(sdn.size() * elem);
      shared_offsets = device_buffer(2 * sizeof(int32_t));
      composed_shared_hidden = device_buffer(t * static_cast<size_t>(in) * elem);
      composed_shared_y = device_buffer(t * s.row_bytes());
      shared_table = device_buffer(grouped_gemm_workspace_bytes(shared_args(g, s, true)));
      Result<void*> ly = shared_comm().alloc(y_bytes);
      layer_y = ly.ok() ? *ly : nullptr;
      shared_ok = shared_gate_up && shared_down && shared_offsets && composed_shared_hidden && composed_shared_y &&
                  shared_table && layer_y != nullptr && upload(shared_gate_up.get(), pack(g.moe.dtype, sgu)) &&
                  upload(shared_down.get(), pack(g.moe.dtype, sdn)) &&
                  upload(shared_offsets.get(), std::vector<int32_t>{0, static_cast<int32_t>(s.tokens)});
    }
    composed_out = device_buffer(s.out_bytes());
    MoeExpertGemm up_args = expert_gemm(g, s, nullptr);
    table = device_buffer(grouped_gemm_workspace_bytes(planner::dispatch_gemm_grouped_args(
        MoePlan{s.config, s.layouts.capacity, s.tokens, nullptr, nullptr, 0}, s.layouts, s.recv, up_args, nullptr)));
    Result<void*> y = shared_comm().alloc(s.recv_bytes());
    composed_y = y.ok() ? *y : nullptr;
    ok = gate_up && down && hidden && composed_hidden && composed_out && table && composed_y && shared_ok &&
         upload(gate_up.get(), pack(g.moe.dtype, gu)) && upload(down.get(), pack(g.moe.dtype, dn)) && poison(s);
  }
  ~LayerBuffers() {
    if (composed_y != nullptr) (void)shared_comm().free(composed_y);
    if (layer_y != nullptr) (void)shared_comm().free(layer_y);
  }
  // The shared expert's FFN through grouped_gemm: fc1 (SwiGLU) when `up`, else fc2.
  GroupedGemmArgs shared_args(const LayerCase& g, const CaseBuffers& s, bool up) const {
    GroupedGemmArgs a;
    a.a = up ? s.d_x.get() : composed_shared_hidden.get();
    a.b = up ? shared_gate_up.get() : shared_down.get();
    a.d = up ? composed_shared_hidden.get() : composed_shared_y.get();
    a.offsets = static_cast<const int32_t*>(shared_offsets.get());
    a.m_total = s.tokens;
    a.n = up ? 2 * g.inter : g.moe.hidden;
    a.k = up ? g.moe.hidden : g.inter;
    a.num_experts = 1;
    a.in_dtype = a.out_dtype = g.moe.dtype;
    a.activation = up ? GroupedActivation::kSwiGLU : GroupedActivation::kNone;
    a.workspace = shared_table.get();
    a.workspace_bytes = grouped_gemm_workspace_bytes(a);
    return a;
  }
  void* y(const CaseBuffers& s) const { return layer_y != nullptr ? layer_y : s.y; }
  LayerBuffers(const LayerBuffers&) = delete;
  LayerBuffers& operator=(const LayerBuffers&) = delete;

  bool poison(const CaseBuffers& s) const {
    if (layer_y != nullptr && cudaMemset(layer_y, 0xFF, y_bytes) != cudaSuccess) return false;
    return cudaMemset(hidden.get(), 0xFF, hidden_bytes) == cudaSuccess &&
           cudaMemset(composed_hidden.get(), 0xFF, composed_hidden_bytes) == cudaSuccess &&
           cudaMemset(composed_out.get(), 0xFF, s.out_bytes()) == cudaSuccess &&
           cudaMemset(composed_y, 0xFF, s.recv_bytes()) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
  }
  MoeLayerWeights weights(const LayerCase& g) const {
    MoeLayerWeights w;
    w.gate_up = gate_up.get();
    w.down = down.get();
    w.intermediate = g.inter;
    w.shared_gate_up = shared_gate_up.get();
    w.shared_down = shared_down.get();
    return w;
  }
  MoeLayerBuffers buffers(const CaseBuffers& s) const {
    MoeLayerBuffers b;
    b.recv_x = s.recv;
    b.hidden = hidden.get();
    b.expert_out = y(s);
    return b;
  }
  MoeExpertGemm expert_gemm(const LayerCase& g, const CaseBuffers& s, void* out) const {
    MoeExpertGemm a;
    a.weights = gate_up.get();
    a.n = 2 * g.inter;
    a.activation = GroupedActivation::kSwiGLU;
    a.out = out;
    a.out_dtype = s.c.dtype;
    return a;
  }
};

// moe_dispatch_gemm (SwiGLU) -> grouped_gemm (down) -> moe_combine on the same tile, into the
// composed buffers; every rank makes the same calls.
Status run_composed(const LayerCase& g, const CaseBuffers& s, LayerBuffers& b, const MoePlan& plan) {
  Communicator& comm = shared_comm();
  MoeDispatchGemmOptions o;
  o.tile = g.tile;
  o.expert_groups = g.expert_groups;
  LOOM_TRY(moe_dispatch_gemm(comm, plan, s.d_x.get(), s.recv, b.expert_gemm(g, s, b.composed_hidden.get()), nullptr, o));
  GroupedGemmArgs ga;
  ga.a = b.composed_hidden.get();
  ga.b = b.down.get();
  ga.d = b.composed_y;
  ga.offsets = plan.expert_offsets;
  ga.m_total = s.layouts.capacity;
  ga.n = g.moe.hidden;
  ga.k = g.inter;
  ga.num_experts = s.layouts.local_experts;
  ga.in_dtype = ga.out_dtype = g.moe.dtype;
  ga.workspace = b.table.get();
  ga.workspace_bytes = grouped_gemm_workspace_bytes(ga);
  GroupedGemmOptions go;
  go.tile = g.tile;
  go.expert_groups = g.expert_groups;
  LOOM_TRY(grouped_gemm(ga, nullptr, go));
  MoeCombineArgs ca;
  ca.expert_out = b.composed_y;
  ca.out = b.composed_out.get();
  ca.dtype = g.moe.dtype;
  LOOM_TRY(moe_combine(comm, plan, ca, nullptr));
  if (!g.shared || s.tokens == 0) return {};
  LOOM_TRY(grouped_gemm(b.shared_args(g, s, true), nullptr, go));
  return grouped_gemm(b.shared_args(g, s, false), nullptr, go);
}

// out against the fp64 reference (above).
void check_layer(const LayerCase& g, const CaseBuffers& s, const std::string& what) {
  const ref::RefRank& want = s.expected[s.me];
  const std::vector<uint8_t> got = download<uint8_t>(s.d_out.get(), s.out_bytes());
  ASSERT_EQ(got.size(), s.out_bytes()) << what << ": reading out back";
  const DType t = g.moe.dtype;
  const int64_t hd = g.moe.hidden, in = g.inter, el = s.layouts.local_experts;
  const int k = g.moe.top_k;
  auto round = [t](double v) { return static_cast<double>(from_bits(t, to_bits(t, static_cast<float>(v)))); };
  double err2 = 0.0, ref2 = 0.0;
  int64_t not_finite = 0;
  std::vector<double> x(static_cast<size_t>(hd)), h(static_cast<size_t>(in)), out(static_cast<size_t>(hd));
  for (int64_t tok = 0; tok < s.tokens; ++tok) {
    std::fill(out.begin(), out.end(), 0.0);
    for (int64_t c = 0; c < hd; ++c) x[c] = round(x_value(g.moe.seed, s.me, tok, c, hd));
    for (int j = 0; j < k + (g.shared ? 1 : 0); ++j) {  // j == k: the shared expert, weight 1
      const size_t q = static_cast<size_t>(tok * k + j);
      if (j < k && want.slot_dest[q] < 0) continue;  // unused or dropped
      const int64_t e = j < k ? s.ids[s.me][q] : kSharedExpert;
      const double weight = j < k ? static_cast<double>(s.weights[s.me][q]) : 1.0;
      for (int64_t i = 0; i < in; ++i) {
        double gate = 0.0, up = 0.0;
        for (int64_t c = 0; c < hd; ++c) {
          gate += x[c] * gate_value(g, e, i, c);
          up += x[c] * up_value(g, e, i, c);
        }
        h[i] = round(gate / (1.0 + std::exp(-gate)) * up);
      }
      for (int64_t c = 0; c < hd; ++c) {
        double y = 0.0;
        for (int64_t i = 0; i < in; ++i) y += h[i] * down_value(g, e, c, i);
        out[c] += weight * round(y);
      }
    }
    for (int64_t c = 0; c < hd; ++c) {
      const double v = from_bits(t, element_bits(t, got.data(), static_cast<size_t>(tok * hd + c)));
      if (!std::isfinite(v)) ++not_finite;
      err2 += (v - out[c]) * (v - out[c]);
      ref2 += out[c] * out[c];
    }
  }
  (void)el;
  const double rel = std::sqrt(err2 / std::max(ref2, 1e-300));
  const double tol = 2 * unit_roundoff(t) + 1e-4;
  EXPECT_EQ(not_finite, 0) << what << ": rank " << s.me << ": " << not_finite << " outputs are not finite (unwritten?)";
  if (ref2 > 0) EXPECT_LE(rel, tol) << what << ": rank " << s.me << ": ||out - ref|| / ||ref|| = " << rel;
}

class MoeLayer : public MoeTest, public ::testing::WithParamInterface<LayerCase> {};

TEST_P(MoeLayer, MatchesTheReferenceAndTheComposedCalls) {
  const LayerCase& g = GetParam();
  Communicator& comm = shared_comm();
  const std::string what = "moe_layer " + g.text(comm.world_size());
  CaseBuffers s(g.moe);
  ASSERT_TRUE(agree(s.ok)) << what << ": setting up";
  LayerBuffers b(g, s);
  ASSERT_TRUE(agree(b.ok)) << what << ": setting up the layer";
  Result<MoePlan> plan = moe_routing(comm, s.config, s.routing_args(), nullptr);
  ASSERT_TRUE(agree(plan.ok())) << what << ": moe_routing: " << plan.status().to_string();
  const Status layer =
      moe_layer(comm, *plan, s.d_x.get(), b.weights(g), b.buffers(s), s.d_out.get(), nullptr, g.options());
  ASSERT_TRUE(agree(layer.ok())) << what << ": rank " << process().rank << ": moe_layer: " << layer.to_string();
  Result<MoeReport> report = moe_report(comm, *plan, nullptr);  // synchronizes the stream
  ASSERT_TRUE(agree(report.ok())) << what << ": " << report.status().to_string();
  EXPECT_TRUE(report->status.ok()) << what << ": " << report->status.to_string();
  check_routing(s, *plan, *report, what);
  check_dispatch(s, what);
  const ref::RefRank& want = s.expected[s.me];
  const size_t kept = want.rows.size();
  const std::vector<uint8_t> hidden = download<uint8_t>(b.hidden.get(), b.hidden_bytes);
  const std::vector<uint8_t> y = download<uint8_t>(b.y(s), b.y_bytes);
  const std::vector<uint8_t> out = download<uint8_t>(s.d_out.get(), s.out_bytes());
  // Rows past the kept ones are never written, nor past the shared expert's (rows shared_row + t).
  const size_t hidden_row = static_cast<size_t>(g.inter) * dtype_size(g.moe.dtype);
  const size_t shared_first = g.shared ? static_cast<size_t>(b.shared_row) : static_cast<size_t>(b.rows);
  const size_t shared_end = g.shared ? shared_first + static_cast<size_t>(s.tokens) : shared_first;
  auto untouched = [](const std::vector<uint8_t>& v, size_t row_bytes, size_t first, size_t end) {
    return std::all_of(v.begin() + first * row_bytes, v.begin() + std::max(first, end) * row_bytes,
                       [](uint8_t byte) { return byte == 0xFF; });
  };
  EXPECT_TRUE(untouched(hidden, hidden_row, kept, shared_first) &&
              untouched(hidden, hidden_row, shared_end, static_cast<size_t>(b.rows)))
      << what << ": rank " << s.me << ": hidden rows past the kept ones were written";
  EXPECT_TRUE(untouched(y, s.row_bytes(), kept, shared_first) &&
              untouched(y, s.row_bytes(), shared_end, static_cast<size_t>(b.rows)))
      << what << ": rank " << s.me << ": expert_out rows past the kept ones were written";

  // The composed calls (all collective calls before the slow host reference).
  const Status composed = run_composed(g, s, b, *plan);
  ASSERT_TRUE(agree(composed.ok())) << what << ": the composed calls: " << composed.to_string();
  const Status synced = comm.synchronize(nullptr);
  ASSERT_TRUE(agree(synced.ok())) << what << ": " << synced.to_string();
  EXPECT_TRUE(std::equal(hidden.begin(), hidden.begin() + kept * hidden_row,
                         download<uint8_t>(b.composed_hidden.get(), kept * hidden_row).begin()))
      << what << ": rank " << s.me << ": hidden differs from moe_dispatch_gemm's";
  EXPECT_TRUE(std::equal(y.begin(), y.begin() + kept * s.row_bytes(), download<uint8_t>(b.composed_y, kept * s.row_bytes()).begin()))
      << what << ": rank " << s.me << ": expert_out differs from grouped_gemm's";
  if (g.shared) {
    // The shared expert's rows: grouped_gemm's bits on the tokens. out adds them before its one
    // rounding, which the composed calls cannot: the reference checks it.
    const size_t shared_rows = shared_end - shared_first;
    EXPECT_TRUE(std::equal(hidden.begin() + shared_first * hidden_row, hidden.begin() + shared_end * hidden_row,
                           download<uint8_t>(b.composed_shared_hidden.get(), shared_rows * hidden_row).begin()))
        << what << ": rank " << s.me << ": the shared expert's hidden rows differ from grouped_gemm's";
    EXPECT_TRUE(std::equal(y.begin() + shared_first * s.row_bytes(), y.begin() + shared_end * s.row_bytes(),
                           download<uint8_t>(b.composed_shared_y.get(), shared_rows * s.row_bytes()).begin()))
        << what << ": rank " << s.me << ": the shared expert's output rows differ from grouped_gemm's";
  } else {
    EXPECT_TRUE(out == download<uint8_t>(b.composed_out.get(), s.out_bytes()))
        << what << ": rank " << s.me << ": out differs from moe_combine's over the composed calls";
  }
  check_layer(g, s, what);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

std::vector<LayerCase> layer_cases() {
  std::vector<LayerCase> v;
  LayerCase uniform;
  uniform.moe = make_case(Routing::kUniform, 131);
  uniform.tile = GemmTile::k128x128;
  v.push_back(uniform);
  LayerCase skewed;  // H and 2I not multiples of the tile's columns
  skewed.moe = make_case(Routing::kSkewed, 132);
  skewed.moe.hidden = 320;
  skewed.inter = 136;
  v.push_back(skewed);
  LayerCase all_to_one;  // fp16
  all_to_one.moe = make_case(Routing::kAllToOne, 133);
  all_to_one.moe.dtype = DType::kF16;
  v.push_back(all_to_one);
  LayerCase empty;  // an expert without rows, unused slots, a rank without tokens
  empty.moe = make_case(Routing::kEmptyExpert, 134);
  empty.moe.experts_per_rank = 6;
  empty.moe.rank0_empty = true;
  v.push_back(empty);
  LayerCase drop;  // capacity overflow: the dropped slots add nothing
  drop.moe = make_case(Routing::kSkewed, 135);
  drop.moe.capacity = 300;
  drop.moe.overflow = MoeOverflow::kDrop;
  v.push_back(drop);
  LayerCase many;  // many tile rows per expert, top-8 of 8 experts per rank
  many.moe = make_case(Routing::kSkewed, 136);
  many.moe.experts_per_rank = 8;
  many.moe.top_k = 8;
  many.moe.tokens = 1000;
  many.moe.hidden = 128;
  many.inter = 64;
  v.push_back(many);
  LayerCase repeated;
  repeated.moe = make_case(Routing::kRepeated, 137);
  repeated.tile = GemmTile::k128x128;
  v.push_back(repeated);
  // A shared expert: beside uniform routing; with a rank of no tokens (no shared tiles there);
  // with dropped slots (a token may have only the shared expert), fp16, the other tile.
  LayerCase shared = uniform;
  shared.moe.seed = 138;
  shared.tile = GemmTile::k128x256;
  shared.shared = true;
  v.push_back(shared);
  LayerCase shared_empty = empty;
  shared_empty.moe.seed = 139;
  shared_empty.shared = true;
  v.push_back(shared_empty);
  LayerCase shared_drop = drop;
  shared_drop.moe.seed = 140;
  shared_drop.moe.dtype = DType::kF16;
  shared_drop.tile = GemmTile::k128x128;
  shared_drop.shared = true;
  v.push_back(shared_drop);
  // Raster groups of group_m tile rows whatever the experts (MoeLayerOptions::expert_groups =
  // false): many tile rows per expert, and beside a shared expert's rows.
  uint64_t plain_seed = 141;
  for (const LayerCase* base : {&many, &shared}) {
    LayerCase plain = *base;
    plain.moe.seed = plain_seed++;
    plain.expert_groups = false;
    v.push_back(plain);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeLayer, ::testing::ValuesIn(layer_cases()), routing_case_name<LayerCase>);

class MoeLayerChecks : public MoeTest {};

// What the host can check is refused before anything is launched or written; a routing that
// failed on the device leaves out untouched; the next call works.
TEST_F(MoeLayerChecks, BadInputIsRefusedAndAFailedRoutingWritesNothing) {
  Communicator& comm = shared_comm();
  LayerCase g;
  g.moe = make_case(Routing::kUniform, 141);
  g.shared = true;  // a failed routing must not run the shared expert either
  const std::string what = "moe_layer bad input: " + g.text(comm.world_size());
  CaseBuffers s(g.moe);
  ASSERT_TRUE(agree(s.ok)) << what << ": setting up";
  LayerBuffers b(g, s);
  ASSERT_TRUE(agree(b.ok)) << what << ": setting up the layer";
  Result<MoePlan> plan = moe_routing(comm, s.config, s.routing_args(), nullptr);
  ASSERT_TRUE(agree(plan.ok())) << plan.status().to_string();
  // As above: no synchronous copy while the routing kernel may wait for this process's proxy.
  const Status routed = comm.synchronize(nullptr);
  ASSERT_TRUE(agree(routed.ok())) << what << ": " << routed.to_string();
  auto refused = [&](MoeLayerWeights w, MoeLayerBuffers bufs, void* out, StatusCode code, const char* words) {
    const Status st = moe_layer(comm, *plan, s.d_x.get(), w, bufs, out, nullptr);
    EXPECT_EQ(st.code(), code) << st.to_string();
    EXPECT_NE(st.message().find(words), std::string::npos) << st.message();
  };
  MoeLayerWeights w = b.weights(g);
  w.down = nullptr;
  refused(w, b.buffers(s), s.d_out.get(), StatusCode::kInvalidArgument, "must not be null");
  w = b.weights(g);
  w.intermediate = 100;  // not a multiple of 8
  refused(w, b.buffers(s), s.d_out.get(), StatusCode::kUnsupported, "multiple of 8");
  MoeLayerBuffers bufs = b.buffers(s);
  bufs.expert_out = b.composed_hidden.get();  // plain device memory
  refused(b.weights(g), bufs, s.d_out.get(), StatusCode::kInvalidArgument, "symmetric");
  refused(b.weights(g), b.buffers(s), b.hidden.get(), StatusCode::kInvalidArgument, "overlaps");  // out over hidden
  std::vector<uint8_t> host(64);
  bufs = b.buffers(s);
  bufs.hidden = host.data();
  refused(b.weights(g), bufs, s.d_out.get(), StatusCode::kInvalidArgument, "hidden");
  w = b.weights(g);
  w.shared_down = nullptr;  // shared_gate_up without shared_down
  refused(w, b.buffers(s), s.d_out.get(), StatusCode::kInvalidArgument, "go together");
  bufs = b.buffers(s);
  bufs.hidden = b.composed_hidden.get();  // a shared expert, but hidden holds the receive rows only
  refused(b.weights(g), bufs, s.d_out.get(), StatusCode::kInvalidArgument, "moe_layer_rows");
  MoeLayerOptions narrow;
  narrow.tile = GemmTile::k64x128;
  const Status tile = moe_layer(comm, *plan, s.d_x.get(), b.weights(g), b.buffers(s), s.d_out.get(), nullptr, narrow);
  EXPECT_EQ(tile.code(), StatusCode::kUnsupported) << tile.to_string();
  EXPECT_TRUE(all_bytes(s.d_out.get(), s.out_bytes(), 0xFF)) << what << ": a refused call wrote out";

  // An expert id out of range: the routing fails on the device; the layer launches and writes
  // nothing; the report names it.
  s.ids[s.world - 1][2 * g.moe.top_k] = static_cast<int32_t>(s.config.num_experts);
  ASSERT_TRUE(agree(upload(s.d_ids.get(), s.ids[s.me]))) << what;
  Result<MoePlan> bad = moe_routing(comm, s.config, s.routing_args(), nullptr);
  ASSERT_TRUE(agree(bad.ok())) << bad.status().to_string();
  ASSERT_TRUE(agree(moe_layer(comm, *bad, s.d_x.get(), b.weights(g), b.buffers(s), s.d_out.get(), nullptr).ok())) << what;
  Result<MoeReport> report = moe_report(comm, *bad, nullptr);
  ASSERT_TRUE(agree(report.ok())) << what << ": the communicator must stay usable: " << report.status().to_string();
  EXPECT_EQ(report->status.code(), StatusCode::kInvalidArgument) << report->status.to_string();
  EXPECT_TRUE(all_bytes(s.d_out.get(), s.out_bytes(), 0xFF)) << what << ": out was written after a failed routing";
  EXPECT_TRUE(all_bytes(b.hidden.get(), b.hidden_bytes, 0xFF)) << what << ": hidden was written after a failed routing";
  EXPECT_TRUE(all_bytes(b.y(s), b.y_bytes, 0xFF)) << what << ": expert_out was written after a failed routing";
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

// moe_routing + moe_layer back to back (run_back_to_back): every launch leaves the same bits,
// and the last one the reference's.
void back_to_back_layer(bool swap_tails) {
  Communicator& comm = shared_comm();
  LayerCase g;
  g.moe = make_case(Routing::kSkewed, 142);
  g.swap_tails = swap_tails;
  const std::string what = "moe_layer " + g.text(comm.world_size()) + ", back-to-back launches";
  CaseBuffers s(g.moe);
  ASSERT_TRUE(agree(s.ok)) << what << ": setting up";
  LayerBuffers b(g, s);
  ASSERT_TRUE(agree(b.ok)) << what << ": setting up the layer";
  MoePlan plan;
  int differ = -1;
  const std::string failure = run_back_to_back(
      comm, s, s.d_out.get(), s.out_bytes(),
      [&](cudaStream_t stream) -> Result<MoePlan> {
        LOOM_ASSIGN_OR_RETURN(MoePlan p, moe_routing(comm, s.config, s.routing_args(), stream));
        LOOM_TRY(moe_layer(comm, p, s.d_x.get(), b.weights(g), b.buffers(s), s.d_out.get(), stream, g.options()));
        return p;
      },
      plan, differ);
  ASSERT_TRUE(agree(failure.empty())) << what << ": rank " << process().rank << ": " << failure;
  EXPECT_EQ(differ, 0) << what << ": rank " << process().rank << ": " << differ << " launches differ from launch 0";
  check_dispatch(s, what);
  check_layer(g, s, what);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

// Padded tails first, then swapped (the swapped path is the default; a failure in both points
// elsewhere).
TEST_F(MoeLayerChecks, BackToBackLaunchesAreBitIdentical) {
  for (bool swap : {false, true}) {
    back_to_back_layer(swap);
    if (::testing::Test::HasFailure()) return;
  }
}

// MoeLayerOptions::phases: every CTA of the grid fills its record (in order: entered, its dispatch
// role done, its first tile, its queue dry, its combine share done), the records past the grid are
// untouched, and the CTAs' tiles add up to both GEMMs' tiles: sum over local experts of
// ceil(rows / 128) tile rows (plus the shared expert's ceil(T / 128)), times N / 128 of each GEMM
// (tile 128x128: 2I / 128 for gate/up, H / 128 for down). The layer's bits are unchanged.
TEST_F(MoeLayerChecks, PhasesRecordEveryCtaAndEveryTile) {
  Communicator& comm = shared_comm();
  LayerCase g;
  g.moe = make_case(Routing::kSkewed, 143);
  g.tile = GemmTile::k128x128;
  g.shared = true;
  const std::string what = "moe_layer " + g.text(comm.world_size()) + ", phases";
  CaseBuffers s(g.moe);
  ASSERT_TRUE(agree(s.ok)) << what << ": setting up";
  LayerBuffers b(g, s);
  ASSERT_TRUE(agree(b.ok)) << what << ": setting up the layer";
  const int sms = comm.sm_count();
  const size_t record_bytes = sizeof(MoeLayerPhaseRecord);
  const DeviceBuffer records = device_buffer(static_cast<size_t>(sms) * record_bytes);
  ASSERT_TRUE(records && cudaMemset(records.get(), 0xFF, static_cast<size_t>(sms) * record_bytes) == cudaSuccess);
  Result<MoePlan> plan = moe_routing(comm, s.config, s.routing_args(), nullptr);
  ASSERT_TRUE(agree(plan.ok())) << what << ": " << plan.status().to_string();
  MoeLayerOptions options;
  options.tile = g.tile;
  options.phases = static_cast<MoeLayerPhaseRecord*>(records.get());
  const Status st = moe_layer(comm, *plan, s.d_x.get(), b.weights(g), b.buffers(s), s.d_out.get(), nullptr, options);
  ASSERT_TRUE(agree(st.ok())) << what << ": " << st.to_string();
  const Status synced = comm.synchronize(nullptr);
  ASSERT_TRUE(agree(synced.ok())) << what << ": " << synced.to_string();
  check_layer(g, s, what);

  const std::vector<MoeLayerPhaseRecord> got = download<MoeLayerPhaseRecord>(records.get(), static_cast<size_t>(sms));
  ASSERT_EQ(got.size(), static_cast<size_t>(sms));
  auto untouched = [](const MoeLayerPhaseRecord& r) { return r.entered_ns == ~uint64_t{0}; };
  int grid = 0;
  while (grid < sms && !untouched(got[static_cast<size_t>(grid)])) ++grid;
  EXPECT_GE(grid, 1) << what << ": no CTA wrote its record";
  int64_t tiles = 0;
  for (int i = 0; i < sms; ++i) {
    const MoeLayerPhaseRecord& r = got[static_cast<size_t>(i)];
    if (i >= grid) {
      EXPECT_TRUE(untouched(r)) << what << ": record " << i << " past the grid of " << grid << " was written";
      continue;
    }
    EXPECT_GT(r.entered_ns, 0u) << what << ": CTA " << i;
    EXPECT_LE(r.entered_ns, r.roles_done_ns) << what << ": CTA " << i;
    EXPECT_LE(r.roles_done_ns, r.tiles_done_ns) << what << ": CTA " << i;
    EXPECT_LE(r.tiles_done_ns, r.reduced_ns) << what << ": CTA " << i;
    if (r.tiles > 0) {
      EXPECT_LE(r.roles_done_ns, r.first_tile_ns) << what << ": CTA " << i;
      EXPECT_LE(r.first_tile_ns, r.tiles_done_ns) << what << ": CTA " << i;
    } else {
      EXPECT_EQ(r.first_tile_ns, 0u) << what << ": CTA " << i << " computed no tile";
    }
    EXPECT_LE(r.role, 3u) << what << ": CTA " << i;
    tiles += r.tiles;
  }
  const ref::RefRank& want = s.expected[s.me];
  int64_t tile_rows = (s.tokens + 127) / 128;  // the shared expert's
  for (size_t e = 0; e + 1 < want.expert_offsets.size(); ++e) {
    tile_rows += (want.expert_offsets[e + 1] - want.expert_offsets[e] + 127) / 128;
  }
  const int64_t expected_tiles = tile_rows * ((2 * g.inter + 127) / 128 + (g.moe.hidden + 127) / 128);
  EXPECT_EQ(tiles, expected_tiles) << what << ": rank " << s.me << ": the CTAs' tiles";
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

// MoE calls captured into a CUDA graph on `stream` (step() returns the plan), instantiated; the
// graph is destroyed with the object.
struct CapturedSteps {
  MoePlan plan;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;

  template <class Step>
  std::string capture(cudaStream_t stream, Step&& step) {
    if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return "cudaStreamBeginCapture";
    Result<MoePlan> captured = step();
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    if (!captured.ok()) return captured.status().to_string();
    if (ended != cudaSuccess) return cudaGetErrorString(ended);
    plan = *captured;
    return cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess ? "" : "cudaGraphInstantiate";
  }
  ~CapturedSteps() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
};

// CUDA graphs: routing, dispatch and combine captured on a stream (after moe_reserve_workspace and
// one eager step, which also loads the kernels), then the graph replayed three times with recv_x,
// out and expert_offsets poisoned before each replay: every replay writes the reference's bits (the launch
// epochs are read on the device, so each replay is a fresh launch to the peers; across nodes the
// forwarders' staged-plan check passes on every replay).
TEST_P(MoeGraph, RoutingDispatchCombineReplayTheReferenceBits) {
  Communicator& comm = shared_comm();
  Case c = make_case(Routing::kSkewed, 97);
  const std::string what = "graph: " + c.text(comm.world_size());
  CaseBuffers s(c);
  ASSERT_TRUE(agree(s.ok && s.fill_expert_outputs())) << what << ": setting up";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Status reserved = moe_reserve_workspace(comm, s.config, stream);
  ASSERT_TRUE(agree(reserved.ok())) << what << ": " << reserved.to_string();
  auto step = [&]() -> Result<MoePlan> {
    LOOM_ASSIGN_OR_RETURN(MoePlan p, moe_routing(comm, s.config, s.routing_args(), stream));
    LOOM_TRY(moe_dispatch(comm, p, s.d_x.get(), s.recv, stream));
    LOOM_TRY(moe_combine(comm, p, s.combine_args(), stream));
    return p;
  };
  Result<MoePlan> eager = step();
  ASSERT_TRUE(agree(eager.ok() && comm.synchronize(stream).ok())) << what << ": the eager step";
  CapturedSteps graph;
  const std::string captured_error = graph.capture(stream, step);
  ASSERT_TRUE(agree(captured_error.empty())) << what << ": capture: " << captured_error;
  const MoePlan& captured = graph.plan;
  for (int replay = 0; replay < 3 && !::testing::Test::HasFailure(); ++replay) {
    // recv_x, out and expert_offsets poisoned; expert_out (poisoned too) rewritten
    ASSERT_TRUE(agree(s.poison() && s.fill_expert_outputs())) << what << ": poisoning";
    ASSERT_EQ(cudaGraphLaunch(graph.exec, stream), cudaSuccess);
    Result<MoeReport> report = moe_report(comm, captured, stream);  // synchronizes the stream
    ASSERT_TRUE(agree(report.ok())) << what << ": replay " << replay << ": " << report.status().to_string();
    EXPECT_TRUE(report->status.ok()) << what << ": " << report->status.to_string();
    check_routing(s, captured, *report, what + ", replay " + std::to_string(replay));
    check_dispatch(s, what + ", replay " + std::to_string(replay));
    check_combine(s, what + ", replay " + std::to_string(replay));
  }
  cudaStreamDestroy(stream);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

// moe_routing + moe_layer (with a shared expert) captured in a CUDA graph after one eager step,
// replayed three times with recv_x, hidden, expert_out and out poisoned before each replay: every
// replay writes the eager step's bits.
TEST_P(MoeGraph, LayerReplaysTheEagerBits) {
  Communicator& comm = shared_comm();
  LayerCase g;
  g.moe = make_case(Routing::kSkewed, 97);  // MoeGraph's config: the pinned workspace fits it
  g.shared = true;
  const std::string what = "moe_layer graph: " + g.text(comm.world_size());
  CaseBuffers s(g.moe);
  ASSERT_TRUE(agree(s.ok)) << what << ": setting up";
  LayerBuffers b(g, s);
  ASSERT_TRUE(agree(b.ok)) << what << ": setting up the layer";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_TRUE(agree(moe_reserve_workspace(comm, s.config, stream).ok())) << what;
  auto step = [&]() -> Result<MoePlan> {
    LOOM_ASSIGN_OR_RETURN(MoePlan p, moe_routing(comm, s.config, s.routing_args(), stream));
    LOOM_TRY(moe_layer(comm, p, s.d_x.get(), b.weights(g), b.buffers(s), s.d_out.get(), stream));
    return p;
  };
  Result<MoePlan> eager = step();
  ASSERT_TRUE(agree(eager.ok() && comm.synchronize(stream).ok())) << what << ": the eager step";
  const std::vector<uint8_t> eager_out = download<uint8_t>(s.d_out.get(), s.out_bytes());
  CapturedSteps graph;
  const std::string captured_error = graph.capture(stream, step);
  ASSERT_TRUE(agree(captured_error.empty())) << what << ": capture: " << captured_error;
  for (int replay = 0; replay < 3 && !::testing::Test::HasFailure(); ++replay) {
    ASSERT_TRUE(agree(s.poison() && b.poison(s))) << what << ": poisoning";
    ASSERT_EQ(cudaGraphLaunch(graph.exec, stream), cudaSuccess);
    const Status synced = comm.synchronize(stream);
    ASSERT_TRUE(agree(synced.ok())) << what << ": replay " << replay << ": " << synced.to_string();
    EXPECT_TRUE(download<uint8_t>(s.d_out.get(), s.out_bytes()) == eager_out)
        << what << ": rank " << s.me << ": replay " << replay << " differs from the eager step";
    check_dispatch(s, what + ", replay " + std::to_string(replay));
  }
  cudaStreamDestroy(stream);
  check_layer(g, s, what);
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeGraph, ::testing::Values(0));

// Composition: combine straight over the dispatched rows (identity experts): out[t] is the
// slot-order fp32 sum of w[t, j] * x[t] over t's kept slots.
TEST_F(MoeCompose, CombineOfDispatchIsTheWeightedToken) {
  Communicator& comm = shared_comm();
  Case c = make_case(Routing::kUniform, 71);
  const std::string what = "compose: " + c.text(comm.world_size());
  CaseBuffers s(c);
  ASSERT_TRUE(agree(s.ok)) << what << ": setting up";
  MoeCombineArgs a = s.combine_args();
  a.expert_out = s.recv;
  Result<MoePlan> plan = launch_all(s, a);
  ASSERT_TRUE(plan.ok()) << what << ": " << plan.status().to_string();
  const Status synced = comm.synchronize(nullptr);
  ASSERT_TRUE(agree(synced.ok())) << what << ": " << synced.to_string();
  const std::vector<uint8_t> got = download<uint8_t>(s.d_out.get(), s.out_bytes());
  ASSERT_EQ(got.size(), s.out_bytes());
  const ref::RefRank& want = s.expected[s.me];
  int64_t wrong = 0;
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t h = 0; h < c.hidden; ++h) {
      const float xv = from_bits(c.dtype, to_bits(c.dtype, x_value(c.seed, s.me, t, h, c.hidden)));
      const float acc = s.combined(t, [&](size_t) { return xv; });
      const float value = from_bits(c.dtype, element_bits(c.dtype, got.data(), static_cast<size_t>(t * c.hidden + h)));
      if (to_bits(c.dtype, acc) != to_bits(c.dtype, value) && !(value == 0.0f && acc == 0.0f)) ++wrong;
    }
  }
  EXPECT_EQ(wrong, 0) << what << ": rank " << s.me << ": " << wrong << " outputs differ";
  EXPECT_TRUE(agree(!::testing::Test::HasFailure())) << what << ": a peer failed";
}

}  // namespace
}  // namespace loom
