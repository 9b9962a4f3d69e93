"""loom: fused multi-GPU kernels for NVIDIA Hopper, from Python.

``import loom`` needs neither torch nor a GPU. Tensors are any DLPack CUDA tensors (torch, CuPy,
JAX); ops run on the caller's current stream (torch, CuPy) or on ``stream=`` (torch.cuda.Stream,
anything with ``__cuda_stream__``, or a cudaStream_t as an int). Where an op takes a communicator,
a torch ProcessGroup works too (``Communicator.for_process_group`` caches one per group).
``loom.torch`` registers the ops as torch.library operators (``torch.ops.loom.*``), with the same
argument order (``comm`` first). The distribution is called ``loom-kernels``.

    comm = loom.Communicator.from_process_group()  # under torchrun, after init_process_group
    x = torch.from_dlpack(comm.empty((n,), "bf16"))  # symmetric memory (peers can read it)
    loom.all_reduce(comm, x)                      # in place, current torch stream

Expert parallelism (MoE), within a node or across nodes: ``loom.MoeConfig``, ``loom.moe_routing``,
``loom.moe_dispatch``, ``loom.moe_combine``, ``loom.moe_report``, ``loom.moe_dispatch_gemm``, and
``loom.moe_layer``, the whole FFN step in one kernel within a node (loom/_moe.py has the step;
``loom.torch.moe_buffers`` allocates its buffers); ``loom.moe_topk``, the router's top-k on one GPU.
"""

from ._errors import (Aborted, CudaError, InternalError, InvalidArgument, LoomError, PeerFailure,
                      SystemCallError, Timeout, Unsupported)

try:
    from . import _C
except ImportError as error:  # pragma: no cover - only when the package was not built
    raise ImportError(f"loom: the compiled extension loom._C could not be loaded ({error}); install the "
                      "package with `pip install .` from the loom repository") from error

from ._comm import Communicator, discard_unique_id, make_unique_id
from ._moe import (MoeConfig, MoePlan, MoeReport, MoeSizes, moe_can_implement, moe_combine, moe_dispatch,
                   moe_dispatch_gemm, moe_layer, moe_layer_phases, moe_layer_rows, moe_report, moe_reserve_workspace,
                   moe_routing, moe_sizes, moe_topk)
from ._ops import (ag_gemm, all_gather, all_reduce, attention, attention_merge, gemm, gemm_ar, gemm_rs,
                   grouped_gemm, grouped_gemm_workspace_bytes, reduce_scatter, ring_attention,
                   synchronize_standalone)

__version__ = _C.__version__

__all__ = [
    "Communicator", "discard_unique_id", "make_unique_id",
    "gemm", "all_gather", "reduce_scatter", "all_reduce", "ag_gemm", "gemm_rs", "gemm_ar",
    "attention", "attention_merge", "ring_attention", "synchronize_standalone", "grouped_gemm",
    "grouped_gemm_workspace_bytes",
    "MoeConfig", "MoePlan", "MoeSizes", "MoeReport", "moe_can_implement", "moe_sizes", "moe_reserve_workspace",
    "moe_routing", "moe_dispatch", "moe_combine", "moe_report", "moe_dispatch_gemm", "moe_layer", "moe_layer_phases",
    "moe_layer_rows", "moe_topk",
    "LoomError", "InvalidArgument", "Unsupported", "Timeout", "PeerFailure", "CudaError",
    "SystemCallError", "Aborted", "InternalError",
    "__version__",
]
