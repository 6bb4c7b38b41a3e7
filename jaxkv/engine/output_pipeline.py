"""Steps on the calling thread, output processing on an OutputThread beside it: what
`LLM.generate` and the GPU engine benchmark run (AsyncLLM runs the same split with its own
inbox and streams). The calling thread only runs `LLMEngine.engine_core_step`; detokenizing,
stop strings and RequestOutputs happen one step behind on the output thread, and the stop
strings it finds are applied at the next `step`."""

from __future__ import annotations

from collections import deque
from typing import Callable

from jaxkv.engine.output_thread import OutputThread


class OutputPipeline:
    """`deliver(outputs)`: called on the output thread with each batch of RequestOutputs
    (and by `close` on the calling thread with the last ones). Call `step` while
    `engine.has_unfinished_requests()`, then `close` (also after an error)."""

    def __init__(self, engine, deliver: Callable[[list], None]):
        self.engine = engine
        self._deliver = deliver
        self._inbox: deque = deque()  # ("stops", ...) and ("error", e) from the output thread
        self._out = OutputThread(engine.output_processor, lambda outs, _: deliver(outs),
                                 self._inbox.append)

    def step(self) -> int:
        """Apply the stop strings found so far (an output thread's error is raised here) and
        deliver the outputs an earlier LLMEngine.step held back, then one engine step whose
        outputs go to the output thread. Returns the tokens the step appended."""
        self._apply_inbox()
        held_back = self.engine.take_pending_outputs()  # (from an earlier LLMEngine.step)
        if held_back:
            self._deliver(held_back)
        if not self.engine.has_unfinished_requests():
            return 0
        core = self.engine.engine_core_step()
        if core:
            self._out.put_step(core)
        return sum(len(co.new_token_ids) for co in core)

    def close(self) -> BaseException | None:
        """Let the output thread finish what it was given and end; apply its last stop
        strings and deliver what it held back. Returns the first error of the output thread
        not raised yet (None if none)."""
        self._out.stop()
        try:
            self._apply_inbox()
            error = None
        except BaseException as e:  # noqa: BLE001 - the caller decides
            error = e
        held = self._out.take_held()
        if held:
            self._deliver(held)
        return error

    def _apply_inbox(self) -> None:
        stopped, error = [], None
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] == "error":
                error = error or cmd[1]
            else:
                self.engine.stop_requests(cmd[1])
                stopped += [x[1] for x in cmd[1]]
        if stopped and self._out.alive:
            self._out.put_stopped(stopped)
        if error is not None:
            raise error


__all__ = ["OutputPipeline"]
