"""docs/ENVIRONMENT.md against the code (scripts/dev/env_reference.py), and the check itself on
small fake checkouts: it must name every variable that is read but undocumented, documented but
unread, or listed wrongly in the page, and every reader whose range or default differs."""

import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts/dev/env_reference.py"

# Built at run time: the check scans this file too, and must not see these as reads.
ALPHA, BETA, GAMMA, OMEGA = ("LOOM_" + n for n in ("ALPHA", "BETA", "GAMMA", "OMEGA"))


@pytest.fixture(scope="module")
def ref():
    spec = importlib.util.spec_from_file_location("env_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_environment_page_matches_the_code():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def fake_checkout(root, table, code):
    """A checkout whose env.cc table lists `table` and whose other sources are `code`."""
    entries = "\n".join(f'    {{"{name}", "meaning of " "{name}"}},' for name in table)
    (root / "src/core").mkdir(parents=True)
    (root / "src/core/env.cc").write_text(f"constexpr VariableDoc kVariables[] = {{\n{entries}\n}};\n")
    for path, text in code.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def groups_of(ref, *variables):
    return (ref.Group("Runtime", "", variables),)


def alpha(ref, **changes):
    fields = dict(name=ALPHA, kind="integer", default=1, lo=1, hi=64)
    fields.update(changes)
    return ref.Var(**fields)


def test_a_consistent_checkout_passes_and_names_every_reader(ref, tmp_path):
    root = fake_checkout(tmp_path, [ALPHA], {
        "src/a.cc": f'constexpr int kMost = 1 << 6;\nauto v = env::get_int("{ALPHA}", 1, 1, kMost);\n',
        "python/loom/x.py": f'import os\nv = os.environ.get("{ALPHA}")\nos.environ["{BETA}"] = "1"\n',
        "scripts/run.sh": f'export NCCL_NVLS_ENABLE=0\necho "${{{ALPHA}:-1}}"\n',
    })
    problems, page, reads, switches = ref.build(root, groups_of(ref, alpha(ref)))
    assert problems == []
    assert BETA not in reads  # an assignment, not a read
    row = next(line for line in page.splitlines() if line.startswith(f"| `{ALPHA}`"))
    assert "library; Python package; scripts (`scripts/run.sh`)" in row
    assert f"meaning of {ALPHA}" in row  # the adjacent C strings of env.cc, joined
    assert "| `NCCL_NVLS_ENABLE` | `0` | scripts (`scripts/run.sh`) |" in page


def test_a_read_that_is_not_documented_is_named_with_its_place(ref, tmp_path):
    root = fake_checkout(tmp_path, [ALPHA], {
        "src/a.cc": f'auto a = env::get_int("{ALPHA}", 1, 1, 64);\nauto b = std::getenv("{BETA}");\n',
    })
    problems, _, _, _ = ref.build(root, groups_of(ref, alpha(ref)))
    assert any(p.startswith(f"{BETA} is read (src/a.cc:2) but not documented") for p in problems), problems
    assert any(p.startswith(f"{BETA} is read by the library") and "kVariables" in p for p in problems), problems


def test_a_documented_variable_that_nothing_reads_is_named(ref, tmp_path):
    root = fake_checkout(tmp_path, [ALPHA, OMEGA], {"src/a.cc": f'auto a = env::get_int("{ALPHA}", 1, 1, 64);\n'})
    gamma = ref.Var(GAMMA, "text", text_type="path", default_text="unset", meaning="a test knob")
    problems, _, _, _ = ref.build(root, groups_of(ref, alpha(ref), gamma))
    assert any(p.startswith(f"{GAMMA} is documented, but nothing") for p in problems), problems
    assert any(f"kVariables in src/core/env.cc lists {OMEGA}" in p for p in problems), problems


def test_a_reader_with_another_range_or_default_is_named(ref, tmp_path):
    root = fake_checkout(tmp_path, [ALPHA], {
        "src/a.cc": f"constexpr int64_t kMost = int64_t{{1}} << 5;\n"
                    f'auto a = env::get_int("{ALPHA}", 2\'000, 1, kMost);\n',
    })
    problems, _, _, _ = ref.build(root, groups_of(ref, alpha(ref)))
    assert f"src/a.cc:2: {ALPHA} accepts [1, 32]; GROUPS documents [1, 64]" in problems
    assert f"src/a.cc:2: {ALPHA} defaults to 2000; GROUPS documents 1" in problems


def test_a_choice_reader_with_other_choices_is_named(ref, tmp_path):
    root = fake_checkout(tmp_path, [ALPHA], {
        "src/a.cc": f'auto a = env::get_choice("{ALPHA}", "auto", {{"auto", "vmm"}});\n',
    })
    documented = ref.Var(ALPHA, "choice", default="auto", choices=("auto", "vmm", "ipc"))
    problems, _, _, _ = ref.build(root, groups_of(ref, documented))
    assert len(problems) == 1 and problems[0].startswith(f"src/a.cc:1: {ALPHA} reads one of ('auto', 'vmm')")


def test_a_stale_page_names_what_it_lacks_and_what_nothing_reads(ref, tmp_path):
    root = fake_checkout(tmp_path, [ALPHA], {"src/a.cc": f'auto a = env::get_int("{ALPHA}", 1, 1, 64);\n'})
    problems, page, reads, switches = ref.build(root, groups_of(ref, alpha(ref)))
    assert problems == [] and ref.page_problems(page, page, reads, switches) == []
    stale = "\n".join(line for line in page.splitlines() if ALPHA not in line) + f"\n| `{OMEGA}` | | | | |\n"
    (message,) = ref.page_problems(stale, page, reads, switches)
    assert f"it lacks {ALPHA}" in message and f"it lists {OMEGA}, which nothing reads" in message
    assert "--write" in message


def test_write_then_check_round_trips(ref, tmp_path, monkeypatch):
    root = fake_checkout(tmp_path, [ALPHA], {"src/a.cc": f'auto a = env::get_int("{ALPHA}", 1, 1, 64);\n'})
    (root / "docs").mkdir()
    monkeypatch.setattr(ref, "GROUPS", groups_of(ref, alpha(ref)))
    assert ref.main(["--root", str(root)]) == 1  # no page yet
    assert ref.main(["--root", str(root), "--write"]) == 0
    assert ref.main(["--root", str(root)]) == 0


def test_shell_comments_neither_read_nor_set(ref, tmp_path):
    root = fake_checkout(tmp_path, [ALPHA], {
        "src/a.cc": f'auto a = env::get_int("{ALPHA}", 1, 1, 64);\n',
        "scripts/run.sh": f'# echo ${{{BETA}}}; run NCCL_NVLS_ENABLE=1 scripts/run.sh for multicast\n'
                          'export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"  # NCCL_NVLS_ENABLE=2 here too\n',
    })
    problems, page, reads, switches = ref.build(root, groups_of(ref, alpha(ref)))
    assert problems == [] and BETA not in reads
    assert switches == {"NCCL_NVLS_ENABLE": {"`0` unless set": ["scripts/run.sh"]}}
