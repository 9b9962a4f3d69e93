"""The job every GPU test module shares: one loom communicator and torch.distributed per process
(created on first use), fresh random inputs, the fp32 references and their tolerances.

Ranks sharing one GPU (LOOM_RANKS_PER_GPU = n > 1, the shared-GPU mode) take GPU LOCAL_RANK mod
the visible GPUs, and torch.distributed runs on gloo there: NCCL refuses two ranks on one GPU, and
the tests exchange only Python objects through it.
"""

import datetime
import os
import random
import zlib

import torch
import torch.distributed as dist

import loom

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# Relative Frobenius error vs an fp32 reference: one output rounding is ~2^-9 (bf16) or ~2^-11
# (fp16) relative per element; decomposed paths round an intermediate too.
GEMM_TOLERANCE = {BF16: 1e-2, FP16: 2e-3, FP32: 1e-4}

_comm = None
_seed = None


def shared_gpu() -> bool:
    return int(os.environ.get("LOOM_RANKS_PER_GPU", "1")) > 1


def start_job() -> "loom.Communicator":
    """This process's communicator (created once), from torch.distributed's world group: the job
    secret travels inside the unique id over the process group."""
    global _comm
    if _comm is None:
        local = int(os.environ["LOCAL_RANK"])
        device = local % torch.cuda.device_count() if shared_gpu() else local
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            # Bounded: a rank that fails between collectives must not leave the others waiting 10 minutes.
            timeout = datetime.timedelta(seconds=90)
            if shared_gpu():
                dist.init_process_group("gloo", timeout=timeout)
            else:
                dist.init_process_group("nccl", device_id=torch.device("cuda", device), timeout=timeout)
        _comm = loom.Communicator.from_env()  # under torchrun with torch.distributed up: from_process_group
    return _comm


def job_seed() -> int:
    """This job's random seed: rank 0 draws it once and every rank gets it (printed by rank 0)."""
    global _seed
    if _seed is None:
        box = [random.SystemRandom().randrange(1 << 30) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        _seed = box[0]
        if dist.get_rank() == 0:
            print(f"\nGPU tests' seed: {_seed}")
    return _seed


def rand(seed, salt, rank, shape, dtype=BF16, scale=1.0):
    """Rank `rank`'s input for `salt`: the same on every rank that asks."""
    g = torch.Generator(device="cuda")
    g.manual_seed((seed * 1_000_003 + zlib.crc32(salt.encode()) * 131 + rank) % (1 << 62))
    return (torch.randn(shape, generator=g, device="cuda", dtype=FP32) * scale).to(dtype)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def tp_inputs(seed, comm, op, m, n, k, layout, dtype):
    """Every rank's (a, b) for `op` over all ranks of the job (the tensor-parallel group spans the
    nodes too), and the fp32 reference of this rank's output."""
    w = comm.world_size
    a_rows = m // w if op == "ag_gemm" else m
    a = [rand(seed, f"{op}a{m}{n}{k}{layout}", r, (a_rows, k), dtype) for r in range(w)]
    b = [rand(seed, f"{op}b{m}{n}{k}{layout}", r, (k, n) if layout == "kn" else (n, k), dtype, scale=k ** -0.5)
         for r in range(w)]
    dense = [bi.float() if layout == "kn" else bi.float().t() for bi in b]
    if op == "ag_gemm":
        ref = torch.cat([ai.float() for ai in a]) @ dense[comm.rank]
    else:
        ref = sum(a[r].float() @ dense[r] for r in range(w))
        if op == "gemm_rs":
            ref = ref.chunk(w)[comm.rank]
    return a[comm.rank], b[comm.rank], ref


def check_ag_gemm_keeps_the_gathered_a(comm, seed, m, n, k):
    """loom.ag_gemm with a symmetric gathered_a (NaN-filled first): it ends holding every rank's
    rows bit for bit, and the output matches the fp32 reference."""
    import loom.torch as lt

    nan = float("nan")
    a, b, ref = tp_inputs(seed, comm, "ag_gemm", m, n, k, "kn", BF16)
    gathered = lt.empty(comm, (m, k), BF16).fill_(nan)
    out = torch.full((m, n), nan, dtype=BF16, device="cuda")
    loom.ag_gemm(comm, a, b, out, gathered_a=gathered)
    comm.synchronize()
    full_a = torch.cat([rand(seed, f"ag_gemma{m}{n}{k}kn", r, (m // comm.world_size, k), BF16)
                        for r in range(comm.world_size)])
    assert torch.equal(gathered, full_a)
    assert rel_err(out, ref) < GEMM_TOLERANCE[BF16]


def poison(comm, *shapes_dtypes):
    """NaN into loom.torch's staging buffers and into blocks torch's allocator hands out next."""
    for buffer in comm._staging.buffers():
        buffer.fill_(float("nan"))
    for shape, dtype in shapes_dtypes:
        torch.full(shape, float("nan"), dtype=dtype, device="cuda")  # freed at once: the next alloc of this size reuses it


def check_tp_op(comm, seed, op, m, n, k, layout, dtype):
    """One tensor-parallel op through the DLPack layer (explicit output, NaN-filled) and through
    loom.torch (staging poisoned): both match the fp32 reference and agree bit for bit."""
    import loom.torch as lt

    a, b, ref = tp_inputs(seed, comm, op, m, n, k, layout, dtype)
    rows = m // comm.world_size if op == "gemm_rs" else m
    if op == "gemm_ar":
        out = lt.empty(comm, (rows, n), dtype).fill_(float("nan"))
    else:
        out = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
    getattr(loom, op)(comm, a, b, out, b_layout=layout)
    comm.synchronize()
    err = rel_err(out, ref)
    assert err < GEMM_TOLERANCE[dtype], (op, m, n, k, err)

    poison(comm, ((rows, n), dtype))
    out2 = getattr(lt, op)(comm, a, b, b_layout=layout)
    comm.synchronize()
    assert out2.shape == (rows, n)
    assert rel_err(out2, ref) < GEMM_TOLERANCE[dtype], (op, m, n, k)
    assert torch.equal(out2, out), "loom.torch and the explicit API disagree"
