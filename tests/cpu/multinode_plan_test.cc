// The multi-node planner (planner/multinode_plan.h): roles, tile, layout and workspace of each
// operator, and the options it refuses rather than ignores (comm_ctas, tail_pieces, decomposed).
#include <gtest/gtest.h>

#include <string>

#include "planner/multinode_plan.h"
#include "planner/tp_plan.h"

namespace loom::planner {
namespace {

namespace kmn = kernels::tp::multinode;

MultiNodeRequest request(OpId op, uint32_t nodes, uint32_t local, int64_t m = 8192, int64_t n = 4096, int64_t k = 2048) {
  MultiNodeRequest r;
  r.op = op;
  r.m = m;
  r.n = n;
  r.k = k;
  r.dtype = DType::kBF16;
  r.b_layout = BLayout::kNK;
  r.grid.nodes = nodes;
  r.grid.local = local;
  r.grid.node = 1 % nodes;
  r.grid.me = local - 1;
  r.sm_count = 132;
  r.plan_sm_count = 132;
  r.flag_base = 16;
  r.flag_capacity = 1u << 20;
  return r;
}

bool contains(const Status& s, const std::string& part) { return s.message().find(part) != std::string::npos; }

TEST(MultiNodePlan, RolesFollowTheOperatorAndTheGpusPerNode) {
  struct Case {
    OpId op;
    uint32_t local;
    uint32_t send, recv, nvlink;
  };
  for (const Case& c : {Case{OpId::kAgGemm, 1, 1, 0, 0}, Case{OpId::kAgGemm, 2, 1, 1, 2}, Case{OpId::kAgGemm, 8, 1, 4, 2},
                        Case{OpId::kGemmRs, 4, 1, 0, 0}, Case{OpId::kGemmAr, 1, 1, 0, 0}, Case{OpId::kGemmAr, 3, 1, 2, 0}}) {
    Result<MultiNodePlan> p = plan_multinode(request(c.op, 2, c.local, 1024 * 2 * c.local), {});
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    EXPECT_EQ(p->roles.count(kmn::CtaRole::kNetSend), c.send);
    EXPECT_EQ(p->roles.count(kmn::CtaRole::kNetRecv), c.recv) << "L = " << c.local;
    EXPECT_EQ(p->roles.count(kmn::CtaRole::kNvlink), c.nvlink) << "L = " << c.local;
    EXPECT_EQ(p->grid, 132);
    EXPECT_LT(p->roles.rest_begin(), 132u) << "a compute CTA is left";
  }
}

TEST(MultiNodePlan, CommCtasAndTailPiecesAreRefusedNotIgnored) {
  for (OpId op : {OpId::kAgGemm, OpId::kGemmRs, OpId::kGemmAr}) {
    TpGemmOptions o;
    o.comm_ctas = 8;
    Result<MultiNodePlan> p = plan_multinode(request(op, 2, 2), o);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
    EXPECT_TRUE(contains(p.status(), "role split is fixed")) << p.status().to_string();
    EXPECT_TRUE(contains(p.status(), std::string(tp_op_name(op)))) << p.status().to_string();
    o.comm_ctas = -1;
    o.tail_pieces = 4;
    p = plan_multinode(request(op, 2, 2), o);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
    EXPECT_TRUE(contains(p.status(), "no tail split")) << p.status().to_string();
    for (int none : {-1, 0, 1}) {
      o.tail_pieces = none;
      EXPECT_TRUE(plan_multinode(request(op, 2, 2), o).ok()) << "tail_pieces " << none << " asks for no split";
    }
  }
}

TEST(MultiNodePlan, RefusesWhatOnlyOneNodeHas) {
  TpGemmOptions o;
  o.algorithm = TpAlgorithm::kDecomposed;
  Result<MultiNodePlan> p = plan_multinode(request(OpId::kGemmRs, 2, 2), o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(contains(p.status(), "no decomposed path")) << p.status().to_string();
  o = {};
  o.tile = GemmTile::k64x128;
  p = plan_multinode(request(OpId::kGemmRs, 2, 2), o);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(contains(p.status(), "128x256 and 128x128")) << p.status().to_string();
  o.tile = GemmTile::k128x128;
  p = plan_multinode(request(OpId::kGemmRs, 2, 2), o);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->tile, GemmTile::k128x128);
}

TEST(MultiNodePlan, ShapeRulesUseTheGlobalWorld) {
  // W = 2 x 2: 256 rows give each rank 64, not a whole 128-row tile.
  Result<MultiNodePlan> p = plan_multinode(request(OpId::kAgGemm, 2, 2, 256), {});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(contains(p.status(), "M/W = 64 rows must be a multiple of 128")) << p.status().to_string();
  p = plan_multinode(request(OpId::kAgGemm, 2, 2, 8190), {});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(p.status(), "(2 nodes x 2 GPUs)")) << p.status().to_string();
  MultiNodeRequest r = request(OpId::kGemmAr, 2, 2);
  r.dtype = DType::kF32;
  p = plan_multinode(r, {});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
}

TEST(MultiNodePlan, WorkspaceIsWhatTheLayoutsNeed) {
  MultiNodeRequest r = request(OpId::kAgGemm, 2, 2);
  Result<MultiNodePlan> p = plan_multinode(r, {});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->workspace_bytes, static_cast<size_t>(r.m * r.k) * 2) << "the gathered A";
  EXPECT_EQ(p->flags, p->ag.flags());
  r.gathered_a = true;
  p = plan_multinode(r, {});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->workspace_bytes, 0u) << "the caller's gathered A";
  for (OpId op : {OpId::kGemmRs, OpId::kGemmAr}) {
    r = request(op, 2, 2);
    p = plan_multinode(r, {});
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    const size_t row_bytes = static_cast<size_t>(r.n) * 2;
    EXPECT_EQ(p->fold_bytes % 1024, 0u);
    EXPECT_GE(p->fold_bytes, p->reduce.fold_rows() * row_bytes);
    EXPECT_EQ(p->workspace_bytes, p->fold_bytes + p->reduce.send_rows() * row_bytes);
    EXPECT_EQ(p->reduce.all_reduce, op == OpId::kGemmAr ? 1u : 0u);
    EXPECT_EQ(p->group_m % p->ramp_m, 0u) << "raster groups grow from one chunk in whole chunks";
  }
}

TEST(MultiNodePlan, RefusesWhatTheWindowOrTheGpuCannotHold) {
  MultiNodeRequest r = request(OpId::kGemmRs, 2, 2);
  r.flag_capacity = 64;
  Result<MultiNodePlan> p = plan_multinode(r, {});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(contains(p.status(), "network-window flags")) << p.status().to_string();
  r = request(OpId::kAgGemm, 2, 8);
  r.sm_count = r.plan_sm_count = 4;  // 1 send + 4 receive + 2 NVLink CTAs
  p = plan_multinode(r, {});
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(contains(p.status(), "too few SMs")) << p.status().to_string();
}

}  // namespace
}  // namespace loom::planner
