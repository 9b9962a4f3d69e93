#include "tensor_arg.h"

#include <nanobind/stl/string.h>

#include <string>

namespace loom::python {
namespace {

constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;

// torch objects looked up once torch has been imported by someone (never imported from here).
struct TorchRefs {
  PyTypeObject* tensor_type = nullptr;
  PyObject* bf16 = nullptr;
  PyObject* f16 = nullptr;
  PyObject* f32 = nullptr;
  PyObject* i32 = nullptr;
  PyObject* u8 = nullptr;
};

PyObject* interned(const char* s) { return PyUnicode_InternFromString(s); }

const TorchRefs* torch_refs() {
  static TorchRefs refs;
  static bool ready = false;
  if (ready) return &refs;
  PyObject* modules = PyImport_GetModuleDict();  // borrowed
  PyObject* torch = PyDict_GetItemString(modules, "torch");  // borrowed; null until imported
  if (torch == nullptr) return nullptr;
  // Kept for the life of the process (torch cannot be unloaded).
  PyObject* tensor = PyObject_GetAttrString(torch, "Tensor");
  refs.bf16 = PyObject_GetAttrString(torch, "bfloat16");
  refs.f16 = PyObject_GetAttrString(torch, "float16");
  refs.f32 = PyObject_GetAttrString(torch, "float32");
  refs.i32 = PyObject_GetAttrString(torch, "int32");
  refs.u8 = PyObject_GetAttrString(torch, "uint8");
  if (tensor == nullptr || !PyType_Check(tensor) || refs.bf16 == nullptr || refs.f16 == nullptr || refs.f32 == nullptr ||
      refs.i32 == nullptr || refs.u8 == nullptr) {
    PyErr_Clear();  // a half-initialised torch (import in progress): try again next call
    return nullptr;
  }
  refs.tensor_type = reinterpret_cast<PyTypeObject*>(tensor);
  ready = true;
  return &refs;
}

nb::object call_method(nb::handle obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(obj.ptr(), name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

nb::object get_attr(nb::handle obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj.ptr(), name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

void set_shape(TensorArg& t, const int64_t* dims, int ndim, std::string_view op, int rank) {
  if (ndim > TensorArg::kMaxDims) {
    invalid(op, rank, std::string(t.name) + " has " + std::to_string(ndim) + " dimensions; loom takes at most " +
                          std::to_string(TensorArg::kMaxDims));
  }
  t.ndim = ndim;
  t.numel = 1;
  for (int i = 0; i < ndim; ++i) {
    t.shape[static_cast<size_t>(i)] = dims[i];
    t.numel *= dims[i];
  }
}

[[noreturn]] void bad_dtype(const TensorArg& t, const std::string& what, std::string_view op, int rank) {
  const char* wanted = t.elements == Elements::kInt32  ? "; it must be int32"
                       : t.elements == Elements::kBytes ? "; it must be uint8 or int32 (raw device memory)"
                                                        : "; loom takes bfloat16, float16 or float32";
  invalid(op, rank, std::string(t.name) + " has dtype " + what + wanted);
}

[[noreturn]] void not_contiguous(const TensorArg& t, std::string_view op, int rank) {
  invalid(op, rank, std::string(t.name) + " " + t.shape_text() +
                        " is not row-major contiguous; pass a contiguous tensor (e.g. .contiguous())");
}

void read_torch(TensorArg& t, nb::handle obj, const TorchRefs& torch, std::string_view op, int rank) {
  static PyObject* s_data_ptr = interned("data_ptr");
  static PyObject* s_dtype = interned("dtype");
  static PyObject* s_shape = interned("shape");
  static PyObject* s_is_cuda = interned("is_cuda");
  static PyObject* s_get_device = interned("get_device");
  static PyObject* s_is_contiguous = interned("is_contiguous");

  nb::object dtype = get_attr(obj, s_dtype);
  const PyObject* d = dtype.ptr();
  if (t.elements == Elements::kInt32) {
    if (d != torch.i32) bad_dtype(t, nb::cast<std::string>(nb::str(dtype)), op, rank);
    t.element_size = 4;
  } else if (t.elements == Elements::kBytes) {
    if (d != torch.u8 && d != torch.i32) bad_dtype(t, nb::cast<std::string>(nb::str(dtype)), op, rank);
    t.element_size = d == torch.u8 ? 1 : 4;
  } else if (d == torch.bf16) {
    t.dtype = DType::kBF16;
  } else if (d == torch.f16) {
    t.dtype = DType::kF16;
  } else if (d == torch.f32) {
    t.dtype = DType::kF32;
  } else {
    bad_dtype(t, nb::cast<std::string>(nb::str(dtype)), op, rank);
  }
  if (t.elements == Elements::kFloat) t.element_size = dtype_size(t.dtype);
  nb::object shape = get_attr(obj, s_shape);  // torch.Size: a tuple
  if (!PyTuple_Check(shape.ptr())) invalid(op, rank, std::string(t.name) + ".shape is not a tuple");
  const int ndim = static_cast<int>(PyTuple_GET_SIZE(shape.ptr()));
  int64_t dims[TensorArg::kMaxDims] = {};
  for (int i = 0; i < ndim && i < TensorArg::kMaxDims; ++i) {
    dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), i));
  }
  set_shape(t, dims, ndim, op, rank);
  if (call_method(obj, s_is_contiguous).ptr() != Py_True) not_contiguous(t, op, rank);
  t.cuda = get_attr(obj, s_is_cuda).ptr() == Py_True;
  t.device = t.cuda ? static_cast<int>(PyLong_AsLong(call_method(obj, s_get_device).ptr())) : -1;
  t.data = PyLong_AsVoidPtr(call_method(obj, s_data_ptr).ptr());
  if (PyErr_Occurred()) throw nb::python_error();
}

void read_dlpack(TensorArg& t, nb::handle obj, std::string_view op, int rank) {
  if (!nb::try_cast<nb::ndarray<>>(obj, t.dlpack)) {
    PyErr_Clear();
    invalid(op, rank, std::string(t.name) + " must be a tensor (torch, CuPy, JAX or any DLPack producer), got " +
                          nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()))))));
  }
  const nb::ndarray<>& a = t.dlpack;
  const int ndim = static_cast<int>(a.ndim());
  int64_t dims[TensorArg::kMaxDims] = {};
  for (int i = 0; i < ndim && i < TensorArg::kMaxDims; ++i) dims[i] = static_cast<int64_t>(a.shape(static_cast<size_t>(i)));
  const nb::dlpack::dtype dt = a.dtype();
  const auto code = static_cast<nb::dlpack::dtype_code>(dt.code);
  auto refuse = [&]() {
    static const char* kCodes[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
    const std::string name = (dt.code < 7 ? kCodes[dt.code] : "code" + std::to_string(dt.code)) +
                             std::to_string(dt.bits) + (dt.lanes != 1 ? "x" + std::to_string(dt.lanes) : "");
    bad_dtype(t, name, op, rank);
  };
  const bool is_int32 = dt.lanes == 1 && code == nb::dlpack::dtype_code::Int && dt.bits == 32;
  const bool is_uint8 = dt.lanes == 1 && code == nb::dlpack::dtype_code::UInt && dt.bits == 8;
  if (t.elements == Elements::kInt32) {
    if (!is_int32) refuse();
    t.element_size = 4;
  } else if (t.elements == Elements::kBytes) {
    if (!is_int32 && !is_uint8) refuse();
    t.element_size = is_uint8 ? 1 : 4;
  } else if (dt.lanes == 1 && code == nb::dlpack::dtype_code::Bfloat && dt.bits == 16) {
    t.dtype = DType::kBF16;
  } else if (dt.lanes == 1 && code == nb::dlpack::dtype_code::Float && dt.bits == 16) {
    t.dtype = DType::kF16;
  } else if (dt.lanes == 1 && code == nb::dlpack::dtype_code::Float && dt.bits == 32) {
    t.dtype = DType::kF32;
  } else {
    refuse();
  }
  if (t.elements == Elements::kFloat) t.element_size = dtype_size(t.dtype);
  set_shape(t, dims, ndim, op, rank);
  // Row-major: each stride is the product of the later extents (dimensions of extent 1 may carry
  // any stride, as torch allows).
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    const int64_t extent = dims[i];
    if (extent != 1 && a.stride(static_cast<size_t>(i)) != expected) not_contiguous(t, op, rank);
    expected *= extent;
  }
  t.cuda = a.device_type() == kDLCUDA || a.device_type() == kDLCUDAManaged;
  t.device = a.device_id();
  t.data = a.data();
}

}  // namespace

void fail(StatusCode code, std::string_view op, int rank, std::string reason) {
  throw CallError(code, op, rank, std::move(reason));
}

void check(const Status& status, std::string_view op, int rank) {
  if (status.ok()) return;
  std::string_view message = status.message();
  // The library prefixes many messages with the operation's name; the error names it already.
  if (message.size() > op.size() + 2 && message.substr(0, op.size()) == op && message.substr(op.size(), 2) == ": ") {
    message.remove_prefix(op.size() + 2);
  }
  throw CallError(status.code(), op, rank, std::string(message));
}

std::string shape_text(const int64_t* dims, int ndim) {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

std::string TensorArg::shape_text() const { return python::shape_text(shape.data(), ndim); }

std::string TensorArg::device_text() const {
  if (dlpack.is_valid()) {
    switch (dlpack.device_type()) {
      case kDLCPU: return "cpu";
      case kDLCUDA: return "cuda:" + std::to_string(dlpack.device_id());
      case kDLCUDAHost: return "cuda pinned host memory";
      case kDLCUDAManaged: return "cuda managed:" + std::to_string(dlpack.device_id());
      default: return "DLPack device type " + std::to_string(dlpack.device_type());
    }
  }
  PyObject* device = PyObject_GetAttrString(source.ptr(), "device");
  PyObject* text = device != nullptr ? PyObject_Str(device) : nullptr;
  const char* utf8 = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
  std::string result = utf8 != nullptr ? utf8 : "an unknown device";
  if (utf8 == nullptr) PyErr_Clear();
  Py_XDECREF(text);
  Py_XDECREF(device);
  return result;
}

TensorArg tensor_arg(nb::handle obj, const char* name, std::string_view op, int rank, Elements elements) {
  TensorArg t;
  t.name = name;
  t.elements = elements;
  t.source = obj;
  if (obj.is_none()) invalid(op, rank, std::string(name) + " is None; loom needs a tensor");
  const TorchRefs* torch = torch_refs();
  if (torch != nullptr && PyObject_TypeCheck(obj.ptr(), torch->tensor_type)) {
    read_torch(t, obj, *torch, op, rank);
  } else {
    read_dlpack(t, obj, op, rank);
  }
  return t;
}

void require_device(const TensorArg& t, int device, std::string_view op, int rank) {
  if (!t.cuda) {
    invalid(op, rank, std::string(t.name) + " is on " + t.device_text() + "; loom needs CUDA device memory");
  }
  if (device >= 0 && t.device != device) {
    invalid(op, rank, std::string(t.name) + " is on cuda:" + std::to_string(t.device) + " but this " +
                          (rank >= 0 ? "communicator uses" : "call runs on") + " cuda:" + std::to_string(device));
  }
  if (t.data == nullptr && t.numel != 0) invalid(op, rank, std::string(t.name) + " has a null data pointer");
}

}  // namespace loom::python
