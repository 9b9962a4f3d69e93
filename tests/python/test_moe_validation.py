"""Argument checks of the MoE bindings that need no GPU: loom.MoeConfig, and the tensor checks of
moe_routing, moe_dispatch, moe_combine, moe_dispatch_gemm and moe_layer through
`_C._check_moe_args(op, config, world, num_tokens, tensors)`, which runs the same checks as the
calls with `world` standing in for the communicator (capacity and E/W from moe.h's defaults) and
`num_tokens` for the routed tokens; and moe_topk's through `_C._check_moe_topk(logits, topk_ids,
topk_weights, top_k, scoring, renormalize)`, which also runs loom's host checks
(moe_topk_can_implement) before the device check. As in test_validation.py, shapes and dtypes are
checked before devices, so CPU tensors with correct shapes fail on the device check, which proves
that every shape rule passed. What needs a communicator (loom's own config checks, the plan buffer's size,
symmetric memory, the plan's owner) is in test_gpu_moe.py."""

import contextlib
import struct

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

import loom  # noqa: E402
from loom import _C  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32

WORLD = 2
E, K, H, TMAX = 8, 2, 64, 32  # E/W = 4 local experts; default capacity TMAX * W * K = 128
CAPACITY = TMAX * WORLD * K
T = 16


@contextlib.contextmanager
def raises(cls, *fragments):
    """pytest.raises that also checks each fragment is in the message."""
    with pytest.raises(cls) as info:
        yield info
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


def config(**changes):
    fields = dict(num_experts=E, top_k=K, hidden=H, dtype=BF16, max_tokens=TMAX)
    fields.update(changes)
    return loom.MoeConfig(**fields)


def t(*shape, dtype=BF16):
    return torch.zeros(shape, dtype=dtype)


def check(op, tensors, cfg=None, tokens=T, **options):
    _C._check_moe_args(op, cfg or config(), WORLD, tokens, tuple(tensors), **options)


# ---- MoeConfig ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,name", [(BF16, "bf16"), (FP16, "fp16"), (FP32, "fp32"), ("bfloat16", "bf16"),
                                        ("half", "fp16"), (np.dtype(np.float32), "fp32")])
def test_config_takes_any_dtype_spelling(dtype, name):
    c = config(dtype=dtype, capacity=100, overflow="drop")
    assert (c.num_experts, c.top_k, c.hidden, c.dtype, c.max_tokens, c.capacity, c.overflow) == (
        E, K, H, name, TMAX, 100, "drop")
    assert isinstance(c, _C.MoeConfig)
    assert repr(c) == (f"MoeConfig(num_experts={E}, top_k={K}, hidden={H}, dtype='{name}', max_tokens={TMAX}, "
                       "capacity=100, overflow='drop')")


def test_config_defaults():
    c = config()
    assert (c.capacity, c.overflow) == (0, "error")


def test_config_refuses_what_it_can_see():
    with raises(loom.InvalidArgument, "torch.int32", "bfloat16, float16 or float32"):
        config(dtype=I32)
    with raises(loom.InvalidArgument, "MoeConfig: overflow 'truncate'", "'error'", "'drop'"):
        config(overflow="truncate")
    with raises(loom.InvalidArgument, "MoeConfig: top_k must be an int, got float"):
        config(top_k=2.0)
    with raises(loom.InvalidArgument, "MoeConfig: num_experts must be an int, got bool"):
        config(num_experts=True)
    with raises(loom.InvalidArgument, "top_k = 4294967296 does not fit its C++ field"):
        config(top_k=1 << 32)
    with raises(loom.InvalidArgument, "MoeConfig: dtype 'fp8'"):
        _C.MoeConfig(E, K, H, "fp8", TMAX)


def test_config_values_are_loom_s_to_judge():
    # k > E is refused by loom against a communicator (moe_can_implement), not here.
    assert config(top_k=E + 1).top_k == E + 1


def test_plan_is_made_by_moe_routing_only():
    with pytest.raises(TypeError):
        loom.MoePlan()


def test_python_layer_wants_a_communicator():
    with raises(loom.InvalidArgument, "moe_sizes: comm must be a loom.Communicator"):
        loom.moe_sizes(object(), config())
    with raises(loom.InvalidArgument, "moe_dispatch: comm must be a loom.Communicator"):
        loom.moe_dispatch(None, None, t(T, H), t(CAPACITY, H))


# ---- moe_routing --------------------------------------------------------------------------------

def routing(ids=None, weights=None, plan=None, offsets=None):
    return [t(T, K, dtype=I32) if ids is None else ids, weights,
            t(4096, dtype=torch.uint8) if plan is None else plan,
            t(E // WORLD + 1, dtype=I32) if offsets is None else offsets]


def test_routing_correct_shapes_fail_only_on_the_device():
    with raises(loom.InvalidArgument, "loom rank 0: moe_routing: topk_ids is on cpu"):
        check("moe_routing", routing(weights=t(T, K, dtype=FP32)))
    # No tokens on this rank; int32 or numpy plan buffers (raw memory).
    with raises(loom.InvalidArgument, "topk_ids is on cpu"):
        check("moe_routing", routing(ids=t(0, K, dtype=I32), weights=t(0, K, dtype=FP32), plan=t(64, dtype=I32)))
    with raises(loom.InvalidArgument, "topk_ids is on cpu"):
        check("moe_routing", routing(plan=np.zeros(100, np.uint8), offsets=np.zeros(5, np.int32)))


def test_routing_ids_are_int32_t_by_k():
    with raises(loom.InvalidArgument, "topk_ids has dtype torch.int64; it must be int32"):
        check("moe_routing", routing(ids=t(T, K, dtype=torch.int64)))
    with raises(loom.InvalidArgument, "topk_ids must be 2-D [T, top_k] int32, got shape [32]"):
        check("moe_routing", routing(ids=t(T * K, dtype=I32)))
    with raises(loom.InvalidArgument, "topk_ids must be [T, top_k] with the config's top_k = 2, got [16, 3]"):
        check("moe_routing", routing(ids=t(T, 3, dtype=I32)))
    with raises(loom.InvalidArgument, "topk_ids [16, 2] is not row-major contiguous"):
        check("moe_routing", routing(ids=t(K, T, dtype=I32).t()))


def test_routing_weights_are_fp32_like_the_ids():
    with raises(loom.InvalidArgument, "topk_weights must be float32 (the router's weights), got bf16"):
        check("moe_routing", routing(weights=t(T, K)))
    with raises(loom.InvalidArgument, "topk_weights must be [T, top_k] = [16, 2], got [16, 3]"):
        check("moe_routing", routing(weights=t(T, 3, dtype=FP32)))
    with raises(loom.InvalidArgument, "topk_weights has dtype int32; loom takes bfloat16, float16 or float32"):
        check("moe_routing", routing(weights=np.zeros((T, K), np.int32)))


def test_routing_plan_buffer_is_raw_memory():
    with raises(loom.InvalidArgument, "plan_buffer has dtype torch.float32; it must be uint8 or int32 (raw device memory)"):
        check("moe_routing", routing(plan=t(1024, dtype=FP32)))
    with raises(loom.InvalidArgument, "plan_buffer has dtype int64; it must be uint8 or int32"):
        check("moe_routing", routing(plan=np.zeros(64, np.int64)))
    with raises(loom.InvalidArgument, "plan_buffer [64, 64] is not row-major contiguous"):
        check("moe_routing", routing(plan=t(64, 64, dtype=torch.uint8).t()))


def test_routing_expert_offsets_are_local_experts_plus_one():
    with raises(loom.InvalidArgument, "expert_offsets must be [E/W + 1] = [5] int32, got [9]"):
        check("moe_routing", routing(offsets=t(E + 1, dtype=I32)))
    with raises(loom.InvalidArgument, "expert_offsets must be 1-D [E/W + 1] int32, got shape [5, 1]"):
        check("moe_routing", routing(offsets=t(5, 1, dtype=I32)))
    with raises(loom.InvalidArgument, "expert_offsets has dtype torch.int64; it must be int32"):
        check("moe_routing", routing(offsets=t(5, dtype=torch.int64)))


def test_routing_missing_tensors():
    with raises(loom.InvalidArgument, "topk_ids is None; loom needs a tensor"):
        check("moe_routing", [None, None, t(64, dtype=torch.uint8), t(5, dtype=I32)])
    with raises(loom.InvalidArgument, "plan_buffer must be a tensor", "list"):
        check("moe_routing", routing(plan=[0] * 64))


def test_stand_in_world_must_divide_the_experts():
    with raises(loom.InvalidArgument, "num_experts 7 is not a positive multiple of the world size 2"):
        check("moe_dispatch", [t(T, H), t(CAPACITY, H)], cfg=config(num_experts=7))


# ---- moe_dispatch -------------------------------------------------------------------------------

def test_dispatch_correct_shapes_fail_only_on_the_device():
    with raises(loom.InvalidArgument, "loom rank 0: moe_dispatch: x is on cpu"):
        check("moe_dispatch", [t(T, H), t(CAPACITY, H)])
    with raises(loom.InvalidArgument, "x is on cpu"):  # a rank without tokens
        check("moe_dispatch", [t(0, H), t(CAPACITY, H)], tokens=0)
    with raises(loom.InvalidArgument, "x is on cpu"):  # an explicit capacity; fp32 rows
        check("moe_dispatch", [t(T, H, dtype=FP32), t(100, H, dtype=FP32)], cfg=config(capacity=100, dtype=FP32))
    with raises(loom.InvalidArgument, "x is on cpu"):  # any DLPack producer
        check("moe_dispatch", [np.zeros((T, H), np.float16), np.zeros((CAPACITY, H), np.float16)],
              cfg=config(dtype=FP16))


def test_dispatch_dtypes_follow_the_config():
    with raises(loom.InvalidArgument, "x is fp16 but the config's dtype is bf16"):
        check("moe_dispatch", [t(T, H, dtype=FP16), t(CAPACITY, H)])
    with raises(loom.InvalidArgument, "recv_x is fp32 but the config's dtype is bf16"):
        check("moe_dispatch", [t(T, H), t(CAPACITY, H, dtype=FP32)])


def test_dispatch_shapes_follow_the_plan():
    with raises(loom.InvalidArgument, "x must be [T, hidden] (T: the tokens given to moe_routing) = [16, 64], got [15, 64]"):
        check("moe_dispatch", [t(T - 1, H), t(CAPACITY, H)])
    with raises(loom.InvalidArgument, "x must be [T, hidden] (T: the tokens given to moe_routing) = [16, 64], got [16, 32]"):
        check("moe_dispatch", [t(T, H // 2), t(CAPACITY, H)])
    with raises(loom.InvalidArgument, "recv_x must be [capacity, hidden] = [128, 64], got [127, 64]"):
        check("moe_dispatch", [t(T, H), t(CAPACITY - 1, H)])
    with raises(loom.InvalidArgument, "recv_x must be 2-D [capacity, hidden], got shape [128, 8, 8]"):
        check("moe_dispatch", [t(T, H), t(CAPACITY, 8, 8)])
    with raises(loom.InvalidArgument, "x must be 2-D [T, hidden], got shape [1024]"):
        check("moe_dispatch", [t(T * H), t(CAPACITY, H)])


# ---- moe_combine --------------------------------------------------------------------------------

def test_combine_correct_shapes_fail_only_on_the_device():
    with raises(loom.InvalidArgument, "loom rank 0: moe_combine: expert_out is on cpu"):
        check("moe_combine", [t(CAPACITY, H), t(T, H)])
    # Another width and dtype than the dispatch's, and combine's own weights.
    with raises(loom.InvalidArgument, "expert_out is on cpu"):
        check("moe_combine", [t(CAPACITY, 24, dtype=FP32), t(T, 24, dtype=FP32), t(T, K, dtype=FP32)])


def test_combine_shapes_and_dtypes():
    with raises(loom.InvalidArgument, "expert_out is bf16 but out is fp16; they must have the same dtype"):
        check("moe_combine", [t(CAPACITY, H), t(T, H, dtype=FP16)])
    with raises(loom.InvalidArgument, "expert_out must be [capacity, H'] = [128, 64], got [64, 64]"):
        check("moe_combine", [t(CAPACITY // 2, H), t(T, H)])
    with raises(loom.InvalidArgument, "out must be [T, H'] (T: the tokens given to moe_routing, H': expert_out's width) "
                                      "= [16, 32], got [16, 64]"):
        check("moe_combine", [t(CAPACITY, 32), t(T, H)])
    with raises(loom.InvalidArgument, "expert_out [128, 0] has no columns"):
        check("moe_combine", [t(CAPACITY, 0), t(T, 0)])
    with raises(loom.InvalidArgument, "topk_weights must be [T, top_k] = [16, 2], got [2, 16]"):
        check("moe_combine", [t(CAPACITY, H), t(T, H), t(K, T, dtype=FP32)])
    with raises(loom.InvalidArgument, "topk_weights must be float32"):
        check("moe_combine", [t(CAPACITY, H), t(T, H), t(T, K, dtype=FP16)])


# ---- moe_dispatch_gemm ----------------------------------------------------------------------------

N = 48


def gemm_tensors(weights=None, out=None, n_out=N, out_dtype=BF16):
    return [t(T, H), t(CAPACITY, H), t(E // WORLD, N, H) if weights is None else weights,
            t(CAPACITY, n_out, dtype=out_dtype) if out is None else out]


@pytest.mark.parametrize("out_dtype", [BF16, FP16, FP32])
def test_dispatch_gemm_correct_shapes_fail_only_on_the_device(out_dtype):
    with raises(loom.InvalidArgument, "loom rank 0: moe_dispatch_gemm: x is on cpu"):
        check("moe_dispatch_gemm", gemm_tensors(out_dtype=out_dtype))
    with raises(loom.InvalidArgument, "x is on cpu"):
        check("moe_dispatch_gemm", gemm_tensors(weights=t(E // WORLD, H, N)), b_layout="kn")
    with raises(loom.InvalidArgument, "x is on cpu"):
        check("moe_dispatch_gemm", gemm_tensors(n_out=N // 2, out_dtype=out_dtype), activation="swiglu")


def test_dispatch_gemm_weights_are_this_rank_s_experts():
    with raises(loom.InvalidArgument, "weights must be [E/W, N, hidden] with E/W = 4 (this rank's experts) and hidden = 64 "
                                      "(b_layout 'nk'), got [8, 48, 64]"):
        check("moe_dispatch_gemm", gemm_tensors(weights=t(E, N, H)))
    with raises(loom.InvalidArgument, "weights must be [E/W, hidden, N]", "(b_layout 'kn'), got [4, 48, 64]"):
        check("moe_dispatch_gemm", gemm_tensors(), b_layout="kn")
    with raises(loom.InvalidArgument, "weights must be 3-D [E/W, N, hidden], got shape [48, 64]"):
        check("moe_dispatch_gemm", gemm_tensors(weights=t(N, H)))
    with raises(loom.InvalidArgument, "weights is fp16 but the config's dtype is bf16"):
        check("moe_dispatch_gemm", gemm_tensors(weights=t(E // WORLD, N, H, dtype=FP16)))


def test_dispatch_gemm_out_shape():
    with raises(loom.InvalidArgument, "out must be [capacity, N] = [128, 48], got [128, 24]"):
        check("moe_dispatch_gemm", gemm_tensors(n_out=N // 2))
    with raises(loom.InvalidArgument, "out must be [capacity, N / 2] = [128, 24], got [128, 48]"):
        check("moe_dispatch_gemm", gemm_tensors(), activation="swiglu")
    with raises(loom.InvalidArgument, "out must be [capacity, N] = [128, 48], got [16, 48]"):
        check("moe_dispatch_gemm", gemm_tensors(out=t(T, N)))


def test_dispatch_gemm_options():
    with raises(loom.InvalidArgument, "b_layout 'mk'"):
        check("moe_dispatch_gemm", gemm_tensors(), b_layout="mk")
    with raises(loom.InvalidArgument, "activation 'gelu': expected 'none' or 'swiglu'"):
        check("moe_dispatch_gemm", gemm_tensors(), activation="gelu")


def test_dispatch_gemm_tokens_as_dispatch():
    with raises(loom.InvalidArgument, "x is fp16 but the config's dtype is bf16"):
        check("moe_dispatch_gemm", [t(T, H, dtype=FP16)] + gemm_tensors()[1:])


# ---- moe_layer ----------------------------------------------------------------------------------

INTER = 24  # I: gate_up [E/W, 2I, H] = [4, 48, 64], down [4, 64, 24], hidden [capacity, 24]
EL = E // WORLD


def layer_tensors(dtype=BF16, **changes):
    """moe_layer's tensors in the binding's order, each replaceable by name."""
    tensors = dict(x=t(T, H, dtype=dtype), gate_up=t(EL, 2 * INTER, H, dtype=dtype), down=t(EL, H, INTER, dtype=dtype),
                   recv_x=t(CAPACITY, H, dtype=dtype), hidden=t(CAPACITY, INTER, dtype=dtype),
                   expert_out=t(CAPACITY, H, dtype=dtype), out=t(T, H, dtype=dtype))
    assert set(changes) <= set(tensors)
    tensors.update(changes)
    return list(tensors.values())


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_layer_correct_shapes_fail_only_on_the_device(dtype):
    with raises(loom.InvalidArgument, "loom rank 0: moe_layer: x is on cpu"):
        check("moe_layer", layer_tensors(dtype), cfg=config(dtype=dtype))
    with raises(loom.InvalidArgument, "x is on cpu"):  # a rank without tokens
        check("moe_layer", layer_tensors(x=t(0, H), out=t(0, H)), tokens=0)
    with raises(loom.InvalidArgument, "x is on cpu"):  # an explicit capacity sizes hidden and expert_out
        check("moe_layer", layer_tensors(recv_x=t(100, H), hidden=t(100, INTER), expert_out=t(100, H)),
              cfg=config(capacity=100))
    # I's own rule (a positive multiple of 8) is loom's: an I of 12 passes the binding.
    with raises(loom.InvalidArgument, "x is on cpu"):
        check("moe_layer", layer_tensors(gate_up=t(EL, 24, H), down=t(EL, H, 12), hidden=t(CAPACITY, 12)))


def test_layer_gate_up_is_this_rank_s_experts():
    with raises(loom.InvalidArgument, "moe_layer: gate_up must be [E/W, 2I, hidden] with E/W = 4 (this rank's experts), "
                                      "an even 2I (gate and up rows interleaved by 8) and hidden = 64, got [8, 48, 64]"):
        check("moe_layer", layer_tensors(gate_up=t(E, 2 * INTER, H)))
    with raises(loom.InvalidArgument, "gate_up must be [E/W, 2I, hidden]", "got [4, 48, 32]"):
        check("moe_layer", layer_tensors(gate_up=t(EL, 2 * INTER, H // 2)))
    with raises(loom.InvalidArgument, "gate_up must be [E/W, 2I, hidden]", "an even 2I", "got [4, 47, 64]"):
        check("moe_layer", layer_tensors(gate_up=t(EL, 2 * INTER - 1, H)))
    with raises(loom.InvalidArgument, "gate_up must be 3-D [E/W, 2I, hidden], got shape [48, 64]"):
        check("moe_layer", layer_tensors(gate_up=t(2 * INTER, H)))
    # The hidden-major layout [E/W, hidden, 2I] ('kn') is not taken: its 2I would be read as hidden.
    with raises(loom.InvalidArgument, "gate_up must be [E/W, 2I, hidden]", "got [4, 64, 48]"):
        check("moe_layer", layer_tensors(gate_up=t(EL, H, 2 * INTER)))


def test_layer_down_agrees_with_gate_up():
    with raises(loom.InvalidArgument, "down must be [E/W, hidden, I] (I = 24: half of gate_up's 48 rows) = "
                                      "[4, 64, 24], got [4, 64, 32]"):
        check("moe_layer", layer_tensors(down=t(EL, H, 32)))
    with raises(loom.InvalidArgument, "down must be [E/W, hidden, I] (I = 24", "got [4, 64, 48]"):  # 2I, not I
        check("moe_layer", layer_tensors(down=t(EL, H, 2 * INTER)))
    with raises(loom.InvalidArgument, "down must be [E/W, hidden, I]", "= [4, 64, 24], got [4, 24, 64]"):  # [E/W, I, H]
        check("moe_layer", layer_tensors(down=t(EL, INTER, H)))
    with raises(loom.InvalidArgument, "down must be [E/W, hidden, I]", "got [8, 64, 24]"):
        check("moe_layer", layer_tensors(down=t(E, H, INTER)))
    with raises(loom.InvalidArgument, "down must be 3-D [E/W, hidden, I], got shape [64, 24]"):
        check("moe_layer", layer_tensors(down=t(H, INTER)))


def test_layer_buffers_and_out_shapes():
    with raises(loom.InvalidArgument, "hidden must be [capacity, I] = [128, 24], got [128, 32]"):
        check("moe_layer", layer_tensors(hidden=t(CAPACITY, 32)))
    with raises(loom.InvalidArgument, "hidden must be [capacity, I] = [128, 24], got [16, 24]"):  # per token, not row
        check("moe_layer", layer_tensors(hidden=t(T, INTER)))
    with raises(loom.InvalidArgument, "hidden must be 2-D [capacity, I], got shape [4, 32, 24]"):
        check("moe_layer", layer_tensors(hidden=t(EL, CAPACITY // EL, INTER)))
    with raises(loom.InvalidArgument, "expert_out must be [capacity, hidden] = [128, 64], got [128, 32]"):
        check("moe_layer", layer_tensors(expert_out=t(CAPACITY, H // 2)))
    with raises(loom.InvalidArgument, "out must be [T, hidden] (T: the tokens given to moe_routing) = [16, 64], "
                                      "got [128, 64]"):
        check("moe_layer", layer_tensors(out=t(CAPACITY, H)))
    with raises(loom.InvalidArgument, "recv_x must be [capacity, hidden] = [128, 64], got [127, 64]"):
        check("moe_layer", layer_tensors(recv_x=t(CAPACITY - 1, H)))
    with raises(loom.InvalidArgument, "x must be [T, hidden] (T: the tokens given to moe_routing) = [16, 64], "
                                      "got [15, 64]"):
        check("moe_layer", layer_tensors(x=t(T - 1, H)))


SHARED_ROWS = 128 + TMAX  # moe_layer_rows(CAPACITY = 128, TMAX, True): the capacity rounded up to 128, then Tmax


def shared_tensors(dtype=BF16, **changes):
    """moe_layer's tensors with a shared expert: hidden and expert_out of SHARED_ROWS rows, then
    shared_gate_up [2I, H] and shared_down [H, I]."""
    tensors = layer_tensors(dtype, hidden=t(SHARED_ROWS, INTER, dtype=dtype), expert_out=t(SHARED_ROWS, H, dtype=dtype))
    shared = dict(shared_gate_up=t(2 * INTER, H, dtype=dtype), shared_down=t(H, INTER, dtype=dtype))
    names = ["x", "gate_up", "down", "recv_x", "hidden", "expert_out", "out"]
    for name in list(changes):
        if name in shared:
            shared[name] = changes.pop(name)
    base = dict(zip(names, tensors))
    base.update(changes)
    return list(base.values()) + list(shared.values())


def test_layer_rows():
    assert loom.moe_layer_rows(CAPACITY, TMAX, False) == CAPACITY
    assert loom.moe_layer_rows(CAPACITY, TMAX, True) == SHARED_ROWS
    assert loom.moe_layer_rows(300, 10, True) == 384 + 10


def test_layer_shared_expert_shapes():
    with raises(loom.InvalidArgument, "x is on cpu"):  # right shapes: only the device check fails
        check("moe_layer", shared_tensors())
    with raises(loom.InvalidArgument, "shared_gate_up and shared_down go together"):
        check("moe_layer", shared_tensors()[:-1])
    with raises(loom.InvalidArgument, "hidden must be [rows (moe_layer_rows(capacity, max_tokens, True) = 160), I] = "
                                      "[160, 24], got [128, 24]"):
        check("moe_layer", shared_tensors(hidden=t(CAPACITY, INTER)))
    with raises(loom.InvalidArgument, "expert_out must be [rows (moe_layer_rows", "= [160, 64], got [128, 64]"):
        check("moe_layer", shared_tensors(expert_out=t(CAPACITY, H)))
    with raises(loom.InvalidArgument, "shared_gate_up must be [2I, hidden] (I = 24, gate_up's) = [48, 64], got [24, 64]"):
        check("moe_layer", shared_tensors(shared_gate_up=t(INTER, H)))
    with raises(loom.InvalidArgument, "shared_down must be [hidden, I] (I = 24, gate_up's) = [64, 24], got [24, 64]"):
        check("moe_layer", shared_tensors(shared_down=t(INTER, H)))
    with raises(loom.InvalidArgument, "shared_gate_up must be 2-D [2I, hidden], got shape [1, 48, 64]"):
        check("moe_layer", shared_tensors(shared_gate_up=t(1, 2 * INTER, H)))
    with raises(loom.InvalidArgument, "shared_down is fp16 but the config's dtype is bf16"):
        check("moe_layer", shared_tensors(shared_down=t(H, INTER, dtype=FP16)))


@pytest.mark.parametrize("name", ["x", "gate_up", "down", "recv_x", "hidden", "expert_out", "out"])
def test_layer_every_tensor_has_the_config_s_dtype(name):
    # No per-tensor dtypes: MoeLayerWeights and MoeLayerBuffers carry none (out cannot be fp32 as
    # moe_combine's can).
    shapes = dict(zip(["x", "gate_up", "down", "recv_x", "hidden", "expert_out", "out"],
                      [(T, H), (EL, 2 * INTER, H), (EL, H, INTER), (CAPACITY, H), (CAPACITY, INTER), (CAPACITY, H),
                       (T, H)]))
    for other in (FP16, FP32):
        said = f"{name} is {'fp16' if other == FP16 else 'fp32'} but the config's dtype is bf16"
        with raises(loom.InvalidArgument, said):
            check("moe_layer", layer_tensors(**{name: t(*shapes[name], dtype=other)}))


@pytest.mark.parametrize("name,shape", [("x", (H, T)), ("gate_up", (EL, H, 2 * INTER)), ("down", (EL, INTER, H)),
                                        ("hidden", (INTER, CAPACITY)), ("expert_out", (H, CAPACITY)), ("out", (H, T))])
def test_layer_tensors_must_be_contiguous(name, shape):
    transposed = t(*shape).transpose(-2, -1)  # the right shape, column-major in the last two dimensions
    with raises(loom.InvalidArgument, f"{name} {list(transposed.shape)} is not row-major contiguous"):
        check("moe_layer", layer_tensors(**{name: transposed}))


def test_layer_missing_tensors():
    with raises(loom.InvalidArgument, "hidden is None; loom needs a tensor"):
        check("moe_layer", layer_tensors(hidden=None))
    with raises(loom.InvalidArgument, "down must be a tensor", "list"):
        check("moe_layer", layer_tensors(down=[0.0] * 8))


def test_layer_python_layer_wants_a_communicator():
    with raises(loom.InvalidArgument, "moe_layer: comm must be a loom.Communicator"):
        loom.moe_layer(None, None, *layer_tensors())


def test_torch_moe_buffers_keep_their_old_fields():
    """loom.torch.MoeBuffers made without hidden (code written before moe_layer) still works."""
    import loom.torch as lt

    b = lt.MoeBuffers(sizes=None, plan_buffer=t(16, dtype=torch.uint8), expert_offsets=t(EL + 1, dtype=I32),
                      recv_x=t(CAPACITY, H), expert_out=None)
    assert b.hidden is None
    assert "moe_layer" in lt.__all__ and "moe_layer" in loom.__all__


def test_unknown_op():
    with raises(loom.InvalidArgument, "unknown op 'moe_gather'"):
        check("moe_gather", [])


# ---- moe_topk (one GPU, no communicator) ----------------------------------------------------------

TE, TK = 64, 8  # logits [T, 64], top 8


def topk_tensors(logits=None, ids=None, weights=None, tokens=T, experts=TE, k=TK, dtype=FP32):
    return [t(tokens, experts, dtype=dtype) if logits is None else logits,
            t(tokens, k, dtype=I32) if ids is None else ids,
            t(tokens, k, dtype=FP32) if weights is None else weights]


def check_topk(tensors, top_k=TK, scoring="softmax", renormalize=False):
    _C._check_moe_topk(*tensors, top_k, scoring, renormalize)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_topk_correct_shapes_fail_only_on_the_device(dtype, scoring):
    with raises(loom.InvalidArgument, "loom: moe_topk: logits is on cpu"):
        check_topk(topk_tensors(dtype=dtype), scoring=scoring)
    with raises(loom.InvalidArgument, "logits is on cpu"):
        check_topk(topk_tensors(dtype=dtype), scoring=scoring, renormalize=True)


def test_topk_edges_of_the_ranges_pass():
    with raises(loom.InvalidArgument, "logits is on cpu"):  # k = E
        check_topk(topk_tensors(experts=4, k=4), top_k=4)
    with raises(loom.InvalidArgument, "logits is on cpu"):  # k = 32, E = 1024
        check_topk(topk_tensors(experts=1024, k=32), top_k=32)
    with raises(loom.InvalidArgument, "logits is on cpu"):  # a single expert
        check_topk(topk_tensors(experts=1, k=1), top_k=1)
    with raises(loom.InvalidArgument, "logits is on cpu"):  # no tokens
        check_topk(topk_tensors(tokens=0))
    with raises(loom.InvalidArgument, "logits is on cpu"):  # any DLPack producer
        check_topk([np.zeros((T, TE), np.float16), np.zeros((T, TK), np.int32), np.zeros((T, TK), np.float32)])


def test_topk_k_is_at_most_e_and_32():
    with raises(loom.InvalidArgument, "moe_topk: top_k 8 is outside [1, min(E, 32)]"):  # k > E
        check_topk(topk_tensors(experts=4))
    with raises(loom.InvalidArgument, "moe_topk: top_k 33 is outside [1, min(E, 32)]"):  # k > 32
        check_topk(topk_tensors(k=33), top_k=33)
    with raises(loom.InvalidArgument, "moe_topk: top_k 0 is outside [1, min(E, 32)]"):
        check_topk(topk_tensors(k=0), top_k=0)
    with raises(loom.InvalidArgument, "moe_topk: num_experts 1025 is outside [1, 1024]"):
        check_topk(topk_tensors(experts=1025))
    with raises(loom.InvalidArgument, "moe_topk: num_experts 0 is outside [1, 1024]"):
        check_topk(topk_tensors(experts=0))


def test_topk_unknown_scoring():
    with raises(loom.InvalidArgument, "moe_topk: scoring 'tanh': expected 'softmax'", "or 'sigmoid'"):
        check_topk(topk_tensors(), scoring="tanh")
    with raises(loom.InvalidArgument, "moe_topk: scoring must be 'softmax' or 'sigmoid', got NoneType"):
        loom.moe_topk(*topk_tensors(), top_k=TK, scoring=None)
    with raises(loom.InvalidArgument, "scoring 'Softmax'"):  # names are exact
        loom.moe_topk(*topk_tensors(), top_k=TK, scoring="Softmax")


def test_topk_shapes():
    with raises(loom.InvalidArgument, "logits must be 2-D [T, E], got shape [1024]"):
        check_topk(topk_tensors(logits=t(T * TE, dtype=FP32)))
    with raises(loom.InvalidArgument, "topk_ids must be [T, top_k] (T: logits' rows) = [16, 8], got [16, 4]"):
        check_topk(topk_tensors(ids=t(T, 4, dtype=I32)))
    with raises(loom.InvalidArgument, "topk_ids must be [T, top_k] (T: logits' rows) = [16, 8], got [15, 8]"):
        check_topk(topk_tensors(ids=t(T - 1, TK, dtype=I32)))
    with raises(loom.InvalidArgument, "topk_ids must be 2-D [T, top_k] int32, got shape [128]"):
        check_topk(topk_tensors(ids=t(T * TK, dtype=I32)))
    with raises(loom.InvalidArgument, "topk_weights must be [T, top_k] = [16, 8], got [8, 16]"):
        check_topk(topk_tensors(weights=t(TK, T, dtype=FP32)))
    with raises(loom.InvalidArgument, "topk_weights must be 2-D [T, top_k] float32, got shape [16, 8, 1]"):
        check_topk(topk_tensors(weights=t(T, TK, 1, dtype=FP32)))
    with raises(loom.InvalidArgument, "logits [16, 64] is not row-major contiguous"):
        check_topk(topk_tensors(logits=t(TE, T, dtype=FP32).t()))


def test_topk_dtypes():
    with raises(loom.InvalidArgument, "topk_ids has dtype torch.int64; it must be int32"):
        check_topk(topk_tensors(ids=t(T, TK, dtype=torch.int64)))
    with raises(loom.InvalidArgument, "topk_weights must be float32 (the router's weights), got bf16"):
        check_topk(topk_tensors(weights=t(T, TK)))
    with raises(loom.InvalidArgument, "topk_weights has dtype int32; loom takes bfloat16, float16 or float32"):
        check_topk(topk_tensors(weights=np.zeros((T, TK), np.int32)))
    with raises(loom.InvalidArgument, "logits has dtype torch.int32; loom takes bfloat16, float16 or float32"):
        check_topk(topk_tensors(logits=t(T, TE, dtype=I32)))
    with raises(loom.InvalidArgument, "logits has dtype torch.float64"):
        check_topk(topk_tensors(logits=t(T, TE, dtype=torch.float64)))


def test_topk_missing_tensors():
    with raises(loom.InvalidArgument, "topk_weights is None; loom needs a tensor"):
        check_topk(topk_tensors()[:2] + [None])
    with raises(loom.InvalidArgument, "logits must be a tensor", "list"):
        check_topk(topk_tensors(logits=[0.0] * 8))


def test_topk_outputs_must_not_overlap():
    """loom's host check (moe_topk_can_implement), reached on CPU tensors through _check_moe_topk."""
    flat = t(2 * T * TK, dtype=I32)
    half = T * TK // 2  # weights start halfway into ids
    with raises(loom.InvalidArgument, "moe_topk: logits, topk_ids and topk_weights must not overlap"):
        check_topk(topk_tensors(ids=flat[:T * TK].view(T, TK), weights=flat[half:half + T * TK].view(FP32).view(T, TK)))
    ids = t(T, TK, dtype=I32)
    with raises(loom.InvalidArgument, "must not overlap"):
        check_topk(topk_tensors(ids=ids, weights=ids.view(FP32)))
    logits = t(T, TE, dtype=FP32)
    with raises(loom.InvalidArgument, "must not overlap"):  # the weights written over the logits
        check_topk(topk_tensors(logits=logits, weights=logits.view(-1)[:T * TK].view(T, TK)))


def test_topk_python_layer():
    """loom.moe_topk takes no communicator and checks its scalars' types; the call itself checks the
    devices first (a CPU tensor is refused there, even with k > E)."""
    with raises(loom.InvalidArgument, "loom: moe_topk: logits is on cpu"):
        loom.moe_topk(*topk_tensors(), top_k=TK, scoring="sigmoid", renormalize=True)
    with raises(loom.InvalidArgument, "logits is on cpu"):
        loom.moe_topk(*topk_tensors(experts=4), top_k=TK)
    with raises(loom.InvalidArgument, "topk_ids must be [T, top_k] (T: logits' rows) = [16, 4]"):
        loom.moe_topk(*topk_tensors(), top_k=4)
    with raises(loom.InvalidArgument, "moe_topk: top_k must be an int, got float"):
        loom.moe_topk(*topk_tensors(), top_k=8.0)
    with raises(loom.InvalidArgument, "moe_topk: top_k must be an int, got bool"):
        loom.moe_topk(*topk_tensors(), top_k=True)
    with raises(loom.InvalidArgument, "top_k = 4294967296 does not fit its C++ field"):
        loom.moe_topk(*topk_tensors(), top_k=1 << 32)
    with raises(loom.InvalidArgument, "moe_topk: renormalize must be a bool, got int"):
        loom.moe_topk(*topk_tensors(), top_k=TK, renormalize=1)
    with raises(loom.InvalidArgument, "moe_topk: stream must be a stream object"):
        loom.moe_topk(*topk_tensors(), top_k=TK, stream="default")
    with pytest.raises(TypeError):
        loom.moe_topk(*topk_tensors(), TK)  # top_k is keyword-only
    assert "moe_topk" in loom.__all__


def test_topk_torch_helper():
    import loom.torch as lt

    assert "moe_topk" in lt.__all__
    with raises(loom.InvalidArgument, "loom: moe_topk: logits is on cpu"):  # allocated on logits' device
        lt.moe_topk(t(T, TE), TK, scoring="sigmoid", renormalize=True)
    with raises(loom.InvalidArgument, "moe_topk: logits must be 2-D [T, E], got shape [16, 64, 1]"):
        lt.moe_topk(t(T, TE, 1), TK)
    with raises(loom.InvalidArgument, "moe_topk: top_k must be a positive int, got 0"):
        lt.moe_topk(t(T, TE), 0)
    with raises(loom.InvalidArgument, "moe_topk: top_k must be a positive int, got 2.0"):
        lt.moe_topk(t(T, TE), 2.0)
    with raises(loom.InvalidArgument, "moe_topk: logits must be a torch.Tensor, got numpy.ndarray"):
        lt.moe_topk(np.zeros((T, TE), np.float32), TK)
    with raises(loom.InvalidArgument, "moe_topk: scoring 'tanh'"):
        lt.moe_topk(t(T, TE), TK, scoring="tanh")


def test_layer_phases_are_checked_before_the_launch():
    # The diagnostics buffer: uint8 or int32, one 64-byte record per SM (the check's fake GPU has
    # one SM), then on the device like every other tensor.
    base = layer_tensors() + [None, None]
    with raises(loom.InvalidArgument, "phases has dtype torch.bfloat16; it must be uint8 or int32"):
        check("moe_layer", base + [t(64)])
    with raises(loom.InvalidArgument, "phases must hold one 64-byte record per SM: at least 64 bytes for 1 SMs, "
                                      "got 32 ([32])"):
        check("moe_layer", base + [t(32, dtype=torch.uint8)])
    with raises(loom.InvalidArgument, "moe_layer: x is on cpu"):
        check("moe_layer", base + [t(16, dtype=I32)])


def test_layer_phase_records_are_read_in_cta_order():
    # Two records of loom::MoeLayerPhaseRecord (7 x u64, 2 x u32) and one that no CTA entered.
    fields = (1000, 2000, 2500, 9000, 9500, 300, 700)
    data = (struct.pack("<7Q2I", *fields, 2, 12) + struct.pack("<7Q2I", *([0] * 7), 0, 0)
            + struct.pack("<7Q2I", 1100, 1100, 1200, 9100, 9600, 100, 800, 3, 14))
    records = loom.moe_layer_phases(data)
    assert [r["cta"] for r in records] == [0, 2]
    assert records[0]["role"] == "push" and records[1]["role"] == "compute"
    assert (records[0]["entered_ns"], records[0]["reduced_ns"], records[0]["tiles"]) == (1000, 9500, 12)
    assert (records[1]["up_wait_ns"], records[1]["down_wait_ns"]) == (100, 800)
    # The same records from a tensor (copied to the host first) or a numpy array.
    as_tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert loom.moe_layer_phases(as_tensor) == records
    assert loom.moe_layer_phases(as_tensor.numpy()) == records
