// loom-bench all_gather | reduce_scatter | all_reduce: loom's NVLink collectives against NCCL on
// the same buffers, in one process group. Each size is checked bit-exact once, then both sides
// are timed (median of --iters after --warmup, max over ranks). On one rank a collective is a
// device copy, so there loom is timed beside cudaMemcpyAsync (column "copy") and the row has no
// speedup: comparing needs 2+ ranks.
#include "collectives_bench.h"

#include "baselines.h"

#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "loom/collectives.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"
#include "tests/common/verifiable.cuh"
#include "timing.h"

namespace loom::bench {
namespace {

Status nccl_check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return {};
  return Status::internal(std::string(what) + ": " + ncclGetErrorString(r));
}

// nccl-tests' bus bandwidth: the per-link rate an optimal algorithm needs for that time.
double bus_bandwidth_gbps(const std::string& op, uint64_t payload, int world, double ms) {
  if (ms <= 0) return 0;
  const double w = world;
  double total = 0, factor = 0;
  if (op == "all_gather" || op == "reduce_scatter") {
    total = static_cast<double>(payload) * w;  // whole gathered / scattered buffer
    factor = (w - 1) / w;
  } else {
    total = static_cast<double>(payload);
    factor = 2 * (w - 1) / w;
  }
  return total * factor / (ms * 1e-3) / 1e9;
}

template <typename T>
Status run_one(Communicator& comm, ncclComm_t nccl, const std::string& op, uint64_t payload,
               const CollectiveBenchOptions& o, int ctas, cudaStream_t stream, Report& report) {
  const int world = comm.local_world_size();
  const int me = comm.local_rank();
  const uint64_t count = payload / sizeof(T);
  const DType dtype = dtype_of<T>();
  // Buffers: symmetric where loom needs it (NCCL uses the same ones).
  void* sym_a = nullptr;  // AG recv | RS send | AR send
  void* sym_b = nullptr;  // AR recv
  void* plain = nullptr;  // AG send | RS recv
  const uint64_t big = op == "all_reduce" ? payload : payload * world;
  LOOM_ASSIGN_OR_RETURN(sym_a, comm.alloc(big));
  if (op == "all_reduce") {
    LOOM_ASSIGN_OR_RETURN(sym_b, comm.alloc(payload));
  } else {
    LOOM_CUDA_TRY(cudaMalloc(&plain, payload));
  }
  auto release = [&] {
    if (sym_b) (void)comm.free(sym_b);
    (void)comm.free(sym_a);
    if (plain) cudaFree(plain);
  };

  CollectiveOptions options;
  options.num_ctas = ctas;
  options.engine = o.engine;
  std::function<Status()> loom_op, nccl_op;
  const void* in = nullptr;  // what one rank's collective copies (world 1)
  void* out = nullptr;
  const uint64_t seed = 1234 + payload;
  if (op == "all_gather") {
    verify::fill_bits(static_cast<T*>(plain), count, seed, me, stream);
    in = plain;
    out = sym_a;
    loom_op = [&] { return all_gather(comm, plain, sym_a, count, dtype, stream, options); };
    nccl_op = [&] { return nccl_check(ncclAllGather(plain, sym_a, count, nccl_type(dtype), nccl, stream), "ncclAllGather"); };
  } else if (op == "reduce_scatter") {
    verify::fill_values(static_cast<T*>(sym_a), count * world, seed, me, stream);
    in = sym_a;
    out = plain;
    loom_op = [&] { return reduce_scatter(comm, sym_a, plain, count, dtype, stream, options); };
    nccl_op = [&] {
      return nccl_check(ncclReduceScatter(sym_a, plain, count, nccl_type(dtype), ncclSum, nccl, stream), "ncclReduceScatter");
    };
  } else {
    verify::fill_values(static_cast<T*>(sym_a), count, seed, me, stream);
    in = sym_a;
    out = sym_b;
    loom_op = [&] { return all_reduce(comm, sym_a, sym_b, count, dtype, stream, options); };
    nccl_op = [&] { return nccl_check(ncclAllReduce(sym_a, sym_b, count, nccl_type(dtype), ncclSum, nccl, stream), "ncclAllReduce"); };
  }
  auto sync = [&] { return comm.synchronize(stream); };

  const bool one_rank = world == 1;
  std::function<Status()> copy_op = [&]() -> Status {
    LOOM_CUDA_TRY(cudaMemcpyAsync(out, in, payload, cudaMemcpyDeviceToDevice, stream));
    return {};
  };

  // Correctness once, outputs poisoned first.
  const uint64_t out_bytes = op == "all_gather" ? payload * world : payload;
  LOOM_CUDA_TRY(cudaMemsetAsync(out, 0xFF, out_bytes, stream));
  Status s = [&]() -> Status {
    LOOM_TRY(loom_op());
    return sync();
  }();
  if (!s.ok()) {
    release();
    return s;
  }
  verify::Mismatch m{};
  if (op == "all_gather") {
    m = verify::check_all_gather(static_cast<const T*>(out), count, world, seed, stream);
  } else {
    m = verify::check_sum(static_cast<const T*>(out), count, op == "reduce_scatter" ? count * me : 0, world, seed, stream);
  }
  int64_t wrong = static_cast<int64_t>(m.wrong);
  LOOM_ASSIGN_OR_RETURN(double max_wrong, max_over_ranks(comm, static_cast<double>(wrong)));

  // Side by side in shuffled rounds (timing.h: the op after a lighter one runs on a cooler GPU).
  LOOM_TRY(comm.barrier());
  Result<std::vector<Timing>> t = time_interleaved(stream, o.warmup, o.iters, {loom_op, one_rank ? copy_op : nccl_op},
                                                   sync, [&] { return comm.barrier(); });
  release();
  LOOM_TRY(t.status());
  LOOM_ASSIGN_OR_RETURN(Timing loom_t, max_over_ranks(comm, (*t)[0]));
  LOOM_ASSIGN_OR_RETURN(Timing base_t, max_over_ranks(comm, (*t)[1]));

  Row row;
  row.op = op;
  row.dtype = std::string(dtype_name(dtype));
  row.bytes = static_cast<long long>(payload);
  row.rel_err = max_wrong == 0 ? 0.0 : 1.0;
  row.set_time("loom", loom_t);
  if (one_rank) {
    row.set_time("copy", base_t);
    row.extra["note"] = "world 1: a copy (a collective needs 2+ ranks)";
  } else {
    row.set_time("nccl", base_t);
    row.extra["busbw_gbps"] = {{"loom", bus_bandwidth_gbps(op, payload, world, loom_t.median_ms)},
                               {"nccl", bus_bandwidth_gbps(op, payload, world, base_t.median_ms)}};
  }
  row.extra["wrong_elements"] = max_wrong;
  row.extra["ctas"] = ctas;
  row.extra["iters"] = o.iters;
  report.add(std::move(row));
  if (max_wrong != 0) {
    return Status::internal(op + " " + std::to_string(payload) + " B/rank: " + std::to_string(static_cast<long long>(max_wrong)) +
                            " wrong elements (first at " + std::to_string(m.first) + " on this rank)");
  }
  return {};
}

}  // namespace

Result<double> max_over_ranks(Communicator& comm, double value) {
  std::vector<double> all(comm.world_size());
  LOOM_TRY(internal(comm).bootstrap->all_gather(&value, all.data(), sizeof(double)));
  double m = value;
  for (double v : all) m = v > m ? v : m;
  return m;
}

Result<Timing> max_over_ranks(Communicator& comm, const Timing& t) {
  const double mine[3] = {t.min_ms, t.median_ms, t.p90_ms};
  std::vector<double> all(3 * static_cast<size_t>(comm.world_size()));
  LOOM_TRY(internal(comm).bootstrap->all_gather(mine, all.data(), sizeof(mine)));
  Timing out = t;
  for (size_t r = 0; r < all.size(); r += 3) {
    out.min_ms = std::max(out.min_ms, all[r]);
    out.median_ms = std::max(out.median_ms, all[r + 1]);
    out.p90_ms = std::max(out.p90_ms, all[r + 2]);
  }
  return out;
}

Result<ncclComm_t> make_nccl_comm(Communicator& comm) {
  ncclUniqueId id{};
  if (comm.rank() == 0) LOOM_TRY(nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  LOOM_TRY(internal(comm).bootstrap->broadcast(&id, sizeof(id), 0));
  ncclComm_t nccl = nullptr;
  LOOM_TRY(nccl_check(ncclCommInitRank(&nccl, comm.world_size(), id, comm.rank()), "ncclCommInitRank"));
  return nccl;
}

Status run_collective_bench(Communicator& comm, ncclComm_t nccl, const CollectiveBenchOptions& o, Report& report,
                            Progress& progress) {
  for (uint64_t size : o.sizes) {
    if (size % dtype_size(o.dtype) != 0) {
      return Status::invalid_argument("--sizes " + std::to_string(size) + ": not a multiple of the " +
                                      std::string(dtype_name(o.dtype)) + " element size (" +
                                      std::to_string(dtype_size(o.dtype)) + " bytes)");
    }
  }
  cudaStream_t stream = nullptr;
  LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Status status;
  for (const std::string& op : o.ops) {
    for (uint64_t size : o.sizes) {
      for (int ctas : o.ctas) {
        progress.step(op + " " + std::to_string(size) + " B/rank" + (ctas > 0 ? ", " + std::to_string(ctas) + " CTAs" : ""));
        Status s = [&]() -> Status {
          switch (o.dtype) {
            case DType::kBF16: return run_one<__nv_bfloat16>(comm, nccl, op, size, o, ctas, stream, report);
            case DType::kF16: return run_one<__half>(comm, nccl, op, size, o, ctas, stream, report);
            case DType::kF32: return run_one<float>(comm, nccl, op, size, o, ctas, stream, report);
          }
          return Status::invalid_argument("unknown dtype");
        }();
        if (!s.ok()) {
          std::fprintf(stderr, "loom-bench: %s\n", s.to_string().c_str());
          if (status.ok()) status = s;
          if (!comm.health().ok()) {
            cudaStreamDestroy(stream);
            return status;
          }
        }
      }
    }
  }
  cudaStreamDestroy(stream);
  return status;
}

}  // namespace loom::bench
