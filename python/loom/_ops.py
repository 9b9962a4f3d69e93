"""loom's ops on any DLPack CUDA tensors, with explicit outputs (nothing is allocated here).

Each runs on ``stream`` if given (a cudaStream_t as an int), else on the current stream of the
tensor's framework (torch, CuPy; other frameworks must pass ``stream=``). Arguments are checked
before anything is launched; problems raise ``loom.InvalidArgument`` (a ValueError) or
``loom.Unsupported`` naming the rank, the op and the reason. Launches are asynchronous:
device-side failures (a peer that never arrives) surface at ``comm.synchronize()``.

Symmetric buffers (``comm.empty``) are required where peers read or write: all_gather's recv,
reduce_scatter's send, all_reduce's send and recv, gemm_ar's out, ag_gemm's gathered_a.
"""

from __future__ import annotations

from typing import Any

from . import _C
from ._streams import current_stream


def gemm(a: Any, b: Any, out: Any, *, b_layout: str = "kn", stream: int | None = None, tile: str = "auto",
         num_ctas: int = 0) -> Any:
    """out[M, N] = a[M, K] @ b on one GPU; b is [K, N] (b_layout 'kn') or an nn.Linear weight
    [N, K] ('nk'). bf16/fp16 inputs (the same for a and b), bf16/fp16/fp32 out; fp32 accumulation."""
    _C.gemm(a, b, out, current_stream(a) if stream is None else stream, b_layout, tile, num_ctas)
    return out


def all_gather(comm: Any, send: Any, recv: Any, *, stream: int | None = None, num_ctas: int = 0,
               engine: str = "auto") -> Any:
    """recv (symmetric, world_size x send's elements) = every rank's send, in rank order."""
    _C.all_gather(comm._c, send, recv, current_stream(send, comm.device) if stream is None else stream, num_ctas,
                  engine)
    return recv


def reduce_scatter(comm: Any, send: Any, recv: Any, *, stream: int | None = None, num_ctas: int = 0) -> Any:
    """recv = this rank's chunk of the sum over ranks of send (symmetric, world_size x recv's elements)."""
    _C.reduce_scatter(comm._c, send, recv, current_stream(send, comm.device) if stream is None else stream, num_ctas)
    return recv


def all_reduce(comm: Any, send: Any, recv: Any = None, *, stream: int | None = None, num_ctas: int = 0) -> Any:
    """recv = sum over ranks of send (both symmetric); in place when recv is omitted.

    Sums are fp32 in rank order with one rounding: every rank gets bit-identical results."""
    if recv is None:
        recv = send
    _C.all_reduce(comm._c, send, recv, current_stream(send, comm.device) if stream is None else stream, num_ctas)
    return recv


def ag_gemm(comm: Any, a: Any, b: Any, out: Any, *, b_layout: str = "kn", gathered_a: Any = None,
            stream: int | None = None, algorithm: str = "auto", comm_ctas: int = -1, tile: str = "auto") -> Any:
    """out[M, N] = AllGather_rows(a[M/W, K]) @ b. With gathered_a (symmetric [M, K]) the gathered
    A is kept there too."""
    _C.ag_gemm(comm._c, a, b, out, current_stream(a, comm.device) if stream is None else stream, b_layout,
               gathered_a, algorithm, comm_ctas, tile)
    return out


def gemm_rs(comm: Any, a: Any, b: Any, out: Any, *, b_layout: str = "kn", stream: int | None = None,
            algorithm: str = "auto", comm_ctas: int = -1, tile: str = "auto") -> Any:
    """out[M/W, N] = ReduceScatter_rows(a[M, K] @ b), K being this rank's share of the reduction."""
    _C.gemm_rs(comm._c, a, b, out, current_stream(a, comm.device) if stream is None else stream, b_layout, None,
               algorithm, comm_ctas, tile)
    return out


def gemm_ar(comm: Any, a: Any, b: Any, out: Any, *, b_layout: str = "kn", stream: int | None = None,
            algorithm: str = "auto", comm_ctas: int = -1, tile: str = "auto") -> Any:
    """out[M, N] (symmetric) = AllReduce(a[M, K] @ b)."""
    _C.gemm_ar(comm._c, a, b, out, current_stream(a, comm.device) if stream is None else stream, b_layout, None,
               algorithm, comm_ctas, tile)
    return out
