#include "report.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string_view>
#include <vector>

#include "loom/version.h"

extern char** environ;

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

namespace {

// "13.0" from cudaRuntimeGetVersion / cudaDriverGetVersion's 13000.
nlohmann::json cuda_version_text(cudaError_t e, int v) {
  if (e != cudaSuccess) return nullptr;
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

// The NVIDIA kernel module's version, from the first version-like word of
// /proc/driver/nvidia/version ("NVRM version: NVIDIA UNIX ... Kernel Module  580.159.04  ...").
nlohmann::json nvidia_driver_version() {
  std::ifstream f("/proc/driver/nvidia/version");
  std::string line;
  if (!std::getline(f, line)) return nullptr;
  std::istringstream words(line);
  for (std::string w; words >> w;) {
    const bool version_like = std::isdigit(static_cast<unsigned char>(w[0])) && w.find('.') != std::string::npos &&
                              w.find_first_not_of("0123456789.") == std::string::npos;
    if (version_like) return w;
  }
  return nullptr;
}

nlohmann::json nccl_version() {
  int code = 0;
  if (ncclGetVersion(&code) != ncclSuccess) return nullptr;
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." + std::to_string(code % 100);
}

nlohmann::json cublas_version() {
  int major = 0, minor = 0, patch = 0;
  if (cublasGetProperty(MAJOR_VERSION, &major) != CUBLAS_STATUS_SUCCESS ||
      cublasGetProperty(MINOR_VERSION, &minor) != CUBLAS_STATUS_SUCCESS ||
      cublasGetProperty(PATCH_LEVEL, &patch) != CUBLAS_STATUS_SUCCESS) {
    return nullptr;
  }
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

// A device attribute in kHz as MHz (null if it cannot be read).
nlohmann::json clock_mhz(cudaDeviceAttr attribute, int device) {
  int khz = 0;
  if (cudaDeviceGetAttribute(&khz, attribute, device) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return khz / 1000;
}

}  // namespace

nlohmann::json run_environment(int device, int argc, char** argv) {
  nlohmann::json j;
  j["loom_version"] = loom::version();
  int runtime = 0, driver = 0;
  const cudaError_t runtime_error = cudaRuntimeGetVersion(&runtime);
  const cudaError_t driver_error = cudaDriverGetVersion(&driver);
  j["versions"] = {{"cuda_runtime", cuda_version_text(runtime_error, runtime)},
                   {"cuda_driver", cuda_version_text(driver_error, driver)},
                   {"nvidia_driver", nvidia_driver_version()},
                   {"nccl", nccl_version()},
                   {"cublas", cublas_version()}};
  // Peak (not current) clocks: without NVML these are what the device reports.
  j["gpu_peak_clocks_mhz"] = {{"sm", clock_mhz(cudaDevAttrClockRate, device)},
                              {"memory", clock_mhz(cudaDevAttrMemoryClockRate, device)}};
  j["command"] = std::vector<std::string>(argv, argv + argc);
  nlohmann::json env = nlohmann::json::object();
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const size_t eq = text.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string name(text.substr(0, eq));
    if (name.rfind("LOOM_", 0) != 0 && name.rfind("NCCL_", 0) != 0) continue;
    // The job's bootstrap secret must not end up in committed results.
    env[name] = name == "LOOM_SECRET" ? std::string("(set, not recorded)") : std::string(text.substr(eq + 1));
  }
  j["env"] = std::move(env);
  return j;
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
  for (auto it = info.environment.begin(); it != info.environment.end(); ++it) j[it.key()] = it.value();
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
    row["ms_min"] = r.ms_min;
    row["ms_p90"] = r.ms_p90;
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
  // moe_dispatch_gemm rows have no loom / baseline columns: print_moe_table (moe_bench.h) shows them.
  auto own_table = [](const Row& r) { return r.op == "moe_dispatch_gemm"; };
  if (!rows_.empty() && std::all_of(rows_.begin(), rows_.end(), own_table)) return;
  std::fprintf(out, "\n%-15s %-5s %-24s %10s %10s %10s %10s %8s %s\n", "op", "dtype", "shape / bytes per rank",
               "loom ms", "base ms", "gemm ms", "base", "speedup", "notes");
  for (const Row& r : rows_) {
    if (own_table(r)) continue;
    char shape[64];
    if (r.m) {
      std::snprintf(shape, sizeof(shape), "%lldx%lldx%lld", *r.m, r.n.value_or(0), r.k.value_or(0));
    } else {
      std::snprintf(shape, sizeof(shape), "%lld", r.bytes.value_or(0));
    }
    auto ms = [&](const char* key) { auto it = r.ms.find(key); return it == r.ms.end() ? -1.0 : it->second; };
    const double loom = ms("loom");
    // The baseline a row is judged against: NCCL+cuBLAS for fused ops, NCCL for collectives,
    // cuBLAS for a plain GEMM; a world-1 collective's device copy is shown, not judged against.
    const char* base_key = r.ms.count("nccl_cublas") ? "nccl_cublas"
                           : r.ms.count("nccl")      ? "nccl"
                           : r.ms.count("copy")      ? "copy"
                                                     : "cublas";
    const double base = ms(base_key);
    const double gemm = r.ms.count("nccl_cublas") ? ms("cublas") : -1.0;
    std::string notes;
    const bool comparable = !r.extra.contains("note");
    if (!comparable) notes = r.extra["note"].get<std::string>();
    if (r.extra.contains("busbw_gbps")) {
      if (!notes.empty()) notes += "; ";
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
    if (comparable && loom > 0 && base > 0) std::snprintf(speed_s, sizeof(speed_s), "%.3fx", base / loom);
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
