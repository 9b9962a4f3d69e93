// loom-bench: runs loom's operators beside their baselines (NCCL, cuBLAS) in one process group
// and reports medians (max over ranks), JSON and a table printed last.
//
//   loom-bench all --spawn 2 --json bench/results/run.json     the main job
//   loom-bench all_reduce --sizes 64M,512M --spawn 2
//   loom-bench tp --spawn 2 --json tp.json                     ag_gemm, gemm_rs, gemm_ar vs NCCL + cuBLAS
//   loom-bench gemm_rs --m 4096 --comm-ctas 8 --spawn 2
//   loom-bench tune --cache tuning.json --spawn 2               writes the tuning cache (LOOM_TUNING_CACHE)
//   LOOM_EMULATE_NODES=2 LOOM_EMULATE_NET_GBPS=50 loom-bench multinode --spawn 2   across (emulated) nodes
//   LOOM_SECRET=$(openssl rand -hex 16) torchrun --no-python --nproc-per-node 8 loom-bench collectives
//                                                               (ranks from the environment)
#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "collectives_bench.h"
#include "gemm_bench.h"
#include "core/env.h"
#include "launch.h"
#include "loom/loom.h"
#include "multinode_bench.h"
#include "planner/tp_plan.h"
#include "report.h"
#include "runtime/communicator_impl.h"
#include "tp_bench.h"

namespace {

using loom::Status;

struct GlobalOptions {
  int spawn = -1;  // -1: ranks come from the environment; 0: one per visible GPU
  std::string json_path;
  int warmup = 5;
  int iters = 30;
  std::string dtype = "bf16";
};

struct GemmCli {
  // Issue 3's shapes: the large M sweep and the small-M sweep over four (N, K) pairs.
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
  // Issue 4's shapes: ag_gemm (M, 14336, 8192); gemm_rs / gemm_ar (M, 8192, 14336), K split over ranks.
  std::vector<int64_t> m = {1024, 2048, 4096, 8192, 16384, 32768};
  int64_t n = 0;  // 0: the N for the op
  int64_t k = 0;  // 0: the K (global K for gemm_rs / gemm_ar)
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

int visible_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

Status parse_sizes(const std::vector<std::string>& text, std::vector<uint64_t>& out) {
  for (const std::string& s : text) {
    LOOM_ASSIGN_OR_RETURN(uint64_t b, loom::env::parse_bytes("--sizes", s, 1, uint64_t{1} << 40));
    out.push_back(b);
  }
  return {};
}

Status run_collectives(loom::Communicator& comm, const std::vector<std::string>& ops, const GlobalOptions& g,
                       const CollectiveCli& c, loom::bench::Report& report) {
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
  Status s = loom::bench::run_collective_bench(comm, nccl, o, report);
  ncclCommDestroy(nccl);
  return s;
}

Status run_gemm(loom::Communicator* comm, const GlobalOptions& g, const GemmCli& c, loom::bench::Report& report) {
  loom::bench::GemmBenchOptions o;
  for (const std::string& pair : c.nk) {
    const size_t x = pair.find('x');
    if (x == std::string::npos) return Status::invalid_argument("--nk expects NxK pairs, got '" + pair + "'");
    LOOM_ASSIGN_OR_RETURN(int64_t n, loom::env::parse_int("--nk", pair.substr(0, x), 1, int64_t{1} << 31));
    LOOM_ASSIGN_OR_RETURN(int64_t k, loom::env::parse_int("--nk", pair.substr(x + 1), 1, int64_t{1} << 31));
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
  LOOM_ASSIGN_OR_RETURN(std::vector<loom::bench::GemmBenchRow> rows, loom::bench::run_gemm_bench(o));
  for (const loom::bench::GemmBenchRow& r : rows) {
    loom::bench::Row row;
    row.op = "gemm";
    row.dtype = std::string(loom::dtype_name(r.in_dtype));
    row.m = r.m;
    row.n = r.n;
    row.k = r.k;
    row.rel_err = r.rel_err;
    double loom_ms = r.ms_loom, cublas_ms = r.ms_cublas;
    if (comm != nullptr) {  // every rank ran the same shapes on its own GPU: report the slowest
      LOOM_ASSIGN_OR_RETURN(loom_ms, loom::bench::max_over_ranks(*comm, loom_ms));
      LOOM_ASSIGN_OR_RETURN(cublas_ms, loom::bench::max_over_ranks(*comm, cublas_ms));
    }
    row.ms["loom"] = loom_ms;
    row.ms["cublas"] = cublas_ms;
    row.extra["config"] = r.config;
    row.extra["b_layout"] = std::string(loom::b_layout_name(r.b_layout));
    row.extra["out_dtype"] = std::string(loom::dtype_name(r.out_dtype));
    row.extra["tflops"] = {{"loom", r.tflops_loom}, {"cublas", r.tflops_cublas}};
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
              loom::bench::Report& report) {
  LOOM_ASSIGN_OR_RETURN(loom::bench::TpBenchOptions o, tp_options(ops, g, c));
  LOOM_ASSIGN_OR_RETURN(ncclComm_t nccl, loom::bench::make_nccl_comm(comm));
  Status s = loom::bench::run_tp_bench(comm, nccl, o, report);
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

Status run_tune(loom::Communicator& comm, const GlobalOptions& g, const TpCli& c, loom::bench::Report& report) {
  loom::bench::TpTuneOptions t;
  LOOM_ASSIGN_OR_RETURN(t.bench, tp_options(c.ops, g, c));
  t.comm_ctas = c.sweep_ctas;
  t.try_decomposed = !c.no_decomposed;
  t.cache_path = c.cache;
  return loom::bench::run_tp_tune(comm, t, report);
}

}  // namespace

int main(int argc, char** argv) {
  // NVLink multicast stays off for every library in this process (see DESIGN.md).
  setenv("NCCL_NVLS_ENABLE", "0", 1);

  CLI::App app{"loom-bench: loom's fused multi-GPU operators beside NCCL and cuBLAS"};
  app.require_subcommand(1);
  app.fallthrough();  // global options may follow the subcommand
  GlobalOptions g;
  app.add_option("--spawn", g.spawn, "start N local ranks (0: one per visible GPU); default: ranks from RANK/WORLD_SIZE");
  app.add_option("--json", g.json_path, "write the results to this JSON file (rank 0)");
  app.add_option("--warmup", g.warmup, "warm-up iterations per measurement")->check(CLI::NonNegativeNumber);
  app.add_option("--iters", g.iters, "timed iterations per measurement (median reported)")->check(CLI::Range(1, 100000));
  app.add_option("--dtype", g.dtype, "bf16, fp16 or fp32")->check(CLI::IsMember({"bf16", "fp16", "fp32"}));

  CollectiveCli coll;
  std::vector<std::pair<CLI::App*, std::vector<std::string>>> collective_commands;
  for (const char* name : {"all_gather", "reduce_scatter", "all_reduce", "collectives"}) {
    CLI::App* sub = app.add_subcommand(name, std::string(name) == "collectives"
                                                 ? "all three NVLink collectives vs NCCL"
                                                 : std::string("loom ") + name + " vs NCCL");
    sub->add_option("--sizes", coll.sizes, "per-rank payloads, e.g. 1M,64M,512M")->delimiter(',');
    sub->add_option("--ctas", coll.ctas, "copy CTAs to try (0: planner), e.g. 0,16,32")->delimiter(',');
    sub->add_option("--engine", coll.engine, "copy engine for all_gather")->check(CLI::IsMember({"auto", "vector", "bulk"}));
    std::vector<std::string> ops = std::string(name) == "collectives"
                                       ? std::vector<std::string>{"all_gather", "reduce_scatter", "all_reduce"}
                                       : std::vector<std::string>{name};
    collective_commands.emplace_back(sub, ops);
  }
  GemmCli gemm_cli;
  CLI::App* gemm = app.add_subcommand("gemm", "loom::gemm vs cuBLAS on one GPU per rank (same inputs)");
  gemm->add_option("--m", gemm_cli.m, "M values")->delimiter(',');
  gemm->add_option("--nk", gemm_cli.nk, "NxK pairs, e.g. 14336x8192,8192x7168")->delimiter(',');
  gemm->add_option("--layout", gemm_cli.layout, "B layout: nk (nn.Linear weight) or kn")->check(CLI::IsMember({"nk", "kn"}));
  gemm->add_option("--out-dtype", gemm_cli.out_dtype, "output type")->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  gemm->add_option("--tile", gemm_cli.tile, "force a tile: 128x256, 128x128, 128x64, 64x128");
  gemm->add_option("--ctas", gemm_cli.ctas, "persistent CTAs (0: planner)");
  gemm->add_option("--group-m", gemm_cli.group_m, "raster group height in tile rows (0: planner)")
      ->check(CLI::NonNegativeNumber);
  TpCli tp_cli;
  std::vector<std::pair<CLI::App*, std::vector<std::string>>> tp_commands;
  for (const char* name : {"ag_gemm", "gemm_rs", "gemm_ar", "tp"}) {
    const bool all_three = std::string(name) == "tp";
    CLI::App* sub = app.add_subcommand(
        name, all_three ? "ag_gemm, gemm_rs and gemm_ar vs cuBLAS alone and NCCL + cuBLAS"
                        : std::string("loom ") + name + " vs cuBLAS alone, NCCL alone and NCCL + cuBLAS in sequence");
    sub->add_option("--m", tp_cli.m, "M values (global rows)")->delimiter(',');
    sub->add_option("--n", tp_cli.n, "N of each rank's B (default: the issue's, 14336 for ag_gemm, 8192 otherwise)");
    sub->add_option("--k", tp_cli.k, "K (gemm_rs / gemm_ar: the global K, split over the ranks; default 8192 / 14336)");
    sub->add_option("--layout", tp_cli.layout, "B layout: nk (nn.Linear weight) or kn")->check(CLI::IsMember({"nk", "kn"}));
    sub->add_option("--algorithm", tp_cli.algorithm, "force auto, fused or decomposed")
        ->check(CLI::IsMember({"auto", "fused", "decomposed"}));
    sub->add_option("--comm-ctas", tp_cli.comm_ctas, "force the communication CTAs (-1: planner)");
    sub->add_option("--tile", tp_cli.tile, "force the compute tile: 128x256, 128x128, 128x64, 64x128");
    sub->add_option("--tail-pieces", tp_cli.tail_pieces,
                    "fused kernels: K pieces per tile of the last partial wave (-1: planner, 1: none)");
    sub->add_option("--variant-tail-pieces", tp_cli.variant_tail_pieces,
                    "also time loom with this --tail-pieces in the same alternating rounds (ms key loom_variant)");
    sub->add_flag("--no-baselines", tp_cli.no_baselines, "time loom only");
    sub->add_option("--timeline", tp_cli.timeline_dir,
                    "write per-tile timelines of loom (fused) and loom's GEMM alone into this folder "
                    "(timeline_<op>_<M>_<what>_rank<r>.csv; summarise with bench/timeline_summary.py)");
    tp_commands.emplace_back(sub, all_three ? std::vector<std::string>{"ag_gemm", "gemm_rs", "gemm_ar"}
                                            : std::vector<std::string>{name});
  }
  CLI::App* tune = app.add_subcommand("tune", "sweep comm CTAs and the algorithm per shape; write the tuning cache");
  tune->add_option("--cache", tp_cli.cache, "tuning cache to write (merged if it exists); use it with LOOM_TUNING_CACHE")
      ->required();
  tune->add_option("--ops", tp_cli.ops, "operators, e.g. ag_gemm,gemm_rs,gemm_ar")->delimiter(',');
  tune->add_option("--m", tp_cli.m, "M values (global rows)")->delimiter(',');
  tune->add_option("--n", tp_cli.n, "N of each rank's B (default: the issue's)");
  tune->add_option("--k", tp_cli.k, "K (gemm_rs / gemm_ar: the global K)");
  tune->add_option("--layout", tp_cli.layout, "B layout: nk or kn")->check(CLI::IsMember({"nk", "kn"}));
  tune->add_option("--tile", tp_cli.tile, "force the compute tile for every candidate");
  tune->add_option("--comm-ctas", tp_cli.sweep_ctas, "comm CTA counts to try (fused)")->delimiter(',');
  tune->add_flag("--no-decomposed", tp_cli.no_decomposed, "do not try the decomposed algorithm");
  TpCli mn_cli;
  CLI::App* multinode = app.add_subcommand(
      "multinode", "ag_gemm, gemm_rs, gemm_ar across (real or LOOM_EMULATE_NODES) nodes vs the GEMM then the transfer");
  multinode->add_option("--ops", mn_cli.ops, "operators, e.g. ag_gemm,gemm_rs,gemm_ar")->delimiter(',');
  multinode->add_option("--m", mn_cli.m, "M values (global rows)")->delimiter(',');
  multinode->add_option("--n", mn_cli.n, "N of each rank's B (default: the issue's, 14336 for ag_gemm, 8192 otherwise)");
  multinode->add_option("--k", mn_cli.k, "K (gemm_rs / gemm_ar: the global K, split over the ranks)");
  multinode->add_option("--layout", mn_cli.layout, "B layout: nk or kn")->check(CLI::IsMember({"nk", "kn"}));
  multinode->add_option("--tile", mn_cli.tile, "force the compute tile: 128x256 or 128x128");
  multinode->add_flag("--no-baselines", mn_cli.no_baselines, "time loom only");
  CLI::App* all = app.add_subcommand("all", "the main job: every implemented operator at its headline sizes");
  CLI11_PARSE(app, argc, argv);

  const int gpus = visible_gpus();
  if (gpus == 0) {
    std::fprintf(stderr,
                 "loom-bench: no CUDA GPU is visible on this machine. loom runs its kernels on NVIDIA Hopper GPUs "
                 "(sm_90a); run loom-bench where they are (the CPU test suite runs anywhere: scripts/test.sh).\n");
    return 2;
  }
  // Ranks sharing a GPU take turns on it, and NCCL refuses them: nothing measured there means anything.
  if (loom::Result<int64_t> per_gpu = loom::env::get_int("LOOM_RANKS_PER_GPU", 1, 1, loom::env::kMaxRanksPerGpu);
      !per_gpu.ok() || *per_gpu > 1) {
    std::fprintf(stderr, "loom-bench: %s\n",
                 per_gpu.ok() ? "LOOM_RANKS_PER_GPU > 1 is the shared-GPU mode, a correctness mode: ranks take turns on "
                                "one GPU and NCCL refuses them, so loom-bench times nothing there (run the tests in it: "
                                "loom-run --ranks-per-gpu N -n N -- loom_gpu_tests)"
                              : per_gpu.status().to_string().c_str());
    return 2;
  }
  if (g.spawn >= 0 && std::getenv("RANK") == nullptr) {
    return loom::bench::spawn_self(argc, argv, g.spawn == 0 ? gpus : g.spawn);
  }

  // The symmetric heap must hold the largest case: world x payload (all_gather recv,
  // reduce_scatter send) or 2 x payload (all_reduce send + recv).
  std::vector<uint64_t> sizes;
  if (Status s = parse_sizes(coll.sizes, sizes); !s.ok()) {
    std::fprintf(stderr, "loom-bench: %s\n", s.to_string().c_str());
    return 1;
  }
  uint64_t largest = 0;
  for (uint64_t b : sizes) largest = std::max(largest, b);
  const char* world_env = std::getenv("WORLD_SIZE");
  const uint64_t world = std::max<uint64_t>(2, world_env ? std::strtoull(world_env, nullptr, 10) : 1);
  loom::CommOptions comm_options;
  comm_options.heap_bytes = std::max<uint64_t>(uint64_t{1} << 30, world * largest + (uint64_t{256} << 20));
  bool tp_parsed = all->parsed() || tune->parsed();
  for (auto& [sub, ops] : tp_commands) tp_parsed = tp_parsed || sub->parsed();
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
  loom::Result<std::unique_ptr<loom::Communicator>> comm_or = loom::Communicator::from_env(comm_options);
  if (!comm_or.ok()) {
    std::fprintf(stderr, "loom-bench: %s\n", comm_or.status().to_string().c_str());
    return 1;
  }
  loom::Communicator& comm = **comm_or;
  loom::bench::Report report;
  Status status;
  for (auto& [sub, ops] : collective_commands) {
    if (sub->parsed()) status = run_collectives(comm, ops, g, coll, report);
  }
  if (gemm->parsed()) status = run_gemm(&comm, g, gemm_cli, report);
  for (auto& [sub, ops] : tp_commands) {
    if (sub->parsed()) status = run_tp(comm, ops, g, tp_cli, report);
  }
  if (tune->parsed()) status = run_tune(comm, g, tp_cli, report);
  if (multinode->parsed()) {
    loom::Result<loom::bench::MultiNodeBenchOptions> mn = multinode_options(g, mn_cli);
    status = mn.ok() ? loom::bench::run_multinode_bench(comm, *mn, report) : mn.status();
  }
  if (all->parsed()) {
    status = run_collectives(comm, {"all_gather", "reduce_scatter", "all_reduce"}, g, coll, report);
    Status s = run_gemm(&comm, g, gemm_cli, report);
    if (status.ok()) status = s;
    if (comm.health().ok()) {
      s = run_tp(comm, {"ag_gemm", "gemm_rs", "gemm_ar"}, g, tp_cli, report);
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
    if (!g.json_path.empty()) {
      Status w = report.write_json(g.json_path, info);
      if (!w.ok()) std::fprintf(stderr, "loom-bench: %s\n", w.to_string().c_str());
    }
    report.print_table(stdout);
    loom::bench::print_tp_table(report, stdout);  // the fused operators' times, h and plans: last
    loom::bench::print_multinode_table(report, stdout);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "loom-bench: rank %d: %s\n", comm.rank(), status.to_string().c_str());
    return 1;
  }
  return 0;
}
