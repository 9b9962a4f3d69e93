"""Types the signatures of loom's functions use (loom imports no array framework)."""

from __future__ import annotations

from typing import Any, Protocol


class DLPackArray(Protocol):
    """A tensor of any framework that speaks DLPack (torch, CuPy, JAX, loom's symmetric buffers)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> tuple[int, int]: ...


# A dtype as loom takes it: a name ('bf16', 'bfloat16', 'fp16', 'float32', ...), a torch dtype, or
# a numpy / CuPy dtype (anything whose .name is one of the names); checked by dtype_name().
DTypeLike = Any
