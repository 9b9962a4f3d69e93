"""CUDA streams: the caller's current one, found from the tensor's framework (no framework is
imported here), and the stream objects that ``stream=`` takes."""

from __future__ import annotations

import sys
from typing import Any, Callable, Protocol, Union

from ._errors import _invalid


class CudaStreamLike(Protocol):
    """The CUDA Python stream protocol: ``__cuda_stream__()`` returns (0, the cudaStream_t as an
    int). torch.cuda.Stream, CuPy's and cuda.core's streams implement it."""

    def __cuda_stream__(self) -> tuple[int, int]: ...


# What every ``stream=`` takes: None (the current stream), a cudaStream_t as an int (0 is the
# legacy default stream), or a stream object.
StreamArg = Union[None, int, CudaStreamLike]

# type(tensor) -> function(tensor, device or None) -> cudaStream_t as int
_getters: dict[type, Callable[[Any, int | None], int]] = {}


def _torch_getter() -> Callable[[Any, int | None], int]:
    import torch

    # The raw-stream query is what torch's own generated code uses: one C call instead of building
    # a torch.cuda.Stream object (about 1 us less per op).
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # pragma: no cover - older or future torch
        def raw(device: int) -> int:
            return torch.cuda.current_stream(device).cuda_stream

    def getter(tensor: Any, device: int | None) -> int:
        if device is None:
            device = tensor.get_device()
        # A CPU tensor is refused by the op itself (with its name); no stream is needed then.
        return raw(device) if device >= 0 else 0

    return getter


def _cupy_getter() -> Callable[[Any, int | None], int]:
    import cupy

    def getter(tensor: Any, device: int | None) -> int:
        # CuPy's current stream is per device; the op runs on the tensor's device.
        with cupy.cuda.Device(tensor.device.id if device is None else device):
            return cupy.cuda.get_current_stream().ptr

    return getter


def _getter_for(cls: type) -> Callable[[Any, int | None], int]:
    getter = _getters.get(cls)
    if getter is not None:
        return getter
    framework = cls.__module__.split(".")[0]
    if framework == "torch":
        getter = _torch_getter()
    elif framework == "cupy":
        getter = _cupy_getter()
    else:
        raise _invalid("stream", f"cannot tell the current CUDA stream of a {cls.__module__}.{cls.__qualname__}; "
                                 "pass stream= (a cudaStream_t as an int; 0 is the legacy default stream)")
    _getters[cls] = getter
    return getter


_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


def current_stream(tensor: Any, device: int | None = None) -> int:
    """The current stream of `tensor`'s framework on `device` (default: the tensor's device)."""
    getter = _getters.get(type(tensor))
    if getter is None:
        try:
            getter = _getter_for(type(tensor))
        except ValueError:
            # Not CUDA memory at all (numpy, a list): the op refuses it with its own, clearer error.
            dlpack_device = getattr(tensor, "__dlpack_device__", None)
            if dlpack_device is None or dlpack_device()[0] not in _DLPACK_CUDA:
                return 0
            raise
    return getter(tensor, device)


def default_stream(device: int) -> int:
    """The current stream on `device` of whichever framework is loaded (torch, then CuPy), else 0."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.current_stream(device).cuda_stream
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream().ptr
    return 0


def stream_handle(stream: StreamArg, op: str, device: int | None = None, rank: int | None = None) -> int:
    """The cudaStream_t of a non-None ``stream=`` argument, as an int.

    A stream object that tells its device (torch's ``device_index``, CuPy's ``device_id``) must be
    on `device` when the op knows it: a kernel queued on another GPU's stream would run there."""
    if type(stream) is int:
        if stream < 0:
            raise _invalid(op, f"stream = {stream}: a cudaStream_t is not negative", rank)
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is None:
        raise _invalid(op, f"stream must be a stream object (torch.cuda.Stream, anything with __cuda_stream__) or "
                           f"a cudaStream_t as an int, got {type(stream).__name__}", rank)
    reported = protocol()
    if not (isinstance(reported, tuple) and len(reported) == 2 and all(type(v) is int for v in reported)):
        raise _invalid(op, f"{type(stream).__name__}.__cuda_stream__() returned {reported!r}, not (version, handle)",
                       rank)
    version, handle = reported
    if version != 0:
        raise _invalid(op, f"{type(stream).__name__}.__cuda_stream__() speaks protocol version {version}; loom knows "
                           "version 0", rank)
    stream_device = getattr(stream, "device_index", getattr(stream, "device_id", None))
    if device is not None and device >= 0 and type(stream_device) is int and stream_device != device:
        raise _invalid(op, f"stream is on cuda:{stream_device} but the op runs on cuda:{device}", rank)
    return handle
