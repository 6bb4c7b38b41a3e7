"""Request: one sequence's token ids, status, num_computed_tokens and bookkeeping (host only).

The runner never sees a Request; the scheduler turns requests into a SchedulerOutput.
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # structured outputs: the grammar refused the sampled token (vLLM's)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


@dataclass
class RequestTimes:
    """Monotonic seconds (time.monotonic), as in RequestOutput.metrics."""
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class Request:
    """One sequence. For n > 1 a user request becomes n Requests (children) sharing a parent id.

    `sampling_params` is a SamplingParams with max_tokens already resolved; `seed` is the
    per-request seed (user's, or drawn by the engine) and `sample_index` the child index j:
    sample j draws from fold_in(seed, j).
    """
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    eos_token_ids: tuple[int, ...] | int | None  # the model's end-of-sequence ids
    seed: int
    sample_index: int = 0
    parent_id: str | None = None
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    # n > 1: the position the other samples fork at, until they have forked (None after):
    # the KV cache manager keeps the blocks that position's sliding window sees.
    fork_position: int | None = None
    times: RequestTimes = field(default_factory=RequestTimes)
    # Per-step products kept for the output: logprob dicts and cumulative logprob.
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    cumulative_logprob: float | None = None
    # Structured outputs: this sequence's grammar matcher (jaxkv.core.grammar).
    grammar: Any = None
    # sampling_params.bad_words as token id sequences (the engine tokenized them)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        if self.eos_token_ids is None:
            self.eos_token_ids = ()
        elif isinstance(self.eos_token_ids, int):
            self.eos_token_ids = (self.eos_token_ids,)
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if not self.times.arrival_time:
            self.times.arrival_time = time.monotonic()
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @functools.cached_property  # (checked against every sampled token)
    def stop_ids(self) -> list[int]:
        """Token ids that end the request: stop_token_ids, and every EOS id unless ignore_eos."""
        sp = self.sampling_params
        ids = list(sp.stop_token_ids or [])
        if not sp.ignore_eos:
            ids.extend(t for t in self.eos_token_ids if t not in ids)
        return ids

    @functools.cached_property  # (read per sequence per step)
    def reads_history(self) -> bool:
        """Whether sampling reads the token history: penalties, or bad_words."""
        sp = self.sampling_params
        return sp.has_penalties or bool(sp.bad_words)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first num_output_tokens output tokens (a stop string found before
        the last token of a multi-token step)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[-drop:]
            del self.all_token_ids[-drop:]


def check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Token-level stop of a request that just got `token` (vLLM's check_stop): EOS and
    stop_token_ids once min_tokens are out (sets stop_reason: None for EOS, else the stop
    token id), then max_tokens and max_model_len; None when it goes on."""
    sp = req.sampling_params
    num_output = len(req.output_token_ids)  # (per sequence per step: no properties)
    if token in req.stop_ids and num_output >= sp.min_tokens:
        is_eos = token in req.eos_token_ids and not sp.ignore_eos
        req.stop_reason = None if is_eos else token
        return RequestStatus.FINISHED_STOPPED
    if num_output >= sp.max_tokens or len(req.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
