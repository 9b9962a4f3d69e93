#!/usr/bin/env python3
"""Draws benchmark results JSON (bench/results) as PNGs, one per operator family.

    bench/plot.py [--out docs/img] [files...]

Without files it draws the current results named in bench/results/README.md (the table under
"## Current results"). Every row is sorted into a family by its op and drawn into that family's
PNG; rows of several files of one family go into one picture, one series per file:

  tp_speedup.png        ag_gemm / gemm_rs / gemm_ar on one node: speedup over NCCL + cuBLAS in
                        sequence vs M (with cuBLAS alone, the most any overlap can give), the
                        hidden fraction h, and torch's fused op against loom where it was timed
  multinode.png         the same ops across (emulated) nodes: speedup over the GEMM then the
                        transfer, h and h_max (the most any overlap can hide)
  gemm_tflops.png       loom's GEMM vs cuBLAS, TFLOP/s vs M per (N, K)
  collectives_busbw.png all_gather / reduce_scatter / all_reduce vs NCCL, bus bandwidth vs size
  attention.png, moe.png  ops named *attention* / moe*: loom's speedup over each other timed
                        column, vs M (or tokens, or bytes); the families' own plots replace this
                        when their results settle

Times are the medians loom-bench reports (ms). Rows that are not comparisons are left out and
counted on stderr: world-1 rows with a "note", rows with a "loom_error", rows without the times a
plot needs. Files without rows to draw (test-suite summaries, examples/tp_mlp.py or Python
overhead results, tuning caches, raw bench/torch_fused.py output: merge it first with
bench/merge_results.py) and ops of no known family are skipped with a line on stderr.

Exit status: 0 pictures written; 1 a file is not readable JSON; 2 a file is missing, an argument
is wrong, matplotlib is missing, or nothing in the files can be drawn.
"""

import argparse
import collections
import json
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CURRENT_HEADING = "## Current results"

TP_OPS = ("ag_gemm", "gemm_rs", "gemm_ar")
COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce")


class InputError(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def note(message):
    print(f"plot.py: {message}", file=sys.stderr, flush=True)


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise InputError(f"{path} does not exist", 2) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is not readable JSON: {e}", 1) from None


def current_files(readme=RESULTS / "README.md"):
    """The JSON files named (in backquotes) in the README's "Current results" section."""
    try:
        text = readme.read_text()
    except OSError as e:
        raise InputError(f"no files given and {readme} cannot be read: {e}", 2) from None
    section = text.split(CURRENT_HEADING, 1)
    if len(section) < 2:
        raise InputError(f"no files given and {readme} has no \"{CURRENT_HEADING}\" section", 2)
    body = re.split(r"^## ", section[1], maxsplit=1, flags=re.M)[0]
    names = list(dict.fromkeys(re.findall(r"`([^`/]+\.json)`", body)))
    if not names:
        raise InputError(f"no files given and {readme}'s \"{CURRENT_HEADING}\" names no .json file", 2)
    return [readme.parent / name for name in names]


def family_of(row, doc):
    op = str(row.get("op", ""))
    if op in COLLECTIVE_OPS:
        return "collectives"
    if op == "gemm":
        return "gemm"
    if op in TP_OPS:
        across_nodes = row.get("multinode") or (doc.get("emulated_nodes") or 0) > 0 or (doc.get("nodes") or 1) > 1
        return "multinode" if across_nodes else "tp"
    if "attention" in op:
        return "attention"
    if op.startswith("moe"):
        return "moe"
    return None


def file_kind_without_rows(doc):
    """Why a file has nothing to draw, or None when it holds loom-bench rows."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("kind") == "suite":
        return "a test-suite summary (test outcomes, no timings)"
    if doc.get("what") == "torch_fused":
        return "raw bench/torch_fused.py output (join it to loom-bench's JSON with bench/merge_results.py)"
    if "loom_ms" in doc and "torch_nccl_ms" in doc:
        return "an examples/tp_mlp.py result (one time per side, no rows)"
    if "per_call_us_max_over_ranks" in doc:
        return "a Python per-call overhead result (no rows)"
    if "entries" in doc and "format" in doc:
        return "a tuning cache (no comparisons)"
    if isinstance(doc.get("runs") or doc.get("rounds"), list):
        return "an A/B experiment holding several runs (plot its runs' loom-bench JSON one by one)"
    if not isinstance(doc.get("rows"), list):
        return f"no \"rows\" list (keys: {', '.join(sorted(doc)[:8])})"
    return None


def ms(row, column):
    """A row's median time in `column`, or None when it was not measured."""
    value = (row.get("ms") or {}).get(column) if isinstance(row.get("ms"), dict) else None
    return value if isinstance(value, (int, float)) and value > 0 else None


def ratio(numerator, denominator):
    return numerator / denominator if numerator and denominator else None


class Source:
    """One input file: its rows by family and a caption of the run."""

    def __init__(self, path, doc):
        self.path = Path(path)
        self.doc = doc
        self.label = self.path.stem
        self.rows = {}
        for row in doc["rows"]:
            if isinstance(row, dict):
                self.rows.setdefault(family_of(row, doc), []).append(row)

    def caption(self):
        doc = self.doc
        gpus = f"{doc.get('world', '?')} x {doc.get('gpu', '?')}"
        if (doc.get("emulated_nodes") or 0) > 0:
            gpus += f", {doc['emulated_nodes']} emulated nodes"
            if doc.get("net_gbps"):
                gpus += f" at {doc['net_gbps']:g} GB/s"
        sha = str(doc.get("git_sha", "?"))[:7]
        return f"{gpus}, commit {sha}, {str(doc.get('date', '?'))[:10]}"


def comparable(rows, needed, skipped):
    """The rows that compare loom with its baselines and have every column in `needed`; the others
    are counted in `skipped` (a Counter) by why."""
    out = []
    for row in rows:
        if row.get("note"):
            skipped[f"not a comparison ({row['note']})"] += 1
        elif row.get("loom_error"):
            skipped["loom failed"] += 1
        elif any(ms(row, c) is None for c in needed):
            skipped["no " + " / ".join(needed) + " time"] += 1
        else:
            out.append(row)
    return out


def series(entries, x_field, group_fields):
    """{label: [(x, row), ...] sorted by x} from (source, row) pairs, one series per file and shape;
    the label names the shape fields that differ between the series, and the file when one shape
    comes from several files."""
    groups = {}
    for source, row in entries:
        if not isinstance(row.get(x_field), (int, float)):
            continue
        shape = tuple(row.get(f) for f in group_fields)
        groups.setdefault((shape, source.label), []).append((row[x_field], row))
    shapes = [shape for shape, _ in groups]
    varying = [i for i in range(len(group_fields)) if len({shape[i] for shape in shapes}) > 1]
    out = {}
    for (shape, label), points in groups.items():
        parts = [f"{group_fields[i]}={shape[i]}" for i in varying]
        if shapes.count(shape) > 1:
            parts.append(label)
        out[", ".join(parts)] = sorted(points, key=lambda p: p[0])
    return out


def short_count(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def human_bytes(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def log2_axis(ax, xs, fmt=short_count):
    from matplotlib.ticker import NullLocator
    ax.set_xscale("log", base=2)
    ticks = sorted(set(xs))
    ax.set_xticks(ticks)
    ax.set_xticklabels([fmt(x) for x in ticks], fontsize=7)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, alpha=0.3)


def line(ax, points, value, label, **style):
    """Draws value(row) against x, leaving out points where it is None."""
    xy = [(x, value(row)) for x, row in points]
    xy = [(x, y) for x, y in xy if y is not None]
    if xy:
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker=style.pop("marker", "o"), markersize=4,
                label=label, **style)
    return [x for x, _ in xy]


def legend(ax):
    if any(not artist.get_label().startswith("_") for artist in ax.lines):
        ax.legend(fontsize=6)


def with_suffix(label, name):
    return f"{name} ({label})" if label else name


def new_figure(columns, rows, width=4.2, height=3.0):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    return fig, axes


def finish(fig, title, sources):
    captions = "; ".join(dict.fromkeys(s.caption() for s in sources))
    fig.suptitle(f"{title}\n{captions}", fontsize=10)
    fig.tight_layout()
    return fig


def by_op(entries, ops):
    present = [op for op in ops if any(r.get("op") == op for _, r in entries)]
    return {op: [(s, r) for s, r in entries if r.get("op") == op] for op in present}


def plot_tp(entries, sources):
    ops = by_op(entries, TP_OPS)
    if not ops:
        return None
    has_h = any(isinstance(r.get("h"), (int, float)) for _, r in entries)
    has_torch = any(ms(r, "torch_fused") for _, r in entries)
    panels = 1 + has_h + has_torch
    fig, axes = new_figure(len(ops), panels)
    for col, (op, op_entries) in enumerate(ops.items()):
        groups = series(op_entries, "M", ("N", "K"))
        xs = []
        ax = axes[0][col]
        for label, points in groups.items():
            xs += line(ax, points, lambda r: ratio(ms(r, "nccl_cublas"), ms(r, "loom")), with_suffix(label, "loom"))
            line(ax, points, lambda r: ratio(ms(r, "nccl_cublas"), ms(r, "cublas")),
                 with_suffix(label, "cuBLAS alone (all hidden)"), linestyle="--", marker=".", color="gray")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(op, fontsize=9)
        ax.set_ylabel("speedup over NCCL + cuBLAS", fontsize=8)
        panel = 1
        if has_h:
            hax = axes[panel][col]
            for label, points in groups.items():
                line(hax, points, lambda r: r.get("h") if isinstance(r.get("h"), (int, float)) else None,
                     with_suffix(label, "h"))
            hax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
            hax.axhline(0.0, color="black", linewidth=0.8)
            hax.set_ylabel("hidden fraction h", fontsize=8)
            panel += 1
        if has_torch:
            tax = axes[panel][col]
            if any(ms(r, "torch_fused") for _, r in op_entries):
                for label, points in groups.items():
                    # Paired (torch and loom timed in one process) where it exists: the fair ratio;
                    # separate runs can meet the GPU at different clocks.
                    line(tax, points, lambda r: ratio(ms(r, "torch_fused"), ms(r, "loom_beside_torch")),
                         with_suffix(label, "torch / loom, same process"))
                    line(tax, points,
                         lambda r: None if ms(r, "loom_beside_torch") else ratio(ms(r, "torch_fused"), ms(r, "loom")),
                         with_suffix(label, "torch / loom, separate runs"), linestyle=":", marker="x")
                tax.axhline(1.0, color="black", linewidth=0.8)
                tax.set_ylabel("torch fused time / loom time", fontsize=8)
            else:
                tax.axis("off")
                tax.text(0.5, 0.5, f"{op}: no torch fused time", ha="center", va="center", transform=tax.transAxes)
        for p in range(panels):
            if axes[p][col].axison:
                log2_axis(axes[p][col], xs or [1])
                legend(axes[p][col])
        axes[panels - 1][col].set_xlabel("M (tokens)", fontsize=8)
    return finish(fig, "Fused tensor-parallel operators vs NCCL + cuBLAS", sources)


def plot_multinode(entries, sources):
    ops = by_op(entries, TP_OPS)
    if not ops:
        return None
    fig, axes = new_figure(len(ops), 2)
    for col, (op, op_entries) in enumerate(ops.items()):
        groups = series(op_entries, "M", ("N", "K"))
        xs = []
        for label, points in groups.items():
            xs += line(axes[0][col], points, lambda r: ratio(ms(r, "sequential"), ms(r, "loom")),
                       with_suffix(label, "loom"))
            line(axes[0][col], points,
                 lambda r: ratio(ms(r, "sequential"), max(ms(r, "gemm") or 0, ms(r, "net") or 0) or None),
                 with_suffix(label, "all hidden: max(GEMM, transfer)"), linestyle="--", marker=".")
            line(axes[1][col], points, lambda r: r.get("h") if isinstance(r.get("h"), (int, float)) else None,
                 with_suffix(label, "h"))
            line(axes[1][col], points,
                 lambda r: r.get("h_max") if isinstance(r.get("h_max"), (int, float)) else None,
                 with_suffix(label, "h_max"), linestyle="--", marker=".")
        axes[0][col].axhline(1.0, color="black", linewidth=0.8)
        axes[0][col].set_title(op, fontsize=9)
        axes[0][col].set_ylabel("speedup over GEMM then transfer", fontsize=8)
        axes[1][col].axhline(0.0, color="black", linewidth=0.8)
        axes[1][col].set_ylabel("hidden fraction", fontsize=8)
        axes[1][col].set_xlabel("M (tokens)", fontsize=8)
        for p in range(2):
            log2_axis(axes[p][col], xs or [1])
            legend(axes[p][col])
    return finish(fig, "Multi-node fused operators vs the GEMM then the network transfer", sources)


def tflops(row, column):
    t = (row.get("tflops") or {}).get(column) if isinstance(row.get("tflops"), dict) else None
    if isinstance(t, (int, float)) and t > 0:
        return t
    time = ms(row, column)
    if time and all(isinstance(row.get(f), int) for f in ("M", "N", "K")):
        return 2.0 * row["M"] * row["N"] * row["K"] / (time * 1e-3) / 1e12
    return None


def plot_gemm(entries, sources):
    shapes = list(dict.fromkeys((r.get("N"), r.get("K")) for _, r in entries))
    if not shapes:
        return None
    columns = min(len(shapes), 2)
    rows = math.ceil(len(shapes) / columns)
    fig, axes = new_figure(columns, rows)
    for i, (n, k) in enumerate(shapes):
        ax = axes[i // columns][i % columns]
        shape_entries = [(s, r) for s, r in entries if (r.get("N"), r.get("K")) == (n, k)]
        xs = []
        for label, points in series(shape_entries, "M", ("dtype", "b_layout")).items():
            xs += line(ax, points, lambda r: tflops(r, "loom"), with_suffix(label, "loom"))
            line(ax, points, lambda r: tflops(r, "cublas"), with_suffix(label, "cuBLAS"), linestyle="--")
        ax.set_title(f"N = {n}, K = {k}", fontsize=9)
        ax.set_ylabel("TFLOP/s", fontsize=8)
        ax.set_xlabel("M", fontsize=8)
        ax.set_ylim(bottom=0)
        log2_axis(ax, xs or [1])
        legend(ax)
    for j in range(len(shapes), rows * columns):
        axes[j // columns][j % columns].axis("off")
    return finish(fig, "GEMM engine vs cuBLAS", sources)


def busbw(row, column):
    value = (row.get("busbw_gbps") or {}).get(column) if isinstance(row.get("busbw_gbps"), dict) else None
    return value if isinstance(value, (int, float)) and value > 0 else None


def plot_collectives(entries, sources):
    ops = by_op(entries, COLLECTIVE_OPS)
    if not ops:
        return None
    fig, axes = new_figure(len(ops), 1)
    for col, (op, op_entries) in enumerate(ops.items()):
        ax = axes[0][col]
        xs = []
        for label, points in series(op_entries, "bytes", ("dtype",)).items():
            xs += line(ax, points, lambda r: busbw(r, "loom"), with_suffix(label, "loom"))
            line(ax, points, lambda r: busbw(r, "nccl"), with_suffix(label, "NCCL"), linestyle="--")
        ax.set_title(op, fontsize=9)
        ax.set_ylabel("bus bandwidth, GB/s", fontsize=8)
        ax.set_xlabel("bytes per rank", fontsize=8)
        ax.set_ylim(bottom=0)
        log2_axis(ax, xs or [1], human_bytes)
        legend(ax)
    return finish(fig, "NVLink collectives vs NCCL", sources)


def x_field(rows):
    for field in ("M", "tokens", "seq_len", "bytes"):
        if all(isinstance(r.get(field), (int, float)) for r in rows):
            return field
    return None


def plot_generic(title):
    """Loom's speedup over each other timed column, per op: for families without their own plot."""

    def draw(entries, sources):
        ops = by_op(entries, list(dict.fromkeys(r.get("op") for _, r in entries)))
        drawable = {op: e for op, e in ops.items() if x_field([r for _, r in e])}
        for op in set(ops) - set(drawable):
            note(f"{title}: {op} rows have no common M / tokens / seq_len / bytes field to plot against; skipped")
        if not drawable:
            return None
        fig, axes = new_figure(len(drawable), 1)
        for col, (op, op_entries) in enumerate(drawable.items()):
            ax = axes[0][col]
            field = x_field([r for _, r in op_entries])
            baselines = sorted({c for _, r in op_entries for c in (r.get("ms") or {}) if c != "loom"})
            xs = []
            for label, points in series(op_entries, field, ()).items():
                for base in baselines:
                    xs += line(ax, points, lambda r, b=base: ratio(ms(r, b), ms(r, "loom")),
                               with_suffix(label, f"over {base}"))
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_title(op, fontsize=9)
            ax.set_ylabel("speedup of loom", fontsize=8)
            ax.set_xlabel(field, fontsize=8)
            log2_axis(ax, xs or [1], human_bytes if field == "bytes" else str)
            legend(ax)
        return finish(fig, title, sources)

    return draw


# family: (PNG name, the ms columns a row needs, plotter)
FAMILIES = {
    "tp": ("tp_speedup.png", ("loom", "nccl_cublas"), plot_tp),
    "multinode": ("multinode.png", ("loom", "sequential"), plot_multinode),
    "gemm": ("gemm_tflops.png", ("loom", "cublas"), plot_gemm),
    "collectives": ("collectives_busbw.png", ("loom", "nccl"), plot_collectives),
    "attention": ("attention.png", ("loom",), plot_generic("Attention vs its baselines")),
    "moe": ("moe.png", ("loom",), plot_generic("Mixture of experts vs its baselines")),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "docs" / "img"), help="folder for the PNGs (default: docs/img)")
    p.add_argument("files", nargs="*", help="results JSON (default: the current files in bench/results/README.md)")
    args = p.parse_args(argv)

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note("needs matplotlib: pip install -r bench/requirements.txt")
        return 2

    try:
        paths = [Path(f) for f in args.files] or current_files()
        sources = []
        for path in paths:
            doc = load(path)
            why = file_kind_without_rows(doc)
            if why:
                note(f"{path.name}: skipped, {why}")
                continue
            sources.append(Source(path, doc))
    except InputError as e:
        note(str(e))
        return e.code

    for source in sources:
        unknown = sorted({str(r.get("op")) for r in source.rows.get(None, [])})
        if unknown:
            note(f"{source.path.name}: no plot for ops {', '.join(unknown)}; skipped")

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        note(f"cannot create {out}: {e}")
        return 2
    written = 0
    for family, (name, needed, plotter) in FAMILIES.items():
        skipped = collections.Counter()
        entries = [(s, r) for s in sources for r in comparable(s.rows.get(family, []), needed, skipped)]
        for why, count in skipped.items():
            note(f"{family}: {count} rows left out: {why}")
        if not entries:
            continue
        contributing = [s for s in sources if any(src is s for src, _ in entries)]
        fig = plotter(entries, contributing)
        if fig is None:
            continue
        target = out / name
        try:
            # No "Software" stamp, so the same JSON gives the same bytes.
            fig.savefig(target, dpi=80, metadata={"Software": None})
        except OSError as e:
            note(f"cannot write {target}: {e}")
            return 2
        finally:
            plt.close(fig)
        print(f"{target}: {len(entries)} rows from {', '.join(s.path.name for s in contributing)}")
        written += 1
    if not written:
        note("nothing to plot in the given files")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
