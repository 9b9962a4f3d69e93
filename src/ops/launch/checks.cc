#include "ops/launch/checks.h"

#include <string>

namespace loom::ops {

ByteRange bytes_of(const void* p, int64_t rows, int64_t cols, size_t elem) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  return {lo, lo + static_cast<uintptr_t>(rows) * static_cast<uintptr_t>(cols) * elem};
}

Status check_optional_tma_pointer(std::string_view op, NamedPointer p) {
  if (reinterpret_cast<uintptr_t>(p.ptr) % 16 != 0) {
    return Status::invalid_argument(std::string(op) + ": " + p.what +
                                    " is not 16-byte aligned (TMA needs 16-byte aligned rows)");
  }
  return {};
}

Status check_tma_pointers(std::string_view op, std::initializer_list<NamedPointer> required) {
  for (const NamedPointer& p : required) {
    if (p.ptr == nullptr) return Status::invalid_argument(std::string(op) + ": " + p.what + " is null");
    LOOM_TRY(check_optional_tma_pointer(op, p));
  }
  return {};
}

Status check_disjoint(std::string_view op, const ByteRange& x, const char* x_name, const ByteRange& y, const char* y_name) {
  if (!x.overlaps(y)) return {};
  return Status::invalid_argument(std::string(op) + ": " + x_name + " overlaps " + y_name);
}

}  // namespace loom::ops
