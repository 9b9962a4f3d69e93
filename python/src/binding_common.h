// What the binding files of loom._C share: ext.cc (the module, the communicator and most ops) and
// moe.cc (the MoE family, registered by bind_moe() from ext.cc's module definition): the
// communicator object, the GIL release around loom calls, and the argument checks every op makes
// the same way (so that their messages read the same whichever file raises them).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "loom/communicator.h"
#include "loom/gemm.h"
#include "loom/moe.h"
#include "loom/status.h"
#include "loom/types.h"
#include "tensor_arg.h"

namespace loom::python {

namespace nb = nanobind;

inline cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// Runs a loom call without the GIL: launches are short, but some calls block (allocation and
// barriers wait for the other ranks; the first call of a larger TP shape synchronizes the GPU).
template <class F>
Status without_gil(F&& f) {
  nb::gil_scoped_release release;
  return f();
}

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// loom._C.Communicator.
struct PyCommunicator {
  std::unique_ptr<Communicator> comm;
  // Copied at creation: error messages and properties stay valid after close().
  int rank = -1, world_size = 0, local_rank = -1, local_world_size = 0, node = -1, num_nodes = 0, device = -1,
      sm_count = 0, ranks_per_gpu = 1, ranks_on_gpu = 1;
  int live_buffers = 0;  // symmetric buffers handed out by empty() and not yet freed (GIL-guarded)

  explicit PyCommunicator(std::unique_ptr<Communicator> c) : comm(std::move(c)) {
    rank = comm->rank();
    world_size = comm->world_size();
    local_rank = comm->local_rank();
    local_world_size = comm->local_world_size();
    node = comm->node();
    num_nodes = comm->num_nodes();
    device = comm->device();
    sm_count = comm->sm_count();
    ranks_per_gpu = comm->ranks_per_gpu();
    ranks_on_gpu = comm->ranks_on_gpu();
  }
  PyCommunicator(PyCommunicator&&) = default;

  ~PyCommunicator() {
    if (!comm) return;
    if (interpreter_finalizing()) {
      // Interpreter teardown: the process is exiting; the OS reclaims the mappings, and a
      // barrier now could wait for a peer that already left.
      (void)comm.release();
      return;
    }
    nb::gil_scoped_release release;  // the destructor waits (bounded) for the other ranks
    comm.reset();
  }

  Communicator& get(std::string_view op) {
    if (!comm) fail(StatusCode::kAborted, op, rank, "the communicator was closed");
    return *comm;
  }
};

// What the ops need of a communicator. `comm` is null only for the argument-check entry points
// (_check_args, _check_moe_args: no runtime; the call is checked, never launched). `world` is the
// local world size (one NVLink domain: the collectives, MoE); `tp_world` every rank of the job,
// over which the tensor-parallel ops split M or K (the same on one node; across nodes the
// multi-node operators take the global world).
struct CommView {
  Communicator* comm = nullptr;
  int rank = -1;
  int world = 0;
  int tp_world = 0;
  int device = -1;  // -1: any CUDA device
};

inline CommView view_of(PyCommunicator& pc, std::string_view op) {
  return CommView{&pc.get(op), pc.rank, pc.local_world_size, pc.world_size, pc.device};
}

// ---- option parsing (InvalidArgument naming the accepted values) --------------------------------

BLayout layout_of(std::string_view name, std::string_view op, int rank);
GemmTile tile_of(std::string_view name, std::string_view op, int rank);
GroupedActivation activation_of(std::string_view name, std::string_view op, int rank);

// ---- argument checks shared by the ops ----------------------------------------------------------

void require_ndim(const TensorArg& t, int ndim, const char* meaning, std::string_view op, int rank);
void require_same_dtype(const TensorArg& x, const TensorArg& y, std::string_view op, int rank);
// Unsupported for fp32 (the GEMM engines take bf16 or fp16).
void require_half(const TensorArg& t, std::string_view op, int rank);
// A 2-D tensor of [rows, cols]; `meaning` names the shape, e.g. "[M, N]".
void require_shape(const TensorArg& t, int64_t rows, int64_t cols, const std::string& meaning, std::string_view op,
                   int rank);
// Symmetric memory of this communicator (skipped without one). loom's own check says the same in
// C++ terms (Communicator::alloc); this one names what a Python caller allocates it with.
void require_symmetric(const CommView& c, const TensorArg& t, std::string_view why, std::string_view op);

// Launches a prepared call (anything with launch(), op() and rank()) and raises its failure.
template <class Call>
void run(const Call& call) {
  check(without_gil([&] { return call.launch(); }), call.op(), call.rank());
}

// The MoE family (moe.cc).
void bind_moe(nb::module_& m);

}  // namespace loom::python
