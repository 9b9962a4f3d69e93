#include "runtime/call_log.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>

#include "loom/types.h"

namespace loom {
namespace {

struct Call {
  uint32_t signature = 0;
  OpId op = OpId::kNone;
  size_t count = 0;
  std::array<CallField, kMaxCallFields> fields{};
};

struct Log {
  std::mutex mutex;
  std::array<Call, kCalls> calls{};
  size_t used = 0;
  size_t next = 0;  // the slot the next new call replaces once all are used
  std::atomic<uint64_t> last{~uint64_t{0}};  // the last remembered signature (fast path)
};

Log& the_log() {
  static Log* log = new Log;  // never destroyed: calls may come from static destructors
  return *log;
}

}  // namespace

void remember_call(uint32_t signature, OpId op, std::span<const CallField> fields) {
  Log& log = the_log();
  if (log.last.load(std::memory_order_relaxed) == signature) return;
  std::lock_guard<std::mutex> lock(log.mutex);
  log.last.store(signature, std::memory_order_relaxed);
  const auto end = log.calls.begin() + static_cast<std::ptrdiff_t>(log.used);
  if (std::find_if(log.calls.begin(), end, [&](const Call& c) { return c.signature == signature; }) != end) return;
  Call& slot = log.used < kCalls ? log.calls[log.used++] : log.calls[log.next++ % kCalls];
  slot.signature = signature;
  slot.op = op;
  slot.count = std::min(fields.size(), kMaxCallFields);
  std::copy_n(fields.begin(), slot.count, slot.fields.begin());
}

std::string describe_call(uint32_t signature) {
  Log& log = the_log();
  std::lock_guard<std::mutex> lock(log.mutex);
  for (size_t i = 0; i < log.used; ++i) {
    const Call& c = log.calls[i];
    if (c.signature != signature) continue;
    std::string text = std::string(op_name(c.op)) + "(";
    for (size_t f = 0; f < c.count; ++f) {
      const CallField& field = c.fields[f];
      if (f > 0) text += ", ";
      if (field.name != nullptr) text += std::string(field.name) + "=";
      const bool dtype = field.name != nullptr && std::string_view(field.name) == "dtype" && field.value >= 0 &&
                         field.value <= 2;
      text += dtype ? std::string(dtype_name(static_cast<DType>(field.value))) : std::to_string(field.value);
    }
    return text + ")";
  }
  return "";
}

}  // namespace loom
