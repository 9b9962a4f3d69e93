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


def test_from_env_under_torchrun_needs_a_secret_or_a_process_group(monkeypatch):
    """Fail closed: no secret from public values, and no unique id (which holds the secret) in
    torch's store, which anyone who reaches MASTER_PORT can read."""
    for name, value in {"TORCHELASTIC_RUN_ID": "loom-test", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOOM_SECRET", raising=False)
    with pytest.raises(loom.InvalidArgument, match="loom rank 1: Communicator.from_env: under torchrun without "
                                                   "LOOM_SECRET: initialise torch.distributed first"):
        loom.Communicator.from_env()


def test_from_env_without_a_secret_is_refused_naming_it(monkeypatch):
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29533"}.items():
        monkeypatch.setenv(name, value)
    for name in ("LOOM_SECRET", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    # The C++ layer refuses before it looks for a GPU or connects to anyone.
    with pytest.raises(loom.InvalidArgument, match="loom rank 1: Communicator.from_env: LOOM_SECRET is not set: a job "
                                                   "of 2 ranks needs a secret"):
        loom.Communicator.from_env()


@pytest.mark.parametrize("kwargs,match", [
    ({"op_timeout_ms": -1}, r"CommOptions::op_timeout = -1 ms is outside \[0, 86400000\]"),
    ({"bootstrap_timeout_ms": 1 << 62}, r"CommOptions::bootstrap_timeout = 4611686018427387904 ms is outside"),
    ({"heap_bytes": 1000}, r"CommOptions::heap_bytes = 1000 is outside \[1 MiB, 1 TiB\]"),
    ({"heap_bytes": -1}, r"heap_bytes = -1 does not fit its C\+\+ field \[0, 18446744073709551615\]"),
    ({"op_timeout_ms": 1.5}, "op_timeout_ms must be an int, got float"),
    ({"device": -2}, "CommOptions::device = -2: -1 picks LOCAL_RANK"),
])
def test_creation_options_are_checked(kwargs, match):
    with pytest.raises(loom.InvalidArgument, match=match):
        loom.Communicator.from_env(**kwargs)


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


def test_discard_unique_id_closes_its_listener():
    import socket
    import struct

    uid = loom.make_unique_id()
    port = struct.unpack_from("<H", uid, 6)[0]  # layout: magic u32 | version u16 | port u16 | ...
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # listening
    loom.discard_unique_id(uid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    loom.discard_unique_id(uid)  # a second time: nothing to close, no error
    with pytest.raises(loom.InvalidArgument, match="must be 128 bytes"):
        loom.discard_unique_id(uid[:10])


def test_unused_unique_ids_are_capped():
    made = []
    try:
        with pytest.raises(loom.InvalidArgument, match="unique ids of this process are still listening, unused"):
            for _ in range(100):
                made.append(loom.make_unique_id())
        assert len(made) <= 64
    finally:
        for uid in made:
            loom.discard_unique_id(uid)
    loom.discard_unique_id(loom.make_unique_id())  # room again
