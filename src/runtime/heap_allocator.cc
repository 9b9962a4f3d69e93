#include "runtime/heap_allocator.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <iterator>
#include <limits>
#include <string>

namespace loom::runtime {
namespace {

// "3145728 B (3.00 MiB)": exact for comparisons, scaled for people.
std::string describe_bytes(uint64_t bytes) {
  char text[64];
  std::snprintf(text, sizeof(text), "%llu B (%.2f MiB)", static_cast<unsigned long long>(bytes),
                static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}

// Rounds up to a power-of-two multiple; false when the result does not fit in 64 bits.
bool round_up(uint64_t value, uint64_t multiple, uint64_t* rounded) {
  const uint64_t mask = multiple - 1;
  if (value > std::numeric_limits<uint64_t>::max() - mask) return false;
  *rounded = (value + mask) & ~mask;
  return true;
}

}  // namespace

HeapAllocator::HeapAllocator(uint64_t begin, uint64_t size) : begin_(begin), size_(size) {
  free_blocks_.emplace(begin_, size_ - begin_);
}

Result<HeapAllocator> HeapAllocator::create(uint64_t reserved_prefix, uint64_t size) {
  if (size % kMinAlignment != 0) {
    return Status::invalid_argument("heap allocator: heap size " + describe_bytes(size) +
                                    " is not a multiple of " + std::to_string(kMinAlignment) + " B");
  }
  uint64_t begin = 0;
  if (!round_up(reserved_prefix, kMinAlignment, &begin) || begin >= size) {
    return Status::invalid_argument("heap allocator: reserved prefix of " + describe_bytes(reserved_prefix) +
                                    " leaves no room in a heap of " + describe_bytes(size) +
                                    "; raise LOOM_HEAP_BYTES");
  }
  return HeapAllocator(begin, size);
}

Result<uint64_t> HeapAllocator::allocate(uint64_t bytes, uint64_t align) {
  if (bytes == 0) return Status::invalid_argument("heap allocate: size 0 requested");
  if (!std::has_single_bit(align)) {
    return Status::invalid_argument("heap allocate: alignment " + std::to_string(align) +
                                    " is not a power of two");
  }
  align = std::max(align, kMinAlignment);
  uint64_t rounded = 0;
  if (!round_up(bytes, kMinAlignment, &rounded)) {
    return Status::invalid_argument("heap allocate: size " + std::to_string(bytes) + " B overflows");
  }

  // First fit by address: the lowest block that holds an aligned start plus the rounded size.
  for (auto it = free_blocks_.begin(); it != free_blocks_.end(); ++it) {
    const uint64_t block_begin = it->first;
    const uint64_t block_end = it->first + it->second;
    uint64_t start = 0;
    if (!round_up(block_begin, align, &start) || start >= block_end || block_end - start < rounded) continue;

    free_blocks_.erase(it);
    if (start > block_begin) free_blocks_.emplace(block_begin, start - block_begin);  // alignment padding
    if (start + rounded < block_end) free_blocks_.emplace(start + rounded, block_end - (start + rounded));
    allocated_.emplace(start, rounded);
    bytes_in_use_ += rounded;
    return start;
  }

  const uint64_t free_bytes = (size_ - begin_) - bytes_in_use_;
  return Status::invalid_argument(
      "symmetric heap out of space: asked for " + describe_bytes(bytes) + " aligned to " + std::to_string(align) +
      " B, " + describe_bytes(free_bytes) + " free, largest free block " + describe_bytes(largest_free_block()) +
      " of a " + describe_bytes(size_) + " heap; raise LOOM_HEAP_BYTES");
}

Status HeapAllocator::release(uint64_t offset) {
  auto allocation = allocated_.find(offset);
  if (allocation == allocated_.end()) {
    return Status::invalid_argument("heap release: offset " + std::to_string(offset) +
                                    " is not an allocated block (released twice, or never allocated)");
  }
  uint64_t begin = allocation->first;
  uint64_t bytes = allocation->second;
  bytes_in_use_ -= bytes;
  allocated_.erase(allocation);

  // Coalesce with the free neighbours on both sides, so free blocks never touch.
  auto next = free_blocks_.lower_bound(begin);
  if (next != free_blocks_.end() && next->first == begin + bytes) {
    bytes += next->second;
    next = free_blocks_.erase(next);
  }
  if (next != free_blocks_.begin()) {
    auto previous = std::prev(next);
    if (previous->first + previous->second == begin) {
      begin = previous->first;
      bytes += previous->second;
      free_blocks_.erase(previous);
    }
  }
  free_blocks_.emplace(begin, bytes);
  return Status::ok_status();
}

uint64_t HeapAllocator::largest_free_block() const {
  uint64_t largest = 0;
  for (const auto& [offset, bytes] : free_blocks_) largest = std::max(largest, bytes);
  return largest;
}

bool HeapAllocator::range_allocated(uint64_t offset, uint64_t bytes) const {
  auto it = allocated_.upper_bound(offset);
  if (it == allocated_.begin()) return false;
  --it;  // the allocation starting at or before offset
  const uint64_t end = it->first + it->second;
  return offset < end && bytes <= end - offset;
}

uint64_t HeapAllocator::allocation_size(uint64_t offset) const {
  auto allocation = allocated_.find(offset);
  return allocation == allocated_.end() ? 0 : allocation->second;
}

}  // namespace loom::runtime
