// loom-bench moe: the numbers issue 21 asks for, i.e. what moe_dispatch_gemm (the MoE dispatch and
// the local experts' fc1 in one persistent kernel) costs over its own grouped GEMM, and what it
// saves over the two calls it replaces. Per shape (a model's per-GPU slice, tokens per GPU, a
// routing), on one routing plan, the same inputs and the same tile, three columns timed side by
// side:
//   fused       moe_dispatch_gemm: the dispatch and out = silu(x W_gate^T) * (x W_up^T) of every
//               local expert (fc1, SwiGLU) in one kernel, an expert's tiles starting as its rows land
//   grouped     grouped_gemm alone on the rows already dispatched into recv_x: the fused kernel's
//               GEMM without the dispatch, the floor the fused call approaches
//   sequential  moe_dispatch, then grouped_gemm: what the fused kernel replaces
//   dispatch    moe_dispatch alone; dispatch_gbps counts true bytes: each token row once per
//               distinct rank holding one of its experts (the bytes that cross NVLink), not once
//               per top-k slot (the copies on the destination are not counted)
// ratio_fused_over_grouped = T_fused / T_grouped. At world 1 the dispatch is a copy within the GPU.
//
// Inputs: token rows uniform in [-1, 1), expert weights uniform in [-1, 1) / sqrt(H) (both filled
// on the device; values do not change the timing), top-k ids drawn on the host as
// tests/gpu/moe_ops_test.cu's make_ids draws them, and uploaded.
#include "moe_bench.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "collectives_bench.h"
#include "kernels/gemm/reference.cuh"
#include "loom/moe.h"
#include "planner/moe_plan.h"
#include "runtime/cuda_check.h"
#include "timing.h"
#include "tp_bench_common.cuh"

namespace loom::bench {
namespace {

constexpr const char* kOp = "moe_dispatch_gemm";  // the rows' op
// The timed columns (JSON keys of ms), in the order MoeCase::launches() returns them.
constexpr const char* kColumns[] = {"fused", "grouped", "sequential", "dispatch"};

MoeConfig config_of(const MoeShape& s, DType dtype) {
  MoeConfig c;
  c.num_experts = s.experts;
  c.top_k = s.top_k;
  c.hidden = s.model.hidden;
  c.dtype = dtype;
  c.max_tokens = s.tokens;
  return c;  // capacity 0: room for every routed row, none dropped
}

// Each token's k distinct experts, drawn one after another from a Categorical over the E experts,
// a chosen expert leaving the draw. The skewed weights come from a seed every rank shares, the
// draws from one per rank.
std::vector<int32_t> make_topk_ids(const MoeShape& s, int rank, uint64_t seed) {
  std::vector<double> expert_weights(static_cast<size_t>(s.experts), 1.0);
  if (s.routing == MoeRouting::kSkewed) {
    std::mt19937_64 shared(seed * 7919ull);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (double& w : expert_weights) w = u(shared);
  }
  std::mt19937_64 rng(seed * 1000003ull + static_cast<uint64_t>(rank));
  std::vector<int32_t> ids(static_cast<size_t>(s.tokens * s.top_k));
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::vector<double> left = expert_weights;
    for (int j = 0; j < s.top_k; ++j) {
      const int32_t id = std::discrete_distribution<int32_t>(left.begin(), left.end())(rng);
      ids[static_cast<size_t>(t * s.top_k + j)] = id;
      left[static_cast<size_t>(id)] = 0.0;
    }
  }
  return ids;
}

// The routing weights, U(0, 1) (kept by the plan for moe_combine; the timed calls do not read them).
std::vector<float> make_topk_weights(const MoeShape& s, int rank, uint64_t seed) {
  std::mt19937_64 rng(seed * 31337ull + static_cast<uint64_t>(rank));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> weights(static_cast<size_t>(s.tokens * s.top_k));
  for (float& w : weights) w = u(rng);
  return weights;
}

template <class T>
Status upload(DeviceBuffer& buffer, const std::vector<T>& host) {
  LOOM_TRY(buffer.alloc(host.size() * sizeof(T)));
  LOOM_CUDA_TRY(cudaMemcpy(buffer.p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return {};
}

// rows x cols values uniform in [-scale, scale), a pure function of the seed and the index.
Status fill_uniform(void* out, DType t, int64_t rows, int64_t cols, uint64_t seed, float scale, cudaStream_t stream) {
  kernels::gemm::reference::fill_uniform<<<1024, 256, 0, stream>>>(out, static_cast<int>(t), rows, cols, cols, seed,
                                                                    scale);
  LOOM_CUDA_TRY_LAUNCH();
  return {};
}

// One shape on this rank: its buffers, its routing plan (made once, used by every call) and the
// three timed launches.
class MoeCase {
 public:
  MoeCase(Communicator& comm, cudaStream_t stream, const MoeBenchOptions& o, const MoeShape& s)
      : comm_(comm), stream_(stream), o_(o), s_(s), config_(config_of(s, o.dtype)) {}

  // Allocates and fills the inputs, routes them and checks the routing's report.
  Status setup() {
    LOOM_ASSIGN_OR_RETURN(const MoeSizes sizes, moe_sizes(comm_, config_));
    capacity_ = sizes.capacity;
    local_experts_ = sizes.local_experts;
    const int rank = comm_.rank();
    const size_t element = dtype_size(o_.dtype);
    const int64_t hidden = s_.model.hidden;
    const std::vector<int32_t> ids = make_topk_ids(s_, rank, o_.seed);
    LOOM_TRY(upload(topk_ids_, ids));
    for (int64_t t = 0; t < s_.tokens; ++t) {  // distinct destination ranks per token
      uint64_t ranks = 0;
      for (int j = 0; j < s_.top_k; ++j) ranks |= 1ull << (ids[static_cast<size_t>(t * s_.top_k + j)] / local_experts_);
      dispatch_bytes_ += static_cast<double>(__builtin_popcountll(ranks)) * static_cast<double>(hidden * element);
    }
    LOOM_TRY(upload(topk_weights_, make_topk_weights(s_, rank, o_.seed)));
    LOOM_TRY(plan_buffer_.alloc(sizes.plan_bytes));
    LOOM_TRY(expert_offsets_.alloc(static_cast<size_t>(local_experts_ + 1) * sizeof(int32_t)));
    LOOM_TRY(x_.alloc(static_cast<size_t>(s_.tokens * hidden) * element));
    LOOM_TRY(recv_x_.alloc(comm_, sizes.recv_bytes));
    LOOM_TRY(expert_weights_.alloc(static_cast<size_t>(local_experts_ * gemm_n() * hidden) * element));
    LOOM_TRY(fused_out_.alloc(out_bytes()));
    LOOM_TRY(sequential_out_.alloc(out_bytes()));
    const uint64_t seed = o_.seed * 1000 + 2 * static_cast<uint64_t>(rank);
    LOOM_TRY(fill_uniform(x_.p, o_.dtype, s_.tokens, hidden, seed, 1.0f, stream_));
    LOOM_TRY(fill_uniform(expert_weights_.p, o_.dtype, local_experts_ * gemm_n(), hidden, seed + 1,
                          1.0f / std::sqrt(static_cast<float>(hidden)), stream_));

    MoeRoutingArgs routing;
    routing.topk_ids = static_cast<const int32_t*>(topk_ids_.p);
    routing.topk_weights = static_cast<const float*>(topk_weights_.p);
    routing.num_tokens = s_.tokens;
    routing.plan = plan_buffer_.p;
    routing.expert_offsets = static_cast<int32_t*>(expert_offsets_.p);
    LOOM_ASSIGN_OR_RETURN(plan_, moe_routing(comm_, config_, routing, stream_));
    LOOM_ASSIGN_OR_RETURN(const MoeReport report, moe_report(comm_, plan_, stream_));
    if (!report.status.ok()) return Status(report.status).with_context("moe_routing");
    kept_rows_ = report.kept_rows;

    // The grouped GEMM moe_dispatch_gemm runs (include/loom/moe.h), into sequential_out.
    grouped_.layout = GroupedLayout::kContiguous;
    grouped_.a = recv_x_.p;
    grouped_.b = expert_weights_.p;
    grouped_.d = sequential_out_.p;
    grouped_.offsets = static_cast<const int32_t*>(expert_offsets_.p);
    grouped_.m_total = capacity_;
    grouped_.n = gemm_n();
    grouped_.k = hidden;
    grouped_.num_experts = local_experts_;
    grouped_.in_dtype = o_.dtype;
    grouped_.out_dtype = o_.dtype;
    grouped_.activation = GroupedActivation::kSwiGLU;
    grouped_.workspace_bytes = grouped_gemm_workspace_bytes(grouped_);
    LOOM_TRY(gemm_workspace_.alloc(grouped_.workspace_bytes));
    grouped_.workspace = gemm_workspace_.p;
    return {};
  }

  int64_t kept_rows() const { return kept_rows_; }
  double dispatch_bytes() const { return dispatch_bytes_; }  // true bytes (see the top)

  // fused, grouped, sequential and dispatch (kColumns' order). grouped multiplies whatever recv_x
  // holds: run a dispatching launch first (mismatched_rows does).
  std::vector<std::function<Status()>> launches() {
    return {[this] { return fused(); }, [this] { return grouped(); }, [this] { return sequential(); },
            [this] { return moe_dispatch(comm_, plan_, x_.p, recv_x_.p, stream_); }};
  }

  // Runs fused and sequential once, into outputs pre-filled with two different byte patterns (a
  // row neither call wrote cannot match), and counts the kept rows whose bytes differ.
  Result<int64_t> mismatched_rows() {
    LOOM_CUDA_TRY(cudaMemsetAsync(fused_out_.p, 0xFF, out_bytes(), stream_));
    LOOM_CUDA_TRY(cudaMemsetAsync(sequential_out_.p, 0xFE, out_bytes(), stream_));
    LOOM_TRY(fused());
    LOOM_TRY(sequential());
    LOOM_TRY(comm_.synchronize(stream_));
    const size_t row_bytes = static_cast<size_t>(s_.model.intermediate) * dtype_size(o_.dtype);  // [rows, I]
    const size_t bytes = static_cast<size_t>(kept_rows_) * row_bytes;
    std::vector<uint8_t> fused_rows(bytes), sequential_rows(bytes);
    LOOM_CUDA_TRY(cudaMemcpy(fused_rows.data(), fused_out_.p, bytes, cudaMemcpyDeviceToHost));
    LOOM_CUDA_TRY(cudaMemcpy(sequential_rows.data(), sequential_out_.p, bytes, cudaMemcpyDeviceToHost));
    int64_t mismatched = 0;
    for (size_t offset = 0; offset < bytes; offset += row_bytes) {
      mismatched += std::memcmp(fused_rows.data() + offset, sequential_rows.data() + offset, row_bytes) != 0;
    }
    return mismatched;
  }

 private:
  int64_t gemm_n() const { return 2 * s_.model.intermediate; }  // gate and up, interleaved by 8
  size_t out_bytes() const {
    return static_cast<size_t>(capacity_) * static_cast<size_t>(s_.model.intermediate) * dtype_size(o_.dtype);
  }

  Status fused() {
    MoeExpertGemm gemm;
    gemm.weights = expert_weights_.p;
    gemm.n = gemm_n();
    gemm.activation = GroupedActivation::kSwiGLU;
    gemm.out = fused_out_.p;
    gemm.out_dtype = o_.dtype;
    MoeDispatchGemmOptions options;
    options.tile = o_.tile;
    options.push_ctas = o_.push_ctas;
    options.arrival_ctas = o_.arrival_ctas;
    return moe_dispatch_gemm(comm_, plan_, x_.p, recv_x_.p, gemm, stream_, options);
  }

  Status grouped() {
    GroupedGemmOptions options;
    options.tile = o_.tile;
    return grouped_gemm(grouped_, stream_, options);
  }

  Status sequential() {
    LOOM_TRY(moe_dispatch(comm_, plan_, x_.p, recv_x_.p, stream_));
    return grouped();
  }

  Communicator& comm_;
  cudaStream_t stream_;
  const MoeBenchOptions& o_;
  const MoeShape& s_;
  const MoeConfig config_;
  int64_t capacity_ = 0;
  int64_t local_experts_ = 0;
  int64_t kept_rows_ = 0;
  double dispatch_bytes_ = 0;
  MoePlan plan_;
  GroupedGemmArgs grouped_;
  DeviceBuffer topk_ids_, topk_weights_, plan_buffer_, expert_offsets_, x_, expert_weights_;
  DeviceBuffer fused_out_, sequential_out_, gemm_workspace_;
  SymmetricBuffer recv_x_;  // [capacity, H]
};

Row base_row(const MoeShape& s, const MoeBenchOptions& o, int world) {
  Row row;
  row.op = kOp;
  row.dtype = std::string(dtype_name(o.dtype));
  row.n = 2 * s.model.intermediate;
  row.k = s.model.hidden;
  row.extra["model"] = std::string(s.model.name);
  row.extra["experts"] = s.experts / world;  // per GPU
  row.extra["top_k"] = s.top_k;
  row.extra["tokens"] = s.tokens;
  row.extra["routing"] = std::string(moe_routing_name(s.routing));
  row.extra["tile"] = std::string(gemm_tile_name(o.tile));
  row.extra["push_ctas"] = o.push_ctas;
  row.extra["arrival_ctas"] = o.arrival_ctas;
  row.extra["world"] = world;
  row.extra["iters"] = o.iters;
  row.extra["warmup"] = o.warmup;
  return row;
}

// One shape: set up, checked once, timed; fills `row` (M = kept_rows, the most over the ranks).
// Returns the most kept rows of any rank on which fused and sequential differ.
Result<int64_t> measure_shape(Communicator& comm, const MoeBenchOptions& o, const MoeShape& shape, cudaStream_t stream,
                              Row& row) {
  MoeCase c(comm, stream, o, shape);
  LOOM_TRY(c.setup());
  LOOM_ASSIGN_OR_RETURN(const double kept_rows, max_over_ranks(comm, static_cast<double>(c.kept_rows())));
  row.m = static_cast<long long>(kept_rows);
  row.extra["kept_rows"] = *row.m;
  LOOM_ASSIGN_OR_RETURN(const int64_t mine, c.mismatched_rows());
  LOOM_ASSIGN_OR_RETURN(const double mismatched, max_over_ranks(comm, static_cast<double>(mine)));
  row.extra["bit_identical"] = mismatched == 0;

  // Side by side in shuffled rounds (timing.h: the op after a lighter one runs on a cooler GPU).
  auto sync = [&] { return comm.synchronize(stream); };
  auto barrier = [&] { return comm.barrier(); };
  LOOM_ASSIGN_OR_RETURN(const std::vector<Timing> times,
                        time_interleaved(stream, o.warmup, o.iters, c.launches(), sync, barrier));
  const double flop = 2.0 * kept_rows * static_cast<double>(*row.n) * static_cast<double>(*row.k);
  nlohmann::json tflops = nlohmann::json::object();
  for (size_t i = 0; i < std::size(kColumns); ++i) {
    LOOM_ASSIGN_OR_RETURN(const Timing slowest, max_over_ranks(comm, times[i]));
    row.set_time(kColumns[i], slowest);
    tflops[kColumns[i]] = flop / (slowest.median_ms * 1e-3) / 1e12;
  }
  tflops.erase("dispatch");  // no FLOPs
  row.extra["tflops"] = tflops;
  LOOM_ASSIGN_OR_RETURN(const double dispatch_bytes, max_over_ranks(comm, c.dispatch_bytes()));
  row.extra["dispatch_bytes"] = dispatch_bytes;
  row.extra["dispatch_gbps"] = dispatch_bytes / (row.ms["dispatch"] * 1e-3) / 1e9;
  row.extra["ratio_fused_over_grouped"] = row.ms["fused"] / row.ms["grouped"];
  return static_cast<int64_t>(mismatched);
}

// Grows loom's MoE workspace once, to the largest shape's: a workspace that grows later is
// reallocated beside the receive buffer of the moment, and the heap would need room for both.
Status reserve_workspace(Communicator& comm, const MoeBenchOptions& o, const std::vector<MoeShape>& shapes,
                         cudaStream_t stream) {
  std::optional<MoeConfig> largest;
  size_t largest_bytes = 0;
  for (const MoeShape& s : shapes) {
    const MoeConfig config = config_of(s, o.dtype);
    const Result<MoeSizes> sizes = moe_sizes(comm, config);
    if (sizes.ok() && sizes->workspace_bytes > largest_bytes) {
      largest = config;
      largest_bytes = sizes->workspace_bytes;
    }
  }
  if (!largest) return {};  // every shape is refused, each with its own message when it runs
  return moe_reserve_workspace(comm, *largest, stream);
}

// What fails the run for a measured shape: its error, or fused rows that differ from sequential ones.
Status shape_failure(const MoeShape& shape, const Result<int64_t>& mismatched) {
  if (!mismatched.ok()) return Status(mismatched.status()).with_context(shape.text());
  if (*mismatched > 0) {
    return Status::internal(shape.text() + ": moe_dispatch_gemm's output differs from moe_dispatch + grouped_gemm's " +
                            "in " + std::to_string(*mismatched) + " kept rows (on the rank with the most)");
  }
  return {};
}

std::string cell(double v, const char* format) { return v > 0 ? fmt(format, v) : std::string("-"); }

}  // namespace

Result<MoeModel> find_moe_model(std::string_view name) {
  for (const MoeModel& m : kMoeModels) {
    if (m.name == name) return m;
  }
  std::string known;
  for (const MoeModel& m : kMoeModels) known += (known.empty() ? "" : ", ") + std::string(m.name);
  return Status::invalid_argument("unknown MoE model '" + std::string(name) + "' (known: " + known + ")");
}

std::string_view moe_routing_name(MoeRouting routing) {
  return routing == MoeRouting::kSkewed ? "skewed" : "uniform";
}

Result<MoeRouting> parse_moe_routing(std::string_view name) {
  if (name == "uniform") return MoeRouting::kUniform;
  if (name == "skewed") return MoeRouting::kSkewed;
  return Status::invalid_argument("unknown routing '" + std::string(name) + "' (uniform or skewed)");
}

std::string MoeShape::text() const {
  return "moe " + std::string(model.name) + " E" + std::to_string(experts) + " k" + std::to_string(top_k) + " T" +
         std::to_string(tokens) + " " + std::string(moe_routing_name(routing));
}

std::vector<MoeShape> moe_shapes(const MoeBenchOptions& o, int world) {
  std::vector<MoeShape> shapes;
  for (const MoeModel& model : o.models) {
    const int64_t experts = model.experts_per_gpu * world;
    const int top_k = static_cast<int>(std::min<int64_t>(model.top_k, experts));
    for (int64_t tokens : o.tokens) {
      for (MoeRouting routing : o.routings) {
        if (routing == MoeRouting::kSkewed && experts == 1) continue;
        shapes.push_back({model, tokens, routing, experts, top_k});
      }
    }
  }
  return shapes;
}

Status run_moe_bench(Communicator& comm, const MoeBenchOptions& o, Report& report, Progress& progress) {
  if (o.dtype != DType::kBF16 && o.dtype != DType::kF16) {
    return Status::invalid_argument("moe bench: bf16 or fp16 only (got " + std::string(dtype_name(o.dtype)) + ")");
  }
  if (comm.ranks_on_gpu() > 1) {
    return Status::unsupported("moe bench: " + std::to_string(comm.ranks_on_gpu()) +
                               " ranks share this GPU and take turns on it, so nothing timed there means anything "
                               "(run one rank per GPU)");
  }
  const int world = comm.world_size();
  const std::vector<MoeShape> shapes = moe_shapes(o, world);
  StreamHolder stream;
  LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking));
  LOOM_TRY_CTX(reserve_workspace(comm, o, shapes, stream.stream), "moe bench");
  Status status;
  for (const MoeShape& shape : shapes) {
    progress.step(shape.text());
    Row row = base_row(shape, o, world);
    const Result<int64_t> mismatched = measure_shape(comm, o, shape, stream.stream, row);
    const Status failed = shape_failure(shape, mismatched);
    if (!mismatched.ok()) row.extra["loom_error"] = failed.to_string();
    report.add(std::move(row));
    if (status.ok()) status = failed;
    if (!comm.health().ok()) return status;  // a device-side failure ends the communicator: stop here
  }
  return status;
}

uint64_t moe_heap_bytes(const MoeBenchOptions& o, int world) {
  uint64_t recv = 0, workspace = 0;
  for (const MoeShape& s : moe_shapes(o, world)) {
    planner::MoeRequest request;
    request.config = config_of(s, o.dtype);
    request.world = world;
    const Result<planner::MoeLayouts> layouts = planner::plan_moe(request);
    if (!layouts.ok()) continue;  // refused when it runs, with the planner's message
    const MoeSizes sizes = layouts->sizes();
    recv = std::max<uint64_t>(recv, sizes.recv_bytes);
    workspace = std::max<uint64_t>(workspace, sizes.workspace_bytes);
  }
  return recv + workspace + (uint64_t{256} << 20);
}

void print_moe_table(const Report& report, std::FILE* out) {
  bool any = false;
  for (const Row& r : report.rows()) any = any || r.op == kOp;
  if (!any) return;
  std::fprintf(out, "\n%-12s %6s %-8s %9s %9s %9s %10s %8s %8s %9s %9s %s\n", "model", "tokens", "routing",
               "kept rows", "fused ms", "grouped", "sequential", "fus/grp", "TFLOP/s", "dispatch", "disp GB/s",
               "bit-identical");
  for (const Row& r : report.rows()) {
    if (r.op != kOp) continue;
    auto ms = [&](const char* key) {
      const auto it = r.ms.find(key);
      return it == r.ms.end() ? -1.0 : it->second;
    };
    const double tflops = r.extra.contains("tflops") ? r.extra["tflops"].value("fused", -1.0) : -1.0;
    std::string identical = r.extra.contains("bit_identical") ? (r.extra["bit_identical"].get<bool>() ? "yes" : "NO")
                                                              : "-";
    if (r.extra.contains("loom_error")) identical += "  ERROR " + r.extra["loom_error"].get<std::string>();
    std::fprintf(out, "%-12s %6lld %-8s %9s %9s %9s %10s %8s %8s %9s %9s %s\n", r.extra.value("model", "?").c_str(),
                 r.extra.value("tokens", 0LL), r.extra.value("routing", "?").c_str(),
                 r.m ? std::to_string(*r.m).c_str() : "-", cell(ms("fused"), "%.4f").c_str(),
                 cell(ms("grouped"), "%.4f").c_str(), cell(ms("sequential"), "%.4f").c_str(),
                 cell(r.extra.value("ratio_fused_over_grouped", -1.0), "%.3f").c_str(), cell(tflops, "%.0f").c_str(),
                 cell(ms("dispatch"), "%.4f").c_str(), cell(r.extra.value("dispatch_gbps", -1.0), "%.0f").c_str(),
                 identical.c_str());
  }
  std::fflush(out);
}

}  // namespace loom::bench
