"""The output thread of AsyncLLM and of LLM.generate (output_pipeline.py): output processing
one step behind the engine thread (vLLM V1's split of EngineCore and output processing, in
threads of one process).

The engine thread puts each step's EngineCoreOutputs here (`put_step`), and an abort's
(`put_abort`); this thread turns them into RequestOutputs (OutputProcessor.process) and hands
them to `deliver` (stat loggers, streams). A stop string it finds goes back to the engine
thread (`post(("stops", ...))`), which finishes the sequence and frees its blocks, then
confirms (`put_stopped`). The final output of a request with such a stop not yet confirmed is
held until then: when its caller sees the end, the engine holds nothing of it any more (its
id is free, its blocks are back), and no older output of it is left in the queue.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from jaxkv.outputs import RequestOutput


class OutputThread:
    """`output_processor`: the engine's OutputProcessor (only this thread calls its
    `process` from now on); `deliver(outputs, aborted)`: hands RequestOutputs on (`aborted`:
    {request id: its stream} of an abort, else None); `post(cmd)`: a command into the engine
    thread's inbox. At most `maxsize` items wait (a full queue makes the engine thread wait)."""

    def __init__(self, output_processor, deliver: Callable, post: Callable, maxsize: int = 4):
        self.output_processor = output_processor
        self._deliver, self._post = deliver, post
        self._q: queue.Queue = queue.Queue(maxsize=maxsize)
        self._pending: dict[str, set[str]] = {}  # request id -> sequences whose stop is unconfirmed
        self._group_of: dict[str, str] = {}  # such a sequence's request id
        self._held: dict[str, RequestOutput] = {}  # their final outputs
        self._thread = threading.Thread(target=self._run, name="jaxkv-output", daemon=True)
        self._thread.start()

    # ---- engine thread --------------------------------------------------------------------
    def put_step(self, core: list) -> None:
        self._q.put(("step", core, None))

    def put_abort(self, core: list, streams: dict) -> None:
        self._q.put(("abort", core, streams))

    def put_stopped(self, sequence_ids: list[str]) -> None:
        """The engine finished these sequences (or they had ended already)."""
        self._q.put(("stopped", sequence_ids, None))

    def stop(self) -> None:
        """Process what was put so far, then end (held outputs are dropped)."""
        self._q.put(None)
        self._thread.join()

    def take_held(self) -> list[RequestOutput]:
        """After `stop`: the final outputs still held (their stops unconfirmed), now given up."""
        held, self._held = list(self._held.values()), {}
        self._pending.clear()
        self._group_of.clear()
        return held

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- this thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            kind, payload, aborted = item
            try:
                if kind == "stopped":
                    self._deliver(self._release(payload), None)
                    continue
                outputs, stops, error = self.output_processor.process(payload, every_sample=kind == "abort")
                for rid, sid, _, _ in stops:
                    self._pending.setdefault(rid, set()).add(sid)
                    self._group_of[sid] = rid
                if stops:
                    self._post(("stops", stops))
                ready = self._hold(outputs)
                if aborted and self._held:  # a held final output ends those streams later
                    aborted = {rid: st for rid, st in aborted.items() if rid not in self._held}
                self._deliver(ready, aborted)
                if error is not None:
                    raise error
            except BaseException as e:  # noqa: BLE001 - the engine thread dies of it
                self._post(("error", e))

    def _hold(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` less the final ones of requests with an unconfirmed stop (kept)."""
        if not self._pending:
            return outputs
        ready = []
        for o in outputs:
            if o.finished and o.request_id in self._pending:
                self._held[o.request_id] = o
            else:
                ready.append(o)
        return ready

    def _release(self, sequence_ids: list[str]) -> list[RequestOutput]:
        """The held final outputs whose every stop is now confirmed."""
        out = []
        for sid in sequence_ids:
            rid = self._group_of.pop(sid, None)
            left = self._pending.get(rid)
            if left is None:
                continue
            left.discard(sid)
            if not left:
                del self._pending[rid]
                if rid in self._held:
                    out.append(self._held.pop(rid))
        return out


__all__ = ["OutputThread"]
