#!/usr/bin/env bash
# Issue 38, item 4, on a lent GPU, in a call of its own after gpu_check.sh (about 9 minutes):
# what jaxkv's choices for XLA:GPU save against 2026-12-04's, one at a time. The decode and
# trace stages of benchmarks/gpu_engine.py (Llama-3-8B shapes, random weights; batch 1 and
# 128, each with the step run ahead dispatched on the engine thread and from the launcher's;
# the trace's GPU idle share, kernels per step and kernel time by kind at 128) once per
# XLA_FLAGS variant:
#   default   jaxkv's choices: q/k/v and gate/up fused into one weight each, XLA's dot merger
#             off, XLA's default command types plus WHILE (multi-step decode's loop;
#             jaxkv/runner/xla_options.py)
#   before    2026-12-04's: the projections apart (--projections unfused), XLA's dot merger at
#             jaxlib 0.10.2's default (64 MiB: the q/k/v dots merged into one Triton gemm
#             fusion reading the three weights) and XLA's default command types, named in
#             XLA_FLAGS, which jaxkv then leaves alone
#   sync      the default but CONDITIONAL out of the command types: fused sampling's switch a
#             thunk that blocks the dispatching thread until the step's forward pass is done
#             (dispatch_ms near device_step_ms); beside `default` it says whether XLA's
#             defaults capture the switch (then default's dispatch_ms is well below)
#   cublas    the default with --xla_gpu_enable_triton_gemm=false: every dot by cuBLAS
#             (2026-12-04's trace: q/k/v and o_proj ran as Triton gemm fusions at 1.9-2.4
#             TB/s, gate/up/down by cuBLAS at 3.5)
#   scan      the default with the layers as one loop over stacked weights (--scan-layers):
#             ~10 weight arguments instead of ~195, one layer compiled instead of 32; its
#             hlo_moves say whether XLA copies each layer's slice out (dynamic-slice)
#   stacked   (by name only) that scan fully unrolled (--scan-layers --scan-unroll): the
#             stacked weights' few arguments, static slices of them, no loop
#
#   bash benchmarks/gpu_flags.sh                 # on the GPU machine: every variant, in order
#   bash benchmarks/gpu_flags.sh sync scan       # some of them (rows of one call compare)
#   bash benchmarks/gpu_flags.sh --cpu-dry-run   # a tiny model on the CPU: the flags parse,
#                                                # XLA:CPU ignores them (a test runs this)
#
# Each variant gets LIMIT seconds (110; a variant cut short keeps the rows it wrote), or what
# is left of GPU_BUDGET (benchmarks/device_out.sh; 560 s by default on the lent machine: the
# five variants need a call of their own and may not all fit it): after gpu_check.sh in the
# same session, `GPU_BUDGET=<the seconds left> bash benchmarks/gpu_flags.sh cublas scan`; a
# variant left under 60 s is recorded as skipped, one the budget cut short as cut(budget).
#
# Rows: $OUT/flags_<variant>/5_gpu_engine.jsonl (else benchmarks/results/gpu/flags_<variant>;
# on the lent machine packed into $OUT/gpu_flags.tgz after each variant, benchmarks/device_out.sh);
# each variant's status, seconds and flags in $OUT/flags.tsv; whether jaxkv's list of XLA's
# default command types is this jaxlib's in $OUT/xla_defaults.json. A variant that fails (a
# flag this jaxlib does not know) is recorded and the next one still runs. Compare the
# variants' rows of one run only.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
DRY=""
if [[ "${1:-}" == "--cpu-dry-run" ]]; then
  shift
  DRY="--cpu-dry-run"
  export JAX_PLATFORMS=cpu
  ARGS=(--cpu-dry-run --batches 1 4 --stages decode trace)
  LIMIT=240
else
  ARGS=(--config benchmarks/configs/llama3-8b --batches 1 128 --stages decode trace)
  LIMIT=110
fi
VARIANTS=("$@")
[[ ${#VARIANTS[@]} -gt 0 ]] || VARIANTS=(default before sync cublas scan)
for variant in "${VARIANTS[@]}"; do
  case $variant in
    default|before|sync|cublas|scan|stacked) ;;
    *) echo "gpu_flags.sh: no variant $variant (default, before, sync, cublas, scan, stacked)" >&2; exit 2 ;;
  esac
done
. benchmarks/device_out.sh
results_dir gpu_flags "$DRY"   # on the device: packed into $OUT/gpu_flags.tgz after each variant
XLA_TYPES=$($PY -c "from jaxkv.runner.xla_options import XLA_DEFAULT_TYPES as t; print(t)")
NO_CONDITIONAL=${XLA_TYPES/CONDITIONAL,/}
# Whether XLA_TYPES is this jaxlib's default list, and its dot merger threshold.
$PY -m benchmarks.xla_defaults > "$RES/xla_defaults.json" 2>&1 || true
: > "$RES/flags.tsv"
fail=0
for variant in "${VARIANTS[@]}"; do
  extra=()
  case $variant in
    default) flags="" ;;
    before) flags="--xla_gpu_dot_merger_threshold_mb=64 --xla_gpu_enable_command_buffer=$XLA_TYPES"
            extra=(--projections unfused) ;;
    sync) flags="--xla_gpu_enable_command_buffer=$NO_CONDITIONAL" ;;
    cublas) flags="--xla_gpu_enable_triton_gemm=false" ;;
    scan) flags=""; extra=(--scan-layers) ;;
    stacked) flags=""; extra=(--scan-layers --scan-unroll) ;;
  esac
  out="$RES/flags_$variant"
  limit=$(stage_seconds "$LIMIT" 60)
  if (( limit == 0 )); then
    printf '%s\tskipped(budget)\t0s\t\n' "$variant" | tee -a "$RES/flags.tsv"
    pack flags.tsv xla_defaults.json
    continue
  fi
  mkdir -p "$out"
  t0=$SECONDS
  combined="${XLA_FLAGS:-}"
  [[ -n "$flags" ]] && combined="${combined:+$combined }$flags"
  XLA_FLAGS="$combined" OUT="$out" \
    timeout --signal=TERM --kill-after=10 "$limit" $PY -m benchmarks.forbid_imports benchmarks.gpu_engine "${ARGS[@]}" "${extra[@]}" > "$out/log.txt" 2>&1
  rc=$?
  status=$(stage_status "$rc" "$limit" "$LIMIT")
  printf '%s\t%s\t%ss\t%s\n' "$variant" "$status" \
    "$((SECONDS - t0))" "$flags${extra[*]:+ (${extra[*]})}" | tee -a "$RES/flags.tsv"
  [[ $status == ok || $status == "cut(budget)" ]] || { fail=1; tail -5 "$out/log.txt"; }
  pack flags.tsv xla_defaults.json
done
exit $fail
