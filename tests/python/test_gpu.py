"""GPU suite: every rank of `torchrun --nproc-per-node 2 -m pytest tests/python -m gpu` runs it
(scripts/device/python_suite.sh); skipped without GPUs.

Every rank runs the same tests in the same order (loom's calls are collective). Inputs are fresh
random numbers each run: rank 0 draws a seed and broadcasts it, and each rank's inputs come from
(seed, test, rank), so every rank can compute every other rank's inputs and the reference locally.
Outputs are pre-filled with NaN (explicit outputs, staging buffers, and the blocks torch's
allocator will hand out next), so an op that writes nothing cannot pass. Collectives must be
bit-exact (loom sums in fp32 in rank order with one rounding, which the reference does too); GEMMs
are compared with an fp32 reference by relative Frobenius error.
"""

import json
import os
import random
import statistics
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import loom  # noqa: E402
import loom.torch as lt  # noqa: E402
from gpu_job import (GEMM_TOLERANCE, check_ag_gemm_keeps_the_gathered_a, check_tp_op, job_seed, poison, rand,  # noqa: E402
                     rel_err, shared_gpu, start_job)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAN = float("nan")


# ---- job-wide fixtures ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def comm():
    c = start_job()
    if c.num_nodes > 1:
        pytest.skip("the single-node suite (collectives stay within a node): test_gpu_multinode.py runs across nodes")
    yield c
    torch.cuda.synchronize()
    # Not closed: tensors kept by failed tests' tracebacks may still hold symmetric buffers, and a
    # close on some ranks only would wait for the others. The process exits next (the extension
    # skips the teardown barrier then); closing is tested on its own communicator.
    dist.barrier()


@pytest.fixture(scope="module")
def seed(comm):
    return job_seed()


def nan_like(t):
    return torch.full_like(t, NAN)


def rank_sum(parts, dtype):
    """loom's reduction: fp32 in rank order, one rounding."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(dtype)


# ---- communicator ------------------------------------------------------------------------------

def test_communicator_properties(comm):
    assert comm.rank == int(os.environ["RANK"])
    assert comm.world_size == int(os.environ["WORLD_SIZE"])
    assert comm.local_rank == int(os.environ["LOCAL_RANK"])
    assert comm.local_world_size == int(os.environ["LOCAL_WORLD_SIZE"])
    assert comm.device == torch.cuda.current_device()
    assert comm.ranks_per_gpu == int(os.environ.get("LOOM_RANKS_PER_GPU", "1"))
    assert 1 <= comm.ranks_on_gpu <= comm.ranks_per_gpu
    assert (comm.node, comm.num_nodes) == (0, 1)
    assert comm.sm_count > 0
    assert comm.health() is None
    comm.barrier()
    comm.synchronize()


def test_from_process_group_and_close(comm):
    with loom.Communicator.from_process_group(heap_bytes=64 << 20) as second:
        assert (second.rank, second.world_size) == (comm.rank, comm.world_size)
        assert second.device == comm.device
        x = lt.empty(second, (1024,), BF16)
        x.fill_(float(second.rank + 1))
        loom.all_reduce(second, x)
        second.synchronize()
        assert torch.all(x == sum(range(1, second.world_size + 1))).item()
        with pytest.raises(loom.InvalidArgument, match="still referenced"):
            second.close()
        del x
    assert second.closed
    with pytest.raises(loom.Aborted, match="closed"):
        second.barrier()


def test_symmetric_empty_is_a_dlpack_tensor(comm):
    before = comm._c.live_buffers
    t = lt.empty(comm, (4, 1000), FP16)
    assert (t.shape, t.dtype, t.device) == ((4, 1000), FP16, torch.device("cuda", comm.device))
    assert comm.is_symmetric(t.data_ptr(), t.numel() * t.element_size())
    assert not comm.is_symmetric(torch.empty(16, device="cuda").data_ptr(), 64)
    assert comm._c.live_buffers == before + 1
    view = t[1:]  # a view keeps the buffer alive too
    del t
    assert comm._c.live_buffers == before + 1
    del view
    assert comm._c.live_buffers == before


# ---- collectives, explicit symmetric buffers ----------------------------------------------------

SHAPES = [(1,), (1000, 3), (4096, 512), (3, 5, 7)]


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_all_gather(comm, seed, dtype, shape):
    w = comm.world_size
    parts = [rand(seed, f"ag{shape}", r, shape, dtype) for r in range(w)]
    recv = lt.empty(comm, (w * shape[0], *shape[1:]), dtype)
    recv.fill_(NAN)
    loom.all_gather(comm, parts[comm.rank], recv)
    comm.synchronize()
    assert torch.equal(recv, torch.cat(parts))


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reduce_scatter(comm, seed, dtype, shape):
    w = comm.world_size
    full = (w * shape[0], *shape[1:])
    parts = [rand(seed, f"rs{shape}", r, full, dtype) for r in range(w)]
    send = lt.empty(comm, full, dtype)
    send.copy_(parts[comm.rank])
    recv = torch.full(shape, NAN, dtype=dtype, device="cuda")
    loom.reduce_scatter(comm, send, recv)
    comm.synchronize()
    assert torch.equal(recv, rank_sum(parts, dtype).chunk(w)[comm.rank])


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "inplace"])
def test_all_reduce(comm, seed, dtype, shape, in_place):
    parts = [rand(seed, f"ar{shape}{in_place}", r, shape, dtype) for r in range(comm.world_size)]
    send = lt.empty(comm, shape, dtype)
    send.copy_(parts[comm.rank])
    recv = send if in_place else lt.empty(comm, shape, dtype).fill_(NAN)
    loom.all_reduce(comm, send, None if in_place else recv)
    comm.synchronize()
    assert torch.equal(recv, rank_sum(parts, dtype))


# ---- GEMM ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("in_dtype,out_dtype", [(BF16, BF16), (FP16, FP16), (BF16, FP32), (FP16, FP32)])
@pytest.mark.parametrize("mnk", [(1000, 256, 512), (128, 1024, 64), (4096, 2048, 1024)], ids=str)
def test_gemm(comm, seed, layout, in_dtype, out_dtype, mnk):
    m, n, k = mnk
    a = rand(seed, f"gemm{mnk}", comm.rank, (m, k), in_dtype)
    b = rand(seed, f"gemmb{mnk}", comm.rank, (k, n) if layout == "kn" else (n, k), in_dtype)
    ref = a.float() @ (b.float() if layout == "kn" else b.float().t())
    out = torch.full((m, n), NAN, dtype=out_dtype, device="cuda")
    loom.gemm(a, b, out, b_layout=layout)
    torch.cuda.synchronize()
    assert rel_err(out, ref) < GEMM_TOLERANCE[out_dtype]
    poison(comm, ((m, n), out_dtype))
    out2 = lt.gemm(a, b, b_layout=layout, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert out2.dtype == out_dtype and rel_err(out2, ref) < GEMM_TOLERANCE[out_dtype]


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_grouped_gemm(comm, seed, b_layout, dtype):
    """4 experts (one empty) over contiguous rows, b [E, N, K] or [E, K, N], against fp32; rows
    outside every expert keep their NaN (loom.grouped_gemm) or are zero (torch op)."""
    offsets = torch.tensor([8, 200, 200, 333, 500], dtype=torch.int32, device="cuda")  # rows 0..7 and 500.. unowned
    k, n = 192, 320
    a = rand(seed, f"grouped-a-{b_layout}", comm.rank, (520, k), dtype)
    b = rand(seed, f"grouped-b-{b_layout}", comm.rank, (4, n, k) if b_layout == "nk" else (4, k, n), dtype, scale=k ** -0.5)
    weights = b.float() if b_layout == "kn" else b.float().transpose(1, 2)
    ref = torch.zeros(520, n, device="cuda")
    bounds = offsets.tolist()
    for e in range(4):
        ref[bounds[e]:bounds[e + 1]] = a[bounds[e]:bounds[e + 1]].float() @ weights[e]
    out = torch.full((520, n), NAN, dtype=dtype, device="cuda")
    workspace = torch.empty(loom.grouped_gemm_workspace_bytes(520, 4) // 4 + 1, dtype=torch.int32, device="cuda")
    loom.grouped_gemm(a, b, out, workspace=workspace, offsets=offsets, b_layout=b_layout)
    torch.cuda.synchronize()
    owned = slice(bounds[0], bounds[-1])
    assert rel_err(out[owned], ref[owned]) < GEMM_TOLERANCE[dtype]
    assert out[:bounds[0]].isnan().all() and out[bounds[-1]:].isnan().all()
    d = lt.grouped_gemm(a, b, offsets=offsets, b_layout=b_layout)
    torch.cuda.synchronize()
    assert rel_err(d, ref) < GEMM_TOLERANCE[dtype]

    # SwiGLU over gate / up weights of I = n / 2 outputs: d = silu(a gate^T) * (a up^T).
    gate, up = (w.narrow(1 if b_layout == "nk" else 2, 0, n // 2) for w in (b, b.flip(0)))
    fused = lt.swiglu_weights(gate, up, b_layout)
    dense = (lambda w: w.float()) if b_layout == "kn" else (lambda w: w.float().transpose(1, 2))
    want = torch.zeros(520, n // 2, device="cuda")
    for e in range(4):
        rows = a[bounds[e]:bounds[e + 1]].float()
        want[bounds[e]:bounds[e + 1]] = torch.nn.functional.silu(rows @ dense(gate)[e]) * (rows @ dense(up)[e])
    act = lt.grouped_gemm(a, fused, offsets=offsets, b_layout=b_layout, activation="swiglu")
    torch.cuda.synchronize()
    assert act.shape == (520, n // 2) and rel_err(act, want) < GEMM_TOLERANCE[dtype]


# ---- tensor-parallel GEMMs --------------------------------------------------------------------

TP_CASES = [(256, 512, 1024), (2048, 1024, 512), (1000, 256, 128)]


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("mnk", TP_CASES, ids=str)
def test_tp_ops(comm, seed, op, layout, dtype, mnk):
    check_tp_op(comm, seed, op, *mnk, layout, dtype)


def test_ag_gemm_keeps_the_gathered_a(comm, seed):
    check_ag_gemm_keeps_the_gathered_a(comm, seed, 1024, 256, 512)


# ---- collectives through loom.torch (staging and zero-copy paths) -------------------------------

@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("symmetric_input", [False, True], ids=["plain", "symmetric"])
def test_torch_collectives(comm, seed, dtype, symmetric_input):
    w = comm.world_size
    shape = (64 * w, 96)
    parts = [rand(seed, f"tc{dtype}{symmetric_input}", r, shape, dtype) for r in range(w)]
    x = parts[comm.rank]
    if symmetric_input:
        x = lt.empty(comm, shape, dtype)
        x.copy_(parts[comm.rank])
    for _ in range(3):  # steady state: staging buffers reused, results still fresh tensors
        poison(comm, ((w * shape[0], shape[1]), dtype), (shape, dtype), ((shape[0] // w, shape[1]), dtype))
        gathered = lt.all_gather(comm, x)
        scattered = lt.reduce_scatter(comm, x)
        reduced = lt.all_reduce(comm, x)
        comm.synchronize()
        assert torch.equal(gathered, torch.cat(parts))
        assert torch.equal(scattered, rank_sum(parts, dtype).chunk(w)[comm.rank])
        assert torch.equal(reduced, rank_sum(parts, dtype))
        assert torch.equal(x, parts[comm.rank]), "the input was modified"
    assert reduced.data_ptr() != comm._staging.buffer("all_reduce.buffer", dtype).data_ptr()


# ---- torch.library.opcheck on the real kernels -----------------------------------------------------

def opcheck_args(comm, seed, op, requires_grad):
    """Arguments of `op` for opcheck: the same shapes on every rank (opcheck's runs are collective)."""
    w, h = comm.world_size, lt.handle(comm)
    a = rand(seed, f"opcheck-{op}", comm.rank, (128 if op == "ag_gemm" else 128 * w, 64)).requires_grad_(requires_grad)
    b = rand(seed, f"opcheck-{op}-b", comm.rank, (96, 64), scale=0.125)
    if op == "gemm":
        return (a, b, "nk", FP32)
    if op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        return (h, a, b, "nk")
    if op == "attention":
        q = rand(seed, "opcheck-q", comm.rank, (2, 200, 4, 64)).requires_grad_(requires_grad)
        kv = [rand(seed, f"opcheck-{x}", comm.rank, (2, 300, 2, 64)) for x in "kv"]
        return (q, *kv, True, None, None, None, 0, 0, False)
    if op == "ring_attention":
        qkv = [rand(seed, f"opcheck-ring-{x}", comm.rank, (1, 256, 4, 64)) for x in "qkv"]
        return (h, qkv[0].requires_grad_(requires_grad), qkv[1], qkv[2], False, None)
    if op == "grouped_gemm":  # 3 experts (one empty) of a contiguous 200 x 64 A, b [3, 96, 64]
        offsets = torch.tensor([0, 120, 120, 200], dtype=torch.int32, device=a.device)
        experts = rand(seed, "opcheck-experts", comm.rank, (3, 96, 64), scale=0.125)
        rows = rand(seed, "opcheck-grouped-a", comm.rank, (200, 64)).requires_grad_(requires_grad)
        return (rows, experts, offsets, None, None)
    if op == "attention_merge":
        parts = rand(seed, "opcheck-parts", comm.rank, (2, 2, 100, 4, 64), FP32).requires_grad_(requires_grad)
        return (parts, rand(seed, "opcheck-lse", comm.rank, (2, 2, 4, 100), FP32), BF16)
    return (h, rand(seed, f"opcheck-{op}", comm.rank, (16 * w, 24)).requires_grad_(requires_grad))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain", "grad"])
@pytest.mark.parametrize("op", lt.OPS)
def test_opcheck(comm, seed, op, requires_grad):
    """Schema, autograd registration, fake function against the kernel, and torch.compile
    (aot_dispatch_dynamic), with loom's kernels."""
    torch.library.opcheck(getattr(torch.ops.loom, op).default, opcheck_args(comm, seed, op, requires_grad))
    comm.synchronize()


# ---- CUDA graphs ----------------------------------------------------------------------------------

def test_cuda_graph_replayed_100_times_equals_eager(comm, seed):
    """ag_gemm -> gemm_rs -> all_reduce captured once, replayed 100 times: every replay equals the
    eager result (loom's epochs advance on the device, without host work)."""
    w = comm.world_size
    m, hidden, ffn = 1024, 512, 1024

    def block(x, w1, w2):
        h = lt.ag_gemm(comm, x, w1, b_layout="nk")  # [m, ffn / w]
        y = lt.gemm_rs(comm, h, w2, b_layout="nk")  # [m / w, hidden]
        return lt.all_reduce(comm, y)

    w1 = rand(seed, "graph-w1", comm.rank, (ffn // w, hidden), scale=hidden ** -0.5)
    w2 = rand(seed, "graph-w2", comm.rank, (hidden, ffn // w), scale=ffn ** -0.5)
    x0 = rand(seed, "graph-x0", comm.rank, (m // w, hidden))
    static_x = x0.clone()

    # Warm-up (allocates the staging buffers and loom's workspace), on a side stream as torch
    # recommends before capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            block(static_x, w1, w2)
    torch.cuda.current_stream().wait_stream(side)
    comm.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x, w1, w2)
    comm.synchronize()

    expected = block(x0, w1, w2)
    comm.synchronize()
    for i in range(100):
        if i in (30, 70):  # new inputs through the static buffer; eager on the same inputs
            fresh = rand(seed, f"graph-x{i}", comm.rank, (m // w, hidden))
            static_x.copy_(fresh)
            expected = block(fresh, w1, w2)
        static_out.fill_(NAN)
        graph.replay()
        assert torch.equal(static_out, expected), f"replay {i} differs from eager"
    comm.synchronize()
    assert comm.health() is None


def test_capture_before_warm_up_is_refused(comm):
    # No other test all-gathers fp16 through loom.torch: that staging buffer does not exist yet.
    assert comm._staging.buffer("all_gather.recv", FP16) is None
    x = torch.ones((8, 8, 8, 3), dtype=FP16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(loom.InvalidArgument, match="run the op once eagerly"):
        with torch.cuda.graph(graph):
            lt.all_gather(comm, x)
    comm.synchronize()


def test_captured_staging_buffer_outlives_its_growth(comm, seed):
    """A graph captured on a small staging buffer still replays correctly after a larger eager
    call replaced that buffer: the captured one is retired, not freed."""
    w = comm.world_size
    parts = [rand(seed, "retire", r, (16, 64), FP32) for r in range(w)]
    x = parts[comm.rank].clone()
    lt.all_reduce(comm, x)  # warm-up at this size
    comm.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lt.all_reduce(comm, x)
    comm.synchronize()
    held = comm._staging.held_bytes()
    big = lt.all_reduce(comm, torch.ones((4096, 64), dtype=FP32, device="cuda"))  # grows the buffer
    comm.synchronize()
    assert torch.all(big == w).item()
    assert comm._staging.held_bytes() > held
    out.fill_(NAN)
    graph.replay()
    comm.synchronize()
    assert torch.equal(out, rank_sum(parts, FP32))


# ---- the staging cache's budget ------------------------------------------------------------------

def test_staging_stays_bounded_over_100_batch_sizes(comm, seed):
    """Serving with 100 different batch sizes (in a shuffled order, the same on every rank): the
    staging buffers hold at most the largest request of each role (x2 for the geometric growth),
    and every result is still right."""
    w, hidden = comm.world_size, 256
    fresh = loom.Communicator.from_process_group(heap_bytes=256 << 20)
    try:
        sizes = list(range(1, 101))
        random.Random(seed).shuffle(sizes)
        weight = rand(seed, "budget-w", comm.rank, (hidden, hidden), scale=hidden ** -0.5)
        for step, batch in enumerate(sizes):
            x = rand(seed, f"budget{batch}", comm.rank, (batch * w, hidden))
            reduced = lt.all_reduce(fresh, x)
            gathered = lt.all_gather(fresh, x)
            scattered = lt.reduce_scatter(fresh, x)
            projected = lt.gemm_ar(fresh, x, weight)
            if step % 10 == 0:  # a sample of the results, against the explicit API
                fresh.synchronize()
                parts = [rand(seed, f"budget{batch}", r, (batch * w, hidden)) for r in range(w)]
                assert torch.equal(reduced, rank_sum(parts, BF16))
                assert torch.equal(gathered, torch.cat(parts))
                assert torch.equal(scattered, rank_sum(parts, BF16).chunk(w)[comm.rank])
                assert projected.shape == (batch * w, hidden)
        fresh.synchronize()
        largest = 100 * w * hidden * 2  # bytes of the largest x (bf16)
        # all_reduce.buffer and reduce_scatter.send: largest x; all_gather.recv: w x; gemm_ar.out: largest x.
        bound = 2 * largest * (3 + w)
        assert fresh._staging.held_bytes() <= bound, (fresh._staging.held_bytes(), bound)
        assert fresh._staging.allocations <= 4 * 8, fresh._staging.allocations  # O(log) growths per role
    finally:
        fresh.close()


def test_staging_budget_refuses_a_request_over_it(comm):
    fresh = loom.Communicator.from_process_group(heap_bytes=64 << 20)
    try:
        lt.set_staging_budget(fresh, 1 << 20)
        ok = lt.all_reduce(fresh, torch.ones((1 << 18,), dtype=FP32, device="cuda"))  # exactly 1 MiB
        with pytest.raises(loom.InvalidArgument, match="staging budget is 1048576 bytes"):
            lt.all_reduce(fresh, torch.ones((1 << 18) + 1, dtype=FP32, device="cuda"))
        fresh.synchronize()
        assert torch.all(ok == fresh.world_size).item()
        del ok
    finally:
        fresh.close()


# ---- process groups and stream objects ---------------------------------------------------------

def test_ops_take_a_process_group(comm, seed):
    """A torch ProcessGroup where a communicator goes: one cached communicator per group."""
    group = dist.group.WORLD
    cached = loom.Communicator.for_process_group(group, heap_bytes=64 << 20)
    assert loom.Communicator.for_process_group(group) is cached
    w = comm.world_size
    parts = [rand(seed, "pg", r, (8 * w, 32)) for r in range(w)]
    reduced = lt.all_reduce(group, parts[comm.rank])
    sym = lt.empty(group, (8 * w, 32), BF16)
    sym.copy_(parts[comm.rank])
    loom.all_reduce(group, sym)
    cached.synchronize()
    assert torch.equal(reduced, rank_sum(parts, BF16))
    assert torch.equal(sym, rank_sum(parts, BF16))
    del sym


def test_stream_objects(comm, seed):
    """torch.cuda.Stream, any __cuda_stream__ object and ints are all streams."""
    class ProtocolStream:
        def __init__(self, stream):
            self.stream = stream

        def __cuda_stream__(self):
            return (0, self.stream.cuda_stream)

    side = torch.cuda.Stream()
    a = rand(seed, "streams-a", comm.rank, (256, 128))
    b = rand(seed, "streams-b", comm.rank, (128, 64))
    ref = a.float() @ b.float()
    side.wait_stream(torch.cuda.current_stream())
    for stream in (side, ProtocolStream(side), side.cuda_stream):
        out = torch.full((256, 64), NAN, dtype=BF16, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        loom.gemm(a, b, out, stream=stream)
        comm.synchronize(stream)
        assert rel_err(out, ref) < GEMM_TOLERANCE[BF16], type(stream)
    x = lt.empty(comm, (1024,), BF16).fill_(1.0)
    torch.cuda.current_stream().synchronize()
    loom.all_reduce(comm, x, stream=side)
    comm.synchronize(side)
    assert torch.all(x == comm.world_size).item()
    if torch.cuda.device_count() > 1:
        other = torch.cuda.Stream(device=(comm.device + 1) % torch.cuda.device_count())
        with pytest.raises(loom.InvalidArgument, match="stream is on cuda:"):
            loom.all_reduce(comm, x, stream=other)


# ---- errors on real devices ---------------------------------------------------------------------

def test_errors_name_rank_op_and_reason(comm):
    x = torch.zeros(1024, dtype=BF16, device="cuda")
    sym = lt.empty(comm, (2 * 1024,), BF16)
    with pytest.raises(loom.InvalidArgument, match=f"loom rank {comm.rank}: all_gather: recv must be symmetric"):
        loom.all_gather(comm, x, torch.zeros(2 * 1024, dtype=BF16, device="cuda"))
    with pytest.raises(loom.InvalidArgument, match="send must be symmetric"):
        loom.all_reduce(comm, x, sym[:1024])
    with pytest.raises(loom.InvalidArgument, match="gemm_ar: out must be symmetric"):
        loom.gemm_ar(comm, torch.zeros(128, 64, dtype=BF16, device="cuda"),
                     torch.zeros(64, 64, dtype=BF16, device="cuda"), torch.zeros(128, 64, dtype=BF16, device="cuda"))
    if torch.cuda.device_count() > 1:
        other = (comm.device + 1) % torch.cuda.device_count()
        with pytest.raises(loom.InvalidArgument, match=f"is on cuda:{other} but this communicator uses cuda:{comm.device}"):
            loom.all_gather(comm, torch.zeros(1024, dtype=BF16, device=f"cuda:{other}"), sym)
    with pytest.raises(loom.Unsupported, match="N or K|multiple of 8"):
        loom.gemm(torch.zeros(128, 60, dtype=BF16, device="cuda"), torch.zeros(60, 64, dtype=BF16, device="cuda"),
                  torch.zeros(128, 64, dtype=BF16, device="cuda"))
    comm.synchronize()
    assert comm.health() is None  # refused calls leave the communicator usable


# ---- Python overhead per call over the C++ launch ----------------------------------------------

def test_python_overhead_per_call(comm, seed):
    """10^4 back-to-back calls of tiny ops from Python vs the same launches from a C++ loop
    (loom._C._bench_cpp_loop): host time per call, median over batches of 200 (short enough that
    the GPU never throttles the host), with a synchronize between batches."""
    if shared_gpu():
        pytest.skip("a timing: ranks sharing a GPU (LOOM_RANKS_PER_GPU) measure no speed")
    batches, batch = 50, 200
    stream = torch.cuda.current_stream().cuda_stream
    x = lt.empty(comm, (4096,), BF16)
    x.copy_(rand(seed, "ovh-x", comm.rank, (4096,)) * 0)
    a, b, c = (torch.randn(128, 128, device="cuda", dtype=BF16) for _ in range(3))
    a_shard = torch.randn(128 // comm.world_size, 128, device="cuda", dtype=BF16)

    cases = {
        "all_reduce": (lambda: loom.all_reduce(comm, x), lambda: lt.all_reduce(comm, x),
                       ("all_reduce", (comm._c, x, x, stream))),
        "gemm": (lambda: loom.gemm(a, b, c), lambda: lt.gemm(a, b),
                 ("gemm", (a, b, c, stream))),
        "ag_gemm": (lambda: loom.ag_gemm(comm, a_shard, b, c), lambda: lt.ag_gemm(comm, a_shard, b),
                    ("ag_gemm", (comm._c, a_shard, b, c, stream))),
    }

    def per_call_us(run_batch):
        samples = []
        for _ in range(batches):
            comm.synchronize()
            start = time.perf_counter_ns()
            run_batch()
            samples.append((time.perf_counter_ns() - start) / batch / 1000)
        comm.synchronize()
        return statistics.median(samples)

    def python_batch(fn):
        def run():
            for _ in range(batch):
                fn()
        return run

    results = {}
    for name, (python_call, torch_call, (cpp_op, cpp_args)) in cases.items():
        python_call(), torch_call()  # warm-up: staging buffers, workspaces, kernel attributes
        cpp = per_call_us(lambda: loom._C._bench_cpp_loop(cpp_op, batch, cpp_args))
        python = per_call_us(python_batch(python_call))
        torch_op = per_call_us(python_batch(torch_call))
        results[name] = {"cpp_launch_us": round(cpp, 3), "python_us": round(python, 3),
                         "torch_op_us": round(torch_op, 3), "python_overhead_us": round(python - cpp, 3),
                         "torch_op_overhead_us": round(torch_op - cpp, 3)}

    # The slowest rank's numbers count.
    gathered = [None] * comm.world_size
    dist.all_gather_object(gathered, results)
    worst = {op: {key: max(r[op][key] for r in gathered) for key in results[op]} for op in results}
    report = {"calls": batches * batch, "batch": batch, "ranks": comm.world_size,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "loom": loom.__version__,
              "per_call_us_max_over_ranks": worst,
              "note": "python = loom.<op> (DLPack/torch tensors, current stream); torch_op = loom.torch.<op> "
                      "(torch.ops.loom dispatcher, output allocation, staging copies for symmetric needs)"}
    if comm.rank == 0:
        print("\nper-call host time (us, max over ranks)")
        print(f"{'op':<12}{'C++ loop':>10}{'loom.*':>10}{'overhead':>10}{'loom.torch':>12}{'overhead':>10}")
        for op, r in worst.items():
            print(f"{op:<12}{r['cpp_launch_us']:>10.2f}{r['python_us']:>10.2f}{r['python_overhead_us']:>10.2f}"
                  f"{r['torch_op_us']:>12.2f}{r['torch_op_overhead_us']:>10.2f}")
        path = os.environ.get("LOOM_TEST_PY_OVERHEAD_JSON")
        if path:
            with open(path, "w") as f:
                json.dump(report, f, indent=2)
    for op, r in worst.items():
        assert r["python_overhead_us"] <= 10.0, f"{op}: {r['python_overhead_us']} us over the C++ launch"


# ---- failures last: they end a communicator -----------------------------------------------------

def test_silent_peer_times_out_naming_it(comm):
    """Rank 0 all-reduces, the others never do: rank 0's synchronize raises loom.Timeout naming
    rank 1 within the op timeout (+ 1 s), and the communicator is failed afterwards."""
    timeout_ms = 2000
    failing = loom.Communicator.from_process_group(heap_bytes=64 << 20, op_timeout_ms=timeout_ms,
                                                   bootstrap_timeout_ms=10_000)
    x = lt.empty(failing, (4096,), BF16).fill_(1.0)
    dist.barrier()
    if failing.rank == 0:
        loom.all_reduce(failing, x)
        start = time.monotonic()
        with pytest.raises(loom.Timeout, match="rank 1") as info:
            failing.synchronize()
        elapsed = time.monotonic() - start
        assert elapsed < timeout_ms / 1000 + 3, elapsed
        assert info.value.rank == 0 and isinstance(info.value, TimeoutError)
        assert isinstance(failing.health(), loom.LoomError)
        with pytest.raises(loom.Aborted):
            loom.all_reduce(failing, x)
    dist.barrier()
    del x
    failing.close()  # bounded: the failed rank skips the teardown barrier, the others wait 10 s at most
    dist.barrier()
    # The job's main communicator and the GPU are still fine.
    y = lt.empty(comm, (1024,), BF16).fill_(1.0)
    loom.all_reduce(comm, y)
    comm.synchronize()
    assert torch.all(y == comm.world_size).item()
