"""Count the XLA programs a block of code compiles, from JAX's public monitoring events.

JAX records `/jax/core/compile/backend_compile_duration` (jax.monitoring) each time it builds
an executable, from scratch or from the persistent compilation cache. One process-wide listener
credits each event to the innermost `CompileCounter` open on the thread that compiled (a
thread compiling for another opens that one's counter: jaxkv/runner/compiler.py's workers).
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_local = threading.local()
_lock = threading.Lock()  # (several threads may credit one counter)


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    counter = getattr(_local, "counter", None)
    if counter is not None and event == BACKEND_COMPILE_EVENT:
        with _lock:
            counter.programs += 1
            counter.seconds += seconds


jax.monitoring.register_event_duration_secs_listener(_on_duration)


class CompileCounter:
    """`with counter:` credits the programs compiled inside to `programs` (int) and their
    compile (or cache-load) time to `seconds` (float). Re-entrant; nests per thread."""

    def __init__(self):
        self.programs = 0
        self.seconds = 0.0

    @staticmethod
    def current() -> CompileCounter | None:
        """The innermost counter open on the calling thread, or None."""
        return getattr(_local, "counter", None)

    def __enter__(self) -> CompileCounter:
        if not hasattr(_local, "outer"):
            _local.outer = []  # this thread's enclosing counters
        _local.outer.append(getattr(_local, "counter", None))
        _local.counter = self
        return self

    def __exit__(self, *exc) -> None:
        _local.counter = _local.outer.pop()
