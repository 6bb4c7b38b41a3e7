#!/usr/bin/env bash
# Issue 38, item 4, on a lent GPU, in a call of its own after gpu_check.sh (about 6 minutes):
# what jaxkv's choices for XLA:GPU save against 2026-12-04's, one at a time. The decode and
# trace stages of benchmarks/gpu_engine.py (Llama-3-8B shapes, random weights; batch 1 and
# 128, each with the step run ahead dispatched on the engine thread and from the launcher's;
# the trace's GPU idle share, kernels per step and kernel time by kind at 128) once per
# XLA_FLAGS variant:
#   default   jaxkv's choices: q/k/v and gate/up fused into one weight each, XLA's dot merger
#             off, conditionals (fused sampling's switch) and loops (multi-step decode) inside
#             the command buffer (jaxkv/runner/xla_options.py)
#   before    2026-12-04's: the projections apart (--projections unfused), XLA's dot merger at
#             its default (32 MiB: q/k/v's weights concatenated, a copy, every step) and XLA's
#             default command types, named in XLA_FLAGS, which jaxkv then leaves alone
#   sync      the default but XLA's default command types: the sampling switch a thunk that
#             blocks the dispatching thread until the step's forward pass is done (its
#             decode rows' dispatch_ms near device_step_ms says it did)
#   cublas    the default with --xla_gpu_enable_triton_gemm=false: every dot by cuBLAS
#             (2026-12-04's trace: q/k/v and o_proj ran as Triton gemm fusions at 1.9-2.4
#             TB/s, gate/up/down by cuBLAS at 3.5)
#
#   bash benchmarks/gpu_flags.sh                 # on the GPU machine
#   bash benchmarks/gpu_flags.sh --cpu-dry-run   # a tiny model on the CPU: the flags parse,
#                                                # XLA:CPU ignores them (a test runs this)
#
# Rows: $OUT/flags_<variant>/5_gpu_engine.jsonl (else benchmarks/results/gpu/flags_<variant>);
# each variant's status, seconds and flags in $OUT/flags.tsv. A variant that fails (a flag this
# jaxlib does not know) is recorded and the next one still runs. Compare the variants' rows of
# one run only.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
RES=${OUT:-$ROOT/benchmarks/results/gpu}
mkdir -p "$RES"
if [[ "${1:-}" == "--cpu-dry-run" ]]; then
  export JAX_PLATFORMS=cpu
  ARGS=(--cpu-dry-run --batches 1 4 --stages decode trace)
  LIMIT=240
else
  ARGS=(--config benchmarks/configs/llama3-8b --batches 1 128 --stages decode trace)
  LIMIT=130
fi
XLA_TYPES=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN  # XLA's default command types
: > "$RES/flags.tsv"
fail=0
for variant in default before sync cublas; do
  extra=()
  case $variant in
    default) flags="" ;;
    before) flags="--xla_gpu_dot_merger_threshold_mb=32 --xla_gpu_enable_command_buffer=$XLA_TYPES"
            extra=(--projections unfused) ;;
    sync) flags="--xla_gpu_enable_command_buffer=$XLA_TYPES" ;;
    cublas) flags="--xla_gpu_enable_triton_gemm=false" ;;
  esac
  out="$RES/flags_$variant"
  mkdir -p "$out"
  t0=$SECONDS
  combined="${XLA_FLAGS:-}"
  [[ -n "$flags" ]] && combined="${combined:+$combined }$flags"
  XLA_FLAGS="$combined" OUT="$out" \
    timeout --signal=TERM --kill-after=10 "$LIMIT" $PY -m benchmarks.forbid_imports benchmarks.gpu_engine "${ARGS[@]}" "${extra[@]}" > "$out/log.txt" 2>&1
  rc=$?
  printf '%s\t%s\t%ss\t%s\n' "$variant" "$([[ $rc == 0 ]] && echo ok || echo "failed($rc)")" \
    "$((SECONDS - t0))" "$flags${extra[*]:+ (${extra[*]})}" | tee -a "$RES/flags.tsv"
  [[ $rc == 0 ]] || { fail=1; tail -5 "$out/log.txt"; }
done
exit $fail
