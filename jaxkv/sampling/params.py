"""SamplingParams: how one request is sampled and when it stops.

Names, defaults and validation follow vLLM's ``vllm.SamplingParams``. Bad input is rejected
here, at the edge, with a ``ValueError`` naming the field and the value; the engine core
assumes every SamplingParams it sees is valid.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from dataclasses import dataclass

from jaxkv.structured_outputs.params import StructuredOutputsParams

# vLLM's _SAMPLING_EPS: temperatures below this are treated as greedy (argmax).
_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's RequestOutputKind)."""

    CUMULATIVE = 0  # the whole output so far, every time
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


def _fail(name: str, rule: str, value: object) -> None:
    raise ValueError(f"{name} {rule}, got {value!r}")


# The most samples one request may ask for, on both doors (the server's n field says the same).
MAX_N = 16


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(name, "must be an int", value)
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, "must be a number", value)
    try:
        value = float(value)
    except OverflowError:
        _fail(name, "must be finite", value)
    if not math.isfinite(value) or abs(value) > 3.4e38:  # float32 on the device
        _fail(name, "must be finite (within float32)", value)
    return value


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        _fail(name, "must be a bool", value)
    return value


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM's SamplingParams)."""

    n: int = 1
    """Number of output sequences to return for the prompt (>= 1)."""
    temperature: float = 1.0
    """Divides the logits before softmax; lower is more deterministic. Values below 1e-5
    (including 0) mean greedy decoding (argmax), as in vLLM."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens whose cumulative probability
    reaches top_p. In (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep only the top_k most likely tokens. 0 disables it; -1 (vLLM's old "off") is
    accepted and normalised to 0."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times that of the most likely token.
    In [0, 1]; 0 disables it."""
    repetition_penalty: float = 1.0
    """Multiplicative penalty (> 0) on tokens already in the prompt or output: their
    positive logits are divided by it, negative ones multiplied. 1 disables it."""
    presence_penalty: float = 0.0
    """Additive penalty in [-2, 2] subtracted from the logit of every token that appears in
    the output so far (once per token). 0 disables it."""
    frequency_penalty: float = 0.0
    """Additive penalty in [-2, 2] times the number of times the token appears in the
    output so far. 0 disables it."""
    seed: int | None = None
    """Per-request random seed; the same seed and inputs give the same samples."""
    stop: str | list[str] | None = None
    """Strings that end generation when they appear in the output text. The returned text
    stops before the string (unless include_stop_str_in_output). Normalised to a list."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation. The token is in output_token_ids; its text is in the
    output text only if it is not a special token skipped by skip_special_tokens.
    Normalised to a list."""
    ignore_eos: bool = False
    """Keep generating after the EOS token (benchmarks use this)."""
    min_tokens: int = 0
    """Minimum number of output tokens before EOS, stop_token_ids or stop strings may end
    the request (>= 0, <= max_tokens)."""
    max_tokens: int | None = 16
    """Maximum number of output tokens (>= 1). None means "as many as fit in
    max_model_len"; the engine fills in the number."""
    logprobs: int | None = None
    """Number of log probabilities to return per output token, besides the sampled
    token's own (>= 0). None returns none."""
    prompt_logprobs: int | None = None
    """Number of log probabilities to return per prompt token (>= 0). None returns none."""
    skip_special_tokens: bool = True
    """Leave special tokens (e.g. <|im_end|>) out of the output text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    spaces_between_special_tokens: bool = True
    """Join the text around added tokens with spaces when detokenizing (vLLM's; as there, it
    changes the text only with slow tokenizers: jaxkv's GGUF and fast tokenizers ignore it)."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """Cumulative, delta or final-only outputs (see RequestOutputKind)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit before sampling (OpenAI's logit_bias; keys may be
    strings of digits, as JSON sends them). Normalised to {int: float}."""
    allowed_token_ids: list[int] | None = None
    """Sample only among these token ids (vLLM's allowed_token_ids); non-empty."""
    bad_words: list[str] | None = None
    """Words never generated (vLLM's bad_words): each, with and without a leading space, is
    tokenized; the last token of its ids is banned wherever the output ends with the others."""
    structured_outputs: StructuredOutputsParams | None = None
    """The output must match a JSON schema, regex, choice or grammar (vLLM's
    StructuredOutputsParams; a dict of its fields is accepted). Enforced token by token."""

    def __post_init__(self) -> None:
        """Validate every field where it enters (ValueError naming the field and the value),
        normalizing types and spellings (top_k -1 -> 0, a str stop -> [str], numeric strings as
        logit_bias keys), in field groups."""
        self._check_sampling()
        self._check_penalties()
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
            if not -2**63 <= self.seed < 2**64:
                _fail("seed", "must fit in 64 bits", self.seed)
        self._check_stops()
        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)
        self.spaces_between_special_tokens = _as_bool(
            "spaces_between_special_tokens", self.spaces_between_special_tokens)
        self.include_stop_str_in_output = _as_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self._check_lengths()
        self._check_token_filters()
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", "must be a StructuredOutputsParams", self.structured_outputs)

        if not isinstance(self.output_kind, RequestOutputKind):
            _fail("output_kind", "must be a RequestOutputKind", self.output_kind)

    def _check_sampling(self) -> None:
        """n in [1, MAX_N], temperature, top_p, top_k (-1 -> 0), min_p."""
        self.n = _as_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            _fail("n", f"must be in [1, {MAX_N}]", self.n)

        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0:
            _fail("temperature", "must be >= 0", self.temperature)
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", "must be in (0, 1]", self.top_p)
        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < -1:
            _fail("top_k", "must be -1 (disable), 0 (disable) or >= 1", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", "must be in [0, 1]", self.min_p)

    def _check_penalties(self) -> None:
        """repetition_penalty > 0; presence and frequency penalties in [-2, 2]."""
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", "must be > 0", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                _fail(name, "must be in [-2, 2]", value)
            setattr(self, name, value)

    def _check_stops(self) -> None:
        """stop: strings, none empty; stop_token_ids: ints >= 0."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            _fail("stop", "must be a str or a list of str", self.stop)
        for s in self.stop:
            if not isinstance(s, str):
                _fail("stop", "must contain only strings", self.stop)
            if not s:
                _fail("stop", "cannot contain an empty string", self.stop)

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = [_as_int("stop_token_ids", t) for t in self.stop_token_ids]
        else:
            _fail("stop_token_ids", "must be a list of int", self.stop_token_ids)
        if any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "must be >= 0", self.stop_token_ids)

    def _check_lengths(self) -> None:
        """max_tokens >= 1, 0 <= min_tokens <= max_tokens, logprobs and prompt_logprobs >= 0."""
        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                _fail("max_tokens", "must be >= 1", self.max_tokens)
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            _fail("min_tokens", "must be >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens={self.max_tokens}", self.min_tokens)

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _as_int(name, value)
                if value < 0:
                    _fail(name, "must be >= 0", value)
                setattr(self, name, value)

    def _check_token_filters(self) -> None:
        """logit_bias (token id -> bias), allowed_token_ids, bad_words."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", "must be a dict of token id -> bias", self.logit_bias)
            bias = {}
            for k, v in self.logit_bias.items():
                if isinstance(k, str) and k.strip().isascii() and k.strip().isdigit():
                    k = int(k)
                if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
                    _fail("logit_bias", "keys must be token ids (ints >= 0)", k)
                bias[int(k)] = _as_float("logit_bias", v)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                _fail("allowed_token_ids", "must be a non-empty list of token ids", self.allowed_token_ids)
            self.allowed_token_ids = [_as_int("allowed_token_ids", t) for t in self.allowed_token_ids]
            if any(t < 0 for t in self.allowed_token_ids):
                _fail("allowed_token_ids", "must be >= 0", self.allowed_token_ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                _fail("bad_words", "must be a list of str", self.bad_words)
            self.bad_words = list(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                _fail("bad_words", "must contain only non-empty strings", self.bad_words)

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax: temperature below 1e-5 (vLLM's rule)."""
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any of repetition/presence/frequency penalty is active."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def has_logits_filters(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words change the logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    def clone(self) -> SamplingParams:
        """A deep copy (the engine may fill in max_tokens on its own copy)."""
        return copy.deepcopy(self)
