"""The step run ahead is dispatched from a thread of its own, off the engine thread.

Dispatching a step program is host work that grows with the program: enqueueing one of
Llama-3-8B shapes took 3.3-5.5 ms on the H200 (2026-12-04; its ~520 kernels ran as CUDA
graphs), and on any platform the call checks each of its ~300 argument buffers (~0.6 ms on
this project's 2-core CPU for a 32-layer model). jaxlib releases the GIL while it does so.
Async scheduling (jaxkv/runner/lookahead.py) dispatches the next decode step before this
step's tokens reach the host; with a Launcher that dispatch is handed to one worker thread, so
the engine thread goes on at once (reading this step's tokens, updating the requests,
detokenizing, scheduling) while the worker enqueues the step. The host's prep of the step (its
StepInput, the sampler's arrays) stays on the engine thread: the worker runs only the call
into the compiled program.

Order: the worker runs one call at a time, in order, and every other use of the KV pool waits
for the call in flight to return first (`join`; ModelRunner.kv_cache does so), so programs
reach the device in the order they were asked for, as from one thread. A call that raises
keeps its error until `join` raises it on the engine thread, when the next step takes the
results (jaxkv/runner/run_ahead.py: those sequences then run in line, or, if the pool went
with the failed call, that step fails and is undone).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor


class Launcher:
    """One worker thread that makes dispatch calls in order. `num_launched`: calls handed
    to it."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxkv-dispatch")
        self._pending: Future | None = None
        self._worker: int | None = None  # the worker thread's ident, once it has run a call
        self.num_launched = 0

    def launch(self, fn, *args) -> Future:
        """Call fn(*args) on the worker thread (after the call before it); returns its Future,
        whose result is what fn returns (device arrays: their programs may still run)."""
        self._pending = self._pool.submit(self._call, fn, args)
        self.num_launched += 1
        return self._pending

    def _call(self, fn, args):
        self._worker = threading.get_ident()
        return fn(*args)

    @property
    def busy(self) -> bool:
        """Whether a call was launched and not joined yet."""
        return self._pending is not None

    def join(self, raise_error: bool = True) -> None:
        """Wait until the call in flight has returned (its programs enqueued, not finished),
        then raise its error if it raised (once; `raise_error` False drops it). On the worker
        thread itself (the launched call reaching a join) it returns at once."""
        pending = self._pending
        if pending is None or threading.get_ident() == self._worker:
            return
        error = pending.exception()  # (interrupted here, the call stays pending: joined later)
        if self._pending is pending:
            self._pending = None
        if error is not None and raise_error:
            raise error

    def shutdown(self) -> None:
        """Join the call in flight (dropping its error) and stop the worker thread."""
        self.join(raise_error=False)
        self._pool.shutdown(wait=True)
