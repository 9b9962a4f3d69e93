#include "runtime/names.h"

#include <map>
#include <mutex>
#include <string_view>

#include "core/log.h"

namespace loom {
namespace {

struct Registry {
  std::mutex mu;
  std::map<uint32_t, const char*> flags;
  std::map<uint32_t, const char*> ops;
};

Registry& registry() {
  static Registry r;
  return r;
}

const char* registered(std::map<uint32_t, const char*>& names, uint32_t code) {
  std::lock_guard<std::mutex> lock(registry().mu);
  auto it = names.find(code);
  return it == names.end() ? "unknown" : it->second;
}

void add(std::map<uint32_t, const char*>& names, uint32_t code, const char* name, const char* what) {
  std::lock_guard<std::mutex> lock(registry().mu);
  auto [it, inserted] = names.emplace(code, name);
  if (!inserted && std::string_view(it->second) != name) {
    LOOM_ERROR("%s %u is registered as '%s' and again as '%s' (two families picked one number)", what, code, it->second,
               name);
  }
}

}  // namespace

void register_flag_kind_names(std::initializer_list<FlagKindName> names) {
  for (const FlagKindName& n : names) add(registry().flags, static_cast<uint32_t>(n.kind), n.name, "flag kind");
}

void register_op_names(std::initializer_list<OpName> names) {
  for (const OpName& n : names) add(registry().ops, static_cast<uint32_t>(n.op), n.name, "operator id");
}

const char* op_name(OpId op) {
  switch (op) {
    case OpId::kNone: return "none";
    case OpId::kSelfTest: return "self_test";
    case OpId::kAllGather: return "all_gather";
    case OpId::kReduceScatter: return "reduce_scatter";
    case OpId::kAllReduce: return "all_reduce";
    case OpId::kGemm: return "gemm";
    case OpId::kAgGemm: return "ag_gemm";
    case OpId::kGemmRs: return "gemm_rs";
    case OpId::kGemmAr: return "gemm_ar";
    case OpId::kNetExchange: return "net_exchange";
  }
  return registered(registry().ops, static_cast<uint32_t>(op));
}

const char* flag_kind_name(FlagKind kind) {
  switch (kind) {
    case FlagKind::kNone: return "none";
    case FlagKind::kEntered: return "entered";
    case FlagKind::kChunk: return "chunk";
    case FlagKind::kDone: return "done";
    case FlagKind::kTile: return "tile";
    case FlagKind::kRingSpace: return "command ring space";
    case FlagKind::kNetEntry: return "network entry";
    case FlagKind::kNetChunk: return "network chunk";
    case FlagKind::kProxyDone: return "proxy completion";
  }
  return registered(registry().flags, static_cast<uint32_t>(kind));
}

}  // namespace loom
