# Sourced by scripts/device/gemm_ab.sh and attention_ab.sh: times two builds (old, new) of one
# benchmark in the same shuffled rounds, so the GPU's clock and temperature drift alike for both.
#
#   ab_rounds NAME ROUNDS LIMIT_S DIR RUN_SIDE
# RUN_SIDE is a function called as `RUN_SIDE SIDE JSON LEFT_S` (SIDE old or new; LEFT_S the seconds
# left of LIMIT_S) that runs one side once and writes JSON; its output goes to DIR/<side>_<round>.log.
# Fills the arrays old_files and new_files with the rounds' JSON; rounds stop when fewer than 10 s
# are left. Returns 1 (after printing the log's tail) when a run fails or no round completed.
# Joined with commas (`ab_join "${old_files[@]}"`) they are bench/compare.py's arguments.
ab_rounds() {
  local name=$1 rounds=$2 limit=$3 dir=$4 run_side=$5
  local start r side left json log
  start=$(date +%s)
  old_files=() new_files=()
  for (( r = 1; r <= rounds; r++ )); do
    for side in $(printf 'old\nnew\n' | shuf); do
      left=$(( limit - ($(date +%s) - start) ))
      if (( left < 10 )); then echo "$name: out of time after $((r - 1)) rounds" >&2; break 2; fi
      json="$dir/${side}_$r.json"
      log="$dir/${side}_$r.log"
      if ! "$run_side" "$side" "$json" "$left" > "$log" 2>&1; then
        echo "$name: round $r, $side failed (log: $log)" >&2
        tail -5 "$log" >&2
        return 1
      fi
      if [[ $side == old ]]; then old_files+=("$json"); else new_files+=("$json"); fi
    done
  done
  # A round cut by the limit after one side leaves the sides uneven: compare whole rounds only.
  (( ${#old_files[@]} > ${#new_files[@]} )) && old_files=("${old_files[@]:0:${#new_files[@]}}")
  (( ${#new_files[@]} > ${#old_files[@]} )) && new_files=("${new_files[@]:0:${#old_files[@]}}")
  (( ${#new_files[@]} > 0 )) || { echo "$name: no complete round" >&2; return 1; }
}

ab_join() { local IFS=,; echo "$*"; }
