#include "planner/attention_plan.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "kernels/attention/config.h"

namespace loom {

std::string_view attention_layout_name(AttentionLayout layout) {
  return layout == AttentionLayout::kPacked ? "packed" : "bshd";
}

namespace planner {

namespace {

namespace ka = kernels::attention;

template <class Cfg>
AttentionPlanInfo info_of() {
  AttentionPlanInfo i;
  i.block_m = Cfg::kBlockM;
  i.block_n = Cfg::kBlockN;
  i.stages = Cfg::kStages;
  i.threads = Cfg::kThreads;
  i.smem_bytes = Cfg::kSmemBytes;
  return i;
}

constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxStrideBytes = int64_t{1} << 40;  // TMA's limit on a tensor map stride

std::string str(int64_t v) { return std::to_string(v); }

// Byte range [lo, hi) of a tensor of rows x heads x batch rows of `width` elements.
struct ByteRange {
  uintptr_t lo = 0, hi = 0;
  bool overlaps(const ByteRange& o) const { return lo < hi && o.lo < o.hi && lo < o.hi && o.lo < hi; }
};
ByteRange range_of(const void* p, int64_t rows, int64_t heads, int64_t batch, int64_t width, const AttentionStrides& s,
                   size_t elem) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  if (rows <= 0 || heads <= 0 || batch <= 0 || width <= 0) return {lo, lo};
  const int64_t last = (rows - 1) * s.row + (heads - 1) * s.head + (batch - 1) * s.batch + width;
  return {lo, lo + static_cast<uintptr_t>(last) * elem};
}

// Rows, heads and batch entries of q (or out) and of k/v as the kernel addresses them.
struct Extents {
  int64_t q_rows, k_rows, batch;
};
Extents extents_of(const AttentionArgs& a) {
  if (a.layout == AttentionLayout::kPacked) return {a.total_q, a.total_k, 1};
  return {a.seqlen_q, a.seqlen_k, a.batch};
}

Status check_strides(const char* name, const AttentionStrides& s, int64_t rows, int64_t heads, int64_t batch,
                     int64_t head_dim, size_t elem) {
  for (const auto& [field, value] : {std::pair{"row", s.row}, {"head", s.head}, {"batch", s.batch}}) {
    if (value <= 0 || value % 8 != 0) {
      return Status::invalid_argument(std::string("attention: ") + name + " " + field + " stride " + str(value) +
                                      " must be a positive multiple of 8 elements (16 bytes: TMA)");
    }
    if (value > kMaxStrideBytes / static_cast<int64_t>(elem)) {
      return Status::invalid_argument(std::string("attention: ") + name + " " + field + " stride " + str(value) +
                                      " is 2^40 bytes or more (TMA's limit)");
    }
  }
  // Every element offset must fit in int64 arithmetic.
  const double last = static_cast<double>(rows) * s.row + static_cast<double>(heads) * s.head +
                      static_cast<double>(batch) * s.batch + head_dim;
  if (last * static_cast<double>(elem) > 4.0e18) {
    return Status::invalid_argument(std::string("attention: ") + name + " spans more than 2^62 bytes");
  }
  return Status{};
}

Status check_pointer(const char* name, const void* p, bool needed, size_t align) {
  if (p == nullptr) {
    return needed ? Status::invalid_argument(std::string("attention: ") + name + " is null") : Status{};
  }
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    return Status::invalid_argument(std::string("attention: ") + name + " is not " + str(static_cast<int64_t>(align)) +
                                    "-byte aligned");
  }
  return Status{};
}

}  // namespace

AttentionPlanInfo attention_tile(int64_t head_dim, int block_n, int block_m) {
  if (block_m == 192) {  // three consumer warpgroups: hd64 with BLOCK_N 128 only
    return head_dim == 64 && (block_n == 0 || block_n == 128) ? info_of<ka::Flash64x128_m192>() : AttentionPlanInfo{};
  }
  if (block_m != 0 && block_m != 128) return AttentionPlanInfo{};
  switch (head_dim * 1000 + block_n) {
    case 64000:  // the default (default_block_n picks by sequence length)
    case 64128: return info_of<ka::Flash64x128>();
    case 64192: return info_of<ka::Flash64x192>();
    case 128128: return info_of<ka::Flash128x128>();
    case 128000:
    case 128176: return info_of<ka::Flash128x176>();
    case 256064: return info_of<ka::Flash256x64>();
    case 256000:
    case 256080: return info_of<ka::Flash256x80>();
    default: return AttentionPlanInfo{};
  }
}

int default_block_n(int64_t head_dim, int64_t seqlen_k, bool causal) {
  // Measured on one H200 (docs/PERFORMANCE_NOTES.md): at hd64 the wider block wins from 2K keys on
  // (fewer rescales and row reductions per key), below it the narrower one; at hd128 176 keys beat
  // 128 at every length from 4K (the softmax per block amortizes over more keys), and without a
  // mask below it too; under a causal mask below 2K keys 128 wins (one H100: 6 % at 1K), where a
  // 176-key block that does not divide the 128-row tiles computes 22 % more scores than the mask
  // keeps (10 % with 128); at hd256 80.
  switch (head_dim) {
    case 64: return seqlen_k >= 2048 ? 192 : 128;
    case 128: return causal && seqlen_k < 2048 ? 128 : 176;
    case 256: return 80;
    default: return 0;
  }
}

int default_block_m(int64_t head_dim, int block_n, bool causal, int64_t seqlen_q) {
  // Measured on one H100 (docs/PERFORMANCE_NOTES.md): at hd64 three consumers (192 x 128 tiles)
  // beat two at every length from 512 queries, but under a causal mask only from 2K (at 1K the
  // diagonal's partly masked 192-row tiles cost more); shorter sequences were not measured. At
  // hd128 they lost (192 x 80).
  if (head_dim != 64 || block_n != 0) return 128;
  return seqlen_q >= (causal ? 2048 : 512) ? 192 : 128;
}

bool ring_tile_built(int64_t head_dim, int block_n) {
  for (const RingTile& t : kRingTiles) {
    if (t.head_dim == head_dim && t.block_n == block_n) return true;
  }
  return false;
}

AttentionResolvedStrides resolve_attention_strides(const AttentionArgs& a) {
  const Extents e = extents_of(a);
  auto fill = [&](AttentionStrides s, int64_t heads, int64_t rows) {
    if (s.head == 0) s.head = a.head_dim;
    if (s.row == 0) s.row = heads * a.head_dim;
    if (s.batch == 0) s.batch = std::max<int64_t>(rows, 1) * s.row;
    return s;
  };
  AttentionResolvedStrides r;
  r.q = fill(a.q_strides, a.heads_q, e.q_rows);
  r.k = fill(a.k_strides, a.heads_kv, e.k_rows);
  r.v = fill(a.v_strides, a.heads_kv, e.k_rows);
  r.out = fill(a.out_strides, a.heads_q, e.q_rows);
  r.lse_head = std::max<int64_t>(e.q_rows, 1);
  r.lse_batch = a.heads_q * r.lse_head;
  return r;
}

Status validate_attention(const AttentionArgs& a, const AttentionOptions& o) {
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) {
    return Status::unsupported("attention: q, k and v must be bf16 or fp16 (got " + std::string(dtype_name(a.dtype)) +
                               ")");
  }
  if (attention_tile(a.head_dim).block_m == 0) {
    return Status::unsupported("attention: head dim " + str(a.head_dim) + " is not supported (64, 128 or 256)");
  }
  if (attention_tile(a.head_dim, o.block_n, o.block_m).block_m == 0) {
    return Status::invalid_argument("attention: block_m " + std::to_string(o.block_m) + " with block_n " +
                                    std::to_string(o.block_n) + " is not a configuration for head dim " +
                                    str(a.head_dim) + " (block_n 0, or hd64: 128, 192; hd128: 128, 176; hd256: 64, "
                                    "80; block_m 0 or 128, or 192 at hd64 with block_n 0 or 128)");
  }
  if (a.heads_q < 1 || a.heads_kv < 1) {
    return Status::invalid_argument("attention: heads_q (" + str(a.heads_q) + ") and heads_kv (" + str(a.heads_kv) +
                                    ") must be at least 1");
  }
  if (a.heads_q % a.heads_kv != 0) {
    return Status::invalid_argument("attention: heads_q (" + str(a.heads_q) + ") must be a multiple of heads_kv (" +
                                    str(a.heads_kv) + ")");
  }
  for (const auto& [name, value] : {std::pair{"batch", a.batch}, {"seqlen_q", a.seqlen_q}, {"seqlen_k", a.seqlen_k},
                                    {"total_q", a.total_q}, {"total_k", a.total_k}, {"heads_q", a.heads_q}}) {
    if (value < 0) return Status::invalid_argument(std::string("attention: ") + name + " is negative (" + str(value) + ")");
    if (value > kMaxDim) {
      return Status::unsupported(std::string("attention: ") + name + " (" + str(value) + ") must be below 2^31");
    }
  }
  const bool packed = a.layout == AttentionLayout::kPacked;
  if (packed) {
    if (a.batch > 0 && (a.cu_seqlens_q == nullptr || a.cu_seqlens_k == nullptr)) {
      return Status::invalid_argument("attention: the packed layout needs cu_seqlens_q and cu_seqlens_k ([batch + 1] "
                                      "int32 on the device)");
    }
    LOOM_TRY(check_pointer("cu_seqlens_q", a.cu_seqlens_q, false, 4));
    LOOM_TRY(check_pointer("cu_seqlens_k", a.cu_seqlens_k, false, 4));
  } else {
    if (a.cu_seqlens_q != nullptr || a.cu_seqlens_k != nullptr || a.total_q != 0 || a.total_k != 0) {
      return Status::invalid_argument("attention: cu_seqlens and total_q/total_k belong to the packed layout "
                                      "(layout is bshd)");
    }
  }
  const int64_t m_blocks = (a.seqlen_q + 127) / 128;
  if (static_cast<double>(a.batch) * static_cast<double>(a.heads_q) * static_cast<double>(m_blocks) >= 4294967295.0) {
    return Status::unsupported("attention: batch x heads x query tiles must stay below 2^32");
  }
  if (!(std::isfinite(o.scale) && o.scale >= 0.f)) {
    return Status::invalid_argument("attention: scale must be finite and positive (0 means 1/sqrt(head_dim))");
  }
  if (o.num_ctas < 0) return Status::invalid_argument("attention: num_ctas must be >= 0 (0: one per SM)");
  if (o.partial && a.lse == nullptr) {
    return Status::invalid_argument("attention: partial mode needs lse (attention_merge weighs partials by it)");
  }

  const Extents e = extents_of(a);
  const bool any_q = e.q_rows > 0 && e.batch > 0;
  const bool any_k = e.k_rows > 0 && e.batch > 0;
  LOOM_TRY(check_pointer("q", a.q, any_q, 16));
  LOOM_TRY(check_pointer("out", a.out, any_q, 16));
  LOOM_TRY(check_pointer("k", a.k, any_k, 16));
  LOOM_TRY(check_pointer("v", a.v, any_k, 16));
  LOOM_TRY(check_pointer("lse", a.lse, false, 4));

  const AttentionResolvedStrides s = resolve_attention_strides(a);
  const size_t in_elem = dtype_size(a.dtype);
  const size_t out_elem = o.partial ? 4 : in_elem;
  LOOM_TRY(check_strides("q", s.q, e.q_rows, a.heads_q, e.batch, a.head_dim, in_elem));
  LOOM_TRY(check_strides("k", s.k, e.k_rows, a.heads_kv, e.batch, a.head_dim, in_elem));
  LOOM_TRY(check_strides("v", s.v, e.k_rows, a.heads_kv, e.batch, a.head_dim, in_elem));
  LOOM_TRY(check_strides("out", s.out, e.q_rows, a.heads_q, e.batch, a.head_dim, out_elem));

  const ByteRange q = range_of(a.q, e.q_rows, a.heads_q, e.batch, a.head_dim, s.q, in_elem);
  const ByteRange k = range_of(a.k, e.k_rows, a.heads_kv, e.batch, a.head_dim, s.k, in_elem);
  const ByteRange v = range_of(a.v, e.k_rows, a.heads_kv, e.batch, a.head_dim, s.v, in_elem);
  const ByteRange out = range_of(a.out, e.q_rows, a.heads_q, e.batch, a.head_dim, s.out, out_elem);
  const AttentionStrides lse_strides{1, s.lse_head, s.lse_batch};
  const ByteRange lse = a.lse == nullptr ? ByteRange{} : range_of(a.lse, e.q_rows, a.heads_q, e.batch, 1, lse_strides, 4);
  for (const auto& [name, r] : {std::pair{"q", q}, {"k", k}, {"v", v}}) {
    if (out.overlaps(r)) return Status::invalid_argument(std::string("attention: out overlaps ") + name);
    if (lse.overlaps(r)) return Status::invalid_argument(std::string("attention: lse overlaps ") + name);
  }
  if (lse.overlaps(out)) return Status::invalid_argument("attention: lse overlaps out");
  return Status{};
}

Result<AttentionPlan> plan_attention(const AttentionArgs& a, const AttentionOptions& o,
                                     const AttentionDeviceLimits& device) {
  LOOM_TRY(validate_attention(a, o));
  AttentionPlan plan;
  // BLOCK_M 192 brings its own BLOCK_N; otherwise the option's or the default for the keys.
  const int block_m = o.block_m > 0 ? o.block_m : default_block_m(a.head_dim, o.block_n, o.causal, a.seqlen_q);
  const int block_n = o.block_n > 0 || block_m == 192 ? o.block_n : default_block_n(a.head_dim, a.seqlen_k, o.causal);
  plan.info = attention_tile(a.head_dim, block_n, block_m);
  if (static_cast<int64_t>(plan.info.smem_bytes) > device.smem_per_block_optin) {
    return Status::unsupported("attention: head dim " + str(a.head_dim) + " needs " +
                               str(static_cast<int64_t>(plan.info.smem_bytes)) +
                               " bytes of shared memory per block; the device allows " +
                               str(device.smem_per_block_optin));
  }
  if (device.sm_count < 1) return Status::invalid_argument("attention: the device reports no SMs");
  plan.strides = resolve_attention_strides(a);
  plan.scale = o.scale > 0.f ? o.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.head_dim)));
  plan.m_blocks = (a.seqlen_q + plan.info.block_m - 1) / plan.info.block_m;
  const int64_t pairs = a.batch * a.heads_q;
  plan.info.tiles = pairs * plan.m_blocks;
  plan.empty = plan.info.tiles == 0 || (a.layout == AttentionLayout::kPacked && a.total_q == 0);
  const int64_t grid = o.num_ctas > 0 ? o.num_ctas : device.sm_count;
  plan.info.grid = static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(grid, plan.info.tiles), 1, kMaxDim));
  // Causal order: sections of (batch, head) pairs whose K and V fit in half the L2 (heads that
  // share a K/V head under GQA count once).
  const int64_t group = a.heads_q / a.heads_kv;
  const double kv_bytes_per_pair =
      std::max(1.0, static_cast<double>(a.seqlen_k) * a.head_dim * 2.0 * static_cast<double>(dtype_size(a.dtype)) /
                        static_cast<double>(group));
  const double l2 = device.l2_bytes > 0 ? static_cast<double>(device.l2_bytes) : 0.0;
  const int64_t fit = static_cast<int64_t>(l2 / 2.0 / kv_bytes_per_pair);
  plan.section_heads = static_cast<uint32_t>(std::clamp<int64_t>(fit, 1, std::max<int64_t>(pairs, 1)));
  return plan;
}

Status validate_attention_merge(const AttentionMergeArgs& a) {
  if (a.num_partials < 1) return Status::invalid_argument("attention_merge: num_partials must be at least 1");
  for (const auto& [name, value] :
       {std::pair{"batch", a.batch}, {"seqlen", a.seqlen}, {"heads", a.heads}, {"head_dim", a.head_dim}}) {
    if (value < 0) {
      return Status::invalid_argument(std::string("attention_merge: ") + name + " is negative (" + str(value) + ")");
    }
  }
  if (a.head_dim % 4 != 0) return Status::invalid_argument("attention_merge: head_dim must be a multiple of 4");
  const double elems = static_cast<double>(a.num_partials) * a.batch * a.seqlen * a.heads * a.head_dim;
  if (elems >= 4.0e18 / 4) return Status::unsupported("attention_merge: the partials span more than 2^62 bytes");
  const bool any = a.batch > 0 && a.seqlen > 0 && a.heads > 0 && a.head_dim > 0;
  struct Pointer {
    const char* name;
    const void* p;
    int64_t align;
  };
  for (const Pointer& x : {Pointer{"partial_out", a.partial_out, 16}, Pointer{"partial_lse", a.partial_lse, 4},
                           Pointer{"out", a.out, 16}}) {
    if (any && x.p == nullptr) return Status::invalid_argument(std::string("attention_merge: ") + x.name + " is null");
    if (reinterpret_cast<uintptr_t>(x.p) % static_cast<uintptr_t>(x.align) != 0) {
      return Status::invalid_argument(std::string("attention_merge: ") + x.name + " is not " + str(x.align) +
                                      "-byte aligned");
    }
  }
  if (reinterpret_cast<uintptr_t>(a.lse) % 4 != 0) return Status::invalid_argument("attention_merge: lse is not 4-byte aligned");
  const int64_t rows = a.batch * a.seqlen * a.heads;
  const ByteRange out = {reinterpret_cast<uintptr_t>(a.out),
                         reinterpret_cast<uintptr_t>(a.out) +
                             static_cast<uintptr_t>(rows * a.head_dim) * dtype_size(a.out_dtype)};
  const ByteRange parts = {reinterpret_cast<uintptr_t>(a.partial_out),
                           reinterpret_cast<uintptr_t>(a.partial_out) +
                               static_cast<uintptr_t>(a.num_partials * rows * a.head_dim) * 4};
  const ByteRange part_lse = {reinterpret_cast<uintptr_t>(a.partial_lse),
                              reinterpret_cast<uintptr_t>(a.partial_lse) + static_cast<uintptr_t>(a.num_partials * rows) * 4};
  const ByteRange lse = a.lse == nullptr ? ByteRange{}
                                         : ByteRange{reinterpret_cast<uintptr_t>(a.lse),
                                                     reinterpret_cast<uintptr_t>(a.lse) + static_cast<uintptr_t>(rows) * 4};
  if (out.overlaps(parts) || out.overlaps(part_lse) || lse.overlaps(parts) || lse.overlaps(part_lse) ||
      lse.overlaps(out)) {
    return Status::invalid_argument("attention_merge: the outputs overlap the partials or each other");
  }
  return Status{};
}

AttentionArgs ring_core_args(const RingAttentionArgs& r) {
  AttentionArgs a;
  a.q = r.q;
  a.k = r.k;
  a.v = r.v;
  a.out = r.out;
  a.lse = r.lse;
  a.dtype = r.dtype;
  a.batch = r.batch;
  a.seqlen_q = a.seqlen_k = r.seqlen;
  a.heads_q = r.heads_q;
  a.heads_kv = r.heads_kv;
  a.head_dim = r.head_dim;
  return a;
}

AttentionOptions ring_core_options(const RingAttentionArgs& r, const RingAttentionOptions& o) {
  AttentionOptions core;
  core.causal = o.causal;
  core.scale = o.scale;
  // The ring kernel is built for the unmasked defaults only (kRingTiles), causal rings included.
  core.block_n = o.block_n != 0 ? o.block_n : default_block_n(r.head_dim, r.seqlen, false);
  core.block_m = 128;  // the ring kernel is built with two consumer warpgroups only (kRingTiles)
  return core;
}

Status validate_ring_attention(const RingAttentionArgs& r, const RingAttentionOptions& o, int world) {
  if (world < 1) return Status::invalid_argument("ring_attention: the ring needs at least one rank");
  if ((o.causal ? 2 : 1) * world > ka::kMaxSegments) {
    return Status::unsupported("ring_attention: a query tile visits " + std::string(o.causal ? "two key segments" : "one key segment") +
                               " per rank, at most " + std::to_string(ka::kMaxSegments) + " in all: " + std::to_string(world) +
                               " local ranks are too many");
  }
  const Status s = validate_attention(ring_core_args(r), ring_core_options(r, o));
  if (!s.ok()) {
    std::string m(s.message());
    if (m.rfind("attention: ", 0) == 0) m = "ring_attention: " + m.substr(11);
    return Status(s.code(), m);
  }
  if (o.block_n != 0 && !ring_tile_built(r.head_dim, o.block_n)) {
    std::string built;
    for (const RingTile& t : kRingTiles) {
      if (t.head_dim == r.head_dim) built += (built.empty() ? "" : ", ") + std::to_string(t.block_n);
    }
    return Status::invalid_argument("ring_attention: block_n " + std::to_string(o.block_n) +
                                    " is not built for the ring at head dim " + str(r.head_dim) + " (built: " + built +
                                    "; 0 picks the default)");
  }
  if (r.seqlen < 1 || r.batch < 1) {
    return Status::invalid_argument("ring_attention: batch (" + str(r.batch) + ") and seqlen (" + str(r.seqlen) +
                                    ") must be at least 1");
  }
  if (o.causal && r.seqlen % 2 != 0) {
    return Status::invalid_argument("ring_attention: causal masks use the zigzag layout (two chunks of seqlen / 2 per "
                                    "rank): seqlen " + str(r.seqlen) + " must be even");
  }
  if (o.kv_ctas < 0) return Status::invalid_argument("ring_attention: kv_ctas must be >= 0 (0: the planner's)");
  if (static_cast<double>(world) * r.seqlen * 2 >= 2147483647.0) {
    return Status::unsupported("ring_attention: world x seqlen x 2 must stay below 2^31");
  }
  const RingWorkspace w = ring_workspace(r, world);
  if (w.bytes > (uint64_t{1} << 46)) return Status::unsupported("ring_attention: the workspace would exceed 64 TiB");
  return Status{};
}

RingWorkspace ring_workspace(const RingAttentionArgs& r, int world) {
  RingWorkspace w;
  // A ring of one receives nothing and flags nothing: no receive slots (its K/V never move).
  const uint64_t slots = world > 1 ? static_cast<uint64_t>(world) : 0;
  const uint64_t kv = slots * static_cast<uint64_t>(r.batch) * static_cast<uint64_t>(r.seqlen) *
                      static_cast<uint64_t>(r.heads_kv) * static_cast<uint64_t>(r.head_dim) * dtype_size(r.dtype);
  auto align = [](uint64_t x) { return (x + 1023) / 1024 * 1024; };
  w.chunks = static_cast<uint32_t>((r.seqlen + ka::RingTunables::kChunkRows - 1) / ka::RingTunables::kChunkRows);
  w.recv_k = 0;
  w.recv_v = align(kv);
  w.arrived = w.recv_v + align(kv);
  w.bytes = w.arrived + align(slots * static_cast<uint64_t>(r.batch) * w.chunks * 8);
  return w;
}

int ring_kv_ctas(const RingAttentionOptions& o, int world, int sm_count) {
  if (world < 2) return 0;
  const int want = o.kv_ctas > 0 ? o.kv_ctas : ka::RingTunables::kDefaultKvCtas;
  return std::max(1, std::min({want, ka::RingTunables::kMaxKvCtas, sm_count - 1}));
}

}  // namespace planner

size_t ring_attention_workspace_bytes(const RingAttentionArgs& args, int world) {
  return static_cast<size_t>(planner::ring_workspace(args, world).bytes);
}

Status ring_attention_can_implement(const RingAttentionArgs& args, const RingAttentionOptions& options, int world) {
  return planner::validate_ring_attention(args, options, world);
}

Status attention_can_implement(const AttentionArgs& args, const AttentionOptions& options) {
  return planner::validate_attention(args, options);
}

Status attention_merge_can_implement(const AttentionMergeArgs& args) { return planner::validate_attention_merge(args); }

}  // namespace loom
