#!/usr/bin/env bash
# The test command: installs dependencies, builds everything, runs the CPU suite, and the GPU
# suite too when this machine has an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/cuda/bin:$PATH"
scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
ctest --preset cpu
# The installed CMake package as a consumer uses it (find_package(loom), examples/consumer).
scripts/ci_consumer.sh

# Python package: `pip install .` exactly as a user runs it (it builds libloom and the extension,
# a few minutes on 2 cores) into a virtual environment with the test requirements, then the CPU
# pytest suite (the GPU tests skip themselves here). LOOM_TEST_PIP_PREBUILT=1 builds only the
# extension against the libloom.so above, for quicker local runs.
PY=${PYTHON:-python3}
[[ -x build/py-venv/bin/python ]] || "$PY" -m venv build/py-venv
build/py-venv/bin/python -m pip install -q -r python/requirements-test.txt
pip_args=(-Cbuild-dir=build/python)
[[ ${LOOM_TEST_PIP_PREBUILT:-0} == 1 ]] && pip_args+=(-Ccmake.define.LOOM_PREBUILT_LIBRARY="$PWD/build/libloom.so")
build/py-venv/bin/python -m pip install -q . "${pip_args[@]}"
build/py-venv/bin/python -m pytest tests/python -m "not gpu" -p no:cacheprovider -q
# The wheel as `pip wheel .` builds it, installed into a fresh environment and imported.
bash scripts/ci_wheel.sh build/libloom.so
if nvidia-smi -L >/dev/null 2>&1; then
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 ctest --preset gpu
else
  echo "test.sh: no NVIDIA GPU here; the GPU suite (ctest --preset gpu) was not run"
fi
