#!/usr/bin/env bash
# Here (no GPU): builds an earlier commit's libloom.so and loom-bench in a git worktree, as the
# "old" side of an A/B timing on the GPU machine (scripts/device/stage.sh --base DIR, then
# scripts/device/attention_ab.sh or gemm_ab.sh). Only the library and the benchmark are built
# (about 7 minutes on 2 cores from nothing).
#   scripts/dev/build_at.sh REV [DIR]     DIR: default /tmp/loom-build-<short sha>
# DIR then holds libloom.so, loom-bench and GIT_SHA (REV's full sha), which stage.sh reads.
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=$(git rev-parse --verify --quiet "${1:?usage: scripts/dev/build_at.sh REV [DIR]}^{commit}") ||
  { echo "build_at.sh: '$1' is not a commit here" >&2; exit 2; }
dir=$(realpath -m "${2:-/tmp/loom-build-${rev:0:7}}")
src=$dir/src
export PATH="/usr/local/cuda/bin:$PATH"
if [[ ! -d $src ]]; then
  mkdir -p "$dir"
  git worktree add --detach --quiet "$src" "$rev"
elif [[ $(git -C "$src" rev-parse HEAD) != "$rev" ]]; then
  echo "build_at.sh: $src holds another commit; name another DIR or remove it (git worktree remove $src)" >&2
  exit 2
fi
cmake -S "$src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=nvcc >/dev/null
cmake --build "$dir/build" --target loom loom-bench
cp "$dir/build/libloom.so" "$dir/build/loom-bench" "$dir/"
echo "$rev" > "$dir/GIT_SHA"
echo "build_at.sh: $dir (stage it: scripts/device/stage.sh --base $dir)"
