"""The benchmark scripts' plumbing (CPU): bench/merge_results.py joins torch_fused.py's rows, its
paired loom time included, bench/torch_fused.py parses the options the device script passes, and
bench/moe_layer.py parses its options, refuses the shared-GPU mode and routes as documented."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO


def write(path, doc):
    path.write_text(json.dumps(doc))
    return str(path)


LOOM_ROW = {"op": "ag_gemm", "M": 4096, "N": 14336, "K": 8192, "dtype": "bf16", "b_layout": "nk",
            "ms": {"loom": 1.40, "cublas": 1.37, "loom_gemm": 1.41, "nccl_cublas": 1.56}, "rel_err": 1.7e-3}


def merge(tmp_path, torch_rows):
    loom = write(tmp_path / "loom.json", {"rows": [dict(LOOM_ROW, ms=dict(LOOM_ROW["ms"]))]})
    torch = write(tmp_path / "torch.json", {"rows": torch_rows})
    out = tmp_path / "merged.json"
    run = subprocess.run([sys.executable, str(REPO / "bench/merge_results.py"), "--loom", loom, "--torch", torch,
                          "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(out.read_text())["rows"][0], run.stdout


def table_cell(stdout, label):
    """The ag_gemm row's cell under `label` (cells are right-aligned to their header's width)."""
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("op "))
    row = next(line for line in lines if line.startswith("ag_gemm"))
    start = header.index(" " + label + " ") + 1
    return row[start:start + len(label)].strip()


def test_merge_adds_the_paired_loom_time_and_its_ratio(tmp_path):
    torch_row = {"op": "ag_gemm", "M": 4096, "N": 14336, "K": 8192, "dtype": "bf16", "b_layout": "nk",
                 "ms": 1.30, "rel_err": 1.6e-3, "loom_ms": 1.25, "rel_err_loom": 1.7e-3}
    row, stdout = merge(tmp_path, [torch_row])
    assert row["ms"]["torch_fused"] == pytest.approx(1.30)
    assert row["ms"]["loom_beside_torch"] == pytest.approx(1.25)
    assert row["rel_err_loom_beside_torch"] == pytest.approx(1.7e-3)
    assert float(table_cell(stdout, "torch/loom")) == pytest.approx(1.30 / 1.40, abs=1e-3)
    assert float(table_cell(stdout, "paired")) == pytest.approx(1.30 / 1.25, abs=1e-3)


def test_merge_without_a_paired_time_leaves_the_column_empty(tmp_path):
    torch_row = {"op": "ag_gemm", "M": 4096, "N": 14336, "K": 8192, "dtype": "bf16", "b_layout": "nk",
                 "ms": 1.30, "rel_err": 1.6e-3}
    row, stdout = merge(tmp_path, [torch_row])
    assert "loom_beside_torch" not in row["ms"]
    assert table_cell(stdout, "paired") == "-"


def load_torch_fused():
    spec = importlib.util.spec_from_file_location("torch_fused", REPO / "bench/torch_fused.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no torch: that happens in main()
    return module


@pytest.mark.parametrize("flag", ["--m-values", "--m"])
def test_torch_fused_takes_m_values_under_either_name(monkeypatch, flag):
    module = load_torch_fused()
    monkeypatch.setattr(sys, "argv", ["torch_fused.py", flag, "2048,4096", "--loom", "--iters", "7"])
    args = module.parse_args()
    assert args.m == [2048, 4096]
    assert args.loom and args.iters == 7


def load_moe_layer_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # its `from bench_common import ...`
    spec = importlib.util.spec_from_file_location("moe_layer_bench", REPO / "bench/moe_layer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no torch or loom: that happens in main()
    return module


def test_grouped_gemm_bench_skew_ratio_per_shape(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("grouped_gemm_bench", REPO / "bench/grouped_gemm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no torch or loom: that happens in main()
    rows = [{"model": "m", "gemm": "fc1", "tokens": 1024, "routing": "uniform", "ms": {"loom": 2.0}},
            {"model": "m", "gemm": "fc1", "tokens": 1024, "routing": "skewed", "ms": {"loom": 2.1}},
            {"model": "m", "gemm": "fc2", "tokens": 1024, "routing": "skewed", "ms": {"loom": 1.0}}]
    assert module.skew_ratios(rows) == {("m", "fc1", 1024): pytest.approx(1.05)}  # fc2 has no uniform row
    rows.append({"model": "m", "gemm": "fc2", "tokens": 1024, "routing": "random", "ms": {"loom": 0.8}})
    assert module.skew_ratios(rows, "random") == {("m", "fc2", 1024): pytest.approx(1.25)}
    # Queued times, where a row has them: each ratio from its own timing.
    rows[0]["ms_queued"], rows[1]["ms_queued"] = {"loom": 1.8}, {"loom": 2.0}
    assert module.skew_ratios(rows, "uniform", "ms_queued") == {("m", "fc1", 1024): pytest.approx(2.0 / 1.8)}
    assert module.skew_ratios(rows, "random", "ms_queued") == {}


def test_moe_layer_bench_table_prints_the_queued_times(monkeypatch, capsys):
    module = load_moe_layer_bench(monkeypatch)
    ms = {"loom": 2.0, "compute_bound": 1.8, "loom_composed": 2.2, "torch": 3.0}
    row = {"model": "deepseek-v3", "tokens": 4096, "routing": "uniform", "max_over_mean": 1.0, "ms": ms,
           "rel_err": 1e-3, "composed_bits_equal": True}
    module.print_table([row])
    assert "queued" not in capsys.readouterr().out
    module.print_table([dict(row, ms_queued={"loom": 1.9, "compute_bound": 1.7, "loom_composed": 2.1, "torch": 2.9})])
    queued = capsys.readouterr().out.split("queued behind a spin kernel")[1]
    assert f"{1.7 / 1.9:.3f}" in queued and f"{2.9 / 1.9:.3f}" in queued


class FakeCudaClock:
    """A stand-in for torch.cuda (no GPU on CI): a GPU timeline that kernels and events advance, a
    spin kernel of `cycles` at 1000 cycles per microsecond, and candidate calls that take a fixed
    host time before their kernel is queued."""

    def __init__(self):
        self.gpu_free_at = 0.0  # ms on a common clock
        self.host_now = 0.0
        self.spins = []

    def launch(self, gpu_ms):  # a kernel queued now runs after what is queued before it
        self.gpu_free_at = max(self.gpu_free_at, self.host_now) + gpu_ms

    def _sleep(self, cycles):
        self.spins.append(cycles)
        self.launch(cycles / 1000 / 1000)

    def module(self):
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                clock.launch(0.0)
                self.at = clock.gpu_free_at

            def synchronize(self):
                clock.host_now = max(clock.host_now, self.at)

            def elapsed_time(self, end):
                return end.at - self.at

        cuda = type(sys)("torch.cuda")
        cuda.Event = Event
        cuda._sleep = self._sleep
        torch = type(sys)("torch")
        torch.cuda = cuda
        return torch


def test_time_shuffled_queued_timing_leaves_out_the_host_share(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import bench_common

    clock = FakeCudaClock()
    monkeypatch.setitem(sys.modules, "torch", clock.module())
    monkeypatch.setitem(sys.modules, "torch.cuda", clock.module().cuda)
    monkeypatch.setattr(bench_common, "_spin_cycles_per_us", lambda: 1000.0)

    def call(host_ms, gpu_ms):
        def run():
            clock.host_now += host_ms  # the host's work before the launch
            clock.launch(gpu_ms)
        return run

    candidates = {"slow_host": call(0.05, 1.0), "fast_host": call(0.001, 1.0)}
    idle = bench_common.time_shuffled(candidates, 1, 5)
    assert idle["slow_host"] == pytest.approx(1.05) and idle["fast_host"] == pytest.approx(1.001)
    host = {}
    queued = bench_common.time_shuffled(candidates, 1, 5, queue_behind_us=200.0, host_ms=host)
    assert queued == {"slow_host": pytest.approx(1.0), "fast_host": pytest.approx(1.0)}
    assert clock.spins and set(clock.spins) == {200_000}
    assert set(host) == {"slow_host", "fast_host"}
    samples = {}
    bench_common.time_shuffled(candidates, 1, 5, samples=samples)
    assert {name: len(t) for name, t in samples.items()} == {"slow_host": 5, "fast_host": 5}
    assert samples["slow_host"] == [pytest.approx(1.05)] * 5
    # time_both: the row's fields, the queued ones only when asked.
    assert set(bench_common.time_both(candidates, 1, 5)) == {"ms", "host_ms"}
    both = bench_common.time_both(candidates, 1, 5, queue_behind_us=200.0)
    assert set(both) == {"ms", "host_ms", "ms_queued"}
    assert both["ms"]["slow_host"] == pytest.approx(1.05) and both["ms_queued"]["slow_host"] == pytest.approx(1.0)
    # A spin shorter than a call's host work cannot hide it: said on stderr.
    bench_common.time_shuffled(candidates, 1, 5, queue_behind_us=0.001)
    assert "queued times include host time" in capsys.readouterr().err


def test_attention_bench_shuffles_the_run_order_only_when_asked(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("attention_bench", REPO / "bench/attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no torch or loom: that happens in main()
    monkeypatch.setattr(sys, "argv", ["attention.py"])
    assert not module.parse_args().shuffle_shapes
    monkeypatch.setattr(sys, "argv", ["attention.py", "--shuffle-shapes"])
    assert module.parse_args().shuffle_shapes
    assert module.case_order(36, False) == list(range(36))
    shuffled = module.case_order(36, True, seed=1)
    assert sorted(shuffled) == list(range(36)) and shuffled != list(range(36))
    assert module.case_order(36, True, seed=1) == shuffled  # a seed repeats its order


def test_moe_layer_bench_options(monkeypatch):
    module = load_moe_layer_bench(monkeypatch)
    args = module.parse_args([])
    assert (args.models, args.tokens, args.routing, args.tile) == (
        ["deepseek-v3", "qwen3-235b"], [1024, 4096, 16384], ["uniform", "skewed"], "auto")
    assert args.iters >= 20 and args.json == "" and not args.phases and not args.padded
    args = module.parse_args(["--tokens", "4096", "--models", "qwen3-235b", "--tile", "128x256", "--phases"])
    assert (args.tokens, args.models, args.tile, args.phases) == ([4096], ["qwen3-235b"], "128x256", True)
    assert module.parse_args(["--padded"]).padded
    assert args.queue_behind_us == 0 and module.parse_args(["--queue-behind-us", "500"]).queue_behind_us == 500
    for bad in (["--iters", "19"], ["--models", "mixtral"], ["--routing", "all-to-one"], ["--tile", "64x64"]):
        with pytest.raises(SystemExit):
            module.parse_args(bad)
    assert module.MODELS["deepseek-v3"] == (7168, 2048, 32, 8) and module.MODELS["qwen3-235b"] == (4096, 1536, 16, 8)
    # --shared-expert keeps the models that have one (DeepSeek-V3), and refuses a list of none.
    assert module.parse_args(["--shared-expert"]).models == ["deepseek-v3"]
    with pytest.raises(SystemExit):
        module.parse_args(["--shared-expert", "--models", "qwen3-235b"])


def test_moe_layer_bench_phase_summary(monkeypatch):
    # Two CTAs entered at 1 and 2 us: a push CTA done with its dispatch at 101 us, a compute CTA;
    # first tiles at 150 and 120 us, queues dry at 900 and 950 us, combine shares done at 1000
    # and 990 us; waits of 10 / 30 us (fc1) and 4 / 6 us (fc2).
    module = load_moe_layer_bench(monkeypatch)
    us = 1000
    records = [dict(entered_ns=1 * us, roles_done_ns=101 * us, first_tile_ns=150 * us, tiles_done_ns=900 * us,
                    reduced_ns=1000 * us, up_wait_ns=10 * us, down_wait_ns=4 * us, role="push", tiles=5, cta=0),
               dict(entered_ns=2 * us, roles_done_ns=2 * us, first_tile_ns=120 * us, tiles_done_ns=950 * us,
                    reduced_ns=990 * us, up_wait_ns=30 * us, down_wait_ns=6 * us, role="compute", tiles=7, cta=1)]
    got = module.summarize_phases(records)
    want = {"ctas": 2, "dispatch_done": 0.1, "first_tile_median": 0.149, "first_tile_last": 0.149,
            "queue_dry_first": 0.899, "queue_dry_last": 0.949, "combine_done": 0.999, "combine_tail": 0.05,
            "up_wait_per_cta": 0.02,
            "down_wait_per_cta": 0.005, "tiles": 12,
            # the compute-only CTAs on their own: CTA 1
            "compute_ctas": 1, "compute_first_tile_median": 0.119, "compute_up_wait_per_cta": 0.03,
            "compute_down_wait_per_cta": 0.006}
    per_cta = got.pop("per_cta")
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-9 for k in want), got
    first = {"cta": 0, "role": "push", "tiles": 5, "roles_done": 0.1, "first_tile": 0.149, "tiles_done": 0.899,
             "reduced": 0.999, "up_wait": 0.01, "down_wait": 0.004}
    assert per_cta[0].keys() == first.keys()
    assert all(per_cta[0][k] == first[k] if isinstance(first[k], str) else abs(per_cta[0][k] - first[k]) < 1e-9
               for k in first), per_cta[0]
    assert [c["cta"] for c in per_cta] == [0, 1]


@pytest.mark.parametrize("env,says", [({"LOOM_RANKS_PER_GPU": "2"}, "LOOM_RANKS_PER_GPU=2 is the shared-GPU mode"),
                                      ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2: this is the W = 1 benchmark")])
def test_moe_layer_bench_refuses_before_touching_a_gpu(env, says):
    base = {k: v for k, v in os.environ.items() if k not in ("LOOM_RANKS_PER_GPU", "WORLD_SIZE")}
    run = subprocess.run([sys.executable, str(REPO / "bench/moe_layer.py"), "--json", "never.json"],
                         env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and says in run.stderr, run.stderr


def test_moe_layer_bench_routing_and_torch_order(monkeypatch):
    torch = pytest.importorskip("torch")
    module = load_moe_layer_bench(monkeypatch)
    experts, k, tokens = 16, 8, 512
    uniform = module.make_topk_ids("uniform", tokens, experts, k, seed=3)
    skewed = module.make_topk_ids("skewed", tokens, experts, k, seed=3)
    for ids in (uniform, skewed):
        assert ids.dtype == torch.int32 and ids.shape == (tokens, k)
        assert all(len(set(row)) == k for row in ids.tolist()), "a token's experts must be distinct"
        assert 0 <= ids.min() and ids.max() < experts
    assert torch.equal(skewed, module.make_topk_ids("skewed", tokens, experts, k, seed=3))  # reproducible
    order, token_of_row, ends = module.expert_order(skewed, experts)
    flat = skewed.reshape(-1).long()
    # The receive order at W = 1: by expert, then token, then slot; ends are torch._grouped_mm's offs.
    assert [(int(flat[i]), int(i) // k, int(i) % k) for i in order] == sorted(
        (int(e), i // k, i % k) for i, e in enumerate(flat))
    assert torch.equal(token_of_row, order // k)
    assert ends.dtype == torch.int32 and ends.tolist() == torch.bincount(flat, minlength=experts).cumsum(0).tolist()


def test_timeline_summary_places_slow_epilogues_in_their_quarter(tmp_path):
    # 8 tiles on 2 CTAs at 1 GHz (1 cycle per ns), 100 us each: mainloop 98 us, epilogue 2 us,
    # except the first tile of each CTA, whose epilogue takes 20 us (a burst at the start).
    header = "tile,m_block,n_block,kind,cta,smid,claimed_ns,stored_ns,claimed_clock,mainloop_clock,stored_clock,fold_cycles"
    lines = ["# op=gemm_rs M=512 N=512 K_rank=64 what=fused tile=128x256 rank=0 world=2", header]
    tile = 0
    for cta in range(2):
        t = 0
        for i in range(4):
            epi = 20_000 if i == 0 else 2_000
            main_end = t + 98_000
            lines.append(f"{tile},{i},{cta},0,{cta},{cta},{t},{main_end + epi},{t},{main_end},{main_end + epi},0")
            t = main_end + epi
            tile += 1
    path = tmp_path / "timeline_gemm_rs_512_fused_rank0.csv"
    path.write_text("\n".join(lines) + "\n")
    run = subprocess.run([sys.executable, str(REPO / "bench/timeline_summary.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "8 items on 2 CTAs" in run.stdout
    assert "slow epilogues (> 6.0 us): 2 of 8, by quarter of the span [2, 0, 0, 0]" in run.stdout, run.stdout


def test_timeline_summary_splits_the_fold_when_the_csv_has_its_parts(tmp_path):
    # 4 fold tiles on one CTA at 1 GHz: fold 2500 cycles = drain 800 + previous signal 200 + 1500.
    header = ("tile,m_block,n_block,kind,cta,smid,claimed_ns,stored_ns,claimed_clock,mainloop_clock,stored_clock,"
              "fold_cycles,fold_drain_cycles,fold_signal_cycles")
    lines = ["# op=gemm_ar M=512 N=256 K_rank=64 what=fused tile=128x256 rank=0 world=2", header]
    t = 0
    for i in range(4):
        main_end = t + 98_000
        lines.append(f"{i},{i},0,4,0,0,{t},{main_end + 2_000},{t},{main_end},{main_end + 2_000},2500,800,200")
        t = main_end + 2_000
    (tmp_path / "timeline_gemm_ar_512_fused_rank0.csv").write_text("\n".join(lines) + "\n")
    run = subprocess.run([sys.executable, str(REPO / "bench/timeline_summary.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "fold: median   2.50 us" in run.stdout, run.stdout
    assert "drain  0.80 us, previous signal  0.20 us, partials  1.50 us" in run.stdout, run.stdout


def test_timeline_summary_reports_the_tail_split(tmp_path):
    # At 1 GHz: two whole fold tiles (fold 2 us), then a split tile: two pieces claimed at 300 us
    # (40 us each, records after the tiles, m_block -1) and its fold item claimed at 301 us,
    # stored at 361 us after a 20 us fold (it waited for the pieces).
    header = ("tile,m_block,n_block,kind,cta,smid,claimed_ns,stored_ns,claimed_clock,mainloop_clock,stored_clock,"
              "fold_cycles,fold_drain_cycles,fold_signal_cycles")
    lines = ["# op=gemm_ar M=512 N=256 K_rank=64 what=fused tile=128x256 rank=0 world=2", header]
    for i in range(2):
        t = i * 100_000
        lines.append(f"{i},{i},0,4,0,0,{t},{t + 100_000},{t},{t + 98_000},{t + 100_000},2000,500,200")
    for slot in range(2):
        t = 300_000
        lines.append(f"{4 + slot},-1,-1,5,{1 + slot},{1 + slot},{t},{t + 40_000},{t},{t + 39_000},{t + 40_000},0,0,0")
    t = 301_000
    lines.append(f"2,2,0,4,0,0,{t},{t + 60_000},{t},{t + 58_000},{t + 60_000},20000,500,200")
    (tmp_path / "timeline_gemm_ar_512_fused_rank0.csv").write_text("\n".join(lines) + "\n")
    run = subprocess.run([sys.executable, str(REPO / "bench/timeline_summary.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert ("tail split: 2 pieces claimed from 300.0 us, claim to stored median 40.0 us; 1 folds since: "
            "claim to stored median 60.0 us, fold median 20.0 max 20.0 us") in run.stdout, run.stdout


def test_timeline_summary_reports_whole_tiles_left_beside_the_pieces(tmp_path):
    # At 1 GHz: a whole tile claimed with two pieces at 300 us ends at 390 us, after both pieces
    # (340 us): the split left it out.
    header = ("tile,m_block,n_block,kind,cta,smid,claimed_ns,stored_ns,claimed_clock,mainloop_clock,stored_clock,"
              "fold_cycles,fold_drain_cycles,fold_signal_cycles")
    lines = ["# op=ag_gemm M=512 N=256 K_rank=64 what=fused tile=128x256 rank=0 world=2", header]
    lines.append("0,0,0,0,0,0,0,90000,0,88000,90000,0,0,0")
    lines.append("1,1,0,0,0,0,300000,390000,300000,388000,390000,0,0,0")
    for slot in range(2):
        lines.append(f"{2 + slot},-1,-1,5,{1 + slot},{1 + slot},300000,340000,300000,339000,340000,0,0,0")
    (tmp_path / "timeline_ag_gemm_512_fused_rank0.csv").write_text("\n".join(lines) + "\n")
    run = subprocess.run([sys.executable, str(REPO / "bench/timeline_summary.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "1 whole tiles end after the last piece, the latest at 390.0 us" in run.stdout, run.stdout


# ---- bench/suite_summary.py ------------------------------------------------------------------------

def _gtest_json(cases):
    """A GoogleTest JSON report: cases = [(suite, name, outcome)], outcome passed / failed / skipped."""
    suites = {}
    for suite, name, outcome in cases:
        case = {"name": name, "status": "RUN", "result": "SKIPPED" if outcome == "skipped" else "COMPLETED"}
        if outcome == "failed":
            case["failures"] = [{"failure": "boom", "type": ""}]
        suites.setdefault(suite, []).append(case)
    return json.dumps({"testsuites": [{"name": s, "testsuite": c} for s, c in suites.items()]})


def _summary(tmp_path, files, *extra):
    args = [sys.executable, str(REPO / "bench/suite_summary.py"), "--suite", "multi-node_2x2", "--ranks", "2",
            "--ranks-per-gpu", "2", "--emulated-nodes", "2", "--gpus", "1", "--wall-s", "12.34", "--git-sha", "abc1234",
            "--date", "2026-12-01", *extra]
    run = subprocess.run(args + [str(f) for f in files], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def test_suite_summary_counts_each_test_once_over_ranks(tmp_path):
    r0, r1 = tmp_path / "rank0.json", tmp_path / "rank1.json"
    r0.write_text(_gtest_json([("A", "ok", "passed"), ("A", "bad", "passed"), ("B", "skip", "skipped"),
                               ("B", "half", "skipped")]))
    r1.write_text(_gtest_json([("A", "ok", "passed"), ("A", "bad", "failed"), ("B", "skip", "skipped"),
                               ("B", "half", "passed")]))
    s = _summary(tmp_path, [r0, r1], "--exit-code", "1")
    assert s["kind"] == "suite" and s["suite"] == "multi-node_2x2" and s["git_sha"] == "abc1234"
    assert (s["ranks"], s["ranks_per_gpu"], s["emulated_nodes"], s["gpus"]) == (2, 2, 2, 1)
    assert (s["passed"], s["failed"], s["skipped"]) == (2, 1, 1)
    assert s["failures"] == ["A.bad"] and s["missing_ranks"] == [] and s["wall_s"] == 12.3


def test_suite_summary_never_reads_green_for_a_broken_run(tmp_path):
    r0 = tmp_path / "rank0.json"
    r0.write_text(_gtest_json([("A", "ok", "passed")]))
    missing = _summary(tmp_path, [r0], "--exit-code", "0")
    assert missing["failed"] == 1 and missing["missing_ranks"] == [1], "rank 1 left no result"
    both = tmp_path / "rank1.json"
    both.write_text(_gtest_json([("A", "ok", "passed")]))
    hung = _summary(tmp_path, [r0, both], "--exit-code", "124")
    assert hung["passed"] == 1 and hung["failed"] == 1 and "exited 124" in hung["failures"][0]


def test_suite_summary_reads_pytest_junit_xml(tmp_path):
    for rank, outcome in ((0, ""), (1, "<failure message='x'/>")):
        (tmp_path / f"rank{rank}.xml").write_text(
            "<testsuites><testsuite name='pytest'>"
            "<testcase classname='test_gpu' name='test_a'/>"
            f"<testcase classname='test_gpu' name='test_b'>{outcome}</testcase>"
            "<testcase classname='test_gpu' name='test_c'><skipped message='no'/></testcase>"
            "</testsuite></testsuites>")
    s = _summary(tmp_path, [tmp_path / "rank0.xml", tmp_path / "rank1.xml"], "--exit-code", "1")
    assert (s["passed"], s["failed"], s["skipped"]) == (1, 1, 1) and s["failures"] == ["test_gpu.test_b"]


def test_suite_summary_split_writes_one_file_per_suite(tmp_path):
    lines = [{"kind": "suite", "git_sha": "abc1234+", "date": "2026-12-01", "suite": name, "passed": 1}
             for name in ("multi-node_2x2", "single-node_2ranks")]
    jsonl = tmp_path / "suites.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run = subprocess.run([sys.executable, str(REPO / "bench/suite_summary.py"), "split", str(jsonl), str(tmp_path)],
                         capture_output=True, text=True, check=True)
    made = sorted(p.name for p in tmp_path.glob("*_suite_*.json"))
    assert made == ["2026-12-01_abc1234+_suite_multi-node_2x2.json", "2026-12-01_abc1234+_suite_single-node_2ranks.json"]
    assert json.loads((tmp_path / made[0]).read_text())["suite"] == "multi-node_2x2"
    assert len(run.stdout.split()) == 2


# ---- scripts/device/call.sh --------------------------------------------------------------------------

def test_device_call_runs_every_step_and_packs_their_files(tmp_path):
    out = tmp_path / "out"
    steps = ['echo one > "$OUT/a.txt"', "exit 3", 'mkdir -p "$OUT/sub" && echo two > "$OUT/sub/b.txt"']
    run = subprocess.run(["bash", str(REPO / "scripts/device/call.sh"), *steps], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, OUT=str(out)))
    assert run.returncode == 1  # the failed step, after which the next one still ran
    listing = subprocess.run(["tar", "-tzf", str(out / "results.tgz")], capture_output=True, text=True,
                             check=True).stdout.split()
    assert {"r/a.txt", "r/sub/b.txt", "r/call.txt"} <= set(listing)
    summary = (out / "r" / "call.txt").read_text().splitlines()
    assert [line.split(" in ")[0] for line in summary[2:]] == ["exit 0", "exit 3", "exit 0"]


def test_device_call_skips_steps_past_its_limit(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(REPO / "scripts/device/call.sh"), "sleep 1", "echo late"],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, OUT=str(out), CALL_LIMIT_S="1"))
    assert run.returncode == 1
    summary = (out / "r" / "call.txt").read_text()
    assert re.search(r"skipped at \+\d+s \(CALL_LIMIT_S=1\): echo late", summary) and (out / "results.tgz").exists()


# ---- scripts/dev/build_at.sh ---------------------------------------------------------------------------

def test_build_at_refuses_what_is_not_a_commit(tmp_path):
    run = subprocess.run(["bash", str(REPO / "scripts/dev/build_at.sh"), "no-such-revision", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "'no-such-revision' is not a commit here" in run.stderr
    assert not (tmp_path / "b").exists()  # nothing built or checked out
