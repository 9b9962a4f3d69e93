#!/usr/bin/env bash
# Builds the loom-kernels wheel, installs it into a fresh virtual environment and imports it.
#
#   scripts/ci_wheel.sh [path/to/libloom.so]     (default: build/libloom.so)
#
# The wheel is the extension-only build (python/CMakeLists.txt) against the prebuilt libloom, so
# no CUDA compiler runs here; pip fetches the build requirements (scikit-build-core, nanobind,
# nlohmann-json) from PyPI. Prints the wheel's name, what `auditwheel show` says of it (when pip can
# install auditwheel) and loom.__version__ from the installed wheel. Exits non-zero on any failure.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
lib=$(realpath "${1:-$repo/build/libloom.so}")
python=${PYTHON:-python3}
[[ -f $lib ]] || { echo "ci_wheel: $lib does not exist (build the loom target first)" >&2; exit 1; }

work=$(mktemp -d /tmp/loom-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT

"$python" -m venv "$work/build-venv"
"$work/build-venv/bin/python" -m pip install -q --upgrade pip
(cd "$repo" && "$work/build-venv/bin/python" -m pip wheel . -q --no-deps -w "$work/dist" \
   -Cbuild-dir="$work/build" -Ccmake.source-dir=python -Ccmake.define.LOOM_PREBUILT_LIBRARY="$lib")
wheel=$(ls "$work"/dist/loom_kernels-*.whl)
echo "ci_wheel: built $(basename "$wheel")"

if "$work/build-venv/bin/python" -m pip install -q auditwheel 2>/dev/null; then
  echo "ci_wheel: auditwheel show:"
  "$work/build-venv/bin/auditwheel" show "$wheel" || true  # informational: the tag is linux_x86_64
else
  echo "ci_wheel: auditwheel could not be installed; skipped"
fi

"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-deps "$wheel"
# From outside the repository, so that the installed package is the one imported.
(cd "$work" && "$work/venv/bin/python" - <<'PY'
import pathlib

import loom

package = pathlib.Path(loom.__file__).parent
assert "site-packages" in str(package), package
for name in ("py.typed", "_C.pyi", "libloom.so"):
    assert (package / name).is_file(), f"the wheel lacks loom/{name}"
assert loom._C.library_version() == loom.__version__
print("ci_wheel: import loom ok:", loom.__version__)
PY
)
