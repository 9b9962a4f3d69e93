// loom._C's MoE family (include/loom/moe.h, docs/MOE.md): the config, the size queries, the plan
// handle moe_routing returns, the collective calls moe_routing, moe_dispatch, moe_combine,
// moe_report, moe_dispatch_gemm and moe_layer, and the router's top-k on one GPU (moe_topk, no
// communicator). bind_moe() registers them from ext.cc's module definition.
//
// loom's C++ API takes raw pointers, so it cannot see a tensor's shape or dtype: those are checked
// here against the config (shapes and dtypes of every tensor first, then devices, then symmetric
// memory, so that a CPU tensor with the right shape proves the shape rules passed). Everything
// else (config limits, alignment, sizes in bytes, overlaps, T > max_tokens, the rules across
// nodes) is loom's own check, whose Status is raised as the matching loom.LoomError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "binding_common.h"
#include "loom/moe.h"
#include "tensor_arg.h"

namespace loom::python {
namespace {

using namespace nb::literals;

std::string num(int64_t v) { return std::to_string(v); }

std::string_view overflow_name(MoeOverflow o) { return o == MoeOverflow::kDrop ? "drop" : "error"; }

MoeOverflow overflow_of(std::string_view name, std::string_view op) {
  if (name == "error") return MoeOverflow::kError;
  if (name == "drop") return MoeOverflow::kDrop;
  invalid(op, -1, "overflow '" + std::string(name) + "': expected 'error' (nothing moves when a rank's rows exceed "
                      "the capacity) or 'drop' (rows past the capacity are dropped)");
}

MoeConfig make_config(int64_t num_experts, int top_k, int64_t hidden, std::string_view dtype, int64_t max_tokens,
                      int64_t capacity, std::string_view overflow) {
  const char* op = "MoeConfig";
  Result<DType> d = parse_dtype(dtype);
  if (!d.ok()) invalid(op, -1, "dtype '" + std::string(dtype) + "': expected bf16, fp16 or fp32");
  MoeConfig c;
  c.num_experts = num_experts;
  c.top_k = top_k;
  c.hidden = hidden;
  c.dtype = *d;
  c.max_tokens = max_tokens;
  c.capacity = capacity;
  c.overflow = overflow_of(overflow, op);
  return c;
}

std::string config_text(const MoeConfig& c) {
  return "MoeConfig(num_experts=" + num(c.num_experts) + ", top_k=" + num(c.top_k) + ", hidden=" + num(c.hidden) +
         ", dtype='" + std::string(dtype_name(c.dtype)) + "', max_tokens=" + num(c.max_tokens) +
         ", capacity=" + num(c.capacity) + ", overflow='" + std::string(overflow_name(c.overflow)) + "')";
}

// What the tensor checks need of a config on a communicator.
struct MoeShape {
  int64_t capacity = 0;       // receive rows per rank (the config's, or its default)
  int64_t local_experts = 0;  // E / W
  size_t plan_bytes = 0;      // 0: unknown (no communicator), the plan buffer's size is not checked
};

// moe_sizes' answer (its refusal raised), or without a communicator (_check_moe_args) moe.h's
// documented defaults for `world` local ranks.
MoeShape shape_of(const CommView& pc, const MoeConfig& config, std::string_view op) {
  if (pc.comm != nullptr) {
    Result<MoeSizes> s = moe_sizes(*pc.comm, config);
    check(s.status(), op, pc.rank);
    return {s->capacity, s->local_experts, s->plan_bytes};
  }
  if (pc.world < 1 || config.num_experts < 1 || config.num_experts % pc.world != 0) {
    invalid(op, pc.rank, "num_experts " + num(config.num_experts) + " is not a positive multiple of the world size " +
                             num(pc.world));
  }
  const int64_t capacity = config.capacity != 0 ? config.capacity : config.max_tokens * pc.world * config.top_k;
  return {capacity, config.num_experts / pc.world, 0};
}

// The handle moe_routing returns: loom's MoePlan (plain values) and the Python objects whose memory
// it points into, kept alive as long as the handle is (the routing lives on the device in the plan
// buffer and expert_offsets; dispatch, combine and the report read them).
struct PyMoePlan {
  MoePlan plan;
  int64_t local_experts = 0;
  const PyCommunicator* owner = nullptr;  // the communicator it was routed on (null: _check_moe_args)
  nb::object comm, config, plan_buffer, expert_offsets;
};

// A plan is only meaningful on the communicator that routed it: its workspace, peers and epochs.
void require_owner(const PyCommunicator& pc, const PyMoePlan& plan, std::string_view op) {
  if (plan.owner != &pc) {
    invalid(op, pc.rank, "the plan was made by moe_routing on another communicator; route on the one you call with");
  }
}

void require_dtype(const TensorArg& t, DType dtype, const char* whose, std::string_view op, int rank) {
  if (t.dtype != dtype) {
    invalid(op, rank, std::string(t.name) + " is " + std::string(dtype_name(t.dtype)) + " but " + whose + " is " +
                          std::string(dtype_name(dtype)));
  }
}

// topk_weights: fp32 [T, k] like topk_ids.
void require_weights(const TensorArg& w, int64_t tokens, int top_k, std::string_view op, int rank) {
  if (w.dtype != DType::kF32) {
    invalid(op, rank, "topk_weights must be float32 (the router's weights), got " + std::string(dtype_name(w.dtype)));
  }
  require_ndim(w, 2, "[T, top_k] float32", op, rank);
  require_shape(w, tokens, top_k, "[T, top_k]", op, rank);
}

// ---- moe_routing ------------------------------------------------------------------------------

struct MoeRoutingCall {
  TensorArg ids, weights, plan_buffer, offsets;
  MoeRoutingArgs args;
  MoeShape shape;
  cudaStream_t stream = nullptr;
};

// topk_ids int32 [T, k], topk_weights fp32 [T, k] or None, plan_buffer (uint8 or int32, at least
// plan_bytes), expert_offsets int32 [E/W + 1].
MoeRoutingCall prepare_moe_routing(const CommView& pc, const MoeConfig& config, nb::handle topk_ids, nb::handle topk_weights,
                                   nb::handle plan_buffer, nb::handle expert_offsets, uintptr_t stream) {
  const char* op = "moe_routing";
  const int rank = pc.rank;
  MoeRoutingCall c;
  c.shape = shape_of(pc, config, op);
  c.ids = tensor_arg(topk_ids, "topk_ids", op, rank, Elements::kInt32);
  const bool has_weights = !topk_weights.is_none();
  if (has_weights) c.weights = tensor_arg(topk_weights, "topk_weights", op, rank);
  c.plan_buffer = tensor_arg(plan_buffer, "plan_buffer", op, rank, Elements::kBytes);
  c.offsets = tensor_arg(expert_offsets, "expert_offsets", op, rank, Elements::kInt32);
  require_ndim(c.ids, 2, "[T, top_k] int32", op, rank);
  if (c.ids.dim(1) != config.top_k) {
    invalid(op, rank, "topk_ids must be [T, top_k] with the config's top_k = " + num(config.top_k) + ", got " +
                          c.ids.shape_text());
  }
  const int64_t tokens = c.ids.dim(0);
  if (has_weights) require_weights(c.weights, tokens, config.top_k, op, rank);
  if (c.shape.plan_bytes != 0 && c.plan_buffer.bytes() < c.shape.plan_bytes) {
    invalid(op, rank, "plan_buffer holds " + num(static_cast<int64_t>(c.plan_buffer.bytes())) +
                          " bytes; this config needs moe_sizes(comm, config).plan_bytes = " +
                          num(static_cast<int64_t>(c.shape.plan_bytes)));
  }
  require_ndim(c.offsets, 1, "[E/W + 1] int32", op, rank);
  if (c.offsets.dim(0) != c.shape.local_experts + 1) {
    invalid(op, rank, "expert_offsets must be [E/W + 1] = [" + num(c.shape.local_experts + 1) + "] int32, got " +
                          c.offsets.shape_text());
  }
  require_device(c.ids, pc.device, op, rank);
  if (has_weights) require_device(c.weights, pc.device, op, rank);
  require_device(c.plan_buffer, pc.device, op, rank);
  require_device(c.offsets, pc.device, op, rank);
  c.args.topk_ids = static_cast<const int32_t*>(c.ids.data);
  c.args.topk_weights = has_weights ? static_cast<const float*>(c.weights.data) : nullptr;
  c.args.num_tokens = tokens;
  c.args.plan = c.plan_buffer.data;
  c.args.expert_offsets = static_cast<int32_t*>(c.offsets.data);
  c.stream = as_stream(stream);
  return c;
}

// ---- moe_dispatch -----------------------------------------------------------------------------

struct MoeDispatchCall {
  Communicator* comm = nullptr;
  int comm_rank = -1;
  MoePlan plan;
  TensorArg x, recv_x;
  MoeDispatchOptions options;
  cudaStream_t stream = nullptr;
  Status launch() const { return moe_dispatch(*comm, plan, x.data, recv_x.data, stream, options); }
  std::string_view op() const { return "moe_dispatch"; }
  int rank() const { return comm_rank; }
};

// x [T, hidden] (T: the tokens routed) and recv_x [capacity, hidden], both of the config's dtype
// (moe_dispatch and moe_dispatch_gemm). Shapes only: the caller checks devices after its other
// tensors' shapes.
void read_token_tensors(const PyMoePlan& p, nb::handle x, nb::handle recv_x, TensorArg& tx, TensorArg& tr,
                        std::string_view op, int rank) {
  const MoeConfig& config = p.plan.config;
  tx = tensor_arg(x, "x", op, rank);
  tr = tensor_arg(recv_x, "recv_x", op, rank);
  require_ndim(tx, 2, "[T, hidden]", op, rank);
  require_ndim(tr, 2, "[capacity, hidden]", op, rank);
  require_dtype(tx, config.dtype, "the config's dtype", op, rank);
  require_dtype(tr, config.dtype, "the config's dtype", op, rank);
  require_shape(tx, p.plan.num_tokens, config.hidden, "[T, hidden] (T: the tokens given to moe_routing)", op, rank);
  require_shape(tr, p.plan.capacity, config.hidden, "[capacity, hidden]", op, rank);
}

MoeDispatchCall prepare_moe_dispatch(const CommView& pc, const PyMoePlan& p, nb::handle x, nb::handle recv_x,
                                     uintptr_t stream, int num_ctas, int arrival_ctas) {
  MoeDispatchCall c;
  const std::string_view op = c.op();
  const int rank = pc.rank;
  c.comm = pc.comm;
  c.comm_rank = rank;
  c.plan = p.plan;
  read_token_tensors(p, x, recv_x, c.x, c.recv_x, op, rank);
  require_device(c.x, pc.device, op, rank);
  require_device(c.recv_x, pc.device, op, rank);
  require_symmetric(pc, c.recv_x, "peers write the rows routed to this rank into it", op);
  c.options.num_ctas = num_ctas;
  c.options.arrival_ctas = arrival_ctas;
  c.stream = as_stream(stream);
  return c;
}

// ---- moe_combine ------------------------------------------------------------------------------

struct MoeCombineCall {
  Communicator* comm = nullptr;
  int comm_rank = -1;
  MoePlan plan;
  TensorArg expert_out, out, weights;
  MoeCombineArgs args;
  MoeCombineOptions options;
  cudaStream_t stream = nullptr;
  Status launch() const { return moe_combine(*comm, plan, args, stream, options); }
  std::string_view op() const { return "moe_combine"; }
  int rank() const { return comm_rank; }
};

// expert_out [capacity, H'] and out [T, H'] of one dtype (H' and the dtype may differ from the
// dispatch's), topk_weights fp32 [T, k] or None (the routing's weights).
MoeCombineCall prepare_moe_combine(const CommView& pc, const PyMoePlan& p, nb::handle expert_out, nb::handle out,
                                   nb::handle topk_weights, uintptr_t stream, int num_ctas) {
  MoeCombineCall c;
  const std::string_view op = c.op();
  const int rank = pc.rank;
  c.comm = pc.comm;
  c.comm_rank = rank;
  c.plan = p.plan;
  c.expert_out = tensor_arg(expert_out, "expert_out", op, rank);
  c.out = tensor_arg(out, "out", op, rank);
  const bool has_weights = !topk_weights.is_none();
  if (has_weights) c.weights = tensor_arg(topk_weights, "topk_weights", op, rank);
  require_ndim(c.expert_out, 2, "[capacity, H']", op, rank);
  require_ndim(c.out, 2, "[T, H']", op, rank);
  require_same_dtype(c.expert_out, c.out, op, rank);
  const int64_t width = c.expert_out.dim(1);
  // loom reads a width of 0 as "the config's hidden": an empty row must not stand for it.
  if (width < 1) invalid(op, rank, "expert_out " + c.expert_out.shape_text() + " has no columns");
  require_shape(c.expert_out, p.plan.capacity, width, "[capacity, H']", op, rank);
  require_shape(c.out, p.plan.num_tokens, width, "[T, H'] (T: the tokens given to moe_routing, H': expert_out's width)",
                op, rank);
  if (has_weights) require_weights(c.weights, p.plan.num_tokens, p.plan.config.top_k, op, rank);
  require_device(c.expert_out, pc.device, op, rank);
  require_device(c.out, pc.device, op, rank);
  if (has_weights) require_device(c.weights, pc.device, op, rank);
  require_symmetric(pc, c.expert_out, "the tokens' owners read their rows from it", op);
  c.args.expert_out = c.expert_out.data;
  c.args.out = c.out.data;
  c.args.topk_weights = has_weights ? static_cast<const float*>(c.weights.data) : nullptr;
  c.args.hidden = width;
  c.args.dtype = c.out.dtype;
  c.options.num_ctas = num_ctas;
  c.stream = as_stream(stream);
  return c;
}

// The options of a fused MoE kernel (MoeDispatchGemmOptions, MoeLayerOptions: the same fields).
template <class Options>
Options fused_options(std::string_view tile, int num_ctas, int push_ctas, int arrival_ctas, std::string_view op, int rank) {
  Options o{};
  o.tile = tile_of(tile, op, rank);
  o.num_ctas = num_ctas;
  o.push_ctas = push_ctas;
  o.arrival_ctas = arrival_ctas;
  return o;
}

// ---- moe_dispatch_gemm --------------------------------------------------------------------------

struct MoeDispatchGemmCall {
  Communicator* comm = nullptr;
  int comm_rank = -1;
  MoePlan plan;
  TensorArg x, recv_x, weights, out;
  MoeExpertGemm gemm;
  MoeDispatchGemmOptions options;
  cudaStream_t stream = nullptr;
  Status launch() const { return moe_dispatch_gemm(*comm, plan, x.data, recv_x.data, gemm, stream, options); }
  std::string_view op() const { return "moe_dispatch_gemm"; }
  int rank() const { return comm_rank; }
};

// x and recv_x as moe_dispatch; weights [E/W, N, hidden] (b_layout 'nk') or [E/W, hidden, N]
// ('kn') of the config's dtype; out [capacity, N] ([capacity, N / 2] with 'swiglu'), bf16, fp16
// or fp32.
MoeDispatchGemmCall prepare_moe_dispatch_gemm(const CommView& pc, const PyMoePlan& p, nb::handle x, nb::handle recv_x,
                                              nb::handle weights, nb::handle out, uintptr_t stream,
                                              std::string_view b_layout, std::string_view activation,
                                              std::string_view tile, int num_ctas, int push_ctas, int arrival_ctas) {
  MoeDispatchGemmCall c;
  const std::string_view op = c.op();
  const int rank = pc.rank;
  c.comm = pc.comm;
  c.comm_rank = rank;
  c.plan = p.plan;
  const MoeConfig& config = p.plan.config;
  const BLayout layout = layout_of(b_layout, op, rank);
  const bool kn = layout == BLayout::kKN;
  c.gemm.activation = activation_of(activation, op, rank);
  const bool swiglu = c.gemm.activation == GroupedActivation::kSwiGLU;
  read_token_tensors(p, x, recv_x, c.x, c.recv_x, op, rank);
  c.weights = tensor_arg(weights, "weights", op, rank);
  c.out = tensor_arg(out, "out", op, rank);
  const char* w_shape = kn ? "[E/W, hidden, N]" : "[E/W, N, hidden]";
  require_ndim(c.weights, 3, w_shape, op, rank);
  require_dtype(c.weights, config.dtype, "the config's dtype", op, rank);
  const int64_t n = c.weights.dim(kn ? 2 : 1), k = c.weights.dim(kn ? 1 : 2);
  if (c.weights.dim(0) != p.local_experts || k != config.hidden) {
    invalid(op, rank, "weights must be " + std::string(w_shape) + " with E/W = " + num(p.local_experts) +
                          " (this rank's experts) and hidden = " + num(config.hidden) + " (b_layout '" +
                          std::string(b_layout) + "'), got " + c.weights.shape_text());
  }
  const int64_t n_out = swiglu ? n / 2 : n;
  require_ndim(c.out, 2, swiglu ? "[capacity, N / 2]" : "[capacity, N]", op, rank);
  require_shape(c.out, p.plan.capacity, n_out, swiglu ? "[capacity, N / 2]" : "[capacity, N]", op, rank);
  require_device(c.x, pc.device, op, rank);
  require_device(c.recv_x, pc.device, op, rank);
  require_device(c.weights, pc.device, op, rank);
  require_device(c.out, pc.device, op, rank);
  require_symmetric(pc, c.recv_x, "peers write the rows routed to this rank into it", op);
  c.gemm.weights = c.weights.data;
  c.gemm.n = n;
  c.gemm.b_layout = layout;
  c.gemm.out = c.out.data;
  c.gemm.out_dtype = c.out.dtype;
  c.options = fused_options<decltype(c.options)>(tile, num_ctas, push_ctas, arrival_ctas, op, rank);
  c.stream = as_stream(stream);
  return c;
}

// ---- moe_layer ----------------------------------------------------------------------------------

struct MoeLayerCall {
  Communicator* comm = nullptr;
  int comm_rank = -1;
  MoePlan plan;
  TensorArg x, gate_up, down, recv_x, hidden, expert_out, out, shared_gate_up, shared_down, phases;
  MoeLayerWeights weights;
  MoeLayerBuffers buffers;
  MoeLayerOptions options;
  cudaStream_t stream = nullptr;
  Status launch() const { return moe_layer(*comm, plan, x.data, weights, buffers, out.data, stream, options); }
  std::string_view op() const { return "moe_layer"; }
  int rank() const { return comm_rank; }
};

// A [d0, d1, d2] tensor, or InvalidArgument naming the shape it must have and why.
void require_shape3(const TensorArg& t, int64_t d0, int64_t d1, int64_t d2, const std::string& meaning,
                    std::string_view op, int rank) {
  if (t.dim(0) != d0 || t.dim(1) != d1 || t.dim(2) != d2) {
    invalid(op, rank, std::string(t.name) + " must be " + meaning + " = [" + num(d0) + ", " + num(d1) + ", " + num(d2) +
                          "], got " + t.shape_text());
  }
}

// x and recv_x as moe_dispatch; gate_up [E/W, 2I, hidden] (gate and up rows interleaved by 8,
// loom.torch.swiglu_weights), down [E/W, hidden, I], hidden [rows, I], expert_out [rows, hidden],
// out [T, hidden], all of the config's dtype; a shared expert (both or neither): shared_gate_up
// [2I, hidden], shared_down [hidden, I]. rows = moe_layer_rows(capacity, max_tokens, shared expert
// or not). I is read from gate_up (its rows / 2) and down must agree; loom checks I's own rule (a
// positive multiple of 8). phases (diagnostics, optional): uint8 or int32 device memory of at least
// sm_count MoeLayerPhaseRecords (64 bytes each).
MoeLayerCall prepare_moe_layer(const CommView& pc, const PyMoePlan& p, nb::handle x, nb::handle gate_up, nb::handle down,
                               nb::handle recv_x, nb::handle hidden, nb::handle expert_out, nb::handle out,
                               uintptr_t stream, std::string_view tile, int num_ctas, int push_ctas, int arrival_ctas,
                               nb::handle shared_gate_up, nb::handle shared_down, nb::handle phases, int sm_count) {
  MoeLayerCall c{};
  const std::string_view op = c.op();
  const int rank = pc.rank;
  c.comm = pc.comm;
  c.comm_rank = rank;
  c.plan = p.plan;
  const MoeConfig& config = p.plan.config;
  const int64_t experts = p.local_experts, capacity = p.plan.capacity;
  read_token_tensors(p, x, recv_x, c.x, c.recv_x, op, rank);
  c.gate_up = tensor_arg(gate_up, "gate_up", op, rank);
  c.down = tensor_arg(down, "down", op, rank);
  c.hidden = tensor_arg(hidden, "hidden", op, rank);
  c.expert_out = tensor_arg(expert_out, "expert_out", op, rank);
  c.out = tensor_arg(out, "out", op, rank);
  require_ndim(c.gate_up, 3, "[E/W, 2I, hidden]", op, rank);
  require_ndim(c.down, 3, "[E/W, hidden, I]", op, rank);
  require_ndim(c.hidden, 2, "[capacity, I]", op, rank);
  require_ndim(c.expert_out, 2, "[capacity, hidden]", op, rank);
  require_ndim(c.out, 2, "[T, hidden]", op, rank);
  // One dtype for the whole layer: loom's MoeLayerWeights and MoeLayerBuffers carry none of their own.
  for (const TensorArg* t : {&c.gate_up, &c.down, &c.hidden, &c.expert_out, &c.out}) {
    require_dtype(*t, config.dtype, "the config's dtype", op, rank);
  }
  const int64_t gate_up_rows = c.gate_up.dim(1);
  if (c.gate_up.dim(0) != experts || c.gate_up.dim(2) != config.hidden || gate_up_rows % 2 != 0) {
    invalid(op, rank, "gate_up must be [E/W, 2I, hidden] with E/W = " + num(experts) + " (this rank's experts), an even "
                          "2I (gate and up rows interleaved by 8) and hidden = " + num(config.hidden) + ", got " +
                          c.gate_up.shape_text());
  }
  const int64_t inter = gate_up_rows / 2;
  require_shape3(c.down, experts, config.hidden, inter,
                 "[E/W, hidden, I] (I = " + num(inter) + ": half of gate_up's " + num(gate_up_rows) + " rows)", op,
                 rank);
  if (shared_gate_up.is_none() != shared_down.is_none()) {
    invalid(op, rank, "shared_gate_up and shared_down go together (both: a shared expert; neither: none)");
  }
  const bool shared = !shared_gate_up.is_none();
  if (shared) {
    c.shared_gate_up = tensor_arg(shared_gate_up, "shared_gate_up", op, rank);
    c.shared_down = tensor_arg(shared_down, "shared_down", op, rank);
    require_ndim(c.shared_gate_up, 2, "[2I, hidden]", op, rank);
    require_ndim(c.shared_down, 2, "[hidden, I]", op, rank);
    require_shape(c.shared_gate_up, 2 * inter, config.hidden, "[2I, hidden] (I = " + num(inter) + ", gate_up's)", op,
                  rank);
    require_shape(c.shared_down, config.hidden, inter, "[hidden, I] (I = " + num(inter) + ", gate_up's)", op, rank);
    require_dtype(c.shared_gate_up, config.dtype, "the config's dtype", op, rank);
    require_dtype(c.shared_down, config.dtype, "the config's dtype", op, rank);
  }
  const int64_t rows = moe_layer_rows(capacity, config.max_tokens, shared);
  const std::string rows_text = shared ? "rows (moe_layer_rows(capacity, max_tokens, True) = " + num(rows) + ")"
                                       : "capacity";
  require_shape(c.hidden, rows, inter, "[" + rows_text + ", I]", op, rank);
  require_shape(c.expert_out, rows, config.hidden, "[" + rows_text + ", hidden]", op, rank);
  require_shape(c.out, p.plan.num_tokens, config.hidden, "[T, hidden] (T: the tokens given to moe_routing)", op, rank);
  if (!phases.is_none()) {  // diagnostics: one MoeLayerPhaseRecord per SM
    c.phases = tensor_arg(phases, "phases", op, rank, Elements::kBytes);
    const size_t need = static_cast<size_t>(sm_count) * sizeof(MoeLayerPhaseRecord);
    if (c.phases.bytes() < need) {
      invalid(op, rank, "phases must hold one 64-byte record per SM: at least " + num(static_cast<int64_t>(need)) +
                            " bytes for " + num(sm_count) + " SMs, got " + num(static_cast<int64_t>(c.phases.bytes())) +
                            " (" + c.phases.shape_text() + ")");
    }
  }
  for (const TensorArg* t : {&c.x, &c.gate_up, &c.down, &c.recv_x, &c.hidden, &c.expert_out, &c.out}) {
    require_device(*t, pc.device, op, rank);
  }
  if (shared) {
    require_device(c.shared_gate_up, pc.device, op, rank);
    require_device(c.shared_down, pc.device, op, rank);
  }
  if (!phases.is_none()) require_device(c.phases, pc.device, op, rank);
  require_symmetric(pc, c.recv_x, "peers write the rows routed to this rank into it", op);
  require_symmetric(pc, c.expert_out, "the tokens' owners read their rows from it", op);
  c.weights.gate_up = c.gate_up.data;
  c.weights.down = c.down.data;
  c.weights.intermediate = inter;
  c.weights.shared_gate_up = shared ? c.shared_gate_up.data : nullptr;
  c.weights.shared_down = shared ? c.shared_down.data : nullptr;
  c.buffers.recv_x = c.recv_x.data;
  c.buffers.hidden = c.hidden.data;
  c.buffers.expert_out = c.expert_out.data;
  c.options = fused_options<decltype(c.options)>(tile, num_ctas, push_ctas, arrival_ctas, op, rank);
  c.options.phases = static_cast<MoeLayerPhaseRecord*>(c.phases.data);  // null without phases
  c.stream = as_stream(stream);
  return c;
}

// ---- moe_topk (one GPU, no communicator) ------------------------------------------------------

MoeScoring scoring_of(std::string_view name, std::string_view op) {
  if (name == "softmax") return MoeScoring::kSoftmax;
  if (name == "sigmoid") return MoeScoring::kSigmoid;
  invalid(op, -1, "scoring '" + std::string(name) + "': expected 'softmax' (over all E logits) or 'sigmoid' (each "
                      "logit on its own)");
}

struct MoeTopkCall {
  TensorArg logits, ids, weights;
  MoeTopkArgs args;
  cudaStream_t stream = nullptr;
  Status launch() const { return moe_topk(args, stream); }
  std::string_view op() const { return "moe_topk"; }
  int rank() const { return -1; }
};

// logits [T, E] (bf16, fp16 or fp32), topk_ids int32 [T, top_k], topk_weights fp32 [T, top_k]: the
// shapes and dtypes only (the scoring name first); require_topk_devices checks the devices. The
// values (E and top_k in range, alignment, overlaps) are loom's own check, moe_topk_can_implement.
MoeTopkCall read_moe_topk(nb::handle logits, nb::handle topk_ids, nb::handle topk_weights, int top_k,
                          std::string_view scoring, bool renormalize) {
  MoeTopkCall c;
  const std::string_view op = c.op();
  const int rank = c.rank();
  c.args.scoring = scoring_of(scoring, op);
  c.logits = tensor_arg(logits, "logits", op, rank);
  c.ids = tensor_arg(topk_ids, "topk_ids", op, rank, Elements::kInt32);
  c.weights = tensor_arg(topk_weights, "topk_weights", op, rank);
  require_ndim(c.logits, 2, "[T, E]", op, rank);
  require_ndim(c.ids, 2, "[T, top_k] int32", op, rank);
  const int64_t tokens = c.logits.dim(0);
  require_shape(c.ids, tokens, top_k, "[T, top_k] (T: logits' rows)", op, rank);
  require_weights(c.weights, tokens, top_k, op, rank);
  c.args.logits = c.logits.data;
  c.args.dtype = c.logits.dtype;
  c.args.num_tokens = tokens;
  c.args.num_experts = c.logits.dim(1);
  c.args.top_k = top_k;
  c.args.renormalize = renormalize;
  c.args.topk_ids = static_cast<int32_t*>(c.ids.data);
  c.args.topk_weights = static_cast<float*>(c.weights.data);
  return c;
}

// All three on one CUDA device, logits' (grouped_gemm's rule: the call runs on its inputs' GPU).
void require_topk_devices(const MoeTopkCall& c) {
  require_device(c.logits, -1, c.op(), c.rank());
  require_device(c.ids, c.logits.device, c.op(), c.rank());
  require_device(c.weights, c.logits.device, c.op(), c.rank());
}

MoeTopkCall prepare_moe_topk(nb::handle logits, nb::handle topk_ids, nb::handle topk_weights, uintptr_t stream,
                             int top_k, std::string_view scoring, bool renormalize) {
  MoeTopkCall c = read_moe_topk(logits, topk_ids, topk_weights, top_k, scoring, renormalize);
  require_topk_devices(c);
  c.stream = as_stream(stream);
  return c;
}

}  // namespace

void bind_moe(nb::module_& m) {
  nb::class_<MoeConfig>(m, "MoeConfig",
                        "The shape of an MoE step (loom::MoeConfig); every rank passes the same one. See loom.MoeConfig.")
      .def(
          "__init__",
          [](MoeConfig* self, int64_t num_experts, int top_k, int64_t hidden, std::string_view dtype,
             int64_t max_tokens, int64_t capacity, std::string_view overflow) {
            new (self) MoeConfig(make_config(num_experts, top_k, hidden, dtype, max_tokens, capacity, overflow));
          },
          "num_experts"_a, "top_k"_a, "hidden"_a, "dtype"_a, "max_tokens"_a, "capacity"_a = 0, "overflow"_a = "error")
      .def_ro("num_experts", &MoeConfig::num_experts)
      .def_ro("top_k", &MoeConfig::top_k)
      .def_ro("hidden", &MoeConfig::hidden)
      .def_prop_ro("dtype", [](const MoeConfig& c) { return std::string(dtype_name(c.dtype)); })
      .def_ro("max_tokens", &MoeConfig::max_tokens)
      .def_ro("capacity", &MoeConfig::capacity)
      .def_prop_ro("overflow", [](const MoeConfig& c) { return std::string(overflow_name(c.overflow)); })
      .def("__repr__", &config_text);

  nb::class_<MoeSizes>(m, "MoeSizes", "What a config needs on a communicator (moe_sizes).")
      .def_ro("capacity", &MoeSizes::capacity)
      .def_ro("local_experts", &MoeSizes::local_experts)
      .def_ro("plan_bytes", &MoeSizes::plan_bytes)
      .def_ro("recv_bytes", &MoeSizes::recv_bytes)
      .def_ro("workspace_bytes", &MoeSizes::workspace_bytes)
      .def("__repr__", [](const MoeSizes& s) {
        return "MoeSizes(capacity=" + num(s.capacity) + ", local_experts=" + num(s.local_experts) +
               ", plan_bytes=" + num(static_cast<int64_t>(s.plan_bytes)) + ", recv_bytes=" +
               num(static_cast<int64_t>(s.recv_bytes)) + ", workspace_bytes=" +
               num(static_cast<int64_t>(s.workspace_bytes)) + ")";
      });

  nb::class_<MoeReport>(m, "MoeReport", "This rank's counts from the device after a routing (moe_report).")
      .def_ro("recv_rows", &MoeReport::recv_rows)
      .def_ro("kept_rows", &MoeReport::kept_rows)
      .def_ro("dropped_rows", &MoeReport::dropped_rows)
      .def_ro("dropped_slots", &MoeReport::dropped_slots)
      .def_ro("max_recv_rows", &MoeReport::max_recv_rows)
      .def("__repr__", [](const MoeReport& r) {
        return "MoeReport(recv_rows=" + num(r.recv_rows) + ", kept_rows=" + num(r.kept_rows) + ", dropped_rows=" +
               num(r.dropped_rows) + ", dropped_slots=" + num(r.dropped_slots) + ", max_recv_rows=" +
               num(r.max_recv_rows) + ")";
      });

  nb::class_<PyMoePlan>(m, "MoePlan",
                        "The routing's handle (made by moe_routing only); keeps its plan buffer and expert_offsets "
                        "alive. Valid for the communicator that routed it until the next routing into its buffers.")
      .def_prop_ro("config", [](const PyMoePlan& p) { return p.config; })
      .def_prop_ro("num_tokens", [](const PyMoePlan& p) { return p.plan.num_tokens; })
      .def_prop_ro("capacity", [](const PyMoePlan& p) { return p.plan.capacity; })
      .def_prop_ro("local_experts", [](const PyMoePlan& p) { return p.local_experts; })
      .def_prop_ro("plan_buffer", [](const PyMoePlan& p) { return p.plan_buffer; })
      .def_prop_ro("expert_offsets", [](const PyMoePlan& p) { return p.expert_offsets; })
      .def("__repr__", [](const PyMoePlan& p) {
        return "<loom.MoePlan rank " + num(p.owner != nullptr ? p.owner->rank : -1) + ", " + num(p.plan.num_tokens) +
               " tokens, capacity " + num(p.plan.capacity) + ", " + num(p.local_experts) + " local experts>";
      });

  m.def(
      "moe_can_implement",
      [](PyCommunicator& pc, const MoeConfig& config) -> std::optional<std::tuple<std::string, std::string>> {
        Status s = moe_can_implement(pc.get("moe_can_implement"), config);
        if (s.ok()) return std::nullopt;
        return std::make_tuple(std::string(status_code_name(s.code())), s.message());
      },
      "comm"_a, "config"_a, "None when the config can run on comm (host checks only), else (status code, reason).");
  m.def(
      "moe_sizes",
      [](PyCommunicator& pc, const MoeConfig& config) {
        Result<MoeSizes> s = moe_sizes(pc.get("moe_sizes"), config);
        check(s.status(), "moe_sizes", pc.rank);
        return *s;
      },
      "comm"_a, "config"_a, "The sizes a config needs on comm (capacity, E/W, plan, receive and workspace bytes).");
  m.def(
      "moe_reserve_workspace",
      [](PyCommunicator& pc, const MoeConfig& config, uintptr_t stream) {
        const char* op = "moe_reserve_workspace";
        Communicator& comm = pc.get(op);
        check(without_gil([&] { return moe_reserve_workspace(comm, config, as_stream(stream)); }), op, pc.rank);
      },
      "comm"_a, "config"_a, "stream"_a,
      "Collective: grows loom's symmetric workspace for the config now (before CUDA-graph capture).");
  m.def(
      "moe_routing",
      [](PyCommunicator& pc, nb::handle_t<MoeConfig> config, nb::handle topk_ids, nb::handle plan_buffer,
         nb::handle expert_offsets, uintptr_t stream, nb::handle topk_weights) {
        const char* op = "moe_routing";
        const MoeConfig& cfg = nb::cast<const MoeConfig&>(config);
        const CommView view = view_of(pc, op);
        MoeRoutingCall c = prepare_moe_routing(view, cfg, topk_ids, topk_weights, plan_buffer, expert_offsets, stream);
        Result<MoePlan> plan = [&] {
          nb::gil_scoped_release release;
          return moe_routing(*view.comm, cfg, c.args, c.stream);
        }();
        check(plan.status(), op, pc.rank);
        return PyMoePlan{*plan, c.shape.local_experts, &pc, nb::find(&pc), nb::borrow(config), nb::borrow(plan_buffer),
                         nb::borrow(expert_offsets)};
      },
      "comm"_a, "config"_a, "topk_ids"_a.none(), "plan_buffer"_a.none(), "expert_offsets"_a.none(), "stream"_a,
      "topk_weights"_a.none() = nb::none(),
      "Collective: routes every rank's top-k expert ids on the device; returns the plan for dispatch and combine.");
  m.def(
      "moe_dispatch",
      [](PyCommunicator& pc, const PyMoePlan& plan, nb::handle x, nb::handle recv_x, uintptr_t stream, int num_ctas,
         int arrival_ctas) {
        require_owner(pc, plan, "moe_dispatch");
        run(prepare_moe_dispatch(view_of(pc, "moe_dispatch"), plan, x, recv_x, stream, num_ctas, arrival_ctas));
      },
      "comm"_a, "plan"_a, "x"_a.none(), "recv_x"_a.none(), "stream"_a, "num_ctas"_a = 0, "arrival_ctas"_a = 0,
      "Collective: sends x's rows [T, hidden] to their experts' ranks, into recv_x (symmetric [capacity, hidden]).");
  m.def(
      "moe_combine",
      [](PyCommunicator& pc, const PyMoePlan& plan, nb::handle expert_out, nb::handle out, uintptr_t stream,
         nb::handle topk_weights, int num_ctas) {
        require_owner(pc, plan, "moe_combine");
        run(prepare_moe_combine(view_of(pc, "moe_combine"), plan, expert_out, out, topk_weights, stream, num_ctas));
      },
      "comm"_a, "plan"_a, "expert_out"_a.none(), "out"_a.none(), "stream"_a, "topk_weights"_a.none() = nb::none(),
      "num_ctas"_a = 0,
      "Collective: out[t] = sum over t's slots j of w[t, j] * expert_out[row of (t, j)] (expert_out symmetric), fp32.");
  m.def(
      "moe_report",
      [](PyCommunicator& pc, const PyMoePlan& plan, uintptr_t stream) {
        const char* op = "moe_report";
        Communicator& comm = pc.get(op);
        require_owner(pc, plan, op);
        Result<MoeReport> r = [&] {
          nb::gil_scoped_release release;  // waits (bounded) for the stream
          return moe_report(comm, plan.plan, as_stream(stream));
        }();
        check(r.status(), op, pc.rank);
        check(r->status, op, pc.rank);  // what the device found: bad expert ids, a rank over its capacity
        return *r;
      },
      "comm"_a, "plan"_a, "stream"_a,
      "Waits for the stream and returns this rank's counts; raises what the routing found on the device.");
  m.def(
      "moe_dispatch_gemm",
      [](PyCommunicator& pc, const PyMoePlan& plan, nb::handle x, nb::handle recv_x, nb::handle weights,
         nb::handle out, uintptr_t stream, std::string_view b_layout, std::string_view activation,
         std::string_view tile, int num_ctas, int push_ctas, int arrival_ctas, bool expert_groups) {
        require_owner(pc, plan, "moe_dispatch_gemm");
        MoeDispatchGemmCall call = prepare_moe_dispatch_gemm(view_of(pc, "moe_dispatch_gemm"), plan, x, recv_x, weights,
                                                             out, stream, b_layout, activation, tile, num_ctas,
                                                             push_ctas, arrival_ctas);
        call.options.expert_groups = expert_groups;
        run(call);
      },
      "comm"_a, "plan"_a, "x"_a.none(), "recv_x"_a.none(), "weights"_a.none(), "out"_a.none(), "stream"_a,
      "b_layout"_a = "nk", "activation"_a = "none", "tile"_a = "auto", "num_ctas"_a = 0, "push_ctas"_a = 0,
      "arrival_ctas"_a = 0, "expert_groups"_a = true,
      "Collective: moe_dispatch and, in the same kernel, out = recv_x_e @ weights_e^T for every local expert e.");
  m.def(
      "moe_layer",
      [](PyCommunicator& pc, const PyMoePlan& plan, nb::handle x, nb::handle gate_up, nb::handle down,
         nb::handle recv_x, nb::handle hidden, nb::handle expert_out, nb::handle out, uintptr_t stream,
         std::string_view tile, int num_ctas, int push_ctas, int arrival_ctas, nb::handle shared_gate_up,
         nb::handle shared_down, nb::handle phases, bool swap_tails, bool expert_groups) {
        require_owner(pc, plan, "moe_layer");
        MoeLayerCall call = prepare_moe_layer(view_of(pc, "moe_layer"), plan, x, gate_up, down, recv_x, hidden,
                                              expert_out, out, stream, tile, num_ctas, push_ctas, arrival_ctas,
                                              shared_gate_up, shared_down, phases, pc.sm_count);
        call.options.swap_tails = swap_tails;
        call.options.expert_groups = expert_groups;
        run(call);
      },
      "comm"_a, "plan"_a, "x"_a.none(), "gate_up"_a.none(), "down"_a.none(), "recv_x"_a.none(), "hidden"_a.none(),
      "expert_out"_a.none(), "out"_a.none(), "stream"_a, "tile"_a = "auto", "num_ctas"_a = 0, "push_ctas"_a = 0,
      "arrival_ctas"_a = 0, "shared_gate_up"_a.none() = nb::none(), "shared_down"_a.none() = nb::none(),
      "phases"_a.none() = nb::none(), "swap_tails"_a = true, "expert_groups"_a = true,
      "Collective: the whole MoE FFN step in one kernel: out[t] = sum_j w[t, j] * "
      "(silu(x gate^T) * (x up^T)) down^T over t's routed experts, plus a shared expert's "
      "FFN of x[t] when shared_gate_up and shared_down are given. phases: diagnostics, one 64-byte "
      "record per SM (loom.moe_layer_phases reads them).");
  m.def("moe_layer_rows", &moe_layer_rows, "capacity"_a, "max_tokens"_a, "shared_expert"_a,
        "The rows of moe_layer's hidden and expert_out: capacity, or with a shared expert align_up(capacity, 128) + "
        "max_tokens.");

  m.def(
      "moe_topk",
      [](nb::handle logits, nb::handle topk_ids, nb::handle topk_weights, uintptr_t stream, int top_k,
         std::string_view scoring, bool renormalize) {
        run(prepare_moe_topk(logits, topk_ids, topk_weights, stream, top_k, scoring, renormalize));
      },
      "logits"_a.none(), "topk_ids"_a.none(), "topk_weights"_a.none(), "stream"_a, "top_k"_a,
      "scoring"_a = "softmax", "renormalize"_a = false,
      "The router's top-k on one GPU (no communicator): topk_ids [T, k] the k largest logits of [T, E] (largest "
      "first, ties to the lower id), topk_weights their softmax over E or sigmoid (renormalize: / their sum).");

  // The tensor checks of an MoE call without a communicator and without launching: `world`
  // stands in for the local world size (capacity and E/W from moe.h's defaults; the plan buffer's
  // size unchecked; rank 0 in messages) and `num_tokens` for the routed tokens. CPU tensors with
  // the right shapes fail only on the device check.
  m.def(
      "_check_moe_args",
      [](const std::string& op, const MoeConfig& config, int world, int64_t num_tokens, nb::tuple tensors,
         std::string_view b_layout, std::string_view activation) {
        auto t = [&](size_t i) { return i < tensors.size() ? nb::handle(tensors[i]) : nb::handle(Py_None); };
        const CommView fake{nullptr, 0, world, world, -1};
        if (op == "moe_routing") {
          (void)prepare_moe_routing(fake, config, t(0), t(1), t(2), t(3), 0);
          return;
        }
        const MoeShape shape = shape_of(fake, config, op);
        PyMoePlan plan;
        plan.plan = MoePlan{config, shape.capacity, num_tokens, nullptr, nullptr};
        plan.local_experts = shape.local_experts;
        if (op == "moe_dispatch") {
          (void)prepare_moe_dispatch(fake, plan, t(0), t(1), 0, 0, 0);
        } else if (op == "moe_combine") {
          (void)prepare_moe_combine(fake, plan, t(0), t(1), t(2), 0, 0);
        } else if (op == "moe_dispatch_gemm") {
          (void)prepare_moe_dispatch_gemm(fake, plan, t(0), t(1), t(2), t(3), 0, b_layout, activation, "auto", 0, 0, 0);
        } else if (op == "moe_layer") {
          // phases (t(9)): its type, and its size against one SM (the fake has no GPU).
          (void)prepare_moe_layer(fake, plan, t(0), t(1), t(2), t(3), t(4), t(5), t(6), 0, "auto", 0, 0, 0, t(7), t(8),
                                  t(9), 1);
        } else {
          invalid("_check_moe_args", -1, "unknown op '" + op + "'");
        }
      },
      "op"_a, "config"_a, "world"_a, "num_tokens"_a, "tensors"_a, "b_layout"_a = "nk", "activation"_a = "none",
      "The tensor checks of an MoE call (tensors in the binding's order), without a communicator or a launch.");

  // moe_topk's checks without launching: the binding's shape and dtype checks, then loom's host
  // checks (moe_topk_can_implement: E and top_k in range, alignment, overlaps; no CUDA call), then
  // the device checks. So on a machine without a GPU, CPU tensors reach loom's value rules, and
  // tensors that pass them fail only on the device check. (The call itself checks the devices
  // before loom does; on CUDA tensors both orders raise the same error.)
  m.def(
      "_check_moe_topk",
      [](nb::handle logits, nb::handle topk_ids, nb::handle topk_weights, int top_k, std::string_view scoring,
         bool renormalize) {
        const MoeTopkCall c = read_moe_topk(logits, topk_ids, topk_weights, top_k, scoring, renormalize);
        check(moe_topk_can_implement(c.args), c.op(), c.rank());
        require_topk_devices(c);
      },
      "logits"_a.none(), "topk_ids"_a.none(), "topk_weights"_a.none(), "top_k"_a, "scoring"_a = "softmax",
      "renormalize"_a = false,
      "moe_topk's checks (the binding's, then loom's host checks, then the devices), without a launch.");
}

}  // namespace loom::python
