#include <gtest/gtest.h>

#include "planner/collective_plan.h"

namespace loom::planner {
namespace {

CollectiveRequest request(uint64_t bytes) {
  CollectiveRequest r;
  r.op = OpId::kAllGather;
  r.bytes = bytes;
  r.local_world = 2;
  r.sm_count = 132;
  r.max_chunks = 4096;
  return r;
}

TEST(CollectivePlan, TinyMessagesUseOneCta) {
  Result<CollectivePlan> p = plan_collective(request(2));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->num_ctas, 1);
  EXPECT_EQ(p->engine, CopyEngine::kVector);
}

TEST(CollectivePlan, MidSizeMessagesSpreadOverOneCtaPassEach) {
  EXPECT_EQ(plan_collective(request(256 * 1024))->num_ctas, 8);
  EXPECT_EQ(plan_collective(request(1 << 20))->num_ctas, 32);
}

TEST(CollectivePlan, LargeMessagesAreCappedBySmFraction) {
  Result<CollectivePlan> p = plan_collective(request(uint64_t{1} << 30));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->num_ctas, 132 / 2);
}

TEST(CollectivePlan, CapNeverBelowMinimumOnSmallGpus) {
  CollectiveRequest r = request(uint64_t{1} << 30);
  r.sm_count = 16;
  Result<CollectivePlan> p = plan_collective(r);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->num_ctas, 8);
}

TEST(CollectivePlan, OverrideIsHonouredAndBounded) {
  CollectiveRequest r = request(1 << 20);
  r.override_ctas = 64;
  EXPECT_EQ(plan_collective(r)->num_ctas, 64);
  r.override_ctas = 500;
  EXPECT_EQ(plan_collective(r).status().code(), StatusCode::kInvalidArgument);
  r.override_ctas = 100;
  r.max_chunks = 64;
  EXPECT_EQ(plan_collective(r).status().code(), StatusCode::kInvalidArgument);
}

TEST(CollectivePlan, BulkEngineNeedsEligibleBuffers) {
  CollectiveRequest r = request(1 << 20);
  r.want_bulk = true;
  EXPECT_EQ(plan_collective(r).status().code(), StatusCode::kInvalidArgument);
  r.bulk_eligible = true;
  EXPECT_EQ(plan_collective(r)->engine, CopyEngine::kBulk);
}

TEST(CollectivePlan, UnknownSmCountIsInternal) {
  CollectiveRequest r = request(1);
  r.sm_count = 0;
  EXPECT_EQ(plan_collective(r).status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace loom::planner
