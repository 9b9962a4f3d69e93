"""loom's ops on any DLPack CUDA tensors, with explicit outputs (nothing is allocated here).

Each runs on ``stream`` if given (a stream object: torch.cuda.Stream or anything with
``__cuda_stream__``; or a cudaStream_t as an int), else on the current stream of the tensor's
framework (torch, CuPy; other frameworks must pass ``stream=``). ``comm`` is a loom.Communicator or
a torch ProcessGroup (then the communicator cached for it: ``Communicator.for_process_group``). Arguments are checked
before anything is launched; problems raise ``loom.InvalidArgument`` (a ValueError) or
``loom.Unsupported`` naming the rank, the op and the reason. Launches are asynchronous:
device-side failures (a peer that never arrives) surface at ``comm.synchronize()``.

Symmetric buffers (``comm.empty``) are required where peers read or write: all_gather's recv,
reduce_scatter's send, all_reduce's send and recv, gemm_ar's out, ag_gemm's gathered_a.
"""

from __future__ import annotations

from typing import Optional, TypeVar

from . import _C
from ._comm import CommLike, as_communicator
from ._streams import StreamArg, current_stream, stream_handle
from ._types import DLPackArray

Out = TypeVar("Out", bound=DLPackArray)


def _stream(stream: StreamArg, tensor: DLPackArray, op: str, device: Optional[int] = None,
            rank: Optional[int] = None) -> int:
    if stream is None:
        return current_stream(tensor, device)
    return stream_handle(stream, op, device, rank)


def gemm(a: DLPackArray, b: DLPackArray, out: Out, *, b_layout: str = "kn", stream: StreamArg = None,
         tile: str = "auto", num_ctas: int = 0) -> Out:
    """out[M, N] = a[M, K] @ b on one GPU; b is [K, N] (b_layout 'kn') or an nn.Linear weight
    [N, K] ('nk'). bf16/fp16 inputs (the same for a and b), bf16/fp16/fp32 out; fp32 accumulation."""
    # A stream object that names its device must be a's (torch tensors tell theirs).
    device = a.get_device() if stream is not None and hasattr(a, "get_device") else None
    _C.gemm(a, b, out, _stream(stream, a, "gemm", device), b_layout, tile, num_ctas)
    return out


def all_gather(comm: CommLike, send: DLPackArray, recv: Out, *, stream: StreamArg = None, num_ctas: int = 0,
               engine: str = "auto") -> Out:
    """recv (symmetric, world_size x send's elements) = every rank's send, in rank order."""
    c = as_communicator(comm, "all_gather")
    _C.all_gather(c._c, send, recv, _stream(stream, send, "all_gather", c.device, c.rank), num_ctas, engine)
    return recv


def reduce_scatter(comm: CommLike, send: DLPackArray, recv: Out, *, stream: StreamArg = None,
                   num_ctas: int = 0) -> Out:
    """recv = this rank's chunk of the sum over ranks of send (symmetric, world_size x recv's elements)."""
    c = as_communicator(comm, "reduce_scatter")
    _C.reduce_scatter(c._c, send, recv, _stream(stream, send, "reduce_scatter", c.device, c.rank), num_ctas)
    return recv


def all_reduce(comm: CommLike, send: DLPackArray, recv: Optional[DLPackArray] = None, *, stream: StreamArg = None,
               num_ctas: int = 0) -> DLPackArray:
    """recv = sum over ranks of send (both symmetric); in place when recv is omitted.

    Sums are fp32 in rank order with one rounding: every rank gets bit-identical results."""
    c = as_communicator(comm, "all_reduce")
    if recv is None:
        recv = send
    _C.all_reduce(c._c, send, recv, _stream(stream, send, "all_reduce", c.device, c.rank), num_ctas)
    return recv


def ag_gemm(comm: CommLike, a: DLPackArray, b: DLPackArray, out: Out, *, b_layout: str = "kn",
            gathered_a: Optional[DLPackArray] = None, stream: StreamArg = None, algorithm: str = "auto",
            comm_ctas: int = -1, tile: str = "auto") -> Out:
    """out[M, N] = AllGather_rows(a[M/W, K]) @ b. With gathered_a (symmetric [M, K]) the gathered
    A is kept there too."""
    c = as_communicator(comm, "ag_gemm")
    _C.ag_gemm(c._c, a, b, out, _stream(stream, a, "ag_gemm", c.device, c.rank), b_layout, gathered_a, algorithm,
               comm_ctas, tile)
    return out


def gemm_rs(comm: CommLike, a: DLPackArray, b: DLPackArray, out: Out, *, b_layout: str = "kn",
            stream: StreamArg = None, algorithm: str = "auto", comm_ctas: int = -1, tile: str = "auto") -> Out:
    """out[M/W, N] = ReduceScatter_rows(a[M, K] @ b), K being this rank's share of the reduction."""
    c = as_communicator(comm, "gemm_rs")
    _C.gemm_rs(c._c, a, b, out, _stream(stream, a, "gemm_rs", c.device, c.rank), b_layout, None, algorithm,
               comm_ctas, tile)
    return out


def gemm_ar(comm: CommLike, a: DLPackArray, b: DLPackArray, out: Out, *, b_layout: str = "kn",
            stream: StreamArg = None, algorithm: str = "auto", comm_ctas: int = -1, tile: str = "auto") -> Out:
    """out[M, N] (symmetric) = AllReduce(a[M, K] @ b)."""
    c = as_communicator(comm, "gemm_ar")
    _C.gemm_ar(c._c, a, b, out, _stream(stream, a, "gemm_ar", c.device, c.rank), b_layout, None, algorithm,
               comm_ctas, tile)
    return out


def _device_of(x: DLPackArray) -> Optional[int]:
    return x.get_device() if hasattr(x, "get_device") else None


def attention(q: DLPackArray, k: DLPackArray, v: DLPackArray, out: Out, *, lse: Optional[DLPackArray] = None,
              causal: bool = False, scale: Optional[float] = None, cu_seqlens_q: Optional[DLPackArray] = None,
              cu_seqlens_k: Optional[DLPackArray] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
              partial: bool = False, stream: StreamArg = None, num_ctas: int = 0, block_n: int = 0,
              block_m: int = 0) -> Out:
    """out = softmax(scale * q k^T) v on one GPU (flash attention forward).

    q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] (bf16 or fp16; Hq a multiple of Hkv; D 64, 128 or
    256), out like q; lse [B, Hq, Sq] float32 receives the log-sum-exp. Packed sequences: q [Tq, Hq,
    D], k and v [Tk, Hkv, D], int32 offsets cu_seqlens_q / cu_seqlens_k [B + 1] on the GPU and the
    longest lengths max_seqlen_q / max_seqlen_k; lse [Hq, Tq]. causal: key j is visible to query i
    iff j <= i + Sk - Sq (bottom-right). scale: default 1/sqrt(D). partial: out is float32 for
    attention_merge (lse required). Offsets are checked on the GPU: bad ones write nothing and
    raise at the next loom call on the device or at synchronize_standalone(). block_n: keys per
    block, block_m: query rows per tile (tuning; 0: the planner's; block_m 192 at D 64 only)."""
    device = _device_of(q) if stream is not None else None
    _C.attention(q, k, v, out, lse, _stream(stream, q, "attention", device), causal,
                 0.0 if scale is None else float(scale), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 partial, num_ctas, block_n, block_m)
    return out


def attention_merge(partial_out: DLPackArray, partial_lse: DLPackArray, out: Out, *, lse: Optional[DLPackArray] = None,
                    stream: StreamArg = None) -> Out:
    """Combines n partial-mode attention results over disjoint key sets of the same queries in
    fp32: partial_out [n, B, S, H, D] float32 (packed: [n, T, H, D]), partial_lse [n, B, H, S]
    ([n, H, T]); out [B, S, H, D] (bf16, fp16 or fp32), lse [B, H, S] (optional)."""
    device = _device_of(partial_out) if stream is not None else None
    _C.attention_merge(partial_out, partial_lse, out, lse, _stream(stream, partial_out, "attention_merge", device))
    return out


def synchronize_standalone(stream: StreamArg = None, like: Optional[DLPackArray] = None) -> None:
    """Waits for the stream (default: the current torch stream) and raises what a standalone op
    (attention, gemm) recorded on the GPU since the last check, such as bad packed offsets."""
    handle = stream_handle(stream, "synchronize_standalone", None, None) if stream is not None else (
        current_stream(like, None) if like is not None else 0)
    _C.synchronize_standalone(handle)


def ring_attention(comm: CommLike, q: DLPackArray, k: DLPackArray, v: DLPackArray, out: Out, *,
                   lse: Optional[DLPackArray] = None, causal: bool = False, scale: Optional[float] = None,
                   stream: StreamArg = None, kv_ctas: int = 0, block_n: int = 0) -> Out:
    """Sequence-parallel attention over the ranks of the job, one node or several (collective;
    across nodes rank r = node * L + local index, as torchrun numbers them): this rank's chunk q
    [B, S_l, Hq, D], k and v [B, S_l, Hkv, D] attend over every rank's keys; out like q, lse
    [B, Hq, S_l] float32. causal: the zigzag layout (rank r holds chunks r and 2W-1-r of S_l / 2;
    loom.torch.zigzag_shard builds it). One persistent kernel: K/V travel around the ring (across
    nodes once per node through the proxy, then around each node's ring) while the attention
    engine computes."""
    c = as_communicator(comm, "ring_attention")
    _C.ring_attention(c._c, q, k, v, out, lse, _stream(stream, q, "ring_attention", c.device, c.rank), causal,
                      0.0 if scale is None else float(scale), kv_ctas, block_n)
    return out


def grouped_gemm(a: DLPackArray, b: DLPackArray, d: Out, *, workspace: DLPackArray,
                 offsets: Optional[DLPackArray] = None, counts: Optional[DLPackArray] = None,
                 stream: StreamArg = None, tile: str = "auto", num_ctas: int = 0, b_layout: str = "nk",
                 activation: str = "none", swap_tails: bool = True, group_m: int = 0,
                 tile_queue: bool = True, expert_groups: bool = True) -> Out:
    """d_e = a_e @ b_e^T for every expert e in one kernel (MoE expert GEMM on one GPU); b [E, N, K]
    (one nn.Linear weight per expert; b_layout 'kn': b [E, K, N] and d_e = a_e @ b_e), bf16 or
    fp16; d bf16, fp16 or fp32; fp32 accumulation.

    Contiguous layout (offsets given): a [M, K] with rows grouped by expert, offsets int32 [E + 1]
    on the GPU (expert e owns rows offsets[e] .. offsets[e+1], any count including 0), d [M, N].
    Masked layout (counts given): a [E, C, K], counts int32 [E], d [E, C, N]. Rows outside every
    expert are not written. workspace: int32 on the GPU with at least
    grouped_gemm_workspace_bytes(M or C, E, masked) / 4 elements, one call at a time. The counts
    stay on the GPU: no host synchronization. activation 'swiglu': b's N = 2I hold gate and up
    interleaved by 8 (loom.torch.swiglu_weights), d = silu(a @ gate^T) * (a @ up^T) with I columns.
    swap_tails (default): each expert's last partial tile row is computed with its rows as wgmma's N
    (about its own rows' cost, not a whole tile's); False pads it like the others (A/B timing).
    group_m: the raster's group height in tile rows (0: the planner's). tile_queue (default): tiles
    claimed first come, first served from a counter in the workspace; False: round-robin.
    expert_groups (default): the raster's groups end at the experts' ends, so a group loads one
    expert's B; False: groups of group_m tile rows whatever the experts."""
    device = _device_of(a) if stream is not None else None
    _C.grouped_gemm(a, b, d, offsets, counts, workspace, _stream(stream, a, "grouped_gemm", device), tile, num_ctas,
                    b_layout, activation, swap_tails, group_m, tile_queue, expert_groups)
    return d


def grouped_gemm_workspace_bytes(rows: int, num_experts: int, masked: bool = False) -> int:
    """Bytes of workspace grouped_gemm needs: rows = M (contiguous layout) or the capacity per
    expert (masked)."""
    return _C.grouped_gemm_workspace_bytes(rows, num_experts, masked)
