#!/usr/bin/env python3
"""One shape's attention through loom and through torch SDPA's cuDNN backend, each called --iters
times (no warm-up: a profiler replays what it measures), so that Nsight Compute looks at both
kernels side by side (`scripts/device/attention_suite.sh attention-ncu`). Prints the median times.

    python3 bench/probes/attention_launch.py --shape 4x8192x16x16x128 --causal 0 --iters 1
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import time_shuffled  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4x8192x16x16x128", help="BxSxHxHkvxD (Sq = Sk)")
    p.add_argument("--causal", type=int, default=0)
    p.add_argument("--iters", type=int, default=1)
    args = p.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import loom

    B, S, H, Hkv, D = (int(x) for x in args.shape.split("x"))
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, S, h, D, device=dev, dtype=torch.bfloat16, generator=g) for h in (H, Hkv, Hkv))
    out = torch.empty_like(q)
    causal = bool(args.causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal, enable_gqa=H != Hkv)

    calls = {"loom": lambda: loom.attention(q, k, v, out, causal=causal), "cudnn": cudnn}
    ms = time_shuffled(calls, 0, args.iters)
    print(args.shape, "causal" if causal else "full", " ".join(f"{n} {t:.3f} ms" for n, t in ms.items()))


if __name__ == "__main__":
    main()
