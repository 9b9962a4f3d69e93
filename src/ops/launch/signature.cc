#include "ops/launch/signature.h"

#include <algorithm>
#include <array>

namespace loom::ops {
namespace {

// FNV-1a over 64-bit words, folded to 32 bits at the end.
class Hash {
 public:
  explicit Hash(OpId op) { mix(static_cast<uint64_t>(op)); }
  void mix(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h_ ^= (v >> (8 * i)) & 0xFF;
      h_ *= 0x100000001b3ull;
    }
  }
  // Never 0: a zero entry word means "never written" (runtime/device_abi.h, entry_reached).
  uint32_t value() const {
    const auto v = static_cast<uint32_t>(h_ ^ (h_ >> 32));
    return v == 0 ? 1 : v;
  }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

}  // namespace

uint32_t call_signature(OpId op, std::initializer_list<CallField> fields) {
  Hash h(op);
  for (const CallField& f : fields) h.mix(static_cast<uint64_t>(f.value));
  remember_call(h.value(), op, std::span<const CallField>(fields.begin(), fields.size()));
  return h.value();
}

namespace {

// `named` fields first, then `values` unnamed (they differ per operator): all hashed, as many kept
// for messages as the call log holds.
uint32_t with_values(OpId op, std::initializer_list<CallField> named, std::initializer_list<int64_t> values) {
  Hash h(op);
  std::array<CallField, kMaxCallFields> fields{};
  size_t count = 0;
  for (const CallField& f : named) {
    h.mix(static_cast<uint64_t>(f.value));
    if (count < fields.size()) fields[count++] = f;
  }
  for (int64_t v : values) {
    h.mix(static_cast<uint64_t>(v));
    if (count < fields.size()) fields[count++] = {nullptr, v};
  }
  remember_call(h.value(), op, std::span<const CallField>(fields.data(), count));
  return h.value();
}

}  // namespace

uint32_t fused_plan_signature(OpId op, int tile, int world, std::initializer_list<int64_t> values) {
  return with_values(op, {{"tile", tile}, {"world", world}}, values);
}

uint32_t values_signature(OpId op, std::initializer_list<int64_t> values) { return with_values(op, {}, values); }

uint32_t collective_signature(OpId label, uint32_t outer, uint64_t bytes, DType dtype, int ctas, int engine,
                              uint64_t send_offset, uint64_t recv_offset) {
  return call_signature(label, {{"of_call", outer},
                                {"bytes", static_cast<int64_t>(bytes)},
                                {"dtype", static_cast<int64_t>(dtype)},
                                {"ctas", ctas},
                                {"engine", engine},
                                {"send_offset", static_cast<int64_t>(send_offset)},
                                {"recv_offset", static_cast<int64_t>(recv_offset)}});
}

uint32_t decomposed_tp_signature(OpId op, int64_t m, int64_t n, int64_t k, DType dtype, int b_layout, int world) {
  return call_signature(op, {{"m", m},
                             {op == OpId::kAgGemm ? "k" : "n", op == OpId::kAgGemm ? k : n},
                             {"dtype", static_cast<int64_t>(dtype)},
                             {"b_layout", b_layout},
                             {"world", world},
                             {"decomposed", 1}});
}

}  // namespace loom::ops
