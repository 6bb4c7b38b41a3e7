"""EngineCoreOutput: what one step did to one sequence, copied out of the engine's Request
(vLLM V1's name; its scheduler's update_from_output makes them, as Scheduler.update_from_output
does here, jaxkv/core/step_commit.py). The output processor builds RequestOutputs from these
alone, never from a Request, so it may run on another thread while the engine thread goes on
with the next step (jaxkv/engine/output_thread.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .request import Request, RequestStatus


@dataclass(slots=True)  # (one per sequence per step: no __dict__)
class EngineCoreOutput:
    """request_id: the sequence's (a sample's) id. new_token_ids: tokens appended this step
    (after the token-level stops). new_logprobs: per new token (logprob, rank, top logprobs,
    top ids), or None. prompt_logprobs: (first prompt position, (target logprobs, ranks, top
    logprobs, top ids)) of a prompt chunk, or None. finished: the status it ended with
    (stopped, length, aborted, error), or None while it runs. stop_reason: the stop token id
    that ended it (None for EOS). Times are time.monotonic() seconds, as of this step.
    num_cached_tokens: prompt tokens served from the prefix cache (-1 before the first
    schedule)."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list | None = None
    prompt_logprobs: tuple | None = None
    finished: RequestStatus | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = -1


def core_output(req: Request, new_token_ids: list[int], new_logprobs=None,
                prompt_logprobs=None) -> EngineCoreOutput:
    """The snapshot of `req` after a step that appended `new_token_ids`."""
    t = req.times
    finished = req.status if req.status >= RequestStatus.FINISHED_STOPPED else None
    return EngineCoreOutput(req.request_id, new_token_ids, new_logprobs, prompt_logprobs,
                            finished, req.stop_reason, t.first_scheduled_time,
                            t.first_token_time, t.last_token_time, t.finished_time,
                            req.num_cached_tokens)


__all__ = ["EngineCoreOutput", "core_output"]
