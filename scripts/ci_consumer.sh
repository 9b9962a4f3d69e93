#!/usr/bin/env bash
# Checks loom's CMake package as a user gets it: installs the already-built tree build/ into a
# temporary prefix, builds examples/consumer against that install (find_package(loom)), and runs
# it. Run after `cmake --build --preset default` (LOOM_TEST_BUILD_DIR names another build tree); any
# failure ends the script non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/cuda/bin:$PATH"

build_dir=${LOOM_TEST_BUILD_DIR:-build}
[[ -f $build_dir/CMakeCache.txt ]] || { echo "ci_consumer.sh: $build_dir is not a configured build (cmake --preset default)" >&2; exit 1; }

build_abs=$(cd "$build_dir" && pwd)

tmp=$(mktemp -d "${TMPDIR:-/tmp}/loom-consumer.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

cmake --install "$build_dir" --prefix "$prefix" >/dev/null
for f in include/loom/loom.h include/loom/version.h lib/libloom.so \
         lib/cmake/loom/loomConfig.cmake lib/cmake/loom/loomConfigVersion.cmake lib/cmake/loom/loomTargets.cmake; do
  [[ -e $prefix/$f ]] || { echo "ci_consumer.sh: the install lacks $f" >&2; exit 1; }
done

# Ninja when present (as the presets use), else CMake's default generator.
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S examples/consumer -B "$tmp/consumer" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
# The installed libloom must be the one found (not the build tree's): the consumer's RUNPATH names
# the prefix only.
if readelf -d "$tmp/consumer/loom_consumer" | grep -qF "$build_abs"; then
  echo "ci_consumer.sh: loom_consumer points into $build_dir instead of the install" >&2
  exit 1
fi
# Bounded: creating a one-rank communicator on a GPU machine takes seconds.
timeout 120 "$tmp/consumer/loom_consumer"
echo "ci_consumer.sh: examples/consumer built and ran against the installed package"
