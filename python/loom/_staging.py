"""The symmetric staging buffers loom.torch copies through, under a byte budget.

Policy: one flat buffer per (role, dtype) — a role is an op's use, e.g. "all_gather.recv" — that
grows, never shrinks, and is viewed for every smaller request. Serving with varying batch sizes
therefore holds at most the largest request of each role, not one buffer per shape seen. A buffer
grows to max(request, 2 x its old size) while that fits the budget (so a rising sequence of sizes
reallocates O(log) times), else exactly to the request; a request that does not fit the budget
next to the other buffers is refused with ``loom.InvalidArgument``.

Allocation is collective (every rank of the communicator makes the same calls), and so is
freeing. Growth decisions depend only on the sequence of (role, shape, dtype) requests, which the
ops' collective contract makes identical on every rank.

Growing drops the old buffer, after waiting for the stream that used it last (peers may still
write into it). A buffer that a CUDA graph captured is kept instead ("retired") until the
communicator closes: the graph's replays use its address. Retired buffers count against the
budget.

Pure Python (no torch import): the buffers are whatever ``allocate`` returns; they must support
``buffer[:n].view(shape)`` (torch tensors do).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

from ._errors import _invalid

DEFAULT_STAGING_BUDGET = 256 << 20
# Views kept per buffer: shapes a workload alternates between (prefill and decode, say) reuse
# their view instead of slicing again; past this many, the cache of views starts over.
_MAX_VIEWS = 16


class _Slot:
    __slots__ = ("buffer", "capacity", "nbytes", "views", "captured", "last_stream")

    def __init__(self, buffer: Any, capacity: int, nbytes: int) -> None:
        self.buffer = buffer
        self.capacity = capacity  # elements
        self.nbytes = nbytes
        self.views: dict[tuple[int, ...], Any] = {}
        self.captured = False  # used while a CUDA graph was being captured
        self.last_stream: int | None = None


class StagingCache:
    """One communicator's staging buffers (see the module's doc for the policy)."""

    def __init__(self, budget_bytes: int = DEFAULT_STAGING_BUDGET) -> None:
        self.budget_bytes = budget_bytes
        self._slots: dict[tuple[str, Hashable], _Slot] = {}
        self._retired: list[Any] = []
        self._retired_bytes = 0
        self.allocations = 0  # buffers allocated so far (a measure of the policy, for tests)

    def lookup(self, role: str, shape: tuple[int, ...], dtype: Hashable, numel: int, stream: int,
               capturing: bool) -> Any:
        """The view of `shape` onto the (role, dtype) buffer when it is large enough, else None."""
        slot = self._slots.get((role, dtype))
        if slot is None or numel > slot.capacity:
            return None
        slot.last_stream = stream
        if capturing:
            slot.captured = True
        view = slot.views.get(shape)
        if view is None:
            if len(slot.views) >= _MAX_VIEWS:
                slot.views.clear()
            view = slot.views[shape] = slot.buffer[:numel].view(shape)
        return view

    def grow(self, role: str, shape: tuple[int, ...], dtype: Hashable, numel: int, itemsize: int, stream: int,
             allocate: Callable[[int, Any], Any], synchronize: Callable[[int], None], op: str,
             rank: int | None = None) -> Any:
        """Replaces the (role, dtype) buffer by one that holds `numel` elements and returns the view
        of `shape` onto it. `allocate(numel, dtype)` makes a flat symmetric buffer (collective);
        `synchronize(stream)` waits for the work queued on a stream."""
        key = (role, dtype)
        old = self._slots.get(key)
        need = numel * itemsize
        others = self.held_bytes() - (old.nbytes if old is not None else 0)
        if others + need > self.budget_bytes:
            raise _invalid(op, f"{role} needs a {need}-byte symmetric staging buffer for {list(shape)} {dtype}, but "
                               f"loom.torch's staging budget is {self.budget_bytes} bytes and {others} are held by "
                               "other staging buffers: raise it with loom.torch.set_staging_budget(comm, nbytes), or "
                               "call the explicit-output op (loom.<op>) on symmetric tensors", rank)
        capacity = numel
        if old is not None and others + 2 * old.nbytes <= self.budget_bytes:
            capacity = max(numel, 2 * old.capacity)
        if old is not None:
            del self._slots[key]
            if old.captured:
                self._retired.append(old.buffer)
                self._retired_bytes += old.nbytes
            elif old.last_stream is not None:
                synchronize(old.last_stream)
            old = None  # the last reference: the buffer goes back to the heap here, on every rank alike
        slot = _Slot(allocate(capacity, dtype), capacity, capacity * itemsize)
        self.allocations += 1
        self._slots[key] = slot
        return self.lookup(role, shape, dtype, numel, stream, False)

    def held_bytes(self) -> int:
        """Bytes of symmetric memory the cache holds: live buffers and retired (graph-captured) ones."""
        return sum(slot.nbytes for slot in self._slots.values()) + self._retired_bytes

    def buffers(self) -> Sequence[Any]:
        """The live buffers (whole, not viewed)."""
        return [slot.buffer for slot in self._slots.values()]

    def buffer(self, role: str, dtype: Hashable) -> Any:
        """The live buffer of (role, dtype), or None."""
        slot = self._slots.get((role, dtype))
        return None if slot is None else slot.buffer

    def clear(self) -> None:
        """Drops every buffer (the communicator is closing)."""
        self._slots.clear()
        self._retired.clear()
        self._retired_bytes = 0
