// Benchmark results: rows, the JSON file (schema in docs/BENCHMARKS.md) and the closing table.
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/status.h"
#include "timing.h"

namespace loom::bench {

struct Row {
  std::string op;
  std::string dtype;
  std::optional<long long> m, n, k;
  std::optional<long long> bytes;   // per-rank payload of a pure collective
  std::optional<double> rel_err;    // ||out - ref|| / ||ref|| (0 for bit-exact checks that passed)
  // Per timed column ("loom", "cublas", "nccl", "nccl_cublas", "copy", ...): the median, the
  // fastest and the 90th-percentile sample, each the maximum over the ranks.
  std::map<std::string, double> ms;
  std::map<std::string, double> ms_min;
  std::map<std::string, double> ms_p90;
  // op-specific fields (busbw, ctas, config); "note" says why a row shows no speedup (world 1)
  nlohmann::json extra = nlohmann::json::object();

  // Records `t` (already the maximum over the ranks) as column `key`.
  void set_time(const std::string& key, const Timing& t) {
    ms[key] = t.median_ms;
    ms_min[key] = t.min_ms;
    ms_p90[key] = t.p90_ms;
  }
};

// r.ms[key] when it was measured (a positive time), else nullopt.
std::optional<double> measured_ms(const Row& r, const char* key);
// (base - t) / (base - floor) over r.ms keys: the share of the gap between `base` and `floor` that
// `t` removes (the benches' hidden fraction h); nullopt unless all three were measured and
// base > floor.
std::optional<double> hidden_share(const Row& r, const char* t, const char* base, const char* floor);

struct RunInfo {
  std::string gpu;
  int world = 1;
  int nodes = 1;
  int emulated_nodes = 0;
  std::optional<double> net_gbps;
  nlohmann::json environment = nlohmann::json::object();  // run_environment(): merged into the top level
};

// What a run was measured with, as JSON fields: loom_version, versions (CUDA runtime and driver,
// NVIDIA kernel driver, NCCL, cuBLAS), gpu_peak_clocks_mhz (SM, memory) of `device`, command
// (`argv`) and env (every LOOM_* and NCCL_* variable; LOOM_SECRET's value is not written).
nlohmann::json run_environment(int device, int argc, char** argv);

class Report {
 public:
  void add(Row row) { rows_.push_back(std::move(row)); }
  const std::vector<Row>& rows() const { return rows_; }
  nlohmann::json to_json(const RunInfo& info) const;
  Status write_json(const std::string& path, const RunInfo& info) const;
  // A fixed-width table with one line per row (but moe_dispatch_gemm's: print_moe_table); ratio
  // columns where both sides exist.
  void print_table(std::FILE* out) const;

 private:
  std::vector<Row> rows_;
};

const char* git_sha();  // compiled in at configure time ("-dirty" if the tree had changes)
std::string utc_now_iso8601();

}  // namespace loom::bench
