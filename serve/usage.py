"""UsageAccumulator: the token counts of one HTTP request, shared by the generation routes."""

from __future__ import annotations

from serve.protocol_responses import PromptTokenUsageInfo, UsageInfo


class UsageAccumulator:
    """Sums the usage of an HTTP request's engine requests. Feed it every RequestOutput
    (the routes ask for DELTA outputs, so each holds only its new tokens): completion tokens
    are counted from every output, prompt and cached tokens once, from each engine request's
    finished output."""

    def __init__(self, continuous: bool = False):
        """continuous: stream_options.continuous_usage_stats (with include_usage), vLLM's usage
        in every chunk; `so_far()` then gives it."""
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.continuous = continuous
        self._prompts: dict[str, int] = {}  # engine request id -> its prompt tokens
        self._choices: dict[tuple[str, int], int] = {}  # (request id, choice) -> tokens so far

    def add(self, out) -> None:
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if self.continuous:
            self._prompts[out.request_id] = len(out.prompt_token_ids)
            for c in out.outputs:
                key = (out.request_id, c.index)
                self._choices[key] = self._choices.get(key, 0) + len(c.token_ids)
        if out.finished:
            self.prompt_tokens += len(out.prompt_token_ids)
            self.cached_tokens += out.num_cached_tokens

    def so_far(self, request_id: str, index: int, minus: int = 0) -> UsageInfo | None:
        """With `continuous`, vLLM's usage of one chunk: the prompt of the chunk's engine
        request and the tokens its choice generated so far (less `minus`: a role chunk sent
        before its output counts none of it); else None."""
        if not self.continuous:
            return None
        prompt = self._prompts.get(request_id, 0)
        done = self._choices.get((request_id, index), 0) - minus
        return UsageInfo(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def info(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens,
                         prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=self.cached_tokens))


def continuous_usage(req) -> bool:
    """Whether a streamed request asked for usage in every chunk (vLLM: include_usage and
    continuous_usage_stats)."""
    so = getattr(req, "stream_options", None)
    return bool(req.stream and so is not None and so.include_usage and so.continuous_usage_stats)
