"""The attention ops through Python on one GPU (no communicator): loom.attention (DLPack, explicit
outputs) and torch.ops.loom.attention against an fp32 torch reference, packed sequences, the
partial mode with attention_merge, CUDA-graph capture, and bad offsets reported without writes.
Run directly as a job of one: `WORLD_SIZE=1 python3 -m pytest tests/python/test_gpu_attention.py -m gpu`
(conftest.py skips GPU tests outside a torchrun job; scripts/device/attention_suite.sh pytest)."""

import math

import pytest

torch = pytest.importorskip("torch")

import loom  # noqa: E402
import loom.torch as lt  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the attention engine needs an sm_90 GPU", allow_module_level=True)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOL = {BF16: 1e-2, FP16: 4e-3}


def reference(q, k, v, causal, scale=None):
    """fp32 attention on [B, S, H, D] (bottom-right causal mask): (out [B, S, H, D], lse [B, H, S])."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    s = qf @ kf.transpose(-1, -2) * (scale if scale is not None else d ** -0.5)
    if causal:
        mask = torch.arange(sk, device=q.device)[None, :] > torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = (torch.softmax(s, dim=-1).nan_to_num() @ vf).transpose(1, 2)
    return out, lse


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def inputs(b, sq, sk, h, hkv, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=FP32).to(dtype)  # noqa: E731
    return r(b, sq, h, d), r(b, sk, hkv, d), r(b, sk, hkv, d)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 333, 333, 4, 4), (1, 200, 700, 8, 2), (1, 700, 200, 4, 1)], ids=str)
def test_attention_matches_fp32(dtype, d, causal, shape):
    b, sq, sk, h, hkv = shape
    q, k, v = inputs(b, sq, sk, h, hkv, d, dtype, seed=sq * 7 + d + causal)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    loom.attention(q, k, v, out, lse=lse, causal=causal)
    ref, ref_lse = reference(q, k, v, causal)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~finite), "rows without keys must have LSE -inf"
    assert torch.allclose(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)
    out2, lse2 = lt.attention(q, k, v, causal=causal)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 333, 333, 4, 4), (1, 200, 700, 8, 2), (1, 700, 200, 4, 1)], ids=str)
def test_three_consumer_tile(causal, shape):
    """hd64 with block_m=192 (three consumer warpgroups): the reference's output and LSE; hd128 has no such tile."""
    b, sq, sk, h, hkv = shape
    q, k, v = inputs(b, sq, sk, h, hkv, 64, BF16, seed=sq * 11 + causal)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    loom.attention(q, k, v, out, lse=lse, causal=causal, block_m=192)
    ref, ref_lse = reference(q, k, v, causal)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[BF16]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~finite)
    assert torch.allclose(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)
    q128, k128, v128 = (torch.cat([t, t], dim=-1) for t in (q, k, v))
    with pytest.raises(loom.InvalidArgument, match="block_m 192"):
        loom.attention(q128, k128, v128, torch.empty_like(q128), causal=causal, block_m=192)


def test_packed_sequences_and_bad_offsets():
    lens_q, lens_k = [0, 1, 130, 513, 64], [5, 0, 200, 513, 300]
    h, hkv, d = 4, 2, 128
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q, k, v = inputs(1, sum(lens_q), sum(lens_k), h, hkv, d, BF16, seed=5)
    q, k, v = q[0], k[0], v[0]
    for causal in (False, True):
        out, lse = lt.attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
        for i in range(len(lens_q)):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            if lens_q[i] == 0:
                continue
            ref, ref_lse = reference(q[None, qs], k[None, ks], v[None, ks], causal)
            if lens_k[i] == 0:
                assert torch.equal(out[qs], torch.zeros_like(out[qs])) and torch.isinf(lse[:, qs]).all()
                continue
            assert rel_err(out[None, qs], ref) < TOL[BF16], f"sequence {i}"
            finite = torch.isfinite(ref_lse[0])
            assert torch.allclose(lse[:, qs][finite], ref_lse[0][finite], rtol=1e-3, atol=1e-3)
    bad = cu_q.clone()
    bad[2] = bad[3] + 1  # decreasing at sequence 2
    out = torch.full_like(q, float("nan"))
    loom.attention(q, k, v, out, cu_seqlens_q=bad, cu_seqlens_k=cu_k, max_seqlen_q=600, max_seqlen_k=600)
    with pytest.raises(loom.InvalidArgument, match="invalid device-resident arguments"):
        loom.synchronize_standalone(like=q)
    assert torch.isnan(out).all(), "bad offsets must leave out untouched"


def test_partial_and_merge_equal_one_call():
    q, k, v = inputs(2, 300, 1000, 4, 2, 128, BF16, seed=9)
    full, full_lse = lt.attention(q, k, v)
    parts, lses = [], []
    for ks in (slice(0, 400), slice(400, 1000)):
        o, l = lt.attention(q, k[:, ks].contiguous(), v[:, ks].contiguous(), partial=True)
        assert o.dtype == FP32
        parts.append(o)
        lses.append(l)
    merged, merged_lse = lt.attention_merge(torch.stack(parts), torch.stack(lses), out_dtype=BF16)
    ref, ref_lse = reference(q, k, v, False)
    assert rel_err(merged, ref) < TOL[BF16]
    assert torch.allclose(merged_lse, ref_lse, rtol=1e-4, atol=1e-4)
    assert rel_err(merged, full.float()) < TOL[BF16]


def test_cuda_graph_capture_and_compile():
    q, k, v = inputs(2, 512, 512, 8, 8, 128, BF16, seed=11)
    eager, _ = lt.attention(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured, _ = lt.attention(q, k, v, causal=True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    compiled = torch.compile(lambda a, b, c: lt.attention(a, b, c, causal=True)[0], fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)
