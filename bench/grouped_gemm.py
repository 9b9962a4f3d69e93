#!/usr/bin/env python3
"""loom.grouped_gemm beside torch._grouped_mm on one GPU (MoE expert GEMMs, bf16).

    python3 bench/grouped_gemm.py --json grouped.json

The per-GPU slices of expert-parallel MoE layers (EP8): DeepSeek-V3 (H 7168, I 2048, 32 experts
per GPU, top-8), Qwen3-235B (H 4096, I 1536, 16 per GPU, top-8) and Mixtral (H 4096, I 14336, 1 per
GPU, top-2); 1K / 4K / 16K tokens per GPU, so tokens x top-k rows reach the GPU's experts. fc1: N = 2I
(gate and up), K = H; fc2: N = H, K = I. Routing: uniform (equal counts, multiples of 128 rows at
these slices), random (counts drawn from Categorical with equal weights: every expert ends in a
partial tile row, as under any routing that is not exactly balanced) or skewed (counts drawn from
Categorical(p), p ~ U(0, 1) per expert: max/mean about 2). Both operators take the same A
(rows grouped by expert), the same weights [E, N, K] (torch reads them as [E, K, N] views) and the
same offsets; loom's output is checked against torch's (rel_err). loom_static: loom with
tile_queue=False (tiles claimed round-robin instead of from the queue), timed in the same shuffled
rounds. Median of --iters shuffled rounds after warm-up.
TFLOP/s = 2 rows N K / time. A table is printed last, then loom's skewed / uniform time per shape
(issue 21's bar: at most 1.05) and, where random ran, skewed / random (the imbalance alone, both
with partial last tile rows).
"""

import argparse
import datetime
import json
import random
import socket
import sys

from bench_common import add_queue_option, git_sha, time_both

MODELS = {  # name: (H, I, experts per GPU, top-k)
    "deepseek-v3": (7168, 2048, 32, 8),
    "qwen3-235b": (4096, 1536, 16, 8),
    "mixtral": (4096, 14336, 1, 2),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default="1024,4096,16384", help="tokens per GPU")
    p.add_argument("--routing", default="uniform,skewed", help="uniform, random, skewed (comma-separated)")
    p.add_argument("--gemms", default="fc1,fc2")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-rel-err", type=float, default=1e-2)
    add_queue_option(p)
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.iters < 20:
        p.error("--iters must be at least 20")
    args.models = [m for m in args.models.split(",") if m]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}: expected one of {', '.join(MODELS)}")
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.routing = [r for r in args.routing.split(",") if r]
    for r in args.routing:
        if r not in ("uniform", "random", "skewed"):
            p.error(f"unknown routing {r!r}: expected uniform, random or skewed")
    args.gemms = [g for g in args.gemms.split(",") if g]
    return args


def counts_of(rows, experts, routing, gen):
    import torch
    if routing == "uniform" or experts == 1:
        c = torch.full((experts,), rows // experts, dtype=torch.int64)
        c[: rows % experts] += 1
        return c
    p = torch.ones(experts) if routing == "random" else torch.rand(experts, generator=gen)
    idx = torch.multinomial(p, rows, replacement=True, generator=gen)
    return torch.bincount(idx, minlength=experts)


def main():
    args = parse_args()
    import torch

    import loom

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator().manual_seed(7)
    random.seed(0)
    rows_out = []
    for model in args.models:
        hidden, inter, experts, topk = MODELS[model]
        for gemm in args.gemms:
            n, k = (2 * inter, hidden) if gemm == "fc1" else (hidden, inter)
            w = (torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5).contiguous()
            for tokens in args.tokens:
                for routing in args.routing:
                    if routing != "uniform" and experts == 1:
                        continue
                    rows = tokens * topk
                    counts = counts_of(rows, experts, routing, gen)
                    ends = counts.cumsum(0).to(torch.int32)
                    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), ends]).to(dev)
                    offs = ends.to(dev)  # torch._grouped_mm: the end of each group
                    a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
                    d = torch.full((rows, n), float("nan"), device=dev, dtype=torch.bfloat16)
                    words = -(-loom.grouped_gemm_workspace_bytes(rows, experts) // 4)
                    ws = torch.empty(max(words, 1), device=dev, dtype=torch.int32)
                    wt = w.transpose(-2, -1)  # [E, K, N] view

                    def run_loom():
                        loom.grouped_gemm(a, w, d, offsets=offsets, workspace=ws)

                    def run_loom_static():
                        loom.grouped_gemm(a, w, d, offsets=offsets, workspace=ws, tile_queue=False)

                    def run_torch():
                        return torch._grouped_mm(a, wt, offs=offs)

                    ref = run_torch()
                    run_loom_static()
                    torch.cuda.synchronize()
                    rel_err_static = float((d.float() - ref.float()).norm() / ref.float().norm())
                    d.fill_(float("nan"))
                    run_loom()
                    torch.cuda.synchronize()
                    rel_err = float((d.float() - ref.float()).norm() / ref.float().norm())
                    candidates = {"loom": run_loom, "loom_static": run_loom_static, "torch_grouped": run_torch}
                    timing = time_both(candidates, args.warmup, args.iters, args.queue_behind_us)
                    ms = timing["ms"]
                    row = {"op": "grouped_gemm", "model": model, "gemm": gemm, "experts": experts, "tokens": tokens,
                           "routing": routing, "rows": rows, "max_over_mean": float(counts.max()) / (rows / experts),
                           "N": n, "K": k, "rel_err": rel_err, "rel_err_static": rel_err_static, **timing}
                    rows_out.append(row)
                    print(f"[{len(rows_out)}] {model} {gemm} T{tokens} {routing}: loom {ms['loom']:.3f} ms, "
                          f"static {ms['loom_static']:.3f} ms, torch {ms['torch_grouped']:.3f} ms, rel_err {rel_err:.2e}",
                          flush=True)
                    del a, d, ref, ws
            del w
            torch.cuda.empty_cache()

    result = {"git_sha": git_sha(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "host": socket.gethostname(), "world": 1, "torch": torch.__version__,
              "command": " ".join(sys.argv), "rows": rows_out}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    def tflops(r, t):
        return 2.0 * r["rows"] * r["N"] * r["K"] / (t * 1e-3) / 1e12

    print("\nTFLOP/s (one GPU, bf16)")
    print(f"{'model':<13}{'gemm':<6}{'tokens':>7} {'routing':<9}{'max/mean':>9}{'loom':>8}{'static':>8}{'torch':>8}"
          f"{'torch/loom time':>17}{'static/loom':>13}{'rel_err':>10}")
    for r in rows_out:
        print(f"{r['model']:<13}{r['gemm']:<6}{r['tokens']:>7} {r['routing']:<9}{r['max_over_mean']:>9.2f}"
              f"{tflops(r, r['ms']['loom']):>8.0f}{tflops(r, r['ms']['loom_static']):>8.0f}"
              f"{tflops(r, r['ms']['torch_grouped']):>8.0f}"
              f"{r['ms']['torch_grouped'] / r['ms']['loom']:>17.3f}{r['ms']['loom_static'] / r['ms']['loom']:>13.3f}"
              f"{r['rel_err']:>10.2e}")
    queued = args.queue_behind_us > 0
    for base, note in (("uniform", "issue 21: <= 1.05"), ("random", "the imbalance alone")):
        skew = skew_ratios(rows_out, base)
        if skew:
            skew_queued = skew_ratios(rows_out, base, "ms_queued") if queued else {}
            print(f"\nskewed / {base} time (loom; {note}" + ("; then from ms_queued" if queued else "") + ")")
            for shape, ratio in skew.items():
                model, gemm, tokens = shape
                print(f"{model:<13}{gemm:<6}{tokens:>7}{ratio:>8.3f}"
                      + (f"{skew_queued[shape]:>8.3f}" if shape in skew_queued else ""))
    bad = [r for r in rows_out if not (r["rel_err"] <= args.max_rel_err and r["rel_err_static"] <= args.max_rel_err)]
    sys.exit(1 if bad else 0)


def skew_ratios(rows, base="uniform", times="ms"):
    """loom's skewed time over its time under routing `base`, per (model, gemm, tokens) that has both rows
    (times: the rows' "ms" or "ms_queued")."""
    by_shape = {}
    for r in rows:
        if times in r:
            by_shape.setdefault((r["model"], r["gemm"], r["tokens"]), {})[r["routing"]] = r[times]["loom"]
    return {shape: t["skewed"] / t[base] for shape, t in by_shape.items() if "skewed" in t and base in t}


if __name__ == "__main__":
    main()
