#include "binding_common.h"

#include <string>

namespace loom::python {

BLayout layout_of(std::string_view name, std::string_view op, int rank) {
  Result<BLayout> l = parse_b_layout(name);
  if (!l.ok()) invalid(op, rank, "b_layout '" + std::string(name) + "': expected 'kn' ([K, N]) or 'nk' ([N, K], an nn.Linear weight)");
  return *l;
}

GemmTile tile_of(std::string_view name, std::string_view op, int rank) {
  Result<GemmTile> t = parse_gemm_tile(name);
  if (!t.ok()) invalid(op, rank, "tile '" + std::string(name) + "': expected auto, 128x256, 128x128, 128x64 or 64x128");
  return *t;
}

GroupedActivation activation_of(std::string_view name, std::string_view op, int rank) {
  if (name == "none") return GroupedActivation::kNone;
  if (name == "swiglu") return GroupedActivation::kSwiGLU;
  invalid(op, rank, "activation '" + std::string(name) + "': expected 'none' or 'swiglu'");
}

void require_ndim(const TensorArg& t, int ndim, const char* meaning, std::string_view op, int rank) {
  if (t.ndim != ndim) {
    invalid(op, rank, std::string(t.name) + " must be " + std::to_string(ndim) + "-D " + meaning + ", got shape " +
                          t.shape_text());
  }
}

void require_same_dtype(const TensorArg& x, const TensorArg& y, std::string_view op, int rank) {
  if (x.dtype != y.dtype) {
    invalid(op, rank, std::string(x.name) + " is " + std::string(dtype_name(x.dtype)) + " but " + y.name + " is " +
                          std::string(dtype_name(y.dtype)) + "; they must have the same dtype");
  }
}

void require_half(const TensorArg& t, std::string_view op, int rank) {
  if (t.dtype == DType::kF32) {
    fail(StatusCode::kUnsupported, op, rank,
         std::string(t.name) + " is fp32; " + std::string(op) + " takes bf16 or fp16 inputs");
  }
}

void require_shape(const TensorArg& t, int64_t rows, int64_t cols, const std::string& meaning, std::string_view op,
                   int rank) {
  if (t.dim(0) != rows || t.dim(1) != cols) {
    invalid(op, rank, std::string(t.name) + " must be " + meaning + " = [" + std::to_string(rows) + ", " +
                          std::to_string(cols) + "], got " + t.shape_text());
  }
}

void require_symmetric(const CommView& c, const TensorArg& t, std::string_view why, std::string_view op) {
  if (c.comm != nullptr && t.numel != 0 && !c.comm->is_symmetric(t.data, t.bytes())) {
    invalid(op, c.rank, std::string(t.name) + " must be symmetric memory (" + std::string(why) +
                            "): allocate it with comm.empty(...) or loom.torch.empty(comm, ...)");
  }
}

}  // namespace loom::python
