"""Probe: does the grouped GEMM's time depend on where its operands lie in memory? Between runs of
bench/grouped_gemm.py with the same counts, DeepSeek-V3 fc1 at 4K tokens under skewed routing took
3.09-3.82 ms on one H100 (eight processes, each the median of 20 calls), uniform 2.71-2.92. Here one
process times the same counts on several fresh copies of the weights and rows (each allocated while
the earlier copies stay alive, so every trial reads other pages), loom and torch._grouped_mm side
by side in shuffled rounds. A spread between trials as large as between processes points at the
placement; a spread within a trial's rounds, at the launch itself.

    python3 bench/probes/grouped_placement.py [--tokens 1024,4096] [--trials 6] [--json FILE]

The counts are bench/grouped_gemm.py's for DeepSeek-V3 fc1 (same generator, seed and draw order
as `--models deepseek-v3 --gemms fc1 --routing uniform,random,skewed` with the same --tokens).
"""

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import git_sha, time_shuffled  # noqa: E402
from grouped_gemm import MODELS, counts_of  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--routing", default="uniform,skewed", help="which of the drawn patterns to time")
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default="")
    args = p.parse_args()
    tokens_list = [int(t) for t in args.tokens.split(",") if t]
    timed_routings = [r for r in args.routing.split(",") if r]
    for r in timed_routings:
        if r not in ("uniform", "random", "skewed"):
            p.error(f"unknown routing {r!r}: expected uniform, random or skewed")
    import torch

    import loom

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    hidden, inter, experts, topk = MODELS["deepseek-v3"]
    n, k = 2 * inter, hidden
    gen = torch.Generator().manual_seed(7)
    random.seed(0)
    rows_out = []
    for tokens in tokens_list:
        rows = tokens * topk
        drawn = {r: counts_of(rows, experts, r, gen) for r in ("uniform", "random", "skewed")}
        for routing in timed_routings:
            counts = drawn[routing]
            ends = counts.cumsum(0).to(torch.int32)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int32), ends]).to(dev)
            offs = ends.to(dev)
            words = -(-loom.grouped_gemm_workspace_bytes(rows, experts) // 4)
            kept = []  # every trial's operands stay allocated, so the next trial's land elsewhere
            for trial in range(args.trials):
                w = (torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5).contiguous()
                a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
                d = torch.full((rows, n), float("nan"), device=dev, dtype=torch.bfloat16)
                ws = torch.empty(max(words, 1), device=dev, dtype=torch.int32)
                wt = w.transpose(-2, -1)
                kept.append((w, a, d, ws))
                ref = torch._grouped_mm(a, wt, offs=offs)
                loom.grouped_gemm(a, w, d, offsets=offsets, workspace=ws)
                torch.cuda.synchronize()
                rel_err = float((d.float() - ref.float()).norm() / ref.float().norm())
                del ref
                samples = {}

                def run_loom():
                    loom.grouped_gemm(a, w, d, offsets=offsets, workspace=ws)

                def run_torch():
                    return torch._grouped_mm(a, wt, offs=offs)

                ms = time_shuffled({"loom": run_loom, "torch_grouped": run_torch}, args.warmup, args.iters,
                                   samples=samples)
                row = {"tokens": tokens, "routing": routing, "trial": trial, "rel_err": rel_err, "ms": ms,
                       "loom_ms_spread": [min(samples["loom"]), max(samples["loom"])],
                       "w_ptr": w.data_ptr()}
                rows_out.append(row)
                print(f"T{tokens} {routing} trial {trial}: loom {ms['loom']:.3f} ms "
                      f"({min(samples['loom']):.3f}-{max(samples['loom']):.3f}), torch {ms['torch_grouped']:.3f}, "
                      f"rel_err {rel_err:.1e}", flush=True)
            del kept
            torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"git_sha": git_sha(), "gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                       "rows": rows_out}, f, indent=1)
    print("\nloom ms per trial (median of each trial's rounds; then the trials' spread)")
    for tokens in tokens_list:
        for routing in timed_routings:
            t = [r["ms"]["loom"] for r in rows_out if r["tokens"] == tokens and r["routing"] == routing]
            tt = [r["ms"]["torch_grouped"] for r in rows_out if r["tokens"] == tokens and r["routing"] == routing]
            print(f"T{tokens:<6}{routing:<9}" + "".join(f"{x:8.3f}" for x in t)
                  + f"   loom {min(t):.3f}-{max(t):.3f} (median {statistics.median(t):.3f}),"
                  + f" torch {min(tt):.3f}-{max(tt):.3f}")
    sys.exit(0 if all(r["rel_err"] < 1e-2 for r in rows_out) else 1)


if __name__ == "__main__":
    main()
