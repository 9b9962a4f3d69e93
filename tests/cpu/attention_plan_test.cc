// The attention engine's host side without a GPU: argument rules, strides, the plan, and the
// persistent tile order (every tile exactly once, longest first under causal masking).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

#include "kernels/attention/params.h"
#include "loom/attention.h"
#include "planner/attention_plan.h"

namespace loom {
namespace {

namespace ka = kernels::attention;

// Fake but aligned device addresses, far apart.
const void* at(uintptr_t gib) { return reinterpret_cast<const void*>(gib << 30); }

AttentionArgs good_args() {
  AttentionArgs a;
  a.q = at(1);
  a.k = at(2);
  a.v = at(3);
  a.out = const_cast<void*>(at(4));
  a.lse = static_cast<float*>(const_cast<void*>(at(5)));
  a.batch = 2;
  a.seqlen_q = 1000;
  a.seqlen_k = 1500;
  a.heads_q = 8;
  a.heads_kv = 2;
  a.head_dim = 128;
  return a;
}

planner::AttentionDeviceLimits h200() { return {132, 232448, 60 * 1024 * 1024}; }

TEST(AttentionPlan, AcceptsSupportedShapes) {
  for (int64_t d : {64, 128, 256}) {
    AttentionArgs a = good_args();
    a.head_dim = d;
    EXPECT_TRUE(attention_can_implement(a).ok()) << d;
    AttentionOptions causal;
    causal.causal = true;
    EXPECT_TRUE(attention_can_implement(a, causal).ok()) << d;
  }
  AttentionArgs a = good_args();
  a.dtype = DType::kF16;
  EXPECT_TRUE(attention_can_implement(a).ok());
  a.heads_kv = 1;  // MQA
  EXPECT_TRUE(attention_can_implement(a).ok());
}

TEST(AttentionPlan, RefusesBadInputWithAReason) {
  struct Case {
    const char* what;
    void (*mutate)(AttentionArgs&, AttentionOptions&);
    StatusCode code;
  };
  const Case cases[] = {
      {"head dim 96", [](AttentionArgs& a, AttentionOptions&) { a.head_dim = 96; }, StatusCode::kUnsupported},
      {"head dim 192", [](AttentionArgs& a, AttentionOptions&) { a.head_dim = 192; }, StatusCode::kUnsupported},
      {"fp32", [](AttentionArgs& a, AttentionOptions&) { a.dtype = DType::kF32; }, StatusCode::kUnsupported},
      {"Hq % Hkv", [](AttentionArgs& a, AttentionOptions&) { a.heads_kv = 3; }, StatusCode::kInvalidArgument},
      {"no heads", [](AttentionArgs& a, AttentionOptions&) { a.heads_kv = 0; }, StatusCode::kInvalidArgument},
      {"negative batch", [](AttentionArgs& a, AttentionOptions&) { a.batch = -1; }, StatusCode::kInvalidArgument},
      {"2^31 rows", [](AttentionArgs& a, AttentionOptions&) { a.seqlen_k = int64_t{1} << 31; },
       StatusCode::kUnsupported},
      {"null q", [](AttentionArgs& a, AttentionOptions&) { a.q = nullptr; }, StatusCode::kInvalidArgument},
      {"misaligned v",
       [](AttentionArgs& a, AttentionOptions&) { a.v = static_cast<const char*>(a.v) + 8; },
       StatusCode::kInvalidArgument},
      {"lse misaligned",
       [](AttentionArgs& a, AttentionOptions&) { a.lse = reinterpret_cast<float*>(reinterpret_cast<char*>(a.lse) + 2); },
       StatusCode::kInvalidArgument},
      {"odd stride", [](AttentionArgs& a, AttentionOptions&) { a.q_strides.row = 8 * 128 + 2; },
       StatusCode::kInvalidArgument},
      {"negative stride", [](AttentionArgs& a, AttentionOptions&) { a.k_strides.head = -128; },
       StatusCode::kInvalidArgument},
      {"out overlaps k", [](AttentionArgs& a, AttentionOptions&) { a.out = const_cast<void*>(a.k); },
       StatusCode::kInvalidArgument},
      {"lse overlaps out",
       [](AttentionArgs& a, AttentionOptions&) { a.lse = static_cast<float*>(a.out) + 64; },
       StatusCode::kInvalidArgument},
      {"negative scale", [](AttentionArgs&, AttentionOptions& o) { o.scale = -0.5f; }, StatusCode::kInvalidArgument},
      {"infinite scale", [](AttentionArgs&, AttentionOptions& o) { o.scale = INFINITY; }, StatusCode::kInvalidArgument},
      {"partial without lse",
       [](AttentionArgs& a, AttentionOptions& o) {
         o.partial = true;
         a.lse = nullptr;
       },
       StatusCode::kInvalidArgument},
      {"negative num_ctas", [](AttentionArgs&, AttentionOptions& o) { o.num_ctas = -2; }, StatusCode::kInvalidArgument},
      {"block_n 96 at hd128", [](AttentionArgs&, AttentionOptions& o) { o.block_n = 96; }, StatusCode::kInvalidArgument},
      {"block_m 192 at hd256",
       [](AttentionArgs& a, AttentionOptions& o) {
         a.head_dim = 256;
         o.block_m = 192;
       },
       StatusCode::kInvalidArgument},
      {"block_m 192 at hd128", [](AttentionArgs&, AttentionOptions& o) { o.block_m = 192; },
       StatusCode::kInvalidArgument},
      {"block_m 192 with block_n 176 at hd128",
       [](AttentionArgs&, AttentionOptions& o) {
         o.block_m = 192;
         o.block_n = 176;
       },
       StatusCode::kInvalidArgument},
      {"block_m 64", [](AttentionArgs&, AttentionOptions& o) { o.block_m = 64; }, StatusCode::kInvalidArgument},
      {"block_m 192 with block_n 192 at hd64",
       [](AttentionArgs& a, AttentionOptions& o) {
         a.head_dim = 64;
         o.block_m = 192;
         o.block_n = 192;
       },
       StatusCode::kInvalidArgument},
      {"offsets with bshd",
       [](AttentionArgs& a, AttentionOptions&) { a.cu_seqlens_q = static_cast<const int32_t*>(at(6)); },
       StatusCode::kInvalidArgument},
      {"packed without offsets",
       [](AttentionArgs& a, AttentionOptions&) {
         a.layout = AttentionLayout::kPacked;
         a.total_q = a.total_k = 100;
       },
       StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    AttentionArgs a = good_args();
    AttentionOptions o;
    c.mutate(a, o);
    const Status s = attention_can_implement(a, o);
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty()) << c.what;
  }
}

TEST(AttentionPlan, EmptyTensorsNeedNoPointers) {
  AttentionArgs a = good_args();
  a.seqlen_k = 0;  // no keys: every row gets O = 0, LSE = -inf
  a.k = a.v = nullptr;
  EXPECT_TRUE(attention_can_implement(a).ok());
  a = good_args();
  a.batch = 0;
  a.q = a.k = a.v = nullptr;
  a.out = nullptr;
  ASSERT_TRUE(attention_can_implement(a).ok());
  auto plan = planner::plan_attention(a, {}, h200());
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan.value().empty);
}

TEST(AttentionPlan, DefaultStridesFollowTheLayout) {
  AttentionArgs a = good_args();
  planner::AttentionResolvedStrides s = planner::resolve_attention_strides(a);
  EXPECT_EQ(s.q.row, 8 * 128);
  EXPECT_EQ(s.q.head, 128);
  EXPECT_EQ(s.q.batch, 1000 * 8 * 128);
  EXPECT_EQ(s.k.row, 2 * 128);
  EXPECT_EQ(s.k.batch, 1500 * 2 * 128);
  EXPECT_EQ(s.lse_head, 1000);
  EXPECT_EQ(s.lse_batch, 8 * 1000);
  a.layout = AttentionLayout::kPacked;
  a.total_q = 3000;
  a.total_k = 4000;
  s = planner::resolve_attention_strides(a);
  EXPECT_EQ(s.lse_head, 3000);  // [Hq, Tq]
  a.q_strides = AttentionStrides{128, 1000 * 128, 8 * 1000 * 128};  // a [B, H, S, D] tensor
  s = planner::resolve_attention_strides(a);
  EXPECT_EQ(s.q.head, 1000 * 128);
}

TEST(AttentionPlan, PlanSizesTheGridAndTheScale) {
  AttentionArgs a = good_args();
  auto plan = planner::plan_attention(a, {}, h200());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const planner::AttentionPlan& p = plan.value();
  EXPECT_EQ(p.info.block_m, 128);
  EXPECT_EQ(p.info.block_n, 176);
  EXPECT_EQ(p.m_blocks, 8);  // ceil(1000 / 128)
  EXPECT_EQ(p.info.tiles, 2 * 8 * 8);
  EXPECT_EQ(p.info.grid, 128);  // fewer tiles than SMs
  EXPECT_NEAR(p.scale, 1.0 / std::sqrt(128.0), 1e-7);
  EXPECT_GE(p.section_heads, 1u);
  AttentionOptions o;
  o.num_ctas = 7;
  o.scale = 0.25f;
  plan = planner::plan_attention(a, o, h200());
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan.value().info.grid, 7);
  EXPECT_FLOAT_EQ(plan.value().scale, 0.25f);
  planner::AttentionDeviceLimits small = h200();
  small.smem_per_block_optin = 100 * 1024;
  EXPECT_EQ(planner::plan_attention(a, {}, small).status().code(), StatusCode::kUnsupported);
}

// tile_at is a bijection from [0, tiles) onto (batch, head, query block) for both orders.
TEST(AttentionPlan, TileOrderVisitsEveryTileOnce) {
  for (bool causal : {false, true}) {
    for (uint32_t m_blocks : {1u, 5u, 16u}) {
      for (uint32_t heads : {1u, 3u, 8u}) {
        for (uint32_t batch : {1u, 2u}) {
          for (uint32_t section : {1u, 4u, 100u}) {
            const uint32_t pairs = batch * heads, tiles = pairs * m_blocks;
            std::set<uint64_t> seen;
            for (uint32_t t = 0; t < tiles; ++t) {
              const ka::TileCoord c = ka::tile_at(t, m_blocks, heads, pairs, causal, std::min(section, pairs));
              ASSERT_LT(c.m_block, m_blocks);
              ASSERT_LT(c.head, heads);
              ASSERT_LT(c.batch, batch);
              EXPECT_TRUE(seen.insert((uint64_t{c.batch} * heads + c.head) * m_blocks + c.m_block).second)
                  << "tile visited twice";
            }
            EXPECT_EQ(seen.size(), tiles);
          }
        }
      }
    }
  }
}

TEST(AttentionPlan, CausalOrderStartsWithTheLongestTiles) {
  const uint32_t m_blocks = 16, heads = 4, pairs = 4;
  for (uint32_t t = 0; t + 1 < pairs * m_blocks; ++t) {
    const ka::TileCoord a = ka::tile_at(t, m_blocks, heads, pairs, true, pairs);
    const ka::TileCoord b = ka::tile_at(t + 1, m_blocks, heads, pairs, true, pairs);
    EXPECT_GE(a.m_block, b.m_block) << "within one section the query blocks must not get longer";
  }
  EXPECT_EQ(ka::tile_at(0, m_blocks, heads, pairs, true, pairs).m_block, m_blocks - 1);
}

TEST(AttentionPlan, BlockNDefaultsAndOverrides) {
  EXPECT_EQ(planner::default_block_n(64, 1024, false), 128);
  EXPECT_EQ(planner::default_block_n(64, 8192, true), 192);
  EXPECT_EQ(planner::default_block_n(128, 512, false), 176);
  EXPECT_EQ(planner::default_block_n(128, 8192, false), 176);
  // Under a causal mask short sequences take 128 (176 does not divide the 128-row tiles' diagonal).
  EXPECT_EQ(planner::default_block_n(128, 1024, true), 128);
  EXPECT_EQ(planner::default_block_n(128, 2047, true), 128);
  EXPECT_EQ(planner::default_block_n(128, 2048, true), 176);
  EXPECT_EQ(planner::default_block_n(256, 8192, false), 80);
  AttentionArgs a = good_args();
  AttentionOptions o;
  o.block_n = 128;
  auto plan = planner::plan_attention(a, o, h200());
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan.value().info.block_n, 128);
  EXPECT_EQ(plan.value().info.stages, 2);
  // Three consumer warpgroups at hd64: 192-row tiles of 128 keys, whatever the keys' default.
  a.head_dim = 64;
  a.seqlen_k = 8192;
  o.block_n = 0;
  o.block_m = 192;
  plan = planner::plan_attention(a, o, h200());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan.value().info.block_m, 192);
  EXPECT_EQ(plan.value().info.block_n, 128);
  EXPECT_EQ(plan.value().info.threads, 512);
  EXPECT_EQ(plan.value().m_blocks, (a.seqlen_q + 191) / 192);
  // The defaults: 192 rows at hd64 from 512 queries (2K under a causal mask) unless BLOCK_N is set.
  EXPECT_EQ(planner::default_block_m(64, 0, false, 512), 192);
  EXPECT_EQ(planner::default_block_m(64, 0, false, 511), 128);
  EXPECT_EQ(planner::default_block_m(64, 0, true, 1024), 128);
  EXPECT_EQ(planner::default_block_m(64, 0, true, 2048), 192);
  EXPECT_EQ(planner::default_block_m(64, 192, false, 8192), 128);
  EXPECT_EQ(planner::default_block_m(128, 0, false, 8192), 128);
  AttentionOptions defaults;
  a.seqlen_q = 500;
  plan = planner::plan_attention(a, defaults, h200());  // hd64, 500 queries
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan.value().info.block_m, 128);
  a.seqlen_q = 4096;
  plan = planner::plan_attention(a, defaults, h200());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan.value().info.block_m, 192);
  EXPECT_EQ(plan.value().info.block_n, 128);
  defaults.block_n = 192;  // an explicit BLOCK_N keeps the 128-row tiles
  plan = planner::plan_attention(a, defaults, h200());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan.value().info.block_m, 128);
  EXPECT_EQ(plan.value().info.block_n, 192);
  // The ring runs its own builds: 128-row tiles, and its unmasked BLOCK_N under a causal mask too.
  RingAttentionArgs ring;
  ring.head_dim = 128;
  ring.seqlen = 1024;
  RingAttentionOptions causal_ring;
  causal_ring.causal = true;
  EXPECT_EQ(planner::ring_core_options(ring, causal_ring).block_m, 128);
  EXPECT_EQ(planner::ring_core_options(ring, causal_ring).block_n, 176);
}

TEST(AttentionPlan, RingRulesAndWorkspace) {
  RingAttentionArgs r;
  r.q = at(1);
  r.k = at(2);
  r.v = at(3);
  r.out = const_cast<void*>(at(4));
  r.batch = 2;
  r.seqlen = 1000;
  r.heads_q = 8;
  r.heads_kv = 2;
  r.head_dim = 128;
  RingAttentionOptions o;
  EXPECT_TRUE(ring_attention_can_implement(r, o, 4).ok());
  o.causal = true;
  EXPECT_TRUE(ring_attention_can_implement(r, o, 4).ok());
  RingAttentionArgs odd = r;
  odd.seqlen = 999;
  const Status s = ring_attention_can_implement(odd, o, 4);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("even"), std::string::npos) << s.message();
  RingAttentionArgs bad = r;
  bad.heads_kv = 3;
  EXPECT_EQ(ring_attention_can_implement(bad, o, 4).message().rfind("ring_attention: ", 0), 0u);
  EXPECT_EQ(ring_attention_can_implement(r, o, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(ring_attention_can_implement(r, o, 8).ok());
  EXPECT_EQ(ring_attention_can_implement(r, o, 9).code(), StatusCode::kUnsupported);  // 18 segments
  RingAttentionOptions neg;
  neg.kv_ctas = -1;
  EXPECT_EQ(ring_attention_can_implement(r, neg, 2).code(), StatusCode::kInvalidArgument);
  // The engine has BLOCK_N 128 at hd128, the ring only its default 176: refused before any launch.
  RingAttentionOptions narrow;
  narrow.block_n = 128;
  const Status unbuilt = ring_attention_can_implement(r, narrow, 2);
  EXPECT_EQ(unbuilt.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unbuilt.message().find("built: 176"), std::string::npos) << unbuilt.message();
  narrow.block_n = 176;
  EXPECT_TRUE(ring_attention_can_implement(r, narrow, 2).ok());
  for (int hd : {64, 128, 256}) {  // every default the planner can pick is built
    for (int64_t s : {1, 1024, 2048, 1 << 20}) {
      EXPECT_TRUE(planner::ring_tile_built(hd, planner::default_block_n(hd, s, false))) << "hd " << hd << ", " << s << " keys";
    }
  }
  // Every rank's K and V, 1 KiB aligned, then W * B * chunks flags.
  const planner::RingWorkspace w = planner::ring_workspace(r, 4);
  const uint64_t kv = 4ull * 2 * 1000 * 2 * 128 * 2;
  EXPECT_EQ(w.chunks, 8u);  // ceil(1000 / 128)
  EXPECT_EQ(w.recv_v, (kv + 1023) / 1024 * 1024);
  EXPECT_EQ(w.arrived, 2 * ((kv + 1023) / 1024 * 1024));
  EXPECT_GE(w.bytes, w.arrived + 4ull * 2 * 8 * 8);
  EXPECT_EQ(ring_attention_workspace_bytes(r, 4), w.bytes);
  EXPECT_EQ(ring_attention_workspace_bytes(r, 1), 0u);  // a ring of one receives nothing
  EXPECT_EQ(planner::ring_kv_ctas({}, 1, 132), 0);  // a ring of one moves nothing
  EXPECT_EQ(planner::ring_kv_ctas({}, 8, 132), 4);
}

TEST(AttentionPlan, MergeRules) {
  AttentionMergeArgs m;
  m.partial_out = static_cast<const float*>(at(1));
  m.partial_lse = static_cast<const float*>(at(2));
  m.out = const_cast<void*>(at(3));
  m.lse = static_cast<float*>(const_cast<void*>(at(4)));
  m.num_partials = 3;
  m.batch = 2;
  m.seqlen = 100;
  m.heads = 4;
  m.head_dim = 128;
  EXPECT_TRUE(attention_merge_can_implement(m).ok());
  AttentionMergeArgs bad = m;
  bad.num_partials = 0;
  EXPECT_EQ(attention_merge_can_implement(bad).code(), StatusCode::kInvalidArgument);
  bad = m;
  bad.head_dim = 126;
  EXPECT_EQ(attention_merge_can_implement(bad).code(), StatusCode::kInvalidArgument);
  bad = m;
  bad.out = const_cast<float*>(m.partial_out) + 4;
  EXPECT_EQ(attention_merge_can_implement(bad).code(), StatusCode::kInvalidArgument);
  bad = m;
  bad.partial_lse = nullptr;
  EXPECT_EQ(attention_merge_can_implement(bad).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace loom
