"""What enqueueing one jitted program costs the host, by the number of its argument buffers.

  python -m benchmarks.dispatch_cost                 # on the GPU machine (gpu_check.sh stage 0)
  python -m benchmarks.dispatch_cost --cpu-dry-run   # fewer calls, on the CPU

On 2026-12-04's H200 the host took 3.3-5.5 ms to enqueue one decode step of Llama-3-8B
(probe3: the same through the AOT `Compiled` object and jax.jit's fast path), its ~520 kernels
already in one CUDA graph (docs/performance.md): the step has 291 weight leaves and 2 pool
leaves. This probe tells whether that cost grows with the argument buffers: per count N of
bfloat16 arguments (small: the size does not travel), a program that reads every argument
once (a sum of one element of each, so none is pruned) and writes one donated buffer, as the
step writes its pool. The host time of `calls` back-to-back calls without a wait, per call
(dispatch_us), then the wall time per call once the device is done (total_us), and whether
the output is the sum it should be (output_right). A row per N,
then a fit row: dispatch_us = fixed_us + per_arg_us * N (least squares over the rows). If
per_arg_us * 291 is near the 3.3 ms, fewer argument leaves is the lever (--scan-layers: ~10).
It times jax.jit's call path (the engine calls the AOT `Compiled` objects; probe3 found both
cost the same), with the same buffers every call, and its one fusion may not make a CUDA
graph: the cost of updating a graph's buffers is not in it. On XLA:CPU a program this small
runs inline in the call, so there dispatch_us is not enqueueing alone.

Rows go to <dir>/0_dispatch.jsonl as measured (benchmarks/result_rows.py).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.result_rows import Rows

COUNTS = (1, 8, 32, 128, 300)


def program(n: int):
    """A jitted f(out, *xs) -> out + sum of xs[i][0]: every argument read, `out` donated."""
    import jax
    import jax.numpy as jnp

    def f(out, *xs):
        total = sum(x[0].astype(jnp.float32) for x in xs)
        return out + total

    return jax.jit(f, donate_argnums=(0,))


def measure(n: int, calls: int) -> tuple[float, float, bool]:
    """(dispatch µs per call, wall µs per call, whether the output is the sum it should be)
    over `calls` calls of program(n)."""
    import jax
    import jax.numpy as jnp
    xs = [jnp.full((256,), i % 8 + 1, jnp.bfloat16) for i in range(n)]
    f, out = program(n), jnp.zeros((1024,), jnp.float32)
    for _ in range(3):  # compile, then warm
        out = f(out, *xs)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(calls):
        out = f(out, *xs)
    dispatch = time.perf_counter() - t0
    jax.block_until_ready(out)
    total = time.perf_counter() - t0
    right = float(out[0]) == (3 + calls) * sum(i % 8 + 1 for i in range(n))
    return 1e6 * dispatch / calls, 1e6 * total / calls, right


def fit(counts, dispatch_us) -> tuple[float, float]:
    """(fixed µs, µs per argument): the least-squares line through (N, dispatch µs)."""
    per_arg, fixed = np.polyfit(np.asarray(counts, float), np.asarray(dispatch_us, float), 1)
    return float(fixed), float(per_arg)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="fewer calls, on the CPU")
    a = ap.parse_args(argv)
    import jax
    calls = 20 if a.cpu_dry_run else 200
    rows, got = Rows("0_dispatch"), []
    device = str(jax.devices()[0])
    for n in COUNTS:
        dispatch_us, total_us, right = measure(n, calls)
        got.append(dispatch_us)
        rows.add(stage="dispatch", args=n + 1, calls=calls, dispatch_us=round(dispatch_us, 2),
                 total_us=round(total_us, 2), output_right=right, device=device)
    fixed, per_arg = fit([n + 1 for n in COUNTS], got)
    rows.add(stage="fit", fixed_us=round(fixed, 2), per_arg_us=round(per_arg, 3),
             at_293_args_us=round(fixed + 293 * per_arg, 1), device=device)


if __name__ == "__main__":
    main()
