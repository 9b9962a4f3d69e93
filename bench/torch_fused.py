#!/usr/bin/env python3
"""PyTorch's fused tensor-parallel ops, timed on the shapes loom-bench uses (the `torch_fused` baseline).

    torchrun --nproc-per-node 2 bench/torch_fused.py --json torch_fused.json
    python3 -m torch.distributed.run --nproc-per-node 2 bench/torch_fused.py --m-values 4096,16384 --ops ag_gemm

  ag_gemm  torch.ops.symm_mem.fused_all_gather_matmul(A_shard [M/W, K], [B [K, N]], 0, group, return_A=False)
  gemm_rs  torch.ops.symm_mem.fused_matmul_reduce_scatter(A [M, K/W], B [K/W, N], "sum", 0, group)
(PyTorch has no fused matmul + all-reduce; gemm_ar rows have no torch_fused time.)

Each shape: one call checked against all_gather + matmul / matmul + reduce_scatter in fp32 (rel_err in the
row), then CUDA-event timing of every call after warm-up; the median per rank, the maximum over ranks
(all_reduce MAX). Rank 0 writes {"rows": [{"op", "M", "N", "K", "ms", ...}]} where K is the global K
(gemm_rs: each rank holds K/W), matching loom-bench's rows; bench/merge_results.py joins them.

With --loom (needs the loom package, e.g. PYTHONPATH from scripts/device/build_python_ext.sh) loom's op
runs in the same process on the same inputs, checked against the same reference, and the two are timed
in --iters rounds of one call each, back to back in a shuffled order (the same on every rank), so both
see the same clocks and temperature and neither always follows the other: the row gains "loom_ms" and
"rel_err_loom". A GPU under sustained load slows down by 10-15 %, and the call after a lighter one runs
faster, so times taken minutes apart, or in a fixed order, are not a fair ratio; these are.

Never hangs silently: collectives get --timeout-s, and a watchdog ends the process (with every thread's
stack) after --deadline-s. NVLink multicast stays off (docs/BENCHMARKS.md, "Method").
"""

import os

# Before torch.distributed is imported: no NVLink multicast anywhere (it can take shared GPUs out of
# service), whatever the caller's environment says.
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse
import datetime
import faulthandler
import json
import math
import random
import socket
import sys
import warnings

ISSUE_SHAPES = {  # op -> (N, global K): issue 4
    "ag_gemm": (14336, 8192),
    "gemm_rs": (8192, 14336),
}
DEFAULT_M = [1024, 2048, 4096, 8192, 16384, 32768]


def fail(message, code=2):
    print(f"torch_fused.py: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="ag_gemm,gemm_rs", help="comma-separated: ag_gemm, gemm_rs")
    # Not --m alone: under torchrun, argparse would take it for an abbreviation of torchrun's --max-restarts.
    p.add_argument("--m-values", "--m", dest="m", default=",".join(map(str, DEFAULT_M)),
                   help="comma-separated global M values")
    p.add_argument("--n", type=int, default=0, help="N (default: the issue's per op)")
    p.add_argument("--k", type=int, default=0, help="global K (gemm_rs: split over the ranks; default: the issue's)")
    p.add_argument("--layout", choices=["nk", "kn"], default="nk",
                   help="B as an nn.Linear weight [N, K] (passed transposed) or a [K, N] matrix")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30, help="timed calls per shape (median reported; at least 20)")
    p.add_argument("--json", default="", help="write the rows here (rank 0)")
    p.add_argument("--timeout-s", type=float, default=120, help="timeout of every torch.distributed collective")
    p.add_argument("--deadline-s", type=float, default=540, help="watchdog: end the process after this long")
    p.add_argument("--max-rel-err", type=float, default=2e-2, help="fail when a result is further off than this")
    p.add_argument("--loom", action="store_true",
                   help="also time loom's op on the same inputs, alternating with torch's in every round")
    args = p.parse_args()
    args.ops = [o for o in args.ops.split(",") if o]
    for op in args.ops:
        if op not in ISSUE_SHAPES:
            fail(f"unknown op '{op}' (torch has fused ag_gemm and gemm_rs only)")
    try:
        args.m = [int(x) for x in args.m.split(",") if x]
    except ValueError:
        fail(f"--m expects integers, got '{args.m}'")
    if args.iters < 1 or args.warmup < 0:
        fail("--iters must be >= 1 and --warmup >= 0")
    return args


def main():
    args = parse_args()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            fail(f"{var} is not set: start this under torchrun, e.g. "
                 "`torchrun --nproc-per-node 2 bench/torch_fused.py` (or python3 -m torch.distributed.run)")
    # A hang anywhere (a peer that died inside a collective, a stuck kernel) ends the process with
    # every thread's stack instead of blocking the caller's time budget.
    faulthandler.dump_traceback_later(args.deadline_s, exit=True)

    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        fail(f"cannot import torch ({e}); this baseline needs PyTorch with CUDA")
    if not torch.cuda.is_available():
        fail("torch sees no CUDA device")
    try:
        import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem.*
    except ImportError as e:
        fail(f"torch {torch.__version__} has no symmetric memory module ({e})")
    for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        if not hasattr(torch.ops.symm_mem, name):
            fail(f"torch {torch.__version__} lacks torch.ops.symm_mem.{name}")

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if world < 2:
        fail("needs at least two ranks (--nproc-per-node 2)")
    if torch.cuda.device_count() <= local_rank:
        fail(f"rank {rank}: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices are visible")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.timeout_s), device_id=device)
    group = dist.group.WORLD
    group_name = group.group_name
    # Older releases need the group registered for symmetric memory; newer ones deprecate the call.
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group_name)

    comm = None
    if args.loom:
        try:
            import loom
        except ImportError as e:
            fail(f"--loom: cannot import loom ({e}); build it with scripts/device/build_python_ext.sh and set PYTHONPATH")
        # The symmetric heap holds loom's workspace: the gathered A (ag_gemm) or the staged
        # partials (gemm_rs), at most M x K elements; twice that leaves room to grow it.
        largest = max(m * (args.k or max(ks for _, ks in ISSUE_SHAPES.values())) for m in args.m)
        heap_bytes = max(1 << 30, 2 * largest * 2 + (256 << 20))
        comm = loom.Communicator.from_process_group(group, heap_bytes=heap_bytes)

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = []
    failures = []
    for op in args.ops:
        n = args.n or ISSUE_SHAPES[op][0]
        k = args.k or ISSUE_SHAPES[op][1]
        for m in args.m:
            row, error = run_shape(torch, dist, group, group_name, op, m, n, k, world, rank, device, dtype, args, comm)
            rows.append(row)
            if error:
                failures.append(error)
            if rank == 0:
                paired = (f"  loom {row['loom_ms']:.4f} ms  rel_err {row['rel_err_loom']:.2e}  torch/loom "
                          f"{row['ms'] / row['loom_ms']:.3f}" if "loom_ms" in row else "")
                print(f"torch_fused {op:8s} {m}x{n}x{k} {args.layout}: {row['ms']:.4f} ms  rel_err {row['rel_err']:.2e}"
                      + paired + (f"  ERROR {error}" if error else ""), flush=True)

    if rank == 0:
        doc = {
            "what": "torch_fused",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": socket.gethostname(),
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "world": world,
            "rows": rows,
        }
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=2)
                f.write("\n")
        print_table(rows)
    dist.barrier()
    if comm is not None:
        comm.close()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    if failures:
        fail("; ".join(failures), code=1)


def run_shape(torch, dist, group, group_name, op, m, n, k, world, rank, device, dtype, args, comm):
    if m % world:
        fail(f"{op}: M = {m} is not a multiple of the {world} ranks")
    if op == "gemm_rs" and k % world:
        fail(f"gemm_rs: the global K = {k} does not split over {world} ranks")
    gen = torch.Generator(device=device)
    gen.manual_seed(1000 * (1 + rank) + m)

    def uniform(*shape):  # random in [-1, 1), never zeros
        return (torch.rand(*shape, generator=gen, device=device, dtype=torch.float32) * 2 - 1).to(dtype)

    k_rank = k if op == "ag_gemm" else k // world
    a = uniform(m // world, k) if op == "ag_gemm" else uniform(m, k_rank)
    # nn.Linear weights are [N, K]; torch's ops take B as [K, N] and accept the transposed view.
    # loom takes the stored matrix and its layout.
    b_stored = uniform(n, k_rank) if args.layout == "nk" else uniform(k_rank, n)
    b = b_stored.t() if args.layout == "nk" else b_stored

    if op == "ag_gemm":
        # Like loom's default, the gathered A is not returned (releases before return_A always return it).
        ag_matmul = torch.ops.symm_mem.fused_all_gather_matmul
        kwargs = {"return_A": False} if "return_A" in str(ag_matmul.default._schema) else {}

        def call():
            return ag_matmul(a, [b], 0, group_name, **kwargs)[1][0]

        gathered = torch.empty(m, k, device=device, dtype=dtype)
        dist.all_gather_into_tensor(gathered, a, group=group)
        reference = gathered.float() @ b.float()
    else:
        def call():
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)

        partial = a.float() @ b.float()
        reference = torch.empty(m // world, n, device=device, dtype=torch.float32)
        dist.reduce_scatter_tensor(reference, partial, group=group)
        del partial

    def checked_rel_err(out):
        if tuple(out.shape) != tuple(reference.shape):
            fail(f"{op} {m}x{n}x{k}: returned shape {tuple(out.shape)}, expected {tuple(reference.shape)}", code=1)
        err = (out.float() - reference).norm().item() / max(reference.norm().item(), 1e-30)
        # One verdict for all ranks, so no rank stops while the others wait in a collective.
        err_t = torch.tensor([err if math.isfinite(err) else 1e30], device=device)
        dist.all_reduce(err_t, op=dist.ReduceOp.MAX, group=group)
        return err_t.item()

    out = call()
    torch.cuda.synchronize()
    rel_err = checked_rel_err(out)
    del out
    calls = [call]
    rel_err_loom = None
    if comm is not None:
        import loom
        rows_out = m if op == "ag_gemm" else m // world
        loom_out = torch.full((rows_out, n), float("nan"), device=device, dtype=dtype)  # unwritten -> NaN -> fails
        loom_fn = loom.ag_gemm if op == "ag_gemm" else loom.gemm_rs

        def call_loom():
            return loom_fn(comm, a, b_stored, loom_out, b_layout=args.layout)

        call_loom()
        torch.cuda.synchronize()
        rel_err_loom = checked_rel_err(loom_out)
        calls.append(call_loom)
    del reference

    for fn in calls:
        for _ in range(args.warmup):
            fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    # --iters rounds of one call each, back to back in a shuffled order: the same seed on every rank
    # (the calls are collective), and neither call always follows the other (the call after a
    # lighter one finds a cooler GPU).
    samples = [[] for _ in calls]
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in calls]
    for r in range(args.iters):
        order = list(range(len(calls)))
        random.Random(0x6C6F6F6D + r).shuffle(order)
        for i in order:
            events[i][0].record()
            calls[i]()
            events[i][1].record()
        torch.cuda.synchronize()
        for (start, end), times in zip(events, samples):
            times.append(start.elapsed_time(end))
    medians = []
    for times in samples:
        times.sort()
        median = times[len(times) // 2] if len(times) % 2 else 0.5 * (times[len(times) // 2 - 1] + times[len(times) // 2])
        t = torch.tensor([median], device=device, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        medians.append(t.item())

    row = {
        "op": op, "dtype": args.dtype, "M": m, "N": n, "K": k, "k_per_rank": k_rank, "b_layout": args.layout,
        "ms": medians[0], "rel_err": rel_err, "iters": len(samples[0]), "warmup": args.warmup,
        "impl": "torch.ops.symm_mem." + ("fused_all_gather_matmul(return_A=False)" if op == "ag_gemm"
                                         else "fused_matmul_reduce_scatter"),
    }
    error = None
    if not rel_err <= args.max_rel_err:
        error = f"{op} {m}x{n}x{k}: torch's result is off by rel_err {rel_err:.3g} (limit {args.max_rel_err})"
    if comm is not None:
        row.update({"loom_ms": medians[1], "rel_err_loom": rel_err_loom, "rounds": args.iters})
        if not rel_err_loom <= args.max_rel_err:
            error = (error + "; " if error else "") + \
                f"{op} {m}x{n}x{k}: loom's result is off by rel_err {rel_err_loom:.3g} (limit {args.max_rel_err})"
    return row, error


def print_table(rows):
    paired = any("loom_ms" in r for r in rows)
    print(f"\n{'op':8s} {'M x N x K':22s} {'B':3s} {'torch fused ms':>14s} {'rel_err':>9s}"
          + (f" {'loom ms':>9s} {'rel_err':>9s} {'torch/loom':>10s}" if paired else ""))
    for r in rows:
        shape = f"{r['M']}x{r['N']}x{r['K']}"
        line = f"{r['op']:8s} {shape:22s} {r['b_layout']:3s} {r['ms']:14.4f} {r['rel_err']:9.1e}"
        if "loom_ms" in r:
            line += f" {r['loom_ms']:9.4f} {r['rel_err_loom']:9.1e} {r['ms'] / r['loom_ms']:10.3f}"
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
