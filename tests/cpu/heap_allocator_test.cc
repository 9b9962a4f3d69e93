#include "runtime/heap_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

namespace loom::runtime {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

HeapAllocator make_allocator(uint64_t prefix, uint64_t size) {
  Result<HeapAllocator> allocator = HeapAllocator::create(prefix, size);
  EXPECT_TRUE(allocator.ok()) << allocator.status().to_string();
  return std::move(allocator).value();
}

TEST(HeapAllocator, RejectsBadGeometry) {
  EXPECT_EQ(HeapAllocator::create(0, 1000).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(HeapAllocator::create(kMiB, kMiB).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(HeapAllocator::create(UINT64_MAX, kMiB).status().code(), StatusCode::kInvalidArgument);
}

TEST(HeapAllocator, StartsAfterThePrefixRoundedUp) {
  HeapAllocator allocator = make_allocator(4097, kMiB);
  EXPECT_EQ(allocator.begin(), 4352u);  // 17 * 256
  Result<uint64_t> first = allocator.allocate(1);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, 4352u);
  EXPECT_EQ(allocator.bytes_in_use(), HeapAllocator::kMinAlignment);
}

TEST(HeapAllocator, HonoursPowerOfTwoAlignment) {
  HeapAllocator allocator = make_allocator(4096, 64 * kMiB);
  for (uint64_t align : {uint64_t{1}, uint64_t{64}, uint64_t{256}, uint64_t{4096}, uint64_t{65536}, 2 * kMiB}) {
    Result<uint64_t> offset = allocator.allocate(1000, align);
    ASSERT_TRUE(offset.ok()) << offset.status().to_string();
    EXPECT_EQ(*offset % std::max(align, HeapAllocator::kMinAlignment), 0u) << "align " << align;
  }
  EXPECT_EQ(allocator.allocate(256, 3).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(allocator.allocate(256, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(allocator.allocate(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(allocator.allocate(UINT64_MAX).status().code(), StatusCode::kInvalidArgument);
}

TEST(HeapAllocator, AlignmentPaddingStaysUsable) {
  HeapAllocator allocator = make_allocator(0, kMiB);
  Result<uint64_t> small = allocator.allocate(256);
  Result<uint64_t> aligned = allocator.allocate(256, 65536);
  ASSERT_TRUE(small.ok() && aligned.ok());
  EXPECT_EQ(*small, 0u);
  EXPECT_EQ(*aligned, 65536u);
  // The gap [256, 65536) the alignment skipped is first fit for the next small block.
  Result<uint64_t> filler = allocator.allocate(512);
  ASSERT_TRUE(filler.ok());
  EXPECT_EQ(*filler, 256u);
}

TEST(HeapAllocator, CoalescesOnBothSides) {
  const uint64_t size = 4 * kMiB;
  HeapAllocator allocator = make_allocator(0, size);
  std::vector<uint64_t> offsets;
  for (int i = 0; i < 4; ++i) {
    Result<uint64_t> offset = allocator.allocate(kMiB);
    ASSERT_TRUE(offset.ok());
    offsets.push_back(*offset);
  }
  EXPECT_EQ(allocator.largest_free_block(), 0u);
  ASSERT_TRUE(allocator.release(offsets[0]).ok());
  ASSERT_TRUE(allocator.release(offsets[2]).ok());
  EXPECT_EQ(allocator.largest_free_block(), kMiB);
  ASSERT_TRUE(allocator.release(offsets[1]).ok());  // joins its left and right neighbours
  EXPECT_EQ(allocator.largest_free_block(), 3 * kMiB);
  Result<uint64_t> big = allocator.allocate(3 * kMiB);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(*big, 0u);
  ASSERT_TRUE(allocator.release(*big).ok());
  ASSERT_TRUE(allocator.release(offsets[3]).ok());
  EXPECT_EQ(allocator.largest_free_block(), size);
  EXPECT_EQ(allocator.bytes_in_use(), 0u);
}

TEST(HeapAllocator, ExhaustionNamesTheNumbersAndTheVariable) {
  HeapAllocator allocator = make_allocator(kMiB, 4 * kMiB);
  Result<uint64_t> a = allocator.allocate(kMiB);
  Result<uint64_t> b = allocator.allocate(kMiB);
  Result<uint64_t> c = allocator.allocate(kMiB);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_TRUE(allocator.release(*b).ok());  // 1 MiB free in the middle, nothing at the end
  Result<uint64_t> too_big = allocator.allocate(2 * kMiB);
  ASSERT_FALSE(too_big.ok());
  const std::string& message = too_big.status().message();
  EXPECT_EQ(too_big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(message.find("asked for 2097152 B"), std::string::npos) << message;
  EXPECT_NE(message.find("1048576 B (1.00 MiB) free"), std::string::npos) << message;
  EXPECT_NE(message.find("largest free block 1048576 B"), std::string::npos) << message;
  EXPECT_NE(message.find("LOOM_HEAP_BYTES"), std::string::npos) << message;
}

TEST(HeapAllocator, DoubleAndForeignReleaseAreRejected) {
  HeapAllocator allocator = make_allocator(0, kMiB);
  Result<uint64_t> offset = allocator.allocate(4096);
  ASSERT_TRUE(offset.ok());
  EXPECT_EQ(allocator.release(*offset + 256).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(allocator.release(*offset).ok());
  Status twice = allocator.release(*offset);
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(twice.message().find("released twice"), std::string::npos) << twice.message();
  EXPECT_EQ(allocator.bytes_in_use(), 0u);
}

// One random allocate/release script, applied to an allocator; returns the offsets it got.
std::vector<uint64_t> run_script(HeapAllocator& allocator, uint32_t seed, int steps) {
  std::mt19937 rng(seed);
  std::vector<uint64_t> live;
  std::vector<uint64_t> handed_out;
  for (int step = 0; step < steps; ++step) {
    if (!live.empty() && rng() % 5 < 2) {
      const size_t victim = rng() % live.size();
      EXPECT_TRUE(allocator.release(live[victim]).ok());
      live.erase(live.begin() + static_cast<ptrdiff_t>(victim));
      continue;
    }
    const uint64_t bytes = 1 + rng() % (256 * 1024);
    const uint64_t align = uint64_t{1} << (rng() % 17);
    Result<uint64_t> offset = allocator.allocate(bytes, align);
    if (offset.ok()) {
      live.push_back(*offset);
      handed_out.push_back(*offset);
    } else {
      handed_out.push_back(UINT64_MAX);
    }
  }
  return handed_out;
}

TEST(HeapAllocator, RandomScriptsNeverOverlapAndAlwaysCoalesce) {
  constexpr uint64_t kPrefix = 8192;
  constexpr uint64_t kSize = 16 * kMiB;
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    HeapAllocator allocator = make_allocator(kPrefix, kSize);
    std::map<uint64_t, uint64_t> reference;  // live blocks: offset -> requested bytes
    std::mt19937 rng(seed);
    for (int step = 0; step < 2000; ++step) {
      if (!reference.empty() && rng() % 5 < 2) {
        auto victim = reference.begin();
        std::advance(victim, static_cast<ptrdiff_t>(rng() % reference.size()));
        ASSERT_TRUE(allocator.release(victim->first).ok());
        reference.erase(victim);
        continue;
      }
      const uint64_t bytes = 1 + rng() % (512 * 1024);
      const uint64_t align = uint64_t{1} << (rng() % 17);
      Result<uint64_t> got = allocator.allocate(bytes, align);
      if (!got.ok()) {
        ASSERT_EQ(got.status().code(), StatusCode::kInvalidArgument);
        continue;
      }
      const uint64_t offset = *got;
      ASSERT_GE(offset, kPrefix);
      ASSERT_LE(offset + bytes, kSize);
      ASSERT_EQ(offset % std::max(align, HeapAllocator::kMinAlignment), 0u);
      ASSERT_GE(allocator.allocation_size(offset), bytes);
      // No overlap with the live neighbour below or the one above.
      auto above = reference.lower_bound(offset);
      if (above != reference.end()) {
        ASSERT_LE(offset + bytes, above->first) << "seed " << seed;
      }
      if (above != reference.begin()) {
        auto below = std::prev(above);
        ASSERT_LE(below->first + below->second, offset) << "seed " << seed;
      }
      reference.emplace(offset, bytes);
    }
    uint64_t in_use = 0;
    for (const auto& [offset, bytes] : reference) in_use += allocator.allocation_size(offset);
    EXPECT_EQ(allocator.bytes_in_use(), in_use);
    for (const auto& [offset, bytes] : reference) ASSERT_TRUE(allocator.release(offset).ok());
    EXPECT_EQ(allocator.bytes_in_use(), 0u);
    EXPECT_EQ(allocator.largest_free_block(), kSize - kPrefix) << "free list did not coalesce, seed " << seed;
  }
}

TEST(HeapAllocator, SameScriptGivesSameOffsets) {
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    HeapAllocator first = make_allocator(4096, 8 * kMiB);
    HeapAllocator second = make_allocator(4096, 8 * kMiB);
    EXPECT_EQ(run_script(first, seed, 3000), run_script(second, seed, 3000)) << "seed " << seed;
  }
}

}  // namespace
}  // namespace loom::runtime

namespace loom::runtime {
namespace {

TEST(HeapAllocatorRanges, InteriorRangesOfLiveAllocationsOnly) {
  Result<HeapAllocator> created = HeapAllocator::create(4096, 1 << 20);
  ASSERT_TRUE(created.ok());
  HeapAllocator& heap = *created;
  Result<uint64_t> a = heap.allocate(1000);
  Result<uint64_t> b = heap.allocate(5000);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(heap.range_allocated(*a, 1000));
  EXPECT_TRUE(heap.range_allocated(*a + 10, 500));
  EXPECT_TRUE(heap.range_allocated(*b, heap.allocation_size(*b)));
  EXPECT_FALSE(heap.range_allocated(*b, heap.allocation_size(*b) + 1));  // runs past the block
  EXPECT_FALSE(heap.range_allocated(*a + 900, heap.allocation_size(*a)));  // straddles two blocks
  EXPECT_FALSE(heap.range_allocated(0, 16));                              // reserved prefix
  ASSERT_TRUE(heap.release(*a).ok());
  EXPECT_FALSE(heap.range_allocated(*a, 16));  // freed
}

}  // namespace
}  // namespace loom::runtime
