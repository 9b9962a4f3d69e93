// The attention engine's tile configurations and shared-memory layout (plain C++: the planner,
// the launchers and the kernels read the same constants; no CUDA headers).
//
// A CTA is one producer warpgroup and kConsumers (2 or 3) consumer warpgroups (128 threads each).
// One tile is kBlockM = 64 * kConsumers query rows of one (batch, head); consumer warpgroup c owns
// rows [64c, 64c + 64) and loops over the tile's K/V blocks of kBlockN rows. The producer's elected
// thread issues every TMA load. Three consumers (hd64 only) give the softmax of two warpgroups the
// time of one warpgroup's GEMMs: at hd64 a block's softmax takes as long as its GEMMs.
//
// Shared memory (offsets from a 1024-byte aligned base; kSmemBytes adds 1024 for the alignment):
//   q[t]    kQStages * kQBytes, kQBytes = kBlockM * D * 2   D/64 boxes of kBlockM rows x 128 B (128B
//           swizzle); two slots where they fit, so the next tile's Q loads while this one ends
//   k[s]    kStages * kKVBytes, kKVBytes = kBlockN * D * 2   D/64 boxes of kBlockN rows x 128 B
//   v[s]    kStages * kKVBytes                    same boxes (read N-major by the P V wgmma)
//   bars    8 B mbarriers: q_full[t], q_empty[t], k_full[s], k_empty[s], v_full[s], v_empty[s],
//           then one 8 B word (the offset check's first bad sequence), then kQStages tile tasks
//           of kTaskBytes = 16 + 16 * kMaxSegments (the tile the producer claimed for Q slot t and
//           its key segments' lengths, positions and blocks, written before q_full[t] completes)
#pragma once

#include <cstdint>

namespace loom::kernels::attention {

// Warpgroups of a CTA, in thread order (warpgroup g = threads [128g, 128g + 128)).
enum class WarpGroupRole : uint32_t {
  kProducer = 0,   // one elected thread issues the TMA loads of Q, K and V
  kConsumer0 = 1,  // rows [0, 64) of the tile: S = Q K^T, online softmax, O += P V
  kConsumer1 = 2,  // rows [64, 128)
  kConsumer2 = 3,  // rows [128, 192) (three-consumer configurations)
};

// Named barriers (bar.sync ids; 0 is __syncthreads): the consumers take turns issuing their wgmma
// (pingpong, in the order 0, 1, ..., kConsumers - 1, 0, ...), so the others' softmax runs while one
// warpgroup's GEMMs use the tensor cores. Consumer c waits at kPingpongBarrier0 + c for its turn.
constexpr uint32_t kPingpongBarrier0 = 1;
constexpr uint32_t kMaxConsumers = 3;

// Key segments a query tile may visit (ring attention: two per rank of up to 8 local ranks).
constexpr int kMaxSegments = 16;

template <int kHeadDim_, int kBlockN_, int kStages_, int kQStages_, int kConsumers_ = 2>
struct FlashConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kQStages = kQStages_;
  static constexpr int kConsumerRows = kBlockM / kConsumers;  // one m64 wgmma row block
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kDChunks = kHeadDim / 64;  // 128-byte swizzled boxes along D

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim must be 64, 128 or 256");
  static_assert(kBlockN % 16 == 0 && kBlockN >= 16 && kBlockN <= 256,
                "BLOCK_N must be a multiple of 16 (one P V k-step) and at most 256 (a TMA box)");
  static_assert(kStages >= 2, "K/V need at least two stages to overlap loads with compute");
  static_assert(kQStages == 1 || kQStages == 2, "Q has one slot, or two so the next tile's Q loads early");
  static_assert(kConsumerRows == 64, "each consumer warpgroup owns one m64 row block");
  static_assert(kConsumers == 2 || (kConsumers == 3 && kBlockN / 2 + kBlockN / 4 + kHeadDim / 2 <= 128),
                "three consumers hold S, P and O (BLOCK_N / 2 + BLOCK_N / 4 + D / 2 registers) in 160 each: at most "
                "128 of them");

  // Registers: the producer gives registers to the consumers (128 * producer + 128 * kConsumers *
  // consumer <= 65536). Ring attention's producer (its keys policy: segments, arrival waits) spills
  // below 56; hd256's consumers (O alone is 128 registers) need 232, and their producer gets 40.
  // Three consumers get 160 each (S 64 + P 32 + O 32 at BLOCK_N 128), leaving the producer 32.
  static constexpr int kProducerRegs = kConsumers == 3 ? 32 : kHeadDim == 256 ? 40 : 56;
  static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : kHeadDim == 256 ? 232 : 224;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 65536, "the register split exceeds the SM's registers");
  // The online softmax's lazy rescale (softmax.cuh): 2-10 % faster at hd64 and 4-8 % at hd256 on
  // one H100 (two A/Bs); hd128, whose consumers hold S, P and O in 196 of their 224 registers, was
  // 1-3 % slower in one A/B and within the noise in another (0.97-1.04 by row), so it keeps the
  // exact maximum (docs/PERFORMANCE_NOTES.md).
  static constexpr bool kLazyRescale = kHeadDim != 128;

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * 2;
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr uint32_t kQBoxBytes = kBlockM * 128;   // one D-chunk of Q
  static constexpr uint32_t kKVBoxBytes = kBlockN * 128;  // one D-chunk of a K or V block

  static constexpr uint32_t kQOffset = 0;
  static constexpr uint32_t kKOffset = kQOffset + kQStages * kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kKVBytes;
  static constexpr uint32_t kBarrierOffset = kVOffset + kStages * kKVBytes;
  static constexpr uint32_t kBarriers = 2 * kQStages + 4 * kStages;
  static constexpr uint32_t kScratchOffset = kBarrierOffset + 8 * kBarriers;
  static constexpr uint32_t kTaskOffset = (kScratchOffset + 8 + 15) / 16 * 16;
  static constexpr uint32_t kTaskBytes = 16 + 16 * kMaxSegments;
  static constexpr uint32_t kSmemBytes = 1024 + kTaskOffset + kTaskBytes * kQStages;

  static_assert(kKVBoxBytes % 1024 == 0, "K/V boxes must keep the 1024-byte swizzle-atom alignment (BLOCK_N % 8 == 0)");
  // H100/H200 allow 227 KiB of dynamic shared memory per block (232448 bytes); the planner checks
  // the device's actual limit as well.
  static_assert(kSmemBytes <= 232448, "configuration does not fit in 227 KiB of shared memory");
};

// Every tunable of ring attention (sm90_ring_attention.cuh; the host planner reads them too).
struct RingTunables {
  static constexpr uint32_t kChunkRows = 128;  // K/V rows per arrival flag (all KV heads of a batch)
  static constexpr int kPushStages = 8;         // each push CTA's bulk-copy stream: stages x piece bytes
  static constexpr uint32_t kPushPieceBytes = 16 * 1024;
  static constexpr int kPushFlagLag = 4;        // bulk groups in flight before a chunk's flag is set
  static constexpr int kMaxKvCtas = 8;
  static constexpr int kDefaultKvCtas = 4;
};

// The configurations loom ships (BLOCK_N and the stages fill the shared memory; a wider BLOCK_N
// leaves room for one Q slot only). The planner picks one per head dim; AttentionOptions::block_m
// and block_n force another. Names: head dim x BLOCK_N, then _m<BLOCK_M> where it is not 128.
using Flash64x128 = FlashConfig<64, 128, 4, 2>;
using Flash64x128_m192 = FlashConfig<64, 128, 4, 2, 3>;
using Flash64x192 = FlashConfig<64, 192, 3, 2>;
using Flash128x128 = FlashConfig<128, 128, 2, 2>;
using Flash128x176 = FlashConfig<128, 176, 2, 1>;
using Flash256x64 = FlashConfig<256, 64, 2, 1>;
using Flash256x80 = FlashConfig<256, 80, 2, 1>;

}  // namespace loom::kernels::attention
