// Host launcher of gemm_ar: validate -> plan -> workspace -> launch (kernel: kernels/tp/gemm_ar.cuh).
//
// Rules beyond tp_common.h: a is this GPU's device memory [M, K] (K = this rank's K_r); b [K, N]
// or [N, K]; out symmetric [M, N] (Communicator::alloc: peers store their reduced rows into it),
// not overlapping a or b.
#include <cuda_runtime_api.h>

#include <string>

#include "kernels/tp/gemm_ar.cuh"
#include "loom/collectives.h"
#include "loom/gemm.h"
#include "ops/collective_common.h"
#include "ops/launch/queued_work.h"
#include "ops/multinode.h"
#include "ops/tp_common.h"

namespace loom {
namespace {

namespace kt = kernels::tp;
using ops::tp::TpDecision;
using ops::tp::TpPath;

Status check_buffers(Communicator::Impl& impl, const TpGemmArgs& a) {
  const size_t e = dtype_size(a.dtype);
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.a, static_cast<size_t>(a.m * a.k) * e, "a ([M, K])"), "gemm_ar");
  LOOM_TRY_CTX(impl.check_local_device_buffer(a.b, static_cast<size_t>(a.k * a.n) * e, "b"), "gemm_ar");
  LOOM_ASSIGN_OR_RETURN(uint64_t offset,
                        impl.symmetric_offset(a.out, static_cast<size_t>(a.m * a.n) * e, "gemm_ar: out ([M, N])"));
  (void)offset;
  const ops::tp::ByteRange out = ops::tp::bytes_of(a.out, a.m, a.n, e);
  if (out.overlaps(ops::tp::bytes_of(a.a, a.m, a.k, e))) return Status::invalid_argument("gemm_ar: out overlaps a");
  if (out.overlaps(ops::tp::bytes_of(a.b, a.k, a.n, e))) return Status::invalid_argument("gemm_ar: out overlaps b");
  return {};
}

// GEMM into out, then loom's all_reduce in place (each rank reduces and pushes its own chunk of
// out, reading every rank's copy of that chunk before anyone writes it: collectives.h).
Status run_decomposed(Communicator& comm, const TpGemmArgs& a, const TpDecision& d, cudaStream_t stream) {
  LOOM_TRY(gemm(ops::tp::local_gemm(a.a, a.b, a.out, a.m, a), stream, ops::tp::gemm_options_for(d)));
  return ops::all_reduce_for(comm, a.out, a.out, static_cast<size_t>(a.m * a.n), a.dtype, stream, {}, OpId::kGemmAr,
                             ops::decomposed_tp_signature(OpId::kGemmAr, a, comm.local_world_size()))
      .with_context("gemm_ar (decomposed)");
}

Status run_fused(Communicator& comm, const TpGemmArgs& a, const TpDecision& d, cudaStream_t stream) {
  return ops::tp::launch_reduce_fused(comm, a, d, stream, /*broadcast=*/true, "gemm_ar",
                                      [&]<class Cfg, bool kBF16, bool kBNMajor>() { return &kt::gemm_ar_kernel<Cfg, kBF16, kBNMajor>; });
}


Status gemm_ar_one_node(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options) {
  Communicator::Impl& impl = internal(comm);
  LOOM_TRY(ops::tp::check_common(impl, OpId::kGemmAr, args));
  const int world = impl.topology.local_world_size;
  auto fused_check = [&](GemmTile tile, int grid) -> std::string {
    const int64_t pieces = ops::tp::piece_slots_of(ops::tp::reduce_tail_split(args, tile, grid, world, options.tail_pieces));
    return ops::tp::check_flag_capacity(impl, ops::tp::reduce_flags_for(args.m, args.n, world, tile, true, pieces));
  };
  LOOM_ASSIGN_OR_RETURN(TpDecision d, ops::tp::decide(impl, OpId::kGemmAr, args, options, fused_check));
  LOOM_TRY(check_buffers(impl, args));
  switch (d.path) {
    case TpPath::kPlainGemm: return gemm(ops::tp::local_gemm(args.a, args.b, args.out, args.m, args), stream,
                                         ops::tp::gemm_options_for(d));
    case TpPath::kDecomposed: return run_decomposed(comm, args, d, stream);
    case TpPath::kFused: return run_fused(comm, args, d, stream);
  }
  return Status::internal("gemm_ar: no path");
}

}  // namespace

Status gemm_ar(Communicator& comm, const TpGemmArgs& args, cudaStream_t stream, const TpGemmOptions& options) {
  const Status queued = comm.num_nodes() > 1 ? ops::gemm_ar_multinode(comm, args, stream, options)  // ops/multinode.h
                                             : gemm_ar_one_node(comm, args, stream, options);
  return ops::noted(comm, queued, stream);
}

}  // namespace loom
