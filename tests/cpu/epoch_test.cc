#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "runtime/device_abi.h"

namespace loom {
namespace {

TEST(Epoch, ReachedIsSerialNumberComparison) {
  EXPECT_TRUE(epoch_reached(5, 5));
  EXPECT_TRUE(epoch_reached(6, 5));
  EXPECT_FALSE(epoch_reached(4, 5));
  EXPECT_FALSE(epoch_reached(0, 1));  // fresh flag never satisfies the first launch
}

TEST(Epoch, WrapAroundAtTwoToThe64) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  // Launch counter crossing the wrap: target 0 (after kMax) and 1.
  EXPECT_TRUE(epoch_reached(0, kMax));       // flag written after the wrap reaches a pre-wrap target
  EXPECT_FALSE(epoch_reached(kMax, 0));      // a pre-wrap flag does not satisfy a post-wrap target
  EXPECT_FALSE(epoch_reached(kMax - 1, kMax));
  EXPECT_TRUE(epoch_reached(2, kMax - 3));
  // Walk 1000 launches across the wrap: the current flag satisfies exactly targets <= itself.
  uint64_t e = kMax - 500;
  for (int i = 0; i < 1000; ++i, ++e) {
    EXPECT_TRUE(epoch_reached(e, e));
    EXPECT_TRUE(epoch_reached(e + 1, e));
    EXPECT_FALSE(epoch_reached(e - 1, e));
    EXPECT_FALSE(epoch_reached(e, e + 1));
  }
}

TEST(Epoch, StaleFlagsWithinHalfTheRangeNeverSatisfy) {
  const uint64_t target = 1000;
  for (uint64_t age : {uint64_t{1}, uint64_t{1} << 20, uint64_t{1} << 40, (uint64_t{1} << 63) - 1}) {
    EXPECT_FALSE(epoch_reached(target - age, target)) << age;
  }
}

TEST(ControlLayout, RegionsAreDisjointAndPageRounded) {
  for (uint32_t world : {1u, 2u, 3u, 8u, 72u}) {
    const ControlLayout c = make_control_layout(world, 4096);
    EXPECT_EQ(c.entered_offset, 0u);
    EXPECT_EQ(c.done_offset, c.entered_offset + 8ull * world);
    EXPECT_EQ(c.chunk_offset, c.done_offset + 8ull * world);
    EXPECT_EQ(c.self_test_offset, c.chunk_offset + 8ull * world * 4096);
    EXPECT_GE(c.bytes, c.self_test_offset + 8ull * world * ControlLayout::kSelfTestWords);
    EXPECT_EQ(c.bytes % 4096, 0u);
  }
}

}  // namespace
}  // namespace loom
