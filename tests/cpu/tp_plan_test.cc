// The tensor-parallel planner: shape rules and their messages, option overrides, the tuning
// cache (round trip, malformed files, LOOM_TUNING_CACHE) and the cost model's choices.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "planner/gemm_heuristic.h"
#include "planner/tp_plan.h"

namespace loom::planner {
namespace {

constexpr int kSms = 132;  // H200
constexpr int64_t kIssueMs[] = {1024, 2048, 4096, 8192, 16384, 32768};

// The issue's shapes: ag_gemm (M, 14336, 8192); gemm_rs / gemm_ar (M, 8192, 14336) with the
// global K split over the ranks (k is this rank's share, as in TpGemmArgs).
TpRequest issue_request(OpId op, int64_t m, int world = 2) {
  TpRequest r;
  r.op = op;
  r.m = m;
  r.n = op == OpId::kAgGemm ? 14336 : 8192;
  r.k = op == OpId::kAgGemm ? 8192 : 14336 / world;
  r.local_world = world;
  r.dtype = DType::kBF16;
  r.b_layout = BLayout::kNK;
  r.sm_count = kSms;
  return r;
}

TpRequest small_request(OpId op, int64_t m, int64_t n, int64_t k) {
  TpRequest r = issue_request(op, m);
  r.n = n;
  r.k = k;
  return r;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A file under the test's temporary directory, removed at scope exit.
struct TempFile {
  std::string path;
  explicit TempFile(const std::string& name)
      : path(::testing::TempDir() + "loom_tp_plan_" + std::to_string(::getpid()) + "_" + name) {}
  ~TempFile() { std::remove(path.c_str()); }
  void write(const std::string& text) const {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
  }
};

struct ScopedEnv {
  std::string name;
  explicit ScopedEnv(const char* n, const char* value) : name(n) {
    if (value) setenv(n, value, 1);
    else unsetenv(n);
  }
  ~ScopedEnv() { unsetenv(name.c_str()); }
};

const OpId kOps[] = {OpId::kAgGemm, OpId::kGemmRs, OpId::kGemmAr};

// ---- shape rules -------------------------------------------------------------------------------

TEST(TpPlanShape, MNotDivisibleByWorldIsRefusedWithTheReason) {
  for (OpId op : kOps) {
    TpRequest r = issue_request(op, 1001);
    Result<TpPlan> p = plan_tp(r, {}, nullptr);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    const std::string& m = p.status().message();
    EXPECT_TRUE(contains(m, std::string(tp_op_name(op)) + ": ")) << m;
    EXPECT_TRUE(contains(m, "M=1001")) << m;
    EXPECT_TRUE(contains(m, "multiple of the 2 local ranks")) << m;
  }
}

TEST(TpPlanShape, NAndKMustBeMultiplesOfEight) {
  TpRequest r = issue_request(OpId::kGemmRs, 4096);
  r.n = 8190;
  Result<TpPlan> p = plan_tp(r, {}, nullptr);
  EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(contains(p.status().message(), "multiples of 8")) << p.status().message();
  r.n = 8192;
  r.k = 7164;
  EXPECT_EQ(plan_tp(r, {}, nullptr).status().code(), StatusCode::kUnsupported);
}

TEST(TpPlanShape, NonPositiveSizesAreInvalid) {
  for (int64_t bad : {int64_t{0}, int64_t{-2}}) {
    TpRequest r = issue_request(OpId::kAgGemm, 4096);
    r.m = bad;
    Result<TpPlan> p = plan_tp(r, {}, nullptr);
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(p.status().message(), "must be positive")) << p.status().message();
    r = issue_request(OpId::kAgGemm, 4096);
    r.k = bad;
    EXPECT_EQ(plan_tp(r, {}, nullptr).status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(TpPlanShape, Fp32IsUnsupportedAndNamed) {
  TpRequest r = issue_request(OpId::kGemmAr, 4096);
  r.dtype = DType::kF32;
  Result<TpPlan> p = plan_tp(r, {}, nullptr);
  EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(contains(p.status().message(), "gemm_ar: fp32")) << p.status().message();
  r.dtype = DType::kF16;
  EXPECT_TRUE(plan_tp(r, {}, nullptr).ok());
}

TEST(TpPlanShape, SizesOf2To31AreUnsupported) {
  TpRequest r = issue_request(OpId::kAgGemm, int64_t{1} << 31);
  EXPECT_EQ(plan_tp(r, {}, nullptr).status().code(), StatusCode::kUnsupported);
}

TEST(TpPlanShape, CallerBugsAreInternal) {
  TpRequest r = issue_request(OpId::kAgGemm, 4096);
  r.op = OpId::kAllReduce;
  EXPECT_EQ(plan_tp(r, {}, nullptr).status().code(), StatusCode::kInternal);
  r = issue_request(OpId::kAgGemm, 4096);
  r.sm_count = 0;
  EXPECT_EQ(plan_tp(r, {}, nullptr).status().code(), StatusCode::kInternal);
  r = issue_request(OpId::kAgGemm, 4096);
  r.local_world = 0;
  EXPECT_EQ(plan_tp(r, {}, nullptr).status().code(), StatusCode::kInternal);
}

TEST(TpPlanShape, EveryIssueShapeIsAcceptedAtTwoFourAndEightRanks) {
  for (int world : {2, 4, 8}) {
    for (OpId op : kOps) {
      for (int64_t m : kIssueMs) {
        Result<TpPlan> p = plan_tp(issue_request(op, m, world), {}, nullptr);
        ASSERT_TRUE(p.ok()) << tp_op_name(op) << " M=" << m << " W=" << world << ": " << p.status().to_string();
        EXPECT_NE(p->algorithm, TpAlgorithm::kAuto);
        EXPECT_NE(p->tile, GemmTile::kAuto);
        EXPECT_EQ(p->source, "model");
      }
    }
  }
}

// ---- options -----------------------------------------------------------------------------------

TEST(TpPlanOptions, EachOptionOverridesTheModel) {
  const TpRequest r = issue_request(OpId::kAgGemm, 16384);
  TpGemmOptions o;
  o.algorithm = TpAlgorithm::kDecomposed;
  Result<TpPlan> p = plan_tp(r, o, nullptr);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->algorithm, TpAlgorithm::kDecomposed);
  EXPECT_EQ(p->source, "options");

  o = {};
  o.comm_ctas = 0;  // the op decides whether zero communication CTAs can work
  p = plan_tp(r, o, nullptr);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->comm_ctas, 0);
  o.comm_ctas = 31;
  EXPECT_EQ(plan_tp(r, o, nullptr)->comm_ctas, 31);

  o = {};
  o.tile = GemmTile::k128x64;
  p = plan_tp(r, o, nullptr);
  EXPECT_EQ(p->tile, GemmTile::k128x64);
  EXPECT_EQ(p->source, "options");
}

TEST(TpPlanOptions, OutOfRangeOptionsAreInvalidWithTheReason) {
  const TpRequest r = issue_request(OpId::kGemmRs, 4096);
  TpGemmOptions o;
  o.comm_ctas = kSms;
  Result<TpPlan> p = plan_tp(r, o, nullptr);
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(p.status().message(), "leaves no compute CTA on 132 SMs")) << p.status().message();
  o.comm_ctas = -2;
  p = plan_tp(r, o, nullptr);
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(p.status().message(), "-1 lets the planner decide")) << p.status().message();
  o = {};
  o.algorithm = static_cast<TpAlgorithm>(7);
  EXPECT_EQ(plan_tp(r, o, nullptr).status().code(), StatusCode::kInvalidArgument);
  o = {};
  o.tile = static_cast<GemmTile>(9);
  EXPECT_EQ(plan_tp(r, o, nullptr).status().code(), StatusCode::kInvalidArgument);
  for (int bad : {-2, TpGemmOptions::kMaxTailPieces + 1}) {
    o = {};
    o.tail_pieces = bad;
    p = plan_tp(r, o, nullptr);
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(contains(p.status().message(), "tail_pieces " + std::to_string(bad))) << p.status().message();
  }
}

// ---- tail split ----------------------------------------------------------------------------------

// gemm_rs / gemm_ar, 128x256 tiles (4 stages), 132 SMs, K per rank 7168 (112 k-blocks).
constexpr int kStages128x256 = 4;
constexpr int64_t kIssueKBlocks = 14336 / 2 / 64;

TEST(TpTailSplit, IssueShapesSplitWhereTheLastWaveSaves) {
  // M = 8192: 2048 tiles = 15 waves + 68; in 3 pieces 204 items end in 2 rounds of a third of a
  // tile (2 pieces: 2 rounds of halves, no gain; 4: 3 rounds of quarters).
  TailSplit t = plan_tail_split(2048, kSms, kIssueKBlocks, kStages128x256, 512, -1);
  EXPECT_EQ(t.tiles, 68);
  EXPECT_EQ(t.pieces, 3);
  // M = 16384 and 32768: 4 and 8 tiles left over: quarters in one round.
  t = plan_tail_split(4096, kSms, kIssueKBlocks, kStages128x256, 512, -1);
  EXPECT_EQ(t.tiles, 4);
  EXPECT_EQ(t.pieces, 4);
  EXPECT_EQ(plan_tail_split(8192, kSms, kIssueKBlocks, kStages128x256, 1024, -1).pieces, 4);
  // M = 1024 .. 4096: 124, 116, 100 tiles left: no pieces count up to 4 ends sooner than whole tiles.
  for (int64_t tiles : {256, 512, 1024}) {
    EXPECT_EQ(plan_tail_split(tiles, kSms, kIssueKBlocks, kStages128x256, 512, -1).pieces, 0) << tiles;
  }
  // Whole waves: nothing to split.
  EXPECT_EQ(plan_tail_split(4 * kSms, kSms, kIssueKBlocks, kStages128x256, 1024, -1).pieces, 0);
}

TEST(TpTailSplit, LimitsAndRequests) {
  // The leftover must fit in the splittable tiles (the order's last band).
  EXPECT_EQ(plan_tail_split(2048, kSms, kIssueKBlocks, kStages128x256, 67, -1).pieces, 0);
  // The model keeps 2 * stages k-blocks per piece: 24 k-blocks allow 3, 16 only 2 (halves of 68
  // tiles gain nothing), 15 none.
  EXPECT_EQ(plan_tail_split(2048, kSms, 24, kStages128x256, 512, -1).pieces, 3);
  EXPECT_EQ(plan_tail_split(2048, kSms, 16, kStages128x256, 512, -1).pieces, 0);
  EXPECT_EQ(plan_tail_split(4096, kSms, 16, kStages128x256, 512, -1).pieces, 2);
  EXPECT_EQ(plan_tail_split(4096, kSms, 15, kStages128x256, 512, -1).pieces, 0);
  // min_tail_gain: 0.333 of a tile is not enough when 0.4 is asked for.
  TpCostModel strict;
  strict.min_tail_gain = 0.4;
  EXPECT_EQ(plan_tail_split(2048, kSms, kIssueKBlocks, kStages128x256, 512, -1, 0, strict).pieces, 0);
  // Requests: 0 and 1 mean none; a count is taken as given while every piece keeps a k-block.
  EXPECT_EQ(plan_tail_split(2048, kSms, kIssueKBlocks, kStages128x256, 512, 1).pieces, 0);
  EXPECT_EQ(plan_tail_split(2048, kSms, kIssueKBlocks, kStages128x256, 512, 0).pieces, 0);
  TailSplit t = plan_tail_split(2048, kSms, kIssueKBlocks, kStages128x256, 512, 2);
  EXPECT_EQ(t.tiles, 68);
  EXPECT_EQ(t.pieces, 2);
  EXPECT_EQ(plan_tail_split(2048, kSms, 16, kStages128x256, 512, 16).pieces, 16);
  EXPECT_EQ(plan_tail_split(2048, kSms, 15, kStages128x256, 512, 16).pieces, 0);
  // Fewer tiles than SMs: all of them are the last wave.
  EXPECT_EQ(plan_tail_split(60, kSms, 16, kStages128x256, 96, -1).tiles, 60);
  EXPECT_EQ(plan_tail_split(60, kSms, 16, kStages128x256, 96, -1).pieces, 2);
  // Nonsense grids split nothing.
  EXPECT_EQ(plan_tail_split(2048, 0, kIssueKBlocks, kStages128x256, 512, 3).pieces, 0);
}

TEST(TpTailSplit, LateClaimsLeaveMoreTilesToTheLastWave) {
  // ag_gemm M = 1024 (448 tiles of 128x256, 128 k-blocks): 52 tiles are left over on 132 CTAs,
  // 14 more when 14 comm CTAs each miss a claim; both end soonest in halves.
  EXPECT_EQ(plan_tail_split(448, kSms, 128, kStages128x256, 448, -1).tiles, 52);
  TailSplit t = plan_tail_split(448, kSms, 128, kStages128x256, 448, -1, 14);
  EXPECT_EQ(t.tiles, 66);
  EXPECT_EQ(t.pieces, 2);
  // A requested count splits the same tiles.
  EXPECT_EQ(plan_tail_split(448, kSms, 128, kStages128x256, 448, 3, 14).tiles, 66);
  // Whole waves plus late claims: the late claims are the tail.
  EXPECT_EQ(plan_tail_split(4 * kSms, kSms, 128, kStages128x256, 1024, -1, 10).tiles, 10);
  // Never more than one wave, nor more than the tiles; negative claims count as none.
  EXPECT_EQ(plan_tail_split(448, kSms, 128, kStages128x256, 448, 2, 500).tiles, kSms);
  EXPECT_EQ(plan_tail_split(60, kSms, 128, kStages128x256, 448, 2, 100).tiles, 60);
  EXPECT_EQ(plan_tail_split(448, kSms, 128, kStages128x256, 448, 2, -5).tiles, 52);
}

TEST(AgRowsPerFlag, WholeTileRowsWhenTheyGiveEveryCommCtaAChunk) {
  const uint64_t row = 8192 * 2;  // K = 8192, bf16: a 128-row tile row is 2 MiB
  // M = 8192 on 2 ranks: 32 tile rows of 2 MiB each; 5 comm CTAs have a chunk each.
  EXPECT_EQ(ag_rows_per_flag(4096, row, 5, 1), 128);
  // Small rows: as many tile rows as fit 1 MiB (K = 1024: 4 tile rows = 1 MiB).
  EXPECT_EQ(ag_rows_per_flag(4096, 1024 * 2, 5, 1), 512);
  EXPECT_EQ(ag_rows_per_flag(4096, 1024 * 2, 8, 1), 512);
}

TEST(AgRowsPerFlag, FinerChunksWhenCommCtasWouldIdle) {
  const uint64_t row = 8192 * 2;
  // M = 1024 on 2 ranks: 4 tile rows for 14 comm CTAs; 32-row chunks (16 of 512 KiB) give each
  // a chunk (the largest divisor of 512 with >= 14 chunks).
  EXPECT_EQ(ag_rows_per_flag(512, row, 14, 1), 32);
  // Two peers (W = 3) halve the chunks needed: 7 -> 64 rows (8 chunks, 1 MiB each).
  EXPECT_EQ(ag_rows_per_flag(512, row, 14, 2), 64);
  // More comm CTAs than the 16-row floor allows: the finest chunks, 16 rows.
  EXPECT_EQ(ag_rows_per_flag(512, row, 100, 1), 16);
  // Shards that are not whole tile rows (any divisor works for the flags).
  EXPECT_EQ(ag_rows_per_flag(96, row, 4, 1), 24);
  EXPECT_EQ(ag_rows_per_flag(8, row, 4, 1), 8);   // below the floor: the whole shard
  EXPECT_EQ(ag_rows_per_flag(1, row, 4, 1), 1);
  // A row over the chunk size: one tile row per flag when that is enough chunks, else the floor.
  EXPECT_EQ(ag_rows_per_flag(1024, uint64_t{4} << 20, 8, 1), 128);
  EXPECT_EQ(ag_rows_per_flag(1024, uint64_t{4} << 20, 16, 1), 16);
  // Every result divides the shard and no chunk count is below what was asked when possible.
  for (int64_t rows : {128, 256, 384, 512, 1536, 4096}) {
    for (int ctas : {1, 2, 5, 14, 33}) {
      const int64_t rpf = ag_rows_per_flag(rows, row, ctas, 1);
      EXPECT_EQ(rows % rpf, 0) << rows << " " << ctas;
      if (rows / 16 >= ctas) EXPECT_GE(rows / rpf, ctas) << rows << " " << ctas;
    }
  }
}

TEST(AgLateClaims, PushingCommCtasMissATileEach) {
  TpRequest r = issue_request(OpId::kAgGemm, 1024);
  // 14 comm CTAs, 16 chunks of 512 KiB: the busiest pushes 1 MiB (~50 us) within a tile's time.
  EXPECT_EQ(ag_late_claims(r, GemmTile::k128x256, 14, 32, 1), 14);
  // 4 chunks of 2 MiB for 14 comm CTAs: only 4 push, ~95 us each: two tiles' time.
  EXPECT_EQ(ag_late_claims(r, GemmTile::k128x256, 14, 128, 1), 8);
  // Nothing to push, nobody late.
  EXPECT_EQ(ag_late_claims(issue_request(OpId::kAgGemm, 1024, 1), GemmTile::k128x256, 14, 32, 1), 0);
  EXPECT_EQ(ag_late_claims(r, GemmTile::k128x256, 0, 32, 1), 0);
}

// ---- cost model ----------------------------------------------------------------------------------

// The model with the fused kernels switched off (TpCostModel::fused_by_default).
TpCostModel fused_disabled() {
  TpCostModel m;
  m.fused_by_default = false;
  return m;
}

TEST(TpPlanModel, DecomposedWhenTheFusedKernelsAreSwitchedOff) {
  for (OpId op : kOps) {
    for (int64_t m : kIssueMs) {
      Result<TpPlan> p = plan_tp(issue_request(op, m), {}, nullptr, fused_disabled());
      ASSERT_TRUE(p.ok()) << p.status().to_string();
      EXPECT_EQ(p->algorithm, TpAlgorithm::kDecomposed) << tp_op_name(op) << " M=" << m;
    }
  }
}

TEST(TpPlanModel, IssueShapesOnTwoH200sAreFusedWithAFewCommCtas) {
  for (OpId op : kOps) {
    for (int64_t m : kIssueMs) {
      const TpRequest r = issue_request(op, m);
      Result<TpPlan> p = plan_tp(r, {}, nullptr);
      ASSERT_TRUE(p.ok()) << p.status().to_string();
      const TpEstimate e = estimate_tp(r, p->comm_ctas, p->tile);
      EXPECT_EQ(p->algorithm, TpAlgorithm::kFused)
          << tp_op_name(op) << " M=" << m << ": fused " << e.fused_s * 1e3 << " ms vs decomposed " << e.decomposed_s * 1e3;
      EXPECT_TRUE(is_fused_tile(p->tile)) << gemm_tile_name(p->tile);
      if (op == OpId::kAgGemm) {
        EXPECT_GE(p->comm_ctas, TpCostModel{}.min_comm_ctas);
        EXPECT_LE(p->comm_ctas, kSms / TpCostModel{}.max_comm_ctas_sm_divisor);
      } else {
        EXPECT_EQ(p->comm_ctas, 0) << "gemm_rs / gemm_ar move data from the compute CTAs' epilogues";
      }
    }
  }
}

TEST(TpPlanModel, FusedNeedsWholeTileRowsPerRankAndAtMostEightRanks) {
  const TpCostModel model;
  for (OpId op : kOps) {
    TpRequest r = issue_request(op, 2000);  // 1000 rows per rank: not whole 128-row tiles
    EXPECT_FALSE(fused_can_run(r, model));
    EXPECT_EQ(plan_tp(r, {}, nullptr)->algorithm, TpAlgorithm::kDecomposed) << tp_op_name(op);
    r = issue_request(op, 2048);
    EXPECT_TRUE(fused_can_run(r, model));
    r = issue_request(op, 16 * 1024, 16);
    EXPECT_FALSE(fused_can_run(r, model));
    EXPECT_EQ(plan_tp(r, {}, nullptr)->algorithm, TpAlgorithm::kDecomposed) << tp_op_name(op) << " on 16 ranks";
  }
}

TEST(TpPlanModel, ForcedAlgorithmGetsTheModelsSplitForIt) {
  // A shape the model decomposes, forced fused: the fused tile and the model's comm CTAs, not the
  // decomposed plan's (whose tile may have no fused kernel and which moves nothing with CTAs).
  TpGemmOptions fused;
  fused.algorithm = TpAlgorithm::kFused;
  for (OpId op : kOps) {
    const TpRequest r = small_request(op, 256, 1024, 1024);
    ASSERT_EQ(plan_tp(r, {}, nullptr)->algorithm, TpAlgorithm::kDecomposed);
    Result<TpPlan> p = plan_tp(r, fused, nullptr);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->algorithm, TpAlgorithm::kFused);
    EXPECT_TRUE(is_fused_tile(p->tile)) << gemm_tile_name(p->tile);
    if (op == OpId::kAgGemm) {
      EXPECT_GE(p->comm_ctas, 1);
    }
  }
  // And the other way round: decomposed keeps the plain GEMM's tile choice.
  TpGemmOptions decomposed;
  decomposed.algorithm = TpAlgorithm::kDecomposed;
  const TpRequest r = issue_request(OpId::kAgGemm, 16384);
  EXPECT_EQ(plan_tp(r, decomposed, nullptr)->tile, choose_gemm_tile(r.m, r.n, r.k, r.sm_count));
}

TEST(TpPlanModel, CommCtasAreTheFewestThatFinishEarlyEnough) {
  const TpCostModel model;
  const TpRequest r = issue_request(OpId::kAgGemm, 16384);
  Result<TpPlan> p = plan_tp(r, {}, nullptr, model);
  ASSERT_TRUE(p.ok());
  auto window = [&](const TpEstimate& e) { return e.gemm_s / model.fused_compute_efficiency * (r.local_world - 1) / r.local_world; };
  const TpEstimate chosen = estimate_tp(r, p->comm_ctas, p->tile);
  EXPECT_LE(chosen.comm_s, model.comm_finish_fraction * window(chosen));
  const TpEstimate fewer = estimate_tp(r, p->comm_ctas - 1, p->tile);
  EXPECT_GT(fewer.comm_s, model.comm_finish_fraction * window(fewer)) << "comm_ctas " << p->comm_ctas << " is not the fewest";
}

TEST(TpPlanModel, AgGemmAtSmallMTakesTheTileWhoseLastWaveHasRoomAndFillsItWithCommCtas) {
  // M = 1024: 128x128 is modelled ~3% faster as a plain GEMM (896 tiles, 7 waves, 28 idle slots)
  // but 128x256 (448 tiles, 4 waves, 80 idle slots) absorbs the fused kernel's delays; measured
  // on 2 x H200 (Nov 2026) 128x256 with 14-16 comm CTAs beat 128x128 with 5 by 2-4%.
  const TpCostModel model;
  const TpRequest r = issue_request(OpId::kAgGemm, 1024);
  ASSERT_LT(gemm_model_seconds(GemmTile::k128x128, r.m, r.n, r.k, kSms),
            gemm_model_seconds(GemmTile::k128x256, r.m, r.n, r.k, kSms));
  Result<TpPlan> p = plan_tp(r, {}, nullptr, model);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->tile, GemmTile::k128x256);
  // 448 tiles in 4 waves need 112 CTAs: 20 could go; capped at what saturates NVLink.
  const int saturating = static_cast<int>(std::ceil(model.nvlink_bytes_per_s / model.comm_cta_bytes_per_s));
  EXPECT_EQ(p->comm_ctas, std::min(20, saturating));
  // Without the tolerance the faster plain GEMM's tile is kept.
  TpCostModel strict = model;
  strict.fused_tile_tolerance = 0;
  EXPECT_EQ(plan_tp(r, {}, nullptr, strict)->tile, GemmTile::k128x128);
  // Where the last wave is full the spare-CTA rule adds nothing: M = 16384 keeps the fewest.
  const TpRequest big = issue_request(OpId::kAgGemm, 16384);
  const TpPlan pb = *plan_tp(big, {}, nullptr, model);
  const TpEstimate fewer = estimate_tp(big, pb.comm_ctas - 1, pb.tile);
  EXPECT_GT(fewer.comm_s, model.comm_finish_fraction * fewer.gemm_s / model.fused_compute_efficiency / 2);
}

TEST(TpPlanModel, AllReduceMovesTwiceTheBytesOfReduceScatter) {
  for (int64_t m : kIssueMs) {
    const TpRequest rs = issue_request(OpId::kGemmRs, m);
    const TpRequest ar = issue_request(OpId::kGemmAr, m);
    const TpEstimate ers = estimate_tp(rs, 0, GemmTile::k128x256);
    const TpEstimate ear = estimate_tp(ar, 0, GemmTile::k128x256);
    EXPECT_DOUBLE_EQ(ear.comm_bytes, 2 * ers.comm_bytes);
    EXPECT_GT(ear.fused_s, ers.fused_s * (1 - 1e-12)) << "M=" << m;
  }
}

TEST(TpPlanModel, AgTransferThatCannotEndEarlySaturatesTheLink) {
  // ag_gemm with a narrow N: the 134 MB shard exchange takes longer than a quarter of the 0.7 ms
  // GEMM whatever the CTA count, so fused gets enough CTAs to saturate NVLink.
  const TpCostModel model;
  TpGemmOptions fused;
  fused.algorithm = TpAlgorithm::kFused;
  const TpPlan p = *plan_tp(small_request(OpId::kAgGemm, 16384, 2048, 8192), fused, nullptr);
  EXPECT_EQ(p.comm_ctas, static_cast<int>(std::ceil(model.nvlink_bytes_per_s / model.comm_cta_bytes_per_s)));
}

TEST(TpPlanModel, SmallShapesAreDecomposed) {
  for (OpId op : kOps) {
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{128, 1024, 1024}, {256, 1024, 1024}, {512, 2048, 2048},
                           {128, 14336, 8192}}) {
      Result<TpPlan> p = plan_tp(small_request(op, m, n, k), {}, nullptr);
      ASSERT_TRUE(p.ok());
      EXPECT_EQ(p->algorithm, TpAlgorithm::kDecomposed) << tp_op_name(op) << " " << m << "x" << n << "x" << k;
    }
  }
}

TEST(TpPlanModel, OneRankIsAPlainGemm) {
  for (OpId op : kOps) {
    const TpRequest r = issue_request(op, 16384, 1);
    Result<TpPlan> p = plan_tp(r, {}, nullptr);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->algorithm, TpAlgorithm::kDecomposed);
    EXPECT_EQ(estimate_tp(r, p->comm_ctas, p->tile).comm_bytes, 0);
  }
}

TEST(TpPlanModel, NothingToHideMeansDecomposed) {
  TpCostModel instant;
  instant.nvlink_bytes_per_s = 1e18;
  instant.comm_cta_bytes_per_s = 1e18;
  Result<TpPlan> p = plan_tp(issue_request(OpId::kGemmRs, 16384), {}, nullptr, instant);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->algorithm, TpAlgorithm::kDecomposed);
}

TEST(TpPlanModel, RequiredGainIsHonoured) {
  TpCostModel strict;
  strict.fused_min_gain = 0.5;
  for (OpId op : kOps) EXPECT_EQ(plan_tp(issue_request(op, 16384), {}, nullptr, strict)->algorithm, TpAlgorithm::kDecomposed);
}

TEST(TpPlanModel, EstimateTermsBehave) {
  const TpCostModel model;
  const TpRequest r = issue_request(OpId::kAgGemm, 8192);
  const GemmTile tile = GemmTile::k128x256;
  double previous = 1e30;
  for (int c = 1; c <= 40; ++c) {
    const TpEstimate e = estimate_tp(r, c, tile);
    EXPECT_LE(e.comm_s, previous) << "c=" << c;
    EXPECT_GE(e.comm_s, e.comm_bytes / model.nvlink_bytes_per_s * (1 - 1e-12));
    EXPECT_GT(e.fused_s, e.gemm_s);
    previous = e.comm_s;
  }
  const TpEstimate e = estimate_tp(r, 8, tile);
  EXPECT_DOUBLE_EQ(e.comm_bytes, 0.5 * 8192 * 8192 * 2);
  EXPECT_DOUBLE_EQ(e.gemm_s, gemm_model_seconds(tile, 8192, 14336, 8192, kSms));
  EXPECT_NEAR(e.decomposed_s, e.comm_bytes / model.nvlink_bytes_per_s + e.gemm_s + model.decomposed_overhead_s, 1e-12);
  // Zero comm CTAs are modelled as one (the value only matters when forced).
  EXPECT_DOUBLE_EQ(estimate_tp(r, 0, tile).comm_s, estimate_tp(r, 1, tile).comm_s);
  // gemm_rs / gemm_ar push from the epilogues at the link's rate, whatever comm_ctas says.
  const TpRequest rs = issue_request(OpId::kGemmRs, 8192);
  EXPECT_DOUBLE_EQ(estimate_tp(rs, 0, tile).comm_s, estimate_tp(rs, 40, tile).comm_s);
  EXPECT_DOUBLE_EQ(estimate_tp(rs, 0, tile).comm_s, estimate_tp(rs, 0, tile).comm_bytes / model.nvlink_bytes_per_s);
}

TEST(TpPlanModel, PlansAreDeterministic) {
  for (OpId op : kOps) {
    const TpPlan a = *plan_tp(issue_request(op, 4096), {}, nullptr);
    const TpPlan b = *plan_tp(issue_request(op, 4096), {}, nullptr);
    EXPECT_EQ(a.algorithm, b.algorithm);
    EXPECT_EQ(a.comm_ctas, b.comm_ctas);
    EXPECT_EQ(a.tile, b.tile);
  }
}

// ---- names -----------------------------------------------------------------------------------------

TEST(TpPlanNames, RoundTripAndUnknownNames) {
  for (OpId op : kOps) EXPECT_EQ(*parse_tp_op(tp_op_name(op)), op);
  for (TpAlgorithm a : {TpAlgorithm::kAuto, TpAlgorithm::kFused, TpAlgorithm::kDecomposed}) {
    EXPECT_EQ(*parse_tp_algorithm(tp_algorithm_name(a)), a);
  }
  EXPECT_EQ(parse_tp_op("all_reduce").status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(parse_tp_algorithm("fastest").status().message(), "expected auto, fused or decomposed"));
}

// ---- tuning cache ----------------------------------------------------------------------------------

TpPlan plan_of(TpAlgorithm a, int ctas, GemmTile tile) {
  TpPlan p;
  p.algorithm = a;
  p.comm_ctas = ctas;
  p.tile = tile;
  return p;
}

TEST(TpTuningCache, HitWinsOverTheModelAndOptionsWinOverTheCache) {
  const TpRequest r = issue_request(OpId::kGemmRs, 4096);
  TuningCache cache;
  cache.put(key_of(r), plan_of(TpAlgorithm::kFused, 24, GemmTile::k128x128));
  Result<TpPlan> p = plan_tp(r, {}, &cache);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->source, "cache");
  EXPECT_EQ(p->comm_ctas, 24);
  EXPECT_EQ(p->tile, GemmTile::k128x128);
  TpGemmOptions o;
  o.comm_ctas = 6;
  p = plan_tp(r, o, &cache);
  EXPECT_EQ(p->comm_ctas, 6);
  EXPECT_EQ(p->tile, GemmTile::k128x128);  // the rest still from the cache
  EXPECT_EQ(p->source, "options");
  // Another shape, layout or world size misses.
  TpRequest other = r;
  other.b_layout = BLayout::kKN;
  EXPECT_EQ(plan_tp(other, {}, &cache)->source, "model");
  other = issue_request(OpId::kGemmRs, 8192);
  EXPECT_EQ(plan_tp(other, {}, &cache)->source, "model");
}

TEST(TpTuningCache, EntryTooLargeForThisDeviceIsIgnored) {
  TpRequest r = issue_request(OpId::kAgGemm, 4096);
  TuningCache cache;
  cache.put(key_of(r), plan_of(TpAlgorithm::kFused, 100, GemmTile::k128x256));
  r.sm_count = 78;
  Result<TpPlan> p = plan_tp(r, {}, &cache);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->source, "model");
  EXPECT_LT(p->comm_ctas, 78);
}

TEST(TpTuningCache, SaveLoadRoundTrip) {
  TempFile file("roundtrip.json");
  TuningCache cache;
  cache.set_gpu("NVIDIA H200");
  std::vector<std::pair<TpKey, TpPlan>> entries;
  int i = 0;
  for (OpId op : kOps) {
    for (int64_t m : {1024, 16384}) {
      TpRequest r = issue_request(op, m);
      r.b_layout = i % 2 ? BLayout::kKN : BLayout::kNK;
      r.dtype = i % 3 ? DType::kBF16 : DType::kF16;
      const TpPlan p = plan_of(i % 2 ? TpAlgorithm::kFused : TpAlgorithm::kDecomposed, 2 + i, i % 2 ? GemmTile::k128x256 : GemmTile::k64x128);
      cache.put(key_of(r), p, 1.5 + i);
      entries.emplace_back(key_of(r), p);
      ++i;
    }
  }
  ASSERT_TRUE(cache.save(file.path).ok());
  Result<TuningCache> loaded = TuningCache::load(file.path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->size(), entries.size());
  EXPECT_EQ(loaded->gpu(), "NVIDIA H200");
  for (const auto& [key, plan] : entries) {
    const TpPlan* hit = loaded->find(key);
    ASSERT_NE(hit, nullptr);
    EXPECT_EQ(hit->algorithm, plan.algorithm);
    EXPECT_EQ(hit->comm_ctas, plan.comm_ctas);
    EXPECT_EQ(hit->tile, plan.tile);
  }
  // Saving what was loaded gives the same bytes (stable order, measured times kept).
  EXPECT_EQ(loaded->to_json_text(), cache.to_json_text());
  EXPECT_TRUE(contains(cache.to_json_text(), "\"ms\": 1.5"));
  EXPECT_TRUE(contains(cache.to_json_text(), "\"format\": \"loom-tuning-cache\""));
}

TEST(TpTuningCache, MissingFileIsEmptyAndUnwritablePathIsASystemError) {
  Result<TuningCache> c = TuningCache::load(::testing::TempDir() + "loom_no_such_cache_file.json");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->size(), 0u);
  Status s = TuningCache{}.save("/nonexistent-dir-for-loom/cache.json");
  EXPECT_EQ(s.code(), StatusCode::kSystemError);
  EXPECT_TRUE(contains(s.message(), "/nonexistent-dir-for-loom/cache.json")) << s.message();
}

std::string cache_text(const std::string& entries, int version = 1) {
  return "{\"format\": \"loom-tuning-cache\", \"version\": " + std::to_string(version) + ", \"entries\": [" + entries + "]}";
}

const char* kGoodEntry =
    R"({"op": "ag_gemm", "m": 4096, "n": 14336, "k": 8192, "world": 2, "dtype": "bf16", "b_layout": "nk",
        "algorithm": "fused", "comm_ctas": 8, "tile": "128x256"})";

std::string entry_with(const std::string& field, const std::string& value) {
  std::string e = kGoodEntry;
  const std::string quoted = "\"" + field + "\": ";
  const size_t at = e.find(quoted);
  if (at == std::string::npos) return e;  // field not present: caller adds it
  const size_t start = at + quoted.size();
  const size_t end = e.find_first_of(",}", start);
  return e.substr(0, start) + value + e.substr(end);
}

std::string entry_without(const std::string& field) {
  std::string e = kGoodEntry;
  const size_t at = e.find("\"" + field + "\": ");
  const size_t end = e.find_first_of(",}", at);
  if (e[end] == ',') return e.substr(0, at) + e.substr(end + 1);
  const size_t comma = e.rfind(',', at);
  return e.substr(0, comma) + e.substr(end);
}

TEST(TpTuningCache, GoodEntryParses) {
  Result<TuningCache> c = TuningCache::parse(cache_text(kGoodEntry), "x.json");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->size(), 1u);
}

TEST(TpTuningCache, MalformedFilesNameTheFileTheEntryAndTheReason) {
  struct Case {
    std::string text;
    std::string reason;
  };
  const std::vector<Case> cases = {
      {"{\"format\": \"loom-tuning-cache\", \"version\": 1, \"entries\": [", "not valid JSON"},
      {"", "not valid JSON"},
      {"[]", "top level must be an object"},
      {R"({"version": 1, "entries": []})", "\"format\" must be \"loom-tuning-cache\""},
      {R"({"format": "something-else", "version": 1, "entries": []})", "is this a loom tuning cache?"},
      {R"({"format": "loom-tuning-cache", "entries": []})", "\"version\" is missing"},
      {cache_text("", 2), "version 2 is not supported (this build reads version 1"},
      {R"({"format": "loom-tuning-cache", "version": 1})", "\"entries\" is missing or not an array"},
      {R"({"format": "loom-tuning-cache", "version": 1, "entries": {}})", "\"entries\" is missing or not an array"},
      {R"({"format": "loom-tuning-cache", "version": 1, "gpu": 5, "entries": []})", "\"gpu\" must be a string"},
      {cache_text("3"), "entry 0: must be an object"},
      {cache_text(entry_without("op")), "entry 0: 'op' is missing"},
      {cache_text(entry_with("op", "\"all_reduce\"")), "entry 0: unknown operator 'all_reduce'"},
      {cache_text(entry_with("m", "\"4096\"")), "entry 0: 'm' must be an integer"},
      {cache_text(entry_with("m", "0")), "entry 0: 'm' = 0 is outside"},
      {cache_text(entry_with("n", "4096.5")), "entry 0: 'n' must be an integer"},
      {cache_text(entry_with("k", "99999999999999999999")), "entry 0: 'k'"},
      {cache_text(entry_with("world", "0")), "entry 0: 'world' = 0 is outside"},
      {cache_text(entry_with("dtype", "\"fp32\"")), "entry 0: dtype fp32 is not supported"},
      {cache_text(entry_with("dtype", "\"int8\"")), "entry 0: unknown dtype 'int8'"},
      {cache_text(entry_with("b_layout", "\"tn\"")), "entry 0: unknown B layout 'tn'"},
      {cache_text(entry_with("algorithm", "\"auto\"")), "entry 0: 'algorithm' must be fused or decomposed"},
      {cache_text(entry_with("algorithm", "7")), "entry 0: 'algorithm' must be a string"},
      {cache_text(entry_with("comm_ctas", "-1")), "entry 0: 'comm_ctas' = -1 is outside"},
      {cache_text(entry_without("comm_ctas")), "entry 0: 'comm_ctas' is missing"},
      {cache_text(entry_with("tile", "\"auto\"")), "entry 0: 'tile' must name a configuration"},
      {cache_text(entry_with("tile", "\"256x256\"")), "entry 0: unknown GEMM tile '256x256'"},
      {cache_text(std::string(kGoodEntry).insert(1, "\"comm_cta\": 3, ")), "entry 0: unknown field 'comm_cta'"},
      {cache_text(std::string(kGoodEntry).insert(1, "\"ms\": -1, ")), "entry 0: 'ms' must be a non-negative number"},
      {cache_text(std::string(kGoodEntry) + ", " + entry_with("comm_ctas", "9") + ", " + kGoodEntry),
       "entry 1 repeats the key of entry 0 (ag_gemm m=4096 n=14336 k=8192 world=2 bf16 nk)"},
  };
  for (const Case& c : cases) {
    TempFile file("malformed.json");
    file.write(c.text);
    Result<TuningCache> loaded = TuningCache::load(file.path);
    ASSERT_FALSE(loaded.ok()) << "accepted: " << c.text;
    EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument) << loaded.status().to_string();
    const std::string& m = loaded.status().message();
    EXPECT_TRUE(contains(m, "tuning cache " + file.path + ": ")) << m;
    EXPECT_TRUE(contains(m, c.reason)) << "want '" << c.reason << "' in: " << m;
  }
}

TEST(TpTuningCache, InformationalFieldsAreAccepted) {
  std::string e = std::string(kGoodEntry).insert(1, R"("ms": 4.7, "gpu": "NVIDIA H200", "note": "tuned", )");
  Result<TuningCache> c = TuningCache::parse(cache_text(e), "x.json");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->size(), 1u);
}

TEST(TpTuningCacheEnv, UnsetMeansNoCache) {
  ScopedEnv env("LOOM_TUNING_CACHE", nullptr);
  Result<const TuningCache*> c = tuning_cache_from_env();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, nullptr);
}

TEST(TpTuningCacheEnv, EmptyValueIsInvalid) {
  ScopedEnv env("LOOM_TUNING_CACHE", "");
  Result<const TuningCache*> c = tuning_cache_from_env();
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(c.status().message(), "LOOM_TUNING_CACHE is set but empty")) << c.status().message();
}

TEST(TpTuningCacheEnv, FileIsReadOnceAndUsedByThePlanner) {
  TempFile file("env_good.json");
  const TpRequest r = issue_request(OpId::kAgGemm, 4096);
  TuningCache written;
  written.put(key_of(r), plan_of(TpAlgorithm::kFused, 17, GemmTile::k128x128));
  ASSERT_TRUE(written.save(file.path).ok());
  ScopedEnv env("LOOM_TUNING_CACHE", file.path.c_str());
  Result<const TuningCache*> c = tuning_cache_from_env();
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ASSERT_NE(*c, nullptr);
  EXPECT_EQ((*c)->size(), 1u);
  EXPECT_EQ(*tuning_cache_from_env(), *c);  // the same object on later calls
  Result<TpPlan> p = plan_tp(r, {}, *c);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->comm_ctas, 17);
  EXPECT_EQ(p->source, "cache");
}

TEST(TpTuningCacheEnv, MalformedFileIsReportedOnEveryCall) {
  TempFile file("env_bad.json");
  file.write(cache_text(entry_with("tile", "\"huge\"")));
  ScopedEnv env("LOOM_TUNING_CACHE", file.path.c_str());
  for (int i = 0; i < 2; ++i) {
    Result<const TuningCache*> c = tuning_cache_from_env();
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(c.status().message(), "LOOM_TUNING_CACHE: tuning cache " + file.path + ": entry 0: unknown GEMM tile"))
        << c.status().message();
  }
}

TEST(TpTuningCacheEnv, MissingFileIsAnEmptyCache) {
  const std::string path = ::testing::TempDir() + "loom_tp_plan_not_written_yet.json";
  ScopedEnv env("LOOM_TUNING_CACHE", path.c_str());
  Result<const TuningCache*> c = tuning_cache_from_env();
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ASSERT_NE(*c, nullptr);
  EXPECT_EQ((*c)->size(), 0u);
}

}  // namespace
}  // namespace loom::planner
