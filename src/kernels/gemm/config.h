// GEMM engine tile configurations and shared-memory layout (plain C++: the host planner, the
// launchers and the kernels all read these constants; no CUDA headers).
//
// A CTA of a configuration is 1 producer warpgroup + kConsumers consumer warpgroups (128 threads
// each). Consumer warpgroup g owns tile rows [64g, 64g + 64) and issues m64nBNk16 wgmma; the
// producer's one elected thread runs the scheduler and issues every TMA load.
//
// Shared memory (offsets from a 1024-byte-aligned base; kSmemBytes adds 1024 for the alignment):
//   a[s]       kStages * kABytes      kABytes = BM * 64 * 2      (A tile, K-major, 128B swizzle)
//   b[s]       kStages * kBBytes      kBBytes = BN * 64 * 2      (B tile; K-major: BN rows x 128 B;
//                                                                N-major: BN/64 boxes of 64 K-rows x 128 B)
//   epi[w][2]  kConsumers*4*2 * 2048  per consumer warp, two 16-row x 128-byte staging boxes (swizzled)
//   control    kControlBytes          full[s], empty[s], tile_full[t], tile_empty[t], signal_full[t],
//                                     signal_empty[t] (8 B mbarriers), tile ring and signal ring
//                                     items (kWorkItemBytes each), persisted role state (kRoleStateBytes)
#pragma once

#include <cstdint>

namespace loom::kernels::gemm {

constexpr int kBlockK = 64;       // 64 x 16-bit = 128 bytes: one 128B-swizzle row
constexpr int kMaxDst = 8;        // epilogue destinations (row partition, e.g. one per rank)
constexpr int kTileSlots = 4;     // tile ring depth between the producer and the consumers, and
                                  // signal ring depth between the consumers and the signaler
constexpr int kWorkItemBytes = 44;  // a WorkItem (params.h) in the tile and signal rings
constexpr int kRoleStateBytes = 128;  // the compute role's state persisted between run() calls
constexpr int kEpiRows = 16;      // rows per consumer warp
constexpr int kEpiBoxBytes = kEpiRows * 128;
// A tile row that ends inside its tile (schedulers with row ranges) loads only its rows of A, in
// boxes of this many rows (GemmOperands::a_rows): the wgmma N step of a swapped tail, and a
// multiple of the 128B swizzle's 8-row period, so the boxes land as one BM-row box would.
constexpr int kTailRowBox = 16;

template <int kBlockM_, int kBlockN_, int kStages_>
struct TileConfig {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockK = gemm::kBlockK;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumers = kBlockM / 64;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerThreads = 128 * kConsumers;

  static_assert(kBlockM == 64 || kBlockM == 128, "BLOCK_M is 64 (one consumer warpgroup) or 128 (two)");
  static_assert(kBlockN == 64 || kBlockN == 128 || kBlockN == 256, "BLOCK_N must be a wgmma N: 64, 128 or 256");
  static_assert(kStages >= 2, "the pipeline needs at least two stages");

  // Register budgets: with two consumer warpgroups the producer gives registers to the consumers
  // (128*40 + 256*232 = 64512 <= 65536). With one, every thread already gets 255 (256 threads).
  static constexpr bool kSetMaxNReg = kConsumers > 1;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  // Registers per thread at kernel entry under __launch_bounds__(kThreads, 1) (multiple of 8).
  static constexpr int kEntryRegs = (65536 / kThreads) / 8 * 8 > 255 ? 255 : (65536 / kThreads) / 8 * 8;

  static constexpr uint32_t kABytes = kBlockM * kBlockK * 2;
  static constexpr uint32_t kBBytes = kBlockN * kBlockK * 2;
  static constexpr uint32_t kStageTxBytes = kABytes + kBBytes;  // what TMA delivers per stage

  static constexpr uint32_t kAOffset = 0;
  static constexpr uint32_t kBOffset = kAOffset + kStages * kABytes;
  static constexpr uint32_t kEpiOffset = kBOffset + kStages * kBBytes;
  static constexpr uint32_t kEpiBytes = kConsumers * 4 * 2 * kEpiBoxBytes;
  static constexpr uint32_t kControlOffset = kEpiOffset + kEpiBytes;
  static constexpr uint32_t kFullOffset = kControlOffset;
  static constexpr uint32_t kEmptyOffset = kFullOffset + 8 * kStages;
  static constexpr uint32_t kTileFullOffset = kEmptyOffset + 8 * kStages;
  static constexpr uint32_t kTileEmptyOffset = kTileFullOffset + 8 * kTileSlots;
  static constexpr uint32_t kTileRingOffset = kTileEmptyOffset + 8 * kTileSlots;
  static constexpr uint32_t kSignalFullOffset = kTileRingOffset + kWorkItemBytes * kTileSlots;
  static constexpr uint32_t kSignalEmptyOffset = kSignalFullOffset + 8 * kTileSlots;
  static constexpr uint32_t kSignalRingOffset = kSignalEmptyOffset + 8 * kTileSlots;
  static constexpr uint32_t kStateOffset = kSignalRingOffset + kWorkItemBytes * kTileSlots;
  static constexpr uint32_t kControlBytes = kStateOffset + kRoleStateBytes - kControlOffset;
  static constexpr uint32_t kSmemBytes = 1024 + kControlOffset + kControlBytes;

  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "stage buffers must keep 1024-byte swizzle alignment");
  static_assert(kEpiOffset % 1024 == 0, "epilogue boxes must be 1024-byte aligned (128B swizzle)");
  // H100/H200 allow 227 KiB of dynamic shared memory per block (232448 bytes); launchers check
  // the device's actual limit as well.
  static_assert(kSmemBytes <= 232448, "configuration does not fit in 227 KiB of shared memory");
};

// The configurations loom ships (GemmTile in include/loom/gemm.h names them).
using Tile128x256 = TileConfig<128, 256, 4>;  // large M: 2 consumers x m64n256
using Tile128x128 = TileConfig<128, 128, 6>;  // medium
using Tile128x64 = TileConfig<128, 64, 8>;    // M around 128..1024 with N too small for enough 128x128 tiles
using Tile64x128 = TileConfig<64, 128, 8>;    // M <= 64: one consumer

}  // namespace loom::kernels::gemm
