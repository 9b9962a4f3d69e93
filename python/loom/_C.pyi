"""
loom's low-level API: explicit CUDA streams, any DLPack CUDA tensor. Most code uses loom.* or loom.torch.
"""

# Kept by hand: `python -m nanobind.stubgen -m loom._C` wrote it first (empty()'s return type and
# the underscore names were added); tests/python/test_stubs.py checks it against the module.

from collections.abc import Sequence

from loom._types import DLPackArray

__version__: str


def library_version() -> str:
    """the version of the libloom.so this extension runs with"""

class Communicator:
    """A loom communicator (see loom.Communicator for the Python API)."""

    @staticmethod
    def from_env(device: int = -1, heap_bytes: int = 0, op_timeout_ms: int = 0, bootstrap_timeout_ms: int = 0) -> Communicator: ...

    @staticmethod
    def from_unique_id(unique_id: bytes, rank: int, world_size: int, device: int = -1, heap_bytes: int = 0, op_timeout_ms: int = 0, bootstrap_timeout_ms: int = 0) -> Communicator: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def local_world_size(self) -> int: ...

    @property
    def node(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def device(self) -> int: ...

    @property
    def sm_count(self) -> int: ...

    @property
    def ranks_per_gpu(self) -> int: ...

    @property
    def ranks_on_gpu(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def live_buffers(self) -> int: ...

    def synchronize(self, stream: int) -> None: ...

    def barrier(self) -> None: ...

    def abort(self, reason: str) -> None: ...

    def health(self) -> tuple[str, str] | None: ...

    def is_symmetric(self, ptr: int, bytes: int) -> bool: ...

    def empty(self, shape: Sequence[int], dtype: str) -> DLPackArray:
        """
        Collective: a symmetric buffer as a DLPack array (torch.from_dlpack / cupy.from_dlpack), freed when its last consumer goes.
        """

    def close(self) -> None: ...

def make_unique_id(bind_addr: str = '127.0.0.1') -> bytes: ...

def discard_unique_id(unique_id: bytes) -> None: ...

def gemm(a: object | None, b: object | None, out: object | None, stream: int, b_layout: str = 'kn', tile: str = 'auto', num_ctas: int = 0) -> None:
    """
    out = a @ b (b_layout 'kn': b is [K, N]; 'nk': b is [N, K]) on one GPU; bf16/fp16 in, bf16/fp16/fp32 out.
    """

def all_gather(comm: Communicator, send: object | None, recv: object | None, stream: int, num_ctas: int = 0, engine: str = 'auto') -> None:
    """
    recv (symmetric, world x send elements) = every rank's send, in rank order.
    """

def reduce_scatter(comm: Communicator, send: object | None, recv: object | None, stream: int, num_ctas: int = 0, engine: str = 'auto') -> None:
    """
    recv = this rank's chunk of the sum over ranks of send (send symmetric, world x recv elements).
    """

def all_reduce(comm: Communicator, send: object | None, recv: object | None, stream: int, num_ctas: int = 0, engine: str = 'auto') -> None:
    """recv = sum over ranks of send (both symmetric; send may be recv)."""

def ag_gemm(comm: Communicator, a: object | None, b: object | None, out: object | None, stream: int, b_layout: str = 'kn', gathered_a: object | None = None, algorithm: str = 'auto', comm_ctas: int = -1, tile: str = 'auto') -> None:
    """out [M, N] = AllGather_rows(a [M/W, K]) @ b."""

def gemm_rs(comm: Communicator, a: object | None, b: object | None, out: object | None, stream: int, b_layout: str = 'kn', gathered_a: object | None = None, algorithm: str = 'auto', comm_ctas: int = -1, tile: str = 'auto') -> None:
    """out [M/W, N] = ReduceScatter_rows(a [M, K] @ b)."""

def gemm_ar(comm: Communicator, a: object | None, b: object | None, out: object | None, stream: int, b_layout: str = 'kn', gathered_a: object | None = None, algorithm: str = 'auto', comm_ctas: int = -1, tile: str = 'auto') -> None:
    """out [M, N] (symmetric) = AllReduce(a [M, K] @ b)."""

def attention(q: object | None, k: object | None, v: object | None, out: object | None, lse: object | None, stream: int, causal: bool = False, scale: float = 0.0, cu_seqlens_q: object | None = None, cu_seqlens_k: object | None = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0, partial: bool = False, num_ctas: int = 0, block_n: int = 0) -> None:
    """
    out = softmax(scale q k^T) v (flash attention forward on one GPU); lse (optional) gets the fp32 log-sum-exp.
    """

def ring_attention(comm: Communicator, q: object | None, k: object | None, v: object | None, out: object | None, lse: object | None, stream: int, causal: bool = False, scale: float = 0.0, kv_ctas: int = 0, block_n: int = 0) -> None:
    """
    Ring attention over the communicator's ranks: out = attention of this rank's queries over every rank's keys.
    """

def attention_merge(partial_out: object | None, partial_lse: object | None, out: object | None, lse: object | None, stream: int) -> None:
    """Combines partial-mode attention results over disjoint key sets (fp32)."""

def grouped_gemm(a: object | None, b: object | None, d: object | None, offsets: object | None, counts: object | None, workspace: object | None, stream: int, tile: str = 'auto', num_ctas: int = 0, b_layout: str = 'nk', activation: str = 'none') -> None:
    """
    d_e = a_e @ b_e^T (b [E, N, K], b_layout 'nk') or a_e @ b_e (b [E, K, N], 'kn') for every expert e (MoE grouped GEMM on one GPU); offsets: contiguous rows, counts: masked; activation 'swiglu': silu(gate) * up over N interleaved by 8 (d has N / 2 columns).
    """

def grouped_gemm_workspace_bytes(rows: int, num_experts: int, masked: bool = False) -> int:
    """
    Bytes of workspace grouped_gemm needs: rows = M (contiguous) or the capacity per expert (masked).
    """

def synchronize_standalone(stream: int) -> None:
    """
    Waits for the stream and raises what a standalone op (attention, gemm) recorded on the device (bad offsets).
    """

def _check_args(op: str, world: int, tensors: tuple, b_layout: str = 'kn') -> None:
    """The argument checks of an op, without a communicator and without launching."""

def _bench_cpp_loop(op: str, iters: int, args: tuple) -> int:
    """Host nanoseconds of `iters` launches of a prepared op from a C++ loop."""
