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
"""

from __future__ import annotations

import contextlib
import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now (objects an earlier call froze are
    unfrozen first, so those that died since are collected). Returns how many are frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_frozen_heap() -> None:
    """Unfreeze and collect: what died since the freeze (a dropped engine's cycles, its
    device buffers with them) goes now."""
    gc.unfreeze()
    gc.collect()


@contextlib.contextmanager
def frozen_heap():
    """Within: every object alive at entry frozen, so the full collections a long generate
    triggers traverse only what it allocates; unfrozen at exit (back in the oldest generation,
    collected as before). A heap someone froze already is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
