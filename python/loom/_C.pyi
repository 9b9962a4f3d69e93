"""
loom's low-level API: explicit CUDA streams, any DLPack CUDA tensor. Most code uses loom.* or loom.torch.
"""

# Kept by hand: `python -m nanobind.stubgen -m loom._C` wrote it first (empty()'s return type and
# the underscore names were added; the MoE classes and functions were pasted from its output when
# they were bound); tests/python/test_stubs.py checks it against the module.

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

def attention(q: object | None, k: object | None, v: object | None, out: object | None, lse: object | None, stream: int, causal: bool = False, scale: float = 0.0, cu_seqlens_q: object | None = None, cu_seqlens_k: object | None = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0, partial: bool = False, num_ctas: int = 0, block_n: int = 0, block_m: int = 0) -> None:
    """
    out = softmax(scale q k^T) v (flash attention forward on one GPU); lse (optional) gets the fp32 log-sum-exp.
    """

def ring_attention(comm: Communicator, q: object | None, k: object | None, v: object | None, out: object | None, lse: object | None, stream: int, causal: bool = False, scale: float = 0.0, kv_ctas: int = 0, block_n: int = 0) -> None:
    """
    Ring attention over the communicator's ranks: out = attention of this rank's queries over every rank's keys.
    """

def attention_merge(partial_out: object | None, partial_lse: object | None, out: object | None, lse: object | None, stream: int) -> None:
    """Combines partial-mode attention results over disjoint key sets (fp32)."""

def grouped_gemm(a: object | None, b: object | None, d: object | None, offsets: object | None, counts: object | None, workspace: object | None, stream: int, tile: str = 'auto', num_ctas: int = 0, b_layout: str = 'nk', activation: str = 'none', swap_tails: bool = True, group_m: int = 0, tile_queue: bool = True, expert_groups: bool = True) -> None:
    """
    d_e = a_e @ b_e^T (b [E, N, K], b_layout 'nk') or a_e @ b_e (b [E, K, N], 'kn') for every expert e (MoE grouped GEMM on one GPU); offsets: contiguous rows, counts: masked; activation 'swiglu': silu(gate) * up over N interleaved by 8 (d has N / 2 columns).
    """

class MoeConfig:
    """
    The shape of an MoE step (loom::MoeConfig); every rank passes the same one. See loom.MoeConfig.
    """

    def __init__(self, num_experts: int, top_k: int, hidden: int, dtype: str, max_tokens: int, capacity: int = 0, overflow: str = 'error') -> None: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def top_k(self) -> int: ...

    @property
    def hidden(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def max_tokens(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def overflow(self) -> str: ...

    def __repr__(self) -> str: ...

class MoeSizes:
    """What a config needs on a communicator (moe_sizes)."""

    @property
    def capacity(self) -> int: ...

    @property
    def local_experts(self) -> int: ...

    @property
    def plan_bytes(self) -> int: ...

    @property
    def recv_bytes(self) -> int: ...

    @property
    def workspace_bytes(self) -> int: ...

    def __repr__(self) -> str: ...

class MoeReport:
    """This rank's counts from the device after a routing (moe_report)."""

    @property
    def recv_rows(self) -> int: ...

    @property
    def kept_rows(self) -> int: ...

    @property
    def dropped_rows(self) -> int: ...

    @property
    def dropped_slots(self) -> int: ...

    @property
    def max_recv_rows(self) -> int: ...

    def __repr__(self) -> str: ...

class MoePlan:
    """
    The routing's handle (made by moe_routing only); keeps its plan buffer and expert_offsets alive. Valid for the communicator that routed it until the next routing into its buffers.
    """

    @property
    def config(self) -> object: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def local_experts(self) -> int: ...

    @property
    def plan_buffer(self) -> object: ...

    @property
    def expert_offsets(self) -> object: ...

    def __repr__(self) -> str: ...

def moe_can_implement(comm: Communicator, config: MoeConfig) -> tuple[str, str] | None:
    """
    None when the config can run on comm (host checks only), else (status code, reason).
    """

def moe_sizes(comm: Communicator, config: MoeConfig) -> MoeSizes:
    """
    The sizes a config needs on comm (capacity, E/W, plan, receive and workspace bytes).
    """

def moe_reserve_workspace(comm: Communicator, config: MoeConfig, stream: int) -> None:
    """
    Collective: grows loom's symmetric workspace for the config now (before CUDA-graph capture).
    """

def moe_routing(comm: Communicator, config: MoeConfig, topk_ids: object | None, plan_buffer: object | None, expert_offsets: object | None, stream: int, topk_weights: object | None = None) -> MoePlan:
    """
    Collective: routes every rank's top-k expert ids on the device; returns the plan for dispatch and combine.
    """

def moe_dispatch(comm: Communicator, plan: MoePlan, x: object | None, recv_x: object | None, stream: int, num_ctas: int = 0, arrival_ctas: int = 0) -> None:
    """
    Collective: sends x's rows [T, hidden] to their experts' ranks, into recv_x (symmetric [capacity, hidden]).
    """

def moe_combine(comm: Communicator, plan: MoePlan, expert_out: object | None, out: object | None, stream: int, topk_weights: object | None = None, num_ctas: int = 0) -> None:
    """
    Collective: out[t] = sum over t's slots j of w[t, j] * expert_out[row of (t, j)] (expert_out symmetric), fp32.
    """

def moe_report(comm: Communicator, plan: MoePlan, stream: int) -> MoeReport:
    """
    Waits for the stream and returns this rank's counts; raises what the routing found on the device.
    """

def moe_dispatch_gemm(comm: Communicator, plan: MoePlan, x: object | None, recv_x: object | None, weights: object | None, out: object | None, stream: int, b_layout: str = 'nk', activation: str = 'none', tile: str = 'auto', num_ctas: int = 0, push_ctas: int = 0, arrival_ctas: int = 0, expert_groups: bool = True) -> None:
    """
    Collective: moe_dispatch and, in the same kernel, out = recv_x_e @ weights_e^T for every local expert e.
    """

def moe_layer(comm: Communicator, plan: MoePlan, x: object | None, gate_up: object | None, down: object | None, recv_x: object | None, hidden: object | None, expert_out: object | None, out: object | None, stream: int, tile: str = 'auto', num_ctas: int = 0, push_ctas: int = 0, arrival_ctas: int = 0, shared_gate_up: object | None = None, shared_down: object | None = None, phases: object | None = None, swap_tails: bool = True, expert_groups: bool = True) -> None:
    """
    Collective: the whole MoE FFN step in one kernel: out[t] = sum_j w[t, j] * (silu(x gate^T) * (x up^T)) down^T over t's routed experts, plus a shared expert's FFN of x[t] when shared_gate_up and shared_down are given. phases: diagnostics, one 64-byte record per SM (loom.moe_layer_phases reads them).
    """

def moe_layer_rows(capacity: int, max_tokens: int, shared_expert: bool) -> int:
    """
    The rows of moe_layer's hidden and expert_out: capacity, or with a shared expert align_up(capacity, 128) + max_tokens.
    """

def moe_topk(logits: object | None, topk_ids: object | None, topk_weights: object | None, stream: int, top_k: int, scoring: str = 'softmax', renormalize: bool = False) -> None:
    """
    The router's top-k on one GPU (no communicator): topk_ids [T, k] the k largest logits of [T, E] (largest first, ties to the lower id), topk_weights their softmax over E or sigmoid (renormalize: / their sum).
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

def _check_moe_args(op: str, config: MoeConfig, world: int, num_tokens: int, tensors: tuple, b_layout: str = 'nk', activation: str = 'none') -> None:
    """
    The tensor checks of an MoE call (tensors in the binding's order), without a communicator or a launch.
    """

def _check_moe_topk(logits: object | None, topk_ids: object | None, topk_weights: object | None, top_k: int, scoring: str = 'softmax', renormalize: bool = False) -> None:
    """
    moe_topk's checks (the binding's, then loom's host checks, then the devices), without a launch.
    """
