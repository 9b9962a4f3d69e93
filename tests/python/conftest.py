"""Shared pieces of the Python tests.

CPU tests run anywhere (CI: `pytest tests/python -m "not gpu"`). GPU tests (marked `gpu`) run as
every rank of `torchrun --nproc-per-node 2 -m pytest tests/python -m gpu` on the GPU machine
(scripts/device/python_suite.sh) and are skipped elsewhere.
"""

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def project_version() -> str:
    text = (REPO / "include/loom/version.h").read_text()
    return re.search(r'#define LOOM_VERSION_STRING "([0-9.]+)"', text).group(1)


def gpu_job() -> bool:
    """True in a torchrun job on a machine with CUDA GPUs."""
    if "WORLD_SIZE" not in os.environ:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """LOOM_TEST_JUNIT_DIR=d: every rank of a torchrun job writes its JUnit XML to d/rank<RANK>.xml
    (torchrun passes one command line to all ranks; scripts/device/shared_gpu_suite.sh reads them)."""
    directory = os.environ.get("LOOM_TEST_JUNIT_DIR")
    if directory and not getattr(config.option, "xmlpath", None):
        config.option.xmlpath = os.path.join(directory, f"rank{os.environ.get('RANK', '0')}.xml")


def pytest_collection_modifyitems(config, items):
    if gpu_job():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs and a torchrun job (scripts/device/python_suite.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
