"""Probe: where the grouped GEMM's skewed time goes. For a few DeepSeek-V3 slices, loom (several
scheduling variants) and torch._grouped_mm time the same rows under several count patterns:

  uniform        every expert rows / E rows (multiples of 128 at these shapes)
  shifted        uniform with 64 rows moved from the last expert to the first (every expert but the
                 first starts off a 128-row boundary; the same tile rows)
  tails64        every expert 64 rows less than uniform (each expert's last tile row holds 64 rows:
                 the same tile rows as uniform, 3/4 of its rows at 1K)
  skewed         bench/grouped_gemm.py's skewed counts (the same generator and seed)
  skewed_sorted  those counts, largest expert first
  skewed_pad     the skewed counts rounded up to 128 (no partial tile row; more rows)

Candidates: torch._grouped_mm, and loom per tile (--tiles) and variant (--variants): words joined
by '+', 'padded' (swap_tails=False), 'static' (tile_queue=False: round-robin claims), 'rows'
(expert_groups=False: groups of group_m tile rows whatever the experts), 'experts'
(expert_groups=True, the default), 'g<N>' (group_m=N); 'default' alone is the defaults. Every variant's output
(NaN-prefilled) is checked against torch's. Prints ms per pattern and candidate, and the tile rows
each pattern has (the work a padded schedule does). Through the Python package on one GPU:
  python3 bench/probes/grouped_skew.py [--shapes fc1:1024,fc1:4096,fc2:1024] [--json FILE]
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import git_sha, time_shuffled  # noqa: E402

HIDDEN, INTER, EXPERTS, TOPK = 7168, 2048, 32, 8  # DeepSeek-V3, 32 experts per GPU


def patterns(rows, gen):
    import torch
    uniform = torch.full((EXPERTS,), rows // EXPERTS, dtype=torch.int64)
    shifted = uniform.clone()
    shifted[0] += 64
    shifted[-1] -= 64
    tails = uniform - 64
    p = torch.rand(EXPERTS, generator=gen)
    idx = torch.multinomial(p, rows, replacement=True, generator=gen)
    skewed = torch.bincount(idx, minlength=EXPERTS)
    return {"uniform": uniform, "shifted": shifted, "tails64": tails, "skewed": skewed,
            "skewed_sorted": skewed.sort(descending=True).values, "skewed_pad": (skewed + 127) // 128 * 128}


def variant_options(variant):
    kw = {}
    for word in variant.split("+"):
        if word == "padded":
            kw["swap_tails"] = False
        elif word == "static":
            kw["tile_queue"] = False
        elif word == "experts":
            kw["expert_groups"] = True
        elif word == "rows":
            kw["expert_groups"] = False
        elif word.startswith("g") and word[1:].isdigit():
            kw["group_m"] = int(word[1:])
        elif word != "default":
            raise SystemExit(f"grouped_skew.py: unknown variant word {word!r} (default, padded, static, rows, experts, g<N>)")
    return kw


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="fc1:1024,fc1:4096,fc1:16384,fc2:1024")
    ap.add_argument("--tiles", default="auto")
    ap.add_argument("--variants", default="default,rows,static,padded,g8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import torch

    import loom
    dev = torch.device("cuda", 0)
    random.seed(0)
    rows_out = []
    failures = 0
    for shape in args.shapes.split(","):
        gemm, tokens = shape.split(":")
        tokens = int(tokens)
        n, k = (2 * INTER, HIDDEN) if gemm == "fc1" else (HIDDEN, INTER)
        w = torch.randn(EXPERTS, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        wt = w.transpose(-2, -1)
        gen = torch.Generator().manual_seed(7)
        for name, counts in patterns(tokens * TOPK, gen).items():
            rows = int(counts.sum())
            ends = counts.cumsum(0).to(torch.int32)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int32), ends]).to(dev)
            offs = ends.to(dev)
            a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            d = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            ws = torch.empty(-(-loom.grouped_gemm_workspace_bytes(rows, EXPERTS) // 4), device=dev, dtype=torch.int32)
            cands = {"torch": lambda: torch._grouped_mm(a, wt, offs=offs)}
            for tile in args.tiles.split(","):
                for variant in args.variants.split(","):
                    kw = variant_options(variant)
                    cands[f"{tile}:{variant}"] = (lambda t=tile, kw=kw: loom.grouped_gemm(
                        a, w, d, offsets=offsets, workspace=ws, tile=t, **kw))
            ms = time_shuffled(cands, 3, args.iters)
            ref = torch._grouped_mm(a, wt, offs=offs).float()
            rel_err = {}
            for label, call in cands.items():  # every variant computes the same rows (NaN: unwritten)
                if label != "torch":
                    d.fill_(float("nan"))
                    call()
                    rel_err[label] = float((d.float() - ref).norm() / ref.norm())
            bad = {label: e for label, e in rel_err.items() if not e <= 1e-2}
            if bad:
                print(f"grouped_skew.py: {gemm} T{tokens} {name}: wrong results {bad}", file=sys.stderr)
                failures += 1
            tile_rows = int(((counts + 127) // 128).sum())
            row = {"gemm": gemm, "tokens": tokens, "pattern": name, "rows": rows, "tile_rows_128": tile_rows,
                   "max_over_mean": float(counts.max()) / (rows / EXPERTS), "ms": ms,
                   "max_rel_err": max(rel_err.values())}
            rows_out.append(row)
            print(f"{gemm} T{tokens:<6} {name:<14} rows {rows:6} tile_rows {tile_rows:4} " +
                  " ".join(f"{c} {t:.3f}" for c, t in ms.items()), flush=True)
            del a, d, ws, ref
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"git_sha": git_sha(), "gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                       "rows": rows_out}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
