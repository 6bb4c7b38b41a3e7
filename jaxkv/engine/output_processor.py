"""Turns EngineCoreOutputs into RequestOutputs: detokenization, stop strings, logprob dicts,
output kinds. (Token-level stops are the scheduler's: Scheduler.update_from_output.)

It reads only EngineCoreOutputs (jaxkv/core/core_output.py) and keeps its own state per
sequence, never the engine's Requests: it may run on another thread than the engine's
(AsyncLLM's output thread), one step behind. A stop string it finds ends the sequence here
at once (tokens sampled after it are dropped); `process` returns it as a stop for the
engine to apply to its Request (LLMEngine.stop_requests), as vLLM V1 aborts a request in
its engine core when the detokenizer of its front end finds a stop string.

One RequestGroup per user request; for n > 1 it has n samples. Output kinds follow vLLM's
RequestOutputKind: CUMULATIVE (everything so far, every step), DELTA (only what is new),
FINAL_ONLY (once, when every sample has finished).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxkv.core.core_output import EngineCoreOutput
from jaxkv.engine.detokenizer import IncrementalDetokenizer, detokenize_token
from jaxkv.core.request import Request, RequestStatus
from jaxkv.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxkv.sampling.params import RequestOutputKind

STOPPED = RequestStatus.FINISHED_STOPPED


@dataclass(eq=False)
class SampleState:
    """The output side of one sequence: its tokens, logprob dicts and text so far, its
    finish, and what was handed out already (DELTA)."""
    request_id: str
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finished: RequestStatus | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = -1
    sent_tokens: int = 0
    sent_logprobs: int = 0
    reported: bool = False  # in a RequestMetrics.finished_samples already


@dataclass(eq=False)
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    arrival_time: float
    samples: list[SampleState]
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        if len(self.samples) == 1:  # (asked for every request every step)
            return self.samples[0].finished is not None
        return all(s.finished is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.groups: dict[str, RequestGroup] = {}
        self.samples: dict[str, tuple[RequestGroup, SampleState]] = {}  # by sequence id
        self.num_generation_tokens = 0  # tokens handed out (none past a stop string)
        self.cpu_seconds = 0.0  # CPU time of the threads that ran process()
        self._token_text: dict[int, str] = {}

    def add_group(self, request_id, prompt, children: list[Request]) -> None:
        """Register a request's samples (the engine's Requests, read once here)."""
        first = children[0]
        sp = first.sampling_params
        states = [SampleState(c.request_id, c.sample_index,
                              IncrementalDetokenizer(self.tokenizer, c.prompt_token_ids, sp),
                              logprobs=[] if sp.logprobs is not None else None,
                              cumulative_logprob=0.0 if sp.logprobs is not None else None)
                  for c in children]
        g = RequestGroup(request_id, prompt, first.prompt_token_ids, sp.output_kind,
                         first.times.arrival_time, states,
                         [None] if sp.prompt_logprobs is not None else None)
        self.groups[request_id] = g
        for s in states:
            self.samples[s.request_id] = (g, s)

    def token_text(self, token_id: int) -> str:
        t = self._token_text.get(token_id)
        if t is None:
            t = self._token_text[token_id] = detokenize_token(self.tokenizer, token_id)
        return t

    def logprob_dict(self, ids, lps, ranks, chosen: tuple | None) -> dict[int, Logprob]:
        d = {}
        if chosen is not None:
            d[int(chosen[0])] = Logprob(float(chosen[1]), int(chosen[2]), self.token_text(int(chosen[0])))
        for r, (i, lp) in enumerate(zip(ids, lps)):
            if int(i) not in d:
                d[int(i)] = Logprob(float(lp), r + 1, self.token_text(int(i)))
        return d

    def add_prompt_logprobs(self, g: RequestGroup, first_position: int, data) -> None:
        """Logprob dicts for prompt positions first_position.. (a chunk); positions already
        filled (a chunk recomputed after preemption) are kept."""
        target_lp, ranks, top_lp, top_ids = data
        for j in range(len(target_lp)):
            pos = first_position + j
            if pos < len(g.prompt_logprobs):
                continue
            t = g.prompt_token_ids[pos]
            g.prompt_logprobs.append(self.logprob_dict(top_ids[j], top_lp[j], None,
                                                       (t, target_lp[j], ranks[j])))

    def process_token(self, s: SampleState, token: int, logprob_data,
                      stopped_by_token: bool = False) -> str | None:
        """The text side of one token, the last of `s.token_ids`: its logprob dict,
        detokenization, stop strings. `stopped_by_token`: it is the EOS or stop token that
        ended the sequence (its text is left out unless include_stop_str_in_output).
        Returns the stop string that now ends the sequence, or None."""
        if logprob_data is not None:
            lp, rank, top_lp, top_ids = logprob_data
            s.logprobs.append(self.logprob_dict(top_ids, top_lp, None, (token, lp, rank)))
            s.cumulative_logprob += float(lp)
        stop_str = s.detok.update([token], len(s.token_ids) - 1, stop_terminated=stopped_by_token)
        return None if stopped_by_token else stop_str

    # ---- one step -------------------------------------------------------------------------
    def process(self, outputs: list[EngineCoreOutput], every_sample: bool = False):
        """A step's RequestOutputs. Returns (outputs, stops, error): stops are (request id,
        sequence id, stop string, tokens kept) of the sequences a stop string ended, for the
        engine to finish; error is the first exception raised while one sequence's text was processed
        (the others are processed all the same; its tokens are kept without their text), or
        None. Outputs of sequences already finished here (tokens sampled after a stop string,
        one step behind) are dropped. `every_sample`: a DELTA output lists every sample of
        its group (an abort), not only those with news."""
        t0 = time.thread_time()
        changed, touched, stops, error = set(), {}, [], None
        for co in outputs:
            entry = self.samples.get(co.request_id)
            if entry is None or entry[1].finished is not None:
                continue
            g, s = entry
            try:
                self._apply(g, s, co, stops)
            except BaseException as e:  # noqa: BLE001 - returned, after the others
                error = error or e
            if co.new_token_ids or co.finished is not None or every_sample:
                changed.add(co.request_id)
                touched[g.request_id] = g
        if every_sample:
            changed.update(s.request_id for g in touched.values() for s in g.samples)
        made = []
        for g in touched.values():
            try:
                o = self.make_output(g, changed)
            except BaseException as e:  # noqa: BLE001 - returned, with the stops found
                error = error or e
                continue
            if o is not None:
                made.append(o)
        self.cpu_seconds += time.thread_time() - t0
        return made, stops, error

    def _apply(self, g: RequestGroup, s: SampleState, co: EngineCoreOutput, stops: list) -> None:
        """Take one EngineCoreOutput into `s`: times, prompt logprobs, each token's text
        (up to a stop string, which finishes `s` and joins `stops`), then the engine's
        finish."""
        if co.first_scheduled_time is not None:  # (an abort of a sequence the engine no
            s.first_scheduled_time = co.first_scheduled_time  # longer holds knows no times)
        if co.last_token_time is not None:
            s.first_token_time, s.last_token_time = co.first_token_time, co.last_token_time
        if co.num_cached_tokens >= 0:
            s.num_cached_tokens = co.num_cached_tokens
        if co.prompt_logprobs is not None and g.prompt_logprobs is not None:
            self.add_prompt_logprobs(g, *co.prompt_logprobs)
        ids, lps, done = co.new_token_ids, co.new_logprobs, 0
        last = len(ids) - 1
        try:
            for j, token in enumerate(ids):
                s.token_ids.append(token)
                done = j + 1
                self.num_generation_tokens += 1
                stop_str = self.process_token(s, token, lps[j] if lps else None,
                                              j == last and co.finished == STOPPED)
                if stop_str is not None:  # wins over a length finish of this token, as vLLM;
                    s.finished, s.stop_reason = STOPPED, stop_str  # tokens after it dropped
                    s.finished_time = co.last_token_time or time.monotonic()
                    stops.append((g.request_id, s.request_id, stop_str, len(s.token_ids)))
                    return
        finally:
            if s.finished is None:  # (after an error: the tokens are kept, without text)
                s.token_ids.extend(ids[done:])
                self.num_generation_tokens += len(ids) - done
                if co.finished is not None:
                    s.finished, s.stop_reason, s.finished_time = co.finished, co.stop_reason, co.finished_time

    def make_output(self, g: RequestGroup, changed: set[str]) -> RequestOutput | None:
        """The group's RequestOutput now (None: FINAL_ONLY before the end); a finished group
        is forgotten, even if building its output raises."""
        finished = g.finished
        if g.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        try:
            return self._output(g, changed, finished)
        finally:
            if finished:
                self.groups.pop(g.request_id, None)
                for s in g.samples:
                    self.samples.pop(s.request_id, None)

    def _output(self, g: RequestGroup, changed: set[str], finished: bool) -> RequestOutput:
        delta = g.output_kind == RequestOutputKind.DELTA
        outs = []
        for s in g.samples:
            if delta and s.request_id not in changed:
                continue
            text = s.detok.get_next_output_text(s.finished is not None, delta)
            start = s.sent_tokens if delta else 0
            lp_start = s.sent_logprobs if delta else 0
            s.sent_tokens = len(s.token_ids)
            logprobs = None
            if s.logprobs is not None:
                logprobs = s.logprobs[lp_start:]
                s.sent_logprobs = len(s.logprobs)
            outs.append(CompletionOutput(  # (index, text, token_ids, cumulative_logprob,
                s.index, text, s.token_ids[start:], s.cumulative_logprob,  # logprobs,
                logprobs, s.finished.finish_reason if s.finished else None,  # finish_reason,
                s.stop_reason))  # stop_reason)
        prompt_lp = g.prompt_logprobs
        if delta and prompt_lp is not None:
            prompt_lp = None if g.prompt_logprobs_sent else prompt_lp
            g.prompt_logprobs_sent = True
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, prompt_lp, outs,
                             finished, _metrics(g, finished), max(g.samples[0].num_cached_tokens, 0))


def _newly_finished(g: RequestGroup) -> list[tuple]:
    out = []
    for s in g.samples:
        if s.finished is not None and not s.reported:
            s.reported = True
            out.append((s.index, len(s.token_ids), s.first_token_time, s.last_token_time))
    return out


def _metrics(g: RequestGroup, finished: bool) -> RequestMetrics:
    """The group's RequestMetrics now: its samples' earliest first times and latest last
    times."""
    if len(g.samples) == 1:  # the common case, without the min/max over samples
        s = g.samples[0]
        return RequestMetrics(g.arrival_time, s.first_scheduled_time, s.first_token_time,
                              s.last_token_time, s.finished_time if finished else None,
                              len(s.token_ids), _newly_finished(g) if s.finished is not None else [])
    t = g.samples
    return RequestMetrics(
        arrival_time=g.arrival_time,
        first_scheduled_time=_min(x.first_scheduled_time for x in t),
        first_token_time=_min(x.first_token_time for x in t),
        last_token_time=_max(x.last_token_time for x in t),
        finished_time=_max(x.finished_time for x in t) if finished else None,
        num_generation_tokens=sum(len(x.token_ids) for x in t),
        finished_samples=_newly_finished(g))


def _min(xs):
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def _max(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


__all__ = ["OutputProcessor", "RequestGroup", "SampleState"]
