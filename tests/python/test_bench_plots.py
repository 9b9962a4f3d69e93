"""bench/plot.py draws the committed current results (CPU, needs matplotlib) and bench/compare.py
compares two runs: ratios, geometric mean, --fail-over's exit status."""

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from conftest import REPO

PLOT = REPO / "bench/plot.py"
COMPARE = REPO / "bench/compare.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(script, *args):
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def write(path, doc):
    path.write_text(json.dumps(doc))
    return path


def test_plot_draws_the_current_results(tmp_path):
    pytest.importorskip("matplotlib")
    result = run(PLOT, "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("tp_speedup.png", "multinode.png", "gemm_tflops.png", "collectives_busbw.png"):
        png = tmp_path / name
        assert png.exists(), f"{name} missing; stdout: {result.stdout} stderr: {result.stderr}"
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        assert png.stat().st_size < 150 * 1024, f"{name} is {png.stat().st_size} bytes"


def test_the_current_files_named_in_the_results_index_exist():
    spec = importlib.util.spec_from_file_location("bench_plot", PLOT)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    files = plot.current_files()
    assert len(files) >= 4
    for path in files:
        assert path.exists(), path


def test_plot_skips_kinds_without_a_plot_and_draws_new_families(tmp_path):
    pytest.importorskip("matplotlib")
    suite = write(tmp_path / "suite.json", {"kind": "suite", "suite": "single-node_2ranks", "passed": 3})
    rows = write(tmp_path / "rows.json", {"git_sha": "abc1234", "gpu": "H200", "world": 2, "rows": [
        {"op": "ring_attention", "M": m, "ms": {"loom": 1.0 * m, "flash_nccl": 1.2 * m}} for m in (1024, 2048)
    ] + [{"op": "mystery_op", "M": 1024, "ms": {"loom": 1.0}},
         {"op": "ag_gemm", "M": 1024, "N": 8, "K": 8, "ms": {"loom": 1.0}, "note": "world 1"}]})
    out = tmp_path / "img"
    result = run(PLOT, "--out", out, suite, rows)
    assert result.returncode == 0, result.stderr
    assert (out / "attention.png").exists()
    assert sorted(p.name for p in out.iterdir()) == ["attention.png"]
    assert "suite.json: skipped, a test-suite summary" in result.stderr
    assert "no plot for ops mystery_op" in result.stderr
    assert "tp: 1 rows left out: not a comparison (world 1)" in result.stderr


def test_plot_refuses_bad_input(tmp_path):
    pytest.importorskip("matplotlib")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert run(PLOT, "--out", tmp_path, broken).returncode == 1
    assert run(PLOT, "--out", tmp_path, tmp_path / "missing.json").returncode == 2
    suite = write(tmp_path / "suite.json", {"kind": "suite"})
    result = run(PLOT, "--out", tmp_path, suite)
    assert result.returncode == 2 and "nothing to plot" in result.stderr


def tp_run(path, loom_ms, baseline_ms=1.0):
    rows = [{"op": "ag_gemm", "dtype": "bf16", "b_layout": "nk", "M": m, "N": 8192, "K": 8192,
             "ms": {"loom": t, "nccl_cublas": baseline_ms}} for m, t in loom_ms.items()]
    return write(path, {"git_sha": "abc1234", "world": 2, "nodes": 1, "emulated_nodes": 0, "rows": rows})


def ratio_column(stdout):
    """{M: new/old} from compare.py's table."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("ag_gemm"):
            fields = line.split()
            out[int(fields[3].split("x")[0])] = float(fields[-1])
    return out


def test_compare_ratios_geomean_and_fail_over(tmp_path):
    old = tp_run(tmp_path / "old.json", {1024: 1.0, 2048: 2.0, 4096: 4.0})
    new = tp_run(tmp_path / "new.json", {1024: 1.1, 2048: 2.0, 4096: 3.6, 8192: 8.0})
    result = run(COMPARE, old, new)
    assert result.returncode == 0, result.stderr
    assert ratio_column(result.stdout) == {1024: 1.1, 2048: 1.0, 4096: 0.9}
    geomean = (1.1 * 1.0 * 0.9) ** (1 / 3)
    assert f"geomean new/old: {geomean:.3f} over 3 rows" in result.stdout
    assert "only in the new run: ag_gemm bf16 nk 8192x8192x8192" in result.stderr
    assert result.stdout.split("worst rows: ")[1].startswith("ag_gemm bf16 nk 1024x8192x8192 1.100")

    assert run(COMPARE, old, new, "--fail-over", 15).returncode == 0
    failed = run(COMPARE, old, new, "--fail-over", 5)
    assert failed.returncode == 1
    assert "FAIL: 1 rows slower by more than 5%: ag_gemm bf16 nk 1024x8192x8192 1.100" in failed.stdout


def test_compare_against_a_baseline_cancels_a_uniformly_slower_gpu(tmp_path):
    old = tp_run(tmp_path / "old.json", {1024: 1.0, 2048: 2.0}, baseline_ms=2.0)
    new = tp_run(tmp_path / "new.json", {1024: 1.2, 2048: 2.4}, baseline_ms=2.4)
    assert run(COMPARE, old, new, "--fail-over", 5).returncode == 1
    relative = run(COMPARE, old, new, "--baseline", "nccl_cublas", "--fail-over", 5)
    assert relative.returncode == 0, relative.stdout + relative.stderr
    assert all(math.isclose(r, 1.0) for r in ratio_column(relative.stdout).values())


def test_compare_takes_each_rows_median_over_rounds_and_checks_the_geomean(tmp_path):
    # Three rounds a side (scripts/device/gemm_ab.sh): one slow outlier round per side is ignored.
    old = ",".join(str(tp_run(tmp_path / f"old{i}.json", {1024: t, 2048: 2.0})) for i, t in enumerate((1.0, 1.0, 9.0)))
    new = ",".join(str(tp_run(tmp_path / f"new{i}.json", {1024: t, 2048: 2.03})) for i, t in enumerate((5.0, 1.01, 1.01)))
    out = tmp_path / "ab.json"
    result = run(COMPARE, old, new, "--fail-over", 2, "--fail-geomean-over", 1, "--json", out)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ratio_column(result.stdout) == {1024: 1.01, 2048: 1.015}
    assert "FAIL: the geometric mean is 1.25% slower (limit 1%)" in result.stdout
    assert "rows slower by more than" not in result.stdout
    doc = json.loads(out.read_text())
    assert doc["old"]["git_sha"] == ["abc1234"] and len(doc["new"]["files"]) == 3
    assert [row["M"] for row in doc["rows"]] == [1024, 2048]
    assert math.isclose(doc["rows"][0]["new_over_old"], 1.01)
    assert run(COMPARE, old, new, "--fail-over", 2, "--fail-geomean-over", 1.5).returncode == 0
    assert run(COMPARE, old, new, "--fail-geomean-over", "nan").returncode == 2


def test_compare_refuses_runs_of_different_kinds_and_bad_arguments(tmp_path):
    tp = tp_run(tmp_path / "tp.json", {1024: 1.0})
    collectives = write(tmp_path / "coll.json", {"rows": [
        {"op": "all_reduce", "dtype": "bf16", "bytes": 1 << 20, "ms": {"loom": 0.02, "nccl": 0.02}}]})
    different = run(COMPARE, tp, collectives)
    assert different.returncode == 2 and "share no row" in different.stderr
    suite = write(tmp_path / "suite.json", {"kind": "suite"})
    assert "test-suite summary" in run(COMPARE, tp, suite).stderr
    missing_column = run(COMPARE, tp, tp, "--column", "torch_fused")
    assert missing_column.returncode == 2 and "columns both timed: loom, nccl_cublas" in missing_column.stderr
    assert run(COMPARE, tp, tp, "--fail-over", "-1").returncode == 2
    assert run(COMPARE, tp, tmp_path / "missing.json").returncode == 2


def test_compare_reads_another_object_of_times(tmp_path):
    # bench/moe_layer.py rows: "ms" timed from an idle GPU, "ms_queued" the GPU's time alone, and
    # one launch's "phases" (numbers among other fields; a list is no time).
    def layer_run(path, queued, tail):
        return write(path, {"git_sha": "abc1234", "world": 1, "rows": [
            {"op": "moe_layer", "model": "deepseek-v3", "tokens": 4096, "routing": "uniform",
             "ms": {"loom": 5.0, "compute_bound": 4.5}, "ms_queued": {"loom": queued, "compute_bound": 4.4},
             "phases": {"combine_tail": tail, "ctas": 132, "per_cta": [{"cta": 0}]}}]})

    old = layer_run(tmp_path / "old.json", 4.8, 0.25)
    new = layer_run(tmp_path / "new.json", 4.56, 0.20)
    assert run(COMPARE, old, new).stdout.splitlines()[1].endswith("1.000")
    queued = run(COMPARE, old, new, "--times", "ms_queued", "--json", tmp_path / "q.json")
    assert queued.returncode == 0, queued.stderr
    assert "old ms_queued.loom ms" in queued.stdout and queued.stdout.splitlines()[1].endswith("0.950")
    assert json.loads((tmp_path / "q.json").read_text())["times"] == "ms_queued"
    relative = run(COMPARE, old, new, "--times", "ms_queued", "--baseline", "compute_bound")
    assert relative.stdout.splitlines()[1].endswith("0.950")
    tail = run(COMPARE, old, new, "--times", "phases", "--column", "combine_tail")
    assert tail.returncode == 0 and tail.stdout.splitlines()[1].endswith("0.800"), tail.stdout
    assert "moe_layer deepseek-v3 T4096 uniform" in tail.stdout
    missing = run(COMPARE, old, new, "--times", "phases", "--column", "per_cta")
    assert missing.returncode == 2 and "columns both timed: combine_tail, ctas" in missing.stderr
    assert run(COMPARE, old, new, "--times", "nothing").returncode == 2


def grouped_run(path, loom_ms):
    # bench/grouped_gemm.py rows: one per (model, gemm, tokens, routing), the same N and K for several.
    rows = [{"op": "grouped_gemm", "model": "deepseek-v3", "gemm": "fc1", "experts": 32, "tokens": 1024,
             "routing": routing, "rows": 8192, "N": 4096, "K": 7168, "ms": {"loom": t, "torch_grouped": 1.0}}
            for routing, t in loom_ms.items()]
    return write(path, {"git_sha": "abc1234", "world": 1, "rows": rows})


def test_compare_tells_grouped_gemm_rows_apart_by_routing(tmp_path):
    old = grouped_run(tmp_path / "old.json", {"uniform": 0.8, "random": 1.0, "skewed": 1.0})
    new = grouped_run(tmp_path / "new.json", {"uniform": 0.8, "random": 0.9, "skewed": 0.95})
    result = run(COMPARE, old, new)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[4]: float(line.split()[-1]) for line in result.stdout.splitlines()
             if line.startswith("grouped_gemm")}
    assert lines == {"uniform": 1.0, "random": 0.9, "skewed": 0.95}
    assert "grouped_gemm deepseek-v3 fc1 T1024 skewed (4096x7168, 32 experts)" in result.stdout
