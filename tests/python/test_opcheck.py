"""torch.library.opcheck for every loom.torch operator, on CPU.

opcheck compares an op's fake (meta) function with its real kernel, so it needs a kernel that
runs. loom's kernels need GPUs; here a test-only CPU kernel per op computes what the op computes
for a stand-in communicator of W ranks that all hold this rank's inputs (all_gather: W copies;
the sums: W times the input). It replaces loom's CPU kernel (which only refuses CPU tensors) for
the duration of the test, so the checks exercise loom's schemas, fake functions and autograd
registration: test_schema, test_autograd_registration, test_faketensor and
test_aot_dispatch_dynamic. test_gpu.py runs opcheck on the real kernels."""

import contextlib
import warnings

import pytest

torch = pytest.importorskip("torch")

import loom.torch as lt  # noqa: E402
from stand_in import StandInComm  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


WORLD = 2
COMM = StandInComm(WORLD)
HANDLE = lt.register_communicator(COMM)


def _dense(b, b_layout):
    return b if b_layout == "kn" else b.t()


def _sum_over_ranks(x):
    """The stand-in's reduction: W ranks holding x, summed in fp32 with one rounding."""
    return (x.float() * WORLD).to(x.dtype)


def _attention(q, k, v, causal=False, scale=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
               max_seqlen_k=0, partial=False):
    """Attention on [B, S, H, D] in fp32 (bottom-right causal mask): (out, lse [B, H, S])."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    s = qf @ kf.transpose(-1, -2) * (scale if scale is not None else d ** -0.5)
    if causal:
        mask = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = (torch.softmax(s, dim=-1).nan_to_num() @ vf).transpose(1, 2)
    return out.to(FP32 if partial else q.dtype).contiguous(), lse.contiguous()


def _attention_merge(partial_out, partial_lse, out_dtype=None):
    lse = torch.logsumexp(partial_lse, dim=0)  # [B, H, S]
    weights = (partial_lse - lse).exp().transpose(-1, -2).unsqueeze(-1)  # [n, B, S, H, 1]
    return (weights * partial_out).sum(0).to(out_dtype or FP32), lse


def _ring_attention(comm, q, k, v, causal=False, scale=None):
    """The stand-in's W ranks all hold this chunk: every key appears W times, which leaves the
    output as is and adds log W to the LSE (non-causal cases only)."""
    out, lse = _attention(q, k, v, causal, scale)
    return out, lse + torch.log(torch.tensor(float(WORLD)))


def _swiglu(x):
    """silu(gate) * up over the last dimension's gate / up columns interleaved by 8."""
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 16, 2, 8)
    return (torch.nn.functional.silu(pairs[..., 0, :]) * pairs[..., 1, :]).reshape(*x.shape[:-1], x.shape[-1] // 2)


def _grouped_gemm(a, b, offsets=None, counts=None, out_dtype=None, b_layout="nk", activation="none"):
    """Every expert's rows times its weight's transpose ([E, N, K]) or its weight ([E, K, N]) in
    fp32, then the activation; rows outside every expert zero."""
    weights = b.float() if b_layout == "kn" else b.float().transpose(1, 2)  # [E, K, N]
    e, n = weights.shape[0], weights.shape[2]
    dtype = out_dtype or a.dtype
    act = _swiglu if activation == "swiglu" else (lambda x: x)
    n_out = n // 2 if activation == "swiglu" else n
    if counts is not None:
        d = torch.zeros(e, a.shape[1], n_out, dtype=FP32)
        for i in range(e):
            c = int(counts[i])
            d[i, :c] = act(a[i, :c].float() @ weights[i])
        return d.to(dtype)
    d = torch.zeros(a.shape[0], n_out, dtype=FP32)
    for i in range(e):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        d[lo:hi] = act(a[lo:hi].float() @ weights[i])
    return d.to(dtype)


REFERENCE_KERNELS = {
    "grouped_gemm": _grouped_gemm,
    "attention": _attention,
    "ring_attention": _ring_attention,
    "attention_merge": _attention_merge,
    "gemm": lambda a, b, b_layout="kn", out_dtype=None: (a.float() @ _dense(b, b_layout).float()).to(
        out_dtype or a.dtype),
    "all_gather": lambda comm, x: torch.cat([x] * WORLD),
    "reduce_scatter": lambda comm, x: _sum_over_ranks(x).chunk(WORLD)[0].clone(),
    "all_reduce": lambda comm, x: _sum_over_ranks(x),
    "ag_gemm": lambda comm, a, b, b_layout="kn": (torch.cat([a] * WORLD).float() @ _dense(b, b_layout).float()).to(
        a.dtype),
    "gemm_rs": lambda comm, a, b, b_layout="kn": _sum_over_ranks(a.float() @ _dense(b, b_layout).float()).to(
        a.dtype).chunk(WORLD)[0].clone(),
    "gemm_ar": lambda comm, a, b, b_layout="kn": _sum_over_ranks(a.float() @ _dense(b, b_layout).float()).to(a.dtype),
}


def _like_a_kernel(reference):
    """Computed without autograd, as loom's kernels write their outputs."""
    def kernel(*args):
        with torch.no_grad():
            return reference(*args)
    return kernel


@contextlib.contextmanager
def reference_kernels(kernels=None):
    """The reference kernels (default: REFERENCE_KERNELS) in place of loom's CPU ones; loom's come
    back when the library fragment is destroyed."""
    fragment = torch.library.Library("loom", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is the point
        for name, reference in (REFERENCE_KERNELS if kernels is None else kernels).items():
            fragment.impl(name, _like_a_kernel(reference), "CPU", allow_override=True)
    try:
        yield
    finally:
        fragment._destroy()


@pytest.fixture
def reference_cpu_kernels():
    with reference_kernels():
        yield


def rand(*shape, dtype=BF16, requires_grad=False):
    return torch.randn(shape, dtype=FP32).to(dtype).requires_grad_(requires_grad)


def cases():
    """(op name, args) for every op: several shapes, dtypes and layouts, with and without grad."""
    w = WORLD
    for grad in (False, True):
        for dtype in (BF16, FP16):
            yield "gemm", (rand(64, 32, dtype=dtype, requires_grad=grad), rand(32, 16, dtype=dtype), "kn", None)
            yield "gemm", (rand(64, 32, dtype=dtype), rand(16, 32, dtype=dtype, requires_grad=grad), "nk", FP32)
            for layout in ("kn", "nk"):
                b = rand(48, 32, dtype=dtype) if layout == "nk" else rand(32, 48, dtype=dtype)
                yield "ag_gemm", (HANDLE, rand(16, 32, dtype=dtype, requires_grad=grad), b, layout)
                yield "gemm_rs", (HANDLE, rand(16 * w, 32, dtype=dtype, requires_grad=grad), b, layout)
                yield "gemm_ar", (HANDLE, rand(24, 32, dtype=dtype, requires_grad=grad), b, layout)
            for causal in (False, True):
                for partial in (False, True):
                    yield "attention", (rand(2, 5, 4, 64, dtype=dtype, requires_grad=grad), rand(2, 7, 2, 64, dtype=dtype),
                                        rand(2, 7, 2, 64, dtype=dtype), causal, None, None, None, 0, 0, partial)
            yield "attention_merge", (rand(3, 2, 5, 4, 64, dtype=FP32, requires_grad=grad), rand(3, 2, 4, 5, dtype=FP32),
                                      dtype)
            yield "ring_attention", (HANDLE, rand(2, 6, 4, 64, dtype=dtype, requires_grad=grad), rand(2, 6, 2, 64, dtype=dtype),
                                     rand(2, 6, 2, 64, dtype=dtype), False, None)
            offsets = torch.tensor([0, 5, 5, 12], dtype=torch.int32)  # an empty expert
            yield "grouped_gemm", (rand(12, 32, dtype=dtype, requires_grad=grad), rand(3, 16, 32, dtype=dtype), offsets,
                                   None, None)
            yield "grouped_gemm", (rand(3, 8, 32, dtype=dtype), rand(3, 16, 32, dtype=dtype, requires_grad=grad), None,
                                   torch.tensor([8, 0, 3], dtype=torch.int32), FP32)
            yield "grouped_gemm", (rand(12, 32, dtype=dtype), rand(3, 32, 16, dtype=dtype), offsets, None, None, "kn")
            yield "grouped_gemm", (rand(12, 32, dtype=dtype), rand(3, 32, 32, dtype=dtype), offsets, None, None, "nk",
                                   "swiglu")
        for dtype in (BF16, FP16, FP32):
            for shape in ((8 * w,), (4 * w, 3, 5)):
                for op in ("all_gather", "reduce_scatter", "all_reduce"):
                    yield op, (HANDLE, rand(*shape, dtype=dtype, requires_grad=grad))


CASES = list(cases())


def case_id(case):
    name, args = case
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    shapes = "x".join("-".join(map(str, t.shape)) for t in tensors)
    grad = "-grad" if any(t.requires_grad for t in tensors) else ""
    extra = "-".join(str(a) for a in args if isinstance(a, str))
    return f"{name}-{shapes}-{tensors[0].dtype}{'-' + extra if extra else ''}{grad}"


def test_every_op_is_checked():
    assert {name for name, _ in CASES} == set(lt.OPS)
    assert set(REFERENCE_KERNELS) == set(lt.OPS)


@pytest.mark.usefixtures("reference_cpu_kernels")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_opcheck(case):
    name, args = case
    torch.library.opcheck(getattr(torch.ops.loom, name).default, args)


@pytest.mark.usefixtures("reference_cpu_kernels")
def test_outputs_do_not_require_grad():
    """Non-differentiable: an input that requires grad gives an output without autograd history."""
    out = lt.all_reduce(COMM, rand(4 * WORLD, requires_grad=True))
    assert not out.requires_grad and out.grad_fn is None


def test_loom_cpu_kernels_are_back_after_the_references():
    with reference_kernels():
        assert lt.all_reduce(COMM, torch.ones(4)).tolist() == [2.0] * 4
    with pytest.raises(ValueError, match="x is on cpu but the communicator uses cuda:0"):
        lt.all_reduce(COMM, torch.zeros(4))


# ---- the MoE operators (lt.MOE_OPS) ----------------------------------------------------------------

LOCAL_EXPERTS = 4  # per rank of the stand-in: E = LOCAL_EXPERTS * WORLD


def _moe_topk(logits, top_k, scoring="softmax", renormalize=False):
    """The top_k largest logits' ids and their softmax over all E (or sigmoid), renormalized on request."""
    v = logits.float()
    ids = v.topk(top_k, dim=1).indices
    scores = torch.softmax(v, dim=1) if scoring == "softmax" else torch.sigmoid(v)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=1, keepdim=True)
    return ids.to(torch.int32), weights.contiguous()


def _moe_layer(comm, x, topk_ids, topk_weights, gate_up, down, num_experts, max_tokens, capacity=0, overflow="error"):
    """The stand-in's W ranks all hold this rank's experts' weights: expert e computes with local
    expert e % (E/W)'s. Per slot, hidden = silu(x gate^T) * (x up^T) and the expert's output rounded
    to x's dtype; out = the fp32 sum over the slots of w * output, rounded once; -1 slots add nothing."""
    local = gate_up.shape[0]
    out = torch.zeros(x.shape, dtype=FP32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            hidden = _swiglu(x[t:t + 1].float() @ gate_up[e % local].float().t()).to(x.dtype)
            y = (hidden.float() @ down[e % local].float().t()).to(x.dtype)
            out[t] += (1.0 if topk_weights is None else topk_weights[t, j]) * y[0].float()
    return out.to(x.dtype)


MOE_REFERENCE_KERNELS = {"moe_topk": _moe_topk, "moe_layer": _moe_layer}


def moe_cases():
    """(op name, args) for both MoE operators: dtypes, scorings, weighted or not, a token-less rank,
    with and without grad."""
    g = torch.Generator().manual_seed(7)
    experts = LOCAL_EXPERTS * WORLD
    for grad in (False, True):
        for dtype in (BF16, FP16, FP32):
            for scoring, renormalize in (("softmax", False), ("sigmoid", True)):
                yield "moe_topk", (rand(12, 16, dtype=dtype, requires_grad=grad), 4, scoring, renormalize)
        for dtype in (BF16, FP16):
            for tokens, weighted in ((12, True), (12, False), (0, True)):
                ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)]).to(torch.int32) \
                    if tokens else torch.empty(0, 2, dtype=torch.int32)
                if tokens:
                    ids[3, 1] = -1  # an unused slot
                weights = torch.rand(tokens, 2, generator=g) if weighted else None
                yield "moe_layer", (HANDLE, rand(tokens, 64, dtype=dtype, requires_grad=grad), ids, weights,
                                    rand(LOCAL_EXPERTS, 32, 64, dtype=dtype) * 0.125,
                                    rand(LOCAL_EXPERTS, 64, 16, dtype=dtype) * 0.25, experts, 16, 0, "error")


MOE_CASES = list(moe_cases())


def moe_case_id(case):
    name, args = case
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    grad = "-grad" if any(t.requires_grad for t in tensors) else ""
    extra = "-".join(str(a) for a in args if isinstance(a, (str, bool)))
    weighted = "" if name != "moe_layer" else ("-weighted" if args[3] is not None else "-unweighted")
    return f"{name}-{'x'.join('-'.join(map(str, t.shape)) for t in tensors[:1])}-{tensors[0].dtype}-{extra}{weighted}{grad}"


def test_every_moe_op_is_checked():
    assert {name for name, _ in MOE_CASES} == set(lt.MOE_OPS) == set(MOE_REFERENCE_KERNELS)
    assert not set(lt.MOE_OPS) & set(lt.OPS)


@pytest.mark.parametrize("case", MOE_CASES, ids=moe_case_id)
def test_moe_opcheck(case):
    name, args = case
    with reference_kernels(MOE_REFERENCE_KERNELS):
        torch.library.opcheck(getattr(torch.ops.loom, name).default, args)


def test_moe_outputs_do_not_require_grad():
    with reference_kernels(MOE_REFERENCE_KERNELS):
        ids, weights = lt.moe_topk(rand(8, 16, requires_grad=True), 2)
        assert not weights.requires_grad and weights.grad_fn is None and ids.dtype == torch.int32
