"""RequestOutput / CompletionOutput / Logprob, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)  # (one per token or request per step: no __dict__)
class Logprob:
    """One entry of a logprobs dict: raw model log-probability (natural log), its 1-based rank
    in the vocabulary, and the token's text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)  # (one per token or request per step: no __dict__)
class RequestMetrics:
    """Monotonic seconds (time.monotonic()); None until the event happened.
    num_generation_tokens: output tokens so far, summed over the n samples. finished_samples:
    (index, output tokens, first token time, last token time) of each sample that finished
    since the request's previous output (per-sample histograms, as vLLM keeps per request)."""
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_generation_tokens: int = 0
    finished_samples: list[tuple[int, int, float | None, float | None]] = field(default_factory=list)


@dataclass(slots=True)  # (one per token or request per step: no __dict__)
class CompletionOutput:
    """One of the n samples. token_ids include the EOS or stop token that ended it (as vLLM);
    text does not. finish_reason: "stop" | "length" | "abort" | "error" (a structured-output
    request whose grammar refused the sampled token, which is dropped) | None while running;
    stop_reason: the stop string or stop token id that ended it (None for EOS or length).
    logprobs: per output token, dict token id -> Logprob (top-k plus the sampled token)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)  # (one per token or request per step: no __dict__)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict = field(default_factory=dict)
