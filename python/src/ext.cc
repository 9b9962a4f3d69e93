// loom._C: the low-level Python API over loom's C++ API (nanobind, DLPack; no torch at build
// time). Every op takes an explicit `stream` (a cudaStream_t as an int); the pure-Python layer
// (loom/_ops.py, loom/torch.py) finds the caller's current stream. Arguments are checked here
// before anything is launched, shapes before devices, so errors name the real problem; loom's
// own checks run after these. The MoE family lives in moe.cc (bind_moe); what both files use is in
// binding_common.h.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "loom/attention.h"
#include "loom/moe.h"
#include "loom/collectives.h"
#include "loom/communicator.h"
#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/version.h"
#include "loom/tensor_parallel.h"
#include "loom/types.h"
#include "binding_common.h"
#include "tensor_arg.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace loom::python {
namespace {

// ---- communicator --------------------------------------------------------------------------

struct CommOptionsArgs {
  static CommOptions make(int device, uint64_t heap_bytes, int64_t op_timeout_ms, int64_t bootstrap_timeout_ms) {
    CommOptions o;
    o.device = device;
    o.heap_bytes = heap_bytes;
    o.op_timeout = std::chrono::milliseconds(op_timeout_ms);
    o.bootstrap_timeout = std::chrono::milliseconds(bootstrap_timeout_ms);
    return o;
  }
};

int rank_from_env() {
  const char* r = std::getenv("RANK");
  return r != nullptr ? std::atoi(r) : -1;
}

PyCommunicator create(Result<std::unique_ptr<Communicator>> (*make)(void*), void* ctx, std::string_view op, int rank) {
  Result<std::unique_ptr<Communicator>> r = [&] {
    nb::gil_scoped_release release;  // bootstrap waits for every rank (bounded)
    return make(ctx);
  }();
  check(r.status(), op, rank);
  return PyCommunicator(std::move(r).value());
}

// The owner of a symmetric allocation handed out as a DLPack array: frees it when the last
// consumer (e.g. a torch tensor made by torch.from_dlpack) lets go, and keeps the communicator
// alive until then.
struct BufferOwner {
  nb::object comm_object;
  PyCommunicator* comm;
  void* ptr;
};

nb::ndarray<> empty_symmetric(PyCommunicator& self, const std::vector<int64_t>& shape, const std::string& dtype_name) {
  const char* op = "empty";
  Communicator& comm = self.get(op);
  Result<DType> dtype = parse_dtype(dtype_name);
  if (!dtype.ok()) invalid(op, self.rank, "dtype '" + dtype_name + "': expected bf16, fp16 or fp32");
  if (shape.size() > static_cast<size_t>(TensorArg::kMaxDims)) invalid(op, self.rank, "more than 8 dimensions");
  size_t numel = 1;
  std::vector<size_t> dims;
  for (int64_t d : shape) {
    if (d < 0) invalid(op, self.rank, "negative extent in shape " + shape_text(shape.data(), static_cast<int>(shape.size())));
    numel *= static_cast<size_t>(d);
    dims.push_back(static_cast<size_t>(d));
  }
  if (numel == 0) {
    invalid(op, self.rank, "shape " + shape_text(shape.data(), static_cast<int>(shape.size())) +
                               " has no elements; symmetric buffers must hold at least one");
  }
  const size_t bytes = numel * dtype_size(*dtype);
  Result<void*> ptr = [&] {
    nb::gil_scoped_release release;  // collective: waits for every rank's matching call
    return comm.alloc(bytes);
  }();
  check(ptr.status(), op, self.rank);
  auto* owner = new BufferOwner{nb::find(&self), &self, *ptr};
  ++self.live_buffers;
  nb::capsule capsule(owner, [](void* p) noexcept {
    auto* o = static_cast<BufferOwner*>(p);
    if (o->comm->comm) (void)o->comm->comm->free(o->ptr);
    --o->comm->live_buffers;
    delete o;
  });
  nb::dlpack::dtype dt{};
  dt.code = static_cast<uint8_t>(*dtype == DType::kBF16 ? nb::dlpack::dtype_code::Bfloat : nb::dlpack::dtype_code::Float);
  dt.bits = static_cast<uint8_t>(8 * dtype_size(*dtype));
  dt.lanes = 1;
  return nb::ndarray<>(*ptr, dims.size(), dims.data(), capsule, nullptr, dt, nb::device::cuda::value, self.device);
}

// ---- option parsing ------------------------------------------------------------------------

TpAlgorithm algorithm_of(std::string_view name, std::string_view op, int rank) {
  if (name == "auto") return TpAlgorithm::kAuto;
  if (name == "fused") return TpAlgorithm::kFused;
  if (name == "decomposed") return TpAlgorithm::kDecomposed;
  invalid(op, rank, "algorithm '" + std::string(name) + "': expected auto, fused or decomposed");
}

CopyEngineChoice engine_of(std::string_view name, std::string_view op, int rank) {
  if (name == "auto") return CopyEngineChoice::kAuto;
  if (name == "vector") return CopyEngineChoice::kVector;
  if (name == "bulk") return CopyEngineChoice::kBulk;
  invalid(op, rank, "engine '" + std::string(name) + "': expected auto, vector or bulk");
}

// ---- ops: parse + check once ("prepare"), launch any number of times -----------------------
// The Python bindings prepare and launch once; _bench_cpp_loop prepares once and launches in a
// C++ loop, which is the baseline of the Python per-call overhead measurement.

struct GemmCall {
  TensorArg a, b, d;
  GemmArgs args;
  GemmOptions options;
  cudaStream_t stream = nullptr;
  bool empty = false;
  Status launch() const { return empty ? Status{} : gemm(args, stream, options); }
  std::string_view op() const { return "gemm"; }
  int rank() const { return -1; }
};

GemmCall prepare_gemm(nb::handle a, nb::handle b, nb::handle out, uintptr_t stream, std::string_view b_layout,
                      std::string_view tile, int num_ctas) {
  const char* op = "gemm";
  const int rank = -1;
  GemmCall c;
  c.a = tensor_arg(a, "a", op, rank);
  c.b = tensor_arg(b, "b", op, rank);
  c.d = tensor_arg(out, "out", op, rank);
  const BLayout layout = layout_of(b_layout, op, rank);
  require_ndim(c.a, 2, "[M, K]", op, rank);
  require_ndim(c.b, 2, layout == BLayout::kKN ? "[K, N]" : "[N, K]", op, rank);
  require_ndim(c.d, 2, "[M, N]", op, rank);
  require_same_dtype(c.a, c.b, op, rank);
  require_half(c.a, op, rank);
  const int64_t m = c.a.dim(0), k = c.a.dim(1);
  const int64_t n = layout == BLayout::kKN ? c.b.dim(1) : c.b.dim(0);
  const int64_t b_k = layout == BLayout::kKN ? c.b.dim(0) : c.b.dim(1);
  if (b_k != k) {
    invalid(op, rank, "a is " + c.a.shape_text() + " (K = " + std::to_string(k) + ") but b is " + c.b.shape_text() +
                          (layout == BLayout::kKN ? " ([K, N], b_layout 'kn')" : " ([N, K], b_layout 'nk')"));
  }
  require_shape(c.d, m, n, "[M, N]", op, rank);
  c.options.tile = tile_of(tile, op, rank);
  c.options.num_ctas = num_ctas;
  require_device(c.a, -1, op, rank);
  require_device(c.b, c.a.device, op, rank);
  require_device(c.d, c.a.device, op, rank);
  c.args.a = c.a.data;
  c.args.b = c.b.data;
  c.args.d = c.d.data;
  c.args.m = m;
  c.args.n = n;
  c.args.k = k;
  c.args.in_dtype = c.a.dtype;
  c.args.out_dtype = c.d.dtype;
  c.args.b_layout = layout;
  c.stream = as_stream(stream);
  c.empty = c.d.numel == 0;
  return c;
}

enum class CollectiveKind { kAllGather, kReduceScatter, kAllReduce };

struct CollectiveCall {
  Communicator* comm = nullptr;
  int comm_rank = -1;
  CollectiveKind kind = CollectiveKind::kAllReduce;
  TensorArg send, recv;
  size_t count = 0;  // all_gather: send elements; reduce_scatter: recv elements; all_reduce: elements
  CollectiveOptions options;
  cudaStream_t stream = nullptr;
  Status launch() const {
    if (count == 0) return {};
    switch (kind) {
      case CollectiveKind::kAllGather: return all_gather(*comm, send.data, recv.data, count, send.dtype, stream, options);
      case CollectiveKind::kReduceScatter: return reduce_scatter(*comm, send.data, recv.data, count, send.dtype, stream, options);
      case CollectiveKind::kAllReduce: return all_reduce(*comm, send.data, recv.data, count, send.dtype, stream, options);
    }
    return Status::internal("unknown collective");
  }
  std::string_view op() const {
    return kind == CollectiveKind::kAllGather ? "all_gather" : kind == CollectiveKind::kReduceScatter ? "reduce_scatter" : "all_reduce";
  }
  int rank() const { return comm_rank; }
};

CollectiveCall prepare_collective(CollectiveKind kind, const CommView& pc, nb::handle send, nb::handle recv,
                                  uintptr_t stream, int num_ctas, std::string_view engine) {
  CollectiveCall c;
  c.kind = kind;
  const std::string_view op = c.op();
  const int rank = pc.rank;
  c.comm = pc.comm;
  c.comm_rank = rank;
  c.send = tensor_arg(send, "send", op, rank);
  c.recv = tensor_arg(recv, "recv", op, rank);
  require_same_dtype(c.send, c.recv, op, rank);
  const int64_t w = pc.world;
  const std::string ws = std::to_string(w);
  switch (kind) {
    case CollectiveKind::kAllGather:
      if (c.recv.numel != w * c.send.numel) {
        invalid(op, rank, "recv " + c.recv.shape_text() + " must hold world_size (" + ws + ") x send " +
                              c.send.shape_text() + " = " + std::to_string(w * c.send.numel) + " elements, it holds " +
                              std::to_string(c.recv.numel));
      }
      c.count = static_cast<size_t>(c.send.numel);
      break;
    case CollectiveKind::kReduceScatter:
      if (c.send.numel != w * c.recv.numel) {
        invalid(op, rank, "send " + c.send.shape_text() + " must hold world_size (" + ws + ") x recv " +
                              c.recv.shape_text() + " = " + std::to_string(w * c.recv.numel) + " elements, it holds " +
                              std::to_string(c.send.numel));
      }
      c.count = static_cast<size_t>(c.recv.numel);
      break;
    case CollectiveKind::kAllReduce:
      if (c.recv.numel != c.send.numel) {
        invalid(op, rank, "send " + c.send.shape_text() + " and recv " + c.recv.shape_text() +
                              " must hold the same number of elements");
      }
      c.count = static_cast<size_t>(c.send.numel);
      break;
  }
  c.options.num_ctas = num_ctas;
  c.options.engine = engine_of(engine, op, rank);
  require_device(c.send, pc.device, op, rank);
  require_device(c.recv, pc.device, op, rank);
  if (kind != CollectiveKind::kReduceScatter) require_symmetric(pc, c.recv, "peers write into it", op);
  if (kind != CollectiveKind::kAllGather) require_symmetric(pc, c.send, "peers read it", op);
  c.stream = as_stream(stream);
  return c;
}

enum class TpKind { kAgGemm, kGemmRs, kGemmAr };

struct TpCall {
  Communicator* comm = nullptr;
  int comm_rank = -1;
  TpKind kind = TpKind::kAgGemm;
  TensorArg a, b, out, gathered;
  TpGemmArgs args;
  TpGemmOptions options;
  cudaStream_t stream = nullptr;
  bool empty = false;
  Status launch() const {
    if (empty) return {};
    switch (kind) {
      case TpKind::kAgGemm: return ag_gemm(*comm, args, stream, options);
      case TpKind::kGemmRs: return gemm_rs(*comm, args, stream, options);
      case TpKind::kGemmAr: return gemm_ar(*comm, args, stream, options);
    }
    return Status::internal("unknown tensor-parallel op");
  }
  std::string_view op() const {
    return kind == TpKind::kAgGemm ? "ag_gemm" : kind == TpKind::kGemmRs ? "gemm_rs" : "gemm_ar";
  }
  int rank() const { return comm_rank; }
};

TpCall prepare_tp(TpKind kind, const CommView& pc, nb::handle a, nb::handle b, nb::handle out, uintptr_t stream,
                  std::string_view b_layout, nb::handle gathered_a, std::string_view algorithm, int comm_ctas,
                  std::string_view tile) {
  TpCall c;
  c.kind = kind;
  const std::string_view op = c.op();
  const int rank = pc.rank;
  c.comm = pc.comm;
  c.comm_rank = rank;
  const BLayout layout = layout_of(b_layout, op, rank);
  c.a = tensor_arg(a, "a", op, rank);
  c.b = tensor_arg(b, "b", op, rank);
  c.out = tensor_arg(out, "out", op, rank);
  const bool has_gathered = !gathered_a.is_none();
  if (has_gathered && kind != TpKind::kAgGemm) invalid(op, rank, "gathered_a belongs to ag_gemm");
  if (has_gathered) c.gathered = tensor_arg(gathered_a, "gathered_a", op, rank);
  const int64_t w = pc.tp_world;
  require_ndim(c.a, 2, kind == TpKind::kAgGemm ? "[M/W, K] (this rank's rows)" : "[M, K]", op, rank);
  require_ndim(c.b, 2, layout == BLayout::kKN ? "[K, N]" : "[N, K]", op, rank);
  require_ndim(c.out, 2, kind == TpKind::kGemmRs ? "[M/W, N]" : "[M, N]", op, rank);
  require_same_dtype(c.a, c.b, op, rank);
  require_same_dtype(c.a, c.out, op, rank);
  require_half(c.a, op, rank);
  const int64_t k = c.a.dim(1);
  const int64_t m = kind == TpKind::kAgGemm ? w * c.a.dim(0) : c.a.dim(0);
  const int64_t n = layout == BLayout::kKN ? c.b.dim(1) : c.b.dim(0);
  const int64_t b_k = layout == BLayout::kKN ? c.b.dim(0) : c.b.dim(1);
  if (b_k != k) {
    invalid(op, rank, "a is " + c.a.shape_text() + " (K = " + std::to_string(k) + ") but b is " + c.b.shape_text() +
                          (layout == BLayout::kKN ? " ([K, N], b_layout 'kn')" : " ([N, K], b_layout 'nk')"));
  }
  if (kind == TpKind::kGemmRs && m % w != 0) {
    invalid(op, rank, "M = " + std::to_string(m) + " rows of a " + c.a.shape_text() +
                          " do not divide by the world size " + std::to_string(w));
  }
  if (kind == TpKind::kGemmRs) {
    require_shape(c.out, m / w, n, "[M/W, N]", op, rank);
  } else {
    require_shape(c.out, m, n, "[M, N]", op, rank);
  }
  if (has_gathered) {
    require_ndim(c.gathered, 2, "[M, K]", op, rank);
    require_same_dtype(c.a, c.gathered, op, rank);
    require_shape(c.gathered, m, k, "[M, K]", op, rank);
  }
  c.options.algorithm = algorithm_of(algorithm, op, rank);
  c.options.comm_ctas = comm_ctas;
  c.options.tile = tile_of(tile, op, rank);
  require_device(c.a, pc.device, op, rank);
  require_device(c.b, pc.device, op, rank);
  require_device(c.out, pc.device, op, rank);
  if (has_gathered) {
    require_device(c.gathered, pc.device, op, rank);
    require_symmetric(pc, c.gathered, "peers write their rows into it", op);
  }
  if (kind == TpKind::kGemmAr) require_symmetric(pc, c.out, "peers write their reduced rows into it", op);
  c.args.a = c.a.data;
  c.args.b = c.b.data;
  c.args.out = c.out.data;
  c.args.m = m;
  c.args.n = n;
  c.args.k = k;
  c.args.dtype = c.a.dtype;
  c.args.b_layout = layout;
  c.args.gathered_a = has_gathered ? c.gathered.data : nullptr;
  c.stream = as_stream(stream);
  c.empty = c.out.numel == 0;
  return c;
}

// ---- attention --------------------------------------------------------------------------------

struct AttentionCall {
  TensorArg q, k, v, out, lse, cu_q, cu_k;
  AttentionArgs args;
  AttentionOptions options;
  cudaStream_t stream = nullptr;
  Status launch() const { return attention(args, stream, options); }
  std::string_view op() const { return "attention"; }
  int rank() const { return -1; }
};

// q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D], out like q (fp32 in partial mode), lse [B, Hq, Sq]
// fp32; packed (cu_seqlens given): q [Tq, Hq, D], k and v [Tk, Hkv, D], lse [Hq, Tq], int32
// offsets [B + 1] and the longest sequence lengths.
AttentionCall prepare_attention(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                                uintptr_t stream, bool causal, double scale, nb::handle cu_seqlens_q,
                                nb::handle cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool partial,
                                int num_ctas, int block_n, int block_m) {
  const char* op = "attention";
  const int rank = -1;
  AttentionCall c;
  const bool packed = !cu_seqlens_q.is_none() || !cu_seqlens_k.is_none();
  if (packed && (cu_seqlens_q.is_none() || cu_seqlens_k.is_none())) {
    invalid(op, rank, "packed sequences need both cu_seqlens_q and cu_seqlens_k");
  }
  c.q = tensor_arg(q, "q", op, rank);
  c.k = tensor_arg(k, "k", op, rank);
  c.v = tensor_arg(v, "v", op, rank);
  c.out = tensor_arg(out, "out", op, rank);
  const bool has_lse = !lse.is_none();
  if (has_lse) c.lse = tensor_arg(lse, "lse", op, rank);
  const int nd = packed ? 3 : 4;
  require_ndim(c.q, nd, packed ? "[Tq, Hq, D]" : "[B, Sq, Hq, D]", op, rank);
  require_ndim(c.k, nd, packed ? "[Tk, Hkv, D]" : "[B, Sk, Hkv, D]", op, rank);
  require_ndim(c.v, nd, packed ? "[Tk, Hkv, D]" : "[B, Sk, Hkv, D]", op, rank);
  require_ndim(c.out, nd, packed ? "[Tq, Hq, D] like q" : "[B, Sq, Hq, D] like q", op, rank);
  require_same_dtype(c.q, c.k, op, rank);
  require_same_dtype(c.q, c.v, op, rank);
  require_half(c.q, op, rank);
  const int o = packed ? 0 : 1;  // first sequence dimension
  for (int i = 0; i < nd; ++i) {
    if (c.out.dim(i) != c.q.dim(i)) invalid(op, rank, "out " + c.out.shape_text() + " must have q's shape " + c.q.shape_text());
    if (c.v.dim(i) != c.k.dim(i)) invalid(op, rank, "v " + c.v.shape_text() + " must have k's shape " + c.k.shape_text());
  }
  if (!packed && c.k.dim(0) != c.q.dim(0)) {
    invalid(op, rank, "q " + c.q.shape_text() + " and k " + c.k.shape_text() + " have different batch sizes");
  }
  if (c.k.dim(o + 2) != c.q.dim(o + 2)) {
    invalid(op, rank, "q " + c.q.shape_text() + " and k " + c.k.shape_text() + " have different head dims");
  }
  const DType out_dtype = partial ? DType::kF32 : c.q.dtype;
  if (c.out.dtype != out_dtype) {
    invalid(op, rank, std::string("out must be ") + std::string(dtype_name(out_dtype)) +
                          (partial ? " in partial mode" : " (q's dtype)") + ", got " + std::string(dtype_name(c.out.dtype)));
  }
  AttentionArgs& a = c.args;
  a.q = c.q.data;
  a.k = c.k.data;
  a.v = c.v.data;
  a.out = c.out.data;
  a.dtype = c.q.dtype;
  a.heads_q = c.q.dim(o + 1);
  a.heads_kv = c.k.dim(o + 1);
  a.head_dim = c.q.dim(o + 2);
  if (packed) {
    c.cu_q = tensor_arg(cu_seqlens_q, "cu_seqlens_q", op, rank, Elements::kInt32);
    c.cu_k = tensor_arg(cu_seqlens_k, "cu_seqlens_k", op, rank, Elements::kInt32);
    require_ndim(c.cu_q, 1, "[B + 1] int32", op, rank);
    require_ndim(c.cu_k, 1, "[B + 1] int32", op, rank);
    if (c.cu_q.numel < 1 || c.cu_q.numel != c.cu_k.numel) {
      invalid(op, rank, "cu_seqlens_q " + c.cu_q.shape_text() + " and cu_seqlens_k " + c.cu_k.shape_text() +
                            " must both hold B + 1 >= 1 offsets");
    }
    if (max_seqlen_q < 0 || max_seqlen_k < 0 || (c.q.dim(0) > 0 && max_seqlen_q == 0) ||
        (c.k.dim(0) > 0 && max_seqlen_k == 0)) {
      invalid(op, rank, "packed sequences need max_seqlen_q and max_seqlen_k (the longest sequence of each, > 0)");
    }
    a.layout = AttentionLayout::kPacked;
    a.batch = c.cu_q.numel - 1;
    a.total_q = c.q.dim(0);
    a.total_k = c.k.dim(0);
    a.seqlen_q = max_seqlen_q;
    a.seqlen_k = max_seqlen_k;
    a.cu_seqlens_q = static_cast<const int32_t*>(c.cu_q.data);
    a.cu_seqlens_k = static_cast<const int32_t*>(c.cu_k.data);
  } else {
    a.batch = c.q.dim(0);
    a.seqlen_q = c.q.dim(1);
    a.seqlen_k = c.k.dim(1);
  }
  if (has_lse) {
    if (c.lse.dtype != DType::kF32) invalid(op, rank, "lse must be float32");
    const bool ok = packed ? (c.lse.ndim == 2 && c.lse.dim(0) == a.heads_q && c.lse.dim(1) == a.total_q)
                           : (c.lse.ndim == 3 && c.lse.dim(0) == a.batch && c.lse.dim(1) == a.heads_q &&
                              c.lse.dim(2) == a.seqlen_q);
    if (!ok) {
      invalid(op, rank, std::string("lse must be ") + (packed ? "[Hq, Tq]" : "[B, Hq, Sq]") + " float32, got " +
                            c.lse.shape_text());
    }
    a.lse = static_cast<float*>(c.lse.data);
  }
  c.options.causal = causal;
  c.options.scale = static_cast<float>(scale);
  c.options.partial = partial;
  c.options.num_ctas = num_ctas;
  c.options.block_n = block_n;
  c.options.block_m = block_m;
  require_device(c.q, -1, op, rank);
  for (const TensorArg* t : {&c.k, &c.v, &c.out}) require_device(*t, c.q.device, op, rank);
  if (has_lse) require_device(c.lse, c.q.device, op, rank);
  if (packed) {
    require_device(c.cu_q, c.q.device, op, rank);
    require_device(c.cu_k, c.q.device, op, rank);
  }
  c.stream = as_stream(stream);
  return c;
}

struct RingAttentionCall {
  Communicator* comm = nullptr;
  int comm_rank = -1;
  TensorArg q, k, v, out, lse;
  RingAttentionArgs args;
  RingAttentionOptions options;
  cudaStream_t stream = nullptr;
  Status launch() const { return ring_attention(*comm, args, stream, options); }
  std::string_view op() const { return "ring_attention"; }
  int rank() const { return comm_rank; }
};

// This rank's chunk: q [B, S_l, Hq, D], k and v [B, S_l, Hkv, D], out like q, lse [B, Hq, S_l].
RingAttentionCall prepare_ring_attention(const CommView& pc, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                                         nb::handle lse, uintptr_t stream, bool causal, double scale, int kv_ctas,
                                         int block_n) {
  const char* op = "ring_attention";
  const int rank = pc.rank;
  RingAttentionCall c;
  c.comm = pc.comm;
  c.comm_rank = rank;
  c.q = tensor_arg(q, "q", op, rank);
  c.k = tensor_arg(k, "k", op, rank);
  c.v = tensor_arg(v, "v", op, rank);
  c.out = tensor_arg(out, "out", op, rank);
  const bool has_lse = !lse.is_none();
  if (has_lse) c.lse = tensor_arg(lse, "lse", op, rank);
  require_ndim(c.q, 4, "[B, S_l, Hq, D]", op, rank);
  require_ndim(c.k, 4, "[B, S_l, Hkv, D]", op, rank);
  require_ndim(c.v, 4, "[B, S_l, Hkv, D]", op, rank);
  require_ndim(c.out, 4, "[B, S_l, Hq, D] like q", op, rank);
  require_same_dtype(c.q, c.k, op, rank);
  require_same_dtype(c.q, c.v, op, rank);
  require_same_dtype(c.q, c.out, op, rank);
  require_half(c.q, op, rank);
  for (int i = 0; i < 4; ++i) {
    if (c.out.dim(i) != c.q.dim(i)) invalid(op, rank, "out " + c.out.shape_text() + " must have q's shape " + c.q.shape_text());
    if (c.v.dim(i) != c.k.dim(i)) invalid(op, rank, "v " + c.v.shape_text() + " must have k's shape " + c.k.shape_text());
  }
  if (c.k.dim(0) != c.q.dim(0) || c.k.dim(1) != c.q.dim(1) || c.k.dim(3) != c.q.dim(3)) {
    invalid(op, rank, "q " + c.q.shape_text() + " and k " + c.k.shape_text() + " must agree in B, S_l and D");
  }
  RingAttentionArgs& a = c.args;
  a.q = c.q.data;
  a.k = c.k.data;
  a.v = c.v.data;
  a.out = c.out.data;
  a.dtype = c.q.dtype;
  a.batch = c.q.dim(0);
  a.seqlen = c.q.dim(1);
  a.heads_q = c.q.dim(2);
  a.heads_kv = c.k.dim(2);
  a.head_dim = c.q.dim(3);
  if (has_lse) {
    if (c.lse.dtype != DType::kF32 || c.lse.ndim != 3 || c.lse.dim(0) != a.batch || c.lse.dim(1) != a.heads_q ||
        c.lse.dim(2) != a.seqlen) {
      invalid(op, rank, "lse must be [B, Hq, S_l] float32, got " + c.lse.shape_text());
    }
    a.lse = static_cast<float*>(c.lse.data);
  }
  c.options.causal = causal;
  c.options.scale = static_cast<float>(scale);
  c.options.kv_ctas = kv_ctas;
  c.options.block_n = block_n;
  require_device(c.q, pc.device, op, rank);
  for (const TensorArg* t : {&c.k, &c.v, &c.out}) require_device(*t, pc.device, op, rank);
  if (has_lse) require_device(c.lse, pc.device, op, rank);
  c.stream = as_stream(stream);
  return c;
}

struct AttentionMergeCall {
  TensorArg parts, part_lse, out, lse;
  AttentionMergeArgs args;
  cudaStream_t stream = nullptr;
  Status launch() const { return attention_merge(args, stream); }
  std::string_view op() const { return "attention_merge"; }
  int rank() const { return -1; }
};

// partial_out [n, B, S, H, D] fp32 (packed: [n, T, H, D]), partial_lse [n, B, H, S] ([n, H, T]),
// out [B, S, H, D] ([T, H, D]), lse [B, H, S] ([H, T]) or None.
AttentionMergeCall prepare_attention_merge(nb::handle partial_out, nb::handle partial_lse, nb::handle out,
                                           nb::handle lse, uintptr_t stream) {
  const char* op = "attention_merge";
  const int rank = -1;
  AttentionMergeCall c;
  c.parts = tensor_arg(partial_out, "partial_out", op, rank);
  c.part_lse = tensor_arg(partial_lse, "partial_lse", op, rank);
  c.out = tensor_arg(out, "out", op, rank);
  const bool has_lse = !lse.is_none();
  if (has_lse) c.lse = tensor_arg(lse, "lse", op, rank);
  const bool packed = c.parts.ndim == 4;
  if (c.parts.ndim != 4 && c.parts.ndim != 5) {
    invalid(op, rank, "partial_out must be [n, B, S, H, D] or [n, T, H, D] float32, got " + c.parts.shape_text());
  }
  if (c.parts.dtype != DType::kF32 || c.part_lse.dtype != DType::kF32) {
    invalid(op, rank, "partial_out and partial_lse must be float32 (attention's partial mode)");
  }
  AttentionMergeArgs& a = c.args;
  a.num_partials = c.parts.dim(0);
  a.batch = packed ? 1 : c.parts.dim(1);
  a.seqlen = c.parts.dim(packed ? 1 : 2);
  a.heads = c.parts.dim(packed ? 2 : 3);
  a.head_dim = c.parts.dim(packed ? 3 : 4);
  const bool lse_ok = packed ? (c.part_lse.ndim == 3 && c.part_lse.dim(0) == a.num_partials &&
                                c.part_lse.dim(1) == a.heads && c.part_lse.dim(2) == a.seqlen)
                             : (c.part_lse.ndim == 4 && c.part_lse.dim(0) == a.num_partials &&
                                c.part_lse.dim(1) == a.batch && c.part_lse.dim(2) == a.heads &&
                                c.part_lse.dim(3) == a.seqlen);
  if (!lse_ok) {
    invalid(op, rank, "partial_lse " + c.part_lse.shape_text() + " must be " + (packed ? "[n, H, T]" : "[n, B, H, S]") +
                          " for partial_out " + c.parts.shape_text());
  }
  if (c.out.ndim != c.parts.ndim - 1 || c.out.numel * a.num_partials != c.parts.numel) {
    invalid(op, rank, "out " + c.out.shape_text() + " must be partial_out's shape without the first dimension");
  }
  if (has_lse && (c.lse.dtype != DType::kF32 || c.lse.numel * a.num_partials != c.part_lse.numel)) {
    invalid(op, rank, "lse " + c.lse.shape_text() + " must be float32 with partial_lse's shape without the first dimension");
  }
  a.partial_out = static_cast<const float*>(c.parts.data);
  a.partial_lse = static_cast<const float*>(c.part_lse.data);
  a.out = c.out.data;
  a.out_dtype = c.out.dtype;
  a.lse = has_lse ? static_cast<float*>(c.lse.data) : nullptr;
  require_device(c.parts, -1, op, rank);
  require_device(c.part_lse, c.parts.device, op, rank);
  require_device(c.out, c.parts.device, op, rank);
  if (has_lse) require_device(c.lse, c.parts.device, op, rank);
  c.stream = as_stream(stream);
  return c;
}

// ---- grouped GEMM -------------------------------------------------------------------------------

struct GroupedGemmCall {
  TensorArg a, b, d, rows, workspace;
  GroupedGemmArgs args;
  GroupedGemmOptions options;
  cudaStream_t stream = nullptr;
  Status launch() const { return grouped_gemm(args, stream, options); }
  std::string_view op() const { return "grouped_gemm"; }
  int rank() const { return -1; }
};

// Contiguous (offsets given): a [M, K], offsets int32 [E + 1], d [M, N]. Masked (counts given):
// a [E, C, K], counts int32 [E], d [E, C, N]. b [E, N, K] (b_layout 'nk') or [E, K, N] ('kn');
// workspace int32 of at least grouped_gemm_workspace_bytes / 4 elements.
GroupedGemmCall prepare_grouped_gemm(nb::handle a, nb::handle b, nb::handle d, nb::handle offsets, nb::handle counts,
                                     nb::handle workspace, uintptr_t stream, std::string_view tile, int num_ctas,
                                     std::string_view b_layout, std::string_view activation, bool swap_tails,
                                     int group_m, bool tile_queue, bool expert_groups) {
  const char* op = "grouped_gemm";
  const int rank = -1;
  GroupedGemmCall c;
  if (offsets.is_none() == counts.is_none()) {
    invalid(op, rank, "give exactly one of offsets (the contiguous layout) and counts (the masked layout)");
  }
  const bool masked = !counts.is_none();
  c.a = tensor_arg(a, "a", op, rank);
  c.b = tensor_arg(b, "b", op, rank);
  c.d = tensor_arg(d, "d", op, rank);
  c.rows = tensor_arg(masked ? counts : offsets, masked ? "counts" : "offsets", op, rank, Elements::kInt32);
  c.workspace = tensor_arg(workspace, "workspace", op, rank, Elements::kInt32);
  const BLayout layout = layout_of(b_layout, op, rank);
  const bool kn = layout == BLayout::kKN;
  const char* b_shape = kn ? "[E, K, N]" : "[E, N, K]";
  require_ndim(c.b, 3, b_shape, op, rank);
  require_same_dtype(c.a, c.b, op, rank);
  require_half(c.a, op, rank);
  require_ndim(c.workspace, 1, "[n] int32", op, rank);
  const int64_t experts = c.b.dim(0), n = c.b.dim(kn ? 2 : 1), k = c.b.dim(kn ? 1 : 2);
  GroupedGemmArgs& g = c.args;
  g.activation = activation_of(activation, op, rank);
  const bool swiglu = g.activation == GroupedActivation::kSwiGLU;
  const int64_t n_out = swiglu ? n / 2 : n;  // D's columns
  if (masked) {
    require_ndim(c.a, 3, "[E, capacity, K]", op, rank);
    require_ndim(c.d, 3, "[E, capacity, N]", op, rank);
    require_ndim(c.rows, 1, "[E] int32", op, rank);
    if (c.a.dim(0) != experts || c.a.dim(2) != k || c.rows.dim(0) != experts) {
      invalid(op, rank, "a " + c.a.shape_text() + " and counts " + c.rows.shape_text() + " must be [E, capacity, K] and [E] for b " +
                            c.b.shape_text() + " " + b_shape);
    }
    if (c.d.dim(0) != experts || c.d.dim(1) != c.a.dim(1) || c.d.dim(2) != n_out) {
      invalid(op, rank, "d " + c.d.shape_text() + " must be [E, capacity, " + (swiglu ? "N / 2" : "N") + "] = [" +
                            std::to_string(experts) + ", " + std::to_string(c.a.dim(1)) + ", " + std::to_string(n_out) +
                            "]");
    }
    g.layout = GroupedLayout::kMasked;
    g.capacity = c.a.dim(1);
    g.counts = static_cast<const int32_t*>(c.rows.data);
  } else {
    require_ndim(c.a, 2, "[M, K]", op, rank);
    require_ndim(c.rows, 1, "[E + 1] int32", op, rank);
    if (c.a.dim(1) != k || c.rows.dim(0) != experts + 1) {
      invalid(op, rank, "a " + c.a.shape_text() + " and offsets " + c.rows.shape_text() + " must be [M, K] and [E + 1] for b " +
                            c.b.shape_text() + " " + b_shape);
    }
    require_shape(c.d, c.a.dim(0), n_out, swiglu ? "[M, N / 2]" : "[M, N]", op, rank);
    g.layout = GroupedLayout::kContiguous;
    g.m_total = c.a.dim(0);
    g.offsets = static_cast<const int32_t*>(c.rows.data);
  }
  g.a = c.a.data;
  g.b = c.b.data;
  g.d = c.d.data;
  g.n = n;
  g.k = k;
  g.num_experts = experts;
  g.in_dtype = c.a.dtype;
  g.out_dtype = c.d.dtype;
  g.b_layout = layout;
  g.workspace = c.workspace.data;
  g.workspace_bytes = c.workspace.bytes();
  c.options.tile = tile_of(tile, op, rank);
  c.options.num_ctas = num_ctas;
  c.options.swap_tails = swap_tails;
  c.options.group_m = group_m;
  c.options.tile_queue = tile_queue;
  c.options.expert_groups = expert_groups;
  require_device(c.a, -1, op, rank);
  for (const TensorArg* t : {&c.b, &c.d, &c.rows, &c.workspace}) require_device(*t, c.a.device, op, rank);
  c.stream = as_stream(stream);
  return c;
}

// Host time of `iters` launches issued back to back from C++ (no synchronization).
template <class Call>
int64_t time_launches(const Call& call, int iters) {
  Status status;
  int64_t ns = 0;
  {
    nb::gil_scoped_release release;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters && status.ok(); ++i) status = call.launch();
    ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  }
  check(status, call.op(), call.rank());
  return ns;
}

// ---- errors --------------------------------------------------------------------------------

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const CallError& e) {
    // The classes live in Python (loom/_errors.py) so they can also derive from ValueError,
    // TimeoutError, OSError.
    static nb::object from_status = nb::module_::import_("loom._errors").attr("_from_status");
    nb::object rank = e.rank >= 0 ? nb::object(nb::int_(e.rank)) : nb::none();
    nb::object exc = from_status(std::string(status_code_name(e.code)), e.op, rank, e.reason);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  }
}

}  // namespace
}  // namespace loom::python

NB_MODULE(_C, m) {
  using namespace loom;
  using namespace loom::python;
  m.doc() = "loom's low-level API: explicit CUDA streams, any DLPack CUDA tensor. Most code uses loom.* or loom.torch.";
  m.attr("__version__") = LOOM_VERSION_STRING;
  m.def("library_version", [] { return std::string(version()); }, "the version of the libloom.so this extension runs with");
  nb::register_exception_translator(translate);
  // Tensors made from symmetric buffers may outlive the interpreter's last collection.
  nb::set_leak_warnings(false);

  nb::class_<PyCommunicator>(m, "Communicator", "A loom communicator (see loom.Communicator for the Python API).")
      .def_static(
          "from_env",
          [](int device, uint64_t heap_bytes, int64_t op_timeout_ms, int64_t bootstrap_timeout_ms) {
            CommOptions options = CommOptionsArgs::make(device, heap_bytes, op_timeout_ms, bootstrap_timeout_ms);
            return create([](void* o) { return Communicator::from_env(*static_cast<CommOptions*>(o)); }, &options,
                          "Communicator.from_env", rank_from_env());
          },
          "device"_a = -1, "heap_bytes"_a = 0, "op_timeout_ms"_a = 0, "bootstrap_timeout_ms"_a = 0)
      .def_static(
          "from_unique_id",
          [](nb::bytes uid, int rank, int world_size, int device, uint64_t heap_bytes, int64_t op_timeout_ms,
             int64_t bootstrap_timeout_ms) {
            const char* op = "Communicator.from_unique_id";
            UniqueId id;
            if (uid.size() != id.bytes.size()) {
              invalid(op, rank, "the unique id must be " + std::to_string(id.bytes.size()) + " bytes (from loom.make_unique_id), got " +
                                    std::to_string(uid.size()));
            }
            if (world_size < 1) invalid(op, rank, "world_size must be >= 1, got " + std::to_string(world_size));
            if (rank < 0 || rank >= world_size) {
              invalid(op, rank, "rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world_size) + ")");
            }
            std::memcpy(id.bytes.data(), uid.c_str(), id.bytes.size());
            struct Ctx {
              UniqueId id;
              int rank, world;
              CommOptions options;
            } ctx{id, rank, world_size, CommOptionsArgs::make(device, heap_bytes, op_timeout_ms, bootstrap_timeout_ms)};
            return create(
                [](void* p) {
                  auto* c = static_cast<Ctx*>(p);
                  return Communicator::from_unique_id(c->id, c->rank, c->world, c->options);
                },
                &ctx, op, rank);
          },
          "unique_id"_a, "rank"_a, "world_size"_a, "device"_a = -1, "heap_bytes"_a = 0, "op_timeout_ms"_a = 0,
          "bootstrap_timeout_ms"_a = 0)
      .def_prop_ro("rank", [](const PyCommunicator& c) { return c.rank; })
      .def_prop_ro("world_size", [](const PyCommunicator& c) { return c.world_size; })
      .def_prop_ro("local_rank", [](const PyCommunicator& c) { return c.local_rank; })
      .def_prop_ro("local_world_size", [](const PyCommunicator& c) { return c.local_world_size; })
      .def_prop_ro("node", [](const PyCommunicator& c) { return c.node; })
      .def_prop_ro("num_nodes", [](const PyCommunicator& c) { return c.num_nodes; })
      .def_prop_ro("device", [](const PyCommunicator& c) { return c.device; })
      .def_prop_ro("sm_count", [](const PyCommunicator& c) { return c.sm_count; })
      .def_prop_ro("ranks_per_gpu", [](const PyCommunicator& c) { return c.ranks_per_gpu; })
      .def_prop_ro("ranks_on_gpu", [](const PyCommunicator& c) { return c.ranks_on_gpu; })
      .def_prop_ro("closed", [](const PyCommunicator& c) { return !c.comm; })
      .def_prop_ro("live_buffers", [](const PyCommunicator& c) { return c.live_buffers; })
      .def(
          "synchronize",
          [](PyCommunicator& c, uintptr_t stream) {
            Communicator& comm = c.get("synchronize");
            check(without_gil([&] { return comm.synchronize(as_stream(stream)); }), "synchronize", c.rank);
          },
          "stream"_a)
      .def("barrier",
           [](PyCommunicator& c) {
             Communicator& comm = c.get("barrier");
             check(without_gil([&] { return comm.barrier(); }), "barrier", c.rank);
           })
      .def(
          "abort", [](PyCommunicator& c, const std::string& reason) { c.get("abort").abort(reason); }, "reason"_a)
      .def("health",
           [](const PyCommunicator& c) -> std::optional<std::tuple<std::string, std::string>> {
             if (!c.comm) return std::make_tuple(std::string("aborted"), std::string("the communicator was closed"));
             Status s = c.comm->health();
             if (s.ok()) return std::nullopt;
             return std::make_tuple(std::string(status_code_name(s.code())), s.message());
           })
      .def(
          "is_symmetric",
          [](const PyCommunicator& c, uintptr_t ptr, size_t bytes) {
            return c.comm && c.comm->is_symmetric(reinterpret_cast<const void*>(ptr), bytes);
          },
          "ptr"_a, "bytes"_a)
      .def("empty", &empty_symmetric, "shape"_a, "dtype"_a,
           "Collective: a symmetric buffer as a DLPack array (torch.from_dlpack / cupy.from_dlpack), freed when its "
           "last consumer goes.")
      .def("close", [](PyCommunicator& c) {
        if (!c.comm) return;
        if (c.live_buffers > 0) {
          invalid("close", c.rank, std::to_string(c.live_buffers) +
                                       " symmetric buffers (from empty()) are still referenced; drop the tensors "
                                       "made from them before closing");
        }
        nb::gil_scoped_release release;  // waits (bounded) for the other ranks
        c.comm.reset();
      });

  m.def(
      "make_unique_id",
      [](const std::string& bind_addr) {
        Result<UniqueId> id = [&] {
          nb::gil_scoped_release release;
          return make_unique_id(bind_addr);
        }();
        check(id.status(), "make_unique_id", -1);
        return nb::bytes(reinterpret_cast<const char*>(id->bytes.data()), id->bytes.size());
      },
      "bind_addr"_a = "127.0.0.1");
  m.def(
      "discard_unique_id",
      [](nb::bytes uid) {
        UniqueId id;
        if (uid.size() != id.bytes.size()) {
          invalid("discard_unique_id", -1, "the unique id must be " + std::to_string(id.bytes.size()) + " bytes, got " +
                                               std::to_string(uid.size()));
        }
        std::memcpy(id.bytes.data(), uid.c_str(), id.bytes.size());
        discard_unique_id(id);
      },
      "unique_id"_a);

  m.def(
      "gemm",
      [](nb::handle a, nb::handle b, nb::handle out, uintptr_t stream, std::string_view b_layout, std::string_view tile,
         int num_ctas) { run(prepare_gemm(a, b, out, stream, b_layout, tile, num_ctas)); },
      "a"_a.none(), "b"_a.none(), "out"_a.none(), "stream"_a, "b_layout"_a = "kn", "tile"_a = "auto", "num_ctas"_a = 0,
      "out = a @ b (b_layout 'kn': b is [K, N]; 'nk': b is [N, K]) on one GPU; bf16/fp16 in, bf16/fp16/fp32 out.");
  auto collective = [&m](const char* name, CollectiveKind kind, const char* doc) {
    m.def(
        name,
        [kind, name](PyCommunicator& c, nb::handle send, nb::handle recv, uintptr_t stream, int num_ctas,
                     std::string_view engine) {
          run(prepare_collective(kind, view_of(c, name), send, recv, stream, num_ctas, engine));
        },
        "comm"_a, "send"_a.none(), "recv"_a.none(), "stream"_a, "num_ctas"_a = 0, "engine"_a = "auto", doc);
  };
  collective("all_gather", CollectiveKind::kAllGather,
             "recv (symmetric, world x send elements) = every rank's send, in rank order.");
  collective("reduce_scatter", CollectiveKind::kReduceScatter,
             "recv = this rank's chunk of the sum over ranks of send (send symmetric, world x recv elements).");
  collective("all_reduce", CollectiveKind::kAllReduce, "recv = sum over ranks of send (both symmetric; send may be recv).");
  auto tp = [&m](const char* name, TpKind kind, const char* doc) {
    m.def(
        name,
        [kind, name](PyCommunicator& c, nb::handle a, nb::handle b, nb::handle out, uintptr_t stream,
                     std::string_view b_layout, nb::handle gathered_a, std::string_view algorithm, int comm_ctas,
                     std::string_view tile) {
          run(prepare_tp(kind, view_of(c, name), a, b, out, stream, b_layout, gathered_a, algorithm, comm_ctas, tile));
        },
        "comm"_a, "a"_a.none(), "b"_a.none(), "out"_a.none(), "stream"_a, "b_layout"_a = "kn", "gathered_a"_a.none() = nb::none(),
        "algorithm"_a = "auto", "comm_ctas"_a = -1, "tile"_a = "auto", doc);
  };
  tp("ag_gemm", TpKind::kAgGemm, "out [M, N] = AllGather_rows(a [M/W, K]) @ b.");
  tp("gemm_rs", TpKind::kGemmRs, "out [M/W, N] = ReduceScatter_rows(a [M, K] @ b).");
  tp("gemm_ar", TpKind::kGemmAr, "out [M, N] (symmetric) = AllReduce(a [M, K] @ b).");

  m.def(
      "attention",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, uintptr_t stream, bool causal,
         double scale, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
         bool partial, int num_ctas, int block_n, int block_m) {
        run(prepare_attention(q, k, v, out, lse, stream, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, partial, num_ctas, block_n, block_m));
      },
      "q"_a.none(), "k"_a.none(), "v"_a.none(), "out"_a.none(), "lse"_a.none(), "stream"_a, "causal"_a = false,
      "scale"_a = 0.0, "cu_seqlens_q"_a.none() = nb::none(), "cu_seqlens_k"_a.none() = nb::none(),
      "max_seqlen_q"_a = 0, "max_seqlen_k"_a = 0, "partial"_a = false, "num_ctas"_a = 0, "block_n"_a = 0,
      "block_m"_a = 0,
      "out = softmax(scale q k^T) v (flash attention forward on one GPU); lse (optional) gets the fp32 log-sum-exp.");
  m.def(
      "ring_attention",
      [](PyCommunicator& pc, nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, uintptr_t stream,
         bool causal, double scale, int kv_ctas, int block_n) {
        run(prepare_ring_attention(view_of(pc, "ring_attention"), q, k, v, out, lse, stream, causal, scale, kv_ctas,
                                   block_n));
      },
      "comm"_a, "q"_a.none(), "k"_a.none(), "v"_a.none(), "out"_a.none(), "lse"_a.none(), "stream"_a,
      "causal"_a = false, "scale"_a = 0.0, "kv_ctas"_a = 0, "block_n"_a = 0,
      "Ring attention over the communicator's ranks: out = attention of this rank's queries over every rank's keys.");
  m.def(
      "attention_merge",
      [](nb::handle partial_out, nb::handle partial_lse, nb::handle out, nb::handle lse, uintptr_t stream) {
        run(prepare_attention_merge(partial_out, partial_lse, out, lse, stream));
      },
      "partial_out"_a.none(), "partial_lse"_a.none(), "out"_a.none(), "lse"_a.none(), "stream"_a,
      "Combines partial-mode attention results over disjoint key sets (fp32).");
  m.def(
      "grouped_gemm",
      [](nb::handle a, nb::handle b, nb::handle d, nb::handle offsets, nb::handle counts, nb::handle workspace,
         uintptr_t stream, std::string_view tile, int num_ctas, std::string_view b_layout, std::string_view activation,
         bool swap_tails, int group_m, bool tile_queue, bool expert_groups) {
        run(prepare_grouped_gemm(a, b, d, offsets, counts, workspace, stream, tile, num_ctas, b_layout, activation,
                                 swap_tails, group_m, tile_queue, expert_groups));
      },
      "a"_a.none(), "b"_a.none(), "d"_a.none(), "offsets"_a.none(), "counts"_a.none(), "workspace"_a.none(),
      "stream"_a, "tile"_a = "auto", "num_ctas"_a = 0, "b_layout"_a = "nk", "activation"_a = "none",
      "swap_tails"_a = true, "group_m"_a = 0, "tile_queue"_a = true, "expert_groups"_a = true,
      "d_e = a_e @ b_e^T (b [E, N, K], b_layout 'nk') or a_e @ b_e (b [E, K, N], 'kn') for every expert e (MoE "
      "grouped GEMM on one GPU); offsets: contiguous rows, counts: masked; activation 'swiglu': silu(gate) * up "
      "over N interleaved by 8 (d has N / 2 columns).");
  bind_moe(m);
  m.def(
      "grouped_gemm_workspace_bytes",
      [](int64_t rows, int64_t num_experts, bool masked) {
        GroupedGemmArgs g;
        g.layout = masked ? GroupedLayout::kMasked : GroupedLayout::kContiguous;
        (masked ? g.capacity : g.m_total) = rows;
        g.num_experts = num_experts;
        return grouped_gemm_workspace_bytes(g);
      },
      "rows"_a, "num_experts"_a, "masked"_a = false,
      "Bytes of workspace grouped_gemm needs: rows = M (contiguous) or the capacity per expert (masked).");
  m.def(
      "synchronize_standalone",
      [](uintptr_t stream) {
        check(without_gil([&] { return synchronize_standalone(as_stream(stream)); }), "synchronize_standalone", -1);
      },
      "stream"_a,
      "Waits for the stream and raises what a standalone op (attention, gemm) recorded on the device (bad offsets).");

  // The argument checks of an op without a communicator and without launching (`world` stands
  // in for the local world size; rank 0 in messages): the same code as the ops run, reachable on
  // a machine without a GPU. Tensors that pass every shape rule still fail the device check
  // unless they are CUDA tensors.
  m.def(
      "_check_args",
      [](const std::string& op, int world, nb::tuple tensors, std::string_view b_layout) {
        auto t = [&](size_t i) { return i < tensors.size() ? nb::handle(tensors[i]) : nb::handle(Py_None); };
        const CommView fake{nullptr, 0, world, world, -1};
        if (op == "gemm") {
          (void)prepare_gemm(t(0), t(1), t(2), 0, b_layout, "auto", 0);
        } else if (op == "all_gather") {
          (void)prepare_collective(CollectiveKind::kAllGather, fake, t(0), t(1), 0, 0, "auto");
        } else if (op == "reduce_scatter") {
          (void)prepare_collective(CollectiveKind::kReduceScatter, fake, t(0), t(1), 0, 0, "auto");
        } else if (op == "all_reduce") {
          (void)prepare_collective(CollectiveKind::kAllReduce, fake, t(0), t(1), 0, 0, "auto");
        } else if (op == "ag_gemm" || op == "gemm_rs" || op == "gemm_ar") {
          const TpKind kind = op == "ag_gemm" ? TpKind::kAgGemm : op == "gemm_rs" ? TpKind::kGemmRs : TpKind::kGemmAr;
          (void)prepare_tp(kind, fake, t(0), t(1), t(2), 0, b_layout, t(3), "auto", -1, "auto");
        } else {
          invalid("_check_args", -1, "unknown op '" + op + "'");
        }
      },
      "op"_a, "world"_a, "tensors"_a, "b_layout"_a = "kn");

  // Baseline of the overhead measurement: the op prepared once (positional arguments as the
  // binding takes them, defaults for the rest), then `iters` launches from a C++ loop without
  // synchronizing; returns the host nanoseconds of the loop.
  m.def(
      "_bench_cpp_loop",
      [](const std::string& op, int iters, nb::tuple args) -> int64_t {
        auto h = [&](size_t i) { return nb::handle(args[i]); };
        auto stream_at = [&](size_t i) { return nb::cast<uintptr_t>(args[i]); };
        if (op == "gemm") return time_launches(prepare_gemm(h(0), h(1), h(2), stream_at(3), "kn", "auto", 0), iters);
        const CommView cv = view_of(nb::cast<PyCommunicator&>(args[0]), op);
        if (op == "all_gather") {
          return time_launches(prepare_collective(CollectiveKind::kAllGather, cv, h(1), h(2), stream_at(3), 0, "auto"), iters);
        }
        if (op == "reduce_scatter") {
          return time_launches(prepare_collective(CollectiveKind::kReduceScatter, cv, h(1), h(2), stream_at(3), 0, "auto"), iters);
        }
        if (op == "all_reduce") {
          return time_launches(prepare_collective(CollectiveKind::kAllReduce, cv, h(1), h(2), stream_at(3), 0, "auto"), iters);
        }
        if (op != "ag_gemm" && op != "gemm_rs" && op != "gemm_ar") invalid("_bench_cpp_loop", -1, "unknown op " + op);
        const TpKind kind = op == "ag_gemm" ? TpKind::kAgGemm : op == "gemm_rs" ? TpKind::kGemmRs : TpKind::kGemmAr;
        return time_launches(prepare_tp(kind, cv, h(1), h(2), h(3), stream_at(4), "kn", nb::none(), "auto", -1, "auto"), iters);
      },
      "op"_a, "iters"_a, "args"_a);
}
