"""loom-bench's command line (CPU): the help text, --version and usage errors (exit status 2 and a
message that names the problem). None of it needs a GPU: the command line is checked first."""

import os
import re
import subprocess

import pytest

from conftest import REPO, project_version

BENCH = REPO / "build/loom-bench"

pytestmark = pytest.mark.skipif(not BENCH.exists(), reason="build/loom-bench is not built")


def bench(*args, env=None):
    return subprocess.run([str(BENCH), *args], capture_output=True, text=True, timeout=60, env=env)


def test_help_shows_the_defaults():
    run = bench("--help")
    assert run.returncode == 0, run.stderr
    assert re.search(r"--iters .*=30\b", run.stdout), run.stdout
    assert re.search(r"--dtype .*=bf16\b", run.stdout), run.stdout
    assert re.search(r"--spawn .*=-1\b", run.stdout), run.stdout


@pytest.mark.parametrize("subcommand", ["collectives", "all_reduce", "gemm", "tp", "gemm_rs", "tune", "multinode", "all"])
def test_subcommand_help_lists_the_global_options(subcommand):
    run = bench(subcommand, "--help")
    assert run.returncode == 0, run.stderr
    globals_part = run.stdout.split("Global options", 1)
    assert len(globals_part) == 2, run.stdout
    for option in ("--spawn", "--json", "--warmup", "--iters", "--dtype"):
        assert option in globals_part[1], run.stdout


def test_subcommand_help_shows_its_defaults():
    run = bench("gemm", "--help")
    assert re.search(r"--m .*=\[128,512,", run.stdout), run.stdout
    assert re.search(r"--layout .*=nk\b", run.stdout), run.stdout


def test_help_starts_torchrun_without_python():
    text = bench("--help").stdout
    assert "torchrun --no-python --nproc-per-node 8 build/loom-bench" in text
    assert not re.search(r"torchrun (?!--no-python)--nproc", text)


def test_version_is_loom_version():
    run = bench("--version")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"loom-bench {project_version()}"


@pytest.mark.parametrize("args, message", [
    ([], "a subcommand is required (one of: all_gather, reduce_scatter, all_reduce, collectives, gemm,"),
    (["bogus"], "unknown subcommand 'bogus' (the subcommands: all_gather,"),
    (["--iters", "5", "bogus"], "unknown subcommand 'bogus'"),
    (["--bogus"], "not a global option: --bogus"),
    (["gemm", "--m", "x"], "--m: 'x' is not an integer"),
    (["gemm", "--m", "0"], "--m: 0 is not >= 1"),
    (["gemm", "--nk", "12"], "--nk: expected NxK (e.g. 14336x8192), got '12'"),
    (["gemm", "--tile", "7x7"], "--tile: unknown GEMM tile '7x7'"),
    (["gemm", "extra"], "not expected: extra"),
    (["gemm", "--iters", "0"], "--iters: 0 is not in [1, 100000]"),
    (["--spawn", "-3", "tp"], "--spawn: -3 is not in [-1, 4096]"),
    (["collectives", "--sizes", "3"], "--sizes 3: not a multiple of the bf16 element size (2 bytes)"),
    (["collectives", "--sizes", "1Q"], "--sizes: size='1Q': unknown size suffix"),
    (["--dtype", "fp32", "tp"], "--dtype fp32: only the collectives run fp32"),
    (["tune"], "--cache is required"),
    (["tune", "--cache", "c.json", "--ops", "ag_gemm,foo"], "--ops: foo not in {ag_gemm,gemm_rs,gemm_ar}"),
    (["--json", "/nonexistent-loom-dir/x.json", "gemm"], "--json /nonexistent-loom-dir/x.json: cannot write into"),
])
def test_usage_errors_exit_2_with_a_precise_message(args, message):
    run = bench(*args)
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert message in run.stderr, run.stderr
    assert "--help" in run.stderr  # where to look next


def test_no_visible_gpu_is_a_failed_run_not_a_usage_error():
    run = bench("gemm", env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert "no CUDA GPU is visible" in run.stderr
