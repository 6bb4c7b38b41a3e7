"""Ahead-of-time compilation of token buckets: warmup's, and the background compiler's.

`compile_bucket` builds every program a step of token bucket T can need: the step program
(twice with a decode kernel: mixed and decode-only, for the buckets a decode-only step can
use), the small program that gathers the sampled rows, and the greedy / random / filtered
sampler for its row count R = min(T, max_num_seqs), each also with structured outputs'
bitmask (with speculative decoding also for the
larger row counts its draft rows can need, ModelRunner.sample_row_counts). It lowers from abstract shapes
(jax.ShapeDtypeStruct) and host arrays only, never from the live KV pool: the pool is donated
to every step, so another thread's step may delete a live array while it is being lowered.

Warmup compiles the warmup buckets before the engine is ready. `BackgroundCompiler` compiles
the others one after another (ascending) on a daemon thread at low priority (nice 19 on
Linux), and switches each in (`ModelRunner.add_compiled_bucket`) only once all its programs
exist; the runner pads every step to the smallest compiled bucket holding it, so no step waits
for a compile. JAX's persistent compilation cache keeps the programs for the next start.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
import time

import jax
import numpy as np

from jaxkv.core.scheduler_output import SchedulerOutput
from jaxkv.sampling import sampler as smp
from jaxkv.sampling.rows import sampling_arrays
from jaxkv.runner.buckets import num_rows
from jaxkv.runner.compile_counter import CompileCounter
from jaxkv.runner.input_builder import build_step_input

logger = logging.getLogger("jaxkv")


@dataclasses.dataclass
class Programs:
    """A ModelRunner's compiled programs, held by the runner and filled by it and by
    `compile_bucket` (warmup, the background compiler).

    step: the AOT step executable per (token bucket, decode_only); sampler_rows: the row counts
    whose sampler programs are all compiled; gather_rows, sample, prompt_logprobs: the jitted
    functions (plain ones with enforce_eager) whose caches hold the gather and sampler programs."""
    gather_rows: object
    sample: object
    prompt_logprobs: object
    step: dict = dataclasses.field(default_factory=dict)
    sampler_rows: set = dataclasses.field(default_factory=set)


def abstract(tree, sharded: bool = False):
    """The shapes and dtypes of a pytree of arrays, as jax.ShapeDtypeStruct; with `sharded`
    (tensor parallelism) their shardings too, so that the programs take the arrays as placed."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=getattr(x, "sharding", None) if sharded else None), tree)


def compile_bucket(runner, t: int, stopped=lambda: False) -> bool:
    """Compile every program of token bucket `t` into `runner.programs` (a ModelRunner's
    `Programs`): the step executables into its table, the gather and sampler programs into
    their jitted functions' caches, where the step's calls find them. Programs already there
    are skipped. Returns False, with the bucket incomplete,
    if `stopped()` turned true before one of its programs."""
    r = num_rows(t, runner.max_num_seqs)
    empty = SchedulerOutput([])
    si = build_step_input(empty, block_size=runner.block_size, num_tokens=t, rows=r,
                          max_blocks=runner.max_blocks, rope_table=runner.rope_table,
                          prev_rows=runner.prev_rows,
                          fused_sampling=t <= runner.fused_program_max_tokens)
    tp = getattr(runner, "mesh", None) is not None
    params = abstract(runner.params, tp)
    programs = runner.programs
    for decode_only in ((False, True) if t <= runner.decode_max else (False,)):
        if (t, decode_only) not in programs.step:
            if stopped():
                return False
            programs.step[(t, decode_only)] = runner.jitted_step.lower(
                params, runner.kv_spec, dataclasses.replace(si, decode_only=decode_only)).compile()
        if getattr(runner, "multi_step", None) is not None and t <= runner.multi_step_max_tokens:
            if stopped():  # multi-step decode's k-step program of this decode bucket
                return False
            runner.multi_step.compile(params, runner.kv_spec, dataclasses.replace(si, decode_only=decode_only))
    hidden = abstract(programs.step[(t, False)].out_info[0], tp)  # [t, hidden_size]
    for rs in runner.sample_row_counts(t):
        gather = programs.gather_rows.lower(hidden, np.zeros(rs, np.int32))
        rows_out = gather.compile().out_info  # placed as the step will hand it (the mesh's, with TP)
        if rs not in programs.sampler_rows:
            s_arr = sampling_arrays([], rs)
            mask = np.zeros((rs, -(-runner.vocab_size // 32)), np.int32)
            for mode in smp.MODES:
                for bitmask in (None, mask):  # free rows; structured outputs' masked rows
                    if stopped():
                        return False
                    programs.sample.lower(params, abstract(rows_out, tp), s_arr, None, bitmask, None,
                                          mode=mode, num_logprobs=0).compile()  # (as called)
            programs.sampler_rows.add(rs)
    return True


class BackgroundCompiler:
    """Compiles `buckets` of `runner` on a daemon thread, in the order given, each switched in
    once all its programs are compiled. `stop()` ends it after the program in flight (XLA
    cannot be interrupted mid-compile); at interpreter exit every one still running is
    stopped and joined, since a compile cut off by the exit aborts the process."""

    def __init__(self, runner, buckets: tuple[int, ...]):
        self.runner = runner
        self.buckets = tuple(buckets)
        self.compiles = CompileCounter()  # programs this thread compiled (or read from cache)
        self.seconds: float | None = None  # wall time, once every bucket is in
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxkv-bucket-compiler",
                                        daemon=True)

    def start(self) -> BackgroundCompiler:
        _register_exit_hook()
        with _lock:
            _running.add(self)
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        """True once the thread has ended (finished, stopped or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the thread ends; False if `timeout` passed first."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Ask the thread to stop after the program in flight; returns at once."""
        self._stop.set()

    def stop(self, timeout: float | None = None) -> bool:
        """cancel() and join; False if the thread is still running after `timeout`."""
        self.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        _lower_this_threads_priority()
        t0 = time.perf_counter()
        try:
            with self.compiles:
                for t in self.buckets:
                    if not compile_bucket(self.runner, t, self._stop.is_set):
                        logger.info("background compile stopped; token buckets compiled: %s",
                                    list(self.runner.compiled_token_buckets))
                        return
                    self.runner.add_compiled_bucket(t)
            self.seconds = time.perf_counter() - t0
            logger.info("background compile finished in %.1f s: token buckets %s (%d programs); "
                        "all %d buckets compiled", self.seconds, list(self.buckets),
                        self.compiles.programs, len(self.runner.compiled_token_buckets))
        except BaseException as e:  # noqa: BLE001 - the engine goes on with what is compiled
            self.error = e
            logger.warning("background compile failed (%r); steps keep to the compiled token "
                           "buckets %s", e, list(self.runner.compiled_token_buckets))
        finally:
            with _lock:
                _running.discard(self)
            self._done.set()


def _lower_this_threads_priority() -> None:
    """Nice 19 for the calling thread (Linux only: there a thread id names one thread), so
    that steps get the CPU first. XLA's own compile workers keep their priority, and the
    lowering (Python) still shares the GIL with the engine thread."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


_lock = threading.Lock()
_running: set[BackgroundCompiler] = set()
_hook: list[bool] = []


def _register_exit_hook() -> None:
    """Once, after JAX's own exit handlers (atexit runs last-registered first)."""
    with _lock:
        if not _hook:
            atexit.register(_stop_all)
            _hook.append(True)


def _stop_all() -> None:
    with _lock:
        running = list(_running)
    for c in running:
        c.cancel()
    for c in running:
        c.stop()
