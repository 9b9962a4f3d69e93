"""The package imports without torch and without a GPU, and says what it is."""

import subprocess
import sys

import pytest

from conftest import project_version


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_version_matches_the_cmake_project():
    import loom

    assert loom.__version__ == project_version()
    assert loom._C.library_version() == loom.__version__, "the extension and its libloom.so disagree"


def test_import_loom_needs_no_torch():
    # torch made unimportable: `import loom` and the low-level API must still work.
    result = run_python(
        "import sys; sys.modules['torch'] = None\n"
        "import loom\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print(loom.__version__, len(loom.make_unique_id()))\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [project_version(), "128"]


def test_import_loom_does_not_import_torch():
    result = run_python("import sys, loom; print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_public_names():
    import loom

    for name in ("Communicator", "make_unique_id", "gemm", "all_gather", "reduce_scatter", "all_reduce", "ag_gemm",
                 "gemm_rs", "gemm_ar", "LoomError", "InvalidArgument", "Unsupported", "Timeout", "PeerFailure",
                 "CudaError", "SystemCallError", "Aborted", "InternalError"):
        assert hasattr(loom, name), name


def test_extension_finds_its_libloom_next_to_it():
    import loom

    with open("/proc/self/maps") as maps:
        libs = {line.split()[-1] for line in maps if "libloom" in line}
    assert libs, "libloom.so is not mapped"
    package_dir = __import__("os").path.dirname(loom._C.__file__)
    assert all(lib.startswith(package_dir) for lib in libs), (libs, package_dir)


def test_loom_torch_registers_every_op():
    torch = pytest.importorskip("torch")
    import loom.torch  # noqa: F401

    for op in ("gemm", "all_gather", "reduce_scatter", "all_reduce", "ag_gemm", "gemm_rs", "gemm_ar"):
        assert hasattr(torch.ops.loom, op), op
