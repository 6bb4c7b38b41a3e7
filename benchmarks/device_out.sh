# Sourced by gpu_check.sh and gpu_flags.sh: where their results go, and packing them for the
# lent GPU machine, which returns at most 8 files from $OUT and none more than two folders down
# (the device tool's README). There (OUT set, not a dry run; or PACK=1) a script writes its
# results three folders down, $OUT/raw/NAME/results, and after each stage packs them into
# $OUT/NAME.tgz, its status table copied beside it, so a run cut short still returns what it
# measured; elsewhere it writes into $OUT, else benchmarks/results/gpu.

results_dir() {  # results_dir NAME DRY: sets RES (made) and PACK_TO ("" when not packing)
  local name=$1 dry=$2
  PACK_TO=""
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
