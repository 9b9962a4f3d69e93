#!/usr/bin/env python3
"""Summarises per-tile timelines written by `loom-bench <op> --timeline DIR` (standard library only).

For each CSV (one launch of one kernel on one rank, loom/diagnostics.h TileTimelineRecord):
  span       first claim to last epilogue, us (globaltimer)
  GHz        mean SM clock over the tiles: (stored_clock - claimed_clock) / (stored_ns - claimed_ns)
  period     per CTA, mainloop end to the next tile's mainloop end (cycles -> us at that tile's clock):
             the steady rate at which a CTA finishes tiles, by the kind of the later tile
  fold       time the consumers spent folding other ranks' partials in, inside the mainloop (us),
             and of it (in CSVs that have them) draining the last k-block, posting the previous
             tile's signal, and the rest (waiting for the staged partials and adding them)
  epilogue   mainloop end -> last box handed to TMA, including a plain tile's signal hand-off (us)
  slow epi   epilogues over 3x the kernel's median epilogue, and when they ran (mainloop end, us
             after the first claim, in quarters of the span): bursts of stores show up as one
             crowded quarter
  tail split the pieces of split tiles, the fold items claimed since the first piece, and whole
             tiles that end after the last piece (the split took too few tiles)
  start, end when CTAs got their first tile and finished their last (us after the first claim):
             spread = how unevenly the CTAs start and finish (the tail)
Usage: timeline_summary.py DIR_OR_FILES...  (prints one block per file, fused next to gemm)
"""
import csv
import glob
import os
import statistics
import sys


def load(path):
    with open(path) as f:
        header = f.readline().lstrip("# ").split()
        meta = dict(kv.split("=", 1) for kv in header if "=" in kv)
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in r:
            r[k] = int(r[k])
    return meta, rows


def pct(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def summarise(meta, rows):
    t0 = min(r["claimed_ns"] for r in rows)
    span = (max(r["stored_ns"] for r in rows) - t0) / 1e3
    ghz = [(r["stored_clock"] - r["claimed_clock"]) / max(1, r["stored_ns"] - r["claimed_ns"]) for r in rows
           if r["stored_ns"] > r["claimed_ns"]]
    clock = statistics.median(ghz) if ghz else float("nan")
    by_cta = {}
    for r in rows:
        by_cta.setdefault(r["cta"], []).append(r)
    period = {}
    for tiles in by_cta.values():
        tiles.sort(key=lambda r: r["claimed_ns"])
        for prev, cur in zip(tiles, tiles[1:]):
            cycles = cur["mainloop_clock"] - prev["mainloop_clock"]
            period.setdefault(cur["kind"], []).append(cycles / clock / 1e3)
    folds = [r for r in rows if r["kind"] == 4]
    fold = [r["fold_cycles"] / clock / 1e3 for r in folds]
    epi_us = [(r["stored_clock"] - r["mainloop_clock"]) / clock / 1e3 for r in rows]
    epi = {}
    for r, e in zip(rows, epi_us):
        epi.setdefault(r["kind"], []).append(e)
    starts = [(min(r["claimed_ns"] for r in t) - t0) / 1e3 for t in by_cta.values()]
    ends = [(max(r["stored_ns"] for r in t) - t0) / 1e3 for t in by_cta.values()]
    tiles_per_cta = [len(t) for t in by_cta.values()]
    out = [f"{meta.get('op')} M={meta.get('M')} {meta.get('what'):5} rank {meta.get('rank')} tile {meta.get('tile')}: "
           f"{len(rows)} items on {len(by_cta)} CTAs ({min(tiles_per_cta)}-{max(tiles_per_cta)} each), "
           f"span {span:.1f} us, SM clock {clock:.3f} GHz (p10 {pct(ghz, 0.1):.3f}, p90 {pct(ghz, 0.9):.3f})"]
    for kind, values in sorted(period.items()):
        name = {0: "tile", 4: "fold tile", 5: "piece"}.get(kind, str(kind))
        out.append(f"    period {name:9}: median {statistics.median(values):7.2f} us  p90 {pct(values, 0.9):7.2f}  "
                   f"max {max(values):7.2f}  (n={len(values)})")
    for kind, values in sorted(epi.items()):
        name = {0: "tile", 4: "fold tile", 5: "piece"}.get(kind, str(kind))
        out.append(f"    epilogue {name:9}: median {statistics.median(values):6.2f} us  p90 {pct(values, 0.9):6.2f}  max {max(values):6.2f}")
    slow_us = 3 * statistics.median(epi_us)
    slow_at = [(r["claimed_ns"] - t0) / 1e3 + (r["mainloop_clock"] - r["claimed_clock"]) / clock / 1e3
               for r, e in zip(rows, epi_us) if e > slow_us]
    if slow_at:
        quarters = [0, 0, 0, 0]
        for t in slow_at:
            quarters[min(3, max(0, int(4 * t / span)))] += 1
        out.append(f"    slow epilogues (> {slow_us:.1f} us): {len(slow_at)} of {len(rows)}, "
                   f"by quarter of the span {quarters}")
    if fold:
        out.append(f"    fold: median {statistics.median(fold):6.2f} us  p90 {pct(fold, 0.9):6.2f}  max {max(fold):6.2f}")
        if "fold_drain_cycles" in folds[0]:
            drain = [r["fold_drain_cycles"] / clock / 1e3 for r in folds]
            signal = [r["fold_signal_cycles"] / clock / 1e3 for r in folds]
            rest = [(r["fold_cycles"] - r["fold_drain_cycles"] - r["fold_signal_cycles"]) / clock / 1e3 for r in folds]
            out.append(f"      of it (medians): drain {statistics.median(drain):5.2f} us, previous signal "
                       f"{statistics.median(signal):5.2f} us, partials {statistics.median(rest):5.2f} us")
    pieces = [r for r in rows if r["kind"] == 5]
    if pieces:
        # Tail split: the pieces, and the fold items claimed since the first piece (the split
        # tiles' folds, which wait for their pieces).
        first = min(r["claimed_ns"] for r in pieces)
        piece_us = [(r["stored_ns"] - r["claimed_ns"]) / 1e3 for r in pieces]
        split_folds = [r for r in folds if r["claimed_ns"] >= first]
        line = (f"    tail split: {len(pieces)} pieces claimed from {(first - t0) / 1e3:.1f} us, claim to stored "
                f"median {statistics.median(piece_us):.1f} us")
        if split_folds:
            f_us = [r["fold_cycles"] / clock / 1e3 for r in split_folds]
            d_us = [(r["stored_ns"] - r["claimed_ns"]) / 1e3 for r in split_folds]
            line += (f"; {len(split_folds)} folds since: claim to stored median {statistics.median(d_us):.1f} us, "
                     f"fold median {statistics.median(f_us):.1f} max {max(f_us):.1f} us")
        # Whole tiles still running when every piece is done: the split took too few tiles
        # (ag_gemm before it counted the comm CTAs' late claims).
        last_piece = max(r["stored_ns"] for r in pieces)
        late_whole = [r for r in rows if r["kind"] == 0 and r["stored_ns"] > last_piece]
        if late_whole:
            line += (f"; {len(late_whole)} whole tiles end after the last piece, the latest at "
                     f"{(max(r['stored_ns'] for r in late_whole) - t0) / 1e3:.1f} us")
        out.append(line)
    out.append(f"    CTA start: median {statistics.median(starts):6.1f}  max {max(starts):6.1f} us;"
               f"  CTA end: min {min(ends):7.1f}  median {statistics.median(ends):7.1f}  max {max(ends):7.1f} us")
    return "\n".join(out)


def main(args):
    paths = []
    for a in args:
        paths += sorted(glob.glob(os.path.join(a, "timeline_*.csv"))) if os.path.isdir(a) else [a]
    if not paths:
        print("timeline_summary.py: no timeline_*.csv found", file=sys.stderr)
        return 1
    for p in paths:
        meta, rows = load(p)
        if not rows:
            print(f"{p}: no tiles")
            continue
        print(summarise(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
