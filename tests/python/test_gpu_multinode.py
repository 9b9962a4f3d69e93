"""GPU suite across (emulated) nodes: every rank of
`LOOM_EMULATE_NODES=2 torchrun --nproc-per-node 4 -m pytest tests/python -m gpu` runs it
(scripts/device/python_suite.sh); skipped on a single-node job and without GPUs.

The tensor-parallel ops split M (ag_gemm, gemm_rs) or K (gemm_rs, gemm_ar) over every rank of the
job, W = nodes x GPUs per node: rank r owns row block r. Each op runs through both layers, the
DLPack one (`loom.<op>`, explicit outputs pre-filled with NaN) and `loom.torch` (staging NaN-filled
first), against an fp32 reference of this rank's output; both must agree bit for bit. The
collectives stay within one NVLink domain and refuse a multi-node communicator by name.
"""

import os

import pytest

torch = pytest.importorskip("torch")

import loom  # noqa: E402
import loom.torch as lt  # noqa: E402
from gpu_job import BF16, FP16, check_ag_gemm_keeps_the_gathered_a, check_tp_op, job_seed, start_job  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
NAN = float("nan")


@pytest.fixture(scope="module")
def comm():
    c = start_job()
    if c.num_nodes == 1:
        pytest.skip("needs a job of several nodes (LOOM_EMULATE_NODES=2 with 4 ranks, for one)")
    return c


@pytest.fixture(scope="module")
def seed(comm):
    return job_seed()


def test_the_job_spans_nodes(comm):
    nodes = int(os.environ.get("LOOM_EMULATE_NODES", "1"))
    assert comm.num_nodes == max(nodes, 1)
    assert comm.world_size == int(os.environ["WORLD_SIZE"])
    assert comm.local_world_size * comm.num_nodes == comm.world_size
    assert (comm.node, comm.local_rank) == divmod(comm.rank, comm.local_world_size)


# M / W must be a multiple of 128 across nodes (a tile never spans two ranks' blocks).
def tp_cases(world):
    return [(128 * world, 512, 1024), (512 * world, 1024, 256), (256 * world, 136, 2056)]


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("case", [0, 1, 2])
def test_tp_ops_across_nodes(comm, seed, op, layout, dtype, case):
    check_tp_op(comm, seed, op, *tp_cases(comm.world_size)[case], layout, dtype)


def test_ag_gemm_gathers_every_nodes_rows(comm, seed):
    check_ag_gemm_keeps_the_gathered_a(comm, seed, 256 * comm.world_size, 256, 512)


def test_rules_use_the_global_world(comm):
    # M / W not a multiple of 128 across nodes: refused before anything is written, naming the rule.
    w = comm.world_size
    a = torch.zeros(64, 128, dtype=BF16, device="cuda")  # 64 rows per rank
    b = torch.zeros(128, 128, dtype=BF16, device="cuda")
    out = torch.full((64 * w, 128), NAN, dtype=BF16, device="cuda")
    with pytest.raises(loom.Unsupported, match="M/W = 64 rows must be a multiple of 128"):
        loom.ag_gemm(comm, a, b, out)
    assert torch.isnan(out).all(), "a refused call wrote its output"
    # M is W x a's rows (every rank of the job), not the local world's.
    with pytest.raises(loom.InvalidArgument, match=rf"out must be \[M, N\] = \[{64 * w}, 128\]"):
        loom.ag_gemm(comm, a, b, torch.empty(64 * comm.local_world_size, 128, dtype=BF16, device="cuda"))
    comm.synchronize()
    assert comm.health() is None


def test_collectives_refuse_a_multi_node_communicator(comm):
    x = lt.empty(comm, (1024,), BF16).fill_(1.0)
    with pytest.raises(loom.Unsupported, match=f"within one NVLink domain; this job spans {comm.num_nodes} nodes"):
        loom.all_reduce(comm, x)
    comm.synchronize()
    assert comm.health() is None
