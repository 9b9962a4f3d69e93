// The MoE family's host side: which configs run (and the refusals' codes), the buffer layouts
// and their size formulas, the grids and role splits, the launch signature; and the routing
// reference the GPU tests compare the kernels with, on cases computed by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <set>
#include <type_traits>
#include <vector>

#include "kernels/moe/flags.h"
#include "kernels/moe/layout.h"
#include "loom/loom.h"
#include "planner/moe_plan.h"
#include "common/moe_reference.h"  // tests/ is on the CPU tests' include path

namespace loom::planner {
namespace {

// The public calls' signatures (checked at compile time: the CPU tests link no CUDA code).
static_assert(std::is_same_v<decltype(&moe_routing),
                             Result<MoePlan> (*)(Communicator&, const MoeConfig&, const MoeRoutingArgs&, cudaStream_t)>,
              "loom/moe.h must declare loom::moe_routing");
static_assert(std::is_same_v<decltype(&moe_dispatch), Status (*)(Communicator&, const MoePlan&, const void*, void*,
                                                                  cudaStream_t, const MoeDispatchOptions&)>,
              "loom/moe.h must declare loom::moe_dispatch");
static_assert(std::is_same_v<decltype(&moe_combine), Status (*)(Communicator&, const MoePlan&, const MoeCombineArgs&,
                                                                 cudaStream_t, const MoeCombineOptions&)>,
              "loom/moe.h must declare loom::moe_combine");
static_assert(std::is_same_v<decltype(&moe_report), Result<MoeReport> (*)(Communicator&, const MoePlan&, cudaStream_t)>,
              "loom/moe.h must declare loom::moe_report");
static_assert(std::is_same_v<decltype(&moe_layer),
                             Status (*)(Communicator&, const MoePlan&, const void*, const MoeLayerWeights&,
                                        const MoeLayerBuffers&, void*, cudaStream_t, const MoeLayerOptions&)>,
              "loom/moe.h must declare loom::moe_layer");

namespace km = kernels::moe;
using km::MoeTunables;

MoeRequest request(int64_t experts, int top_k, int64_t hidden, int64_t max_tokens, int world, int64_t capacity = 0,
                   int nodes = 1) {
  MoeRequest r;
  r.config.num_experts = experts;
  r.config.top_k = top_k;
  r.config.hidden = hidden;
  r.config.dtype = DType::kBF16;
  r.config.max_tokens = max_tokens;
  r.config.capacity = capacity;
  r.world = world;
  r.num_nodes = nodes;
  return r;
}

StatusCode code_of(const MoeRequest& r) { return plan_moe(r).status().code(); }

TEST(MoePlan, DefaultsRefuseOverflowAndUseTheRoutingWeights) {
  const MoeConfig c;
  EXPECT_EQ(c.overflow, MoeOverflow::kError);
  EXPECT_EQ(c.capacity, 0);
  const MoeCombineArgs a;
  EXPECT_EQ(a.topk_weights, nullptr);
  EXPECT_EQ(a.hidden, 0);
  EXPECT_EQ(MoeDispatchOptions{}.num_ctas, 0);
}

TEST(MoePlan, DeepSeekSliceSizes) {
  // 256 experts over 8 ranks, top-8, H 7168 bf16, 4096 tokens per rank, default capacity.
  Result<MoeLayouts> l = plan_moe(request(256, 8, 7168, 4096, 8));
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->local_experts, 32);
  EXPECT_EQ(l->row_bytes, 7168u * 2);
  EXPECT_EQ(l->capacity, 4096 * 8 * 8);  // every token of every rank, k rows each
  const MoeSizes s = l->sizes();
  EXPECT_EQ(s.recv_bytes, static_cast<size_t>(4096) * 8 * 8 * 7168 * 2);
  EXPECT_EQ(s.plan_bytes, l->plan.bytes);
  EXPECT_EQ(s.workspace_bytes, l->workspace.bytes);
}

TEST(MoePlan, PlanLayoutFollowsItsFormula) {
  const uint64_t tmax = 1000, k = 6, e = 384;
  const km::PlanLayout p = km::PlanLayout::make(tmax, static_cast<uint32_t>(k), static_cast<uint32_t>(e), 3);
  const std::vector<uint64_t> starts{p.status, p.slot_dest, p.slot_weight, p.chunk_counts, p.send_base, p.token_nodes, p.bytes};
  const std::vector<uint64_t> sizes{sizeof(km::MoeStatusWords), 4 * tmax * k, 4 * tmax * k,
                                    4 * km::routing_chunks(tmax) * e, 4 * e, 8 * tmax};
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    EXPECT_EQ(starts[i] % 256, 0u) << "region " << i;
    EXPECT_GE(starts[i + 1] - starts[i], sizes[i]) << "region " << i << " is too small";
    EXPECT_LT(starts[i + 1] - starts[i], sizes[i] + 256) << "region " << i << " wastes more than its alignment";
  }
  EXPECT_EQ(km::routing_chunks(1000), 4u);  // ceil(1000 / 256)
  // One node: no per-token node masks.
  const km::PlanLayout one = km::PlanLayout::make(tmax, static_cast<uint32_t>(k), static_cast<uint32_t>(e), 1);
  EXPECT_EQ(one.bytes, one.token_nodes);
}

// The workspace of a job of N nodes x L ranks: every region at least its formula's size, in order,
// the three zeroed ranges tiling the flag regions; on one node the network regions are empty.
void check_workspace(uint32_t nodes, uint32_t local) {
  km::MoeShape shape;
  shape.world = nodes * local;
  shape.nodes = nodes;
  shape.experts = 64;
  shape.top_k = 6;
  shape.max_tokens = 3000;
  shape.capacity = 5000;
  shape.row_bytes = 7168 * 2;
  shape.hidden = 7168;
  const km::WorkspaceLayout l = km::WorkspaceLayout::make(shape);
  const uint64_t w = shape.world, e = shape.experts, tmax = shape.max_tokens, cap = shape.capacity;
  const uint64_t remote = nodes - 1, q = nodes > 1 ? km::net_chunks(tmax) : 0;
  const uint64_t eb = nodes > 1 ? km::net_entry_bytes(shape.top_k, shape.row_bytes) : 0;
  const uint64_t pb = nodes > 1 ? 4 * shape.hidden : 0;
  const std::vector<uint64_t> starts{l.count_table, l.count_flags, l.node_tokens, l.chunk_flags, l.routing_words,
                                     l.arrival,     l.ready,       l.send_fill,   l.sent_chunks, l.send_count,
                                     l.pushes_done, l.hidden_done, l.out_done,    l.out_ready,
                                     l.read_done,   l.done,        l.ret_count,   l.ret_sent,    l.rows,
                                     l.tiles,       l.staged_epoch, l.token_pos,  l.send_window, l.staging,
                                     l.ret_window,  l.partials,    l.bytes};
  const uint64_t blocks = km::arrival_blocks(cap);
  // tiles: the table of moe_dispatch_gemm and moe_layer, 16 bytes of header and 16 per tile row,
  // Tr = ceil(C / 64) + E / W rows; moe_layer's counters: 8 bytes per tile row and per shared
  // expert tile row (Ts = ceil(Tmax / 64)), its flags 8 per row of align_up(C, 128) + Tmax
  const uint64_t tile_rows = (cap + 63) / 64 + e / w;
  const uint64_t layer_tile_rows = (tmax + 63) / 64 + tile_rows;
  const uint64_t layer_rows = (cap + 127) / 128 * 128 + tmax;
  const std::vector<uint64_t> sizes{4 * w * km::count_row_ints(shape.experts, nodes), 8 * w, 4ull * nodes,
                                    8 * km::routing_chunks(tmax), 16, 8 * blocks, 8 * blocks, 4 * remote, 8 * remote,
                                    4 * remote * q, 8, 8 * layer_tile_rows, 8 * layer_tile_rows, 8 * layer_rows,
                                    8ull * MoeTunables::kMaxCtas, 8ull * local, 4 * remote * q, 8 * remote,
                                    16 * cap, 16 + 16 * tile_rows, nodes > 1 ? 8u : 0u,
                                    4 * tmax * remote, remote * tmax * eb, remote * tmax * eb, remote * tmax * pb,
                                    remote * tmax * pb};
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    EXPECT_EQ(starts[i] % 256, 0u) << "region " << i;
    EXPECT_GE(starts[i + 1] - starts[i], sizes[i]) << "region " << i << " is too small";
    EXPECT_LT(starts[i + 1] - starts[i], sizes[i] + 256 + (i == 4 ? 256 : 0)) << "region " << i << " is too large";
  }
  EXPECT_EQ(blocks, (cap + MoeTunables::kArrivalRows - 1) / MoeTunables::kArrivalRows);
  EXPECT_EQ(km::count_row_ints(shape.experts, nodes) % 4, 0u);
  EXPECT_GE(km::count_row_ints(shape.experts, nodes), e + nodes + km::kCountHeaderInts);
  // The three zeroed ranges tile the flag regions but moe_layer's (which it zeroes with the
  // dispatch's and the combine's); the row origins and windows are never zeroed.
  EXPECT_EQ(l.routing_zero_begin(), 0u);
  EXPECT_EQ(l.routing_zero_end(), l.dispatch_zero_begin());
  EXPECT_EQ(l.dispatch_zero_end(), l.hidden_done);
  EXPECT_EQ(l.out_ready + km::align_up(8 * layer_rows, 256), l.combine_zero_begin());
  EXPECT_EQ(km::layer_rows(cap, tmax, true), layer_rows);
  EXPECT_EQ(km::layer_rows(cap, tmax, false), cap);
  EXPECT_EQ(l.combine_zero_end(), l.rows);
  EXPECT_EQ(l.window_chunks, q);
  EXPECT_EQ(l.entry_bytes, eb);
  EXPECT_EQ(l.partial_bytes, pb);
}

TEST(MoePlan, WorkspaceRegionsAreOrderedAndEachCallZeroesItsOwn) {
  check_workspace(1, 4);
  check_workspace(2, 4);
  check_workspace(4, 2);
  EXPECT_EQ(km::net_header_bytes(6), 64u);  // 16 + 8 * 6 = 64
  EXPECT_EQ(km::net_header_bytes(8), 80u);
  EXPECT_EQ(km::net_chunks(3000), 47u);
}

// Each node's index of the others: a rank of node a keeps what goes to node b at remote_slot(a, b),
// and node b names it remote_slot(b, a); remote_node inverts remote_slot.
TEST(MoePlan, RemoteSlotsAreABijection) {
  for (uint32_t nodes = 2; nodes <= 5; ++nodes) {
    for (uint32_t a = 0; a < nodes; ++a) {
      std::set<uint32_t> slots;
      for (uint32_t b = 0; b < nodes; ++b) {
        if (b == a) continue;
        const uint32_t i = km::remote_slot(a, b, nodes);
        EXPECT_LT(i, nodes - 1);
        EXPECT_EQ(km::remote_node(a, i, nodes), b);
        slots.insert(i);
      }
      EXPECT_EQ(slots.size(), nodes - 1);
    }
  }
}

// The push order's buckets: in row order, never split an arrival block (a bucket is a whole number
// of them), all in range, and a token with no destination (first row >= C) goes last.
TEST(MoePlan, PushSortBucketsFollowTheReceiveRows) {
  constexpr uint32_t kBuckets = km::MoeTunables::kPushSortBuckets;
  constexpr uint32_t kRows = km::MoeTunables::kArrivalRows;
  for (const uint32_t capacity : {1u, 63u, 64u, 1000u, kBuckets * kRows, kBuckets * kRows + 1, 3'000'000u, 0xffffffffu}) {
    uint32_t previous = 0;
    for (uint64_t row = 0; row < capacity; row += std::max<uint64_t>(1, capacity / 4099)) {
      const uint32_t b = km::push_sort_bucket(static_cast<uint32_t>(row), capacity);
      EXPECT_LT(b, kBuckets) << "C " << capacity << " row " << row;
      EXPECT_GE(b, previous) << "C " << capacity << " row " << row << ": buckets must follow the rows";
      EXPECT_EQ(b, km::push_sort_bucket(static_cast<uint32_t>(row / kRows * kRows), capacity))
          << "C " << capacity << " row " << row << ": an arrival block's rows must share a bucket";
      previous = b;
    }
    EXPECT_EQ(km::push_sort_bucket(capacity, capacity), kBuckets - 1) << "C " << capacity;
    EXPECT_EQ(km::push_sort_bucket(0xffffffffu, capacity), kBuckets - 1) << "C " << capacity;
  }
  // Up to kBuckets arrival blocks, each block has a bucket of its own.
  EXPECT_EQ(km::push_sort_bucket(kRows, kBuckets * kRows), 1u);
  EXPECT_EQ(km::push_sort_bucket(kBuckets * kRows - 1, kBuckets * kRows), kBuckets - 1);
  EXPECT_EQ(km::push_sort_bucket(kRows - 1, 1000), 0u);
}

TEST(MoePlan, HostCheckableInputIsRefusedWithItsCode) {
  EXPECT_EQ(code_of(request(64, 4, 1024, 100, 4)), StatusCode::kOk);
  MoeRequest nodes = request(64, 4, 1024, 100, 4);
  nodes.num_nodes = 2;
  EXPECT_EQ(code_of(nodes), StatusCode::kOk);  // 2 nodes x 2 ranks
  EXPECT_EQ(code_of(request(66, 4, 1024, 100, 4)), StatusCode::kInvalidArgument);  // E % W
  EXPECT_EQ(code_of(request(8, 9, 1024, 100, 2)), StatusCode::kInvalidArgument);   // k > E
  EXPECT_EQ(code_of(request(64, 33, 1024, 100, 2)), StatusCode::kUnsupported);     // k > 32
  EXPECT_EQ(code_of(request(2048, 4, 1024, 100, 2)), StatusCode::kUnsupported);    // E > 1024
  EXPECT_EQ(code_of(request(0, 4, 1024, 100, 2)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of(request(64, 0, 1024, 100, 2)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of(request(64, 4, 0, 100, 2)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of(request(64, 4, 1001, 100, 2)), StatusCode::kInvalidArgument);  // 2002-byte rows
  EXPECT_EQ(code_of(request(64, 4, 1024, -1, 2)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of(request(64, 4, 1024, 100, 2, -5)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of(request(66, 4, 1024, 100, 33)), StatusCode::kUnsupported);  // 32-bit rank masks
  EXPECT_EQ(code_of(request(64, 4, 1024, 100, 64, 0, 2)), StatusCode::kOk);    // 32 per node
  EXPECT_EQ(code_of(request(512, 4, 1024, 100, 512, 0, 16)), StatusCode::kUnsupported);  // W > kMaxWorld
  EXPECT_EQ(code_of(request(128, 4, 1024, 100, 128, 0, 128)), StatusCode::kUnsupported);  // N > kMaxNodes
  EXPECT_EQ(code_of(request(64, 4, 1024, 100, 8, 0, 3)), StatusCode::kInvalidArgument);  // 8 ranks on 3 nodes
  // Per-launch network flags: (N - 1) * ceil(Tmax / 64) must fit the flag window.
  EXPECT_EQ(code_of(request(64, 4, 1024, 64 * 60000, 8, 1 << 20, 4)), StatusCode::kUnsupported);
  EXPECT_EQ(code_of(request(64, 8, 1024, INT32_MAX / 4, 2)), StatusCode::kUnsupported);  // T*k past int32
  EXPECT_EQ(code_of(request(64, 4, 1024, 100, 4, INT32_MAX / 2)), StatusCode::kUnsupported);  // W*C past int32
  // fp32 rows: 4 x 4 = 16 bytes are fine.
  MoeRequest f32 = request(64, 4, 4, 100, 2);
  f32.config.dtype = DType::kF32;
  EXPECT_EQ(code_of(f32), StatusCode::kOk);
}

TEST(MoePlan, RefusalsSayWhy) {
  const Status s = plan_moe(request(8, 9, 1024, 100, 2)).status();
  EXPECT_NE(s.message().find("top_k 9 is larger than the expert count 8"), std::string::npos) << s.message();
  const Status w = plan_moe(request(66, 4, 1024, 100, 4)).status();
  EXPECT_NE(w.message().find("not a multiple of the 4 ranks"), std::string::npos) << w.message();
}

TEST(MoePlan, ZeroTokensStillPlan) {
  Result<MoeLayouts> l = plan_moe(request(16, 2, 256, 0, 2));
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_GE(l->capacity, 1);
  EXPECT_EQ(plan_moe_routing_grid(0, 132), 1);  // the coordinator exchanges counts even with no token
}

TEST(MoePlan, DispatchGridKeepsBothRoles) {
  Result<MoeDispatchGrid> g = plan_moe_dispatch(132, 0, 0);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->grid, 132);
  EXPECT_EQ(g->arrival_ctas, 132 / MoeTunables::kArrivalShareDen);
  g = plan_moe_dispatch(2, 0, 0);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->grid, 2);
  EXPECT_EQ(g->arrival_ctas, 1);
  EXPECT_EQ(plan_moe_dispatch(1, 0, 0).status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(plan_moe_dispatch(132, 8, 8).status().code(), StatusCode::kInvalidArgument);   // no pushing CTA
  EXPECT_EQ(plan_moe_dispatch(132, 200, 0).status().code(), StatusCode::kInvalidArgument);  // more than the SMs
  g = plan_moe_dispatch(132, 16, 3);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->grid, 16);
  EXPECT_EQ(g->arrival_ctas, 3);
  EXPECT_EQ(g->forward_ctas, 0);
  // Several nodes: a forwarding role too, and one more CTA at least.
  g = plan_moe_dispatch(132, 0, 0, 2);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->forward_ctas, 132 / MoeTunables::kForwardShareDen);
  EXPECT_LT(g->arrival_ctas + g->forward_ctas, g->grid);
  EXPECT_EQ(plan_moe_dispatch(2, 0, 0, 2).status().code(), StatusCode::kUnsupported);
  g = plan_moe_dispatch(3, 0, 0, 2);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->forward_ctas, 1);
  EXPECT_EQ(g->arrival_ctas, 1);
}

// moe_dispatch_gemm's grid: the planner's shares, both data roles at least one CTA, the two
// tiles it is built for, and refusals that name their rule.
TEST(MoePlan, DispatchGemmGridAndTiles) {
  MoePlan plan;
  plan.config.num_experts = 64;
  plan.config.top_k = 8;
  plan.config.hidden = 7168;
  plan.config.max_tokens = 4096;
  plan.capacity = 4096 * 8;
  plan.num_tokens = 4096;
  MoeRequest r;
  r.config = plan.config;
  r.world = 2;
  Result<MoeLayouts> l = plan_moe(r);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  // Addresses far apart (never dereferenced: the host checks only compare ranges).
  auto at = [](uintptr_t tib) { return reinterpret_cast<char*>(tib << 40); };
  char *recv = at(1), *weights = at(2), *out = at(3), *table = at(4);
  plan.expert_offsets = reinterpret_cast<const int32_t*>(at(5));
  MoeExpertGemm g;
  g.weights = weights;
  g.n = 4096;
  g.activation = GroupedActivation::kSwiGLU;
  g.out = out;
  const GroupedGemmArgs args = dispatch_gemm_grouped_args(plan, *l, recv, g, table);
  EXPECT_EQ(args.num_experts, 32);
  EXPECT_EQ(args.m_total, l->capacity);
  EXPECT_EQ(args.k, 7168);
  EXPECT_EQ(args.workspace_bytes, grouped_gemm_workspace_bytes(args));  // the workspace's tiles region fits
  const GemmDeviceLimits h200{132, 232448};
  const MoeJob two_ranks{2, 1};
  Result<MoeDispatchGemmPlan> p = plan_moe_dispatch_gemm(args, {}, h200, two_ranks);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->grid, 132);
  EXPECT_EQ(p->gemm.num_ctas, 132);
  EXPECT_EQ(p->push_ctas, 132 / MoeTunables::kFusedPushShareDen);
  EXPECT_EQ(p->arrival_ctas, 132 / MoeTunables::kFusedArrivalShareDen);
  EXPECT_TRUE(p->gemm.tile == GemmTile::k128x256 || p->gemm.tile == GemmTile::k128x128);
  MoeDispatchGemmOptions o;
  o.num_ctas = 2;
  p = plan_moe_dispatch_gemm(args, o, h200, two_ranks);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->push_ctas, 1);
  EXPECT_EQ(p->arrival_ctas, 1);
  // One rank: the pushing warps complete the receive blocks, so no arrival CTA unless asked for.
  p = plan_moe_dispatch_gemm(args, {}, h200);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->push_ctas, 132 / MoeTunables::kFusedPushShareDenOneRank);
  EXPECT_EQ(p->arrival_ctas, 0);
  p = plan_moe_dispatch_gemm(args, o, h200);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->push_ctas, 1);
  EXPECT_EQ(p->arrival_ctas, 0);
  o.arrival_ctas = 4;
  o.num_ctas = 0;
  p = plan_moe_dispatch_gemm(args, o, h200);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->arrival_ctas, 4);
  o = {};
  o.num_ctas = 1;
  EXPECT_EQ(plan_moe_dispatch_gemm(args, o, h200).status().code(), StatusCode::kInvalidArgument);
  o.num_ctas = 133;
  EXPECT_EQ(plan_moe_dispatch_gemm(args, o, h200).status().code(), StatusCode::kInvalidArgument);
  o = {};
  o.push_ctas = 100;
  o.arrival_ctas = 40;
  const Status crowded = plan_moe_dispatch_gemm(args, o, h200).status();
  EXPECT_EQ(crowded.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(crowded.message().find("exceed the grid"), std::string::npos) << crowded.message();
  o = {};
  o.tile = GemmTile::k128x64;
  EXPECT_EQ(plan_moe_dispatch_gemm(args, o, h200).status().code(), StatusCode::kUnsupported);
  o.tile = GemmTile::k128x128;
  p = plan_moe_dispatch_gemm(args, o, h200);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->gemm.tile, GemmTile::k128x128);
  EXPECT_EQ(plan_moe_dispatch_gemm(args, {}, GemmDeviceLimits{1, 232448}).status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(p->forward_ctas, 0);
  // Several nodes: forwarding CTAs too (then they compute), within the grid.
  const MoeJob two_nodes{2, 2};
  p = plan_moe_dispatch_gemm(args, {}, h200, two_nodes);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->forward_ctas, 132 / MoeTunables::kFusedForwardShareDen);
  EXPECT_LE(p->push_ctas + p->arrival_ctas + p->forward_ctas, p->grid);
  o = {};
  o.num_ctas = 2;
  EXPECT_EQ(plan_moe_dispatch_gemm(args, o, h200, two_nodes).status().code(), StatusCode::kInvalidArgument);  // 3 roles, 2 CTAs

  // moe_layer: up is the dispatch_gemm's GEMM (K = H, N = 2I, SwiGLU into hidden), down K = I,
  // N = H into expert_out; both on one tile (one tile table), the same grid and roles.
  char *down_weights = at(6), *hidden = at(7), *expert_out = at(8);
  MoeLayerWeights lw{weights, down_weights, 2048};
  MoeLayerBuffers lb{recv, hidden, expert_out};
  const GroupedGemmArgs up = layer_up_args(plan, *l, lw, lb, table);
  const GroupedGemmArgs down = layer_down_args(plan, *l, lw, lb, table);
  EXPECT_EQ(up.n, 4096);
  EXPECT_EQ(up.k, 7168);
  EXPECT_EQ(up.activation, GroupedActivation::kSwiGLU);
  EXPECT_EQ(up.d, hidden);
  EXPECT_EQ(down.a, hidden);
  EXPECT_EQ(down.n, 7168);
  EXPECT_EQ(down.k, 2048);
  EXPECT_EQ(down.activation, GroupedActivation::kNone);
  EXPECT_EQ(down.d, expert_out);
  EXPECT_EQ(down.workspace, up.workspace);
  Result<MoeLayerPlan> layer = plan_moe_layer(up, down, {}, h200);
  ASSERT_TRUE(layer.ok()) << layer.status().to_string();
  EXPECT_EQ(layer->up.tile, layer->down.tile);
  EXPECT_EQ(layer->up.max_tile_rows, layer->down.max_tile_rows);
  EXPECT_EQ(layer->grid, 132);
  EXPECT_EQ(layer->down.num_ctas, 132);
  EXPECT_EQ(layer->up.n_blocks, 4096 / gemm_tile_info(layer->up.tile).block_n);
  EXPECT_EQ(layer->forward_ctas, 0);
  EXPECT_EQ(layer->arrival_ctas, 0);  // one rank
  EXPECT_EQ(layer->push_ctas, 132 / MoeTunables::kFusedPushShareDenOneRank);
  // Several nodes: the layer's forwarding CTAs are moe_dispatch_gemm's (then they compute).
  layer = plan_moe_layer(up, down, {}, h200, two_nodes);
  ASSERT_TRUE(layer.ok()) << layer.status().to_string();
  EXPECT_EQ(layer->forward_ctas, 132 / MoeTunables::kFusedForwardShareDen);
  EXPECT_LE(layer->push_ctas + layer->arrival_ctas + layer->forward_ctas, layer->grid);
  MoeLayerOptions two_ctas;
  two_ctas.num_ctas = 2;  // three roles
  EXPECT_EQ(plan_moe_layer(up, down, two_ctas, h200, two_nodes).status().code(), StatusCode::kInvalidArgument);
  layer = plan_moe_layer(up, down, {}, h200);
  ASSERT_TRUE(layer.ok()) << layer.status().to_string();
  MoeLayerOptions lo;
  lo.tile = GemmTile::k64x128;
  EXPECT_EQ(plan_moe_layer(up, down, lo, h200).status().code(), StatusCode::kUnsupported);
  lo.tile = GemmTile::k128x128;
  layer = plan_moe_layer(up, down, lo, h200);
  ASSERT_TRUE(layer.ok()) << layer.status().to_string();
  EXPECT_EQ(layer->down.tile, GemmTile::k128x128);
}

TEST(MoePlan, RoutingAndCombineGrids) {
  const int64_t per_cta = static_cast<int64_t>(MoeTunables::kChunkTokens) * MoeTunables::kWarps;
  EXPECT_EQ(plan_moe_routing_grid(1, 132), 1);
  EXPECT_EQ(plan_moe_routing_grid(5 * per_cta, 132), 5);
  EXPECT_EQ(plan_moe_routing_grid(5 * per_cta + 1, 132), 6);
  EXPECT_EQ(plan_moe_routing_grid(1000 * per_cta, 132), 132);
  EXPECT_EQ(plan_moe_combine_grid(0, 132, 0)->grid, 1);
  EXPECT_EQ(plan_moe_combine_grid(MoeTunables::kWarps * 10, 132, 0)->grid, 10);
  EXPECT_EQ(plan_moe_combine_grid(1 << 20, 132, 0)->grid, 132);
  EXPECT_EQ(plan_moe_combine_grid(100, 132, 7)->grid, 7);
  EXPECT_EQ(plan_moe_combine_grid(100, 132, 7)->forward_ctas, 0);
  EXPECT_EQ(plan_moe_combine_grid(100, 132, 133).status().code(), StatusCode::kInvalidArgument);
  // Several nodes: every SM by default (other nodes' tokens are work too), a forwarding share.
  EXPECT_EQ(plan_moe_combine_grid(0, 132, 0, 2)->grid, 132);
  EXPECT_EQ(plan_moe_combine_grid(0, 132, 0, 2)->forward_ctas, 132 / MoeTunables::kForwardShareDen);
  EXPECT_EQ(plan_moe_combine_grid(0, 132, 2, 2)->forward_ctas, 1);
  EXPECT_EQ(plan_moe_combine_grid(0, 132, 1, 2).status().code(), StatusCode::kInvalidArgument);
}

TEST(MoePlan, SignatureSeparatesPlans) {
  const uint32_t a = moe_signature(kernels::moe::kDispatchOp, {256, 8, 1000, 14336, 8, 4096, 8192});
  EXPECT_EQ(a, moe_signature(kernels::moe::kDispatchOp, {256, 8, 1000, 14336, 8, 4096, 8192}));
  EXPECT_NE(a, 0u) << "32 bits (ops/launch/signature.h), never 0";
  std::set<uint32_t> seen{a};
  seen.insert(moe_signature(kernels::moe::kCombineOp, {256, 8, 1000, 14336, 8, 4096, 8192}));
  seen.insert(moe_signature(kernels::moe::kDispatchOp, {256, 8, 1001, 14336, 8, 4096, 8192}));
  seen.insert(moe_signature(kernels::moe::kDispatchOp, {256, 8, 1000, 14336, 8, 4096, 8448}));
  EXPECT_EQ(seen.size(), 4u);
}

// ---- the routing reference, on a case computed by hand -----------------------------------------
// W = 2, E = 4 (experts 0, 1 on rank 0; 2, 3 on rank 1), k = 2:
//   rank 0: token 0 -> {0, 3}, token 1 -> {1, 0}
//   rank 1: token 0 -> {3, 2}, token 1 -> {-1 (unused), 0}
// Rank 0 receives, by (local expert, source, token, slot): e0: (0,0,0) (0,1,1) (1,1,1); e1: (0,1,0)
// Rank 1 receives: e2: (1,0,1); e3: (0,0,1) (1,0,0)
test::moe::RefInput hand_case(int64_t capacity, bool drop) {
  test::moe::RefInput in;
  in.world = 2;
  in.experts = 4;
  in.top_k = 2;
  in.capacity = capacity;
  in.drop = drop;
  in.ids = {{0, 3, 1, 0}, {3, 2, -1, 0}};
  return in;
}

TEST(MoeReference, HandCase) {
  const auto r = test::moe::reference_routing(hand_case(10, false));
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].code, test::moe::kRefOk);
  EXPECT_EQ(r[0].slot_dest, (std::vector<int32_t>{0, 11, 3, 1}));
  EXPECT_EQ(r[1].slot_dest, (std::vector<int32_t>{12, 10, -1, 2}));
  EXPECT_EQ(r[0].expert_offsets, (std::vector<int32_t>{0, 3, 4}));
  EXPECT_EQ(r[1].expert_offsets, (std::vector<int32_t>{0, 1, 3}));
  EXPECT_EQ(r[0].recv_rows, 4);
  EXPECT_EQ(r[1].recv_rows, 3);
  EXPECT_EQ(r[1].max_recv_rows, 4);
  // Rank 0's row 3 is token 1 of rank 0 again (expert 1 after expert 0): its primary is row 1.
  std::vector<int64_t> primaries0, primaries1;
  for (const auto& row : r[0].rows) primaries0.push_back(row.primary);
  for (const auto& row : r[1].rows) primaries1.push_back(row.primary);
  EXPECT_EQ(primaries0, (std::vector<int64_t>{0, 1, 2, 1}));
  EXPECT_EQ(primaries1, (std::vector<int64_t>{0, 1, 0}));
  EXPECT_EQ(r[0].rows[2].source, 1);
  EXPECT_EQ(r[0].rows[2].token, 1);
  EXPECT_EQ(r[0].rows[2].slot, 1);
}

TEST(MoeReference, DropCutsTheReceiveOrder) {
  const auto r = test::moe::reference_routing(hand_case(3, true));
  EXPECT_EQ(r[0].code, test::moe::kRefOk);
  EXPECT_EQ(r[0].kept_rows, 3);
  EXPECT_EQ(r[0].dropped_rows, 1);
  EXPECT_EQ(r[0].slot_dest, (std::vector<int32_t>{0, 4, -1, 1}));  // token 1's expert-1 row fell off rank 0
  EXPECT_EQ(r[0].dropped_slots, 1);
  EXPECT_EQ(r[0].expert_offsets, (std::vector<int32_t>{0, 3, 3}));
  EXPECT_EQ(r[1].slot_dest, (std::vector<int32_t>{5, 3, -1, 2}));
  EXPECT_EQ(r[1].dropped_slots, 0);
}

TEST(MoeReference, OverCapacityFailsEveryRank) {
  const auto r = test::moe::reference_routing(hand_case(3, false));
  for (const auto& rank : r) {
    EXPECT_EQ(rank.code, test::moe::kRefCapacity);
    EXPECT_EQ(rank.bad_rank, 0);
    EXPECT_EQ(rank.bad_token, 4);
    EXPECT_EQ(rank.slot_dest, (std::vector<int32_t>(4, -1)));
    EXPECT_EQ(rank.kept_rows, 0);
  }
}

TEST(MoeReference, BadIdFailsEveryRankNamingTheFirst) {
  test::moe::RefInput in = hand_case(10, false);
  in.ids[1] = {3, 2, 7, -2};
  const auto r = test::moe::reference_routing(in);
  for (const auto& rank : r) {
    EXPECT_EQ(rank.code, test::moe::kRefBadExpert);
    EXPECT_EQ(rank.bad_rank, 1);
    EXPECT_EQ(rank.bad_token, 1);
    EXPECT_EQ(rank.bad_slot, 0);
    EXPECT_EQ(rank.bad_value, 7);
    EXPECT_EQ(rank.expert_offsets, (std::vector<int32_t>{0, 0, 0}));
  }
}

// moe_topk's host checks (the kernel is checked against a reference in tests/gpu/moe_ops_test.cu).
TEST(MoePlan, TopkArgumentsAreCheckedOnTheHost) {
  static_assert(std::is_same_v<decltype(&moe_topk), Status (*)(const MoeTopkArgs&, cudaStream_t)>,
                "loom/moe.h must declare loom::moe_topk");
  auto at = [](uintptr_t tib) { return reinterpret_cast<char*>(tib << 40); };
  MoeTopkArgs a;
  a.logits = at(1);
  a.num_tokens = 100;
  a.num_experts = 64;
  a.top_k = 8;
  a.topk_ids = reinterpret_cast<int32_t*>(at(2));
  a.topk_weights = reinterpret_cast<float*>(at(3));
  EXPECT_TRUE(moe_topk_can_implement(a).ok());
  auto refused = [](MoeTopkArgs b, const char* words) {
    const Status s = moe_topk_can_implement(b);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find(words), std::string::npos) << s.message();
  };
  MoeTopkArgs b = a;
  b.top_k = 65;
  refused(b, "top_k");
  b = a;
  b.top_k = 33;
  b.num_experts = 100;
  refused(b, "top_k");
  b = a;
  b.num_experts = kMoeMaxExperts + 1;
  refused(b, "num_experts");
  b = a;
  b.num_tokens = -1;
  refused(b, "num_tokens");
  b = a;
  b.topk_ids = nullptr;
  refused(b, "must not be null");
  b = a;
  b.dtype = DType::kBF16;
  b.logits = at(1) + 1;  // misaligned for bf16
  refused(b, "aligned");
  b = a;
  b.topk_weights = reinterpret_cast<float*>(at(2) + 16);  // inside topk_ids
  refused(b, "overlap");
  b = a;
  b.num_tokens = 0;
  b.logits = nullptr;  // nothing to read or write
  EXPECT_TRUE(moe_topk_can_implement(b).ok());
}

}  // namespace
}  // namespace loom::planner
