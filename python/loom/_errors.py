"""loom's exceptions: one class per ``loom::StatusCode``.

Every error carries ``code`` (the C++ status name), ``rank`` (the communicator's rank, or None
for calls without one), ``op`` (the operation) and ``reason``; ``str(error)`` has all of them.
Classes also derive from the matching builtin where one exists, so ``except ValueError`` catches
a bad argument and ``except TimeoutError`` a peer that never arrived.
"""

from __future__ import annotations

__all__ = [
    "LoomError",
    "InvalidArgument",
    "Unsupported",
    "Timeout",
    "PeerFailure",
    "CudaError",
    "SystemCallError",
    "Aborted",
    "InternalError",
]


class LoomError(RuntimeError):
    """Base class of every error loom raises."""

    code = "internal"

    def __init__(self, message: str = "", *, op: str | None = None, rank: int | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.rank = rank
        self.reason = reason if reason is not None else message


class InvalidArgument(LoomError, ValueError):
    """Bad input: nothing was written, nothing was launched."""

    code = "invalid_argument"


class Unsupported(LoomError):
    """Valid input outside what this build or device implements (e.g. fp32 GEMM inputs, no GPU)."""

    code = "unsupported"


class Timeout(LoomError, TimeoutError):
    """A bounded wait passed its deadline (the message names the rank waited on)."""

    code = "timeout"


class PeerFailure(LoomError):
    """Another rank reported an error or disappeared."""

    code = "peer_failure"


class CudaError(LoomError):
    """A CUDA runtime or driver call failed."""

    code = "cuda_error"


class SystemCallError(LoomError, OSError):
    """An OS call failed (sockets, files, memory)."""

    code = "system_error"


class Aborted(LoomError):
    """The operation was aborted, or the communicator failed (or was closed) earlier."""

    code = "aborted"


class InternalError(LoomError):
    """A loom invariant broke: a bug."""

    code = "internal"


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, Unsupported, Timeout, PeerFailure, CudaError,
                                      SystemCallError, Aborted, InternalError)}


def _message(op: str, rank: int | None, reason: str) -> str:
    where = f"loom rank {rank}" if rank is not None else "loom"
    return f"{where}: {op}: {reason}"


def _from_status(code: str, op: str, rank: int | None, reason: str) -> LoomError:
    """The exception for a failed C++ Status (called by the extension)."""
    cls = _BY_CODE.get(code, InternalError)
    return cls(_message(op, rank, reason), op=op, rank=rank, reason=reason)


def _invalid(op: str, reason: str, rank: int | None = None) -> InvalidArgument:
    """An InvalidArgument raised by the Python layer, formatted like the extension's."""
    return InvalidArgument(_message(op, rank, reason), op=op, rank=rank, reason=reason)


def _unsupported(op: str, reason: str, rank: int | None = None) -> Unsupported:
    """An Unsupported raised by the Python layer, formatted like the extension's."""
    return Unsupported(_message(op, rank, reason), op=op, rank=rank, reason=reason)
