"""Turns finished steps into RequestOutputs: detokenization, stop strings, logprob dicts, output
kinds. (Token-level stops are the scheduler's: Scheduler.update_from_output.)

One RequestGroup per user request; for n > 1 it has n child Requests. Output kinds follow
vLLM's RequestOutputKind: CUMULATIVE (everything so far, every step), DELTA (only what is new),
FINAL_ONLY (once, when every child has finished).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxkv.engine.detokenizer import IncrementalDetokenizer, detokenize_token
from jaxkv.core.request import Request, RequestStatus
from jaxkv.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxkv.sampling.params import RequestOutputKind

FINISHED = RequestStatus.FINISHED_STOPPED  # the first finished status (RequestStatus.is_finished)


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    sent_tokens: list[int] = field(default_factory=list)  # per child, for DELTA
    sent_logprobs: list[int] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    finished_reported: set[int] = field(default_factory=set)  # samples in finished_samples

    @property
    def finished(self) -> bool:
        if len(self.children) == 1:  # (asked for every request every step)
            return self.children[0].status >= FINISHED
        return all(c.status >= FINISHED for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.groups: dict[str, RequestGroup] = {}
        self.child_to_group: dict[str, RequestGroup] = {}
        self._token_text: dict[int, str] = {}

    def add_group(self, request_id, prompt, children: list[Request]) -> None:
        detoks = [IncrementalDetokenizer(self.tokenizer, c.prompt_token_ids, c.sampling_params)
                  for c in children]
        g = RequestGroup(request_id, prompt, children, detoks, [0] * len(children), [0] * len(children))
        self.groups[request_id] = g
        for c in children:
            self.child_to_group[c.request_id] = g

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

    def add_prompt_logprobs(self, req: Request, first_position: int, data) -> None:
        """Logprob dicts for prompt positions first_position.. (a chunk); positions already
        filled (a chunk recomputed after preemption) are kept."""
        target_lp, ranks, top_lp, top_ids = data
        for j in range(len(target_lp)):
            pos = first_position + j
            if pos < len(req.prompt_logprobs):
                continue
            t = req.prompt_token_ids[pos]
            req.prompt_logprobs.append(self.logprob_dict(top_ids[j], top_lp[j], None,
                                                         (t, target_lp[j], ranks[j])))

    def process_token(self, req: Request, token: int, logprob_data,
                      position: int | None = None) -> str | None:
        """The text side of one token the scheduler has appended (and applied its token-level
        stops to): its logprob dict, detokenization, stop strings. `position`: its index among
        the output tokens (default: the last; a multi-token step passes each in turn). Returns
        the stop string that now ends the request, or None (a request already stopped by a
        token keeps that reason; its token's text is left out unless
        include_stop_str_in_output)."""
        last = req.num_output_tokens - 1
        before = last if position is None else position
        if logprob_data is not None:
            lp, rank, top_lp, top_ids = logprob_data
            req.logprobs.append(self.logprob_dict(top_ids, top_lp, None, (token, lp, rank)))
            req.cumulative_logprob += float(lp)
        g = self.child_to_group[req.request_id]
        detok = g.detoks[0 if len(g.children) == 1 else g.children.index(req)]
        stopped_by_token = before == last and req.status == RequestStatus.FINISHED_STOPPED
        stop_str = detok.update([token], before, stop_terminated=stopped_by_token)
        return None if stopped_by_token else stop_str

    def make_output(self, g: RequestGroup, changed: set[str]) -> RequestOutput | None:
        kind = g.children[0].sampling_params.output_kind
        finished = g.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        outs = []
        for j, c in enumerate(g.children):
            if delta and c.request_id not in changed:
                continue
            text = g.detoks[j].get_next_output_text(c.status >= FINISHED, delta)
            start = g.sent_tokens[j] if delta else 0
            lp_start = g.sent_logprobs[j] if delta else 0
            g.sent_tokens[j] = c.num_output_tokens
            logprobs = None
            if c.logprobs is not None:
                logprobs = c.logprobs[lp_start:]
                g.sent_logprobs[j] = len(c.logprobs)
            outs.append(CompletionOutput(  # (index, text, token_ids, cumulative_logprob,
                c.sample_index, text, c.output_token_ids[start:],  # logprobs, finish_reason,
                c.cumulative_logprob, logprobs, c.status.finish_reason, c.stop_reason))  # stop_reason)
        first = g.children[0]
        prompt_lp = first.prompt_logprobs
        if delta and prompt_lp is not None:
            prompt_lp = None if g.prompt_logprobs_sent else prompt_lp
            g.prompt_logprobs_sent = True
        metrics = _metrics(g, finished)
        if finished:
            del self.groups[g.request_id]
            for c in g.children:
                self.child_to_group.pop(c.request_id, None)
        return RequestOutput(g.request_id, g.prompt, first.prompt_token_ids, prompt_lp, outs,
                             finished, metrics, max(first.num_cached_tokens, 0))


    @staticmethod
    def _newly_finished(g: RequestGroup) -> list[tuple]:
        if len(g.children) == 1:  # (per sequence per step: the common case at once)
            if g.children[0].status < FINISHED or g.finished_reported:
                return []
        elif len(g.finished_reported) == len(g.children) or not any(c.status >= FINISHED for c in g.children):
            return []
        out = []
        for c in g.children:
            if c.status.is_finished and c.sample_index not in g.finished_reported:
                g.finished_reported.add(c.sample_index)
                out.append((c.sample_index, c.num_output_tokens, c.times.first_token_time,
                            c.times.last_token_time))
        return out


def _metrics(g: RequestGroup, finished: bool) -> RequestMetrics:
    """The group's RequestMetrics now: its samples' earliest first times and latest last
    times."""
    first = g.children[0]
    if len(g.children) == 1:  # the common case, without the min/max over samples
        t = first.times
        return RequestMetrics(t.arrival_time, t.first_scheduled_time, t.first_token_time,
                              t.last_token_time, t.finished_time if finished else None,
                              first.num_output_tokens, OutputProcessor._newly_finished(g))
    t = [c.times for c in g.children]
    return RequestMetrics(
        arrival_time=first.times.arrival_time,
        first_scheduled_time=_min(x.first_scheduled_time for x in t),
        first_token_time=_min(x.first_token_time for x in t),
        last_token_time=_max(x.last_token_time for x in t),
        finished_time=_max(x.finished_time for x in t) if finished else None,
        num_generation_tokens=sum(c.num_output_tokens for c in g.children),
        finished_samples=OutputProcessor._newly_finished(g))


def _min(xs):
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def _max(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


__all__ = ["OutputProcessor", "RequestGroup"]
