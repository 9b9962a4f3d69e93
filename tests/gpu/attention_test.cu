// The attention engine on one GPU (every rank runs these on its own GPU): loom::attention against
// an fp32 reference (tests/gpu/attention_reference.cuh) over head dims, dtypes, masks, GQA ratios,
// sequence lengths that are no multiple of any tile, packed sequences with empty and one-row
// members, strided inputs, the partial mode with attention_merge, bad input, device-checked
// offsets, determinism and CUDA-graph replay.
//
// Inputs: q, k, v ~ N(0, 1) (fresh per case), scale 1/sqrt(D), so logits have unit spread; one
// case multiplies the scale by 16. Outputs and LSE are pre-filled with NaN.
// Tolerances (documented in docs/ATTENTION.md): ||out - ref|| / ||ref|| < 1e-2 for bf16 (P and O
// are rounded to bf16, 2^-9 relative each), 4e-3 for fp16 (2^-11), 4e-3 / 2e-3 for fp32 partials
// of bf16 / fp16 inputs (only P's rounding: measured 1.5e-3 for bf16); LSE within 1e-3 * max(1, |ref|); every row's O finite.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "loom/attention.h"
#include "tests/gpu/attention_fixture.h"
#include "tests/gpu/attention_reference.cuh"
#include "tests/gpu/harness.h"

namespace loom {
namespace {

using test::DevBuf;
using test::fill_nan;
using test::fill_normal;
using test::from_half_bits;
using test::is_hopper;

// One problem: shapes, layout, mask; buffers sized for it.
struct Problem {
  DType dtype = DType::kBF16;
  AttentionLayout layout = AttentionLayout::kBSHD;
  int64_t batch = 1, seqlen_q = 0, seqlen_k = 0, heads_q = 1, heads_kv = 1, head_dim = 128;
  std::vector<int32_t> lens_q, lens_k;  // packed: per-sequence lengths
  bool causal = false;
  float scale = 0.f;
  bool bhsd_q = false;  // q stored [B, H, S, D] and passed with strides
  int block_m = 0, block_n = 0;  // the tile (AttentionOptions; 0: the planner's)
  int num_ctas = 0;               // persistent CTAs (AttentionOptions; 0: the planner's)

  bool packed() const { return layout == AttentionLayout::kPacked; }
  int64_t total(const std::vector<int32_t>& lens) const {
    int64_t t = 0;
    for (int32_t l : lens) t += l;
    return t;
  }
  int64_t q_rows() const { return packed() ? total(lens_q) : batch * seqlen_q; }
  int64_t k_rows() const { return packed() ? total(lens_k) : batch * seqlen_k; }
  std::string name() const {
    std::string s = std::string(dtype == DType::kBF16 ? "bf16" : "fp16") + (causal ? " causal" : " full") + " D" +
                    std::to_string(head_dim) + " H" + std::to_string(heads_q) + "/" + std::to_string(heads_kv);
    if (block_m != 0 || block_n != 0) s += " tile " + std::to_string(block_m) + "x" + std::to_string(block_n);
    if (num_ctas != 0) s += ", CTAs: " + std::to_string(num_ctas);
    if (packed()) {
      s += " packed [";
      for (size_t b = 0; b < lens_q.size(); ++b) s += std::to_string(lens_q[b]) + ":" + std::to_string(lens_k[b]) + " ";
      return s + "]";
    }
    return s + " B" + std::to_string(batch) + " Sq" + std::to_string(seqlen_q) + " Sk" + std::to_string(seqlen_k) +
           (bhsd_q ? " q[B,H,S,D]" : "");
  }
};

struct Buffers {
  DevBuf q, k, v, out, lse, cu_q, cu_k;
  AttentionArgs args;
};

void make_buffers(const Problem& pr, Buffers& b, uint64_t seed, bool partial) {
  const int64_t D = pr.head_dim;
  const size_t qn = static_cast<size_t>(pr.q_rows() * pr.heads_q * D);
  const size_t kn = static_cast<size_t>(pr.k_rows() * pr.heads_kv * D);
  b.q = DevBuf(qn * 2);
  b.k = DevBuf(kn * 2);
  b.v = DevBuf(kn * 2);
  b.out = DevBuf(qn * (partial ? 4 : 2));
  b.lse = DevBuf(static_cast<size_t>(pr.q_rows() * pr.heads_q) * 4);
  fill_normal(b.q, qn, pr.dtype, seed);
  fill_normal(b.k, kn, pr.dtype, seed + 1);
  fill_normal(b.v, kn, pr.dtype, seed + 2);
  fill_nan(b.out);
  fill_nan(b.lse);
  AttentionArgs& a = b.args;
  a = AttentionArgs{};
  a.q = b.q.p;
  a.k = b.k.p;
  a.v = b.v.p;
  a.out = b.out.p;
  a.lse = b.lse.as<float>();
  a.dtype = pr.dtype;
  a.layout = pr.layout;
  a.heads_q = pr.heads_q;
  a.heads_kv = pr.heads_kv;
  a.head_dim = D;
  if (pr.packed()) {
    std::vector<int32_t> cq{0}, ck{0};
    int32_t mq = 0, mk = 0;
    for (size_t i = 0; i < pr.lens_q.size(); ++i) {
      cq.push_back(cq.back() + pr.lens_q[i]);
      ck.push_back(ck.back() + pr.lens_k[i]);
      mq = std::max(mq, pr.lens_q[i]);
      mk = std::max(mk, pr.lens_k[i]);
    }
    b.cu_q = DevBuf(cq.size() * 4);
    b.cu_k = DevBuf(ck.size() * 4);
    cudaMemcpy(b.cu_q.p, cq.data(), cq.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(b.cu_k.p, ck.data(), ck.size() * 4, cudaMemcpyHostToDevice);
    a.batch = static_cast<int64_t>(pr.lens_q.size());
    a.seqlen_q = mq;
    a.seqlen_k = mk;
    a.total_q = cq.back();
    a.total_k = ck.back();
    a.cu_seqlens_q = b.cu_q.as<int32_t>();
    a.cu_seqlens_k = b.cu_k.as<int32_t>();
  } else {
    a.batch = pr.batch;
    a.seqlen_q = pr.seqlen_q;
    a.seqlen_k = pr.seqlen_k;
    if (pr.bhsd_q) a.q_strides = AttentionStrides{D, pr.seqlen_q * D, pr.heads_q * pr.seqlen_q * D};
  }
}

struct Reference {
  std::vector<float> out;  // [rows, Hq, D]
  std::vector<float> lse;  // [Hq, rows]
};

Reference reference(const Problem& pr, const Buffers& b) {
  const AttentionArgs& a = b.args;
  const int64_t rows = pr.q_rows();
  DevBuf out(static_cast<size_t>(rows * pr.heads_q * pr.head_dim) * 4), lse(static_cast<size_t>(rows * pr.heads_q) * 4);
  test::RefAttention r{};
  r.q = a.q;
  r.k = a.k;
  r.v = a.v;
  r.out = out.as<float>();
  r.lse = lse.as<float>();
  const int64_t D = pr.head_dim;
  auto strides = [&](const AttentionStrides& given, int64_t heads, int64_t seq, int64_t (&s)[3]) {
    s[0] = given.row ? given.row : heads * D;
    s[1] = given.head ? given.head : D;
    s[2] = given.batch ? given.batch : seq * heads * D;
  };
  int64_t qs[3], ks[3], vs[3];
  strides(a.q_strides, pr.heads_q, pr.seqlen_q, qs);
  strides(a.k_strides, pr.heads_kv, pr.seqlen_k, ks);
  strides(a.v_strides, pr.heads_kv, pr.seqlen_k, vs);
  r.q_row = qs[0], r.q_head = qs[1], r.q_batch = qs[2];
  r.k_row = ks[0], r.k_head = ks[1], r.k_batch = ks[2];
  r.v_row = vs[0], r.v_head = vs[1], r.v_batch = vs[2];
  r.cu_q = pr.packed() ? a.cu_seqlens_q : nullptr;
  r.cu_k = pr.packed() ? a.cu_seqlens_k : nullptr;
  r.batch = static_cast<int32_t>(a.batch);
  r.seqlen_q = static_cast<int32_t>(a.seqlen_q);
  r.seqlen_k = static_cast<int32_t>(a.seqlen_k);
  r.heads_q = static_cast<int32_t>(pr.heads_q);
  r.heads_kv = static_cast<int32_t>(pr.heads_kv);
  r.head_dim = static_cast<int32_t>(D);
  r.rows = rows;
  r.scale = pr.scale > 0.f ? pr.scale : 1.f / std::sqrt(static_cast<float>(D));
  r.causal = pr.causal ? 1 : 0;
  r.bf16 = pr.dtype == DType::kBF16 ? 1 : 0;
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(a.seqlen_q, 1)), static_cast<unsigned>(pr.heads_q),
                  static_cast<unsigned>(std::max<int64_t>(a.batch, 1)));
  const size_t smem = static_cast<size_t>(std::max<int64_t>(a.seqlen_k, 1)) * 4;
  cudaFuncSetAttribute(test::reference_attention, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  test::reference_attention<<<grid, 128, smem>>>(r);
  Reference ref;
  ref.out.resize(static_cast<size_t>(rows * pr.heads_q * D));
  ref.lse.resize(static_cast<size_t>(rows * pr.heads_q));
  cudaMemcpy(ref.out.data(), out.p, ref.out.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(ref.lse.data(), lse.p, ref.lse.size() * 4, cudaMemcpyDeviceToHost);
  return ref;
}

// The kernel's out as dense [rows, Hq, D] floats, and its LSE as [Hq, rows] (both layouts put the
// LSE of row r, head h at h * rows_per_batch + ...: batched [B, Hq, Sq], packed [Hq, T]).
struct Result2 {
  std::vector<float> out, lse;
};
Result2 fetch(const Problem& pr, const Buffers& b, bool partial) {
  const int64_t rows = pr.q_rows(), H = pr.heads_q, D = pr.head_dim;
  Result2 r;
  r.out.resize(static_cast<size_t>(rows * H * D));
  if (partial) {
    cudaMemcpy(r.out.data(), b.out.p, r.out.size() * 4, cudaMemcpyDeviceToHost);
  } else {
    std::vector<uint16_t> raw(r.out.size());
    cudaMemcpy(raw.data(), b.out.p, raw.size() * 2, cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < raw.size(); ++i) r.out[i] = from_half_bits(raw[i], pr.dtype);
  }
  std::vector<float> lse(static_cast<size_t>(rows * H));
  cudaMemcpy(lse.data(), b.lse.p, lse.size() * 4, cudaMemcpyDeviceToHost);
  r.lse.resize(lse.size());
  if (pr.packed()) {
    r.lse = lse;  // [Hq, T]
  } else {        // [B, Hq, Sq] -> [Hq, B * Sq]
    for (int64_t bb = 0; bb < pr.batch; ++bb)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t s = 0; s < pr.seqlen_q; ++s)
          r.lse[static_cast<size_t>(h * rows + bb * pr.seqlen_q + s)] =
              lse[static_cast<size_t>((bb * H + h) * pr.seqlen_q + s)];
  }
  return r;
}

struct Check {
  double rel_err = 0, lse_err = 0;
  int64_t nonfinite = 0, lse_bad = 0;
};
Check compare(const Reference& ref, const Result2& got) {
  Check c;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.out.size(); ++i) {
    if (!std::isfinite(got.out[i])) {
      ++c.nonfinite;
      continue;
    }
    const double d = static_cast<double>(got.out[i]) - ref.out[i];
    num += d * d;
    den += static_cast<double>(ref.out[i]) * ref.out[i];
  }
  c.rel_err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    const float want = ref.lse[i], have = got.lse[i];
    if (std::isinf(want)) {
      if (!(std::isinf(have) && have < 0)) ++c.lse_bad;
      continue;
    }
    const double err = std::fabs(static_cast<double>(have) - want) / std::max(1.0, std::fabs(static_cast<double>(want)));
    if (!(err <= 1e-3)) ++c.lse_bad;
    c.lse_err = std::max(c.lse_err, std::isfinite(err) ? err : 1e30);
  }
  return c;
}

double tolerance(DType t, bool partial) {
  if (partial) return t == DType::kBF16 ? 4e-3 : 2e-3;  // fp32 O: only P is rounded (to the input type)
  return t == DType::kBF16 ? 1e-2 : 4e-3;
}

void run_and_check(const Problem& pr, uint64_t seed, bool partial = false) {
  SCOPED_TRACE(pr.name());
  Buffers b;
  make_buffers(pr, b, seed, partial);
  AttentionOptions o;
  o.causal = pr.causal;
  o.scale = pr.scale;
  o.partial = partial;
  o.block_m = pr.block_m;
  o.block_n = pr.block_n;
  o.num_ctas = pr.num_ctas;
  LOOM_ASSERT_OK(attention(b.args, nullptr, o));
  LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
  LOOM_ASSERT_OK(synchronize_standalone(nullptr));
  const Reference ref = reference(pr, b);
  LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
  const Check c = compare(ref, fetch(pr, b, partial));
  EXPECT_EQ(c.nonfinite, 0) << "outputs left NaN or not finite";
  EXPECT_LT(c.rel_err, tolerance(pr.dtype, partial)) << "relative error of O";
  EXPECT_EQ(c.lse_bad, 0) << "LSE rows off by more than 1e-3 relative (max " << c.lse_err << ")";
}

Problem bshd(DType t, int64_t D, bool causal, int64_t B, int64_t sq, int64_t sk, int64_t hq, int64_t hkv) {
  Problem p;
  p.dtype = t;
  p.head_dim = D;
  p.causal = causal;
  p.batch = B;
  p.seqlen_q = sq;
  p.seqlen_k = sk;
  p.heads_q = hq;
  p.heads_kv = hkv;
  return p;
}

TEST(Attention, MatchesFp32ReferenceAcrossHeadDimsAndMasks) {
  REQUIRE_HOPPER();
  uint64_t seed = 1000;
  for (int64_t D : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      run_and_check(bshd(DType::kBF16, D, causal, 2, 1000, 1000, 3, 3), seed++);  // 1000: no multiple of any tile
      run_and_check(bshd(DType::kBF16, D, causal, 1, 300, 1037, 4, 2), seed++);   // causal with Sq < Sk
      run_and_check(bshd(DType::kBF16, D, causal, 1, 777, 129, 2, 1), seed++);    // Sq > Sk: early rows see nothing
      run_and_check(bshd(DType::kBF16, D, causal, 3, 1, 5, 2, 2), seed++);        // one query row
    }
  }
}

TEST(Attention, Fp16MatchesFp32Reference) {
  REQUIRE_HOPPER();
  uint64_t seed = 2000;
  for (int64_t D : {64, 128, 256}) {
    for (bool causal : {false, true}) run_and_check(bshd(DType::kF16, D, causal, 2, 513, 700, 4, 2), seed++);
  }
}

TEST(Attention, EveryGqaRatio) {
  REQUIRE_HOPPER();
  uint64_t seed = 3000;
  for (int64_t hkv : {8, 4, 2, 1}) {
    for (bool causal : {false, true}) run_and_check(bshd(DType::kBF16, 128, causal, 2, 640, 640, 8, hkv), seed++);
  }
}

TEST(Attention, LargeLogits) {
  REQUIRE_HOPPER();
  for (bool causal : {false, true}) {
    Problem p = bshd(DType::kBF16, 128, causal, 2, 700, 900, 4, 4);
    p.scale = 16.f / std::sqrt(128.f);  // logits ~16x the usual spread: nearly one-hot rows
    run_and_check(p, 4000 + causal);
  }
}

TEST(Attention, LongerSequences) {
  REQUIRE_HOPPER();
  run_and_check(bshd(DType::kBF16, 128, true, 1, 4096, 4096, 4, 2), 4500);
  run_and_check(bshd(DType::kBF16, 64, false, 1, 2048, 4096, 4, 4), 4501);
}

TEST(Attention, PackedSequencesWithEmptyAndSingleRows) {
  REQUIRE_HOPPER();
  uint64_t seed = 5000;
  for (int64_t D : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      Problem p;
      p.layout = AttentionLayout::kPacked;
      p.head_dim = D;
      p.causal = causal;
      p.heads_q = 4;
      p.heads_kv = 2;
      p.lens_q = {0, 1, 130, 513, 7, 64, 1};
      p.lens_k = {5, 0, 200, 513, 1, 64, 300};
      run_and_check(p, seed++);
    }
  }
}

// Every built tile (kFlashInstances), on shapes that end mid-tile, with Sq < Sk and Sq > Sk under
// both masks, packed sequences with empty and one-row entries, and fp16 for the three-consumer tile.
TEST(Attention, EveryTileConfiguration) {
  REQUIRE_HOPPER();
  uint64_t seed = 5500;
  struct Tile {
    int64_t head_dim;
    int block_m, block_n;
  };
  for (const Tile& t : {Tile{64, 128, 128}, Tile{64, 192, 128}, Tile{64, 128, 192}, Tile{128, 128, 128},
                        Tile{128, 128, 176}, Tile{256, 128, 64}, Tile{256, 128, 80}}) {
    for (bool causal : {false, true}) {
      std::vector<Problem> problems = {bshd(DType::kBF16, t.head_dim, causal, 2, 1000, 1000, 3, 3),
                                       bshd(DType::kBF16, t.head_dim, causal, 1, 300, 1037, 4, 2),
                                       bshd(DType::kBF16, t.head_dim, causal, 1, 777, 129, 2, 1)};
      if (t.block_m == 192) {
        problems.push_back(bshd(DType::kF16, t.head_dim, causal, 2, 513, 700, 8, 2));
        Problem packed;
        packed.layout = AttentionLayout::kPacked;
        packed.head_dim = t.head_dim;
        packed.causal = causal;
        packed.heads_q = 4;
        packed.heads_kv = 1;
        packed.lens_q = {0, 1, 193, 513, 7, 192, 1};
        packed.lens_k = {5, 0, 200, 513, 1, 192, 300};
        problems.push_back(packed);
      }
      for (Problem& p : problems) {
        p.block_m = t.block_m;
        p.block_n = t.block_n;
        run_and_check(p, seed++);
      }
    }
  }
}

// A CTA's tiles one after another: with one or three CTAs each takes dozens of tiles, causal
// ones of every key-block count from one up (and rows without keys when Sq > Sk), so whatever a
// consumer carries from one tile to the next (the softmax state, the K/V stage ring, the Q
// slots) is checked; with a grid of one SM per tile it rarely is.
TEST(Attention, FewCtasTakeManyTilesEach) {
  REQUIRE_HOPPER();
  uint64_t seed = 5800;
  for (int64_t D : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (int ctas : {1, 3}) {
        for (Problem p : {bshd(DType::kBF16, D, causal, 2, 700, 700, 3, 3), bshd(DType::kBF16, D, causal, 1, 900, 500, 4, 2)}) {
          p.num_ctas = ctas;
          run_and_check(p, seed++);
        }
      }
    }
  }
}

TEST(Attention, StridedQuery) {
  REQUIRE_HOPPER();
  Problem p = bshd(DType::kBF16, 128, false, 2, 300, 300, 4, 4);
  p.bhsd_q = true;
  run_and_check(p, 6000);
}

TEST(Attention, PartialModeAndMergeEqualOneCall) {
  REQUIRE_HOPPER();
  for (bool bf16 : {true, false}) {
    const DType t = bf16 ? DType::kBF16 : DType::kF16;
    Problem p = bshd(t, 128, false, 2, 500, 1000, 4, 2);
    run_and_check(p, 7000 + bf16, /*partial=*/true);  // the partial alone (fp32 O)

    // Two calls over the two halves of the keys, merged, against one call over all of them.
    Buffers b;
    make_buffers(p, b, 7100 + bf16, /*partial=*/false);
    const int64_t half = p.seqlen_k / 2, D = p.head_dim, rows = p.q_rows();
    const size_t part_elems = static_cast<size_t>(rows * p.heads_q * D);
    DevBuf parts(2 * part_elems * 4), part_lse(static_cast<size_t>(2 * rows * p.heads_q) * 4);
    fill_nan(parts);
    fill_nan(part_lse);
    AttentionOptions partial;
    partial.partial = true;
    for (int i = 0; i < 2; ++i) {
      AttentionArgs a = b.args;
      const size_t offset = static_cast<size_t>(i * half * p.heads_kv * D) * 2;
      a.k = static_cast<const uint8_t*>(b.k.p) + offset;
      a.v = static_cast<const uint8_t*>(b.v.p) + offset;
      a.seqlen_k = i == 0 ? half : p.seqlen_k - half;
      a.k_strides = a.v_strides = AttentionStrides{p.heads_kv * D, D, p.seqlen_k * p.heads_kv * D};
      a.out = parts.as<float>() + i * part_elems;
      a.lse = part_lse.as<float>() + i * rows * p.heads_q;
      LOOM_ASSERT_OK(attention(a, nullptr, partial));
    }
    AttentionMergeArgs m;
    m.partial_out = parts.as<float>();
    m.partial_lse = part_lse.as<float>();
    m.num_partials = 2;
    m.out = b.out.p;
    m.lse = b.lse.as<float>();
    m.out_dtype = t;
    m.batch = p.batch;
    m.seqlen = p.seqlen_q;
    m.heads = p.heads_q;
    m.head_dim = D;
    LOOM_ASSERT_OK(attention_merge(m, nullptr));
    LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
    const Reference ref = reference(p, b);
    LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
    const Check c = compare(ref, fetch(p, b, false));
    EXPECT_EQ(c.nonfinite, 0);
    EXPECT_LT(c.rel_err, tolerance(t, false)) << "merged halves vs the reference";
    EXPECT_EQ(c.lse_bad, 0) << "merged LSE (max rel err " << c.lse_err << ")";
  }
}

// One launch's output, then 20 more launches: the same bits.
std::vector<uint16_t> expect_repeats_identical(const Buffers& b, const AttentionOptions& o) {
  std::vector<uint16_t> first(b.out.bytes / 2), again(first.size());
  EXPECT_TRUE(attention(b.args, nullptr, o).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaMemcpy(first.data(), b.out.p, b.out.bytes, cudaMemcpyDeviceToHost);
  for (int i = 0; i < 20; ++i) EXPECT_TRUE(attention(b.args, nullptr, o).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaMemcpy(again.data(), b.out.p, b.out.bytes, cudaMemcpyDeviceToHost);
  EXPECT_EQ(first, again) << "20 launches later";
  return first;
}

TEST(Attention, RepeatedLaunchesAndGraphReplayAreBitIdentical) {
  REQUIRE_HOPPER();
  {  // the three-consumer tile
    Problem p = bshd(DType::kBF16, 64, true, 2, 1000, 1000, 8, 2);
    Buffers b;
    make_buffers(p, b, 7999, false);
    AttentionOptions o;
    o.causal = true;
    o.block_m = 192;
    expect_repeats_identical(b, o);
  }
  Problem p = bshd(DType::kBF16, 128, true, 2, 1000, 1000, 8, 2);
  Buffers b;
  make_buffers(p, b, 8000, false);
  AttentionOptions o;
  o.causal = true;
  const std::vector<uint16_t> first = expect_repeats_identical(b, o);
  std::vector<uint16_t> again(first.size());

  cudaStream_t stream = nullptr;
  LOOM_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  fill_nan(b.out);
  LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
  LOOM_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status captured = attention(b.args, stream, o);
  LOOM_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  LOOM_ASSERT_OK(captured);
  LOOM_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) LOOM_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  LOOM_ASSERT_CUDA(cudaStreamSynchronize(stream));
  cudaMemcpy(again.data(), b.out.p, b.out.bytes, cudaMemcpyDeviceToHost);
  EXPECT_EQ(first, again) << "graph replay";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(Attention, BadInputIsRefusedBeforeLaunch) {
  Problem p = bshd(DType::kBF16, 128, false, 1, 256, 256, 4, 2);
  Buffers b;
  make_buffers(p, b, 9000, false);
  const AttentionArgs good = b.args;
  auto expect = [&](AttentionArgs a, AttentionOptions o, StatusCode code, const char* what) {
    const Status s = attention_can_implement(a, o);
    EXPECT_EQ(s.code(), code) << what << ": " << s.to_string();
    const Status t = attention(a, nullptr, o);
    EXPECT_EQ(t.code(), code) << what << ": " << t.to_string();
  };
  AttentionArgs a = good;
  a.head_dim = 96;
  expect(a, {}, StatusCode::kUnsupported, "head dim 96");
  a = good;
  a.heads_kv = 3;
  expect(a, {}, StatusCode::kInvalidArgument, "Hq % Hkv != 0");
  a = good;
  a.dtype = DType::kF32;
  expect(a, {}, StatusCode::kUnsupported, "fp32 inputs");
  a = good;
  a.q = static_cast<const uint8_t*>(good.q) + 2;
  expect(a, {}, StatusCode::kInvalidArgument, "misaligned q");
  a = good;
  a.k_strides = AttentionStrides{p.heads_kv * 128 + 4, 128, 0};
  expect(a, {}, StatusCode::kInvalidArgument, "row stride not a multiple of 8");
  a = good;
  a.out = const_cast<void*>(good.q);
  expect(a, {}, StatusCode::kInvalidArgument, "out overlaps q");
  a = good;
  a.cu_seqlens_q = b.lse.as<int32_t>();
  expect(a, {}, StatusCode::kInvalidArgument, "offsets with the bshd layout");
  AttentionOptions o;
  o.scale = -1.f;
  expect(good, o, StatusCode::kInvalidArgument, "negative scale");
  o = {};
  o.scale = std::nanf("");
  expect(good, o, StatusCode::kInvalidArgument, "NaN scale");
  o = {};
  o.partial = true;
  a = good;
  a.lse = nullptr;
  expect(a, o, StatusCode::kInvalidArgument, "partial without lse");
  a = good;
  a.layout = AttentionLayout::kPacked;
  a.total_q = 256;
  a.total_k = 256;
  expect(a, {}, StatusCode::kInvalidArgument, "packed without offsets");
  if (is_hopper()) {
    LOOM_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> out(b.out.bytes / 2);
    cudaMemcpy(out.data(), b.out.p, b.out.bytes, cudaMemcpyDeviceToHost);
    for (uint16_t x : out) ASSERT_EQ(x, 0xffff) << "a refused call wrote into out";
  }
}

TEST(Attention, BadDeviceOffsetsWriteNothingAndAreReported) {
  REQUIRE_HOPPER();
  Problem p;
  p.layout = AttentionLayout::kPacked;
  p.heads_q = p.heads_kv = 2;
  p.lens_q = {100, 100, 100};
  p.lens_k = {100, 100, 100};
  Buffers b;
  make_buffers(p, b, 9100, false);
  const std::vector<int32_t> bad{0, 150, 120, 300};  // decreasing at sequence 1
  cudaMemcpy(b.cu_q.p, bad.data(), bad.size() * 4, cudaMemcpyHostToDevice);
  LOOM_ASSERT_OK(attention(b.args, nullptr, {}));  // launched: the offsets live on the device
  const Status s = synchronize_standalone(nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  std::vector<uint16_t> out(b.out.bytes / 2);
  cudaMemcpy(out.data(), b.out.p, b.out.bytes, cudaMemcpyDeviceToHost);
  for (uint16_t x : out) ASSERT_EQ(x, 0xffff) << "bad offsets must leave out untouched";
  LOOM_ASSERT_OK(synchronize_standalone(nullptr));  // reported once
}

}  // namespace
}  // namespace loom
