#include "runtime/transports/transport.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "core/env.h"
#include "runtime/bootstrap.h"
#include "runtime/topology.h"
#include "runtime/transports/fabric.h"
#include "runtime/transports/verbs.h"

namespace loom::runtime::net {

Status TransportBase::check_open() const {
  if (closed_) return Status::aborted(std::string(name_) + ": transport closed");
  return {};
}

Status TransportBase::check_registrable(const MemoryRegion& region) const {
  LOOM_TRY(check_open());
  if (region.base == nullptr || region.bytes == 0) return Status::invalid_argument(std::string(name_) + ": empty memory region");
  return {};
}
namespace {

// An endpoint or window blob larger than this is a bug (RC endpoints grow with the world: 4 B
// of queue pair number per rank, so this allows far more ranks than any job has).
constexpr uint64_t kMaxBlobBytes = uint64_t{16} << 20;

}  // namespace

const char* transport_kind_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kCopyEngine: return "copy_engine";
    case TransportKind::kFabric: return "fabric";
    case TransportKind::kVerbs: return "verbs";
  }
  return "unknown";
}

const char* transport_choice_name(TransportChoice choice) {
  switch (choice) {
    case TransportChoice::kAuto: return "auto";
    case TransportChoice::kCopyEngine: return "copy_engine";
    case TransportChoice::kFabric: return "fabric";
    case TransportChoice::kVerbs: return "verbs";
  }
  return "unknown";
}

// ---- exchanges ---------------------------------------------------------------------------------

Result<std::vector<std::vector<uint8_t>>> all_gather_blobs(Bootstrap& bootstrap, std::span<const uint8_t> mine) {
  const int world = bootstrap.world_size();
  const uint64_t my_length = mine.size();
  std::vector<uint64_t> lengths(static_cast<size_t>(world));
  LOOM_TRY_CTX(bootstrap.all_gather(&my_length, lengths.data(), sizeof(uint64_t)), "gathering blob lengths");
  uint64_t slot = 0;
  for (int r = 0; r < world; ++r) {
    if (lengths[r] > kMaxBlobBytes) {
      return Status::invalid_argument("rank " + std::to_string(r) + " offers a " + std::to_string(lengths[r]) +
                                      "-byte blob, more than the " + std::to_string(kMaxBlobBytes) + " allowed");
    }
    slot = std::max(slot, lengths[r]);
  }
  std::vector<uint8_t> padded(slot, 0);
  std::copy(mine.begin(), mine.end(), padded.begin());
  std::vector<uint8_t> all(slot * static_cast<uint64_t>(world));
  if (slot > 0) LOOM_TRY_CTX(bootstrap.all_gather(padded.data(), all.data(), slot), "gathering blobs");
  std::vector<std::vector<uint8_t>> blobs(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const uint8_t* begin = all.data() + slot * static_cast<uint64_t>(r);
    blobs[r].assign(begin, begin + lengths[r]);
  }
  return blobs;
}

Status exchange_endpoints(Bootstrap& bootstrap, Transport& transport) {
  Result<std::vector<uint8_t>> mine = transport.local_endpoint();
  // Every rank takes part in the gather even after a local failure, so nobody waits for it;
  // a failing rank tells the others through the bootstrap.
  if (!mine.ok()) {
    bootstrap.report_failure(mine.status().to_string());
    return std::move(mine).take_status().with_context(std::string(transport_kind_name(transport.kind())) + " endpoint");
  }
  LOOM_ASSIGN_OR_RETURN(std::vector<std::vector<uint8_t>> all, all_gather_blobs(bootstrap, *mine));
  Status connected = transport.connect(all);
  // The others go on to the next collective step: tell them, so they fail now, not at a deadline.
  if (!connected.ok()) bootstrap.report_failure(connected.to_string());
  return connected;
}

// ---- shaping -----------------------------------------------------------------------------------

LinkShaper::LinkShaper(double gbps, double latency_us) {
  enabled_ = gbps > 0 || latency_us > 0;
  ns_per_byte_ = gbps > 0 ? 1.0 / gbps : 0.0;  // 1 GB/s = 1 byte per ns
  latency_ = std::chrono::nanoseconds(static_cast<int64_t>(std::llround(latency_us * 1000.0)));
}

LinkShaper::Clock::time_point LinkShaper::schedule(uint64_t bytes, Clock::time_point now) {
  if (!enabled_) return now;
  const Clock::time_point start = std::max(now, link_free_);
  const auto serialization =
      std::chrono::nanoseconds(static_cast<int64_t>(std::llround(static_cast<double>(bytes) * ns_per_byte_)));
  link_free_ = start + serialization;
  return link_free_ + latency_;
}

// ---- settings ----------------------------------------------------------------------------------

Result<double> parse_decimal(std::string_view name, std::string_view text, double min, double max) {
  std::string owned(text);
  // Trim like env::parse_int does.
  while (!owned.empty() && std::isspace(static_cast<unsigned char>(owned.back()))) owned.pop_back();
  size_t first = 0;
  while (first < owned.size() && std::isspace(static_cast<unsigned char>(owned[first]))) ++first;
  owned.erase(0, first);
  auto bad = [&](const std::string& why) {
    return Status::invalid_argument(std::string(name) + "='" + std::string(text) + "': " + why);
  };
  if (owned.empty()) return bad("empty; expected a number");
  // Plain decimal only: digits with at most one point (no exponents, hex, inf or nan).
  bool point = false;
  bool digit = false;
  for (char c : owned) {
    if (c == '.' && !point) {
      point = true;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      digit = true;
    } else {
      return bad("not a decimal number");
    }
  }
  if (!digit) return bad("not a decimal number");
  errno = 0;
  const double value = std::strtod(owned.c_str(), nullptr);
  if (errno == ERANGE || !std::isfinite(value)) return bad("out of range");
  if (value < min || value > max) {
    return bad("outside [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return value;
}

Result<NetworkSettings> NetworkSettings::from_env() {
  NetworkSettings s;
  LOOM_ASSIGN_OR_RETURN(std::string transport,
                        env::get_choice("LOOM_TRANSPORT", "auto", {"auto", "copy_engine", "fabric", "verbs"}));
  s.transport = transport == "copy_engine" ? TransportChoice::kCopyEngine
                : transport == "fabric"    ? TransportChoice::kFabric
                : transport == "verbs"     ? TransportChoice::kVerbs
                                           : TransportChoice::kAuto;
  LOOM_ASSIGN_OR_RETURN(int64_t nodes, env::get_int("LOOM_EMULATE_NODES", 1, 1, 64));
  s.emulate_nodes = static_cast<int>(nodes);
  if (std::optional<std::string> raw = env::get_raw("LOOM_EMULATE_NET_GBPS")) {
    LOOM_ASSIGN_OR_RETURN(s.emulate_net_gbps, parse_decimal("LOOM_EMULATE_NET_GBPS", *raw, 0.0, 100000.0));
  }
  if (std::optional<std::string> raw = env::get_raw("LOOM_EMULATE_NET_LAT_US")) {
    LOOM_ASSIGN_OR_RETURN(s.emulate_net_latency_us, parse_decimal("LOOM_EMULATE_NET_LAT_US", *raw, 0.0, 1e7));
  }
  LOOM_ASSIGN_OR_RETURN(int64_t threads, env::get_int("LOOM_PROXY_THREADS", 1, 1, 64));
  s.proxy_threads = static_cast<int>(threads);
  if (std::optional<std::string> raw = env::get_raw("LOOM_NET_DEVICE")) {
    if (raw->empty()) return Status::invalid_argument("LOOM_NET_DEVICE='': set but empty; unset it to pick the first usable device");
    s.net_device = *raw;
  }
  if (std::optional<std::string> raw = env::get_raw("LOOM_FABRIC_PROVIDER")) {
    if (raw->empty()) return Status::invalid_argument("LOOM_FABRIC_PROVIDER='': set but empty; unset it for efa, verbs, then tcp");
    s.fabric_provider = *raw;
  }
  LOOM_ASSIGN_OR_RETURN(int64_t gid, env::get_int("LOOM_IB_GID_INDEX", 0, 0, 255));
  s.ib_gid_index = static_cast<int>(gid);
  return s;
}

NetworkProbe probe_network(const NetworkSettings& settings) {
  NetworkProbe probe;
  Result<std::string> verbs = probe_verbs(verbs_options_from_settings(settings));
  probe.verbs_usable = verbs.ok();
  probe.verbs_reason = verbs.ok() ? *verbs : verbs.status().message();
  Result<FabricOptions> fabric = fabric_options_from_settings(settings);
  probe.fabric_usable = fabric.ok();
  probe.fabric_reason = fabric.ok() ? "provider " + fabric->provider : fabric.status().message();
  return probe;
}

Result<TransportDecision> choose_transport(const NetworkSettings& settings, const Topology& topology,
                                           const NetworkProbe& probe) {
  // Emulated nodes are consecutive within a host: node n lives on physical host n / emulate_nodes.
  const int per_host = std::max(1, settings.emulate_nodes);
  const int my_host = topology.node / per_host;
  bool any_cross_node = false;
  bool all_same_host = true;
  for (int r = 0; r < topology.world_size; ++r) {
    if (topology.node_of_rank[r] == topology.node) continue;
    any_cross_node = true;
    if (topology.node_of_rank[r] / per_host != my_host) all_same_host = false;
  }
  TransportDecision d;
  if (!any_cross_node) {
    d.transport = TransportChoice::kCopyEngine;
    d.reason = "no cross-node peers";
    return d;
  }
  switch (settings.transport) {
    case TransportChoice::kCopyEngine:
      if (!all_same_host) {
        return Status::unsupported("LOOM_TRANSPORT=copy_engine: some cross-node peers run on another host; copy_engine "
                                   "only reaches GPUs of this host (use fabric or verbs)");
      }
      d.transport = TransportChoice::kCopyEngine;
      d.reason = "LOOM_TRANSPORT=copy_engine";
      return d;
    case TransportChoice::kVerbs:
      if (!probe.verbs_usable) return Status::unsupported("LOOM_TRANSPORT=verbs: " + probe.verbs_reason);
      d.transport = TransportChoice::kVerbs;
      d.reason = "LOOM_TRANSPORT=verbs (" + probe.verbs_reason + ")";
      return d;
    case TransportChoice::kFabric:
      if (!probe.fabric_usable) return Status::unsupported("LOOM_TRANSPORT=fabric: " + probe.fabric_reason);
      d.transport = TransportChoice::kFabric;
      d.reason = "LOOM_TRANSPORT=fabric (" + probe.fabric_reason + ")";
      return d;
    case TransportChoice::kAuto:
      break;
  }
  if (all_same_host) {
    d.transport = TransportChoice::kCopyEngine;
    d.reason = "auto: every cross-node peer is an emulated node of this host";
    return d;
  }
  if (probe.verbs_usable) {
    d.transport = TransportChoice::kVerbs;
    d.reason = "auto: " + probe.verbs_reason;
    return d;
  }
  if (probe.fabric_usable) {
    d.transport = TransportChoice::kFabric;
    d.reason = "auto: verbs unusable (" + probe.verbs_reason + "); " + probe.fabric_reason;
    return d;
  }
  return Status::unsupported("no transport reaches the other nodes: verbs: " + probe.verbs_reason +
                             "; fabric: " + probe.fabric_reason);
}

}  // namespace loom::runtime::net
