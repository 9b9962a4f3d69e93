"""Bootstrap between processes: a unique id made by one process is used by others. On a machine
without a GPU every rank must fail with a clean exception that names the reason, within a bounded
time, never hang. Every multi-process test has a wall-clock limit (pytest-timeout and join
deadlines)."""

import multiprocessing as mp
import os
import time

import pytest

import loom

pytestmark = pytest.mark.timeout(90)

# A rank that hangs would be killed at this deadline and fail the test.
JOIN_DEADLINE_S = 60


def has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return os.path.exists("/dev/nvidiactl")


no_gpu_only = pytest.mark.skipif(has_gpu(), reason="checks the no-GPU failure; the GPU suite creates real communicators")


def rank_main(rank: int, world: int, uid_queue, results, bootstrap_timeout_ms: int) -> None:
    start = time.monotonic()
    try:
        if rank == 0:
            uid = loom.make_unique_id("127.0.0.1")
            for _ in range(world - 1):
                uid_queue.put(uid)
        else:
            uid = uid_queue.get(timeout=30)
        comm = loom.Communicator.from_unique_id(uid, rank, world, bootstrap_timeout_ms=bootstrap_timeout_ms)
        results.put((rank, "ok", repr(comm), time.monotonic() - start))
        comm.close()
    except Exception as error:  # the test inspects it
        results.put((rank, type(error).__name__, str(error), time.monotonic() - start))


def run_ranks(world: int, bootstrap_timeout_ms: int = 5000) -> dict:
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank, as torchrun would give
    uid_queue, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, uid_queue, results, bootstrap_timeout_ms))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_DEADLINE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} did not finish within {JOIN_DEADLINE_S} s"
    out = {}
    while len(out) < world:
        rank, kind, message, seconds = results.get(timeout=5)
        out[rank] = (kind, message, seconds)
    return out


@no_gpu_only
@pytest.mark.parametrize("world", [2, 3])
def test_unique_id_ranks_fail_cleanly_without_a_gpu(world):
    results = run_ranks(world)
    for rank, (kind, message, seconds) in sorted(results.items()):
        assert kind == "Unsupported", (rank, kind, message)
        assert f"loom rank {rank}: Communicator.from_unique_id:" in message
        assert "no CUDA GPU" in message
        assert seconds < 30, f"rank {rank} took {seconds:.1f} s to fail"


def torchrun_rank_main(rank: int, env: dict, results) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    start = time.monotonic()
    try:
        loom.Communicator.from_env(bootstrap_timeout_ms=20_000)
        results.put((rank, "ok", "", time.monotonic() - start))
    except Exception as error:  # the test inspects it
        results.put((rank, type(error).__name__, str(error), time.monotonic() - start))


@no_gpu_only
def test_from_env_under_torchrun_passes_the_unique_id_through_the_store():
    """Under torchrun MASTER_PORT is torch's store (here: one the test serves, as torchrun's agent
    would); rank 0's unique id reaches rank 1 through it, and then both fail on the missing GPU in
    from_unique_id (not in the exchange)."""
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_RUN_ID": "loom-test", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=torchrun_rank_main, args=(r, env, results)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_DEADLINE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} did not finish within {JOIN_DEADLINE_S} s"
    out = dict((r, (k, m, t)) for r, k, m, t in (results.get(timeout=5) for _ in range(2)))
    for rank, (kind, message, seconds) in sorted(out.items()):
        assert kind == "Unsupported", (rank, kind, message)
        assert f"loom rank {rank}: Communicator.from_unique_id: no CUDA GPU" in message, message
        assert seconds < 30
    assert len(store.get("loom/unique_id/0/1")) == 128


def test_from_env_under_torchrun_times_out_when_rank_0_never_shows(monkeypatch):
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in {"TORCHELASTIC_RUN_ID": "loom-test-timeout", "RANK": "1", "LOCAL_RANK": "1",
                        "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(loom.Timeout, match="loom rank 1: Communicator.from_env: rank 0's unique id did not arrive"):
        loom.Communicator.from_env(bootstrap_timeout_ms=1500)
    assert time.monotonic() - start < 15


@no_gpu_only
def test_from_env_fails_cleanly_without_a_gpu(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    start = time.monotonic()
    with pytest.raises(loom.Unsupported, match="loom rank 0: Communicator.from_env: no CUDA GPU"):
        loom.Communicator.from_env()
    assert time.monotonic() - start < 30


def test_from_env_names_the_missing_variable(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(loom.InvalidArgument, match="WORLD_SIZE is not set"):
        loom.Communicator.from_env()


def test_unique_id_is_128_opaque_bytes_that_pickle():
    import pickle

    uid = loom.make_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    assert pickle.loads(pickle.dumps(uid)) == uid
    assert loom.make_unique_id() != uid  # fresh port and secret each time


def test_unique_id_arguments_are_checked_before_any_work():
    uid = loom.make_unique_id()
    with pytest.raises(loom.InvalidArgument, match="must be 128 bytes"):
        loom.Communicator.from_unique_id(uid[:100], 0, 2)
    with pytest.raises(loom.InvalidArgument, match=r"rank 2 is outside \[0, 2\)"):
        loom.Communicator.from_unique_id(uid, 2, 2)
    with pytest.raises(loom.InvalidArgument, match="world_size must be >= 1"):
        loom.Communicator.from_unique_id(uid, 0, 0)
    with pytest.raises(loom.InvalidArgument, match="unique_id must be the bytes"):
        loom.Communicator.from_unique_id("not bytes", 0, 2)


def test_make_unique_id_refuses_the_wildcard_address():
    with pytest.raises(loom.InvalidArgument, match="wildcard"):
        loom.make_unique_id("0.0.0.0")


def test_make_unique_id_unresolvable_host_fails_cleanly():
    start = time.monotonic()
    with pytest.raises(loom.LoomError, match="make_unique_id"):
        loom.make_unique_id("no-such-host.invalid")
    assert time.monotonic() - start < 30
