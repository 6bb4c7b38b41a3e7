"""The start-up heap kept out of the garbage collector's way (vLLM's engine core freezes it).

CPython's full collection traverses every tracked object. A process with JAX, the tokenizer
and an engine holds a few hundred thousand of them, so each full collection, which steady
decoding triggers every few seconds (the per-step records that outlive a young collection),
stalled the engine thread for ~200 ms: on the CPU, 3 of 5 runs of 32 steady decode steps at
batch 256 took 15-16 ms of host CPU per step instead of 9 (docs/async-scheduling.md).
`gc.freeze()` after start-up moves those objects to a permanent generation that no
collection visits; later garbage is collected as before.

`freeze_startup_heap` is for a process that owns its engine (`jaxkv serve`, the benchmarks):
a frozen object in a reference cycle (an LLM dropped later) is freed only once
`release_frozen_heap` unfreezes it. `LLM.generate` freezes the heap only while it runs
(`frozen_heap`), so a user's process keeps its usual collector.

Both also raise the young generation's threshold to YOUNG_THRESHOLD allocations (CPython's
default is 700), as servers commonly do. A decode step at batch 256 allocates a few thousand
short-lived records (the scheduler's, the outputs') before the last step's are freed, so at 700
a young collection ran ~4.7 times per step, 0.8-1.4 ms of the threads' time per step on the
2-core CPU (gc.callbacks, 2026-12-05); at 50,000 none ran in 96 steps: the records die by
reference counting first.
"""

from __future__ import annotations

import contextlib
import gc

YOUNG_THRESHOLD = 50_000


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now (objects an earlier call froze are
    unfrozen first, so those that died since are collected). Returns how many are frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _raise_young_threshold()
    return gc.get_freeze_count()


def _raise_young_threshold() -> tuple[int, int, int]:
    """Raise the young generation's threshold to YOUNG_THRESHOLD (a higher one is kept);
    returns the thresholds from before."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], YOUNG_THRESHOLD), *before[1:])
    return before


def release_frozen_heap() -> None:
    """Unfreeze and collect: what died since the freeze (a dropped engine's cycles, its
    device buffers with them) goes now."""
    gc.unfreeze()
    gc.collect()


@contextlib.contextmanager
def frozen_heap():
    """Within: every object alive at entry frozen, so the full collections a long generate
    triggers traverse only what it allocates, and the young threshold raised; at exit
    unfrozen (back in the oldest generation, collected as before) and the threshold put
    back. A heap someone froze already is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    before = _raise_young_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
