#!/usr/bin/env python3
"""Where ring attention's W = 1 overhead comes from: the ring call and the attention engine alone on
the same q, k, v of one GPU, each with and without the LSE (and at hd64 BLOCK_N 128 beside the default), in
shuffled rounds (median of --iters after warm-up). Each variant is timed twice in its own shuffled rounds:
"ms" with the GPU idle when the call starts (its host-side work up to the launch counted, as in every
loom benchmark) and "ms_queued" submitted behind a spin kernel of --queue-behind-us (the GPU's work
alone, as in a stream of calls or a CUDA graph); "host_ms" is the Python call's own time.
Rows: {"shape", "causal", "ms": {variant: ms}, "ms_queued": {...}, "host_ms": {...}}.

    python3 bench/probes/ring_w1.py --json ring_w1.json [--shapes 1x8192x32x32x128,...]
"""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import add_queue_option, git_sha, time_both  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x8192x32x32x128,1x32768x32x32x128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    add_queue_option(p, default=1000.0)
    p.add_argument("--json", default="")
    args = p.parse_args()
    import torch
    import torch.distributed as dist

    import loom

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    comm = loom.Communicator.from_process_group()
    dev = torch.device("cuda", 0)
    random.seed(0)
    rows = []
    for shape in args.shapes.split(","):
        B, S, H, Hkv, D = (int(x) for x in shape.split("x"))
        for causal in (c == "1" for c in args.causal.split(",")):
            g = torch.Generator(device=dev).manual_seed(7)
            q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, generator=g)
            k = torch.randn(B, S, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(B, S, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            out = torch.empty_like(q)
            lse = torch.empty(B, H, S, device=dev, dtype=torch.float32)
            half = S // 2

            def engine(with_lse, block_n=0):
                if not causal:
                    return lambda: loom.attention(q, k, v, out, lse=lse if with_lse else None, block_n=block_n)

                def zigzag():  # W = 1: chunk 0 then chunk 1, each bottom-right causal over the keys before its end
                    for h in (0, 1):
                        end = (h + 1) * half
                        loom.attention(q[:, h * half:(h + 1) * half], k[:, :end], v[:, :end], out[:, h * half:(h + 1) * half],
                                       causal=True, block_n=block_n)
                return zigzag

            variants = {
                "engine": engine(False),
                "engine_lse": engine(True),
                "ring": lambda: loom.ring_attention(comm, q, k, v, out, lse=lse, causal=causal),
                "ring_nolse": lambda: loom.ring_attention(comm, q, k, v, out, causal=causal),
            }
            if D == 64:  # the ring has both hd64 widths; at hd128 and hd256 only the default
                variants["engine_bn128"] = engine(False, 128)
                variants["ring_bn128"] = lambda: loom.ring_attention(comm, q, k, v, out, lse=lse, causal=causal, block_n=128)
            row = {"shape": shape, "causal": causal, **time_both(variants, args.warmup, args.iters, args.queue_behind_us)}
            rows.append(row)
            for key in ("ms", "ms_queued", "host_ms"):
                if key in row:
                    print(shape, "causal" if causal else "full", key, " ".join(f"{n} {t:.3f}" for n, t in row[key].items()),
                          flush=True)
    names = list(dict.fromkeys(n for r in rows for n in r["ms"]))
    for key in ("ms", "ms_queued", "host_ms"):
        if not any(key in r for r in rows):
            continue
        print(f"\n{key}\n{'shape':<20}{'mask':<8}" + "".join(f"{n:>14}" for n in names) + f"{'engine/ring':>13}")
        for r in rows:
            if key not in r:
                continue
            t = r[key]
            print(f"{r['shape']:<20}{'causal' if r['causal'] else 'full':<8}"
                  + "".join(f"{t[n]:>14.3f}" if n in t else f"{'-':>14}" for n in names)
                  + f"{t['engine'] / t['ring']:>13.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "ring_w1_probe", "git_sha": git_sha(), "gpu": torch.cuda.get_device_name(0), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
