#!/usr/bin/env python3
"""One test-suite summary from every rank's result file (GoogleTest JSON or pytest's JUnit XML).

    bench/suite_summary.py --suite multi-node_2x2 --ranks 4 --ranks-per-gpu 4 --emulated-nodes 2 \
        --gpus 1 --wall-s 81 --exit-code 0 --git-sha abc1234 rank0.json rank1.json ...
    bench/suite_summary.py split suites.jsonl bench/results    (one file per summary line)

Prints one JSON object on stdout (docs/BENCHMARKS.md, "suite summaries") and a line for people
on stderr:
  {"kind": "suite", "git_sha", "date", "suite", "ranks", "ranks_per_gpu", "emulated_nodes", "gpus",
   "passed", "failed", "skipped", "wall_s", "exit_code", "failures": [...], "missing_ranks": [...]}
A test counts once however many ranks ran it: failed if it failed on any rank, skipped if every
rank skipped it, else passed. A rank without a result file (it crashed or was killed) and a job
that exited non-zero with no failed test each count as a failure, so a summary of a broken run
can never read as green.
"""

import argparse
import datetime
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def gtest_outcomes(path: Path) -> dict:
    data = json.loads(path.read_text())
    out = {}
    for suite in data.get("testsuites", []):
        for case in suite.get("testsuite", []):
            name = f"{suite['name']}.{case['name']}"
            if case.get("failures"):
                out[name] = "failed"
            elif case.get("result") == "SKIPPED" or case.get("status") == "NOTRUN":
                out[name] = "skipped"
            else:
                out[name] = "passed"
    return out


def junit_outcomes(path: Path) -> dict:
    root = ET.parse(path).getroot()
    out = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}.{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out[name] = "failed"
        elif case.find("skipped") is not None:
            out[name] = "skipped"
        else:
            out[name] = "passed"
    return out


def summarize(files, ranks, exit_code):
    per_test = {}
    seen_ranks = set()
    for f in files:
        path = Path(f)
        rank = int("".join(ch for ch in path.stem if ch.isdigit()) or -1)
        seen_ranks.add(rank)
        outcomes = junit_outcomes(path) if path.suffix == ".xml" else gtest_outcomes(path)
        for name, outcome in outcomes.items():
            per_test.setdefault(name, []).append(outcome)
    passed = failed = skipped = 0
    failures = []
    for name in sorted(per_test):
        outcomes = per_test[name]
        if "failed" in outcomes:
            failed += 1
            failures.append(name)
        elif all(o == "skipped" for o in outcomes):
            skipped += 1
        else:
            passed += 1
    missing = sorted(set(range(ranks)) - seen_ranks)
    failed += len(missing)
    failures += [f"rank {r}: no result file (crashed, killed or timed out)" for r in missing]
    if exit_code != 0 and failed == 0:
        failed = 1
        failures.append(f"the job exited {exit_code} with every test passed (a hang, a crash at exit, or a time limit)")
    return passed, failed, skipped, failures, missing


def split(jsonl: str, out_dir: str) -> list:
    """Writes each summary line of `jsonl` (shared_gpu_suite.sh's $OUT/suites.jsonl) to
    out_dir/<date>_<sha>_suite_<suite>.json; returns the paths. A sha ending in "+" (a build of a
    tree with changes) keeps it: the file must not pass for the commit's own build."""
    paths = []
    for line in Path(jsonl).read_text().splitlines():
        if not line.strip():
            continue
        s = json.loads(line)
        path = Path(out_dir) / f"{s['date']}_{s['git_sha']}_suite_{s['suite']}.json"
        path.write_text(json.dumps(s, indent=1) + "\n")
        paths.append(str(path))
    return paths


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "split":
        if len(argv) != 3:
            print("usage: bench/suite_summary.py split SUITES.jsonl OUT_DIR", file=sys.stderr)
            return 2
        for path in split(argv[1], argv[2]):
            print(path)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", required=True)
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--ranks-per-gpu", type=int, default=1)
    p.add_argument("--emulated-nodes", type=int, default=0)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--wall-s", type=float, required=True)
    p.add_argument("--exit-code", type=int, required=True)
    p.add_argument("--git-sha", default="unknown")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("files", nargs="*", help="rankN.json (GoogleTest) or rankN.xml (pytest --junitxml), N = the rank")
    args = p.parse_args(argv)
    passed, failed, skipped, failures, missing = summarize(args.files, args.ranks, args.exit_code)
    summary = {"kind": "suite", "git_sha": args.git_sha, "date": args.date, "suite": args.suite, "ranks": args.ranks,
               "ranks_per_gpu": args.ranks_per_gpu, "emulated_nodes": args.emulated_nodes, "gpus": args.gpus,
               "passed": passed, "failed": failed, "skipped": skipped, "wall_s": round(args.wall_s, 1),
               "exit_code": args.exit_code, "failures": failures, "missing_ranks": missing}
    json.dump(summary, sys.stdout)
    sys.stdout.write("\n")
    line = f"  -> {args.suite}: {passed} passed, {failed} failed, {skipped} skipped in {summary['wall_s']} s"
    if failures:
        line += "; " + "; ".join(failures[:5]) + (f"; ... {len(failures) - 5} more" if len(failures) > 5 else "")
    print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
