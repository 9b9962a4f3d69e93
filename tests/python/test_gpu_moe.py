"""GPU suite of the Python MoE operators (loom.moe_*; include/loom/moe.h, docs/MOE.md): every rank of
`torchrun --nproc-per-node N -m pytest tests/python -m gpu` runs it (scripts/device/shared_gpu_suite.sh
python-2: two ranks sharing one GPU); skipped without GPUs.

Every rank runs the same tests in the same order (the MoE calls are collective). Inputs are fresh
random numbers each run (the job's seed, then this rank and the test): every rank draws its own
top-k ids, router weights and token rows and gathers everyone's with torch.distributed (as CPU
tensors, so gloo carries them in the shared-GPU mode), then checks its own part of the call:

  routing   expert_offsets and moe_report's counts equal the reference routing below (docs/MOE.md,
            "The receive layout": a rank's rows ordered by (local expert, source rank, token,
            slot), cut at the capacity);
  dispatch  recv_x rows [0, kept) equal the source token rows bit for bit; rows past them keep the
            NaN they were filled with;
  combine   the "experts" are elementwise (y = x[:, :H'] * a_e + b_e in fp32, rounded to expert_out's
            dtype), so the token's owner computes every expert's output for its token exactly;
            out (NaN-filled) must be within docs/MOE.md's bound of the exact (fp64) weighted sum
            over the token's kept slots: |out - exact| <= u |exact| + k 2^-23 sum_j |w_j y_j|, u
            the output type's unit roundoff (bf16 2^-8, fp16 2^-11, fp32 2^-24); a token without
            kept slots must be exactly 0;
  dispatch_gemm  recv_x as for dispatch; out rows [0, kept) against the fp32 reference
            recv_x_e @ W_e^T (relative error GEMM_TOLERANCE) and bit-identical to moe_dispatch +
            grouped_gemm on the same tile; rows past kept still NaN;
  layer     moe_layer's out against an fp32 reference of the whole layer (every expert's weights
            drawn alike on every rank: a token's owner computes its experts' outputs itself;
            relative error LAYER_TOLERANCE), and recv_x, hidden, expert_out and out bit-identical
            to moe_dispatch_gemm -> grouped_gemm -> moe_combine on the same tile; across nodes the
            call is refused (loom.Unsupported).

moe_topk (one GPU, not collective: each rank checks its own logits) against a CPU reference of
moe.h's rules: ids ordered by (logit desc, expert id asc) over the logits as the GPU reads them
(rounded to their dtype), -1 past the finite ones; weights within 1e-5 relative of the fp64 softmax
over all E or sigmoid (renormalized: over the token's top_k), exactly 0 in -1 slots.

Bad input: refused calls raise the documented exception before anything launches and leave the
communicator usable; an out-of-range expert id and an over-capacity routing are reported by
moe_report on every rank, with nothing moved.
"""

import zlib

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import loom  # noqa: E402
import loom.torch as lt  # noqa: E402
from gpu_job import GEMM_TOLERANCE, job_seed, rel_err, start_job  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAN = float("nan")
UNIT_ROUNDOFF = {BF16: 2.0 ** -8, FP16: 2.0 ** -11, FP32: 2.0 ** -24}

EXPERTS_PER_RANK = 4
TOP_K = 4
HIDDEN = 256
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def comm():
    c = start_job()
    yield c
    torch.cuda.synchronize()
    dist.barrier()  # not closed: see test_gpu.py's fixture


@pytest.fixture(scope="module")
def seed(comm):
    return job_seed()


# ---- inputs --------------------------------------------------------------------------------------

def generator(seed, salt, rank=-1):
    """A CPU generator for (seed, salt, rank); rank -1: the same on every rank."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(salt.encode()) * 131 + rank + 1) % (1 << 62))


def make_ids(routing, tokens, experts, k, seed, salt, rank):
    """This rank's top-k expert ids, int32 [tokens, k] on the CPU.

    uniform: k distinct experts, uniformly; skewed: k distinct draws from one Categorical over the
    experts with U(0, 1) weights shared by every rank (max/mean about 2); all-to-one: slot 0 of every
    token on the last expert, the others distinct among the rest; unused-slots: uniform with about
    a third of the slots -1 (no expert)."""
    g = generator(seed, salt, rank)
    if tokens == 0:
        return torch.empty((0, k), dtype=torch.int32)
    if routing == "skewed":
        probs = torch.rand(experts, generator=generator(seed, salt + "-probs"))
        ids = torch.multinomial(probs.repeat(tokens, 1), k, replacement=False, generator=g)
    elif routing == "all-to-one":
        hot = experts - 1
        rest = torch.rand(tokens, experts - 1, generator=g).topk(k - 1, dim=1).indices
        ids = torch.cat([torch.full((tokens, 1), hot, dtype=rest.dtype), rest], dim=1)
    else:
        ids = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices
        if routing == "unused-slots":
            ids[torch.rand(tokens, k, generator=g) < 0.35] = -1
    return ids.to(torch.int32).contiguous()


def gather(value):
    """Every rank's `value` (Python objects, CPU tensors), in rank order."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


class Reference:
    """The routing as docs/MOE.md specifies it, for every rank, from every rank's ids: rank d's rows
    are the (source s, token t, slot j) pairs whose expert lies on d, ordered by (local expert, s,
    t, j); rows at or past the capacity are dropped (overflow 'drop')."""

    def __init__(self, ids, world, experts, capacity):
        per_rank = experts // world
        rows = [[] for _ in range(world)]
        for s, rank_ids in enumerate(ids):
            for t, slots in enumerate(rank_ids.tolist()):
                for j, e in enumerate(slots):
                    if e >= 0:
                        rows[e // per_rank].append((e % per_rank, s, t, j))
        for r in rows:
            r.sort()
        self.recv_rows = [len(r) for r in rows]
        self.max_recv_rows = max(self.recv_rows)
        self.kept = [r[:capacity] for r in rows]  # (local expert, source, token, slot)
        self.offsets = [[min(capacity, sum(1 for row in r if row[0] < le)) for le in range(per_rank + 1)] for r in rows]
        self.dropped_slots = [0] * world
        self.kept_slots = set()  # (source, token, slot)
        for r in rows:
            for i, (_, s, t, j) in enumerate(r):
                if i < capacity:
                    self.kept_slots.add((s, t, j))
                else:
                    self.dropped_slots[s] += 1


def bits(t):
    """The tensor's bits as integers (bit-exact comparison: NaN and -0.0 included)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def expert_params(seed, salt, experts, width):
    """Every expert's elementwise function y = x[:, :width] * a_e + b_e (fp32), the same on every rank."""
    g = generator(seed, salt + "-experts")
    return (torch.rand(experts, width, generator=g) + 0.5).cuda(), torch.randn(experts, width, generator=g).cuda()


def apply_experts(rows, expert_ids, a, b, dtype):
    """The experts' outputs: elementwise in fp32 (no reduction), so the same row and expert give the
    same bits wherever and in whatever batch they are computed."""
    width = a.shape[1]
    return (rows[:, :width].float() * a[expert_ids] + b[expert_ids]).to(dtype)


def local_expert_of_rows(offsets):
    """The local expert of each kept row, from expert_offsets (a list)."""
    counts = torch.tensor([offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)])
    return torch.repeat_interleave(torch.arange(len(counts)), counts)


# ---- one MoE step against the reference -----------------------------------------------------------

def run_step(comm, seed, salt, routing, dtype=BF16, *, capacity=0, overflow="error", rank0_empty=False,
             out_hidden=HIDDEN, out_dtype=None, weighted=True, combine_weights=False):
    """Routing, dispatch, the elementwise experts and combine on every rank, then every check of
    this rank's part (see the module's doc)."""
    w, me = comm.world_size, comm.rank
    experts = EXPERTS_PER_RANK * w
    out_dtype = out_dtype or dtype
    config = loom.MoeConfig(num_experts=experts, top_k=TOP_K, hidden=HIDDEN, dtype=dtype, max_tokens=MAX_TOKENS,
                            capacity=capacity, overflow=overflow)
    tokens = 0 if rank0_empty and me == 0 else 128 + 37 * (me % 3)
    ids = make_ids(routing, tokens, experts, TOP_K, seed, salt, me)
    g = generator(seed, salt + "-rows", me)
    router_weights = torch.rand(tokens, TOP_K, generator=g)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    x_dev = x.cuda()
    override = torch.rand(tokens, TOP_K, generator=g)  # combine's own weights (combine_weights=True)
    everyone = gather((ids, x))  # before any loom call: every rank's inputs, for the reference
    ref = Reference([i for i, _ in everyone], w, experts, capacity or MAX_TOKENS * w * TOP_K)
    a, b = expert_params(seed, salt, experts, out_hidden)

    bufs = lt.moe_buffers(comm, config, expert_out_hidden=out_hidden, expert_out_dtype=out_dtype)
    bufs.recv_x.fill_(NAN)
    bufs.expert_out.fill_(NAN)
    out = torch.full((tokens, out_hidden), NAN, dtype=out_dtype, device="cuda")
    plan = loom.moe_routing(comm, config, ids.cuda(), topk_weights=router_weights.cuda() if weighted else None,
                            plan_buffer=bufs.plan_buffer, expert_offsets=bufs.expert_offsets)
    loom.moe_dispatch(comm, plan, x_dev, bufs.recv_x)
    report = loom.moe_report(comm, plan)  # waits for the routing and the dispatch
    offsets = bufs.expert_offsets.tolist()
    kept = offsets[-1]
    row_experts = (local_expert_of_rows(offsets) + me * EXPERTS_PER_RANK).cuda()
    bufs.expert_out[:kept] = apply_experts(bufs.recv_x[:kept], row_experts, a, b, out_dtype)
    loom.moe_combine(comm, plan, bufs.expert_out, out, topk_weights=override.cuda() if combine_weights else None)
    comm.synchronize()

    # routing
    assert (plan.num_tokens, plan.capacity, plan.local_experts) == (tokens, bufs.sizes.capacity, EXPERTS_PER_RANK)
    assert plan.config is config and plan.expert_offsets is bufs.expert_offsets
    assert offsets == ref.offsets[me]
    assert (report.recv_rows, report.kept_rows, report.dropped_rows, report.dropped_slots, report.max_recv_rows) == (
        ref.recv_rows[me], kept, ref.recv_rows[me] - kept, ref.dropped_slots[me], ref.max_recv_rows)
    # dispatch: the source rows, bit for bit; the rest untouched
    xs = [rows for _, rows in everyone]
    rows = ref.kept[me]
    assert kept == len(rows)
    if rows:
        expected = torch.stack([xs[s][t] for _, s, t, _ in rows])
        assert torch.equal(bits(bufs.recv_x[:kept].cpu()), bits(expected)), "dispatched rows differ from the sources"
    assert bufs.recv_x[kept:].isnan().all()
    # combine: within the bound of the exact sum over the kept slots
    slot_weights = override if combine_weights else router_weights if weighted else torch.ones(tokens, TOP_K)
    exact = torch.zeros(tokens, out_hidden, dtype=torch.float64)
    magnitude = torch.zeros(tokens, out_hidden, dtype=torch.float64)
    for j in range(TOP_K):
        kept_slot = torch.tensor([(me, t, j) in ref.kept_slots for t in range(tokens)], dtype=torch.bool)
        expert = ids[:, j].long().clamp(min=0)
        y = apply_experts(x_dev, expert.cuda(), a, b, out_dtype).cpu().double()
        term = (slot_weights[:, j, None].double() * y) * kept_slot[:, None]  # a dropped or unused slot adds 0
        exact += term
        magnitude += term.abs()
    bound = UNIT_ROUNDOFF[out_dtype] * exact.abs() + TOP_K * 2.0 ** -23 * magnitude
    error = (out.cpu().double() - exact).abs()
    assert not out.isnan().any(), "combine left rows unwritten"
    assert (error <= bound).all(), f"combine error {(error - bound).max().item()} over the bound"
    return report


@pytest.mark.parametrize("routing", ["uniform", "skewed", "all-to-one", "unused-slots"])
def test_moe_step(comm, seed, routing):
    run_step(comm, seed, f"step-{routing}", routing)


@pytest.mark.parametrize("dtype", [FP16, FP32], ids=str)
def test_moe_step_dtypes(comm, seed, dtype):
    run_step(comm, seed, f"dtype-{dtype}", "uniform", dtype)


def test_moe_rank_without_tokens_and_unweighted(comm, seed):
    """Rank 0 routes no token; the routing has no weights (each 1)."""
    run_step(comm, seed, "empty-rank", "skewed", rank0_empty=True, weighted=False)


def test_moe_combine_own_width_dtype_and_weights(comm, seed):
    """expert_out narrower than the tokens and fp32, combine given its own weights (on one node:
    across nodes the other nodes sum with the routing's, test_across_nodes_combine_rules)."""
    run_step(comm, seed, "combine-width", "uniform", BF16, out_hidden=HIDDEN // 2, out_dtype=FP32,
             combine_weights=comm.num_nodes == 1)


def test_moe_overflow_drop(comm, seed):
    """All-to-one with a capacity below what the hot rank needs: its rows past the capacity are
    dropped and counted (the reference says which), their slots add nothing in combine."""
    capacity = 96
    report = run_step(comm, seed, "drop", "all-to-one", capacity=capacity, overflow="drop")
    assert report.max_recv_rows > capacity  # the case really overflows
    if comm.rank == comm.world_size - 1:  # the hot expert's rank
        assert report.dropped_rows > 0 and report.kept_rows == capacity


# ---- moe_dispatch_gemm --------------------------------------------------------------------------

@pytest.mark.parametrize("b_layout,activation,in_dtype,out_dtype", [
    ("nk", "none", BF16, BF16), ("kn", "none", FP16, FP32), ("nk", "swiglu", BF16, BF16), ("kn", "swiglu", BF16, FP32),
])
def test_moe_dispatch_gemm(comm, seed, b_layout, activation, in_dtype, out_dtype):
    """The fused dispatch + first expert GEMM: recv_x as moe_dispatch writes it, out rows against an
    fp32 reference and bit-identical to moe_dispatch + grouped_gemm on the same tile."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("moe_dispatch_gemm needs an sm_90 GPU")
    w, me = comm.world_size, comm.rank
    experts, n = EXPERTS_PER_RANK * w, 256
    salt = f"dgemm-{b_layout}-{activation}-{in_dtype}"
    config = loom.MoeConfig(num_experts=experts, top_k=TOP_K, hidden=HIDDEN, dtype=in_dtype, max_tokens=MAX_TOKENS)
    tokens = 128 + 37 * (me % 3)
    ids = make_ids("skewed", tokens, experts, TOP_K, seed, salt, me)
    g = generator(seed, salt + "-rows", me)
    x = torch.randn(tokens, HIDDEN, generator=g).to(in_dtype)
    # This rank's experts' weights: [El, N, H] (nk) or [El, H, N] (kn); SwiGLU: gate and up of N / 2
    # outputs each, interleaved by 8 (loom.torch.swiglu_weights).
    shape = (EXPERTS_PER_RANK, n, HIDDEN) if b_layout == "nk" else (EXPERTS_PER_RANK, HIDDEN, n)
    dense = torch.randn(shape, generator=g) * HIDDEN ** -0.5
    if activation == "swiglu":
        gate, up = dense.chunk(2, dim=1 if b_layout == "nk" else 2)
        weights = lt.swiglu_weights(gate.contiguous(), up.contiguous(), b_layout).to(in_dtype).cuda()
    else:
        weights = dense.to(in_dtype).cuda()
    everyone = gather((ids, x))
    ref = Reference([i for i, _ in everyone], w, experts, MAX_TOKENS * w * TOP_K)

    bufs = lt.moe_buffers(comm, config, expert_out=False)
    bufs.recv_x.fill_(NAN)
    n_out = n // 2 if activation == "swiglu" else n
    out = torch.full((bufs.sizes.capacity, n_out), NAN, dtype=out_dtype, device="cuda")
    plan = loom.moe_routing(comm, config, ids.cuda(), plan_buffer=bufs.plan_buffer, expert_offsets=bufs.expert_offsets)
    loom.moe_dispatch_gemm(comm, plan, x.cuda(), bufs.recv_x, weights, out, b_layout=b_layout, activation=activation,
                           tile="128x256")
    loom.moe_report(comm, plan)
    # The same rows through grouped_gemm on the same tile (one GPU, no communication).
    again = torch.full_like(out, NAN)
    workspace = torch.empty(loom.grouped_gemm_workspace_bytes(bufs.sizes.capacity, EXPERTS_PER_RANK) // 4 + 1,
                            dtype=torch.int32, device="cuda")
    loom.grouped_gemm(bufs.recv_x, weights, again, workspace=workspace, offsets=bufs.expert_offsets, tile="128x256",
                      b_layout=b_layout, activation=activation)
    comm.synchronize()

    offsets = bufs.expert_offsets.tolist()
    kept = offsets[-1]
    assert offsets == ref.offsets[me]
    rows = ref.kept[me]
    if rows:
        expected = torch.stack([everyone[s][1][t] for _, s, t, _ in rows])
        assert torch.equal(bits(bufs.recv_x[:kept].cpu()), bits(expected))
    assert bufs.recv_x[kept:].isnan().all()
    reference = torch.zeros(kept, n_out, device="cuda")
    for e in range(EXPERTS_PER_RANK):
        lo, hi = offsets[e], offsets[e + 1]
        a = bufs.recv_x[lo:hi].float()
        if activation == "swiglu":
            g_e, u_e = gate[e].cuda(), up[e].cuda()
            if b_layout == "nk":
                g_e, u_e = g_e.t(), u_e.t()
            # The weights the kernel saw are in_dtype: round gate and up the same way.
            g_e, u_e = g_e.to(in_dtype).float(), u_e.to(in_dtype).float()
            reference[lo:hi] = torch.nn.functional.silu(a @ g_e) * (a @ u_e)
        else:
            w_e = weights[e].float()
            reference[lo:hi] = a @ (w_e.t() if b_layout == "nk" else w_e)
    if kept:
        assert rel_err(out[:kept], reference) < GEMM_TOLERANCE[out_dtype]
    assert out[kept:].isnan().all()
    assert torch.equal(bits(out[:kept]), bits(again[:kept])), "moe_dispatch_gemm differs from dispatch + grouped_gemm"


# ---- moe_layer ----------------------------------------------------------------------------------

INTERMEDIATE = 192  # I: fc1's 2I = 384 columns are one and a half 128x256 tiles; fc2's K = I
# Relative L2 error of moe_layer's out against layer_reference. The reference rounds hidden and the
# experts' outputs to the input type where the kernel does, so the two differ only by accumulation
# order (which can move a rounding of hidden or expert_out by one ulp, u relative) and by out's own
# rounding (u / 2 at most): 2 u + 1e-4 bounds the relative L2 error.
LAYER_TOLERANCE = {BF16: 2 * 2.0 ** -8 + 1e-4, FP16: 2 * 2.0 ** -11 + 1e-4}


def layer_weights(seed, salt, experts, dtype):
    """Every expert's gate and up [E, I, H] and down [E, H, I] (nn.Linear weights), rounded to
    dtype, as fp32 CPU tensors, the same on every rank: a token's owner needs all its experts'."""
    g = generator(seed, salt + "-weights")
    gate = torch.randn(experts, INTERMEDIATE, HIDDEN, generator=g) * HIDDEN ** -0.5
    up = torch.randn(experts, INTERMEDIATE, HIDDEN, generator=g) * HIDDEN ** -0.5
    down = torch.randn(experts, HIDDEN, INTERMEDIATE, generator=g) * INTERMEDIATE ** -0.5
    return tuple(w.to(dtype).float() for w in (gate, up, down))


def layer_reference(x, ids, weights, gate, up, down, dtype):
    """The whole layer for this rank's tokens in fp32 on the CPU: for each slot's expert e,
    h = silu(x gate_e^T) * (x up_e^T) rounded to dtype (the kernel's hidden), y = h down_e^T rounded
    to dtype (its expert_out), out = sum over the slots of w * y in fp32. A token's k experts are
    distinct, so each expert takes at most one slot of a token."""
    out = torch.zeros(x.shape[0], HIDDEN)
    rows_of = x.float()
    for e in ids.unique().tolist():
        if e < 0:
            continue
        token, slot = (ids == e).nonzero(as_tuple=True)
        rows = rows_of[token]
        h = (torch.nn.functional.silu(rows @ gate[e].t()) * (rows @ up[e].t())).to(dtype).float()
        y = (h @ down[e].t()).to(dtype).float()
        out.index_add_(0, token, weights[token, slot].unsqueeze(1) * y)
    return out


@pytest.mark.parametrize("routing,dtype,rank0_empty", [("skewed", BF16, False), ("uniform", FP16, False),
                                                        ("skewed", BF16, True)],
                         ids=["skewed-bf16", "uniform-fp16", "skewed-bf16-rank0-empty"])
def test_moe_layer(comm, seed, routing, dtype, rank0_empty):
    """The whole MoE FFN step in one kernel: out against the fp32 reference of the layer, and
    recv_x, hidden, expert_out and out bit-identical to the three calls it fuses on the same tile;
    loom.torch.moe_layer (the planner's tile) within the same tolerance. rank0_empty: rank 0 routes
    no token."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("moe_layer needs an sm_90 GPU")
    w, me = comm.world_size, comm.rank
    experts, tile = EXPERTS_PER_RANK * w, "128x256"
    salt = f"layer-{routing}-{dtype}-{rank0_empty}"
    config = loom.MoeConfig(num_experts=experts, top_k=TOP_K, hidden=HIDDEN, dtype=dtype, max_tokens=MAX_TOKENS)
    tokens = 0 if rank0_empty and me == 0 else 128 + 37 * (me % 3)
    ids = make_ids(routing, tokens, experts, TOP_K, seed, salt, me)
    g = generator(seed, salt + "-rows", me)
    router_weights = torch.rand(tokens, TOP_K, generator=g)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    gate, up, down = layer_weights(seed, salt, experts, dtype)
    mine = slice(me * EXPERTS_PER_RANK, (me + 1) * EXPERTS_PER_RANK)
    gate_up_dev = lt.swiglu_weights(gate[mine], up[mine]).to(dtype).cuda()
    down_dev = down[mine].to(dtype).cuda()
    x_dev = x.cuda()
    everyone = gather((ids, x))
    ref = Reference([i for i, _ in everyone], w, experts, MAX_TOKENS * w * TOP_K)

    bufs = lt.moe_buffers(comm, config, hidden_intermediate=INTERMEDIATE)
    composed = lt.moe_buffers(comm, config, hidden_intermediate=INTERMEDIATE)  # the three calls' own buffers
    for b in (bufs, composed):
        for buffer in (b.recv_x, b.hidden, b.expert_out):
            buffer.fill_(NAN)
    out = torch.full((tokens, HIDDEN), NAN, dtype=dtype, device="cuda")
    out_composed = torch.full_like(out, NAN)
    capacity = bufs.sizes.capacity
    workspace = torch.empty(loom.grouped_gemm_workspace_bytes(capacity, EXPERTS_PER_RANK) // 4 + 1, dtype=torch.int32,
                            device="cuda")
    plan = loom.moe_routing(comm, config, ids.cuda(), topk_weights=router_weights.cuda(), plan_buffer=bufs.plan_buffer,
                            expert_offsets=bufs.expert_offsets)
    # loom.torch's helper first (the planner's tile): the explicit call below then rewrites bufs on its tile.
    out_torch = lt.moe_layer(comm, plan, x_dev, gate_up_dev, down_dev, bufs)
    loom.moe_layer(comm, plan, x_dev, gate_up_dev, down_dev, bufs.recv_x, bufs.hidden, bufs.expert_out, out, tile=tile)
    # The same step composed: dispatch + fc1 (SwiGLU) -> fc2 over the same rows -> the weighted combine.
    loom.moe_dispatch_gemm(comm, plan, x_dev, composed.recv_x, gate_up_dev, composed.hidden, activation="swiglu",
                           tile=tile)
    loom.grouped_gemm(composed.hidden, down_dev, composed.expert_out, workspace=workspace,
                      offsets=bufs.expert_offsets, tile=tile)
    loom.moe_combine(comm, plan, composed.expert_out, out_composed)
    report = loom.moe_report(comm, plan)
    comm.synchronize()

    offsets = bufs.expert_offsets.tolist()
    kept = offsets[-1]
    assert offsets == ref.offsets[me]
    assert (report.kept_rows, report.dropped_slots) == (kept, 0)
    rows = ref.kept[me]
    if rows:
        expected = torch.stack([everyone[s][1][t] for _, s, t, _ in rows])
        assert torch.equal(bits(bufs.recv_x[:kept].cpu()), bits(expected)), "moe_layer's recv_x differs from the sources"
    assert bufs.recv_x[kept:].isnan().all()
    for name in ("recv_x", "hidden", "expert_out"):
        fused, separate = getattr(bufs, name)[:kept], getattr(composed, name)[:kept]
        assert torch.equal(bits(fused), bits(separate)), f"moe_layer's {name} differs from the composed calls'"
    assert not out.isnan().any(), "moe_layer left token rows unwritten"
    assert torch.equal(bits(out), bits(out_composed)), (
        "moe_layer differs from moe_dispatch_gemm -> grouped_gemm -> moe_combine on the same tile")
    assert out_torch.shape == out.shape and out_torch.dtype == dtype
    if tokens:
        reference = layer_reference(x, ids, router_weights, gate, up, down, dtype)
        err = rel_err(out.cpu(), reference)
        assert err <= LAYER_TOLERANCE[dtype], f"moe_layer's relative error {err:.2e} over {LAYER_TOLERANCE[dtype]:.2e}"
        # loom.torch.moe_layer ran on the planner's tile: the same math, maybe another tile.
        assert rel_err(out_torch.cpu(), reference) <= LAYER_TOLERANCE[dtype]


@pytest.mark.parametrize("rank0_empty", [False, True], ids=["every-rank", "rank0-empty"])
def test_moe_layer_shared_expert(comm, seed, rank0_empty):
    """A shared expert (one dense SwiGLU FFN on every token, weight 1): loom.torch.moe_layer with
    moe_buffers(shared_expert=True) and torch.ops.loom.moe_layer (moe_layer_from_topk) against the
    fp32 reference of the routed experts plus the shared one; both the same bits; the shared rows
    of hidden and expert_out after align_up(capacity, 128) equal loom.grouped_gemm over the tokens
    (one group) on the same tile; no other row past the kept ones written."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("moe_layer needs an sm_90 GPU")
    w, me, dtype, tile = comm.world_size, comm.rank, BF16, "128x256"
    experts = EXPERTS_PER_RANK * w
    salt = f"layer-shared-{rank0_empty}"
    config = loom.MoeConfig(num_experts=experts, top_k=TOP_K, hidden=HIDDEN, dtype=dtype, max_tokens=MAX_TOKENS)
    tokens = 0 if rank0_empty and me == 0 else 128 + 37 * (me % 3)
    ids = make_ids("skewed", tokens, experts, TOP_K, seed, salt, me)
    g = generator(seed, salt + "-rows", me)
    router_weights = torch.rand(tokens, TOP_K, generator=g)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    gate, up, down = layer_weights(seed, salt, experts + 1, dtype)  # the last one: the shared expert
    mine = slice(me * EXPERTS_PER_RANK, (me + 1) * EXPERTS_PER_RANK)
    gate_up_dev = lt.swiglu_weights(gate[mine], up[mine]).to(dtype).cuda()
    down_dev = down[mine].to(dtype).cuda()
    shared_gate_up = lt.swiglu_weights(gate[experts:], up[experts:])[0].to(dtype).cuda()
    shared_down = down[experts].to(dtype).cuda()
    x_dev, ids_dev, weights_dev = x.cuda(), ids.cuda(), router_weights.cuda()

    bufs = lt.moe_buffers(comm, config, hidden_intermediate=INTERMEDIATE, shared_expert=True)
    capacity = bufs.sizes.capacity
    rows = loom.moe_layer_rows(capacity, MAX_TOKENS, True)
    first = (capacity + 127) // 128 * 128
    assert rows == first + MAX_TOKENS and bufs.hidden.shape == (rows, INTERMEDIATE)
    assert bufs.expert_out.shape == (rows, HIDDEN) and bufs.recv_x.shape == (capacity, HIDDEN)
    bufs.hidden.fill_(NAN)
    bufs.expert_out.fill_(NAN)
    plan = loom.moe_routing(comm, config, ids_dev, topk_weights=weights_dev, plan_buffer=bufs.plan_buffer,
                            expert_offsets=bufs.expert_offsets)
    out = torch.full((tokens, HIDDEN), NAN, dtype=dtype, device="cuda")
    loom.moe_layer(comm, plan, x_dev, gate_up_dev, down_dev, bufs.recv_x, bufs.hidden, bufs.expert_out, out, tile=tile,
                   shared_gate_up=shared_gate_up, shared_down=shared_down)
    kept = bufs.expert_offsets[-1].item()
    hidden_rows, expert_rows = bufs.hidden.clone(), bufs.expert_out.clone()
    out_plain = lt.moe_layer(comm, plan, x_dev, gate_up_dev, down_dev, bufs, shared_gate_up=shared_gate_up,
                             shared_down=shared_down)
    out_op = lt.moe_layer_from_topk(comm, x_dev, ids_dev, weights_dev, gate_up_dev, down_dev, num_experts=experts,
                                    max_tokens=MAX_TOKENS, shared_gate_up=shared_gate_up, shared_down=shared_down)
    # The shared expert alone through grouped_gemm (one group of the tokens, the same tile).
    s_hidden = torch.full((max(tokens, 1), INTERMEDIATE), NAN, dtype=dtype, device="cuda")
    s_out = torch.full((max(tokens, 1), HIDDEN), NAN, dtype=dtype, device="cuda")
    if tokens:
        offs = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
        ws = torch.empty(loom.grouped_gemm_workspace_bytes(tokens, 1) // 4 + 1, dtype=torch.int32, device="cuda")
        loom.grouped_gemm(x_dev, shared_gate_up.unsqueeze(0), s_hidden, workspace=ws, offsets=offs, tile=tile,
                          activation="swiglu")
        loom.grouped_gemm(s_hidden, shared_down.unsqueeze(0), s_out, workspace=ws, offsets=offs, tile=tile)
    report = loom.moe_report(comm, plan)
    comm.synchronize()
    assert report.dropped_slots == 0
    assert not out.isnan().any(), "moe_layer left token rows unwritten"
    assert torch.equal(bits(out_plain), bits(out)) and torch.equal(bits(out_op), bits(out)), (
        "loom.torch.moe_layer or torch.ops.loom.moe_layer differs from loom.moe_layer on the same tile")
    assert torch.equal(bits(hidden_rows[first:first + tokens]), bits(s_hidden[:tokens])), "shared hidden rows differ"
    assert torch.equal(bits(expert_rows[first:first + tokens]), bits(s_out[:tokens])), "shared output rows differ"
    for name, buf in (("hidden", hidden_rows), ("expert_out", expert_rows)):
        assert buf[kept:first].isnan().all() and buf[first + tokens:].isnan().all(), f"{name}: a row past the rest"
    if tokens:
        reference = layer_reference(x, ids, router_weights, gate, up, down, dtype)
        reference += layer_reference(x, torch.full((tokens, 1), experts), torch.ones(tokens, 1), gate, up, down, dtype)
        err = rel_err(out.cpu(), reference)
        assert err <= LAYER_TOLERANCE[dtype], f"relative error {err:.2e} over {LAYER_TOLERANCE[dtype]:.2e}"


def test_moe_layer_bad_buffers_are_refused_before_launch(comm, seed):
    """What the host sees is refused before the launch (non-symmetric recv_x or expert_out, hidden
    overlapping expert_out, an I that is not a multiple of 8); then the same plan runs."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("moe_layer needs an sm_90 GPU")
    config = small_config(comm)
    ids = make_ids("uniform", 32, config.num_experts, config.top_k, seed, "layer-refused", comm.rank).cuda()
    bufs = lt.moe_buffers(comm, config, hidden_intermediate=INTERMEDIATE)
    capacity = bufs.sizes.capacity
    g = generator(seed, "layer-refused-weights", comm.rank)
    gate_up = (torch.randn(EXPERTS_PER_RANK, 2 * INTERMEDIATE, HIDDEN, generator=g) * HIDDEN ** -0.5).to(BF16).cuda()
    down = (torch.randn(EXPERTS_PER_RANK, HIDDEN, INTERMEDIATE, generator=g) * INTERMEDIATE ** -0.5).to(BF16).cuda()
    x = torch.randn(32, HIDDEN, generator=g).to(BF16).cuda()
    out = torch.full((32, HIDDEN), NAN, dtype=BF16, device="cuda")
    plan = loom.moe_routing(comm, config, ids, plan_buffer=bufs.plan_buffer, expert_offsets=bufs.expert_offsets)
    with pytest.raises(loom.InvalidArgument, match="recv_x must be symmetric memory"):
        loom.moe_layer(comm, plan, x, gate_up, down, torch.empty_like(bufs.recv_x), bufs.hidden, bufs.expert_out, out)
    with pytest.raises(loom.InvalidArgument, match="expert_out must be symmetric memory"):
        loom.moe_layer(comm, plan, x, gate_up, down, bufs.recv_x, bufs.hidden, torch.empty_like(bufs.expert_out), out)
    inside_expert_out = bufs.expert_out.view(-1)[: capacity * INTERMEDIATE].view(capacity, INTERMEDIATE)
    overlap = r"buffers.hidden \(\[capacity = \d+, I\]\) overlaps buffers.expert_out"
    with pytest.raises(loom.InvalidArgument, match=overlap):
        loom.moe_layer(comm, plan, x, gate_up, down, bufs.recv_x, inside_expert_out, bufs.expert_out, out)
    odd = 12  # I = 12: the down GEMM's K rows would not be 16-byte aligned
    with pytest.raises(loom.Unsupported, match="multiple of 8"):
        loom.moe_layer(comm, plan, x, gate_up[:, : 2 * odd].contiguous(), down[:, :, :odd].contiguous(), bufs.recv_x,
                       bufs.hidden[:, :odd].contiguous(), bufs.expert_out, out)
    with pytest.raises(loom.InvalidArgument, match="buffers.hidden is None"):
        lt.moe_layer(comm, plan, x, gate_up, down, lt.MoeBuffers(bufs.sizes, bufs.plan_buffer, bufs.expert_offsets,
                                                                  bufs.recv_x, bufs.expert_out))
    comm.synchronize()
    assert comm.health() is None
    loom.moe_layer(comm, plan, x, gate_up, down, bufs.recv_x, bufs.hidden, bufs.expert_out, out)
    loom.moe_report(comm, plan)
    comm.synchronize()
    assert not out.isnan().any()


# ---- bad input -------------------------------------------------------------------------------------

def small_config(comm, **changes):
    fields = dict(num_experts=EXPERTS_PER_RANK * comm.world_size, top_k=2, hidden=HIDDEN, dtype=BF16, max_tokens=64)
    fields.update(changes)
    return loom.MoeConfig(**fields)


def test_bad_configs_are_refused(comm):
    w = comm.world_size
    assert loom.moe_can_implement(comm, small_config(comm)) is None
    sizes = loom.moe_sizes(comm, small_config(comm))
    assert (sizes.capacity, sizes.local_experts) == (64 * w * 2, EXPERTS_PER_RANK)
    assert sizes.recv_bytes == sizes.capacity * HIDDEN * 2 and sizes.plan_bytes > 0 and sizes.workspace_bytes > 0
    too_many = small_config(comm, top_k=EXPERTS_PER_RANK * w + 1)
    assert isinstance(loom.moe_can_implement(comm, too_many), loom.InvalidArgument)
    with pytest.raises(loom.InvalidArgument, match="larger than the expert count"):
        loom.moe_sizes(comm, too_many)
    with pytest.raises(loom.InvalidArgument, match="multiple of 16"):
        lt.moe_buffers(comm, small_config(comm, hidden=12))  # 24-byte rows; refused before any allocation
    if w > 1:
        uneven = small_config(comm, num_experts=EXPERTS_PER_RANK * w + 1)
        assert isinstance(loom.moe_can_implement(comm, uneven), loom.InvalidArgument)
    with pytest.raises(loom.Unsupported, match="at most"):
        loom.moe_sizes(comm, small_config(comm, num_experts=2048 * w, top_k=2))
    loom.moe_reserve_workspace(comm, small_config(comm))
    comm.synchronize()
    assert comm.health() is None


def test_bad_tensors_are_refused_before_launch(comm, seed):
    """Each refused call raises before it launches; the communicator stays usable, and a correct
    step afterwards still works."""
    config = small_config(comm)
    bufs = lt.moe_buffers(comm, config)
    ids = make_ids("uniform", 32, config.num_experts, config.top_k, seed, "refused", comm.rank).cuda()
    routing = dict(plan_buffer=bufs.plan_buffer, expert_offsets=bufs.expert_offsets)
    with pytest.raises(loom.InvalidArgument, match="num_tokens 65 is outside"):
        loom.moe_routing(comm, config, torch.zeros(65, 2, dtype=torch.int32, device="cuda"), **routing)
    with pytest.raises(loom.InvalidArgument, match="plan_buffer holds 16 bytes"):
        loom.moe_routing(comm, config, ids, plan_buffer=bufs.plan_buffer[:16], expert_offsets=bufs.expert_offsets)
    with pytest.raises(loom.InvalidArgument, match="topk_ids must be"):
        loom.moe_routing(comm, config, ids[:, :1].contiguous(), **routing)
    plan = loom.moe_routing(comm, config, ids, **routing)
    # Across nodes no kernel may load for the first time while an MoE call waits on the proxy
    # (CUDA's lazy loading waits for it: docs/NETWORK.md, "A hazard"); the torch calls below do.
    comm.synchronize()
    x = torch.randn(32, HIDDEN, device="cuda").to(BF16)
    with pytest.raises(loom.InvalidArgument, match="recv_x must be symmetric memory"):
        loom.moe_dispatch(comm, plan, x, torch.empty_like(bufs.recv_x))
    with pytest.raises(loom.InvalidArgument, match="x is fp16 but the config's dtype is bf16"):
        loom.moe_dispatch(comm, plan, x.half(), bufs.recv_x)
    with pytest.raises(loom.InvalidArgument, match=r"x must be \[T, hidden\]"):
        loom.moe_dispatch(comm, plan, x[:31], bufs.recv_x)
    out = torch.empty(32, HIDDEN, dtype=BF16, device="cuda")
    with pytest.raises(loom.InvalidArgument, match="expert_out must be symmetric memory"):
        loom.moe_combine(comm, plan, torch.empty_like(bufs.expert_out), out)
    with pytest.raises(loom.InvalidArgument, match="must be the loom.MoePlan"):
        loom.moe_combine(comm, "plan", bufs.expert_out, out)
    weights = torch.zeros(EXPERTS_PER_RANK, 60, HIDDEN, dtype=BF16, device="cuda")  # N = 60: not a multiple of 8
    with pytest.raises(loom.Unsupported):
        loom.moe_dispatch_gemm(comm, plan, x, bufs.recv_x, weights, torch.empty(bufs.sizes.capacity, 60, dtype=BF16,
                                                                                   device="cuda"))
    # A plan belongs to the communicator that routed it.
    other = loom.Communicator.from_process_group(heap_bytes=64 << 20)
    try:
        with pytest.raises(loom.InvalidArgument, match="another communicator"):
            loom.moe_dispatch(other, plan, x, bufs.recv_x)
    finally:
        other.close()
    comm.synchronize()
    assert comm.health() is None
    # Still usable: the same plan dispatches and reports.
    bufs.recv_x.fill_(NAN)
    loom.moe_dispatch(comm, plan, x, bufs.recv_x)
    report = loom.moe_report(comm, plan)
    assert report.kept_rows == bufs.expert_offsets[-1].item()


def test_bad_expert_id_is_reported_on_every_rank(comm, seed):
    """The last rank names expert E + 5 at token 3, slot 1: every rank's moe_report raises it, no
    rank moves anything (recv_x and out keep their NaN, expert_offsets are 0), and the next
    routing on the same buffers works."""
    w = comm.world_size
    config = small_config(comm)
    experts = config.num_experts
    bufs = lt.moe_buffers(comm, config)
    bufs.recv_x.fill_(NAN)
    bufs.expert_out.fill_(NAN)
    ids = make_ids("uniform", 32, experts, 2, seed, "bad-id", comm.rank)
    if comm.rank == w - 1:
        ids[3, 1] = experts + 5
    x = torch.randn(32, HIDDEN, device="cuda").to(BF16)
    out = torch.full((32, HIDDEN), NAN, dtype=BF16, device="cuda")
    plan = loom.moe_routing(comm, config, ids.cuda(), plan_buffer=bufs.plan_buffer, expert_offsets=bufs.expert_offsets)
    loom.moe_dispatch(comm, plan, x, bufs.recv_x)
    loom.moe_combine(comm, plan, bufs.expert_out, out)
    named = f"rank {w - 1} token 3 slot 1: expert id {experts + 5} is outside"
    with pytest.raises(loom.InvalidArgument, match=named) as info:
        loom.moe_report(comm, plan)
    assert info.value.rank == comm.rank and info.value.op == "moe_report"
    # The exception's traceback holds this frame: dropping it now frees the symmetric buffers at the
    # test's end on every rank alike (not whenever each rank's garbage collector runs), so the
    # heap's offsets stay in step for the next allocations.
    del info
    assert bufs.recv_x.isnan().all() and out.isnan().all()
    assert bufs.expert_offsets.eq(0).all()
    assert comm.health() is None
    ids[3, 1] = 0
    plan = loom.moe_routing(comm, config, ids.cuda(), plan_buffer=bufs.plan_buffer, expert_offsets=bufs.expert_offsets)
    assert loom.moe_report(comm, plan).recv_rows == bufs.expert_offsets[-1].item()


def test_over_capacity_is_reported_on_every_rank(comm, seed):
    """All-to-one with capacity 8 and overflow 'error': the hot rank would receive every token's
    slot 0; every rank's moe_report raises naming the lowest rank over the capacity and its rows,
    and nothing moved."""
    config = small_config(comm, capacity=8)
    ids = make_ids("all-to-one", 32, config.num_experts, 2, seed, "capacity", comm.rank)
    ref = Reference(gather(ids), comm.world_size, config.num_experts, 8)
    over = next(d for d, rows in enumerate(ref.recv_rows) if rows > 8)
    bufs = lt.moe_buffers(comm, config)
    bufs.recv_x.fill_(NAN)
    plan = loom.moe_routing(comm, config, ids.cuda(), plan_buffer=bufs.plan_buffer, expert_offsets=bufs.expert_offsets)
    loom.moe_dispatch(comm, plan, torch.randn(32, HIDDEN, device="cuda").to(BF16), bufs.recv_x)
    with pytest.raises(loom.InvalidArgument,
                       match=f"rank {over} would receive {ref.recv_rows[over]} rows, more than the capacity 8"):
        loom.moe_report(comm, plan)
    assert bufs.recv_x.isnan().all() and bufs.expert_offsets.eq(0).all()
    assert comm.health() is None


def test_across_nodes_combine_rules(comm, seed):
    """Across (emulated) nodes combine refuses, before launching, a plan whose dispatch did not run
    last (loom.InvalidArgument) and weights of its own (loom.Unsupported); after the dispatch the
    same call works."""
    if comm.num_nodes == 1:
        pytest.skip("one node: combine needs no dispatch and takes any weights")
    w = comm.world_size
    config = loom.MoeConfig(num_experts=EXPERTS_PER_RANK * w, top_k=2, hidden=HIDDEN, dtype=BF16, max_tokens=32)
    bufs = lt.moe_buffers(comm, config)
    g = generator(seed, "across-nodes", comm.rank)
    ids = torch.stack([torch.randperm(EXPERTS_PER_RANK * w, generator=g)[:2] for _ in range(32)]).to(torch.int32)
    x = torch.randn(32, HIDDEN, generator=g).to(BF16).cuda()
    out = torch.full((32, HIDDEN), NAN, dtype=BF16, device="cuda")
    plan = loom.moe_routing(comm, config, ids.cuda(), plan_buffer=bufs.plan_buffer, expert_offsets=bufs.expert_offsets)
    with pytest.raises(loom.InvalidArgument, match="call moe_dispatch or moe_dispatch_gemm with this MoePlan first"):
        loom.moe_combine(comm, plan, bufs.expert_out, out)
    loom.moe_dispatch(comm, plan, x, bufs.recv_x)
    comm.synchronize()  # before the torch calls below (see test_bad_tensors_are_refused_before_launch)
    with pytest.raises(loom.Unsupported, match="topk_weights"):
        loom.moe_combine(comm, plan, bufs.expert_out, out, topk_weights=torch.ones(32, 2, device="cuda"))
    bufs.expert_out.copy_(bufs.recv_x)  # identity experts: out = sum of the routing's weights (1) x the token
    loom.moe_combine(comm, plan, bufs.expert_out, out)
    comm.synchronize()
    expected = (x.float() * 2).to(BF16)  # two slots of weight 1, both kept (default capacity)
    assert torch.equal(out, expected), "combine across nodes of identity experts is not 2 x the token"
    assert comm.health() is None


# ---- moe_topk (one GPU; every rank on its own) -----------------------------------------------------

TOPK_TOKENS, TOPK_EXPERTS, TOPK_K = 300, 64, 8
NEG_INF = float("-inf")


def topk_reference(logits, k, scoring, renormalize):
    """moe.h's moe_topk on the CPU: ids by (logit desc, expert id asc) over the finite logits, -1
    past them (the order made here, not torch.topk's); weights in fp64 from the logits as the GPU
    reads them (rounded to their dtype, then fp32): softmax over all E or sigmoid, divided by the
    token's sum of its k weights when renormalize, 0 in -1 slots."""
    v = logits.float().cpu().double()
    tokens, experts = v.shape
    ids = torch.full((tokens, k), -1, dtype=torch.int32)
    for t, row in enumerate(v.tolist()):
        order = sorted((e for e in range(experts) if row[e] != NEG_INF), key=lambda e: (-row[e], e))[:k]
        if order:
            ids[t, :len(order)] = torch.tensor(order, dtype=torch.int32)
    scores = torch.softmax(v, dim=1) if scoring == "softmax" else torch.sigmoid(v)  # NaN on an all -inf row
    used = ids >= 0
    w = torch.where(used, scores.gather(1, ids.clamp(min=0).long()), torch.zeros((), dtype=torch.float64))
    if renormalize:
        total = w.sum(dim=1, keepdim=True)
        w = torch.where(total > 0, w / total, w)
    return ids, w


def topk_logits(seed, salt, rank, dtype):
    """[TOPK_TOKENS, TOPK_EXPERTS] randn logits of `dtype` on this rank's GPU; row 0 has 3 finite
    logits (the rest -inf), row 1 none, row 2 all equal (ties throughout: ids 0 .. k-1)."""
    logits = torch.randn(TOPK_TOKENS, TOPK_EXPERTS, generator=generator(seed, salt, rank)).to(dtype)
    logits[0] = NEG_INF
    logits[0, [5, 17, 40]] = torch.tensor([0.5, 2.0, -1.0]).to(dtype)
    logits[1] = NEG_INF
    logits[2] = 0.25
    return logits.cuda()


@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renormalized"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_moe_topk(comm, seed, dtype, scoring, renormalize):
    """loom.torch.moe_topk and loom.moe_topk (explicit outputs, on a side stream) against
    topk_reference; both give the same bits."""
    logits = topk_logits(seed, f"topk-{dtype}-{scoring}-{renormalize}", comm.rank, dtype)
    ref_ids, ref_w = topk_reference(logits, TOPK_K, scoring, renormalize)
    ids, weights = lt.moe_topk(logits, TOPK_K, scoring=scoring, renormalize=renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == FP32
    assert ids.shape == weights.shape == (TOPK_TOKENS, TOPK_K) and ids.device == weights.device == logits.device
    ids, weights = ids.cpu(), weights.cpu().double()
    wrong = (ids != ref_ids).any(dim=1).nonzero().flatten().tolist()
    assert not wrong, f"ids differ from (logit desc, id asc) in rows {wrong[:8]}: got {ids[wrong[0]].tolist()}, " \
                      f"expected {ref_ids[wrong[0]].tolist()} (logits {logits[wrong[0]].float().tolist()})"
    assert ids[0].tolist() == [17, 5, 40] + [-1] * (TOPK_K - 3) and ids[1].eq(-1).all()
    assert ids[2].tolist() == list(range(TOPK_K))
    unused = ref_ids < 0
    assert weights[unused].eq(0).all(), "slots without an expert must weigh exactly 0"
    err = ((weights - ref_w).abs() / ref_w.abs())[~unused]
    assert err.max().item() <= 1e-5, f"weights off by {err.max().item():.3g} relative"

    # The explicit-output call on another stream (NaN / garbage-filled outputs are overwritten).
    out_ids = torch.full((TOPK_TOKENS, TOPK_K), 12345, dtype=torch.int32, device="cuda")
    out_w = torch.full((TOPK_TOKENS, TOPK_K), NAN, dtype=FP32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    got = loom.moe_topk(logits, out_ids, out_w, top_k=TOPK_K, scoring=scoring, renormalize=renormalize, stream=side)
    assert got[0] is out_ids and got[1] is out_w
    side.synchronize()
    assert torch.equal(out_ids.cpu(), ids) and torch.equal(bits(out_w).cpu(), bits(weights.float()))


def test_moe_topk_refusals(comm):
    """Refused before launch on GPU tensors: loom's own range checks (k > E, k > 32) and the
    binding's shape checks; the outputs stay untouched."""
    logits = torch.randn(16, 4, device="cuda")
    ids = torch.full((16, 8), 7, dtype=torch.int32, device="cuda")
    w = torch.zeros(16, 8, device="cuda")
    with pytest.raises(loom.InvalidArgument, match=r"moe_topk: top_k 8 is outside \[1, min\(E, 32\)\]"):
        loom.moe_topk(logits, ids, w, top_k=8)
    with pytest.raises(loom.InvalidArgument, match="top_k 33 is outside"):
        lt.moe_topk(torch.randn(16, 64, device="cuda"), 33)
    with pytest.raises(loom.InvalidArgument, match="topk_ids must be"):
        loom.moe_topk(logits, ids, w, top_k=2)  # outputs [16, 8] for k = 2
    with pytest.raises(loom.InvalidArgument, match="scoring 'tanh'"):
        lt.moe_topk(logits, 2, scoring="tanh")
    torch.cuda.synchronize()
    assert ids.eq(7).all()


# ---- the operators: torch.ops.loom.moe_layer (loom.torch.moe_layer_from_topk) and moe_topk ---------
# Last in the file: test_moe_layer_op_in_a_cuda_graph captures MoE calls, which pins loom's MoE
# workspace (it cannot grow for a larger config afterwards). Every test here uses one config per
# dtype (E = 4 W, top_k 4, hidden 256, max_tokens 256, I = 192), and test_moe_layer_shared_expert
# adds the bf16 one with a shared expert, so loom.torch's MoE buffer cache holds at most three
# entries.

def require_layer(comm):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("moe_layer needs an sm_90 GPU")


def op_inputs(comm, seed, salt, dtype=BF16, *, weighted=True, rank0_empty=False):
    """This rank's x, topk_ids, topk_weights (None unless weighted), gate_up and down on the GPU, as
    test_moe_layer draws them (T = 128 + 37 (rank mod 3), 0 on rank 0 with rank0_empty)."""
    w, me = comm.world_size, comm.rank
    experts = EXPERTS_PER_RANK * w
    tokens = 0 if rank0_empty and me == 0 else 128 + 37 * (me % 3)
    ids = make_ids("skewed", tokens, experts, TOP_K, seed, salt, me)
    g = generator(seed, salt + "-rows", me)
    router_weights = torch.rand(tokens, TOP_K, generator=g)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    gate, up, down = layer_weights(seed, salt, experts, dtype)
    mine = slice(me * EXPERTS_PER_RANK, (me + 1) * EXPERTS_PER_RANK)
    return (x.cuda(), ids.cuda(), router_weights.cuda() if weighted else None,
            lt.swiglu_weights(gate[mine], up[mine]).to(dtype).cuda(), down[mine].to(dtype).cuda())


def layer_op(comm, x, ids, weights, gate_up, down):
    return lt.moe_layer_from_topk(comm, x, ids, weights, gate_up, down, num_experts=EXPERTS_PER_RANK * comm.world_size,
                                  max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("dtype,weighted,rank0_empty", [(BF16, True, False), (FP16, False, False), (BF16, True, True)],
                         ids=["bf16", "fp16-unweighted", "bf16-rank0-empty"])
def test_moe_layer_op_equals_the_plan_path(comm, seed, dtype, weighted, rank0_empty):
    """torch.ops.loom.moe_layer gives the bits of loom.moe_routing + loom.torch.moe_layer on the
    same inputs (both on the planner's tile); a second call reuses the cached buffers."""
    require_layer(comm)
    x, ids, weights, gate_up, down = op_inputs(comm, seed, f"op-{dtype}-{weighted}-{rank0_empty}", dtype,
                                               weighted=weighted, rank0_empty=rank0_empty)
    config = loom.MoeConfig(num_experts=EXPERTS_PER_RANK * comm.world_size, top_k=TOP_K, hidden=HIDDEN, dtype=dtype,
                            max_tokens=MAX_TOKENS)
    bufs = lt.moe_buffers(comm, config, hidden_intermediate=INTERMEDIATE)
    plan = loom.moe_routing(comm, config, ids, topk_weights=weights, plan_buffer=bufs.plan_buffer,
                            expert_offsets=bufs.expert_offsets)
    expected = lt.moe_layer(comm, plan, x, gate_up, down, bufs)
    got = layer_op(comm, x, ids, weights, gate_up, down)
    entries = len(comm._moe_layer_buffers)
    again = torch.ops.loom.moe_layer(lt.handle(comm), x, ids, weights, gate_up, down, EXPERTS_PER_RANK * comm.world_size,
                                     MAX_TOKENS, 0, "error")
    comm.synchronize()
    assert len(comm._moe_layer_buffers) == entries <= 3  # the second call reused this config's entry
    assert got.shape == (x.shape[0], HIDDEN) and got.dtype == dtype and got.device == x.device
    assert not got.requires_grad
    assert not got.isnan().any(), "the op left token rows unwritten"
    assert torch.equal(bits(got), bits(expected)), "torch.ops.loom.moe_layer differs from moe_routing + moe_layer"
    assert torch.equal(bits(again), bits(expected)), "the second call (cached buffers) differs"
    if x.shape[0]:
        reference = layer_reference(x.cpu(), ids.cpu(), weights.cpu() if weighted else torch.ones(x.shape[0], TOP_K),
                                    *(t.cpu() for t in layer_weights(seed, f"op-{dtype}-{weighted}-{rank0_empty}",
                                                                     EXPERTS_PER_RANK * comm.world_size, dtype)),
                                    dtype)
        assert rel_err(got.cpu(), reference) <= LAYER_TOLERANCE[dtype]


def test_moe_layer_op_input_with_grad(comm, seed):
    """x and the expert weights requiring grad: the same bits, an output without history."""
    require_layer(comm)
    x, ids, weights, gate_up, down = op_inputs(comm, seed, "op-grad")
    expected = layer_op(comm, x, ids, weights, gate_up, down)
    got = layer_op(comm, x.clone().requires_grad_(True), ids, weights, gate_up.clone().requires_grad_(True), down)
    comm.synchronize()
    assert not got.requires_grad and got.grad_fn is None
    assert torch.equal(bits(got), bits(expected))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain", "grad"])
def test_moe_ops_opcheck(comm, seed, requires_grad):
    """Schema, autograd registration, fake functions against the kernels, and torch.compile
    (aot_dispatch_dynamic) for both MoE operators (every rank runs the same checks: moe_layer is
    collective)."""
    require_layer(comm)
    x, ids, weights, gate_up, down = op_inputs(comm, seed, "op-opcheck")
    torch.library.opcheck(torch.ops.loom.moe_layer.default,
                          (lt.handle(comm), x.requires_grad_(requires_grad), ids, weights, gate_up, down,
                           EXPERTS_PER_RANK * comm.world_size, MAX_TOKENS, 0, "error"))
    comm.synchronize()
    logits = topk_logits(seed, "op-opcheck-topk", comm.rank, BF16)
    torch.library.opcheck(torch.ops.loom.moe_topk.default, (logits.requires_grad_(requires_grad), TOPK_K, "sigmoid",
                                                            True))
    torch.cuda.synchronize()


def test_moe_layer_op_under_torch_compile(comm, seed):
    """torch.compile(fullgraph=True) of a function calling the op gives the eager bits."""
    require_layer(comm)
    x, ids, weights, gate_up, down = op_inputs(comm, seed, "op-compile")
    eager = layer_op(comm, x, ids, weights, gate_up, down)
    comm.synchronize()
    # Inductor's first compile (imports, worker pools) on every rank before the compile that ends in
    # a collective call: the ranks then reach it about together, well within loom's op timeout.
    torch.compile(lambda t: t * 2 + 1)(x.float())
    torch.cuda.synchronize()
    dist.barrier()

    experts = EXPERTS_PER_RANK * comm.world_size  # outside: a loom.Communicator's properties are C++ calls

    @torch.compile(fullgraph=True)
    def step(x, ids, weights, gate_up, down):
        return lt.moe_layer_from_topk(comm, x, ids, weights, gate_up, down, num_experts=experts, max_tokens=MAX_TOKENS)

    got = step(x, ids, weights, gate_up, down)
    comm.synchronize()
    assert torch.equal(bits(got), bits(eager)), "torch.compile changed the op's bits"


def test_moe_topk_op_under_torch_compile(comm, seed):
    logits = topk_logits(seed, "op-compile-topk", comm.rank, BF16)
    ids, weights = lt.moe_topk(logits, TOPK_K, renormalize=True)
    got_ids, got_weights = torch.compile(lambda t: lt.moe_topk(t, TOPK_K, renormalize=True), fullgraph=True)(logits)
    torch.cuda.synchronize()
    assert torch.equal(got_ids, ids) and torch.equal(bits(got_weights), bits(weights))


def test_moe_layer_op_in_a_cuda_graph(comm, seed):
    """After one eager call, a CUDA graph captures the op; replayed with new x, topk_ids and
    topk_weights copied into the captured inputs it gives an eager call's bits on them. A first
    call of another config during capture is refused before anything is launched."""
    require_layer(comm)
    x0, ids0, weights0, gate_up, down = op_inputs(comm, seed, "op-graph-0")
    x1, ids1, weights1, _, _ = op_inputs(comm, seed, "op-graph-1")  # the same T per rank, new contents
    static = [x0.clone(), ids0.clone(), weights0.clone()]

    def step(x, ids, weights):
        return layer_op(comm, x, ids, weights, gate_up, down)

    # The eager call first (the op's buffers for this config, loom's workspace), on a side stream
    # as torch recommends before capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = step(*static)
    torch.cuda.current_stream().wait_stream(side)
    comm.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static)
    comm.synchronize()
    captured.fill_(NAN)
    graph.replay()
    comm.synchronize()
    assert torch.equal(bits(captured), bits(first)), "the replay differs from the eager call on the same inputs"

    for replay in range(3):
        for held, new in zip(static, (x1, ids1, weights1) if replay % 2 == 0 else (x0, ids0, weights0)):
            held.copy_(new)
        captured.fill_(NAN)
        graph.replay()
        expected = step(*(t.clone() for t in static))
        comm.synchronize()
        assert torch.equal(bits(captured), bits(expected)), f"replay {replay} differs from the eager call on its inputs"
    assert not torch.equal(bits(layer_op(comm, x1, ids1, weights1, gate_up, down)), bits(first))  # the inputs mattered
    comm.synchronize()

    # Not run eagerly before: refused during capture (nothing launched, on every rank alike).
    refused = torch.cuda.CUDAGraph()
    with torch.cuda.graph(refused):
        with pytest.raises(loom.InvalidArgument, match="cannot be during CUDA graph capture: run it once eagerly first"):
            lt.moe_layer_from_topk(comm, *static, gate_up, down, num_experts=EXPERTS_PER_RANK * comm.world_size,
                                   max_tokens=MAX_TOKENS + 1)
    del refused
    comm.synchronize()
    assert comm.health() is None
