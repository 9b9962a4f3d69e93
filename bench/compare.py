#!/usr/bin/env python3
"""Compares two benchmark runs of one kind: per row the time ratio new / old.

    bench/compare.py OLD.json NEW.json [--column loom] [--baseline COL] [--times ms] [--worst 5]
                     [--fail-over PCT] [--fail-geomean-over PCT] [--json OUT.json]

Both files are loom-bench JSON, merged TP JSON (bench/merge_results.py) or raw bench/torch_fused.py
output (its columns are torch_fused and loom_beside_torch). Rows match on their kind (tensor-
parallel on one node or across nodes, GEMM, collective, ...), op, dtype, B layout and shape
(M, N, K or bytes per rank); rows in one file only are listed, not compared. The time compared is
the row's median in `--column` (default loom); with `--baseline COL` it is that time divided by
COL's from the same row, which was timed in the same rounds, so the GPU's clock drift between
runs mostly cancels. `--times NAME` reads the columns from another object of milliseconds in each
row instead of "ms": bench/moe_layer.py's "ms_queued" (the GPU's time alone) or "phases" (one
launch's phases, e.g. --column combine_tail). A ratio above 1 means the new run is slower.

OLD and NEW may each name several runs of the same kind, comma-separated (the rounds of
scripts/device/gemm_ab.sh, which times two builds in the same shuffled rounds): a row's value is
then its median over the runs that have it.

Prints a table of every matched row, the geometric mean of the ratios and the worst rows.
Exit status: 0 compared; 1 `--fail-over PCT` was given and some row is slower by more than PCT
percent, or `--fail-geomean-over PCT` and the geometric mean is; 2 a file is missing or not a results file, an argument is wrong, or the files share no
row with the time asked for.
"""

import argparse
import json
import math
import statistics
import sys

TP_OPS = ("ag_gemm", "gemm_rs", "gemm_ar")
COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce")
# A row's identity: the GEMM-like fields, then attention's shape (bench/attention.py rows), then a
# grouped GEMM's slice (bench/grouped_gemm.py rows).
KEY_FIELDS = ("op", "dtype", "b_layout", "M", "N", "K", "bytes", "B", "S", "H", "H_kv", "D", "causal",
              "model", "gemm", "experts", "tokens", "routing")


class InputError(Exception):
    pass


def load(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is not readable JSON: {e}") from None
    if isinstance(doc, dict) and doc.get("kind") == "suite":
        raise InputError(f"{path} is a test-suite summary: it holds test outcomes, no times to compare")
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise InputError(f"{path} has no \"rows\" list (not loom-bench, merged or torch_fused JSON)")
    for i, row in enumerate(doc["rows"]):
        if not isinstance(row, dict) or "op" not in row:
            raise InputError(f"{path}: row {i} is not an object with an \"op\"")
    return doc


def kind(row, doc):
    """What a row measures, so that rows of different subcommands never match."""
    op = row["op"]
    if doc.get("what") == "torch_fused":
        return "torch_fused"
    if op in TP_OPS:
        across_nodes = row.get("multinode") or (doc.get("emulated_nodes") or 0) > 0 or (doc.get("nodes") or 1) > 1
        return "multinode" if across_nodes else "tp"
    if op in COLLECTIVE_OPS:
        return "collective"
    return op


def row_key(row, doc):
    return (kind(row, doc),) + tuple(row.get(f) for f in KEY_FIELDS)


def times(row, field="ms"):
    """A row's median times by column, from its object `field` (raw torch_fused rows hold torch's
    time as a number in "ms"); entries that are not positive numbers are no times."""
    if isinstance(row.get(field), dict):
        columns = dict(row[field])
    elif field == "ms":
        columns = {"torch_fused": row.get("ms"), "loom_beside_torch": row.get("loom_ms")}
    else:
        columns = {}
    return {c: t for c, t in columns.items()
            if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0}


def rows_by_key(path, doc):
    out = {}
    for row in doc["rows"]:
        key = row_key(row, doc)
        if key in out:
            raise InputError(f"{path}: two rows for {describe(key)}; compare files with one row per op and shape")
        out[key] = row
    return out


def describe(key):
    f = dict(zip(KEY_FIELDS, key[1:]))
    op, dtype, layout, m, n, k, nbytes = (f[x] for x in ("op", "dtype", "b_layout", "M", "N", "K", "bytes"))
    b, s, h, h_kv, d, causal = (f[x] for x in ("B", "S", "H", "H_kv", "D", "causal"))
    if f["model"] is not None:  # a grouped GEMM's slice, or a MoE layer's (no gemm, N or K)
        parts = [f["model"], f["gemm"], f"T{f['tokens']}", f["routing"]]
        if n is not None:
            parts.append(f"({n}x{k}, {f['experts']} experts)")
        shape = " ".join(str(x) for x in parts if x is not None)
    elif m is not None:
        shape = f"{m}x{n}x{k}"
    elif d is not None:
        shape = f"{b}x{s}x{h}x{h_kv}x{d}" + (" causal" if causal else "")
    else:
        shape = f"{nbytes} B"
    return " ".join(str(part) for part in (op, dtype, layout, shape) if part is not None)


def value(row, column, baseline, field):
    t = times(row, field)
    if column not in t or (baseline and baseline not in t):
        return None
    return t[column] / t[baseline] if baseline else t[column]


def geomean(ratios):
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def load_runs(paths):
    """[(path, doc, {key: row})] for a comma-separated list of runs of one kind."""
    runs = []
    for path in paths.split(","):
        doc = load(path)
        runs.append((path, doc, rows_by_key(path, doc)))
    return runs


def side_values(runs, column, baseline, field):
    """{key: median over the runs of the row's value, or None when no run timed it} and the
    columns each key's rows timed in every run."""
    values, columns = {}, {}
    for _, _, rows in runs:
        for key, row in rows.items():
            values.setdefault(key, []).append(value(row, column, baseline, field))
            t = set(times(row, field))
            columns[key] = columns[key] & t if key in columns else t
    medians = {}
    for key, vs in values.items():
        timed = [v for v in vs if v is not None]
        medians[key] = statistics.median(timed) if timed else None
    return medians, columns


def compare(old_paths, new_paths, column, baseline, field="ms"):
    """[(key, old value, new value)] for the rows both sides have with the time asked for, the
    keys on one side only, the keys on both without that time, and the columns both sides timed."""
    old, old_columns = side_values(load_runs(old_paths), column, baseline, field)
    new, new_columns = side_values(load_runs(new_paths), column, baseline, field)
    matched, untimed, columns = [], [], set()
    for key, before in old.items():
        if key not in new:
            continue
        columns |= old_columns[key] & new_columns[key]
        after = new[key]
        if before is None or after is None:
            untimed.append(key)
        else:
            matched.append((key, before, after))
    only = [(key, "old") for key in old if key not in new] + [(key, "new") for key in new if key not in old]
    return matched, only, untimed, sorted(columns)


def shas(paths):
    return sorted({load(path).get("git_sha") or "unknown" for path in paths.split(",")})


def write_json(path, args, matched, mean):
    doc = {
        "what": "compare",
        "old": {"files": args.old.split(","), "git_sha": shas(args.old)},
        "new": {"files": args.new.split(","), "git_sha": shas(args.new)},
        "times": args.times,
        "column": args.column,
        "baseline": args.baseline or None,
        "geomean_new_over_old": mean,
        "rows": [dict(zip(("kind",) + KEY_FIELDS, key), old=before, new=after, new_over_old=after / before)
                 for key, before, after in matched],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="the earlier run's JSON (several runs: comma-separated)")
    p.add_argument("new", help="the later run's JSON (several runs: comma-separated)")
    p.add_argument("--column", default="loom", help="ms column to compare (default: loom)")
    p.add_argument("--baseline", default="",
                   help="compare column / BASELINE (e.g. nccl_cublas, cublas, nccl) instead of the time itself")
    p.add_argument("--times", default="ms", metavar="NAME",
                   help="each row's object of milliseconds to read the columns from (default: ms; "
                        "bench/moe_layer.py rows also have ms_queued and phases)")
    p.add_argument("--worst", type=int, default=5, help="how many of the slowest rows to list (default: 5)")
    p.add_argument("--fail-over", type=float, default=None, metavar="PCT",
                   help="exit 1 if any row is more than PCT percent slower (ratio > 1 + PCT/100)")
    p.add_argument("--fail-geomean-over", type=float, default=None, metavar="PCT",
                   help="exit 1 if the geometric mean of new/old is more than PCT percent over 1")
    p.add_argument("--json", default="", metavar="OUT", help="also write the matched rows and their ratios here")
    args = p.parse_args(argv)
    if args.worst < 0:
        p.error("--worst must be 0 or more")
    for name in ("fail_over", "fail_geomean_over"):
        pct = getattr(args, name)
        if pct is not None and not (pct >= 0 and math.isfinite(pct)):
            p.error(f"--{name.replace('_', '-')} must be a percentage, 0 or more")

    try:
        matched, only, untimed, columns = compare(args.old, args.new, args.column, args.baseline, args.times)
    except InputError as e:
        print(f"compare.py: {e}", file=sys.stderr)
        return 2
    where = "" if args.times == "ms" else f"{args.times}."
    measure = f"{where}{args.column} / {where}{args.baseline}" if args.baseline else f"{where}{args.column} ms"
    if not matched and not untimed:
        kinds = {side: sorted({describe(key).split()[0] for key, s in only if s == side}) for side in ("old", "new")}
        print(f"compare.py: the two files share no row (old: {', '.join(kinds['old']) or 'none'}; "
              f"new: {', '.join(kinds['new']) or 'none'}): not the same kind of run", file=sys.stderr)
        return 2
    if not matched:
        print(f"compare.py: no row has a {measure} time in both runs; columns both timed: "
              f"{', '.join(columns) or 'none'}", file=sys.stderr)
        return 2
    for key, side in only:
        print(f"compare.py: only in the {side} run: {describe(key)}", file=sys.stderr)
    for key in untimed:
        print(f"compare.py: no {measure} in both runs: {describe(key)}", file=sys.stderr)

    width = max(len(describe(key)) for key, _, _ in matched)
    cell = max(12, len("old " + measure))
    print(f"{'row':{width}s} {'old ' + measure:>{cell}s} {'new ' + measure:>{cell}s} {'new/old':>8s}")
    for key, before, after in matched:
        print(f"{describe(key):{width}s} {before:{cell}.4f} {after:{cell}.4f} {after / before:8.3f}")
    ratios = [after / before for _, before, after in matched]
    mean = geomean(ratios)
    print(f"\ngeomean new/old: {mean:.3f} over {len(matched)} rows "
          f"({abs(mean - 1) * 100:.1f}% {'slower' if mean > 1 else 'faster'})")
    worst = sorted(matched, key=lambda m: m[2] / m[1], reverse=True)[:args.worst]
    if worst:
        print("worst rows: " + "; ".join(f"{describe(key)} {after / before:.3f}" for key, before, after in worst))
    if args.json:
        write_json(args.json, args, matched, mean)
    failed = False
    if args.fail_over is not None:
        limit = 1 + args.fail_over / 100
        slower = [(key, after / before) for key, before, after in matched if after / before > limit]
        if slower:
            print(f"FAIL: {len(slower)} rows slower by more than {args.fail_over:g}%: "
                  + "; ".join(f"{describe(key)} {r:.3f}" for key, r in slower))
            failed = True
    if args.fail_geomean_over is not None and mean > 1 + args.fail_geomean_over / 100:
        print(f"FAIL: the geometric mean is {(mean - 1) * 100:.2f}% slower (limit {args.fail_geomean_over:g}%)")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
