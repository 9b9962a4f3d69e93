"""loom's ops as torch.library operators (``torch.ops.loom.*``) with fake implementations, so
that torch.compile traces them and CUDA graphs capture them.

    import loom, loom.torch
    comm = loom.Communicator.from_process_group()     # or pass a torch ProcessGroup as comm
    y = loom.torch.ag_gemm(comm, x_shard, w)          # [M/W, K] -> [M, N]
    z = loom.torch.gemm_rs(comm, torch.nn.functional.gelu(y), w2)

``comm`` comes first, as in ``loom.*``, and is a loom.Communicator or a torch ProcessGroup (then
the communicator ``loom.Communicator.for_process_group(group)`` caches for it).

Operators are functional: each returns a new tensor. Where loom needs symmetric memory (all_gather
and gemm_ar outputs, all_reduce and reduce_scatter inputs) the op goes through a symmetric staging
buffer cached on the communicator, and a copy moves the data in or out. There is one staging
buffer per (role, dtype), grown to the largest shape seen and viewed for smaller ones, under a
byte budget (256 MiB unless ``set_staging_budget`` says otherwise; loom/_staging.py has the
policy): varying batch sizes hold the largest one's bytes, not one buffer per shape. Growing is
collective like every op (every rank makes the same calls). An input that is already symmetric
(``loom.torch.empty``) is used in place. For zero-copy outputs use the explicit-output API on
symmetric tensors (``loom.all_reduce(comm, x)`` etc.).

CUDA graphs: the ops make no host synchronization and no allocation other than torch's own
(graph-pool) outputs, and loom's launch epochs advance on the device, so a captured graph can be
replayed any number of times. Run every op once eagerly with the largest shapes you capture first:
that allocates the staging buffers and loom's tensor-parallel workspace, neither of which can be
allocated during capture (such a call raises ``loom.InvalidArgument``). A staging buffer a graph
captured is kept until the communicator closes even when a larger shape later replaces it.

MoE: ``torch.ops.loom.moe_topk`` (the router's top-k on one GPU; ``moe_topk`` below) and
``torch.ops.loom.moe_layer`` (collective: loom's routing of the top-k, then the whole MoE FFN step
in one kernel; ``moe_layer_from_topk`` below). The layer op routes into MoE
buffers (``moe_buffers``: the plan buffer, expert_offsets, symmetric recv_x and expert_out, hidden)
cached on the communicator, one set per (MoE config, intermediate size I), allocated by the first
call with that config (collective) and kept until the communicator closes; token counts up to
max_tokens share them. As for staging, that first call must be eager: during capture it raises
``loom.InvalidArgument``. ``moe_layer(comm, plan, ...)``, ``moe_buffers`` and ``swiglu_weights``
stay plain functions (a MoePlan or MoeConfig cannot go through an operator schema).

Communicators enter the operators as an int handle, their first argument (``loom.torch.handle(comm)``;
the functions below take the communicator and do it for you). The registry holds them weakly.

No autograd formulas are registered: these are forward (inference) operators. Their outputs never
require grad, as for a non-differentiable torch op (the Autograd key falls through, which costs
nothing per call), so gradients do not flow through them.

Overhead: operators are defined with ``torch.library.Library`` rather than the
``torch.library.custom_op`` decorator, whose extra Python layers cost ~15 us per call; a call
costs a few microseconds over the C++ launch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import torch

from . import _C
from . import _comm as _comm_registry
from ._comm import CommLike, Communicator, _process_group_type, as_communicator
from ._errors import _invalid, _unsupported
from ._moe import (MoeConfig, MoePlan, MoeSizes, _plan, moe_layer as _moe_layer, moe_routing as _moe_routing, moe_sizes,
                   moe_topk as _moe_topk)

__all__ = ["empty", "handle", "register_communicator", "set_staging_budget", "gemm", "all_gather",
           "reduce_scatter", "all_reduce", "ag_gemm", "gemm_rs", "gemm_ar", "attention", "attention_merge",
           "ring_attention", "zigzag_shard", "zigzag_unshard", "grouped_gemm", "swiglu_weights", "MoeBuffers",
           "moe_buffers", "moe_layer", "moe_layer_from_topk", "moe_topk"]

_HALF = (torch.bfloat16, torch.float16)
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)

# ---- communicators ---------------------------------------------------------------------------

def register_communicator(comm: Any) -> int:
    """The int that stands for `comm` in operator calls (idempotent; loom.Communicator objects
    have one from creation; a torch ProcessGroup stands for its cached communicator). Anything with
    ``local_world_size`` (and ``rank``; ``world_size`` when it spans several nodes) can be
    registered, which is how fake-tensor tests run without a GPU. Register before torch.compile
    traces."""
    h = getattr(comm, "_loom_handle", None)
    if h is not None:
        return h
    group_type = _process_group_type()
    if group_type is not None and isinstance(comm, group_type):
        return Communicator.for_process_group(comm)._loom_handle
    return _comm_registry.register(comm)


handle = register_communicator


def _comm(h: int, op: str) -> Any:
    comm = _comm_registry.lookup(h)
    if comm is None:
        raise _invalid(op, f"no live loom communicator has handle {h} (register it with loom.torch.handle(comm))")
    return comm


def empty(comm: CommLike, shape: Sequence[int] | int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Collective: an uninitialised symmetric tensor on comm's device (see Communicator.empty)."""
    return torch.from_dlpack(as_communicator(comm, "empty").empty(shape, dtype))


def set_staging_budget(comm: CommLike, nbytes: int) -> None:
    """The bytes of symmetric memory loom.torch may hold in `comm`'s staging buffers (default 256
    MiB). A call that would need more is refused with ``loom.InvalidArgument``; buffers already
    held stay until a request replaces them. Set it to the same value on every rank."""
    c = as_communicator(comm, "set_staging_budget")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise _invalid("set_staging_budget", f"nbytes must be an int >= 0, got {nbytes!r}", c.rank)
    c._staging.budget_bytes = nbytes


# ---- helpers -----------------------------------------------------------------------------------

# The raw stream query is what torch's generated code uses: cheaper than torch.cuda.current_stream().
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
if _raw_stream is None:  # pragma: no cover
    def _raw_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


def _stream(device: int) -> int:
    # A CPU tensor is refused by the extension before the stream is used.
    return _raw_stream(device) if device >= 0 else 0


def _check_input(x: torch.Tensor, name: str, op: str, comm: Any, dtypes: tuple = _FLOAT) -> None:
    """What the extension would refuse, checked before a staging copy hides it."""
    if x.dtype not in dtypes:
        raise _invalid(op, f"{name} has dtype {x.dtype}; {op} takes {', '.join(str(d) for d in dtypes)}", comm.rank)
    if x.device.type != "cuda" or x.get_device() != comm.device:
        raise _invalid(op, f"{name} is on {x.device} but the communicator uses cuda:{comm.device}", comm.rank)
    if not x.is_contiguous():
        raise _invalid(op, f"{name} {list(x.shape)} is not contiguous; pass x.contiguous()", comm.rank)
    if x.dim() == 0:
        raise _invalid(op, f"{name} must have at least one dimension", comm.rank)


def _staging(comm: Communicator, role: str, shape: tuple[int, ...], dtype: torch.dtype, stream: int) -> torch.Tensor:
    """A symmetric [shape] dtype view for `role` (see the module's doc), used on `stream`."""
    numel = math.prod(shape)
    capturing = torch.cuda.is_current_stream_capturing()
    view = comm._staging.lookup(role, shape, dtype, numel, stream, capturing)
    if view is not None:
        return view
    op = role.split(".")[0]
    if capturing:
        raise _invalid(op, f"a symmetric staging buffer {list(shape)} {dtype} is needed, which cannot be allocated "
                           "during CUDA graph capture: run the op once eagerly with this shape (or a larger one) "
                           "before capturing", comm.rank)
    # A buffer holds at least one element: symmetric allocations are never empty.
    return comm._staging.grow(role, shape, dtype, numel, dtype.itemsize, stream,
                              lambda count, dt: empty(comm, (max(count, 1),), dt), comm.synchronize, op, comm.rank)


def _without_history(x: torch.Tensor) -> torch.Tensor:
    """x, detached if it requires grad: the kernels run with autograd on (the Autograd key falls
    through), and a copy of x into a cached staging buffer must not give that buffer a history."""
    return x.detach() if x.requires_grad else x


def _is_symmetric(comm: Communicator, x: torch.Tensor) -> bool:
    return comm._c.is_symmetric(x.data_ptr(), x.numel() * x.element_size())


def _tp_world(comm: Any) -> int:
    """Ranks the tensor-parallel ops split M or K over: every rank of the job (across nodes too);
    the collectives stay within one node (local_world_size)."""
    return getattr(comm, "world_size", comm.local_world_size)


def _tp_shapes(op: str, a: torch.Tensor, b: torch.Tensor, b_layout: str, world: int, rank: int | None) -> tuple:
    """(M, N, K) of a tensor-parallel op, with the shape rules checked."""
    if a.dim() != 2 or b.dim() != 2:
        raise _invalid(op, f"a and b must be 2-D, got {list(a.shape)} and {list(b.shape)}", rank)
    if b_layout not in ("kn", "nk"):
        raise _invalid(op, f"b_layout {b_layout!r}: expected 'kn' ([K, N]) or 'nk' ([N, K])", rank)
    k = a.shape[1]
    n, b_k = (b.shape[1], b.shape[0]) if b_layout == "kn" else (b.shape[0], b.shape[1])
    if b_k != k:
        raise _invalid(op, f"a is {list(a.shape)} (K = {k}) but b is {list(b.shape)} (b_layout {b_layout!r})", rank)
    m = a.shape[0] * world if op == "ag_gemm" else a.shape[0]
    if op == "gemm_rs" and m % world != 0:
        raise _invalid(op, f"M = {m} rows of a do not divide by the world size {world}", rank)
    if a.dtype != b.dtype or a.dtype not in _HALF:
        raise _invalid(op, f"a and b must both be bfloat16 or float16, got {a.dtype} and {b.dtype}", rank)
    return m, n, k


# ---- operator definitions ----------------------------------------------------------------------

_lib = torch.library.Library("loom", "DEF")
_lib.define("gemm(Tensor a, Tensor b, str b_layout='kn', ScalarType? out_dtype=None) -> Tensor")
# `comm` first, as in the Python functions below and in loom.*.
_lib.define("all_gather(int comm, Tensor x) -> Tensor")
_lib.define("reduce_scatter(int comm, Tensor x) -> Tensor")
_lib.define("all_reduce(int comm, Tensor x) -> Tensor")
_lib.define("ag_gemm(int comm, Tensor a, Tensor b, str b_layout='kn') -> Tensor")
_lib.define("gemm_rs(int comm, Tensor a, Tensor b, str b_layout='kn') -> Tensor")
_lib.define("gemm_ar(int comm, Tensor a, Tensor b, str b_layout='kn') -> Tensor")
_lib.define("attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, Tensor? cu_seqlens_q=None, "
            "Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0, bool partial=False) -> (Tensor, Tensor)")
_lib.define("attention_merge(Tensor partial_out, Tensor partial_lse, ScalarType? out_dtype=None) -> (Tensor, Tensor)")
_lib.define("ring_attention(int comm, Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None) -> (Tensor, Tensor)")
_lib.define("grouped_gemm(Tensor a, Tensor b, Tensor? offsets=None, Tensor? counts=None, ScalarType? out_dtype=None, "
            "str b_layout=\"nk\", str activation=\"none\") -> Tensor")
_lib.define("moe_topk(Tensor logits, int top_k, str scoring=\"softmax\", bool renormalize=False) -> (Tensor, Tensor)")
_lib.define("moe_layer(int comm, Tensor x, Tensor topk_ids, Tensor? topk_weights, Tensor gate_up, Tensor down, "
            "int num_experts, int max_tokens, int capacity=0, str overflow=\"error\", Tensor? shared_gate_up=None, "
            "Tensor? shared_down=None) -> Tensor")

OPS = ("gemm", "all_gather", "reduce_scatter", "all_reduce", "ag_gemm", "gemm_rs", "gemm_ar", "attention",
       "attention_merge", "ring_attention", "grouped_gemm")
# The MoE operators, apart: their inputs (routable top-k ids, expert weights) are not what a generic
# op check draws; tests/python/test_opcheck.py and test_gpu_moe.py check them.
MOE_OPS = ("moe_topk", "moe_layer")

_Fn = Callable[..., torch.Tensor]


def _impl(name: str) -> Callable[[_Fn], _Fn]:
    # CPU too, so that a CPU tensor gets loom's error instead of a dispatcher message.
    def register(fn: _Fn) -> _Fn:
        _lib.impl(name, fn, "CUDA")
        _lib.impl(name, fn, "CPU")
        # Non-differentiable: a Python autograd kernel would cost 5-17 us per call; the
        # fallthrough costs nothing and leaves the outputs without autograd history.
        _lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
        return fn
    return register


def _fake(name: str) -> Callable[[_Fn], _Fn]:
    def register(fn: _Fn) -> _Fn:
        torch.library.register_fake(f"loom::{name}", fn, lib=_lib)
        return fn
    return register


# gemm ------------------------------------------------------------------------------------------

def _gemm_shape(a: torch.Tensor, b: torch.Tensor, b_layout: str) -> tuple:
    if a.dim() != 2 or b.dim() != 2:
        raise _invalid("gemm", f"a and b must be 2-D, got {list(a.shape)} and {list(b.shape)}")
    if b_layout not in ("kn", "nk"):
        raise _invalid("gemm", f"b_layout {b_layout!r}: expected 'kn' ([K, N]) or 'nk' ([N, K])")
    n, b_k = (b.shape[1], b.shape[0]) if b_layout == "kn" else (b.shape[0], b.shape[1])
    if b_k != a.shape[1]:
        raise _invalid("gemm", f"a is {list(a.shape)} (K = {a.shape[1]}) but b is {list(b.shape)} (b_layout {b_layout!r})")
    return a.shape[0], n


@_impl("gemm")
def _gemm_impl(a, b, b_layout="kn", out_dtype=None):
    m, n = _gemm_shape(a, b, b_layout)
    out = torch.empty((m, n), dtype=out_dtype or a.dtype, device=a.device)
    _C.gemm(a, b, out, _stream(a.get_device()), b_layout)
    return out


@_fake("gemm")
def _gemm_fake(a, b, b_layout="kn", out_dtype=None):
    m, n = _gemm_shape(a, b, b_layout)
    if a.dtype != b.dtype or a.dtype not in _HALF:
        raise _invalid("gemm", f"a and b must both be bfloat16 or float16, got {a.dtype} and {b.dtype}")
    if out_dtype is not None and out_dtype not in _FLOAT:
        raise _invalid("gemm", f"out_dtype {out_dtype}: expected bfloat16, float16 or float32")
    return a.new_empty((m, n), dtype=out_dtype or a.dtype)


# collectives -----------------------------------------------------------------------------------

@_impl("all_gather")
def _all_gather_impl(comm, x):
    c = _comm(comm, "all_gather")
    _check_input(x, "x", "all_gather", c)
    stream = _raw_stream(c.device)
    recv = _staging(c, "all_gather.recv", (c.local_world_size * x.shape[0], *x.shape[1:]), x.dtype, stream)
    _C.all_gather(c._c, x, recv, stream)
    return recv.clone()


@_fake("all_gather")
def _all_gather_fake(comm, x):
    c = _comm(comm, "all_gather")
    if x.dim() == 0:
        raise _invalid("all_gather", "x must have at least one dimension", c.rank)
    return x.new_empty((c.local_world_size * x.shape[0], *x.shape[1:]))


def _scatter_shape(x: torch.Tensor, c: Any) -> tuple:
    if x.dim() == 0 or x.shape[0] % c.local_world_size != 0:
        raise _invalid("reduce_scatter", f"x {list(x.shape)}: the first dimension must divide by the world size "
                                         f"{c.local_world_size}", c.rank)
    return (x.shape[0] // c.local_world_size, *x.shape[1:])


@_impl("reduce_scatter")
def _reduce_scatter_impl(comm, x):
    c = _comm(comm, "reduce_scatter")
    _check_input(x, "x", "reduce_scatter", c)
    x = _without_history(x)
    out = x.new_empty(_scatter_shape(x, c))
    stream = _raw_stream(c.device)
    send = x
    if not _is_symmetric(c, x):
        send = _staging(c, "reduce_scatter.send", tuple(x.shape), x.dtype, stream)
        send.copy_(x)
    _C.reduce_scatter(c._c, send, out, stream)
    return out


@_fake("reduce_scatter")
def _reduce_scatter_fake(comm, x):
    return x.new_empty(_scatter_shape(x, _comm(comm, "reduce_scatter")))


@_impl("all_reduce")
def _all_reduce_impl(comm, x):
    c = _comm(comm, "all_reduce")
    _check_input(x, "x", "all_reduce", c)
    x = _without_history(x)
    stream = _raw_stream(c.device)
    staging = _staging(c, "all_reduce.buffer", tuple(x.shape), x.dtype, stream)
    if _is_symmetric(c, x):
        _C.all_reduce(c._c, x, staging, stream)
    else:
        staging.copy_(x)
        _C.all_reduce(c._c, staging, staging, stream)
    return staging.clone()


@_fake("all_reduce")
def _all_reduce_fake(comm, x):
    _comm(comm, "all_reduce")
    return torch.empty_like(x)


# tensor-parallel GEMMs -----------------------------------------------------------------------

@_impl("ag_gemm")
def _ag_gemm_impl(comm, a, b, b_layout="kn"):
    c = _comm(comm, "ag_gemm")
    m, n, _ = _tp_shapes("ag_gemm", a, b, b_layout, _tp_world(c), c.rank)
    out = a.new_empty((m, n))
    _C.ag_gemm(c._c, a, b, out, _raw_stream(c.device), b_layout)
    return out


@_impl("gemm_rs")
def _gemm_rs_impl(comm, a, b, b_layout="kn"):
    c = _comm(comm, "gemm_rs")
    m, n, _ = _tp_shapes("gemm_rs", a, b, b_layout, _tp_world(c), c.rank)
    out = a.new_empty((m // _tp_world(c), n))
    _C.gemm_rs(c._c, a, b, out, _raw_stream(c.device), b_layout)
    return out


@_impl("gemm_ar")
def _gemm_ar_impl(comm, a, b, b_layout="kn"):
    c = _comm(comm, "gemm_ar")
    m, n, _ = _tp_shapes("gemm_ar", a, b, b_layout, _tp_world(c), c.rank)
    _check_input(a, "a", "gemm_ar", c, _HALF)
    stream = _raw_stream(c.device)
    out = _staging(c, "gemm_ar.out", (m, n), a.dtype, stream)
    _C.gemm_ar(c._c, a, b, out, stream, b_layout)
    return out.clone()


def _tp_fake(op: str) -> _Fn:
    def fake(comm, a, b, b_layout="kn"):
        c = _comm(comm, op)
        m, n, _ = _tp_shapes(op, a, b, b_layout, _tp_world(c), c.rank)
        return a.new_empty((m // _tp_world(c) if op == "gemm_rs" else m, n))
    return fake


for _op in ("ag_gemm", "gemm_rs", "gemm_ar"):
    torch.library.register_fake(f"loom::{_op}", _tp_fake(_op), lib=_lib)


# attention ---------------------------------------------------------------------------------------

def _attention_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, partial) -> tuple:
    """(out shape, out dtype, lse shape) with the shape rules checked (loom/attention.h)."""
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if packed and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise _invalid("attention", "packed sequences need both cu_seqlens_q and cu_seqlens_k")
    nd = 3 if packed else 4
    layout = "[T, H, D]" if packed else "[B, S, H, D]"
    if q.dim() != nd or k.dim() != nd or v.dim() != nd:
        raise _invalid("attention", f"q, k and v must be {layout}, got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if k.shape != v.shape:
        raise _invalid("attention", f"k {list(k.shape)} and v {list(v.shape)} must have the same shape")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.dtype not in _HALF:
        raise _invalid("attention", f"q, k and v must all be bfloat16 or all float16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not packed and q.shape[0] != k.shape[0]:
        raise _invalid("attention", f"q {list(q.shape)} and k {list(k.shape)} have different batch sizes")
    if q.shape[-1] != k.shape[-1]:
        raise _invalid("attention", f"q {list(q.shape)} and k {list(k.shape)} have different head dims")
    heads = q.shape[-2]
    lse_shape = (heads, q.shape[0]) if packed else (q.shape[0], heads, q.shape[1])
    return tuple(q.shape), torch.float32 if partial else q.dtype, lse_shape


@_impl("attention")
def _attention_impl(q, k, v, causal=False, scale=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                    max_seqlen_k=0, partial=False):
    out_shape, out_dtype, lse_shape = _attention_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, partial)
    out = q.new_empty(out_shape, dtype=out_dtype)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    _C.attention(q, k, v, out, lse, _stream(q.get_device()), causal, 0.0 if scale is None else scale, cu_seqlens_q,
                 cu_seqlens_k, max_seqlen_q, max_seqlen_k, partial)
    return out, lse


@_fake("attention")
def _attention_fake(q, k, v, causal=False, scale=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                    max_seqlen_k=0, partial=False):
    out_shape, out_dtype, lse_shape = _attention_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, partial)
    return q.new_empty(out_shape, dtype=out_dtype), q.new_empty(lse_shape, dtype=torch.float32)


def _merge_shapes(partial_out, partial_lse, out_dtype) -> tuple:
    if partial_out.dim() not in (4, 5) or partial_out.dtype != torch.float32 or partial_lse.dtype != torch.float32:
        raise _invalid("attention_merge", f"partial_out must be [n, B, S, H, D] or [n, T, H, D] float32 and partial_lse "
                                          f"float32, got {list(partial_out.shape)} {partial_out.dtype} and "
                                          f"{partial_lse.dtype}")
    if out_dtype is not None and out_dtype not in _FLOAT:
        raise _invalid("attention_merge", f"out_dtype {out_dtype}: expected bfloat16, float16 or float32")
    return tuple(partial_out.shape[1:]), out_dtype or torch.float32, tuple(partial_lse.shape[1:])


@_impl("attention_merge")
def _attention_merge_impl(partial_out, partial_lse, out_dtype=None):
    out_shape, dtype, lse_shape = _merge_shapes(partial_out, partial_lse, out_dtype)
    out = partial_out.new_empty(out_shape, dtype=dtype)
    lse = partial_lse.new_empty(lse_shape)
    _C.attention_merge(partial_out, partial_lse, out, lse, _stream(partial_out.get_device()))
    return out, lse


@_fake("attention_merge")
def _attention_merge_fake(partial_out, partial_lse, out_dtype=None):
    out_shape, dtype, lse_shape = _merge_shapes(partial_out, partial_lse, out_dtype)
    return partial_out.new_empty(out_shape, dtype=dtype), partial_lse.new_empty(lse_shape)


# ring attention ----------------------------------------------------------------------------------

def _ring_shapes(q, k, v, rank) -> tuple:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise _invalid("ring_attention", f"q must be [B, S_l, Hq, D] and k, v [B, S_l, Hkv, D], got {list(q.shape)}, "
                                         f"{list(k.shape)}, {list(v.shape)}", rank)
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise _invalid("ring_attention", f"q {list(q.shape)} and k {list(k.shape)} must agree in B, S_l and D", rank)
    if q.dtype != k.dtype or q.dtype != v.dtype or q.dtype not in _HALF:
        raise _invalid("ring_attention", f"q, k and v must all be bfloat16 or all float16", rank)
    return tuple(q.shape), (q.shape[0], q.shape[2], q.shape[1])


@_impl("ring_attention")
def _ring_attention_impl(comm, q, k, v, causal=False, scale=None):
    c = _comm(comm, "ring_attention")
    out_shape, lse_shape = _ring_shapes(q, k, v, c.rank)
    q, k, v = (_without_history(x) for x in (q, k, v))
    out = q.new_empty(out_shape)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    _C.ring_attention(c._c, q, k, v, out, lse, _raw_stream(c.device), causal, 0.0 if scale is None else scale)
    return out, lse


@_fake("ring_attention")
def _ring_attention_fake(comm, q, k, v, causal=False, scale=None):
    c = _comm(comm, "ring_attention")
    out_shape, lse_shape = _ring_shapes(q, k, v, c.rank)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


# grouped GEMM (MoE experts) ----------------------------------------------------------------------

def _grouped_shapes(a, b, offsets, counts, out_dtype, b_layout, activation) -> tuple:
    """(d shape, d dtype, workspace rows, masked) with the shape rules checked (loom/moe.h)."""
    op = "grouped_gemm"
    if (offsets is None) == (counts is None):
        raise _invalid(op, "give exactly one of offsets (the contiguous layout) and counts (the masked layout)")
    if b_layout not in ("nk", "kn"):
        raise _invalid(op, f"b_layout {b_layout!r}: expected 'nk' (b [E, N, K]) or 'kn' (b [E, K, N])")
    b_shape = "[E, N, K]" if b_layout == "nk" else "[E, K, N]"
    if b.dim() != 3:
        raise _invalid(op, f"b must be {b_shape}, got {list(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in _HALF:
        raise _invalid(op, f"a and b must both be bfloat16 or both float16, got {a.dtype} and {b.dtype}")
    if out_dtype is not None and out_dtype not in _FLOAT:
        raise _invalid(op, f"out_dtype {out_dtype}: expected bfloat16, float16 or float32")
    e, n, k = b.shape if b_layout == "nk" else (b.shape[0], b.shape[2], b.shape[1])
    if activation not in ("none", "swiglu"):
        raise _invalid(op, f"activation {activation!r}: expected 'none' or 'swiglu'")
    if activation == "swiglu":
        if n % 16 != 0:
            raise _invalid(op, f"the SwiGLU epilogue needs N (gate and up interleaved by 8) a multiple of 16, got {n}")
        n //= 2
    masked = counts is not None
    rows = counts if masked else offsets
    want = e if masked else e + 1
    if rows.dtype != torch.int32 or rows.dim() != 1 or rows.shape[0] != want:
        raise _invalid(op, f"{'counts' if masked else 'offsets'} must be int32 [{want}], got {list(rows.shape)} {rows.dtype}")
    if masked:
        if a.dim() != 3 or a.shape[0] != e or a.shape[2] != k:
            raise _invalid(op, f"a must be [E, capacity, K] = [{e}, C, {k}] for b {list(b.shape)}, got {list(a.shape)}")
        return (e, a.shape[1], n), out_dtype or a.dtype, a.shape[1], True
    if a.dim() != 2 or a.shape[1] != k:
        raise _invalid(op, f"a must be [M, K] with K = {k} for b {list(b.shape)}, got {list(a.shape)}")
    return (a.shape[0], n), out_dtype or a.dtype, a.shape[0], False


@_impl("grouped_gemm")
def _grouped_gemm_impl(a, b, offsets=None, counts=None, out_dtype=None, b_layout="nk", activation="none"):
    shape, dtype, rows, masked = _grouped_shapes(a, b, offsets, counts, out_dtype, b_layout, activation)
    d = a.new_zeros(shape, dtype=dtype)  # rows outside every expert stay zero
    words = max(1, -(-_C.grouped_gemm_workspace_bytes(rows, b.shape[0], masked) // 4))
    workspace = a.new_empty((words,), dtype=torch.int32)
    _C.grouped_gemm(a, b, d, offsets, counts, workspace, _stream(a.get_device()), b_layout=b_layout,
                    activation=activation)
    return d


@_fake("grouped_gemm")
def _grouped_gemm_fake(a, b, offsets=None, counts=None, out_dtype=None, b_layout="nk", activation="none"):
    shape, dtype, _, _ = _grouped_shapes(a, b, offsets, counts, out_dtype, b_layout, activation)
    return a.new_empty(shape, dtype=dtype)


# MoE ------------------------------------------------------------------------------------------------

_MOE_MAX_EXPERTS = 1024  # moe.h: kMoeMaxExperts (moe_topk stages a token's logits in shared memory)
_MOE_MAX_TOP_K = 32      # moe.h: kMoeMaxTopK
_SCORINGS = ("softmax", "sigmoid")


def _topk_rows(logits: torch.Tensor, top_k: Any, scoring: Any) -> Any:
    """T (logits' rows), with moe_topk's shape, dtype and range rules checked (loom/moe.h)."""
    op = "moe_topk"
    if logits.dim() != 2:
        raise _invalid(op, f"logits must be 2-D [T, E], got shape {list(logits.shape)}")
    if logits.dtype not in _FLOAT:
        raise _invalid(op, f"logits has dtype {logits.dtype}; moe_topk takes bfloat16, float16 or float32 logits")
    if not isinstance(scoring, str) or scoring not in _SCORINGS:
        raise _invalid(op, f"scoring {scoring!r}: expected 'softmax' (over all E logits) or 'sigmoid' (each logit on "
                           "its own)")
    e = logits.shape[1]
    if not 1 <= e <= _MOE_MAX_EXPERTS:
        raise _invalid(op, f"num_experts {e} is outside [1, {_MOE_MAX_EXPERTS}] (a token's logits are staged in shared "
                           "memory)")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, torch.SymInt)) or not 1 <= top_k <= min(e, _MOE_MAX_TOP_K):
        raise _invalid(op, f"top_k {top_k} is outside [1, min(E, {_MOE_MAX_TOP_K})] (E = {e})")
    return logits.shape[0]


@_impl("moe_topk")
def _moe_topk_impl(logits, top_k, scoring="softmax", renormalize=False):
    rows = _topk_rows(logits, top_k, scoring)
    ids = logits.new_empty((rows, top_k), dtype=torch.int32)
    weights = logits.new_empty((rows, top_k), dtype=torch.float32)
    return _moe_topk(_without_history(logits), ids, weights, top_k=top_k, scoring=scoring, renormalize=renormalize,
                     stream=_stream(logits.get_device()))


@_fake("moe_topk")
def _moe_topk_fake(logits, top_k, scoring="softmax", renormalize=False):
    rows = _topk_rows(logits, top_k, scoring)
    return logits.new_empty((rows, top_k), dtype=torch.int32), logits.new_empty((rows, top_k), dtype=torch.float32)


def _moe_scalars(num_experts: Any, max_tokens: Any, capacity: Any, overflow: Any, rank: int | None) -> None:
    """The MoE config's numbers and overflow policy, as the operator's schema and MoeConfig take them."""
    for name, value, low in (("num_experts", num_experts, 1), ("max_tokens", max_tokens, 1), ("capacity", capacity, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value < low:
            raise _invalid("moe_layer", f"{name} must be an int >= {low}, got {value!r}", rank)
    if not isinstance(overflow, str) or overflow not in ("error", "drop"):
        raise _invalid("moe_layer", f"overflow {overflow!r}: expected 'error' or 'drop'", rank)


def _moe_layer_shapes(c: Any, x, topk_ids, topk_weights, gate_up, down, num_experts, max_tokens, capacity,
                      overflow, shared_gate_up=None, shared_down=None) -> tuple:
    """(T, hidden, top_k, I) of a moe_layer call, with the rules the host can check checked: those
    of the MoE config loom.torch makes from the tensors, and those of loom.moe_layer (loom/moe.h)."""
    op, rank = "moe_layer", c.rank
    _moe_scalars(num_experts, max_tokens, capacity, overflow, rank)
    world = _tp_world(c)  # every rank of the job, over all nodes
    if num_experts % world != 0:
        raise _invalid(op, f"num_experts {num_experts} is not a multiple of the world size {world}", rank)
    if x.dim() != 2 or x.dtype not in _HALF or x.shape[1] < 1:
        raise _invalid(op, f"x must be [T, hidden] bfloat16 or float16, got {list(x.shape)} {x.dtype}", rank)
    tokens, hidden = x.shape
    if (hidden * x.element_size()) % 16 != 0:
        raise _invalid(op, f"hidden {hidden}: a token row of {hidden * x.element_size()} bytes must be a multiple of 16 "
                           "bytes", rank)
    if tokens > max_tokens:
        raise _invalid(op, f"x has {tokens} tokens, more than max_tokens {max_tokens}", rank)
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise _invalid(op, f"topk_ids must be int32 [T, top_k] with T = {tokens} (x's rows), got "
                           f"{list(topk_ids.shape)} {topk_ids.dtype}", rank)
    top_k = topk_ids.shape[1]
    if not 1 <= top_k <= min(num_experts, _MOE_MAX_TOP_K):
        raise _invalid(op, f"top_k {top_k} (topk_ids' columns) is outside [1, min(E, {_MOE_MAX_TOP_K})] "
                           f"(E = {num_experts})", rank)
    if topk_weights is not None and (topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape):
        raise _invalid(op, f"topk_weights must be float32 [T, top_k] like topk_ids {list(topk_ids.shape)}, got "
                           f"{list(topk_weights.shape)} {topk_weights.dtype}", rank)
    local = num_experts // world
    if gate_up.dim() != 3 or down.dim() != 3:
        raise _invalid(op, f"gate_up must be [E/W, 2I, hidden] and down [E/W, hidden, I], got {list(gate_up.shape)} "
                           f"and {list(down.shape)}", rank)
    inter = down.shape[2]
    if tuple(gate_up.shape) != (local, 2 * inter, hidden) or tuple(down.shape) != (local, hidden, inter):
        raise _invalid(op, f"gate_up must be [E/W, 2I, hidden] = [{local}, {2 * inter}, {hidden}] and down "
                           f"[E/W, hidden, I] = [{local}, {hidden}, {inter}] ({local} local experts of {num_experts} "
                           f"over {world} ranks, I = {inter} from down), got {list(gate_up.shape)} and "
                           f"{list(down.shape)}", rank)
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise _invalid(op, f"gate_up and down must have x's dtype {x.dtype}, got {gate_up.dtype} and {down.dtype}", rank)
    if inter < 8 or inter % 8 != 0:
        raise _unsupported(op, f"I = {inter} (down's last dimension) must be a positive multiple of 8", rank)
    if (shared_gate_up is None) != (shared_down is None):
        raise _invalid(op, "shared_gate_up and shared_down go together (both: a shared expert; neither: none)", rank)
    if shared_gate_up is not None:
        if tuple(shared_gate_up.shape) != (2 * inter, hidden) or tuple(shared_down.shape) != (hidden, inter):
            raise _invalid(op, f"shared_gate_up must be [2I, hidden] = [{2 * inter}, {hidden}] and shared_down "
                               f"[hidden, I] = [{hidden}, {inter}] (I = {inter}, the experts'), got "
                               f"{list(shared_gate_up.shape)} and {list(shared_down.shape)}", rank)
        if shared_gate_up.dtype != x.dtype or shared_down.dtype != x.dtype:
            raise _invalid(op, f"shared_gate_up and shared_down must have x's dtype {x.dtype}, got "
                               f"{shared_gate_up.dtype} and {shared_down.dtype}", rank)
    return tokens, hidden, top_k, inter


def _moe_layer_entry(c: Communicator, key: tuple) -> tuple:
    """(MoeConfig, MoeBuffers) for `key` = (num_experts, top_k, hidden, dtype, max_tokens, capacity,
    overflow, I, shared expert), allocated (collective) at its first call and kept on the
    communicator (Communicator._moe_layer_buffers, dropped by close(): entries are never replaced,
    so a CUDA graph's addresses stay valid until then)."""
    cache = c._moe_layer_buffers
    entry = cache.get(key)
    if entry is not None:
        return entry
    num_experts, top_k, hidden, dtype, max_tokens, capacity, overflow, inter, shared = key
    if torch.cuda.is_current_stream_capturing():
        raise _invalid("moe_layer", f"the MoE buffers of num_experts={num_experts}, top_k={top_k}, hidden={hidden}, "
                                    f"{dtype}, max_tokens={max_tokens}, capacity={capacity}, overflow={overflow!r}, "
                                    f"I={inter} are not allocated yet, and cannot be during CUDA graph capture: run it "
                                    "once eagerly first", c.rank)
    config = MoeConfig(num_experts=num_experts, top_k=top_k, hidden=hidden, dtype=dtype, max_tokens=max_tokens,
                       capacity=capacity, overflow=overflow)
    entry = cache[key] = (config, moe_buffers(c, config, hidden_intermediate=inter, shared_expert=shared))
    return entry


@_impl("moe_layer")
def _moe_layer_impl(comm, x, topk_ids, topk_weights, gate_up, down, num_experts, max_tokens, capacity=0,
                    overflow="error", shared_gate_up=None, shared_down=None):
    op = "moe_layer"
    c = _comm(comm, op)
    tokens, hidden, top_k, inter = _moe_layer_shapes(c, x, topk_ids, topk_weights, gate_up, down, num_experts,
                                                     max_tokens, capacity, overflow, shared_gate_up, shared_down)
    shared = shared_gate_up is not None
    _check_input(x, "x", op, c, _HALF)
    _check_input(topk_ids, "topk_ids", op, c, (torch.int32,))
    if topk_weights is not None:
        _check_input(topk_weights, "topk_weights", op, c, (torch.float32,))
        topk_weights = _without_history(topk_weights)
    _check_input(gate_up, "gate_up", op, c, _HALF)
    _check_input(down, "down", op, c, _HALF)
    if shared:
        _check_input(shared_gate_up, "shared_gate_up", op, c, _HALF)
        _check_input(shared_down, "shared_down", op, c, _HALF)
        shared_gate_up, shared_down = _without_history(shared_gate_up), _without_history(shared_down)
    x, gate_up, down = _without_history(x), _without_history(gate_up), _without_history(down)
    config, bufs = _moe_layer_entry(c, (num_experts, top_k, hidden, x.dtype, max_tokens, capacity, overflow, inter,
                                        shared))
    stream = _raw_stream(c.device)
    # NaN first: a routing that fails on the device (an expert id out of range, a rank over its
    # capacity) makes the layer write nothing, and the op cannot report it without a host wait.
    # Filled before the routing: across nodes no kernel may load for the first time while an MoE
    # call waits on the proxy (docs/MOE.md, "Loading").
    out = torch.full((tokens, hidden), float("nan"), dtype=x.dtype, device=x.device)
    plan = _moe_routing(c, config, topk_ids, plan_buffer=bufs.plan_buffer, expert_offsets=bufs.expert_offsets,
                        topk_weights=topk_weights, stream=stream)
    _moe_layer(c, plan, x, gate_up, down, bufs.recv_x, bufs.hidden, bufs.expert_out, out, stream=stream,
               shared_gate_up=shared_gate_up, shared_down=shared_down)
    return out


@_fake("moe_layer")
def _moe_layer_fake(comm, x, topk_ids, topk_weights, gate_up, down, num_experts, max_tokens, capacity=0,
                    overflow="error", shared_gate_up=None, shared_down=None):
    tokens, hidden, _, _ = _moe_layer_shapes(_comm(comm, "moe_layer"), x, topk_ids, topk_weights, gate_up, down,
                                             num_experts, max_tokens, capacity, overflow, shared_gate_up, shared_down)
    return x.new_empty((tokens, hidden))


# ---- Python entry points -----------------------------------------------------------------------

def gemm(a: torch.Tensor, b: torch.Tensor, *, b_layout: str = "kn", out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """a[M, K] @ b ([K, N], or an nn.Linear weight [N, K] with b_layout='nk'): a new [M, N] tensor."""
    return torch.ops.loom.gemm.default(a, b, b_layout, out_dtype)


def all_gather(comm: CommLike, x: torch.Tensor) -> torch.Tensor:
    """[n, ...] on every rank -> [W * n, ...], rank order."""
    return torch.ops.loom.all_gather.default(register_communicator(comm), x)


def reduce_scatter(comm: CommLike, x: torch.Tensor) -> torch.Tensor:
    """[W * n, ...] -> this rank's [n, ...] chunk of the sum over ranks."""
    return torch.ops.loom.reduce_scatter.default(register_communicator(comm), x)


def all_reduce(comm: CommLike, x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, bit-identical on every rank (a new tensor; x is not modified)."""
    return torch.ops.loom.all_reduce.default(register_communicator(comm), x)


def ag_gemm(comm: CommLike, a: torch.Tensor, b: torch.Tensor, *, b_layout: str = "kn") -> torch.Tensor:
    """AllGather_rows(a[M/W, K]) @ b -> [M, N]."""
    return torch.ops.loom.ag_gemm.default(register_communicator(comm), a, b, b_layout)


def gemm_rs(comm: CommLike, a: torch.Tensor, b: torch.Tensor, *, b_layout: str = "kn") -> torch.Tensor:
    """ReduceScatter_rows(a[M, K_r] @ b) -> [M/W, N]."""
    return torch.ops.loom.gemm_rs.default(register_communicator(comm), a, b, b_layout)


def gemm_ar(comm: CommLike, a: torch.Tensor, b: torch.Tensor, *, b_layout: str = "kn") -> torch.Tensor:
    """AllReduce(a[M, K_r] @ b) -> [M, N]."""
    return torch.ops.loom.gemm_ar.default(register_communicator(comm), a, b, b_layout)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: Optional[float] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
              cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
              partial: bool = False) -> tuple:
    """(out, lse) = flash attention forward on one GPU: q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D]
    (packed: [T, H, D] with int32 cu_seqlens and the longest lengths); out like q (float32 when
    partial), lse [B, Hq, Sq] ([Hq, Tq]) float32. See loom.attention."""
    return torch.ops.loom.attention.default(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, partial)


def attention_merge(partial_out: torch.Tensor, partial_lse: torch.Tensor, *,
                    out_dtype: Optional[torch.dtype] = None) -> tuple:
    """(out, lse) combining partial-mode results over disjoint key sets (fp32): partial_out
    [n, B, S, H, D] float32, partial_lse [n, B, H, S]; out in out_dtype (default float32)."""
    return torch.ops.loom.attention_merge.default(partial_out, partial_lse, out_dtype)


def ring_attention(comm: CommLike, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   scale: Optional[float] = None) -> tuple:
    """(out, lse) of this rank's chunk q [B, S_l, Hq, D] over every rank's k, v [B, S_l, Hkv, D]
    (collective over comm's ranks; causal: the zigzag layout, see zigzag_shard). See loom.ring_attention."""
    return torch.ops.loom.ring_attention.default(register_communicator(comm), q, k, v, causal, scale)


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, *, offsets: Optional[torch.Tensor] = None,
                 counts: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                 b_layout: str = "nk", activation: str = "none") -> torch.Tensor:
    """d_e = a_e @ b_e^T for every expert e (MoE expert GEMM on one GPU), b [E, N, K] (b_layout 'kn':
    b [E, K, N], d_e = a_e @ b_e). Contiguous (offsets int32 [E + 1]): a [M, K] -> d [M, N]; masked
    (counts int32 [E]): a [E, C, K] -> d [E, C, N]. Rows outside every expert are zero. activation
    'swiglu': b from swiglu_weights(gate, up), d = silu(a @ gate^T) * (a @ up^T) with N / 2 columns.
    See loom.grouped_gemm."""
    return torch.ops.loom.grouped_gemm.default(a, b, offsets, counts, out_dtype, b_layout, activation)


def swiglu_weights(gate: torch.Tensor, up: torch.Tensor, b_layout: str = "nk") -> torch.Tensor:
    """The weight grouped_gemm(activation='swiglu') takes: gate and up ([E, I, K] each, or [E, K, I]
    with b_layout 'kn'; I a multiple of 8) interleaved by 8 along I into [E, 2I, K] ([E, K, 2I]):
    rows 16j..16j+7 are gate rows 8j..8j+7, rows 16j+8..16j+15 up rows 8j..8j+7."""
    if gate.shape != up.shape or gate.dim() != 3:
        raise _invalid("swiglu_weights", f"gate and up must have one [E, I, K] shape, got {list(gate.shape)} and "
                       f"{list(up.shape)}")
    axis = 1 if b_layout == "nk" else 2
    i = gate.shape[axis]
    if i % 8 != 0 or b_layout not in ("nk", "kn"):
        raise _invalid("swiglu_weights", f"I = {i} must be a multiple of 8 and b_layout 'nk' or 'kn' (got {b_layout!r})")
    shape = list(gate.shape)
    shape[axis : axis + 1] = [i // 8, 8]
    both = torch.stack([gate.reshape(shape), up.reshape(shape)], dim=axis + 1)  # [..., I/8, 2, 8, ...]
    out_shape = list(gate.shape)
    out_shape[axis] = 2 * i
    return both.reshape(out_shape)


@dataclasses.dataclass
class MoeBuffers:
    """The buffers of one MoE config on one rank (moe_buffers); pass the fields to loom.moe_*. rows:
    the capacity, or loom.moe_layer_rows(capacity, max_tokens, True) with a shared expert."""

    sizes: MoeSizes                       # moe_sizes(comm, config)
    plan_buffer: torch.Tensor             # uint8 [plan_bytes] on comm's GPU: moe_routing's plan_buffer
    expert_offsets: torch.Tensor          # int32 [E/W + 1] on comm's GPU: moe_routing's expert_offsets
    recv_x: torch.Tensor                  # symmetric [capacity, hidden], the config's dtype: moe_dispatch's
    expert_out: Optional[torch.Tensor]    # symmetric [rows, H']: moe_combine's (None when not asked for)
    hidden: Optional[torch.Tensor] = None  # [rows, I] on comm's GPU, the config's dtype: moe_layer's
                                           # (None unless hidden_intermediate was given)


_MOE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _positive_int(value: Any, name: str, rank: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _invalid("moe_buffers", f"{name} must be a positive int, got {value!r}", rank)
    return value


def moe_buffers(comm: CommLike, config: MoeConfig, *, expert_out: bool = True, expert_out_hidden: Optional[int] = None,
                expert_out_dtype: Optional[torch.dtype] = None,
                hidden_intermediate: Optional[int] = None, shared_expert: bool = False) -> MoeBuffers:
    """Collective (every rank, same arguments, same order: recv_x and expert_out are symmetric
    allocations): allocates what `config` needs besides the tokens. The plan buffer and
    expert_offsets are ordinary device memory; recv_x is symmetric [capacity, hidden] of the
    config's dtype; expert_out (unless expert_out=False) symmetric [capacity, expert_out_hidden or
    hidden] of expert_out_dtype or the config's dtype. hidden_intermediate=I (moe_layer's I, the
    experts' intermediate size) also allocates hidden, ordinary device memory [capacity, I] of
    the config's dtype (None: no hidden). shared_expert=True (moe_layer with a shared expert; needs
    hidden_intermediate) gives hidden and expert_out ``loom.moe_layer_rows(capacity, max_tokens,
    True)`` rows instead: the shared expert's rows follow the receive rows (recv_x stays [capacity,
    hidden]). Contents are uninitialised (expert_offsets zero). Reuse
    them for every step with this config: moe_routing rewrites the plan buffer and
    expert_offsets, and the plan it returns is valid until the next routing into them."""
    c = as_communicator(comm, "moe_buffers")
    sizes = moe_sizes(c, config)  # the config's refusal, before anything is allocated
    width = _positive_int(config.hidden if expert_out_hidden is None else expert_out_hidden, "expert_out_hidden",
                          c.rank)
    if hidden_intermediate is not None:
        _positive_int(hidden_intermediate, "hidden_intermediate", c.rank)
    if not isinstance(shared_expert, bool) or (shared_expert and hidden_intermediate is None):
        raise _invalid("moe_buffers", f"shared_expert must be a bool and comes with hidden_intermediate, got "
                                      f"{shared_expert!r} with hidden_intermediate={hidden_intermediate!r}", c.rank)
    device = torch.device("cuda", c.device)
    dtype = _MOE_DTYPES[config.dtype]
    layer_rows = _C.moe_layer_rows(sizes.capacity, config.max_tokens, shared_expert)
    recv_x = empty(c, (sizes.capacity, config.hidden), dtype)
    out = empty(c, (layer_rows, width), expert_out_dtype or dtype) if expert_out else None
    hidden = None
    if hidden_intermediate is not None:
        hidden = torch.empty((layer_rows, hidden_intermediate), dtype=dtype, device=device)
    return MoeBuffers(sizes=sizes,
                      plan_buffer=torch.empty(sizes.plan_bytes, dtype=torch.uint8, device=device),
                      expert_offsets=torch.zeros(sizes.local_experts + 1, dtype=torch.int32, device=device),
                      recv_x=recv_x, expert_out=out, hidden=hidden)


def moe_layer(comm: CommLike, plan: MoePlan, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              buffers: MoeBuffers, out: Optional[torch.Tensor] = None, *, shared_gate_up: Optional[torch.Tensor] = None,
              shared_down: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Collective: loom.moe_layer on the current torch stream with `buffers`' recv_x, hidden and
    expert_out (from ``moe_buffers(comm, config, hidden_intermediate=I)``, expert_out of the
    config's width and dtype), writing `out` or, when None, a new [T, hidden] tensor of the
    config's dtype; returns it. A plain function, not a torch.ops operator: the MoePlan is a Python
    object an operator schema cannot carry (``moe_layer_from_topk`` is the operator, routing and
    buffers included). A shared expert (shared_gate_up [2I, hidden], shared_down [hidden, I]) needs
    ``moe_buffers(..., shared_expert=True)``. See loom.moe_layer for the shapes and the math."""
    c = as_communicator(comm, "moe_layer")
    if buffers.hidden is None or buffers.expert_out is None:
        missing = "hidden" if buffers.hidden is None else "expert_out"
        raise _invalid("moe_layer", f"buffers.{missing} is None: allocate the buffers with moe_buffers(comm, config, "
                                    "hidden_intermediate=I) (and expert_out=True)", c.rank)
    if out is None:
        config = _plan(plan, "moe_layer", c.rank).config
        out = torch.empty((plan.num_tokens, config.hidden), dtype=_MOE_DTYPES[config.dtype],
                          device=torch.device("cuda", c.device))
    return _moe_layer(c, plan, x, gate_up, down, buffers.recv_x, buffers.hidden, buffers.expert_out, out,
                      stream=_raw_stream(c.device), shared_gate_up=shared_gate_up, shared_down=shared_down)


def moe_topk(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
             renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's top-k on logits' GPU (``torch.ops.loom.moe_topk``): loom.moe_topk on the current
    torch stream into new tensors, returning (ids int32 [T, top_k], weights float32 [T, top_k]) for
    logits [T, E] (bf16, fp16 or fp32, contiguous; E <= 1024, top_k <= min(E, 32)). ids: the top_k
    largest logits of each row, largest first (ties: the lower id), -1 where fewer than top_k
    logits are finite (-inf is never chosen); weights: their softmax over all E (scoring 'softmax')
    or sigmoid(logit) ('sigmoid'), divided by their sum when renormalize, 0 in the -1 slots. No
    communicator; capturable in a CUDA graph. See loom.moe_topk."""
    op = "moe_topk"
    if not isinstance(logits, torch.Tensor):
        raise _invalid(op, f"logits must be a torch.Tensor, got {type(logits).__module__}.{type(logits).__qualname__}")
    if logits.dim() != 2:
        raise _invalid(op, f"logits must be 2-D [T, E], got shape {list(logits.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise _invalid(op, f"top_k must be a positive int, got {top_k!r}")
    if not isinstance(scoring, str):
        raise _invalid(op, f"scoring must be 'softmax' or 'sigmoid', got {type(scoring).__name__}")
    if not isinstance(renormalize, bool):
        raise _invalid(op, f"renormalize must be a bool, got {type(renormalize).__name__}")
    return torch.ops.loom.moe_topk.default(logits, top_k, scoring, renormalize)


def moe_layer_from_topk(comm: CommLike, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
                        gate_up: torch.Tensor, down: torch.Tensor, *, num_experts: int, max_tokens: int,
                        capacity: int = 0, overflow: str = "error", shared_gate_up: Optional[torch.Tensor] = None,
                        shared_down: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Collective (``torch.ops.loom.moe_layer``): the whole MoE FFN step from the router's top-k,
    on the current torch stream: loom.moe_routing of topk_ids (and topk_weights),
    then loom.moe_layer into a new out [T, hidden] of x's dtype, returned. out[t] = sum over token
    t's routed slots j, in slot order, of w[t, j] * (silu(x[t] Wg_e^T) * (x[t] Wu_e^T)) Wd_e^T
    (see loom.moe_layer for the math and the rounding).

    x: [T, hidden] bf16 or fp16 (T <= max_tokens, may differ per rank and be 0). topk_ids: int32
    [T, k], expert ids in [0, num_experts) or -1 (an unused slot), e.g. from moe_topk.
    topk_weights: float32 [T, k] (None: every weight 1). gate_up: this rank's experts' gate and up
    weights, [E/W, 2I, hidden] interleaved by 8 (``swiglu_weights(gate, up)``); down: [E/W,
    hidden, I]; both x's dtype, I a multiple of 8. The MoE config is (num_experts, k, hidden, x's
    dtype, max_tokens, capacity, overflow); see loom.MoeConfig. Every rank calls it in the same
    order with the same config.

    The routing goes into buffers cached on the communicator for (config, I) (``moe_buffers(comm,
    config, hidden_intermediate=I)``), allocated by the first call with them (collective; kept until
    the communicator closes). Calls sharing them are ordered by the stream, as the collective
    contract asks. CUDA graphs: run it once eagerly with the config first; a first call during
    capture raises ``loom.InvalidArgument``. Bad
    shapes, dtypes or devices raise ``loom.InvalidArgument`` before anything is launched; expert
    ids out of range or a rank over its capacity (overflow 'error') leave out all NaN (it is
    NaN-filled first, and a failed routing makes the layer write nothing); the op cannot say why
    without a host wait (``loom.moe_report`` needs the plan: use moe_buffers, loom.moe_routing and
    moe_layer to see it).

    Shared expert (both or neither): shared_gate_up [2I, hidden] (``swiglu_weights(gate[None],
    up[None])[0]``) and shared_down [hidden, I], x's dtype: every token also goes through that
    dense FFN, added with weight 1 before out's one rounding (DeepSeek-V3, Llama 4); its tiles
    run first in the kernel, overlapping the dispatch."""
    # The numbers before the dispatcher sees them (it would refuse a float without loom's message);
    # the operator checks everything again, with the rank.
    _moe_scalars(num_experts, max_tokens, capacity, overflow, None)
    return torch.ops.loom.moe_layer.default(register_communicator(comm), x, topk_ids, topk_weights, gate_up, down,
                                            num_experts, max_tokens, capacity, overflow, shared_gate_up, shared_down)


def zigzag_shard(x: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s chunk of a whole sequence for causal ring attention: the sequence (dimension
    `dim`, length divisible by 2 * world) cut into 2 * world chunks, chunks rank and 2W-1-rank."""
    n = x.shape[dim]
    if world < 1 or not 0 <= rank < world or n % (2 * world) != 0:
        raise _invalid("zigzag_shard", f"a sequence of {n} rows does not split into 2 x {world} chunks for rank {rank}")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's zigzag chunk (parts[r] from rank r), in order."""
    world = len(parts)
    halves = [None] * (2 * world)
    for r, p in enumerate(parts):
        a, b = p.chunk(2, dim=dim)
        halves[r], halves[2 * world - 1 - r] = a, b
    return torch.cat(halves, dim=dim)
