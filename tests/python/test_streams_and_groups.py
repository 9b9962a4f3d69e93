"""What ops take as `stream=` (ints, torch.cuda.Stream, __cuda_stream__ objects) and as `comm`
(a loom.Communicator or a torch ProcessGroup, through a cached communicator per group), on CPU:
arguments are resolved before the extension refuses the CPU tensors, so the refusal proves it."""

import pytest

import loom
from loom import _comm
from loom._streams import stream_handle

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


class ProtocolStream:
    def __init__(self, reported, device_index=None):
        self.reported = reported
        if device_index is not None:
            self.device_index = device_index

    def __cuda_stream__(self):
        return self.reported


# ---- streams ------------------------------------------------------------------------------------

def test_stream_handles():
    assert stream_handle(0, "op") == 0
    assert stream_handle(0x7F00_1234, "op") == 0x7F00_1234
    assert stream_handle(ProtocolStream((0, 4096)), "op") == 4096
    assert stream_handle(ProtocolStream((0, 4096), device_index=1), "op", device=1) == 4096


@pytest.mark.parametrize("stream,match", [
    (-1, "stream = -1: a cudaStream_t is not negative"),
    (True, "stream must be a stream object .* got bool"),
    ("0", "stream must be a stream object .* got str"),
    (1.0, "got float"),
    (ProtocolStream((1, 4096)), "protocol version 1; loom knows version 0"),
    (ProtocolStream(4096), r"returned 4096, not \(version, handle\)"),
    (ProtocolStream((0, 4096), device_index=2), "stream is on cuda:2 but the op runs on cuda:1"),
])
def test_bad_streams_are_refused(stream, match):
    with pytest.raises(loom.InvalidArgument, match=match):
        stream_handle(stream, "all_reduce", device=1)


@pytest.mark.parametrize("stream", [None, 0, ProtocolStream((0, 0))], ids=["current", "int", "protocol"])
def test_gemm_takes_stream_objects(stream):
    a, b, out = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16), \
        torch.zeros(128, 32, dtype=torch.bfloat16)
    with pytest.raises(loom.InvalidArgument, match="loom: gemm: a is on cpu"):  # past the stream
        loom.gemm(a, b, out, stream=stream)


def test_gemm_refuses_a_bad_stream_naming_it():
    with pytest.raises(loom.InvalidArgument, match="loom: gemm: stream must be a stream object"):
        loom.gemm(torch.zeros(128, 64), torch.zeros(64, 32), torch.zeros(128, 32), stream="default")


# ---- communicators and process groups ------------------------------------------------------------

def test_ops_refuse_what_is_not_a_communicator():
    x = torch.zeros(8)
    for op in (loom.all_reduce, loom.all_gather, loom.reduce_scatter):
        with pytest.raises(loom.InvalidArgument, match="comm must be a loom.Communicator or a torch.distributed "
                                                       "ProcessGroup, got builtins.object"):
            op(object(), x, x)


@pytest.fixture
def world_group():
    """A one-rank gloo job in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        _comm._group_communicators.clear()


def test_a_process_group_creates_its_communicator(world_group):
    """Without a GPU the communicator cannot be made: the op says why (not a TypeError)."""
    import loom.torch as lt

    with pytest.raises(loom.Unsupported, match="Communicator.from_unique_id: no CUDA GPU"):
        loom.all_reduce(world_group, torch.zeros(8))
    with pytest.raises(loom.Unsupported, match="no CUDA GPU"):
        lt.all_reduce(world_group, torch.zeros(8))
    assert _comm._group_communicators == {}  # a failed creation is not cached


class RecordingComm:
    """Stands in for the communicator from_process_group would make."""

    instances = []

    def __init__(self, group):
        self.group, self.closed, self.local_world_size, self.rank, self.device = group, False, 1, 0, 0
        _comm.register(self)
        RecordingComm.instances.append(self)

    def close(self):
        self.closed = True


def test_one_cached_communicator_per_group_closed_at_exit(world_group, monkeypatch):
    import loom.torch as lt

    monkeypatch.setattr(loom.Communicator, "from_process_group", classmethod(lambda cls, group, **kw: RecordingComm(group)))
    RecordingComm.instances.clear()
    first = loom.Communicator.for_process_group()
    assert first.group is world_group
    assert loom.Communicator.for_process_group(world_group) is first
    assert lt.register_communicator(world_group) == first._loom_handle
    _comm._close_group_communicators()  # what atexit runs
    assert first.closed and _comm._group_communicators == {}
    second = loom.Communicator.for_process_group(world_group)  # a closed one is made anew
    assert second is not first and len(RecordingComm.instances) == 2


def test_exit_warns_about_a_communicator_it_cannot_close(world_group, monkeypatch):
    class Stuck(RecordingComm):
        def close(self):
            raise loom.InvalidArgument("1 symmetric buffers (from empty()) are still referenced")

    monkeypatch.setattr(loom.Communicator, "from_process_group", classmethod(lambda cls, group, **kw: Stuck(group)))
    loom.Communicator.for_process_group(world_group)
    with pytest.warns(RuntimeWarning, match="not closed at exit: 1 symmetric buffers"):
        _comm._close_group_communicators()
