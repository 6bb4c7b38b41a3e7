"""Ahead-of-time compilation of token buckets: warmup's, and the background compiler's.

`compile_bucket` builds every program a step of token bucket T can need: the step program
(twice with a decode kernel: mixed and decode-only, for the buckets a decode-only step can
use), the small program that gathers the sampled rows, and the greedy / random / filtered
sampler for its row count R = min(T, max_num_seqs), each also with structured outputs'
bitmask (with speculative decoding also for the
larger row counts its draft rows can need, ModelRunner.sample_row_counts). It lowers from abstract shapes
(jax.ShapeDtypeStruct) and host arrays only, never from the live KV pool: the pool is donated
to every step, so another thread's step may delete a live array while it is being lowered.

Warmup compiles the warmup buckets before the engine is ready, side by side on
`compile_workers()` threads (`compile_buckets`: in waves, since a bucket's sampler programs
take the placement of its step's output). `BackgroundCompiler` compiles
the others one after another (ascending) on a daemon thread at low priority (nice 19 on
Linux; a bucket's programs side by side on a quarter of warmup's threads when those are 8 or
more), and switches each in (`ModelRunner.add_compiled_bucket`) only once all its programs
exist; the runner pads every step to the smallest compiled bucket holding it, so no step waits
for a compile. JAX's persistent compilation cache keeps the programs for the next start.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

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


def compile_bucket(runner, t: int, stopped=lambda: False, workers: int = 1) -> bool:
    """Compile every program of token bucket `t` into `runner.programs` (a ModelRunner's
    `Programs`): the step executables into its table, the gather and sampler programs into
    their jitted functions' caches, where the step's calls find them. Programs already there
    are skipped. Returns False, with the bucket incomplete,
    if `stopped()` turned true before one of its programs. `workers` > 1: compile_buckets'
    waves on that many threads, at nice 19 (the background compiler's)."""
    return compile_buckets(runner, (t,), stopped, workers, low_priority=workers > 1)


def compile_buckets(runner, buckets, stopped=lambda: False, workers: int = 1,
                    low_priority: bool = False) -> bool:
    """compile_bucket for each of `buckets`, on `workers` threads: in three waves (the step
    programs of every bucket, then the gathers of their sampled rows, which tell where the
    rows are placed, then the sampler programs of each row count, each once), each wave's
    programs compiled side by side (XLA compiles without the GIL; the tracing before it holds
    it). Programs compiled on the workers count in the calling thread's innermost
    CompileCounter; `low_priority`: the workers run at nice 19 (the background compiler's).
    The first error of a program raises here, once the wave has ended."""
    tp = getattr(runner, "mesh", None) is not None
    params = abstract(runner.params, tp)
    jobs = [job for t in buckets for job in _step_jobs(runner, t, params)]
    run = functools.partial(_run, workers=workers, stopped=stopped, low_priority=low_priority)
    if not run(jobs):
        return False
    pairs = [(t, rs) for t in buckets for rs in runner.sample_row_counts(t)]
    placed = {}  # row count -> the sampled rows as its gathers hand them to the sampler
    gathers = [functools.partial(_compile_gather, runner, tp, t, rs, placed) for t, rs in pairs]
    if not run(gathers):
        return False
    new = sorted(rs for rs in placed if rs not in runner.programs.sampler_rows)
    s_jobs = [functools.partial(_compile_sampler, runner, params, tp, placed[rs], mode, masked)
              for rs in new for mode in smp.MODES for masked in (False, True)]
    if not run(s_jobs):
        return False
    runner.programs.sampler_rows.update(new)
    return True


MAX_COMPILE_THREADS = 16  # (each compile holds its own host memory; warmup has ~25-40 programs)


def compile_workers(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """Threads for warmup's compiles: JAXKV_COMPILE_THREADS if set (a positive integer), else
    the CPUs this process may run on (its affinity, within a container's CPU quota: cgroup
    v2's `cpu.max`, read from `cpu_max`), at most MAX_COMPILE_THREADS. ValueError naming the
    variable for another value."""
    given = os.environ.get("JAXKV_COMPILE_THREADS", "").strip()
    if given:
        try:
            n = int(given)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"JAXKV_COMPILE_THREADS must be a positive integer, got {given!r}")
        return n
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        n = os.cpu_count() or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, -(-int(quota) // int(period)))
    except (OSError, ValueError):  # no cgroup v2 quota to read
        pass
    return max(1, min(n, MAX_COMPILE_THREADS))


def _run(jobs, workers: int, stopped, low_priority: bool = False) -> bool:
    """Call each of `jobs` (on `workers` threads when more than one, at nice 19 with
    `low_priority`); False, as soon as `stopped()` is true before a job, with the jobs not
    started skipped."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            if stopped():
                return False
            job()
        return True
    counter = CompileCounter.current()

    def call(job):
        if stopped():
            return False
        with counter if counter is not None else contextlib.nullcontext():
            job()
        return True

    with ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="jaxkv-compile",
                            initializer=_lower_this_threads_priority if low_priority else None) as ex:
        futures = [ex.submit(call, job) for job in jobs]
    return all([f.result() for f in futures])


def _step_jobs(runner, t: int, params) -> list:
    """The calls that compile bucket t's step programs still missing (twice with a decode
    kernel: mixed and decode-only) and multi-step decode's k-step programs."""
    si = build_step_input(SchedulerOutput([]), block_size=runner.block_size, num_tokens=t,
                          rows=num_rows(t, runner.max_num_seqs), max_blocks=runner.max_blocks,
                          rope_table=runner.rope_table, prev_rows=runner.prev_rows,
                          fused_sampling=t <= runner.fused_program_max_tokens)
    jobs = []
    for decode_only in ((False, True) if t <= runner.decode_max else (False,)):
        x = dataclasses.replace(si, decode_only=decode_only)
        if (t, decode_only) not in runner.programs.step:
            jobs.append(functools.partial(_compile_step, runner, params, t, x))
        if getattr(runner, "multi_step", None) is not None and t <= runner.multi_step_max_tokens:
            jobs.append(functools.partial(runner.multi_step.compile, params, runner.kv_spec, x))
    return jobs


def _compile_step(runner, params, t: int, si) -> None:
    runner.programs.step[(t, si.decode_only)] = runner.jitted_step.lower(
        params, runner.kv_spec, si).compile()


def _compile_gather(runner, tp: bool, t: int, rs: int, placed: dict) -> None:
    """The gather of rs sampled rows of bucket t's hidden states; records the rows'
    placement for the sampler programs of rs rows (the mesh's, with tensor parallelism)."""
    hidden = abstract(runner.programs.step[(t, False)].out_info[0], tp)  # [t, hidden_size]
    out = runner.programs.gather_rows.lower(hidden, np.zeros(rs, np.int32)).compile().out_info
    placed.setdefault(rs, out)


def _compile_sampler(runner, params, tp: bool, rows_out, mode: str, masked: bool) -> None:
    """The sampler program of rows shaped `rows_out` in `mode`, with structured outputs'
    bitmask (`masked`) or without, lowered as the step calls it."""
    rs = rows_out.shape[0]
    mask = np.zeros((rs, -(-runner.vocab_size // 32)), np.int32) if masked else None
    runner.programs.sample.lower(params, abstract(rows_out, tp), sampling_arrays([], rs), None,
                                 mask, None, mode=mode, num_logprobs=0).compile()


class BackgroundCompiler:
    """Compiles `buckets` of `runner` on a daemon thread, in the order given, each switched in
    once all its programs are compiled; with `workers` > 1 a bucket's programs compile side by
    side on that many threads (compile_buckets' waves, at nice 19 too). `stop()` ends it after
    the programs in flight (XLA cannot be interrupted mid-compile); at interpreter exit every
    one still running is stopped and joined, since a compile cut off by the exit aborts the
    process."""

    def __init__(self, runner, buckets: tuple[int, ...], workers: int = 1):
        self.runner = runner
        self.buckets = tuple(buckets)
        self.workers = workers  # threads compiling one bucket's programs side by side
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
        """Ask the thread to stop after the programs in flight; returns at once."""
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
                    if not compile_bucket(self.runner, t, self._stop.is_set, self.workers):
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
