"""loom's expert-parallel (MoE) operators on any DLPack CUDA tensors, with explicit outputs
(include/loom/moe.h; the design is docs/MOE.md).

Experts are split contiguously over the ranks of the job: with E experts and W ranks, rank r
holds experts [r*E/W, (r+1)*E/W), its "local experts" 0 .. E/W - 1 (ranks counted node-major, as
torchrun numbers them). Across nodes a token row crosses the network once per node holding one of
its experts (docs/MOE.md, "Across nodes"). One MoE step on every rank:

    config = loom.MoeConfig(num_experts=64, top_k=8, hidden=4096, dtype=torch.bfloat16, max_tokens=4096)
    bufs = loom.torch.moe_buffers(comm, config)        # once per config (collective: symmetric memory)
    plan = loom.moe_routing(comm, config, topk_ids, topk_weights=topk_weights,
                            plan_buffer=bufs.plan_buffer, expert_offsets=bufs.expert_offsets)
    loom.moe_dispatch(comm, plan, x, bufs.recv_x)      # token rows -> their experts' ranks
    # local expert i: rows bufs.expert_offsets[i] .. [i+1] of recv_x -> the same rows of expert_out
    loom.moe_combine(comm, plan, bufs.expert_out, out) # out[t] = sum_j w[t, j] * expert_out[row(t, j)]
    loom.moe_report(comm, plan)                        # optional; waits, raises what the GPU found

The router's top-k, on one GPU and before any of them (no communicator; ``loom.torch.moe_topk``
allocates its outputs):

    loom.moe_topk(router_logits, topk_ids, topk_weights, top_k=8)   # [T, E] -> ids, weights [T, 8]

Within one node the whole FFN step (dispatch, gate/up GEMM with SwiGLU, down GEMM, weighted
combine) is one call, on the same plan:

    bufs = loom.torch.moe_buffers(comm, config, hidden_intermediate=I)   # adds hidden [capacity, I]
    loom.moe_layer(comm, plan, x, gate_up, down, bufs.recv_x, bufs.hidden, bufs.expert_out, out)

Rules every call here follows:

- Collective (all but moe_topk, which runs on one GPU): every rank of the communicator calls moe_routing, moe_dispatch, moe_combine,
  moe_dispatch_gemm, moe_layer and moe_reserve_workspace in the same order, with the same config (a rank
  with another config fails the launch instead of corrupting memory). Across nodes moe_combine
  needs its plan's dispatch (moe_dispatch or moe_dispatch_gemm) to have run last and the
  routing's weights (topk_weights None); and no kernel should load for the first time (a first
  torch op, say) while an MoE call still runs there: CUDA's lazy loading would wait for it
  (docs/NETWORK.md, "A hazard"; synchronize first, or set CUDA_MODULE_LOADING=EAGER).
- Asynchronous on ``stream`` (default: the current stream of the tensors' framework). moe_report
  alone waits for the stream.
- Symmetric memory (``comm.empty``, ``loom.torch.empty``, ``loom.torch.moe_buffers``) for the two
  buffers peers touch: ``recv_x`` (peers write the rows routed to this rank into it) and
  ``expert_out`` (the tokens' owners read from it). Everything else (x, out, topk_ids,
  topk_weights, the plan buffer, expert_offsets, the expert weights, moe_layer's hidden) is
  ordinary device memory of the communicator's GPU.
- Bad input the host can see (shapes, dtypes, devices, non-symmetric buffers, a config loom does
  not implement) raises ``loom.InvalidArgument`` or ``loom.Unsupported`` before anything is
  launched. Expert ids live on the GPU: an id outside [0, E) other than -1, or a rank receiving
  more rows than its capacity with overflow 'error', makes every rank move nothing (recv_x and
  out untouched, expert_offsets all 0); moe_report then raises ``loom.InvalidArgument`` on every
  rank, naming the rank, token, slot and id (or the rank and its rows). The communicator stays
  usable.
"""

from __future__ import annotations

import struct
from typing import Any, List, Optional, Tuple, TypeVar

from . import _C
from ._comm import CommLike, as_communicator, dtype_name
from ._errors import LoomError, _from_status, _invalid
from ._ops import _device_of, _stream
from ._streams import StreamArg, default_stream, stream_handle
from ._types import DLPackArray, DTypeLike

Out = TypeVar("Out", bound=DLPackArray)

MoePlan = _C.MoePlan
MoeSizes = _C.MoeSizes
MoeReport = _C.MoeReport

# The C++ fields' ranges: MoeConfig::top_k is an int, the other counts int64_t.
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


class MoeConfig(_C.MoeConfig):
    """The shape of an MoE step; every rank passes the same one.

    num_experts: E over all ranks, a multiple of the world size (rank r holds experts
    [r*E/W, (r+1)*E/W)). top_k: k, 1 .. min(E, 32). hidden: H, elements per token row (H times the
    element size a multiple of 16 bytes). dtype: of the token rows (bfloat16, float16 or float32
    as a name, torch or numpy dtype; dispatch moves bits, moe_dispatch_gemm takes bf16 / fp16).
    max_tokens: the most tokens one rank routes per call. capacity: receive rows per rank; 0 means
    max_tokens * W * k, which never overflows (moe_report's max_recv_rows says what a smaller one
    must hold). overflow: 'error' (a rank over its capacity makes the call move nothing, reported
    by moe_report) or 'drop' (rows past the capacity are dropped and counted; their slots add
    nothing in combine). Only types are checked here; loom checks the values against a
    communicator (moe_can_implement, moe_sizes, every call)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, dtype: DTypeLike, max_tokens: int,
                 capacity: int = 0, overflow: str = "error") -> None:
        for name, value, (low, high) in (("num_experts", num_experts, _INT64), ("top_k", top_k, _INT32),
                                         ("hidden", hidden, _INT64), ("max_tokens", max_tokens, _INT64),
                                         ("capacity", capacity, _INT64)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise _invalid("MoeConfig", f"{name} must be an int, got {type(value).__name__}")
            if not low <= value <= high:
                raise _invalid("MoeConfig", f"{name} = {value} does not fit its C++ field [{low}, {high}]")
        if not isinstance(overflow, str):
            raise _invalid("MoeConfig", f"overflow must be 'error' or 'drop', got {type(overflow).__name__}")
        super().__init__(num_experts, top_k, hidden, dtype_name(dtype), max_tokens, capacity, overflow)


def _config(config: MoeConfig, op: str, rank: int) -> MoeConfig:
    if not isinstance(config, _C.MoeConfig):
        raise _invalid(op, f"config must be a loom.MoeConfig, got {type(config).__module__}.{type(config).__qualname__}",
                       rank)
    return config


def _plan(plan: MoePlan, op: str, rank: int) -> MoePlan:
    if not isinstance(plan, _C.MoePlan):
        raise _invalid(op, f"plan must be the loom.MoePlan moe_routing returned, got "
                           f"{type(plan).__module__}.{type(plan).__qualname__}", rank)
    return plan


def moe_can_implement(comm: CommLike, config: MoeConfig) -> Optional[LoomError]:
    """None when `config` can run on `comm` (host checks only: E a multiple of the world size,
    k <= min(E, 32), E <= 1024, rows a multiple of 16 bytes, at most 32 ranks per node, ...);
    otherwise the error a call would raise (returned, not raised). Nothing is allocated or
    launched."""
    c = as_communicator(comm, "moe_can_implement")
    failure = _C.moe_can_implement(c._c, _config(config, "moe_can_implement", c.rank))
    if failure is None:
        return None
    code, reason = failure
    return _from_status(code, "moe_can_implement", c.rank, reason)


def moe_sizes(comm: CommLike, config: MoeConfig) -> MoeSizes:
    """What `config` needs on `comm`: ``capacity`` (receive rows per rank), ``local_experts``
    (E / W), ``plan_bytes`` (the plan buffer), ``recv_bytes`` (recv_x: capacity * hidden * element
    size) and ``workspace_bytes`` (loom's symmetric workspace for the MoE family). Raises the
    config's refusal (``loom.InvalidArgument`` / ``loom.Unsupported``)."""
    c = as_communicator(comm, "moe_sizes")
    return _C.moe_sizes(c._c, _config(config, "moe_sizes", c.rank))


def moe_reserve_workspace(comm: CommLike, config: MoeConfig, *, stream: StreamArg = None) -> None:
    """Collective: grows loom's symmetric workspace for `config` now. The calls grow it on first
    use, which cannot happen inside CUDA-graph capture: reserve every config you capture first,
    on every rank in the same order. `stream` (default: the current torch or CuPy stream): where
    the growth waits for earlier work."""
    c = as_communicator(comm, "moe_reserve_workspace")
    handle = default_stream(c.device) if stream is None else stream_handle(stream, "moe_reserve_workspace", c.device,
                                                                            c.rank)
    _C.moe_reserve_workspace(c._c, _config(config, "moe_reserve_workspace", c.rank), handle)


def moe_routing(comm: CommLike, config: MoeConfig, topk_ids: DLPackArray, *, plan_buffer: DLPackArray,
                expert_offsets: DLPackArray, topk_weights: Optional[DLPackArray] = None,
                stream: StreamArg = None) -> MoePlan:
    """Collective: routes this rank's tokens on the GPU (no host synchronization) and returns the
    plan that moe_dispatch, moe_combine, moe_dispatch_gemm and moe_report take.

    topk_ids: int32 [T, k] (T <= max_tokens, may differ per rank and be 0), each token's expert
    ids in [0, E), -1 marking an unused slot. topk_weights: float32 [T, k], the router's weights
    combine applies (None: every weight 1). plan_buffer: uint8 or int32 device memory of at least
    ``moe_sizes(comm, config).plan_bytes`` (16-byte aligned), written here and read by the later
    calls: leave it untouched until the last call using the plan. expert_offsets: int32 [E/W + 1],
    written here on the GPU: local expert i owns receive rows [expert_offsets[i],
    expert_offsets[i+1]); expert_offsets[E/W] is the number of rows received. The plan keeps the
    plan buffer and expert_offsets alive (``plan.plan_buffer``, ``plan.expert_offsets``).
    ``loom.torch.moe_buffers`` allocates both."""
    c = as_communicator(comm, "moe_routing")
    cfg = _config(config, "moe_routing", c.rank)
    return _C.moe_routing(c._c, cfg, topk_ids, plan_buffer, expert_offsets,
                          _stream(stream, topk_ids, "moe_routing", c.device, c.rank), topk_weights)


def moe_dispatch(comm: CommLike, plan: MoePlan, x: DLPackArray, recv_x: Out, *, stream: StreamArg = None,
                 num_ctas: int = 0, arrival_ctas: int = 0) -> Out:
    """Collective: sends each token row of x to the ranks of its experts, into their recv_x.

    x: [T, hidden] of the config's dtype (T: the tokens given to moe_routing). recv_x: symmetric
    [capacity, hidden], same dtype, the same allocation order on every rank. Rows are grouped by
    local expert (expert i: rows expert_offsets[i] .. expert_offsets[i+1]), inside an expert by
    source rank, token and slot; rows past expert_offsets[E/W] are not written. A token bound for
    several experts of one rank crosses NVLink once. num_ctas (0: every SM) and arrival_ctas (0:
    the planner's) tune the kernel."""
    c = as_communicator(comm, "moe_dispatch")
    _C.moe_dispatch(c._c, _plan(plan, "moe_dispatch", c.rank), x, recv_x,
                    _stream(stream, x, "moe_dispatch", c.device, c.rank), num_ctas, arrival_ctas)
    return recv_x


def moe_combine(comm: CommLike, plan: MoePlan, expert_out: DLPackArray, out: Out, *,
                topk_weights: Optional[DLPackArray] = None, stream: StreamArg = None, num_ctas: int = 0) -> Out:
    """Collective: out[t] = sum over token t's routed slots j, in slot order, of w[t, j] *
    expert_out[row of (t, j)] on the rank of its expert, accumulated in fp32 and rounded once
    (bit-identical across runs). A token without a routed slot gets zeros.

    expert_out: symmetric [capacity, H'], its rows in recv_x's layout (the experts' outputs for the
    rows moe_dispatch delivered). out: [T, H'] of expert_out's dtype (H' and the dtype may differ
    from the config's). topk_weights: float32 [T, k] (None: the weights given to moe_routing, or 1;
    across nodes it must be None). Each rank's expert_out must be complete on its stream before
    the call. Across nodes: call it after its plan's dispatch, with no other MoE dispatch between;
    the sum is then per node in slot order, and those node sums in node order."""
    c = as_communicator(comm, "moe_combine")
    _C.moe_combine(c._c, _plan(plan, "moe_combine", c.rank), expert_out, out,
                   _stream(stream, out, "moe_combine", c.device, c.rank), topk_weights, num_ctas)
    return out


def moe_report(comm: CommLike, plan: MoePlan, *, stream: StreamArg = None) -> MoeReport:
    """Waits (bounded) for `stream` (default: the current stream of the plan's tensors) and
    returns what the GPU found while routing, for this rank: ``recv_rows`` (rows routed to it),
    ``kept_rows`` (in its recv_x: expert_offsets[E/W]), ``dropped_rows`` (overflow 'drop'),
    ``dropped_slots`` (this rank's (token, slot) pairs that found no room) and ``max_recv_rows``
    (the largest recv_rows of any rank: the capacity that would fit). Raises
    ``loom.InvalidArgument`` when the routing refused its input (an expert id out of range, a rank
    over its capacity with overflow 'error'): nothing moved then, on any rank. Not collective."""
    c = as_communicator(comm, "moe_report")
    p = _plan(plan, "moe_report", c.rank)
    return _C.moe_report(c._c, p, _stream(stream, p.expert_offsets, "moe_report", c.device, c.rank))


def moe_dispatch_gemm(comm: CommLike, plan: MoePlan, x: DLPackArray, recv_x: DLPackArray, weights: DLPackArray,
                      out: Out, *, b_layout: str = "nk", activation: str = "none", tile: str = "auto",
                      stream: StreamArg = None, num_ctas: int = 0, push_ctas: int = 0, arrival_ctas: int = 0,
                      expert_groups: bool = True) -> Out:
    """Collective: moe_dispatch (recv_x written exactly as it writes it) and, in the same
    persistent kernel, out_e = recv_x_e @ weights_e^T for every local expert e, each tile starting
    as soon as its rows have landed. Rows [0, expert_offsets[E/W]) of out are bit-identical to
    moe_dispatch followed by grouped_gemm over recv_x with the same tile; later rows are not
    written.

    x, recv_x: as moe_dispatch (bf16 or fp16). weights: this rank's experts, [E/W, N, hidden]
    (b_layout 'nk': one nn.Linear weight per expert) or [E/W, hidden, N] ('kn'), the config's
    dtype; N a multiple of 8. out: [capacity, N] bf16, fp16 or fp32 ([capacity, N / 2] with
    activation 'swiglu': weights from ``loom.torch.swiglu_weights(gate, up)``, out = silu(x gate^T)
    * (x up^T), N a multiple of 16); ordinary memory, or symmetric when moe_combine reads it
    directly. tile: 'auto', '128x256' or '128x128'. num_ctas (0: every SM), push_ctas and
    arrival_ctas (0: the planner's) tune the kernel. expert_groups: as ``grouped_gemm``'s (False:
    raster groups of group_m tile rows whatever the experts; for A/B timing)."""
    c = as_communicator(comm, "moe_dispatch_gemm")
    _C.moe_dispatch_gemm(c._c, _plan(plan, "moe_dispatch_gemm", c.rank), x, recv_x, weights, out,
                         _stream(stream, x, "moe_dispatch_gemm", c.device, c.rank), b_layout, activation, tile,
                         num_ctas, push_ctas, arrival_ctas, expert_groups)
    return out


def moe_layer(comm: CommLike, plan: MoePlan, x: DLPackArray, gate_up: DLPackArray, down: DLPackArray,
              recv_x: DLPackArray, hidden: DLPackArray, expert_out: DLPackArray, out: Out, *,
              stream: StreamArg = None, tile: str = "auto", num_ctas: int = 0, push_ctas: int = 0,
              arrival_ctas: int = 0, shared_gate_up: Optional[DLPackArray] = None,
              shared_down: Optional[DLPackArray] = None, phases: Optional[DLPackArray] = None,
              swap_tails: bool = True, expert_groups: bool = True) -> Out:
    """Collective: the whole MoE FFN step in one persistent kernel (across nodes too):
    out[t] = sum over token t's routed slots j, in slot order, of w[t, j] * (silu(x[t] Wg_e^T) *
    (x[t] Wu_e^T)) Wd_e^T, e the slot's expert and w the routing's weights (moe_routing's
    topk_weights, 1 when none were given). The dispatch, the gate/up GEMM with the SwiGLU
    epilogue, the down GEMM and the weighted combine each start on a tile row as soon as its
    inputs are there. fp32 accumulation in both GEMMs and in the sum; hidden, expert_out and out
    are each rounded once. Bit-identical to moe_dispatch_gemm(activation='swiglu', out=hidden) ->
    grouped_gemm(hidden, down, expert_out, offsets=plan.expert_offsets) -> moe_combine(expert_out)
    on the same tile; recv_x is written exactly as moe_dispatch writes it. Across nodes as those
    calls (each token row crosses the network once per node, each node's partial sum once back).

    Every tensor has the config's dtype, bf16 or fp16 (fp32 raises ``loom.Unsupported``).
    x: [T, hidden] (T: the tokens given to moe_routing). gate_up: this rank's experts' gate and
    up weights, [E/W, 2I, hidden], rows interleaved by 8 (``loom.torch.swiglu_weights(gate,
    up)`` from nn.Linear weights [E/W, I, hidden] each); I, read from gate_up, must be a multiple of
    8 (``loom.Unsupported`` otherwise).
    down: [E/W, hidden, I] (one nn.Linear weight per expert). recv_x: symmetric [capacity,
    hidden], as moe_dispatch's. hidden: [capacity, I], ordinary device memory (silu(gate) * up of
    each received row). expert_out: symmetric [capacity, hidden] (the down GEMM's rows, read by
    the tokens' owners). out: [T, hidden]. ``loom.torch.moe_buffers(comm, config,
    hidden_intermediate=I)`` allocates recv_x, hidden and expert_out. tile: 'auto', '128x256' or
    '128x128' (both GEMMs). num_ctas (0: every SM), push_ctas and arrival_ctas (0: the
    planner's) tune the kernel.

    Shared expert (both or neither): shared_gate_up [2I, hidden] (interleaved as gate_up) and
    shared_down [hidden, I]; every token of this rank also goes through that FFN, added with
    weight 1 after the routed sum (out is still rounded once): DeepSeek-V3's and Llama 4's shared
    expert. Its rows live in hidden and expert_out after the receive rows, so both then have
    ``moe_layer_rows(capacity, max_tokens, True)`` rows (``moe_buffers(...,
    shared_expert=True)``); its tiles run first in the kernel, overlapping the dispatch.

    phases (diagnostics, optional): uint8 or int32 device memory of at least ``64 * comm.sm_count``
    bytes; each CTA of the launch writes where its time went into its 64-byte record
    (``moe_layer_phases`` reads a copy). swap_tails and expert_groups: as ``grouped_gemm``'s, both
    GEMMs (False pads each expert's last tile row, or cuts raster groups every group_m tile rows
    whatever the experts; for A/B timing)."""
    c = as_communicator(comm, "moe_layer")
    _C.moe_layer(c._c, _plan(plan, "moe_layer", c.rank), x, gate_up, down, recv_x, hidden, expert_out, out,
                 _stream(stream, x, "moe_layer", c.device, c.rank), tile, num_ctas, push_ctas, arrival_ctas,
                 shared_gate_up, shared_down, phases, swap_tails, expert_groups)
    return out


_PHASE_RECORD = struct.Struct("<7Q2I")  # loom::MoeLayerPhaseRecord (loom/diagnostics.h)
_PHASE_FIELDS = ("entered_ns", "roles_done_ns", "first_tile_ns", "tiles_done_ns", "reduced_ns", "up_wait_ns",
                 "down_wait_ns", "role", "tiles")
_LAYER_ROLES = ("arrival", "forward", "push", "compute")


def moe_layer_phases(data: Any) -> List[dict]:
    """moe_layer's phase records as one dict per CTA of the launch, in CTA order: the fields of
    loom::MoeLayerPhaseRecord (%globaltimer nanoseconds; ``up_wait_ns`` and ``down_wait_ns`` summed
    over the CTA's claims), ``role`` as a name, and ``cta``. Records past the launch's grid (never
    entered) are left out. data: the ``phases`` buffer after the launch completed, as a torch
    tensor (on any device: it is copied to the host), an array with ``tobytes()``, or bytes."""
    if hasattr(data, "cpu"):  # a torch tensor
        data = data.detach().cpu().contiguous().numpy()
    if hasattr(data, "tobytes"):
        data = data.tobytes()
    data = bytes(data)
    size = _PHASE_RECORD.size
    records = []
    for cta in range(len(data) // size):
        r = dict(zip(_PHASE_FIELDS, _PHASE_RECORD.unpack_from(data, cta * size)))
        if r["entered_ns"] == 0:
            continue
        r["role"] = _LAYER_ROLES[r["role"]] if r["role"] < len(_LAYER_ROLES) else str(r["role"])
        r["cta"] = cta
        records.append(r)
    return records


def moe_layer_rows(capacity: int, max_tokens: int, shared_expert: bool) -> int:
    """The rows of moe_layer's hidden and expert_out: capacity (MoeSizes.capacity), or with a
    shared expert the capacity rounded up to 128 plus max_tokens."""
    return _C.moe_layer_rows(capacity, max_tokens, shared_expert)


def moe_topk(logits: DLPackArray, topk_ids: Out, topk_weights: DLPackArray, *, top_k: int, scoring: str = "softmax",
             renormalize: bool = False, stream: StreamArg = None) -> Tuple[Out, DLPackArray]:
    """The router's top-k on one GPU (no communicator, not collective): for every token t,
    topk_ids[t] the top_k experts with the largest logits, largest first (equal logits: the lower
    expert id first), and topk_weights[t, j] the weight of expert topk_ids[t, j]: its softmax over
    all E logits of the token (scoring 'softmax') or sigmoid(logit) ('sigmoid'); with
    renormalize, divided by the sum of the token's top_k weights. A logit of -inf is never chosen:
    a token with fewer than top_k finite logits gets id -1 (an unused slot, as moe_routing reads
    it) and weight 0 in the remaining slots. fp32 math; asynchronous on `stream` (default: the
    current stream of logits' framework), no host synchronization, capturable in a CUDA graph.
    The outputs are moe_routing's topk_ids and topk_weights.

    logits: [T, E] bf16, fp16 or fp32, row-major contiguous, on a GPU (E in [1, 1024]).
    topk_ids: int32 [T, top_k] and topk_weights: float32 [T, top_k] on logits' GPU, written here
    (not overlapping logits or each other). top_k: 1 .. min(E, 32). Bad shapes, dtypes or devices
    raise ``loom.InvalidArgument`` naming the tensor, then loom's own checks (E and top_k out of
    range, misaligned or overlapping memory) raise ``loom.InvalidArgument`` before anything is
    launched. Returns (topk_ids, topk_weights)."""
    op = "moe_topk"
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise _invalid(op, f"top_k must be an int, got {type(top_k).__name__}")
    if not _INT32[0] <= top_k <= _INT32[1]:
        raise _invalid(op, f"top_k = {top_k} does not fit its C++ field [{_INT32[0]}, {_INT32[1]}]")
    if not isinstance(scoring, str):
        raise _invalid(op, f"scoring must be 'softmax' or 'sigmoid', got {type(scoring).__name__}")
    if not isinstance(renormalize, bool):
        raise _invalid(op, f"renormalize must be a bool, got {type(renormalize).__name__}")
    device = _device_of(logits) if stream is not None else None
    _C.moe_topk(logits, topk_ids, topk_weights, _stream(stream, logits, op, device), top_k, scoring, renormalize)
    return topk_ids, topk_weights
