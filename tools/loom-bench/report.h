// Benchmark results: rows, the JSON file (schema in docs/BENCHMARKS.md) and the closing table.
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/status.h"

namespace loom::bench {

struct Row {
  std::string op;
  std::string dtype;
  std::optional<long long> m, n, k;
  std::optional<long long> bytes;   // per-rank payload of a pure collective
  std::optional<double> rel_err;    // ||out - ref|| / ||ref|| (0 for bit-exact checks that passed)
  std::map<std::string, double> ms;  // "loom", "cublas", "nccl", "nccl_cublas", "torch_fused", ...
  nlohmann::json extra = nlohmann::json::object();  // op-specific fields (busbw, ctas, config)
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
};

class Report {
 public:
  void add(Row row) { rows_.push_back(std::move(row)); }
  const std::vector<Row>& rows() const { return rows_; }
  nlohmann::json to_json(const RunInfo& info) const;
  Status write_json(const std::string& path, const RunInfo& info) const;
  // A fixed-width table with one line per row; ratio columns where both sides exist.
  void print_table(std::FILE* out) const;

 private:
  std::vector<Row> rows_;
};

const char* git_sha();  // compiled in at configure time ("-dirty" if the tree had changes)
std::string utc_now_iso8601();

}  // namespace loom::bench
