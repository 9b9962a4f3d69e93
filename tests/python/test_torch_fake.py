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


def recording_backend(graphs):
    """A torch.compile backend that keeps each traced graph in `graphs` and, traced only (no GPU to
    run it on), returns a callable giving zeros shaped like the outputs."""
    def record(gm, example_inputs):
        graphs.append(gm)
        outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
        shapes = [(o.meta["example_value"].shape, o.meta["example_value"].dtype) for o in outputs]
        return lambda *args: [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes]
    return record


def test_torch_compile_traces_a_tp_block():
    """torch.compile (fullgraph) puts the loom operators in its graph, using the fake functions."""
    comm = StandInComm(2)
    lt.register_communicator(comm)  # loom.Communicator objects have a handle from creation
    graphs = []
    record = recording_backend(graphs)

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


# ---- MoE: torch.ops.loom.moe_topk and torch.ops.loom.moe_layer ----------------------------------

I32 = torch.int32
MOE_TOKENS, MOE_HIDDEN, MOE_K, MOE_I, MOE_MAX_TOKENS = 100, 256, 4, 192, 256
LOCAL_EXPERTS = 4


def moe_layer_args(world, device="cuda", dtype=BF16, **changes):
    """moe_layer's arguments after the communicator, for `world` ranks of LOCAL_EXPERTS experts each;
    `changes` replaces any of them (None: topk_weights absent)."""
    def tensor(*shape, dtype=dtype):
        return torch.empty(shape, dtype=dtype, device=device)

    args = dict(x=tensor(MOE_TOKENS, MOE_HIDDEN), topk_ids=tensor(MOE_TOKENS, MOE_K, dtype=I32),
                topk_weights=tensor(MOE_TOKENS, MOE_K, dtype=FP32),
                gate_up=tensor(LOCAL_EXPERTS, 2 * MOE_I, MOE_HIDDEN), down=tensor(LOCAL_EXPERTS, MOE_HIDDEN, MOE_I),
                num_experts=LOCAL_EXPERTS * world, max_tokens=MOE_MAX_TOKENS, capacity=0, overflow="error")
    args.update(changes)
    return args


def call_moe_layer(h, args):
    return torch.ops.loom.moe_layer(h, args["x"], args["topk_ids"], args["topk_weights"], args["gate_up"],
                                    args["down"], args["num_experts"], args["max_tokens"], args["capacity"],
                                    args["overflow"])


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_moe_topk_shapes(dtype):
    with FakeTensorMode():
        logits = fake(300, 64, dtype=dtype)
        ids, weights = torch.ops.loom.moe_topk(logits, 8, "softmax", False)
        assert ids.shape == weights.shape == (300, 8)
        assert ids.dtype == I32 and weights.dtype == FP32 and ids.device.type == weights.device.type == "cuda"
        ids, weights = lt.moe_topk(fake(0, 1024, dtype=dtype), 32, scoring="sigmoid", renormalize=True)
        assert ids.shape == weights.shape == (0, 32) and ids.dtype == I32 and weights.dtype == FP32


def test_moe_topk_shape_errors():
    with FakeTensorMode():
        with pytest.raises(loom.InvalidArgument, match=r"moe_topk: top_k 9 is outside \[1, min\(E, 32\)\] \(E = 8\)"):
            torch.ops.loom.moe_topk(fake(16, 8), 9)
        with pytest.raises(loom.InvalidArgument, match="top_k 33 is outside"):
            torch.ops.loom.moe_topk(fake(16, 64), 33)
        with pytest.raises(loom.InvalidArgument, match="num_experts 1025 is outside"):
            torch.ops.loom.moe_topk(fake(16, 1025), 2)
        with pytest.raises(loom.InvalidArgument, match="moe_topk: scoring 'tanh'"):
            torch.ops.loom.moe_topk(fake(16, 64), 2, "tanh")
        with pytest.raises(loom.InvalidArgument, match=r"logits must be 2-D \[T, E\], got shape \[16, 64, 1\]"):
            torch.ops.loom.moe_topk(fake(16, 64, 1), 2)
        with pytest.raises(loom.InvalidArgument, match="logits has dtype torch.int32"):
            torch.ops.loom.moe_topk(fake(16, 64, dtype=I32), 2)
        with pytest.raises(loom.InvalidArgument, match="renormalize must be a bool, got int"):
            lt.moe_topk(fake(16, 64), 2, renormalize=1)
        with pytest.raises(loom.InvalidArgument, match="scoring must be 'softmax' or 'sigmoid', got NoneType"):
            lt.moe_topk(fake(16, 64), 2, scoring=None)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_moe_layer_shapes(comm, dtype):
    h = lt.register_communicator(comm)
    w = comm.local_world_size
    with FakeTensorMode():
        args = moe_layer_args(w, dtype=dtype)
        out = call_moe_layer(h, args)
        assert out.shape == (MOE_TOKENS, MOE_HIDDEN) and out.dtype == dtype and out.device.type == "cuda"
        # The function: the communicator itself, unweighted, no tokens on this rank, overflow 'drop'.
        args = moe_layer_args(w, dtype=dtype, x=fake(0, MOE_HIDDEN, dtype=dtype), topk_ids=fake(0, MOE_K, dtype=I32),
                              topk_weights=None, capacity=64, overflow="drop")
        out = lt.moe_layer_from_topk(comm, **args)
        assert out.shape == (0, MOE_HIDDEN) and out.dtype == dtype


def _moe_layer_refusals(world):
    """(changes to moe_layer_args, the refusal's class, a fragment of its message)."""
    def t(*shape, dtype=BF16):
        return dict(shape=shape, dtype=dtype)

    e = LOCAL_EXPERTS * world
    return [
        (dict(x=t(MOE_TOKENS, MOE_HIDDEN, dtype=FP32)), "x must be [T, hidden] bfloat16 or float16, got [100, 256] "
                                                          "torch.float32"),
        (dict(x=t(MOE_TOKENS, MOE_HIDDEN, 1)), "x must be [T, hidden]"),
        (dict(x=t(MOE_TOKENS, 12), gate_up=t(LOCAL_EXPERTS, 2 * MOE_I, 12), down=t(LOCAL_EXPERTS, 12, MOE_I)),
         "hidden 12: a token row of 24 bytes must be a multiple of 16 bytes"),
        (dict(max_tokens=MOE_TOKENS - 1), f"x has {MOE_TOKENS} tokens, more than max_tokens {MOE_TOKENS - 1}"),
        (dict(topk_ids=t(MOE_TOKENS, MOE_K, dtype=torch.int64)), "topk_ids must be int32 [T, top_k] with T = 100"),
        (dict(topk_ids=t(MOE_TOKENS - 1, MOE_K, dtype=I32)), "topk_ids must be int32 [T, top_k] with T = 100 (x's "
                                                             "rows), got [99, 4]"),
        (dict(topk_ids=t(MOE_TOKENS, dtype=I32)), "topk_ids must be int32 [T, top_k]"),
        (dict(topk_weights=t(MOE_TOKENS, MOE_K + 1, dtype=FP32)), "topk_weights must be float32 [T, top_k] like "
                                                                  "topk_ids [100, 4], got [100, 5]"),
        (dict(topk_weights=t(MOE_TOKENS, MOE_K, dtype=BF16)), "topk_weights must be float32"),
        (dict(topk_ids=t(MOE_TOKENS, 0, dtype=I32), topk_weights=None), "top_k 0 (topk_ids' columns) is outside"),
        (dict(topk_ids=t(MOE_TOKENS, 33, dtype=I32), topk_weights=None, num_experts=64 * world),
         r"top_k 33 (topk_ids' columns) is outside [1, min(E, 32)]"),
        (dict(num_experts=e + 1), f"num_experts {e + 1} is not a multiple of the world size {world}"),
        (dict(num_experts=2 * e), f"gate_up must be [E/W, 2I, hidden] = [{2 * LOCAL_EXPERTS}, {2 * MOE_I}, 256]"),
        (dict(gate_up=t(LOCAL_EXPERTS, MOE_I, MOE_HIDDEN)), "I = 192 from down), got [4, 192, 256]"),
        (dict(down=t(LOCAL_EXPERTS, MOE_I, MOE_HIDDEN)), "and down [E/W, hidden, I]"),
        (dict(down=t(MOE_HIDDEN, MOE_I)), "gate_up must be [E/W, 2I, hidden] and down [E/W, hidden, I], got"),
        (dict(gate_up=t(LOCAL_EXPERTS, 2 * MOE_I, MOE_HIDDEN, dtype=FP16)), "gate_up and down must have x's dtype "
                                                                           "torch.bfloat16, got torch.float16"),
        (dict(num_experts=0), "num_experts must be an int >= 1, got 0"),
        (dict(max_tokens=0), "max_tokens must be an int >= 1, got 0"),
        (dict(capacity=-1), "capacity must be an int >= 0, got -1"),
        (dict(overflow="wrap"), "overflow 'wrap': expected 'error' or 'drop'"),
    ]


def _materialise(changes, device):
    return {k: torch.empty(v["shape"], dtype=v["dtype"], device=device) if isinstance(v, dict) else v
            for k, v in changes.items()}


@pytest.mark.parametrize("case", range(len(_moe_layer_refusals(2))))
def test_moe_layer_refusals(comm, case):
    """Each bad argument is refused with loom.InvalidArgument: by the fake function (tracing) and
    by the real operator on CPU tensors, before anything is allocated or launched (the stand-in
    communicator has no staging cache and no GPU: reaching either would fail otherwise)."""
    h = lt.register_communicator(comm)
    w = comm.local_world_size
    changes, fragment = _moe_layer_refusals(w)[case]
    with FakeTensorMode():
        with pytest.raises(loom.InvalidArgument) as info:
            call_moe_layer(h, moe_layer_args(w, **_materialise(changes, "cuda")))
        assert fragment in str(info.value) and info.value.op == "moe_layer", str(info.value)
    with pytest.raises(loom.InvalidArgument) as info:
        lt.moe_layer_from_topk(comm, **moe_layer_args(w, device="cpu", **_materialise(changes, "cpu")))
    assert fragment in str(info.value) and info.value.op == "moe_layer", str(info.value)


def test_moe_layer_on_cpu_tensors_is_refused_after_every_shape_rule():
    """Right shapes on the CPU: the device check refuses them (every shape rule passed), nothing
    allocated."""
    comm = StandInComm(2)
    with pytest.raises(loom.InvalidArgument, match="loom rank 0: moe_layer: x is on cpu but the communicator uses cuda:0"):
        lt.moe_layer_from_topk(comm, **moe_layer_args(2, device="cpu"))


def test_moe_layer_function_checks_the_numbers_before_the_dispatcher():
    comm = StandInComm(2)
    args = moe_layer_args(2, device="cpu")
    for name, value, fragment in (("num_experts", 8.0, "num_experts must be an int >= 1, got 8.0"),
                                  ("max_tokens", True, "max_tokens must be an int >= 1, got True"),
                                  ("capacity", "0", "capacity must be an int >= 0, got '0'"),
                                  ("overflow", None, "overflow None: expected 'error' or 'drop'")):
        with pytest.raises(loom.InvalidArgument, match="moe_layer: " + fragment.replace("(", r"\(").replace(")", r"\)")):
            lt.moe_layer_from_topk(comm, **{**args, name: value})


def test_moe_layer_across_nodes_traces():
    comm = StandInComm(2)
    comm.world_size = 4  # two nodes of two ranks: E/W counts every rank of the job
    h = lt.register_communicator(comm)
    with FakeTensorMode():
        out = call_moe_layer(h, moe_layer_args(4))
    assert out.shape[1] == MOE_HIDDEN


def test_moe_layer_odd_intermediate_is_unsupported():
    comm = StandInComm(2)
    h = lt.register_communicator(comm)
    with FakeTensorMode(), pytest.raises(loom.Unsupported, match=r"I = 12 \(down's last dimension\) must be a positive "
                                                                 "multiple of 8"):
        call_moe_layer(h, moe_layer_args(2, gate_up=fake(LOCAL_EXPERTS, 24, MOE_HIDDEN),
                                         down=fake(LOCAL_EXPERTS, MOE_HIDDEN, 12)))


def test_torch_compile_traces_an_moe_block():
    """torch.compile (fullgraph) puts moe_topk and moe_layer in its graph, using the fake functions."""
    comm = StandInComm(2)
    lt.register_communicator(comm)
    graphs = []
    record = recording_backend(graphs)

    def moe_block(x, router, gate_up, down):
        ids, weights = lt.moe_topk(lt.gemm(x, router, b_layout="nk"), MOE_K, renormalize=True)
        y = lt.moe_layer_from_topk(comm, x, ids, weights, gate_up, down, num_experts=2 * LOCAL_EXPERTS,
                                   max_tokens=MOE_MAX_TOKENS)
        return y + x

    compiled = torch.compile(moe_block, backend=record, fullgraph=True)
    args = moe_layer_args(2, device="cpu")
    out = compiled(args["x"], torch.randn(2 * LOCAL_EXPERTS, MOE_HIDDEN, dtype=BF16), args["gate_up"], args["down"])
    assert len(graphs) == 1
    assert out.shape == (MOE_TOKENS, MOE_HIDDEN) and out.dtype == BF16
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    for op in ("moe_topk", "moe_layer", "gemm"):
        assert f"loom.{op}.default" in targets, (op, targets)


class CacheComm(StandInComm):
    """A stand-in with what moe_layer's buffer cache reads of a loom.Communicator."""

    def __init__(self, world):
        super().__init__(world)
        self._moe_layer_buffers = {}  # as loom.Communicator's


def test_moe_layer_buffers_are_cached_per_config_and_refused_during_capture(monkeypatch):
    """The buffer cache's policy with moe_buffers stubbed out: one entry per (config, I), made by
    the first call (never during CUDA graph capture: 'run it once eagerly first'), found by the
    next ones (capturing too), and kept on the communicator (Communicator.close drops them)."""
    made = []

    def moe_buffers(comm, config, *, hidden_intermediate=None, shared_expert=False):
        made.append((config.num_experts, config.top_k, config.hidden, config.dtype, config.max_tokens, config.capacity,
                     config.overflow, hidden_intermediate, shared_expert))
        return object()

    monkeypatch.setattr(lt, "moe_buffers", moe_buffers)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    comm = CacheComm(2)
    key = (8, 4, 256, BF16, 256, 0, "error", 192, False)
    capturing[0] = True
    with pytest.raises(loom.InvalidArgument, match="cannot be during CUDA graph capture: run it once eagerly first"):
        lt._moe_layer_entry(comm, key)
    assert made == []
    capturing[0] = False
    config, buffers = lt._moe_layer_entry(comm, key)
    assert (config.num_experts, config.top_k, config.hidden, config.dtype, config.max_tokens) == (8, 4, 256, "bf16", 256)
    assert made == [(8, 4, 256, "bf16", 256, 0, "error", 192, False)]
    capturing[0] = True
    assert lt._moe_layer_entry(comm, key)[1] is buffers  # cached: capturing is fine
    capturing[0] = False
    other = key[:-2] + (384, False)  # another I: another entry
    assert lt._moe_layer_entry(comm, other)[1] is not buffers
    shared = key[:-1] + (True,)  # a shared expert: buffers of more rows, another entry
    assert lt._moe_layer_entry(comm, shared)[1] is not buffers and made[-1][-1] is True
    assert lt._moe_layer_entry(comm, key)[1] is buffers and len(made) == 3
    assert len(comm._moe_layer_buffers) == 3
