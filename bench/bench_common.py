"""What the Python benchmarks (attention.py, ring_attention.py, grouped_gemm.py) share: the git sha a
result belongs to, and the timing method (shuffled rounds, CUDA events, median after warm-up)."""

import functools
import os
import random
import subprocess
import sys


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


@functools.lru_cache(maxsize=None)
def _spin_cycles_per_us():
    """torch.cuda._sleep's cycles per microsecond on this GPU, timed once per process."""
    import torch

    cycles = 2_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def time_shuffled(candidates, warmup, iters, before_each=None, queue_behind_us=0.0, host_ms=None, samples=None):
    """Median ms of each candidate (name -> callable) over `iters` rounds after `warmup`, every
    round in a fresh random order (the caller seeds `random`; ranks with the same seed run the same
    order). `before_each` runs before every timed call (a barrier across ranks, say).

    The GPU is idle when the start event is recorded, so a call's time includes its host-side work
    up to the launch. queue_behind_us > 0 first queues a spin kernel of about that many
    microseconds, so the call is submitted while the GPU is busy and the events time the GPU's work
    alone (as in a stream of calls or a CUDA graph). host_ms: a dict that receives each
    candidate's median host time per call (ms, the Python call itself); samples: a dict that
    receives each candidate's timed rounds (ms, in round order)."""
    import time

    import torch

    spin_cycles = int(queue_behind_us * _spin_cycles_per_us()) if queue_behind_us > 0 else 0
    times = {name: [] for name in candidates}
    host = {name: [] for name in candidates}
    for rnd in range(warmup + iters):
        order = list(candidates)
        random.shuffle(order)
        for name in order:
            if before_each is not None:
                before_each()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if spin_cycles:
                torch.cuda._sleep(spin_cycles)
            start.record()
            t0 = time.perf_counter()
            candidates[name]()
            t1 = time.perf_counter()
            end.record()
            end.synchronize()
            if rnd >= warmup:
                times[name].append(start.elapsed_time(end))
                host[name].append((t1 - t0) * 1e3)
    def medians(per_name):
        return {name: sorted(t)[len(t) // 2] for name, t in per_name.items()}

    host_median = medians(host)
    if samples is not None:
        samples.update(times)
    if host_ms is not None:
        host_ms.update(host_median)
    slow = [name for name, t in host_median.items() if spin_cycles and t * 1e3 > queue_behind_us]
    if slow:
        print(f"time_shuffled: the host took longer than the {queue_behind_us:.0f} us spin to submit "
              f"{', '.join(slow)}: their queued times include host time", file=sys.stderr)
    return medians(times)


def add_queue_option(parser, default=0.0):
    """--queue-behind-us, which time_both reads."""
    parser.add_argument("--queue-behind-us", type=float, default=default,
                        help="also time each call queued behind a spin kernel of this many microseconds (ms_queued: "
                             "the GPU's time without the host's share; 0: skip)")


def time_both(candidates, warmup, iters, queue_behind_us=0.0, before_each=None):
    """A row's timing fields: "ms" (time_shuffled from an idle GPU) and "host_ms" (each call's host
    time), plus "ms_queued" (the same candidates queued behind a spin kernel) when queue_behind_us > 0."""
    host_ms = {}
    fields = {"ms": time_shuffled(candidates, warmup, iters, before_each, host_ms=host_ms), "host_ms": host_ms}
    if queue_behind_us > 0:
        fields["ms_queued"] = time_shuffled(candidates, warmup, iters, before_each, queue_behind_us=queue_behind_us)
    return fields
