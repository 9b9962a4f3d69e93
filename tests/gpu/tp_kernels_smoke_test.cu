// Smoke test of the fused tensor-parallel kernels (src/kernels/tp/) and their decomposed paths
// (src/ops/{ag_gemm,gemm_rs,gemm_ar}.cu) on every rank of the job (loom-run -n 2 -- loom_gpu_tests).
//
// For each operator: bf16, a small shape (M = 128 W: one tile row per rank; N and K with tails)
// and a medium one (M = 512 W), both B layouts; forced fused (the planner's tile on the small
// shape, 128x256 and 128x128 on the medium one, one ag_gemm case with a single communication
// CTA, one gemm_rs / gemm_ar case wide enough for two bands of the rank-banded order) and
// forced decomposed. Every rank fills its operands from seeds (case, rank) and rebuilds
// every peer's from the same seeds, so it computes an fp32 reference of its own output on the
// GPU's CUDA cores (kernels/gemm/reference.cuh). Outputs start as NaN bytes. Also checked:
// ag_gemm's gathered_a (a separate buffer, and in place) bit for bit against the shards; gemm_ar's
// output bit-identical on all ranks; fused gemm_rs / gemm_ar relaunched give the same bits.
//
// Tolerance (inputs uniform in [-1, 1), bf16 output):
//   ||out - ref|| / ||ref|| <= 1e-2  and every element within (1/32) (|ref| + rms(ref)).
// Error sources: one bf16 rounding of the output (2^-9 relative), one of each partial a fused
// gemm_rs / gemm_ar stages for its owner, fp32 summation order. A missing, doubled or misplaced
// tile or partial is off by O(1) relative, far outside.
//
// On failure: op, shape, algorithm, tile, rank, relative error, the first mismatches and a map of
// the 128 x 128 output tiles (. ok, X wrong, N NaN = never written). Every rank agrees on the
// verdict after each case, so one failing rank stops all of them instead of leaving the others
// waiting in the next launch. Test names avoid the substring "Gemm": the device script runs
// *Gemm* tests on one rank only.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/gemm/reference.cuh"
#include "loom/tensor_parallel.h"
#include "runtime/communicator_impl.h"
#include "tests/gpu/harness.h"
#include "tests/gpu/common/hopper.h"

namespace loom {
namespace {

using test::process;
using test::shared_comm;
namespace ref = kernels::gemm::reference;

constexpr double kRelTol = 1e-2;
constexpr double kElemTol = 1.0 / 32;
constexpr int kMapTile = 128;

enum class Gathered : uint8_t { kNone, kSeparate, kInPlace };

struct Case {
  OpId op;
  int64_t m, n, k;
  BLayout layout;
  TpAlgorithm algorithm;
  GemmTile tile;
  int comm_ctas = -1;
  Gathered gathered = Gathered::kNone;
  uint64_t id = 0;  // seeds

  std::string text() const {
    const char* op_name = op == OpId::kAgGemm ? "ag_gemm" : op == OpId::kGemmRs ? "gemm_rs" : "gemm_ar";
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s M=%lld N=%lld K=%lld B=%s %s tile=%s comm_ctas=%d%s", op_name,
                  static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                  std::string(b_layout_name(layout)).c_str(), algorithm == TpAlgorithm::kFused ? "fused" : "decomposed",
                  std::string(gemm_tile_name(tile)).c_str(), comm_ctas,
                  gathered == Gathered::kSeparate  ? " gathered_a=separate"
                  : gathered == Gathered::kInPlace ? " gathered_a=in-place"
                                                   : "");
    return buf;
  }
};

uint64_t seed_a(const Case& c, int rank) { return c.id * 1000 + static_cast<uint64_t>(rank) * 2 + 1; }
uint64_t seed_b(const Case& c, int rank) { return c.id * 1000 + static_cast<uint64_t>(rank) * 2 + 2; }

void fill_bf16(void* p, int64_t rows, int64_t cols, uint64_t seed) {
  ref::fill_uniform<<<256, 256>>>(p, 0, rows, cols, cols, seed, 1.0f);
}

float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<uint16_t> to_host_bits(const void* dev, size_t elements) {
  std::vector<uint16_t> bits(elements);
  cudaMemcpy(bits.data(), dev, elements * 2, cudaMemcpyDeviceToHost);
  return bits;
}

uint64_t fnv1a(const std::vector<uint16_t>& bits) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint16_t v : bits) {
    h ^= v;
    h *= 0x100000001b3ull;
  }
  return h;
}

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) {
    if (cudaMalloc(&p, std::max<size_t>(bytes, 16)) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

// C[n_rows, N] (fp32) = A[n_rows, K] * B on the CUDA cores.
void reference_gemm(const void* a, const void* b, float* c, int64_t n_rows, int64_t n, int64_t k, BLayout layout) {
  const dim3 grid(static_cast<unsigned>((n + 31) / 32), static_cast<unsigned>((n_rows + 31) / 32));
  const bool kn = layout == BLayout::kKN;
  ref::gemm_fp32<__nv_bfloat16><<<grid, 256>>>(static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b),
                                               c, nullptr, static_cast<int>(n_rows), static_cast<int>(n),
                                               static_cast<int>(k), k, kn ? n : k, kn);
}

// got (bf16 bits) against want; the report holds the diagnostics when it fails.
struct Verdict {
  bool ok = true;
  std::string report;
};

Verdict compare(const std::vector<uint16_t>& got_bits, const std::vector<double>& want, int64_t rows, int64_t cols,
                const std::string& what) {
  Verdict v;
  double num = 0, den = 0;
  for (double w : want) den += w * w;
  const double rms = std::sqrt(den / static_cast<double>(std::max<size_t>(want.size(), 1)));
  const int64_t tr = (rows + kMapTile - 1) / kMapTile, tc = (cols + kMapTile - 1) / kMapTile;
  std::vector<char> map(static_cast<size_t>(tr * tc), '.');
  std::string first;
  int shown = 0;
  int64_t nan = 0, bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      const double g = bf16_bits_to_float(got_bits[i]);
      const double w = want[i];
      char& cell = map[static_cast<size_t>((r / kMapTile) * tc + c / kMapTile)];
      if (std::isnan(g)) {
        ++nan;
        cell = 'N';
      } else {
        num += (g - w) * (g - w);
        if (std::fabs(g - w) <= kElemTol * (std::fabs(w) + rms)) continue;
        ++bad;
        if (cell == '.') cell = 'X';
      }
      if (shown < 8) {
        char buf[128];
        std::snprintf(buf, sizeof buf, "    (row %lld, col %lld): got %.6g want %.6g\n", static_cast<long long>(r),
                      static_cast<long long>(c), g, w);
        first += buf;
        ++shown;
      }
    }
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  v.ok = nan == 0 && bad == 0 && rel <= kRelTol && den > 0;
  if (!v.ok) {
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "%s, rank %d: rel_err %.3g (tolerance %.0e), %lld NaN, %lld elements off by more than %.4g (|ref| + "
                  "rms %.3g); first mismatches:\n",
                  what.c_str(), process().rank, rel, kRelTol, static_cast<long long>(nan), static_cast<long long>(bad),
                  kElemTol, rms);
    v.report = buf + first + "  output tile map (" + std::to_string(kMapTile) + "x" + std::to_string(kMapTile) +
               "; . ok, X wrong, N NaN / never written):\n";
    for (int64_t i = 0; i < std::min<int64_t>(tr, 64); ++i) {
      v.report += "    ";
      for (int64_t j = 0; j < std::min<int64_t>(tc, 100); ++j) v.report += map[static_cast<size_t>(i * tc + j)];
      v.report += "\n";
    }
  }
  return v;
}

Status launch(Communicator& comm, const Case& c, const TpGemmArgs& args, cudaStream_t stream) {
  TpGemmOptions options;
  options.algorithm = c.algorithm;
  options.tile = c.tile;
  options.comm_ctas = c.comm_ctas;
  switch (c.op) {
    case OpId::kAgGemm: return ag_gemm(comm, args, stream, options);
    case OpId::kGemmRs: return gemm_rs(comm, args, stream, options);
    default: return gemm_ar(comm, args, stream, options);
  }
}

// Runs one case on every rank and checks it; returns false (on every rank) when any rank failed.
bool run_case(const Case& c) {
  Communicator& comm = shared_comm();
  const int world = comm.local_world_size();
  const int me = comm.local_rank();
  const int64_t rows = c.m / world;  // rows per rank
  const bool ag = c.op == OpId::kAgGemm;
  const int64_t a_rows = ag ? rows : c.m;
  const int64_t out_rows = c.op == OpId::kGemmRs ? rows : c.m;
  const size_t a_bytes = static_cast<size_t>(a_rows * c.k) * 2;
  const size_t b_bytes = static_cast<size_t>(c.n * c.k) * 2;
  const size_t out_bytes = static_cast<size_t>(out_rows * c.n) * 2;
  const size_t gathered_bytes = static_cast<size_t>(c.m * c.k) * 2;
  const std::string what = c.text() + " W=" + std::to_string(world);

  // Buffers (symmetric ones in the same order on every rank).
  DevBuf a_plain(a_bytes), b(b_bytes), out_plain(out_bytes);
  void* out = out_plain.p;
  void* gathered = nullptr;
  std::vector<void*> symmetric;
  auto sym_alloc = [&](size_t bytes) -> void* {
    Result<void*> p = comm.alloc(bytes);
    EXPECT_TRUE(p.ok()) << what << ": symmetric alloc: " << p.status().to_string();
    if (!p.ok()) return nullptr;
    symmetric.push_back(*p);
    return *p;
  };
  if (c.op == OpId::kGemmAr) out = sym_alloc(out_bytes);
  if (ag && c.gathered != Gathered::kNone) gathered = sym_alloc(gathered_bytes);
  const void* a = a_plain.p;
  if (ag && c.gathered == Gathered::kInPlace && gathered != nullptr) {
    a = static_cast<char*>(gathered) + static_cast<size_t>(me) * a_bytes;
  }
  bool ok = a_plain.p && b.p && out && (!ag || c.gathered == Gathered::kNone || gathered);
  if (ok) {
    if (gathered) cudaMemset(gathered, 0xFF, gathered_bytes);
    fill_bf16(const_cast<void*>(a), a_rows, c.k, seed_a(c, me));
    if (c.layout == BLayout::kKN) fill_bf16(b.p, c.k, c.n, seed_b(c, me));
    else fill_bf16(b.p, c.n, c.k, seed_b(c, me));
    cudaMemset(out, 0xFF, out_bytes);  // NaN in bf16
    ok = cudaDeviceSynchronize() == cudaSuccess;
  }
  if (!test::all_ranks_agree(comm, ok)) {
    ADD_FAILURE() << what << ": setting up the buffers failed on some rank";
    for (auto it = symmetric.rbegin(); it != symmetric.rend(); ++it) (void)comm.free(*it);
    return false;
  }

  TpGemmArgs args;
  args.a = a;
  args.b = b.p;
  args.out = out;
  args.m = c.m;
  args.n = c.n;
  args.k = c.k;
  args.dtype = DType::kBF16;
  args.b_layout = c.layout;
  args.gathered_a = gathered;
  Status launched = launch(comm, c, args, nullptr);
  const bool refused = launched.code() == StatusCode::kUnsupported && c.algorithm == TpAlgorithm::kFused;
  if (test::all_ranks_agree(comm, refused)) {
    // A shape the fused kernel cannot run (e.g. more local ranks than it addresses): not a
    // failure of the kernels, but say so.
    if (process().rank == 0) std::printf("[ info     ] %s: fused refused: %s\n", what.c_str(), launched.to_string().c_str());
    for (auto it = symmetric.rbegin(); it != symmetric.rend(); ++it) (void)comm.free(*it);
    return true;
  }
  EXPECT_TRUE(launched.ok()) << what << ": " << launched.to_string();
  Status synced = launched.ok() ? comm.synchronize(nullptr) : launched;
  EXPECT_TRUE(synced.ok()) << what << ": " << synced.to_string();
  bool good = launched.ok() && synced.ok();

  if (good) {
    // fp32 reference of this rank's output, in double on the host.
    std::vector<double> want(static_cast<size_t>(out_rows * c.n), 0.0);
    DevBuf c32(static_cast<size_t>(c.m * c.n) * 4), a_s(static_cast<size_t>(c.m * c.k) * 2), b_s(b_bytes);
    std::vector<float> part(static_cast<size_t>(out_rows * c.n));
    if (ag) {
      for (int s = 0; s < world; ++s) {
        fill_bf16(static_cast<char*>(a_s.p) + static_cast<size_t>(s) * a_bytes, rows, c.k, seed_a(c, s));
      }
      reference_gemm(a_s.p, b.p, static_cast<float*>(c32.p), c.m, c.n, c.k, c.layout);
      cudaMemcpy(part.data(), c32.p, part.size() * 4, cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < part.size(); ++i) want[i] = part[i];
      if (gathered != nullptr) {
        const std::vector<uint16_t> got = to_host_bits(gathered, static_cast<size_t>(c.m * c.k));
        const std::vector<uint16_t> exp = to_host_bits(a_s.p, static_cast<size_t>(c.m * c.k));
        int64_t wrong = 0, first = -1;
        for (size_t i = 0; i < got.size(); ++i) {
          if (got[i] != exp[i]) {
            if (first < 0) first = static_cast<int64_t>(i);
            ++wrong;
          }
        }
        EXPECT_EQ(wrong, 0) << what << ", rank " << process().rank << ": gathered_a differs from the shards in " << wrong
                            << " elements; first at row " << first / c.k << " col " << first % c.k << " (row owner rank "
                            << first / c.k / rows << ")";
        good = good && wrong == 0;
      }
    } else {
      const int64_t row0 = c.op == OpId::kGemmRs ? me * rows : 0;
      for (int s = 0; s < world; ++s) {  // rank order, summed in double
        fill_bf16(a_s.p, c.m, c.k, seed_a(c, s));
        if (c.layout == BLayout::kKN) fill_bf16(b_s.p, c.k, c.n, seed_b(c, s));
        else fill_bf16(b_s.p, c.n, c.k, seed_b(c, s));
        reference_gemm(static_cast<char*>(a_s.p) + static_cast<size_t>(row0 * c.k) * 2, b_s.p, static_cast<float*>(c32.p),
                       out_rows, c.n, c.k, c.layout);
        cudaMemcpy(part.data(), c32.p, part.size() * 4, cudaMemcpyDeviceToHost);
        for (size_t i = 0; i < part.size(); ++i) want[i] += part[i];
      }
    }
    const std::vector<uint16_t> got = to_host_bits(out, static_cast<size_t>(out_rows * c.n));
    const Verdict v = compare(got, want, out_rows, c.n, what);
    EXPECT_TRUE(v.ok) << v.report;
    good = good && v.ok;

    if (c.op == OpId::kGemmAr) {
      // Every rank must hold the same bits (each element rounded once, by its owner).
      const uint64_t mine = fnv1a(got);
      std::vector<uint64_t> all(static_cast<size_t>(comm.world_size()));
      const Status gathered_hashes = internal(comm).bootstrap->all_gather(&mine, all.data(), sizeof mine);
      EXPECT_TRUE(gathered_hashes.ok()) << gathered_hashes.to_string();
      for (size_t r = 0; r < all.size(); ++r) {
        EXPECT_EQ(all[r], mine) << what << ": rank " << r << "'s output differs from rank " << process().rank << "'s";
        good = good && all[r] == mine;
      }
    }
  }

  // Relaunch (fused reduce operators): the same bits every time.
  if (test::all_ranks_agree(comm, good) && c.algorithm == TpAlgorithm::kFused && !ag) {
    const std::vector<uint16_t> first = to_host_bits(out, static_cast<size_t>(out_rows * c.n));
    for (int i = 0; i < 3 && good; ++i) {
      cudaMemset(out, 0xFF, out_bytes);
      const Status relaunched = launch(comm, c, args, nullptr);
      const Status again = relaunched.ok() ? comm.synchronize(nullptr) : relaunched;
      EXPECT_TRUE(again.ok()) << what << ": relaunch " << i << ": " << again.to_string();
      int64_t differ = 0;
      if (again.ok()) {
        const std::vector<uint16_t> now = to_host_bits(out, first.size());
        for (size_t j = 0; j < now.size(); ++j) differ += now[j] != first[j];
      }
      EXPECT_EQ(differ, 0) << what << ", rank " << process().rank << ": relaunch " << i << " differs from the first launch in "
                           << differ << " elements";
      good = good && again.ok() && differ == 0;
      if (!test::all_ranks_agree(comm, good)) break;
    }
  }
  const bool all_good = test::all_ranks_agree(comm, good);
  for (auto it = symmetric.rbegin(); it != symmetric.rend(); ++it) (void)comm.free(*it);
  return all_good;
}

// All cases of one operator: small and medium shapes, both layouts, fused and decomposed.
void run_operator(OpId op) {
  if (!test::all_ranks_agree(shared_comm(), test::is_hopper())) GTEST_SKIP() << "needs Hopper GPUs on every rank";
  const int64_t world = shared_comm().local_world_size();
  uint64_t id = 1 + static_cast<uint64_t>(op) * 100;
  std::vector<Case> cases;
  for (BLayout layout : {BLayout::kKN, BLayout::kNK}) {
    // Small: one tile row per rank, N and K not multiples of any tile.
    cases.push_back({op, 128 * world, 264, 200, layout, TpAlgorithm::kFused, GemmTile::kAuto});
    cases.push_back({op, 128 * world, 264, 200, layout, TpAlgorithm::kDecomposed, GemmTile::kAuto});
    // Medium: several tile rows and chunks per rank, both fused tiles.
    const Gathered gathered = op != OpId::kAgGemm ? Gathered::kNone
                              : layout == BLayout::kKN ? Gathered::kSeparate
                                                       : Gathered::kInPlace;
    for (GemmTile tile : {GemmTile::k128x256, GemmTile::k128x128}) {
      cases.push_back({op, 512 * world, 1032, 1096, layout, TpAlgorithm::kFused, tile, -1, gathered});
    }
    cases.push_back({op, 512 * world, 1032, 1096, layout, TpAlgorithm::kDecomposed, GemmTile::kAuto, -1, gathered});
  }
  if (op == OpId::kAgGemm) {
    // One communication CTA pushes every chunk to every peer (flag lag across many items).
    cases.push_back({op, 512 * world, 1032, 1096, BLayout::kNK, TpAlgorithm::kFused, GemmTile::k128x128, 1});
  } else {
    // Wide N: 128 tile columns make a band of 4 tile rows hold two waves of 132 SMs, so each
    // owner's 8 tile rows form two bands of the rank-banded order (own tiles mid-run).
    cases.push_back({op, 1024 * world, 16384, 256, BLayout::kNK, TpAlgorithm::kFused, GemmTile::k128x128});
  }
  for (Case& c : cases) {
    c.id = ++id;
    if (!run_case(c)) return;  // every rank stops at the same case
  }
}

TEST(TpFusedSmoke, ag_gemm_bf16) { run_operator(OpId::kAgGemm); }
TEST(TpFusedSmoke, gemm_rs_bf16) { run_operator(OpId::kGemmRs); }
TEST(TpFusedSmoke, gemm_ar_bf16) { run_operator(OpId::kGemmAr); }

}  // namespace
}  // namespace loom
