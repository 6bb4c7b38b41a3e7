"""AsyncLLM: the LLMEngine driven by its own thread, with one async stream of outputs per request.

Shaped like vLLM's ``AsyncLLM``: ``add_request`` (validates at once, raises ValueError and
queues nothing on bad input) returns a ``RequestStream``; ``generate`` is the async-generator
form; ``abort`` frees a request's blocks before the engine's next step. ``LLMEngine.step()``
never runs on the event loop: a step can take hundreds of milliseconds on a CPU, and HTTP
handling and other streams must go on meanwhile. The engine thread owns the engine; the loop
thread only tokenizes, validates and posts commands (add / abort) into an inbox the engine
thread drains between steps.

As vLLM V1 splits its EngineCore from its output processing, the engine thread only runs
``LLMEngine.engine_core_step`` and hands its EngineCoreOutputs to an output thread, which
detokenizes, checks stop strings, builds the RequestOutputs and puts them on the streams
(``loop.call_soon_threadsafe``) while the engine thread goes on with the next step. The stop
strings it finds come back through the inbox (``LLMEngine.stop_requests``): the engine may have
run a step or two more of such a sequence by then, and those tokens are dropped. Aborts go the
same way as steps (the engine thread frees the blocks; the output thread makes the final
output), so a stream sees its outputs in order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections import deque
from typing import AsyncIterator

from jaxkv.engine.core_request import EngineCoreRequest
from jaxkv.engine.kv_snapshot import kv_cache_snapshot
from jaxkv.engine.llm_engine import child_request_id
from jaxkv.engine.output_thread import OutputThread
from jaxkv.engine.stat_logger import LoggingStatLogger
from jaxkv.outputs import RequestOutput
from jaxkv.sampling.params import SamplingParams

logger = logging.getLogger("jaxkv")


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can be served any more."""


class RequestStream:
    """Async iterator over one request's RequestOutputs; ends after the finished one.
    Raises EngineDeadError if the engine dies while the request runs."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, ids: frozenset = frozenset()):
        self.request_id = request_id
        self.ids = ids or frozenset((request_id,))  # the engine's ids of its samples too
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def put(self, item) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is None:  # ended without a final output (aborted before it produced one)
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncLLM:
    """Wraps an LLMEngine (see ``from_engine_args``). ``stat_loggers``: objects with
    ``record(outputs)``, called on the output thread after every step with that step's
    RequestOutputs (the Prometheus logger of the server is one). ``log_stats``: the
    every-5-seconds throughput log line (vLLM's LoggingStatLogger)."""

    def __init__(self, engine, *, log_stats: bool = True, stat_loggers=(), log_interval_s: float = 5.0):
        self.engine = engine
        self.stat_loggers = list(stat_loggers)
        self._log = LoggingStatLogger(log_interval_s) if log_stats else None
        self._inbox: deque = deque()
        self._cond = threading.Condition()
        self._streams: dict[str, RequestStream] = {}
        self._stats = engine.stats()
        self._stopping = False
        self.dead: BaseException | None = None
        self._out = OutputThread(engine.output_processor, self._deliver, self._post)
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args, **kwargs) -> "AsyncLLM":
        from jaxkv.engine.llm_engine import LLMEngine
        return cls(LLMEngine.from_engine_args(args), **kwargs)

    # ---- caller side (event loop thread) -------------------------------------------------
    @property
    def max_model_len(self) -> int:
        """Longest prompt + output in tokens."""
        return self.engine.max_model_len

    def get_tokenizer(self):
        """The engine's tokenizer (thread-safe for encode/decode)."""
        return self.engine.get_tokenizer()

    def stats(self):
        """EngineStats as of the engine thread's last loop turn, with the output thread's
        counts (generation tokens, its CPU time) as of now (safe from any thread)."""
        op = self.engine.output_processor
        return dataclasses.replace(self._stats, num_generation_tokens=op.num_generation_tokens,
                                   output_cpu_seconds=op.cpu_seconds)

    def process_inputs(self, request_id: str, prompt, params: SamplingParams | None):
        """Validate and tokenize without queueing (ValueError on bad input)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead!r}")
        processed = self.engine.process_inputs(request_id, prompt, params)
        with self._cond:
            self._check_free(request_id, _sample_ids(request_id, processed.sampling_params.n))
        return processed

    def _check_free(self, request_id: str, ids: frozenset) -> None:
        """ValueError if a live stream already uses one of `ids` (its own id or a sample's);
        the engine thread may not have seen that stream's request yet. Call under _cond."""
        for s in self._streams.values():
            if s.ids & ids:
                raise ValueError(f"request_id {request_id!r} is already in use"
                                 + ("" if s.request_id == request_id else
                                    f" (it collides with the sample ids of {s.request_id!r})"))

    def add_processed(self, processed: EngineCoreRequest) -> RequestStream:
        """Queue a request checked by process_inputs; outputs arrive on the returned stream.
        Raises EngineDeadError if the engine has stopped (checked under the inbox lock, so a
        stream is never registered with a dead engine)."""
        request_id = processed.request_id
        ids = _sample_ids(request_id, processed.sampling_params.n)
        stream = RequestStream(request_id, asyncio.get_running_loop(), ids)
        with self._cond:
            if self.dead is not None:
                raise EngineDeadError(f"the engine stopped: {self.dead!r}")
            self._check_free(request_id, ids)
            self._streams[request_id] = stream
            self._inbox.append(("add", request_id, processed))
            self._cond.notify()
        return stream

    async def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> RequestStream:
        """Validate (ValueError, nothing queued) and queue one request; returns its stream."""
        return self.add_processed(self.process_inputs(request_id, prompt, params))

    async def generate(self, prompt, sampling_params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (shaped by sampling_params.output_kind). Closing
        or cancelling the iterator before the end aborts the request."""
        stream = await self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_ids) -> None:
        """Abort requests (their blocks are freed before the next step). Unknown or
        finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        with self._cond:  # the streams meant (a later request may reuse an id)
            streams = {rid: self._streams.get(rid) for rid in request_ids}
        self._post(("abort", list(request_ids), streams))

    def kv_cache_snapshot(self, timeout: float = 5.0) -> dict | None:
        """The block pool between two steps (jaxkv.engine.kv_snapshot), taken on the engine
        thread at its next turn; None if the engine is dead or did not answer in `timeout` s.
        Blocking: call it from a worker thread in async code."""
        if self.dead is not None:
            return None
        box, done = {}, threading.Event()
        self._post(("snapshot", box, done))
        done.wait(timeout)
        return box.get("snapshot")

    def shutdown(self) -> None:
        """Stop the engine thread (after the step in flight) and the engine's background
        compile of token buckets; unfinished streams get EngineDeadError."""
        self._post(("stop",))
        self._thread.join()
        self.engine.shutdown()

    def _post(self, cmd) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._cond.notify()

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not self._inbox and not engine.has_unfinished_requests():
                        self._stats = engine.stats()
                        if self._log is not None:  # the last line of a burst, then baselines
                            self._log.maybe_log(self.stats())
                        # Wake now and then even without the log line, so stats() (and
                        # /metrics) see the token buckets the background compiler adds.
                        self._cond.wait(self._log.interval_s if self._log is not None else 5.0)
                    cmds = list(self._inbox)
                    self._inbox.clear()
                stopped, aborts = self._apply(cmds)
                core = engine.engine_core_step() if engine.has_unfinished_requests() else []
                self._stats = engine.stats()  # (before the outputs can reach a caller)
                if stopped:
                    self._out.put_stopped(stopped)
                for a in aborts:
                    self._out.put_abort(*a)
                if core:
                    self._out.put_step(core)
                if self._log is not None:
                    self._log.maybe_log(self.stats())
        except BaseException as e:  # noqa: BLE001 - every stream must learn that the engine died
            self._die(e)

    def _die(self, e: BaseException) -> None:
        """The engine thread's end: the output thread delivers what it was handed and stops,
        every stream left gets EngineDeadError, and the engine's requests are finished (the
        stop strings found meanwhile applied, the rest aborted)."""
        if not isinstance(e, EngineDeadError):
            logger.exception("engine thread died")
        err = e if isinstance(e, EngineDeadError) else EngineDeadError(f"the engine stopped: {e!r}")
        self._out.stop()
        with self._cond:  # no stream can be added after this
            self.dead = e
            for rid in list(self._streams):
                self._finish_stream(rid, err)
            stops = [c[1] for c in self._inbox if c[0] == "stops"]
            self._inbox.clear()
        try:  # leave the engine clean: no request holds blocks
            for x in stops:
                self.engine.stop_requests(x)
            self.engine.abort_request(list(self.engine.output_processor.groups))
            self._stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - best effort after a failure
            logger.exception("could not abort the requests of a dead engine")

    def _apply(self, cmds) -> tuple[list[str], list[tuple]]:
        """Run the inbox's commands on the engine thread, in order; returns (the sequences a
        stop string ended, now finished; each abort's EngineCoreOutputs and streams), for the
        output thread. EngineDeadError on "stop" (and on "error", the output thread's
        failure)."""
        engine, stopped, aborts = self.engine, [], []
        for i, cmd in enumerate(cmds):
            if cmd[0] in ("stop", "error"):
                with self._cond:  # what came after it, for _die (stop strings to apply)
                    self._inbox.extendleft(reversed(cmds[i + 1:]))
                raise EngineDeadError("the engine was shut down") if cmd[0] == "stop" else cmd[1]
            if cmd[0] == "snapshot":
                cmd[1]["snapshot"] = kv_cache_snapshot(engine)
                cmd[2].set()
            elif cmd[0] == "stops":  # stop strings the output thread found
                engine.stop_requests(cmd[1])
                stopped += [x[1] for x in cmd[1]]
            elif cmd[0] == "add":
                _, rid, processed = cmd
                try:
                    engine.add_processed(processed)
                except ValueError as e:  # that request alone fails; the engine goes on
                    self._finish_stream(rid, e)
            else:
                aborts.append((engine.abort_core(cmd[1]), cmd[2]))
        return stopped, aborts

    # ---- output thread ---------------------------------------------------------------------
    def _deliver(self, outputs, aborted: dict | None) -> None:
        """Hand RequestOutputs to the stat loggers and the streams (on the output thread);
        `aborted`: {request id: its stream} of an abort, whose streams end now if no output
        of theirs is left."""
        for lg in self.stat_loggers:
            lg.record(outputs)
        for out in outputs:
            s = self._streams.get(out.request_id)
            if s is not None:
                if out.finished:  # its id is free before its caller can see the end
                    with self._cond:
                        self._streams.pop(out.request_id, None)
                s.put(out)
        for rid, stream in (aborted or {}).items():  # ended without a final output
            if stream is not None and not any(o.request_id == rid for o in outputs):
                with self._cond:
                    if self._streams.get(rid) is stream:  # not a later request's
                        self._finish_stream(rid, None)

    def _finish_stream(self, rid: str, err) -> None:
        s = self._streams.pop(rid, None)
        if s is not None:
            s.put(err)


def _sample_ids(request_id: str, n: int) -> frozenset:
    return frozenset([request_id] + [child_request_id(request_id, j, n) for j in range(n)])


__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]
