"""loom.torch's staging-cache policy (loom/_staging.py) with CPU tensors standing in for symmetric
buffers: one growing buffer per (role, dtype), a byte budget, graph-captured buffers kept."""

import random

import pytest

torch = pytest.importorskip("torch")

import loom  # noqa: E402
from loom._staging import StagingCache  # noqa: E402

FP32, BF16 = torch.float32, torch.bfloat16


class Heap:
    """Records the allocations and the stream waits the cache asks for."""

    def __init__(self) -> None:
        self.allocated = []
        self.waited = []

    def allocate(self, numel, dtype):
        self.allocated.append((numel, dtype))
        return torch.empty(numel, dtype=dtype)

    def synchronize(self, stream):
        self.waited.append(stream)


def request(cache, heap, role, shape, dtype=FP32, stream=7, capturing=False):
    numel = 1
    for d in shape:
        numel *= d
    view = cache.lookup(role, shape, dtype, numel, stream, capturing)
    if view is None:
        assert not capturing, "loom.torch refuses to grow during capture"
        view = cache.grow(role, shape, dtype, numel, torch.empty((), dtype=dtype).element_size(), stream,
                          heap.allocate, heap.synchronize, "all_reduce")
    return view


def test_100_batch_sizes_hold_at_most_twice_the_largest():
    cache, heap = StagingCache(), Heap()
    sizes = list(range(1, 101))
    random.Random(1).shuffle(sizes)
    hidden = 512
    for batch in sizes:
        view = request(cache, heap, "all_reduce.buffer", (batch, hidden))
        assert view.shape == (batch, hidden) and view.is_contiguous()
    largest = 100 * hidden * 4
    assert largest <= cache.held_bytes() <= 2 * largest
    assert len(cache.buffers()) == 1
    assert len(heap.allocated) <= 8  # shuffled sizes: each growth at least doubles or reaches a new maximum


def test_rising_sizes_reallocate_logarithmically():
    cache, heap = StagingCache(), Heap()
    for batch in range(1, 1001):
        request(cache, heap, "all_gather.recv", (batch, 8))
    assert len(heap.allocated) == 11  # 1, 2, 4, ..., 1024 rows
    assert cache.held_bytes() == 1024 * 8 * 4


def test_views_share_the_buffer_and_repeat_shapes_reuse_their_view():
    cache, heap = StagingCache(), Heap()
    big = request(cache, heap, "r", (64, 4))
    small = request(cache, heap, "r", (3, 5))
    assert small.data_ptr() == big.data_ptr()
    assert request(cache, heap, "r", (3, 5)) is small
    assert len(heap.allocated) == 1


def test_roles_and_dtypes_have_their_own_buffers():
    cache, heap = StagingCache(), Heap()
    a = request(cache, heap, "all_reduce.buffer", (16,))
    b = request(cache, heap, "reduce_scatter.send", (16,))
    c = request(cache, heap, "all_reduce.buffer", (16,), dtype=BF16)
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    assert c.dtype == BF16
    assert cache.held_bytes() == 16 * 4 * 2 + 16 * 2


def test_growth_waits_for_the_old_buffers_last_stream():
    cache, heap = StagingCache(), Heap()
    request(cache, heap, "r", (4,), stream=11)
    request(cache, heap, "r", (4,), stream=12)
    request(cache, heap, "r", (400,), stream=13)
    assert heap.waited == [12]


def test_graph_captured_buffers_are_retired_not_freed():
    cache, heap = StagingCache(), Heap()
    request(cache, heap, "r", (4,))
    captured = request(cache, heap, "r", (4,), capturing=True)
    request(cache, heap, "r", (400,))
    assert heap.waited == []  # nothing to wait for: the captured buffer stays allocated
    assert cache.held_bytes() == 4 * 4 + 400 * 4
    assert captured.data_ptr() not in {b.data_ptr() for b in cache.buffers()}
    cache.clear()
    assert cache.held_bytes() == 0 and cache.buffers() == []


def test_the_budget_refuses_what_does_not_fit_and_caps_the_doubling():
    cache, heap = StagingCache(budget_bytes=1000), Heap()
    request(cache, heap, "a", (100,))  # 400 bytes
    request(cache, heap, "b", (100,))  # 400 bytes
    request(cache, heap, "a", (120,))  # doubling would reach 1200: grows to exactly 480
    assert cache.held_bytes() == 880
    with pytest.raises(loom.InvalidArgument, match=r"needs a 800-byte symmetric staging buffer .* budget is 1000 "
                                                   r"bytes and 480 are held"):
        request(cache, heap, "b", (200,))
    assert cache.held_bytes() == 880  # the refused request changed nothing


def test_set_staging_budget_checks_its_argument():
    import loom.torch as lt

    class Stand:
        local_world_size, rank, device = 2, 0, 0

    with pytest.raises(loom.InvalidArgument, match="comm must be a loom.Communicator or a torch.distributed"):
        lt.set_staging_budget(Stand(), 1 << 20)
