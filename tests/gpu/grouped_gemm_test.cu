// loom::grouped_gemm on one GPU: both layouts, B as [E, N, K] and [E, K, N], bf16 and fp16 inputs,
// every tile configuration, against an fp32 reference of each expert's product computed on the GPU (CUDA cores,
// kernels/gemm/reference.cuh).
//
// Inputs: A uniform in [-1, 1), B (nn.Linear-like) uniform in [-1, 1) / sqrt(K), fresh seeds per
// case. D is filled with 0xFF bytes (NaN in bf16, fp16 and fp32) before the call: every row of an
// expert must come back finite and close to the reference, every other row (past a masked
// expert's count, before offsets[0], after offsets[E], a zero-count expert's) must still hold the
// poison bit for bit.
// Tolerance on ||out - ref|| / ||ref|| over the experts' rows: the output's rounding dominates
// (the reference sees the same bf16/fp16 inputs; only the fp32 summation order differs), relative
// rms about 2^-9 for bf16 and 2^-12 for fp16 outputs, so bf16 < 8e-3, fp16 < 1.5e-3,
// fp32 < 1e-4.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/gemm/reference.cuh"
#include "kernels/moe/grouped_gemm_params.h"
#include "loom/gemm.h"
#include "loom/moe.h"
#include "ops/gemm/gemm_launch.h"
#include "ops/launch/standalone_wait.h"
#include "tests/gpu/common/hopper.h"

namespace loom {
namespace {

namespace ref = kernels::gemm::reference;
namespace km = kernels::moe;

#define GG_CUDA(expr)                                                                               \
  do {                                                                                              \
    cudaError_t e_ = (expr);                                                                        \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);                          \
  } while (0)


struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t n) {
    if (cudaMalloc(&p, std::max<size_t>(n, 16)) != cudaSuccess) p = nullptr;
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

float half_bits_to_float(uint16_t h, DType t) {
  if (t == DType::kBF16) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}

double tolerance(DType out) {
  if (out == DType::kF32) return 1e-4;
  return out == DType::kF16 ? 1.5e-3 : 8e-3;
}

struct GroupedCase {
  std::string name;
  GroupedLayout layout = GroupedLayout::kContiguous;
  DType in = DType::kBF16;
  DType out = DType::kBF16;
  int64_t n = 256, k = 512;
  std::vector<int32_t> counts;  // per expert (masked: may lie outside [0, capacity])
  int64_t capacity = 0;         // masked
  int32_t lead = 0;             // contiguous: rows before offsets[0] (no expert's)
  int32_t tail = 0;             // contiguous: rows after offsets[E]
  GemmTile tile = GemmTile::kAuto;
  int num_ctas = 0;
  uint64_t seed = 1;
  uint32_t expect_clamped = 0;
  BLayout b_layout = BLayout::kNK;  // B [E, N, K], or kKN [E, K, N]
  GroupedActivation activation = GroupedActivation::kNone;  // kSwiGLU: D [rows, N / 2]
  bool swap_tails = true;   // GroupedGemmOptions::swap_tails
  bool tile_queue = true;   // GroupedGemmOptions::tile_queue (run twice: the plan kernel rezeroes the counter)
  int group_m = 0;          // GroupedGemmOptions::group_m
  bool expert_groups = false;  // GroupedGemmOptions::expert_groups
};

std::string describe(const GroupedCase& c) {
  std::ostringstream s;
  s << c.name << " [" << grouped_layout_name(c.layout) << ", " << dtype_name(c.in) << "->" << dtype_name(c.out)
    << ", B " << (c.b_layout == BLayout::kKN ? "[E, K, N]" : "[E, N, K]") << ", N " << c.n << ", K " << c.k
    << ", tile " << gemm_tile_name(c.tile) << ", E " << c.counts.size()
    << (c.activation == GroupedActivation::kSwiGLU ? ", SwiGLU" : "") << (c.swap_tails ? "" : ", tails padded")
    << (c.tile_queue ? "" : ", round-robin claims") << (c.group_m > 0 ? ", group_m " + std::to_string(c.group_m) : "")
    << (c.expert_groups ? ", expert groups" : "");
  if (c.layout == GroupedLayout::kMasked) s << ", capacity " << c.capacity;
  s << ", counts";
  for (size_t e = 0; e < c.counts.size() && e < 24; ++e) s << ' ' << c.counts[e];
  if (c.counts.size() > 24) s << " ...";
  s << "]";
  return s.str();
}

// Runs one case and checks it (see the file comment).
void run_case(const GroupedCase& c) {
  SCOPED_TRACE(describe(c));
  const int64_t experts = static_cast<int64_t>(c.counts.size());
  const bool masked = c.layout == GroupedLayout::kMasked;
  // Each expert's rows of A and D: [first[e], first[e] + valid[e]).
  std::vector<int64_t> first(experts), valid(experts);
  std::vector<int32_t> offsets(experts + 1);
  int64_t rows = 0;
  if (masked) {
    for (int64_t e = 0; e < experts; ++e) {
      first[e] = e * c.capacity;
      valid[e] = std::clamp<int64_t>(c.counts[e], 0, c.capacity);
    }
    rows = experts * c.capacity;
  } else {
    offsets[0] = c.lead;
    for (int64_t e = 0; e < experts; ++e) {
      first[e] = offsets[e];
      valid[e] = c.counts[e];
      offsets[e + 1] = offsets[e] + c.counts[e];
    }
    rows = offsets[experts] + c.tail;
  }
  const size_t in_size = dtype_size(c.in), out_size = dtype_size(c.out);
  const bool swiglu = c.activation == GroupedActivation::kSwiGLU;
  const int64_t n_out = swiglu ? c.n / 2 : c.n;  // D's columns
  DevBuf a(static_cast<size_t>(rows * c.k) * in_size);
  DevBuf b(static_cast<size_t>(experts * c.n * c.k) * in_size);
  DevBuf d(static_cast<size_t>(rows * n_out) * out_size);
  DevBuf reference(static_cast<size_t>(rows * c.n) * 4);
  DevBuf groups(static_cast<size_t>(experts + 1) * 4);
  ASSERT_TRUE(a.p && b.p && d.p && reference.p && groups.p);
  if (rows > 0) ref::fill_uniform<<<256, 256>>>(a.p, static_cast<int>(c.in), rows, c.k, c.k, c.seed * 2 + 1, 1.0f);
  const bool b_kn = c.b_layout == BLayout::kKN;
  const int64_t b_rows = b_kn ? c.k : c.n, b_cols = b_kn ? c.n : c.k;  // one expert's B
  ref::fill_uniform<<<256, 256>>>(b.p, static_cast<int>(c.in), experts * b_rows, b_cols, b_cols, c.seed * 2 + 2,
                                  1.0f / std::sqrt(static_cast<float>(c.k)));
  GG_CUDA(cudaMemset(d.p, 0xFF, static_cast<size_t>(rows * n_out) * out_size));
  GG_CUDA(cudaMemset(reference.p, 0, static_cast<size_t>(rows * c.n) * 4));
  if (masked) {
    GG_CUDA(cudaMemcpy(groups.p, c.counts.data(), static_cast<size_t>(experts) * 4, cudaMemcpyHostToDevice));
  } else {
    GG_CUDA(cudaMemcpy(groups.p, offsets.data(), static_cast<size_t>(experts + 1) * 4, cudaMemcpyHostToDevice));
  }

  GroupedGemmArgs args;
  args.layout = c.layout;
  args.a = a.p;
  args.b = b.p;
  args.d = d.p;
  args.offsets = masked ? nullptr : groups.as<int32_t>();
  args.counts = masked ? groups.as<int32_t>() : nullptr;
  args.m_total = masked ? 0 : rows;
  args.capacity = masked ? c.capacity : 0;
  args.n = c.n;
  args.k = c.k;
  args.num_experts = experts;
  args.in_dtype = c.in;
  args.out_dtype = c.out;
  args.b_layout = c.b_layout;
  args.activation = c.activation;
  const size_t ws_bytes = grouped_gemm_workspace_bytes(args);
  DevBuf workspace(ws_bytes);
  ASSERT_TRUE(workspace.p);
  args.workspace = workspace.p;
  args.workspace_bytes = ws_bytes;
  GroupedGemmOptions options;
  options.tile = c.tile;
  options.num_ctas = c.num_ctas;
  options.swap_tails = c.swap_tails;
  options.tile_queue = c.tile_queue;
  options.group_m = c.group_m;
  options.expert_groups = c.expert_groups;
  const Status s = grouped_gemm(args, nullptr, options);
  ASSERT_TRUE(s.ok()) << s.to_string();
  GG_CUDA(cudaGetLastError());
  if (c.tile_queue) {  // a second launch claims from a counter the first one left at its end
    GG_CUDA(cudaMemset(d.p, 0xFF, static_cast<size_t>(rows * n_out) * out_size));
    const Status again = grouped_gemm(args, nullptr, options);
    ASSERT_TRUE(again.ok()) << again.to_string();
    GG_CUDA(cudaGetLastError());
  }

  for (int64_t e = 0; e < experts; ++e) {
    if (valid[e] == 0) continue;
    const dim3 grid(static_cast<unsigned>((c.n + 31) / 32), static_cast<unsigned>((valid[e] + 31) / 32));
    float* out = reference.as<float>() + first[e] * c.n;
    if (c.in == DType::kBF16) {
      const auto* pa = a.as<__nv_bfloat16>() + first[e] * c.k;
      const auto* pb = b.as<__nv_bfloat16>() + e * c.n * c.k;
      ref::gemm_fp32<__nv_bfloat16><<<grid, 256>>>(pa, pb, out, nullptr, static_cast<int>(valid[e]),
                                                   static_cast<int>(c.n), static_cast<int>(c.k), c.k, b_cols, b_kn);
    } else {
      const auto* pa = a.as<__half>() + first[e] * c.k;
      const auto* pb = b.as<__half>() + e * c.n * c.k;
      ref::gemm_fp32<__half><<<grid, 256>>>(pa, pb, out, nullptr, static_cast<int>(valid[e]), static_cast<int>(c.n),
                                            static_cast<int>(c.k), c.k, b_cols, b_kn);
    }
  }
  GG_CUDA(cudaDeviceSynchronize());
  // A device-side failure (a bounded wait that ran out) is recorded for the next call to report.
  Result<ops::StandaloneWait*> wait = ops::standalone_wait();
  ASSERT_TRUE(wait.ok()) << wait.status().to_string();
  EXPECT_EQ((*wait)->error->code, 0u) << "the grouped GEMM failed on the device";
  if (rows == 0) return;  // nothing was launched

  km::GroupedWorkspaceHeader header{};
  GG_CUDA(cudaMemcpy(&header, workspace.p, sizeof header, cudaMemcpyDeviceToHost));
  EXPECT_EQ(header.clamped_experts, c.expect_clamped) << "experts whose offsets or count were clamped";

  std::vector<uint8_t> got(static_cast<size_t>(rows * n_out) * out_size);
  std::vector<float> product(static_cast<size_t>(rows * c.n));
  GG_CUDA(cudaMemcpy(got.data(), d.p, got.size(), cudaMemcpyDeviceToHost));
  GG_CUDA(cudaMemcpy(product.data(), reference.p, product.size() * 4, cudaMemcpyDeviceToHost));
  // The expected D: the product, or with SwiGLU silu(gate) * up over B's rows interleaved by 8
  // (output column o: gate column 16 (o / 8) + o % 8, up column 8 further), in double.
  std::vector<float> want(static_cast<size_t>(rows * n_out));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < n_out; ++o) {
      const float* row = product.data() + r * c.n;
      if (!swiglu) {
        want[static_cast<size_t>(r * n_out + o)] = row[o];
        continue;
      }
      const double gate = row[16 * (o / 8) + o % 8], up = row[16 * (o / 8) + o % 8 + 8];
      want[static_cast<size_t>(r * n_out + o)] = static_cast<float>(gate / (1.0 + std::exp(-gate)) * up);
    }
  }

  std::vector<int64_t> owner(static_cast<size_t>(rows), -1);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = first[e]; r < first[e] + valid[e]; ++r) owner[static_cast<size_t>(r)] = e;
  }
  double err2 = 0, ref2 = 0;
  std::vector<double> expert_err2(experts, 0.0), expert_ref2(experts, 0.0);
  int64_t nonfinite = 0, touched = 0, checked = 0;
  std::string first_touched, first_nonfinite;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t e = owner[static_cast<size_t>(r)];
    for (int64_t col = 0; col < n_out; ++col) {
      const size_t i = static_cast<size_t>(r * n_out + col);
      const uint8_t* raw = got.data() + i * out_size;
      if (e < 0) {
        bool poison = true;
        for (size_t byte = 0; byte < out_size; ++byte) poison = poison && raw[byte] == 0xFF;
        if (!poison && touched++ == 0) first_touched = "row " + std::to_string(r) + " col " + std::to_string(col);
        continue;
      }
      float v;
      if (c.out == DType::kF32) {
        std::memcpy(&v, raw, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, raw, 2);
        v = half_bits_to_float(h, c.out);
      }
      ++checked;
      if (!std::isfinite(v)) {
        if (nonfinite++ == 0) {
          first_nonfinite = "row " + std::to_string(r) + " (expert " + std::to_string(e) + ") col " + std::to_string(col);
        }
        continue;
      }
      const double diff = static_cast<double>(v) - want[i];
      err2 += diff * diff;
      ref2 += static_cast<double>(want[i]) * want[i];
      expert_err2[e] += diff * diff;
      expert_ref2[e] += static_cast<double>(want[i]) * want[i];
    }
  }
  EXPECT_EQ(touched, 0) << "elements outside every expert's rows were written; the first at " << first_touched;
  EXPECT_EQ(nonfinite, 0) << "experts' elements left unwritten or not finite; the first at " << first_nonfinite;
  if (checked == 0) return;
  ASSERT_GT(ref2, 0.0) << "the reference is all zeros: the check would pass trivially";
  const double rel = std::sqrt(err2 / ref2);
  std::ostringstream per_expert;
  for (int64_t e = 0; e < experts; ++e) {
    if (expert_ref2[e] > 0) per_expert << " e" << e << "=" << std::sqrt(expert_err2[e] / expert_ref2[e]);
  }
  EXPECT_LT(rel, tolerance(c.out)) << "relative error " << rel << "; per expert:" << per_expert.str();
}

// Skewed routing as in mKernel's benchmarks: expert weights U(0, 1), each row's expert drawn
// from the weights (max / mean of the counts about 2).
std::vector<int32_t> skewed_counts(int64_t experts, int64_t rows, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> weights(static_cast<size_t>(experts));
  for (double& w : weights) w = u(gen);
  std::discrete_distribution<int64_t> pick(weights.begin(), weights.end());
  std::vector<int32_t> counts(static_cast<size_t>(experts), 0);
  for (int64_t r = 0; r < rows; ++r) ++counts[static_cast<size_t>(pick(gen))];
  return counts;
}

const GemmTile kEveryTile[] = {GemmTile::kAuto, GemmTile::k128x256, GemmTile::k128x128, GemmTile::k128x64,
                               GemmTile::k64x128};

// Counts of every kind: 0, 1, a tile minus one, a tile, a tile plus one, several tiles, 64.
const std::vector<int32_t> kMixedCounts = {0, 1, 127, 128, 129, 300, 0, 64, 63, 65};

// kMixedCounts over contiguous rows at one tile: the case the per-tile tests below vary.
GroupedCase mixed_counts(const char* name, GemmTile tile, DType in, DType out, int64_t n, uint64_t seed) {
  GroupedCase c;
  c.name = name;
  c.counts = kMixedCounts;
  c.tile = tile;
  c.in = in;
  c.out = out;
  c.n = n;
  c.seed = seed;
  return c;
}

// Four masked experts of capacity 256 (empty, partial, nearly empty, full).
GroupedCase four_masked(const char* name, uint64_t seed) {
  GroupedCase c;
  c.name = name;
  c.layout = GroupedLayout::kMasked;
  c.counts = {0, 200, 7, 256};
  c.capacity = 256;
  c.seed = seed;
  return c;
}

TEST(GroupedGemmContiguous, CountsOfEveryKindBf16) {
  REQUIRE_HOPPER();
  uint64_t seed = 100;
  // N = 384: a partial 256-wide tile column.
  for (GemmTile t : kEveryTile) run_case(mixed_counts("mixed counts", t, DType::kBF16, DType::kBF16, 384, ++seed));
}

TEST(GroupedGemmContiguous, CountsOfEveryKindFp16) {
  REQUIRE_HOPPER();
  uint64_t seed = 200;
  for (GemmTile t : kEveryTile) run_case(mixed_counts("mixed counts", t, DType::kF16, DType::kF16, 384, ++seed));
}

// B as [E, K, N] (each expert's B N-major): every tile, both input types, both row layouts.
TEST(GroupedGemmBLayout, EKNWeightsEveryTile) {
  REQUIRE_HOPPER();
  uint64_t seed = 1500;
  for (GemmTile t : kEveryTile) {
    for (DType in : {DType::kBF16, DType::kF16}) {
      // N = 320: a partial tile column at every tile width; K = 264: a partial k-block.
      GroupedCase c = mixed_counts("B [E, K, N], mixed counts", t, in, in == DType::kBF16 ? DType::kBF16 : DType::kF32,
                                   320, ++seed);
      c.b_layout = BLayout::kKN;
      c.k = 264;
      run_case(c);
    }
  }
  GroupedCase masked = four_masked("B [E, K, N], masked", 1599);
  masked.b_layout = BLayout::kKN;
  run_case(masked);
}

// The SwiGLU epilogue: gate and up interleaved by 8 in B's N rows, D = silu(gate) * up with N / 2
// columns; every tile that takes it (BLOCK_N >= 128), both B layouts, every output type, both
// row layouts.
TEST(GroupedGemmSwiGLU, EveryTileBothBLayouts) {
  REQUIRE_HOPPER();
  uint64_t seed = 1700;
  int variant = 0;
  for (GemmTile t : {GemmTile::kAuto, GemmTile::k128x256, GemmTile::k128x128, GemmTile::k64x128}) {
    for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
      const DType in = variant % 2 == 0 ? DType::kBF16 : DType::kF16;
      const DType out = variant % 3 == 0 ? DType::kF32 : in;
      ++variant;
      // N = 400: 200 outputs, a partial tile column at every tile width.
      GroupedCase c = mixed_counts("SwiGLU, mixed counts", t, in, out, 400, ++seed);
      c.activation = GroupedActivation::kSwiGLU;
      c.b_layout = layout;
      c.k = 264;
      run_case(c);
    }
  }
  GroupedCase masked = four_masked("SwiGLU, masked", 1799);
  masked.activation = GroupedActivation::kSwiGLU;
  masked.n = 512;
  run_case(masked);
}

// Every length 1..127 of an expert's last tile row, after 0, 1 or 2 full tile rows, in each output
// type, plain and SwiGLU, swapped (kernels/gemm/swap_tail.cuh: every N from 16 to 128) and padded
// (the row-range stores, and the second consumer warpgroup's skipped wgmma when the row holds at
// most 64 rows).
TEST(GroupedGemmContiguous, EveryTailLength) {
  REQUIRE_HOPPER();
  std::vector<int32_t> counts;
  for (int32_t r = 1; r < 128; ++r) counts.push_back(r + 128 * (r % 3));
  struct Variant {
    GemmTile tile;
    DType in, out;
    GroupedActivation activation;
    int64_t n;
  };
  const Variant variants[] = {
      {GemmTile::k128x256, DType::kBF16, DType::kBF16, GroupedActivation::kNone, 264},
      {GemmTile::k128x128, DType::kF16, DType::kF32, GroupedActivation::kNone, 264},
      {GemmTile::k128x256, DType::kF16, DType::kF16, GroupedActivation::kSwiGLU, 400},
      {GemmTile::k128x128, DType::kBF16, DType::kF32, GroupedActivation::kSwiGLU, 400},
  };
  uint64_t seed = 1900;
  struct Schedule {
    bool swap, queue;
    int group_m;
    bool expert_groups;
  };
  for (const Variant& v : variants) {
    // Expert groups of at most 2 tile rows: the counts' 1-3 tile rows per expert give groups of
    // 1 and 2 rows, and a 3-row expert's last row a group of its own.
    for (const Schedule sched : {Schedule{true, true, 0, false}, Schedule{false, true, 0, false},
                                 Schedule{true, false, 3, false}, Schedule{true, true, 2, true}}) {
      GroupedCase c;
      c.name = "every tail length";
      c.counts = counts;
      c.tile = v.tile;
      c.in = v.in;
      c.out = v.out;
      c.activation = v.activation;
      c.n = v.n;
      c.k = 200;
      c.seed = ++seed;
      c.swap_tails = sched.swap;
      c.tile_queue = sched.queue;
      c.group_m = sched.group_m;
      c.expert_groups = sched.expert_groups;
      run_case(c);
    }
  }
}

TEST(GroupedGemmContiguous, NAndKTails) {
  REQUIRE_HOPPER();
  // N = 200 ends inside a staged box; K = 200 ends inside a k-block (TMA zero-fills the rest).
  for (DType t : {DType::kBF16, DType::kF16}) {
    GroupedCase c;
    c.name = "N and K tails";
    c.in = c.out = t;
    c.counts = {37, 0, 140, 5};
    c.n = 200;
    c.k = 200;
    c.tile = GemmTile::k128x128;
    c.seed = t == DType::kBF16 ? 301 : 302;
    run_case(c);
  }
}

TEST(GroupedGemmContiguous, OneExpertTakesAllRows) {
  REQUIRE_HOPPER();
  for (DType t : {DType::kBF16, DType::kF16}) {
    GroupedCase c;
    c.name = "all rows to expert 2";
    c.in = c.out = t;
    c.counts = {0, 0, 777, 0, 0};
    c.n = 256;
    c.k = 256;
    c.seed = t == DType::kBF16 ? 401 : 402;
    run_case(c);
  }
}

TEST(GroupedGemmContiguous, SkewedRouting) {
  REQUIRE_HOPPER();
  const std::vector<int32_t> counts = skewed_counts(16, 3000, 77);
  const int32_t max_count = *std::max_element(counts.begin(), counts.end());
  EXPECT_GT(max_count, 3000 / 16 * 3 / 2) << "the routing is meant to be skewed (max / mean about 2)";
  uint64_t seed = 500;
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (GemmTile tile : {GemmTile::kAuto, GemmTile::k64x128}) {
      GroupedCase c;
      c.name = "skewed";
      c.in = c.out = t;
      c.counts = counts;
      c.n = 512;
      c.k = 384;
      c.tile = tile;
      c.seed = ++seed;
      run_case(c);
    }
  }
}

TEST(GroupedGemmContiguous, RowsOutsideEveryExpertAreUntouched) {
  REQUIRE_HOPPER();
  GroupedCase c;
  c.name = "rows before offsets[0] and after offsets[E]";
  c.counts = {50, 0, 130};
  c.lead = 21;
  c.tail = 75;
  c.tile = GemmTile::k128x128;
  c.seed = 601;
  run_case(c);
  c.name = "every expert empty";
  c.counts = {0, 0, 0, 0};
  c.lead = 100;
  c.tail = 30;
  c.seed = 602;
  run_case(c);
}

TEST(GroupedGemmContiguous, Fp32Output) {
  REQUIRE_HOPPER();
  for (GemmTile t : {GemmTile::k128x128, GemmTile::k64x128}) {
    GroupedCase c;
    c.name = "fp32 output";
    c.out = DType::kF32;
    c.counts = {3, 130, 0, 64, 200};
    c.n = 264;
    c.tile = t;
    c.seed = t == GemmTile::k64x128 ? 701 : 702;
    run_case(c);
  }
}

TEST(GroupedGemmContiguous, FewCtasTakeManyTiles) {
  REQUIRE_HOPPER();
  GroupedCase c;
  c.name = "3 CTAs";
  c.counts = {129, 1, 256, 0, 77, 300};
  c.n = 512;
  c.k = 1024;  // 16 k-blocks: the stage ring wraps within every tile
  c.tile = GemmTile::k128x128;
  c.num_ctas = 3;
  c.seed = 801;
  run_case(c);
}

TEST(GroupedGemmMasked, RowsPastEachCountAreUntouched) {
  REQUIRE_HOPPER();
  uint64_t seed = 900;
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (GemmTile tile : kEveryTile) {
      GroupedCase c;
      c.name = "masked";
      c.layout = GroupedLayout::kMasked;
      c.in = c.out = t;
      c.capacity = 200;
      c.counts = {0, 1, 200, 37, 128, 129, 0};
      c.n = 384;
      c.tile = tile;
      c.seed = ++seed;
      run_case(c);
    }
  }
}

TEST(GroupedGemmMasked, OutOfRangeCountsAreClampedAndCounted) {
  REQUIRE_HOPPER();
  GroupedCase c;
  c.name = "counts above capacity and negative";
  c.layout = GroupedLayout::kMasked;
  c.capacity = 96;
  c.counts = {250, -3, 10, 96};  // expert 0 computes its 96 rows, expert 1 none
  c.seed = 1001;
  c.expect_clamped = 2;
  run_case(c);
}

TEST(GroupedGemmContiguous, WorkspaceIsRewrittenByEachCall) {
  REQUIRE_HOPPER();
  // The same shapes twice with different counts: the second call must not see the first's table.
  GroupedCase c;
  c.name = "first call";
  c.counts = {300, 0, 20, 1};
  c.tile = GemmTile::k128x128;
  c.seed = 1101;
  run_case(c);
  c.name = "second call";
  c.counts = {1, 20, 0, 300};
  c.seed = 1102;
  run_case(c);
}

TEST(GroupedGemmApi, BadInputIsRefusedBeforeAnyLaunch) {
  // No GPU work is needed to refuse these; the checks run before any CUDA call.
  GroupedGemmArgs args;
  args.a = reinterpret_cast<const void*>(uintptr_t{0x1000});
  args.b = reinterpret_cast<const void*>(uintptr_t{0x100000});
  args.d = reinterpret_cast<void*>(uintptr_t{0x200000});
  args.offsets = reinterpret_cast<const int32_t*>(uintptr_t{0x300000});
  args.m_total = 64;
  args.n = 64;
  args.k = 64;
  args.num_experts = 2;
  EXPECT_EQ(grouped_gemm(args, nullptr).code(), StatusCode::kInvalidArgument) << "no workspace";
  args.num_experts = 0;
  EXPECT_EQ(grouped_gemm(args, nullptr).code(), StatusCode::kInvalidArgument) << "no experts";
  args.num_experts = 2;
  args.k = 60;
  EXPECT_EQ(grouped_gemm(args, nullptr).code(), StatusCode::kUnsupported) << "K not a multiple of 8";
  args.k = 64;
  args.b_layout = static_cast<BLayout>(7);
  GroupedGemmArgs odd = args;
  odd.b_layout = BLayout::kNK;
  odd.activation = GroupedActivation::kSwiGLU;
  odd.n = 72;  // not a multiple of 16
  EXPECT_EQ(grouped_gemm_can_implement(odd).code(), StatusCode::kUnsupported) << "SwiGLU with N % 16 != 0";
  odd.n = 64;
  GroupedGemmOptions narrow;
  narrow.tile = GemmTile::k128x64;
  EXPECT_EQ(grouped_gemm_can_implement(odd, narrow).code(), StatusCode::kUnsupported) << "SwiGLU with BLOCK_N 64";
  const Status layout = grouped_gemm_can_implement(args);
  EXPECT_EQ(layout.code(), StatusCode::kInvalidArgument) << layout.to_string();
  EXPECT_NE(layout.message().find("b_layout"), std::string::npos) << layout.to_string();
}

TEST(GroupedGemmApi, PlanSizesTheWorkspaceAndGrid) {
  REQUIRE_HOPPER();
  GroupedGemmArgs args;
  args.a = reinterpret_cast<const void*>(uintptr_t{1} << 20);  // never dereferenced
  args.b = reinterpret_cast<const void*>(uintptr_t{1} << 30);
  args.d = reinterpret_cast<void*>(uintptr_t{1} << 40);
  args.offsets = reinterpret_cast<const int32_t*>(uintptr_t{1} << 41);
  args.m_total = 4096;
  args.n = 4096;
  args.k = 2048;
  args.num_experts = 8;
  args.workspace = reinterpret_cast<void*>(uintptr_t{1} << 42);
  args.workspace_bytes = grouped_gemm_workspace_bytes(args);
  const Result<GroupedGemmPlanInfo> plan = grouped_gemm_plan(args);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_NE(plan->tile, GemmTile::kAuto);
  EXPECT_EQ(plan->rows, 4096);
  EXPECT_EQ(plan->workspace_bytes, grouped_gemm_workspace_bytes(args));
  EXPECT_GT(plan->grid, 0);
  // Every expert's last tile row may be partial: at most M_total / BLOCK_M + E tile rows.
  const int64_t bm = plan->tile_info.block_m, bn = plan->tile_info.block_n;
  EXPECT_LE(plan->max_tiles, (4096 / bm + 8) * ((4096 + bn - 1) / bn));
  EXPECT_GE(plan->max_tiles, (4096 / bm) * ((4096 + bn - 1) / bn));
  GroupedGemmOptions forced;
  forced.tile = GemmTile::k128x128;
  forced.num_ctas = 5;
  const Result<GroupedGemmPlanInfo> small = grouped_gemm_plan(args, forced);
  ASSERT_TRUE(small.ok()) << small.status().to_string();
  EXPECT_EQ(small->tile, GemmTile::k128x128);
  EXPECT_EQ(small->grid, 5);
  args.k = 60;
  EXPECT_EQ(grouped_gemm_plan(args).status().code(), StatusCode::kUnsupported) << "K not a multiple of 8";
}

TEST(GroupedGemmApi, NoRowsLaunchesNothing) {
  REQUIRE_HOPPER();
  GroupedCase c;
  c.name = "M_total 0";
  c.counts = {0, 0};
  c.seed = 1201;
  run_case(c);  // rows == 0: no launch; the workspace keeps whatever it held
}

}  // namespace
}  // namespace loom
