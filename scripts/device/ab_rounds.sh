# Sourced by scripts/device/gemm_ab.sh and attention_ab.sh: times two or more builds of one
# benchmark in the same shuffled rounds, so the GPU's clock and temperature drift alike for all.
#
#   ab_rounds NAME ROUNDS LIMIT_S DIR RUN_SIDE [SIDE...]
# SIDEs default to `old new`. RUN_SIDE is a function called as `RUN_SIDE SIDE JSON LEFT_S` (LEFT_S
# the seconds left of LIMIT_S) that runs one side once and writes JSON; its output goes to
# DIR/<side>_<round>.log. Fills the associative array ab_files (side -> the rounds' JSON, joined
# with commas: bench/compare.py's arguments) and, for the two default sides, the arrays old_files
# and new_files; rounds stop when fewer than 10 s are left. Returns 1 (after printing the log's
# tail) when a run fails or no round completed.
declare -A ab_files
ab_rounds() {
  local name=$1 rounds=$2 limit=$3 dir=$4 run_side=$5
  shift 5
  local sides=("$@")
  ((${#sides[@]})) || sides=(old new)
  local start r side left json log done_rounds=0
  start=$(date +%s)
  ab_files=()
  declare -A per_side=()
  for (( r = 1; r <= rounds; r++ )); do
    for side in $(printf '%s\n' "${sides[@]}" | shuf); do
      left=$(( limit - ($(date +%s) - start) ))
      if (( left < 10 )); then echo "$name: out of time after $((r - 1)) rounds" >&2; break 2; fi
      json="$dir/${side}_$r.json"
      log="$dir/${side}_$r.log"
      if ! "$run_side" "$side" "$json" "$left" > "$log" 2>&1; then
        echo "$name: round $r, $side failed (log: $log)" >&2
        tail -5 "$log" >&2
        return 1
      fi
      per_side[$side]+="${per_side[$side]:+ }$json"
    done
    done_rounds=$r
  done
  # A round cut by the limit leaves the sides uneven: compare whole rounds only.
  (( done_rounds > 0 )) || { echo "$name: no complete round" >&2; return 1; }
  local files
  for side in "${sides[@]}"; do
    read -r -a files <<< "${per_side[$side]}"
    ab_files[$side]=$(ab_join "${files[@]:0:done_rounds}")
  done
  old_files=() new_files=()
  [[ -n ${ab_files[old]:-} ]] && IFS=, read -r -a old_files <<< "${ab_files[old]}"
  [[ -n ${ab_files[new]:-} ]] && IFS=, read -r -a new_files <<< "${ab_files[new]}"
  return 0
}

ab_join() { local IFS=,; echo "$*"; }
