#include "report.h"

#include <cstdio>
#include <ctime>
#include <fstream>

namespace loom::bench {

#ifndef LOOM_GIT_SHA
#define LOOM_GIT_SHA "unknown"
#endif

const char* git_sha() { return LOOM_GIT_SHA; }

std::string utc_now_iso8601() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

nlohmann::json Report::to_json(const RunInfo& info) const {
  nlohmann::json j;
  j["git_sha"] = git_sha();
  j["date"] = utc_now_iso8601();
  j["gpu"] = info.gpu;
  j["world"] = info.world;
  j["nodes"] = info.nodes;
  j["emulated_nodes"] = info.emulated_nodes;
  j["net_gbps"] = info.net_gbps ? nlohmann::json(*info.net_gbps) : nlohmann::json(nullptr);
  nlohmann::json rows = nlohmann::json::array();
  for (const Row& r : rows_) {
    nlohmann::json row;
    row["op"] = r.op;
    row["dtype"] = r.dtype;
    row["M"] = r.m ? nlohmann::json(*r.m) : nlohmann::json(nullptr);
    row["N"] = r.n ? nlohmann::json(*r.n) : nlohmann::json(nullptr);
    row["K"] = r.k ? nlohmann::json(*r.k) : nlohmann::json(nullptr);
    row["bytes"] = r.bytes ? nlohmann::json(*r.bytes) : nlohmann::json(nullptr);
    row["rel_err"] = r.rel_err ? nlohmann::json(*r.rel_err) : nlohmann::json(nullptr);
    row["ms"] = r.ms;
    for (auto it = r.extra.begin(); it != r.extra.end(); ++it) row[it.key()] = it.value();
    rows.push_back(std::move(row));
  }
  j["rows"] = std::move(rows);
  return j;
}

Status Report::write_json(const std::string& path, const RunInfo& info) const {
  std::ofstream f(path);
  if (!f) return Status::system_error("cannot open " + path + " for writing");
  f << to_json(info).dump(2) << "\n";
  if (!f) return Status::system_error("writing " + path + " failed");
  return {};
}

void Report::print_table(std::FILE* out) const {
  std::fprintf(out, "\n%-15s %-5s %-24s %10s %10s %10s %10s %8s %s\n", "op", "dtype", "shape / bytes per rank",
               "loom ms", "base ms", "gemm ms", "base", "speedup", "notes");
  for (const Row& r : rows_) {
    char shape[64];
    if (r.m) {
      std::snprintf(shape, sizeof(shape), "%lldx%lldx%lld", *r.m, r.n.value_or(0), r.k.value_or(0));
    } else {
      std::snprintf(shape, sizeof(shape), "%lld", r.bytes.value_or(0));
    }
    auto ms = [&](const char* key) { auto it = r.ms.find(key); return it == r.ms.end() ? -1.0 : it->second; };
    const double loom = ms("loom");
    // The baseline a row is judged against: NCCL+cuBLAS for fused ops, NCCL for collectives,
    // cuBLAS for a plain GEMM.
    const char* base_key = r.ms.count("nccl_cublas") ? "nccl_cublas" : r.ms.count("nccl") ? "nccl" : "cublas";
    const double base = ms(base_key);
    const double gemm = r.ms.count("nccl_cublas") ? ms("cublas") : -1.0;
    std::string notes;
    if (r.extra.contains("busbw_gbps")) {
      char b[96];
      std::snprintf(b, sizeof(b), "busbw loom %.0f / nccl %.0f GB/s", r.extra["busbw_gbps"].value("loom", 0.0),
                    r.extra["busbw_gbps"].value("nccl", 0.0));
      notes += b;
    }
    if (r.rel_err) {
      char b[48];
      std::snprintf(b, sizeof(b), "%srel_err %.1e", notes.empty() ? "" : "; ", *r.rel_err);
      notes += b;
    }
    if (r.extra.contains("ctas")) notes += "; ctas " + r.extra["ctas"].dump();
    char loom_s[16] = "-", base_s[16] = "-", gemm_s[16] = "-", speed_s[16] = "-";
    if (loom > 0) std::snprintf(loom_s, sizeof(loom_s), "%.4f", loom);
    if (base > 0) std::snprintf(base_s, sizeof(base_s), "%.4f", base);
    if (gemm > 0) std::snprintf(gemm_s, sizeof(gemm_s), "%.4f", gemm);
    if (loom > 0 && base > 0) std::snprintf(speed_s, sizeof(speed_s), "%.3fx", base / loom);
    std::fprintf(out, "%-15s %-5s %-24s %10s %10s %10s %10s %8s %s\n", r.op.c_str(), r.dtype.c_str(), shape, loom_s,
                 base_s, gemm_s, base_key, speed_s, notes.c_str());
  }
  std::fflush(out);
}

std::optional<double> measured_ms(const Row& r, const char* key) {
  const auto it = r.ms.find(key);
  if (it == r.ms.end() || !(it->second > 0)) return std::nullopt;
  return it->second;
}

std::optional<double> hidden_share(const Row& r, const char* t, const char* base, const char* floor) {
  const std::optional<double> x = measured_ms(r, t), b = measured_ms(r, base), f = measured_ms(r, floor);
  if (!x || !b || !f || *b <= *f) return std::nullopt;
  return (*b - *x) / (*b - *f);
}

}  // namespace loom::bench
