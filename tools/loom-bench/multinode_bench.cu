// loom-bench multinode: ag_gemm, gemm_rs and gemm_ar across (real or emulated) nodes, against
//   gemm        the same local GEMM alone on loom's engine (ag: [M, N, K] on the gathered A;
//               rs / ar: [M, N, K_r]) — what a fused operator approaches
//   net         the same shaped network transfer alone: ops::net_exchange through the proxy and
//               the transport (ag: each rank's shard; rs: its node partial block; ar: both stages'
//               volume), direct to the same-index GPU of every other node
//   sequential  the GEMM, then the transfer, on one stream — the baseline
//   cublas      cuBLAS on the local shape (reference only)
// and h = (T_sequential - T_loom) / (T_sequential - T_gemm), the share of the transfer loom hides,
// next to h_max = (T_sequential - max(T_gemm, T_net)) / (T_sequential - T_gemm), the most any
// overlap can hide: a fused kernel takes at least as long as the longer of its two parts (below 1
// when the transfer outlasts the GEMM, e.g. gemm_ar on one GPU per node).
// With LOOM_EMULATE_NET_GBPS the copy engine paces the transfer like a NIC of that rate.
//
// Inputs are random (12-bit values in [-1, 1), a pure function of seed, rank and index), so any
// rank rebuilds every other rank's operands for its fp32 reference on sampled rows.
#include "multinode_bench.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "baselines.h"
#include "collectives_bench.h"
#include "loom/gemm.h"
#include "ops/tp/multinode/multinode.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"
#include "tests/common/verifiable.cuh"
#include "timing.h"
#include "tp_bench_common.cuh"

namespace loom::bench {
namespace {


struct Shape {
  OpId op;
  int64_t m, n, k_global, k_rank;
  int world, rank, block;
  int64_t rows() const { return m / world; }
  int64_t a_rows() const { return op == OpId::kAgGemm ? rows() : m; }
  int64_t out_rows() const { return op == OpId::kGemmRs ? rows() : m; }
  std::string text() const {
    return std::string(op_name(op)) + " " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k_global);
  }
  // Bytes each rank sends to every other node in the transfer baseline.
  uint64_t transfer_bytes(DType t) const {
    const uint64_t e = dtype_size(t);
    switch (op) {
      case OpId::kAgGemm: return static_cast<uint64_t>(rows() * k_rank) * e;
      case OpId::kGemmRs: return static_cast<uint64_t>(rows() * n) * e;
      default: return 2 * static_cast<uint64_t>(rows() * n) * e;  // reduce-scatter, then all-gather
    }
  }
};

int rank_of_block(const Communicator& comm, int d) {
  const auto& t = internal(comm).topology;
  return t.rank_of(d / t.local_world_size, d % t.local_world_size);
}

class Case {
 public:
  Case(Communicator& comm, cublasHandle_t cublas, cudaStream_t stream, const MultiNodeBenchOptions& o, Shape s)
      : comm_(comm), cublas_(cublas), stream_(stream), o_(o), s_(s) {}

  Status setup() {
    const DType t = o_.dtype;
    const size_t e = dtype_size(t);
    const bool kn = o_.b_layout == BLayout::kKN;
    LOOM_TRY(a_.alloc(static_cast<size_t>(s_.a_rows() * s_.k_rank) * e));
    LOOM_TRY(b_.alloc(static_cast<size_t>(s_.n * s_.k_rank) * e));
    out_bytes_ = static_cast<size_t>(s_.out_rows() * s_.n) * e;
    if (s_.op == OpId::kGemmAr) {
      LOOM_TRY(out_sym_.alloc(comm_, out_bytes_));
      out_ = out_sym_.p;
    } else {
      LOOM_TRY(out_plain_.alloc(out_bytes_));
      out_ = out_plain_.p;
    }
    // The GEMM alone: on the gathered A (ag) or this rank's A (rs, ar), into a scratch output.
    if (s_.op == OpId::kAgGemm) {
      LOOM_TRY(gemm_a_.alloc(static_cast<size_t>(s_.m * s_.k_rank) * e));
      for (int d = 0; d < s_.world; ++d) {
        LOOM_TRY(fill_matrix(offset_elements(gemm_a_.p, d * s_.rows() * s_.k_rank, t), t, s_.rows(), s_.k_rank, s_.k_rank, seed_a(),
                             rank_of_block(comm_, d), stream_));
      }
    }
    LOOM_TRY(gemm_out_.alloc(static_cast<size_t>(s_.m * s_.n) * e));
    // The transfer: a symmetric source and the receive area of (nodes - 1) slots.
    const uint64_t bytes = s_.transfer_bytes(t);
    LOOM_TRY(net_src_.alloc(comm_, bytes));
    LOOM_TRY(net_dst_.alloc(comm_, bytes * static_cast<uint64_t>(comm_.num_nodes() - 1)));
    LOOM_CUDA_TRY(cudaMemsetAsync(net_src_.p, 0x3c, bytes, stream_));
    LOOM_TRY(fill_matrix(a_.p, t, s_.a_rows(), s_.k_rank, s_.k_rank, seed_a(), s_.rank, stream_));
    LOOM_TRY(fill_matrix(b_.p, t, kn ? s_.k_rank : s_.n, kn ? s_.n : s_.k_rank, kn ? s_.n : s_.k_rank, seed_b(), s_.rank, stream_));
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

  Status launch_loom() {
    switch (s_.op) {
      case OpId::kAgGemm: return ag_gemm(comm_, loom_args(), stream_, o_.loom);
      case OpId::kGemmRs: return gemm_rs(comm_, loom_args(), stream_, o_.loom);
      default: return gemm_ar(comm_, loom_args(), stream_, o_.loom);
    }
  }

  GemmArgs gemm_args() const {
    GemmArgs g;
    g.a = s_.op == OpId::kAgGemm ? gemm_a_.p : a_.p;
    g.b = b_.p;
    g.d = gemm_out_.p;
    g.m = s_.m;
    g.n = s_.n;
    g.k = s_.k_rank;
    g.in_dtype = o_.dtype;
    g.out_dtype = o_.dtype;
    g.b_layout = o_.b_layout;
    return g;
  }
  Status gemm_alone() { return gemm(gemm_args(), stream_); }
  Status cublas_alone() {
    const GemmArgs g = gemm_args();
    return cublas_gemm(cublas_, g.a, g.b, g.d, g.m, g.n, g.k, o_.b_layout, o_.dtype, o_.dtype);
  }
  Status net_alone() { return ops::net_exchange(comm_, net_src_.p, net_dst_.p, s_.transfer_bytes(o_.dtype), stream_); }
  Status sequential() {
    LOOM_TRY(gemm_alone());
    return net_alone();
  }

  // One launch into a NaN-filled output, then ||out - ref|| / ||ref|| on sampled rows.
  Result<double> check(int64_t* nans) {
    LOOM_CUDA_TRY(cudaMemsetAsync(out_, 0xFF, out_bytes_, stream_));
    LOOM_TRY(comm_.synchronize(stream_));
    LOOM_TRY(comm_.barrier());  // no peer writes into out before it was poisoned here
    LOOM_TRY(launch_loom());
    LOOM_TRY(comm_.synchronize(stream_));
    return compare(nans);
  }

 private:
  uint64_t seed_a() const { return o_.seed * 16 + 1; }
  uint64_t seed_b() const { return o_.seed * 16 + 2; }

  Result<double> compare(int64_t* nans) {
    ReferenceCall c = reference_call(s_, o_, s_.block, b_.p, [this](int d) { return rank_of_block(comm_, d); });
    c.max_rows = 192;
    LOOM_ASSIGN_OR_RETURN(const SampledCheck check, check_sampled_rows(c, out_, stream_));
    *nans = check.nan_count;
    return check.rel_err;
  }

  Communicator& comm_;
  cublasHandle_t cublas_;
  cudaStream_t stream_;
  const MultiNodeBenchOptions& o_;
  Shape s_;
  DeviceBuffer a_, b_, out_plain_, gemm_a_, gemm_out_;
  SymmetricBuffer out_sym_, net_src_, net_dst_;
  void* out_ = nullptr;
  size_t out_bytes_ = 0;
};

bool is_multinode_row(const Row& r) { return r.extra.contains("multinode"); }

std::optional<double> hidden_fraction(const Row& r) { return hidden_share(r, "loom", "sequential", "gemm"); }

// h_max: what hiding all of the shorter part would give, (T_seq - max(T_gemm, T_net)) / (T_seq - T_gemm).
std::optional<double> hidden_fraction_bound(const Row& r) {
  const std::optional<double> base = measured_ms(r, "sequential"), gemm = measured_ms(r, "gemm"), net = measured_ms(r, "net");
  if (!base || !gemm || !net || *base <= *gemm) return std::nullopt;
  return std::min(1.0, (*base - std::max(*gemm, *net)) / (*base - *gemm));
}

// Times `op` and records it (max over ranks) as `row`'s column `key`; nothing if `status` is
// already an error, and a failure becomes `status`.
void time_column(Communicator& comm, cudaStream_t stream, const MultiNodeBenchOptions& o, Row& row, const char* key,
                 const std::function<Status()>& op, Status& status) {
  if (!status.ok()) return;
  Status barrier = comm.barrier();
  if (!barrier.ok()) {
    status = barrier;
    return;
  }
  Result<Timing> t = time_op(stream, o.warmup, o.iters, op, [&] { return comm.synchronize(stream); });
  if (!t.ok()) {
    status = t.status();
    return;
  }
  Result<Timing> slowest = max_over_ranks(comm, *t);
  if (!slowest.ok()) {
    status = slowest.status();
    return;
  }
  row.set_time(key, *slowest);
}

}  // namespace

Status run_multinode_bench(Communicator& comm, const MultiNodeBenchOptions& o, Report& report, Progress& progress) {
  if (comm.num_nodes() < 2) {
    return Status::unsupported("loom-bench multinode needs a job of several nodes (real ones, or emulated: LOOM_EMULATE_NODES=2 "
                               "LOOM_EMULATE_NET_GBPS=50 loom-bench multinode --spawn 2)");
  }
  if (o.dtype != DType::kBF16 && o.dtype != DType::kF16) return Status::invalid_argument("multinode: bf16 or fp16");
  const int world = comm.world_size();
  std::vector<Shape> shapes;
  for (OpId op : o.ops) {
    const bool ag = op == OpId::kAgGemm;
    const int64_t n = o.n > 0 ? o.n : (ag ? 14336 : 8192);
    const int64_t k = o.k > 0 ? o.k : (ag ? 8192 : 14336);
    if (!ag && k % world != 0) return Status::invalid_argument("multinode: the global K must split over the ranks");
    for (int64_t m : o.m) {
      shapes.push_back(Shape{op, m, n, k, ag ? k : k / world, world, comm.rank(), comm.node() * comm.local_world_size() + comm.local_rank()});
    }
  }
  StreamHolder stream;
  LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking));
  CublasContext cublas;
  LOOM_TRY(cublas.init(stream.stream));
  Status status;
  for (const Shape& shape : shapes) {
    progress.step("multinode " + shape.text());
    Row row;
    row.op = std::string(op_name(shape.op));
    row.dtype = std::string(dtype_name(o.dtype));
    row.m = shape.m;
    row.n = shape.n;
    row.k = shape.k_global;
    row.extra["multinode"] = true;
    row.extra["k_per_rank"] = shape.k_rank;
    row.extra["b_layout"] = std::string(b_layout_name(o.b_layout));
    row.extra["nodes"] = comm.num_nodes();
    row.extra["gpus_per_node"] = comm.local_world_size();
    row.extra["transfer_bytes"] = shape.transfer_bytes(o.dtype);
    row.extra["iters"] = o.iters;
    row.extra["warmup"] = o.warmup;
    Case c(comm, cublas.handle, stream.stream, o, shape);
    Status case_status = c.setup();
    Result<planner::MultiNodePlan> plan = ops::tp::multinode::plan(internal(comm), shape.op, c.loom_args(), o.loom);
    if (plan.ok()) {
      namespace kmn = kernels::tp::multinode;
      row.extra["plan"] = {{"tile", std::string(gemm_tile_name(plan->tile))},
                           {"grid", plan->grid},
                           {"net_send_ctas", plan->roles.count(kmn::CtaRole::kNetSend)},
                           {"net_recv_ctas", plan->roles.count(kmn::CtaRole::kNetRecv)},
                           {"nvlink_ctas", plan->roles.count(kmn::CtaRole::kNvlink)},
                           {"rows_per_chunk", plan->rows_per_chunk}};
    }
    if (case_status.ok()) {
      int64_t nans = 0;
      Result<double> rel = c.check(&nans);
      if (rel.ok()) {
        LOOM_ASSIGN_OR_RETURN(double rel_err, max_over_ranks(comm, *rel));
        LOOM_ASSIGN_OR_RETURN(double nan_max, max_over_ranks(comm, static_cast<double>(nans)));
        row.rel_err = rel_err;
        row.extra["nan_elements"] = nan_max;
        if (!(rel_err <= o.max_rel_err)) {
          const Status wrong = Status::internal(shape.text() + ": loom's result is wrong: rel_err " + fmt("%.3g", rel_err) +
                                                " (limit " + fmt("%.3g", o.max_rel_err) + "), " +
                                                std::to_string(static_cast<long long>(nan_max)) + " NaN elements sampled");
          case_status = wrong;
        }
      } else {
        case_status = rel.status();
      }
    }
    time_column(comm, stream.stream, o, row, "loom", [&] { return c.launch_loom(); }, case_status);
    if (o.baselines) {
      time_column(comm, stream.stream, o, row, "gemm", [&] { return c.gemm_alone(); }, case_status);
      time_column(comm, stream.stream, o, row, "net", [&] { return c.net_alone(); }, case_status);
      time_column(comm, stream.stream, o, row, "sequential", [&] { return c.sequential(); }, case_status);
      time_column(comm, stream.stream, o, row, "cublas", [&] { return c.cublas_alone(); }, case_status);
    }
    const std::optional<double> h = hidden_fraction(row);
    row.extra["h"] = h ? nlohmann::json(*h) : nlohmann::json(nullptr);
    const std::optional<double> h_max = hidden_fraction_bound(row);
    row.extra["h_max"] = h_max ? nlohmann::json(*h_max) : nlohmann::json(nullptr);
    if (row.ms.count("net") && row.ms["net"] > 0) {
      row.extra["net_gbps_measured"] = static_cast<double>(shape.transfer_bytes(o.dtype)) / (row.ms["net"] * 1e-3) / 1e9;
    }
    if (!case_status.ok()) {
      row.extra["loom_error"] = case_status.to_string();
      if (status.ok()) status = case_status;
    }
    if (comm.rank() == 0) {
      auto ms = [&](const char* key) { return row.ms.count(key) ? fmt("%.4f", row.ms[key]) : std::string("-"); };
      std::printf("%-28s loom %s | gemm %s | net %s | sequential %s | cuBLAS %s | h %s | rel_err %s%s\n", shape.text().c_str(),
                  ms("loom").c_str(), ms("gemm").c_str(), ms("net").c_str(), ms("sequential").c_str(), ms("cublas").c_str(),
                  h ? fmt("%.2f", *h).c_str() : "-", row.rel_err ? fmt("%.2e", *row.rel_err).c_str() : "-",
                  case_status.ok() ? "" : ("  ERROR " + case_status.to_string()).c_str());
      std::fflush(stdout);
    }
    report.add(std::move(row));
    if (!comm.health().ok()) return status;  // a device-side failure ends the communicator
  }
  return status;
}

uint64_t multinode_heap_bytes(const MultiNodeBenchOptions& o, int world, int nodes) {
  // gemm_ar's symmetric output, the operators' workspace (gathered A, or the fold source and send
  // buffer of the partials) and the transfer's source and receive area, all in the heap.
  uint64_t need = 0;
  const uint64_t e = dtype_size(o.dtype);
  const uint64_t w = static_cast<uint64_t>(std::max(world, 1));
  const uint64_t others = static_cast<uint64_t>(std::max(nodes, 2) - 1);
  for (OpId op : o.ops) {
    const bool ag = op == OpId::kAgGemm;
    const uint64_t n = static_cast<uint64_t>(o.n > 0 ? o.n : (ag ? 14336 : 8192));
    const uint64_t k = static_cast<uint64_t>(o.k > 0 ? o.k : (ag ? 8192 : 14336));
    for (int64_t m64 : o.m) {
      const uint64_t m = static_cast<uint64_t>(std::max<int64_t>(m64, 0));
      const uint64_t rows = m / w;
      const uint64_t out = op == OpId::kGemmAr ? m * n * e : 0;
      const uint64_t workspace = ag ? m * k * e : (w * rows + 2 * others * rows + 128) * n * e;
      const uint64_t transfer = (ag ? rows * k : 2 * rows * n) * e;
      need = std::max(need, out + workspace + transfer * (1 + others));
    }
  }
  return need + (uint64_t{512} << 20);
}

void print_multinode_table(const Report& report, std::FILE* out) {
  bool any = false;
  for (const Row& r : report.rows()) any = any || is_multinode_row(r);
  if (!any) return;
  std::fprintf(out, "\n%-8s %-22s %9s %9s %9s %11s %9s %6s %6s %-9s %s\n", "op", "M x N x K", "loom ms", "gemm", "net",
               "sequential", "cuBLAS", "h", "h_max", "tile", "rel_err");
  for (const Row& r : report.rows()) {
    if (!is_multinode_row(r)) continue;
    auto ms = [&](const char* key) -> double {
      auto it = r.ms.find(key);
      return it == r.ms.end() ? -1 : it->second;
    };
    auto cell = [](double v) { return v > 0 ? fmt("%.4f", v) : std::string("-"); };
    char shape[64];
    std::snprintf(shape, sizeof(shape), "%lldx%lldx%lld", r.m.value_or(0), r.n.value_or(0), r.k.value_or(0));
    const std::optional<double> h = hidden_fraction(r);
    const std::optional<double> h_max = hidden_fraction_bound(r);
    std::string tile = "-";
    if (r.extra.contains("plan")) tile = r.extra["plan"].value("tile", "?");
    std::string err = r.rel_err ? fmt("%.1e", *r.rel_err) : std::string("-");
    if (r.extra.contains("loom_error")) err += " ERROR";
    std::fprintf(out, "%-8s %-22s %9s %9s %9s %11s %9s %6s %6s %-9s %s\n", r.op.c_str(), shape, cell(ms("loom")).c_str(),
                 cell(ms("gemm")).c_str(), cell(ms("net")).c_str(), cell(ms("sequential")).c_str(), cell(ms("cublas")).c_str(),
                 h ? fmt("%.2f", *h).c_str() : "-", h_max ? fmt("%.2f", *h_max).c_str() : "-", tile.c_str(), err.c_str());
  }
  std::fflush(out);
}

}  // namespace loom::bench
