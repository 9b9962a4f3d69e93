#!/usr/bin/env bash
# On the GPU machine: one device call of several steps. Each argument is a bash command, run in the
# repository root with OUT=$OUT/r (so the files of every step stay in one folder); each step's exit
# status and seconds go to $OUT/r/call.txt, after the GPU's name and the staged build's sha. At the
# end $OUT/r is packed into $OUT/results.tgz, since the device tool brings back only a few files
# from $OUT. A step that fails does not stop the next one; the exit status is 1 if any failed.
#
#   scripts/device/call.sh 'TEST_FILTER=Attention* scripts/device/attention_suite.sh tests' \
#                          'AB_LIMIT_S=200 scripts/device/attention_ab.sh 3'
#   (CALL_LIMIT_S: skip the steps that would start after that many seconds; default none)
# Back here: tar xzf <files_at>/results.tgz (the files are under r/).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/loom-out}
dir="$OUT/r"
mkdir -p "$dir"
summary="$dir/call.txt"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1 || echo "no nvidia-smi"
  tr '\n' ' ' < .device-carry/GIT_SHA 2>/dev/null && echo || echo "no .device-carry/GIT_SHA"
} > "$summary"
start=$(date +%s)
rc=0
for step in "$@"; do
  elapsed=$(( $(date +%s) - start ))
  if [[ -n ${CALL_LIMIT_S:-} ]] && (( elapsed >= CALL_LIMIT_S )); then
    echo "skipped at +${elapsed}s (CALL_LIMIT_S=$CALL_LIMIT_S): $step" >> "$summary"
    rc=1
    continue
  fi
  step_start=$(date +%s)
  OUT="$dir" bash -c "$step"
  r=$?
  ((r != 0)) && rc=1
  echo "exit $r in $(( $(date +%s) - step_start ))s: $step" >> "$summary"
done
tar -czf "$OUT/results.tgz" -C "$OUT" r
cat "$summary"
exit $rc
