// The tail split, an opt-in policy of the GEMM engine's TileScheduler: the last partial wave of
// whole tiles leaves SMs idle for a whole tile's time; cut into K pieces, its tiles let every SM
// take a share of it. The last `tiles` tiles of the order are each handed out as `pieces` items:
// pieces - 1 kTilePiece items (K ranges 1, 2, ... of `pieces` equal ranges), then the kTileFold
// item (K range 0) that adds the pieces' staged partials — part by part over the split tiles
// (every tile's first piece, then every tile's second, ..., then the fold items). A role whose
// scheduler splits needs a Fold policy with piece_map() (fold.cuh), which stages and folds them.
//
// Policy interface (TileScheduler's Split parameter; NoTailSplit is the default):
//   uint32_t items(uint32_t total) const;                  // work items for `total` tiles
//   TailPosition locate(uint32_t w, uint32_t total) const; // work item w -> position in the order
//   void shape(WorkItem& item, const TailPosition&) const; // a split tile's kind, K range, slots
#pragma once

#include <cstdint>

#include "kernels/gemm/params.h"

namespace loom::kernels::gemm {

// Work item w's place: position t of the tile order, and for a split tile which part it is.
struct TailPosition {
  uint32_t t;
  uint32_t part;       // 0 .. pieces - 1 (the last part is the fold item)
  uint32_t tail_index; // the split tile's index among the split tiles
  bool split;
};

// The default: every tile whole.
struct NoTailSplit {
  __device__ uint32_t items(uint32_t total) const { return total; }
  __device__ TailPosition locate(uint32_t w, uint32_t /*total*/) const { return TailPosition{w, 0, 0, false}; }
  __device__ void shape(WorkItem& /*item*/, const TailPosition& /*pos*/) const {}
};

// TailSplitParams (params.h) at run time: pieces < 2 splits nothing.
class TailSplit {
 public:
  __device__ explicit TailSplit(const TailSplitParams& params) : p_(params) {}

  __device__ uint32_t items(uint32_t total) const { return whole(total) + (total - whole(total)) * pieces(); }

  // The split tiles go part by part: items running side by side read the same K range of
  // neighbouring tiles (L2 reuse, as whole tiles in a raster group do), and every fold item (a
  // tile's last part) comes after every piece, so a fold never waits for a piece that is queued
  // behind it (pieces wait for nothing).
  __device__ TailPosition locate(uint32_t w, uint32_t total) const {
    const uint32_t first = whole(total);
    if (w < first) return TailPosition{w, 0, 0, false};
    const uint32_t split_tiles = total - first;
    const uint32_t part = (w - first) / split_tiles;
    const uint32_t tail_index = (w - first) - part * split_tiles;
    return TailPosition{first + tail_index, part, tail_index, true};
  }

  // Parts 0 .. pieces-2 are the pieces (K ranges 1, 2, ...), the last part the fold item (K
  // range 0), which adds them.
  __device__ void shape(WorkItem& item, const TailPosition& pos) const {
    if (!pos.split) return;
    const uint32_t n = pieces();
    const bool folds = pos.part == n - 1;
    const uint32_t range = folds ? 0 : pos.part + 1;
    item.k_begin = range * p_.k_blocks / n;
    item.k_end = (range + 1) * p_.k_blocks / n;
    item.split_slot = pos.tail_index * (n - 1) + (folds ? 0 : pos.part);
    item.split_count = folds ? n - 1 : 0;
    item.kind = static_cast<uint32_t>(folds ? WorkKind::kTileFold : WorkKind::kTilePiece);
  }

 private:
  __device__ uint32_t pieces() const { return p_.pieces >= 2 ? p_.pieces : 1u; }
  __device__ uint32_t whole(uint32_t total) const { return total - (pieces() > 1 ? p_.tiles : 0u); }  // tiles handed out whole

  const TailSplitParams& p_;
};

}  // namespace loom::kernels::gemm
