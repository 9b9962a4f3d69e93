#!/usr/bin/env python3
"""Joins bench/torch_fused.py's rows into loom-bench's JSON as ms.torch_fused and prints the final table.

    python3 bench/merge_results.py --loom tp.json --torch torch_fused.json --out tp_merged.json

Rows match on op, M, N, K (K is the global K for gemm_rs / gemm_ar in both files) and, where both
rows say, dtype and B layout. The table has, per tensor-parallel row: loom, cuBLAS alone (the
limit), loom's GEMM engine alone, NCCL + cuBLAS (the baseline), torch fused, the ratios and the
hidden fraction h = (T_nccl_cublas - T) / (T_nccl_cublas - T_cublas) for loom and for torch, and
h_eng = (T_nccl_cublas - T_loom) / (T_nccl_cublas - T_loom_gemm): what fusing hides, apart from
how the engine compares with cuBLAS. When torch_fused.py ran with --loom, its rows also carry loom's
time measured in the same process in alternating rounds with torch's (ms.loom_beside_torch), and the
table's `paired` column is torch / loom from those two: the fair ratio, since the separate runs of
loom-bench and torch_fused.py can meet the GPU at different clocks.

Exit status: 0 merged; 1 a file is malformed; 2 a file is missing or an argument is wrong.
"""

import argparse
import json
import sys

TP_OPS = ("ag_gemm", "gemm_rs", "gemm_ar")


def fail(message, code):
    print(f"merge_results.py: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def load(path, what):
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        fail(f"{what} file {path} does not exist", 2)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{what} file {path} is not readable JSON: {e}", 1)
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        fail(f"{what} file {path} has no \"rows\" list", 1)
    for i, row in enumerate(doc["rows"]):
        if not isinstance(row, dict) or "op" not in row:
            fail(f"{what} file {path}: row {i} is not an object with an \"op\"", 1)
    return doc


def key(row):
    return (row.get("op"), row.get("M"), row.get("N"), row.get("K"))


def compatible(loom_row, torch_row):
    for field in ("dtype", "b_layout"):
        if field in loom_row and field in torch_row and loom_row[field] != torch_row[field]:
            return False
    return True


def hidden_fraction(base, gemm, t):
    if not base or not gemm or not t or base - gemm <= 0:
        return None
    return (base - t) / (base - gemm)


def cell(value, fmt):
    """`value` formatted with `fmt` (e.g. '9.4f'), or '-' in the same width when absent."""
    if isinstance(value, (int, float)):
        return format(value, fmt)
    return "-".rjust(int(fmt.split(".")[0]))


def print_table(rows, out=sys.stdout):
    header = (f"{'op':8s} {'M x N x K':20s} {'B':3s} {'loom':>9s} {'cuBLAS':>9s} {'loomGEMM':>9s} {'NCCL+cuB':>9s} "
              f"{'torch':>9s} {'loom/cuB':>8s} {'base/loom':>9s} {'torch/loom':>10s} {'paired':>6s} {'h loom':>7s} {'h_eng':>6s} "
              f"{'h torch':>7s} {'rel_err':>8s}  plan")
    print("\n" + header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        if r.get("op") not in TP_OPS:
            continue
        ms = r.get("ms") or {}
        loom, cub, base, torch_ms = ms.get("loom"), ms.get("cublas"), ms.get("nccl_cublas"), ms.get("torch_fused")
        engine = ms.get("loom_gemm")
        paired = ms.get("loom_beside_torch")
        plan = r.get("plan") or {}
        plan_text = (f"{plan.get('algorithm', '?')}/{plan.get('comm_ctas', '?')}/{plan.get('tile', '?')} "
                     f"{plan.get('source', '')}") if plan else "-"
        if r.get("loom_error"):
            plan_text += "  ERROR " + str(r["loom_error"])
        shape = f"{r.get('M')}x{r.get('N')}x{r.get('K')}"
        print(f"{r['op']:8s} {shape:20s} {str(r.get('b_layout', '?')):3s} "
              f"{cell(loom, '9.4f')} {cell(cub, '9.4f')} {cell(engine, '9.4f')} {cell(base, '9.4f')} {cell(torch_ms, '9.4f')} "
              f"{cell(loom / cub if loom and cub else None, '8.3f')} "
              f"{cell(base / loom if base and loom else None, '9.3f')} "
              f"{cell(torch_ms / loom if torch_ms and loom else None, '10.3f')} "
              f"{cell(torch_ms / paired if torch_ms and paired else None, '6.3f')} "
              f"{cell(hidden_fraction(base, cub, loom), '7.2f')} {cell(hidden_fraction(base, engine, loom), '6.2f')} "
              f"{cell(hidden_fraction(base, cub, torch_ms), '7.2f')} "
              f"{cell(r.get('rel_err'), '8.1e')}  {plan_text}", file=out)
    print("(ms: median, max over ranks; base = NCCL + cuBLAS in sequence; h = share of the communication "
          "hidden: (base - t) / (base - cuBLAS); h_eng: the same against loom's GEMM alone; paired: torch / loom "
          "timed in alternating rounds of one process)", file=out)
    out.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loom", required=True, help="loom-bench --json output")
    p.add_argument("--torch", default="", help="bench/torch_fused.py --json output")
    p.add_argument("--allow-missing-torch", action="store_true",
                   help="print the table without torch times when the torch file does not exist")
    p.add_argument("--out", default="", help="merged JSON (default: print only)")
    args = p.parse_args()

    loom = load(args.loom, "loom-bench")
    torch_rows = []
    if args.torch:
        try:
            torch_doc = load(args.torch, "torch_fused")
            torch_rows = torch_doc["rows"]
            loom["torch"] = {k: torch_doc.get(k) for k in ("torch", "gpu", "date", "world")}
        except SystemExit:
            if not args.allow_missing_torch:
                raise
            print(f"merge_results.py: no torch times ({args.torch} missing or unreadable); table without them",
                  file=sys.stderr, flush=True)

    by_key = {}
    for i, row in enumerate(loom["rows"]):
        if row.get("op") in TP_OPS:
            by_key.setdefault(key(row), []).append(i)
    merged = 0
    unmatched = []
    for t in torch_rows:
        if not isinstance(t.get("ms"), (int, float)):
            fail(f"torch_fused row {key(t)} has no numeric \"ms\"", 1)
        targets = [i for i in by_key.get(key(t), []) if compatible(loom["rows"][i], t)]
        if not targets:
            unmatched.append(key(t))
            continue
        for i in targets:
            row = loom["rows"][i]
            row.setdefault("ms", {})["torch_fused"] = t["ms"]
            if "rel_err" in t:
                row["rel_err_torch_fused"] = t["rel_err"]
            if isinstance(t.get("loom_ms"), (int, float)):
                row["ms"]["loom_beside_torch"] = t["loom_ms"]
                row["rel_err_loom_beside_torch"] = t.get("rel_err_loom")
            merged += 1
    if unmatched:
        print(f"merge_results.py: {len(unmatched)} torch rows match no loom row (op, M, N, K): {unmatched}",
              file=sys.stderr, flush=True)
    if args.torch:
        print(f"merge_results.py: torch_fused added to {merged} rows", file=sys.stderr, flush=True)

    if args.out:
        try:
            with open(args.out, "w") as f:
                json.dump(loom, f, indent=2)
                f.write("\n")
        except OSError as e:
            fail(f"cannot write {args.out}: {e}", 2)
    print_table(loom["rows"])


if __name__ == "__main__":
    main()
