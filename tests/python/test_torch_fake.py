"""loom.torch's operators under FakeTensorMode (their shape functions) and torch.compile tracing,
on the CPU torch wheel: no GPU, no communicator. A stand-in registered with
loom.torch.register_communicator supplies the world size, as a real communicator would."""

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import loom  # noqa: E402
import loom.torch as lt  # noqa: E402
from stand_in import StandInComm  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(params=[2, 4, 8], ids=lambda w: f"W{w}")
def comm(request):
    return StandInComm(request.param)


def fake(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("out_dtype", [None, BF16, FP32])
def test_gemm_shape(layout, out_dtype):
    with FakeTensorMode():
        a = fake(100, 64, dtype=FP16)
        b = fake(64, 48, dtype=FP16) if layout == "kn" else fake(48, 64, dtype=FP16)
        out = torch.ops.loom.gemm(a, b, layout, out_dtype)
        assert out.shape == (100, 48)
        assert out.dtype == (out_dtype or FP16)
        assert out.device.type == "cuda"


def test_gemm_shape_errors():
    with FakeTensorMode():
        with pytest.raises(loom.InvalidArgument, match=r"a is \[100, 64\] \(K = 64\) but b is \[48, 64\]"):
            torch.ops.loom.gemm(fake(100, 64), fake(48, 64), "kn")
        with pytest.raises(loom.InvalidArgument, match="bfloat16 or float16"):
            torch.ops.loom.gemm(fake(100, 64, dtype=FP32), fake(64, 48, dtype=FP32))
        with pytest.raises(loom.InvalidArgument, match="must be 2-D"):
            torch.ops.loom.gemm(fake(100), fake(64, 48))


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_collective_shapes(comm, dtype):
    h = lt.register_communicator(comm)
    w = comm.local_world_size
    with FakeTensorMode():
        x = fake(8 * w, 3, 5, dtype=dtype)
        gathered = torch.ops.loom.all_gather(h, x)
        assert gathered.shape == (8 * w * w, 3, 5) and gathered.dtype == dtype
        scattered = torch.ops.loom.reduce_scatter(h, x)
        assert scattered.shape == (8, 3, 5) and scattered.dtype == dtype
        reduced = torch.ops.loom.all_reduce(h, x)
        assert reduced.shape == x.shape and reduced.dtype == dtype


def test_collective_shape_errors(comm):
    h = lt.register_communicator(comm)
    w = comm.local_world_size
    with FakeTensorMode():
        with pytest.raises(loom.InvalidArgument, match=f"must divide by the world size {w}"):
            torch.ops.loom.reduce_scatter(h, fake(w + 1, 4))
        with pytest.raises(loom.InvalidArgument, match="at least one dimension"):
            torch.ops.loom.all_gather(h, fake())


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_tp_shapes(comm, layout):
    h = lt.register_communicator(comm)
    w = comm.local_world_size
    m, n, k = 128 * w, 96, 64
    with FakeTensorMode():
        b = fake(k, n) if layout == "kn" else fake(n, k)
        assert torch.ops.loom.ag_gemm(h, fake(m // w, k), b, layout).shape == (m, n)
        assert torch.ops.loom.gemm_rs(h, fake(m, k), b, layout).shape == (m // w, n)
        assert torch.ops.loom.gemm_ar(h, fake(m, k), b, layout).shape == (m, n)
        assert torch.ops.loom.gemm_ar(h, fake(m, k, dtype=FP16), b.half(), layout).dtype == FP16


@pytest.mark.parametrize("nodes", [2, 4])
def test_tp_shapes_across_nodes_split_over_every_rank(nodes):
    """A communicator of several nodes: the TP ops split M over world_size, the collectives over
    the node's local_world_size (python/src/ext.cc and the C++ multi-node operators agree)."""
    comm = StandInComm(2)
    comm.world_size = 2 * nodes
    h = lt.register_communicator(comm)
    w = comm.world_size
    m, n, k = 128 * w, 96, 64
    with FakeTensorMode():
        b = fake(k, n)
        assert torch.ops.loom.ag_gemm(h, fake(m // w, k), b, "kn").shape == (m, n)
        assert torch.ops.loom.gemm_rs(h, fake(m, k), b, "kn").shape == (m // w, n)
        assert torch.ops.loom.gemm_ar(h, fake(m, k), b, "kn").shape == (m, n)
        assert torch.ops.loom.all_gather(h, fake(8, 4)).shape == (8 * comm.local_world_size, 4)


def test_tp_shape_errors(comm):
    h = lt.register_communicator(comm)
    w = comm.local_world_size
    with FakeTensorMode():
        with pytest.raises(loom.InvalidArgument, match=f"M = {128 * w + 1} rows of a do not divide"):
            torch.ops.loom.gemm_rs(h, fake(128 * w + 1, 64), fake(64, 32))
        with pytest.raises(loom.InvalidArgument, match=r"K = 64\) but b is \[32, 64\]"):
            torch.ops.loom.ag_gemm(h, fake(128, 64), fake(32, 64), "kn")
        with pytest.raises(loom.InvalidArgument, match="b_layout 'xy'"):
            torch.ops.loom.gemm_ar(h, fake(128, 64), fake(64, 32), "xy")
        with pytest.raises(loom.InvalidArgument, match="bfloat16 or float16"):
            torch.ops.loom.gemm_ar(h, fake(128, 64, dtype=FP32), fake(64, 32, dtype=FP32))


def test_unregistered_handle_is_a_clear_error():
    with FakeTensorMode():
        with pytest.raises(loom.InvalidArgument, match="no live loom communicator has handle 987654"):
            torch.ops.loom.all_reduce(987654, fake(4))


def test_handles_are_stable_and_weak():
    import gc

    comm = StandInComm(2)
    h = lt.register_communicator(comm)
    assert lt.handle(comm) == h
    del comm
    gc.collect()
    with FakeTensorMode(), pytest.raises(loom.InvalidArgument, match="no live loom communicator"):
        torch.ops.loom.all_reduce(h, fake(4))


def test_torch_compile_traces_a_tp_block():
    """torch.compile (fullgraph) puts the loom operators in its graph, using the fake functions."""
    comm = StandInComm(2)
    lt.register_communicator(comm)  # loom.Communicator objects have a handle from creation
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        # Traced only (no GPU to run it on): the callable returns zeros shaped like the outputs.
        outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
        shapes = [(o.meta["example_value"].shape, o.meta["example_value"].dtype) for o in outputs]
        return lambda *args: [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes]

    def tp_mlp(x, w1, w2, w3):
        h = torch.nn.functional.gelu(lt.ag_gemm(comm, x, w1, b_layout="nk"))  # [128, 48]
        y = lt.gemm_rs(comm, h, w2, b_layout="nk")                             # [64, 32]
        z = lt.gemm(y, w3)                                                     # [64, 32]
        return lt.all_reduce(comm, z) + lt.all_gather(comm, z)[:64] + lt.reduce_scatter(comm, z.repeat(2, 1))

    compiled = torch.compile(tp_mlp, backend=record, fullgraph=True)
    x, w1 = torch.randn(64, 32, dtype=BF16), torch.randn(48, 32, dtype=BF16)
    w2, w3 = torch.randn(32, 48, dtype=BF16), torch.randn(32, 32, dtype=BF16)
    compiled(x, w1, w2, w3)
    assert len(graphs) == 1
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    for op in ("ag_gemm", "gemm_rs", "all_reduce", "all_gather", "reduce_scatter", "gemm"):
        assert f"loom.{op}.default" in targets, (op, targets)


def test_cpu_tensors_get_loom_errors_from_the_real_operators():
    with pytest.raises(loom.InvalidArgument, match="loom: gemm: a is on cpu"):
        lt.gemm(torch.zeros(128, 64, dtype=BF16), torch.zeros(64, 32, dtype=BF16))
    with pytest.raises(loom.InvalidArgument, match=r"a is \[128, 64\] \(K = 64\) but b is \[32, 64\]"):
        lt.gemm(torch.zeros(128, 64, dtype=BF16), torch.zeros(32, 64, dtype=BF16))


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("partial", [False, True])
def test_attention_shapes(dtype, partial):
    with FakeTensorMode():
        q, k, v = fake(2, 100, 8, 128, dtype=dtype), fake(2, 300, 2, 128, dtype=dtype), fake(2, 300, 2, 128, dtype=dtype)
        out, lse = torch.ops.loom.attention(q, k, v, True, None, None, None, 0, 0, partial)
        assert out.shape == q.shape and out.dtype == (FP32 if partial else dtype)
        assert lse.shape == (2, 8, 100) and lse.dtype == FP32
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        out, lse = lt.attention(fake(500, 4, 64, dtype=dtype), fake(700, 1, 64, dtype=dtype),
                                fake(700, 1, 64, dtype=dtype), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300,
                                max_seqlen_k=400)
        assert out.shape == (500, 4, 64) and lse.shape == (4, 500)
        merged, merged_lse = lt.attention_merge(fake(3, 2, 100, 8, 128, dtype=FP32), fake(3, 2, 8, 100, dtype=FP32),
                                                out_dtype=dtype)
        assert merged.shape == (2, 100, 8, 128) and merged.dtype == dtype and merged_lse.shape == (2, 8, 100)


def test_attention_shape_errors():
    with FakeTensorMode():
        with pytest.raises(loom.InvalidArgument, match="must be"):
            torch.ops.loom.attention(fake(2, 100, 8, 128), fake(300, 2, 128), fake(300, 2, 128))
        with pytest.raises(loom.InvalidArgument, match="bfloat16 or all float16"):
            torch.ops.loom.attention(fake(2, 100, 8, 128, dtype=FP32), fake(2, 3, 2, 128, dtype=FP32),
                                     fake(2, 3, 2, 128, dtype=FP32))
        with pytest.raises(loom.InvalidArgument, match="different batch sizes"):
            torch.ops.loom.attention(fake(2, 100, 8, 128), fake(3, 3, 2, 128), fake(3, 3, 2, 128))
        with pytest.raises(loom.InvalidArgument, match="both cu_seqlens"):
            cu = torch.empty(3, dtype=torch.int32, device="cuda")
            torch.ops.loom.attention(fake(100, 8, 128), fake(3, 2, 128), fake(3, 2, 128), False, None, cu)


def test_ring_attention_shapes_and_zigzag(comm):
    h = lt.register_communicator(comm)
    with FakeTensorMode():
        out, lse = torch.ops.loom.ring_attention(h, fake(2, 100, 8, 128), fake(2, 100, 2, 128), fake(2, 100, 2, 128), True)
        assert out.shape == (2, 100, 8, 128) and lse.shape == (2, 8, 100) and lse.dtype == FP32
        with pytest.raises(loom.InvalidArgument, match="must agree"):
            torch.ops.loom.ring_attention(h, fake(2, 100, 8, 128), fake(2, 99, 2, 128), fake(2, 99, 2, 128))
    w = comm.local_world_size
    x = torch.arange(2 * w * 3 * 2, dtype=FP32).reshape(2, 2 * w * 3)
    parts = [lt.zigzag_shard(x, w, r) for r in range(w)]
    assert parts[0].shape == (2, 6)
    assert torch.equal(parts[0][:, :3], x[:, :3]) and torch.equal(parts[0][:, 3:], x[:, -3:])
    assert torch.equal(lt.zigzag_unshard(parts), x)
    with pytest.raises(loom.InvalidArgument, match="does not split"):
        lt.zigzag_shard(x[:, :5], w, 0)


def test_grouped_gemm_shapes_and_refusals():
    with FakeTensorMode():
        offsets = torch.empty(5, dtype=torch.int32)
        d = torch.ops.loom.grouped_gemm(fake(100, 64), fake(4, 48, 64), offsets)
        assert d.shape == (100, 48) and d.dtype == BF16
        d = torch.ops.loom.grouped_gemm(fake(4, 32, 64), fake(4, 48, 64), None, torch.empty(4, dtype=torch.int32), FP32)
        assert d.shape == (4, 32, 48) and d.dtype == FP32
        with pytest.raises(loom.InvalidArgument, match="exactly one of offsets"):
            torch.ops.loom.grouped_gemm(fake(100, 64), fake(4, 48, 64))
        with pytest.raises(loom.InvalidArgument, match=r"offsets must be int32 \[5\]"):
            torch.ops.loom.grouped_gemm(fake(100, 64), fake(4, 48, 64), torch.empty(4, dtype=torch.int32))
        with pytest.raises(loom.InvalidArgument, match="K = 64"):
            torch.ops.loom.grouped_gemm(fake(100, 32), fake(4, 48, 64), offsets)
        d = torch.ops.loom.grouped_gemm(fake(100, 64), fake(4, 64, 48), offsets, None, None, "kn")  # b [E, K, N]
        assert d.shape == (100, 48)
        with pytest.raises(loom.InvalidArgument, match=r"K = 48 for b \[4, 48, 64\]"):  # kn: b is [E, K, N]
            torch.ops.loom.grouped_gemm(fake(100, 64), fake(4, 48, 64), offsets, None, None, "kn")
        with pytest.raises(loom.InvalidArgument, match="b_layout 'km'"):
            torch.ops.loom.grouped_gemm(fake(100, 64), fake(4, 64, 48), offsets, None, None, "km")
        d = torch.ops.loom.grouped_gemm(fake(100, 64), fake(4, 96, 64), offsets, None, None, "nk", "swiglu")
        assert d.shape == (100, 48)  # SwiGLU: N / 2 columns
        with pytest.raises(loom.InvalidArgument, match="multiple of 16"):
            torch.ops.loom.grouped_gemm(fake(100, 64), fake(4, 40, 64), offsets, None, None, "nk", "swiglu")
        with pytest.raises(loom.InvalidArgument, match="activation 'gelu'"):
            torch.ops.loom.grouped_gemm(fake(100, 64), fake(4, 96, 64), offsets, None, None, "nk", "gelu")


def test_swiglu_weights_interleave_gate_and_up_by_8():
    gate = torch.arange(2 * 16 * 3, dtype=FP32).reshape(2, 16, 3)
    up = -gate
    w = lt.swiglu_weights(gate, up)
    assert w.shape == (2, 32, 3)
    assert torch.equal(w[:, 0:8], gate[:, 0:8]) and torch.equal(w[:, 8:16], up[:, 0:8])
    assert torch.equal(w[:, 16:24], gate[:, 8:16]) and torch.equal(w[:, 24:32], up[:, 8:16])
    wkn = lt.swiglu_weights(gate.transpose(1, 2), up.transpose(1, 2), b_layout="kn")
    assert torch.equal(wkn, w.transpose(1, 2))
    with pytest.raises(loom.InvalidArgument, match="multiple of 8"):
        lt.swiglu_weights(gate[:, :12], up[:, :12])
