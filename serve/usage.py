"""UsageAccumulator: the token counts of one HTTP request, shared by the generation routes."""

from __future__ import annotations

from serve.protocol_responses import PromptTokenUsageInfo, UsageInfo


class UsageAccumulator:
    """Sums the usage of an HTTP request's engine requests. Feed it every RequestOutput
    (the routes ask for DELTA outputs, so each holds only its new tokens): completion tokens
    are counted from every output, prompt and cached tokens once, from each engine request's
    finished output."""

    def __init__(self):
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def add(self, out) -> None:
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if out.finished:
            self.prompt_tokens += len(out.prompt_token_ids)
            self.cached_tokens += out.num_cached_tokens

    def info(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens,
                         prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=self.cached_tokens))
