// loom-bench ag_gemm | gemm_rs | gemm_ar | tp | tune: the fused tensor-parallel operators against
// the two ceilings of docs/BENCHMARKS.md, on the same inputs, in one process group:
//   cublas       cublasGemmEx alone on the local GEMM shape (the limit a fused op approaches)
//   loom_gemm    loom's own GEMM engine alone on that shape (separates the engine's speed from
//                what fusing costs: h_engine = (T_nccl_cublas - T_loom) / (T_nccl_cublas - T_loom_gemm))
//   nccl         the collective alone (ncclAllGather / ncclReduceScatter / ncclAllReduce)
//   nccl_cublas  the collective and the GEMM in sequence on one stream (the baseline to beat):
//                ag: ncclAllGather of the A shards, then the GEMM on the gathered A;
//                rs: the GEMM, then ncclReduceScatter; ar: the GEMM, then ncclAllReduce
// and h = (T_nccl_cublas - T_loom) / (T_nccl_cublas - T_cublas), the share of the communication
// loom hides (1: all of it; above 1: loom's GEMM beats cuBLAS as well).
//
// Inputs are random (12-bit values in [-1, 1), a pure function of seed, rank and index), so any
// rank can rebuild every other rank's operands for its fp32 reference.
#include "tp_bench.h"

#include "baselines.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives_bench.h"
#include "loom/diagnostics.h"
#include "loom/tensor_parallel.h"
#include "ops/gemm/gemm_launch.h"
#include "planner/tp_plan.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"
#include "tests/common/verifiable.cuh"
#include "timing.h"
#include "tp_bench_common.cuh"

namespace loom::bench {
namespace {

using planner::tp_op_name;

// ---- small helpers ----------------------------------------------------------------------------

Status nccl_status(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return {};
  return Status::internal(std::string(what) + ": " + ncclGetErrorString(r));
}


// Records `t` (max over ranks) as `row`'s column `key`; a failed exchange becomes `status`.
void record_time(Communicator& comm, Row& row, const char* key, const Timing& t, Status& status) {
  Result<Timing> m = max_over_ranks(comm, t);
  if (!m.ok()) {
    if (status.ok()) status = m.status();
    return;
  }
  row.set_time(key, *m);
}

// ---- one shape ----------------------------------------------------------------------------------

struct Shape {
  OpId op;
  int64_t m, n;
  int64_t k_global;  // ag_gemm: K; gemm_rs / gemm_ar: the K split over the ranks
  int64_t k_rank;    // this rank's K (TpGemmArgs::k)
  int world, me;
  int64_t a_rows() const { return op == OpId::kAgGemm ? m / world : m; }
  int64_t out_rows() const { return op == OpId::kGemmRs ? m / world : m; }
  std::string text() const {
    return std::string(tp_op_name(op)) + " " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k_global);
  }
};

using Check = SampledCheck;  // tp_bench_common.cuh

// Operands and baselines of one shape on this rank.
class TpCase {
 public:
  TpCase(Communicator& comm, ncclComm_t nccl, cublasHandle_t cublas, cudaStream_t stream, const TpBenchOptions& o, Shape s)
      : comm_(comm), nccl_(nccl), cublas_(cublas), stream_(stream), o_(o), s_(s) {}

  Status setup() {
    const DType t = o_.dtype;
    const size_t e = dtype_size(t);
    const bool kn = o_.b_layout == BLayout::kKN;
    LOOM_TRY(a_.alloc(static_cast<size_t>(s_.a_rows() * s_.k_rank) * e));
    LOOM_TRY(b_.alloc(static_cast<size_t>(s_.n * s_.k_rank) * e));
    const size_t out_bytes = static_cast<size_t>(s_.out_rows() * s_.n) * e;
    out_bytes_ = out_bytes;
    if (s_.op == OpId::kGemmAr) {
      LOOM_TRY(out_sym_.alloc(comm_, out_bytes));  // peers write their reduced rows into it
      out_ = out_sym_.p;
    } else {
      LOOM_TRY(out_plain_.alloc(out_bytes));
      out_ = out_plain_.p;
    }
    if (s_.op == OpId::kAgGemm) {
      // What ncclAllGather will produce, so that cuBLAS alone (timed first) multiplies real data.
      LOOM_TRY(gathered_.alloc(static_cast<size_t>(s_.m * s_.k_rank) * e));
      const int64_t shard = s_.m / s_.world;
      for (int r = 0; r < s_.world; ++r) {
        LOOM_TRY(fill_matrix(offset_elements(gathered_.p, r * shard * s_.k_rank, t), t, shard, s_.k_rank, s_.k_rank, seed_a(), r,
                             stream_));
      }
    } else {
      LOOM_TRY(partial_.alloc(static_cast<size_t>(s_.m * s_.n) * e));
    }
    LOOM_TRY(fill_matrix(a_.p, t, s_.a_rows(), s_.k_rank, s_.k_rank, seed_a(), s_.me, stream_));
    LOOM_TRY(fill_matrix(b_.p, t, kn ? s_.k_rank : s_.n, kn ? s_.n : s_.k_rank, kn ? s_.n : s_.k_rank, seed_b(), s_.me, stream_));
    LOOM_CUDA_TRY(cudaStreamSynchronize(stream_));
    return {};
  }

  TpGemmArgs loom_args() const {
    TpGemmArgs args;
    args.a = a_.p;
    args.b = b_.p;
    args.out = out_;
    args.m = s_.m;
    args.n = s_.n;
    args.k = s_.k_rank;
    args.dtype = o_.dtype;
    args.b_layout = o_.b_layout;
    return args;
  }

  Status launch_loom(const TpGemmOptions& options) {
    switch (s_.op) {
      case OpId::kAgGemm: return ag_gemm(comm_, loom_args(), stream_, options);
      case OpId::kGemmRs: return gemm_rs(comm_, loom_args(), stream_, options);
      default: return gemm_ar(comm_, loom_args(), stream_, options);
    }
  }

  planner::TpRequest request() const {
    planner::TpRequest r;
    r.op = s_.op;
    r.m = s_.m;
    r.n = s_.n;
    r.k = s_.k_rank;
    r.local_world = s_.world;
    r.dtype = o_.dtype;
    r.b_layout = o_.b_layout;
    const int min_sms = internal(comm_).topology.min_sm_count;
    r.sm_count = min_sms > 0 ? min_sms : comm_.sm_count();
    return r;
  }

  // The local GEMM alone with cuBLAS: ag on the gathered [M, K], rs / ar on this rank's [M, K_r].
  Status cublas_alone() {
    if (s_.op == OpId::kAgGemm) return cublas_gemm(cublas_, gathered_.p, b_.p, out_, s_.m, s_.n, s_.k_rank, o_.b_layout, o_.dtype, o_.dtype);
    return cublas_gemm(cublas_, a_.p, b_.p, partial_.p, s_.m, s_.n, s_.k_rank, o_.b_layout, o_.dtype, o_.dtype);
  }

  // The same local GEMM with loom's engine (the fused kernels' compute role runs this engine).
  Status loom_gemm_alone() { return gemm(loom_gemm_args(), stream_); }

  GemmArgs loom_gemm_args() const {
    GemmArgs g;
    g.a = s_.op == OpId::kAgGemm ? gathered_.p : a_.p;
    g.b = b_.p;
    g.d = s_.op == OpId::kAgGemm ? out_ : partial_.p;
    g.m = s_.m;
    g.n = s_.n;
    g.k = s_.k_rank;
    g.in_dtype = o_.dtype;
    g.out_dtype = o_.dtype;
    g.b_layout = o_.b_layout;
    return g;
  }

  Status nccl_alone() {
    const ncclDataType_t t = nccl_type(o_.dtype);
    switch (s_.op) {
      case OpId::kAgGemm:
        return nccl_status(ncclAllGather(a_.p, gathered_.p, static_cast<size_t>(s_.a_rows() * s_.k_rank), t, nccl_, stream_),
                           "ncclAllGather");
      case OpId::kGemmRs:
        return nccl_status(ncclReduceScatter(partial_.p, out_, static_cast<size_t>(s_.out_rows() * s_.n), t, ncclSum, nccl_, stream_),
                           "ncclReduceScatter");
      default:
        return nccl_status(ncclAllReduce(partial_.p, out_, static_cast<size_t>(s_.m * s_.n), t, ncclSum, nccl_, stream_),
                           "ncclAllReduce");
    }
  }

  Status nccl_then_cublas() {
    if (s_.op == OpId::kAgGemm) {
      LOOM_TRY(nccl_alone());
      return cublas_alone();
    }
    LOOM_TRY(cublas_alone());
    return nccl_alone();
  }

  // Per-tile timelines (loom/diagnostics.h) of loom's fused kernel (when `plan` is fused) and of
  // loom's GEMM alone: `launches` back-to-back launches each, the records of the last one kept,
  // written as timeline_<op>_<M>_{fused,gemm}_rank<r>.csv in `dir`.
  Status write_timelines(const std::string& dir, const planner::TpPlan& plan, int launches) {
    auto trace = [&](const char* what, GemmTile tile, int64_t m_blocks, int64_t n_blocks,
                     const std::function<Status(TileTimelineRecord*)>& launch) -> Status {
      // Room for the finest tile grid any configuration has, whatever tile the launch ends up with.
      const size_t capacity = static_cast<size_t>(tile_timeline_capacity(s_.m, s_.n));
      const size_t tiles = static_cast<size_t>(m_blocks * n_blocks);
      const size_t count = capacity;  // tiles, then the pieces of split tiles
      DeviceBuffer records;
      LOOM_TRY(records.alloc(capacity * sizeof(TileTimelineRecord)));
      LOOM_CUDA_TRY(cudaMemsetAsync(records.p, 0, capacity * sizeof(TileTimelineRecord), stream_));
      LOOM_TRY(comm_.synchronize(stream_));
      LOOM_TRY(comm_.barrier());
      for (int i = 0; i < launches; ++i) LOOM_TRY(launch(static_cast<TileTimelineRecord*>(records.p)));
      LOOM_TRY(comm_.synchronize(stream_));
      std::vector<TileTimelineRecord> host(count);
      LOOM_CUDA_TRY(cudaMemcpy(host.data(), records.p, count * sizeof(TileTimelineRecord), cudaMemcpyDeviceToHost));
      const std::string path = dir + "/timeline_" + std::string(tp_op_name(s_.op)) + "_" + std::to_string(s_.m) + "_" + what +
                               "_rank" + std::to_string(s_.me) + ".csv";
      std::ofstream f(path);
      if (!f) return Status::invalid_argument("--timeline: cannot write " + path);
      f << "# op=" << tp_op_name(s_.op) << " M=" << s_.m << " N=" << s_.n << " K_rank=" << s_.k_rank << " what=" << what
        << " tile=" << gemm_tile_name(tile) << " m_blocks=" << m_blocks << " n_blocks=" << n_blocks << " rank=" << s_.me
        << " world=" << s_.world << " launches=" << launches << " sha=" << git_sha() << "\n";
      f << "tile,m_block,n_block,kind,cta,smid,claimed_ns,stored_ns,claimed_clock,mainloop_clock,stored_clock,fold_cycles,"
           "fold_drain_cycles,fold_signal_cycles\n";
      for (size_t t = 0; t < count; ++t) {
        const TileTimelineRecord& r = host[t];
        if (r.claimed_ns == 0) continue;  // not computed by this launch
        // A piece's record follows the tiles (its tile is not recorded: m_block, n_block = -1).
        const long long m_block = t < tiles ? static_cast<long long>(t / static_cast<size_t>(n_blocks)) : -1;
        const long long n_block = t < tiles ? static_cast<long long>(t % static_cast<size_t>(n_blocks)) : -1;
        f << t << ',' << m_block << ',' << n_block << ',' << r.kind << ','
          << r.cta << ',' << r.smid << ',' << r.claimed_ns << ',' << r.stored_ns << ',' << r.claimed_clock << ','
          << r.mainloop_clock << ',' << r.stored_clock << ',' << r.fold_cycles << ',' << r.fold_drain_cycles << ','
          << r.fold_signal_cycles << '\n';
      }
      return f ? Status{} : Status::internal("--timeline: writing " + path + " failed");
    };
    if (plan.algorithm == TpAlgorithm::kFused) {
      const GemmTileInfo info = gemm_tile_info(plan.tile);
      LOOM_TRY(trace("fused", plan.tile, (s_.m + info.block_m - 1) / info.block_m, (s_.n + info.block_n - 1) / info.block_n,
                     [&](TileTimelineRecord* records) {
                       TpGemmOptions options = o_.loom;
                       options.timeline = records;
                       return launch_loom(options);
                     }));
    }
    GemmOptions gemm_options;
    LOOM_ASSIGN_OR_RETURN(ops::GemmLaunchPlan gemm_plan, ops::plan_gemm_launch(loom_gemm_args(), gemm_options));
    return trace("gemm", gemm_plan.tile, gemm_plan.m_blocks, gemm_plan.n_blocks, [&](TileTimelineRecord* records) {
      GemmOptions options = gemm_options;
      options.timeline = records;
      return gemm(loom_gemm_args(), stream_, options);
    });
  }

  // One launch with `options` into a NaN-filled output, then ||out - ref|| / ||ref|| on sampled
  // rows against an fp32 reference built from every rank's regenerated operands.
  Result<Check> check(const TpGemmOptions& options) {
    LOOM_CUDA_TRY(cudaMemsetAsync(out_, 0xFF, out_bytes_, stream_));
    LOOM_TRY(comm_.synchronize(stream_));
    LOOM_TRY(comm_.barrier());  // no peer may write into out before it was poisoned here
    LOOM_TRY(launch_loom(options));
    LOOM_TRY(comm_.synchronize(stream_));
    return compare_with_reference();
  }

 private:
  uint64_t seed_a() const { return o_.seed * 16 + 1; }
  uint64_t seed_b() const { return o_.seed * 16 + 2; }

  Result<Check> compare_with_reference() {
    return check_sampled_rows(reference_call(s_, o_, s_.me, b_.p, [](int d) { return d; }), out_, stream_);
  }

  Communicator& comm_;
  ncclComm_t nccl_;
  cublasHandle_t cublas_;
  cudaStream_t stream_;
  const TpBenchOptions& o_;
  Shape s_;
  DeviceBuffer a_, b_, out_plain_, gathered_, partial_;
  SymmetricBuffer out_sym_;
  void* out_ = nullptr;
  size_t out_bytes_ = 0;
};

// ---- per-run state ----------------------------------------------------------------------------

Result<std::vector<Shape>> shapes_of(const Communicator& comm, const TpBenchOptions& o) {
  std::vector<Shape> shapes;
  const int world = comm.local_world_size();
  for (OpId op : o.ops) {
    const bool ag = op == OpId::kAgGemm;
    const int64_t n = o.n > 0 ? o.n : (ag ? 14336 : 8192);
    const int64_t k = o.k > 0 ? o.k : (ag ? 8192 : 14336);
    if (!ag && k % world != 0) {
      return Status::invalid_argument(std::string(tp_op_name(op)) + ": the global K = " + std::to_string(k) +
                                      " does not split over " + std::to_string(world) + " ranks");
    }
    for (int64_t m : o.m) {
      if (m % world != 0) {
        return Status::invalid_argument(std::string(tp_op_name(op)) + ": M = " + std::to_string(m) +
                                        " is not a multiple of the " + std::to_string(world) + " ranks (NCCL's collectives need it too)");
      }
      shapes.push_back(Shape{op, m, n, k, ag ? k : k / world, world, comm.local_rank()});
    }
  }
  return shapes;
}

std::string plan_text(const planner::TpPlan& p) {
  return std::string(planner::tp_algorithm_name(p.algorithm)) + "/" + std::to_string(p.comm_ctas) + "/" +
         std::string(gemm_tile_name(p.tile)) + " (" + p.source + ")";
}

nlohmann::json plan_json(const planner::TpPlan& p) {
  return {{"algorithm", std::string(planner::tp_algorithm_name(p.algorithm))},
          {"comm_ctas", p.comm_ctas},
          {"tile", std::string(gemm_tile_name(p.tile))},
          {"source", p.source}};
}

Row base_row(const Shape& s, const TpBenchOptions& o) {
  Row row;
  row.op = std::string(tp_op_name(s.op));
  row.dtype = std::string(dtype_name(o.dtype));
  row.m = s.m;
  row.n = s.n;
  row.k = s.k_global;  // gemm_rs / gemm_ar: the full K; each rank holds k_per_rank
  row.extra["k_per_rank"] = s.k_rank;
  row.extra["b_layout"] = std::string(b_layout_name(o.b_layout));
  row.extra["iters"] = o.iters;
  row.extra["warmup"] = o.warmup;
  return row;
}

bool is_tp_row(const Row& r) { return r.op == "ag_gemm" || r.op == "gemm_rs" || r.op == "gemm_ar"; }

constexpr const char* kOneRankNote = "world 1: needs 2+ ranks (loom runs a plain GEMM, nothing to overlap)";

std::optional<double> hidden_fraction(const Row& r) { return hidden_share(r, "loom", "nccl_cublas", "cublas"); }

}  // namespace

// ---- loom-bench ag_gemm | gemm_rs | gemm_ar ---------------------------------------------------

Status run_tp_bench(Communicator& comm, ncclComm_t nccl, const TpBenchOptions& o, Report& report, Progress& progress) {
  if (o.dtype != DType::kBF16 && o.dtype != DType::kF16) {
    return Status::invalid_argument("tensor-parallel benches run bf16 or fp16 (got " + std::string(dtype_name(o.dtype)) + ")");
  }
  if (comm.num_nodes() > 1) return Status::unsupported("the tensor-parallel operators run within one node");
  LOOM_ASSIGN_OR_RETURN(std::vector<Shape> shapes, shapes_of(comm, o));
  StreamHolder stream;
  LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking));
  CublasContext cublas;
  LOOM_TRY(cublas.init(stream.stream));
  LOOM_ASSIGN_OR_RETURN(const planner::TuningCache* cache, planner::tuning_cache_from_env());
  auto sync = [&] { return comm.synchronize(stream.stream); };
  // One rank has no communication to hide: the operators run a plain GEMM, and NCCL's
  // "collective" is a copy, so only the GEMM columns are timed and the row says why there is no h.
  const bool one_rank = comm.local_world_size() == 1;
  Status status;
  for (const Shape& shape : shapes) {
    progress.step(shape.text());
    Row row = base_row(shape, o);
    if (one_rank) row.extra["note"] = std::string(kOneRankNote);
    TpCase c(comm, nccl, cublas.handle, stream.stream, o, shape);
    LOOM_TRY(c.setup());
    // The plan the operator will pick (same request, options and cache).
    const planner::TpRequest request = c.request();
    Result<planner::TpPlan> plan = planner::plan_tp(request, o.loom, cache);
    if (plan.ok()) {
      row.extra["plan"] = plan_json(*plan);
      if (o.loom.tail_pieces >= 0) row.extra["plan"]["tail_pieces"] = o.loom.tail_pieces;  // forced (else the planner's)
      const planner::TpEstimate e = planner::estimate_tp(request, plan->comm_ctas, plan->tile);
      row.extra["model_ms"] = {{"loom", (plan->algorithm == TpAlgorithm::kFused ? e.fused_s : e.decomposed_s) * 1e3},
                               {"fused", e.fused_s * 1e3},
                               {"decomposed", e.decomposed_s * 1e3},
                               {"gemm", e.gemm_s * 1e3},
                               {"comm", e.comm_s * 1e3}};
    }

    // The baselines (JSON key, launch): timed beside loom in alternating rounds, or alone when loom
    // could not be timed.
    std::vector<std::pair<const char*, std::function<Status()>>> baselines;
    if (o.baselines) {
      baselines = {{"cublas", [&] { return c.cublas_alone(); }}, {"loom_gemm", [&] { return c.loom_gemm_alone(); }}};
      if (!one_rank) {
        baselines.push_back({"nccl", [&] { return c.nccl_alone(); }});
        baselines.push_back({"nccl_cublas", [&] { return c.nccl_then_cublas(); }});
      }
    }

    // Correctness once, then loom's timing (with the baselines').
    Status loom_status;
    bool baselines_done = false;
    Result<Check> check = c.check(o.loom);
    if (!check.ok()) {
      loom_status = check.status();
    } else {
      LOOM_ASSIGN_OR_RETURN(double rel_err, max_over_ranks(comm, check->rel_err));
      LOOM_ASSIGN_OR_RETURN(double nans, max_over_ranks(comm, static_cast<double>(check->nan_count)));
      row.rel_err = rel_err;
      row.extra["nan_elements"] = nans;
      if (!(rel_err <= o.max_rel_err)) {
        row.extra["first_mismatch"] = check->first_mismatch;
        Status wrong = Status::internal(shape.text() + ": loom's result is wrong: rel_err " + fmt("%.3g", rel_err) +
                                        " (limit " + fmt("%.3g", o.max_rel_err) + "), " +
                                        std::to_string(static_cast<long long>(nans)) + " NaN elements sampled; on rank " +
                                        std::to_string(comm.rank()) + " worst " + check->first_mismatch);
        loom_status = wrong;
      }
      // loom and the baselines in alternating rounds (timing.h), so that the GPUs' clock drift
      // (power, temperature) over the measurement falls on every column alike.
      std::vector<const char*> keys = {"loom"};
      std::vector<std::function<Status()>> ops = {[&] { return c.launch_loom(o.loom); }};
      if (o.variant) {
        // The variant must be right too before it is timed.
        Result<Check> vc = c.check(*o.variant);
        Status variant_status = vc.status();
        if (vc.ok()) {
          LOOM_ASSIGN_OR_RETURN(double variant_err, max_over_ranks(comm, vc->rel_err));
          row.extra["rel_err_variant"] = variant_err;
          if (!(variant_err <= o.max_rel_err)) {
            Status wrong = Status::internal(shape.text() + ": the variant (" + o.variant_label + ") is wrong: rel_err " +
                                            fmt("%.3g", variant_err));
            variant_status = wrong;
          }
        }
        if (variant_status.ok()) {
          row.extra["variant"] = o.variant_label;
          keys.push_back("loom_variant");
          ops.push_back([&] { return c.launch_loom(*o.variant); });
        } else if (loom_status.ok()) {
          loom_status = variant_status;
        }
      }
      for (const auto& [key, op] : baselines) {
        keys.push_back(key);
        ops.push_back(op);
      }
      Result<std::vector<Timing>> t =
          time_interleaved(stream.stream, o.warmup, o.iters, ops, sync, [&] { return comm.barrier(); });
      if (t.ok()) {
        for (size_t i = 0; i < keys.size(); ++i) record_time(comm, row, keys[i], (*t)[i], status);
        baselines_done = true;
      } else if (loom_status.ok()) {
        loom_status = t.status();
      }
    }
    if (loom_status.ok() && !o.timeline_dir.empty() && plan.ok()) {
      const Status written = c.write_timelines(o.timeline_dir, *plan, std::max(o.warmup, 1) + 1);
      loom_status = written;
    }
    if (!loom_status.ok()) {
      row.extra["loom_error"] = loom_status.to_string();
      if (status.ok()) status = loom_status;
      if (!comm.health().ok()) {  // a device-side failure ends the communicator: stop here
        report.add(std::move(row));
        return status;
      }
    }

    if (!baselines_done) {  // loom could not be timed: the baselines alone, one after the other
      for (const auto& [key, op] : baselines) {
        LOOM_TRY(comm.barrier());
        LOOM_ASSIGN_OR_RETURN(Timing t, time_op(stream.stream, o.warmup, o.iters, op, sync));
        record_time(comm, row, key, t, status);
      }
    }
    const double flop = 2.0 * static_cast<double>(shape.m) * static_cast<double>(shape.n) * static_cast<double>(shape.k_rank);
    nlohmann::json tflops = nlohmann::json::object();
    for (const char* key : {"loom", "cublas"}) {
      if (auto it = row.ms.find(key); it != row.ms.end() && it->second > 0) tflops[key] = flop / (it->second * 1e-3) / 1e12;
    }
    row.extra["tflops"] = tflops;
    const std::optional<double> h = hidden_fraction(row);
    row.extra["h"] = h ? nlohmann::json(*h) : nlohmann::json(nullptr);
    if (const std::optional<double> h_engine = hidden_share(row, "loom", "nccl_cublas", "loom_gemm")) {
      row.extra["h_engine"] = *h_engine;
    }
    nlohmann::json ratios = nlohmann::json::object();
    if (row.ms.count("loom") && row.ms.count("cublas")) ratios["loom_over_cublas"] = row.ms["loom"] / row.ms["cublas"];
    if (row.ms.count("loom") && row.ms.count("nccl_cublas")) ratios["nccl_cublas_over_loom"] = row.ms["nccl_cublas"] / row.ms["loom"];
    row.extra["ratios"] = ratios;

    if (comm.rank() == 0) {
      auto ms = [&](const char* key) { return row.ms.count(key) ? fmt("%.4f", row.ms[key]) : std::string("-"); };
      std::printf("%-34s %-2s loom %s | cuBLAS %s | loom GEMM %s | NCCL %s | NCCL+cuBLAS %s | h %s | plan %s | rel_err %s%s\n",
                  shape.text().c_str(), std::string(b_layout_name(o.b_layout)).c_str(), ms("loom").c_str(), ms("cublas").c_str(),
                  ms("loom_gemm").c_str(),
                  ms("nccl").c_str(), ms("nccl_cublas").c_str(),
                  one_rank ? "- (needs 2+ ranks)" : h ? fmt("%.2f", *h).c_str() : "-",
                  plan.ok() ? plan_text(*plan).c_str() : plan.status().to_string().c_str(),
                  row.rel_err ? fmt("%.2e", *row.rel_err).c_str() : "-",
                  loom_status.ok() ? "" : ("  ERROR " + loom_status.to_string()).c_str());
      if (row.ms.count("loom_variant")) {
        std::printf("%-34s %-2s loom %s | loom with %s %s | variant / loom %.3f\n", shape.text().c_str(),
                    std::string(b_layout_name(o.b_layout)).c_str(), ms("loom").c_str(), o.variant_label.c_str(),
                    ms("loom_variant").c_str(), row.ms["loom_variant"] / row.ms["loom"]);
      }
      std::fflush(stdout);
    }
    report.add(std::move(row));
  }
  return status;
}

// ---- loom-bench tune ----------------------------------------------------------------------------

Status run_tp_tune(Communicator& comm, const TpTuneOptions& options, Report& report, Progress& progress) {
  const TpBenchOptions& o = options.bench;
  if (options.cache_path.empty()) return Status::invalid_argument("tune: --cache FILE is required");
  if (o.dtype != DType::kBF16 && o.dtype != DType::kF16) return Status::invalid_argument("tune: bf16 or fp16 only");
  // The "model" candidate must be the cost model, not an older cache the operators would read.
  if (std::getenv("LOOM_TUNING_CACHE") != nullptr) {
    if (comm.rank() == 0) std::fprintf(stderr, "loom-bench tune: ignoring LOOM_TUNING_CACHE while tuning\n");
    unsetenv("LOOM_TUNING_CACHE");
  }
  LOOM_ASSIGN_OR_RETURN(std::vector<Shape> shapes, shapes_of(comm, o));
  StreamHolder stream;
  LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking));
  CublasContext cublas;
  LOOM_TRY(cublas.init(stream.stream));
  auto sync = [&] { return comm.synchronize(stream.stream); };
  struct TunedEntry {
    planner::TpKey key;
    planner::TpPlan plan;
    double ms;
  };
  std::vector<TunedEntry> tuned;
  Status status;
  for (const Shape& shape : shapes) {
    progress.step("tune " + shape.text());
    TpCase c(comm, nullptr, cublas.handle, stream.stream, o, shape);
    LOOM_TRY(c.setup());
    const planner::TpRequest request = c.request();
    struct Candidate {
      std::string label;
      TpGemmOptions options;
    };
    std::vector<Candidate> candidates;
    TpGemmOptions model_options;
    model_options.tile = o.loom.tile;
    candidates.push_back({"model", model_options});
    // Fused with each tile the fused kernels have (or the one forced); ag_gemm also with each
    // comm CTA count (gemm_rs / gemm_ar move data from the epilogues and have no comm CTAs).
    std::vector<GemmTile> tiles = {GemmTile::k128x256, GemmTile::k128x128};
    if (o.loom.tile != GemmTile::kAuto) tiles = {o.loom.tile};
    for (GemmTile tile : tiles) {
      TpGemmOptions x = model_options;
      x.algorithm = TpAlgorithm::kFused;
      x.tile = tile;
      const std::string label = "fused/" + std::string(gemm_tile_name(tile));
      if (shape.op != OpId::kAgGemm) {
        candidates.push_back({label, x});
        continue;
      }
      for (int ctas : options.comm_ctas) {
        if (ctas < 1 || ctas >= request.sm_count) continue;
        x.comm_ctas = ctas;
        candidates.push_back({label + "/" + std::to_string(ctas), x});
      }
    }
    if (options.try_decomposed) {
      TpGemmOptions x = model_options;
      x.algorithm = TpAlgorithm::kDecomposed;
      candidates.push_back({"decomposed", x});
    }
    nlohmann::json timings = nlohmann::json::object();
    Timing best_time;
    const Candidate* best = nullptr;
    for (const Candidate& cand : candidates) {
      Result<Check> check = c.check(cand.options);
      Status cand_status = check.status();
      Timing cand_time;
      if (check.ok()) {
        LOOM_ASSIGN_OR_RETURN(double rel_err, max_over_ranks(comm, check->rel_err));
        if (!(rel_err <= o.max_rel_err)) {
          Status wrong = Status::internal("rel_err " + fmt("%.3g", rel_err));
          cand_status = wrong;
        } else {
          LOOM_TRY(comm.barrier());
          Result<Timing> t = time_op(stream.stream, o.warmup, o.iters, [&] { return c.launch_loom(cand.options); }, sync);
          Result<Timing> slowest = t.ok() ? max_over_ranks(comm, *t) : Result<Timing>(t.status());
          cand_status = slowest.status();
          if (slowest.ok()) cand_time = *slowest;
        }
      }
      if (!comm.health().ok()) return cand_status;  // device-side failure: the communicator is gone
      timings[cand.label] = cand_status.ok() ? nlohmann::json(cand_time.median_ms) : nlohmann::json(cand_status.to_string());
      if (cand_status.ok() && (best == nullptr || cand_time.median_ms < best_time.median_ms)) {
        best = &cand;
        best_time = cand_time;
      }
      if (comm.rank() == 0) {
        std::printf("tune %-34s %-12s %s\n", shape.text().c_str(), cand.label.c_str(),
                    cand_status.ok() ? fmt("%.4f ms", cand_time.median_ms).c_str() : cand_status.to_string().c_str());
        std::fflush(stdout);
      }
    }
    Row row = base_row(shape, o);
    row.extra["tune_ms"] = timings;
    if (best == nullptr) {
      const Status none = Status::internal("tune: " + shape.text() + ": no candidate ran correctly");
      row.extra["loom_error"] = none.to_string();
      if (status.ok()) status = none;
      report.add(std::move(row));
      continue;
    }
    LOOM_ASSIGN_OR_RETURN(planner::TpPlan plan, planner::plan_tp(request, best->options, nullptr));
    tuned.push_back({planner::key_of(request), plan, best_time.median_ms});
    row.set_time("loom", best_time);
    row.extra["chosen"] = best->label;
    row.extra["plan"] = plan_json(plan);
    if (comm.rank() == 0) std::printf("tune %-34s -> %s (%s)\n", shape.text().c_str(), best->label.c_str(), plan_text(plan).c_str());
    report.add(std::move(row));
  }
  if (comm.rank() == 0 && !tuned.empty()) {
    // Merge: entries for shapes not tuned in this run stay.
    LOOM_ASSIGN_OR_RETURN(planner::TuningCache merged, planner::TuningCache::load(options.cache_path));
    for (const TunedEntry& e : tuned) merged.put(e.key, e.plan, e.ms);
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, comm.device()) == cudaSuccess) merged.set_gpu(prop.name);
    LOOM_TRY(merged.save(options.cache_path));
    std::printf("tune: wrote %zu entries (%zu from this run) to %s\n", merged.size(), tuned.size(), options.cache_path.c_str());
  }
  return status;
}

uint64_t tp_heap_bytes(const TpBenchOptions& o, int world) {
  // gemm_ar's output is symmetric; the operators' workspaces (gathered A, partial sums, possibly
  // in fp32) come from the same heap: budget two fp32 [M, max(N, K)] on top.
  uint64_t need = 0;
  for (OpId op : o.ops) {
    const bool ag = op == OpId::kAgGemm;
    const uint64_t n = static_cast<uint64_t>(o.n > 0 ? o.n : (ag ? 14336 : 8192));
    const uint64_t k = static_cast<uint64_t>(o.k > 0 ? o.k : (ag ? 8192 : 14336));
    for (int64_t m64 : o.m) {
      const uint64_t m = static_cast<uint64_t>(std::max<int64_t>(m64, 0));
      const uint64_t out = op == OpId::kGemmAr ? m * n * dtype_size(o.dtype) : 0;
      need = std::max(need, out + 2 * m * std::max(n, k) * 4);
    }
  }
  (void)world;
  return need + (uint64_t{512} << 20);
}

void print_tp_table(const Report& report, std::FILE* out) {
  bool any = false;
  for (const Row& r : report.rows()) any = any || is_tp_row(r);
  if (!any) return;
  std::fprintf(out, "\n%-8s %-22s %-3s %9s %9s %9s %11s %9s %9s %6s %-26s %s\n", "op", "M x N x K", "B", "loom ms", "cuBLAS",
               "NCCL", "NCCL+cuBLAS", "loom/cuB", "speedup", "h", "plan", "rel_err");
  for (const Row& r : report.rows()) {
    if (!is_tp_row(r)) continue;
    auto ms = [&](const char* key) -> double {
      auto it = r.ms.find(key);
      return it == r.ms.end() ? -1 : it->second;
    };
    auto cell = [](double v, const char* f) { return v > 0 ? fmt(f, v) : std::string("-"); };
    char shape[64];
    std::snprintf(shape, sizeof(shape), "%lldx%lldx%lld", r.m.value_or(0), r.n.value_or(0), r.k.value_or(0));
    const double loom = ms("loom"), cub = ms("cublas"), base = ms("nccl_cublas");
    const std::optional<double> h = hidden_fraction(r);
    std::string plan = "-";
    if (r.extra.contains("plan")) {
      const nlohmann::json& p = r.extra["plan"];
      plan = p.value("algorithm", "?") + "/" + std::to_string(p.value("comm_ctas", 0)) + "/" + p.value("tile", "?") + " " +
             p.value("source", "?");
    }
    std::string err = r.rel_err ? fmt("%.1e", *r.rel_err) : std::string("-");
    if (r.extra.contains("loom_error")) err += " ERROR";
    if (r.extra.contains("note")) err += "  " + r.extra["note"].get<std::string>();
    std::fprintf(out, "%-8s %-22s %-3s %9s %9s %9s %11s %9s %9s %6s %-26s %s\n", r.op.c_str(), shape,
                 r.extra.value("b_layout", "?").c_str(), cell(loom, "%.4f").c_str(), cell(cub, "%.4f").c_str(),
                 cell(ms("nccl"), "%.4f").c_str(), cell(base, "%.4f").c_str(),
                 loom > 0 && cub > 0 ? fmt("%.3f", loom / cub).c_str() : "-",
                 loom > 0 && base > 0 ? fmt("%.3fx", base / loom).c_str() : "-", h ? fmt("%.2f", *h).c_str() : "-",
                 plan.c_str(), err.c_str());
  }
  std::fflush(out);
}

}  // namespace loom::bench
