#!/usr/bin/env python3
"""loom.attention beside torch SDPA's cuDNN and flash backends, in one process on one GPU.

    python3 bench/attention.py --json attention.json            # the default sweep (below)
    python3 bench/attention.py --shapes 1x8192x16x16x128 --causal 1 --iters 30

Default sweep (bf16): B*S = 32K tokens with S 1K, 4K, 8K, 16K, 32K and H*D = 2048 for head dims
64, 128, 256; GQA (B 2, S 8K, 64 query / 8 KV heads, hd128); the ring shapes (B 1, H 32, S 8K and
32K, hd128); each causal and non-causal. A shape is BxSxHxHkvxD (Sq = Sk).

Method: per shape, q, k, v ~ N(0, 1) in loom's [B, S, H, D] layout (torch gets the [B, H, S, D]
views of the same memory); loom's output is checked against an fp32 reference on a sample of query
rows (rel_err, ||out - ref|| / ||ref||). Then --iters rounds, each timing every backend once with
CUDA events in a shuffled order (the GPU's clock and temperature drift alike for all), after
--warmup rounds; the median per backend. TFLOP/s = 4 B H Sq Sk D / time, halved for causal masks.
A backend that refuses a shape gets no time. Rows: {"op": "attention", "dtype", "B", "S", "H",
"H_kv", "D", "causal", "rel_err", "ms": {"loom", "cudnn", "flash"}}; the table is printed last.
Tuning: --tiles MxN,... (BLOCK_M x BLOCK_N, e.g. 128x192 or 192x128) adds loom at other tiles as
columns in the same rounds, each checked against the reference too ("rel_err_variants").
The GPU is idle when each timed call starts, so "ms" counts every backend's host-side work up to
its launch. --queue-behind-us T times every backend a second time, each call queued behind a spin
kernel of about T microseconds (the GPU's work alone, as in a stream of calls or a CUDA graph):
"ms_queued", and a second ratio column; "host_ms" holds each call's median host time.
"""

import argparse
import datetime
import json
import math
import os
import random
import socket
import sys

from bench_common import add_queue_option, git_sha, time_both

DEFAULT_SHAPES = (
    [(32768 // s, s, 2048 // d, 2048 // d, d) for d in (64, 128, 256) for s in (1024, 4096, 8192, 16384, 32768)]
    + [(2, 8192, 64, 8, 128)]
    + [(1, 8192, 32, 32, 128), (1, 32768, 32, 32, 128)]
)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="", help="comma-separated BxSxHxHkvxD (default: the sweep above)")
    p.add_argument("--causal", default="0,1", help="masks to run: 0 (non-causal), 1 (causal), or 0,1")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20, help="timed rounds per shape (median; at least 20)")
    p.add_argument("--sample-rows", type=int, default=64, help="query rows per (batch, head) checked in fp32")
    p.add_argument("--max-rel-err", type=float, default=2e-2)
    p.add_argument("--json", default="")
    add_queue_option(p)
    p.add_argument("--shuffle-shapes", action="store_true",
                   help="run the (shape, mask) rows in a fresh random order (A/B runs of two builds: a row's "
                        "place in the sweep, after faster or slower rows, then varies from run to run instead "
                        "of biasing one side); the table and JSON keep the sweep's order")
    p.add_argument("--tiles", default="",
                   help="comma-separated BLOCK_MxBLOCK_N tiles to time as extra columns loom_m<M>n<N> (tuning; "
                        "e.g. 192x128 at head dim 64), each checked against the reference like the default")
    args = p.parse_args()
    if args.iters < 20:
        p.error("--iters must be at least 20 (medians of fewer are noise)")
    shapes = DEFAULT_SHAPES
    if args.shapes:
        shapes = []
        for s in args.shapes.split(","):
            parts = [int(x) for x in s.split("x")]
            if len(parts) != 5:
                p.error(f"shape {s!r}: expected BxSxHxHkvxD")
            shapes.append(tuple(parts))
    args.shapes = shapes
    args.causal = [bool(int(c)) for c in args.causal.split(",") if c != ""]
    raw_tiles = args.tiles
    try:
        args.tiles = [tuple(int(x) for x in t.split("x")) for t in raw_tiles.split(",") if t]
    except ValueError:
        args.tiles = [()]
    if any(len(t) != 2 for t in args.tiles):
        p.error(f"--tiles {raw_tiles!r}: expected MxN,...")
    return args


def case_order(count, shuffle, seed=None):
    """The order the (shape, mask) rows run in: the sweep's, or with `shuffle` a fresh random one."""
    order = list(range(count))
    if shuffle:
        random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little")).shuffle(order)
    return order


def main():
    args = parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    import loom

    torch.manual_seed(0)
    random.seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    dev = torch.device("cuda")

    def reference_rel_err(q, k, v, out, causal, scale):
        """||out - ref|| / ||ref|| over a sample of query rows, the reference in fp32."""
        B, S, H, D = q.shape
        Hkv = k.shape[2]
        idx = torch.randperm(S, device=dev)[: args.sample_rows].sort().values
        qs = q[:, idx].float().permute(0, 2, 1, 3)  # [B, H, n, D]
        kf = k.float().permute(0, 2, 1, 3).repeat_interleave(H // Hkv, dim=1)  # [B, H, S, D]
        vf = v.float().permute(0, 2, 1, 3).repeat_interleave(H // Hkv, dim=1)
        num = den = 0.0
        for h0 in range(0, H, 4):  # a few heads at a time: the scores of a sample are [B, h, n, S]
            s = torch.matmul(qs[:, h0:h0 + 4], kf[:, h0:h0 + 4].transpose(-1, -2)) * scale
            if causal:
                mask = torch.arange(S, device=dev)[None, :] > idx[:, None]
                s = s.masked_fill(mask, float("-inf"))
            ref = torch.matmul(torch.softmax(s, dim=-1), vf[:, h0:h0 + 4])
            got = out[:, idx].float().permute(0, 2, 1, 3)[:, h0:h0 + 4]
            num += float((got - ref).pow(2).sum())
            den += float(ref.pow(2).sum())
        return math.sqrt(num / den)

    cases = [(shape, causal) for shape in args.shapes for causal in args.causal]
    done = {}  # case index -> its row
    for i in case_order(len(cases), args.shuffle_shapes):
        (B, S, H, Hkv, D), causal = cases[i]
        q = torch.randn(B, S, H, D, device=dev, dtype=dtype)
        k = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype)
        v = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype)
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(B, H, S, device=dev, dtype=torch.float32)
        scale = 1.0 / math.sqrt(D)
        loom.attention(q, k, v, out, lse=lse, causal=causal)
        torch.cuda.synchronize()
        rel_err = reference_rel_err(q, k, v, out, causal, scale)
        if not (rel_err <= args.max_rel_err):
            print(f"attention.py: loom's output is off for {(B, S, H, Hkv, D, causal)}: rel_err {rel_err:.3g}",
                  file=sys.stderr)

        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D] views
        gqa = H != Hkv

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,
                                                          enable_gqa=gqa)
            return run

        candidates = {
            "loom": lambda: loom.attention(q, k, v, out, lse=lse, causal=causal),
            "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "flash": sdpa(SDPBackend.FLASH_ATTENTION),
        }
        for bm, bn in args.tiles:
            candidates[f"loom_m{bm}n{bn}"] = (lambda bm=bm, bn=bn: loom.attention(
                q, k, v, out, lse=lse, causal=causal, block_m=bm, block_n=bn))
        extra_err = {}
        backends = {}
        for name, fn in candidates.items():
            try:
                if name.startswith("loom_"):  # a tuning variant: its output checked like the default's
                    out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                if name.startswith("loom_"):
                    extra_err[name] = reference_rel_err(q, k, v, out, causal, scale)
                    if not (extra_err[name] <= args.max_rel_err):
                        print(f"attention.py: {name}'s output is off for {(B, S, H, Hkv, D, causal)}: rel_err "
                              f"{extra_err[name]:.3g}", file=sys.stderr)
                        rel_err = max(rel_err, extra_err[name])
                backends[name] = fn
            except Exception as e:  # noqa: BLE001 - a backend that refuses the shape gets no time
                print(f"attention.py: {name} refused {(B, S, H, Hkv, D, causal)}: {str(e).splitlines()[0][:160]}",
                      file=sys.stderr)
        timing = time_both(backends, args.warmup, args.iters, args.queue_behind_us)
        ms = timing["ms"]
        done[i] = {"op": "attention", "dtype": args.dtype, "B": B, "S": S, "H": H, "H_kv": Hkv, "D": D,
                   "causal": causal, "rel_err": rel_err, **timing,
                   **({"rel_err_variants": extra_err} if extra_err else {})}
        print(f"[{len(done)}] B{B} S{S} H{H}/{Hkv} D{D} {'causal' if causal else 'full'}: "
              + " ".join(f"{n} {t:.3f} ms" for n, t in ms.items()) + f" rel_err {rel_err:.2e}", flush=True)
        del q, k, v, out, lse
        torch.cuda.empty_cache()

    rows = [done[i] for i in sorted(done)]  # the sweep's order, however they ran
    result = {"git_sha": git_sha(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "host": socket.gethostname(), "world": 1, "nodes": 1,
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "command": " ".join(sys.argv), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    def tflops(r, t):
        flops = 4.0 * r["B"] * r["H"] * r["S"] * r["S"] * r["D"] * (0.5 if r["causal"] else 1.0)
        return flops / (t * 1e-3) / 1e12

    columns = ["loom", "cudnn", "flash"] + [f"loom_m{bm}n{bn}" for bm, bn in args.tiles]
    def cudnn_over_loom(t):
        return t["cudnn"] / t["loom"] if "cudnn" in t and "loom" in t else float("nan")

    queued = args.queue_behind_us > 0
    print(f"\n{'shape':<30}{'mask':<8}" + "".join(f"{c:>10}" for c in columns) + f"{'loom/cudnn':>12}"
          + (f"{'queued':>8}" if queued else "") + f"{'rel_err':>10}")
    for r in rows:
        cells = [f"{tflops(r, r['ms'][n]):10.0f}" if n in r["ms"] else f"{'-':>10}" for n in columns]
        shape = f"B{r['B']} S{r['S']} H{r['H']}/{r['H_kv']} D{r['D']}"
        print(f"{shape:<30}{'causal' if r['causal'] else 'full':<8}{''.join(cells)}{cudnn_over_loom(r['ms']):12.3f}"
              + (f"{cudnn_over_loom(r['ms_queued']):8.3f}" if queued else "") + f"{r['rel_err']:10.2e}")
    print("(TFLOP/s; loom/cudnn = cuDNN time / loom time" + ("; queued: the same from ms_queued" if queued else "")
          + ")")
    bad = [r for r in rows if not (r["rel_err"] <= args.max_rel_err)]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
