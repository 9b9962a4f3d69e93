// Tensor arguments of loom._C: any DLPack producer (CuPy, JAX, numpy, ...) through nanobind's
// ndarray, and torch tensors through a direct path (torch's __dlpack__ is Python code costing
// ~5 us per tensor, which alone would exceed the per-call overhead budget). Neither needs torch
// at build time. Also: the errors raised in Python as the loom.LoomError classes.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <array>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

#include "loom/status.h"
#include "loom/types.h"

namespace loom::python {

namespace nb = nanobind;

// A rejected argument or a failed loom call. The translator in ext.cc raises it as the
// loom.LoomError subclass of `code` (loom/_errors.py), with the rank, the op and the reason.
struct CallError : std::exception {
  StatusCode code;
  std::string op;
  int rank;  // -1: no communicator (gemm, unique ids)
  std::string reason;
  CallError(StatusCode c, std::string_view o, int r, std::string why)
      : code(c), op(o), rank(r), reason(std::move(why)) {}
  const char* what() const noexcept override { return reason.c_str(); }
};

[[noreturn]] void fail(StatusCode code, std::string_view op, int rank, std::string reason);
[[noreturn]] inline void invalid(std::string_view op, int rank, std::string reason) {
  fail(StatusCode::kInvalidArgument, op, rank, std::move(reason));
}
// Raises a non-ok Status; strips a leading "op: " from its message (the error names the op).
void check(const Status& status, std::string_view op, int rank);

// The element types a tensor argument may have.
enum class Elements : uint8_t {
  kFloat,  // bf16, fp16 or fp32 (TensorArg::dtype says which)
  kInt32,  // int32 indices (sequence offsets, expert ids, row offsets)
  kBytes,  // raw device memory whose bytes alone matter (an MoE plan buffer): uint8 or int32
};

struct TensorArg {
  static constexpr int kMaxDims = 8;
  const char* name = "";
  void* data = nullptr;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  int64_t numel = 1;
  DType dtype = DType::kBF16;  // meaningful for Elements::kFloat only
  Elements elements = Elements::kFloat;
  size_t element_size = 0;     // bytes per element, whatever the element type
  bool cuda = false;       // CUDA device memory (DLPack kDLCUDA / kDLCUDAManaged, torch is_cuda)
  int device = -1;
  nb::handle source;       // borrowed: the caller's object, for error messages
  nb::ndarray<> dlpack;    // keeps a DLPack import alive (not used for torch tensors)

  int64_t dim(int i) const { return shape[static_cast<size_t>(i)]; }
  size_t bytes() const { return static_cast<size_t>(numel) * element_size; }
  std::string shape_text() const;  // "[128, 64]"
  std::string device_text() const;  // "cuda:0", "cpu", ... (error path only)
};

// Reads `obj` (borrowed for the duration of the call). Raises InvalidArgument when it is not a
// tensor, its dtype is not one `elements` allows (bf16/fp16/fp32; int32 for index tensors such as
// sequence offsets; uint8 or int32 for raw buffers), it is not row-major contiguous or has more
// than kMaxDims dimensions. The device is checked by require_device() so that shape errors come
// first.
TensorArg tensor_arg(nb::handle obj, const char* name, std::string_view op, int rank,
                     Elements elements = Elements::kFloat);

// Raises InvalidArgument unless `t` is CUDA memory on `device` (device < 0: any CUDA device).
void require_device(const TensorArg& t, int device, std::string_view op, int rank);

std::string shape_text(const int64_t* dims, int ndim);

}  // namespace loom::python
