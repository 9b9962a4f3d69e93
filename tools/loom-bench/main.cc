// loom-bench: runs loom's operators beside their baselines (NCCL, cuBLAS) in one process group
// and reports medians (max over ranks), JSON and a table printed last. The examples are in
// kExamples below (the help's footer).
#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives_bench.h"
#include "gemm_bench.h"
#include "core/env.h"
#include "launch.h"
#include "loom/loom.h"
#include "loom/version.h"
#include "moe_bench.h"
#include "multinode_bench.h"
#include "planner/tp_plan.h"
#include "progress.h"
#include "report.h"
#include "runtime/communicator_impl.h"
#include "tp_bench.h"

namespace {

using loom::Status;

constexpr int kUsageError = 2;  // exit status of a bad command line (1: a run that failed)

constexpr const char* kExamples = R"(Examples:
  loom-bench all --spawn 0 --json results.json        every operator, one rank per visible GPU
  loom-bench collectives --sizes 1M,64M,512M --spawn 2
  loom-bench gemm --m 4096 --nk 14336x8192
  loom-bench tp --spawn 2 --json tp.json              ag_gemm, gemm_rs, gemm_ar vs NCCL + cuBLAS
  loom-bench gemm_rs --m 4096 --comm-ctas 8 --spawn 2
  loom-bench tune --cache tuning.json --spawn 2       writes the tuning cache (LOOM_TUNING_CACHE)
  loom-bench moe --tokens 1024,4096 --json moe.json   moe_dispatch_gemm vs its grouped GEMM alone
  LOOM_EMULATE_NODES=2 LOOM_EMULATE_NET_GBPS=50 loom-bench multinode --spawn 2
  LOOM_SECRET=$(openssl rand -hex 16) torchrun --no-python --nproc-per-node 8 build/loom-bench collectives
      (without --no-python torchrun runs the binary as a Python script; the ranks come from
      RANK / WORLD_SIZE, as under loom-run or Slurm-style launchers)

NCCL runs with its own defaults: set NCCL_* variables to change them. The JSON records the
versions, the GPU, the command line and every LOOM_* and NCCL_* variable.
Exit status: 0 done, 1 a run that failed (or no GPU), 2 a usage error.)";

// A subcommand's help also lists the global options, which may come before or after it.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_help(const CLI::App* app, std::string name, CLI::AppFormatMode mode) const override {
    const CLI::App* parent = app->get_parent();
    if (parent == nullptr || mode == CLI::AppFormatMode::Sub) return CLI::Formatter::make_help(app, name, mode);
    const std::vector<const CLI::Option*> globals = parent->get_options([parent](const CLI::Option* o) {
      return o->nonpositional() && o != parent->get_help_ptr() && o != parent->get_version_ptr();
    });
    return make_description(app) + make_usage(app, name) + make_positionals(app) + make_groups(app, mode) +
           make_group("Global options (before or after the subcommand)", false, globals) + "\n" + make_footer(app);
  }
};

// A CLI11 check from one of loom's parsers: the value passes when `parse` accepts it, else the
// parser's message is the error.
template <typename Parse>
CLI::Validator accepted_by(Parse parse, std::string description) {
  return CLI::Validator(
      [parse](std::string& text) -> std::string {
        const Status s = parse(text);
        return s.ok() ? std::string() : s.message();
      },
      std::move(description));
}

constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();

// An integer option's check, with messages like "'x' is not an integer" or "-3 is not in [-1, 4096]"
// (CLI11's own numeric checks print their bounds as doubles, DBL_MAX included). The help shows
// `help_name`, or the bounds.
CLI::Validator integer_in(int64_t min, int64_t max, std::string help_name = "") {
  const std::string bounds = max == kNoMax ? ">= " + std::to_string(min)
                                           : "in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  if (help_name.empty()) help_name = bounds;
  return CLI::Validator(
      [min, max, bounds](std::string& text) -> std::string {
        const loom::Result<int64_t> v =
            loom::env::parse_int("value", text, std::numeric_limits<int64_t>::min(), kNoMax);
        if (!v.ok()) return "'" + text + "' is not an integer";
        if (*v < min || *v > max) return text + " is not " + bounds;
        return {};
      },
      std::move(help_name));
}

Status parse_size(const std::string& text, uint64_t& bytes) {
  LOOM_ASSIGN_OR_RETURN(bytes, loom::env::parse_bytes("size", text, 1, uint64_t{1} << 40));
  return {};
}

// "NxK", e.g. 14336x8192.
Status parse_nk(const std::string& pair, int64_t& n, int64_t& k) {
  const size_t x = pair.find('x');
  if (x == std::string::npos) return Status::invalid_argument("expected NxK (e.g. 14336x8192), got '" + pair + "'");
  LOOM_ASSIGN_OR_RETURN(n, loom::env::parse_int("N", pair.substr(0, x), 1, int64_t{1} << 31));
  LOOM_ASSIGN_OR_RETURN(k, loom::env::parse_int("K", pair.substr(x + 1), 1, int64_t{1} << 31));
  return {};
}

const CLI::Validator kNonNegative = integer_in(0, kNoMax, "NONNEGATIVE");
const CLI::Validator kPositive = integer_in(1, kNoMax, "POSITIVE");
const CLI::Validator kByteCount = accepted_by(
    [](const std::string& t) {
      uint64_t b = 0;
      return parse_size(t, b);
    },
    "BYTES");
const CLI::Validator kNkPair = accepted_by(
    [](const std::string& t) {
      int64_t n = 0, k = 0;
      return parse_nk(t, n, k);
    },
    "NxK");
const CLI::Validator kGemmTile = accepted_by([](const std::string& t) { return loom::parse_gemm_tile(t).status(); },
                                             "auto|128x256|128x128|128x64|64x128");
const CLI::Validator kMoeModel = accepted_by(
    [](const std::string& t) { return loom::bench::find_moe_model(t).status(); }, "deepseek-v3|qwen3-235b|mixtral");

struct GlobalOptions {
  int spawn = -1;  // -1: ranks come from the environment; 0: one per visible GPU
  std::string json_path;
  int warmup = 5;
  int iters = 30;
  std::string dtype = "bf16";
};

struct GemmCli {
  // The headline shapes: an M sweep over four (N, K) pairs of Llama-style layers.
  std::vector<int64_t> m = {128, 512, 1024, 4096, 8192, 16384};
  std::vector<std::string> nk = {"14336x8192", "8192x7168", "8192x8192", "28672x8192"};
  std::string layout = "nk";
  std::string out_dtype = "bf16";
  std::string tile = "auto";
  int ctas = 0;
  int group_m = 0;
};

struct CollectiveCli {
  std::vector<std::string> sizes = {"64M", "512M"};
  std::vector<int> ctas = {0};
  std::string engine = "auto";
};

struct TpCli {
  // The headline shapes: ag_gemm (M, 14336, 8192); gemm_rs / gemm_ar (M, 8192, 14336), K split over ranks.
  std::vector<int64_t> m = {1024, 2048, 4096, 8192, 16384, 32768};
  int64_t n = 0;  // 0: the op's headline N
  int64_t k = 0;  // 0: the op's headline K (global K for gemm_rs / gemm_ar)
  std::string layout = "nk";
  std::string algorithm = "auto";
  std::string tile = "auto";
  int comm_ctas = -1;
  int tail_pieces = -1;
  int variant_tail_pieces = -2;  // -2: no variant
  bool no_baselines = false;
  std::string timeline_dir;
  // tune
  std::vector<std::string> ops = {"ag_gemm", "gemm_rs", "gemm_ar"};
  std::vector<int> sweep_ctas = {2, 4, 6, 8, 10, 12, 16, 20, 24, 32};
  bool no_decomposed = false;
  std::string cache;
};

struct MoeCli {
  // bench/grouped_gemm.py's models, routings and (the first two) token counts.
  std::vector<std::string> models = {"deepseek-v3", "qwen3-235b", "mixtral"};
  std::vector<int64_t> tokens = {1024, 4096};
  std::vector<std::string> routings = {"uniform", "skewed"};
  std::string tile = "128x256";
  int push_ctas = 0;
  int arrival_ctas = 0;
};

int visible_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

Status parse_sizes(const std::vector<std::string>& text, std::vector<uint64_t>& out) {
  for (const std::string& t : text) {
    uint64_t b = 0;
    LOOM_TRY(parse_size(t, b));
    out.push_back(b);
  }
  return {};
}

Status run_collectives(loom::Communicator& comm, const std::vector<std::string>& ops, const GlobalOptions& g,
                       const CollectiveCli& c, loom::bench::Report& report, loom::bench::Progress& progress) {
  loom::bench::CollectiveBenchOptions o;
  o.ops = ops;
  LOOM_TRY(parse_sizes(c.sizes, o.sizes));
  o.ctas = c.ctas;
  LOOM_ASSIGN_OR_RETURN(o.dtype, loom::parse_dtype(g.dtype));
  o.engine = c.engine == "bulk" ? loom::CopyEngineChoice::kBulk
             : c.engine == "vector" ? loom::CopyEngineChoice::kVector
                                    : loom::CopyEngineChoice::kAuto;
  o.warmup = g.warmup;
  o.iters = g.iters;
  LOOM_ASSIGN_OR_RETURN(ncclComm_t nccl, loom::bench::make_nccl_comm(comm));
  Status s = loom::bench::run_collective_bench(comm, nccl, o, report, progress);
  ncclCommDestroy(nccl);
  return s;
}

Status run_gemm(loom::Communicator& comm, const GlobalOptions& g, const GemmCli& c, loom::bench::Report& report,
                loom::bench::Progress& progress) {
  loom::bench::GemmBenchOptions o;
  for (const std::string& pair : c.nk) {
    int64_t n = 0, k = 0;
    LOOM_TRY(parse_nk(pair, n, k));
    for (int64_t m : c.m) o.shapes.push_back({m, n, k});
  }
  LOOM_ASSIGN_OR_RETURN(o.in_dtype, loom::parse_dtype(g.dtype));
  LOOM_ASSIGN_OR_RETURN(o.out_dtype, loom::parse_dtype(c.out_dtype));
  LOOM_ASSIGN_OR_RETURN(o.b_layout, loom::parse_b_layout(c.layout));
  LOOM_ASSIGN_OR_RETURN(o.tile, loom::parse_gemm_tile(c.tile));
  o.num_ctas = c.ctas;
  o.group_m = c.group_m;
  o.warmup = g.warmup;
  o.iters = g.iters;
  LOOM_ASSIGN_OR_RETURN(std::vector<loom::bench::GemmBenchRow> rows, loom::bench::run_gemm_bench(o, progress));
  for (const loom::bench::GemmBenchRow& r : rows) {
    loom::bench::Row row;
    row.op = "gemm";
    row.dtype = std::string(loom::dtype_name(r.in_dtype));
    row.m = r.m;
    row.n = r.n;
    row.k = r.k;
    row.rel_err = r.rel_err;
    // Every rank ran the same shapes on its own GPU: report the slowest.
    LOOM_ASSIGN_OR_RETURN(loom::bench::Timing loom_t, loom::bench::max_over_ranks(comm, r.loom));
    LOOM_ASSIGN_OR_RETURN(loom::bench::Timing cublas_t, loom::bench::max_over_ranks(comm, r.cublas));
    row.set_time("loom", loom_t);
    row.set_time("cublas", cublas_t);
    const double flop = 2.0 * static_cast<double>(r.m) * static_cast<double>(r.n) * static_cast<double>(r.k);
    row.extra["config"] = r.config;
    row.extra["b_layout"] = std::string(loom::b_layout_name(r.b_layout));
    row.extra["out_dtype"] = std::string(loom::dtype_name(r.out_dtype));
    row.extra["tflops"] = {{"loom", flop / (loom_t.median_ms * 1e-3) / 1e12},
                           {"cublas", flop / (cublas_t.median_ms * 1e-3) / 1e12}};
    row.extra["rel_err_cublas"] = r.rel_err_cublas;
    row.extra["input_sets"] = r.input_sets;
    report.add(std::move(row));
  }
  return {};
}

loom::Result<loom::bench::TpBenchOptions> tp_options(const std::vector<std::string>& ops, const GlobalOptions& g, const TpCli& c) {
  loom::bench::TpBenchOptions o;
  for (const std::string& op : ops) {
    LOOM_ASSIGN_OR_RETURN(loom::OpId id, loom::planner::parse_tp_op(op));
    o.ops.push_back(id);
  }
  o.m = c.m;
  o.n = c.n;
  o.k = c.k;
  LOOM_ASSIGN_OR_RETURN(o.dtype, loom::parse_dtype(g.dtype));
  LOOM_ASSIGN_OR_RETURN(o.b_layout, loom::parse_b_layout(c.layout));
  LOOM_ASSIGN_OR_RETURN(o.loom.algorithm, loom::planner::parse_tp_algorithm(c.algorithm));
  LOOM_ASSIGN_OR_RETURN(o.loom.tile, loom::parse_gemm_tile(c.tile));
  o.loom.comm_ctas = c.comm_ctas;
  o.loom.tail_pieces = c.tail_pieces;
  if (c.variant_tail_pieces >= -1) {
    o.variant = o.loom;
    o.variant->tail_pieces = c.variant_tail_pieces;
    o.variant_label = "tail_pieces " + std::to_string(c.variant_tail_pieces);
  }
  o.baselines = !c.no_baselines;
  o.timeline_dir = c.timeline_dir;
  o.warmup = g.warmup;
  o.iters = g.iters;
  return o;
}

Status run_tp(loom::Communicator& comm, const std::vector<std::string>& ops, const GlobalOptions& g, const TpCli& c,
              loom::bench::Report& report, loom::bench::Progress& progress) {
  LOOM_ASSIGN_OR_RETURN(loom::bench::TpBenchOptions o, tp_options(ops, g, c));
  LOOM_ASSIGN_OR_RETURN(ncclComm_t nccl, loom::bench::make_nccl_comm(comm));
  Status s = loom::bench::run_tp_bench(comm, nccl, o, report, progress);
  ncclCommDestroy(nccl);
  return s;
}

loom::Result<loom::bench::MultiNodeBenchOptions> multinode_options(const GlobalOptions& g, const TpCli& c) {
  loom::bench::MultiNodeBenchOptions o;
  o.ops.clear();
  for (const std::string& op : c.ops) {
    LOOM_ASSIGN_OR_RETURN(loom::OpId id, loom::planner::parse_tp_op(op));
    o.ops.push_back(id);
  }
  o.m = c.m;
  o.n = c.n;
  o.k = c.k;
  LOOM_ASSIGN_OR_RETURN(o.dtype, loom::parse_dtype(g.dtype));
  LOOM_ASSIGN_OR_RETURN(o.b_layout, loom::parse_b_layout(c.layout));
  LOOM_ASSIGN_OR_RETURN(o.loom.tile, loom::parse_gemm_tile(c.tile));
  o.baselines = !c.no_baselines;
  o.warmup = g.warmup;
  o.iters = g.iters;
  return o;
}

Status run_tune(loom::Communicator& comm, const GlobalOptions& g, const TpCli& c, loom::bench::Report& report,
                loom::bench::Progress& progress) {
  loom::bench::TpTuneOptions t;
  LOOM_ASSIGN_OR_RETURN(t.bench, tp_options(c.ops, g, c));
  t.comm_ctas = c.sweep_ctas;
  t.try_decomposed = !c.no_decomposed;
  t.cache_path = c.cache;
  return loom::bench::run_tp_tune(comm, t, report, progress);
}

loom::Result<loom::bench::MoeBenchOptions> moe_options(const GlobalOptions& g, const MoeCli& c) {
  loom::bench::MoeBenchOptions o;
  o.models.clear();
  for (const std::string& name : c.models) {
    LOOM_ASSIGN_OR_RETURN(loom::bench::MoeModel model, loom::bench::find_moe_model(name));
    o.models.push_back(model);
  }
  o.tokens = c.tokens;
  o.routings.clear();
  for (const std::string& name : c.routings) {
    LOOM_ASSIGN_OR_RETURN(loom::bench::MoeRouting routing, loom::bench::parse_moe_routing(name));
    o.routings.push_back(routing);
  }
  LOOM_ASSIGN_OR_RETURN(o.dtype, loom::parse_dtype(g.dtype));
  LOOM_ASSIGN_OR_RETURN(o.tile, loom::parse_gemm_tile(c.tile));
  o.push_ctas = c.push_ctas;
  o.arrival_ctas = c.arrival_ctas;
  o.warmup = g.warmup;
  o.iters = g.iters;
  return o;
}

int usage_error(const std::string& message) {
  std::fprintf(stderr, "loom-bench: %s\nRun 'loom-bench --help' or 'loom-bench SUBCOMMAND --help' for the options.\n",
               message.c_str());
  return kUsageError;
}

std::string subcommand_names(const CLI::App& app) {
  std::string names;
  for (const CLI::App* sub : app.get_subcommands({})) names += (names.empty() ? "" : ", ") + sub->get_name();
  return names;
}

// CLI11's message, or (with no subcommand given) which word was not a subcommand.
std::string describe_parse_error(const CLI::App& app, const CLI::ParseError& e) {
  if (app.get_subcommands().empty()) {
    for (const std::string& word : app.remaining()) {
      if (!word.empty() && word[0] != '-') {
        return "unknown subcommand '" + word + "' (the subcommands: " + subcommand_names(app) + ")";
      }
    }
    if (dynamic_cast<const CLI::RequiredError*>(&e) != nullptr) {
      std::string unexpected;
      for (const std::string& word : app.remaining()) unexpected += " " + word;
      return "a subcommand is required (one of: " + subcommand_names(app) + ")" +
             (unexpected.empty() ? "" : "; not a global option:" + unexpected);
    }
  }
  return e.what();
}

// What the parser cannot see: combinations of options, and a --json file that could not be written
// at the end of a long run.
Status check_usage(const GlobalOptions& g, bool collectives, bool gemm_or_tp, const std::vector<uint64_t>& sizes) {
  LOOM_ASSIGN_OR_RETURN(loom::DType dtype, loom::parse_dtype(g.dtype));
  if (gemm_or_tp && dtype == loom::DType::kF32) {
    return Status::invalid_argument("--dtype fp32: only the collectives run fp32 (the GEMM, tensor-parallel, "
                                    "multi-node and MoE benches take bf16 or fp16)");
  }
  if (collectives) {
    for (uint64_t b : sizes) {
      if (b % loom::dtype_size(dtype) != 0) {
        return Status::invalid_argument("--sizes " + std::to_string(b) + ": not a multiple of the " + g.dtype +
                                        " element size (" + std::to_string(loom::dtype_size(dtype)) + " bytes)");
      }
    }
  }
  if (!g.json_path.empty()) {
    const size_t slash = g.json_path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : g.json_path.substr(0, slash);
    if (access(dir.c_str(), W_OK) != 0) {
      return Status::invalid_argument("--json " + g.json_path + ": cannot write into " + dir + " (" + std::strerror(errno) +
                                      ")");
    }
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  const auto started = std::chrono::steady_clock::now();
  CLI::App app{"loom-bench: loom's fused multi-GPU operators beside NCCL and cuBLAS"};
  app.formatter(std::make_shared<HelpFormatter>());
  app.option_defaults()->always_capture_default();  // every option's help shows its default
  app.footer(kExamples);
  app.set_version_flag("--version", std::string("loom-bench ") + loom::version(), "print loom's version and exit");
  app.require_subcommand(1);
  app.fallthrough();  // global options may follow the subcommand
  GlobalOptions g;
  app.add_option("--spawn", g.spawn,
                 "start N local ranks (0: one per visible GPU; -1: none, the ranks come from RANK / WORLD_SIZE "
                 "as under torchrun --no-python, loom-run or Slurm-style launchers)")
      ->check(integer_in(-1, 4096));
  app.add_option("--json", g.json_path, "write the results to this JSON file (rank 0)");
  app.add_option("--warmup", g.warmup, "warm-up iterations per measurement")->check(kNonNegative);
  app.add_option("--iters", g.iters, "timed iterations per measurement (median, min and p90 reported)")
      ->check(integer_in(1, 100000));
  app.add_option("--dtype", g.dtype, "element type (fp32: collectives only)")->check(CLI::IsMember({"bf16", "fp16", "fp32"}));

  CollectiveCli coll;
  std::vector<std::pair<CLI::App*, std::vector<std::string>>> collective_commands;
  for (const char* name : {"all_gather", "reduce_scatter", "all_reduce", "collectives"}) {
    CLI::App* sub = app.add_subcommand(name, std::string(name) == "collectives"
                                                 ? "all three NVLink collectives vs NCCL"
                                                 : std::string("loom ") + name + " vs NCCL");
    sub->add_option("--sizes", coll.sizes, "per-rank payloads, e.g. 1M,64M,512M")->delimiter(',')->check(kByteCount);
    sub->add_option("--ctas", coll.ctas, "copy CTAs to try (0: planner), e.g. 0,16,32")
        ->delimiter(',')
        ->check(kNonNegative);
    sub->add_option("--engine", coll.engine, "copy engine for all_gather")->check(CLI::IsMember({"auto", "vector", "bulk"}));
    std::vector<std::string> ops = std::string(name) == "collectives"
                                       ? std::vector<std::string>{"all_gather", "reduce_scatter", "all_reduce"}
                                       : std::vector<std::string>{name};
    collective_commands.emplace_back(sub, ops);
  }
  GemmCli gemm_cli;
  CLI::App* gemm = app.add_subcommand("gemm", "loom::gemm vs cuBLAS on one GPU per rank (same inputs)");
  gemm->add_option("--m", gemm_cli.m, "M values")->delimiter(',')->check(kPositive);
  gemm->add_option("--nk", gemm_cli.nk, "NxK pairs, e.g. 14336x8192,8192x7168")->delimiter(',')->check(kNkPair);
  gemm->add_option("--layout", gemm_cli.layout, "B layout: nk (nn.Linear weight) or kn")->check(CLI::IsMember({"nk", "kn"}));
  gemm->add_option("--out-dtype", gemm_cli.out_dtype, "output type")->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  gemm->add_option("--tile", gemm_cli.tile, "force a tile (auto: planner)")->check(kGemmTile);
  gemm->add_option("--ctas", gemm_cli.ctas, "persistent CTAs (0: planner)")->check(kNonNegative);
  gemm->add_option("--group-m", gemm_cli.group_m, "raster group height in tile rows (0: planner)")
      ->check(kNonNegative);
  // The shape options every tensor-parallel subcommand takes.
  auto add_tp_shape_options = [&](CLI::App* sub, TpCli& cli) {
    sub->add_option("--m", cli.m, "M values (global rows)")->delimiter(',')->check(kPositive);
    sub->add_option("--n", cli.n, "N of each rank's B (0: 14336 for ag_gemm, 8192 otherwise)")->check(kNonNegative);
    sub->add_option("--k", cli.k,
                    "K (0: 8192 for ag_gemm; gemm_rs / gemm_ar: 14336, the global K split over the ranks)")
        ->check(kNonNegative);
    sub->add_option("--layout", cli.layout, "B layout: nk (nn.Linear weight) or kn")
        ->check(CLI::IsMember({"nk", "kn"}));
  };
  TpCli tp_cli;
  std::vector<std::pair<CLI::App*, std::vector<std::string>>> tp_commands;
  for (const char* name : {"ag_gemm", "gemm_rs", "gemm_ar", "tp"}) {
    const bool all_three = std::string(name) == "tp";
    CLI::App* sub = app.add_subcommand(
        name, all_three ? "ag_gemm, gemm_rs and gemm_ar vs cuBLAS alone and NCCL + cuBLAS"
                        : std::string("loom ") + name + " vs cuBLAS alone, NCCL alone and NCCL + cuBLAS in sequence");
    add_tp_shape_options(sub, tp_cli);
    sub->add_option("--algorithm", tp_cli.algorithm, "force auto, fused or decomposed")
        ->check(CLI::IsMember({"auto", "fused", "decomposed"}));
    sub->add_option("--comm-ctas", tp_cli.comm_ctas, "force the communication CTAs (-1: planner)")
        ->check(integer_in(-1, 1 << 20));
    sub->add_option("--tile", tp_cli.tile, "force the compute tile (auto: planner)")->check(kGemmTile);
    sub->add_option("--tail-pieces", tp_cli.tail_pieces,
                    "fused kernels: K pieces per tile of the last partial wave (-1: planner, 1: none)")
        ->check(integer_in(-1, 1 << 20));
    sub->add_option("--variant-tail-pieces", tp_cli.variant_tail_pieces,
                    "also time loom with this --tail-pieces in the same alternating rounds (ms key loom_variant; "
                    "-2: no variant)")
        ->check(integer_in(-2, 1 << 20));
    sub->add_flag("--no-baselines", tp_cli.no_baselines, "time loom only");
    sub->add_option("--timeline", tp_cli.timeline_dir,
                    "write per-tile timelines of loom (fused) and loom's GEMM alone into this folder "
                    "(timeline_<op>_<M>_<what>_rank<r>.csv; summarise with bench/timeline_summary.py)");
    tp_commands.emplace_back(sub, all_three ? std::vector<std::string>{"ag_gemm", "gemm_rs", "gemm_ar"}
                                            : std::vector<std::string>{name});
  }
  const auto tp_op_names = CLI::IsMember({"ag_gemm", "gemm_rs", "gemm_ar"});
  CLI::App* tune = app.add_subcommand("tune", "sweep comm CTAs and the algorithm per shape; write the tuning cache");
  tune->add_option("--cache", tp_cli.cache, "tuning cache to write (merged if it exists); use it with LOOM_TUNING_CACHE")
      ->required();
  tune->add_option("--ops", tp_cli.ops, "operators, e.g. ag_gemm,gemm_rs,gemm_ar")->delimiter(',')->check(tp_op_names);
  add_tp_shape_options(tune, tp_cli);
  tune->add_option("--tile", tp_cli.tile, "force the compute tile for every candidate (auto: each fused tile)")
      ->check(kGemmTile);
  tune->add_option("--comm-ctas", tp_cli.sweep_ctas, "comm CTA counts to try (fused)")
      ->delimiter(',')
      ->check(kPositive);
  tune->add_flag("--no-decomposed", tp_cli.no_decomposed, "do not try the decomposed algorithm");
  TpCli mn_cli;
  CLI::App* multinode = app.add_subcommand(
      "multinode", "ag_gemm, gemm_rs, gemm_ar across (real or LOOM_EMULATE_NODES) nodes vs the GEMM then the transfer");
  multinode->add_option("--ops", mn_cli.ops, "operators, e.g. ag_gemm,gemm_rs,gemm_ar")->delimiter(',')->check(tp_op_names);
  add_tp_shape_options(multinode, mn_cli);
  multinode->add_option("--tile", mn_cli.tile, "force the compute tile: 128x256 or 128x128 (auto: planner)")->check(kGemmTile);
  multinode->add_flag("--no-baselines", mn_cli.no_baselines, "time loom only");
  MoeCli moe_cli;
  CLI::App* moe = app.add_subcommand("moe",
                                     "moe_dispatch_gemm (fused dispatch + fc1) vs its grouped GEMM alone and "
                                     "moe_dispatch then the grouped GEMM");
  moe->add_option("--models", moe_cli.models, "model slices, e.g. deepseek-v3,qwen3-235b,mixtral")
      ->delimiter(',')
      ->check(kMoeModel);
  moe->add_option("--tokens", moe_cli.tokens, "tokens per GPU")->delimiter(',')->check(kPositive);
  moe->add_option("--routing", moe_cli.routings, "uniform, skewed or both")
      ->delimiter(',')
      ->check(CLI::IsMember({"uniform", "skewed"}));
  moe->add_option("--tile", moe_cli.tile, "the tile of the fused kernel and of the grouped GEMM alone")
      ->check(CLI::IsMember({"128x256", "128x128"}));
  moe->add_option("--push-ctas", moe_cli.push_ctas, "fused kernel: CTAs that push rows first (0: planner)")
      ->check(kNonNegative);
  moe->add_option("--arrival-ctas", moe_cli.arrival_ctas,
                  "fused kernel: CTAs that complete receive blocks first (0: planner)")
      ->check(kNonNegative);
  CLI::App* all = app.add_subcommand("all", "the main job: every implemented operator at its headline sizes");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    return usage_error(describe_parse_error(app, e));
  }

  bool collectives_parsed = all->parsed();
  for (auto& [sub, ops] : collective_commands) collectives_parsed = collectives_parsed || sub->parsed();
  bool tp_parsed = all->parsed() || tune->parsed();
  for (auto& [sub, ops] : tp_commands) tp_parsed = tp_parsed || sub->parsed();
  std::vector<uint64_t> sizes;
  if (Status s = parse_sizes(coll.sizes, sizes); !s.ok()) return usage_error(s.message());
  const bool bf16_or_fp16_only = gemm->parsed() || tp_parsed || multinode->parsed() || moe->parsed();
  if (Status s = check_usage(g, collectives_parsed, bf16_or_fp16_only, sizes); !s.ok()) {
    return usage_error(s.message());
  }
  std::optional<loom::bench::MoeBenchOptions> moe_bench;
  if (moe->parsed()) {
    loom::Result<loom::bench::MoeBenchOptions> o = moe_options(g, moe_cli);
    if (!o.ok()) return usage_error(o.status().message());
    moe_bench = *o;
  }

  const int gpus = visible_gpus();
  if (gpus == 0) {
    std::fprintf(stderr,
                 "loom-bench: no CUDA GPU is visible on this machine. loom runs its kernels on NVIDIA Hopper GPUs "
                 "(sm_90a); run loom-bench where they are (the CPU test suite runs anywhere: scripts/test.sh).\n");
    return 1;
  }
  // Ranks sharing a GPU take turns on it, and NCCL refuses them: nothing measured there means anything.
  if (loom::Result<int64_t> per_gpu = loom::env::get_int("LOOM_RANKS_PER_GPU", 1, 1, loom::env::kMaxRanksPerGpu);
      !per_gpu.ok() || *per_gpu > 1) {
    std::fprintf(stderr, "loom-bench: %s\n",
                 per_gpu.ok() ? "LOOM_RANKS_PER_GPU > 1 is the shared-GPU mode, a correctness mode: ranks take turns on "
                                "one GPU and NCCL refuses them, so loom-bench times nothing there (run the tests in it: "
                                "loom-run --ranks-per-gpu N -n N -- loom_gpu_tests)"
                              : per_gpu.status().to_string().c_str());
    return kUsageError;
  }
  if (g.spawn >= 0 && std::getenv("RANK") == nullptr) {
    return loom::bench::spawn_self(argc, argv, g.spawn == 0 ? gpus : g.spawn);
  }

  // The symmetric heap must hold the largest case: world x payload (all_gather recv,
  // reduce_scatter send) or 2 x payload (all_reduce send + recv).
  uint64_t largest = 0;
  for (uint64_t b : sizes) largest = std::max(largest, b);
  const char* world_env = std::getenv("WORLD_SIZE");
  const uint64_t world = std::max<uint64_t>(2, world_env ? std::strtoull(world_env, nullptr, 10) : 1);
  loom::CommOptions comm_options;
  comm_options.heap_bytes = std::max<uint64_t>(uint64_t{1} << 30, world * largest + (uint64_t{256} << 20));
  if (tp_parsed) {
    // gemm_ar's symmetric output and the fused operators' workspaces for the largest shape.
    loom::Result<loom::bench::TpBenchOptions> tp = tp_options({"ag_gemm", "gemm_rs", "gemm_ar"}, g, tp_cli);
    if (tp.ok()) comm_options.heap_bytes = std::max(comm_options.heap_bytes, loom::bench::tp_heap_bytes(*tp, static_cast<int>(world)));
  }
  if (multinode->parsed()) {
    loom::Result<loom::bench::MultiNodeBenchOptions> mn = multinode_options(g, mn_cli);
    // Nodes: the emulated count, else one per LOCAL_WORLD_SIZE ranks (the transfer's receive
    // area grows with them).
    int nodes = 2;
    if (const char* e = std::getenv("LOOM_EMULATE_NODES")) nodes = std::max(2, std::atoi(e));
    else if (const char* l = std::getenv("LOCAL_WORLD_SIZE")) nodes = std::max(2, static_cast<int>(world) / std::max(1, std::atoi(l)));
    if (mn.ok()) {
      comm_options.heap_bytes = std::max(comm_options.heap_bytes, loom::bench::multinode_heap_bytes(*mn, static_cast<int>(world), nodes));
    }
  }
  if (moe_bench) {
    const uint64_t moe_heap = loom::bench::moe_heap_bytes(*moe_bench, static_cast<int>(world));
    comm_options.heap_bytes = std::max(comm_options.heap_bytes, moe_heap);
  }
  loom::Result<std::unique_ptr<loom::Communicator>> comm_or = loom::Communicator::from_env(comm_options);
  if (!comm_or.ok()) {
    std::fprintf(stderr, "loom-bench: %s\n", comm_or.status().to_string().c_str());
    return 1;
  }
  loom::Communicator& comm = **comm_or;

  // Shapes to run, for the progress lines.
  const int collective_cases = static_cast<int>(coll.sizes.size() * coll.ctas.size());
  const int gemm_cases = static_cast<int>(gemm_cli.nk.size() * gemm_cli.m.size());
  int total = 0;
  for (auto& [sub, ops] : collective_commands) total += sub->parsed() ? static_cast<int>(ops.size()) * collective_cases : 0;
  if (gemm->parsed()) total += gemm_cases;
  for (auto& [sub, ops] : tp_commands) total += sub->parsed() ? static_cast<int>(ops.size() * tp_cli.m.size()) : 0;
  if (tune->parsed()) total += static_cast<int>(tp_cli.ops.size() * tp_cli.m.size());
  if (multinode->parsed()) total += static_cast<int>(mn_cli.ops.size() * mn_cli.m.size());
  if (moe_bench) total += static_cast<int>(loom::bench::moe_shapes(*moe_bench, comm.world_size()).size());
  if (all->parsed()) total += 3 * collective_cases + gemm_cases + static_cast<int>(3 * tp_cli.m.size());
  loom::bench::Progress progress(total, comm.rank() == 0, started);

  loom::bench::Report report;
  Status status;
  for (auto& [sub, ops] : collective_commands) {
    if (sub->parsed()) status = run_collectives(comm, ops, g, coll, report, progress);
  }
  if (gemm->parsed()) status = run_gemm(comm, g, gemm_cli, report, progress);
  for (auto& [sub, ops] : tp_commands) {
    if (sub->parsed()) status = run_tp(comm, ops, g, tp_cli, report, progress);
  }
  if (tune->parsed()) status = run_tune(comm, g, tp_cli, report, progress);
  if (multinode->parsed()) {
    loom::Result<loom::bench::MultiNodeBenchOptions> mn = multinode_options(g, mn_cli);
    status = mn.ok() ? loom::bench::run_multinode_bench(comm, *mn, report, progress) : mn.status();
  }
  if (moe_bench) status = loom::bench::run_moe_bench(comm, *moe_bench, report, progress);
  if (all->parsed()) {
    status = run_collectives(comm, {"all_gather", "reduce_scatter", "all_reduce"}, g, coll, report, progress);
    Status s = run_gemm(comm, g, gemm_cli, report, progress);
    if (status.ok()) status = s;
    if (comm.health().ok()) {
      s = run_tp(comm, {"ag_gemm", "gemm_rs", "gemm_ar"}, g, tp_cli, report, progress);
      if (status.ok()) status = s;
    }
  }

  if (comm.rank() == 0) {
    loom::bench::RunInfo info;
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, comm.device());
    info.gpu = prop.name;
    info.world = comm.world_size();
    info.nodes = comm.num_nodes();
    const auto& net = internal(comm).net_settings;
    info.emulated_nodes = net.emulate_nodes > 1 ? net.emulate_nodes : 0;
    if (comm.num_nodes() > 1 && net.emulate_net_gbps > 0) info.net_gbps = net.emulate_net_gbps;
    info.environment = loom::bench::run_environment(comm.device(), argc, argv);
    if (!g.json_path.empty()) {
      Status w = report.write_json(g.json_path, info);
      if (!w.ok()) std::fprintf(stderr, "loom-bench: %s\n", w.to_string().c_str());
    }
    report.print_table(stdout);
    loom::bench::print_tp_table(report, stdout);  // the fused operators' times, h and plans: last
    loom::bench::print_multinode_table(report, stdout);
    loom::bench::print_moe_table(report, stdout);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "loom-bench: rank %d: %s\n", comm.rank(), status.to_string().c_str());
    return 1;
  }
  return 0;
}
