// The fused tensor-parallel operators (ag_gemm, gemm_rs, gemm_ar) on every rank of the job, under
// loom-run with at least two ranks (one rank skips every test, identically on all ranks).
//
// Inputs are deterministic per rank (12-bit values in [-1, 1), a pure function of seed, rank and
// index), so every rank rebuilds every other rank's operands and computes an fp32 reference of its
// own output together with the bound sum_k |a||b| (reliability.md D3). Outputs are pre-filled
// with NaN bytes so an element nobody wrote fails.
//
// Tolerances (u = unit roundoff: bf16 2^-8, fp16 2^-11; W = local ranks):
//   element: |out - ref| <= ((W + 1) u + K 2^-23) * sum_k |a||b|   — at most one rounding of each
//            rank's partial product and one of the sum, plus fp32 accumulation
//   norm:    ||out - ref|| / ||ref|| <= 1e-2 (bf16), 2e-3 (fp16)  — rounding alone gives ~2e-3 / 3e-4
//
// Shapes whose M is a multiple of W x 128, N of 128 and each rank's K of 64 must be accepted.
// Others (M = 128 or 1000 on two ranks, N = 1000, K per rank 520) may be refused: then the refusal
// must be invalid_argument or unsupported with a message, nothing may be written, and the nearest
// shape of the first kind is run instead.
//
// Every multi-rank step is entered by all ranks; verdicts are agreed over the bootstrap before the
// next collective step, so a failure on one rank fails the test everywhere instead of hanging.
// Failures print the op, shape, plan, rank, relative error, the first mismatches and a map of the
// wrong 128 x 128 output tiles.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loom/gemm.h"
#include "loom/tensor_parallel.h"
#include "planner/tp_plan.h"
#include "runtime/communicator_impl.h"
#include "tests/common/verifiable.cuh"
#include "tests/gpu/common/tp_fixture.cuh"
#include "tests/gpu/harness.h"

namespace loom {
namespace {

using test::process;
using test::shared_comm;
using namespace test::tp;  // tests/gpu/common/tp_fixture.cuh

constexpr int kMapTile = 128;  // granularity of the wrong-tile map in failure messages

#define SKIP_UNLESS_MULTI_RANK() \
  if (process().world_size < 2) GTEST_SKIP() << "needs at least two ranks (loom-run -n 2 -- loom_gpu_tests)"

#define TP_CUDA(expr)                                                                      \
  do {                                                                                     \
    cudaError_t tp_err_ = (expr);                                                          \
    ASSERT_EQ(tp_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(tp_err_);       \
  } while (0)

bool agree(bool ok) { return test::all_ranks_agree(shared_comm(), ok); }

// ---- shapes -----------------------------------------------------------------------------------------

struct Shape {
  OpId op = OpId::kAgGemm;
  int64_t m = 0, n = 0;
  int64_t k_global = 0;  // ag_gemm: K; gemm_rs / gemm_ar: the K split over the ranks
  BLayout layout = BLayout::kNK;
  DType dtype = DType::kBF16;
  int world = 1, me = 0;

  int64_t k_rank() const { return op == OpId::kAgGemm ? k_global : k_global / world; }
  int64_t k_total() const { return op == OpId::kAgGemm ? k_global : k_rank() * world; }
  int64_t a_rows() const { return op == OpId::kAgGemm ? m / world : m; }
  int64_t out_rows() const { return op == OpId::kGemmRs ? m / world : m; }
  int64_t out_row0() const { return op == OpId::kGemmRs ? me * (m / world) : 0; }  // first global row of out
  int fill_rank() const { return me; }  // whose values this rank's operands hold
  size_t elem() const { return dtype_size(dtype); }
  size_t a_bytes() const { return static_cast<size_t>(a_rows() * k_rank()) * elem(); }
  size_t b_bytes() const { return static_cast<size_t>(n * k_rank()) * elem(); }
  size_t out_bytes() const { return static_cast<size_t>(out_rows() * n) * elem(); }
  // Granularity every kernel configuration covers (see the top of the file).
  bool must_be_supported() const { return m % (world * 128) == 0 && n % 128 == 0 && k_rank() % 64 == 0; }
  Shape supported_neighbour() const {
    Shape s = *this;
    s.m = (m + world * 128 - 1) / (world * 128) * (world * 128);
    s.n = (n + 127) / 128 * 128;
    const int64_t k_step = op == OpId::kAgGemm ? 64 : 64 * world;
    s.k_global = (k_global + k_step - 1) / k_step * k_step;
    return s;
  }
  std::string text() const {
    return std::string(planner::tp_op_name(op)) + " M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" +
           std::to_string(k_global) + (op == OpId::kAgGemm ? "" : " (K per rank " + std::to_string(k_rank()) + ")") +
           " W=" + std::to_string(world) + " B=" + std::string(b_layout_name(layout)) + " " + std::string(dtype_name(dtype));
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
  s.world = comm.local_world_size();
  s.me = comm.local_rank();
  return s;
}

// The planner's view of a shape (on the node's smallest SM count, as the operators plan).
planner::TpRequest request_of(const Shape& s) {
  planner::TpRequest r;
  r.op = s.op;
  r.m = s.m;
  r.n = s.n;
  r.k = s.k_rank();
  r.local_world = s.world;
  r.dtype = s.dtype;
  r.b_layout = s.layout;
  const int min_sms = internal(shared_comm()).topology.min_sm_count;
  r.sm_count = min_sms > 0 ? min_sms : shared_comm().sm_count();
  return r;
}

std::string plan_text(const Shape& s, const TpGemmOptions& options) {
  const planner::TpRequest r = request_of(s);
  Result<const planner::TuningCache*> cache = planner::tuning_cache_from_env();
  Result<planner::TpPlan> p = planner::plan_tp(r, options, cache.ok() ? *cache : nullptr);
  if (!p.ok()) return "(planner: " + p.status().to_string() + ")";
  return std::string(planner::tp_algorithm_name(p->algorithm)) + " comm_ctas=" + std::to_string(p->comm_ctas) + " tile=" +
         std::string(gemm_tile_name(p->tile)) + " (" + p->source + ")";
}

// ---- reference -----------------------------------------------------------------------------------------

// The fp32 reference of this rank's output rows, from every rank's regenerated operands.
struct Reference {
  DeviceMem c, bound;
  bool ok = false;
  Reference(const Shape& s, uint64_t seed) : c(static_cast<size_t>(s.out_rows() * s.n) * 4), bound(c.bytes) {
    const DType t = s.dtype;
    const bool kn = s.layout == BLayout::kKN;
    const int64_t kt = s.k_total();
    // ag_gemm: the gathered A (shard r is rank r's fill) times this rank's B. gemm_rs / gemm_ar:
    // A_full [M, K] (rank r's columns r*K_r) times B_full (rank r's rows, or columns for [N, K]).
    DeviceMem a_full(static_cast<size_t>(s.m * kt) * s.elem());
    DeviceMem b_full(static_cast<size_t>(s.n * kt) * s.elem());
    if (!c.p || !bound.p || !a_full.p || !b_full.p) return;
    for (int r = 0; r < s.world; ++r) {
      if (s.op == OpId::kAgGemm) {
        const int64_t shard = s.m / s.world;
        fill_matrix(at(a_full.p, r * shard * kt, t), t, shard, kt, kt, seed_a(seed), r, nullptr);
      } else {
        fill_matrix(at(a_full.p, r * s.k_rank(), t), t, s.m, s.k_rank(), kt, seed_a(seed), r, nullptr);
      }
      if (s.op == OpId::kAgGemm && r != s.me) continue;  // ag_gemm multiplies by this rank's own B
      const int64_t b_off = s.op == OpId::kAgGemm ? 0 : (kn ? r * s.k_rank() * s.n : r * s.k_rank());
      const int64_t ldb = kn ? s.n : kt;
      fill_matrix(at(b_full.p, b_off, t), t, kn ? s.k_rank() : s.n, kn ? s.n : s.k_rank(), ldb, seed_b(seed), r, nullptr);
    }
    ok = run_reference(at(a_full.p, s.out_row0() * kt, t), b_full.p, kn, kn ? s.n : kt, s.out_rows(), s.n, kt, t, c.p, bound.p);
  }
};

// The gathered A of ag_gemm, for checking gathered_a bit for bit.
std::unique_ptr<DeviceMem> gathered_reference(const Shape& s, uint64_t seed) {
  auto g = std::make_unique<DeviceMem>(static_cast<size_t>(s.m * s.k_global) * s.elem());
  const int64_t shard = s.m / s.world;
  for (int r = 0; r < s.world && g->p; ++r) {
    fill_matrix(at(g->p, r * shard * s.k_global, s.dtype), s.dtype, shard, s.k_global, s.k_global, seed_a(seed), r, nullptr);
  }
  cudaDeviceSynchronize();
  return g;
}

// ---- comparison -----------------------------------------------------------------------------------------

struct MismatchSample {
  int64_t row, col;
  float got, want, allowed;
};

constexpr int kSamples = 8;

struct CompareCounters {
  unsigned long long wrong;
  unsigned long long nan;
  double sq_err;
  double sq_ref;
  unsigned int samples;
  MismatchSample sample[kSamples];
};

template <typename T>
__global__ void compare_kernel(const T* out, const float* ref, const float* bound, int64_t rows, int64_t n, float bound_factor,
                               CompareCounters* counters, unsigned int* tile_map, int64_t map_cols) {
  double sq_err = 0, sq_ref = 0;
  const int64_t total = rows * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const float g = verify::to_float(out[i]);
    const float w = ref[i];
    const float allowed = bound_factor * bound[i] + 1e-6f;
    const bool is_nan = isnan(g);
    const float err = fabsf(g - w);
    sq_ref += static_cast<double>(w) * w;
    sq_err += is_nan ? 1e30 : static_cast<double>(err) * err;
    if (is_nan || !(err <= allowed)) {
      const int64_t r = i / n, c = i % n;
      atomicAdd(&counters->wrong, 1ull);
      if (is_nan) atomicAdd(&counters->nan, 1ull);
      atomicAdd(&tile_map[(r / kMapTile) * map_cols + c / kMapTile], 1u);
      const unsigned slot = atomicAdd(&counters->samples, 1u);
      if (slot < kSamples) counters->sample[slot] = MismatchSample{r, c, g, w, allowed};
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

struct Verdict {
  bool ok = false;
  double rel_err = 0;
  std::string report;  // filled when !ok
};

// Compares this rank's output of `s` with the reference; `what` starts the failure report.
Verdict compare_output(const Shape& s, const void* out, const Reference& ref, const std::string& what) {
  Verdict v;
  if (!ref.ok) {
    v.report = what + ": could not build the reference (device memory or a CUDA error)";
    return v;
  }
  const int64_t map_rows = (s.out_rows() + kMapTile - 1) / kMapTile, map_cols = (s.n + kMapTile - 1) / kMapTile;
  DeviceMem counters(sizeof(CompareCounters)), map(static_cast<size_t>(map_rows * map_cols) * 4);
  cudaMemset(counters.p, 0, counters.bytes);
  cudaMemset(map.p, 0, map.bytes);
  const float factor = static_cast<float>((s.world + 1) * unit_roundoff(s.dtype) + s.k_total() * std::ldexp(1.0, -23));
  const unsigned grid = verify::grid_for(static_cast<uint64_t>(s.out_rows() * s.n));
  auto* cc = static_cast<CompareCounters*>(counters.p);
  auto* tm = static_cast<unsigned*>(map.p);
  const float* c = static_cast<const float*>(ref.c.p);
  const float* bd = static_cast<const float*>(ref.bound.p);
  if (s.dtype == DType::kBF16) {
    compare_kernel<<<grid, 256>>>(static_cast<const __nv_bfloat16*>(out), c, bd, s.out_rows(), s.n, factor, cc, tm, map_cols);
  } else {
    compare_kernel<<<grid, 256>>>(static_cast<const __half*>(out), c, bd, s.out_rows(), s.n, factor, cc, tm, map_cols);
  }
  CompareCounters h{};
  std::vector<unsigned> tiles(static_cast<size_t>(map_rows * map_cols));
  const cudaError_t e1 = cudaMemcpy(&h, counters.p, sizeof(h), cudaMemcpyDeviceToHost);
  const cudaError_t e2 = cudaMemcpy(tiles.data(), map.p, map.bytes, cudaMemcpyDeviceToHost);
  if (e1 != cudaSuccess || e2 != cudaSuccess) {
    v.report = what + ": comparing failed: " + cudaGetErrorString(e1 != cudaSuccess ? e1 : e2);
    return v;
  }
  v.rel_err = h.sq_ref > 0 ? std::sqrt(h.sq_err / h.sq_ref) : 1e30;
  v.ok = h.wrong == 0 && v.rel_err <= norm_tolerance(s.dtype) && h.sq_ref > 0;
  if (v.ok) return v;
  char line[256];
  std::snprintf(line, sizeof line, ": rank %d: rel_err %.3g (limit %.1g), %llu elements outside the bound (%llu NaN) of %lld\n",
                process().rank, v.rel_err, norm_tolerance(s.dtype), h.wrong, h.nan, static_cast<long long>(s.out_rows() * s.n));
  v.report = what + line;
  for (unsigned i = 0; i < std::min<unsigned>(h.samples, kSamples); ++i) {
    const MismatchSample& m = h.sample[i];
    std::snprintf(line, sizeof line, "    out row %lld (global row %lld), col %lld: got %.6g want %.6g (allowed error %.3g)\n",
                  static_cast<long long>(m.row), static_cast<long long>(m.row + s.out_row0()), static_cast<long long>(m.col),
                  m.got, m.want, m.allowed);
    v.report += line;
  }
  v.report += "  wrong elements per " + std::to_string(kMapTile) + "x" + std::to_string(kMapTile) +
              " output tile (. none, x some, X all; rows of this rank's output, first 64 x 100):\n";
  const int64_t full = int64_t{kMapTile} * kMapTile;
  for (int64_t r = 0; r < std::min<int64_t>(map_rows, 64); ++r) {
    v.report += "    ";
    for (int64_t col = 0; col < std::min<int64_t>(map_cols, 100); ++col) {
      const unsigned w = tiles[static_cast<size_t>(r * map_cols + col)];
      v.report += w == 0 ? '.' : (w >= full ? 'X' : 'x');
    }
    v.report += "\n";
  }
  return v;
}

// Number of 16-bit words of `p` that differ from `q` (q == nullptr: from the NaN fill 0xFFFF).
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

// ---- one case: launch, refusal rules, comparison ----------------------------------------------------

enum class Outcome { kCorrect, kRefused, kFailed };

// Runs `s` once with `options` on every rank and checks it. Collective: every rank calls it with
// the same shape. Returns kRefused (checked to be clean) when the operator declined the shape.
Outcome run_and_check(const Shape& s, uint64_t seed, const TpGemmOptions& options = {}, const char* label = "") {
  Communicator& comm = shared_comm();
  const std::string what = s.text() + (label[0] ? std::string(" [") + label + "]" : "") + ", plan " + plan_text(s, options);
  SymmetricMem sym(comm);
  Inputs in(s, seed);
  Output out(s, sym);
  bool ready = in.ok() && out.p != nullptr && cudaMemset(out.p, 0xFF, s.out_bytes()) == cudaSuccess &&
               cudaDeviceSynchronize() == cudaSuccess;
  // Every rank's output is poisoned before anyone launches (gemm_ar writes into its peers').
  if (!agree(ready)) {
    ADD_FAILURE() << what << ": rank " << process().rank << (ready ? ": a peer" : "") << " could not set up the case";
    return Outcome::kFailed;
  }
  const Status launched = launch(comm, s.op, args_for(s, in, out.p), nullptr, options);
  const bool all_launched = agree(launched.ok());
  const bool all_refused = agree(!launched.ok());
  if (!all_launched && !all_refused) {
    // Validation must not depend on the rank: the ranks that launched now wait for the others.
    const Status synced = launched.ok() ? comm.synchronize(nullptr) : Status{};
    ADD_FAILURE() << what << ": rank " << process().rank
                  << (launched.ok() ? " launched (synchronize: " + synced.to_string() + ")" : " refused (" + launched.to_string() + ")")
                  << " while a peer did the opposite";
    return Outcome::kFailed;
  }
  if (all_refused) {
    const bool clean_code = launched.code() == StatusCode::kInvalidArgument || launched.code() == StatusCode::kUnsupported;
    const bool names_op = launched.message().find(planner::tp_op_name(s.op)) != std::string::npos;
    const bool untouched = different_words(out.p, nullptr, s.out_bytes()) == 0;
    EXPECT_TRUE(clean_code) << what << ": refused with " << launched.to_string() << " (expected invalid_argument or unsupported)";
    EXPECT_FALSE(s.must_be_supported()) << what << ": this shape must be accepted, but: " << launched.to_string();
    EXPECT_TRUE(names_op) << what << ": the message should name the operator: " << launched.to_string();
    EXPECT_TRUE(untouched) << what << ": refused, but the output was written";
    // One verdict everywhere: only a clean refusal on every rank lets the caller go on to the neighbour.
    return agree(clean_code && !s.must_be_supported() && names_op && untouched) ? Outcome::kRefused : Outcome::kFailed;
  }
  const Status synced = comm.synchronize(nullptr);
  if (!synced.ok()) {
    ADD_FAILURE() << what << ": rank " << process().rank << ": synchronize: " << synced.to_string();
    return Outcome::kFailed;
  }
  const Reference ref(s, seed);
  const Verdict v = compare_output(s, out.p, ref, what);
  EXPECT_TRUE(v.ok) << v.report;
  return v.ok ? Outcome::kCorrect : Outcome::kFailed;
}

// A shape that may be refused: when it is, its supported neighbour must run correctly.
void run_shape_or_neighbour(const Shape& s, uint64_t seed, std::vector<std::string>& refused) {
  const Outcome o = run_and_check(s, seed);
  if (o != Outcome::kRefused) return;
  refused.push_back(s.text());
  const Shape n = s.supported_neighbour();
  EXPECT_EQ(run_and_check(n, seed + 1, {}, "supported neighbour of a refused shape"), Outcome::kCorrect)
      << s.text() << " was refused; its neighbour " << n.text() << " must run";
}

const OpId kOps[] = {OpId::kAgGemm, OpId::kGemmRs, OpId::kGemmAr};

std::string op_param_name(OpId op) { return std::string(planner::tp_op_name(op)); }

// ---- correctness ----------------------------------------------------------------------------------------

struct OpLayout {
  OpId op;
  BLayout layout;
};

class TpOpsCorrectness : public ::testing::TestWithParam<OpLayout> {};

TEST_P(TpOpsCorrectness, MatchesFp32ReferenceAcrossShapes) {
  SKIP_UNLESS_MULTI_RANK();
  const OpLayout p = GetParam();
  // (N, K) pairs: small, mid, and one whose N and per-rank K are not multiples of any tile.
  struct NK {
    int64_t n, k;
  };
  const NK pairs[] = {{512, 1024}, {1536, 2048}, {1000, 1040}};
  std::vector<std::string> refused;
  uint64_t seed = 1000 + static_cast<uint64_t>(p.op) * 100 + static_cast<uint64_t>(p.layout) * 50;
  for (int64_t m : {128, 1000, 4096, 16384}) {
    for (const NK& nk : pairs) {
      if (m == 16384 && nk.n != 512) continue;  // the large M once: the reference runs on CUDA cores
      run_shape_or_neighbour(make_shape(p.op, m, nk.n, nk.k, p.layout), ++seed, refused);
      if (!agree(!HasFailure())) return;
    }
  }
  if (process().rank == 0 && !refused.empty()) {
    std::string list;
    for (const std::string& r : refused) list += "\n    " + r;
    std::printf("[ info     ] refused (clean, neighbour ran):%s\n", list.c_str());
  }
}

TEST_P(TpOpsCorrectness, Fp16MatchesReference) {
  SKIP_UNLESS_MULTI_RANK();
  const OpLayout p = GetParam();
  EXPECT_EQ(run_and_check(make_shape(p.op, 2048, 1024, 2048, p.layout, DType::kF16), 77), Outcome::kCorrect);
}

INSTANTIATE_TEST_SUITE_P(TpOps, TpOpsCorrectness,
                         ::testing::Values(OpLayout{OpId::kAgGemm, BLayout::kKN}, OpLayout{OpId::kAgGemm, BLayout::kNK},
                                           OpLayout{OpId::kGemmRs, BLayout::kKN}, OpLayout{OpId::kGemmRs, BLayout::kNK},
                                           OpLayout{OpId::kGemmAr, BLayout::kKN}, OpLayout{OpId::kGemmAr, BLayout::kNK}),
                         [](const ::testing::TestParamInfo<OpLayout>& info) {
                           return op_param_name(info.param.op) + "_" + std::string(b_layout_name(info.param.layout));
                         });

class TpOpsOptions : public ::testing::TestWithParam<OpId> {};

// Every algorithm and a range of role splits give the same (correct) result.
TEST_P(TpOpsOptions, EveryAlgorithmAndRoleSplitIsCorrect) {
  SKIP_UNLESS_MULTI_RANK();
  const Shape s = make_shape(GetParam(), 4096, 1536, 2048, BLayout::kNK);
  const int sms = shared_comm().sm_count();
  struct Variant {
    const char* label;
    TpGemmOptions options;
  };
  std::vector<Variant> variants;
  variants.push_back({"planner", {}});
  variants.push_back({"decomposed", {TpAlgorithm::kDecomposed, -1, GemmTile::kAuto}});
  variants.push_back({"fused, 1 comm CTA", {TpAlgorithm::kFused, 1, GemmTile::kAuto}});
  variants.push_back({"fused, 8 comm CTAs", {TpAlgorithm::kFused, 8, GemmTile::kAuto}});
  variants.push_back({"fused, half the SMs communicate", {TpAlgorithm::kFused, sms / 2, GemmTile::kAuto}});
  variants.push_back({"fused, 128x128 tiles", {TpAlgorithm::kFused, -1, GemmTile::k128x128}});
  // The last partial wave's tiles (192 tiles of 128x256 on the grid) whole, in 3 K pieces, and
  // in one k-block each (ag_gemm: 2, K = 2048); 128x128 in 2 pieces.
  variants.push_back({"fused, no tail split", {TpAlgorithm::kFused, -1, GemmTile::k128x256, 1}});
  variants.push_back({"fused, tail in 3 K pieces", {TpAlgorithm::kFused, -1, GemmTile::k128x256, 3}});
  variants.push_back({"fused, tail in 16 K pieces", {TpAlgorithm::kFused, -1, GemmTile::k128x256, 16}});
  variants.push_back({"fused, 128x128 tail in 2 K pieces", {TpAlgorithm::kFused, -1, GemmTile::k128x128, 2}});
  uint64_t seed = 500;
  for (const Variant& v : variants) {
    EXPECT_EQ(run_and_check(s, ++seed, v.options, v.label), Outcome::kCorrect) << v.label;
    if (!agree(!HasFailure())) return;
  }
}

INSTANTIATE_TEST_SUITE_P(TpOps, TpOpsOptions, ::testing::ValuesIn(kOps),
                         [](const ::testing::TestParamInfo<OpId>& info) { return op_param_name(info.param); });

// The gathered A is bit-exact whatever the row chunks (planner::ag_rows_per_flag; K = 1536:
// 1 comm CTA pushes 256-row chunks, 24 push 32-row chunks, so a tile row waits for 4 flags),
// and the shard reaches this rank's own rows of gathered_a as well.
TEST(TpOpsGatheredA, AgReturnsTheGatheredABitExact) {
  SKIP_UNLESS_MULTI_RANK();
  Communicator& comm = shared_comm();
  uint64_t seed = 900;
  struct Variant {
    const char* label;
    TpGemmOptions options;
  };
  const Variant variants[] = {{"planner", {}},
                              {"fused, 1 comm CTA", {TpAlgorithm::kFused, 1, GemmTile::kAuto}},
                              {"fused, 24 comm CTAs", {TpAlgorithm::kFused, 24, GemmTile::kAuto}}};
  for (const auto& [label, options] : variants) {
    for (BLayout layout : {BLayout::kKN, BLayout::kNK}) {
      ++seed;
      const Shape s = make_shape(OpId::kAgGemm, 2048, 1024, 1536, layout);
      SymmetricMem sym(comm);
      Inputs in(s, seed);
      Output out(s, sym);
      const size_t gathered_bytes = static_cast<size_t>(s.m * s.k_global) * s.elem();
      void* gathered = sym.alloc(gathered_bytes);
      const bool ready = in.ok() && out.p && gathered && cudaMemset(out.p, 0xFF, s.out_bytes()) == cudaSuccess &&
                         cudaMemset(gathered, 0xFF, gathered_bytes) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
      ASSERT_TRUE(agree(ready)) << "setting up " << s.text();
      TpGemmArgs args = args_for(s, in, out.p);
      args.gathered_a = gathered;
      const Status launched = ag_gemm(comm, args, nullptr, options);
      ASSERT_TRUE(agree(launched.ok())) << s.text() << " with gathered_a, " << label << ": " << launched.to_string();
      const Status synced = comm.synchronize(nullptr);
      ASSERT_TRUE(agree(synced.ok())) << s.text() << " with gathered_a, " << label << ": " << synced.to_string();
      const std::unique_ptr<DeviceMem> want = gathered_reference(s, seed);
      EXPECT_EQ(different_words(gathered, want->p, gathered_bytes), 0u)
          << s.text() << ", " << label << ": gathered_a differs from the gathered shards";
      const Reference ref(s, seed);
      const Verdict v = compare_output(s, out.p, ref, s.text() + " with gathered_a, " + label);
      EXPECT_TRUE(v.ok) << v.report;
      ASSERT_TRUE(agree(!HasFailure()));
    }
  }
}

// One fused launch of `s` with a timeline buffer of tile_timeline_capacity(M, N) records (zeroed)
// and a NaN-filled output, on every rank; run() reports a failure and returns false.
struct TimelineRun {
  Shape s;
  SymmetricMem sym;
  Inputs in;
  Output out;
  DeviceMem records;
  std::vector<TileTimelineRecord> r;  // the records after run()

  TimelineRun(const Shape& shape, uint64_t seed)
      : s(shape), sym(shared_comm()), in(shape, seed), out(shape, sym),
        records(static_cast<size_t>(tile_timeline_capacity(shape.m, shape.n)) * sizeof(TileTimelineRecord)) {}

  bool run(TpGemmOptions options) {
    Communicator& comm = shared_comm();
    const bool ready = in.ok() && out.p && records.p && cudaMemset(out.p, 0xFF, s.out_bytes()) == cudaSuccess &&
                       cudaMemset(records.p, 0, records.bytes) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
    if (!agree(ready)) {
      ADD_FAILURE() << "setting up " << s.text();
      return false;
    }
    options.timeline = static_cast<TileTimelineRecord*>(records.p);
    const Status launched = launch(comm, s.op, args_for(s, in, out.p), nullptr, options);
    if (!agree(launched.ok())) {
      ADD_FAILURE() << s.text() << ": " << launched.to_string();
      return false;
    }
    const Status synced = comm.synchronize(nullptr);
    if (!agree(synced.ok())) {
      ADD_FAILURE() << s.text() << ": " << synced.to_string();
      return false;
    }
    r.resize(records.bytes / sizeof(TileTimelineRecord));
    return cudaMemcpy(r.data(), records.p, records.bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
  }
};

// TpGemmOptions::timeline reaches the fused kernels: gemm_rs and gemm_ar record every tile once,
// this rank's own tile rows as fold tiles that spent time folding (K_r = 1024: the fold sits
// before the last k-blocks), the others as plain tiles; the result stays right.
TEST(TpOpsTimeline, FusedReduceKernelsRecordEveryTileAndTheirFolds) {
  SKIP_UNLESS_MULTI_RANK();
  uint64_t seed = 950;
  for (OpId op : {OpId::kGemmRs, OpId::kGemmAr}) {
    const Shape s = make_shape(op, 1024, 768, 2048, BLayout::kNK);
    TimelineRun run(s, ++seed);
    TpGemmOptions options;
    options.algorithm = TpAlgorithm::kFused;
    options.tile = GemmTile::k128x256;
    ASSERT_TRUE(run.run(options));
    const std::vector<TileTimelineRecord>& r = run.r;
    const int64_t m_blocks = s.m / 128, n_blocks = (s.n + 255) / 256, own = m_blocks / s.world;
    for (int64_t t = 0; t < m_blocks * n_blocks; ++t) {
      const TileTimelineRecord& x = r[static_cast<size_t>(t)];
      const bool fold = t / n_blocks >= s.me * own && t / n_blocks < (s.me + 1) * own;
      ASSERT_NE(x.claimed_ns, 0u) << s.text() << ": tile " << t << " has no record on rank " << s.me;
      EXPECT_LE(x.mainloop_clock, x.stored_clock) << s.text() << " tile " << t;
      EXPECT_EQ(x.kind, fold ? 4u : 0u) << s.text() << " tile " << t << " on rank " << s.me;
      if (fold) {
        EXPECT_GT(x.fold_cycles, 0u) << s.text() << " tile " << t;
        EXPECT_LE(uint64_t{x.fold_drain_cycles} + x.fold_signal_cycles, x.fold_cycles) << s.text() << " tile " << t;
      } else {
        EXPECT_EQ(x.fold_cycles, 0u) << s.text() << " tile " << t;
        EXPECT_EQ(x.fold_drain_cycles + x.fold_signal_cycles, 0u) << s.text() << " tile " << t;
      }
    }
    const Reference ref(s, seed);
    const Verdict v = compare_output(s, run.out.p, ref, s.text() + " with a timeline");
    EXPECT_TRUE(v.ok) << v.report;
    ASSERT_TRUE(agree(!HasFailure()));
  }
}

// A split tail (every fused operator): 192 tiles of 128x256 on the grid leave 192 % SMs in the
// last partial wave (ag_gemm: plus the claims its 4 pushing comm CTAs miss,
// planner::ag_late_claims); in 3 K pieces each, their 2 pieces per tile are recorded after the
// tiles (kind 5), nothing beyond.
TEST(TpOpsTimeline, SplitTilesRecordTheirPieces) {
  SKIP_UNLESS_MULTI_RANK();
  Communicator& comm = shared_comm();
  const int sms = comm.sm_count();  // the grid
  uint64_t seed = 970;
  for (OpId op : kOps) {
    const Shape s = make_shape(op, 4096, 1536, 2048, BLayout::kNK);
    const int64_t tiles = (s.m / 128) * (s.n / 256);
    TpGemmOptions options;
    options.algorithm = TpAlgorithm::kFused;
    options.tile = GemmTile::k128x256;
    options.tail_pieces = 3;
    int64_t late = 0;
    if (op == OpId::kAgGemm) {
      options.comm_ctas = 4;
      planner::TpRequest r = request_of(s);
      r.sm_count = sms;  // the split is planned on the launch's grid
      const int64_t rows_per_flag = planner::ag_rows_per_flag(s.a_rows(), s.k_rank() * s.elem(), 4, s.world - 1);
      late = planner::ag_late_claims(r, GemmTile::k128x256, 4, rows_per_flag, s.world - 1);
    }
    const int64_t split_tiles = std::min<int64_t>({tiles % sms + late, sms, tiles});
    // gemm_rs / gemm_ar split only own tiles (the order's last band: all own rows here).
    const int64_t splittable = op == OpId::kAgGemm ? tiles : tiles / s.world;
    if (split_tiles == 0 || split_tiles > splittable) GTEST_SKIP() << tiles << " tiles on " << sms << " SMs leave no tail to split";
    TimelineRun run(s, ++seed);
    ASSERT_TRUE(run.run(options));
    const std::vector<TileTimelineRecord>& r = run.r;
    const int64_t capacity = static_cast<int64_t>(r.size());
    const int64_t pieces = split_tiles * 2;
    ASSERT_LT(tiles + pieces, capacity);
    for (int64_t t = 0; t < tiles + pieces; ++t) {
      const TileTimelineRecord& x = r[static_cast<size_t>(t)];
      ASSERT_NE(x.claimed_ns, 0u) << s.text() << ": record " << t << " is empty on rank " << s.me;
      EXPECT_LE(x.mainloop_clock, x.stored_clock) << s.text() << " record " << t;
      if (t >= tiles) EXPECT_EQ(x.kind, 5u) << s.text() << " record " << t << " (piece slot " << t - tiles << ")";
    }
    EXPECT_EQ(r[static_cast<size_t>(tiles + pieces)].claimed_ns, 0u) << s.text() << ": a record past the pieces was written";
    const Reference ref(s, seed);
    const Verdict v = compare_output(s, run.out.p, ref, s.text() + " split, with a timeline");
    EXPECT_TRUE(v.ok) << v.report;
    ASSERT_TRUE(agree(!HasFailure()));
  }
}

// ---- repeatability and skew (reliability.md D4, H10b) ------------------------------------------------

// Per op: the outputs of consecutive launches, all checked against the first and the first
// against the reference.
struct Series {
  Shape shape;
  Inputs inputs;
  std::vector<std::unique_ptr<DeviceMem>> plain;
  std::vector<void*> outs;
  Series(const Shape& s, uint64_t seed, int count, SymmetricMem& sym) : shape(s), inputs(s, seed) {
    for (int i = 0; i < count; ++i) {
      if (s.op == OpId::kGemmAr) {
        outs.push_back(sym.alloc(s.out_bytes()));
      } else {
        plain.push_back(std::make_unique<DeviceMem>(s.out_bytes()));
        outs.push_back(plain.back()->p);
      }
    }
  }
  bool ready() {
    if (!inputs.ok()) return false;
    for (void* p : outs) {
      if (p == nullptr || cudaMemset(p, 0xFF, shape.out_bytes()) != cudaSuccess) return false;
    }
    return cudaDeviceSynchronize() == cudaSuccess;
  }
  // First output correct, every later one bit-identical to it.
  void check(uint64_t seed, const std::string& context) {
    const std::string what = shape.text() + " " + context + ", plan " + plan_text(shape, {});
    const Reference ref(shape, seed);
    const Verdict v = compare_output(shape, outs[0], ref, what + ", launch 0");
    EXPECT_TRUE(v.ok) << v.report;
    std::string differing;
    int count = 0;
    for (size_t i = 1; i < outs.size(); ++i) {
      const unsigned long long d = different_words(outs[i], outs[0], shape.out_bytes());
      if (d != 0) {
        if (++count <= 10) {
          char item[64];
          std::snprintf(item, sizeof item, " %zu (%llu elements)", i, d);
          differing += item;
        }
      }
    }
    EXPECT_EQ(count, 0) << what << ": rank " << process().rank << ": " << count << " of " << outs.size() - 1
                        << " launches differ from launch 0:" << differing;
  }
};

TEST(TpOpsStress, TwoHundredBackToBackLaunchesAreBitIdentical) {
  SKIP_UNLESS_MULTI_RANK();
  Communicator& comm = shared_comm();
  constexpr int kLaunches = 200;
  const uint64_t seed = 1200;
  SymmetricMem sym(comm);
  std::vector<std::unique_ptr<Series>> series;
  for (OpId op : kOps) series.push_back(std::make_unique<Series>(make_shape(op, 1024, 1024, 2048, BLayout::kNK), seed, kLaunches, sym));
  bool ready = true;
  for (auto& s : series) ready = s->ready() && ready;
  ASSERT_TRUE(agree(ready)) << "setting up " << kLaunches << " outputs per operator";
  cudaStream_t stream;
  TP_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The three operators interleaved, no host synchronisation in between.
  Status launched;
  for (int i = 0; i < kLaunches && launched.ok(); ++i) {
    for (auto& s : series) {
      const Status st = launch(comm, s->shape.op, args_for(s->shape, s->inputs, s->outs[static_cast<size_t>(i)]), stream);
      if (!st.ok()) {
        ADD_FAILURE() << s->shape.text() << ": launch " << i << ": " << st.to_string();
        launched = st;
        break;
      }
    }
  }
  const Status synced = comm.synchronize(stream);
  cudaStreamDestroy(stream);
  ASSERT_TRUE(agree(launched.ok() && synced.ok())) << "rank " << process().rank << ": " << synced.to_string();
  for (auto& s : series) s->check(seed, std::to_string(kLaunches) + " launches without host sync");
}

// Split tail tiles: the pieces are claimed by whichever CTAs come first, yet the fold adds them
// in a fixed order, so launch after launch gives the same bits (and gemm_ar the same on all ranks,
// checked by the reference comparison of every rank).
TEST(TpOpsTailSplit, PiecesFoldBitIdenticallyLaunchAfterLaunch) {
  SKIP_UNLESS_MULTI_RANK();
  Communicator& comm = shared_comm();
  constexpr int kLaunches = 20;
  const uint64_t seed = 1300;
  for (OpId op : kOps) {
    for (int pieces : {2, 3, 4}) {
      SymmetricMem sym(comm);
      Series series(make_shape(op, 4096, 1536, 2048, BLayout::kNK), seed + static_cast<uint64_t>(pieces), kLaunches, sym);
      ASSERT_TRUE(agree(series.ready())) << "setting up " << kLaunches << " outputs";
      TpGemmOptions options;
      options.algorithm = TpAlgorithm::kFused;
      options.tile = GemmTile::k128x256;
      options.tail_pieces = pieces;
      Status launched;
      for (int i = 0; i < kLaunches && launched.ok(); ++i) {
        const Status st = launch(comm, op, args_for(series.shape, series.inputs, series.outs[static_cast<size_t>(i)]), nullptr, options);
        if (!st.ok()) launched = st;
      }
      const Status synced = comm.synchronize(nullptr);
      ASSERT_TRUE(agree(launched.ok() && synced.ok()))
          << "rank " << process().rank << ": " << launched.to_string() << " / " << synced.to_string();
      series.check(seed + static_cast<uint64_t>(pieces), std::to_string(pieces) + " tail pieces, " +
                                                             std::to_string(kLaunches) + " launches");
      if (!agree(!HasFailure())) return;
    }
  }
}

TEST(TpOpsStress, OneRankDelayedBeforeEachLaunch) {
  SKIP_UNLESS_MULTI_RANK();
  Communicator& comm = shared_comm();
  constexpr int kLaunches = 20;
  const uint64_t seed = 1300;
  const int delayed_rank = process().world_size - 1;
  SymmetricMem sym(comm);
  std::vector<std::unique_ptr<Series>> series;
  for (OpId op : kOps) series.push_back(std::make_unique<Series>(make_shape(op, 2048, 1024, 2048, BLayout::kKN), seed, kLaunches, sym));
  bool ready = true;
  for (auto& s : series) ready = s->ready() && ready;
  ASSERT_TRUE(agree(ready));
  std::mt19937 rng(4242);
  std::uniform_int_distribution<int> delay_us(0, 5000);
  Status launched;
  for (int i = 0; i < kLaunches && launched.ok(); ++i) {
    for (auto& s : series) {
      const int us = delay_us(rng);  // drawn on every rank, slept on one
      if (process().rank == delayed_rank) std::this_thread::sleep_for(std::chrono::microseconds(us));
      const Status st = launch(comm, s->shape.op, args_for(s->shape, s->inputs, s->outs[static_cast<size_t>(i)]), nullptr);
      if (!st.ok()) {
        ADD_FAILURE() << s->shape.text() << ": launch " << i << ": " << st.to_string();
        launched = st;
        break;
      }
    }
  }
  const Status synced = comm.synchronize(nullptr);
  ASSERT_TRUE(agree(launched.ok() && synced.ok())) << "rank " << process().rank << ": " << synced.to_string();
  for (auto& s : series) {
    s->check(seed, "with rank " + std::to_string(delayed_rank) + " delayed 0-5 ms before each of " + std::to_string(kLaunches) +
                       " launches");
  }
}

// ---- a peer that never launches (reliability.md H1) ----------------------------------------------

class TpOpsFailure : public ::testing::TestWithParam<OpId> {};

TEST_P(TpOpsFailure, MissingPeerTimesOutAndContextStaysUsable) {
  SKIP_UNLESS_MULTI_RANK();
  const OpId op = GetParam();
  constexpr int kTimeoutMs = 2000;
  CommOptions options;
  options.heap_bytes = uint64_t{512} << 20;
  options.op_timeout = std::chrono::milliseconds(kTimeoutMs);
  std::unique_ptr<Communicator> comm = test::make_comm(options);
  ASSERT_NE(comm, nullptr);
  const int silent_rank = process().world_size - 1;
  Shape s = make_shape(op, 1024, 512, 1024, BLayout::kNK);
  Inputs in(s, 31);
  SymmetricMem sym(*comm);
  Output out(s, sym);
  // One call on every rank first: the operator grows its workspace collectively (a host barrier)
  // on first use, and the peer is to go silent only after it has worked, as in a real job.
  bool warmed_up = in.ok() && out.p != nullptr;
  if (warmed_up) {
    const Status first = launch(*comm, op, args_for(s, in, out.p), nullptr);
    const Status synced = first.ok() ? comm->synchronize(nullptr) : first;
    EXPECT_TRUE(synced.ok()) << s.text() << ": the call before the peer goes silent: " << synced.to_string();
    warmed_up = synced.ok();
  }
  warmed_up = test::all_ranks_agree(*comm, warmed_up);
  // ASSERTs below leave the lambda only: both ranks always reach the rendezvous at the end.
  auto wait_for_the_silent_peer = [&] {
    const auto start = std::chrono::steady_clock::now();
    LOOM_ASSERT_OK(launch(*comm, op, args_for(s, in, out.p), nullptr));
    const Status st = comm->synchronize(nullptr);
    const double elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(st.code(), StatusCode::kTimeout) << s.text() << ": " << st.to_string();
    EXPECT_GE(test::named_rank(st.message()), 0) << "the error should name the rank it waited for: " << st.to_string();
    // Whichever wait hit the deadline first (with three or more ranks, often one for a peer that
    // waits for the silent rank in turn), the message says who never entered the launch.
    EXPECT_NE(st.message().find("rank " + std::to_string(silent_rank) + " did not enter this launch"), std::string::npos)
        << "the error should say the silent rank never entered: " << st.to_string();
    EXPECT_NE(st.message().find(planner::tp_op_name(op)), std::string::npos) << "the error should name the operator: " << st.to_string();
    EXPECT_LE(elapsed_s, kTimeoutMs / 1000.0 + 1.0) << s.text() << ": timed out only after " << elapsed_s << " s";
    // The communicator is failed now ...
    EXPECT_EQ(launch(*comm, op, args_for(s, in, out.p), nullptr).code(), StatusCode::kAborted);
    // ... but the CUDA context is not: a kernel and a copy still run.
    DeviceMem probe(64 * sizeof(float));
    ASSERT_NE(probe.p, nullptr);
    ASSERT_TRUE(verify::fill_values(static_cast<float*>(probe.p), 64, 3, 0, nullptr));
    std::vector<float> host(64, 0.0f);
    TP_CUDA(cudaMemcpy(host.data(), probe.p, 64 * sizeof(float), cudaMemcpyDeviceToHost));
    TP_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(host[5], verify::element_value(3, 0, 5));
  };
  if (!warmed_up) {
    ADD_FAILURE() << "rank " << process().rank << ": setting up " << s.text() << " (or a peer could not)";
  } else if (process().rank != silent_rank) {
    wait_for_the_silent_peer();
  } else {
    // Stay alive, never launching, until the others have given up waiting.
    std::this_thread::sleep_for(std::chrono::milliseconds(kTimeoutMs + 2000));
  }
  // Rendezvous on the host; the silent rank then fails its communicator too, so neither
  // destructor waits for the other.
  (void)internal(*comm).bootstrap->barrier();
  if (process().rank == silent_rank) comm->abort("test over");
}

INSTANTIATE_TEST_SUITE_P(TpOps, TpOpsFailure, ::testing::ValuesIn(kOps),
                         [](const ::testing::TestParamInfo<OpId>& info) { return op_param_name(info.param); });

// ---- argument validation (reliability.md B3, B4) ----------------------------------------------------

class TpOpsValidation : public ::testing::TestWithParam<OpId> {};

TEST_P(TpOpsValidation, BadArgumentsAreRefusedBeforeLaunch) {
  SKIP_UNLESS_MULTI_RANK();
  Communicator& comm = shared_comm();
  const OpId op = GetParam();
  const Shape s = make_shape(op, 1024, 512, 1024, BLayout::kNK);
  const uint64_t seed = 1400;
  SymmetricMem sym(comm);
  Inputs in(s, seed);
  Output out(s, sym);
  DeviceMem plain_out(s.out_bytes() + 64);
  DeviceMem short_a(4096);  // a cudaMalloc allocation far smaller than a
  ASSERT_TRUE(agree(in.ok() && out.p && plain_out.p && short_a.p && cudaMemset(out.p, 0xFF, s.out_bytes()) == cudaSuccess &&
                    cudaDeviceSynchronize() == cudaSuccess))
      << "setting up " << s.text();
  std::vector<float> host(1024, 1.0f);
  const std::string op_name(planner::tp_op_name(op));

  struct Bad {
    std::string what;
    TpGemmArgs args;
    TpGemmOptions options;
    std::string must_mention;  // a word the message has to contain ("" : any message)
  };
  const TpGemmArgs good = args_for(s, in, out.p);
  std::vector<Bad> cases;
  auto with = [&](std::string what, auto edit, std::string mention = "") {
    Bad b{std::move(what), good, {}, std::move(mention)};
    edit(b);
    cases.push_back(std::move(b));
  };
  with("a is null", [](Bad& b) { b.args.a = nullptr; });
  with("b is null", [](Bad& b) { b.args.b = nullptr; });
  with("out is null", [](Bad& b) { b.args.out = nullptr; });
  with("a misaligned by 2 bytes", [](Bad& b) { b.args.a = static_cast<const char*>(b.args.a) + 2; });
  with("b misaligned by 8 bytes", [](Bad& b) { b.args.b = static_cast<const char*>(b.args.b) + 8; });
  with("a is host memory", [&](Bad& b) { b.args.a = host.data(); });
  with("a's allocation ends before a does", [&](Bad& b) { b.args.a = short_a.p; }, "allocation");
  with("fp32 operands", [](Bad& b) { b.args.dtype = DType::kF32; }, "fp32");
  with("M not a multiple of the ranks", [&](Bad& b) { b.args.m = s.m - 1; }, "multiple");
  with("N not a multiple of 8", [](Bad& b) { b.args.n = 500; });
  with("comm_ctas leaves no compute CTA", [&](Bad& b) { b.options.comm_ctas = comm.sm_count(); });
  if (op == OpId::kGemmAr) {
    with("gemm_ar out is not symmetric", [&](Bad& b) { b.args.out = plain_out.p; }, "symmetric");
  } else {
    with("out misaligned by 2 bytes", [&](Bad& b) { b.args.out = static_cast<char*>(plain_out.p) + 2; });
  }
  if (op == OpId::kAgGemm) {
    with("gathered_a is not symmetric", [&](Bad& b) { b.args.gathered_a = plain_out.p; }, "symmetric");
  }
  for (const Bad& b : cases) {
    const Status st = launch(comm, op, b.args, nullptr, b.options);
    EXPECT_TRUE(st.code() == StatusCode::kInvalidArgument || st.code() == StatusCode::kUnsupported)
        << op_name << ", " << b.what << ": got " << st.to_string();
    EXPECT_NE(st.message().find(op_name), std::string::npos) << op_name << ", " << b.what << ": the message should name the operator: "
                                                            << st.to_string();
    if (!b.must_mention.empty()) {
      EXPECT_NE(st.message().find(b.must_mention), std::string::npos)
          << op_name << ", " << b.what << ": the message should say '" << b.must_mention << "': " << st.to_string();
    }
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(different_words(out.p, nullptr, s.out_bytes()), 0u) << op_name << ": a refused call wrote the output";
  EXPECT_TRUE(comm.health().ok()) << comm.health().to_string();
  ASSERT_TRUE(agree(!HasFailure()));
  // Nothing ran on any rank: a valid call right after is in step everywhere and correct.
  EXPECT_EQ(run_and_check(s, seed + 1, {}, "valid call after the refused ones"), Outcome::kCorrect);
}

INSTANTIATE_TEST_SUITE_P(TpOps, TpOpsValidation, ::testing::ValuesIn(kOps),
                         [](const ::testing::TestParamInfo<OpId>& info) { return op_param_name(info.param); });

}  // namespace
}  // namespace loom
