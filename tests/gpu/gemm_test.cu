// GEMM engine on one GPU (every rank runs these on its own GPU): correctness against an fp32
// reference, every tile configuration, and each scheduler and epilogue variant (gated tiles,
// timeouts and aborts, the work queue with role changes, peer / partitioned / reduce-add
// destinations, tile and chunk signals). On failure each check prints the shape, configuration,
// relative error, the first mismatches and a map of the wrong tiles.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels/comm/signals.cuh"
#include "kernels/gemm/reference.cuh"
#include "kernels/gemm/sm90_gemm.cuh"
#include "kernels/tp/flags.h"
#include "kernels/tp/tp_scheduler.cuh"
#include "loom/gemm.h"
#include "ops/gemm/gemm_launch.h"
#include "planner/gemm_heuristic.h"
#include "runtime/cuda_check.h"
#include "tests/gpu/common/hopper.h"

namespace loom {
namespace {

namespace kg = kernels::gemm;
namespace kt = kernels::tp;
namespace ref = kernels::gemm::reference;

#define GT_CUDA(expr)                                                                               \
  do {                                                                                              \
    cudaError_t e_ = (expr);                                                                        \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);                          \
  } while (0)
#define GT_OK(expr)                                                                                 \
  do {                                                                                              \
    ::loom::Status s_ = (expr);                                                                     \
    ASSERT_TRUE(s_.ok()) << s_.to_string();                                                         \
  } while (0)


int sm_count() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n;
}

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  explicit DevBuf(size_t n) : bytes(n) {
    if (cudaMalloc(&p, n) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

struct HostMapped {
  void* p = nullptr;
  explicit HostMapped(size_t n) {
    if (cudaHostAlloc(&p, n, cudaHostAllocMapped) == cudaSuccess) std::memset(p, 0, n);
  }
  ~HostMapped() {
    if (p) cudaFreeHost(p);
  }
};

// Wait words for launches that can fail: error record and host abort in host-mapped memory.
struct WaitSetup {
  HostMapped error{sizeof(ErrorRecord)};
  HostMapped host_abort{sizeof(uint32_t)};
  DevBuf device_abort{sizeof(uint32_t)};
  WaitParams params(uint64_t timeout_ns) {
    cudaMemset(device_abort.p, 0, sizeof(uint32_t));
    std::memset(error.p, 0, sizeof(ErrorRecord));
    *static_cast<volatile uint32_t*>(host_abort.p) = 0;
    return WaitParams{timeout_ns, static_cast<const volatile uint32_t*>(host_abort.p), device_abort.as<uint32_t>(),
                      static_cast<ErrorRecord*>(error.p)};
  }
  const ErrorRecord& record() const { return *static_cast<const ErrorRecord*>(error.p); }
};

float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float f16_to_float(uint16_t h) {
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}

std::vector<float> to_host_f32(const void* dev, DType t, int64_t rows, int64_t cols, int64_t ld) {
  const size_t es = dtype_size(t);
  std::vector<uint8_t> raw(static_cast<size_t>(rows) * ld * es);
  cudaMemcpy(raw.data(), dev, raw.size(), cudaMemcpyDeviceToHost);
  std::vector<float> out(static_cast<size_t>(rows) * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * ld + c);
      float v;
      if (t == DType::kF32) std::memcpy(&v, raw.data() + 4 * i, 4);
      else {
        uint16_t h;
        std::memcpy(&h, raw.data() + 2 * i, 2);
        v = t == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
      }
      out[static_cast<size_t>(r * cols + c)] = v;
    }
  }
  return out;
}

void fill(void* p, DType t, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, float scale = 1.0f) {
  ref::fill_uniform<<<256, 256>>>(p, static_cast<int>(t), rows, cols, ld, seed, scale);
}

// fp32 reference of the whole [M, N] product.
std::vector<float> reference(const GemmArgs& a) {
  const planner::GemmLeadingDims ld = planner::resolve_leading_dims(a);
  DevBuf c(static_cast<size_t>(a.m) * a.n * 4);
  dim3 grid(static_cast<unsigned>((a.n + 31) / 32), static_cast<unsigned>((a.m + 31) / 32));
  const bool kn = a.b_layout == BLayout::kKN;
  if (a.in_dtype == DType::kBF16) {
    ref::gemm_fp32<__nv_bfloat16><<<grid, 256>>>(static_cast<const __nv_bfloat16*>(a.a),
                                                  static_cast<const __nv_bfloat16*>(a.b), c.as<float>(), nullptr,
                                                  static_cast<int>(a.m), static_cast<int>(a.n), static_cast<int>(a.k),
                                                  ld.lda, ld.ldb, kn);
  } else {
    ref::gemm_fp32<__half><<<grid, 256>>>(static_cast<const __half*>(a.a), static_cast<const __half*>(a.b), c.as<float>(),
                                          nullptr, static_cast<int>(a.m), static_cast<int>(a.n), static_cast<int>(a.k),
                                          ld.lda, ld.ldb, kn);
  }
  std::vector<float> out(static_cast<size_t>(a.m) * a.n);
  cudaMemcpy(out.data(), c.p, out.size() * 4, cudaMemcpyDeviceToHost);
  return out;
}

// Documented tolerances: ||out - ref|| / ||ref|| below rel_tol, and no element further than
// elem_tol * (|ref| + rms(ref)) from the reference. Inputs are exact in both computations, so
// the differences are the output rounding (bf16: 2^-9 relative, fp16: 2^-11) and fp32
// summation order.
struct Tolerance {
  double rel_tol;
  double elem_tol;
};
Tolerance tolerance_for(DType out) {
  switch (out) {
    case DType::kBF16: return {8e-3, 1.0 / 64};
    case DType::kF16: return {2e-3, 1.0 / 256};
    case DType::kF32: return {1e-4, 2e-4};
  }
  return {0, 0};
}

// Compares got [rows, cols] with want; on failure the returned string holds the diagnostics.
struct Comparison {
  bool ok = true;
  double rel_err = 0;
  int64_t nan = 0, bad = 0;
  std::string report;
};

Comparison compare(const std::vector<float>& got, const std::vector<float>& want, int64_t rows, int64_t cols,
                   DType out, int tile_m, int tile_n, const std::string& what) {
  Comparison c;
  const Tolerance tol = tolerance_for(out);
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) den += static_cast<double>(want[i]) * want[i];
  const double rms = std::sqrt(den / std::max<size_t>(want.size(), 1));
  const int64_t tr = (rows + tile_m - 1) / tile_m, tc = (cols + tile_n - 1) / tile_n;
  std::vector<char> map(static_cast<size_t>(tr * tc), '.');
  std::string first;
  int shown = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t col = 0; col < cols; ++col) {
      const size_t i = static_cast<size_t>(r * cols + col);
      const double g = got[i], w = want[i];
      const size_t t = static_cast<size_t>((r / tile_m) * tc + col / tile_n);
      if (std::isnan(g)) {
        ++c.nan;
        map[t] = 'N';
      } else {
        num += (g - w) * (g - w);
        if (std::fabs(g - w) > tol.elem_tol * (std::fabs(w) + rms)) {
          ++c.bad;
          if (map[t] == '.') map[t] = 'X';
        } else {
          continue;
        }
      }
      if (shown < 8) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "    (row %lld, col %lld): got %.6g want %.6g\n", static_cast<long long>(r),
                      static_cast<long long>(col), g, w);
        first += buf;
        ++shown;
      }
    }
  }
  c.rel_err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  c.ok = c.nan == 0 && c.bad == 0 && c.rel_err <= tol.rel_tol && den > 0;
  if (!c.ok) {
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "%s: rel_err %.3g (tolerance %.1g), %lld NaN, %lld elements off, ||ref|| %.3g; first mismatches:\n",
                  what.c_str(), c.rel_err, tol.rel_tol, static_cast<long long>(c.nan), static_cast<long long>(c.bad),
                  std::sqrt(den));
    c.report = buf + first;
    c.report += "  tile map (" + std::to_string(tile_m) + "x" + std::to_string(tile_n) +
                " tiles; . ok, X wrong, N unwritten/NaN):\n";
    for (int64_t i = 0; i < std::min<int64_t>(tr, 64); ++i) {
      c.report += "    ";
      for (int64_t j = 0; j < std::min<int64_t>(tc, 100); ++j) c.report += map[static_cast<size_t>(i * tc + j)];
      c.report += "\n";
    }
  }
  return c;
}

std::string describe(const GemmArgs& a, GemmTile tile, const char* extra = "") {
  char buf[256];
  std::snprintf(buf, sizeof buf, "M=%lld N=%lld K=%lld in=%s out=%s B=%s tile=%s%s", static_cast<long long>(a.m),
                static_cast<long long>(a.n), static_cast<long long>(a.k), std::string(dtype_name(a.in_dtype)).c_str(),
                std::string(dtype_name(a.out_dtype)).c_str(), std::string(b_layout_name(a.b_layout)).c_str(),
                std::string(gemm_tile_name(tile)).c_str(), extra);
  return buf;
}

// Owns A, B (random, never zero) and D (NaN) for one problem.
struct Problem {
  GemmArgs args;
  DevBuf a, b, d;
  Problem(int64_t m, int64_t n, int64_t k, DType in, DType out, BLayout layout, uint64_t seed)
      : a(static_cast<size_t>(std::max<int64_t>(m, 1)) * k * 2),
        b(static_cast<size_t>(n) * k * 2),
        d(static_cast<size_t>(std::max<int64_t>(m, 1)) * n * dtype_size(out)) {
    args.a = a.p;
    args.b = b.p;
    args.d = d.p;
    args.m = m;
    args.n = n;
    args.k = k;
    args.in_dtype = in;
    args.out_dtype = out;
    args.b_layout = layout;
    fill(a.p, in, m, k, k, seed * 2 + 1);
    if (layout == BLayout::kKN) fill(b.p, in, k, n, n, seed * 2 + 2);
    else fill(b.p, in, n, k, k, seed * 2 + 2);
    cudaMemset(d.p, 0xFF, d.bytes);  // NaN in every output type
  }
};

// Runs loom::gemm on a fresh problem and checks it against the reference.
void run_and_check(int64_t m, int64_t n, int64_t k, DType in, DType out, BLayout layout, GemmOptions options,
                   uint64_t seed) {
  Problem p(m, n, k, in, out, layout, seed);
  ASSERT_TRUE(p.a.p && p.b.p && p.d.p) << "allocation failed";
  auto plan = ops::plan_gemm_launch(p.args, options);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  GT_OK(gemm(p.args, nullptr, options));
  GT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> want = reference(p.args);
  const std::vector<float> got = to_host_f32(p.d.p, out, m, n, n);
  const GemmTileInfo info = gemm_tile_info(plan->tile);
  const std::string what = describe(p.args, plan->tile, (" ctas=" + std::to_string(plan->num_ctas)).c_str());
  const Comparison c = compare(got, want, m, n, out, info.block_m, info.block_n, what);
  EXPECT_TRUE(c.ok) << c.report;
}

// ---- loom::gemm: shapes x layouts x dtypes ---------------------------------------------------

class GemmShapes : public ::testing::TestWithParam<int64_t> {};

TEST_P(GemmShapes, AllLayoutsAndDtypesMatchReference) {
  REQUIRE_HOPPER();
  const int64_t m = GetParam();
  uint64_t seed = 100 + static_cast<uint64_t>(m);
  for (BLayout layout : {BLayout::kKN, BLayout::kNK}) {
    for (DType in : {DType::kBF16, DType::kF16}) {
      for (DType out : {DType::kBF16, DType::kF16, DType::kF32}) {
        // N and K are not multiples of any tile: the tails go through TMA bounds.
        run_and_check(m, 264, 200, in, out, layout, {}, ++seed);
      }
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Sm90Gemm, GemmShapes, ::testing::Values(1, 127, 128, 129, 1000, 4160, 16384),
                         [](const ::testing::TestParamInfo<int64_t>& i) {
                           std::string name = "M";
                           name += std::to_string(i.param);
                           return name;
                         });

// Every configuration, forced, on a shape with many k-blocks (the stage ring wraps several times)
// and tails in every dimension; once with the planner's grid and once with 3 CTAs (each CTA
// walks many tiles, the tile ring wraps).
TEST(Sm90Gemm, EveryTileConfiguration) {
  REQUIRE_HOPPER();
  uint64_t seed = 7000;
  for (GemmTile tile : {GemmTile::k128x256, GemmTile::k128x128, GemmTile::k128x64, GemmTile::k64x128}) {
    int variant = 0;
    for (BLayout layout : {BLayout::kKN, BLayout::kNK}) {
      for (DType in : {DType::kBF16, DType::kF16}) {
        const DType out = variant % 3 == 0 ? DType::kBF16 : (variant % 3 == 1 ? DType::kF32 : DType::kF16);
        ++variant;
        GemmOptions o;
        o.tile = tile;
        run_and_check(1000, 1032, 1096, in, out, layout, o, ++seed);
        o.num_ctas = 3;
        o.group_m = 2;
        run_and_check(520, 776, 264, in, out, layout, o, ++seed);
      }
    }
  }
}

// gemm_plan: the heuristic's tile for kAuto, a forced tile and grid as asked, the tile count, and
// the same refusals as gemm_can_implement.
TEST(Sm90Gemm, PlanResolvesTheTileAndGrid) {
  REQUIRE_HOPPER();
  GemmArgs a;
  a.a = a.b = reinterpret_cast<const void*>(uintptr_t{1} << 20);  // never dereferenced
  a.d = reinterpret_cast<void*>(uintptr_t{1} << 40);
  a.m = 4096;
  a.n = 14336;
  a.k = 8192;
  a.b_layout = BLayout::kNK;
  const Result<GemmPlanInfo> plan = gemm_plan(a);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->tile, choose_gemm_tile(a.m, a.n, a.k, sm_count()));
  EXPECT_EQ(plan->tile_info.block_m, gemm_tile_info(plan->tile).block_m);
  const int64_t bm = plan->tile_info.block_m, bn = plan->tile_info.block_n;
  EXPECT_EQ(plan->tiles, ((a.m + bm - 1) / bm) * ((a.n + bn - 1) / bn));
  EXPECT_EQ(plan->grid, static_cast<int>(std::min<int64_t>(plan->tiles, sm_count())));
  EXPECT_GE(plan->group_m, 1);
  EXPECT_EQ(gemm_workspace_bytes(a), 0u);
  GemmOptions forced;
  forced.tile = GemmTile::k64x128;
  forced.num_ctas = 7;
  const Result<GemmPlanInfo> small = gemm_plan(a, forced);
  ASSERT_TRUE(small.ok()) << small.status().to_string();
  EXPECT_EQ(small->tile, GemmTile::k64x128);
  EXPECT_EQ(small->grid, 7);
  GemmArgs bad = a;
  bad.k = 100;  // not a multiple of 8
  EXPECT_EQ(gemm_plan(bad).status().code(), gemm_can_implement(bad).code());
  EXPECT_EQ(gemm_plan(bad).status().code(), StatusCode::kUnsupported);
}

// GemmOptions::timeline: every tile of the grid gets one plausible record (claimed, mainloop end,
// epilogue end in order on one SM, a CTA of the launch, plain kind, no fold), records past the
// grid stay untouched, and the product is still right.
TEST(Sm90Gemm, TimelineRecordsEveryTileOnce) {
  REQUIRE_HOPPER();
  uint64_t seed = 7600;
  for (GemmTile tile : {GemmTile::k128x256, GemmTile::k64x128}) {
    GemmOptions o;
    o.tile = tile;
    o.num_ctas = 5;  // several tiles per CTA
    const int64_t m = 520, n = 776, k = 264;
    Problem p(m, n, k, DType::kBF16, DType::kBF16, BLayout::kNK, ++seed);
    const int64_t capacity = tile_timeline_capacity(m, n);
    DevBuf records(static_cast<size_t>(capacity) * sizeof(TileTimelineRecord));
    ASSERT_TRUE(p.a.p && p.b.p && p.d.p && records.p) << "allocation failed";
    GT_CUDA(cudaMemset(records.p, 0, records.bytes));
    o.timeline = static_cast<TileTimelineRecord*>(records.p);
    auto plan = ops::plan_gemm_launch(p.args, o);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    GT_OK(gemm(p.args, nullptr, o));
    GT_CUDA(cudaDeviceSynchronize());
    std::vector<TileTimelineRecord> r(static_cast<size_t>(capacity));
    GT_CUDA(cudaMemcpy(r.data(), records.p, records.bytes, cudaMemcpyDeviceToHost));
    const std::string what = describe(p.args, plan->tile, " timeline");
    const int64_t tiles = plan->m_blocks * plan->n_blocks;
    for (int64_t t = 0; t < capacity; ++t) {
      const TileTimelineRecord& x = r[static_cast<size_t>(t)];
      if (t >= tiles) {
        ASSERT_EQ(x.claimed_ns, 0u) << what << ": record " << t << " lies past the " << tiles << "-tile grid";
        continue;
      }
      ASSERT_NE(x.claimed_ns, 0u) << what << ": tile " << t << " has no record";
      EXPECT_GE(x.stored_ns, x.claimed_ns) << what << " tile " << t;
      EXPECT_LE(x.claimed_clock, x.mainloop_clock) << what << " tile " << t;
      EXPECT_LE(x.mainloop_clock, x.stored_clock) << what << " tile " << t;
      EXPECT_LT(x.cta, static_cast<uint32_t>(plan->num_ctas)) << what << " tile " << t;
      EXPECT_EQ(x.kind, static_cast<uint32_t>(kg::WorkKind::kTile)) << what << " tile " << t;
      EXPECT_EQ(x.fold_cycles, 0u) << what << " tile " << t;
    }
    const GemmTileInfo info = gemm_tile_info(plan->tile);
    const Comparison c = compare(to_host_f32(p.d.p, DType::kBF16, m, n, n), reference(p.args), m, n, DType::kBF16,
                                 info.block_m, info.block_n, what);
    EXPECT_TRUE(c.ok) << c.report;
  }
}

TEST(Sm90Gemm, LeadingDimensionsLargerThanRows) {
  REQUIRE_HOPPER();
  const int64_t m = 300, n = 392, k = 456, lda = 520, ldb = 464, ldd = 400;
  DevBuf a(m * lda * 2), b(n * ldb * 2), d(m * ldd * 4);
  fill(a.p, DType::kBF16, m, k, lda, 11);
  fill(b.p, DType::kBF16, n, k, ldb, 12);
  cudaMemset(d.p, 0xFF, d.bytes);
  GemmArgs args;
  args.a = a.p;
  args.b = b.p;
  args.d = d.p;
  args.m = m;
  args.n = n;
  args.k = k;
  args.lda = lda;
  args.ldb = ldb;
  args.ldd = ldd;
  args.out_dtype = DType::kF32;
  args.b_layout = BLayout::kNK;
  GT_OK(gemm(args, nullptr));
  GT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> want = reference(args);
  const std::vector<float> got = to_host_f32(d.p, DType::kF32, m, n, ldd);
  const Comparison c = compare(got, want, m, n, DType::kF32, 128, 128, describe(args, GemmTile::kAuto, " padded"));
  EXPECT_TRUE(c.ok) << c.report;
  // The padding columns of D stay untouched (NaN).
  std::vector<float> raw(static_cast<size_t>(m * ldd));
  cudaMemcpy(raw.data(), d.p, raw.size() * 4, cudaMemcpyDeviceToHost);
  int64_t touched = 0;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t col = n; col < ldd; ++col) touched += !std::isnan(raw[static_cast<size_t>(r * ldd + col)]);
  EXPECT_EQ(touched, 0) << "the epilogue wrote past N";
}

TEST(Sm90Gemm, InvalidArgumentsLaunchNothing) {
  REQUIRE_HOPPER();
  Problem p(64, 64, 64, DType::kBF16, DType::kBF16, BLayout::kKN, 3);
  GemmArgs a = p.args;
  a.n = 60;
  EXPECT_EQ(gemm(a, nullptr).code(), StatusCode::kUnsupported);
  a = p.args;
  a.d = static_cast<char*>(p.d.p) + 2;
  EXPECT_EQ(gemm(a, nullptr).code(), StatusCode::kInvalidArgument);
  GT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> got = to_host_f32(p.d.p, DType::kBF16, 64, 64, 64);
  for (float v : got) ASSERT_TRUE(std::isnan(v)) << "a rejected call wrote output";
}

// ---- launch_gemm helpers -----------------------------------------------------------------------

struct LaunchCase {
  Problem p;
  ops::GemmLaunch l;
  WaitSetup wait;
  LaunchCase(int64_t m, int64_t n, int64_t k, DType out, GemmTile tile, uint64_t seed, uint64_t timeout_ns = 10'000'000'000ull)
      : p(m, n, k, DType::kBF16, out, BLayout::kNK, seed) {
    l.args = p.args;
    l.options.tile = tile;
    l.wait = wait.params(timeout_ns);
  }
  void check_output(const void* d, const std::vector<float>& want, const char* what) const {
    const std::vector<float> got = to_host_f32(d, p.args.out_dtype, p.args.m, p.args.n, p.args.n);
    const GemmTileInfo info = gemm_tile_info(l.options.tile);
    const Comparison c = compare(got, want, p.args.m, p.args.n, p.args.out_dtype, info.block_m, info.block_n,
                                 describe(p.args, l.options.tile, what));
    EXPECT_TRUE(c.ok) << c.report;
  }
  void expect_no_device_error() const {
    const ErrorRecord& e = wait.record();
    EXPECT_EQ(e.code, 0u) << "device error: code " << e.code << " flag_kind " << e.flag_kind << " index 0x" << std::hex
                          << e.flag_index << std::dec << " cta " << e.cta << " waited_ns " << e.waited_ns;
  }
  // Kernel parameters of a hand-launched role over this case: its tensor maps for `tile` (D
  // dense, in its output type) and its shape; scheduler and epilogue fields are the caller's.
  Status kernel_params(GemmTile tile, kg::GemmKernelParams& k) const {
    k = kg::GemmKernelParams{};
    LOOM_TRY(ops::encode_gemm_operand_maps(p.args, tile, &k.a, &k.b));
    LOOM_TRY(ops::encode_gemm_output_map(p.d.p, p.args.m, p.args.n, p.args.n, p.args.out_dtype, &k.dst[0]));
    k.m = static_cast<uint32_t>(p.args.m);
    k.n = static_cast<uint32_t>(p.args.n);
    k.k = static_cast<uint32_t>(p.args.k);
    k.epi.out_dtype = static_cast<uint32_t>(p.args.out_dtype);
    return Status();
  }
};

// ---- epilogues ---------------------------------------------------------------------------------

TEST(Sm90GemmEpilogue, StoreToAnotherBuffer) {
  REQUIRE_HOPPER();
  LaunchCase c(777, 392, 328, DType::kBF16, GemmTile::k128x128, 21);
  DevBuf peer(c.p.d.bytes);
  cudaMemset(peer.p, 0xFF, peer.bytes);
  c.l.dst[0] = peer.p;  // "peer": any global address the GPU can write (another GPU's, over NVLink)
  GT_OK(ops::launch_gemm(c.l, nullptr));
  GT_CUDA(cudaDeviceSynchronize());
  c.expect_no_device_error();
  c.check_output(peer.p, reference(c.p.args), " dst=peer");
  const std::vector<float> local = to_host_f32(c.p.d.p, DType::kBF16, 777, 392, 392);
  EXPECT_TRUE(std::all_of(local.begin(), local.end(), [](float v) { return std::isnan(v); }))
      << "D was written although the destination was elsewhere";
}

// Rows split over three destinations (rows_per_dst a multiple of the 16-row staging box but not
// of BLOCK_M, and a short last part); a split that would cut a box in two is refused.
TEST(Sm90GemmEpilogue, RowPartitionedDestinations) {
  REQUIRE_HOPPER();
  const int64_t m = 1000, n = 264, rows_per = 400;
  LaunchCase c(m, n, 200, DType::kF16, GemmTile::k128x128, 22);
  DevBuf parts[3] = {DevBuf(rows_per * n * 2), DevBuf(rows_per * n * 2), DevBuf((m - 2 * rows_per) * n * 2)};
  for (int i = 0; i < 3; ++i) {
    cudaMemset(parts[i].p, 0xFF, parts[i].bytes);
    c.l.dst[i] = parts[i].p;
  }
  c.l.epi.num_dst = 3;
  c.l.epi.rows_per_dst = rows_per;
  GT_OK(ops::launch_gemm(c.l, nullptr));
  GT_CUDA(cudaDeviceSynchronize());
  c.expect_no_device_error();
  const std::vector<float> want = reference(c.p.args);
  std::vector<float> got;
  for (int i = 0; i < 3; ++i) {
    const int64_t rows = i < 2 ? rows_per : m - 2 * rows_per;
    const std::vector<float> part = to_host_f32(parts[i].p, DType::kF16, rows, n, n);
    got.insert(got.end(), part.begin(), part.end());
  }
  const Comparison cmp = compare(got, want, m, n, DType::kF16, 128, 128, describe(c.p.args, GemmTile::k128x128, " 3 dsts"));
  EXPECT_TRUE(cmp.ok) << cmp.report;
  c.l.epi.rows_per_dst = 392;
  EXPECT_EQ(ops::launch_gemm(c.l, nullptr).code(), StatusCode::kInvalidArgument);
}

TEST(Sm90GemmEpilogue, ReduceAddEveryOutputType) {
  REQUIRE_HOPPER();
  uint64_t seed = 40;
  for (DType out : {DType::kBF16, DType::kF16, DType::kF32}) {
    LaunchCase c(513, 520, 264, out, GemmTile::k128x256, ++seed);
    fill(c.p.d.p, out, 513, 520, 520, 999, 4.0f);  // what the peer already holds
    const std::vector<float> before = to_host_f32(c.p.d.p, out, 513, 520, 520);
    c.l.epi.op = static_cast<uint32_t>(kg::EpilogueOp::kReduceAdd);
    GT_OK(ops::launch_gemm(c.l, nullptr));
    GT_CUDA(cudaDeviceSynchronize());
    c.expect_no_device_error();
    std::vector<float> want = reference(c.p.args);
    for (size_t i = 0; i < want.size(); ++i) want[i] += before[i];
    c.check_output(c.p.d.p, want, " reduce-add");
  }
}

// Observer for signals: waits (bounded) for each flag in turn and counts NaN in the region the
// flag covers; a flag seen before its data is visible shows up as NaN.
__global__ void observe_flags(const uint64_t* flags, int count, uint64_t epoch, const __nv_bfloat16* d, int n,
                              int rows_per_flag, int cols_per_flag, int flags_per_row, int m, uint64_t timeout_ns,
                              int* nan_seen, int* missed) {
  __shared__ int go;
  const uint64_t deadline = kernels::global_timer_ns() + timeout_ns;
  for (int f = 0; f < count; ++f) {
    if (threadIdx.x == 0) {
      go = 1;
      while (static_cast<int64_t>(kernels::flag_load_acquire(flags + f) - epoch) < 0) {
        if (kernels::global_timer_ns() > deadline) {
          go = 0;
          atomicAdd(missed, 1);
          break;
        }
      }
    }
    __syncthreads();
    if (go) {
      const int r0 = (f / flags_per_row) * rows_per_flag, c0 = (f % flags_per_row) * cols_per_flag;
      int local = 0;
      for (int i = threadIdx.x; i < rows_per_flag * cols_per_flag; i += blockDim.x) {
        const int r = r0 + i / cols_per_flag, col = c0 + i % cols_per_flag;
        if (r < m && col < n) {
          const unsigned short bits =
              *reinterpret_cast<const volatile unsigned short*>(reinterpret_cast<const unsigned short*>(d) +
                                                                static_cast<int64_t>(r) * n + col);
          local += (bits & 0x7F80) == 0x7F80 && (bits & 0x7F) != 0;
        }
      }
      if (local) atomicAdd(nan_seen, local);
    }
    __syncthreads();
  }
}

void run_signal_case(uint32_t chunk_m_blocks) {
  const int64_t m = 1536, n = 1024, k = 1024;
  LaunchCase c(m, n, k, DType::kBF16, GemmTile::k128x128, 50 + chunk_m_blocks);
  const int64_t m_blocks = m / 128, n_blocks = n / 128;
  const int64_t count = chunk_m_blocks == 0 ? m_blocks * n_blocks : (m_blocks + chunk_m_blocks - 1) / chunk_m_blocks;
  DevBuf flags(count * 8), counters(count * 8), nan_seen(8);
  cudaMemset(flags.p, 0, flags.bytes);
  cudaMemset(counters.p, 0, counters.bytes);
  c.l.options.num_ctas = std::max(1, std::min(sm_count() - 4, 16));  // leave SMs for the observer
  c.l.epi.flags[0] = flags.as<uint64_t>();
  c.l.epi.chunk_m_blocks = chunk_m_blocks;
  c.l.epi.chunk_counters = counters.as<uint64_t>();
  cudaStream_t s1, s2;
  GT_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  GT_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  for (uint64_t epoch = 1; epoch <= 2; ++epoch) {  // the second launch checks epoch counting
    cudaMemset(c.p.d.p, 0xFF, c.p.d.bytes);
    cudaMemset(nan_seen.p, 0, 8);
    GT_CUDA(cudaDeviceSynchronize());
    c.l.epi.epoch = epoch;
    GT_OK(ops::launch_gemm(c.l, s1));
    const int rows_per_flag = chunk_m_blocks == 0 ? 128 : 128 * static_cast<int>(chunk_m_blocks);
    const int cols_per_flag = chunk_m_blocks == 0 ? 128 : static_cast<int>(n);
    const int flags_per_row = chunk_m_blocks == 0 ? static_cast<int>(n_blocks) : 1;
    observe_flags<<<1, 256, 0, s2>>>(flags.as<uint64_t>(), static_cast<int>(count), epoch,
                                     static_cast<const __nv_bfloat16*>(c.p.d.p), static_cast<int>(n), rows_per_flag,
                                     cols_per_flag, flags_per_row, static_cast<int>(m), 10'000'000'000ull,
                                     nan_seen.as<int>(), nan_seen.as<int>() + 1);
    GT_CUDA(cudaStreamSynchronize(s1));
    GT_CUDA(cudaStreamSynchronize(s2));
    c.expect_no_device_error();
    int seen[2];
    cudaMemcpy(seen, nan_seen.p, 8, cudaMemcpyDeviceToHost);
    EXPECT_EQ(seen[1], 0) << "observer timed out waiting for " << seen[1] << " flags (epoch " << epoch << ")";
    EXPECT_EQ(seen[0], 0) << seen[0] << " NaN read after their flag was set: the signal came before the data";
    std::vector<uint64_t> f(static_cast<size_t>(count)), cnt(static_cast<size_t>(count));
    cudaMemcpy(f.data(), flags.p, flags.bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(cnt.data(), counters.p, counters.bytes, cudaMemcpyDeviceToHost);
    for (int64_t i = 0; i < count; ++i) {
      EXPECT_EQ(f[static_cast<size_t>(i)], epoch) << "flag " << i;
      if (chunk_m_blocks) {
        const int64_t rows = std::min<int64_t>(m_blocks, (i + 1) * chunk_m_blocks) - i * chunk_m_blocks;
        EXPECT_EQ(cnt[static_cast<size_t>(i)], epoch * rows * n_blocks) << "chunk counter " << i;
      }
    }
    c.check_output(c.p.d.p, reference(c.p.args), chunk_m_blocks ? " chunk signals" : " tile signals");
  }
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
}

TEST(Sm90GemmEpilogue, SignalEachTileAfterItsData) {
  REQUIRE_HOPPER();
  run_signal_case(0);
}
TEST(Sm90GemmEpilogue, SignalEachChunkAfterAllItsTiles) {
  REQUIRE_HOPPER();
  run_signal_case(5);  // 12 tile rows: chunks of 5, 5 and 2 tile rows
}

// ---- schedulers --------------------------------------------------------------------------------

// Sets flags late, in a chosen order, one every `delay_ns`, writing the time just before each store.
__global__ void set_flags_late(uint64_t* flags, const int* order, int count, uint64_t epoch, uint64_t delay_ns,
                               uint64_t* set_time) {
  uint64_t t = kernels::global_timer_ns();
  for (int i = 0; i < count; ++i) {
    const uint64_t until = t + delay_ns;
    while (kernels::global_timer_ns() < until) {
    }
    t = kernels::global_timer_ns();
    set_time[order[i]] = t;
    kernels::flag_store_release(flags + order[i], epoch);
  }
}

// The fused kernels' scheduling policy (kernels/tp/tp_scheduler.cuh: gates, rank-banded order)
// on the GEMM engine: launch_gemm's parameters, run with TpTiles instead of the default tiles.
using TpCfg = kg::Tile128x128;

__global__ void __launch_bounds__(TpCfg::kThreads, 1)
    tp_scheduled_kernel(const __grid_constant__ kg::GemmKernelParams p, const __grid_constant__ kt::TpSchedulerParams tp) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Tiles = kt::TpTiles<TpCfg::kBlockM>;
  using Role = kg::ComputeRole<TpCfg, true, false, kg::TileScheduler<Tiles>, kg::TileEpilogue<TpCfg::kBlockM>>;
  const kernels::WaitContext ctx = kernels::WaitContext::start(p.wait, OpId::kGemm, p.sched.epoch);
  Role::init(smem);
  kg::TileScheduler<Tiles> sched(p.sched, Tiles(tp, p.sched.epoch));
  kg::TileEpilogue<TpCfg::kBlockM> epi(p.epi, p.dst);
  const kg::GemmOperands ops{&p.a, &p.b, p.m, p.n, p.k, nullptr, 0, 0, p.timeline};
  (void)Role::run(smem, ops, sched, epi, blockIdx.x, gridDim.x, ctx);
}

// Launches `l` (bf16 A, B [N, K], the 128x128 tile: LaunchCase's) with the TP scheduling `tp`.
Status launch_tp_scheduled(const ops::GemmLaunch& l, const kt::TpSchedulerParams& tp, cudaStream_t stream) {
  if (l.args.in_dtype != DType::kBF16 || l.args.b_layout != BLayout::kNK || l.options.tile != GemmTile::k128x128) {
    return Status::internal("tp_scheduled_kernel is built for bf16, B [N, K] and the 128x128 tile only");
  }
  kg::GemmKernelParams p;
  ops::GemmLaunchPlan plan;
  LOOM_TRY(ops::gemm_kernel_params(l, &p, &plan));
  LOOM_CUDA_TRY(cudaFuncSetAttribute(tp_scheduled_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(TpCfg::kSmemBytes)));
  tp_scheduled_kernel<<<plan.num_ctas, TpCfg::kThreads, TpCfg::kSmemBytes, stream>>>(p, tp);
  LOOM_CUDA_TRY(cudaGetLastError());
  return Status{};
}

// Gated order: local rows first, every other tile only after its flag. Tiles record when their
// loads were released (trace); the setter records when each flag was set.
TEST(Sm90GemmScheduler, GatedTilesNeverStartBeforeTheirFlag) {
  REQUIRE_HOPPER();
  const int64_t m = 1024, n = 512, k = 256;
  const uint64_t epoch = 5;
  LaunchCase c(m, n, k, DType::kBF16, GemmTile::k128x128, 61);
  const int flags_count = 16;  // 64 rows per flag: two flags per tile row
  DevBuf flags(flags_count * 8), set_time(flags_count * 8), trace(64 * 8), order(16 * 4);
  std::vector<uint64_t> stale(flags_count, epoch - 1);  // a stale epoch must not pass
  cudaMemcpy(flags.p, stale.data(), flags.bytes, cudaMemcpyHostToDevice);
  cudaMemset(set_time.p, 0, set_time.bytes);
  cudaMemset(trace.p, 0, trace.bytes);
  // Sources: 4 ranks of 256 rows; we are rank 1 (rows 256..511 = flags 4..7, no wait).
  const std::vector<int> late = {15, 14, 13, 12, 0, 1, 2, 3, 11, 10, 9, 8};
  cudaMemcpy(order.p, late.data(), late.size() * 4, cudaMemcpyHostToDevice);
  c.l.options.num_ctas = 6;
  kt::TpSchedulerParams gate;
  gate.row_flags = flags.as<uint64_t>();
  gate.rows_per_flag = 64;
  gate.rows_per_source = 256;
  gate.ungated_begin = 256;
  gate.ungated_end = 512;
  c.l.sched.m_block_start = 2;
  c.l.sched.epoch = epoch;
  c.l.sched.trace = trace.as<uint64_t>();
  cudaStream_t s1, s2;
  GT_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  GT_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  // Load the setter's module now: with lazy loading (the CUDA default) its first launch would
  // wait for the running GEMM, which waits for the setter.
  set_flags_late<<<1, 1, 0, s2>>>(flags.as<uint64_t>(), order.as<int>(), 0, epoch, 0, set_time.as<uint64_t>());
  GT_CUDA(cudaDeviceSynchronize());
  GT_OK(launch_tp_scheduled(c.l, gate, s1));
  set_flags_late<<<1, 1, 0, s2>>>(flags.as<uint64_t>(), order.as<int>(), static_cast<int>(late.size()), epoch,
                                  2'000'000ull, set_time.as<uint64_t>());
  GT_CUDA(cudaStreamSynchronize(s1));
  GT_CUDA(cudaStreamSynchronize(s2));
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
  c.expect_no_device_error();
  std::vector<uint64_t> st(flags_count), tr(64);
  cudaMemcpy(st.data(), set_time.p, st.size() * 8, cudaMemcpyDeviceToHost);
  cudaMemcpy(tr.data(), trace.p, tr.size() * 8, cudaMemcpyDeviceToHost);
  uint64_t first_set = ~uint64_t{0};  // when the first remote flag was set
  for (int f : late) first_set = std::min(first_set, st[static_cast<size_t>(f)]);
  std::string timeline;
  int early = 0;
  for (int mb = 0; mb < 8; ++mb) {
    for (int nb = 0; nb < 4; ++nb) {
      const uint64_t t = tr[static_cast<size_t>(mb * 4 + nb)];
      EXPECT_NE(t, 0u) << "tile (" << mb << ", " << nb << ") never started";
      if (mb == 2 || mb == 3) {
        // Local rows: ready at once, long before the first remote flag.
        if (t >= first_set) {
          ++early;
          timeline += "  local tile (" + std::to_string(mb) + "," + std::to_string(nb) + ") started " +
                      std::to_string(static_cast<int64_t>(t - first_set)) + " ns after the first remote flag\n";
        }
        continue;
      }
      const uint64_t need = std::max(st[static_cast<size_t>(2 * mb)], st[static_cast<size_t>(2 * mb + 1)]);
      if (t < need) {
        ++early;
        timeline += "  tile (" + std::to_string(mb) + "," + std::to_string(nb) + ") started " +
                    std::to_string(static_cast<int64_t>(need - t)) + " ns before its flag\n";
      }
    }
  }
  EXPECT_EQ(early, 0) << "gating violated (or local tiles waited):\n" << timeline;
  c.check_output(c.p.d.p, reference(c.p.args), " gated");
}

// A flag that never comes: the launch ends by itself (no hang, no trap) with a timeout record
// naming the flag and the source rank, and the GPU keeps working.
TEST(Sm90GemmScheduler, MissingFlagTimesOutCleanly) {
  REQUIRE_HOPPER();
  const uint64_t epoch = 9;
  LaunchCase c(512, 256, 128, DType::kBF16, GemmTile::k128x128, 71, /*timeout_ns=*/300'000'000ull);
  DevBuf flags(4 * 8);
  std::vector<uint64_t> f = {epoch, epoch, epoch - 1, epoch};  // flag 2 (rows 256..383) never set
  cudaMemcpy(flags.p, f.data(), 32, cudaMemcpyHostToDevice);
  kt::TpSchedulerParams gate;
  gate.row_flags = flags.as<uint64_t>();
  gate.rows_per_flag = 128;
  gate.rows_per_source = 256;
  c.l.sched.epoch = epoch;
  c.l.options.num_ctas = 4;
  const auto t0 = std::chrono::steady_clock::now();
  GT_OK(launch_tp_scheduled(c.l, gate, nullptr));
  GT_CUDA(cudaDeviceSynchronize());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 5.0) << "the launch took too long to give up";
  const ErrorRecord& e = c.wait.record();
  EXPECT_EQ(e.code, static_cast<uint32_t>(DeviceError::kTimeout));
  EXPECT_EQ(e.op, static_cast<uint32_t>(OpId::kGemm));
  EXPECT_EQ(e.flag_kind, static_cast<uint32_t>(FlagKind::kTile));
  EXPECT_EQ(e.flag_index, 2u);
  EXPECT_EQ(e.waited_on, 1);
  EXPECT_EQ(e.epoch, epoch);
  EXPECT_EQ(e.observed, epoch - 1);
  // The context is fine: an ordinary GEMM still works.
  run_and_check(300, 256, 128, DType::kBF16, DType::kBF16, BLayout::kKN, {}, 72);
}

TEST(Sm90GemmScheduler, HostAbortEndsAGatedLaunch) {
  REQUIRE_HOPPER();
  LaunchCase c(512, 256, 128, DType::kBF16, GemmTile::k128x128, 73, /*timeout_ns=*/20'000'000'000ull);
  DevBuf flags(4 * 8);
  cudaMemset(flags.p, 0, flags.bytes);
  kt::TpSchedulerParams gate;
  gate.row_flags = flags.as<uint64_t>();
  gate.rows_per_flag = 128;
  c.l.sched.epoch = 1;
  c.l.options.num_ctas = 4;
  const auto t0 = std::chrono::steady_clock::now();
  GT_OK(launch_tp_scheduled(c.l, gate, nullptr));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  *static_cast<volatile uint32_t*>(c.wait.host_abort.p) = 1;
  GT_CUDA(cudaDeviceSynchronize());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 5.0);
  EXPECT_EQ(c.wait.record().code, static_cast<uint32_t>(DeviceError::kAborted));
}

// Work queue: tiles claimed from a global counter; reduce-add into zeros, so a tile computed
// twice (or never) shows up in the result.
TEST(Sm90GemmScheduler, WorkQueueCoversEveryTileOnce) {
  REQUIRE_HOPPER();
  LaunchCase c(1100, 1000, 264, DType::kF32, GemmTile::k128x128, 81);
  DevBuf queue(4), trace(9 * 8 * 8);
  cudaMemset(queue.p, 0, 4);
  cudaMemset(trace.p, 0, trace.bytes);
  cudaMemset(c.p.d.p, 0, c.p.d.bytes);
  c.l.sched.queue = queue.as<uint32_t>();
  c.l.sched.trace = trace.as<uint64_t>();
  c.l.options.num_ctas = 7;
  c.l.epi.op = static_cast<uint32_t>(kg::EpilogueOp::kReduceAdd);
  GT_OK(ops::launch_gemm(c.l, nullptr));
  GT_CUDA(cudaDeviceSynchronize());
  c.expect_no_device_error();
  uint32_t claimed = 0;
  cudaMemcpy(&claimed, queue.p, 4, cudaMemcpyDeviceToHost);
  EXPECT_EQ(claimed, 9u * 8u + 7u) << "every CTA claims once past the end";
  std::vector<uint64_t> tr(72);
  cudaMemcpy(tr.data(), trace.p, tr.size() * 8, cudaMemcpyDeviceToHost);
  for (size_t i = 0; i < tr.size(); ++i) EXPECT_NE(tr[i], 0u) << "tile " << i << " never claimed";
  c.check_output(c.p.d.p, reference(c.p.args), " queue");
}

// A fused-style kernel: the compute role runs until the scheduler yields (this CTA's index is at
// or above the compute limit), the CTA does "other work" (raises the limit, counts), then
// re-enters the compute role, whose pipeline state persisted in shared memory.
using QueueCfg = kg::Tile128x128;
// run() is called in a loop here, so the role keeps the entry register budget (see ComputeRole).
using QueueRole = kg::StandaloneRole<QueueCfg, true, false, /*kManageRegisters=*/false>;

__global__ void __launch_bounds__(QueueCfg::kThreads, 1)
    role_change_kernel(const __grid_constant__ kg::GemmKernelParams p, uint32_t* limit, uint32_t* yields) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const kernels::WaitContext ctx = kernels::WaitContext::start(p.wait, OpId::kGemm, 0);
  QueueRole::init(smem);
  kg::TileScheduler<> sched(p.sched);
  kg::TileEpilogue<QueueCfg::kBlockM> epi(p.epi, p.dst);
  const kg::GemmOperands ops{&p.a, &p.b, p.m, p.n, p.k};
  for (int rounds = 0; rounds < 64; ++rounds) {
    const kg::WorkItem exit = QueueRole::run(smem, ops, sched, epi, blockIdx.x, gridDim.x, ctx);
    if (exit.kind != static_cast<uint32_t>(kg::WorkKind::kYield)) break;
    if (threadIdx.x == 0) {
      atomicAdd(yields + blockIdx.x, 1u);
      atomicMax(limit, blockIdx.x + 1);  // "the controller moves me back to compute"
      __threadfence();
    }
    __syncthreads();
  }
}

TEST(Sm90GemmScheduler, WorkQueueWithRoleChanges) {
  REQUIRE_HOPPER();
  LaunchCase c(1280, 1024, 520, DType::kF32, GemmTile::k128x128, 91);
  const int grid = 8;
  DevBuf queue(4), limit(4), yields(grid * 4);
  cudaMemset(queue.p, 0, 4);
  cudaMemset(yields.p, 0, yields.bytes);
  const uint32_t initial_limit = 3;
  cudaMemcpy(limit.p, &initial_limit, 4, cudaMemcpyHostToDevice);
  cudaMemset(c.p.d.p, 0, c.p.d.bytes);

  kg::GemmKernelParams p;
  GT_OK(c.kernel_params(GemmTile::k128x128, p));
  p.sched.m_rows = 1280;
  p.sched.m_blocks = 10;
  p.sched.n_blocks = 8;
  p.sched.group_m = 4;
  p.sched.queue = queue.as<uint32_t>();
  p.sched.compute_limit = limit.as<uint32_t>();
  p.epi.op = static_cast<uint32_t>(kg::EpilogueOp::kReduceAdd);
  p.epi.num_dst = 1;
  p.wait = c.wait.params(10'000'000'000ull);
  GT_CUDA(cudaFuncSetAttribute(role_change_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(QueueCfg::kSmemBytes)));
  role_change_kernel<<<grid, QueueCfg::kThreads, QueueCfg::kSmemBytes>>>(p, limit.as<uint32_t>(),
                                                                         yields.as<uint32_t>());
  GT_CUDA(cudaGetLastError());
  GT_CUDA(cudaDeviceSynchronize());
  c.expect_no_device_error();
  std::vector<uint32_t> y(grid);
  cudaMemcpy(y.data(), yields.p, y.size() * 4, cudaMemcpyDeviceToHost);
  EXPECT_GE(y[grid - 1], 1u) << "the highest CTA must have yielded (nobody else admits it)";
  for (int b = 0; b < static_cast<int>(initial_limit); ++b) EXPECT_EQ(y[static_cast<size_t>(b)], 0u) << "CTA " << b;
  c.check_output(c.p.d.p, reference(c.p.args), " queue+role change");
}

// A CTA whose first item is kDone leaves the consumer loop within a few hundred cycles. Every
// consumer warp must still read the ring positions the role persisted before one thread writes
// them back: here the second consumer warpgroup enters run() late (as one still waiting in
// setmaxnreg.inc may) and must find the kDone in the tile ring's first slot, then a second run()
// must start where the first one left. Before 6f34ecd the first warpgroup had written the
// positions back by then, the late one waited for a slot that never fills until the timeout
// (moe_layer's timeouts with ranks sharing a GPU, whose dispatch CTAs join an empty queue).
struct DoneAtOnce {
  __device__ kg::WorkItem next(uint32_t, uint32_t, const kernels::WaitContext&) const {
    return kg::WorkItem{static_cast<uint32_t>(kg::WorkKind::kDone), 0, 0, 0};
  }
};
using LateCfg = kg::Tile128x128;  // two consumer warpgroups, registers moved with setmaxnreg
static_assert(LateCfg::kConsumers == 2 && LateCfg::kSetMaxNReg, "the test needs a late second consumer warpgroup");

__global__ void __launch_bounds__(LateCfg::kThreads, 1)
    late_consumer_kernel(const __grid_constant__ kg::GemmKernelParams p, uint64_t late_ns, uint32_t* done_runs) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Role = kg::ComputeRole<LateCfg, true, false, DoneAtOnce, kg::TileEpilogue<LateCfg::kBlockM>>;
  const kernels::WaitContext ctx = kernels::WaitContext::start(p.wait, OpId::kGemm, 0);
  Role::init(smem);
  DoneAtOnce sched;
  kg::TileEpilogue<LateCfg::kBlockM> epi(p.epi, p.dst);
  const kg::GemmOperands ops{&p.a, &p.b, p.m, p.n, p.k};
  for (int call = 0; call < 2; ++call) {
    if (call == 0 && threadIdx.x >= LateCfg::kThreads - kg::kWarpGroupThreads) {
      const uint64_t until = kernels::global_timer_ns() + late_ns;
      while (kernels::global_timer_ns() < until) {
      }
    }
    const kg::WorkItem exit = Role::run(smem, ops, sched, epi, blockIdx.x, gridDim.x, ctx);
    if (threadIdx.x == 0 && exit.kind == static_cast<uint32_t>(kg::WorkKind::kDone)) atomicAdd(done_runs, 1u);
  }
}

TEST(Sm90GemmScheduler, ALateConsumerWarpgroupFindsTheFirstItem) {
  REQUIRE_HOPPER();
  LaunchCase c(256, 256, 64, DType::kBF16, GemmTile::k128x128, 93, /*timeout_ns=*/2'000'000'000ull);
  const int grid = 4;
  DevBuf done_runs(4);
  cudaMemset(done_runs.p, 0, 4);
  kg::GemmKernelParams p;
  GT_OK(c.kernel_params(GemmTile::k128x128, p));
  p.wait = c.wait.params(2'000'000'000ull);
  GT_CUDA(cudaFuncSetAttribute(late_consumer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(LateCfg::kSmemBytes)));
  late_consumer_kernel<<<grid, LateCfg::kThreads, LateCfg::kSmemBytes>>>(p, /*late_ns=*/1'000'000ull,
                                                                        done_runs.as<uint32_t>());
  GT_CUDA(cudaGetLastError());
  GT_CUDA(cudaDeviceSynchronize());
  c.expect_no_device_error();
  uint32_t runs = 0;
  cudaMemcpy(&runs, done_runs.p, 4, cudaMemcpyDeviceToHost);
  EXPECT_EQ(runs, 2u * grid) << "every CTA's two run() calls must end with kDone";
}

// ---- grouped GEMM: a scheduler policy alone ------------------------------------------------------

// The Tiles policy of a grouped GEMM whose groups own m_blocks_per_group tile rows of A and D each
// and one B: the default order, each tile's group from its row (kernels/gemm/operands.cuh).
struct GroupedTiles : kg::RotatedTiles {
  static constexpr bool kGroupedB = true;
  uint32_t m_blocks_per_group;
  __device__ explicit GroupedTiles(uint32_t per_group) : m_blocks_per_group(per_group) {}
  __device__ void place(kg::WorkItem& item) const { item.group = item.m_block / m_blocks_per_group; }
};
static_assert(GroupedTiles::kGroupedB, "the test policy loads each group's own B");  // also: nvcc saw it unused

using GroupedCfg = kg::Tile128x128;

template <bool kBNMajor>
__global__ void __launch_bounds__(GroupedCfg::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ kg::GemmKernelParams p, uint32_t m_blocks_per_group) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Role =
      kg::ComputeRole<GroupedCfg, true, kBNMajor, kg::TileScheduler<GroupedTiles>, kg::TileEpilogue<GroupedCfg::kBlockM>>;
  const kernels::WaitContext ctx = kernels::WaitContext::start(p.wait, OpId::kGemm, 0);
  Role::init(smem);
  kg::TileScheduler<GroupedTiles> sched(p.sched, GroupedTiles(m_blocks_per_group));
  kg::TileEpilogue<GroupedCfg::kBlockM> epi(p.epi, p.dst);
  const kg::GemmOperands ops{&p.a, &p.b, p.m, p.n, p.k};
  (void)Role::run(smem, ops, sched, epi, blockIdx.x, gridDim.x, ctx);
}

// Three groups of 256 rows, each times its own B (N and K tails): D's rows of group g must be
// A_g * B_g, every group's product through the same engine with only the policy changed.
template <bool kBNMajor>
void run_grouped_case(uint64_t seed) {
  const int64_t groups = 3, rows = 256, n = 320, k = 200;
  const BLayout layout = kBNMajor ? BLayout::kKN : BLayout::kNK;
  Problem p(groups * rows, n, k, DType::kBF16, DType::kBF16, layout, seed);
  DevBuf b_all(static_cast<size_t>(groups * n * k) * 2);
  if (kBNMajor) fill(b_all.p, DType::kBF16, groups * k, n, n, seed * 2 + 3);
  else fill(b_all.p, DType::kBF16, groups * n, k, k, seed * 2 + 3);
  WaitSetup wait;
  ops::GemmLaunch l;
  l.args = p.args;
  l.args.b = b_all.p;
  l.options.tile = GemmTile::k128x128;
  l.wait = wait.params(10'000'000'000ull);
  kg::GemmKernelParams params;
  ops::GemmLaunchPlan plan;
  GT_OK(ops::gemm_kernel_params(l, &params, &plan));
  GT_OK(ops::encode_gemm_grouped_b_map(l.args, groups, GemmTile::k128x128, &params.b));
  auto* kernel = &grouped_gemm_kernel<kBNMajor>;
  GT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(GroupedCfg::kSmemBytes)));
  kernel<<<plan.num_ctas, GroupedCfg::kThreads, GroupedCfg::kSmemBytes>>>(params, static_cast<uint32_t>(rows / 128));
  GT_CUDA(cudaGetLastError());
  GT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(wait.record().code, 0u) << "device error in the grouped GEMM";
  std::vector<float> want;
  for (int64_t g = 0; g < groups; ++g) {
    GemmArgs one = l.args;
    one.a = static_cast<const char*>(p.a.p) + static_cast<size_t>(g * rows * k) * 2;
    one.b = static_cast<const char*>(b_all.p) + static_cast<size_t>(g * n * k) * 2;
    one.m = rows;
    const std::vector<float> part = reference(one);
    want.insert(want.end(), part.begin(), part.end());
  }
  const std::vector<float> got = to_host_f32(p.d.p, DType::kBF16, groups * rows, n, n);
  const Comparison c =
      compare(got, want, groups * rows, n, DType::kBF16, 128, 128, describe(l.args, GemmTile::k128x128, " 3 groups"));
  EXPECT_TRUE(c.ok) << c.report;
}

TEST(Sm90GemmGrouped, EachGroupMultipliesItsOwnB) {
  REQUIRE_HOPPER();
  run_grouped_case<false>(8300);
  run_grouped_case<true>(8301);
}

// ---- fused-kernel extensions: fold, second A source, rank-banded order ---------------------------

// A Fold policy for one GPU: `world` ranks, this one `self`; the other ranks' partials of every
// tile sit in `staged` ([(world-1) * M, N] bf16, slot s < self at s, s > self at s - 1), their
// flags in flags[slot * tiles + tile].
struct FoldTestParams {
  kernels::sm90::TmaDescriptor staged;  // box {64, BLOCK_M}
  kernels::sm90::TmaDescriptor a_local;  // rows [local_begin, local_end) of A, box {64, BLOCK_M}
  kt::TpSchedulerParams fold_range;      // the tiles that fold
  const uint64_t* flags;
  uint32_t world, self, m_rows, tiles, local_begin, local_end;
  uint64_t epoch;
};

template <int kBlockM>
struct TestFold {
  static constexpr bool kEnabled = true;
  const FoldTestParams& f;
  __device__ uint32_t world() const { return f.world; }
  __device__ uint32_t self() const { return f.self; }
  __device__ const kernels::sm90::TmaDescriptor* map() const { return &f.staged; }
  __device__ uint32_t slot(uint32_t s) const { return s < f.self ? s : s - 1; }
  __device__ int32_t source_row(const kg::WorkItem& t, uint32_t s) const {
    return static_cast<int32_t>(slot(s) * f.m_rows + t.m_block * kBlockM);
  }
  __device__ bool wait_sources(const kg::WorkItem& t, const kernels::WaitContext& ctx) const {
    for (uint32_t s = 0; s < f.world; ++s) {
      if (s == f.self) continue;
      if (!kernels::wait_flag(f.flags + slot(s) * f.tiles + t.tile, f.epoch, ctx, static_cast<int>(s), kernels::tp::kPartialFlag,
                              t.tile)) {
        return false;
      }
    }
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    return true;
  }
};

// kFold: the role folds the staged partials (A from one map); otherwise it folds nothing and
// reads tile rows [local_begin, local_end) from a_local (the two extensions are never combined
// in loom's kernels, and together they crowd the producer's 40 registers).
template <class Cfg, bool kFold>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fold_test_kernel(const __grid_constant__ kg::GemmKernelParams p, const __grid_constant__ FoldTestParams f) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Fold = std::conditional_t<kFold, TestFold<Cfg::kBlockM>, kg::NoFold>;
  using Tiles = kt::TpTiles<Cfg::kBlockM>;
  using Role = kg::ComputeRole<Cfg, true, false, kg::TileScheduler<Tiles>, kg::TileEpilogue<Cfg::kBlockM>, Cfg::kSetMaxNReg,
                               Fold>;
  const kernels::WaitContext ctx = kernels::WaitContext::start(p.wait, OpId::kGemm, f.epoch);
  Role::init(smem);
  kg::TileScheduler<Tiles> sched(p.sched, Tiles(f.fold_range, f.epoch));
  kg::TileEpilogue<Cfg::kBlockM> epi(p.epi, p.dst);
  if constexpr (kFold) {
    const kg::GemmOperands ops{&p.a, &p.b, p.m, p.n, p.k};
    (void)Role::run(smem, ops, sched, epi, blockIdx.x, gridDim.x, ctx, Fold{f});
  } else {
    const kg::GemmOperands ops{&p.a, &p.b, p.m, p.n, p.k, &f.a_local, f.local_begin, f.local_end};
    (void)Role::run(smem, ops, sched, epi, blockIdx.x, gridDim.x, ctx);
  }
}

// kFold: out = A * B + the other ranks' staged partials (`missing` leaves one flag unset: the
// launch must time out on it, kPartialFlag naming the source, and leave the GPU usable).
// !kFold: out = A_eff * B where A_eff takes tile row 1 from a second buffer while A holds NaN there.
template <class Cfg, bool kFold>
void run_fold_case(GemmTile tile, uint32_t world, uint32_t self, bool missing, uint64_t seed, int64_t k = 200) {
  const int64_t m = 256, n = 264;  // two tile rows; an N tail (and a K tail for k = 200)
  const uint64_t epoch = 7;
  LaunchCase c(m, n, k, DType::kBF16, tile, seed, missing ? 300'000'000ull : 10'000'000'000ull);
  const GemmTileInfo info = gemm_tile_info(tile);
  const int64_t m_blocks = m / info.block_m, n_blocks = (n + info.block_n - 1) / info.block_n;
  const uint32_t tiles = static_cast<uint32_t>(m_blocks * n_blocks);
  DevBuf a_local(static_cast<size_t>(info.block_m * k) * 2), staged(static_cast<size_t>((world - 1) * m * n) * 2),
      flags((world - 1) * tiles * 8), a_eff(static_cast<size_t>(m * k) * 2);
  fill(a_local.p, DType::kBF16, info.block_m, k, k, seed + 100);
  fill(staged.p, DType::kBF16, (world - 1) * m, n, n, seed + 200, 2.0f);
  GT_CUDA(cudaMemcpy(a_eff.p, c.p.a.p, a_eff.bytes, cudaMemcpyDeviceToDevice));
  if (!kFold) {
    GT_CUDA(cudaMemcpy(static_cast<char*>(a_eff.p) + info.block_m * k * 2, a_local.p, a_local.bytes,
                       cudaMemcpyDeviceToDevice));
    GT_CUDA(cudaMemset(static_cast<char*>(c.p.a.p) + info.block_m * k * 2, 0xFF, a_local.bytes));
  }
  std::vector<uint64_t> f((world - 1) * tiles, epoch);
  if (missing) f[f.size() - 1] = epoch - 1;  // the last source's last tile never arrives
  GT_CUDA(cudaMemcpy(flags.p, f.data(), flags.bytes, cudaMemcpyHostToDevice));

  kg::GemmKernelParams p;
  GT_OK(c.kernel_params(tile, p));
  p.sched.m_rows = p.m;
  p.sched.m_blocks = static_cast<uint32_t>(m_blocks);
  p.sched.n_blocks = static_cast<uint32_t>(n_blocks);
  p.sched.group_m = 1;
  p.epi.op = static_cast<uint32_t>(kg::EpilogueOp::kStore);
  p.epi.num_dst = 1;
  p.wait = c.wait.params(missing ? 300'000'000ull : 10'000'000'000ull);
  FoldTestParams fp{};
  GT_OK(ops::encode_gemm_rows_map(staged.p, (world - 1) * m, n, n, DType::kBF16, info.block_m, &fp.staged));
  GT_OK(ops::encode_gemm_rows_map(a_local.p, info.block_m, k, k, DType::kBF16, info.block_m, &fp.a_local));
  fp.fold_range.fold_m_begin = 0;
  fp.fold_range.fold_m_end = kFold ? static_cast<uint32_t>(m_blocks) : 0;
  fp.flags = flags.as<uint64_t>();
  fp.world = world;
  fp.self = self;
  fp.m_rows = static_cast<uint32_t>(m);
  fp.tiles = tiles;
  fp.local_begin = static_cast<uint32_t>(info.block_m);
  fp.local_end = static_cast<uint32_t>(2 * info.block_m);
  fp.epoch = epoch;
  auto* kernel = &fold_test_kernel<Cfg, kFold>;
  GT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Cfg::kSmemBytes)));
  const auto t0 = std::chrono::steady_clock::now();
  kernel<<<3, Cfg::kThreads, Cfg::kSmemBytes>>>(p, fp);  // 3 CTAs: each walks tiles, the stage ring wraps in folds
  GT_CUDA(cudaGetLastError());
  GT_CUDA(cudaDeviceSynchronize());
  const std::string label = kFold ? " fold world=" + std::to_string(world) + " self=" + std::to_string(self) +
                                        " k=" + std::to_string(k) + (missing ? " missing flag" : "")
                                  : std::string(" second A source for tile row 1");
  const std::string what = describe(c.p.args, tile, label.c_str());
  if (missing) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 5.0) << what << ": the launch took too long to give up";
    const ErrorRecord& e = c.wait.record();
    EXPECT_EQ(e.code, static_cast<uint32_t>(DeviceError::kTimeout)) << what;
    EXPECT_EQ(e.flag_kind, static_cast<uint32_t>(kernels::tp::kPartialFlag)) << what;
    EXPECT_EQ(e.flag_index, tiles - 1) << what;
    EXPECT_EQ(e.waited_on, static_cast<int>(self == world - 1 ? world - 2 : world - 1)) << what;
    run_and_check(300, 256, 128, DType::kBF16, DType::kBF16, BLayout::kKN, {}, seed + 300);  // GPU still usable
    return;
  }
  c.expect_no_device_error();
  GemmArgs eff = c.p.args;
  eff.a = a_eff.p;
  std::vector<float> want = reference(eff);
  if (kFold) {
    const std::vector<float> parts = to_host_f32(staged.p, DType::kBF16, (world - 1) * m, n, n);
    for (uint32_t slot = 0; slot + 1 < world; ++slot) {
      for (size_t i = 0; i < want.size(); ++i) want[i] += parts[slot * want.size() + i];
    }
  }
  c.check_output(c.p.d.p, want, label.c_str());
}

// Every rank position (own accumulator first, in the middle, last), both wide configurations,
// the fold after the last k-block (K = 200: no more k-blocks than stages) and before the last
// kStages k-blocks (K = 1000: 16 k-blocks).
TEST(Sm90GemmFused, FoldAddsStagedPartialsInRankOrder) {
  REQUIRE_HOPPER();
  uint64_t seed = 8000;
  for (int64_t k : {200, 1000}) {
    for (uint32_t self = 0; self < 3; ++self) {
      run_fold_case<kg::Tile128x256, true>(GemmTile::k128x256, 3, self, false, ++seed, k);
      run_fold_case<kg::Tile128x128, true>(GemmTile::k128x128, 3, self, false, ++seed, k);
    }
  }
  run_fold_case<kg::Tile128x128, true>(GemmTile::k128x128, 2, 1, false, ++seed);
}

TEST(Sm90GemmFused, SecondASourceForOwnRows) {
  REQUIRE_HOPPER();
  run_fold_case<kg::Tile128x256, false>(GemmTile::k128x256, 2, 0, false, 8050);
  run_fold_case<kg::Tile128x128, false>(GemmTile::k128x128, 2, 0, false, 8051);
}

TEST(Sm90GemmFused, MissingPartialTimesOutCleanly) {
  REQUIRE_HOPPER();
  run_fold_case<kg::Tile128x256, true>(GemmTile::k128x256, 3, 1, true, 8100);
}

// Host model of the rank-banded order (TpSchedulerParams) with group_m = 1: logical row i.
int64_t banded_row(int64_t i, int64_t world, int64_t self, int64_t offset, int64_t per_rank, int64_t band) {
  const int64_t round = i / (band * world), in_round = i % (band * world), slot = in_round / band;
  return ((self + offset + slot) % world) * per_rank + round * band + in_round % band;
}

// One CTA walks the whole order (tiles slow enough for distinct timestamps): the tile rows come
// in the banded order, every tile once, and the product is right.
TEST(Sm90GemmScheduler, RankBandedOrder) {
  REQUIRE_HOPPER();
  const int64_t world = 3, self = 1, per_rank = 4, band = 2, m = world * per_rank * 128, n = 256, k = 4096;
  LaunchCase c(m, n, k, DType::kBF16, GemmTile::k128x128, 8200);
  const int64_t m_blocks = m / 128, n_blocks = n / 128;
  DevBuf trace(static_cast<size_t>(m_blocks * n_blocks) * 8);
  cudaMemset(trace.p, 0, trace.bytes);
  c.l.options.num_ctas = 1;
  c.l.options.group_m = 1;
  c.l.sched.trace = trace.as<uint64_t>();
  kt::TpSchedulerParams order;
  order.order_world = static_cast<uint32_t>(world);
  order.order_self = static_cast<uint32_t>(self);
  order.order_owner_offset = 1;
  order.order_m_blocks_per_rank = static_cast<uint32_t>(per_rank);
  order.order_band_m_blocks = static_cast<uint32_t>(band);
  GT_OK(launch_tp_scheduled(c.l, order, nullptr));
  GT_CUDA(cudaDeviceSynchronize());
  c.expect_no_device_error();
  std::vector<uint64_t> tr(static_cast<size_t>(m_blocks * n_blocks));
  cudaMemcpy(tr.data(), trace.p, tr.size() * 8, cudaMemcpyDeviceToHost);
  std::vector<std::pair<uint64_t, int64_t>> by_time;
  for (int64_t t = 0; t < static_cast<int64_t>(tr.size()); ++t) {
    EXPECT_NE(tr[static_cast<size_t>(t)], 0u) << "tile " << t << " never started";
    by_time.push_back({tr[static_cast<size_t>(t)], t});
  }
  std::sort(by_time.begin(), by_time.end());
  std::string got, want;
  for (int64_t i = 0; i < m_blocks * n_blocks; ++i) {
    got += std::to_string(by_time[static_cast<size_t>(i)].second / n_blocks) + " ";
    want += std::to_string(banded_row(i / n_blocks, world, self, 1, per_rank, band)) + " ";
  }
  EXPECT_EQ(got, want) << "tile rows in start order (world 3, self 1, bands of 2 tile rows)";
  c.check_output(c.p.d.p, reference(c.p.args), " banded order");
}

}  // namespace
}  // namespace loom
