"""What the Python benchmarks (attention.py, ring_attention.py, grouped_gemm.py) share: the git sha a
result belongs to, and the timing method (shuffled rounds, CUDA events, median after warm-up)."""

import os
import random
import subprocess


def git_sha():
    """The commit measured: .device-carry/GIT_SHA on the GPU machine (the staged build), else git."""
    here = os.path.dirname(os.path.abspath(__file__))
    sha_file = os.path.join(here, "..", ".device-carry", "GIT_SHA")
    if os.path.exists(sha_file):
        return open(sha_file).read().split()[0]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=here, text=True).strip()
    except Exception:  # noqa: BLE001 - no git on the machine
        return "unknown"


def time_shuffled(candidates, warmup, iters, before_each=None):
    """Median ms of each candidate (name -> callable) over `iters` rounds after `warmup`, every
    round in a fresh random order (the caller seeds `random`; ranks with the same seed run the same
    order). `before_each` runs before every timed call (a barrier across ranks, say)."""
    import torch

    times = {name: [] for name in candidates}
    for rnd in range(warmup + iters):
        order = list(candidates)
        random.shuffle(order)
        for name in order:
            if before_each is not None:
                before_each()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            candidates[name]()
            end.record()
            end.synchronize()
            if rnd >= warmup:
                times[name].append(start.elapsed_time(end))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}
