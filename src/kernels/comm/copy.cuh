// The vector copy: every thread of a group moves 16-byte vectors from local memory to local or
// peer (NVLink-mapped) memory, kUnroll loads in flight before the stores (stores to peer memory
// are posted writes, so throughput needs loads in flight). It writes no flag; callers publish
// one (a system fence, then flag_store_release) once the data is complete. The TMA engine's
// copies, driven by one thread, are the bulk-copy stream (kernels/comm/bulk_copy.cuh).
#pragma once

#include <cstdint>


namespace loom::kernels {

constexpr uint32_t kVectorBytes = 16;

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & (kVectorBytes - 1)) == 0;
}

// Copies `bytes` from src to dst with threads [lane, lane + nlanes*k ...) of the caller's group.
// dst and src may have any alignment; when both share the same offset modulo 16 the bulk moves
// as 16-byte vectors, otherwise (only for odd-sized shards) byte by byte.
template <int kUnroll>
__device__ __forceinline__ void vector_copy(char* dst, const char* src, uint64_t bytes, uint32_t lane,
                                            uint32_t nlanes) {
  static_assert(kUnroll >= 1 && kUnroll <= 16, "vector_copy: kUnroll must be between 1 and 16");
  const uint32_t dst_mis = reinterpret_cast<uintptr_t>(dst) & (kVectorBytes - 1);
  const uint32_t src_mis = reinterpret_cast<uintptr_t>(src) & (kVectorBytes - 1);
  if (dst_mis != src_mis) {
    for (uint64_t i = lane; i < bytes; i += nlanes) dst[i] = src[i];
    return;
  }
  uint64_t head = dst_mis == 0 ? 0 : kVectorBytes - dst_mis;
  if (head > bytes) head = bytes;
  for (uint64_t i = lane; i < head; i += nlanes) dst[i] = src[i];
  dst += head;
  src += head;
  bytes -= head;

  const uint64_t vectors = bytes / kVectorBytes;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  const uint64_t step = static_cast<uint64_t>(nlanes) * kUnroll;
  uint64_t v = lane;
  for (; v + (kUnroll - 1) * static_cast<uint64_t>(nlanes) < vectors; v += step) {
    uint4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) buf[u] = s[v + static_cast<uint64_t>(u) * nlanes];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[v + static_cast<uint64_t>(u) * nlanes] = buf[u];
  }
  for (; v < vectors; v += nlanes) d[v] = s[v];

  const uint64_t tail_begin = vectors * kVectorBytes;
  for (uint64_t i = tail_begin + lane; i < bytes; i += nlanes) dst[i] = src[i];
}

// One warp: the row at src (`bytes`) copied into every destination row of `targets` (a
// warp-uniform mask: lane j of it holds its row's address in `dst`), each 16-byte vector loaded
// once and stored to all of them, kUnroll loads in flight. Rows that are not all 16-byte aligned
// with src are copied one after another by vector_copy.
template <int kUnroll>
__device__ __forceinline__ void vector_copy_to_rows(char* dst, uint32_t targets, const char* src, uint64_t bytes,
                                                    uint32_t lane) {
  static_assert(kUnroll >= 1 && kUnroll <= 16, "vector_copy_to_rows: kUnroll must be between 1 and 16");
  const bool aligned = __all_sync(0xffffffffu, ((targets >> lane) & 1) == 0 || aligned16(dst)) && aligned16(src) &&
                       bytes % kVectorBytes == 0;
  if (!aligned) {
    for (uint32_t m = targets; m != 0; m &= m - 1) {
      char* row = reinterpret_cast<char*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dst), __ffs(m) - 1));
      vector_copy<kUnroll>(row, src, bytes, lane, 32);
    }
    return;
  }
  const uint64_t vectors = bytes / kVectorBytes;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  for (uint64_t v0 = 0; v0 < vectors; v0 += 32ull * kUnroll) {
    uint4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + static_cast<uint64_t>(u) * 32 + lane;
      if (v < vectors) buf[u] = s[v];
    }
    for (uint32_t m = targets; m != 0; m &= m - 1) {
      uint4* d = reinterpret_cast<uint4*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dst), __ffs(m) - 1));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t v = v0 + static_cast<uint64_t>(u) * 32 + lane;
        if (v < vectors) d[v] = buf[u];
      }
    }
  }
}

}  // namespace loom::kernels
