"""loom.Communicator: one per rank (process and GPU), over the C++ loom::Communicator."""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Sequence, Union

from . import _C
from ._errors import LoomError, _from_status, _invalid
from ._staging import StagingCache
from ._streams import StreamArg, default_stream, stream_handle
from ._types import DLPackArray, DTypeLike

if TYPE_CHECKING:  # torch is never imported by `import loom`
    from torch.distributed import ProcessGroup

_DTYPE_NAMES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "f16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "f32": "fp32", "float32": "fp32", "float": "fp32",
}


def dtype_name(dtype: DTypeLike) -> str:
    """'bf16', 'fp16' or 'fp32' for a string, a torch dtype or a numpy/CuPy dtype."""
    text = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or str(dtype)
    text = text.removeprefix("torch.")
    name = _DTYPE_NAMES.get(text)
    if name is None:
        raise _invalid("dtype", f"{dtype!r}: loom takes bfloat16, float16 or float32")
    return name


# Communicators by int handle, for the torch operators (whose schemas take ints, not objects);
# held weakly. A handle is given at creation so that torch.compile only ever reads it.
_registry: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def register(comm: Any) -> int:
    """The int handle of `comm` (given once; anything with ``local_world_size`` can be registered)."""
    h = getattr(comm, "_loom_handle", None)
    if h is None:
        h = next(_handles)
        comm._loom_handle = h
        _registry[h] = comm
    return h


def lookup(h: int) -> Any:
    """The live communicator of handle `h`, or None."""
    return _registry.get(h)


def _default_bind_addr(group_root_is_job_root: bool) -> str:
    """Where rank 0's bootstrap listens when the caller does not say."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is not None and local == world:
        return "127.0.0.1"  # the whole job is on this node: loopback needs no name resolution
    address = os.environ.get("MASTER_ADDR") if group_root_is_job_root else None
    return address or socket.gethostbyname(socket.gethostname())


def make_unique_id(bind_addr: str = "127.0.0.1") -> bytes:
    """Rank 0 of a job calls this and shares the 128 bytes with the other ranks (they are opaque).

    It listens on `bind_addr` (an address or host name the other ranks reach; never 0.0.0.0) until
    this process's own ``Communicator.from_unique_id(uid, 0, world_size)`` takes the listener over.
    """
    return _C.make_unique_id(bind_addr)


def discard_unique_id(unique_id: bytes) -> None:
    """Closes the listener ``make_unique_id`` keeps for `unique_id` when this process will not
    create its rank 0 after all (at most 64 unused ids may wait at once)."""
    if not isinstance(unique_id, (bytes, bytearray, memoryview)):
        raise _invalid("discard_unique_id", f"unique_id must be bytes, got {type(unique_id).__name__}")
    _C.discard_unique_id(bytes(unique_id))


# What the C++ CommOptions field of each option holds: (lowest, highest).
_OPTION_RANGES = {"device": (-(1 << 31), (1 << 31) - 1), "heap_bytes": (0, (1 << 64) - 1),
                  "op_timeout_ms": (-(1 << 63), (1 << 63) - 1), "bootstrap_timeout_ms": (-(1 << 63), (1 << 63) - 1)}


def _options(device: int | None, heap_bytes: int, op_timeout_ms: int, bootstrap_timeout_ms: int) -> dict:
    """The creation options as the C++ layer takes them. Only their types are checked here; the C++
    layer (check_comm_options) checks the ranges and names the bad value in an InvalidArgument."""
    op = "Communicator"
    values = {"device": -1 if device is None else device, "heap_bytes": heap_bytes, "op_timeout_ms": op_timeout_ms,
              "bootstrap_timeout_ms": bootstrap_timeout_ms}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise _invalid(op, f"{name} must be an int, got {type(value).__name__}")
        low, high = _OPTION_RANGES[name]
        if not low <= value <= high:
            raise _invalid(op, f"{name} = {value} does not fit its C++ field [{low}, {high}]")
    return values


def _env_rank() -> int | None:
    text = os.environ.get("RANK", "")
    return int(text) if text.strip().isdigit() else None


class Communicator:
    """A loom communicator. Creating one is collective: every rank of the job creates its own.

    Options (0 or None keeps the LOOM_* environment's setting): ``device`` (CUDA device; default
    LOCAL_RANK, else rank % device count), ``heap_bytes`` (symmetric heap), ``op_timeout_ms``
    (device-side waits), ``bootstrap_timeout_ms`` (host-side waits: creation, barrier, empty()).

    Every op that takes a communicator also takes a torch ``ProcessGroup`` in its place: the
    communicator ``Communicator.for_process_group(group)`` caches for it.

    Ops on one communicator must be issued in the same order on every rank, from one stream order
    at a time. After a failure (timeout, abort) the communicator stays failed; later calls raise
    ``loom.Aborted`` with the first reason. ``close()`` (or ``with``) ends it on every rank.
    """

    def __init__(self, native: _C.Communicator) -> None:
        self._c = native
        register(self)
        # loom.torch's symmetric staging buffers (one growing buffer per role and dtype, under a
        # byte budget: loom/_staging.py).
        self._staging = StagingCache()
        # loom.torch's MoE buffers of torch.ops.loom.moe_layer, one set per (config, I); never
        # replaced, so captured CUDA graphs keep valid addresses until close().
        self._moe_layer_buffers: dict[Any, Any] = {}

    # ---- creation ----------------------------------------------------------------------------

    @classmethod
    def from_env(cls, *, device: int | None = None, heap_bytes: int = 0, op_timeout_ms: int = 0,
                 bootstrap_timeout_ms: int = 0) -> "Communicator":
        """From torchrun-style variables: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
        MASTER_ADDR, MASTER_PORT, and LOOM_SECRET (32 hex digits every rank shares; loom-run sets
        it). A job of several ranks without LOOM_SECRET is refused: a secret derived from public
        values would let anyone join it (docs/SECURITY.md).

        Under torchrun, MASTER_PORT is torch's own rendezvous store, so loom's bootstrap listens on
        MASTER_PORT + 1 (LOOM_BOOTSTRAP_PORT overrides). With torch.distributed initialised, this
        is ``from_process_group()``: the secret then travels inside the unique id over the process
        group, and LOOM_SECRET is not needed."""
        options = _options(device, heap_bytes, op_timeout_ms, bootstrap_timeout_ms)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return cls.from_process_group(None, **options)
            if "LOOM_SECRET" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise _invalid("Communicator.from_env",
                               "under torchrun without LOOM_SECRET: initialise torch.distributed first and use "
                               "loom.Communicator.from_process_group() (the secret then travels inside the unique "
                               "id), or set LOOM_SECRET to the same 32 hex digits on every rank (export "
                               "LOOM_SECRET=$(openssl rand -hex 16) where torchrun starts)",
                               _env_rank())
        return cls(_C.Communicator.from_env(**options))

    @classmethod
    def from_unique_id(cls, unique_id: bytes, rank: int, world_size: int, *, device: int | None = None,
                       heap_bytes: int = 0, op_timeout_ms: int = 0, bootstrap_timeout_ms: int = 0) -> "Communicator":
        """From a unique id made by rank 0 with ``loom.make_unique_id()`` and shared by the application."""
        if not isinstance(unique_id, (bytes, bytearray, memoryview)):
            raise _invalid("Communicator.from_unique_id",
                           f"unique_id must be the bytes from loom.make_unique_id(), got {type(unique_id).__name__}",
                           rank)
        return cls(_C.Communicator.from_unique_id(bytes(unique_id), int(rank), int(world_size),
                                                  **_options(device, heap_bytes, op_timeout_ms, bootstrap_timeout_ms)))

    @classmethod
    def from_process_group(cls, group: ProcessGroup | None = None, *, bind_addr: str | None = None, device: int | None = None,
                           heap_bytes: int = 0, op_timeout_ms: int = 0,
                           bootstrap_timeout_ms: int = 0) -> "Communicator":
        """Over the ranks of a torch.distributed process group (default: the world group).

        The group's rank 0 makes the unique id, listening on `bind_addr` (default: 127.0.0.1 when
        the job is on one node (LOCAL_WORLD_SIZE == WORLD_SIZE), else MASTER_ADDR when the group's
        rank 0 is the job's rank 0, else the address of rank 0's host name); it reaches the others
        through ``torch.distributed.broadcast_object_list``. The device defaults to torch's
        current CUDA device.
        """
        import torch
        import torch.distributed as dist

        if group is None:
            group = dist.group.WORLD
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        root = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        payload: list[Any] = [None]
        if rank == 0:
            address = bind_addr if bind_addr is not None else _default_bind_addr(root == 0)
            try:
                payload[0] = ("ok", make_unique_id(address))
            except LoomError as error:  # every rank raises it, so none waits for a bootstrap
                payload[0] = ("error", (type(error).code, error.op, error.reason))
        dist.broadcast_object_list(payload, src=root, group=group)
        status, value = payload[0]
        if status != "ok":
            code, op, reason = value
            raise _from_status(code, op, rank, f"on the group's rank 0: {reason}")
        if device is None and torch.cuda.is_available():
            device = torch.cuda.current_device()
        return cls.from_unique_id(value, rank, world_size, device=device, heap_bytes=heap_bytes,
                                  op_timeout_ms=op_timeout_ms, bootstrap_timeout_ms=bootstrap_timeout_ms)

    @classmethod
    def for_process_group(cls, group: ProcessGroup | None = None, *, bind_addr: str | None = None,
                          device: int | None = None, heap_bytes: int = 0, op_timeout_ms: int = 0,
                          bootstrap_timeout_ms: int = 0) -> "Communicator":
        """The communicator cached for `group` (default: the world group), which ops given the
        group use. The first call for a group creates it with ``from_process_group`` (collective:
        every rank of the group makes it; the options apply then and are ignored later); it is
        closed at interpreter exit (or by ``close()``, after which the next call makes a new one)."""
        import torch.distributed as dist

        if group is None:
            group = dist.group.WORLD
        cached = _group_communicators.get(id(group))
        if cached is not None and cached[0] is group and not cached[1].closed:
            return cached[1]
        comm = cls.from_process_group(group, bind_addr=bind_addr, device=device, heap_bytes=heap_bytes,
                                      op_timeout_ms=op_timeout_ms, bootstrap_timeout_ms=bootstrap_timeout_ms)
        # The group is held too, so that its id() is not reused by another group while cached.
        _group_communicators[id(group)] = (group, comm)
        return comm

    # ---- properties --------------------------------------------------------------------------

    rank = property(lambda self: self._c.rank, doc="this rank in [0, world_size)")
    world_size = property(lambda self: self._c.world_size)
    local_rank = property(lambda self: self._c.local_rank, doc="index within this node")
    local_world_size = property(lambda self: self._c.local_world_size, doc="ranks on this node (one NVLink domain)")
    node = property(lambda self: self._c.node)
    num_nodes = property(lambda self: self._c.num_nodes)
    device = property(lambda self: self._c.device, doc="this rank's CUDA device ordinal")
    sm_count = property(lambda self: self._c.sm_count)
    ranks_per_gpu = property(lambda self: self._c.ranks_per_gpu,
                             doc="LOOM_RANKS_PER_GPU: > 1 in the shared-GPU mode (ranks take turns on a GPU; no timing)")
    ranks_on_gpu = property(lambda self: self._c.ranks_on_gpu, doc="ranks of the job on this rank's GPU, itself included")
    closed = property(lambda self: self._c.closed)

    # ---- runtime -----------------------------------------------------------------------------

    def synchronize(self, stream: StreamArg = None) -> None:
        """Waits (bounded: the op timeout + 1 s) for the work queued on `stream` (a stream object
        or a cudaStream_t as an int; default: the current torch or CuPy stream, else the legacy
        default stream) and raises device-side failures: ``loom.Timeout`` naming the rank that
        never arrived, ``loom.Aborted``."""
        if stream is None:
            handle = default_stream(self.device)
        else:
            handle = stream_handle(stream, "synchronize", self.device, self.rank)
        self._c.synchronize(handle)

    def barrier(self) -> None:
        """Host barrier over all ranks (bounded by the bootstrap timeout)."""
        self._c.barrier()

    def abort(self, reason: str = "aborted by the application") -> None:
        """Makes running loom kernels of this communicator return (within about a millisecond);
        the communicator is failed afterwards."""
        self._c.abort(reason)

    def health(self) -> LoomError | None:
        """None while usable; else the error that ended the communicator (not raised)."""
        failure = self._c.health()
        if failure is None:
            return None
        code, reason = failure
        return _from_status(code, "health", self.rank, reason)

    def empty(self, shape: Sequence[int] | int, dtype: DTypeLike) -> DLPackArray:
        """Collective: a symmetric buffer (peers can read and write it) as a DLPack array, e.g.
        ``torch.from_dlpack(comm.empty((m, k), torch.bfloat16))``. Contents are uninitialised.

        Every rank must call it with the same shape and dtype in the same order. The memory goes
        back to the heap when the last consumer lets go; ranks must free in the same order too
        (a later empty() that lands at different offsets on different ranks fails cleanly)."""
        if isinstance(shape, int):
            shape = (shape,)
        return self._c.empty([int(d) for d in shape], dtype_name(dtype))

    def is_symmetric(self, ptr: int, nbytes: int) -> bool:
        """Whether [ptr, ptr + nbytes) lies in one symmetric allocation of this communicator."""
        return self._c.is_symmetric(int(ptr), int(nbytes))

    def close(self) -> None:
        """Ends the communicator (collective: waits, bounded, for the other ranks). Symmetric
        buffers must be gone by then; loom.torch's cached staging and MoE buffers are dropped here."""
        self._staging.clear()
        self._moe_layer_buffers.clear()
        self._c.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return f"<loom.Communicator rank {self.rank}/{self.world_size}, closed>"
        return (f"<loom.Communicator rank {self.rank}/{self.world_size}, local {self.local_rank}/"
                f"{self.local_world_size}, node {self.node}/{self.num_nodes}, cuda:{self.device}>")


# Communicator.for_process_group's cache: id(group) -> (group, communicator), in creation order.
_group_communicators: dict[int, tuple[Any, Communicator]] = {}


def _close_group_communicators() -> None:
    """At exit: closes the cached communicators, newest first (every rank made them in the same
    order). One that cannot close (symmetric tensors still alive) is left to the process exit,
    with a warning."""
    while _group_communicators:
        _, (_, comm) = _group_communicators.popitem()
        try:
            comm.close()
        except LoomError as error:
            warnings.warn(f"loom: the communicator cached for a process group was not closed at exit: {error}",
                          RuntimeWarning, stacklevel=1)


atexit.register(_close_group_communicators)


def _process_group_type() -> type | None:
    """torch.distributed.ProcessGroup when torch.distributed is loaded (an object can only be a
    process group then), else None; loom never imports torch itself."""
    dist = sys.modules.get("torch.distributed")
    return getattr(dist, "ProcessGroup", None) if dist is not None else None


CommLike = Union[Communicator, "ProcessGroup"]


def as_communicator(comm: CommLike, op: str) -> Communicator:
    """`comm` itself, or the communicator cached for a torch ProcessGroup."""
    if isinstance(comm, Communicator):
        return comm
    group_type = _process_group_type()
    if group_type is not None and isinstance(comm, group_type):
        return Communicator.for_process_group(comm)
    raise _invalid(op, f"comm must be a loom.Communicator or a torch.distributed ProcessGroup, got "
                       f"{type(comm).__module__}.{type(comm).__qualname__}")
