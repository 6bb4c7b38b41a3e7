# Sourced by gpu_check.sh and gpu_flags.sh: where their results go, and packing them for the
# lent GPU machine, which returns at most 8 files from $OUT and none more than two folders down
# (the device tool's README). There (OUT set, not a dry run; or PACK=1) a script writes its
# results three folders down, $OUT/raw/NAME/results, and after each stage packs them into
# $OUT/NAME.tgz, its status table copied beside it, so a run cut short still returns what it
# measured; elsewhere it writes into $OUT, else benchmarks/results/gpu.
#
# The lent machine also runs one command for at most 600 s and a session has 15 minutes of it
# in all, its start included (the device tool's README): there (OUT set, not a dry run) a
# script ends its stages within GPU_BUDGET whole seconds of its start (default 560; 0: no
# budget; none elsewhere unless GPU_BUDGET is set), each stage given its own limit or what is
# left less 10 s to pack, whichever is less, and skipped when less is left than it needs to
# measure anything (stage_seconds); a stage the budget shortened that then times out is
# recorded as cut(budget), not as a failure (stage_status).

results_dir() {  # results_dir NAME DRY: sets RES (made) and PACK_TO ("" when not packing)
  local name=$1 dry=$2
  PACK_TO=""
  BUDGET=${GPU_BUDGET:-0}
  [[ -n "${OUT:-}" && -z "$dry" ]] && BUDGET=${GPU_BUDGET:-560}
  if [[ ! $BUDGET =~ ^[0-9]+$ ]]; then
    echo "GPU_BUDGET=$BUDGET: whole seconds (0: no budget)" >&2
    exit 2
  fi
  if [[ -n "${OUT:-}" && ( -z "$dry" || "${PACK:-0}" == 1 ) ]]; then
    PACK_TO="$OUT/$name.tgz"
    RES="$OUT/raw/$name/results"
  else
    RES=${OUT:-$ROOT/benchmarks/results/gpu}
  fi
  mkdir -p "$RES"
}

pack() {  # pack FILE...: RES into PACK_TO, and each FILE of RES beside it (nothing when not packing)
  [[ -n "$PACK_TO" ]] || return 0
  tar czf "$PACK_TO.part" -C "$RES" . && mv "$PACK_TO.part" "$PACK_TO"
  local f
  for f in "$@"; do
    if [[ -f "$RES/$f" ]]; then cp "$RES/$f" "$(dirname "$PACK_TO")/"; fi
  done
  return 0
}

stage_seconds() {  # stage_seconds LIMIT [MIN]: the seconds a stage may take now; 0 (skip it)
  local limit=$1 least=${2:-20} left  # when under MIN (default 20) are left
  if (( BUDGET <= 0 )); then echo "$limit"; return 0; fi
  left=$((BUDGET - SECONDS - 10))
  if (( left < least )); then echo 0; else echo $((limit < left ? limit : left)); fi
}

stage_status() {  # stage_status RC GIVEN ASKED: ok, cut(budget), timeout(RC) or failed(RC)
  local rc=$1 given=$2 asked=$3
  if [[ $rc == 0 ]]; then echo ok
  elif [[ $rc == 124 || $rc == 137 ]]; then
    if (( given < asked )); then echo "cut(budget)"; else echo "timeout($rc)"; fi
  else echo "failed($rc)"; fi
}
