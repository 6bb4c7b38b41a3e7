#!/usr/bin/env bash
# One command for a lent GPU (an H200 with jax 0.11.2, CUDA 13 plugin; no gguf/fastapi/pydantic,
# no downloads), run from the repository root:
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine (at most GPU_BUDGET = 560 s)
#   bash benchmarks/gpu_check.sh --cpu-dry-run   # on a CPU: same stages, tiny shapes, interpret mode
#
# Stages, each under its own time guard, each writing result rows as soon as they are measured
# to $OUT (else benchmarks/results/gpu/; on the lent machine packed into $OUT/gpu_check.tgz after
# each stage, benchmarks/device_out.sh): 0 what enqueueing a program costs the host by its
# number of argument buffers (benchmarks/dispatch_cost.py: is 2026-12-04's 3.3-5.5 ms per step
# per-argument work over the step's 293 leaves?), 1 smoke (both kernels lower, run and match the
# reference), 2 the gpu-marked tests (pytest when installed, else the same checks without it),
# 3 kernel timings vs the XLA reference (µs, GB/s, device copy GB/s), 4 end-to-end decode
# throughput of a Llama-3-8B-shaped model with random weights at batch 1, 32 and 128, 5 the
# engine against its own device step (benchmarks/gpu_engine.py: batch 1-256, a profiler trace's
# GPU idle time, cold warmup, an offline workload, a serving run, a smoke pass of new paths).
# On the GPU they run most wanted first, 0 5 2 1 4 3 (their limits add to more than one device
# call's 600 s): within GPU_BUDGET seconds, a stage left too little time is recorded as
# skipped. A failing or timed-out stage is recorded and the next one still runs; the exit
# status is non-zero if any stage failed. jaxkv's XLA:GPU choices (fused projections, the dot
# merger off, fused sampling's switch in the command buffer, cuBLAS or Triton gemms, scanned
# layers) are measured one at a time by benchmarks/gpu_flags.sh, in a device call of its own
# (it would not fit this one's time; a session's 15 device minutes hold this call, the
# machine's start and a short second call: `GPU_BUDGET=<s> bash benchmarks/gpu_flags.sh
# cublas scan`, docs/performance.md).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
DRY=""
if [[ "${1:-}" == "--cpu-dry-run" ]]; then
  DRY="--cpu-dry-run"
  export JAX_PLATFORMS=cpu
fi
. benchmarks/device_out.sh
results_dir gpu_check "$DRY"   # on the device: packed into $OUT/gpu_check.tgz after each stage
export OUT="$RES"
export JAXKV_COMPILATION_CACHE=0   # a fresh machine: measure real compile times
LOG="$RES/gpu_check.log"
STATUS="$RES/stages.tsv"
: > "$STATUS"
fail=0

stage() {  # stage NAME SECONDS MIN CMD...: run under a time guard (and the budget: skipped
  local name=$1 asked=$2 limit; limit=$(stage_seconds "$2" "$3"); shift 3  # with under MIN
  local t0=$SECONDS rc status  # seconds left), log, record status and seconds
  if (( limit == 0 )); then
    printf '%s\tskipped(budget)\t0s\n' "$name" | tee -a "$STATUS"
    pack stages.tsv
    return 0
  fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  status=$(stage_status "$rc" "$limit" "$asked")
  printf '%s\t%s\t%ss\n' "$name" "$status" "$((SECONDS - t0))" | tee -a "$STATUS"
  [[ $status == ok || $status == "cut(budget)" ]] || fail=1
  pack stages.tsv
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  $PY -c "import sys, jax; print('python', sys.version.split()[0], 'jax', jax.__version__, 'devices', jax.devices())"
} 2>&1 | tee "$RES/device.txt"

if [[ -n "$DRY" ]]; then
  stage 0_dispatch 60 20 $PY -m benchmarks.forbid_imports benchmarks.dispatch_cost $DRY
  stage 5_gpu_engine 300 20 $PY -m benchmarks.forbid_imports benchmarks.gpu_engine $DRY
  stage 2_gpu_tests 120 20 $PY -m benchmarks.forbid_imports tests.pallas.native_checks --interpret --limit 1
  stage 1_smoke 120 20 $PY -m benchmarks.forbid_imports benchmarks.kernel_bench smoke $DRY
  stage 4_e2e_decode 180 20 $PY -m benchmarks.forbid_imports benchmarks.e2e_decode $DRY
  stage 3_kernels 180 20 $PY -m benchmarks.forbid_imports benchmarks.kernel_bench sweep $DRY
else
  stage 0_dispatch 30 20 $PY -m benchmarks.forbid_imports benchmarks.dispatch_cost
  stage 5_gpu_engine 330 90 $PY -m benchmarks.forbid_imports benchmarks.gpu_engine \
    --config benchmarks/configs/llama3-8b
  if $PY -c "import pytest" 2>/dev/null; then
    # tests/conftest.py defaults JAX_PLATFORMS to cpu: name the GPU platform explicitly.
    stage 2_gpu_tests 150 40 env JAX_PLATFORMS=cuda $PY -m pytest -v -rs -p no:cacheprovider -m gpu tests/pallas/test_gpu.py tests/pallas/test_int4_matmul.py \
      --junitxml="$RES/2_gpu_tests.xml"
  else
    stage 2_gpu_tests 150 40 $PY -m tests.pallas.native_checks
  fi
  stage 1_smoke 40 20 $PY -m benchmarks.forbid_imports benchmarks.kernel_bench smoke
  stage 4_e2e_decode 110 60 $PY -m benchmarks.forbid_imports benchmarks.e2e_decode \
    --config benchmarks/configs/llama3-8b --batches 1 32 128
  stage 3_kernels 70 30 $PY -m benchmarks.forbid_imports benchmarks.kernel_bench sweep
fi

$PY -m benchmarks.result_rows > /dev/null 2>&1 || true
pack stages.tsv summary.md
cat "$STATUS"
echo "results in $RES (summary.md, *.jsonl, gpu_check.log)"
exit $fail
