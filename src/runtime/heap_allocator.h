// HeapAllocator: carves buffers out of the symmetric heap, as offsets (host-only bookkeeping).
//
// Every rank runs its own allocator over a heap of the same size; because allocation is a pure
// function of the call sequence (first fit by address, no randomness, no dependence on pointers),
// the same sequence of allocate/release calls on every rank yields the same offsets, which is what
// lets a kernel address a peer's buffer as peer_base + offset.
//
// Offsets handed out lie in [reserved_prefix, size): the prefix holds the control region (flags,
// self-test area) and is never allocated. Not thread-safe: the owner serializes calls.
#pragma once

#include <cstdint>
#include <map>

#include "loom/status.h"

namespace loom::runtime {

class HeapAllocator {
 public:
  // Smallest alignment and size granule of every block: keeps 128-byte TMA and vector accesses
  // aligned and stops the free list from fragmenting into slivers.
  static constexpr uint64_t kMinAlignment = 256;

  // Fails with invalid_argument when the prefix leaves no room or the size is not a multiple of
  // kMinAlignment. The allocatable range starts at reserved_prefix rounded up to kMinAlignment.
  static Result<HeapAllocator> create(uint64_t reserved_prefix, uint64_t size);

  // An offset aligned to max(align, kMinAlignment); `align` must be a power of two. Sizes are
  // rounded up to kMinAlignment. Out of space: invalid_argument with the request, the free bytes
  // and the largest free block, naming LOOM_HEAP_BYTES.
  Result<uint64_t> allocate(uint64_t bytes, uint64_t align = kMinAlignment);
  // `offset` must come from allocate() and not be released yet (else invalid_argument).
  Status release(uint64_t offset);

  uint64_t begin() const { return begin_; }  // first allocatable offset
  uint64_t size() const { return size_; }    // end of the heap
  uint64_t bytes_in_use() const { return bytes_in_use_; }
  uint64_t largest_free_block() const;
  // The block size (rounded) behind an allocated offset, or 0 when `offset` is not allocated.
  uint64_t allocation_size(uint64_t offset) const;
  // Whether [offset, offset + bytes) lies inside one live allocation (an interior range counts).
  bool range_allocated(uint64_t offset, uint64_t bytes) const;

 private:
  HeapAllocator(uint64_t begin, uint64_t size);

  uint64_t begin_ = 0;
  uint64_t size_ = 0;
  uint64_t bytes_in_use_ = 0;
  std::map<uint64_t, uint64_t> free_blocks_;  // offset -> bytes; never two adjacent entries
  std::map<uint64_t, uint64_t> allocated_;    // offset -> bytes (rounded)
};

}  // namespace loom::runtime
